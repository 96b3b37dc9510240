"""A pull from decode against recomputing the same tokens on prefill (kv_recompute_threshold).

vLLM's prefill recomputes instead of pulling when fewer than ``kv_recompute_threshold`` tokens
are missing. The right threshold is where a pull's fixed cost equals the recompute of that many
tokens. This measures both on a running local pair started with the threshold off
(``agentkv up --kv-recompute-threshold 0``): turn 1 generates ``g`` tokens (``ignore_eos``), so
turn 2's prefill lacks about ``g`` tokens beyond its own cache; turn 2's P leg is timed once with
decode's handle (pull) and once without (recompute), interleaved, each session salted so no
cache is shared between them.

    .venv/bin/python benchmarks/pull_vs_recompute.py [--cluster-file .agentkv/cluster.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import uuid
from pathlib import Path

import agentkv
from agentkv import CachePolicy, HandleState, Message
from agentkv.local._config import default_cluster_file
from agentkv.local._cpu import read_cpu_info

SYSTEM = "You are a log summarizer. Keep answers short.\n" + "\n".join(
    f"{i:03d} worker {i % 7} finished job {i * 31 % 211} in {i % 13} s." for i in range(30)
)
NO_HANDLE = CachePolicy(min_reuse_tokens=10**9)


BLOCK = 128  # vLLM's CPU block size: prefill's own cache holds whole blocks only


def _turn2_prefill(cluster: agentkv.Cluster, generated: int, *, pull: bool) -> tuple[float, int]:
    """P-leg seconds of turn 2, and the tokens prefill lacked beyond its own cache (whole blocks
    of turn 1's prompt): what the pull loads, or what is recomputed without it."""
    salt = uuid.uuid4().hex
    with cluster.session(
        max_tokens=generated,
        policy=CachePolicy() if pull else NO_HANDLE,
        extra_body={"cache_salt": salt, "ignore_eos": True, "min_tokens": generated},
    ) as session:
        session.append(Message.system(SYSTEM))
        first = session.send("Summarize the log.").stats
        result = session.send("Shorter.", max_tokens=1, extra_body={"cache_salt": salt})
    stats = result.stats
    assert (stats.handle_state is HandleState.ATTACHED) == pull, stats.handle_reason
    return stats.prefill_s, stats.ideal_reused_tokens - first.prompt_tokens // BLOCK * BLOCK


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster-file", default=str(default_cluster_file()))
    parser.add_argument("--generated", default="1,4,16,32,64,128")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    rows = []
    with agentkv.Cluster.from_file(Path(args.cluster_file)) as cluster:
        _turn2_prefill(cluster, 8, pull=True)  # warm: the NIXL handshake happens once per pair
        for generated in map(int, args.generated.split(",")):
            pulls, recomputes, missing = [], [], []
            for _ in range(args.repeats):
                seconds, lacked = _turn2_prefill(cluster, generated, pull=True)
                pulls.append(seconds)
                missing.append(lacked)
                recomputes.append(_turn2_prefill(cluster, generated, pull=False)[0])
            row = {
                "generated": generated,
                "missing_tokens": statistics.median(missing),
                "pull_ms": round(statistics.median(pulls) * 1000, 1),
                "recompute_ms": round(statistics.median(recomputes) * 1000, 1),
            }
            print(json.dumps(row), file=sys.stderr, flush=True)
            rows.append(row)
    out = {"cpu": read_cpu_info().model, "command": " ".join(sys.argv), "rows": rows}
    print(json.dumps(out, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
