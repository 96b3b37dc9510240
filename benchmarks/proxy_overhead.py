"""Proxy overhead: a turn through ``agentkv proxy`` versus the same turn on the SDK directly.

Three processes, as deployed: the fake P/D pair (two pairs, served over HTTP on 127.0.0.1 with
SERVER_MS of simulated server time on every chat leg, so that sessions overlap the way real ones
do), the proxy (uvicorn, ``agentkv.proxy.serve`` on a cluster file), and this one, which runs

* direct: ``AsyncSession.send`` against the fake pair, and
* proxy: an ``aiohttp`` client re-sending each session's whole history to the proxy, as OpenAI
  clients do, with ``X-Session-ID``.

Same conversations on both paths: a ~CONTEXT-token system prompt, then TURNS user turns, with
CONCURRENCY sessions at a time. The sessions of a level start spread over one turn's server time,
as independent agents arrive (``--start lockstep`` starts them together: with the same server time
on every leg they then stay in step, and every leg becomes a burst of CONCURRENCY requests that
one event loop serves one after another, a queueing test rather than the hop's cost). The two
paths alternate in rounds (at least MIN_ROUNDS a level), so that drifting machine load weighs on
both alike. With ``--pin`` (the default on a machine with two cores or more) the fake pair, which
stands for GPU servers on other machines, has a core to itself, so that it answers both paths
equally fast; the application and the SDK share another core: in this one process (direct), or
as this process's client and the proxy (proxied). Columns:

* direct / proxy: per-turn latency as the caller sees it (median, p99);
* overhead: proxy minus direct (median, p99): the HTTP hop, uvicorn, and the proxy's own work;
* added: per proxied request, its latency minus the SDK's turn inside the proxy (``Server-Timing``
  ``turn``): what the proxy path adds around the turn (the HTTP hop both ways, uvicorn and
  Starlette, the proxy's code), measured on each request rather than across the two paths;
* in-proxy: the proxy's own work per request as its ``Server-Timing`` header reports it (request
  arrival to answer, minus the SDK's turn): the part the proxy's code controls;
* CPU/turn: CPU seconds per turn of the process running the SDK (this one for direct, the proxy
  for proxy): their difference is the proxy's CPU cost, whatever else the machine is doing; the
  client's (an aiohttp client re-sending the history) and the fake pair's, for the proxied turns.

    .venv/bin/python benchmarks/proxy_overhead.py [--concurrency 1,16,64] [--turns 6]
        [--server-ms 100] [--context 1000] [--min-samples 120] [--min-rounds 3]
        [--start staggered|lockstep] [--pin|--no-pin]

Every process here sends with the SDK's default transport (``agentkv._wire.transport``, on
aiohttp's public ``ClientSession`` since issue 28). An earlier transport (aiohttp's private
modules up to 0ee2cfd, a hand-written HTTP/1.1 client up to a898df9) is measured by running this
file against that tree: ``git archive 0ee2cfd | tar -x -C /tmp/base``, then
``PYTHONPATH=/tmp/base .venv/bin/python /tmp/base/benchmarks/proxy_overhead.py``
(``docs/proxy.md``, "Overhead", has the figures). That changes the client and the fake too;
``--proxy-tree /tmp/base`` changes the proxy alone (its process imports that tree's agentkv;
this file, the client and the fake are this tree's).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Coroutine, MutableMapping
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import httpx2
import orjson
import structlog

from agentkv import AsyncCluster, Message
from agentkv.proxy import ProxyConfig
from agentkv.testing import FakeCluster, FakeServer

Scope = MutableMapping[str, Any]
T = TypeVar("T")


def _silence_logs() -> None:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


# With --pin (the default where the OS allows it): the fake pair, which stands for GPU servers on
# other machines, has core 0 to itself on both paths, so that its answers are as fast for one
# path as for the other. The application and the SDK share core 1: in this one process (direct),
# or as this process's client and the proxy (proxied).
# ("Core 0" and "core 1": the first two of the cores this process may run on.)
APP_CORE, FAKE_CORE = 1, 0
_CORES = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []


def _pin(pid: int, core: int, args: argparse.Namespace) -> None:
    if args.pin:
        os.sched_setaffinity(pid, {_CORES[core]})


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _system_prompt(tokens: int) -> str:
    tokenizer = FakeCluster(pairs=1).tokenizer
    sentence = "agents reuse the decode node's cache so every later turn starts warm "
    text = ""
    while len(tokenizer.encode(text)) < tokens:
        text += sentence
    return text


def _question(session: int, turn: int) -> str:
    return f"Question {turn} of session {session}: what should the agent do next?"


# --- child process: the fake pair over HTTP ------------------------------------------------------


def _fake_app(server: FakeServer, delay_s: float) -> Callable[..., Awaitable[None]]:
    async def app(scope: Scope, receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        if scope["type"] != "http":
            return
        body, more = b"", True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = bool(message.get("more_body", False))
        if scope["path"] == "/v1/chat/completions":
            await asyncio.sleep(delay_s)  # what the GPU would take; costs no CPU here
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        reply = server.handle(scope["method"], scope["path"], headers, body)
        data = reply.body()
        out = [(b"content-length", str(len(data)).encode())]
        if reply.content_type:
            out.append((b"content-type", reply.content_type.encode()))
        await send({"type": "http.response.start", "status": reply.status, "headers": out})
        await send({"type": "http.response.body", "body": data})

    return app


async def _serve_fake(args: argparse.Namespace) -> None:
    import uvicorn

    from agentkv.testing._fake_protocol import parse_json_body

    fake = FakeCluster(pairs=2)
    ports: dict[str, int] = {}
    servers = []
    for server in fake.servers:
        # The fake keeps a deep copy of every request for tests to read; a benchmark of
        # thousands of turns has no reader for it, and copying a whole history costs ~1 ms.
        server._record = lambda body, headers: parse_json_body(body, headers.get("content-type"))  # type: ignore[method-assign]
        ports[server.name] = _free_port()
        config = uvicorn.Config(
            _fake_app(server, args.server_ms / 1000),
            host="127.0.0.1",
            port=ports[server.name],
            log_level="warning",
            lifespan="off",
            access_log=False,
            # Not the default 5 s: the SDK's httpx2 pool also keeps idle connections 5 s, and the
            # race between the two closes makes turns retry (see the closing note).
            timeout_keep_alive=75,
        )
        servers.append(uvicorn.Server(config))
    spec = {
        "model": fake.model,
        "pairs": [
            {
                "name": f"pair-{i}",
                "prefill": f"http://127.0.0.1:{ports[fake.prefill(i).name]}",
                "decode": f"http://127.0.0.1:{ports[fake.decode(i).name]}",
            }
            for i in range(2)
        ],
    }
    Path(args.cluster_file).write_text(json.dumps(spec))  # noqa: ASYNC240 - once, before serving
    await asyncio.gather(*(server.serve() for server in servers))


def _serve_proxy(args: argparse.Namespace) -> None:
    """Child process: the proxy as ``agentkv proxy`` runs it."""
    from agentkv.proxy._server import run

    _silence_logs()
    run(args.cluster_file, ProxyConfig(port=args.port, max_sessions=100_000), log_level="warning")


def _spawn(
    argv: list[str],
    ready: Callable[[], bool],
    *,
    script: str = __file__,
    pythonpath: str | None = None,
) -> subprocess.Popen[bytes]:
    """Start ``script`` (this file by default) with ``argv``, importing ``agentkv`` from
    ``pythonpath`` when given; wait until ``ready()``."""
    env = None if pythonpath is None else {**os.environ, "PYTHONPATH": pythonpath}
    process = subprocess.Popen([sys.executable, script, *argv], env=env)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{argv[0]} exited with {process.returncode}")
        if ready():
            return process
        time.sleep(0.2)
    process.terminate()
    raise RuntimeError(f"{argv[0]} did not start")


def _healthy(url: str) -> bool:
    try:
        return httpx2.get(url, timeout=1).status_code == 200
    except httpx2.HTTPError:
        return False


# --- the two paths ------------------------------------------------------------------------------


class Samples:
    def __init__(self) -> None:
        self.latency: list[float] = []
        self.in_proxy: list[float] = []
        self.added: list[float] = []
        self.cpu = 0.0
        self.client_cpu = 0.0
        self.fake_cpu = 0.0


def _start_delay_s(args: argparse.Namespace, i: int, level: int) -> float:
    """When session ``i`` of ``level`` starts: spread over one turn's server time, as independent
    agents arrive, or all at once (``--start lockstep``)."""
    if args.start == "lockstep":
        return 0.0
    return i / level * 2 * args.server_ms / 1000


async def _direct(
    args: argparse.Namespace, cluster: AsyncCluster, system: str, *, level: int, into: Samples
) -> None:
    """``level`` sessions at once on the SDK, in this process."""

    async def one(i: int) -> None:
        await asyncio.sleep(_start_delay_s(args, i, level))
        async with cluster.session(max_tokens=args.max_tokens, temperature=None) as s:
            s.append(Message.system(system))
            for turn in range(args.turns):
                start = time.perf_counter()
                await s.send(_question(i, turn))
                into.latency.append(time.perf_counter() - start)

    cpu = time.process_time()
    await asyncio.gather(*(one(i) for i in range(level)))
    into.cpu += time.process_time() - cpu


def _timings_s(header: str) -> dict[str, float]:
    """The proxy's ``Server-Timing`` header: ``turn`` (the SDK's) and ``proxy`` (around it)."""
    timings = {}
    for part in header.split(","):
        name, _, dur = part.strip().partition(";dur=")
        timings[name] = float(dur) / 1000
    if not {"turn", "proxy"} <= timings.keys():
        raise ValueError(f"no turn and proxy timings in {header!r}")
    return timings


async def _proxied(
    args: argparse.Namespace,
    client: aiohttp.ClientSession,
    system: str,
    *,
    pid: int,
    level: int,
    tag: str,
    into: Samples,
) -> None:
    """``level`` sessions at once through the proxy (process ``pid``)."""

    async def one(i: int) -> None:
        messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
        headers = {
            "X-Session-ID": f"{tag}-{i}",
            "Authorization": "Bearer bench",
            "Content-Type": "application/json",
        }
        await asyncio.sleep(_start_delay_s(args, i, level))
        for turn in range(args.turns):
            messages.append({"role": "user", "content": _question(i, turn)})
            body = orjson.dumps({"messages": messages, "max_tokens": args.max_tokens})
            start = time.perf_counter()
            async with client.post("/v1/chat/completions", data=body, headers=headers) as response:
                data = orjson.loads(await response.read())
            into.latency.append(time.perf_counter() - start)
            if response.status != 200:
                raise RuntimeError(f"proxy answered {response.status}: {data}")
            timings = _timings_s(response.headers["server-timing"])
            into.in_proxy.append(timings["proxy"])
            into.added.append(into.latency[-1] - timings["turn"])
            messages.append(data["choices"][0]["message"])
        async with client.delete(f"/v1/sessions/{tag}-{i}", headers=headers):
            pass

    cpu, client_cpu = _cpu_seconds(pid), time.process_time()
    await asyncio.gather(*(one(i) for i in range(level)))
    into.cpu += _cpu_seconds(pid) - cpu
    into.client_cpu += time.process_time() - client_cpu


async def _measure(
    args: argparse.Namespace, system: str, url: str, pid: int, fake_pid: int
) -> list[tuple[int, Samples, Samples]]:
    rows = []
    _pin(0, APP_CORE, args)  # after starting the children, which pin themselves
    # The client stands for an OpenAI client (the application); it gets aiohttp's client, as
    # the SDK's default sends with, so that its CPU stays small beside the proxy's.
    async with (
        AsyncCluster.from_file(args.cluster_file) as cluster,
        aiohttp.ClientSession(
            base_url=url,
            connector=aiohttp.TCPConnector(limit=512),
            timeout=aiohttp.ClientTimeout(total=120.0),
        ) as client,
    ):
        # Warm both paths (template anchors, connections) outside the numbers.
        await _direct(args, cluster, system, level=4, into=Samples())
        await _proxied(args, client, system, pid=pid, level=4, tag="warm", into=Samples())
        for level in (int(c) for c in args.concurrency.split(",")):
            # Alternate the two paths in rounds, so that a machine whose load drifts (other
            # jobs) weighs on both alike.
            direct, proxied = Samples(), Samples()
            rounds = max(args.min_rounds, math.ceil(args.min_samples / args.turns / level))
            for r in range(rounds):
                await _direct(args, cluster, system, level=level, into=direct)
                fake_cpu = _cpu_seconds(fake_pid)
                await _proxied(
                    args, client, system, pid=pid, level=level, tag=f"c{level}-{r}", into=proxied
                )
                proxied.fake_cpu += _cpu_seconds(fake_pid) - fake_cpu
            rows.append((level, direct, proxied))
    return rows


# --- report ---------------------------------------------------------------------------------------


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]


def _ms(values: list[float]) -> tuple[float, float]:
    return statistics.median(values) * 1e3, _p99(values) * 1e3


def _run_loop(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` on uvloop when installed, as ``agentkv proxy`` does."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def _run(args: argparse.Namespace) -> list[tuple[int, Samples, Samples]]:
    system = _system_prompt(args.context)
    pin = "--pin" if args.pin else "--no-pin"
    fake = _spawn(
        [
            "--serve-fake",
            pin,
            "--cluster-file",
            args.cluster_file,
            "--server-ms",
            str(args.server_ms),
        ],
        lambda: Path(args.cluster_file).exists(),
    )
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    try:
        proxy = _spawn(
            ["--serve-proxy", pin, "--cluster-file", args.cluster_file, "--port", str(port)],
            lambda: _healthy(f"{url}/healthz"),
            pythonpath=args.proxy_tree,
        )
        try:
            # The same event loop as the proxy's (``agentkv proxy`` runs on uvloop when installed).
            return _run_loop(_measure(args, system, url, proxy.pid, fake.pid))
        finally:
            proxy.terminate()
            proxy.wait(timeout=30)
    finally:
        fake.terminate()
        fake.wait(timeout=30)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", default="1,16,64")
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--server-ms", type=float, default=100.0, help="per chat leg")
    parser.add_argument("--context", type=int, default=1000, help="system prompt tokens")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--min-samples", type=int, default=120, help="turns per level, at least")
    parser.add_argument("--min-rounds", type=int, default=3, help="rounds per level, at least")
    parser.add_argument(
        "--start",
        choices=("staggered", "lockstep"),
        default="staggered",
        help="sessions start spread over one turn's server time, or all at once",
    )
    parser.add_argument(
        "--pin",
        action=argparse.BooleanOptionalAction,
        default=len(_CORES) >= 2,
        help="give the fake pair a core of its own; the application and the SDK share another",
    )
    parser.add_argument(
        "--proxy-tree",
        help="run the proxy of another checkout (its agentkv), under this tree's client and fake",
    )
    parser.add_argument("--serve-fake", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--serve-proxy", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--cluster-file", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_fake:
        _pin(0, FAKE_CORE, args)
        _silence_logs()
        # The fake stands in for servers on other machines: on uvloop it takes less of the CPU
        # the measured processes share with it here.
        _run_loop(_serve_fake(args))
        return 0
    if args.serve_proxy:
        _pin(0, APP_CORE, args)
        _serve_proxy(args)
        return 0

    _silence_logs()
    with tempfile.TemporaryDirectory() as tmp:
        args.cluster_file = str(Path(tmp) / "cluster.json")
        rows = _run(args)

    print(
        f"proxy overhead per turn: {args.turns} turns a session, ~{args.context}-token system "
        f"prompt, fake P/D pair over HTTP with {args.server_ms:g} ms server time per chat leg, "
        f"sessions start {args.start}, "
        f"{'fake pair on a core of its own' if args.pin else 'no pinning'}; "
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
    )
    head = (
        f"{'sessions':>8} {'turns':>5} | {'direct':>7} {'p99':>7} | {'proxy':>7} {'p99':>7} | "
        f"{'overhead':>8} {'p99':>7} | {'added':>6} {'p99':>6} | {'in-proxy':>8} {'p99':>6} | "
        f"{'CPU/turn':>8} {'proxy':>6} "
        f"{'client':>6} {'fake':>5}"
    )
    print(head)
    print("-" * len(head))
    for level, direct, proxied in rows:
        n = len(direct.latency)
        dm, dp = _ms(direct.latency)
        pm, pp = _ms(proxied.latency)
        im, ip = _ms(proxied.in_proxy)
        am, ap = _ms(proxied.added)
        print(
            f"{level:>8} {n:>5} | {dm:>7.2f} {dp:>7.2f} | {pm:>7.2f} {pp:>7.2f} | "
            f"{pm - dm:>8.2f} {pp - dp:>7.2f} | {am:>6.2f} {ap:>6.2f} | {im:>8.3f} {ip:>6.3f} | "
            f"{direct.cpu / n * 1e3:>8.2f} {proxied.cpu / n * 1e3:>6.2f} "
            f"{proxied.client_cpu / n * 1e3:>6.2f} {proxied.fake_cpu / n * 1e3:>5.2f}"
        )
    print(
        "(ms; CPU/turn: the process running the SDK, this one for direct, the proxy's for proxy; "
        "client: this process's CPU sending the proxied turns; fake: the fake pair's, proxied "
        "turns)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
