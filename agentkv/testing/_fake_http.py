"""Serve fake servers over real HTTP (uvicorn, one port per server, on 127.0.0.1).

For clients that are not Python, or that cannot take an httpx2 transport. Killing a server
closes its listening socket (clients get "connection refused"); restarting it listens on the
same port again.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import socket
from collections.abc import Awaitable, Callable, Coroutine, Iterator, MutableMapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

from agentkv._core import Portal, listening_socket
from agentkv.testing._fake_server import FakeServer

_T = TypeVar("_T")
Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


@dataclass
class _Listener:
    server: FakeServer
    port: int
    closing: asyncio.Event | None = None
    uvicorn_server: Any = None
    task: asyncio.Task[None] | None = None
    remove_hook: Callable[[], None] | None = None


@dataclass(frozen=True)
class ServedCluster:
    """Real URLs of a served cluster."""

    model: str
    urls: dict[str, str]
    """Server name (``fake-p0``) to ``http://127.0.0.1:PORT``."""
    pair_names: list[tuple[str, str]] = field(default_factory=list)

    def url(self, server: FakeServer) -> str:
        return self.urls[server.name]

    @property
    def cluster_spec(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "pairs": [
                {"name": f"pair-{i}", "prefill": self.urls[p], "decode": self.urls[d]}
                for i, (p, d) in enumerate(self.pair_names)
            ],
        }


def _events(data: bytes) -> list[bytes]:
    """A stream's body cut after each event's blank line (a cut-off last event kept as is)."""
    events = [event + b"\n\n" for event in data.split(b"\n\n")]
    events[-1] = events[-1][:-2]  # what followed the last blank line: nothing, or a cut event
    return [event for event in events if event]


def _asgi_app(listener: _Listener) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        body = b""
        more = True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = bool(message.get("more_body", False))
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        reply = listener.server.handle(scope["method"], scope["path"], headers, body)
        if reply.failure == "timeout":
            if listener.closing is not None:
                await listener.closing.wait()
            return
        if reply.failure is not None:
            # Promise a body, then hang up: the client sees a dropped connection.
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-length", b"100")],
                }
            )
            await send({"type": "http.response.body", "body": b"", "more_body": True})
            return
        data = reply.body()
        response_headers = [] if reply.is_stream else [(b"content-length", str(len(data)).encode())]
        if reply.content_type:
            response_headers.append((b"content-type", reply.content_type.encode()))
        await send(
            {"type": "http.response.start", "status": reply.status, "headers": response_headers}
        )
        if not reply.is_stream:
            await send({"type": "http.response.body", "body": data})
            return
        # As vLLM streams: chunked, each event a piece of its own, written a loop pass apart
        # (a client reads them as they come, not as one body).
        for event in _events(data):
            await send({"type": "http.response.body", "body": event, "more_body": True})
            await asyncio.sleep(0)
        await send({"type": "http.response.body", "body": b""})

    return app


class _HttpHost:
    """One uvicorn server per fake server, all on one event loop on a thread (a Portal)."""

    def __init__(self, servers: Sequence[FakeServer]) -> None:
        self._portal: Portal | None = None
        self.listeners = [_Listener(server, port=0) for server in servers]

    def _call(self, coro: Coroutine[Any, Any, _T]) -> _T:
        if self._portal is None:
            coro.close()
            raise RuntimeError("the fake servers are not being served")
        return self._portal.call(coro, timeout=30)

    def start(self) -> None:
        self._portal = Portal(name="agentkv-fake-http")
        for listener in self.listeners:
            if listener.server.alive:
                self._call(self._listen(listener))
            else:
                listener.port = _free_port()
            listener.remove_hook = listener.server.add_lifecycle_listener(
                functools.partial(self._on_lifecycle, listener)
            )

    def _on_lifecycle(self, listener: _Listener, event: str) -> None:
        self._call(self._close(listener))
        if event == "restart":
            self._call(self._listen(listener))

    async def _listen(self, listener: _Listener) -> None:
        # Lazy: uvicorn is an optional dependency, needed only to serve over HTTP.
        import uvicorn

        sock = listening_socket("127.0.0.1", listener.port)
        listener.port = sock.getsockname()[1]
        listener.closing = asyncio.Event()
        config = uvicorn.Config(
            _asgi_app(listener),
            lifespan="off",
            log_level="critical",
            access_log=False,
            http="h11",
            ws="none",
            timeout_graceful_shutdown=1,
        )
        server = uvicorn.Server(config)
        listener.uvicorn_server = server
        listener.task = asyncio.ensure_future(server.serve(sockets=[sock]))
        # uvicorn reports readiness as a flag, not an event.
        while not server.started and not listener.task.done():  # noqa: ASYNC110
            await asyncio.sleep(0.005)

    async def _close(self, listener: _Listener) -> None:
        if listener.task is None:
            return
        if listener.closing is not None:
            listener.closing.set()
        listener.uvicorn_server.should_exit = True
        await listener.task
        listener.task = None

    def stop(self) -> None:
        for listener in self.listeners:
            if listener.remove_hook is not None:
                listener.remove_hook()
            self._call(self._close(listener))
        if self._portal is not None:
            self._portal.close()
            self._portal = None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextmanager
def serve_cluster(
    pairs: Sequence[tuple[FakeServer, FakeServer]], *, model: str
) -> Iterator[ServedCluster]:
    """Serve ``pairs`` of (prefill, decode) servers until the block exits."""
    if importlib.util.find_spec("uvicorn") is None:
        raise RuntimeError("FakeCluster.serve() needs uvicorn: pip install 'agentkv[proxy]'")
    servers = [s for pair in pairs for s in pair]
    host = _HttpHost(servers)
    host.start()
    try:
        yield ServedCluster(
            model=model,
            urls={lst.server.name: f"http://127.0.0.1:{lst.port}" for lst in host.listeners},
            pair_names=[(p.name, d.name) for p, d in pairs],
        )
    finally:
        host.stop()
