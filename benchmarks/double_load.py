"""Two loads of one save file, first turns at once, on the real local pair: who attaches.

Each round runs what a user would: a two-turn session with greedy answers, ``save``, ``detach``,
then ``--copies`` loads of the file whose first turns go out together (``asyncio.gather``).
Decode's claim is exclusive, so exactly one copy may attach the handle; the others recompute.
For every copy's turn it reports the handle state, prefill's reused tokens, the drift of its
logprobs from a cold, teacher-forced recompute of the same tokens (``agentkv.testing``), and
whether the copies' greedy answers are identical (or part at a near-tie within the dtype's
tolerance: the tie gap is printed).

    .venv/bin/agentkv up
    .venv/bin/python benchmarks/double_load.py --rounds 5 --json docs/bench/double-load.json

The pair must be agentkv's (``agentkv up``): the claim is its connector's. The output names
the CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import tempfile
import uuid
from pathlib import Path
from typing import Any

import structlog

import agentkv
from agentkv import Message
from agentkv.local._config import ClusterRecord, LocalClusterConfig
from agentkv.local._cpu import read_cpu_info
from agentkv.local._launch import existing_cluster
from agentkv.testing import logprob_drift, teacher_forced_logprobs, tie_gap

SYSTEM = "You are a ferry dispatcher. Answer in one short sentence.\n" + "\n".join(
    f"Pier {i}: ferry {i * 29 % 89} sails to island {chr(65 + i % 26)}{i}." for i in range(40)
)
QUESTIONS = ("Which ferry is at pier 5?", "Where does it sail?", "Which pier serves island C2?")


def _saved(cluster_file: Path, path: Path, salt: str) -> None:
    with agentkv.Cluster.from_file(cluster_file) as cluster:
        session = cluster.session(
            max_tokens=24, extra_body={"logprobs": True, "cache_salt": salt}
        )
        session.append(Message.system(SYSTEM))
        for question in QUESTIONS[:2]:
            session.send(question)
        session.save(path)
        session.detach()


async def _race(cluster_file: Path, path: Path, copies: int) -> list[tuple[Any, list[int]]]:
    async with agentkv.AsyncCluster.from_file(cluster_file) as cluster:
        sessions = [agentkv.AsyncSession.load(path, cluster) for _ in range(copies)]
        results = await asyncio.gather(*(s.send(QUESTIONS[2]) for s in sessions))
        turns = []
        for session, result in zip(sessions, results, strict=True):
            tokens = session.transcript.token_ids
            turns.append((result, list(tokens[: len(tokens) - len(result.token_ids)])))
            await session.aclose()
        return turns


def _round(record: ClusterRecord, cluster_file: Path, copies: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "session.json"
        _saved(cluster_file, path, uuid.uuid4().hex)
        turns = asyncio.run(_race(cluster_file, path, copies))
    url = record.pairs[0].prefill.url
    rows = []
    for result, prompt in turns:
        reference = teacher_forced_logprobs(
            url, model=record.model, prompt_ids=prompt, generated_ids=result.token_ids
        )
        drift = logprob_drift(result.logprobs, reference, result.token_ids)
        rows.append({
            "state": str(result.stats.handle_state),
            "reused": result.stats.reused_tokens,
            "ideal": result.stats.ideal_reused_tokens,
            "drift": round(drift.max_abs, 4),
            "reason": result.stats.handle_reason,
        })
    answers = [result.token_ids for result, _ in turns]
    gap = None
    if any(a != answers[0] for a in answers):
        a, b = next((x, y) for x in answers for y in answers if x != y)
        index = next(i for i, (p, q) in enumerate(zip(a, b, strict=False)) if p != q)
        result, prompt = next(t for t in turns if t[0].token_ids == a)
        at = teacher_forced_logprobs(
            url, model=record.model, prompt_ids=prompt, generated_ids=a[: index + 1]
        )[index]
        gap = round(tie_gap(at, a[index], b[index]), 4)
    return {"copies": rows, "identical": gap is None, "tie_gap": gap}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cluster-file", type=Path, default=Path(".agentkv/cluster.json"))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--copies", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    record = existing_cluster(LocalClusterConfig(cluster_file=args.cluster_file))
    if record is None:
        raise SystemExit(f"no running local pair at {args.cluster_file}: run `agentkv up` first")
    cpu = read_cpu_info()
    print(f"CPU: {cpu.model} ({cpu.isa}); dtype {record.dtype or 'bfloat16'}")
    rounds = []
    for number in range(1, args.rounds + 1):
        outcome = _round(record, args.cluster_file, args.copies)
        rounds.append(outcome)
        cells = "  ".join(
            f"{c['state']:>8} reused {c['reused']:>4}/{c['ideal']:<4} drift {c['drift']:.3f}"
            for c in outcome["copies"]
        )
        same = "identical" if outcome["identical"] else f"part at tie gap {outcome['tie_gap']}"
        print(f"round {number}: {cells}  answers {same}", flush=True)
    attached = [sum(c["state"] == "attached" for c in r["copies"]) for r in rounds]
    drifts = [c["drift"] for r in rounds for c in r["copies"]]
    print(f"attached per round: {attached}; largest drift {max(drifts):.3f} nats; "
          f"identical answers in {sum(r['identical'] for r in rounds)}/{len(rounds)} rounds")
    if args.json is not None:
        report = {"cpu": cpu.model, "isa": cpu.isa, "rounds": rounds}
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
