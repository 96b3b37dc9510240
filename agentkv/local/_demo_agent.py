"""``agentkv demo``: a tool-using agent on the local pair, with a per-turn reuse table.

The agent does arithmetic with three tools, after one worked example given as conversation
turns: a model as small as SmolLM2-135M follows its shape (one call per step, then
``final_answer``), though it often copies numbers instead of computing with them. What the demo
shows is the loop: every step appends the tool results, so every turn after the first pulls the
previous turn's KV from the decode node instead of recomputing it.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TextIO

from agentkv import (
    Agent,
    Cluster,
    JsonToolCalling,
    RunResult,
    Session,
    ToolCallEvent,
    ToolResultEvent,
    TurnEvent,
    TurnStats,
    tool,
)

__all__ = ["EXAMPLE", "SYSTEM", "TASK", "build_agent", "run_agent_demo", "turn_table"]


@tool
def add(a: int, b: int) -> int:
    """Add two numbers."""
    return a + b


@tool
def multiply(a: int, b: int) -> int:
    """Multiply two numbers."""
    return a * b


@tool
def subtract(a: int, b: int) -> int:
    """Subtract b from a."""
    return a - b


PROTOCOL = JsonToolCalling(max_calls=1)
SYSTEM = "You are a careful calculator. Do one operation per step."
# One worked example as real conversation turns: small models follow demonstrated turns far
# better than instructions.
EXAMPLE = PROTOCOL.example(
    "Compute (2 + 3) * 4 - 1.",
    [
        ("add", {"a": 2, "b": 3}, "5"),
        ("multiply", {"a": 5, "b": 4}, "20"),
        ("subtract", {"a": 20, "b": 1}, "19"),
    ],
    "19",
)
TASK = "Compute (17 + 25) * 3 - 4."


def build_agent(target: Cluster | Session) -> Agent:
    """The demo's calculator agent (one call per step, at most 6 steps)."""
    return Agent(
        target,
        tools=[add, multiply, subtract],
        system=SYSTEM,
        examples=EXAMPLE,
        # The task has three operations; SmolLM2-135M sometimes answers after two.
        min_tool_calls=3,
        max_steps=6,
        max_tokens=96,
        tool_calling=PROTOCOL,
    )


def turn_table(turns: tuple[TurnStats, ...]) -> str:
    """Per turn: prompt tokens, reused tokens, the ideal, reuse ratio, TTFT, handle state."""
    lines = ["turn  prompt  reused   ideal   reuse  ttft_ms  handle"]
    for stats in turns:
        ratio = stats.reuse_ratio
        reuse = f"{100 * ratio:5.1f}%" if ratio is not None else "     -"
        lines.append(
            f"{stats.turn:>4}  {stats.prompt_tokens:>6}  {stats.reused_tokens:>6}  "
            f"{stats.ideal_reused_tokens:>6}  {reuse}  {stats.ttft_ms:>7.0f}  "
            f"{stats.handle_state.value}"
        )
    return "\n".join(lines)


def run_agent_demo(cluster_file: Path, *, out: TextIO | None = None) -> int:
    """Run the calculator agent on the cluster in ``cluster_file``; print its steps and turns.

    Returns 0 when the agent gave an answer, 1 when it ran out of steps.
    """
    stream = out or sys.stdout
    write = stream.write
    with Cluster.from_file(cluster_file) as cluster:
        agent = build_agent(cluster)
        write(f"task: {TASK}\n")
        result: RunResult | None = None
        for item in agent.stream(TASK):
            if isinstance(item, TurnEvent):
                write(
                    f"turn {item.stats.turn}: {item.stats.reused_tokens} of "
                    f"{item.stats.prompt_tokens} prompt tokens reused\n"
                )
            elif isinstance(item, ToolCallEvent):
                write(f"  call   {item.call.name}({item.call.arguments})\n")
            elif isinstance(item, ToolResultEvent):
                write(f"  result {item.result.output}\n")
            elif isinstance(item, RunResult):
                result = item
    assert result is not None
    write(
        f"answer: {result.answer}  ({result.stop_reason}, {len(result.tool_results)} tool calls)\n"
    )
    write(turn_table(result.turns) + "\n")
    stats = result.stats
    if stats.reuse_ratio is not None and stats.median_warm_ttft_s is not None:
        write(
            f"turns >= 2: reused {100 * stats.reuse_ratio:.1f}% of the ideal, "
            f"median TTFT {1000 * stats.median_warm_ttft_s:.0f} ms\n"
        )
    return 0 if result.answer is not None else 1
