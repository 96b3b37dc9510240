"""Placement at scale: SESSIONS concurrent sessions over a PxD pool of in-process fake servers.

Every session is opened at once (placed on a decode server), then runs TURNS turns, CONCURRENCY
turns in flight at a time, through the real SDK (``AsyncCluster`` with a ``prefill_pool``). Each
prefill request takes simulated server time proportional to the tokens it computes (the fake
servers answer instantly otherwise), so the prefills' outstanding tokens are a real load signal.
Sessions differ in length (a random system prompt of 20 to 400 words).

After turn 2 one decode and one prefill are removed (killed); turn 3 shows which sessions moved.

Reported:

* decode balance: sessions per decode server, max / mean;
* prefill balance: outstanding tokens per prefill, sampled every few ms while turns run, max /
  mean averaged over the samples; and tokens computed per prefill over the run, max / mean;
* moved: sessions whose decode changed when a decode was removed (target: exactly those that
  were on it), and when a prefill was removed (target: none);
* reuse: turns >= 2 that attached their handle and reused at least the ideal (target: all but
  the moved sessions' first turn after the move).

    .venv/bin/python benchmarks/placement_sim.py [--sessions 10000] [--prefill 16] [--decode 16]
        [--turns 3] [--concurrency 512] [--slack-tokens 2048] [--seed 0]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import platform
import random
import statistics
import time
from collections import Counter
from typing import Any

import httpx2
import structlog

from agentkv import AsyncCluster, HandleState, Message, PrefillWeights, RetryPolicy
from agentkv.testing import FakeCluster

# Simulated prefill compute: seconds per computed prompt token (about a GPU's speed, scaled so a
# 10,000-session run ends in minutes on two CPU cores).
_PREFILL_S_PER_TOKEN = 2e-6


class _PrefillTime(httpx2.AsyncBaseTransport):
    """The fake's transport, with prefill time proportional to the tokens a P leg computes."""

    def __init__(self, inner: httpx2.AsyncBaseTransport) -> None:
        self._inner = inner

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        response = await self._inner.handle_async_request(request)
        if request.url.host.startswith("fake-p") and request.url.path.endswith("/completions"):
            await response.aread()
            usage = json.loads(response.content).get("usage") or {}
            computed = usage.get("prompt_tokens", 0) - (
                (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            )
            await asyncio.sleep(computed * _PREFILL_S_PER_TOKEN)
        return response


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _ratio(values: list[float]) -> float:
    mean = statistics.fmean(values)
    return max(values) / mean if mean else 1.0


async def run(args: argparse.Namespace) -> dict[str, Any]:
    # Per-turn info events would cost more than the simulated turns themselves.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    rng = random.Random(args.seed)  # noqa: S311 - a reproducible workload, not a secret
    fake = FakeCluster(
        prefills=args.prefill,
        decodes=args.decode,
        num_kv_blocks=250_000,  # 4M tokens a server: every session pinned at once
        kv_recompute_threshold=1,
    )
    weights = PrefillWeights(slack_tokens=args.slack_tokens, slack_ratio=args.slack_ratio)
    cluster = AsyncCluster.from_dict(
        fake.pool_spec,
        transport=_PrefillTime(fake.transport),
        block_size=16,
        prefill_weights=weights,
        retry=RetryPolicy(initial_backoff_s=0, jitter_s=0),
    )
    sessions = [cluster.session(session_id=f"s{i}", max_tokens=24) for i in range(args.sessions)]
    for session in sessions:
        words = rng.randint(20, 400)
        session.append(Message.system(" ".join(f"fact{rng.randint(0, 999)}" for _ in range(words))))
    decode_sessions = list(cluster.loads().values())

    samples: list[list[int]] = []
    computed: Counter[str] = Counter()
    results: list[Any] = []
    gate = asyncio.Semaphore(args.concurrency)

    async def sample() -> None:
        while True:
            loads = list(cluster.prefill_loads().values())
            if sum(loads):
                samples.append(loads)
            await asyncio.sleep(0.005)

    async def turn(session: Any, n: int) -> None:
        async with gate:
            session.append(Message.user(f"Question {n}: what is fact{rng.randint(0, 999)}?"))
            result = await session.turn()
            computed[result.stats.prefill] += result.stats.computed_tokens
            results.append((session.session_id, n, result.stats))

    sampler = asyncio.ensure_future(sample())
    started = time.perf_counter()
    for n in (1, 2):
        await asyncio.gather(*(turn(s, n) for s in sessions))
    before = {s.session_id: s.pair.name for s in sessions}
    removed_decode = cluster.pairs[0].name
    removed_prefill = next(iter(cluster.prefills))
    next(s for s in fake.servers if s.name == removed_decode).kill()
    next(s for s in fake.servers if s.name == removed_prefill).kill()
    for n in range(3, args.turns + 1):
        await asyncio.gather(*(turn(s, n) for s in sessions))
    elapsed = time.perf_counter() - started
    sampler.cancel()
    after = {s.session_id: s.pair.name for s in sessions}
    moved = {sid for sid in before if before[sid] != after[sid]}
    on_removed = {sid for sid, pair in before.items() if pair == removed_decode}
    later = [(sid, n, st) for sid, n, st in results if n >= 2]
    kept = [
        st
        for sid, n, st in later
        if st.handle_state is HandleState.ATTACHED and st.reused_tokens >= st.ideal_reused_tokens
    ]
    expected_loss = len(on_removed)  # each moved session recomputes once
    for session in sessions:
        await session.aclose()
    await cluster.aclose()
    return {
        "cpu": _cpu_name(),
        "sessions": args.sessions,
        "pool": f"{args.prefill}P/{args.decode}D",
        "turns": len(results),
        "elapsed_s": round(elapsed, 1),
        "turns_per_s": round(len(results) / elapsed, 1),
        "decode_sessions_max_over_mean": round(_ratio([float(x) for x in decode_sessions]), 3),
        "prefill_outstanding_max_over_mean": round(
            statistics.fmean(_ratio([float(x) for x in s]) for s in samples), 3
        )
        if samples
        else None,
        "prefill_computed_max_over_mean": round(
            _ratio([float(computed[p]) for p in cluster.prefills if p != removed_prefill]), 3
        ),
        "moved_on_decode_removal": len(moved),
        "sessions_on_removed_decode": len(on_removed),
        "moved_only_those": moved == on_removed,
        "reuse_kept": f"{len(kept)}/{len(later)}",
        "reuse_lost_beyond_moved": len(later) - len(kept) - expected_loss,
        "wrong_reuse_events": fake.wrong_reuse_events,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sessions", type=int, default=10_000)
    parser.add_argument("--prefill", type=int, default=16)
    parser.add_argument("--decode", type=int, default=16)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=512)
    parser.add_argument("--slack-tokens", type=int, default=PrefillWeights().slack_tokens)
    parser.add_argument("--slack-ratio", type=float, default=PrefillWeights().slack_ratio)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(json.dumps(asyncio.run(run(args)), indent=2))


if __name__ == "__main__":
    main()
