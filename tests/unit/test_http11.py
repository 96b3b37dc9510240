"""The default transport's HTTP/1.1 exchanges against scripted servers on 127.0.0.1.

Each test's server speaks raw bytes, so the cases a real server rarely shows on demand (a close
mid-body, a body ended by the close, an interim 100, garbage, a stall) are exact.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
import pytest

from agentkv._exceptions import ConnectionLostError, RequestTimeoutError
from agentkv._transport import ServerPools
from agentkv._wire.http import post_json, stream_events

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
"""Serves one connection."""
LIMITS = httpx.Limits(max_connections=4, max_keepalive_connections=4, keepalive_expiry=30.0)


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

    async def __aenter__(self) -> str:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(transport=ServerPools(LIMITS), timeout=5.0) as c:
        yield c


async def keep_alive(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Echo each request's body back, on one connection for as long as the client keeps it."""
    while True:
        _, body = await read_request(reader)
        writer.write(ok(body))
        await writer.drain()


async def test_a_streamed_response_arrives_piece_by_piece(client: httpx.AsyncClient) -> None:
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
    client: httpx.AsyncClient,
) -> None:
    """Reading pauses while over a MiB waits for the reader, and resumes as it drains."""
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
    client: httpx.AsyncClient,
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


async def test_a_server_closing_mid_body_is_a_lost_connection(client: httpx.AsyncClient) -> None:
    async def short(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n{partial")

    async with Scripted(short) as url:
        with pytest.raises(ConnectionLostError, match="complete message body"):
            await post_json(client, url + "/x", b"{}", summary="t")


async def test_a_server_closing_before_answering_is_a_lost_connection(
    client: httpx.AsyncClient,
) -> None:
    async def mute(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)

    async with Scripted(mute) as url:
        with pytest.raises(ConnectionLostError, match="without sending a response"):
            await post_json(client, url + "/x", b"{}", summary="t")


async def test_an_answer_that_is_not_http_is_a_protocol_error(client: httpx.AsyncClient) -> None:
    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"SSH-2.0-OpenSSH_9.6\r\n\r\n")
        await asyncio.sleep(1)

    async with Scripted(garbage) as url:
        with pytest.raises(httpx.RemoteProtocolError, match="malformed"):
            await client.post(url + "/x", content=b"{}")


async def test_a_switch_of_protocols_is_a_protocol_error(client: httpx.AsyncClient) -> None:
    async def upgrade(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(
            b"HTTP/1.1 101 Switching Protocols\r\nconnection: upgrade\r\nupgrade: h2c\r\n\r\n"
        )
        await asyncio.sleep(1)

    async with Scripted(upgrade) as url:
        with pytest.raises(httpx.RemoteProtocolError, match="switched protocols"):
            await client.post(url + "/x", content=b"{}")


async def test_a_stalled_answer_times_out_on_the_read_timeout() -> None:
    async def stall(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await asyncio.sleep(5)

    async with (
        Scripted(stall) as url,
        httpx.AsyncClient(transport=ServerPools(LIMITS), timeout=0.2) as client,
    ):
        with pytest.raises(RequestTimeoutError):
            await post_json(client, url + "/x", b"{}", summary="t")


async def test_an_interim_100_is_skipped(client: httpx.AsyncClient) -> None:
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


async def test_a_chunked_request_body_is_framed(client: httpx.AsyncClient) -> None:
    async def parts() -> AsyncIterator[bytes]:
        for part in (b'{"a": ', b"", b"[1, 2]", b"}"):
            yield part

    async with Scripted(keep_alive) as url:
        response = await client.post(url + "/x", content=parts())
    assert response.json() == {"a": [1, 2]}


async def test_closing_a_stream_early_does_not_reuse_its_connection(
    client: httpx.AsyncClient,
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


async def test_a_cancelled_request_frees_its_place_under_the_limit() -> None:
    async def stall(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await asyncio.sleep(10)

    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    async with (
        Scripted(stall, keep_alive) as url,
        httpx.AsyncClient(transport=ServerPools(limits), timeout=5.0) as client,
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
        Scripted(keep_alive) as url,
        httpx.AsyncClient(
            transport=ServerPools(httpx.Limits(max_connections=1)),
            timeout=httpx.Timeout(5.0, pool=0.1),
        ) as client,
    ):
        async with client.stream("POST", url + "/x", content=b"held"):
            with pytest.raises(httpx.PoolTimeout):
                await client.post(url + "/x", content=b"waits")
        response = await client.post(url + "/x", content=b"now")  # the place is free again
        assert response.content == b"now"


async def test_an_idle_connection_past_its_keepalive_expiry_is_not_reused() -> None:
    server = Scripted(keep_alive)
    limits = httpx.Limits(max_keepalive_connections=4, keepalive_expiry=0.1)
    async with server as url, httpx.AsyncClient(transport=ServerPools(limits)) as client:
        await client.post(url + "/x", content=b"1")
        await client.post(url + "/x", content=b"2")  # reused: within the expiry
        await asyncio.sleep(0.2)
        await client.post(url + "/x", content=b"3")
    assert server.connections == 2


async def test_bytes_arriving_on_an_idle_connection_retire_it(client: httpx.AsyncClient) -> None:
    async def chatty(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(ok(b"1") + b"HTTP/1.1 200 OK\r\n")  # a stray second answer begins
        await writer.drain()
        await keep_alive(reader, writer)

    server = Scripted(chatty, keep_alive)
    async with server as url:
        assert (await client.post(url + "/x", content=b"")).content == b"1"
        await asyncio.sleep(0.05)
        assert (await client.post(url + "/x", content=b"2")).content == b"2"
    assert server.connections == 2


async def test_a_head_answer_ends_at_its_headers(client: httpx.AsyncClient) -> None:
    async def head(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 1234\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(5)

    async with Scripted(head) as url:
        response = await client.head(url + "/health")
    assert (response.status_code, response.headers["content-length"]) == (200, "1234")


async def test_an_unsupported_scheme_is_refused(client: httpx.AsyncClient) -> None:
    with pytest.raises(httpx.UnsupportedProtocol):
        await client.post("ftp://127.0.0.1/x", content=b"")
