"""``post_json`` and ``stream_events`` on the cluster's own client post through
``ServerPools.post`` and ``post_stream``: the request httpx2 would build, answered without
httpx2's request and response objects, with the default transport's limits, timeouts and errors
(raw sockets on 127.0.0.1, as ``test_transport``)."""

from __future__ import annotations

import asyncio
import gc
import gzip
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx2
import pytest

from agentkv._exceptions import (
    BadRequestError,
    ConnectError,
    ConnectionLostError,
    MalformedResponseError,
    RequestTimeoutError,
    ServerError,
)
from agentkv._wire.http import _lines, post_json, stream_events
from agentkv._wire.transport import ClusterClient, ServerPools
from tests.unit.test_transport import LIMITS, Scripted, keep_alive, read_request

Reader, Writer = asyncio.StreamReader, asyncio.StreamWriter


def answer(status: bytes, body: bytes, *headers: bytes) -> bytes:
    extra = b"".join(h + b"\r\n" for h in headers)
    return b"HTTP/1.1 %b\r\n%bcontent-length: %d\r\n\r\n%b" % (status, extra, len(body), body)


def recording(heads: list[bytes], reply: bytes = answer(b"200 OK", b'{"ok": 1}')) -> object:
    async def serve(reader: Reader, writer: Writer) -> None:
        while True:
            head, _ = await read_request(reader)
            heads.append(head)
            writer.write(reply)
            await writer.drain()

    return serve


class NoHttpx2Path(ServerPools):
    """The default transport with httpx2's path shut: only ``post`` may be taken."""

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        raise AssertionError(f"httpx2's path was taken for {request.url}")


async def test_it_sends_the_head_httpx2_sends_and_skips_httpx2s_path() -> None:
    direct: list[bytes] = []
    via_httpx2: list[bytes] = []
    headers = {"x-agent": "a1"}
    async with (
        Scripted(recording(direct)) as url,
        ClusterClient(transport=NoHttpx2Path(LIMITS), headers=headers, timeout=5.0) as client,
    ):
        for _ in range(2):  # the second from the cached template
            data = await post_json(
                client, url + "/v1/x", b'{"a":1}', summary="t", headers={"X-Request-Id": "r"}
            )
            assert data == {"ok": 1}
    async with (
        Scripted(recording(via_httpx2)) as url,
        httpx2.AsyncClient(transport=ServerPools(LIMITS), headers=headers, timeout=5.0) as other,
    ):
        await post_json(
            other, url + "/v1/x", b'{"a":1}', summary="t", headers={"X-Request-Id": "r"}
        )

    def lines(head: bytes) -> list[str]:  # the ports differ
        return [line for line in head.decode().split("\r\n") if not line.startswith("host:")]

    assert lines(direct[0]) == lines(direct[1]) == lines(via_httpx2[0])
    assert "x-request-id: r" in lines(direct[0])


async def test_a_compressed_answer_is_decoded_as_its_headers_say() -> None:
    body = gzip.compress(b'{"ok": 2}')
    reply = answer(b"200 OK", body, b"content-encoding: gzip")
    async with (
        Scripted(recording([], reply)) as url,
        ClusterClient(transport=NoHttpx2Path(LIMITS)) as client,
    ):
        assert await post_json(client, url + "/x", b"{}", summary="t") == {"ok": 2}


@pytest.mark.parametrize(
    ("status", "error"), [(b"400 Bad Request", BadRequestError), (b"503 Busy", ServerError)]
)
async def test_an_error_status_carries_its_body_and_the_request(
    status: bytes, error: type[Exception]
) -> None:
    reply = answer(status, b'{"error": "no"}', b"x-request-id: srv-1")
    async with (
        Scripted(recording([], reply)) as url,
        ClusterClient(transport=NoHttpx2Path(LIMITS)) as client,
    ):
        with pytest.raises(error) as caught:
            await post_json(client, url + "/x", b'{"q":1}', summary="the leg")
    raised = caught.value
    assert raised.status_code == int(status[:3])  # type: ignore[attr-defined]
    assert raised.response_body == '{"error": "no"}'  # type: ignore[attr-defined]
    assert raised.request.content == b'{"q":1}'  # type: ignore[attr-defined]
    assert raised.response.headers["x-request-id"] == "srv-1"  # type: ignore[attr-defined]


async def test_a_body_that_is_not_json_is_malformed() -> None:
    async with (
        Scripted(recording([], answer(b"200 OK", b"<html>"))) as url,
        ClusterClient(transport=NoHttpx2Path(LIMITS)) as client,
    ):
        with pytest.raises(MalformedResponseError, match="not JSON"):
            await post_json(client, url + "/x", b"{}", summary="t")


async def test_connections_are_reused() -> None:
    server = Scripted(keep_alive)
    async with server as url, ClusterClient(transport=NoHttpx2Path(LIMITS)) as client:
        for n in range(3):
            assert await post_json(client, url + "/x", b"[%d]" % n, summary="t") == [n]
    assert server.connections == 1


async def test_errors_are_the_default_transports() -> None:
    async def mute(reader: Reader, writer: Writer) -> None:
        await read_request(reader)

    async def stall(reader: Reader, writer: Writer) -> None:
        await read_request(reader)
        await asyncio.sleep(5)

    async def short(reader: Reader, writer: Writer) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n{partial")

    async with ClusterClient(transport=NoHttpx2Path(LIMITS), timeout=0.3) as client:
        async with Scripted(mute) as url:
            with pytest.raises(ConnectionLostError, match="without sending a response"):
                await post_json(client, url + "/x", b"{}", summary="t")
        async with Scripted(short) as url:
            with pytest.raises(ConnectionLostError, match="complete message body"):
                await post_json(client, url + "/x", b"{}", summary="t")
        async with Scripted(stall) as url:
            with pytest.raises(RequestTimeoutError) as caught:
                await post_json(client, url + "/x", b"{}", summary="t")
            assert isinstance(caught.value.__cause__, httpx2.ReadTimeout)
        with pytest.raises(ConnectError, match="cannot connect"):
            await post_json(client, url + "/x", b"{}", summary="t")  # closed: refused


async def test_a_cancelled_post_frees_its_place_and_a_full_pool_times_out() -> None:
    async def stall(reader: Reader, writer: Writer) -> None:
        await read_request(reader)
        await asyncio.sleep(10)

    limits = httpx2.Limits(max_connections=1)
    timeout = httpx2.Timeout(5.0, pool=0.1)
    async with (
        Scripted(stall, keep_alive) as url,
        ClusterClient(transport=NoHttpx2Path(limits), timeout=timeout) as client,
    ):
        stuck = asyncio.create_task(post_json(client, url + "/x", b"1", summary="t"))
        await asyncio.sleep(0.1)
        started = time.monotonic()
        with pytest.raises(RequestTimeoutError) as caught:  # the one place is taken
            await post_json(client, url + "/x", b"2", summary="t")
        assert isinstance(caught.value.__cause__, httpx2.PoolTimeout)
        assert time.monotonic() - started < 2.0
        stuck.cancel()
        with pytest.raises(asyncio.CancelledError):
            await stuck
        assert await post_json(client, url + "/x", b"3", summary="t") == 3


async def test_closed_clients_and_transports_refuse() -> None:
    transport = NoHttpx2Path(LIMITS)
    client = ClusterClient(transport=transport)
    await client.aclose()
    with pytest.raises(RuntimeError, match="client has been closed"):
        await post_json(client, "http://127.0.0.1:9/x", b"{}", summary="t")
    with pytest.raises(httpx2.ConnectError, match="transport is closed"):
        await transport.post("http://127.0.0.1:9/x", b"{}", [], {})


async def test_httpx2s_path_where_the_template_does_not_hold() -> None:
    """A header that replaces one of httpx2's (content-type here) goes through httpx2's path,
    which merges it as httpx2 does; so does any other client."""
    heads: list[bytes] = []
    async with Scripted(recording(heads)) as url, ClusterClient(transport=ServerPools(LIMITS)) as c:
        await post_json(c, url + "/x", b"{}", summary="t", headers={"content-type": "text/x"})
    assert b"content-type: text/x" in heads[0].lower()
    assert heads[0].lower().count(b"content-type") == 1


# --- streams: ``stream_events`` on ``ServerPools.post_stream`` --------------------------------

EVENTS = b'data: {"n": 1}\r\n\r\n: a comment\rdata: {"n": 2}\r\rdata: {"n": 3}\n\ndata: [DONE]\n\n'


# A chunked answer's head and one event, and no more.
ONE_EVENT = b'HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n10\r\ndata: {"n": 1}\n\n\r\n'


def chunked(*pieces: bytes, head: bytes = b"") -> bytes:
    framed = b"".join(b"%x\r\n%b\r\n" % (len(piece), piece) for piece in pieces if piece)
    return b"HTTP/1.1 200 OK\r\n%btransfer-encoding: chunked\r\n\r\n%b0\r\n\r\n" % (head, framed)


def serving(reply: bytes) -> object:
    async def serve(reader: Reader, writer: Writer) -> None:
        while True:
            await read_request(reader)
            writer.write(reply)
            await writer.drain()

    return serve


async def _events(client: httpx2.AsyncClient, url: str) -> list[object]:
    return [data async for data in stream_events(client, url + "/v1", b"{}", summary="t")]


@pytest.mark.parametrize("cut", range(0, len(EVENTS) + 1, 3))
async def test_events_cut_anywhere_arrive_as_httpx2_reads_them(cut: int) -> None:
    """Lines end in LF, CRLF or CR, and a piece may end inside one (a CR apart from its LF)."""
    reply = chunked(EVENTS[:cut], EVENTS[cut:])
    async with Scripted(serving(reply)) as url:
        async with ClusterClient(transport=NoHttpx2Path(LIMITS)) as client:
            direct = await _events(client, url)
        async with httpx2.AsyncClient(transport=ServerPools(LIMITS)) as other:
            via_httpx2 = await _events(other, url)
    assert direct == via_httpx2 == [{"n": 1}, {"n": 2}, {"n": 3}]


async def test_the_lines_of_every_cut_are_httpx2s() -> None:
    async def pieces(*parts: bytes) -> AsyncIterator[bytes]:
        for part in parts:
            yield part

    body = EVENTS + b"data: no end"
    expected = [line.encode() for line in httpx2.Response(200, content=body).iter_lines()]
    for cut in range(len(body) + 1):
        for second in range(cut, len(body) + 1):
            parts = (body[:cut], body[cut:second], body[second:])
            assert [line async for line in _lines(pieces(*parts))] == expected, parts


async def test_a_stream_refused_with_an_error_status_carries_its_body() -> None:
    reply = answer(b"400 Bad Request", b'{"error": "no"}')
    async with (
        Scripted(serving(reply)) as url,
        ClusterClient(transport=NoHttpx2Path(LIMITS)) as client,
    ):
        with pytest.raises(BadRequestError) as caught:
            await _events(client, url)
    assert caught.value.response_body == '{"error": "no"}'


async def test_a_compressed_stream_is_decoded_as_its_headers_say() -> None:
    reply = chunked(gzip.compress(EVENTS), head=b"content-encoding: gzip\r\n")
    async with (
        Scripted(serving(reply)) as url,
        ClusterClient(transport=NoHttpx2Path(LIMITS)) as client,
    ):
        assert await _events(client, url) == [{"n": 1}, {"n": 2}, {"n": 3}]


async def test_a_stream_without_done_is_malformed_and_a_cut_one_is_lost() -> None:
    whole_but_short = chunked(b'data: {"n": 1}\n\n')
    async with ClusterClient(transport=NoHttpx2Path(LIMITS)) as client:
        async with Scripted(serving(whole_but_short)) as url:
            with pytest.raises(MalformedResponseError, match="before \\[DONE\\]"):
                await _events(client, url)

        async def then_close(reader: Reader, writer: Writer) -> None:
            await read_request(reader)
            writer.write(ONE_EVENT)

        async with Scripted(then_close) as url:
            with pytest.raises(ConnectionLostError):
                await _events(client, url)


async def test_a_stream_stalled_mid_body_times_out() -> None:
    async def stall(reader: Reader, writer: Writer) -> None:
        await read_request(reader)
        writer.write(ONE_EVENT)
        await writer.drain()
        await asyncio.sleep(5)

    async with (
        Scripted(stall) as url,
        ClusterClient(transport=NoHttpx2Path(LIMITS), timeout=0.3) as client,
    ):
        events = stream_events(client, url + "/v1", b"{}", summary="t")
        assert await anext(events) == {"n": 1}
        with pytest.raises(RequestTimeoutError):
            await anext(events)


async def test_a_stream_left_early_frees_its_place_and_its_connection() -> None:
    """An agent that stops reading a streamed turn: the connection (its answer still coming) is
    closed, not reused, and its place under the limit is free again."""
    limits = httpx2.Limits(max_connections=1, max_keepalive_connections=1)

    async def endless(reader: Reader, writer: Writer) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        while True:
            writer.write(b'10\r\ndata: {"n": 1}\n\n\r\n')
            await writer.drain()
            await asyncio.sleep(0.01)

    server = Scripted(endless, keep_alive)
    async with (
        server as url,
        ClusterClient(
            transport=NoHttpx2Path(limits), timeout=httpx2.Timeout(5.0, pool=0.5)
        ) as client,
    ):
        events = stream_events(client, url + "/v1", b"{}", summary="t")
        assert await anext(events) == {"n": 1}
        await events.aclose()
        assert await post_json(client, url + "/x", b"[7]", summary="t") == [7]
    assert server.connections == 2


async def test_a_stream_closed_at_done_leaves_no_generator_for_asyncio_to_close() -> None:
    """Left at [DONE] with the body's end still to come, every iterator of the stream is closed
    then, not handed to asyncio's finalizer (a task per generator, per streamed turn)."""

    async def done_then_end(reader: Reader, writer: Writer) -> None:
        await read_request(reader)
        writer.write(chunked(b'data: {"n": 1}\n\ndata: [DONE]\n\n')[:-5])  # not the end yet
        await writer.drain()
        await asyncio.sleep(0.2)
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(1)

    hooks = sys.get_asyncgen_hooks()
    finalized: list[str] = []

    def finalizer(generator: Any) -> None:
        finalized.append(generator.__qualname__)
        hooks.finalizer(generator)

    sys.set_asyncgen_hooks(firstiter=hooks.firstiter, finalizer=finalizer)
    try:
        async with (
            Scripted(done_then_end) as url,
            ClusterClient(transport=NoHttpx2Path(LIMITS)) as client,
        ):
            assert await _events(client, url) == [{"n": 1}]
            gc.collect()
    finally:
        sys.set_asyncgen_hooks(*hooks)
    assert finalized == []
