"""The cluster's default transport (one pool per server) against real sockets on 127.0.0.1."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx
import pytest

from agentkv import AsyncCluster
from agentkv._exceptions import ConnectError
from agentkv._transport import ClusterClient, ServerPools
from agentkv._wire.http import post_json

LIMITS = httpx.Limits(max_connections=8, max_keepalive_connections=8, keepalive_expiry=30.0)


@dataclass
class TinyServer:
    """HTTP/1.1 keep-alive server: answers every request with its own port and a counter."""

    close_after_each: bool = False
    connections: int = 0
    requests: int = 0
    port: int = 0
    _server: asyncio.Server | None = field(default=None, repr=False)

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.decode().split("\r\n"):
                    name, _, value = line.partition(":")
                    if name.lower() == "content-length":
                        length = int(value)
                await reader.readexactly(length)
                self.requests += 1
                body = f'{{"port": {self.port}, "n": {self.requests}}}'.encode()
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                    + f"content-length: {len(body)}\r\n\r\n".encode()
                    + body
                )
                await writer.drain()
                if self.close_after_each:
                    # Close while the client keeps the connection as idle: what a server's
                    # keep-alive timeout does between an agent's turns.
                    await asyncio.sleep(0.05)
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


@pytest.fixture
async def servers() -> AsyncIterator[tuple[TinyServer, TinyServer]]:
    a, b = TinyServer(), TinyServer()
    await a.start()
    await b.start()
    yield a, b
    await a.stop()
    await b.stop()


async def test_each_server_gets_its_own_pool_and_connections_are_reused(
    servers: tuple[TinyServer, TinyServer],
) -> None:
    a, b = servers
    transport = ServerPools(LIMITS)
    async with httpx.AsyncClient(transport=transport) as client:
        for _ in range(3):
            for server in (a, b):
                data = await post_json(client, server.url + "/x", b"{}", summary="t")
                assert data["port"] == server.port
        assert transport.servers == 2
    assert (a.connections, a.requests, b.connections, b.requests) == (1, 3, 1, 3)


async def test_a_connection_the_server_closed_while_idle_is_not_reused(
    servers: tuple[TinyServer, TinyServer],
) -> None:
    a, _ = servers
    a.close_after_each = True
    async with httpx.AsyncClient(transport=ServerPools(LIMITS)) as client:
        for expected in (1, 2, 3):
            await asyncio.sleep(0.2)  # the server has closed the idle connection by now
            data = await post_json(client, a.url + "/x", b"{}", summary="t")
            assert data["n"] == expected
    assert a.connections == 3


async def test_concurrent_requests_open_parallel_connections_within_the_limit(
    servers: tuple[TinyServer, TinyServer],
) -> None:
    a, _ = servers
    limits = httpx.Limits(max_connections=2, max_keepalive_connections=2)
    async with httpx.AsyncClient(transport=ServerPools(limits)) as client:
        await asyncio.gather(
            *(post_json(client, a.url + "/x", b"{}", summary="t") for _ in range(10))
        )
    assert a.requests == 10
    assert a.connections <= 2


async def test_a_refused_connection_is_agentkvs_connect_error() -> None:
    server = TinyServer()
    await server.start()
    await server.stop()  # the port is now closed
    async with httpx.AsyncClient(transport=ServerPools(LIMITS)) as client:
        with pytest.raises(ConnectError, match="cannot connect"):
            await post_json(client, server.url + "/x", b"{}", summary="t")


async def test_a_closed_transport_opens_no_new_pool(servers: tuple[TinyServer, TinyServer]) -> None:
    a, _ = servers
    transport = ServerPools(LIMITS)
    await transport.aclose()
    request = httpx.Request("POST", a.url + "/x", content=b"{}")
    with pytest.raises(httpx.ConnectError, match="closed"):
        await transport.handle_async_request(request)
    assert a.connections == 0


async def test_a_cluster_uses_its_client_on_per_server_pools_by_default() -> None:
    spec = {"model": "m", "pairs": [{"name": "p", "prefill": "http://a:1", "decode": "http://a:2"}]}
    async with AsyncCluster.from_dict(spec) as cluster:
        assert isinstance(cluster.http_client, ClusterClient)
        assert isinstance(cluster.http_client._transport, ServerPools)
    given = httpx.AsyncClient()
    async with AsyncCluster.from_dict(spec, http_client=given) as cluster:
        assert cluster.http_client is given  # a caller's client (auth, proxies, hooks) is kept
    await given.aclose()


async def test_the_cluster_client_reads_closes_and_reuses_like_httpx(
    servers: tuple[TinyServer, TinyServer],
) -> None:
    a, _ = servers
    async with ClusterClient(transport=ServerPools(LIMITS), base_url=a.url) as client:
        first = await client.post("/x", content=b"{}")
        assert first.is_closed
        assert first.json() == {"port": a.port, "n": 1}
        assert first.request.url == a.url + "/x"
        async with client.stream("POST", "/x", content=b"{}") as streamed:
            assert b"".join([part async for part in streamed.aiter_bytes()]) == (
                f'{{"port": {a.port}, "n": 2}}'.encode()
            )
        assert (await client.get("/x")).json()["n"] == 3
    assert a.connections == 1  # each answer handed its connection back
    with pytest.raises(RuntimeError, match="closed"):
        await client.post("/x", content=b"{}")


async def test_the_cluster_client_refuses_auth_it_would_not_apply(
    servers: tuple[TinyServer, TinyServer],
) -> None:
    a, _ = servers
    async with ClusterClient(transport=ServerPools(LIMITS)) as client:
        with pytest.raises(TypeError, match="without auth"):
            await client.get(a.url + "/x", auth=("user", "secret"))
