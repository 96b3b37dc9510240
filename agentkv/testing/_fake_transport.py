"""The fake cluster's transport: routes requests to fake servers by host and port, as an httpx2
transport and as agentkv's ``Poster``."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Callable, Mapping

import anyio.lowlevel
import httpx2

from agentkv._core import Answer, Streamed, raise_transport_error
from agentkv.testing._fake_reply import Reply
from agentkv.testing._fake_server import FakeServer


def _raise_failure(reply: Reply, request: httpx2.Request | None) -> None:
    """Raise what httpx2 raises for the connection failure ``reply`` stands for, if any."""
    if reply.failure == "refused":
        raise httpx2.ConnectError("[Errno 111] Connection refused", request=request)
    if reply.failure == "timeout":
        raise httpx2.ReadTimeout("timed out", request=request)
    if reply.failure == "reset":
        raise httpx2.RemoteProtocolError(
            "Server disconnected without sending a response.", request=request
        )


def _raw_headers(reply: Reply) -> list[tuple[bytes, bytes]]:
    return [(b"content-type", reply.content_type.encode())] if reply.content_type else []


def to_httpx_response(reply: Reply, request: httpx2.Request) -> httpx2.Response:
    """Turn a reply into a response, or raise what httpx2 raises for a broken connection."""
    _raise_failure(reply, request)
    return httpx2.Response(
        reply.status, headers=_raw_headers(reply), content=reply.body(), request=request
    )


class FakeTransport(httpx2.MockTransport):
    """Serves a fake cluster to ``httpx2.Client`` and ``httpx2.AsyncClient`` alike, and to a
    cluster as its ``Poster`` (``transport=fake.transport``), with the same answers and failures.

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

    def _server(self, url: httpx2.URL, request: httpx2.Request | None) -> FakeServer:
        port = url.port or (443 if url.scheme == "https" else 80)
        server = self._resolve(f"{url.host}:{port}")
        if server is None:
            raise httpx2.ConnectError(
                f"[Errno -2] Name or service not known: {url.host}", request=request
            )
        return server

    def _handle(self, request: httpx2.Request) -> httpx2.Response:
        url = request.url
        headers = {k.lower(): v for k, v in request.headers.items()}
        server = self._server(url, request)
        reply = server.handle(request.method, url.path, headers, request.content)
        return to_httpx_response(reply, request)

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        await request.aread()
        # One scheduling point per request, so concurrent sessions interleave as they would
        # against a real server; the fake itself never blocks.
        await anyio.lowlevel.checkpoint()
        return self._handle(request)

    async def post(
        self,
        url: str,
        body: bytes,
        *,
        headers: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> Answer:
        """The same exchange as a ``Poster`` (``agentkv._wire.transport``: the cluster posts
        through it, as through its default one), its failures agentkv's errors."""
        sent = {"content-type": "application/json"}
        sent.update((k.lower(), v) for k, v in (headers or {}).items())
        return await self._answer("POST", url, sent, body)

    async def post_stream(
        self, url: str, body: bytes, *, headers: Mapping[str, str] | None = None
    ) -> Streamed:
        """``post``'s answer with its body as one piece, as httpx2's path streams it."""
        status, raw_headers, content = await self.post(url, body, headers=headers)
        return Streamed(status, raw_headers, _Whole(content))

    async def get(self, url: str, *, timeout_s: float | None = None) -> Answer:
        return await self._answer("GET", url, {}, b"")

    async def _answer(self, method: str, url: str, headers: dict[str, str], body: bytes) -> Answer:
        await anyio.lowlevel.checkpoint()
        try:
            parsed = _parsed(url)
            reply = self._server(parsed, None).handle(method, parsed.path, headers, body)
            _raise_failure(reply, None)
        except (httpx2.HTTPError, httpx2.InvalidURL) as exc:
            raise_transport_error(exc, url)  # as a user's httpx2 client's would be
        return Answer(reply.status, _raw_headers(reply), reply.body())


@functools.lru_cache(maxsize=512)
def _parsed(url: str) -> httpx2.URL:
    return httpx2.URL(url)


class _Whole:
    """A body as one piece, on an iterator of its own as the default transport's is (an async
    generator left unfinished would be closed by a task of asyncio's)."""

    def __init__(self, body: bytes) -> None:
        self._body = body

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self

    async def __anext__(self) -> bytes:
        body, self._body = self._body, b""
        if not body:
            raise StopAsyncIteration
        return body

    async def aclose(self) -> None:
        self._body = b""
