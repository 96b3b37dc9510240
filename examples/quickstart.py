"""Quickstart: two turns on the local prefill/decode pair, and what the second one reused.

    agentkv up                      # start the local pair (once; a few minutes the first time)
    python examples/quickstart.py   # or: python examples/quickstart.py path/to/cluster.json

The cluster file comes from the first argument, else $AGENTKV_CLUSTER, else .agentkv/cluster.json.
"""

import os
import sys

import agentkv

cluster_file = (sys.argv[1:] or [os.environ.get("AGENTKV_CLUSTER", ".agentkv/cluster.json")])[0]
# A system prompt long enough to be worth reusing (handles below 64 tokens are recomputed).
SYSTEM = "You are a helpful geography assistant. Answer in one sentence.\n" + "\n".join(
    f"Fact {i}: {country} has the capital {capital}."
    for i, (country, capital) in enumerate(
        [
            ("France", "Paris"),
            ("Spain", "Madrid"),
            ("Italy", "Rome"),
            ("Peru", "Lima"),
            ("Japan", "Tokyo"),
            ("Kenya", "Nairobi"),
            ("Chile", "Santiago"),
            ("Egypt", "Cairo"),
            ("Norway", "Oslo"),
            ("Canada", "Ottawa"),
            ("India", "New Delhi"),
            ("Ghana", "Accra"),
        ]
    )
)

with agentkv.Cluster.from_file(cluster_file) as cluster, cluster.session(max_tokens=32) as session:
    session.append(agentkv.Message.system(SYSTEM))
    first = session.send("What is the capital of France?")
    second = session.send("And the capital of Spain?")  # pulls turn 1's KV from the decode node
    print("1:", first.text)
    print("2:", second.text)
    stats = second.stats
    print(
        f"turn 2 reused {stats.reused_tokens} of {stats.prompt_tokens} prompt tokens "
        f"(ideal {stats.ideal_reused_tokens}, handle {stats.handle_state.value}), "
        f"TTFT {stats.ttft_ms:.0f} ms"
    )
    print("session:", session.stats)
