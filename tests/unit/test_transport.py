"""The cluster's default transport (httpx2 on aiohttp's public client) against real sockets on
127.0.0.1: limits, keep-alive, timeouts, errors, streaming.

Each test's server speaks raw bytes, so the cases a real server rarely shows on demand (a close
before answering or mid-body, a body ended by the close, an interim 100, garbage, a stall, a
stray answer) are exact.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import httpx2
import pytest

from agentkv import AsyncCluster
from agentkv._exceptions import (
    ConnectError,
    ConnectionLostError,
    NoHealthyPairError,
    RequestTimeoutError,
    TransportError,
)
from agentkv._wire.http import exchange, post_json, stream_events
from agentkv._wire.transport import ClusterClient, ServerPools

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
"""Serves one connection."""
LIMITS = httpx2.Limits(max_connections=8, max_keepalive_connections=8, keepalive_expiry=30.0)


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """One request: (head, body), the body de-chunked when it came chunked."""
    head = await reader.readuntil(b"\r\n\r\n")
    fields = {}
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        fields[name.strip().lower()] = value.strip()
    if fields.get(b"transfer-encoding") == b"chunked":
        body = b""
        while True:
            size = int((await reader.readuntil(b"\r\n")).strip(), 16)
            body += (await reader.readexactly(size + 2))[:-2]
            if size == 0:
                return head, body
    return head, await reader.readexactly(int(fields.get(b"content-length", b"0")))


def ok(body: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%b" % (len(body), body)


class Scripted:
    """A server whose first connection runs ``first`` and later ones ``then``; counts them."""

    def __init__(self, first: Handler, then: Handler | None = None) -> None:
        self.first = first
        self.then = then or first
        self.connections = 0
        self._server: asyncio.Server | None = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await (self.first if self.connections == 1 else self.then)(reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    @property
    def port(self) -> int:
        assert self._server is not None
        return int(self._server.sockets[0].getsockname()[1])

    async def __aenter__(self) -> str:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.port}"

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()


@pytest.fixture(params=[httpx2.AsyncClient, ClusterClient], ids=["httpx2", "cluster"])
async def client(request: pytest.FixtureRequest) -> AsyncIterator[httpx2.AsyncClient]:
    """Either client on the default transport: ``post_json`` on the cluster's own client takes
    ``ServerPools.post`` (no httpx2 request or response), on another client httpx2's path."""
    async with request.param(transport=ServerPools(LIMITS), timeout=5.0) as c:
        yield c


async def keep_alive(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Echo each request's body back, on one connection for as long as the client keeps it."""
    while True:
        _, body = await read_request(reader)
        writer.write(ok(body))
        await writer.drain()


async def answer_port(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Answer each request with the server's port and the connection's request count."""
    port = writer.get_extra_info("sockname")[1]
    n = 0
    while True:
        await read_request(reader)
        n += 1
        body = b'{"port": %d, "n": %d}' % (port, n)
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%b" % (len(body), body)
        )
        await writer.drain()


async def held(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Answer the head and half the body, then wait: the connection stays busy."""
    await read_request(reader)
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nhalf")
    await writer.drain()
    await asyncio.sleep(10)


# --- pools, limits, reuse ----------------------------------------------------------------------


async def test_each_server_gets_its_own_pool_and_connections_are_reused(
    client: httpx2.AsyncClient,
) -> None:
    a, b = Scripted(answer_port), Scripted(answer_port)
    async with a as url_a, b as url_b:
        for n in (1, 2, 3):
            for server, url in ((a, url_a), (b, url_b)):
                data = await post_json(client, url + "/x", b"{}", summary="t")
                assert data == {"port": server.port, "n": n}
    assert (a.connections, b.connections) == (1, 1)


async def test_limits_apply_to_each_server_not_to_all() -> None:
    """With one connection allowed, a busy server does not hold up a request to another."""
    limits = httpx2.Limits(max_connections=1, max_keepalive_connections=1)
    async with (
        Scripted(held) as busy,
        Scripted(keep_alive) as free,
        httpx2.AsyncClient(
            transport=ServerPools(limits), timeout=httpx2.Timeout(5.0, pool=0.2)
        ) as client,
        client.stream("POST", busy + "/x", content=b"{}"),
    ):
        assert (await client.post(free + "/x", content=b"other")).content == b"other"
        with pytest.raises(httpx2.PoolTimeout):
            await client.post(busy + "/x", content=b"same")


async def test_a_connection_the_server_closed_while_idle_is_not_reused(
    client: httpx2.AsyncClient,
) -> None:
    async def answer_then_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # Close while the client keeps the connection as idle: what a server's keep-alive
        # timeout does between an agent's turns.
        _, body = await read_request(reader)
        writer.write(ok(body))
        await writer.drain()
        await asyncio.sleep(0.05)

    server = Scripted(answer_then_close)
    async with server as url:
        for n in (b"1", b"2", b"3"):
            await asyncio.sleep(0.2)  # the server has closed the idle connection by now
            assert (await client.post(url + "/x", content=n)).content == n
    assert server.connections == 3


async def test_concurrent_requests_open_parallel_connections_within_the_limit() -> None:
    async def slow_echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            _, body = await read_request(reader)
            await asyncio.sleep(0.02)
            writer.write(ok(body))
            await writer.drain()

    server = Scripted(slow_echo)
    limits = httpx2.Limits(max_connections=2, max_keepalive_connections=2)
    async with server as url, httpx2.AsyncClient(transport=ServerPools(limits)) as client:
        answers = await asyncio.gather(
            *(client.post(url + "/x", content=b"%d" % i) for i in range(10))
        )
    assert [a.content for a in answers] == [b"%d" % i for i in range(10)]
    assert server.connections == 2


async def test_idle_connections_are_kept_up_to_the_limit_and_reused() -> None:
    """A burst opens up to max_connections; the next burst reuses them all (aiohttp has no cap
    on idle connections below the limit: keepalive_expiry closes them)."""

    async def slow_echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            _, body = await read_request(reader)
            await asyncio.sleep(0.05)  # long enough that three requests need three connections
            writer.write(ok(body))
            await writer.drain()

    server = Scripted(slow_echo)
    limits = httpx2.Limits(max_connections=3, max_keepalive_connections=1)
    async with server as url, httpx2.AsyncClient(transport=ServerPools(limits)) as client:
        for _ in range(2):
            await asyncio.gather(*(client.post(url + "/x", content=b"x") for _ in range(4)))
    assert server.connections == 3


async def test_a_cancelled_request_frees_its_place_under_the_limit() -> None:
    async def stall(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await asyncio.sleep(10)

    limits = httpx2.Limits(max_connections=1, max_keepalive_connections=1)
    async with (
        Scripted(stall, keep_alive) as url,
        httpx2.AsyncClient(transport=ServerPools(limits), timeout=5.0) as client,
    ):
        stuck = asyncio.create_task(client.post(url + "/x", content=b"1"))
        await asyncio.sleep(0.1)
        stuck.cancel()
        with pytest.raises(asyncio.CancelledError):
            await stuck
        response = await client.post(url + "/x", content=b"2")
        assert response.content == b"2"


async def test_waiting_for_a_connection_past_the_pool_timeout_fails() -> None:
    async with (
        Scripted(held, keep_alive) as url,
        httpx2.AsyncClient(
            transport=ServerPools(httpx2.Limits(max_connections=1)),
            timeout=httpx2.Timeout(5.0, pool=0.1),
        ) as client,
    ):
        async with client.stream("POST", url + "/x", content=b"held"):
            with pytest.raises(httpx2.PoolTimeout):
                await client.post(url + "/x", content=b"waits")
        response = await client.post(url + "/x", content=b"now")  # the place is free again
        assert response.content == b"now"


async def test_an_idle_connection_past_its_keepalive_expiry_is_not_reused() -> None:
    server = Scripted(keep_alive)
    limits = httpx2.Limits(max_keepalive_connections=4, keepalive_expiry=0.1)
    async with server as url, httpx2.AsyncClient(transport=ServerPools(limits)) as client:
        await client.post(url + "/x", content=b"1")
        await client.post(url + "/x", content=b"2")  # reused: within the expiry
        await asyncio.sleep(0.2)
        await client.post(url + "/x", content=b"3")
    assert server.connections == 2


async def test_stray_bytes_after_an_answer_do_not_reach_the_next_request(
    client: httpx2.AsyncClient,
) -> None:
    async def chatty(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(ok(b"1") + b"HTTP/1.1 200 OK\r\n")  # a stray second answer begins
        await writer.drain()
        await keep_alive(reader, writer)

    async with Scripted(chatty, keep_alive) as url:
        assert (await client.post(url + "/x", content=b"")).content == b"1"
        await asyncio.sleep(0.05)
        assert (await client.post(url + "/x", content=b"2")).content == b"2"


async def test_a_closed_transport_opens_no_connection() -> None:
    server = Scripted(keep_alive)
    async with server as url:
        transport = ServerPools(LIMITS)
        await transport.aclose()
        request = httpx2.Request("POST", url + "/x", content=b"{}")
        with pytest.raises(httpx2.ConnectError, match="closed"):
            await transport.handle_async_request(request)
    assert server.connections == 0


# --- bodies ------------------------------------------------------------------------------------


async def test_a_streamed_response_arrives_piece_by_piece(client: httpx2.AsyncClient) -> None:
    """Each server-sent event reaches the reader before the server has sent the next."""
    sent = asyncio.Event()

    async def sse(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for event in (b'data: {"n": 1}\n\n', b'data: {"n": 2}\n\n', b"data: [DONE]\n\n"):
            writer.write(b"%x\r\n%b\r\n" % (len(event), event))
            await writer.drain()
            await sent.wait()  # the client has read this one
            sent.clear()
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    async with Scripted(sse) as url:
        seen = []
        async for data in stream_events(client, url + "/v1", b"{}", summary="t"):
            seen.append(data["n"])
            sent.set()
    assert seen == [1, 2]


async def test_a_body_larger_than_the_read_buffer_arrives_whole_to_a_slow_reader(
    client: httpx2.AsyncClient,
) -> None:
    """Reading pauses while the reader is behind, and resumes as it drains."""
    body = bytes(range(256)) * (3 * 4096)  # 3 MiB

    async def big(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(ok(body))
        await writer.drain()
        await keep_alive(reader, writer)

    server = Scripted(big)
    async with server as url:
        async with client.stream("POST", url + "/x", content=b"{}") as response:
            received = b""
            async for part in response.aiter_raw():
                received += part
                await asyncio.sleep(0.01)
        assert received == body
        assert (await client.post(url + "/x", content=b"next")).content == b"next"
    assert server.connections == 1


async def test_a_body_ended_by_the_servers_close_is_whole_and_not_reused(
    client: httpx2.AsyncClient,
) -> None:
    async def until_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b'HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\r\n{"a": ')
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(b"1}")

    server = Scripted(until_close)
    async with server as url:
        for _ in range(2):
            assert await post_json(client, url + "/x", b"{}", summary="t") == {"a": 1}
    assert server.connections == 2


async def test_closing_a_stream_early_does_not_reuse_its_connection(
    client: httpx2.AsyncClient,
) -> None:
    """A half-read response leaves bytes on the wire: the next request gets a new connection."""

    async def long_then_echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2000000\r\n\r\n" + b"x" * 1000)
        await writer.drain()
        await keep_alive(reader, writer)

    server = Scripted(long_then_echo, keep_alive)
    async with server as url:
        async with client.stream("POST", url + "/x", content=b"{}") as response:
            async for _ in response.aiter_raw():
                break
        response = await client.post(url + "/x", content=b"again")
        assert response.status_code == 200
    assert server.connections == 2


async def test_closing_a_stream_early_frees_its_place_under_the_limit() -> None:
    """An abandoned stream (an agent stopping a streamed turn) does not hold a connection."""
    limits = httpx2.Limits(max_connections=1, max_keepalive_connections=1)
    async with (
        Scripted(held, keep_alive) as url,
        httpx2.AsyncClient(
            transport=ServerPools(limits), timeout=httpx2.Timeout(5.0, pool=0.5)
        ) as client,
    ):
        async with client.stream("POST", url + "/x", content=b"{}") as response:
            async for _ in response.aiter_raw():
                break
        assert (await client.post(url + "/x", content=b"next")).content == b"next"


async def test_an_interim_100_is_skipped(client: httpx2.AsyncClient) -> None:
    async def interim(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await read_request(reader)
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n" + ok(b'{"ok": true}'))
            await writer.drain()

    server = Scripted(interim)
    async with server as url:
        for _ in range(2):
            assert await post_json(client, url + "/x", b"{}", summary="t") == {"ok": True}
    assert server.connections == 1


async def test_a_head_answer_ends_at_its_headers(client: httpx2.AsyncClient) -> None:
    async def head(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 1234\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(5)

    async with Scripted(head) as url:
        response = await client.head(url + "/health")
    assert (response.status_code, response.headers["content-length"]) == (200, "1234")


async def test_a_chunked_request_body_is_framed(client: httpx2.AsyncClient) -> None:
    async def parts() -> AsyncIterator[bytes]:
        for part in (b'{"a": ', b"", b"[1, 2]", b"}"):
            yield part

    async with Scripted(keep_alive) as url:
        response = await client.post(url + "/x", content=parts())
    assert response.json() == {"a": [1, 2]}


async def test_requests_carry_httpx_headers_and_answers_keep_the_servers() -> None:
    """The request goes out with the headers httpx2 built (aiohttp adds none of its own), and
    the answer's status, reason, headers and compressed body are httpx2's to read."""
    seen: list[bytes] = []

    async def gzip_echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        import gzip

        head, _ = await read_request(reader)
        seen.append(head)
        body = gzip.compress(b'{"ok": 1}')
        writer.write(
            b"HTTP/1.1 201 Made It\r\ncontent-encoding: gzip\r\nx-request-id: r1\r\n"
            b"content-length: %d\r\n\r\n%b" % (len(body), body)
        )
        await writer.drain()

    async with (
        Scripted(gzip_echo) as url,
        ClusterClient(transport=ServerPools(LIMITS), headers={"x-agent": "a1"}) as client,
    ):
        response = await client.post(url + "/v1/x?q=1", content=b"{}")
    assert (response.status_code, response.reason_phrase) == (201, "Made It")
    assert response.headers["x-request-id"] == "r1"
    assert response.json() == {"ok": 1}
    lines = seen[0].decode().split("\r\n")
    assert lines[0] == "POST /v1/x?q=1 HTTP/1.1"
    sent = {line.partition(":")[0].lower() for line in lines[1:] if line}
    assert sent == {
        "host",
        "accept",
        "accept-encoding",
        "connection",
        "user-agent",
        "content-length",
        "x-agent",
    }
    assert "user-agent: python-httpx2/" in seen[0].decode().lower()


# --- errors ------------------------------------------------------------------------------------


async def test_a_server_closing_mid_body_is_a_lost_connection(client: httpx2.AsyncClient) -> None:
    async def short(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n{partial")

    async with Scripted(short) as url:
        with pytest.raises(ConnectionLostError, match="complete message body"):
            await post_json(client, url + "/x", b"{}", summary="t")


async def test_a_server_closing_before_answering_is_a_lost_connection_not_a_connect_error(
    client: httpx2.AsyncClient,
) -> None:
    """It connected, so the server is up: a connect error would mark a live pair down."""

    async def mute(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)

    async with Scripted(mute) as url:
        with pytest.raises(ConnectionLostError, match="without sending a response") as caught:
            await post_json(client, url + "/x", b"{}", summary="t")
    assert isinstance(caught.value.__cause__, httpx2.RemoteProtocolError)
    assert not isinstance(caught.value.__cause__, httpx2.ConnectError)


async def test_a_reset_mid_request_is_a_lost_connection(client: httpx2.AsyncClient) -> None:
    async def reset(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()  # RST, not FIN

    async with Scripted(reset) as url:
        with pytest.raises(ConnectionLostError) as caught:
            await post_json(client, url + "/x", b"{}", summary="t")
    assert isinstance(caught.value.__cause__, httpx2.ReadError | httpx2.RemoteProtocolError)


async def test_a_post_whose_connection_is_lost_is_never_sent_again() -> None:
    """A lease call or a turn's leg (POST) is sent once; aiohttp re-sends an idempotent request
    (a GET probe) once when its connection is lost, as RFC 9112 allows."""
    requests = 0

    async def mute(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal requests
        await read_request(reader)
        requests += 1

    async with Scripted(mute) as url, ClusterClient(transport=ServerPools(LIMITS)) as client:
        with pytest.raises(ConnectionLostError):
            await exchange(client, "POST", url + "/lease", body=b"{}", timeout_s=5.0)
        assert requests == 1
        with pytest.raises(ConnectionLostError):
            await exchange(client, "GET", url + "/info", timeout_s=5.0)
        assert requests == 3


async def test_an_answer_that_is_not_http_is_a_protocol_error(client: httpx2.AsyncClient) -> None:
    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"SSH-2.0-OpenSSH_9.6\r\n\r\n")
        await asyncio.sleep(1)

    async with Scripted(garbage) as url:
        with pytest.raises(httpx2.RemoteProtocolError, match="malformed"):
            await client.post(url + "/x", content=b"{}")


async def test_a_switch_of_protocols_is_a_protocol_error(client: httpx2.AsyncClient) -> None:
    async def upgrade(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(
            b"HTTP/1.1 101 Switching Protocols\r\nconnection: upgrade\r\nupgrade: h2c\r\n\r\n"
        )
        await asyncio.sleep(1)

    async with Scripted(upgrade) as url:
        with pytest.raises(httpx2.RemoteProtocolError, match="switched protocols"):
            await client.post(url + "/x", content=b"{}")


async def test_a_stalled_answer_times_out_on_the_read_timeout() -> None:
    async def stall(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await asyncio.sleep(5)

    async with (
        Scripted(stall) as url,
        httpx2.AsyncClient(transport=ServerPools(LIMITS), timeout=0.2) as client,
    ):
        with pytest.raises(RequestTimeoutError) as caught:
            await post_json(client, url + "/x", b"{}", summary="t")
    assert isinstance(caught.value.__cause__, httpx2.ReadTimeout)


async def test_a_stream_that_stalls_mid_body_times_out_on_the_read_timeout() -> None:
    async def stall(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\ndata:\r\n")
        await writer.drain()
        await asyncio.sleep(5)

    async with (
        Scripted(stall) as url,
        httpx2.AsyncClient(transport=ServerPools(LIMITS), timeout=0.2) as client,
        client.stream("POST", url + "/x", content=b"{}") as response,
    ):
        with pytest.raises(httpx2.ReadTimeout):
            async for _ in response.aiter_raw():
                pass


async def test_a_body_the_server_does_not_read_times_out_on_the_write_timeout() -> None:
    async def deaf(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(5)

    async with (
        Scripted(deaf) as url,
        httpx2.AsyncClient(
            transport=ServerPools(LIMITS), timeout=httpx2.Timeout(5.0, write=0.2)
        ) as client,
    ):
        started = time.monotonic()
        with pytest.raises(httpx2.WriteTimeout):
            await client.post(url + "/x", content=b"x" * (64 << 20))
    assert time.monotonic() - started < 2.0


@pytest.fixture
def full_backlog() -> Iterator[int]:
    """A port whose listen queue is full: a new connection hangs in SYN-SENT."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers = []
    for _ in range(4):
        filler = socket.socket()
        filler.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            filler.connect(("127.0.0.1", port))
        fillers.append(filler)
    yield port
    for sock in (*fillers, listener):
        sock.close()


async def test_a_connect_that_hangs_times_out_on_the_connect_timeout(full_backlog: int) -> None:
    async with httpx2.AsyncClient(
        transport=ServerPools(LIMITS), timeout=httpx2.Timeout(5.0, connect=0.2)
    ) as client:
        started = time.monotonic()
        with pytest.raises(ConnectError, match="cannot connect") as caught:
            await post_json(client, f"http://127.0.0.1:{full_backlog}/x", b"{}", summary="t")
    assert isinstance(caught.value.__cause__, httpx2.ConnectTimeout)
    assert time.monotonic() - started < 2.0  # the connect timeout's, not the pool's or read's


async def test_a_refused_connection_is_agentkvs_connect_error() -> None:
    server = Scripted(keep_alive)
    async with server as url:
        pass  # the port is now closed
    async with httpx2.AsyncClient(transport=ServerPools(LIMITS)) as client:
        with pytest.raises(ConnectError, match="cannot connect") as caught:
            await post_json(client, url + "/x", b"{}", summary="t")
    assert type(caught.value.__cause__) is httpx2.ConnectError


async def test_an_unknown_host_is_agentkvs_connect_error(client: httpx2.AsyncClient) -> None:
    with pytest.raises(ConnectError, match="cannot connect"):
        await post_json(client, "http://no-such-host.invalid/x", b"{}", summary="t")


async def test_an_unsupported_scheme_is_refused(client: httpx2.AsyncClient) -> None:
    with pytest.raises(httpx2.UnsupportedProtocol):
        await client.post("ftp://127.0.0.1/x", content=b"")


async def test_a_lost_connection_does_not_mark_a_live_pair_down() -> None:
    """The server accepted the connection and dropped it: the turn fails, the pair stays up;
    a server that refuses connections is marked down (what the first half would miss)."""

    async def healthy_but_mute(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:  # answers the health probe, drops every other request
            head, _ = await read_request(reader)
            if not head.startswith(b"GET /health "):
                return
            writer.write(ok(b""))
            await writer.drain()

    async with Scripted(healthy_but_mute) as url:
        spec = {"model": "m", "pairs": [{"name": "p", "prefill": url, "decode": url}]}
        async with AsyncCluster.from_dict(spec, block_size=16) as cluster:
            async with cluster.session(max_tokens=4) as session:
                with pytest.raises(TransportError):
                    await session.send("hi")
            assert cluster.is_healthy("p")
    async with AsyncCluster.from_dict(spec, block_size=16) as cluster:
        async with cluster.session(max_tokens=4) as session:
            with pytest.raises(NoHealthyPairError):
                await session.send("hi")
        assert not cluster.is_healthy("p")


# --- the client a cluster builds ---------------------------------------------------------------


async def test_a_cluster_uses_its_client_on_per_server_pools_by_default() -> None:
    spec = {"model": "m", "pairs": [{"name": "p", "prefill": "http://a:1", "decode": "http://a:2"}]}
    async with AsyncCluster.from_dict(spec) as cluster:
        assert isinstance(cluster.http_client, ClusterClient)
        assert isinstance(cluster.http_client._transport, ServerPools)
    given = httpx2.AsyncClient()
    async with AsyncCluster.from_dict(spec, http_client=given) as cluster:
        assert cluster.http_client is given  # a caller's client (auth, proxies, hooks) is kept
    await given.aclose()


async def test_the_cluster_client_reads_closes_and_reuses_like_httpx() -> None:
    server = Scripted(answer_port)
    async with (
        server as url,
        ClusterClient(transport=ServerPools(LIMITS), base_url=url) as client,
    ):
        first = await client.post("/x", content=b"{}")
        assert first.is_closed
        assert first.json() == {"port": server.port, "n": 1}
        assert first.request.url == url + "/x"
        async with client.stream("POST", "/x", content=b"{}") as streamed:
            assert b"".join([part async for part in streamed.aiter_bytes()]) == (
                b'{"port": %d, "n": 2}' % server.port
            )
        assert (await client.get("/x")).json()["n"] == 3
    assert server.connections == 1  # each answer handed its connection back
    with pytest.raises(RuntimeError, match="closed"):
        await client.post("/x", content=b"{}")


async def test_the_cluster_client_refuses_auth_it_would_not_apply() -> None:
    async with (
        Scripted(keep_alive) as url,
        ClusterClient(transport=ServerPools(LIMITS)) as client,
    ):
        with pytest.raises(TypeError, match="without auth"):
            await client.get(url + "/x", auth=("user", "secret"))
