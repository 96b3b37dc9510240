"""A P leg right after a decode request, and the same P leg after a pause (docs/idle.md).

On a 2-core machine a vLLM worker that spins on its shared-memory queue for a second after each
step takes a core from whatever runs next. This sends a short request to decode, then at once
(or after ``--pause`` seconds) a prefill of a mostly cached prompt, and prints the prefill's
latency. Run it against a pair from ``agentkv up``:

    .venv/bin/python benchmarks/prefill_after_decode.py [--cluster-file .agentkv/cluster.json]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import httpx2

from agentkv.local._config import ClusterRecord, default_cluster_file

WORDS = "the agent reads the file and reports what it found in the log "


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster-file", default=str(default_cluster_file()))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--pause", type=float, default=1.5, help="seconds, for the second case")
    args = parser.parse_args()
    cluster = ClusterRecord.read(Path(args.cluster_file))
    pair = cluster.pairs[0]
    model = cluster.model
    with httpx2.Client(timeout=300) as client:
        messages = [
            {"role": "system", "content": "You are a coding agent. " + WORDS * 180},
            {"role": "user", "content": "Start."},
        ]
        ids = client.post(
            pair.prefill.url + "/tokenize",
            json={"model": model, "messages": messages, "add_generation_prompt": True},
        ).json()["tokens"]
        prefill = {"model": model, "prompt": ids, "max_tokens": 1}
        decode = {"model": model, "prompt": ids[:50], "max_tokens": 8}
        client.post(pair.prefill.url + "/v1/completions", json=prefill)  # cache the prompt

        def timed_prefill() -> tuple[float, int]:
            start = time.perf_counter()
            answer = client.post(pair.prefill.url + "/v1/completions", json=prefill).json()
            cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
            return (time.perf_counter() - start) * 1000, cached

        for label, pause in (("right after a decode request", 0.0),
                             (f"{args.pause:g} s after a decode request", args.pause)):
            times = []
            for _ in range(args.repeats):
                client.post(pair.decode.url + "/v1/completions", json=decode)
                time.sleep(pause)
                elapsed, cached = timed_prefill()
                times.append(elapsed)
            print(
                f"P leg {label:32s} median {statistics.median(times):7.1f} ms, "
                f"min {min(times):7.1f}, max {max(times):7.1f} "
                f"({len(ids)}-token prompt, {cached} cached)"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
