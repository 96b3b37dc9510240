"""The executor of a fork's copy of its parent's pin (``kv.fork_copy``, ``kv.inherited``).

``AsyncSession.fork`` is synchronous (it only opens a session, and may be called where no event
loop runs), so the copy is a job: started at once when a loop runs, else by the first call that
needs it. Decode writes the parent's pinned blocks to its file tier and keeps the pin. The
parent's calls that could consume the pin (its next turn, an offload, an unpin, an extend, its
close) finish the job first (``leasing.settle``); the fork's first turn waits for it and takes
the entry as its value; a fork closed before the job started drops it (nothing is written).
Never raises for the servers' sake: a copy that fails leaves the fork without KV, its first
turn computing (or prefix-caching) its history as before.
"""

from __future__ import annotations

import asyncio
import time

from agentkv._client import kv, leasing
from agentkv._client.copy_job import CopyJob
from agentkv._client.pool import PairPool
from agentkv._client.state import SessionState

__all__ = ["start_copy"]


def start_copy(pool: PairPool, parent: SessionState, fork: SessionState) -> None:
    """Give ``fork`` a copy of ``parent``'s pin when it can have one, else the reason why not
    (which its first turn's stats then tell)."""
    handle = parent.handle
    copies = handle is not None and pool.leases.copies(pool.decode_url(handle.pair))
    decision = kv.fork_copy(
        parent.kv,
        parent_tokens=parent.transcript.token_ids,
        fork_tokens=fork.transcript.token_ids,
        fork_pair=fork.pair.name,
        copies=copies,
        policy=parent.policy,
        now=pool.clock(),
    )
    if isinstance(decision, kv.NoKV):
        fork.apply(kv.Step(decision))
        return
    job = CopyJob(lambda: _copy(pool, parent, fork, decision))
    parent.forks.append(job)
    fork.inherit = job
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return  # no loop here: the first call that needs the copy starts it
    job.start()


async def _copy(
    pool: PairPool, parent: SessionState, fork: SessionState, effect: kv.Copy
) -> kv.KV:
    handle = effect.handle
    started = time.perf_counter()
    result = await pool.leases.offload(
        pool.decode_url(handle.pair), handle, ttl_s=effect.ttl_s, keep=True
    )
    ref = None if result.offloaded is None else result.offloaded.ref
    value = kv.inherited(
        effect, ref=ref, detail=result.detail, fork_tokens=fork.transcript.token_ids
    )
    if ref is not None and not isinstance(value, kv.OnTier):  # written, but of no use
        delete = kv.DeleteTierEntry(ref=ref, pair=handle.pair, reason="unusable", background=True)
        leasing.start(pool, fork, (delete,))
    leasing.log_call(
        "agentkv.fork_copy",
        parent,
        handle.pair,
        result,
        reason=effect.reason,
        started=started,
        fork_id=fork.session_id,
        tier_id=None if ref is None else ref.id,
        n_tokens=None if ref is None else ref.n_tokens,
    )
    return value
