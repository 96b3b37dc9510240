"""What one benchmark turn measured (``TurnSample``), as every mode reports it."""

from __future__ import annotations

from dataclasses import dataclass

from agentkv.bench._config import Mode

__all__ = ["Held", "TurnSample"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Held:
    """Where a session's turn-end KV stays through a pause: tokens pinned on decode, in its tier."""

    decode_tokens: int = 0
    tier_tokens: int = 0


@dataclass(frozen=True, kw_only=True, slots=True)
class TurnSample:
    """One turn of one session in one mode.

    ``ttft_s`` runs from the moment the turn was asked for to the first generated token: template
    rendering, the P leg (prefill, and any pull from decode), and the D leg up to its first token.
    ``reused_tokens`` is the prefill server's own ``cached_tokens``; ``ideal_reused_tokens`` is
    the previous turn's prompt and output less one (what a perfect handle gives). ``error`` is set
    (and the numbers are zero) when the turn failed.
    """

    mode: Mode
    session: int
    turn: int
    ttft_s: float
    total_s: float
    prompt_tokens: int
    reused_tokens: int
    ideal_reused_tokens: int
    generated_tokens: int
    prefill_s: float | None = None
    """The P leg alone (SDK modes): prefill, and the pull from decode when there is one."""
    handle_state: str = ""
    prefill: str = ""
    """The prefill server that ran the P leg (SDK modes; a pool's placement), else empty."""
    paused_decode_tokens: int | None = None
    """Tokens of this session's KV left pinned on decode through the pause after this turn
    (``None``: no pause followed)."""
    paused_tier_tokens: int | None = None
    """Tokens of this session's KV in decode's file tier through that pause."""
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None
