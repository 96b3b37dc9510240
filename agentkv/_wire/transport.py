"""The default HTTP transport of a cluster: httpx's interface on aiohttp's connection pool.

The SDK's traffic is many small requests to a handful of servers: each turn sends a tokenize
request, a P leg and a D leg. httpcore's connection pool (httpx's default) walks every connection
of the pool and asks each idle one whether its socket was closed, on every request start and
close; with anyio's locks and the pure-Python h11 parser around each exchange, that was ~6 ms of
CPU per request at 64 concurrent sessions on the 2-core machine, and the proxy's event loop
saturated (``docs/proxy.md``). aiohttp does it the cheap way: a connection is an asyncio protocol
(the loop reports a server's close of an idle connection, so nothing is polled), llhttp parses
the response in C, and each (host, port) has its own list of idle connections.

The rest of agentkv speaks httpx (``_wire.http``, the fakes' ``FakeTransport``), so this is an
``httpx.AsyncBaseTransport`` on aiohttp's ``TCPConnector`` (the pool: limits, keep-alive, DNS,
connect) and its client protocol (parsing, body streams with flow control, the read timeout, a
lost connection's errors). It writes the request httpx built (head and body) on the connection
itself rather than through ``aiohttp.ClientSession``, whose per-request work (headers, cookies,
redirects, its own request and response objects) doubled the CPU of an exchange on top of
httpx's (``benchmarks/transport_cpu.py``, ``docs/benchmarks.md``).

* ``httpx.Limits`` apply per server, as aiohttp's ``limit_per_host`` (no total limit), with
  ``max_keepalive_connections`` idle connections kept per server for ``keepalive_expiry`` s;
* httpx's ``Timeout`` phases: ``connect`` bounds opening a connection (aiohttp's
  ``sock_connect``; DNS and the connect together are bounded by ``connect`` + ``pool``), ``pool``
  the wait for a free place under the limit, ``write`` each wait to write the request, ``read``
  each wait for the server's bytes;
* httpx's exceptions: a refused or unresolvable server is ``ConnectError``, a server that closes
  the connection before answering in full is ``RemoteProtocolError`` (a lost connection, never a
  connect error: the cluster must not mark a live server down for it), a reset mid-request
  ``ReadError``, and so on (``_ERRORS``);
* response bodies stream as they arrive (server-sent events are not buffered); a body read to
  its end hands its connection back at once, and closing one that was not closes the connection.

A request is never re-sent; like httpcore, a connection the server closes just as a request goes
out fails that request (``DEFAULT_LIMITS`` keeps idle connections for less than vLLM's keep-alive
so this does not happen). ``https`` URLs go to httpx's own transport; HTTP(S)_PROXY variables are
not used (the servers are the cluster's own): pass ``http_client=`` to a cluster for that.

aiohttp has no option for three of these (the pool timeout, the idle cap, retiring a connection
that receives bytes while idle), and its public client API is the ClientSession this module
avoids: ``_Connector``, ``_Handler`` and ``handle_async_request`` use aiohttp's connector and
client protocol through their internal methods, and ``tests/unit/test_transport.py`` fails if an
aiohttp release changes any of them.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import typing
from collections.abc import AsyncIterator, Callable

import aiohttp
import httpx
from aiohttp.client_proto import ResponseHandler
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.http_writer import StreamWriter
from yarl import URL

if typing.TYPE_CHECKING:
    from aiohttp.client_reqrep import ConnectionKey
    from aiohttp.streams import StreamReader
    from aiohttp.tracing import Trace

__all__ = ["ClusterClient", "ServerPools"]

# The pool timeout of the request this task is sending, read where aiohttp waits for a place.
_POOL_TIMEOUT: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "agentkv_pool_timeout", default=None
)
_HTTP_VERSIONS: dict[tuple[int, int], bytes] = {(1, 1): b"HTTP/1.1", (1, 0): b"HTTP/1.0"}


class _Handler(ResponseHandler):
    """aiohttp's client protocol, retired when bytes arrive while it waits in the pool
    (aiohttp would parse them and hand them to the next request as its answer)."""

    idle = False

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


# aiohttp's exceptions, the more specific first, and the httpx exception each one becomes.
_ERRORS: tuple[tuple[type[BaseException], Callable[[BaseException], httpx.TransportError]], ...] = (
    (aiohttp.SocketTimeoutError, lambda e: httpx.ReadTimeout("timed out reading")),
    (aiohttp.ClientConnectorError, lambda e: httpx.ConnectError(str(e))),  # refused, DNS, ...
    (
        aiohttp.ServerDisconnectedError,
        lambda e: httpx.RemoteProtocolError("Server disconnected without sending a response."),
    ),
    (
        aiohttp.ClientPayloadError,
        lambda e: httpx.RemoteProtocolError(f"incomplete message body: {e}"),
    ),
    (HttpProcessingError, lambda e: httpx.RemoteProtocolError(f"malformed HTTP response: {e!r}")),
    (
        aiohttp.ClientConnectionResetError,
        lambda e: httpx.WriteError(f"the connection closed while the request was sent: {e}"),
    ),
    # a reset or a close mid-request (ClientOSError and the like)
    (aiohttp.ClientConnectionError, lambda e: httpx.ReadError(f"the connection broke: {e!r}")),
    (OSError, lambda e: httpx.ReadError(f"the connection broke: {e!r}")),
)
_AIOHTTP_ERRORS = (aiohttp.ClientError, HttpProcessingError, OSError)


def _error(exc: BaseException) -> httpx.TransportError:
    """The httpx exception for an aiohttp one (``agentkv._wire.http`` maps those onto agentkv's)."""
    for kind, make in _ERRORS:
        if isinstance(exc, kind):
            return make(exc)
    return httpx.TransportError(f"{exc!r}")


@functools.lru_cache(maxsize=64)
def _timeout(connect: float | None, pool: float | None) -> aiohttp.ClientTimeout:
    return aiohttp.ClientTimeout(
        # Bounds DNS and connect together; the connect alone is sock_connect, the wait for a
        # place _Connector's pool timeout.
        connect=None if connect is None or pool is None else connect + pool,
        sock_connect=connect,
    )


async def _drain(protocol: ResponseHandler, write_timeout: float | None) -> None:
    """Wait, at most ``write_timeout`` s, while the connection's send buffer is full."""
    try:
        async with asyncio.timeout(write_timeout):
            await StreamWriter(protocol, protocol._loop).drain()
    except TimeoutError:
        raise httpx.WriteTimeout("timed out writing") from None


def _head(request: httpx.Request) -> bytes:
    """The request line and headers, as httpx built them."""
    head = [request.method.encode("ascii"), b" ", request.url.raw_path, b" HTTP/1.1\r\n"]
    for name, value in request.headers.raw:
        head += (name, b": ", value, b"\r\n")
    head.append(b"\r\n")
    return b"".join(head)


async def _send_stream(
    request: httpx.Request, protocol: ResponseHandler, write_timeout: float | None
) -> None:
    """Write a request whose body is a stream (chunked unless httpx gave it a length)."""
    chunked = request.headers.get("transfer-encoding", "").lower() == "chunked"
    assert isinstance(request.stream, httpx.AsyncByteStream)
    async for chunk in request.stream:
        if chunk:
            if protocol.transport is None:
                raise httpx.WriteError("the server closed the connection")
            protocol.transport.write(b"%x\r\n%b\r\n" % (len(chunk), chunk) if chunked else chunk)
            await _drain(protocol, write_timeout)
    if chunked and protocol.transport is not None:
        protocol.transport.write(b"0\r\n\r\n")
    await _drain(protocol, write_timeout)


class _Body(httpx.AsyncByteStream):
    """A response body as it arrives.

    Its connection went back to the pool when the body ended; closing it before then closes
    the connection (the rest of the body is still on the wire).
    """

    def __init__(self, connection: aiohttp.connector.Connection, payload: StreamReader) -> None:
        self._connection = connection
        self._payload = payload

    async def __aiter__(self) -> AsyncIterator[bytes]:
        payload = self._payload
        try:
            while chunk := await payload.readany():
                yield chunk
        except _AIOHTTP_ERRORS as exc:
            raise _error(exc) from exc

    async def aclose(self) -> None:
        if not self._payload.is_eof():
            self._connection.close()


class ServerPools(httpx.AsyncBaseTransport):
    """An httpx transport on aiohttp's pool; ``limits`` apply to each server."""

    def __init__(self, limits: httpx.Limits) -> None:
        self._limits = limits
        self._connector: _Connector | None = None
        # aiohttp's pool hands out connections for a request; one stands for each server.
        self._servers: dict[tuple[str, int], aiohttp.ClientRequest] = {}
        self._tls: httpx.AsyncHTTPTransport | None = None
        self._closed = False

    def _server(self, host: str, port: int) -> aiohttp.ClientRequest:
        loop = asyncio.get_running_loop()
        if self._connector is None:
            self._connector = _Connector(self._limits)  # aiohttp binds it to the running loop
        server = self._servers[host, port] = aiohttp.ClientRequest(
            "GET", URL.build(scheme="http", host=host, port=port), loop=loop
        )
        return server

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
        return await self._exchange(request, url.host, url.port or 80)

    async def _exchange(self, request: httpx.Request, host: str, port: int) -> httpx.Response:
        """Send ``request`` on a connection to ``host:port`` and return the answer's head."""
        server = self._servers.get((host, port)) or self._server(host, port)
        assert self._connector is not None
        timeout = request.extensions.get("timeout", {})
        _POOL_TIMEOUT.set(timeout.get("pool"))
        try:
            connection = await self._connector.connect(
                server, [], _timeout(timeout.get("connect"), timeout.get("pool"))
            )
        except TimeoutError as exc:
            raise httpx.ConnectTimeout(f"timed out connecting to {host}:{port}") from exc
        except _AIOHTTP_ERRORS as exc:
            raise _error(exc) from exc
        protocol = connection.protocol
        assert protocol is not None
        try:
            typing.cast(_Handler, protocol).idle = False
            protocol.set_response_params(
                skip_payload=request.method == "HEAD",
                read_until_eof=True,  # a body without a length ends with the connection
                auto_decompress=False,  # httpx decodes the body as the headers say
                read_timeout=timeout.get("read"),
            )
            transport = protocol.transport
            if transport is None:
                raise httpx.WriteError("the server closed the connection")
            try:
                transport.write(_head(request) + request.content)
            except httpx.RequestNotRead:
                transport.write(_head(request))
                await _send_stream(request, protocol, timeout.get("write"))
            if protocol.writing_paused:
                await _drain(protocol, timeout.get("write"))
            protocol.start_timeout()  # the read timeout, from here on
            while True:
                message, payload = await protocol.read()
                if not 100 <= message.code < 200:
                    break
                if message.code == 101:
                    raise httpx.RemoteProtocolError("the server switched protocols")
                # An interim answer (100 Continue, 103 Early Hints): the real one follows.
        except BaseException as exc:
            connection.close()
            if isinstance(exc, _AIOHTTP_ERRORS):
                raise _error(exc) from exc
            raise
        payload.on_eof(connection.release)  # the whole body is here: reuse the connection
        return httpx.Response(
            message.code,
            headers=list(message.raw_headers),
            stream=_Body(connection, payload),
            extensions={
                "http_version": _HTTP_VERSIONS.get(message.version, b"HTTP/1.1"),
                "reason_phrase": message.reason.encode("latin-1", "replace"),
            },
        )

    async def aclose(self) -> None:
        self._closed = True
        connector, self._connector = self._connector, None
        if connector is not None:
            await connector.close()
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
