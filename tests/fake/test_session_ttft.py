"""TTFT as a user sees it: from the call, the prompt's rendering included (issue 15.9)."""

from __future__ import annotations

import asyncio

import httpx2

from agentkv import AsyncCluster, Message, RetryPolicy
from agentkv.testing import FakeCluster, ManualClock

RENDER_S = 0.2


class SlowTokenizer(httpx2.AsyncBaseTransport):
    """The server's /tokenize (the prompt's rendering) takes ``RENDER_S``."""

    def __init__(self, inner: httpx2.AsyncBaseTransport) -> None:
        self.inner = inner

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        if request.url.path.endswith("/tokenize"):
            await asyncio.sleep(RENDER_S)
        return await self.inner.handle_async_request(request)


async def test_ttft_runs_from_the_call_and_the_server_side_split_is_kept() -> None:
    clock = ManualClock()
    fake = FakeCluster(pairs=1, clock=clock)
    async with AsyncCluster.from_dict(
        fake.cluster_spec, transport=SlowTokenizer(fake.transport), clock=clock, block_size=16,
        retry=RetryPolicy(max_attempts=1),
    ) as cluster, cluster.session() as s:
        stats = (await s.send(Message.user("What is the capital of France?"))).stats
        s.append(Message.user("And of Spain?"))
        streamed = None
        async for event in s.stream():
            streamed = event
    for turn in (stats, streamed.stats):  # type: ignore[union-attr]
        assert turn.ttft_s >= RENDER_S, turn  # the render is part of what the user waits for
        assert turn.server_ttft_s < turn.ttft_s - RENDER_S / 2
        assert turn.server_ttft_s >= turn.prefill_s
        assert turn.ttft_s <= turn.total_s
