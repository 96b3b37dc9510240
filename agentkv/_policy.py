"""Pure decisions about cached KV: immutable inputs in, a decision out, no I/O.

The clock is always passed in (``now``), so every rule is a plain function to test:

>>> policy = CachePolicy(server_ttl_s=480.0, ttl_margin_s=30.0)
>>> policy.deadline(issued_at=100.0)
550.0
>>> policy.decide_attach(None, prompt_len=500, now=0.0).state
<HandleState.NONE: 'none'>

With agentkv's vLLM extension on decode (``agentkv.connector``), the policy also says what decode
should do with a turn's KV: pin it for the next turn or not at all (``decide_pin``), keep it
longer while a tool runs (``decide_extend``), or free it now (``decide_release``):

>>> policy.decide_pin(final=True)
PinHint(pin=False, ttl_s=None)

Where a session lives and where each turn prefills are decided the same way in ``_placement``.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal, TypeAlias, cast

from agentkv import _constants as defaults
from agentkv._exceptions import ConfigError
from agentkv._route import RoutePolicy
from agentkv._types import HandleState, KVHandle
from agentkv._wire.hints import PinHint
from agentkv._wire.tier import TierRef

__all__ = [
    "AttachDecision",
    "CachePolicy",
    "ExtendDecision",
    "PersistMode",
    "TierCostModel",
    "TierDecision",
    "check_persist_mode",
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


# --- the file tier --------------------------------------------------------------------------------
TierAction: TypeAlias = Literal["pin", "persist", "drop"]
PersistMode: TypeAlias = Literal["auto", "pin", "disk"]
PERSIST_MODES: tuple[str, ...] = ("auto", "pin", "disk")


def check_persist_mode(mode: object) -> PersistMode:
    """``mode`` if it is a persist option (``"auto"``, ``"pin"``, ``"disk"``), else ValueError."""
    if mode not in PERSIST_MODES:
        raise ValueError(f"persist must be one of {', '.join(PERSIST_MODES)}, got {mode!r}")
    return cast(PersistMode, mode)


@dataclass(frozen=True, kw_only=True, slots=True)
class TierCostModel:
    """What moving a turn's KV to the file tier and back costs, against recomputing it.

    The model, for a handle of ``n`` tokens (``docs/design/kv-tier.md``, sections 5 and 7)::

        bytes(n)     = n * bytes_per_token
        persist_s(n) = bytes(n) / write_bytes_per_s + fsync_s       (decode, during the wait)
        resume_s(n)  = bytes(n) / read_bytes_per_s                  (prefill, on the next turn)
        recompute_s(n) = n / recompute_tokens_per_s                 (prefill, without any reuse)

    The defaults are this machine's measurements, each chosen so that the model never
    over-values the tier:

    * ``bytes_per_token`` 23,040: SmolLM2-135M in bf16 (30 layers x K,V x 3 KV heads x 64 x 2 B;
      section 5's table; fp32, what ``agentkv up`` picks without native bf16, is 46,080).
    * ``write_bytes_per_s`` 2.0 GB/s: the slowest bf16 write measured through NIXL POSIX
      (io_uring; AIO reached 4.46 GB/s), section 5.
    * ``fsync_s`` 35 ms: the slowest fsync measured (fp32, 94 MB), section 5.
    * ``read_bytes_per_s`` 4.6 GB/s: the slowest read measured, from the page cache (libaio);
      a cold disk was not measured, section 5.
    * ``recompute_tokens_per_s`` 540: cold prefill in bf16 on the AVX512-BF16 EPYC, the fastest
      measured (fp32 260-282 tok/s, AVX2-only ~40 tok/s), section 7 and ``docs/cpu.md``.

    At those numbers 2,048 tokens (47 MB) persist in ~59 ms and resume in ~10 ms, against ~3.8 s
    of recompute.

    >>> cost = TierCostModel()
    >>> round(cost.resume_s(2048) * 1000, 1), round(cost.recompute_s(2048), 2)
    (10.3, 3.79)
    """

    bytes_per_token: int = 23_040
    write_bytes_per_s: float = 2.0e9
    read_bytes_per_s: float = 4.6e9
    fsync_s: float = 0.035
    recompute_tokens_per_s: float = 540.0

    def __post_init__(self) -> None:
        rates = (self.write_bytes_per_s, self.read_bytes_per_s, self.recompute_tokens_per_s)
        if self.bytes_per_token <= 0 or not all(math.isfinite(r) and r > 0 for r in rates):
            raise ConfigError("the tier cost model's sizes and rates must be positive")
        if not (math.isfinite(self.fsync_s) and self.fsync_s >= 0):
            raise ConfigError(f"fsync_s must not be negative, got {self.fsync_s}")

    def bytes(self, n_tokens: int) -> int:
        return n_tokens * self.bytes_per_token

    def persist_s(self, n_tokens: int) -> float:
        return self.bytes(n_tokens) / self.write_bytes_per_s + self.fsync_s

    def resume_s(self, n_tokens: int) -> float:
        return self.bytes(n_tokens) / self.read_bytes_per_s

    def recompute_s(self, n_tokens: int) -> float:
        return n_tokens / self.recompute_tokens_per_s


@dataclass(frozen=True, kw_only=True, slots=True)
class TierDecision:
    """What to do with a pinned handle before a wait: keep the pin, persist it to the file tier
    (and free decode's memory), or drop it (nothing left worth keeping)."""

    action: TierAction
    reason: str

    @property
    def persist(self) -> bool:
        return self.action == "persist"


_NO_PIN = PinHint(pin=False)


@functools.lru_cache(maxsize=32)
def _pin_hint(ttl_s: float | None) -> PinHint:
    # A policy's TTL is fixed: its (frozen) hint is built and checked once, not every turn.
    return PinHint(ttl_s=ttl_s)


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
        persist_after_s: with a file tier on decode, a wait (``tool_wait``'s ``expected_s``) or
            an idle time at least this long persists the handle to the tier instead of holding
            decode's memory (``decide_tier``). A minute dwarfs the tier's round trip (tens of
            milliseconds for thousands of tokens, ``TierCostModel``) while a pin held for it
            blocks other sessions' KV; shorter waits keep the pin and its free resume.
        persist_kv_usage: decode's ``vllm:kv_cache_usage_perc`` (0-1) at or above which a
            handle is persisted before any wait: memory pressure.
        tier_cost: the tier's cost model (``TierCostModel``).
        tier_ttl_s: how long decode should keep a persisted handle's tier entry; ``None`` keeps
            the server's default (``agentkv_tier_ttl_s``, 24 h), and the server caps it (at
            ``agentkv_tier_max_ttl_s``). A resume after the entry expired recomputes.
        route: how a turn's route is chosen when it is ``auto`` (``RoutePolicy``): pull the KV
            back to prefill, or compute a short append on the session's decode itself.
    """

    server_ttl_s: float = defaults.SERVER_TTL_S
    ttl_margin_s: float = defaults.TTL_MARGIN_S
    recompute_threshold: int = defaults.RECOMPUTE_THRESHOLD
    min_reuse_tokens: int = 0
    pin_ttl_s: float | None = None
    extend_slack_s: float = defaults.EXTEND_SLACK_S
    persist_after_s: float = 60.0
    persist_kv_usage: float = 0.9
    tier_cost: TierCostModel = field(default_factory=TierCostModel)
    tier_ttl_s: float | None = None
    route: RoutePolicy = field(default_factory=RoutePolicy)

    def __post_init__(self) -> None:
        if isinstance(self.tier_cost, Mapping):  # from a saved session (dataclasses.asdict)
            object.__setattr__(self, "tier_cost", TierCostModel(**self.tier_cost))
        if isinstance(self.route, Mapping):
            object.__setattr__(self, "route", RoutePolicy(**self.route))
        if not (math.isfinite(self.persist_after_s) and self.persist_after_s >= 0):
            raise ConfigError(f"persist_after_s must not be negative, got {self.persist_after_s}")
        if not 0 < self.persist_kv_usage <= 1:
            raise ConfigError(f"persist_kv_usage must be in (0, 1], got {self.persist_kv_usage}")
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
        if self.tier_ttl_s is not None and not (
            math.isfinite(self.tier_ttl_s) and self.tier_ttl_s > 0
        ):
            raise ConfigError(
                f"tier_ttl_s must be a positive number of seconds or None, got {self.tier_ttl_s}"
            )

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

    @staticmethod
    def overdue_s(handle: KVHandle | None, *, now: float) -> float | None:
        """Seconds ``handle`` is past our deadline at ``now``; ``None`` while it is live (or
        there is none). The one expiry rule: attach, extend, persist and the agent all ask it.

        >>> CachePolicy.overdue_s(None, now=5.0) is None
        True
        """
        if handle is None or now < handle.deadline:
            return None
        return now - handle.deadline

    def decide_pin(self, *, final: bool) -> PinHint:
        """The hint for a D leg: pin for the next turn, or nothing on a turn no other follows."""
        return _NO_PIN if final else _pin_hint(self.pin_ttl_s)

    def decide_persist(self, *, final: bool) -> PinHint:
        """Deprecated: the old name of :meth:`decide_pin` (it decides a pin, not a tier write)."""
        warnings.warn(
            "CachePolicy.decide_persist is deprecated; use decide_pin",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.decide_pin(final=final)

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
        if (overdue := self.overdue_s(handle, now=now)) is not None:
            return ExtendDecision(
                extend=False, ttl_s=None, reason=f"handle passed its deadline {overdue:.1f}s ago"
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
        if (overdue := self.overdue_s(handle, now=now)) is not None:
            return AttachDecision(
                attach=False,
                state=HandleState.EXPIRED,
                reason=f"handle passed its deadline {overdue:.1f}s ago",
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

    def decide_tier(  # noqa: PLR0911 - one return per rule, in the documented order
        self,
        handle: KVHandle | None,
        *,
        now: float,
        expected_wait_s: float | None = None,
        idle_s: float | None = None,
        hint: PersistMode = "auto",
        decode_kv_usage: float | None = None,
        tier_available: bool,
    ) -> TierDecision:
        """Keep ``handle`` pinned on decode, persist it to the file tier, or drop it?

        In order: nothing to decide without a live leased handle (``drop`` past its deadline:
        decode is freeing it; ``pin`` on a stock decode, which has no persist call); ``hint``
        ``"pin"`` keeps the pin; without a tier on decode the pin is all there is; ``hint``
        ``"disk"`` persists; a resume from the tier that costs as much as recomputing is not
        worth a write (``pin``); decode memory at or above ``persist_kv_usage`` persists; a wait
        or idle time of ``persist_after_s`` or more, and long enough for the write to finish,
        persists. Otherwise the pin stays (``decide_extend`` then says whether to extend it).

        >>> CachePolicy().decide_tier(None, now=0.0, tier_available=True).action
        'drop'
        """
        check_persist_mode(hint)
        for value, name in ((expected_wait_s, "expected_wait_s"), (idle_s, "idle_s")):
            if value is not None and not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")
        if handle is None:
            return TierDecision(action="drop", reason="no stored handle")
        if (overdue := self.overdue_s(handle, now=now)) is not None:
            return TierDecision(
                action="drop", reason=f"handle passed its deadline {overdue:.1f}s ago"
            )
        if not handle.leased:
            return TierDecision(
                action="pin", reason="decode has no agentkv extension (stock vLLM)"
            )
        if hint == "pin":
            return TierDecision(action="pin", reason="the caller asked to keep the pin")
        if not tier_available:
            return TierDecision(action="pin", reason="decode has no file tier")
        if hint == "disk":
            return TierDecision(action="persist", reason="the caller asked for the tier")
        cost, n = self.tier_cost, handle.num_tokens
        if cost.resume_s(n) >= cost.recompute_s(n):
            return TierDecision(
                action="pin",
                reason=f"{n} tokens recompute as fast as they load from the tier",
            )
        if decode_kv_usage is not None and decode_kv_usage >= self.persist_kv_usage:
            return TierDecision(
                action="persist",
                reason=f"decode KV usage {decode_kv_usage:.2f} >= {self.persist_kv_usage:.2f}",
            )
        wait = max(expected_wait_s or 0.0, idle_s or 0.0)
        threshold = max(self.persist_after_s, cost.persist_s(n))
        if wait >= threshold:
            what = "idle" if (idle_s or 0.0) >= (expected_wait_s or 0.0) else "a wait"
            return TierDecision(
                action="persist",
                reason=f"{what} of {wait:.1f}s >= {threshold:.1f}s: the tier resumes {n} tokens "
                f"in {cost.resume_s(n) * 1000:.0f} ms, recompute takes {cost.recompute_s(n):.1f}s",
            )
        return TierDecision(
            action="pin", reason=f"a wait of {wait:.1f}s is shorter than {threshold:.1f}s"
        )

    def decide_tier_attach(
        self, ref: TierRef | None, *, prompt_len: int, prefix_matches: bool
    ) -> AttachDecision:
        """Send the tier reference ``ref`` with a prefill of ``prompt_len`` tokens?

        ``prefix_matches`` says whether the prompt starts with exactly the tokens the entry
        holds: prefill checks that too, token by token, but a reference is only sent where it
        can serve (as ``decide_attach`` does for handles). There is no deadline: the entry
        lives until it is deleted or evicted (then prefill recomputes).
        """
        if ref is None:
            return AttachDecision(attach=False, state=HandleState.NONE, reason="no tier entry")
        if not prefix_matches or ref.n_tokens > prompt_len:
            return AttachDecision(
                attach=False,
                state=HandleState.DIVERGED,
                reason=f"the prompt does not start with the {ref.n_tokens} persisted tokens",
            )
        if ref.n_tokens < self.min_reuse_tokens or ref.n_tokens == 0:
            return AttachDecision(
                attach=False,
                state=HandleState.BELOW_THRESHOLD,
                reason=f"the tier holds {ref.n_tokens} tokens, below {self.min_reuse_tokens}",
            )
        return AttachDecision(attach=True, state=HandleState.TIER, reason="")
