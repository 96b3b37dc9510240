"""CPU per request of the SDK's HTTP client against a local server, stack by stack.

A uvicorn server in its own process answers every POST with a ~2 KB JSON body after SERVER_MS
(so requests overlap, as a turn's legs do); this process sends CONCURRENCY loops of REQUESTS
POSTs of a ~3 KB JSON body each and reports its own CPU time per request for:

* ``httpx``: ``httpx.AsyncClient`` (httpx 0.28, when installed) on its default transport
  (httpcore's pool); agentkv's interface was httpx until it moved to httpx2 (its fork);
* ``httpx2``: ``httpx2.AsyncClient`` on its own pool (httpcore2), the openai SDK's client;
* ``aiohttp``: a bare ``aiohttp.ClientSession`` reading each JSON answer: the floor under any
  httpx interface on aiohttp;
* ``httpx-aiohttp``: ``httpx.AsyncClient`` on ``httpx_aiohttp.AiohttpTransport`` (PyPI
  ``httpx-aiohttp``: httpx's interface on a ``ClientSession``), when installed;
* ``pools``: ``agentkv._wire.transport.ServerPools``, the ``Poster`` a cluster sends with, each
  request sent as a turn sends its legs (``agentkv._wire.http.post_json``: the answer parsed);
* ``httpx2-poster``: the same through ``HttpxPoster`` on an ``httpx2.AsyncClient`` (a user's
  ``http_client=``);
* ``base-pools``, ``base-cluster``: httpx's client and ``ClusterClient`` on the ``ServerPools`` of
  another tree's
  ``transport.py`` (``--base FILE``, a module that imports nothing of agentkv's, of a revision on
  httpx, as 0ee2cfd), to compare two versions of the transport in one run:
  ``git show REV:agentkv/_wire/transport.py > /tmp/t.py``.

    .venv/bin/python benchmarks/transport_cpu.py [--concurrency 64] [--requests 30]
        [--server-ms 100] [--clients httpx2,aiohttp,pools,httpx2-poster] [--base FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

import aiohttp
import httpx2

from agentkv._wire.http import HttpxPoster, post_json
from agentkv._wire.transport import ServerPools

ANSWER = b'{"text": "' + b"a" * 2000 + b'"}'
BODY = b'{"prompt": "' + b"1" * 3000 + b'"}'
LIMITS = httpx2.Limits(max_connections=512, max_keepalive_connections=512)


def _serve(port: int, delay_s: float) -> None:
    import uvicorn

    async def app(
        scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]
    ) -> None:
        if scope["type"] != "http":
            return
        more = True
        while more:
            more = bool((await receive()).get("more_body", False))
        await asyncio.sleep(delay_s)
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(ANSWER))]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": ANSWER})

    uvicorn.run(
        app,
        host="127.0.0.1",
        port=port,
        log_level="warning",
        lifespan="off",
        access_log=False,
        timeout_keep_alive=75,
    )


def _load(path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location("base_transport", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _client(kind: str, args: argparse.Namespace) -> Any:
    if kind == "httpx2":
        return httpx2.AsyncClient(limits=LIMITS)
    if kind in ("httpx", "httpx-aiohttp", "base-pools", "base-cluster"):
        return _httpx_client(kind, args)  # httpx (0.28): no longer agentkv's, measured beside it
    if kind == "pools":
        return contextlib.aclosing(ServerPools(LIMITS, 600.0))
    if kind == "httpx2-poster":
        return contextlib.aclosing(HttpxPoster(httpx2.AsyncClient(limits=LIMITS), owned=True))
    raise SystemExit(f"unknown client {kind!r}")


def _httpx_client(kind: str, args: argparse.Namespace) -> Any:
    import httpx  # only for these comparisons: agentkv does not depend on it

    limits = httpx.Limits(max_connections=512, max_keepalive_connections=512)
    if kind == "httpx":
        return httpx.AsyncClient(limits=limits)
    if kind == "httpx-aiohttp":
        from httpx_aiohttp import AiohttpTransport

        return httpx.AsyncClient(transport=AiohttpTransport(limits=limits))
    if args.base is None:
        raise SystemExit(f"{kind} needs --base FILE (a transport.py of a revision on httpx)")
    base = _load(args.base)
    if kind == "base-pools":
        return httpx.AsyncClient(transport=base.ServerPools(limits))
    return base.ClusterClient(transport=base.ServerPools(limits))


async def _measure_aiohttp(url: str, args: argparse.Namespace) -> tuple[float, float]:
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=LIMITS.max_connections or 0)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def loop() -> None:
            for _ in range(args.requests):
                async with session.post(
                    url, data=BODY, headers={"content-type": "application/json"}
                ) as response:
                    response.raise_for_status()
                    json.loads(await response.read())  # as httpx's .json()

        await asyncio.gather(*(loop() for _ in range(args.concurrency)))  # connections, warm
        cpu, wall = time.process_time(), time.perf_counter()
        await asyncio.gather(*(loop() for _ in range(args.concurrency)))
        n = args.concurrency * args.requests
        return (time.process_time() - cpu) / n * 1e6, time.perf_counter() - wall


async def _measure(kind: str, url: str, args: argparse.Namespace) -> tuple[float, float]:
    """(CPU microseconds per request, wall seconds) of one timed pass, after a warm-up pass."""
    if kind == "aiohttp":
        return await _measure_aiohttp(url, args)
    async with _client(kind, args) as client:

        async def loop() -> None:
            for _ in range(args.requests):
                if kind in ("pools", "httpx2-poster"):
                    await post_json(client, url, BODY, summary="POST")
                    continue
                response = await client.post(
                    url, content=BODY, headers={"content-type": "application/json"}
                )
                response.raise_for_status()
                response.json()

        await asyncio.gather(*(loop() for _ in range(args.concurrency)))  # connections, warm
        cpu, wall = time.process_time(), time.perf_counter()
        await asyncio.gather(*(loop() for _ in range(args.concurrency)))
        n = args.concurrency * args.requests
        return (time.process_time() - cpu) / n * 1e6, time.perf_counter() - wall


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--requests", type=int, default=30, help="per concurrent loop")
    parser.add_argument("--server-ms", type=float, default=100.0)
    parser.add_argument("--clients", default="httpx2,aiohttp,pools,httpx2-poster")
    parser.add_argument("--base", help="another tree's transport.py, for base-pools/base-cluster")
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        _serve(args.serve, args.server_ms / 1000)
        return 0

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, __file__, "--serve", str(port), "--server-ms", str(args.server_ms)]
    )
    try:
        url = f"http://127.0.0.1:{port}/v1/x"
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx2.post(url, content=b"{}")
                break
            except httpx2.TransportError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise SystemExit("the server did not start") from None
                time.sleep(0.2)
        print(
            f"{args.concurrency} concurrent loops x {args.requests} POSTs, {args.server_ms:g} ms "
            "server time; CPU of this process per request:"
        )
        for kind in args.clients.split(","):
            try:
                import uvloop
            except ImportError:
                cpu_us, wall_s = asyncio.run(_measure(kind, url, args))
            else:
                cpu_us, wall_s = uvloop.run(_measure(kind, url, args))
            print(f"  {kind:13} {cpu_us:7.0f} us   (pass took {wall_s:.2f} s)", flush=True)
    finally:
        server.terminate()
        server.wait(timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
