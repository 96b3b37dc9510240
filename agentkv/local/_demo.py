"""``agentkv demo``: one multi-turn session on the local cluster, with a per-turn reuse table."""

from __future__ import annotations

import sys
from pathlib import Path

from agentkv import Cluster, Message, TurnStats

# A shared "system prompt" in the shape of an agent's: instructions plus a block of reference
# material that every turn re-sends. Long enough (~1.3k tokens) that recomputing it is visible.
_SYSTEM = "You are a warehouse assistant. Answer in one short sentence.\n" + "\n".join(
    f"Shelf {i}: holds parcel {i * 37 % 101} for customer {chr(65 + i % 26)}{i}, "
    f"weight {i % 9 + 1} kg."
    for i in range(60)
)
_QUESTIONS = (
    "Which parcel is on shelf 3?",
    "Who is the customer on shelf 7?",
    "How heavy is the parcel on shelf 12?",
    "Which shelf holds parcel 74?",
    "Summarize what you told me so far.",
    "Is there a shelf 61?",
    "Which customer names start with C?",
    "Thank you, that is all.",
)


def _row(stats: TurnStats) -> str:
    ratio = stats.reuse_ratio
    reuse = f"{100 * ratio:5.1f}%" if ratio is not None else "    - "
    return (f"{stats.turn:>4}  {stats.prompt_tokens:>7}  {stats.reused_tokens:>7}  "
            f"{stats.ideal_reused_tokens:>6}  {reuse}  {stats.ttft_ms:>9.0f}  "
            f"{stats.handle_state.value}")


def run_demo(cluster_file: Path, *, turns: int = 4, out: object = None) -> int:
    """Run ``turns`` turns of one session and print per-turn prompt, reuse and TTFT."""
    write = sys.stdout.write if out is None else out.write  # type: ignore[attr-defined]
    with Cluster.from_file(cluster_file) as cluster, cluster.session(max_tokens=48) as session:
        session.append(Message.system(_SYSTEM))
        write(f"session {session.session_id} on {session.pair.name}\n")
        write("turn  prompt   reused   ideal  reuse   ttft_ms  handle\n")
        for question in _QUESTIONS[:turns]:
            result = session.send(question)
            write(_row(result.stats) + "\n")
            write(f"      Q: {question}\n      A: {(result.message.content or '').strip()[:100]}\n")
        stats = session.stats
        if stats.median_warm_ttft_s is not None and stats.reuse_ratio is not None:
            write(f"turns >= 2: median TTFT {stats.median_warm_ttft_s * 1000:.0f} ms, "
                  f"reused {100 * stats.reuse_ratio:.1f}% of the ideal\n")
    return 0
