"""The Redis session store's cost per turn with replicas as deployed: each its own process.

``benchmarks/redis_state.py`` runs its proxies in one process, so one replica's commit (written
behind its answer) runs on the same core and event loop as the next request on the other replica,
and is charged to it. Here every part is a process of its own, talking over loopback as in a
deployment: the fake P/D pair served over HTTP (``proxy_overhead.py``'s), Redis (started here on
a free port, stopped by pid), one or two proxies as ``agentkv proxy`` runs them (uvicorn, on
uvloop when installed), and this client, which re-sends each session's whole history with
``X-Session-ID`` as OpenAI clients do, one request at a time:

* memory: one proxy, sessions in its memory (the default);
* memory-2: two proxies without a store, two sessions' turns interleaved, each session on one
  of them: every request goes to the other process than the one before it, whose caches are
  colder and which has to wake up for it; the baseline of redis-2;
* redis-1: one proxy with ``--state redis://...``;
* redis-2: two proxies on that Redis, each session's turns alternating between them: every
  request goes to the other process, as in memory-2, and every turn restores the snapshot the
  other replica committed.

SESSIONS conversations of TURNS turns (a ~1,400-token system prompt), the modes alternating in
rounds so that drifting machine load weighs on all alike; fresh session ids every round, each
session deleted when its turns are done. ``--think-ms`` pauses after each answer (an agent's
tool call; 0 sends the next request as soon as the answer is in, which leaves a commit written
behind the answer the least time to land). Columns: median and p99 latency as the client sees
it, the added median versus memory, **store added** (versus the same topology without a store:
memory for redis-1, memory-2 for redis-2), and the median of the proxies' ``Server-Timing``:
the SDK's turn, the proxy's own work around it, and the store's part of that.

    .venv/bin/python benchmarks/redis_replicas.py [--sessions 24] [--turns 8] [--rounds 3]
        [--think-ms 0] [--server-ms 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx2

# Run as a script: this folder is on sys.path.
from proxy_overhead import (  # type: ignore[import-not-found]
    _free_port,
    _healthy,
    _run_loop,
    _silence_logs,
    _spawn,
)
from redis_state import SYSTEM, _cpu_name, _redis_server  # type: ignore[import-not-found]

from agentkv.proxy import ProxyConfig

MODES = ("memory", "memory-2", "redis-1", "redis-2")


def _serve_proxy(args: argparse.Namespace) -> None:
    """Child process: one proxy replica, as ``agentkv proxy`` runs it."""
    from agentkv.proxy._server import run

    _silence_logs()
    config = ProxyConfig(port=args.port, max_sessions=100_000, state=args.state or None)
    run(args.cluster_file, config, log_level="warning")


def _samples() -> dict[str, list[float]]:
    return {"latency": [], "turn": [], "proxy": [], "store": []}


def _timing(header: str) -> dict[str, float]:
    parts = (part.strip().split(";dur=") for part in header.split(","))
    return {name: float(ms) for name, ms in parts}


async def _round(
    mode: str, urls: list[str], args: argparse.Namespace, out: dict[str, list[float]]
) -> None:
    """SESSIONS conversations. ``redis-2``: one at a time, its turns alternating replicas;
    ``memory-2``: two at a time, their turns interleaved, each session on one of two replicas.
    Either way every request goes to the other replica than the one before it; only in
    ``redis-2`` does it find its session's last turn there."""
    run_id = uuid.uuid4().hex[:8]
    group = 1 if mode == "redis-2" else 2
    async with httpx2.AsyncClient(timeout=30) as client:
        for first in range(0, args.sessions, group):
            sessions = [i for i in range(first, first + group) if i < args.sessions]
            histories: dict[int, list[dict[str, Any]]] = {
                i: [{"role": "system", "content": SYSTEM}] for i in sessions
            }
            for turn in range(args.turns):
                for i in sessions:
                    index = turn if mode == "redis-2" else i
                    await _ask(
                        client,
                        urls[index % len(urls)],
                        f"{mode}-{run_id}-{i}",
                        histories[i],
                        f"Question {turn} of session {i}?",
                        args=args,
                        out=out,
                    )
            for i in sessions:
                url = urls[i % len(urls)]  # memory-2: the replica that holds it
                ended = await client.delete(f"{url}/v1/sessions/{mode}-{run_id}-{i}")
                if ended.is_error:
                    raise RuntimeError(f"DELETE: {ended.status_code} {ended.text}")


async def _ask(
    client: httpx2.AsyncClient,
    url: str,
    session: str,
    messages: list[dict[str, Any]],
    question: str,
    *,
    args: argparse.Namespace,
    out: dict[str, list[float]],
) -> None:
    messages.append({"role": "user", "content": question})
    started = time.perf_counter()
    response = await client.post(
        f"{url}/v1/chat/completions",
        json={"model": args.model, "messages": messages, "max_tokens": 32},
        headers={"X-Session-ID": session},
    )
    elapsed = time.perf_counter() - started
    if response.is_error:
        raise RuntimeError(f"{session}: {response.status_code} {response.text}")
    timing = _timing(response.headers["server-timing"])
    out["latency"].append(elapsed)
    out["turn"].append(timing["turn"] / 1e3)
    out["proxy"].append(timing["proxy"] / 1e3)
    out["store"].append(timing.get("store", 0.0) / 1e3)
    messages.append(response.json()["choices"][0]["message"])
    if args.think_ms:
        await asyncio.sleep(args.think_ms / 1e3)


def _proxy(cluster_file: str, state: str) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    argv = ["--serve-proxy", "--cluster-file", cluster_file, "--port", str(port)]
    process = _spawn([*argv, "--state", state], lambda: _healthy(f"{url}/healthz"), script=__file__)
    return process, url


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--sessions", type=int, default=24)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--think-ms", type=float, default=0.0)
    parser.add_argument("--server-ms", type=float, default=2.0, help="per chat leg, fake pair")
    parser.add_argument("--serve-proxy", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--cluster-file", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--state", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_proxy:
        _serve_proxy(args)
        return 0
    redis_process, redis_url = _redis_server()
    cluster_file = str(Path(tempfile.mkdtemp(prefix="agentkv-replicas-")) / "cluster.json")
    fake_argv = ["--serve-fake", "--no-pin", "--cluster-file", cluster_file]
    fake = _spawn(  # proxy_overhead.py's own --serve-fake
        [*fake_argv, "--server-ms", str(args.server_ms)], lambda: Path(cluster_file).exists()
    )
    processes = [fake]
    try:
        args.model = json.loads(Path(cluster_file).read_text())["model"]
        memory, memory_url = _proxy(cluster_file, "")
        other, other_url = _proxy(cluster_file, "")
        first, first_url = _proxy(cluster_file, redis_url)
        second, second_url = _proxy(cluster_file, redis_url)
        processes += [memory, other, first, second]
        urls = {
            "memory": [memory_url],
            "memory-2": [memory_url, other_url],
            "redis-1": [first_url],
            "redis-2": [first_url, second_url],
        }
        samples = {mode: _samples() for mode in MODES}
        # Warm every proxy (imports, templates, connections, scripts) before measuring.
        warm_args = argparse.Namespace(**{**vars(args), "sessions": 2})
        for mode in MODES:
            _run_loop(_round(mode, urls[mode], warm_args, _samples()))
        for _ in range(args.rounds):  # alternate, so drifting machine load weighs on all alike
            for mode in MODES:
                _run_loop(_round(mode, urls[mode], args, samples[mode]))
            print(f"{len(samples['memory']['latency'])} turns per mode", file=sys.stderr)
    finally:
        for process in processes:
            process.terminate()
            process.wait(timeout=30)
        redis_process.terminate()
        redis_process.wait(timeout=10)
    medians = {mode: statistics.median(samples[mode]["latency"]) for mode in MODES}
    # The same topology without a store: one replica for redis-1, two taking turns for redis-2.
    baseline = {
        "memory": "memory",
        "memory-2": "memory",
        "redis-1": "memory",
        "redis-2": "memory-2",
    }
    print(
        f"CPU: {_cpu_name()}; {args.sessions} sessions x {args.turns} turns x {args.rounds} "
        f"rounds, one request at a time, think time {args.think_ms:g} ms, fake legs "
        f"{args.server_ms:g} ms; every replica, the fake pair and Redis in their own processes"
    )
    print(
        f"{'mode':8} {'median ms':>10} {'p99 ms':>8} {'added ms':>9} {'store added':>11} "
        f"{'turn ms':>8} {'proxy ms':>8} {'store ms':>8}"
    )
    for mode in MODES:
        s = samples[mode]
        latency = sorted(s["latency"])
        store_added = medians[mode] - medians[baseline[mode]]
        print(
            f"{mode:8} {medians[mode] * 1e3:10.3f} "
            f"{latency[int(0.99 * (len(latency) - 1))] * 1e3:8.3f} "
            f"{(medians[mode] - medians['memory']) * 1e3:9.3f} "
            f"{store_added * 1e3 if mode.startswith('redis') else 0.0:11.3f} "
            f"{statistics.median(s['turn']) * 1e3:8.3f} "
            f"{statistics.median(s['proxy']) * 1e3:8.3f} {statistics.median(s['store']) * 1e3:8.3f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
