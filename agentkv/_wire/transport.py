"""The default HTTP transport of a cluster: httpx2's interface on aiohttp's public client.

The SDK's traffic is many small requests to a handful of servers: each turn sends a tokenize
request, a P leg and a D leg. httpcore's connection pool (httpx2's default) walks every connection
of the pool and asks each idle one whether its socket was closed, on every request start and
close; with anyio's locks and the pure-Python h11 parser around each exchange, that was ~6 ms of
CPU per request at 64 concurrent sessions on the 2-core machine, and the proxy's event loop
saturated (``docs/proxy.md``). aiohttp does it the cheap way: a connection is an asyncio protocol
(the loop reports a server's close of an idle connection, so nothing is polled), llhttp parses
the response in C, and each (host, port) has its own list of idle connections.

The rest of agentkv speaks httpx2 (``_wire.http``, the fakes' ``FakeTransport``), so this is an
``httpx2.AsyncBaseTransport`` that sends each request httpx2 built through one
``aiohttp.ClientSession`` (aiohttp's public API only; ``benchmarks/transport_cpu.py`` measures it
against httpx2's and httpx2's pools and ``httpx-aiohttp``, ``docs/benchmarks.md`` has the numbers).
A turn's posts (tokenize, the P leg, the D leg) skip httpx2's objects: ``ServerPools.post``
takes the headers httpx2 would send and returns the answer's status, headers and body
(``_wire.http.post_json`` on the cluster's own client), ``ServerPools.post_stream`` the same with
the body as it arrives (``_wire.http.stream_events``: a streamed D leg), with the same limits,
timeouts, errors and connection reuse. On a turn run alone, the request and response objects'
code, cold after each wait, cost as much CPU as aiohttp's exchange. The fakes' transport
(``agentkv.testing``) posts the same way (``PostTransport``), so a turn against the fake cluster
runs this path too.

* ``httpx2.Limits``: ``max_connections`` applies per server (a place is taken from the request's
  start until its body is read or closed; no total limit), idle connections are closed after
  ``keepalive_expiry`` s (aiohttp's ``keepalive_timeout``);
* httpx2's ``Timeout`` phases: ``pool`` bounds the wait for a place under the limit, ``connect``
  opening a connection (aiohttp's ``sock_connect``; DNS and the connect together are bounded by
  ``connect`` + ``pool``), ``read`` each wait for the server's bytes;
* httpx2's exceptions: a refused or unresolvable server is ``ConnectError``, a server that closes
  the connection before answering in full is ``RemoteProtocolError`` (a lost connection, never a
  connect error: the cluster must not mark a live server down for it), a reset mid-request
  ``ReadError``, and so on (``_ERRORS``);
* response bodies stream as they arrive (server-sent events are not buffered); a body read to
  its end hands its connection back at once, and closing one that was not closes the connection.

What aiohttp's public client does not offer, and why it does not matter here:

* ``max_keepalive_connections``: idle connections to a server are bounded by ``max_connections``
  and close after ``keepalive_expiry`` (4 s by default), not capped below that;
* ``write``: a server that does not read the request fails it on the ``read`` timeout
  (``ReadTimeout``, agentkv's ``RequestTimeoutError`` as a write timeout is), since aiohttp's read
  timer runs from the request's start;
* aiohttp re-sends a request once when its connection is lost if the method is idempotent (GET,
  HEAD, PUT, DELETE, ...): agentkv's only such requests are probes (GET), and a POST is never
  re-sent;
* a whole answer that a server sends on an idle connection, unasked, is not detected (aiohttp
  reads it as the next request's answer): uvicorn (vLLM's server) never sends one.

``https`` URLs go to httpx2's own transport; HTTP(S)_PROXY variables are not used (the servers are
the cluster's own): pass ``http_client=`` to a cluster for that.
"""

from __future__ import annotations

import asyncio
import functools
import typing
from collections.abc import AsyncIterator, Callable

import aiohttp
import httpx2

__all__ = ["Answer", "ClusterClient", "PostTransport", "ServerPools", "Streamed", "parsed_url"]

_HTTP_VERSIONS: dict[tuple[int, int], bytes] = {(1, 1): b"HTTP/1.1", (1, 0): b"HTTP/1.0"}
# httpx2 built every header the request needs (host, user-agent, accept, content-length, ...):
# aiohttp adds none of its own (content-type would be application/octet-stream otherwise).
_SKIP_HEADERS = ("Accept", "Accept-Encoding", "User-Agent", "Content-Type")
# A body above this is sent in pieces of it, each write bounded by the write timeout (a small
# one fits the socket's buffer at once; aiohttp also warns on a bytes body above 1 MiB).
_PIECE = 1 << 18


async def _timed(
    pieces: AsyncIterator[bytes], deadline: asyncio.Timeout, write_s: float | None
) -> AsyncIterator[bytes]:
    """``pieces``, each one's write (the time until aiohttp asks for the next) within
    ``write_s``: aiohttp has no write timeout of its own."""
    loop = asyncio.get_running_loop()
    async for piece in pieces:
        if write_s is not None:
            deadline.reschedule(loop.time() + write_s)
        yield piece
        deadline.reschedule(None)


async def _pieces(body: bytes) -> AsyncIterator[bytes]:
    view = memoryview(body)
    for start in range(0, len(view), _PIECE):
        yield bytes(view[start : start + _PIECE])


# aiohttp's exceptions, the more specific first, and the httpx2 exception each one becomes.
_ErrorMap = Callable[[BaseException], httpx2.TransportError]
_ERRORS: tuple[tuple[type[BaseException], _ErrorMap], ...] = (
    (aiohttp.ConnectionTimeoutError, lambda e: httpx2.ConnectTimeout(f"timed out connecting: {e}")),
    (aiohttp.SocketTimeoutError, lambda e: httpx2.ReadTimeout("timed out reading")),
    (aiohttp.ClientConnectorError, lambda e: httpx2.ConnectError(str(e))),  # refused, DNS, ...
    (
        aiohttp.ServerDisconnectedError,
        lambda e: httpx2.RemoteProtocolError("Server disconnected without sending a response."),
    ),
    (
        aiohttp.ClientPayloadError,
        lambda e: httpx2.RemoteProtocolError(f"incomplete message body: {e}"),
    ),
    (
        aiohttp.ClientResponseError,  # what aiohttp raises for an answer it cannot parse
        lambda e: httpx2.RemoteProtocolError(f"malformed HTTP response: {e!r}"),
    ),
    (aiohttp.InvalidURL, lambda e: httpx2.UnsupportedProtocol(f"bad URL: {e}")),
    (
        aiohttp.ClientConnectionResetError,
        lambda e: httpx2.WriteError(f"the connection closed while the request was sent: {e}"),
    ),
    # a reset or a close mid-request (ClientOSError and the like)
    (aiohttp.ClientConnectionError, lambda e: httpx2.ReadError(f"the connection broke: {e!r}")),
    (OSError, lambda e: httpx2.ReadError(f"the connection broke: {e!r}")),
)
_AIOHTTP_ERRORS = (aiohttp.ClientError, OSError)


def _error(exc: BaseException) -> httpx2.TransportError:
    """The httpx2 exception for an aiohttp one (``agentkv._wire.http`` maps those onto ours)."""
    for kind, make in _ERRORS:
        if isinstance(exc, kind):
            return make(exc)
    return httpx2.TransportError(f"{exc!r}")


@functools.lru_cache(maxsize=512)
def parsed_url(url: str) -> httpx2.URL:
    """``url`` parsed once: httpx2 parses string URLs in pure Python on every request, and a
    session talks to a handful of URLs (URL objects are immutable)."""
    return httpx2.URL(url)


@functools.lru_cache(maxsize=64)
def _timeout(
    connect: float | None, read: float | None, pool: float | None
) -> aiohttp.ClientTimeout:
    return aiohttp.ClientTimeout(
        total=None,
        # Bounds DNS and connect together; the connect alone is sock_connect (the wait for a
        # place is ServerPools', before aiohttp sees the request).
        connect=None if connect is None or pool is None else connect + pool,
        sock_connect=connect,
        sock_read=read,
    )


class _Place:
    """A request's place under its server's limit, given back once."""

    __slots__ = ("_limit",)

    def __init__(self, limit: asyncio.Semaphore | None) -> None:
        self._limit = limit

    def release(self) -> None:
        limit, self._limit = self._limit, None
        if limit is not None:
            limit.release()


class _Body(httpx2.AsyncByteStream):
    """A response body as it arrives.

    Its connection goes back to the pool when the body ends; closing it before then closes the
    connection (the rest of the body is still on the wire).
    """

    def __init__(self, response: aiohttp.ClientResponse, place: _Place) -> None:
        self._response = response
        self._place = place

    def __aiter__(self) -> AsyncIterator[bytes]:
        # Its own iterator, not an async generator: one left unfinished (a stream closed at
        # [DONE], before the body's end was read) would be closed by a task of asyncio's.
        return self

    async def __anext__(self) -> bytes:
        try:
            chunk = await self._response.content.readany()
        except _AIOHTTP_ERRORS as exc:
            raise _error(exc) from exc
        if not chunk:
            raise StopAsyncIteration
        return chunk

    async def aclose(self) -> None:
        response = self._response
        if response.content.is_eof():
            response.release()
        else:
            response.close()
        self._place.release()


Answer = tuple[int, list[tuple[bytes, bytes]], bytes]
"""An answer read whole: ``(status, raw headers, body as sent)``."""

Streamed = tuple[int, list[tuple[bytes, bytes]], httpx2.AsyncByteStream]
"""An answer whose body arrives as it comes: ``(status, raw headers, body)``; whoever takes it
closes the body (its connection goes back to the pool only when the body was read to its end)."""


@typing.runtime_checkable
class PostTransport(typing.Protocol):
    """An httpx2 transport that also POSTs without httpx2's request and response objects: the
    default one (``ServerPools``) and the fakes' (``agentkv.testing.FakeTransport``), so a turn
    on the fake cluster runs the code it runs on real servers.

    Both methods take ``body`` for an ``http://`` URL with exactly ``headers`` (httpx2's, as
    ``_wire.http`` builds them) under httpx2's timeout ``phases`` (``Timeout.as_dict()``), and
    raise httpx2's exception for a failed exchange, as ``handle_async_request`` would. Defined on
    the class: a wrapper that forwards other attributes to a ``PostTransport`` is not one
    (``ClusterClient.poster``), so its own ``handle_async_request`` sees every request."""

    async def post(
        self, url: str, body: bytes, headers: list[tuple[str, str]], phases: dict[str, float | None]
    ) -> Answer:
        """The whole answer."""
        ...

    async def post_stream(
        self, url: str, body: bytes, headers: list[tuple[str, str]], phases: dict[str, float | None]
    ) -> Streamed:
        """The answer once its head is in; its body as it arrives."""
        ...


class ServerPools(httpx2.AsyncBaseTransport):
    """An httpx2 transport on one ``aiohttp.ClientSession``; ``limits`` apply to each server."""

    def __init__(self, limits: httpx2.Limits) -> None:
        self._limits = limits
        self._session: aiohttp.ClientSession | None = None
        self._places: dict[tuple[str, int], asyncio.Semaphore] = {}
        self._tls: httpx2.AsyncHTTPTransport | None = None
        self._closed = False

    def _open(self) -> aiohttp.ClientSession:
        # aiohttp binds the session to the running loop: made at the first request.
        connector = aiohttp.TCPConnector(
            limit=0,  # the limit is per server, and ServerPools' own (its pool timeout)
            keepalive_timeout=self._limits.keepalive_expiry or 0.0,
        )
        self._session = aiohttp.ClientSession(
            connector=connector,
            cookie_jar=aiohttp.DummyCookieJar(),
            skip_auto_headers=_SKIP_HEADERS,
            auto_decompress=False,  # httpx2 decodes the body as the headers say
            timeout=aiohttp.ClientTimeout(total=None),
        )
        return self._session

    async def _place(self, server: tuple[str, int], pool: float | None) -> _Place:
        """Wait, at most ``pool`` s, for a place under ``server``'s limit."""
        limit = self._places.get(server)
        if limit is None:
            if self._limits.max_connections is None:
                return _Place(None)
            limit = self._places[server] = asyncio.Semaphore(self._limits.max_connections)
        if limit.locked():
            try:
                async with asyncio.timeout(pool):
                    await limit.acquire()
            except TimeoutError:
                raise httpx2.PoolTimeout("timed out waiting for a connection") from None
        else:
            await limit.acquire()  # a free place: taken at once
        return _Place(limit)

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        if self._closed:
            raise httpx2.ConnectError("the transport is closed", request=request)
        url = request.url
        if url.scheme == "https":
            if self._tls is None:
                self._tls = httpx2.AsyncHTTPTransport(limits=self._limits, trust_env=False)
            return await self._tls.handle_async_request(request)
        if url.scheme != "http":
            raise httpx2.UnsupportedProtocol(
                f"Request URL has an unsupported protocol '{url.scheme}://'.", request=request
            )
        timeout = request.extensions.get("timeout", {})
        place = await self._place((url.host, url.port or 80), timeout.get("pool"))
        try:
            return await self._send(request, place)
        except BaseException:
            place.release()
            raise

    async def _start(
        self,
        method: str,
        url: str,
        headers: list[tuple[str, str]],
        body: bytes | AsyncIterator[bytes] | None,
        phases: dict[str, float | None],
    ) -> aiohttp.ClientResponse:
        """Send a request; its answer once its head is in (aiohttp's errors as httpx2's)."""
        session = self._session or self._open()
        deadline = asyncio.timeout(None)
        if isinstance(body, bytes) and len(body) > _PIECE:
            body = _pieces(body)  # with httpx2's content-length: not chunked
        if body is not None and not isinstance(body, bytes):
            body = _timed(body, deadline, phases.get("write"))
        try:
            async with deadline:
                response = await session.request(
                    method,
                    url,
                    data=body,
                    headers=headers,
                    allow_redirects=False,
                    compress=None,
                    timeout=_timeout(phases.get("connect"), phases.get("read"), phases.get("pool")),
                )
        except _AIOHTTP_ERRORS as exc:
            if deadline.expired():  # (TimeoutError is an OSError)
                raise httpx2.WriteTimeout("timed out writing") from None
            raise _error(exc) from exc
        if response.status == 101:
            response.close()
            raise httpx2.RemoteProtocolError("the server switched protocols")
        return response

    async def post(
        self,
        url: str,
        body: bytes,
        headers: list[tuple[str, str]],
        phases: dict[str, float | None],
    ) -> Answer:
        """POST ``body`` to an ``http://`` URL and read the whole answer: ``(status, raw headers,
        body as sent)``, with none of httpx2's request and response objects in between.

        ``headers`` are all of them, as httpx2 would build them (``_wire.http`` does);
        ``phases`` are httpx2's timeouts (``Timeout.as_dict()``). The limits, timeouts, errors
        (httpx2's) and connection reuse are ``handle_async_request``'s: a turn's legs are the
        SDK's hot path, and on a turn run alone between waits the objects' code, cold each time,
        cost a request as much as aiohttp's own (``benchmarks/transport_cpu.py --concurrency 1``).
        """
        response, place = await self._post(url, body, headers, phases)
        try:
            try:
                content = await response.read()
            except BaseException as exc:
                response.close()  # the rest of the body is still on the wire (or cancelled)
                if isinstance(exc, _AIOHTTP_ERRORS):
                    raise _error(exc) from exc
                raise
            response.release()
            return response.status, list(response.raw_headers), content
        finally:
            place.release()

    async def post_stream(
        self,
        url: str,
        body: bytes,
        headers: list[tuple[str, str]],
        phases: dict[str, float | None],
    ) -> Streamed:
        """``post``, answered once the head is in: the body arrives as the server sends it (a
        streamed D leg's events), each piece as aiohttp reads it. Closing the body before its end
        closes the connection; either way its place under the limit is given back."""
        response, place = await self._post(url, body, headers, phases)
        return response.status, list(response.raw_headers), _Body(response, place)

    async def _post(
        self,
        url: str,
        body: bytes,
        headers: list[tuple[str, str]],
        phases: dict[str, float | None],
    ) -> tuple[aiohttp.ClientResponse, _Place]:
        """Send a POST under its server's limit: the answer's head, and the place it holds."""
        if self._closed:
            raise httpx2.ConnectError("the transport is closed")
        parsed = parsed_url(url)
        place = await self._place((parsed.host, parsed.port or 80), phases.get("pool"))
        try:
            return await self._start("POST", url, headers, body, phases), place
        except BaseException:
            place.release()
            raise

    async def _send(self, request: httpx2.Request, place: _Place) -> httpx2.Response:
        """Send ``request`` and return the answer's head; its body streams."""
        headers = request.headers.multi_items()
        body: bytes | AsyncIterator[bytes] | None
        try:
            body = request.content or None
        except httpx2.RequestNotRead:
            assert isinstance(request.stream, httpx2.AsyncByteStream)
            body = aiter(request.stream)
            # aiohttp frames a body of unknown length itself, and refuses httpx2's header for it
            headers = [(k, v) for k, v in headers if k.lower() != "transfer-encoding"]
        response = await self._start(
            request.method,
            str(request.url),
            headers,
            body,
            request.extensions.get("timeout", {}),
        )
        return httpx2.Response(
            response.status,
            headers=list(response.raw_headers),
            stream=_Body(response, place),
            extensions={
                "http_version": _HTTP_VERSIONS.get(response.version or (1, 1), b"HTTP/1.1"),
                "reason_phrase": (response.reason or "").encode("latin-1", "replace"),
            },
        )

    async def aclose(self) -> None:
        self._closed = True
        session, self._session = self._session, None
        if session is not None:
            await session.close()
        if self._tls is not None:
            await self._tls.aclose()


class ClusterClient(httpx2.AsyncClient):
    """The httpx2 client a cluster builds for itself when given none.

    Its requests go to the cluster's own servers, and it is built without auth, cookies, event
    hooks or redirects to follow, so ``send`` hands each request straight to the transport:
    httpx2's per-request auth flow, redirect loop and cookie extraction would cost about as much
    CPU as the exchange itself, for nothing here (``benchmarks/transport_cpu.py``). Requests are
    built as httpx2 builds them (base URL, default headers, the client's timeouts).
    """

    @functools.cached_property
    def poster(self) -> PostTransport | None:
        """Its transport when that one posts without httpx2's objects (``PostTransport``): its
        class defines both methods, so a wrapper forwarding attributes (``__getattr__``) to one
        still sees its requests through ``handle_async_request``."""
        transport = self._transport
        if not isinstance(transport, PostTransport):
            return None
        own = all(callable(getattr(type(transport), m, None)) for m in ("post", "post_stream"))
        return transport if own else None

    async def send(
        self,
        request: httpx2.Request,
        *,
        stream: bool = False,
        auth: typing.Any = httpx2.USE_CLIENT_DEFAULT,
        follow_redirects: typing.Any = httpx2.USE_CLIENT_DEFAULT,
    ) -> httpx2.Response:
        default = httpx2.USE_CLIENT_DEFAULT
        if auth is not default or follow_redirects is not default:
            raise TypeError("the cluster's client sends without auth or redirects")
        if self.is_closed:
            raise RuntimeError("Cannot send a request, as the client has been closed.")
        response = await self._transport.handle_async_request(request)
        response.request = request
        if not stream:
            try:
                await response.aread()
            finally:
                await response.aclose()
        return response
