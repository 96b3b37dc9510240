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

Placement is the same kind of decision: where a session lives and where each turn prefills, as
pure functions of ids and observed load.

A session is pinned to a decode server (a pair's, or one of a pool's): between turns its KV lives
there. Each turn's prefill is chosen by ``choose_prefill`` over the prefills' outstanding tokens;
any prefill can pull from any decode (the handle names decode's engine id, host and port, and
vLLM's NIXL connector handshakes with a new remote engine on first use).

Rendezvous (highest-random-weight) hashing ranks the pairs per session id, so a session's pair
does not change when unrelated pairs come and go; the bounded-load rule skips a pair that already
holds more than ``ceil(load_factor * average)`` sessions, so no pair gets a hot spot.

>>> place("session-1", ["a", "b"], loads={}, healthy={"a", "b"}) in {"a", "b"}
True
>>> place("session-1", ["a", "b"], loads={}, healthy=set()) is None
True
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from agentkv import _constants as defaults
from agentkv._exceptions import ConfigError
from agentkv._types import HandleState, KVHandle
from agentkv._wire.hints import PersistHint

__all__ = [
    "AttachDecision",
    "CachePolicy",
    "ExtendDecision",
    "PrefillWeights",
    "RetryPolicy",
    "choose_prefill",
    "place",
    "rank",
]


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

    server_ttl_s: float = defaults.SERVER_TTL_S
    ttl_margin_s: float = defaults.TTL_MARGIN_S
    recompute_threshold: int = defaults.RECOMPUTE_THRESHOLD
    min_reuse_tokens: int = 0
    pin_ttl_s: float | None = None
    extend_slack_s: float = defaults.EXTEND_SLACK_S

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

    max_attempts: int = defaults.RETRY_ATTEMPTS
    initial_backoff_s: float = defaults.RETRY_INITIAL_BACKOFF_S
    max_backoff_s: float = defaults.RETRY_MAX_BACKOFF_S
    jitter_s: float = defaults.RETRY_JITTER_S

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ConfigError(f"max_attempts must be at least 1, got {self.max_attempts}")
        if min(self.initial_backoff_s, self.max_backoff_s, self.jitter_s) < 0:
            raise ConfigError("backoff and jitter must not be negative")


# --- placement ------------------------------------------------------------------------------------
def _score(session_id: str, pair: str) -> int:
    # blake2b, not hash(): placement must agree across processes (PYTHONHASHSEED varies).
    digest = hashlib.blake2b(session_id.encode() + b"\x00" + pair.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def rank(session_id: str, pairs: Sequence[str]) -> list[str]:
    """``pairs`` in this session's rendezvous order, best first."""
    return sorted(pairs, key=lambda pair: (_score(session_id, pair), pair), reverse=True)


def place(
    session_id: str,
    pairs: Sequence[str],
    *,
    loads: Mapping[str, int],
    healthy: Collection[str],
    load_factor: float = defaults.LOAD_FACTOR,
) -> str | None:
    """The pair for a new (or moving) session, or ``None`` when no pair is healthy.

    ``loads`` counts the sessions already on each pair (not this one). A healthy pair is
    eligible while its load is under ``ceil(load_factor * (total + 1) / healthy pairs)``; the
    eligible pair ranked highest for ``session_id`` wins.
    """
    candidates = [pair for pair in pairs if pair in healthy]
    if not candidates:
        return None
    total = sum(loads.get(pair, 0) for pair in candidates) + 1
    capacity = math.ceil(load_factor * total / len(candidates))
    ranked = rank(session_id, candidates)
    for pair in ranked:
        if loads.get(pair, 0) < capacity:
            return pair
    return ranked[0]  # unreachable for load_factor >= 1: capacities sum past total


@dataclass(frozen=True, kw_only=True, slots=True)
class PrefillWeights:
    """How much load a prefill that still caches the session's prefix may carry and still win.

    A prefill's load is its outstanding tokens: prompt tokens it has been sent and has not
    answered yet, less the tokens those requests pull from decode (``AsyncCluster.
    prefill_loads``). The warm prefill (the one that served the session's previous turn, whose
    prefix cache still holds the session's blocks and so pulls less from decode) is kept while
    its load exceeds the least loaded prefill's by less than ``max(slack_tokens, slack_ratio *
    least)``; otherwise the least loaded prefill wins. ``slack_tokens=0, slack_ratio=0`` is pure
    load (warmth counts for nothing, not even between equals).

    What warmth saves is transfer, not compute: a prefill that lacks the prefix pulls all of it
    from decode (every turn's cached tokens are the same either way). On GPUs with RDMA a pull of
    a long context takes a few tens of milliseconds, about what 512 queued tokens of prefill cost,
    so the defaults keep the warm prefill while it is at most 512 tokens (or 10% on a busy pool)
    behind the least loaded. ``benchmarks/placement_sim.py`` measures the balance they give.
    """

    slack_tokens: int = defaults.PREFILL_SLACK_TOKENS
    slack_ratio: float = defaults.PREFILL_SLACK_RATIO

    def __post_init__(self) -> None:
        if self.slack_tokens < 0 or self.slack_ratio < 0:
            raise ValueError("prefill weights must be non-negative")

    def slack(self, least: int) -> float:
        return max(float(self.slack_tokens), self.slack_ratio * least)


def choose_prefill(
    key: str,
    prefills: Sequence[str],
    *,
    loads: Mapping[str, int],
    healthy: Collection[str],
    warm: str | None = None,
    weights: PrefillWeights = PrefillWeights(),
) -> str | None:
    """The prefill for one turn, or ``None`` when no candidate is healthy.

    The warm prefill wins while its load is less than ``weights.slack`` above the least loaded;
    otherwise the least loaded wins, ties broken by the rendezvous rank of ``key`` (pass the
    session id and turn number, so that equal loads spread turns and sessions over the pool).

    >>> choose_prefill("s/1", ["p0", "p1"], loads={"p0": 100, "p1": 0}, healthy={"p0", "p1"},
    ...                warm="p0")
    'p0'
    >>> choose_prefill("s/1", ["p0", "p1"], loads={"p0": 9000, "p1": 0}, healthy={"p0", "p1"},
    ...                warm="p0")
    'p1'
    """
    candidates = [name for name in prefills if name in healthy]
    if not candidates:
        return None
    least = min(loads.get(name, 0) for name in candidates)
    if warm in candidates and loads.get(warm, 0) - least < weights.slack(least):
        return warm
    ranked = rank(key, candidates)
    return min(ranked, key=lambda name: loads.get(name, 0))  # min keeps the first of equals
