"""Pure decisions about cached KV and retries: immutable inputs in, a decision out, no I/O.

The clock is always passed in (``now``), so every rule is a plain function to test:

>>> policy = CachePolicy(server_ttl_s=480.0, ttl_margin_s=30.0)
>>> policy.deadline(issued_at=100.0)
550.0
>>> policy.decide_attach(None, prompt_len=500, now=0.0).state
<HandleState.NONE: 'none'>

With agentkv's vLLM extension on decode (``agentkv.connector``), the policy also says what decode
should do with a turn's KV: pin it for the next turn or not at all (``decide_persist``), keep it
longer while a tool runs (``decide_extend``), or free it now (``decide_release``):

>>> policy.decide_persist(final=True)
PersistHint(persist=False, ttl_s=None)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from agentkv._exceptions import ConfigError
from agentkv._hints import PersistHint
from agentkv._types import HandleState, KVHandle

__all__ = ["AttachDecision", "CachePolicy", "ExtendDecision", "RetryPolicy"]


@dataclass(frozen=True, kw_only=True, slots=True)
class AttachDecision:
    """Whether to send the stored handle with this turn's prefill, and why."""

    attach: bool
    state: HandleState
    reason: str


@dataclass(frozen=True, kw_only=True, slots=True)
class ExtendDecision:
    """Whether to ask decode to keep the handle longer before a wait, and for how long.

    ``ttl_s`` is what to ask for (decode caps it at its ``agentkv_max_ttl_s``); ``None`` when
    ``extend`` is false.
    """

    extend: bool
    ttl_s: float | None
    reason: str


@dataclass(frozen=True, kw_only=True, slots=True)
class CachePolicy:
    """When a decode handle is still good to send, and what decode should do with it.

    Attributes:
        server_ttl_s: the decode server's ``decoder_kv_blocks_ttl`` (vLLM's default is 480 s).
            Used for handles of a stock decode; a leased handle carries the TTL decode granted.
        ttl_margin_s: how long before the server's expiry agentkv stops using a handle. The server
            counts from when it finished the request, which agentkv only knows to within a network
            round trip, and the next prefill may queue before it pulls (and declines a pull
            within 5 s of the expiry): the margin covers all three. For a TTL shorter than twice
            the margin, half the TTL is used instead.
        recompute_threshold: the servers' ``kv_recompute_threshold``; below it a prefill recomputes
            rather than pulls, so the handle is not worth sending.
        min_reuse_tokens: do not bother attaching handles covering fewer tokens than this.
        pin_ttl_s: with agentkv's extension on decode, how long decode should pin a normal turn's
            KV for the next turn; ``None`` keeps the server's default (``decoder_kv_blocks_ttl``).
        extend_slack_s: tool-call durations are estimates: a wait is extended when it ends less
            than this before the deadline, and by this much more than the estimate.
    """

    server_ttl_s: float = 480.0
    ttl_margin_s: float = 30.0
    recompute_threshold: int = 64
    min_reuse_tokens: int = 0
    pin_ttl_s: float | None = None
    extend_slack_s: float = 30.0

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
        if self.pin_ttl_s is not None and not (
            math.isfinite(self.pin_ttl_s) and self.pin_ttl_s > 0
        ):
            raise ConfigError(
                f"pin_ttl_s must be a positive number of seconds or None, got {self.pin_ttl_s}"
            )
        if not (math.isfinite(self.extend_slack_s) and self.extend_slack_s >= 0):
            raise ConfigError(f"extend_slack_s must not be negative, got {self.extend_slack_s}")

    def deadline(self, issued_at: float) -> float:
        """Our deadline for a handle whose request was sent at ``issued_at`` (session clock).

        Counting from the send time, not the answer, errs early: the server starts its TTL when the
        request finishes, which is after we sent it.
        """
        return issued_at + self.server_ttl_s - self.ttl_margin_s

    def lease_deadline(self, *, sent_at: float, ttl_s: float) -> float:
        """Our deadline for a leased handle: decode granted ``ttl_s`` seconds to a request (a D leg
        or an extend) sent at ``sent_at``.

        >>> CachePolicy(ttl_margin_s=30).lease_deadline(sent_at=100.0, ttl_s=120.0)
        190.0
        >>> CachePolicy(ttl_margin_s=30).lease_deadline(sent_at=100.0, ttl_s=20.0)  # half the TTL
        110.0
        """
        return sent_at + ttl_s - min(self.ttl_margin_s, ttl_s / 2)

    def decide_persist(self, *, final: bool) -> PersistHint:
        """The hint for a D leg: pin for the next turn, or nothing on a turn no other follows."""
        if final:
            return PersistHint(persist=False)
        return PersistHint(ttl_s=self.pin_ttl_s)

    def decide_extend(
        self, handle: KVHandle | None, *, now: float, expected_wait_s: float
    ) -> ExtendDecision:
        """Extend ``handle`` before a wait of about ``expected_wait_s`` seconds starting ``now``?

        Only a leased handle still within our deadline is extended: one past it is not attached
        any more, and a stock decode has no extend call. The asked TTL covers the wait, the
        slack and the margin, so that the deadline after the extend lies ``extend_slack_s``
        beyond the expected end of the wait.
        """
        if not (math.isfinite(expected_wait_s) and expected_wait_s >= 0):
            raise ValueError(f"expected_wait_s must be a finite number >= 0, got {expected_wait_s}")
        if handle is None:
            return ExtendDecision(extend=False, ttl_s=None, reason="no stored handle")
        if not handle.leased:
            return ExtendDecision(
                extend=False, ttl_s=None, reason="decode has no agentkv extension (stock vLLM)"
            )
        if now >= handle.deadline:
            return ExtendDecision(
                extend=False,
                ttl_s=None,
                reason=f"handle passed its deadline {now - handle.deadline:.1f}s ago",
            )
        ends = now + expected_wait_s + self.extend_slack_s
        if ends < handle.deadline:
            return ExtendDecision(
                extend=False,
                ttl_s=None,
                reason=f"the wait ends {handle.deadline - ends:.1f}s before the deadline",
            )
        ttl = expected_wait_s + self.extend_slack_s + self.ttl_margin_s
        return ExtendDecision(
            extend=True,
            ttl_s=ttl,
            reason=f"a {expected_wait_s:.1f}s wait would outlast the deadline "
            f"({handle.deadline - now:.1f}s left)",
        )

    def decide_release(self, handle: KVHandle | None, *, now: float) -> bool:
        """Release ``handle``'s blocks now (session closed, handle dropped unsent)?

        A leased handle until ``ttl_margin_s`` past our deadline: that deadline keeps the margin
        before decode's, so decode may still hold the blocks (later, it has freed them itself).
        A stock decode has no release call. Never call this for a handle a P leg may still be
        reading.
        """
        return (
            handle is not None and handle.leased and now < handle.deadline + self.ttl_margin_s
        )

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
