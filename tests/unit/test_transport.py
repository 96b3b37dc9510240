"""The ``Poster``s against real sockets on 127.0.0.1: the cluster's default (``ServerPools``, on
aiohttp's public client) for limits, keep-alive, timeouts, errors and streaming, and the adapter
over a user's ``httpx2.AsyncClient`` (``HttpxPoster``) for the same answers and errors.

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
    ConfigError,
    ConnectError,
    ConnectionLostError,
    NoHealthyPairError,
    RequestTimeoutError,
    TransportError,
)
from agentkv._wire.http import HttpxPoster, exchange, post_json, stream_events
from agentkv._wire.transport import Poster, ServerPools, Streamed

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


@pytest.fixture(params=["pools", "httpx2"])
async def poster(request: pytest.FixtureRequest) -> AsyncIterator[Poster]:
    """The default poster, or a user's httpx2 client through the adapter: the same answers and
    the same agentkv errors."""
    made: Poster = (
        ServerPools(LIMITS, 5.0)
        if request.param == "pools"
        else HttpxPoster(httpx2.AsyncClient(timeout=5.0), owned=True)
    )
    try:
        yield made
    finally:
        await made.aclose()


@contextlib.asynccontextmanager
async def pools(
    limits: httpx2.Limits = LIMITS, phases: httpx2.Timeout | float = 5.0
) -> AsyncIterator[ServerPools]:
    made = ServerPools(limits, phases)
    try:
        yield made
    finally:
        await made.aclose()


async def echo(poster: Poster, url: str, body: bytes) -> bytes:
    """The body of the answer to a POST of ``body``."""
    return (await poster.post(url, body)).body


@contextlib.asynccontextmanager
async def streaming(poster: Poster, url: str, body: bytes = b"{}") -> AsyncIterator[Streamed]:
    """A POST whose answer's body arrives as it comes, closed on leaving."""
    answer = await poster.post_stream(url, body)
    async with contextlib.aclosing(answer.body):
        yield answer


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


async def test_each_server_gets_its_own_pool_and_connections_are_reused(poster: Poster) -> None:
    a, b = Scripted(answer_port), Scripted(answer_port)
    async with a as url_a, b as url_b:
        for n in (1, 2, 3):
            for server, url in ((a, url_a), (b, url_b)):
                data = await post_json(poster, url + "/x", b"{}", summary="t")
                assert data == {"port": server.port, "n": n}
    assert (a.connections, b.connections) == (1, 1)


async def test_limits_apply_to_each_server_not_to_all() -> None:
    """With one connection allowed, a busy server does not hold up a request to another."""
    limits = httpx2.Limits(max_connections=1, max_keepalive_connections=1)
    async with (
        Scripted(held) as busy,
        Scripted(keep_alive) as free,
        pools(limits, httpx2.Timeout(5.0, pool=0.2)) as poster,
        streaming(poster, busy + "/x"),
    ):
        assert await echo(poster, free + "/x", b"other") == b"other"
        with pytest.raises(RequestTimeoutError, match="waiting for a connection"):
            await poster.post(busy + "/x", b"same")


async def test_a_connection_the_server_closed_while_idle_is_not_reused(poster: Poster) -> None:
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
            assert await echo(poster, url + "/x", n) == n
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
    async with server as url, pools(limits) as poster:
        answers = await asyncio.gather(*(echo(poster, url + "/x", b"%d" % i) for i in range(10)))
    assert answers == [b"%d" % i for i in range(10)]
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
    async with server as url, pools(limits) as poster:
        for _ in range(2):
            await asyncio.gather(*(echo(poster, url + "/x", b"x") for _ in range(4)))
    assert server.connections == 3


async def test_a_cancelled_request_frees_its_place_under_the_limit() -> None:
    async def stall(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await asyncio.sleep(10)

    limits = httpx2.Limits(max_connections=1, max_keepalive_connections=1)
    async with Scripted(stall, keep_alive) as url, pools(limits) as poster:
        stuck = asyncio.create_task(poster.post(url + "/x", b"1"))
        await asyncio.sleep(0.1)
        stuck.cancel()
        with pytest.raises(asyncio.CancelledError):
            await stuck
        assert await echo(poster, url + "/x", b"2") == b"2"


async def test_waiting_for_a_connection_past_the_pool_timeout_fails() -> None:
    async with (
        Scripted(held, keep_alive) as url,
        pools(httpx2.Limits(max_connections=1), httpx2.Timeout(5.0, pool=0.1)) as poster,
    ):
        async with streaming(poster, url + "/x", b"held"):
            with pytest.raises(RequestTimeoutError):
                await poster.post(url + "/x", b"waits")
        assert await echo(poster, url + "/x", b"now") == b"now"  # the place is free again


async def test_an_idle_connection_past_its_keepalive_expiry_is_not_reused() -> None:
    server = Scripted(keep_alive)
    limits = httpx2.Limits(max_keepalive_connections=4, keepalive_expiry=0.1)
    async with server as url, pools(limits) as poster:
        await poster.post(url + "/x", b"1")
        await poster.post(url + "/x", b"2")  # reused: within the expiry
        await asyncio.sleep(0.2)
        await poster.post(url + "/x", b"3")
    assert server.connections == 2


async def test_stray_bytes_after_an_answer_do_not_reach_the_next_request() -> None:
    async def chatty(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(ok(b"1") + b"HTTP/1.1 200 OK\r\n")  # a stray second answer begins
        await writer.drain()
        await keep_alive(reader, writer)

    async with Scripted(chatty, keep_alive) as url, pools() as poster:
        assert await echo(poster, url + "/x", b"") == b"1"
        await asyncio.sleep(0.05)
        assert await echo(poster, url + "/x", b"2") == b"2"


async def test_a_closed_poster_opens_no_connection() -> None:
    server = Scripted(keep_alive)
    async with server as url:
        async with pools() as poster:
            pass
        with pytest.raises(RuntimeError, match="closed"):
            await poster.post(url + "/x", b"{}")
    assert server.connections == 0


# --- bodies ------------------------------------------------------------------------------------


async def test_a_streamed_response_arrives_piece_by_piece(poster: Poster) -> None:
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
        async for data in stream_events(poster, url + "/v1", b"{}", summary="t"):
            seen.append(data["n"])
            sent.set()
    assert seen == [1, 2]


async def test_a_body_larger_than_the_read_buffer_arrives_whole_to_a_slow_reader(
    poster: Poster,
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
        async with streaming(poster, url + "/x") as answer:
            received = b""
            async for part in answer.body:
                received += part
                await asyncio.sleep(0.01)
        assert received == body
        assert await echo(poster, url + "/x", b"next") == b"next"
    assert server.connections == 1


async def test_a_body_ended_by_the_servers_close_is_whole_and_not_reused(poster: Poster) -> None:
    async def until_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b'HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\r\n{"a": ')
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(b"1}")

    server = Scripted(until_close)
    async with server as url:
        for _ in range(2):
            assert await post_json(poster, url + "/x", b"{}", summary="t") == {"a": 1}
    assert server.connections == 2


async def test_closing_a_stream_early_does_not_reuse_its_connection(poster: Poster) -> None:
    """A half-read response leaves bytes on the wire: the next request gets a new connection."""

    async def long_then_echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2000000\r\n\r\n" + b"x" * 1000)
        await writer.drain()
        await keep_alive(reader, writer)

    server = Scripted(long_then_echo, keep_alive)
    async with server as url:
        async with streaming(poster, url + "/x") as answer:
            async for _ in answer.body:
                break
        assert await echo(poster, url + "/x", b"again") == b"again"
    assert server.connections == 2


async def test_closing_a_stream_early_frees_its_place_under_the_limit() -> None:
    """An abandoned stream (an agent stopping a streamed turn) does not hold a connection."""
    limits = httpx2.Limits(max_connections=1, max_keepalive_connections=1)
    async with (
        Scripted(held, keep_alive) as url,
        pools(limits, httpx2.Timeout(5.0, pool=0.5)) as poster,
    ):
        async with streaming(poster, url + "/x") as answer:
            async for _ in answer.body:
                break
        assert await echo(poster, url + "/x", b"next") == b"next"


async def test_an_interim_100_is_skipped(poster: Poster) -> None:
    async def interim(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await read_request(reader)
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n" + ok(b'{"ok": true}'))
            await writer.drain()

    server = Scripted(interim)
    async with server as url:
        for _ in range(2):
            assert await post_json(poster, url + "/x", b"{}", summary="t") == {"ok": True}
    assert server.connections == 1


async def test_a_large_body_is_sent_whole_in_pieces() -> None:
    body = b'{"a": "' + b"x" * (3 << 20) + b'"}'
    async with Scripted(keep_alive) as url, pools() as poster:
        assert await echo(poster, url + "/x", body) == body


async def test_requests_carry_json_and_the_callers_headers_and_answers_the_servers() -> None:
    """A POST says its body is JSON and carries the caller's headers; a compressed answer's
    body is decoded, its status and headers kept."""
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

    async with Scripted(gzip_echo) as url, pools() as poster:
        answer = await poster.post(url + "/v1/x?q=1", b"{}", headers={"x-agent": "a1"})
    assert answer.status == 201
    assert (b"x-request-id", b"r1") in [(k.lower(), v) for k, v in answer.headers]
    assert answer.body == b'{"ok": 1}'
    lines = seen[0].decode().split("\r\n")
    assert lines[0] == "POST /v1/x?q=1 HTTP/1.1"
    sent = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
    assert (sent["content-type"], sent["x-agent"], sent["content-length"]) == (
        "application/json",
        "a1",
        "2",
    )


# --- errors ------------------------------------------------------------------------------------


async def test_a_server_closing_mid_body_is_a_lost_connection(poster: Poster) -> None:
    async def short(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n{partial")

    async with Scripted(short) as url:
        with pytest.raises(ConnectionLostError, match="complete message body"):
            await post_json(poster, url + "/x", b"{}", summary="t")


async def test_a_server_closing_before_answering_is_a_lost_connection_not_a_connect_error(
    poster: Poster,
) -> None:
    """It connected, so the server is up: a connect error would mark a live pair down."""

    async def mute(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)

    async with Scripted(mute) as url:
        with pytest.raises(ConnectionLostError, match="without sending a response"):
            await post_json(poster, url + "/x", b"{}", summary="t")


async def test_a_reset_mid_request_is_a_lost_connection(poster: Poster) -> None:
    async def reset(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()  # RST, not FIN

    async with Scripted(reset) as url:
        with pytest.raises(ConnectionLostError):
            await post_json(poster, url + "/x", b"{}", summary="t")


async def test_a_post_whose_connection_is_lost_is_never_sent_again() -> None:
    """A lease call or a turn's leg (POST) is sent once; aiohttp re-sends an idempotent request
    (a GET probe) once when its connection is lost, as RFC 9112 allows."""
    requests = 0

    async def mute(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal requests
        await read_request(reader)
        requests += 1

    async with Scripted(mute) as url, pools() as poster:
        with pytest.raises(ConnectionLostError):
            await exchange(poster, "POST", url + "/lease", body=b"{}", timeout_s=5.0)
        assert requests == 1
        with pytest.raises(ConnectionLostError):
            await exchange(poster, "GET", url + "/info", timeout_s=5.0)
        assert requests == 3


async def test_an_answer_that_is_not_http_is_a_lost_connection(poster: Poster) -> None:
    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"SSH-2.0-OpenSSH_9.6\r\n\r\n")
        await asyncio.sleep(1)

    async with Scripted(garbage) as url:
        with pytest.raises(ConnectionLostError):
            await poster.post(url + "/x", b"{}")


async def test_a_switch_of_protocols_is_a_lost_connection() -> None:
    async def upgrade(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(
            b"HTTP/1.1 101 Switching Protocols\r\nconnection: upgrade\r\nupgrade: h2c\r\n\r\n"
        )
        await asyncio.sleep(1)

    async with Scripted(upgrade) as url, pools() as poster:
        with pytest.raises(ConnectionLostError, match="switched protocols"):
            await poster.post(url + "/x", b"{}")


async def test_a_stalled_answer_times_out_on_the_read_timeout() -> None:
    async def stall(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await asyncio.sleep(5)

    async with Scripted(stall) as url, pools(phases=0.2) as poster:
        with pytest.raises(RequestTimeoutError):
            await post_json(poster, url + "/x", b"{}", summary="t")
        started = time.monotonic()
        with pytest.raises(RequestTimeoutError):  # a call's own timeout
            await exchange(poster, "GET", url + "/x", timeout_s=0.1)
        assert time.monotonic() - started < 0.19


async def test_a_stream_that_stalls_mid_body_times_out_on_the_read_timeout() -> None:
    async def stall(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\ndata:\r\n")
        await writer.drain()
        await asyncio.sleep(5)

    async with (
        Scripted(stall) as url,
        pools(phases=0.2) as poster,
        streaming(poster, url + "/x") as answer,
    ):
        with pytest.raises(RequestTimeoutError):
            async for _ in answer.body:
                pass


async def test_a_body_the_server_does_not_read_times_out_on_the_write_timeout() -> None:
    async def deaf(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(5)

    async with Scripted(deaf) as url, pools(phases=httpx2.Timeout(5.0, write=0.2)) as poster:
        started = time.monotonic()
        with pytest.raises(RequestTimeoutError, match="writing"):
            await poster.post(url + "/x", b"x" * (64 << 20))
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
    async with pools(phases=httpx2.Timeout(5.0, connect=0.2)) as poster:
        started = time.monotonic()
        with pytest.raises(ConnectError, match="cannot connect"):
            await post_json(poster, f"http://127.0.0.1:{full_backlog}/x", b"{}", summary="t")
    assert time.monotonic() - started < 2.0  # the connect timeout's, not the pool's or read's


async def test_a_refused_connection_is_agentkvs_connect_error(poster: Poster) -> None:
    server = Scripted(keep_alive)
    async with server as url:
        pass  # the port is now closed
    with pytest.raises(ConnectError, match="cannot connect"):
        await post_json(poster, url + "/x", b"{}", summary="t")


async def test_an_unknown_host_is_agentkvs_connect_error(poster: Poster) -> None:
    with pytest.raises(ConnectError, match="cannot connect"):
        await post_json(poster, "http://no-such-host.invalid/x", b"{}", summary="t")


async def test_an_unsupported_scheme_is_a_config_error(poster: Poster) -> None:
    with pytest.raises(ConfigError, match="bad server URL"):
        await poster.post("ftp://127.0.0.1/x", b"")


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


# --- what a cluster sends with -----------------------------------------------------------------


async def test_a_cluster_sends_through_per_server_pools_or_the_callers_client() -> None:
    spec = {"model": "m", "pairs": [{"name": "p", "prefill": "http://a:1", "decode": "http://a:2"}]}
    async with AsyncCluster.from_dict(spec) as cluster:
        assert isinstance(cluster.poster, ServerPools)
        assert cluster.http_client is None
    given = httpx2.AsyncClient()
    async with AsyncCluster.from_dict(spec, http_client=given) as cluster:
        assert cluster.http_client is given  # a caller's client (auth, proxies, hooks) is kept
        assert isinstance(cluster.poster, HttpxPoster)
        assert cluster.poster.client is given
    assert not given.is_closed  # the caller's to close
    await given.aclose()
