"""Decode KV occupancy over time, 16 sessions ending at different times: stock pins vs agentkv.

    .venv/bin/python benchmarks/decode_occupancy.py \\
        --json docs/bench/occupancy.json --png docs/bench/occupancy.png

Runs on the pair of an existing cluster file (``agentkv up``; decode must run agentkv's
connector). Each session ``i`` (``--sessions`` 16) has a unique ~1k-token conversation: turn 1
when the session opens (the sessions open one after another), then the session stays live
(a user thinking, a tool running) holding turn 1's pin, and at ``t ≈ 5 + 5·i`` s it sends its
short turn 2 and closes. Two modes, one after the other, on the same pair with the same prompts:

- ``agentkv``: the SDK's default ``CachePolicy``: turn 2 with ``final=True`` (decode pins
  nothing), then ``close()`` (releases whatever is still pinned through the lease route).
- ``stock``: what stock vLLM does, emulated through the public API with a ``CachePolicy``
  subclass (``StockPolicy``): every turn pins for decode's ``decoder_kv_blocks_ttl`` (the hint
  ``{"persist": true}`` without a TTL, which is exactly what decode does for a request without
  a hint) and ``decide_release`` is always false, so ``close()`` releases nothing and turn 2's
  pin lives out the server TTL (480 s).

``agentkv`` runs first: stock pins outlive the script by the TTL, so the pair is left holding
them (the script ends after sampling instead of waiting 480 s; the pins free themselves). A
warm-up sends each session's turn-1 conversation once to prefill as a plain request, so both
modes see the same warm prefill prefix cache and the same schedule.

Decode's own ``vllm:kv_cache_usage_perc`` (``GET /metrics``) is sampled every 0.5 s from the
mode's start until ``--tail-s`` (30 s) after the last session ended.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx2

import agentkv
from agentkv import CachePolicy
from agentkv._wire.hints import PinHint

USAGE = re.compile(r"^vllm:kv_cache_usage_perc\{[^}]*\} (\S+)$", re.MULTILINE)
RUNNING = re.compile(r"^vllm:num_requests_running\{[^}]*\} (\S+)$", re.MULTILINE)

WORDS = [
    "harbour",
    "ledger",
    "cargo",
    "tide",
    "anchor",
    "pilot",
    "crane",
    "berth",
    "manifest",
    "ferry",
    "rope",
    "signal",
    "dock",
    "hull",
    "ballast",
    "keel",
    "mast",
    "sail",
    "chart",
    "compass",
    "lantern",
    "barrel",
    "crate",
    "tanker",
    "quay",
    "buoy",
    "rudder",
    "deck",
    "galley",
    "hatch",
    "winch",
    "bollard",
    "tug",
    "barge",
    "container",
    "customs",
    "invoice",
    "freight",
    "schedule",
    "weather",
    "storm",
    "calm",
    "fog",
    "gale",
    "swell",
    "current",
    "reef",
    "lighthouse",
    "beacon",
    "radio",
    "clerk",
    "captain",
    "mate",
    "crew",
]


class StockPolicy(CachePolicy):
    """Stock vLLM's pin lifetimes: every turn pinned for the server TTL, nothing ever released."""

    __slots__ = ()

    def decide_pin(self, *, final: bool) -> PinHint:
        return PinHint(ttl_s=None)  # decoder_kv_blocks_ttl, as for a request without a hint

    # The SDK's turn called this older name until issue 41's rewrite; both decide the same.
    decide_persist = decide_pin

    def decide_release(self, handle: Any, *, now: float) -> bool:
        return False


def conversation(index: int, words: int) -> str:
    rng = random.Random(1000 + index)  # noqa: S311 - reproducible text, not a secret
    lines = [
        f"Log {index}-{n}: " + " ".join(rng.choices(WORDS, k=11)) + "." for n in range(words // 12)
    ]
    body = "\n".join(lines)
    return f"Here is harbour log book #{index}.\n{body}\nSummarise it later; for now just say OK."


class Sampler:
    def __init__(self, client: httpx2.AsyncClient, decode: str) -> None:
        self.client, self.decode = client, decode
        self.samples: list[dict[str, float]] = []

    async def read(self) -> tuple[float, float]:
        text = (await self.client.get(f"{self.decode}/metrics", timeout=5.0)).text
        usage = sum(float(v) for v in USAGE.findall(text))
        running = sum(float(v) for v in RUNNING.findall(text))
        return usage, running

    async def run(self, t0: float, stop: asyncio.Event, period: float) -> None:
        next_at = time.monotonic()
        while not stop.is_set():
            try:
                usage, running = await self.read()
                self.samples.append(
                    {"t": round(time.monotonic() - t0, 3), "usage": usage, "running": running}
                )
            except httpx2.HTTPError:
                pass
            next_at += period
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))


async def warm_prefill(
    client: httpx2.AsyncClient, prefill: str, model: str, prompts: list[str]
) -> float:
    started = time.monotonic()

    async def one(prompt: str) -> None:
        r = await client.post(
            f"{prefill}/v1/chat/completions",
            json={
                "model": model,
                "max_tokens": 1,
                "messages": [{"role": "user", "content": prompt}],
            },
            timeout=600.0,
        )
        r.raise_for_status()

    # A few at a time: a 2-core machine gains nothing from more.
    sem = asyncio.Semaphore(4)

    async def limited(prompt: str) -> None:
        async with sem:
            await one(prompt)

    await asyncio.gather(*(limited(p) for p in prompts))
    return time.monotonic() - started


async def run_mode(
    mode: str,
    cluster: agentkv.AsyncCluster,
    sampler: Sampler,
    prompts: list[str],
    args: argparse.Namespace,
) -> dict[str, Any]:
    policy: CachePolicy = StockPolicy() if mode == "stock" else CachePolicy()
    final = mode == "agentkv"
    sampler.samples = []
    t0 = time.monotonic()
    stop = asyncio.Event()
    sampling = asyncio.create_task(sampler.run(t0, stop, args.period_s))
    opened: list[asyncio.Event] = [asyncio.Event() for _ in prompts]
    sessions: list[dict[str, Any]] = [{} for _ in prompts]

    async def one(i: int) -> None:
        rec = sessions[i]
        if i:
            await opened[i - 1].wait()  # open one after another: prefill serves one at a time
        s = cluster.session(policy=policy, max_tokens=args.max_tokens, session_id=f"{mode}-{i}")
        rec["open_t"] = round(time.monotonic() - t0, 3)
        try:
            r1 = await s.send(prompts[i])
        finally:
            opened[i].set()
        rec["turn1_done_t"] = round(time.monotonic() - t0, 3)
        rec["turn1_prompt_tokens"] = r1.stats.prompt_tokens
        rec["turn1_leased"] = s.handle is not None and s.handle.leased
        end_at = max(args.first_end_s + args.spacing_s * i, rec["turn1_done_t"] + 1.0)
        rec["planned_end_t"] = round(end_at, 3)
        await asyncio.sleep(max(0.0, t0 + end_at - time.monotonic()))
        rec["turn2_start_t"] = round(time.monotonic() - t0, 3)
        r2 = await s.send("Thanks. One word: how was the weather?", final=final)
        rec["turn2_prompt_tokens"] = r2.stats.prompt_tokens
        rec["turn2_cached_tokens"] = r2.stats.reused_tokens
        rec["handle_after_turn2"] = s.handle is not None
        await s.aclose()
        rec["closed_t"] = round(time.monotonic() - t0, 3)

    results = await asyncio.gather(*(one(i) for i in range(len(prompts))), return_exceptions=True)
    errors = [repr(r) for r in results if isinstance(r, BaseException)]
    last_end = max((r.get("closed_t", 0.0) for r in sessions), default=0.0)
    await asyncio.sleep(max(0.0, t0 + last_end + args.tail_s - time.monotonic()))
    stop.set()
    await sampling
    return {"mode": mode, "sessions": sessions, "errors": errors, "samples": sampler.samples}


def live_count(sessions: list[dict[str, Any]], t: float) -> int:
    """Sessions holding turn 1's pin at ``t``: turn 1 answered, turn 2 not yet sent."""
    return sum(1 for r in sessions if r.get("turn1_done_t", 1e9) <= t < r.get("turn2_start_t", 1e9))


def ended_count(sessions: list[dict[str, Any]], t: float) -> int:
    return sum(1 for r in sessions if r.get("closed_t", 1e9) <= t)


def analyse(result: dict[str, Any], idle: float, blocks: int) -> dict[str, Any]:
    samples, sessions = result["samples"], result["sessions"]
    last_end = max(r.get("closed_t", 0.0) for r in sessions)
    peak = max(s["usage"] for s in samples)
    tail = [s["usage"] for s in samples if s["t"] >= last_end + 5.0]
    tail_level = statistics.median(tail) if tail else float("nan")
    # Per session holding a pin, on quiet samples (no request running on decode): live sessions
    # hold turn 1's pin; under stock, ended sessions also hold turn 2's.
    stock = result["mode"] == "stock"
    per_pinned = [
        (s["usage"] - idle) / n
        for s in samples
        if s["running"] == 0
        and (n := live_count(sessions, s["t"]) + (ended_count(sessions, s["t"]) if stock else 0))
        > 0
    ]
    mean_live_s = statistics.mean(
        r["turn2_start_t"] - r["turn1_done_t"] for r in sessions if "turn2_start_t" in r
    )
    return {
        "peak_usage": peak,
        "peak_blocks": round((peak - idle) * blocks, 1),
        "after_last_end_usage": tail_level,
        "after_last_end_blocks": round((tail_level - idle) * blocks, 1),
        "per_pinned_session_usage_median": statistics.median(per_pinned) if per_pinned else None,
        "mean_live_s": round(mean_live_s, 2),
        "last_end_t": last_end,
    }


def capacity(per_session: float, budget: float, ttl_s: float, live_s: float) -> dict[str, Any]:
    """Little's law: sessions arrive at a steady rate and hold one pin while live (``live_s``);
    stock also holds the last turn's pin ``ttl_s`` after the session ended, agentkv does not.
    Pinned sessions = live · (live_s + ttl_s) / live_s under stock, = live under agentkv."""
    agentkv_live = budget / per_session
    stock_live = agentkv_live * live_s / (live_s + ttl_s)
    return {
        "live_s": live_s,
        "agentkv_sessions": int(agentkv_live),
        "stock_sessions": int(stock_live),
        "ratio": round(agentkv_live / stock_live, 1),
    }


def plot(runs: list[dict[str, Any]], idle: float, path: Path, load: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 5))
    colours = {"stock": "tab:red", "agentkv": "tab:blue"}
    labels = {
        "stock": "stock vLLM pins (480 s TTL, no release)",
        "agentkv": "agentkv policy (final=True last turn + close())",
    }
    for run in runs:
        mode = run["mode"]
        t = [s["t"] for s in run["samples"]]
        u = [100.0 * s["usage"] for s in run["samples"]]
        ax.plot(t, u, color=colours[mode], label=labels[mode], lw=1.6)
        for n, r in enumerate(run["sessions"]):
            if "closed_t" in r:
                ax.axvline(
                    r["closed_t"],
                    color=colours[mode],
                    alpha=0.25,
                    lw=0.8,
                    ls="--",
                    label=f"session ends ({mode})" if n == 0 else None,
                )
    ax.axhline(100.0 * idle, color="grey", lw=0.8, ls=":", label="idle level")
    ax.set_xlabel("seconds since the mode started")
    ax.set_ylabel("decode vllm:kv_cache_usage_perc (%)")
    ax.set_title(
        f"Decode KV occupancy, 16 sessions ending at different times ({load})", fontsize=10
    )
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


async def amain(args: argparse.Namespace) -> int:
    started = time.monotonic()
    spec = json.loads(Path(args.cluster).read_text())  # noqa: ASYNC240 - once, at start
    pair = spec["pairs"][0]
    spec = {**spec, "pairs": [pair]}
    prompts = [conversation(i, args.words) for i in range(args.sessions)]
    load_before = os.getloadavg()
    async with (
        httpx2.AsyncClient() as client,
        agentkv.AsyncCluster.from_dict(spec, block_size=args.block_size) as cluster,
    ):
        info = (await client.get(f"{pair['decode']}/v1/agentkv/info")).json()
        if not info.get("leases"):
            print(
                "decode has no agentkv leases; this benchmark needs agentkv's connector",
                file=sys.stderr,
            )
            return 2
        sampler = Sampler(client, pair["decode"])
        idle, _ = await sampler.read()
        print(
            f"idle decode usage {idle:.4f}; warming prefill with {len(prompts)} prompts", flush=True
        )
        warm_s = await warm_prefill(client, pair["prefill"], spec["model"], prompts)
        print(f"warm-up {warm_s:.1f}s", flush=True)
        runs = []
        between: dict[str, Any] = {}
        for mode in args.modes.split(","):
            print(f"mode {mode} ...", flush=True)
            run = await run_mode(mode, cluster, sampler, prompts, args)
            runs.append(run)
            print(f"mode {mode} done: {len(run['errors'])} errors", flush=True)
            if mode == "agentkv":
                # Back to idle before stock mode (consumed pins are freed at decode's next step).
                begin = time.monotonic()
                while True:
                    usage, _ = await sampler.read()
                    waited = time.monotonic() - begin
                    if usage <= idle + 0.5 / args.blocks or waited > args.idle_wait_s:
                        break
                    await asyncio.sleep(0.5)
                between = {"usage": usage, "waited_s": round(waited, 2)}
    load_after = os.getloadavg()

    out = {
        "command": " ".join(["python", *sys.argv]),
        "cluster": pair,
        "model": spec["model"],
        "kv_blocks": args.blocks,
        "block_size": args.block_size,
        "sessions": args.sessions,
        "server_ttl_s": args.server_ttl_s,
        "idle_usage": idle,
        "load": {"before": load_before, "after": load_after, "cores": os.cpu_count()},
        "warm_up_s": round(warm_s, 2),
        "between_modes": between,
        "runtime_s": round(time.monotonic() - started, 1),
        "runs": runs,
        "note": "stock mode's pins are left on decode; they expire 480 s after each turn 2",
    }
    if "stock" not in {run["mode"] for run in runs} or "agentkv" not in {
        run["mode"] for run in runs
    }:
        print(json.dumps({"idle": idle, "runs": runs}, indent=1))
        return 0
    return report(out, args)


def report(out: dict[str, Any], args: argparse.Namespace) -> int:
    """Summary, capacity model, JSON and plot from a run (fresh, or read back with --reanalyse)."""
    runs, idle, blocks = out["runs"], out["idle_usage"], out["kv_blocks"]
    summary = {run["mode"]: analyse(run, idle, blocks) for run in runs}
    # Per ended session under stock: the pin of its turn 2, measured after the last end.
    per_session = (summary["stock"]["after_last_end_usage"] - idle) / out["sessions"]
    budget = 1.0 - idle
    live_times = [summary["agentkv"]["mean_live_s"], 60.0, 300.0]
    out["summary"] = summary
    out["capacity_model"] = {
        "model": "Little's law, steady arrivals: each session pins ~per_session_usage while live "
        "(live_s between turns); stock also keeps the last turn's pin server_ttl_s after the "
        "session ended, agentkv frees it at the end (final=True / close()). Handles alive within "
        "the budget: agentkv budget/per_session live sessions; stock that times "
        "live_s/(live_s+server_ttl_s).",
        "per_session_usage": per_session,
        "per_session_blocks": round(per_session * blocks, 2),
        "per_live_session_usage_agentkv": summary["agentkv"]["per_pinned_session_usage_median"],
        "budget_usage": budget,
        "server_ttl_s": out["server_ttl_s"],
        "rows": [capacity(per_session, budget, out["server_ttl_s"], ls) for ls in live_times],
    }
    before, after = out["load"]["before"], out["load"]["after"]
    load = f"load avg {before[0]:.1f} → {after[0]:.1f} on {out['load']['cores']} cores"
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    if args.png:
        plot(runs, idle, Path(args.png), load)
    keys = ("idle_usage", "load", "between_modes", "summary", "capacity_model", "runtime_s")
    print(json.dumps({k: out[k] for k in keys}, indent=1))
    for run in runs:
        if run["errors"]:
            print(run["mode"], "errors:", run["errors"], file=sys.stderr)
    return 1 if any(run["errors"] for run in runs) else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", default=".agentkv/cluster.json")
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument(
        "--words", type=int, default=520, help="≈ words of each conversation (~1k tokens)"
    )
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--first-end-s", type=float, default=5.0)
    parser.add_argument("--spacing-s", type=float, default=5.0)
    parser.add_argument("--tail-s", type=float, default=30.0)
    parser.add_argument("--period-s", type=float, default=0.5)
    parser.add_argument("--idle-wait-s", type=float, default=45.0)
    parser.add_argument(
        "--blocks", type=int, default=364, help="decode's KV blocks (1 GiB / 128 tokens)"
    )
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--server-ttl-s", type=float, default=480.0)
    parser.add_argument("--modes", default="agentkv,stock", help=argparse.SUPPRESS)
    parser.add_argument("--json")
    parser.add_argument("--png")
    parser.add_argument(
        "--reanalyse", metavar="JSON", help="recompute summary, model and plot from a saved run"
    )
    args = parser.parse_args()
    if args.reanalyse:
        return report(json.loads(Path(args.reanalyse).read_text()), args)
    return asyncio.run(amain(args))


if __name__ == "__main__":
    sys.exit(main())
