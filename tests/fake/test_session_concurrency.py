"""Many sessions at once on one cluster."""

from __future__ import annotations

import asyncio

import pytest

from agentkv import AsyncCluster, HandleState, Message
from agentkv.testing import FakeCluster, ManualClock

# Long enough answers that the second turn's pull is over kv_recompute_threshold (64 tokens):
# with short ones prefill recomputes instead of pulling, and "no wrong KV" would hold vacuously.
LONG = {"max_tokens": 90, "extra_body": {"min_tokens": 70}}


@pytest.mark.slow
async def test_500_concurrent_async_sessions_without_error():
    # A KV cache small enough that blocks freed by closed sessions go to others while they run
    # (and some turns meet a full cache: 500, retried without the handle).
    fake = FakeCluster(pairs=2, clock=ManualClock(), num_kv_blocks=1500)
    async with AsyncCluster.from_dict(
        fake.cluster_spec, transport=fake.transport, block_size=16
    ) as cluster:

        async def one(i: int) -> tuple[str, list]:
            async with cluster.session(session_id=f"s{i}", **LONG) as s:
                s.append(Message.system("Be brief."), Message.user(f"Question number {i}?"))
                first = await s.turn()
                second = await s.send("And then?")
                return s.pair.name, [first, second]

        results = await asyncio.gather(*(one(i) for i in range(500)))
        assert cluster.loads() == {"pair-0": 0, "pair-1": 0}
    per_pair = {
        name: sum(1 for pair, _ in results if pair == name) for name in ("pair-0", "pair-1")
    }
    assert max(per_pair.values()) <= 313  # bounded load: ceil(1.25 * 500 / 2)
    assert all(len(turns) == 2 for _, turns in results)
    assert all(t[1].stats.handle_state is not HandleState.DIVERGED for _, t in results)
    # The second turns pulled decode's KV (so the check below has something to check) ...
    pulled = [t[1].stats.pulled_tokens for _, t in results]
    assert sum(1 for p in pulled if p >= 64) >= 200, sorted(pulled)[:20]
    # ... and every pull read exactly the KV of its own session's history.
    assert fake.wrong_reuse_events == 0
    assert all(fake.decode(i).pinned_handles == 0 for i in range(2))
