"""The default HTTP transport of a cluster: httpx's interface on aiohttp's connection pool.

The SDK's traffic is many small requests to a handful of servers: each turn sends a tokenize
request, a P leg and a D leg. httpcore's connection pool (httpx's default) walks every connection
of the pool and asks each idle one whether its socket was closed, on every request start and
close; with anyio's locks and the pure-Python h11 parser around each exchange, that was ~6 ms of
CPU per request at 64 concurrent sessions on the 2-core machine, and the proxy's event loop
saturated (``docs/proxy.md``). aiohttp does the exchange the cheap way: a connection is an
asyncio protocol (the loop reports a server's close of an idle connection, so nothing is polled),
llhttp parses the response in C, and each (host, port) has its own list of idle connections.

The rest of agentkv speaks httpx (``agentkv._http``, the fakes' ``FakeTransport``), so this is an
``httpx.AsyncBaseTransport`` that sends each request through one ``aiohttp.ClientSession``:

* ``httpx.Limits`` apply per server, as aiohttp's ``limit_per_host`` (no total limit), with
  ``max_keepalive_connections`` idle connections kept per server for ``keepalive_expiry`` s;
* httpx's ``Timeout`` phases: ``connect`` bounds opening a connection (aiohttp's
  ``sock_connect``; DNS and the connect together are bounded by ``connect`` + ``pool``), ``pool``
  the wait for a free place under the limit, ``write`` each write of the request body, ``read``
  each wait for the server's bytes (aiohttp's ``sock_read``);
* httpx's exceptions: a refused or unresolvable server is ``ConnectError``, a server that closes
  the connection before answering in full is ``RemoteProtocolError`` (a lost connection, never a
  connect error: the cluster must not mark a live server down for it), a reset mid-request
  ``ReadError``, and so on (``_error``);
* response bodies stream as they arrive (server-sent events are not buffered); closing one hands
  its connection back when it was read to the end, and closes it otherwise.

A request is never re-sent; like httpcore, a connection the server closes just as a request goes
out fails that request (``DEFAULT_LIMITS`` keeps idle connections for less than vLLM's keep-alive
so this does not happen). ``https`` URLs go to httpx's own transport; HTTP(S)_PROXY variables are
not used (the servers are the cluster's own): pass ``http_client=`` to a cluster for that.

Two of httpx's semantics have no aiohttp option, so ``_Connector`` adds them on two of its
internal methods (the pool timeout, the cap on idle connections); the tests in
``tests/unit/test_transport.py`` fail if an aiohttp release changes either.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import typing
from collections.abc import AsyncIterator, Callable

import aiohttp
import httpx
from aiohttp.abc import AbstractStreamWriter
from aiohttp.client_proto import ResponseHandler
from aiohttp.payload import AsyncIterablePayload, Payload
from multidict import CIMultiDict
from yarl import URL

if typing.TYPE_CHECKING:
    from aiohttp.client_reqrep import ConnectionKey
    from aiohttp.tracing import Trace

__all__ = ["ClusterClient", "ServerPools"]

# The pool timeout of the request this task is sending, read where aiohttp waits for a place.
_POOL_TIMEOUT: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "agentkv_pool_timeout", default=None
)
# Sent as httpx built them: aiohttp adds none of its default headers.
_SKIP_HEADERS = ("Accept", "Accept-Encoding", "Content-Type", "User-Agent")
_HTTP_VERSIONS: dict[tuple[int, int], bytes] = {(1, 1): b"HTTP/1.1", (1, 0): b"HTTP/1.0"}


class _Handler(ResponseHandler):
    """aiohttp's client protocol, retired when bytes arrive while it waits in the pool.

    aiohttp would parse them and hand them to the next request as its answer.
    """

    idle = False

    def set_response_params(self, **params: typing.Any) -> None:
        self.idle = False  # a request is about to go out on it
        super().set_response_params(**params)

    def data_received(self, data: bytes) -> None:
        if self.idle and data:  # (aiohttp calls it with b"" to resume its own reading)
            self.close()  # an answer nobody asked for: the connection's state is unknown
            return
        super().data_received(data)


class _Connector(aiohttp.TCPConnector):
    """aiohttp's TCP connection pool with ``httpx.Limits`` semantics, applied per server."""

    def __init__(self, limits: httpx.Limits) -> None:
        super().__init__(
            limit=0,
            limit_per_host=limits.max_connections or 0,
            keepalive_timeout=limits.keepalive_expiry,
        )
        self._max_idle = limits.max_keepalive_connections
        self._factory = typing.cast(
            "functools.partial[ResponseHandler]", functools.partial(_Handler, loop=self._loop)
        )

    async def _wait_for_available_connection(self, key: ConnectionKey, traces: list[Trace]) -> None:
        # Where aiohttp waits for a place under limit_per_host: httpx's pool timeout.
        try:
            async with asyncio.timeout(_POOL_TIMEOUT.get()):
                await super()._wait_for_available_connection(key, traces)
        except TimeoutError:
            raise httpx.PoolTimeout("timed out waiting for a connection") from None

    def _release(
        self, key: ConnectionKey, protocol: ResponseHandler, *, should_close: bool = False
    ) -> None:
        # Keep at most max_keepalive_connections idle connections to one server.
        if self._max_idle is not None and len(self._conns.get(key, ())) >= self._max_idle:
            should_close = True
        typing.cast(_Handler, protocol).idle = True
        super()._release(key, protocol, should_close=should_close)


class _Upload(Payload):
    """A request body, written under httpx's write timeout.

    (Not aiohttp's ``BytesPayload``: that one warns about bodies over 1 MiB, which a long agent
    history with its token ids can be.)
    """

    _autoclose = True

    def __init__(self, value: bytes, write_timeout: float | None) -> None:
        super().__init__(value)
        self._size = len(value)
        self._write_timeout = write_timeout

    def decode(self, encoding: str = "utf-8", errors: str = "strict") -> str:
        return typing.cast(bytes, self._value).decode(encoding, errors)

    async def write(self, writer: AbstractStreamWriter) -> None:
        await self.write_with_length(writer, None)

    # A timeout here reaches the caller as a bare TimeoutError (aiohttp passes those on): _error
    # maps it onto httpx.WriteTimeout.
    async def write_with_length(
        self, writer: AbstractStreamWriter, content_length: int | None
    ) -> None:
        value: bytes = self._value if content_length is None else self._value[:content_length]
        async with asyncio.timeout(self._write_timeout):
            await writer.write(value)


class _StreamUpload(AsyncIterablePayload):
    """A streamed request body; each chunk is written under httpx's write timeout."""

    def __init__(self, stream: httpx.AsyncByteStream, write_timeout: float | None) -> None:
        super().__init__(stream)
        self._stream = stream
        self._write_timeout = write_timeout

    async def write(self, writer: AbstractStreamWriter) -> None:
        await self.write_with_length(writer, None)

    async def write_with_length(
        self, writer: AbstractStreamWriter, content_length: int | None
    ) -> None:
        async for chunk in self._stream:
            if chunk:
                async with asyncio.timeout(self._write_timeout):
                    await writer.write(chunk)


# aiohttp's exceptions, the more specific first, and the httpx exception each one becomes.
_ERRORS: tuple[tuple[type[BaseException], Callable[[BaseException], httpx.TransportError]], ...] = (
    (aiohttp.ConnectionTimeoutError, lambda e: httpx.ConnectTimeout(f"timed out connecting: {e}")),
    (aiohttp.SocketTimeoutError, lambda e: httpx.ReadTimeout("timed out reading")),
    # refused, unreachable, unresolvable
    (aiohttp.ClientConnectorError, lambda e: httpx.ConnectError(str(e))),
    (
        aiohttp.ServerDisconnectedError,
        lambda e: httpx.RemoteProtocolError("Server disconnected without sending a response."),
    ),
    (
        aiohttp.ClientPayloadError,
        lambda e: httpx.RemoteProtocolError(f"incomplete message body: {e}"),
    ),
    (
        aiohttp.ClientResponseError,
        lambda e: httpx.RemoteProtocolError(f"malformed HTTP response: {e}"),
    ),
    (
        aiohttp.ClientConnectionResetError,
        lambda e: httpx.WriteError(f"the connection closed while the request was sent: {e}"),
    ),
    # a reset or close mid-request (ClientOSError and the like)
    (aiohttp.ClientConnectionError, lambda e: httpx.ReadError(f"the connection broke: {e!r}")),
    # _Upload's write timeout (aiohttp raises its own timeouts as the types above)
    (TimeoutError, lambda e: httpx.WriteTimeout("timed out writing")),
    (OSError, lambda e: httpx.ReadError(f"the connection broke: {e!r}")),
)


def _error(exc: BaseException) -> httpx.TransportError:
    """The httpx exception for an aiohttp one (``agentkv._http`` maps those onto agentkv's)."""
    if isinstance(exc, httpx.TransportError):
        return exc  # raised by this module inside aiohttp (the pool timeout)
    for kind, make in _ERRORS:
        if isinstance(exc, kind):
            return make(exc)
    return httpx.TransportError(f"{exc!r}")


@functools.lru_cache(maxsize=512)
def _url(raw: str) -> URL:
    # yarl parses a URL string in Python; a cluster talks to a handful of URLs.
    return URL(raw, encoded=True)


@functools.lru_cache(maxsize=64)
def _timeout(
    connect: float | None, read: float | None, pool: float | None
) -> aiohttp.ClientTimeout:
    return aiohttp.ClientTimeout(
        # Bounds DNS and connect together; the connect alone is sock_connect, the wait for a
        # place _Connector's pool timeout.
        connect=None if connect is None or pool is None else connect + pool,
        sock_connect=connect,
        sock_read=read,
    )


class _Body(httpx.AsyncByteStream):
    """A response body as it arrives; closing it hands the connection back (or closes it)."""

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self._response = response

    async def __aiter__(self) -> AsyncIterator[bytes]:
        content = self._response.content
        try:
            while chunk := await content.readany():
                yield chunk
        except (aiohttp.ClientError, OSError) as exc:
            raise _error(exc) from exc

    async def aclose(self) -> None:
        # Read to the end, the connection went back to the pool already; otherwise it closes.
        self._response.release()


class ServerPools(httpx.AsyncBaseTransport):
    """An httpx transport on aiohttp's pool; ``limits`` apply to each server."""

    def __init__(self, limits: httpx.Limits) -> None:
        self._limits = limits
        self._session: aiohttp.ClientSession | None = None
        self._tls: httpx.AsyncHTTPTransport | None = None
        self._closed = False

    def _open(self) -> aiohttp.ClientSession:
        # Opened on first use: aiohttp binds a session to the running event loop.
        session = aiohttp.ClientSession(
            connector=_Connector(self._limits),
            cookie_jar=aiohttp.DummyCookieJar(),
            skip_auto_headers=_SKIP_HEADERS,
            auto_decompress=False,  # httpx decodes the body as the headers say
            timeout=aiohttp.ClientTimeout(),
        )
        # Never re-send a request (aiohttp retries idempotent ones on a closed connection):
        # the caller decides, as with httpx. aiohttp's own test client sets this the same way.
        session._retry_connection = False
        self._session = session
        return session

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if self._closed:
            raise httpx.ConnectError("the transport is closed", request=request)
        url = request.url
        if url.scheme == "https":
            if self._tls is None:
                self._tls = httpx.AsyncHTTPTransport(limits=self._limits, trust_env=False)
            return await self._tls.handle_async_request(request)
        if url.scheme != "http":
            raise httpx.UnsupportedProtocol(
                f"Request URL has an unsupported protocol '{url.scheme}://'.", request=request
            )
        session = self._session or self._open()
        timeout = request.extensions.get("timeout", {})
        write_timeout = timeout.get("write")
        # (httpx's Headers.multi_items() re-checks the encoding of every header per header.)
        headers = CIMultiDict(
            [
                (name.decode("latin-1"), value.decode("latin-1"))
                for name, value in request.headers.raw
            ]
        )
        data: Payload | None
        try:
            content = request.content
        except httpx.RequestNotRead:
            assert isinstance(request.stream, httpx.AsyncByteStream)
            headers.popall("transfer-encoding", None)  # aiohttp frames the stream itself
            data = _StreamUpload(request.stream, write_timeout)
        else:
            data = _Upload(content, write_timeout) if content else None
        _POOL_TIMEOUT.set(timeout.get("pool"))
        try:
            response = await session.request(
                request.method,
                _url(str(url)),
                headers=headers,
                data=data,
                allow_redirects=False,
                timeout=_timeout(timeout.get("connect"), timeout.get("read"), timeout.get("pool")),
            )
        except (aiohttp.ClientError, OSError, httpx.TransportError) as exc:
            raise _error(exc) from exc
        if response.status == 101:
            response.close()
            raise httpx.RemoteProtocolError("the server switched protocols", request=request)
        return httpx.Response(
            response.status,
            headers=list(response.raw_headers),
            stream=_Body(response),
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


class ClusterClient(httpx.AsyncClient):
    """The httpx client a cluster builds for itself when given none.

    Its requests go to the cluster's own servers, and it is built without auth, cookies, event
    hooks or redirects to follow, so ``send`` hands each request straight to the transport:
    httpx's per-request auth flow, redirect loop and cookie extraction would cost about as much
    CPU as the exchange itself, for nothing here (``benchmarks/transport_cpu.py``). Requests are
    built as httpx builds them (base URL, default headers, the client's timeouts).
    """

    async def send(
        self,
        request: httpx.Request,
        *,
        stream: bool = False,
        auth: typing.Any = httpx.USE_CLIENT_DEFAULT,
        follow_redirects: typing.Any = httpx.USE_CLIENT_DEFAULT,
    ) -> httpx.Response:
        if auth is not httpx.USE_CLIENT_DEFAULT or follow_redirects is not httpx.USE_CLIENT_DEFAULT:
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
