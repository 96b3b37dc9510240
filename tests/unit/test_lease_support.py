"""Whether a decode has agentkv's extension: asked once, but not trusted forever (issue 15.7)."""

from __future__ import annotations

import httpx2

from agentkv._wire.hints import INFO_PATH, ServerInfo
from agentkv._wire.http import HttpxPoster
from agentkv._wire.lease_calls import RECHECK_UNSUPPORTED_S, LeaseCalls

DECODE = "http://decode:8000"


class Server:
    """A decode whose build changes across restarts: first stock, then with the extension."""

    def __init__(self) -> None:
        self.extension = False
        self.asked = 0

    def __call__(self, request: httpx2.Request) -> httpx2.Response:
        assert request.url.path == INFO_PATH
        self.asked += 1
        if not self.extension:
            return httpx2.Response(404, json={"detail": "Not Found"})
        return httpx2.Response(200, json=ServerInfo(leases=True, stream_handles=True).to_wire())


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


async def test_a_no_is_asked_again_after_a_while_so_a_restarted_decode_is_found() -> None:
    server, clock = Server(), Clock()
    async with httpx2.AsyncClient(transport=httpx2.MockTransport(server)) as client:
        calls = LeaseCalls(HttpxPoster(client), clock=clock)
        assert await calls.supported(DECODE) is False
        assert await calls.supported(DECODE) is False
        assert server.asked == 1  # cached meanwhile
        server.extension = True  # restarted with agentkv's connector
        clock.now += RECHECK_UNSUPPORTED_S
        assert await calls.supported(DECODE) is True
        assert server.asked == 2
        clock.now += 10 * RECHECK_UNSUPPORTED_S
        assert await calls.supported(DECODE) is True
        assert server.asked == 2  # a yes is kept


async def test_a_decode_marked_down_is_asked_again_when_back() -> None:
    server, clock = Server(), Clock()
    server.extension = True
    async with httpx2.AsyncClient(transport=httpx2.MockTransport(server)) as client:
        calls = LeaseCalls(HttpxPoster(client), clock=clock)
        assert await calls.supported(DECODE) is True
        server.extension = False  # came back as stock vLLM
        calls.forget(DECODE)
        assert await calls.supported(DECODE) is False
        assert server.asked == 2
