"""What an agent run produces: typed events while it runs, a ``RunResult`` at the end.

``Agent.stream(task)`` yields the events below in order, then the ``RunResult``:

* ``TextEvent``: a piece of the model's text as decode produces it (streaming only);
* ``TurnEvent``: a model turn finished, with its ``TurnStats`` (reuse, TTFT, handle state);
* ``ToolCallEvent``: a tool call about to run;
* ``ToolResultEvent``: a tool call finished (in completion order when calls run in parallel);
* ``HandleExpiredEvent``: the tools outlasted the decode handle's deadline, so the next turn
  recomputes what the handle would have pulled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, TypeAlias

from agentkv._agent.toolset import ToolResult
from agentkv._types import Message, SessionStats, ToolCall, TurnStats

__all__ = [
    "AgentEvent",
    "AgentStep",
    "HandleExpiredEvent",
    "RunResult",
    "StopReason",
    "TextEvent",
    "ToolCallEvent",
    "ToolResultEvent",
    "TurnEvent",
]

StopReason: TypeAlias = Literal["answer", "max_steps"]


@dataclass(frozen=True, kw_only=True, slots=True)
class TextEvent:
    """A piece of the model's text (for ``JsonToolCalling``, of its JSON tool calls)."""

    step: int
    text: str


@dataclass(frozen=True, kw_only=True, slots=True)
class TurnEvent:
    """A model turn finished: its full text and stats."""

    step: int
    text: str
    stats: TurnStats


@dataclass(frozen=True, kw_only=True, slots=True)
class ToolCallEvent:
    """The model asked for this call; it is about to run."""

    step: int
    call: ToolCall


@dataclass(frozen=True, kw_only=True, slots=True)
class ToolResultEvent:
    """A call finished (``result.error`` says whether it failed)."""

    step: int
    result: ToolResult


@dataclass(frozen=True, kw_only=True, slots=True)
class HandleExpiredEvent:
    """The step's tools ran past the decode handle's deadline.

    The session drops the handle on the next turn (``HandleState.EXPIRED``); the next prefill
    recomputes what it would have pulled. ``overdue_s`` is how far past the deadline the tools
    ended (on the session's clock); the step's ``tools_s`` says how long they ran.
    """

    step: int
    overdue_s: float


AgentEvent: TypeAlias = TextEvent | TurnEvent | ToolCallEvent | ToolResultEvent | HandleExpiredEvent


@dataclass(frozen=True, kw_only=True, slots=True)
class AgentStep:
    """One model turn and the tool calls it asked for.

    ``results`` are in call order. ``error`` is set when the reply could not be read as tool
    calls (the model was told, and the next step retried). ``handle_expired`` is true when the
    step's tools outlasted the decode handle.
    """

    index: int
    text: str
    stats: TurnStats
    tool_calls: tuple[ToolCall, ...] = ()
    results: tuple[ToolResult, ...] = ()
    answer: str | None = None
    error: str | None = None
    tools_s: float = 0.0
    handle_expired: bool = False


@dataclass(frozen=True, kw_only=True, slots=True)
class RunResult:
    """The outcome of ``Agent.run``.

    ``answer`` is the model's final answer (``None`` if the run stopped at ``max_steps`` without
    one). ``messages`` is the session's whole transcript after the run, exactly as the model saw
    it; ``steps`` has the parsed tool calls and their results.
    """

    answer: str | None
    stop_reason: StopReason
    steps: tuple[AgentStep, ...]
    messages: tuple[Message, ...]
    session_id: str

    @property
    def turns(self) -> tuple[TurnStats, ...]:
        """Per-turn stats, one per step."""
        return tuple(step.stats for step in self.steps)

    @property
    def tool_results(self) -> tuple[ToolResult, ...]:
        """Every tool call that ran, in order."""
        return tuple(result for step in self.steps for result in step.results)

    @property
    def stats(self) -> SessionStats:
        """Totals over the run's turns (reuse ratio, median warm TTFT, ...)."""
        return SessionStats.from_turns(self.turns)

    @property
    def handle_expiries(self) -> int:
        """Steps whose tools outlasted the decode handle."""
        return sum(step.handle_expired for step in self.steps)
