"""An httpx2 transport that routes requests to fake servers by host and port."""

from __future__ import annotations

from collections.abc import Callable

import anyio.lowlevel
import httpx2

from agentkv.testing._fake_reply import Reply
from agentkv.testing._fake_server import FakeServer


def to_httpx_response(reply: Reply, request: httpx2.Request) -> httpx2.Response:
    """Turn a reply into a response, or raise what httpx2 raises for a broken connection."""
    if reply.failure == "refused":
        raise httpx2.ConnectError("[Errno 111] Connection refused", request=request)
    if reply.failure == "timeout":
        raise httpx2.ReadTimeout("timed out", request=request)
    if reply.failure == "reset":
        raise httpx2.RemoteProtocolError(
            "Server disconnected without sending a response.", request=request
        )
    headers = {"content-type": reply.content_type} if reply.content_type else {}
    return httpx2.Response(reply.status, headers=headers, content=reply.body(), request=request)


class FakeTransport(httpx2.MockTransport):
    """Serves a fake cluster to ``httpx2.Client`` and ``httpx2.AsyncClient`` alike.

    Example:
        >>> from agentkv.testing import FakeCluster
        >>> fake = FakeCluster(pairs=1)
        >>> with httpx2.Client(transport=fake.transport) as client:
        ...     client.get("http://fake-p0.test:8000/health").status_code
        200
    """

    def __init__(self, resolve: Callable[[str], FakeServer | None]) -> None:
        super().__init__(self._handle)
        self._resolve = resolve

    def _handle(self, request: httpx2.Request) -> httpx2.Response:
        url = request.url
        port = url.port or (443 if url.scheme == "https" else 80)
        server = self._resolve(f"{url.host}:{port}")
        if server is None:
            raise httpx2.ConnectError(
                f"[Errno -2] Name or service not known: {url.host}", request=request
            )
        headers = {k.lower(): v for k, v in request.headers.items()}
        reply = server.handle(request.method, url.path, headers, request.content)
        return to_httpx_response(reply, request)

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        await request.aread()
        # One scheduling point per request, so concurrent sessions interleave as they would
        # against a real server; the fake itself never blocks.
        await anyio.lowlevel.checkpoint()
        return self._handle(request)
