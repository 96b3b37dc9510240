"""SDK overhead per turn against the fake cluster, and memory per idle session.

Overhead is a turn's time minus the time spent inside the fake servers' handlers (measured by
wrapping the fake's transport), so it is what agentkv itself costs a turn: the template-delta
request, building and parsing the legs' JSON, the transcript, the policy, stats and logs, and
the HTTP library's objects where the SDK builds them. The fake's transport posts as the default
one is (a ``Poster``: ``post``, no httpx2 request or response), so a turn runs the code it
runs against real servers; an older tree's SDK (``overhead_ab.py``) builds its httpx requests and
responses, as it did against real servers. Turns run one at a time so nothing else shares the
loop.

Both CPU time (``time.thread_time``: the async core and the fake share one thread) and wall time
are reported; on a machine shared with other work, the CPU figure is the stable one.

``--over-http`` measures what a user's process pays instead: the fake cluster is served over real
HTTP on 127.0.0.1 by a child process (``FakeCluster.serve``), the SDK talks to it through its
default transport, and a turn's CPU is this process's (user and system; nothing is subtracted:
the servers' work is the child's). The in-process rows skip the transport (the fake is an httpx2
transport); these include it: sockets, the HTTP client, its parser.

``--replay`` measures the SDK alone: the fake answers a first pass of the same sessions, each
answer recorded under its request (method, path, body), and the measured pass is answered from
that recording, so no server code runs between the SDK's steps (the in-process fake's work evicts
the SDK's code and data from the CPU's caches between them, and its garbage is collected on the
SDK's time). Building each recorded answer is counted as server time, as the fake's is. A
request not in the recording stops the run: the SDK sends the same bytes for the same turns.

``--replay --evict`` runs the same, cold: between turns (off the clock) it sorts a fresh list of
300k floats, ~10 MB of objects, as an agent's own work between its turns (a tool, a parse) would,
so that every turn starts with the SDK's code and data out of the CPU's caches and its attribute
caches cold. The in-process mode sits between the two: the fake's work runs inside each turn.

    .venv/bin/python benchmarks/sdk_overhead.py [--turns 8] [--sessions 30] [--context 2000]
    .venv/bin/python benchmarks/sdk_overhead.py --over-http
    .venv/bin/python benchmarks/sdk_overhead.py --replay [--evict]
    .venv/bin/python benchmarks/sdk_overhead.py [--replay | --over-http] --stream

``--stream`` (with ``--replay`` or ``--over-http``) consumes each turn as ``session.stream()``: the
D leg streamed, its events parsed as they arrive (replayed, a stream comes as one piece; over
HTTP the served fake sends each event as a piece of its own, as vLLM does).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import io
import json
import logging
import os
import statistics
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import structlog

import agentkv._wire.http
from agentkv import AsyncCluster, Cluster, Message, TurnResult
from agentkv.testing import FakeCluster, ManualClock

# The HTTP library the imported SDK speaks: httpx2, or httpx before issue 28 (``overhead_ab.py
# --replay`` runs this script against an older tree's SDK).
HTTP: Any = getattr(agentkv._wire.http, "httpx2", None) or agentkv._wire.http.httpx


Answer = tuple[int, list[tuple[bytes, bytes]], bytes]


class _Whole:
    """A body as one piece, on an iterator of its own as the default transport's and the fake's
    are (an unfinished async generator would cost the SDK a task of asyncio's to close it)."""

    def __init__(self, body: bytes) -> None:
        self._body = body

    def __aiter__(self) -> _Whole:
        return self

    async def __anext__(self) -> bytes:
        body, self._body = self._body, b""
        if not body:
            raise StopAsyncIteration
        return body

    async def aclose(self) -> None:
        pass


class _Transport:
    """An async transport of any tree's SDK: each calls only these methods. ``post`` and
    ``post_stream`` from issue 28 on (``PostTransport``: headers and timeout phases as positional
    arguments), and ``get`` from issue 41 on (``agentkv._wire.transport.Poster``: keyword
    arguments); the arguments pass through as given."""

    inner: Any = None

    async def handle_async_request(self, request: Any) -> Any:
        raise NotImplementedError

    async def post(self, url: str, body: bytes, *args: Any, **kwargs: Any) -> Answer:
        raise NotImplementedError

    async def post_stream(
        self, url: str, body: bytes, *args: Any, **kwargs: Any
    ) -> tuple[int, list[tuple[bytes, bytes]], Any]:
        """``post``'s answer as a stream (the fake's streams come whole, as one piece)."""
        status, headers_, content = await self.post(url, body, *args, **kwargs)
        return status, headers_, _Whole(content)

    async def get(self, url: str, **kwargs: Any) -> Any:
        return await self.inner.get(url, **kwargs)

    async def aclose(self) -> None:
        if self.inner is not None:
            await self.inner.aclose()


class TimedTransport(_Transport):
    """Counts the wall and CPU seconds spent inside the wrapped (fake server) transport."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.server_s = 0.0
        self.server_cpu_s = 0.0

    async def handle_async_request(self, request: Any) -> Any:
        start, cpu = time.perf_counter(), time.thread_time()
        try:
            return await self.inner.handle_async_request(request)
        finally:
            self.server_s += time.perf_counter() - start
            self.server_cpu_s += time.thread_time() - cpu

    async def post(self, url: str, body: bytes, *args: Any, **kwargs: Any) -> Answer:
        start, cpu = time.perf_counter(), time.thread_time()
        try:
            answer: Answer = await self.inner.post(url, body, *args, **kwargs)
            return answer
        finally:
            self.server_s += time.perf_counter() - start
            self.server_cpu_s += time.thread_time() - cpu

    async def get(self, url: str, **kwargs: Any) -> Any:
        start, cpu = time.perf_counter(), time.thread_time()
        try:
            return await self.inner.get(url, **kwargs)
        finally:
            self.server_s += time.perf_counter() - start
            self.server_cpu_s += time.thread_time() - cpu


Tape = dict[tuple[str, str, bytes], Answer]


class Recorder(_Transport):
    """Passes each request to the fake and records its answer under (method, path, body)."""

    def __init__(self, inner: Any, tape: Tape) -> None:
        self.inner = inner
        self.tape = tape

    async def handle_async_request(self, request: Any) -> Any:
        response = await self.inner.handle_async_request(request)
        body = await response.aread()
        key = (request.method, request.url.path, request.content)
        self.tape[key] = (response.status_code, list(response.headers.raw), body)
        return HTTP.Response(response.status_code, headers=response.headers.raw, content=body)

    async def post(self, url: str, body: bytes, *args: Any, **kwargs: Any) -> Answer:
        answer: Answer = await self.inner.post(url, body, *args, **kwargs)
        self.tape[("POST", urlsplit(url).path, body)] = answer
        return answer

    async def get(self, url: str, **kwargs: Any) -> Any:
        answer = await self.inner.get(url, **kwargs)
        self.tape[("GET", urlsplit(url).path, b"")] = answer
        return answer


class Replayer(_Transport):
    """Answers each request from a recording. The path, not the host: a turn may choose the
    other prefill of its pair in this pass (the fake's load and warm prefixes differ), and every
    server serves the same model."""

    def __init__(self, tape: Tape) -> None:
        self.tape = tape

    async def handle_async_request(self, request: Any) -> Any:
        found = self.tape.get((request.method, request.url.path, request.content))
        if found is None:
            raise RuntimeError(f"not in the recording: {request.method} {request.url}")
        status, headers, body = found
        return HTTP.Response(status, headers=headers, content=body)

    async def post(self, url: str, body: bytes, *args: Any, **kwargs: Any) -> Answer:
        found = self.tape.get(("POST", urlsplit(url).path, body))
        if found is None:
            raise RuntimeError(f"not in the recording: POST {url}")
        return found

    async def get(self, url: str, **kwargs: Any) -> Any:
        found = self.tape.get(("GET", urlsplit(url).path, b""))
        if found is None:
            raise RuntimeError(f"not in the recording: GET {url}")
        return found


def _evict() -> None:
    """Work that pushes the SDK out of the CPU's caches: a sort of 300k fresh floats, in an
    order scrambled by a multiplicative hash."""
    sorted((i * 2_654_435_761) % 1_000_003 / 7 for i in range(300_000))


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


async def _turns(
    cluster: AsyncCluster,
    system: str,
    args: argparse.Namespace,
    *,
    cpu_clock: Callable[[], float],
    server: Callable[[], tuple[float, float]] = lambda: (0.0, 0.0),
    after_turn: Callable[[], object] = lambda: None,
) -> Samples:
    """``args.sessions`` sessions of ``args.turns`` turns, one at a time; each turn's wall and
    CPU time less what ``server()`` (wall and CPU seconds spent serving, so far) grew by."""
    samples = Samples()
    for i in range(args.sessions):
        async with cluster.session(max_tokens=args.max_tokens) as s:
            s.append(Message.system(system))
            for turn in range(args.turns):
                s.append(Message.user(f"Question {turn} of session {i}: what next?"))
                server_s, server_cpu = server()
                start, cpu = time.perf_counter(), cpu_clock()
                if args.stream:
                    events = [event async for event in s.stream()]
                    result = events[-1]
                    assert isinstance(result, TurnResult)
                else:
                    result = await s.turn()
                wall, used = time.perf_counter() - start, cpu_clock() - cpu
                if i:  # session 0 warms caches (anchor renders, imports, connections)
                    served_s, served_cpu = server()
                    samples.wall.append(wall - (served_s - server_s))
                    samples.cpu.append(used - (served_cpu - server_cpu))
                    samples.server.append(served_s - server_s)
                samples.prompt_tokens = max(samples.prompt_tokens, result.stats.prompt_tokens)
                after_turn()
    return samples


async def _async_overheads(
    args: argparse.Namespace,
    wrap: Callable[[Any], Any] = lambda transport: transport,
    *,
    evict: bool = False,
) -> Samples:
    """Turns against the in-process fake; ``wrap`` the fake's transport to record or replay;
    ``evict``: run ``_evict`` between turns."""
    fake = FakeCluster(pairs=2, clock=ManualClock())
    timed = TimedTransport(wrap(fake.transport))
    system = _system_prompt(fake, args.context)

    def after_turn() -> None:
        _forget_requests(fake)
        if evict:
            _evict()

    async with AsyncCluster.from_dict(fake.cluster_spec, transport=timed) as cluster:
        return await _turns(
            cluster,
            system,
            args,
            # The async core and the fake share one thread: its CPU, less the fake's.
            cpu_clock=time.thread_time,
            server=lambda: (timed.server_s, timed.server_cpu_s),
            after_turn=after_turn,
        )


# The fake cluster served from a child process: its work runs on another core and another
# interpreter (no GIL shared with the SDK). It prints the cluster spec, then serves until stdin
# closes. The fake is this script's tree's, whichever ``agentkv`` the SDK side imports
# (``overhead_ab.py --over-http`` measures an older SDK against the same servers).
_SERVE = """
import json, sys
from agentkv.testing import FakeCluster
with FakeCluster(pairs=2).serve() as served:
    print(json.dumps(served.cluster_spec), flush=True)
    sys.stdin.read()
"""


@contextlib.contextmanager
def _served_fake() -> Iterator[dict[str, Any]]:
    tree = Path(__file__).resolve().parent.parent
    # ``python -c`` puts its working directory first on sys.path: run it in this tree too.
    child = subprocess.Popen(
        [sys.executable, "-c", _SERVE],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=tree,
        env={**os.environ, "PYTHONPATH": str(tree)},
    )
    try:
        assert child.stdout is not None
        yield json.loads(child.stdout.readline())
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait(timeout=30)


async def _http_overheads(args: argparse.Namespace) -> Samples:
    """Turns against the fake served over real HTTP by a child process; CPU is this process's
    (the servers' is the child's: nothing to subtract)."""
    system = _system_prompt(FakeCluster(pairs=1), args.context)
    with _served_fake() as spec:
        async with AsyncCluster.from_dict(spec) as cluster:
            return await _turns(cluster, system, args, cpu_clock=time.process_time)


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
    # agentkv is quiet by default (its events go to the stdlib logger "agentkv"); an SDK from
    # before that logged through structlog's global configuration.
    logging.getLogger("agentkv").setLevel(logging.WARNING)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))


def _json_logs_to(sink: Callable[[str], object]) -> None:
    configure_logging = getattr(agentkv, "configure_logging", None)
    if configure_logging is not None:

        class Stream(io.TextIOBase):
            def write(self, text: str) -> int:
                sink(text)
                return len(text)

        configure_logging("INFO", json=True, stream=Stream())
        return

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


def _print(
    args: argparse.Namespace, rows: list[tuple[str, float, float]], prompt_tokens: int
) -> None:
    n = (args.sessions - 1) * args.turns
    print(f"SDK overhead per turn ({n} turns, prompts up to {prompt_tokens} tokens)")
    print(f"{'':36} {'median ms':>10} {'p99 ms':>10}")
    for name, median, p99 in rows:
        print(f"{name:36} {median * 1e3:10.3f} {p99 * 1e3:10.3f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=30)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--context", type=int, default=2000, help="system prompt tokens")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--idle-sessions", type=int, default=300)
    parser.add_argument(
        "--over-http",
        action="store_true",
        help="serve the fake over real HTTP from a child process; measure this process's CPU",
    )
    parser.add_argument(
        "--replay", action="store_true", help="answer from a recording of the fake (see above)"
    )
    parser.add_argument(
        "--evict", action="store_true", help="with --replay: evict the caches between turns"
    )
    parser.add_argument(
        "--stream",
        action="store_true",
        help="with --replay or --over-http: stream each turn (session.stream())",
    )
    args = parser.parse_args()
    if args.evict and not args.replay:
        parser.error("--evict goes with --replay")
    if args.stream and not (args.replay or args.over_http):
        parser.error("--stream goes with --replay or --over-http")

    rows = []
    kind = "async streamed turn" if args.stream else "async turn"
    _silence_logs()
    if args.replay:
        tape: Tape = {}
        asyncio.run(_async_overheads(args, lambda fake: Recorder(fake, tape)))
        samples = asyncio.run(_async_overheads(args, lambda _: Replayer(tape), evict=args.evict))
        name = f"{kind}, replayed" + (" cold" if args.evict else "")
        rows.append((f"{name}, CPU", *_quantiles(samples.cpu)))
        rows.append((f"{name}, wall", *_quantiles(samples.wall)))
        _print(args, rows, samples.prompt_tokens)
        return 0
    if args.over_http:
        samples = asyncio.run(_http_overheads(args))
        rows.append((f"{kind} over HTTP, CPU", *_quantiles(samples.cpu)))
        rows.append(("  (wall, servers included)", *_quantiles(samples.wall)))
        _print(args, rows, samples.prompt_tokens)
        return 0
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

    _print(args, rows, prompt_tokens)
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
