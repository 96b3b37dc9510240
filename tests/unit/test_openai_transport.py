"""The in-process ASGI transports stream (a chunk reaches the reader before the app sends the
next), tell the app when the reader leaves early, and run the app's lifespan once."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import httpx2
import pytest

from agentkv._client.portal import Portal
from agentkv._openai.transport import AppTransport, AsyncAppTransport


class StreamingApp:
    """Sends "one", then waits until the test says go before "two"; records what it saw."""

    def __init__(self) -> None:
        self.go = asyncio.Event()
        self.errors: list[str] = []
        self.lifespans: list[str] = []

    async def __call__(self, scope, receive, send):  # type: ignore[no-untyped-def]
        request = await receive()
        assert request["body"] == b"ping"
        await send({"type": "http.response.start", "status": 201, "headers": [(b"x-a", b"1")]})
        try:
            await send({"type": "http.response.body", "body": b"one", "more_body": True})
            await self.go.wait()
            await send({"type": "http.response.body", "body": b"two", "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError as exc:
            self.errors.append(str(exc))

    @contextlib.asynccontextmanager
    async def lifespan(self) -> AsyncIterator[None]:
        self.lifespans.append("start")
        yield
        self.lifespans.append("stop")


async def test_an_async_response_streams_before_the_app_finishes():
    app = StreamingApp()
    transport = AsyncAppTransport(app, model="m", lifespan=app.lifespan)
    async with httpx2.AsyncClient(transport=transport, base_url="http://x") as client:
        async with client.stream("POST", "/p", content=b"ping") as response:
            assert (response.status_code, response.headers["x-a"]) == (201, "1")
            chunks = response.aiter_bytes()
            # httpx2's own ASGITransport would wait here forever: it returns after the app ends.
            assert await asyncio.wait_for(anext(chunks), 1) == b"one"
            app.go.set()
            assert [chunk async for chunk in chunks] == [b"two"]
        assert app.lifespans == ["start"]
    assert app.lifespans == ["start", "stop"]
    assert app.errors == []


async def test_closing_an_async_response_early_tells_the_app():
    app = StreamingApp()
    transport = AsyncAppTransport(app, model="m", lifespan=app.lifespan)
    async with httpx2.AsyncClient(transport=transport, base_url="http://x") as client:
        async with client.stream("POST", "/p", content=b"ping") as response:
            assert await anext(response.aiter_bytes()) == b"one"
        app.go.set()
        await asyncio.sleep(0)
        assert app.errors == ["the client closed the response"]


async def test_an_app_failing_mid_body_is_a_cut_connection():
    async def app(scope, receive, send):  # type: ignore[no-untyped-def]
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
        raise RuntimeError("decode failed")

    @contextlib.asynccontextmanager
    async def nothing() -> AsyncIterator[None]:
        yield

    transport = AsyncAppTransport(app, model="m", lifespan=nothing)
    async with (
        httpx2.AsyncClient(transport=transport, base_url="http://x") as client,
        client.stream("POST", "/p", content=b"") as response,
    ):
        chunks = response.aiter_bytes()
        assert await anext(chunks) == b"data: 1\n\n"
        with pytest.raises(httpx2.RemoteProtocolError):
            await anext(chunks)


def test_a_sync_response_streams_from_the_portals_loop_and_close_ends_the_lifespan():
    portal = Portal()
    try:
        app = portal.call(_make_app())
        closed: list[bool] = []
        transport = AppTransport(
            app, model="m", portal=portal, lifespan=app.lifespan, on_close=lambda: closed.append(1)
        )
        assert app.lifespans == ["start"]
        with (
            httpx2.Client(transport=transport, base_url="http://x") as client,
            client.stream("POST", "/p", content=b"ping") as response,
        ):
            chunks = response.iter_bytes()
            assert next(chunks) == b"one"
            portal.call(_set(app.go))
            assert list(chunks) == [b"two"]
        assert app.lifespans == ["start", "stop"]
        assert closed == [1]
        with pytest.raises(RuntimeError):
            transport.handle_request(httpx2.Request("GET", "http://x/"))
    finally:
        portal.close()


async def _make_app() -> StreamingApp:
    return StreamingApp()  # its Event belongs to the portal's loop


async def _set(event: asyncio.Event) -> None:
    event.set()


class _Routed:
    """A Starlette app with one JSON endpoint and one streamed one, both also given as direct
    endpoints; records which way each request came."""

    def __init__(self) -> None:
        from starlette.applications import Starlette
        from starlette.requests import Request
        from starlette.responses import Response, StreamingResponse
        from starlette.routing import Route

        self.calls: list[str] = []
        self.stream_errors: list[str] = []

        async def answer(request: Request) -> Response:
            body = await request.body()
            self.calls.append(f"answer:{request.headers.get('x-way', '')}")
            return Response(
                b"echo:" + body, status_code=201, headers={"x-b": "2"}, media_type="text/plain"
            )

        async def chunks() -> AsyncIterator[bytes]:
            while True:  # endless: only the client leaving ends it
                yield b"tick"
                await asyncio.sleep(0)

        errors = self.stream_errors

        class Recorded(StreamingResponse):
            async def __call__(self, scope, receive, send):  # type: ignore[no-untyped-def]
                try:
                    await super().__call__(scope, receive, send)
                except BaseException as exc:
                    errors.append(type(exc).__name__)
                    raise

        async def stream(request: Request) -> Response:
            await request.body()
            return Recorded(chunks(), media_type="text/event-stream")

        async def outer(scope, receive, send):  # type: ignore[no-untyped-def]
            scope["headers"] = [*scope["headers"], (b"x-way", b"app")]
            await self.app(scope, receive, send)

        self.app = Starlette(routes=[Route("/a", answer, methods=["POST"])])
        self.outer = outer
        self.direct = {("POST", "/a"): answer, ("POST", "/s"): stream}

    @contextlib.asynccontextmanager
    async def lifespan(self) -> AsyncIterator[None]:
        yield


async def test_a_direct_endpoint_answers_as_the_app_would_without_its_routing():
    routed = _Routed()
    via_app = AsyncAppTransport(routed.outer, model="m", lifespan=routed.lifespan)
    direct = AsyncAppTransport(
        routed.outer, model="m", lifespan=routed.lifespan, direct=routed.direct
    )
    async with (
        httpx2.AsyncClient(transport=via_app, base_url="http://x") as slow,
        httpx2.AsyncClient(transport=direct, base_url="http://x") as fast,
    ):
        expected = await slow.post("/a", content=b"hi")
        answer = await fast.post("/a", content=b"hi")
        # A path that is not direct goes through the app (its 404 here).
        missing = await fast.post("/nowhere", content=b"hi")
    assert routed.calls == ["answer:app", "answer:"]
    assert (answer.status_code, answer.content, answer.headers.raw) == (
        expected.status_code,
        expected.content,
        expected.headers.raw,
    )
    assert (answer.status_code, answer.content) == (201, b"echo:hi")
    assert missing.status_code == 404


async def test_a_streamed_direct_answer_streams_and_hears_the_client_leave():
    routed = _Routed()
    transport = AsyncAppTransport(
        routed.outer, model="m", lifespan=routed.lifespan, direct=routed.direct
    )
    async with (
        httpx2.AsyncClient(transport=transport, base_url="http://x") as client,
        client.stream("POST", "/s", content=b"") as response,
    ):
        assert response.headers["content-type"].startswith("text/event-stream")
        assert await asyncio.wait_for(anext(response.aiter_bytes()), 1) == b"tick"
    # Closing the response ended the endless stream (this line is reached at all), and the
    # response heard it as the proxy's streams do.
    assert routed.stream_errors == ["ClientDisconnect"]
