"""The default HTTP transport of a cluster: one connection pool per server, with a cheap idle check.

httpcore's connection pool, each time a request starts and each time a response is closed, walks
all of its connections and asks every idle one whether its socket is readable (that is, closed by
the server). Two costs made that the largest part of the SDK's CPU at 64 concurrent sessions
(``benchmarks/proxy_overhead.py``):

* one pool held the connections to *every* server of the cluster, so each request paid for all of
  them; here each server (scheme, host, port) gets its own pool, so the walk is bounded by that
  server's connections;
* the check went through anyio's typed-attribute lookup, which builds a dict of callbacks on every
  call (~45 us on the 2-core machine); here the raw socket is looked up once per connection and
  polled directly.

Same httpx semantics otherwise: ``httpx.Limits`` apply per server; timeouts, errors and streaming
are httpx's own. HTTP(S)_PROXY variables are not used (the servers are the cluster's own); pass
``http_client=`` to a cluster for a client that goes through a proxy.
"""

# httpcore's network interfaces take a ``timeout`` argument; these classes implement them.
# ruff: noqa: ASYNC109

from __future__ import annotations

import select
import socket
import typing

import httpcore
import httpx

__all__ = ["ServerPools"]


def _readable(sock: socket.socket | None) -> bool:
    """True when a read would not block: data, or the server's close, is waiting."""
    fd = -1 if sock is None else sock.fileno()
    if fd < 0:
        return True  # gone: the next read returns b"", so treat it as closed
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(0))


class _Stream(httpcore.AsyncNetworkStream):
    """anyio's stream, with ``is_readable`` answered from the socket found once."""

    def __init__(self, inner: httpcore.AsyncNetworkStream) -> None:
        self._inner = inner
        self._socket: socket.socket | None = inner.get_extra_info("socket")

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return await self._inner.read(max_bytes, timeout)

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        await self._inner.write(buffer, timeout)

    async def aclose(self) -> None:
        await self._inner.aclose()

    async def start_tls(
        self,
        ssl_context: typing.Any,
        server_hostname: str | None = None,
        timeout: float | None = None,
    ) -> httpcore.AsyncNetworkStream:
        return _Stream(await self._inner.start_tls(ssl_context, server_hostname, timeout))

    def get_extra_info(self, info: str) -> typing.Any:
        if info == "is_readable":
            return _readable(self._socket)
        return self._inner.get_extra_info(info)


class _Backend(httpcore.AsyncNetworkBackend):
    def __init__(self) -> None:
        self._inner = httpcore.AnyIOBackend()

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: typing.Iterable[typing.Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        stream = await self._inner.connect_tcp(host, port, timeout, local_address, socket_options)
        return _Stream(stream)

    async def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,
        socket_options: typing.Iterable[typing.Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        return _Stream(await self._inner.connect_unix_socket(path, timeout, socket_options))

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


class _ServerPool(httpx.AsyncHTTPTransport):
    """httpx's transport for one server, on a pool with the cheap idle check."""

    def __init__(self, limits: httpx.Limits) -> None:
        super().__init__(limits=limits, trust_env=False)
        # httpx builds its pool without a way to pass a network backend; the transport's request
        # handling (mapping to httpcore, errors, streaming) only needs ``_pool`` to be a pool.
        self._pool = httpcore.AsyncConnectionPool(
            max_connections=limits.max_connections,
            max_keepalive_connections=limits.max_keepalive_connections,
            keepalive_expiry=limits.keepalive_expiry,
            network_backend=_Backend(),
        )


class ServerPools(httpx.AsyncBaseTransport):
    """An httpx transport with one connection pool per server; ``limits`` apply to each."""

    def __init__(self, limits: httpx.Limits) -> None:
        self._limits = limits
        self._pools: dict[tuple[bytes, bytes, int | None], _ServerPool] = {}
        self._closed = False

    @property
    def servers(self) -> int:
        """How many servers have a pool (one per scheme, host and port seen)."""
        return len(self._pools)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        key = (url.raw_scheme, url.raw_host, url.port)
        pool = self._pools.get(key)
        if pool is None:
            if self._closed:
                raise httpx.ConnectError("the transport is closed", request=request)
            pool = self._pools[key] = _ServerPool(self._limits)
        return await pool.handle_async_request(request)

    async def aclose(self) -> None:
        self._closed = True
        pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            await pool.aclose()
