"""Finished conversations through the proxy, back to back, on a small decode: relief off vs on.

    .venv/bin/agentkv up --decode-kv-cache-gib 0.5
    .venv/bin/python benchmarks/proxy_pressure.py --json docs/bench/proxy-pressure.json

Runs ``agentkv proxy`` in process (``ProxyServer``) on the pair of an existing cluster file.
``--conversations`` (16) conversations, each with a unique ~``--context-tokens`` (2,500) token
system prompt and ``--turns`` (3) turns, ``--concurrency`` (4) of them in flight, each starting
as soon as one ends, through the openai SDK (streamed, so the first token's time is the
client's). A finished conversation is not deleted: as with most clients, its session idles,
and its last turn's pin stays on decode until the idle persist or expiry, or until the proxy's
pressure relief frees it (``--relieve-kv-usage``, ``docs/proxy.md``). Two modes on the same
pair, one after the other, with the same prompts: ``off`` (no relief) and ``on`` (0.9). Between
them every session is deleted (its pin released) and the next mode's prompts are salted apart
(another API key), so neither mode finds the other's prefixes cached.

Reported per mode: TTFT p50/p90 of first and later turns, decode's mean queue time per request
(``vllm:request_queue_time_seconds``, sum and count from decode's ``/metrics`` before and after),
its KV usage's peak (sampled every 0.5 s), and how many pins the relief freed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx2
from openai import AsyncOpenAI

import agentkv
from agentkv.proxy import ProxyConfig, ProxyServer

WORDS = (
    "harbour", "ledger", "cargo", "tide", "anchor", "pilot", "crane", "berth", "manifest",
    "customs", "ferry", "quay", "beacon", "channel", "rudder", "keel", "mast", "sail", "galley",
    "hull", "compass", "chart", "lantern", "rope",
)
QUESTIONS = ("Summarise the rules in one line.", "Which rule matters most?", "Why?", "Thanks.")
QUEUE = re.compile(r"^vllm:request_queue_time_seconds_(sum|count)\{[^}]*\} (\S+)$", re.M)
USAGE = re.compile(r"^vllm:kv_cache_usage_perc\{[^}]*\} (\S+)$", re.M)


def system_prompt(index: int, tokens: int, seed: int) -> str:
    """A unique rulebook of about ``tokens`` tokens (~1.3 tokens a word for SmolLM2)."""
    rng = random.Random(seed * 1000 + index)  # noqa: S311 - reproducible text, not a secret
    rules = []
    for n in range(max(1, int(tokens / 1.3) // 12)):
        words = " ".join(rng.choice(WORDS) for _ in range(10))
        rules.append(f"Rule {index}.{n}: {words}.")
    return f"You are assistant {index}. Follow these rules. " + " ".join(rules)


async def decode_metrics(client: httpx2.AsyncClient, decode: str) -> dict[str, float]:
    text = (await client.get(decode + "/metrics")).text
    found = {name: float(value) for name, value in QUEUE.findall(text)}
    usage = [float(v) for v in USAGE.findall(text)]
    return {
        "queue_sum": found.get("sum", 0.0),
        "queue_count": found.get("count", 0.0),
        "usage": max(usage) if usage else 0.0,
    }


async def conversation(
    client: AsyncOpenAI,
    model: str,
    index: int,
    args: argparse.Namespace,
    ttfts: list[tuple[int, float]],
) -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": system_prompt(index, args.context_tokens, args.seed)}
    ]
    for turn in range(args.turns):
        messages.append({"role": "user", "content": QUESTIONS[turn % len(QUESTIONS)]})
        started = time.perf_counter()
        first: float | None = None
        text = []
        stream = await client.chat.completions.create(
            model=model,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=args.output_tokens,
            temperature=0.0,
            stream=True,
            extra_headers={"X-Session-ID": f"conv-{index}"},
        )
        async for chunk in stream:
            delta = chunk.choices[0].delta.content if chunk.choices else None
            if delta:
                if first is None:
                    first = time.perf_counter() - started
                text.append(delta)
        ttfts.append((turn + 1, first if first is not None else time.perf_counter() - started))
        messages.append({"role": "assistant", "content": "".join(text)})


def _relieved(server: ProxyServer) -> float:
    assert server.app is not None
    metrics = server.app.state.metrics
    name = "agentkv_proxy_pins_relieved_total"
    return float(
        metrics.value(name, outcome="released") + metrics.value(name, outcome="persisted")
    )


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


async def run_mode(
    name: str, args: argparse.Namespace, cluster_file: Path, decode: str, key: str
) -> dict[str, Any]:
    config = ProxyConfig(
        port=0,
        relieve_kv_usage=0.9 if name == "on" else None,
        relieve_interval_s=1.0,
        offload_idle_s=None,  # the relief alone frees pins (no 120 s offload in a 3 min run)
    )
    server = ProxyServer(lambda: agentkv.AsyncCluster.from_file(cluster_file), config)
    ttfts: list[tuple[int, float]] = []
    peak = 0.0
    with server:
        async with httpx2.AsyncClient(timeout=30.0) as http:
            before = await decode_metrics(http, decode)
            client = AsyncOpenAI(
                base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=900
            )
            model = (await client.models.list()).data[0].id
            queue: asyncio.Queue[int] = asyncio.Queue()
            for index in range(args.conversations):
                queue.put_nowait(index)
            done = 0

            async def worker() -> None:
                nonlocal done
                while not queue.empty():
                    index = queue.get_nowait()
                    await conversation(client, model, index, args, ttfts)
                    done += 1
                    print(f"[{name}] conversation {done}/{args.conversations}", file=sys.stderr)

            async def sample() -> None:
                nonlocal peak
                while True:
                    peak = max(peak, (await decode_metrics(http, decode))["usage"])
                    await asyncio.sleep(0.5)

            sampler = asyncio.create_task(sample())
            started = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(args.concurrency)))
            wall = time.perf_counter() - started
            sampler.cancel()
            after = await decode_metrics(http, decode)
            relieved = server.call(lambda: _relieved(server))
            for index in range(args.conversations):  # the next mode starts with decode empty
                await http.delete(
                    f"{server.url}/v1/sessions/conv-{index}",
                    headers={"Authorization": f"Bearer {key}"},
                )
            await client.close()
    count = after["queue_count"] - before["queue_count"]
    first = [t for turn, t in ttfts if turn == 1]
    later = [t for turn, t in ttfts if turn > 1]
    return {
        "mode": name,
        "wall_s": round(wall, 1),
        "turns": len(ttfts),
        "ttft_first_p50_s": round(statistics.median(first), 3),
        "ttft_first_p90_s": round(_pct(first, 0.9), 3),
        "ttft_later_p50_s": round(statistics.median(later), 3) if later else None,
        "ttft_later_p90_s": round(_pct(later, 0.9), 3) if later else None,
        "decode_queue_mean_s": round((after["queue_sum"] - before["queue_sum"]) / count, 3)
        if count
        else None,
        "decode_requests": int(count),
        "decode_kv_usage_peak": round(peak, 3),
        "pins_relieved": int(relieved),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cluster-file", default=".agentkv/cluster.json")
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--context-tokens", type=int, default=2500)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--modes", default="off,on")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    cluster_file = Path(args.cluster_file)
    spec = json.loads(cluster_file.read_text())
    decode = spec["pairs"][0]["decode"]
    results = []
    for n, mode in enumerate(args.modes.split(",")):
        result = asyncio.run(run_mode(mode, args, cluster_file, decode, key=f"sk-bench-{n}"))
        results.append(result)
        print(json.dumps(results[-1]), file=sys.stderr)
    header = (
        "mode", "turns", "ttft_first_p50_s", "ttft_first_p90_s", "ttft_later_p50_s",
        "ttft_later_p90_s", "decode_queue_mean_s", "decode_kv_usage_peak", "pins_relieved",
        "wall_s",
    )
    print(" | ".join(header))
    for row in results:
        print(" | ".join(str(row[h]) for h in header))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        report = {"args": vars(args) | {"json": str(args.json)}, "results": results}
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
