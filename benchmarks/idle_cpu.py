"""Idle CPU and transfer speed of a local pair, stock vLLM settings vs agentkv's, in one run.

    .venv/bin/python benchmarks/idle_cpu.py --json bench-out/idle.json

For each mode it starts a fresh pair on its own ports, lets it settle, then measures:
- idle CPU of all server processes over 10 s (percent of one core, summed over the pair);
- cold prefill throughput: a unique ~1k-token prompt on the prefill node (tokens/s);
- a two-turn exchange: turn 2's prefill time with the decode node's handle (its TTFT floor) and
  the NIXL pull time from the prefill node's ``vllm:nixl_xfer_time_seconds`` histogram;
- idle CPU over 10 s while decode holds a turn-end pin, and 30 s later.
Modes run one after another with the same prompts; the table compares them.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx2

from agentkv.local._config import ClusterRecord, LocalClusterConfig
from agentkv.local._launch import start_cluster, stop_cluster
from agentkv.local._procs import group_cpu_percent

NULL_HANDLE = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
WORDS = [
    "alpha",
    "bravo",
    "charlie",
    "delta",
    "echo",
    "foxtrot",
    "golf",
    "hotel",
    "india",
    "juliet",
    "kilo",
    "lima",
    "mike",
    "november",
    "oscar",
    "papa",
    "quebec",
    "romeo",
    "sierra",
    "tango",
    "uniform",
    "victor",
    "whiskey",
    "xray",
    "yankee",
    "zulu",
]


def _say(message: str) -> None:
    print(f"[idle] {message}", file=sys.stderr, flush=True)


def _cpu(record: ClusterRecord, window: float) -> float:
    pids = [s.pid for p in record.pairs for s in (p.prefill, p.decode)]
    return round(sum(group_cpu_percent(pids, window_s=window).values()), 1)


def _metric_sum(client: httpx2.Client, url: str, name: str) -> float:
    text = client.get(f"{url}/metrics").text
    return sum(
        float(m) for m in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    )


def _tokenize(
    client: httpx2.Client, url: str, messages: list[dict[str, str]], gen: bool
) -> list[int]:
    body = {"messages": messages, "add_generation_prompt": gen, "add_special_tokens": False}
    tokens: list[int] = client.post(f"{url}/tokenize", json=body).json()["tokens"]
    return tokens


def _leg(  # noqa: PLR0917 - a private helper mirroring the wire fields
    client: httpx2.Client,
    url: str,
    model: str,
    messages: list[dict[str, str]],
    params: dict[str, Any],
    ids: list[int],
    max_tokens: int,
) -> tuple[dict[str, Any], float]:
    start = time.perf_counter()
    response = client.post(
        f"{url}/v1/chat/completions",
        json={
            "model": model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "return_token_ids": True,
            "kv_transfer_params": {**params, "prompt_token_ids": ids},
        },
    )
    response.raise_for_status()
    return response.json(), time.perf_counter() - start


def measure(record: ClusterRecord, seed: int) -> dict[str, Any]:
    pair, model = record.pairs[0], record.model
    p_url, d_url = pair.prefill.url, pair.decode.url
    rng = random.Random(seed)  # noqa: S311 - workload text, not secrets
    out: dict[str, Any] = {}
    time.sleep(10)
    out["idle_cpu_percent"] = _cpu(record, 10)
    _say(f"idle CPU {out['idle_cpu_percent']}%")
    with httpx2.Client(timeout=600) as client:
        text = " ".join(rng.choice(WORDS) for _ in range(900))
        cold = [{"role": "user", "content": f"{rng.random()} {text}"}]
        ids = _tokenize(client, p_url, cold, gen=True)
        _, seconds = _leg(client, p_url, model, cold, NULL_HANDLE, ids, 1)
        out["cold_prefill_tokens_per_s"] = round(len(ids) / seconds, 1)
        system = " ".join(rng.choice(WORDS) for _ in range(1000))
        messages = [{"role": "system", "content": system}, {"role": "user", "content": "Go on."}]
        ids = _tokenize(client, p_url, messages, gen=True)
        p1, _ = _leg(client, p_url, model, messages, NULL_HANDLE, ids, 1)
        d1, _ = _leg(client, d_url, model, messages, p1["kv_transfer_params"], ids, 32)
        generated = d1["choices"][0]["token_ids"]
        anchor = [
            {"role": "system", "content": "s"},
            {"role": "user", "content": "u"},
            {"role": "assistant", "content": "a"},
        ]
        closed = _tokenize(client, p_url, anchor, gen=False)
        grown = _tokenize(client, p_url, [*anchor, {"role": "user", "content": "More."}], gen=True)
        closing = closed[-1:] if generated[-1] == closed[-2] else closed[-2:]
        ids2 = ids + generated + closing + grown[len(closed) :]
        xfer_before = _metric_sum(client, p_url, "vllm:nixl_xfer_time_seconds_sum")
        p2, seconds = _leg(client, p_url, model, messages, d1["kv_transfer_params"], ids2, 1)
        out["turn2_prefill_ms"] = round(seconds * 1000, 1)
        out["turn2_cached_tokens"] = p2["usage"]["prompt_tokens_details"]["cached_tokens"]
        out["turn2_prompt_tokens"] = len(ids2)
        out["nixl_pull_ms"] = round(
            (_metric_sum(client, p_url, "vllm:nixl_xfer_time_seconds_sum") - xfer_before) * 1000, 1
        )
        # Leave a pin on decode: a turn whose handle is never used (as at a session's end).
        p3, _ = _leg(client, p_url, model, messages, NULL_HANDLE, ids, 1)
        _leg(client, d_url, model, messages, p3["kv_transfer_params"], ids, 8)
    out["pinned_idle_cpu_percent"] = _cpu(record, 10)
    time.sleep(20)
    out["pinned_idle_cpu_percent_30s_later"] = _cpu(record, 10)
    _say(json.dumps(out))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default="stock,agentkv")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    results: dict[str, Any] = {}
    for index, mode in enumerate(args.modes.split(",")):
        folder = Path(tempfile.mkdtemp(prefix=f"agentkv-idle-{mode}-"))
        config = LocalClusterConfig(
            cluster_file=folder / "cluster.json",
            base_port=18700 + 10 * index,
            base_side_channel_port=16700 + 10 * index,
            quiet=mode != "stock",
            agentkv_connector=mode != "stock",
        )
        _say(f"starting the {mode} pair")
        record = start_cluster(config, progress=_say)
        try:
            results[mode] = measure(record, args.seed)
        finally:
            stop_cluster(config, progress=_say)
    keys = list(next(iter(results.values())))
    print(f"{'metric':36}" + "".join(f"{mode:>12}" for mode in results))
    for key in keys:
        print(f"{key:36}" + "".join(f"{results[m][key]:>12}" for m in results))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
