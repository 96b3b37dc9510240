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
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from starlette.applications import Starlette

from agentkv._core import AsyncCluster, Portal, listening_socket
from agentkv.proxy._app import create_app
from agentkv.proxy._config import ProxyConfig
from agentkv.proxy._header_deadline import header_deadline_protocol

if TYPE_CHECKING:
    import uvicorn

__all__ = ["ProxyServer", "run", "serve"]

_START_TIMEOUT_S = 30.0


def _uvicorn_server(app: Starlette, config: ProxyConfig, *, log_level: str) -> uvicorn.Server:
    # Lazy: create_app runs on any ASGI server; only serving here needs uvicorn.
    import uvicorn

    server_config = uvicorn.Config(
        app,
        lifespan="on",
        log_level=log_level,
        access_log=False,  # the proxy logs its own events; a line per request is noise
        # httptools where installed (uvicorn[standard]), else pure-Python h11; with the header
        # deadline uvicorn lacks (_header_deadline).
        http="auto"
        if config.header_timeout_s is None
        else header_deadline_protocol(config.header_timeout_s),
        ws="none",
        # Longer than clients keep idle connections (httpx2: 5 s, uvicorn's default too): a server
        # that closes first races the client's next request on that connection.
        timeout_keep_alive=75,
        timeout_graceful_shutdown=5,
        # Connections (idle, uploading, or not past their headers yet) or requests in flight at
        # most; a request past it gets a plain 503 (docs/proxy.md, "Slow clients").
        limit_concurrency=config.max_connections,
    )
    return uvicorn.Server(server_config)


async def serve(cluster_file: str | Path, config: ProxyConfig, *, log_level: str = "info") -> None:
    """Serve until interrupted: open the cluster, run the app, close the cluster."""
    async with AsyncCluster.from_file(cluster_file) as cluster:
        app = create_app(cluster, config)
        server = _uvicorn_server(app, config, log_level=log_level)
        await server.serve(sockets=[listening_socket(config.host, config.port)])


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
        self._portal: Portal | None = None
        self._cluster: AsyncCluster | None = None
        self._server: uvicorn.Server | None = None
        self._serving: asyncio.Task[None] | None = None
        self.app: Starlette | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _start(self) -> None:
        cluster = self._cluster = self._make_cluster()
        try:
            self.app = create_app(cluster, self._config, clock=self._clock)
            sock = listening_socket("127.0.0.1", self._config.port)
            self.port = sock.getsockname()[1]
            server = self._server = _uvicorn_server(
                self.app, self._config, log_level=self._log_level
            )
            serving = self._serving = asyncio.ensure_future(server.serve(sockets=[sock]))
            # uvicorn reports readiness as a flag, not an event.
            while not server.started and not serving.done():  # noqa: ASYNC110
                await asyncio.sleep(0.005)
            if serving.done():
                serving.result()  # what stopped it
                raise RuntimeError("the proxy did not start (its app's startup failed)")
        except BaseException:
            await cluster.aclose()
            raise

    async def _stop(self) -> None:
        try:
            if self._serving is not None:
                await self._serving
        finally:
            if self._cluster is not None:
                await self._cluster.aclose()

    def open_connections(self) -> int:
        """The client connections the server holds now (open, not yet closed by either side)."""
        server = self._server
        if server is None:
            raise RuntimeError("the proxy server is not running")
        return int(self.call(lambda: len(server.server_state.connections)))

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the server's loop (where the app's state lives); return its result.

        A coroutine function's result is awaited there.
        """

        async def run() -> Any:
            result = fn()
            if asyncio.iscoroutine(result):
                result = await result
            return result

        if self._portal is None:
            raise RuntimeError("the proxy server is not running")
        return self._portal.call(run(), timeout=_START_TIMEOUT_S)

    def __enter__(self) -> ProxyServer:
        self._portal = Portal(name="agentkv-proxy")
        try:
            self._portal.call(self._start(), timeout=_START_TIMEOUT_S)
        except BaseException:
            self._portal.close()
            self._portal = None
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        portal, self._portal = self._portal, None
        if portal is None:
            return
        if self._server is not None:
            self._server.should_exit = True
        try:
            portal.call(self._stop(), timeout=_START_TIMEOUT_S)
        finally:
            portal.close()
