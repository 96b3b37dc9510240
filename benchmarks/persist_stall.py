"""What a tier write costs the other sessions on its decode: tokens streamed during a persist.

A session with a long history (CONTEXT tokens) is pinned on decode; another session streams a
long answer on the same decode; while it streams, the first session persists its turn-end KV
to the file tier (``session.offload()``: decode writes the pinned blocks and fsyncs them).
Printed: how long the persist took, how many of the streaming session's tokens arrived while it
ran, and the streaming session's longest gap between tokens during the persist against its
median gap outside it. Before issue 39's item 7 the write ran on decode's engine thread: no
token could arrive during it, and the longest gap was the whole write. Now the workers write on
a thread of their own and the engine keeps stepping.

Run on a running local pair (``agentkv up``; the tier is on by default):

    .venv/bin/python benchmarks/persist_stall.py [--cluster-file .agentkv/cluster.json]
        [--context 6000] [--rounds 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import statistics
import time
from pathlib import Path

import structlog

from agentkv import AsyncCluster, Message, TextDelta
from agentkv.local._cpu import read_cpu_info

_FILLER = "The warehouse ledger lists parcel {i} on shelf {s}, row {r}, checked by clerk {c}. "


def _long_text(tokens: int) -> str:
    # ~20 tokens a sentence for SmolLM2's tokenizer.
    return "".join(_FILLER.format(i=i, s=i % 17, r=i % 5, c=i % 11) for i in range(tokens // 20))


async def _round(cluster: AsyncCluster, context: int, answer: int) -> dict[str, float]:
    big = cluster.session(max_tokens=8, temperature=0.0)
    await big.send(_long_text(context) + "Summarise.")
    streamer = cluster.session(max_tokens=answer, temperature=0.0,
                               extra_body={"ignore_eos": True})
    streamer.append(Message(role="user", content="Count slowly from one to one thousand."))
    arrivals: list[float] = []
    window: list[float] = []
    started = asyncio.Event()

    async def stream() -> None:
        async for event in streamer.stream():
            if isinstance(event, TextDelta):
                arrivals.append(time.perf_counter())
                if len(arrivals) == 8:
                    started.set()

    async def persist() -> bool:
        await started.wait()
        window.append(time.perf_counter())
        ref = await big.offload()
        window.append(time.perf_counter())
        return ref is not None

    _, persisted = await asyncio.gather(stream(), persist())
    await big.aclose()
    await streamer.aclose()
    if not persisted:
        raise SystemExit("the persist failed: is the tier on (agentkv up, agentkv connector)?")
    begin, end = window
    gaps = [(b - a, a, b) for a, b in itertools.pairwise(arrivals)]
    inside = [g for g, a, b in gaps if b > begin and a < end]
    outside = [g for g, a, b in gaps if b <= begin or a >= end]
    return {
        "persist_s": end - begin,
        "tokens_during_persist": sum(1 for t in arrivals if begin < t < end),
        "max_gap_during_s": max(inside, default=0.0),
        "median_gap_outside_s": statistics.median(outside) if outside else 0.0,
    }


async def _main(args: argparse.Namespace) -> dict[str, object]:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    async with AsyncCluster.from_file(args.cluster_file) as cluster:
        rounds = []
        for i in range(args.rounds):
            result = await _round(cluster, args.context, args.answer)
            rounds.append(result)
            print(f"[persist_stall] round {i + 1}/{args.rounds}:"
                  f" persist {result['persist_s']:.3f} s,"
                  f" {result['tokens_during_persist']} tokens streamed during it, longest gap"
                  f" {result['max_gap_during_s'] * 1e3:.0f} ms vs median"
                  f" {result['median_gap_outside_s'] * 1e3:.0f} ms outside", flush=True)
    return {"cpu": read_cpu_info().model, "context": args.context, "rounds": rounds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster-file", default=".agentkv/cluster.json")
    parser.add_argument("--context", type=int, default=6000,
                        help="tokens of the persisted session's history")
    parser.add_argument("--answer", type=int, default=160,
                        help="tokens the streaming session generates")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    report = asyncio.run(_main(args))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
