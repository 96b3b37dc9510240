"""A user's ``httpx2.AsyncClient`` as a cluster's ``Poster`` (``http_client=``): its own
transport, hooks and headers apply, answers and errors are the default's, and agentkv reads
none of httpx2's private attributes to get there."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from typing import Any

import httpx2
import pytest

from agentkv import AsyncCluster, Message
from agentkv._exceptions import (
    ConfigError,
    ConnectError,
    ConnectionLostError,
    RequestTimeoutError,
    ServerError,
)
from agentkv._wire.http import HttpxPoster, exchange, get_ok, post_json, stream_events
from agentkv.testing import FakeCluster

URL = "http://server.test:8000/v1/x"


class Watched(httpx2.AsyncClient):
    """A client that records each private attribute read from agentkv's code (a frame whose
    module is ``agentkv...``): httpx2's own reads are its business."""

    def __getattribute__(self, name: str) -> Any:
        if name.startswith("_") and not name.startswith("__"):
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if caller.startswith("agentkv"):
                object.__getattribute__(self, "private_reads").append(f"{caller}: {name}")
        return super().__getattribute__(name)

    def __init__(self, **options: Any) -> None:
        self.private_reads: list[str] = []
        super().__init__(**options)


def answering(handle: Callable[[httpx2.Request], httpx2.Response]) -> HttpxPoster:
    return HttpxPoster(Watched(transport=httpx2.MockTransport(handle)), owned=True)


async def test_a_post_carries_json_the_callers_and_the_clients_headers() -> None:
    seen: list[httpx2.Request] = []

    def handle(request: httpx2.Request) -> httpx2.Response:
        seen.append(request)
        return httpx2.Response(200, json={"ok": 1}, headers={"x-request-id": "r1"})

    client = Watched(transport=httpx2.MockTransport(handle), headers={"authorization": "Bearer t"})
    async with contextlib.aclosing(HttpxPoster(client, owned=True)) as poster:
        data = await post_json(poster, URL, b"{}", summary="t", headers={"x-agent": "a1"})
        answer = await poster.get(URL, timeout_s=1.0)
    assert data == {"ok": 1}
    assert answer.status == 200
    assert (b"x-request-id", b"r1") in answer.headers
    posted = seen[0]
    assert (posted.method, posted.content) == ("POST", b"{}")
    assert posted.headers["content-type"] == "application/json"
    assert posted.headers["x-agent"] == "a1"
    assert posted.headers["authorization"] == "Bearer t"  # the user's client's own
    assert seen[1].extensions["timeout"]["read"] == 1.0  # a call's own timeout
    assert client.private_reads == []
    assert client.is_closed  # owned


@pytest.mark.parametrize(
    ("raised", "expected"),
    [
        (httpx2.ConnectError("refused"), ConnectError),
        (httpx2.ConnectTimeout("slow"), ConnectError),
        (httpx2.ReadTimeout("stalled"), RequestTimeoutError),
        (httpx2.PoolTimeout("full"), RequestTimeoutError),
        (httpx2.RemoteProtocolError("closed"), ConnectionLostError),
        (httpx2.ReadError("reset"), ConnectionLostError),
        (httpx2.UnsupportedProtocol("ftp"), ConfigError),
    ],
)
async def test_httpx2s_errors_are_agentkvs_on_every_call(
    raised: Exception, expected: type[Exception]
) -> None:
    def handle(request: httpx2.Request) -> httpx2.Response:
        raise raised

    async with contextlib.aclosing(answering(handle)) as poster:
        with pytest.raises(expected) as caught:
            await post_json(poster, URL, b"{}", summary="t")
        assert caught.value.__cause__ is raised
        with pytest.raises(expected):
            await exchange(poster, "GET", URL, timeout_s=1.0)
        with pytest.raises(expected):
            async for _ in stream_events(poster, URL, b"{}", summary="t"):
                pass
        assert await get_ok(poster, URL, timeout_s=1.0) is False


async def test_an_error_mid_stream_is_agentkvs() -> None:
    class Cut(httpx2.AsyncByteStream):
        async def __aiter__(self) -> Any:
            yield b'data: {"n": 1}\n\n'
            raise httpx2.ReadError("reset mid-body")

    def handle(request: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(200, stream=Cut())

    async with contextlib.aclosing(answering(handle)) as poster:
        events = stream_events(poster, URL, b"{}", summary="t")
        assert await anext(events) == {"n": 1}
        with pytest.raises(ConnectionLostError, match="reset mid-body"):
            await anext(events)


async def test_a_status_error_is_the_defaults() -> None:
    def handle(request: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(503, json={"error": "busy"}, headers={"retry-after": "2"})

    async with contextlib.aclosing(answering(handle)) as poster:
        with pytest.raises(ServerError) as caught:
            await post_json(poster, URL, b'{"q": 1}', summary="the leg")
    assert caught.value.retry_after_s == 2.0
    assert caught.value.request is not None
    assert caught.value.request.content == b'{"q": 1}'


async def test_a_cluster_on_a_users_client_runs_sessions_through_it() -> None:
    """The user's client (its own transport: the fake's, and an event hook) carries every
    request of a session; agentkv reads nothing private of it and leaves it open."""
    fake = FakeCluster(pairs=1)
    paths: list[str] = []

    async def hook(request: httpx2.Request) -> None:
        paths.append(request.url.path)

    client = Watched(transport=fake.transport, event_hooks={"request": [hook]})
    async with (
        AsyncCluster.from_dict(fake.cluster_spec, http_client=client) as cluster,
        cluster.session(max_tokens=8) as session,
    ):
        session.append(Message.user("Hello"))
        first = await session.turn()
        session.append(Message.user("Again"))
        events = [event async for event in session.stream()]
    assert first.text
    assert events
    assert paths.count("/tokenize") >= 2
    assert paths.count("/v1/chat/completions") + paths.count("/v1/completions") == 4
    assert client.private_reads == []
    assert not client.is_closed
    await client.aclose()


async def test_an_httpx2_transport_runs_in_a_client_the_cluster_owns() -> None:
    """``transport=`` an httpx2 transport (not a ``Poster``): a client of the cluster's own
    around it, closed with the cluster."""
    fake = FakeCluster(pairs=1)
    closed: list[bool] = []

    class Plain(httpx2.AsyncBaseTransport):
        async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
            return await fake.transport.handle_async_request(request)

        async def aclose(self) -> None:
            closed.append(True)

    async with AsyncCluster.from_dict(fake.cluster_spec, transport=Plain()) as cluster:
        assert isinstance(cluster.poster, HttpxPoster)
        async with cluster.session(max_tokens=8) as session:
            assert (await session.send("Hello")).text
    assert closed == [True]
