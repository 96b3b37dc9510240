"""Run the proxy on uvicorn: in the foreground (the CLI) or on a background thread (tests, benches).

>>> from agentkv import AsyncCluster
>>> from agentkv.testing import FakeCluster
>>> fake = FakeCluster(pairs=1)
>>> make = lambda: AsyncCluster.from_dict(fake.cluster_spec, transport=fake.transport)
>>> with ProxyServer(make) as server:  # doctest: +SKIP
...     server.url
'http://127.0.0.1:...'
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

from starlette.applications import Starlette

from agentkv._cluster import AsyncCluster
from agentkv.proxy._app import create_app
from agentkv.proxy._config import ProxyConfig

if TYPE_CHECKING:
    import uvicorn

__all__ = ["ProxyServer", "run", "serve"]

_START_TIMEOUT_S = 30.0


def _uvicorn_server(app: Starlette, *, log_level: str) -> uvicorn.Server:
    # Lazy: create_app runs on any ASGI server; only serving here needs uvicorn.
    import uvicorn

    config = uvicorn.Config(
        app,
        lifespan="on",
        log_level=log_level,
        access_log=False,  # the proxy logs its own events; a line per request is noise
        http="auto",  # httptools where installed (uvicorn[standard]), else pure-Python h11
        ws="none",
        # Longer than clients keep idle connections (httpx: 5 s, uvicorn's default too): a server
        # that closes first races the client's next request on that connection.
        timeout_keep_alive=75,
        timeout_graceful_shutdown=5,
    )
    return uvicorn.Server(config)


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.setblocking(False)
    return sock


async def serve(cluster_file: str | Path, config: ProxyConfig, *, log_level: str = "info") -> None:
    """Serve until interrupted: open the cluster, run the app, close the cluster."""
    async with AsyncCluster.from_file(cluster_file) as cluster:
        app = create_app(cluster, config)
        server = _uvicorn_server(app, log_level=log_level)
        await server.serve(sockets=[_listen(config.host, config.port)])


def run(cluster_file: str | Path, config: ProxyConfig, *, log_level: str = "info") -> None:
    """Serve in the foreground until interrupted, on uvloop where it is installed."""
    try:
        import uvloop  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        asyncio.run(serve(cluster_file, config, log_level=log_level))
    else:
        uvloop.run(serve(cluster_file, config, log_level=log_level))


class ProxyServer:
    """The proxy on 127.0.0.1 (an ephemeral port by default), on its own thread and event loop.

    ``make_cluster`` runs on that loop (the cluster's HTTP client lives there) and the cluster is
    closed when the server stops.
    """

    def __init__(
        self,
        make_cluster: Callable[[], AsyncCluster],
        config: ProxyConfig | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        log_level: str = "warning",
    ) -> None:
        self._make_cluster = make_cluster
        self._config = config or ProxyConfig(port=0)
        self._clock = clock
        self._log_level = log_level
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="agentkv-proxy", daemon=True)
        self._ready: Future[None] = Future()
        self._server: uvicorn.Server | None = None
        self.app: Starlette | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._main())
        finally:
            self._loop.close()

    async def _main(self) -> None:
        try:
            cluster = self._make_cluster()
            self.app = create_app(cluster, self._config, clock=self._clock)
            sock = _listen("127.0.0.1", self._config.port)
            self.port = sock.getsockname()[1]
            self._server = _uvicorn_server(self.app, log_level=self._log_level)
        except BaseException as exc:
            self._ready.set_exception(exc)
            raise
        try:
            task = asyncio.ensure_future(self._server.serve(sockets=[sock]))
            # uvicorn reports readiness as a flag, not an event.
            while not self._server.started and not task.done():  # noqa: ASYNC110
                await asyncio.sleep(0.005)
            if task.done():
                task.result()
            self._ready.set_result(None)
            await task
        except BaseException as exc:
            if not self._ready.done():
                self._ready.set_exception(exc)
            raise
        finally:
            await cluster.aclose()

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the server's loop (where the app's state lives); return its result.

        A coroutine function's result is awaited there.
        """

        async def run() -> Any:
            result = fn()
            if asyncio.iscoroutine(result):
                result = await result
            return result

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(_START_TIMEOUT_S)

    def __enter__(self) -> ProxyServer:
        self._thread.start()
        self._ready.result(timeout=_START_TIMEOUT_S)
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._server is not None:
            self._server.should_exit = True
        self._thread.join(timeout=_START_TIMEOUT_S)
