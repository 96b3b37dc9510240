"""The fake's transport is a ``Poster``, as the default one is: the same answers and the same
agentkv errors as a user's httpx2 client on it (``HttpxPoster``), and a cluster posts through it,
so a session on the fake cluster runs the code it runs against real servers, streamed or not."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import httpx2
import pytest

from agentkv import AsyncCluster, Message, TextDelta, TurnResult
from agentkv._exceptions import (
    ConnectError,
    ConnectionLostError,
    RequestTimeoutError,
    TransportError,
)
from agentkv._wire.http import HttpxPoster
from agentkv._wire.json import dumps
from agentkv._wire.transport import Answer, Poster, Streamed, is_poster
from agentkv.testing import FakeCluster

TOKENIZE = {"model": "fake", "prompt": "agents reuse the cache", "add_special_tokens": False}
HEADERS = {"x-agent": "a1"}


TURN_PATHS = ("/tokenize", "/v1/chat/completions", "/v1/completions")


class PostsOnly(httpx2.AsyncBaseTransport):
    """The fake's transport with httpx2's path shut for a turn's posts (its render and legs):
    only the ``Poster`` methods may carry them."""

    def __init__(self, fake: FakeCluster) -> None:
        self.inner = fake.transport
        self.posted: list[str] = []

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        raise AssertionError(f"httpx2's path was taken for {request.method} {request.url}")

    async def post(
        self,
        url: str,
        body: bytes,
        *,
        headers: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> Answer:
        self.posted.append(url)
        return await self.inner.post(url, body, headers=headers, timeout_s=timeout_s)

    async def post_stream(
        self, url: str, body: bytes, *, headers: Mapping[str, str] | None = None
    ) -> Streamed:
        self.posted.append(url)
        return await self.inner.post_stream(url, body, headers=headers)

    async def get(self, url: str, *, timeout_s: float | None = None) -> Answer:
        return await self.inner.get(url, timeout_s=timeout_s)


class Forwarding(httpx2.AsyncBaseTransport):
    """A user's wrapper that sees each request and forwards any other attribute to the fake's
    transport (``post`` too, through ``__getattr__``)."""

    def __init__(self, fake: FakeCluster) -> None:
        self.inner = fake.transport
        self.seen: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        self.seen.append(request.url.path)
        return await self.inner.handle_async_request(request)


async def _both(fake: FakeCluster, url: str, body: bytes) -> tuple[object, object]:
    """The answer of the fake as a ``Poster`` and of a user's httpx2 client on it (through
    ``HttpxPoster``), as (status, content type, body) or the exception's type."""
    results: list[object] = []
    user = HttpxPoster(httpx2.AsyncClient(transport=fake.transport), owned=True)
    for poster in (fake.transport, user):
        try:
            status, headers, content = await poster.post(url, body, headers=HEADERS)
            results.append((status, dict(headers).get(b"content-type"), content))
        except TransportError as exc:
            results.append(type(exc))
    await user.aclose()
    return results[0], results[1]


def test_the_fake_transport_is_a_poster() -> None:
    assert is_poster(FakeCluster(pairs=1).transport)


@pytest.mark.parametrize(
    ("body", "path"),
    [
        (dumps(TOKENIZE), "/tokenize"),
        (b'{"model": "fake", "prompt": ', "/tokenize"),  # not JSON: vLLM's 400
        (dumps(TOKENIZE), "/v1/no-such-route"),
    ],
)
async def test_post_answers_as_a_user_client_on_it_does(body: bytes, path: str) -> None:
    fake = FakeCluster(pairs=1)
    by_post, by_httpx2 = await _both(fake, fake.prefill(0).url + path, body)
    assert by_post == by_httpx2
    assert isinstance(by_post, tuple)


@pytest.mark.parametrize(
    ("arm", "expected"),
    [
        ("timeout", RequestTimeoutError),
        ("reset", ConnectionLostError),
        ("kill", ConnectError),
        ("unknown host", ConnectError),
    ],
)
async def test_post_fails_as_a_user_client_on_it_does(arm: str, expected: type[Exception]) -> None:
    fake = FakeCluster(pairs=1)
    server = fake.prefill(0)
    url = server.url + "/tokenize"
    if arm == "kill":
        server.kill()
    elif arm == "unknown host":
        url = "http://nowhere.test:8000/tokenize"
    else:
        server.fail_next(arm, times=2, path="/tokenize")  # once for each path
    assert await _both(fake, url, dumps(TOKENIZE)) == (expected, expected)


async def test_post_stream_answers_as_a_user_client_on_it_does() -> None:
    fake = FakeCluster(pairs=1)
    url = fake.decode(0).url + "/v1/chat/completions"
    body = dumps(
        {
            "model": fake.model,
            "messages": [{"role": "user", "content": "Hi"}],
            "stream": True,
            "max_tokens": 4,
        }
    )
    status, headers, stream = await fake.transport.post_stream(url, body, headers=HEADERS)
    streamed = b"".join([piece async for piece in stream])
    await stream.aclose()
    user = HttpxPoster(httpx2.AsyncClient(transport=fake.transport), owned=True)
    answer = await user.post_stream(url, body, headers=HEADERS)
    async with contextlib.aclosing(answer.body):
        whole = b"".join([piece async for piece in answer.body])
    await user.aclose()
    assert (status, dict(headers).get(b"content-type")) == (
        answer.status,
        dict(answer.headers).get(b"content-type"),
    )
    assert streamed.startswith(b"data: ")
    # The same events (their ids and times differ): as many, ending the same way.
    assert streamed.count(b"data: ") == whole.count(b"data: ")
    assert streamed.endswith(b"data: [DONE]\n\n")
    assert whole.endswith(b"data: [DONE]\n\n")


async def test_a_session_posts_its_legs_through_post() -> None:
    fake = FakeCluster(pairs=1)
    transport = PostsOnly(fake)
    async with (
        AsyncCluster.from_dict(fake.cluster_spec, transport=transport) as cluster,
        cluster.session(max_tokens=8) as session,
    ):
        session.append(Message.system("You are terse."), Message.user("Hello"))
        first = await session.turn()
        session.append(Message.user("And again?"))
        second = await session.turn()
        session.append(Message.user("Once more, streamed."))
        events = [event async for event in session.stream()]
    assert first.text
    assert second.text
    assert second.stats.reused_tokens > 0  # the second turn reused the first one's KV
    third = events[-1]
    assert isinstance(third, TurnResult)
    assert third.stats.reused_tokens > second.stats.reused_tokens
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == third.text
    # Each turn: its render (tokenize), the P leg and the D leg (the third one's streamed).
    paths = [url.rsplit(":", 1)[1].split("/", 1)[1] for url in transport.posted]
    assert paths.count("tokenize") >= 3
    assert paths.count("v1/chat/completions") + paths.count("v1/completions") == 6


async def test_a_wrapper_forwarding_post_sees_every_request() -> None:
    """``post`` reached through ``__getattr__`` is not the wrapper's own: it is an httpx2
    transport, and its ``handle_async_request`` gets the turn's posts."""
    fake = FakeCluster(pairs=1)
    transport = Forwarding(fake)
    assert isinstance(transport, Poster)  # the protocol check alone would bypass it
    assert not is_poster(transport)
    async with (
        AsyncCluster.from_dict(fake.cluster_spec, transport=transport) as cluster,
        cluster.session(max_tokens=8) as session,
    ):
        session.append(Message.user("Hello"))
        await session.turn()
    assert "/tokenize" in transport.seen
    assert (
        transport.seen.count("/v1/chat/completions") + transport.seen.count("/v1/completions") == 2
    )
