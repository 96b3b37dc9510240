"""Many sessions at once on one cluster."""

from __future__ import annotations

import asyncio

from agentkv import AsyncCluster, HandleState, Message
from agentkv.testing import FakeCluster, ManualClock


async def test_500_concurrent_async_sessions_without_error():
    fake = FakeCluster(pairs=2, clock=ManualClock())
    async with AsyncCluster.from_dict(fake.cluster_spec, transport=fake.transport) as cluster:

        async def one(i: int) -> tuple[str, list]:
            async with cluster.session(session_id=f"s{i}", max_tokens=6) as s:
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
    assert fake.wrong_reuse_events == 0
