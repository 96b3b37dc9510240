"""What the decode route costs decode's other sessions: their inter-token latency while one
session appends, on the real pair.

BACKGROUND sessions keep decode busy: each streams long answers (OUTPUT tokens, ``min_tokens``
so every answer runs to its end), one after another, and every gap between two streamed tokens
is an inter-token latency (ITL) sample. Meanwhile one foreground session, on a CONTEXT-token
history, appends APPEND tokens every PERIOD seconds and asks for a short answer, on the route
of the phase:

* ``none``: no appends (the background's own ITL);
* ``pull``: the append is pulled back to prefill and computed there (decode only pulls KV);
* ``decode``: the append is computed on decode itself, between the background's tokens.

Phases alternate in rounds, so drifting machine load weighs on all alike. Reported per phase:
the background's ITL p50 / p90 / p99 and the ratio of its p90 to ``none``'s, and the
foreground's TTFT p50 per route.

    .venv/bin/agentkv up
    .venv/bin/python benchmarks/route_itl.py [--appends 128,256,512] [--rounds 2]
        [--background 3] [--phase-s 20] [--json docs/bench/route-itl-epyc-zen4.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
import uuid
from pathlib import Path
from typing import Any

import httpx2

from agentkv import AsyncCluster, AsyncSession, Message, Route, TextDelta, TurnResult

FILLER = "The quick brown fox jumps over the lazy dog near the river bank. "


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def _text(tokens: int, tag: str) -> str:
    # ~13 tokens per filler sentence for SmolLM2's tokenizer; the exact length is reported.
    return f"[{tag}] " + FILLER * max(1, tokens // 13)


async def _kv_usage(decode: str) -> float | None:
    """Decode's ``vllm:kv_cache_usage_perc`` (0-1): pins and running requests hold it."""
    async with httpx2.AsyncClient(timeout=10) as client:
        text = (await client.get(decode + "/metrics")).text
    for line in text.splitlines():
        if line.startswith("vllm:kv_cache_usage_perc"):
            return round(float(line.rsplit(" ", 1)[1]), 3)
    return None


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _background(cluster: AsyncCluster, stop: asyncio.Event, gaps: list[float], n: int,
                      output: int) -> None:
    salt = uuid.uuid4().hex
    async with cluster.session(
        max_tokens=output, extra_body={"min_tokens": output, "cache_salt": salt}
    ) as session:
        session.append(Message.system(f"Background session {n}. Tell long stories."))
        while not stop.is_set():
            session.append(Message.user("Tell me another long story about a fox."))
            last: float | None = None
            async for event in session.stream():
                now = time.perf_counter()
                if isinstance(event, TextDelta):
                    if last is not None and not stop.is_set():
                        gaps.append(now - last)
                    last = now


async def _foreground(
    session: AsyncSession, stop: asyncio.Event, *, route: Route, append: int, period_s: float,
    ttfts: list[float], reused: list[int],
) -> None:
    n = 0
    while not stop.is_set():
        started = time.perf_counter()
        n += 1
        session.append(Message.user(_text(append, f"append {n}") + " Reply with one word."))
        result: TurnResult | None = None
        async for event in session.stream(route=route, max_tokens=4):
            if isinstance(event, TurnResult):
                result = event
        assert result is not None
        ttfts.append(result.stats.ttft_s)
        reused.append(result.stats.reused_tokens)
        await asyncio.sleep(max(0.0, period_s - (time.perf_counter() - started)))


async def _phase(
    cluster: AsyncCluster, args: argparse.Namespace, route: Route | None, append: int
) -> dict[str, Any]:
    stop = asyncio.Event()
    gaps: list[float] = []
    ttfts: list[float] = []
    reused: list[int] = []
    async with cluster.session(
        max_tokens=4, extra_body={"cache_salt": uuid.uuid4().hex}, route="pull"
    ) as fg:
        fg.append(Message.system(_text(args.context, "foreground context")))
        fg.append(Message.user("Say ok."))
        await fg.turn()  # the history, pinned on decode before the phase starts
        tasks = [
            asyncio.create_task(_background(cluster, stop, gaps, n, args.output))
            for n in range(args.background)
        ]
        await asyncio.sleep(2.0)  # the background reaches steady decoding
        gaps.clear()
        if route is not None:
            tasks.append(asyncio.create_task(
                _foreground(
                    fg, stop, route=route, append=append, period_s=args.period_s, ttfts=ttfts,
                    reused=reused,
                )
            ))
        await asyncio.sleep(args.phase_s)
        usage = await _kv_usage(fg.pair.decode)  # before anyone's turn ends and frees
        stop.set()
        await asyncio.gather(*tasks)
    ms = [g * 1e3 for g in gaps]
    return {
        "route": route or "none",
        "append_tokens": append,
        "itl_samples": len(ms),
        "itl_p50_ms": _quantile(ms, 0.5),
        "itl_p90_ms": _quantile(ms, 0.9),
        "itl_p99_ms": _quantile(ms, 0.99),
        "appends": len(ttfts),
        "append_ttft_p50_ms": statistics.median(ttfts) * 1e3 if ttfts else None,
        "append_reused_median": statistics.median(reused) if reused else None,
        "decode_kv_usage_at_end": usage,
    }


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    appends = [int(a) for a in args.appends.split(",")]
    routes: tuple[Route, ...] = ("pull", "decode")
    plan: list[tuple[Route | None, int]] = [(None, 0), *((r, a) for a in appends for r in routes)]
    phases: list[dict[str, Any]] = []
    async with AsyncCluster.from_file(args.cluster_file) as cluster:
        for round_ in range(args.rounds):
            for route, append in plan if round_ % 2 == 0 else list(reversed(plan)):
                result = await _phase(cluster, args, route, append)
                result["round"] = round_
                phases.append(result)
                print(json.dumps(result), flush=True)
    summary = []
    for route, append in plan:
        name = route or "none"
        rows = [p for p in phases if p["route"] == name and p["append_tokens"] == append]
        p90 = statistics.median(r["itl_p90_ms"] for r in rows if r["itl_p90_ms"] is not None)
        ttft = [r["append_ttft_p50_ms"] for r in rows if r["append_ttft_p50_ms"] is not None]
        summary.append({
            "route": route or "none",
            "append_tokens": append,
            "itl_p90_ms": round(p90, 2),
            "itl_p50_ms": round(statistics.median(r["itl_p50_ms"] for r in rows), 2),
            "itl_p99_ms": round(statistics.median(r["itl_p99_ms"] for r in rows), 2),
            "append_ttft_p50_ms": round(statistics.median(ttft), 1) if ttft else None,
        })
    base = summary[0]["itl_p90_ms"]
    for row in summary:
        row["itl_p90_vs_none"] = round(row["itl_p90_ms"] / base, 3) if base else None
    return {
        "cpu": _cpu(),
        "command": "benchmarks/route_itl.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "json"
        ),
        "summary": summary,
        "phases": phases,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster-file", default=".agentkv/cluster.json")
    parser.add_argument("--appends", default="128,256,512")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--background", type=int, default=3)
    parser.add_argument("--output", type=int, default=200, help="background answer length")
    parser.add_argument("--context", type=int, default=2000, help="foreground history tokens")
    parser.add_argument("--period-s", type=float, default=2.0, help="time between appends")
    parser.add_argument("--phase-s", type=float, default=20.0)
    parser.add_argument("--json", help="write the report here")
    args = parser.parse_args()
    report = asyncio.run(main_async(args))
    print(f"\nCPU: {report['cpu']}")
    print(f"{'route':8} {'append':>6} {'ITL p50':>8} {'p90':>8} {'p99':>8} {'p90/none':>9} "
          f"{'append TTFT p50':>16}")
    for row in report["summary"]:
        print(
            f"{row['route']:8} {row['append_tokens']:6} {row['itl_p50_ms']:8.1f} "
            f"{row['itl_p90_ms']:8.1f} {row['itl_p99_ms']:8.1f} {row['itl_p90_vs_none']:9.3f} "
            f"{row['append_ttft_p50_ms'] or 0:16.1f}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
