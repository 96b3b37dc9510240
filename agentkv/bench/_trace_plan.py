"""The replay's plan as values: its sessions and their scaled turns (``_trace.plan_replay``
makes it; ``_trace_text`` turns it into the benchmark's text)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from agentkv.bench._workload import Role

__all__ = ["ReplayPlan", "ReplaySession", "ReplayTurn"]


@dataclass(frozen=True, kw_only=True, slots=True)
class ReplayTurn:
    """One request of a session, scaled: the new user text's span and the pause after it."""

    turn: int
    request: int
    """The request's index in the trace."""
    hash_ids: tuple[int, ...]
    input_tokens: int
    """The trace's prompt length, scaled."""
    output_tokens: int
    new_start: float
    """Where the new user text starts, in scaled trace tokens of this request's blocks."""
    new_tokens: int
    """Tokens of new user text: the trace's growth over the previous prompt and output."""
    think_time_s: float
    """The pause after this turn, unscaled (0 after the last turn)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ReplaySession:
    """One session of the replay: a Mooncake inferred session, or a kv-cache-tester
    conversation's parent or one of its subagents."""

    index: int
    start_s: float
    """When the session starts, from the first kept request, unscaled."""
    turns: tuple[ReplayTurn, ...]
    conversation: str | None = None
    role: Role = "parent"
    agent_id: str | None = None
    subagent_type: str | None = None
    scope: str = ""
    """The namespace of its hash ids (``TraceRequest.scope``)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ReplayPlan:
    """The sessions to replay, their lengths scaled and clipped, and what was left out."""

    name: str
    block_tokens: int
    length_scale: float
    sessions: tuple[ReplaySession, ...]
    requests_read: int
    clipped_requests: int = 0
    """Requests dropped because they (or an earlier turn of their session) did not fit."""
    skipped_sessions: int = 0
    """Sessions whose first request did not fit."""
    padded_tokens: int = 0
    """Tokens of user text added where the trace's prompt grew by less than the previous output."""
    ignored_entries: int = 0

    @property
    def subagents(self) -> int:
        return sum(s.role == "subagent" for s in self.sessions)

    @property
    def scaled_block_tokens(self) -> float:
        return self.block_tokens * self.length_scale

    @property
    def requests(self) -> int:
        return sum(len(s.turns) for s in self.sessions)

    @property
    def max_turns(self) -> int:
        return max((len(s.turns) for s in self.sessions), default=0)

    def summary(self) -> dict[str, Any]:
        """The report's description of the workload."""
        return {
            "kind": "trace",
            "file": self.name,
            "block_tokens": self.block_tokens,
            "length_scale": self.length_scale,
            "requests_read": self.requests_read,
            "requests": self.requests,
            "sessions": len(self.sessions),
            "clipped_requests": self.clipped_requests,
            "skipped_sessions": self.skipped_sessions,
            "padded_tokens": self.padded_tokens,
            "ignored_entries": self.ignored_entries,
            "subagent_sessions": self.subagents,
        }


# -- sessions ------------------------------------------------------------------------------------
