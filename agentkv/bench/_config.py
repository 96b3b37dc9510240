"""The benchmark's configuration: one typed object, defaults in one place, checked on construction.

>>> config = BenchConfig(modes=parse_modes("agentkv,disagg"), sessions=2, turns=3)
>>> [mode.value for mode in config.modes]
['disagg', 'agentkv']
>>> config.total_turns
12
"""

from __future__ import annotations

import enum
import secrets
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, TypeAlias

from agentkv import ConfigError, Route

__all__ = [
    "DEFAULT_MODES",
    "PAUSES",
    "WORKLOADS",
    "BenchConfig",
    "Mode",
    "Pause",
    "parse_modes",
]


class Mode(enum.StrEnum):
    """How a session's turns are served; every mode runs the same workload in the same run."""

    DISAGG = "disagg"
    """Standard disaggregated serving: P→D every turn, no handle, P's cache cold for the session."""
    AFFINITY = "affinity"
    """A pinned pair: P keeps its own prefix cache between turns, nothing is pulled from decode."""
    AGENTKV = "agentkv"
    """The agentkv SDK: token-exact transcript, decode's turn-end KV pulled back, cache policy."""
    AGENTKV_DECODE = "agentkv-decode"
    """The agentkv SDK on the ``decode`` route: every later turn goes to the session's decode
    alone, whose prefix cache holds the pinned turn-end KV; decode computes the new tokens."""
    AGENTKV_AUTO = "agentkv-auto"
    """The agentkv SDK on the ``auto`` route: the route policy chooses per turn (a short append
    on decode, a longer one pulled back to prefill)."""
    ORACLE = "oracle"
    """The limit of reuse: before each turn, off the clock, prefill's cache is filled with the
    previous turn's prompt and output, so the timed turn pulls nothing and computes only what
    follows the last whole cached block (the new tokens, and at most one block's tail)."""
    LIMIT = "limit"
    """The limit of a turn: no P/D split, nothing transferred. Each turn's exact prompt goes to
    the decode server alone, whose prefix cache was filled off the clock with the previous
    turn's prompt and output: it computes the new tokens and, as prefix caching keeps whole
    blocks only, at most one block's tail of the previous turn."""
    TIER = "tier"
    """The agentkv SDK, and in every pause between turns the turn-end KV moves to decode's file
    tier (decode's pin freed): the next turn's prefill loads it from the tier."""
    AGGREGATED = "aggregated"
    """Reference: one server (the prefill server) prefills and decodes, with its prefix cache."""


# The modes that run agentkv's SDK with its cache policy, and the route each one's sessions take.
SDK_ROUTES: dict[Mode, Route] = {
    Mode.AGENTKV: "pull",
    Mode.AGENTKV_DECODE: "decode",
    Mode.AGENTKV_AUTO: "auto",
    Mode.TIER: "pull",
}

Pause: TypeAlias = Literal["extend", "tool-wait"]
PAUSES: tuple[Pause, ...] = ("extend", "tool-wait")
"""What the SDK modes (but ``tier``, which always offloads) do with their pin at a pause:
``extend`` it to cover the pause whatever it costs decode (the reference "unlimited pin"), or
``tool-wait``: what an agent does, ``session.tool_wait(expected_s=..., offload="auto")`` held
open until the next turn, so that the SDK's policy (``CachePolicy.decide_tier``) keeps, extends
or offloads the pin, reading decode's KV usage when only memory pressure could decide."""

# Named workloads: settings for the flags a run does not give (``agentkv bench --workload``).
WORKLOADS: Mapping[str, Mapping[str, Any]] = {
    "synthetic": {},
    # Decode pressure: more sessions than decode's memory keeps pinned, pausing as agents do,
    # several turns in flight, each mode on its own so that decode's memory is its alone.
    # 32 sessions pause with ~1.1-2.3k tokens each (~55k tokens), 2.4 times what a 0.5 GiB
    # decode holds on the local pair's model in bf16 (23k tokens); four turns in flight need
    # ~8k of them, so that the pins, not the running turns, fill decode. Sized to run in ~33
    # minutes on two CPU cores (docs/benchmarks.md, Decode pressure).
    "pressure": {
        "sessions": 32,
        "turns": 4,
        "context_tokens": 1024,
        "think_time_s": 20.0,
        "concurrency": 4,
        "pause": "tool-wait",
        "serial_modes": True,
    },
}

# Order of the modes in results and plots (the order of the enum, baseline first).
_ORDER = {mode: index for index, mode in enumerate(Mode)}
DEFAULT_MODES = (Mode.DISAGG, Mode.AFFINITY, Mode.AGENTKV)


def parse_modes(text: str) -> tuple[Mode, ...]:
    """``"disagg,agentkv"`` -> modes in canonical order; unknown or repeated names raise."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise ConfigError("--modes needs at least one mode")
    modes: list[Mode] = []
    for name in names:
        try:
            mode = Mode(name)
        except ValueError:
            known = ", ".join(m.value for m in Mode)
            raise ConfigError(f"unknown mode {name!r}; expected some of {known}") from None
        if mode in modes:
            raise ConfigError(f"mode {name!r} is given twice")
        modes.append(mode)
    return tuple(sorted(modes, key=_ORDER.__getitem__))


def _run_id() -> str:
    return secrets.token_hex(4)


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """One benchmark run.

    Attributes:
        modes: the modes to compare, run side by side on the same workload.
        sessions: agent sessions per mode (each mode runs its own copy of every session).
        turns: turns per session.
        context_tokens: size of the shared system prompt (instructions and tool schemas).
        tool_tokens: size of the tool result each turn after the first carries.
        output_tokens: median model output per turn; each turn generates exactly its planned
            length (``min_tokens = max_tokens``), so every mode's prompts have the same lengths.
        think_time_s: mean pause between a session's turns (the tool running), 0 for none. The
            SDK modes are told each pause's length, as ``tool_wait(expected_s=...)`` is.
        time_scale: pauses last ``time_scale`` times their length in real time (the SDK is still
            told the full length): minutes of think time in seconds of benchmark; 0 for none.
        concurrency: turns in flight at once, across all sessions and modes.
        seed: the workload's seed; the same seed and tokenizer give the same workload.
        stream: stream decode and time the first token (true TTFT); ``False`` times whole
            non-streamed turns, for servers without agentkv's streamed-handle plugin.
        run_id: makes this run's cache salts unique, so no run reuses another's cache.
        trace: replay this trace file (``agentkv.bench._trace``) instead of synthetic sessions;
            ``sessions`` and ``turns`` are then the replay's (its session count, its longest
            session), and the context, tool and output sizes and ``think_time_s`` are unused.
        trace_limit: replay only the trace's first ``trace_limit`` requests.
        length_scale: the trace's lengths (prompts, outputs, blocks) times this.
        max_model_len: the served model's context: a trace turn that would not fit ends its
            session (counted in the report).
        pause: what the SDK modes do with their pin at a pause (``PAUSES``): ``extend`` it
            through the pause, or ``tool-wait`` as an agent does (the SDK's policy decides).
        serial_modes: run the modes one after another (all sessions of one, then the next)
            instead of interleaved, so that each mode has decode's memory to itself and the
            sampled decode metrics are that mode's.
    """

    modes: tuple[Mode, ...] = DEFAULT_MODES
    sessions: int = 2
    turns: int = 8
    context_tokens: int = 2048
    tool_tokens: int = 256
    output_tokens: int = 64
    think_time_s: float = 0.0
    time_scale: float = 1.0
    concurrency: int = 1
    seed: int = 0
    stream: bool = True
    run_id: str = field(default_factory=_run_id)
    trace: str | None = None
    trace_limit: int | None = None
    length_scale: float = 1.0
    max_model_len: int = 8192
    pause: Pause = "extend"
    serial_modes: bool = False

    def __post_init__(self) -> None:
        if not self.modes:
            raise ConfigError("at least one mode is needed")
        if len(set(self.modes)) != len(self.modes):
            raise ConfigError("modes must be distinct")
        object.__setattr__(self, "modes", tuple(sorted(self.modes, key=_ORDER.__getitem__)))
        for name, low in (("sessions", 1), ("turns", 1), ("concurrency", 1),
                          ("context_tokens", 64), ("tool_tokens", 16), ("output_tokens", 8)):
            value = getattr(self, name)
            if type(value) is not int or value < low:
                raise ConfigError(f"{name} must be an integer >= {low}, got {value!r}")
        if not 0.0 <= self.think_time_s <= 3600.0:
            raise ConfigError(f"think_time_s must be in [0, 3600], got {self.think_time_s}")
        if not 0.0 <= self.time_scale <= 1.0:
            raise ConfigError(f"time_scale must be in [0, 1], got {self.time_scale}")
        if self.trace_limit is not None and (type(self.trace_limit) is not int
                                             or self.trace_limit < 1):
            raise ConfigError(f"trace_limit must be an integer >= 1, got {self.trace_limit!r}")
        if not 0.0 < self.length_scale <= 1.0:
            raise ConfigError(f"length_scale must be in (0, 1], got {self.length_scale}")
        if type(self.max_model_len) is not int or self.max_model_len < 256:
            raise ConfigError(
                f"max_model_len must be an integer >= 256, got {self.max_model_len!r}"
            )
        if self.pause not in PAUSES:
            raise ConfigError(f"pause must be one of {', '.join(PAUSES)}, got {self.pause!r}")
        if not self.run_id.isalnum() or len(self.run_id) > 32:
            # It goes into vLLM cache salts, which refuse '/', '@', '\\' and long values.
            raise ConfigError(f"run_id must be 1-32 letters or digits, got {self.run_id!r}")

    @property
    def total_turns(self) -> int:
        return len(self.modes) * self.sessions * self.turns

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["modes"] = [mode.value for mode in self.modes]
        return data
