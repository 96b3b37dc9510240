"""``post_json`` and ``stream_events`` over each ``Poster`` (the default ``ServerPools`` and a
user's httpx2 client through ``HttpxPoster``): parsed answers, status errors with their exchange,
server-sent events cut anywhere, malformed and lost streams (raw sockets on 127.0.0.1, as
``test_transport``)."""

from __future__ import annotations

import asyncio
import gc
import gzip
import sys
from collections.abc import AsyncIterator
from typing import Any

import httpx2
import pytest

from agentkv._exceptions import (
    BadRequestError,
    ConnectionLostError,
    MalformedResponseError,
    RequestTimeoutError,
    ServerError,
)
from agentkv._wire.http import _lines, post_json, stream_events
from agentkv._wire.transport import Poster
from tests.unit.test_transport import Scripted, keep_alive, pools, poster, read_request

__all__ = ["poster"]  # the fixture, shared

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


async def test_a_compressed_answer_is_decoded_as_its_headers_say(poster: Poster) -> None:
    body = gzip.compress(b'{"ok": 2}')
    reply = answer(b"200 OK", body, b"content-encoding: gzip")
    async with Scripted(recording([], reply)) as url:
        assert await post_json(poster, url + "/x", b"{}", summary="t") == {"ok": 2}


@pytest.mark.parametrize(
    ("status", "error"), [(b"400 Bad Request", BadRequestError), (b"503 Busy", ServerError)]
)
async def test_an_error_status_carries_its_body_and_the_request(
    status: bytes, error: type[Exception], poster: Poster
) -> None:
    reply = answer(status, b'{"error": "no"}', b"x-request-id: srv-1")
    async with Scripted(recording([], reply)) as url:
        with pytest.raises(error) as caught:
            await post_json(poster, url + "/x", b'{"q":1}', summary="the leg")
    raised = caught.value
    assert raised.status_code == int(status[:3])  # type: ignore[attr-defined]
    assert raised.response_body == '{"error": "no"}'  # type: ignore[attr-defined]
    assert raised.request.content == b'{"q":1}'  # type: ignore[attr-defined]
    assert raised.response.headers["x-request-id"] == "srv-1"  # type: ignore[attr-defined]


async def test_a_body_that_is_not_json_is_malformed(poster: Poster) -> None:
    async with Scripted(recording([], answer(b"200 OK", b"<html>"))) as url:
        with pytest.raises(MalformedResponseError, match="not JSON"):
            await post_json(poster, url + "/x", b"{}", summary="t")


async def test_connections_are_reused(poster: Poster) -> None:
    server = Scripted(keep_alive)
    async with server as url:
        for n in range(3):
            assert await post_json(poster, url + "/x", b"[%d]" % n, summary="t") == [n]
    assert server.connections == 1


async def test_a_callers_content_type_replaces_the_default_once(poster: Poster) -> None:
    heads: list[bytes] = []
    async with Scripted(recording(heads)) as url:
        headers = {"content-type": "text/x", "x-agent": "a1"}
        await post_json(poster, url + "/x", b"{}", summary="t", headers=headers)
    assert b"content-type: text/x" in heads[0].lower()
    assert heads[0].lower().count(b"content-type") == 1
    assert b"x-agent: a1" in heads[0].lower()


# --- streams: ``stream_events`` on ``post_stream`` -------------------------------------------

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


async def _events(poster: Poster, url: str) -> list[object]:
    return [data async for data in stream_events(poster, url + "/v1", b"{}", summary="t")]


@pytest.mark.parametrize("cut", range(0, len(EVENTS) + 1, 3))
async def test_events_cut_anywhere_arrive_whole(cut: int, poster: Poster) -> None:
    """Lines end in LF, CRLF or CR, and a piece may end inside one (a CR apart from its LF)."""
    reply = chunked(EVENTS[:cut], EVENTS[cut:])
    async with Scripted(serving(reply)) as url:
        assert await _events(poster, url) == [{"n": 1}, {"n": 2}, {"n": 3}]


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


async def test_a_stream_refused_with_an_error_status_carries_its_body(poster: Poster) -> None:
    reply = answer(b"400 Bad Request", b'{"error": "no"}')
    async with Scripted(serving(reply)) as url:
        with pytest.raises(BadRequestError) as caught:
            await _events(poster, url)
    assert caught.value.response_body == '{"error": "no"}'


async def test_a_compressed_stream_is_decoded_as_its_headers_say(poster: Poster) -> None:
    reply = chunked(gzip.compress(EVENTS), head=b"content-encoding: gzip\r\n")
    async with Scripted(serving(reply)) as url:
        assert await _events(poster, url) == [{"n": 1}, {"n": 2}, {"n": 3}]


async def test_a_stream_without_done_is_malformed_and_a_cut_one_is_lost(poster: Poster) -> None:
    whole_but_short = chunked(b'data: {"n": 1}\n\n')
    async with Scripted(serving(whole_but_short)) as url:
        with pytest.raises(MalformedResponseError, match="before \\[DONE\\]"):
            await _events(poster, url)

    async def then_close(reader: Reader, writer: Writer) -> None:
        await read_request(reader)
        writer.write(ONE_EVENT)

    async with Scripted(then_close) as url:
        with pytest.raises(ConnectionLostError):
            await _events(poster, url)


async def test_a_stream_stalled_mid_body_times_out() -> None:
    async def stall(reader: Reader, writer: Writer) -> None:
        await read_request(reader)
        writer.write(ONE_EVENT)
        await writer.drain()
        await asyncio.sleep(5)

    async with Scripted(stall) as url, pools(phases=0.3) as poster:
        events = stream_events(poster, url + "/v1", b"{}", summary="t")
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
    async with server as url, pools(limits, httpx2.Timeout(5.0, pool=0.5)) as poster:
        events = stream_events(poster, url + "/v1", b"{}", summary="t")
        assert await anext(events) == {"n": 1}
        await events.aclose()
        assert await post_json(poster, url + "/x", b"[7]", summary="t") == [7]
    assert server.connections == 2


async def test_a_stream_closed_at_done_leaves_no_generator_for_asyncio_to_close() -> None:
    """Left at [DONE] with the body's end still to come, every iterator of the stream is closed
    then, not handed to asyncio's finalizer (a task per generator, per streamed turn). (The
    default's: httpx2's own pool leaves one.)"""

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
        async with Scripted(done_then_end) as url, pools() as poster:
            assert await _events(poster, url) == [{"n": 1}]
            gc.collect()
    finally:
        sys.set_asyncgen_hooks(*hooks)
    assert finalized == []
