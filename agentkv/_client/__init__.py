"""The SDK's core, bottom up: the PairPool, a session's state, its pinned KV, saving and
restoring it, the turn that directs the work, the sessions and the clusters (public facades)."""
