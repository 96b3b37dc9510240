"""Serving dtype per CPU: speed and numeric drift of the local pair, one configuration at a time.

For each configuration (dtype x ISA; ``--isa avx2`` runs the servers as on an AVX2-only CPU,
see agentkv/local/_cpu.py) this starts a local pair on its own ports and measures:

* cold prefill: tokens/s of a 1,024-token prompt no cache holds (a fresh ``cache_salt``);
* decode: tokens/s of 64 generated tokens;
* a 5-turn conversation (the e2e suite's), streamed, once with reuse and once without: TTFT of
  turns >= 2, whether the greedy answers are identical, the drift of every turn's logprobs from
  a cold, teacher-forced reference (agentkv.testing.logprob_drift), with and without reuse, and
  the closest tie between the two likeliest tokens met on the way (drift above it can flip a
  greedy choice);
* wrong KV: a turn sent with another session's handle, and its drift from the reference.

    .venv/bin/python benchmarks/cpu_dtype.py --dtypes bfloat16,float32 --isas native,avx2 \\
        --json docs/bench/cpu-dtype.json

Numbers depend on the CPU above all: the output names it. Run on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx2

import agentkv
from agentkv import CachePolicy, HandleState, Message
from agentkv._client import kv
from agentkv.local._config import ClusterRecord, LocalClusterConfig
from agentkv.local._cpu import read_cpu_info
from agentkv.local._launch import start_cluster, stop_cluster
from agentkv.testing import logprob_drift, teacher_forced_logprobs, tie_gap

SYSTEM = "You are a warehouse assistant. Answer in one short sentence.\n" + "\n".join(
    f"Shelf {i}: holds parcel {i * 37 % 101} for customer {chr(65 + i % 26)}{i}." for i in range(40)
)
OTHER_SYSTEM = "You are a librarian. Answer in one short sentence.\n" + "\n".join(
    f"Row {i}: the book {i * 13 % 97} by author {chr(90 - i % 26)}{i * 3}." for i in range(40)
)
QUESTIONS = (
    "Which parcel is on shelf 3?",
    "Who is the customer on shelf 7?",
    "Which shelf holds parcel 74?",
    "Summarize your answers.",
    "Is there a shelf 61?",
)
NO_HANDLE = CachePolicy(min_reuse_tokens=10**9)
LOGPROBS = {"logprobs": True}
WORDS = "the agent reads the file and reports what it found in the log and moves on "


def _say(message: str) -> None:
    print(f"[cpu-dtype] {message}", file=sys.stderr, flush=True)


def _prompt_of(session: agentkv.Session, result: agentkv.TurnResult) -> list[int]:
    tokens = session.transcript.token_ids
    generated = result.token_ids
    assert tokens[len(tokens) - len(generated):] == generated
    return list(tokens[: len(tokens) - len(generated)])


def _conversation(
    cluster_file: Path, policy: CachePolicy, *, system: str = SYSTEM
) -> list[tuple[agentkv.TurnResult, list[int]]]:
    out = []
    with agentkv.Cluster.from_file(cluster_file) as cluster, cluster.session(
        max_tokens=24, policy=policy, extra_body=LOGPROBS
    ) as session:
        session.append(Message.system(system))
        for question in QUESTIONS:
            # Streamed, so that ttft_s is the time to the first token, not to the last.
            session.append(Message.user(question))
            result = list(session.stream())[-1]
            assert isinstance(result, agentkv.TurnResult)
            out.append((result, _prompt_of(session, result)))
    return out


def _drifts(
    turns: list[tuple[agentkv.TurnResult, list[int]]], server: str, model: str
) -> tuple[list[float], float]:
    """Each turn's largest drift from the cold reference, and the closest top-2 tie met."""
    drifts, closest = [], float("inf")
    for result, prompt in turns:
        assert result.logprobs is not None
        reference = teacher_forced_logprobs(
            server, model=model, prompt_ids=prompt, generated_ids=result.token_ids
        )
        drifts.append(logprob_drift(result.logprobs, reference, result.token_ids).max_abs)
        for position in reference:
            best = sorted(position.values(), reverse=True)
            if len(best) >= 2:
                closest = min(closest, best[0] - best[1])
    return drifts, closest


def _divergence(
    a: list[tuple[agentkv.TurnResult, list[int]]],
    b: list[tuple[agentkv.TurnResult, list[int]]],
    server: str,
    model: str,
) -> dict[str, Any] | None:
    """Where two greedy conversations first differ, and how close a tie that token was."""
    for turn, ((ra, prompt), (rb, _)) in enumerate(zip(a, b, strict=True), start=1):
        if ra.token_ids == rb.token_ids:
            continue
        index = next(
            (i for i, (x, y) in enumerate(zip(ra.token_ids, rb.token_ids, strict=False))
             if x != y),
            min(len(ra.token_ids), len(rb.token_ids)),
        )
        reference = teacher_forced_logprobs(
            server, model=model, prompt_ids=prompt, generated_ids=ra.token_ids[: index + 1]
        )[index] if index < len(ra.token_ids) else {}
        gap = (
            tie_gap(reference, ra.token_ids[index], rb.token_ids[index])
            if index < min(len(ra.token_ids), len(rb.token_ids))
            else float("inf")
        )
        return {"turn": turn, "token": index, "tie_gap": gap}
    return None


def _wrong_kv_drift(cluster_file: Path, server: str, model: str) -> dict[str, Any]:
    """Turn 2 of one session sent with another session's handle (same pair, other prefix).

    As in tests/e2e/test_session_e2e.py: the victim is salted (prefill holds only its turn 1's
    whole blocks), and the donor's handle ends between those and the victim's turn-2 prompt.
    """
    with agentkv.Cluster.from_file(cluster_file) as cluster, cluster.session(
        max_tokens=24, extra_body={**LOGPROBS, "cache_salt": uuid.uuid4().hex}
    ) as victim, cluster.session(max_tokens=24, extra_body=LOGPROBS) as donor:
        victim.append(Message.system(SYSTEM))
        donor.append(Message.system(OTHER_SYSTEM))
        first = victim.send(QUESTIONS[0])
        donor.send("Which book is in row 3?")
        assert donor.handle is not None
        # Deliberately wrong: the donor's KV behind the victim's prompt.
        victim._state.apply(kv.Step(kv.Pinned(handle=donor.handle)))
        donor._state.apply(kv.detached(donor._state.kv))
        result = victim.send(QUESTIONS[1])
        assert result.stats.handle_state is HandleState.ATTACHED
        prompt = _prompt_of(victim, result)
    assert result.logprobs is not None
    reference = teacher_forced_logprobs(
        server, model=model, prompt_ids=prompt, generated_ids=result.token_ids
    )
    drift = logprob_drift(result.logprobs, reference, result.token_ids).max_abs
    # Prefill held turn 1's whole blocks; what it reused beyond them came from the donor.
    return {"drift": round(drift, 5), "reused_tokens": result.stats.reused_tokens,
            "turn1_prompt_tokens": first.stats.prompt_tokens}


def _cold_prefill_tps(record: ClusterRecord, client: httpx2.Client, repeats: int) -> float:
    url = record.pairs[0].prefill.url
    ids = client.post(url + "/tokenize", json={"model": record.model, "prompt": WORDS * 80})
    prompt = ids.json()["tokens"][:1024]
    rates = []
    for _ in range(repeats):
        body = {"model": record.model, "prompt": prompt, "max_tokens": 1,
                "cache_salt": uuid.uuid4().hex}
        start = time.perf_counter()
        client.post(url + "/v1/completions", json=body).raise_for_status()
        rates.append(len(prompt) / (time.perf_counter() - start))
    return statistics.median(rates)


def _decode_tps(record: ClusterRecord, client: httpx2.Client) -> float:
    url = record.pairs[0].decode.url
    body = {"model": record.model, "prompt": "Once upon a time", "max_tokens": 64,
            "ignore_eos": True, "cache_salt": uuid.uuid4().hex}
    client.post(url + "/v1/completions", json=body).raise_for_status()  # warm
    start = time.perf_counter()
    client.post(url + "/v1/completions", json=body).raise_for_status()
    return 64 / (time.perf_counter() - start)


def measure(dtype: str, isa: str | None, *, workdir: Path, repeats: int) -> dict[str, Any]:
    config = LocalClusterConfig(
        cluster_file=workdir / f"{dtype}-{isa or 'native'}" / "cluster.json",
        base_port=18500,
        base_side_channel_port=16500,
        dtype=dtype,
        cpu_isa=isa,
    )
    started = time.perf_counter()
    record = start_cluster(config, progress=_say)
    start_s = time.perf_counter() - started
    try:
        server = record.pairs[0].prefill.url
        with httpx2.Client(timeout=600) as client:
            cold = _cold_prefill_tps(record, client, repeats)
            decode = _decode_tps(record, client)
        with_reuse = _conversation(config.cluster_file, CachePolicy())
        without = _conversation(config.cluster_file, NO_HANDLE)
        ttfts = [r.stats.ttft_s for r, _ in with_reuse[1:]]
        ttfts_cold = [r.stats.ttft_s for r, _ in without[1:]]
        drift_with, tie_with = _drifts(with_reuse, server, record.model)
        drift_without, tie_without = _drifts(without, server, record.model)
        return {
            "dtype": dtype,
            "isa": isa or "native",
            "start_s": round(start_s, 1),
            "cold_prefill_tokens_per_s": round(cold, 1),
            "decode_tokens_per_s": round(decode, 1),
            "ttft_p50_turns_2plus_s": round(statistics.median(ttfts), 3),
            "ttft_p50_turns_2plus_no_reuse_s": round(statistics.median(ttfts_cold), 3),
            "reuse_ratio": round(
                sum(r.stats.reused_tokens for r, _ in with_reuse[1:])
                / sum(r.stats.ideal_reused_tokens for r, _ in with_reuse[1:]), 4
            ),
            "identical_answers": [r.token_ids for r, _ in with_reuse]
            == [r.token_ids for r, _ in without],
            "first_divergence": _divergence(with_reuse, without, server, record.model),
            "drift_with_reuse": [round(d, 5) for d in drift_with],
            "drift_without_reuse": [round(d, 5) for d in drift_without],
            "closest_top2_gap": round(min(tie_with, tie_without), 5),
            "wrong_kv": _wrong_kv_drift(config.cluster_file, server, record.model),
        }
    finally:
        stop_cluster(config, progress=_say)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--isas", default="native", help="comma-separated: native, avx2")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--workdir", default=".agentkv/bench-cpu-dtype")
    args = parser.parse_args()
    cpu = read_cpu_info()
    rows = []
    for isa in args.isas.split(","):
        for dtype in args.dtypes.split(","):
            _say(f"{dtype} on {cpu.model} ({'native ISA' if isa == 'native' else isa})")
            row = measure(dtype, None if isa == "native" else isa,
                          workdir=Path(args.workdir), repeats=args.repeats)
            _say(json.dumps(row))
            rows.append(row)
    out = {"cpu": cpu.model, "cpu_isa": cpu.isa, "command": " ".join(sys.argv), "rows": rows}
    print(json.dumps(out, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
