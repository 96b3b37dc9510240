"""Whether a client's ``X-AgentKV-Offload: always`` is honoured: off by default, rate-limited per
principal when allowed.

An offload is a write of a session's pinned KV to decode's file tier (on decode's worker threads,
``connector._tier_writer``) that every tenant of that decode shares the machine with, and it takes
room in the tier all tenants share. So a client may ask for one only where the operator allows it
(``ProxyConfig.allow_client_offload``), and then at most ``client_offload_per_minute`` a minute per
principal (a token bucket holding a minute's worth: a burst, then the rate). The idle sweep's
offloads are the proxy's own and pass no gate.

A refused ask is *ignored*, not answered with an error: the header is a hint about where the
turn-end KV waits, and the turn's answer is the same without it; a 403 or 429 would throw away
a whole generation, and make a client written for a proxy that allows it fail here. The turn is
served as if the header said ``auto``, and the answer says what happened
(``X-AgentKV-Offload-Ignored: not_allowed | rate_limited``). A malformed value is still a 400
(``offload_from``): that is bad input, not a refused hint. ``never`` and ``auto`` write nothing
and pass. The gate is per replica: N replicas let a principal offload N times the rate.

The modes are the session's (today ``"disk"`` is the offload; see ``_request.offload_from``).

>>> gate = OffloadGate(allowed=True, per_minute=1, clock=lambda: 0.0)
>>> gate.admit("alice", "disk"), gate.admit("alice", "disk").ignored, gate.admit("bob", "disk")
(Admission(mode='disk', ignored=None), 'rate_limited', Admission(mode='disk', ignored=None))
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from agentkv._core import PersistMode, get_logger

__all__ = ["IGNORED_HEADER", "LEGACY_IGNORED_HEADER", "Admission", "OffloadGate"]

logger = get_logger("agentkv")

IGNORED_HEADER = "X-AgentKV-Offload-Ignored"
# Also sent to a client that asked with the deprecated X-AgentKV-Persist (for one release).
LEGACY_IGNORED_HEADER = "X-AgentKV-Persist-Ignored"
# Buckets beyond this many are pruned of the full ones (a full bucket is the same as none).
_PRUNE_AT = 4096


@dataclass(frozen=True, kw_only=True, slots=True)
class Admission:
    """The offload option a turn runs with, and why the client's was ignored (``None``: it
    was not)."""

    mode: PersistMode
    ignored: Literal["not_allowed", "rate_limited"] | None = None


class OffloadGate:
    """Admits clients' offload asks: per principal, a bucket of ``per_minute`` that refills
    continuously on ``clock`` (monotonic seconds)."""

    def __init__(self, *, allowed: bool, per_minute: float, clock: Callable[[], float]) -> None:
        self._allowed = allowed
        self._capacity = float(per_minute)
        self._per_s = per_minute / 60.0
        self._clock = clock
        self._buckets: dict[str, tuple[float, float]] = {}  # principal -> (tokens, at)

    def admit(self, principal: str, mode: PersistMode) -> Admission:
        if mode != "disk":
            return Admission(mode=mode)
        if not self._allowed:
            return self._ignore(principal, "not_allowed")
        now = self._clock()
        tokens = self._tokens(principal, now)
        if tokens < 1.0:
            self._buckets[principal] = (tokens, now)
            return self._ignore(principal, "rate_limited")
        self._buckets[principal] = (tokens - 1.0, now)
        if len(self._buckets) > _PRUNE_AT:
            self._prune(now)
        return Admission(mode="disk")

    def _tokens(self, principal: str, now: float) -> float:
        tokens, at = self._buckets.get(principal, (self._capacity, now))
        return min(self._capacity, tokens + max(0.0, now - at) * self._per_s)

    def _prune(self, now: float) -> None:
        full = [p for p in self._buckets if self._tokens(p, now) >= self._capacity]
        for principal in full:
            del self._buckets[principal]

    @staticmethod
    def _ignore(principal: str, reason: Literal["not_allowed", "rate_limited"]) -> Admission:
        logger.info("agentkv.proxy.offload_ignored", principal=principal, reason=reason)
        return Admission(mode="auto", ignored=reason)
