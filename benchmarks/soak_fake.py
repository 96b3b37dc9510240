"""Soak on the fake pair: many concurrent sessions, many turns, random tool delays.

Each session sends a system prompt and ``--turns`` user messages, waiting a random tool delay
(inside ``session.tool_wait``) before each turn after the first. Half the sessions end with a
final turn (decode pins nothing), half just close (the SDK releases the pin). Afterwards every
transcript must hold each message exactly once and no decode may hold a pinned handle.

    .venv/bin/python benchmarks/soak_fake.py --sessions 64 --turns 10

``--fault-every N`` makes every Nth turn (across all sessions) meet one retryable fault (503,
timeout or reset) on a random server of its pair; with the default three attempts no turn fails.
A D leg whose answer is lost (timeout, reset) leaves decode's pin of that attempt behind: the
SDK never saw its handle, so it cannot release it, and decode frees it at its TTL
(``pinned_handles_after_ttl``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import random
import statistics
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field

import structlog

from agentkv import AsyncCluster, Message, RetryPolicy, TurnResult
from agentkv.testing import FakeCluster, ManualClock

_PIN_TTL_S = 480.0
SYSTEM = Message.system("You are a careful agent. Use tools, then answer briefly. " * 4)


@dataclass(kw_only=True)
class SoakReport:
    sessions: int
    turns_per_session: int
    turns_ok: int = 0
    turns_failed: int = 0
    lost_or_duplicated_messages: int = 0
    retries: int = 0
    extends: int = 0
    faults_injected: int = 0
    wrong_reuse_events: int = 0
    pinned_handles_after_close: int = 0
    leased_handles_after_close: int = 0
    pinned_handles_after_ttl: int = 0
    reuse_ratio: float | None = None
    wall_s: float = 0.0
    turns_per_s: float = 0.0
    turn_p50_ms: float = 0.0
    turn_p99_ms: float = 0.0
    handle_states: dict[str, int] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)


class _FaultGate:
    """Normal turns share the cluster; a turn with an injected fault runs alone.

    A fault armed with ``fail_next`` hits the next request to that server, whoever sends it: run
    alone, the faulted turn is the one that meets it, exactly once.
    """

    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self._shared = 0
        self._exclusive = False

    @contextlib.asynccontextmanager
    async def shared(self) -> AsyncIterator[None]:
        async with self._cond:
            await self._cond.wait_for(lambda: not self._exclusive)
            self._shared += 1
        try:
            yield
        finally:
            async with self._cond:
                self._shared -= 1
                self._cond.notify_all()

    @contextlib.asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        async with self._cond:
            await self._cond.wait_for(lambda: not self._exclusive and not self._shared)
            self._exclusive = True
        try:
            yield
        finally:
            async with self._cond:
                self._exclusive = False
                self._cond.notify_all()


async def _session(
    cluster: AsyncCluster,
    fake: FakeCluster,
    index: int,
    *,
    turns: int,
    max_delay_s: float,
    fault_every: int,
    rng: random.Random,
    gate: _FaultGate,
    results: list[TurnResult],
    report: SoakReport,
) -> None:
    async with cluster.session(
        session_id=f"soak-{index}", max_tokens=48, extra_body={"min_tokens": 24}
    ) as s:
        s.append(SYSTEM)
        sent = 0
        for turn in range(turns):
            if turn:
                delay = rng.uniform(0, max_delay_s)
                async with s.tool_wait(expected_s=delay):
                    await asyncio.sleep(delay)
            faulted = bool(fault_every) and (index * turns + turn) % fault_every == fault_every - 1
            final = turn == turns - 1 and index % 2 == 0
            text = f"Step {turn} of task {index}: tool output {rng.randrange(10**6)}. Next?"
            try:
                async with gate.exclusive() if faulted else gate.shared():
                    if faulted:
                        pair = int(s.pair.name.rsplit("-", 1)[1])
                        server = rng.choice([fake.prefill(pair), fake.decode(pair)])
                        server.fail_next(rng.choice(["status", "timeout", "reset"]), status=503)
                        report.faults_injected += 1
                    results.append(await s.send(text, final=final))
                sent += 1
            except Exception as exc:  # counted, never hidden: the soak's point is zero of these
                report.turns_failed += 1
                report.errors.append(f"{type(exc).__name__}: {exc}"[:300])
        expected = ["system", *["user", "assistant"] * sent]
        if [m.role for m in s.transcript.messages] != expected or s.transcript.pending:
            report.lost_or_duplicated_messages += 1


async def soak(
    *,
    sessions: int = 64,
    turns: int = 10,
    max_delay_s: float = 0.05,
    fault_every: int = 0,
    seed: int = 0,
    pairs: int = 2,
) -> SoakReport:
    """Run the soak and return its report (``turns_failed`` etc. should all be zero)."""
    rng = random.Random(seed)  # noqa: S311 - reproducible test delays, not secrets
    # Servers and sessions share a manual clock (tool delays are real sleeps): pins cannot expire
    # during the run, so any left at the end was leaked, not forgotten; moving the clock past
    # the pin TTL afterwards shows what decode's TTL cleans up.
    clock = ManualClock()
    fake = FakeCluster(pairs=pairs, clock=clock, decoder_kv_blocks_ttl=_PIN_TTL_S)
    report = SoakReport(sessions=sessions, turns_per_session=turns)
    results: list[TurnResult] = []
    gate = _FaultGate()
    retry = RetryPolicy(max_attempts=3, initial_backoff_s=0.01, jitter_s=0.01)
    started = time.perf_counter()
    async with AsyncCluster.from_dict(
        fake.cluster_spec, transport=fake.transport, retry=retry, block_size=16, clock=clock
    ) as cluster:
        await asyncio.gather(
            *(
                _session(
                    cluster,
                    fake,
                    i,
                    turns=turns,
                    max_delay_s=max_delay_s,
                    fault_every=fault_every,
                    rng=random.Random(rng.random()),  # noqa: S311 - as above
                    gate=gate,
                    results=results,
                    report=report,
                )
                for i in range(sessions)
            )
        )
    report.wall_s = time.perf_counter() - started
    report.turns_ok = len(results)
    report.turns_per_s = report.turns_ok / report.wall_s if report.wall_s else 0.0
    totals = sorted(r.stats.total_s * 1000 for r in results)
    if totals:
        report.turn_p50_ms = statistics.median(totals)
        report.turn_p99_ms = totals[min(len(totals) - 1, int(0.99 * len(totals)))]
    report.retries = sum(r.stats.retries for r in results)
    report.extends = sum(r.stats.extends for r in results)
    report.handle_states = dict(Counter(r.stats.handle_state.value for r in results))
    ideal = sum(r.stats.ideal_reused_tokens for r in results)
    reused = sum(r.stats.reused_tokens for r in results if r.stats.ideal_reused_tokens)
    report.reuse_ratio = reused / ideal if ideal else None
    report.wrong_reuse_events = fake.wrong_reuse_events
    report.pinned_handles_after_close = sum(fake.decode(i).pinned_handles for i in range(pairs))
    report.leased_handles_after_close = sum(fake.decode(i).leased_handles for i in range(pairs))
    clock.advance(_PIN_TTL_S + 1)
    report.pinned_handles_after_ttl = sum(fake.decode(i).pinned_handles for i in range(pairs))
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=64)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--max-tool-delay", type=float, default=0.05, help="seconds")
    parser.add_argument("--fault-every", type=int, default=0, help="0: no injected faults")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    # Per-turn events would drown the report; warnings (retries) still show.
    saved = structlog.get_config()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    try:
        report = asyncio.run(
            soak(
                sessions=args.sessions,
                turns=args.turns,
                max_delay_s=args.max_tool_delay,
                fault_every=args.fault_every,
                seed=args.seed,
            )
        )
    finally:
        structlog.configure(**saved)
    if args.json:
        print(json.dumps(asdict(report), indent=2))
    else:
        for key, value in asdict(report).items():
            print(f"{key:28} {value}")
    return 0 if passed(report) else 1


def passed(report: SoakReport) -> bool:
    """No failed turn, no lost message, no wrong KV, and no pin left behind.

    Nothing may stay pinned once the sessions closed, faults or not: a D leg whose answer was
    lost is released by the request id the SDK chose for it.
    """
    leaked = report.pinned_handles_after_close
    return not (
        report.turns_failed
        or report.lost_or_duplicated_messages
        or report.wrong_reuse_events
        or leaked
        or report.pinned_handles_after_ttl
    )


if __name__ == "__main__":
    sys.exit(main())
