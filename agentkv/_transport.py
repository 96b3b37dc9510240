"""The default HTTP transport of a cluster: HTTP/1.1 on asyncio, an idle list per server.

The SDK's traffic is many small requests to a handful of servers: each turn sends a tokenize
request, a P leg and a D leg. httpcore's connection pool (httpx's default) walks every connection
of the pool and asks each idle one whether its socket was closed, on every request start and
close; with anyio's locks and the pure-Python h11 parser around each exchange, that was ~6 ms of
CPU per request at 64 concurrent sessions on the 2-core machine, and the proxy's event loop
saturated (``docs/proxy.md``). Here:

* each server (host, port) has its own pool: a LIFO list of idle connections, so taking one is a
  pop, and a count of open ones held under ``httpx.Limits`` (which apply per server);
* a connection is an asyncio protocol (``agentkv._http11``): the loop reports the server's close
  of an idle connection, so nothing is polled, and llhttp parses the response in C.

httpx semantics otherwise: its ``Timeout`` (connect, read, write, pool) and its exceptions. A
request is never re-sent; like httpcore, a connection the server closes just as a request goes
out fails that request (``DEFAULT_LIMITS`` keeps idle connections for less than vLLM's keep-alive
so this does not happen). ``https`` URLs go to httpx's own transport; HTTP(S)_PROXY variables
are not used (the servers are the cluster's own): pass ``http_client=`` to a cluster for that.
"""

# httpx's timeouts are per phase (connect, write, read, pool); each is applied where that phase
# waits, so these functions take the phase's timeout.
# ruff: noqa: ASYNC109

from __future__ import annotations

import asyncio
import math
import typing
from collections import deque
from collections.abc import AsyncIterator

import httpx

from agentkv._http11 import Connection, Exchange, wait_for

__all__ = ["ClusterClient", "ServerPools"]


class _Body(httpx.AsyncByteStream):
    """A response body; closing it hands the connection back to its pool."""

    def __init__(
        self, pool: _Pool, connection: Connection, exchange: Exchange, timeout: float | None
    ) -> None:
        self._pool = pool
        self._connection = connection
        self._exchange = exchange
        self._timeout = timeout
        self._closed = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self._exchange.chunks(self._timeout):
            yield chunk

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            self._pool.release(self._connection, self._exchange)


class _Pool:
    """The connections to one server."""

    def __init__(self, host: str, port: int, limits: httpx.Limits) -> None:
        self._host = host
        self._port = port
        self._max_open = math.inf if limits.max_connections is None else limits.max_connections
        self._max_idle = (
            math.inf
            if limits.max_keepalive_connections is None
            else limits.max_keepalive_connections
        )
        self._expiry = math.inf if limits.keepalive_expiry is None else limits.keepalive_expiry
        self._idle: list[Connection] = []  # most recently used last
        self._open: set[Connection] = set()
        self._opening = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._closed = False

    async def handle(self, request: httpx.Request) -> httpx.Response:
        timeout = request.extensions.get("timeout", {})
        connection = await self._acquire(timeout.get("pool"), timeout.get("connect"))
        try:
            exchange = await connection.send(request, write_timeout=timeout.get("write"))
            await exchange.head(timeout.get("read"))
        except BaseException:
            self.discard(connection)
            raise
        return httpx.Response(
            exchange.status,
            headers=exchange.headers,
            stream=_Body(self, connection, exchange, timeout.get("read")),
            extensions={"http_version": b"HTTP/1.1", "reason_phrase": exchange.reason},
        )

    async def _acquire(
        self, pool_timeout: float | None, connect_timeout: float | None
    ) -> Connection:
        loop = asyncio.get_running_loop()
        deadline = None if pool_timeout is None else loop.time() + pool_timeout
        while True:
            if self._closed:
                raise httpx.ConnectError("the transport is closed")
            now = loop.time()
            while self._idle:
                connection = self._idle.pop()
                if connection.usable and now < connection.expires_at:
                    return connection
                self.discard(connection)
            if len(self._open) + self._opening < self._max_open:
                break
            waiter = loop.create_future()
            self._waiters.append(waiter)
            left = None if deadline is None else max(0.0, deadline - now)
            try:
                await wait_for(
                    waiter, left, lambda: httpx.PoolTimeout("timed out waiting for a connection")
                )
            except BaseException:
                if waiter.done() and not waiter.cancelled():
                    self._wake_one()  # pass on the wake-up this caller will not use
                raise
            finally:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
        self._opening += 1
        try:
            connection = await self._connect(connect_timeout)
        except BaseException:
            self._wake_one()  # the place it held is free again (refused, timed out, cancelled)
            raise
        finally:
            self._opening -= 1
        if self._closed:
            connection.close()
            raise httpx.ConnectError("the transport is closed")
        self._open.add(connection)
        return connection

    async def _connect(self, timeout: float | None) -> Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout):
                _, connection = await loop.create_connection(Connection, self._host, self._port)
        except TimeoutError as exc:
            where = f"{self._host}:{self._port}"
            raise httpx.ConnectTimeout(f"timed out connecting to {where}") from exc
        except OSError as exc:
            raise httpx.ConnectError(str(exc)) from exc
        connection.on_lost = self._lost
        return connection

    def release(self, connection: Connection, exchange: Exchange) -> None:
        """Keep ``connection`` for the next request if its exchange ended cleanly."""
        if (
            connection.reusable(exchange)
            and not self._closed
            and connection in self._open
            and len(self._idle) < self._max_idle
        ):
            connection.expires_at = asyncio.get_running_loop().time() + self._expiry
            self._idle.append(connection)
            self._wake_one()
        else:
            self.discard(connection)

    def discard(self, connection: Connection) -> None:
        """Close ``connection`` and free its place under the limit."""
        connection.close()
        self._forget(connection)

    def _lost(self, connection: Connection) -> None:
        if connection in self._idle:
            self._idle.remove(connection)
        self._forget(connection)

    def _forget(self, connection: Connection) -> None:
        if connection in self._open:
            self._open.discard(connection)
            self._wake_one()

    def _wake_one(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def close(self) -> None:
        self._closed = True
        self._idle.clear()
        for connection in list(self._open):
            connection.close()
        self._open.clear()
        while self._waiters:
            self._wake_one()


class ServerPools(httpx.AsyncBaseTransport):
    """An httpx transport with one connection pool per server; ``limits`` apply to each."""

    def __init__(self, limits: httpx.Limits) -> None:
        self._limits = limits
        self._pools: dict[tuple[str, int], _Pool] = {}
        self._tls: httpx.AsyncHTTPTransport | None = None
        self._closed = False

    @property
    def servers(self) -> int:
        """How many servers have a pool (one per host and port seen over plain HTTP)."""
        return len(self._pools)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if self._closed:
            raise httpx.ConnectError("the transport is closed", request=request)
        url = request.url
        if url.scheme == "http":
            key = (url.host, url.port or 80)
            pool = self._pools.get(key)
            if pool is None:
                pool = self._pools[key] = _Pool(*key, self._limits)
            return await pool.handle(request)
        if url.scheme == "https":
            if self._tls is None:
                self._tls = httpx.AsyncHTTPTransport(limits=self._limits, trust_env=False)
            return await self._tls.handle_async_request(request)
        raise httpx.UnsupportedProtocol(
            f"Request URL has an unsupported protocol '{url.scheme}://'.", request=request
        )

    async def aclose(self) -> None:
        self._closed = True
        pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            pool.close()
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
