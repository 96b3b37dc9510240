"""The in-process ASGI transports stream (a chunk reaches the reader before the app sends the
next), tell the app when the reader leaves early, and run the app's lifespan once."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import httpx2
import pytest

from agentkv._asgi_transport import AppTransport, AsyncAppTransport
from agentkv._portal import Portal


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
