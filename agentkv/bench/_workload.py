"""Deterministic synthetic agent sessions, shaped like a coding agent's tool loop.

A session is (see ``docs/benchmarks.md`` for the traces behind the shape):

* a system prompt of about ``context_tokens``: the agent's instructions and its tool schemas,
  shared by every session of a run (one agent, many tasks);
* turn 1: the task (a short user message naming a repository and a failing test);
* turn t >= 2: one tool result of about ``tool_tokens`` (a file, a test log, search hits or a
  directory listing, in turn) and a short instruction, as one user message;
* each turn's model output has a planned length: log-normal around ``output_tokens`` (agent outputs
  are short and heavy-tailed), generated exactly, so prompts grow identically in every mode;
* an optional pause after each turn (the tool running): ``think_time_s`` times a factor in
  [0.5, 1.5].

Sizes are in the served model's tokens: ``calibrate`` measures characters per token of each text
style with the server's tokenizer once, and the generator sizes text by it (to within a few
percent; the prompts' exact lengths are recorded per turn). The workload is a pure function of the
config's seed, sizes and that calibration.

>>> import asyncio
>>> async def count(text):  # a toy tokenizer: 4 characters a token
...     return max(1, len(text) // 4)
>>> config = BenchConfig(sessions=2, turns=3, context_tokens=512, tool_tokens=128)
>>> workload = build_workload(config, asyncio.run(calibrate(count, seed=0)))
>>> [len(s.turns) for s in workload.sessions]
[3, 3]
>>> 480 <= len(workload.system) // 4 <= 530
True
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Literal

from agentkv.bench._config import BenchConfig
from agentkv.bench._text import STYLES, Style, generate, ident, seeded, tool_schema

__all__ = [
    "CharsPerToken",
    "Role",
    "SessionOrigin",
    "SessionScript",
    "TokenCounter",
    "TurnScript",
    "Workload",
    "build_workload",
    "calibrate",
]

TokenCounter = Callable[[str], Awaitable[int]]
CharsPerToken = Mapping[Style, float]
Role = Literal["parent", "subagent"]

_CALIBRATION_CHARS = 6000
# Log-normal spread of output lengths (sigma of the log); clipped to [median/4, 4 * median].
_OUTPUT_SIGMA = 0.6
_CORE_TOOLS = ("read_file", "run_tests", "search_code", "list_dir", "edit_file", "git_diff")
# Which tool answers turn t >= 2, and the style its result is written in.
_RESULTS: tuple[tuple[str, Style], ...] = (
    ("read_file", "code"),
    ("run_tests", "log"),
    ("search_code", "code"),
    ("list_dir", "prose"),
)
_INSTRUCTIONS = (
    "Continue: decide the next step and call one tool.",
    "Read the result above carefully, then call the next tool.",
    "If the failure is explained, propose the fix; otherwise call another tool.",
    "Summarize what you learned in one sentence, then call the next tool.",
)
_PREAMBLE = (
    "You are CodeAgent, an autonomous software engineering agent working inside a sandboxed "
    "checkout of a customer's repository. You solve the task you are given by calling tools, one "
    "per turn, and reading their results. Think briefly before each call. Never invent file "
    "contents: read them. Keep edits minimal and run the tests after every edit. When the task is "
    "done, answer with a short summary of the change.\n\n# Tools\n\nCall a tool by answering with "
    "a JSON object {\"name\": ..., \"arguments\": {...}} matching one of these schemas:\n"
)


@dataclass(frozen=True, kw_only=True, slots=True)
class TurnScript:
    """One turn: the user message to send, how many tokens the model generates, the pause after."""

    turn: int
    user: str
    output_tokens: int
    think_time_s: float


@dataclass(frozen=True, kw_only=True, slots=True)
class SessionOrigin:
    """Where a replayed session comes from: its conversation and its role in it."""

    conversation: str
    role: Role = "parent"
    agent_id: str | None = None
    subagent_type: str | None = None
    shared_chars: int = 0
    """Leading characters of turn 1's user text that a session of the same conversation started
    earlier also opened with (what a subagent shares with its earlier siblings)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SessionScript:
    """One agent session: its index and turns (the system prompt is the workload's)."""

    index: int
    turns: tuple[TurnScript, ...]
    start_s: float = 0.0
    """When the session's first turn may start, from the run's start (a replayed trace's
    arrival time; scaled by ``time_scale`` like the pauses)."""
    salt_group: str | None = None
    """Sessions with the same group are one user to the servers' prefix caches (one cache salt
    per group, where a mode keeps one): a replayed conversation's parent and subagents. ``None``:
    a group of its own."""
    origin: SessionOrigin | None = None
    """The replayed conversation and role (``None`` for synthetic sessions)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Workload:
    """Every session of a run; each mode runs each session once."""

    system: str
    sessions: tuple[SessionScript, ...]


async def calibrate(count: TokenCounter, *, seed: int) -> dict[Style, float]:
    """Characters per token of each text style, measured with ``count`` (the server's tokenizer)."""
    rng = seeded(f"calibrate-{seed}")
    ratios: dict[Style, float] = {}
    for style in STYLES:
        sample = generate(style, rng, _CALIBRATION_CHARS)
        tokens = await count(sample)
        ratios[style] = len(sample) / max(1, tokens)
    return ratios


def _system_prompt(rng: random.Random, tokens: int, ratios: CharsPerToken) -> str:
    parts = [_PREAMBLE]
    used = len(_PREAMBLE) / ratios["prose"]
    for index in itertools.count():
        name = _CORE_TOOLS[index] if index < len(_CORE_TOOLS) else f"tool_{index}_{ident(rng)}"
        schema = tool_schema(rng, name)
        cost = (len(schema) + 1) / ratios["schema"]
        if used + cost > tokens:
            break
        parts.append(schema)
        used += cost
    rest = round((tokens - used) * ratios["prose"])
    if rest > 0:
        # Top up with prose rather than overshoot by a whole schema.
        parts.append(generate("prose", rng, rest))
    return "\n".join(parts)


def _output_tokens(rng: random.Random, median: int) -> int:
    value = round(median * math.exp(rng.gauss(0.0, _OUTPUT_SIGMA)))
    return max(4, median // 4, min(4 * median, value))


def _task(rng: random.Random, session: int) -> str:
    repo = f"acme/{rng.choice(('billing', 'ledger', 'checkout', 'payments', 'reports'))}-{session}"
    test = f"tests/test_{rng.choice(('invoice', 'refund', 'tax', 'export'))}.py"
    return (
        f"Task {session + 1}: in the repository {repo}, {test} fails since the last release: "
        "totals are off by one cent for some currencies. Find the cause, fix it with a minimal "
        "change, and make the whole test suite pass. Start by exploring the repository."
    )


def _tool_turn(rng: random.Random, turn: int, tokens: int, ratios: CharsPerToken) -> str:
    tool, style = _RESULTS[(turn - 2) % len(_RESULTS)]
    body = generate(style, rng, max(16, round(tokens * ratios[style])))
    instruction = _INSTRUCTIONS[(turn - 2) % len(_INSTRUCTIONS)]
    return f'<tool_result name="{tool}">\n{body}\n</tool_result>\n{instruction}'


def build_workload(config: BenchConfig, ratios: CharsPerToken) -> Workload:
    """The run's sessions, from the config's seed and sizes and the tokenizer's ``ratios``."""
    system = _system_prompt(seeded(f"system-{config.seed}"), config.context_tokens, ratios)
    sessions = []
    for index in range(config.sessions):
        rng = seeded(f"session-{config.seed}-{index}")
        turns = []
        for turn in range(1, config.turns + 1):
            user = _task(rng, index) if turn == 1 else _tool_turn(
                rng, turn, config.tool_tokens, ratios
            )
            turns.append(
                TurnScript(
                    turn=turn,
                    user=user,
                    output_tokens=_output_tokens(rng, config.output_tokens),
                    think_time_s=config.think_time_s * rng.uniform(0.5, 1.5),
                )
            )
        sessions.append(SessionScript(index=index, turns=tuple(turns)))
    return Workload(system=system, sessions=tuple(sessions))
