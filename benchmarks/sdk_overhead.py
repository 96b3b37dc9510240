"""SDK overhead per turn against the fake cluster, and memory per idle session.

Overhead is a turn's time minus the time spent inside the fake servers' handlers (measured by
wrapping the fake's transport), so it is what agentkv itself (with httpx2) costs a turn: the
template-delta request, building and parsing the legs' JSON, the transcript, the policy, stats
and logs. Turns run one at a time so nothing else shares the loop.

Both CPU time (``time.thread_time``: the async core and the fake share one thread) and wall time
are reported; on a machine shared with other work, the CPU figure is the stable one.

    .venv/bin/python benchmarks/sdk_overhead.py [--turns 8] [--sessions 30] [--context 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable

import httpx2
import structlog

from agentkv import AsyncCluster, Cluster, Message
from agentkv.testing import FakeCluster, ManualClock


class TimedTransport(httpx2.AsyncBaseTransport):
    """Counts the wall and CPU seconds spent inside the wrapped (fake server) transport."""

    def __init__(self, inner: httpx2.AsyncBaseTransport) -> None:
        self.inner = inner
        self.server_s = 0.0
        self.server_cpu_s = 0.0

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        start, cpu = time.perf_counter(), time.thread_time()
        try:
            return await self.inner.handle_async_request(request)
        finally:
            self.server_s += time.perf_counter() - start
            self.server_cpu_s += time.thread_time() - cpu


def _system_prompt(fake: FakeCluster, tokens: int) -> str:
    sentence = "agents reuse the decode node's cache so every later turn starts warm "
    text = ""
    while len(fake.tokenizer.encode(text)) < tokens:
        text += sentence
    return text


def _forget_requests(fake: FakeCluster) -> None:
    """Drop the fake's request log: it only grows, and collecting it is not agentkv's cost."""
    for server in fake.servers:
        server.requests.clear()


def _quantiles(values: list[float]) -> tuple[float, float]:
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return statistics.median(ordered), p99


class Samples:
    def __init__(self) -> None:
        self.cpu: list[float] = []
        self.wall: list[float] = []
        self.server: list[float] = []
        self.prompt_tokens = 0


async def _async_overheads(args: argparse.Namespace) -> Samples:
    fake = FakeCluster(pairs=2, clock=ManualClock())
    timed = TimedTransport(fake.transport)
    system = _system_prompt(fake, args.context)
    samples = Samples()
    async with AsyncCluster.from_dict(fake.cluster_spec, transport=timed) as cluster:
        for i in range(args.sessions):
            async with cluster.session(max_tokens=args.max_tokens) as s:
                s.append(Message.system(system))
                for turn in range(args.turns):
                    s.append(Message.user(f"Question {turn} of session {i}: what next?"))
                    server, server_cpu = timed.server_s, timed.server_cpu_s
                    start, cpu = time.perf_counter(), time.thread_time()
                    result = await s.turn()
                    wall = time.perf_counter() - start
                    used = time.thread_time() - cpu
                    if i:  # session 0 warms caches (anchor renders, imports)
                        samples.wall.append(wall - (timed.server_s - server))
                        samples.cpu.append(used - (timed.server_cpu_s - server_cpu))
                        samples.server.append(timed.server_s - server)
                    samples.prompt_tokens = max(samples.prompt_tokens, result.stats.prompt_tokens)
                    _forget_requests(fake)
    return samples


def _sync_overheads(args: argparse.Namespace) -> list[float]:
    fake = FakeCluster(pairs=2, clock=ManualClock())
    timed = TimedTransport(fake.transport)
    system = _system_prompt(fake, args.context)
    overheads: list[float] = []
    with Cluster.from_dict(fake.cluster_spec, transport=timed) as cluster:
        for i in range(args.sessions):
            with cluster.session(max_tokens=args.max_tokens) as s:
                s.append(Message.system(system))
                for turn in range(args.turns):
                    s.append(Message.user(f"Question {turn} of session {i}: what next?"))
                    before, start = timed.server_s, time.perf_counter()
                    s.turn()
                    if i:
                        overheads.append(time.perf_counter() - start - (timed.server_s - before))
                    _forget_requests(fake)
    return overheads


async def _idle_memory(args: argparse.Namespace, *, with_turn: bool) -> float:
    """Bytes that stay allocated per open, idle session, counting agentkv's allocations only.

    The fake servers run in this process, so allocations with a fake frame on their stack (its KV
    store, its request log) are filtered out.
    """
    # Room for every session's pinned turn-end KV (decode keeps it for the next turn).
    blocks = args.idle_sessions * (args.context + args.max_tokens + 64) // 16 + 1024
    fake = FakeCluster(pairs=2, clock=ManualClock(), num_kv_blocks=blocks)
    system = _system_prompt(fake, args.context)
    fake_frames = tracemalloc.Filter(False, "*/agentkv/testing/*", all_frames=True)
    async with AsyncCluster.from_dict(fake.cluster_spec, transport=fake.transport) as cluster:
        warm = cluster.session(max_tokens=args.max_tokens)
        warm.append(Message.system(system), Message.user("warm up"))
        await warm.turn()
        gc.collect()
        tracemalloc.start(32)
        before = tracemalloc.take_snapshot().filter_traces([fake_frames])
        sessions = []
        for i in range(args.idle_sessions):
            s = cluster.session(max_tokens=args.max_tokens)
            if with_turn:
                # A distinct system prompt per session, so no text is shared between them.
                s.append(Message.system(f"{i} {system}"), Message.user(f"Hello {i}"))
                await s.turn()
            sessions.append(s)
        gc.collect()
        after = tracemalloc.take_snapshot().filter_traces([fake_frames])
        tracemalloc.stop()
        used = sum(stat.size_diff for stat in after.compare_to(before, "filename"))
        for s in sessions:
            await s.aclose()
    return used / args.idle_sessions


def _silence_logs() -> None:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))


def _json_logs_to(sink: Callable[[str], object]) -> None:
    class Sink:
        def msg(self, message: str) -> None:
            sink(message)

        info = warning = msg

    structlog.configure(
        processors=[
            structlog.processors.TimeStamper(fmt="iso"),
            structlog.processors.JSONRenderer(),
        ],
        logger_factory=lambda *_: Sink(),
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=30)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--context", type=int, default=2000, help="system prompt tokens")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--idle-sessions", type=int, default=300)
    args = parser.parse_args()

    rows = []
    _silence_logs()
    samples = asyncio.run(_async_overheads(args))
    rows.append(("async turn, CPU", *_quantiles(samples.cpu)))
    rows.append(("async turn, wall", *_quantiles(samples.wall)))
    rows.append(("  (fake servers, wall)", *_quantiles(samples.server)))
    _json_logs_to(lambda _: None)
    logged = asyncio.run(_async_overheads(args))
    rows.append(("async turn + JSON log, CPU", *_quantiles(logged.cpu)))
    _silence_logs()
    rows.append(("sync turn, wall", *_quantiles(_sync_overheads(args))))
    prompt_tokens = samples.prompt_tokens

    n = (args.sessions - 1) * args.turns
    print(f"SDK overhead per turn ({n} turns, prompts up to {prompt_tokens} tokens)")
    print(f"{'':30} {'median ms':>10} {'p99 ms':>10}")
    for name, median, p99 in rows:
        print(f"{name:30} {median * 1e3:10.3f} {p99 * 1e3:10.3f}")
    if not args.idle_sessions:  # --idle-sessions 0: the turns only (the memory part is slow)
        return 0
    empty = asyncio.run(_idle_memory(args, with_turn=False))
    used = asyncio.run(_idle_memory(args, with_turn=True))
    print()
    print(f"memory per idle session ({args.idle_sessions} sessions)")
    print(f"{'  opened, no turn':30} {empty / 1024:10.1f} KiB")
    print(f"{'  after one ~' + str(args.context) + '-token turn':30} {used / 1024:10.1f} KiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
