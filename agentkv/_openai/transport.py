"""httpx2 transports that serve requests with an ASGI app in this process: no socket, no hop.

The openai SDK speaks ``httpx2``; given a client on one of these transports, its requests are
answered by the proxy's app (``agentkv.proxy.create_app``) directly. Unlike ``httpx2``'s own
``ASGITransport``, which collects the whole body before returning, responses **stream**: a chat
completion's chunks reach the caller as the app sends them, and closing the response early tells
the app the client left (``http.disconnect``), so an abandoned streamed turn commits nothing.

* ``AsyncAppTransport`` runs the app on the caller's event loop.
* ``AppTransport`` (sync) runs it on a ``Portal``: an event loop on a thread, shared with the
  sync ``Cluster`` whose sessions the app drives (cluster state lives on that loop).

Both run the app's lifespan (its idle-session sweeper, and closing every session at the end):
the async one from its first request, the sync one from construction; ``aclose``/``close``
ends it, which releases every pinned handle.

The hot endpoints (chat completions, responses) can be handed over as ``direct`` endpoints: a
request for one of them skips the app's middleware, routing and the exchange's task and queues,
and a complete (not streamed) answer becomes the ``httpx2.Response`` at once. A streamed answer
is still served through an exchange, with the same disconnect semantics as above. The endpoints
are the app's own (the same error mapping and metrics), so an answer is byte-for-byte the same.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, MutableMapping
from typing import Any

import httpx2
from starlette.requests import Request
from starlette.responses import Response

from agentkv._core import Portal

__all__ = ["AppTransport", "AsyncAppTransport", "AsyncLifespan", "DirectEndpoints"]

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[MutableMapping[str, Any], Receive, Send], Awaitable[None]]
LifespanFactory = Callable[[], contextlib.AbstractAsyncContextManager[Any]]
Endpoint = Callable[[Request], Awaitable[Response]]
DirectEndpoints = Mapping[tuple[str, str], Endpoint]
"""(method, path) -> the app's endpoint for it, served without the app's routing."""


def _scope(request: httpx2.Request) -> dict[str, Any]:
    url = request.url
    return {
        "type": "http",
        # 2.4: a send after the client left raises OSError (the app's cue to stop), as
        # uvicorn's does, instead of the app polling receive() for the disconnect.
        "asgi": {"version": "3.0", "spec_version": "2.4"},
        "http_version": "1.1",
        "method": request.method,
        "headers": [(k.lower(), v) for (k, v) in request.headers.raw],
        "scheme": url.scheme,
        "path": url.path,
        "raw_path": url.raw_path.split(b"?")[0],
        "query_string": url.query,
        "server": (url.host, url.port),
        "client": ("127.0.0.1", 0),
        "root_path": "",
        "path_params": {},
    }


class AsyncLifespan:
    """An app's lifespan, entered once and exited once, from any task on one loop."""

    def __init__(self, factory: LifespanFactory) -> None:
        self._factory = factory
        self._context: contextlib.AbstractAsyncContextManager[Any] | None = None
        self._lock = asyncio.Lock()
        self._closed = False

    async def start(self) -> None:
        if self._context is not None:
            return
        async with self._lock:
            if self._closed:
                raise RuntimeError("the client is closed")
            if self._context is None:
                context = self._factory()
                await context.__aenter__()
                self._context = context

    async def stop(self) -> None:
        self._closed = True
        context, self._context = self._context, None
        if context is not None:
            await context.__aexit__(None, None, None)


class _Exchange:
    """One request served by the app: its response's start, then its body as the app sends it."""

    def __init__(self, app: ASGIApp, scope: dict[str, Any], body: bytes) -> None:
        self._body: bytes | None = body
        self._messages: asyncio.Queue[Message] = asyncio.Queue()
        self._read = asyncio.Event()  # the reader took a message: the app may send more
        self._disconnected = asyncio.Event()  # the exchange is over, read or not
        self._gone = False  # the client closed the response before reading all of it
        self._complete = False
        self._task = asyncio.create_task(self._run(app, scope), name="agentkv-asgi-request")

    async def _run(self, app: ASGIApp, scope: dict[str, Any]) -> None:
        try:
            await app(scope, self._receive, self._send)
        finally:
            # Wake a reader waiting for a body the app will never send.
            self._messages.put_nowait({"type": "agentkv.app.done"})

    async def _receive(self) -> Message:
        body, self._body = self._body, None
        if body is not None:
            return {"type": "http.request", "body": body, "more_body": False}
        await self._disconnected.wait()
        return {"type": "http.disconnect"}

    async def _send(self, message: Message) -> None:
        # Backpressure, as a socket gives it: the app runs at most one message ahead of the
        # reader, so a stream the client stops reading stops too (and is abandoned on close).
        if self._gone:
            raise OSError("the client closed the response")
        self._messages.put_nowait(message)
        while self._messages.qsize() > 1:
            self._read.clear()
            await self._read.wait()
            if self._gone:
                raise OSError("the client closed the response")

    async def _get(self) -> Message:
        message = await self._messages.get()
        self._read.set()
        return message

    async def start(self) -> httpx2.Response:
        """Wait for ``http.response.start``; the response whose stream reads the app's body."""
        message = await self._get()
        if message["type"] != "http.response.start":
            await self._task  # the app failed before answering: its exception, here
            raise RuntimeError("the app finished without answering")
        return httpx2.Response(
            message["status"],
            headers=message.get("headers", []),
            stream=_AsyncBody(self),
        )

    async def chunks(self) -> AsyncIterator[bytes]:
        while True:
            message = await self._get()
            if message["type"] != "http.response.body":
                # The app ended the response without its last body message: over a socket the
                # client would see a connection cut mid-body, and so it does here.
                try:
                    await self._task
                except Exception as exc:
                    raise httpx2.RemoteProtocolError(
                        f"the response ended before its body did ({type(exc).__name__})"
                    ) from exc
                raise httpx2.RemoteProtocolError("the response ended before its body did")
            body = message.get("body", b"")
            if body:
                yield body
            if not message.get("more_body", False):
                break
        self._complete = True
        self._disconnected.set()
        await self._task

    async def aclose(self) -> None:
        """The client is done: tell the app (a stream still running is abandoned), await it."""
        self._gone = not self._complete
        self._disconnected.set()
        self._read.set()
        with contextlib.suppress(Exception):
            await self._task


class _AsyncBody(httpx2.AsyncByteStream):
    def __init__(self, exchange: _Exchange) -> None:
        self._exchange = exchange

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self._exchange.chunks():
            yield chunk

    async def aclose(self) -> None:
        await self._exchange.aclose()


async def _exchange(app: ASGIApp, scope: dict[str, Any], body: bytes) -> httpx2.Response:
    exchange = _Exchange(app, scope, body)
    try:
        return await exchange.start()
    except BaseException:
        await exchange.aclose()
        raise


async def _serve(
    app: ASGIApp, direct: DirectEndpoints, request: httpx2.Request, body: bytes
) -> httpx2.Response:
    """Serve ``request``, within its read timeout (``timeout=`` of the openai call) as a socket
    transport would: no answer started in time is ``httpx2.ReadTimeout``, and the request is
    cancelled (a turn it was running commits nothing)."""
    timeout = request.extensions.get("timeout") or {}
    read_s = timeout.get("read")
    deadline = asyncio.timeout(read_s)
    try:
        async with deadline:
            return await _answer(app, direct, request, body)
    except TimeoutError as exc:
        if not deadline.expired():
            raise
        raise httpx2.ReadTimeout(f"no answer within {read_s} s", request=request) from exc


async def _answer(
    app: ASGIApp, direct: DirectEndpoints, request: httpx2.Request, body: bytes
) -> httpx2.Response:
    scope = _scope(request)
    endpoint = direct.get((request.method, request.url.path))
    if endpoint is None:
        return await _exchange(app, scope, body)
    unread: list[bytes] = [body]

    async def receive() -> Message:
        if unread:
            return {"type": "http.request", "body": unread.pop(), "more_body": False}
        # The endpoint reads the body before it answers; nothing waits on this.
        return {"type": "http.disconnect"}

    response = await endpoint(Request(scope, receive))
    if type(response) is Response and response.background is None:
        # A complete answer: its bytes are the response, no task and no queue.
        return httpx2.Response(
            response.status_code, headers=response.raw_headers, content=bytes(response.body)
        )
    # A streamed answer: sent as the app would send it, through an exchange.
    return await _exchange(response, scope, b"")


class AsyncAppTransport(httpx2.AsyncBaseTransport):
    """Serves an ``httpx2.AsyncClient``'s requests with ``app`` on the caller's event loop.

    ``model`` is the served model's name; ``lifespan`` is entered before the first request and
    exited by ``aclose``; ``on_close`` runs after it (closing a cluster the client owns).
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        model: str,
        lifespan: LifespanFactory,
        on_close: Callable[[], Awaitable[None]] | None = None,
        direct: DirectEndpoints | None = None,
    ) -> None:
        self.model = model
        self._app = app
        self._direct: DirectEndpoints = direct or {}
        self._lifespan = AsyncLifespan(lifespan)
        self._on_close = on_close

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        await self._lifespan.start()
        return await _serve(self._app, self._direct, request, await request.aread())

    async def aclose(self) -> None:
        try:
            await self._lifespan.stop()
        finally:
            on_close, self._on_close = self._on_close, None
            if on_close is not None:
                await on_close()


class _SyncBody(httpx2.SyncByteStream):
    def __init__(self, portal: Portal, stream: httpx2.AsyncByteStream) -> None:
        self._portal = portal
        self._stream = stream
        self._closed = False

    def __iter__(self) -> Iterator[bytes]:
        try:
            yield from self._portal.iterate(aiter(self._stream))
        finally:
            self.close()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            with contextlib.suppress(RuntimeError):  # the portal is already closed
                self._portal.call(self._stream.aclose())


class AppTransport(httpx2.BaseTransport):
    """Serves an ``httpx2.Client``'s requests with ``app`` on ``portal``'s event loop.

    The lifespan is entered now and exited by ``close``; ``on_close`` runs after it, on the
    calling thread (closing a cluster, and with it the portal, that the client owns).
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        model: str,
        portal: Portal,
        lifespan: LifespanFactory,
        on_close: Callable[[], None] | None = None,
        direct: DirectEndpoints | None = None,
    ) -> None:
        self.model = model
        self._app = app
        self._direct: DirectEndpoints = direct or {}
        self._portal = portal
        self._lifespan = portal.call(_make_lifespan(lifespan))
        portal.call(self._lifespan.start())
        self._on_close = on_close
        self._closed = False

    def handle_request(self, request: httpx2.Request) -> httpx2.Response:
        if self._closed:
            raise RuntimeError("the client is closed")
        response = self._portal.call(_serve(self._app, self._direct, request, request.read()))
        assert isinstance(response.stream, httpx2.AsyncByteStream)
        return httpx2.Response(
            response.status_code,
            headers=response.headers.raw,
            stream=_SyncBody(self._portal, response.stream),
        )

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._portal.call(self._lifespan.stop())
        finally:
            if self._on_close is not None:
                self._on_close()


async def _make_lifespan(factory: LifespanFactory) -> AsyncLifespan:
    # Its lock belongs to the portal's loop: create it there.
    return AsyncLifespan(factory)
