"""Forks and siblings on the real local servers: what a child's first turn reuses, and its TTFT.

Two measurements on the cluster of ``--cluster-file`` (a pair, or a pool: ``agentkv up --prefill
2 --decode 1``), each round under fresh cache salts so that no round reuses another's blocks:

* **forks**: a parent session (a long system prompt, then two turns), then a fork of its whole
  history whose first turn asks something new, the fork made with the copy of the parent's pin
  (``fork(copy_kv=True)``, the default) or without it (``copy_kv=False``: what ``fork`` did
  before, the fork reusing what its prefill's prefix cache holds); one parent per arm, the arms
  alternating which goes first. Then the parent's next turn: it keeps its pin either way.
* **siblings** (a pool only): two sessions sharing a long system prompt, each with a task of its
  own (Claude Code's subagents share ~10k tokens of system prompt and tools with each other and
  nothing with their parent), one after the other; the second one's first-turn reuse of the
  prefix they share, with the pool's prefix placement (``PrefixHomes``: a first turn goes to
  the prefill that computed its longest prefix) and with it switched off (the first turn placed
  by load and the session's rendezvous rank, as before).

Reuse is prefill's own count (``cached_tokens``). A fork's ideal is its parent's (the whole
history less one token); a sibling's is the token prefix both siblings' prompts share.

    .venv/bin/agentkv up                          # or --prefill 2 --decode 1
    .venv/bin/python benchmarks/fork_kv.py --rounds 6 --json docs/bench/fork-kv-pair.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import agentkv
from agentkv import Message
from agentkv._placement import PrefixHomes
from agentkv.local._config import LocalClusterConfig
from agentkv.local._cpu import read_cpu_info
from agentkv.local._launch import existing_cluster

SYSTEM = "You are a logistics planner. Answer in one short sentence.\n" + "\n".join(
    f"Route {i}: truck {i * 31 % 97} drives from depot {chr(65 + i % 26)} to town {i * 7 % 53}."
    for i in range(60)
)
TOOLS = "You are a file search specialist. Report paths and line numbers only.\n" + "\n".join(
    f"Tool {i}: grep_{i}(pattern, path) searches file group {i * 11 % 89} for a pattern."
    for i in range(60)
)
QUESTIONS = ("Which truck drives route 4?", "Where does it start?", "Which route ends in town 21?")
TASKS = ("Find where truck 12 is configured.", "Find every caller of route_for().")
MAX_TOKENS = 24


class _NoHomes(PrefixHomes):
    """The pool's prefix placement switched off: no first turn finds a home."""

    def home(self, salt: str | None, tokens: Sequence[int]) -> tuple[str, int] | None:
        del salt, tokens
        return None


def _salted() -> dict[str, Any]:
    return {"cache_salt": uuid.uuid4().hex}


def _row(stats: agentkv.TurnStats, ideal: int | None = None) -> dict[str, Any]:
    return {
        "state": str(stats.handle_state),
        "reused": stats.reused_tokens,
        "ideal": stats.ideal_reused_tokens if ideal is None else ideal,
        "prompt": stats.prompt_tokens,
        "ttft_ms": round(stats.ttft_s * 1000.0, 1),
        "prefill": stats.prefill,
        "reason": stats.handle_reason,
    }


async def _fork_arm(
    cluster: agentkv.AsyncCluster, copy_kv: bool, answer_tokens: int
) -> dict[str, Any]:
    salt = _salted()
    async with cluster.session(max_tokens=MAX_TOKENS, extra_body=salt) as parent:
        parent.append(Message.system(SYSTEM))
        await parent.send(QUESTIONS[0])
        # The parent's last answer before the fork: its tokens are on decode only (prefill
        # computed the prompts), what a fork without the copy computes again.
        body = {**salt, "min_tokens": answer_tokens}
        await parent.send(QUESTIONS[1], max_tokens=answer_tokens, extra_body=body)
        async with parent.fork(copy_kv=copy_kv) as child:
            fork = (await child.send(QUESTIONS[2])).stats
        after = (await parent.send(QUESTIONS[2])).stats
    return {"copy_kv": copy_kv, "fork": _row(fork), "parent_next": _row(after)}


def _shared(a: Sequence[int], b: Sequence[int]) -> int:
    pairs = enumerate(zip(a, b, strict=False))
    return next((i for i, (x, y) in pairs if x != y), min(len(a), len(b)))


async def _siblings(cluster: agentkv.AsyncCluster, placement: bool) -> dict[str, Any]:
    pool = cluster._pool
    homes = pool.prefix_homes
    if not placement:
        pool.prefix_homes = _NoHomes()
    salt = _salted()  # one user: siblings share prefill's cache
    rows, prompts = [], []
    try:
        for task in TASKS:
            async with cluster.session(
                max_tokens=MAX_TOKENS, extra_body=salt, session_id=uuid.uuid4().hex
            ) as sibling:
                sibling.append(Message.system(TOOLS))
                result = await sibling.send(task)
                tokens = sibling.transcript.token_ids
                prompts.append(tokens[: result.stats.prompt_tokens])
                rows.append(result.stats)
    finally:
        pool.prefix_homes = homes  # the forks that follow are placed as the SDK places them
    shared = _shared(prompts[0], prompts[1])
    return {"placement": placement, "first": _row(rows[0], 0), "second": _row(rows[1], shared)}


def _quantiles(values: list[float]) -> tuple[float, float]:
    if len(values) < 2:
        return (values[0], values[0]) if values else (0.0, 0.0)
    cuts = statistics.quantiles(values, n=10, method="inclusive")
    return statistics.median(values), cuts[8]


def _summary(rows: list[dict[str, Any]]) -> str:
    reused = sum(r["reused"] for r in rows)
    ideal = sum(r["ideal"] for r in rows)
    p50, p90 = _quantiles([r["ttft_ms"] for r in rows])
    share = f"reuse/ideal {reused / ideal:6.1%}" if ideal else f"reused {reused:>5} tokens"
    return f"{share}  TTFT p50 {p50:7.1f} ms  p90 {p90:7.1f} ms"


async def _run(cluster_file: Path, rounds: int, answer_tokens: int) -> dict[str, Any]:
    report: dict[str, Any] = {"forks": [], "siblings": []}
    async with agentkv.AsyncCluster.from_file(cluster_file) as cluster:
        pooled = cluster._pool.pooled
        async with cluster.session(max_tokens=4) as warm:  # the servers' first-request costs
            await warm.send("Hello")
        for number in range(rounds):
            arms = (True, False) if number % 2 == 0 else (False, True)
            for copy_kv in arms:
                report["forks"].append(await _fork_arm(cluster, copy_kv, answer_tokens))
            if pooled:
                for placement in arms:
                    report["siblings"].append(await _siblings(cluster, placement))
            print(f"round {number + 1}/{rounds} done", flush=True)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cluster-file", type=Path, default=Path(".agentkv/cluster.json"))
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--answer-tokens", type=int, default=MAX_TOKENS,
                        help="length of the parent's answer before the fork (default 24)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    record = existing_cluster(LocalClusterConfig(cluster_file=args.cluster_file))
    if record is None:
        raise SystemExit(f"no running local cluster at {args.cluster_file}: run `agentkv up`")
    cpu = read_cpu_info()
    print(f"CPU: {cpu.model} ({cpu.isa}); dtype {record.dtype or 'bfloat16'}", flush=True)
    report = asyncio.run(_run(args.cluster_file, args.rounds, args.answer_tokens))
    report["answer_tokens"] = args.answer_tokens
    for copy_kv in (True, False):
        arm = [r for r in report["forks"] if r["copy_kv"] is copy_kv]
        label = "with the copy" if copy_kv else "without it"
        print(f"fork, first turn, {label:>13}: {_summary([r['fork'] for r in arm])}")
        print(f"  parent's next turn        : {_summary([r['parent_next'] for r in arm])}")
    for placement in (True, False):
        arm = [r for r in report["siblings"] if r["placement"] is placement]
        if arm:
            label = "placed" if placement else "by load"
            together = sum(r["second"]["prefill"] == r["first"]["prefill"] for r in arm)
            print(f"second sibling, {label:>7}: {_summary([r['second'] for r in arm])}  "
                  f"(on the first one's prefill in {together}/{len(arm)})")
            print(f"  first sibling          : {_summary([r['first'] for r in arm])}")
    if args.json is not None:
        args.json.write_text(json.dumps({"cpu": cpu.model, "isa": cpu.isa,
                                         "dtype": record.dtype, **report}, indent=1))


if __name__ == "__main__":
    main()
