"""Pure decisions about cached KV and retries: immutable inputs in, a decision out, no I/O.

The clock is always passed in (``now``), so every rule is a plain function to test:

>>> policy = CachePolicy(server_ttl_s=480.0, ttl_margin_s=30.0)
>>> policy.deadline(issued_at=100.0)
550.0
>>> policy.decide_attach(None, prompt_len=500, now=0.0).state
<HandleState.NONE: 'none'>

Later policies (asking the decode node to persist, extend or release a handle) belong here as
further ``decide_*`` methods returning their own frozen decisions.
"""

from __future__ import annotations

from dataclasses import dataclass

from agentkv._exceptions import ConfigError
from agentkv._types import HandleState, KVHandle

__all__ = ["AttachDecision", "CachePolicy", "RetryPolicy"]


@dataclass(frozen=True, kw_only=True, slots=True)
class AttachDecision:
    """Whether to send the stored handle with this turn's prefill, and why."""

    attach: bool
    state: HandleState
    reason: str


@dataclass(frozen=True, kw_only=True, slots=True)
class CachePolicy:
    """When a decode handle is still good to send.

    Attributes:
        server_ttl_s: the decode server's ``decoder_kv_blocks_ttl`` (vLLM's default is 480 s).
        ttl_margin_s: how long before the server's expiry agentkv stops using a handle. The server
            counts from when it finished the request, which agentkv only knows to within a network
            round trip, and the next prefill may queue before it pulls: the margin covers both.
        recompute_threshold: the servers' ``kv_recompute_threshold``; below it a prefill recomputes
            rather than pulls, so the handle is not worth sending.
        min_reuse_tokens: do not bother attaching handles covering fewer tokens than this.
    """

    server_ttl_s: float = 480.0
    ttl_margin_s: float = 30.0
    recompute_threshold: int = 64
    min_reuse_tokens: int = 0

    def __post_init__(self) -> None:
        if self.server_ttl_s <= 0:
            raise ConfigError(f"server_ttl_s must be positive, got {self.server_ttl_s}")
        if not 0 <= self.ttl_margin_s < self.server_ttl_s:
            raise ConfigError(
                f"ttl_margin_s must be in [0, server_ttl_s={self.server_ttl_s}), "
                f"got {self.ttl_margin_s}"
            )
        if self.recompute_threshold < 0 or self.min_reuse_tokens < 0:
            raise ConfigError("recompute_threshold and min_reuse_tokens must not be negative")

    def deadline(self, issued_at: float) -> float:
        """Our deadline for a handle whose request was sent at ``issued_at`` (session clock).

        Counting from the send time, not the answer, errs early: the server starts its TTL when the
        request finishes, which is after we sent it.
        """
        return issued_at + self.server_ttl_s - self.ttl_margin_s

    def decide_attach(
        self, handle: KVHandle | None, *, prompt_len: int, now: float
    ) -> AttachDecision:
        """Attach ``handle`` to a prefill of ``prompt_len`` tokens at time ``now``?"""
        if handle is None:
            return AttachDecision(attach=False, state=HandleState.NONE, reason="no stored handle")
        if now >= handle.deadline:
            return AttachDecision(
                attach=False,
                state=HandleState.EXPIRED,
                reason=f"handle passed its deadline {now - handle.deadline:.1f}s ago",
            )
        if handle.num_tokens >= prompt_len:
            # The pull is positional: the decode KV must cover a strict prefix of the prompt.
            return AttachDecision(
                attach=False,
                state=HandleState.DIVERGED,
                reason=f"handle covers {handle.num_tokens} tokens, prompt has {prompt_len}",
            )
        floor = max(self.recompute_threshold, self.min_reuse_tokens)
        if handle.num_tokens < floor:
            return AttachDecision(
                attach=False,
                state=HandleState.BELOW_THRESHOLD,
                reason=f"handle covers {handle.num_tokens} tokens, below {floor}",
            )
        return AttachDecision(attach=True, state=HandleState.ATTACHED, reason="")


@dataclass(frozen=True, kw_only=True, slots=True)
class RetryPolicy:
    """How often and how patiently a turn is retried after transport errors and 5xx answers.

    ``max_attempts`` counts whole attempts at a turn (first try included). Waits grow
    exponentially from ``initial_backoff_s`` to at most ``max_backoff_s``, with up to ``jitter_s``
    of random jitter so that many sessions do not retry in lockstep.

    >>> RetryPolicy(max_attempts=1)  # never retry
    RetryPolicy(max_attempts=1, initial_backoff_s=0.05, max_backoff_s=1.0, jitter_s=0.05)
    """

    max_attempts: int = 3
    initial_backoff_s: float = 0.05
    max_backoff_s: float = 1.0
    jitter_s: float = 0.05

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ConfigError(f"max_attempts must be at least 1, got {self.max_attempts}")
        if min(self.initial_backoff_s, self.max_backoff_s, self.jitter_s) < 0:
            raise ConfigError("backoff and jitter must not be negative")
