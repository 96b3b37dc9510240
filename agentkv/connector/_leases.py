"""Decode's book of pinned turn-end handles: who may release or extend which, until when.

Pure (no vLLM, clock and secrets injected) so that the policy is tested as plain functions; the
connector applies its decisions to vLLM's scheduler state.

Security model: a handle's blocks may be released or extended only by a caller that presents the
handle's ``remote_request_id``, its exact ``remote_block_ids`` and the lease secret minted here
(128 random bits) when the handle was pinned. All three travel only in the D leg's answer to the
SDK that sent the request. Anything else is answered "unknown", whether the request id exists or
not, so the routes are no oracle for other sessions' request ids.
"""

from __future__ import annotations

import hmac
import math
import secrets
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from enum import Enum

import structlog

from agentkv._hints import (
    HINTS_KEY,
    ExtendRequest,
    ExtendResult,
    HintError,
    LeaseAck,
    LeaseRef,
    PersistHint,
)

logger = structlog.get_logger("agentkv.connector")

Clock = Callable[[], float]
SetDeadline = Callable[[str, float], None]


def new_secret() -> str:
    return secrets.token_urlsafe(16)


@dataclass(frozen=True, kw_only=True, slots=True)
class PinDecision:
    """What to do with a finished D-leg request's blocks: pin for ``ttl_s``, or free them now.

    ``error`` is set when the request's hint was malformed and decode fell back to stock vLLM's
    behaviour (pin for the default TTL): it is reported back in the acknowledgement.
    """

    pin: bool
    ttl_s: float
    error: str | None = None


def decide_pin(params: Mapping[str, object] | None, *, default_ttl_s: float,
               max_ttl_s: float) -> PinDecision:
    """The persist policy for one finished request, from its ``kv_transfer_params``."""
    raw = params.get(HINTS_KEY) if params else None
    if raw is None:
        return PinDecision(pin=True, ttl_s=min(default_ttl_s, max_ttl_s))
    try:
        hint = PersistHint.from_wire(raw)
    except HintError as exc:
        return PinDecision(pin=True, ttl_s=min(default_ttl_s, max_ttl_s), error=str(exc))
    if not hint.persist:
        return PinDecision(pin=False, ttl_s=0.0)
    ttl = default_ttl_s if hint.ttl_s is None else hint.ttl_s
    return PinDecision(pin=True, ttl_s=min(ttl, max_ttl_s))


class Outcome(Enum):
    OK = "ok"
    UNKNOWN = "unknown"  # no such lease, or the caller does not hold it
    EXPIRED = "expired"  # the caller's lease, past its deadline


@dataclass(slots=True)
class Lease:
    request_id: str
    block_ids: tuple[tuple[int, ...], ...]
    secret: str
    deadline: float


class LeaseBook:
    """The pins decode holds for agentkv, keyed by vLLM request id.

    Deadlines are on ``clock`` (decode's ``time.perf_counter``, the clock of vLLM's own
    ``remote_blocks_expiry_time``). Entries leave when vLLM reports the blocks freed (read by a
    prefill, expired, or released) through :meth:`forget`, or at once on release.
    """

    def __init__(self, *, clock: Clock, secret: Callable[[], str] = new_secret,
                 max_ttl_s: float) -> None:
        if not math.isfinite(max_ttl_s) or max_ttl_s <= 0:
            raise ValueError("max_ttl_s must be a positive number of seconds")
        self._clock = clock
        self._secret = secret
        self.max_ttl_s = max_ttl_s
        self._leases: dict[str, Lease] = {}

    def __len__(self) -> int:
        return len(self._leases)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._leases

    def grant(self, request_id: str, block_ids: tuple[tuple[int, ...], ...], *,
              ttl_s: float) -> tuple[Lease, LeaseAck]:
        """Record a new pin; its deadline is now + ``ttl_s`` (capped)."""
        ttl = min(ttl_s, self.max_ttl_s)
        lease = Lease(request_id=request_id, block_ids=block_ids, secret=self._secret(),
                      deadline=self._clock() + ttl)
        self._leases[request_id] = lease
        return lease, LeaseAck(pinned=True, lease=lease.secret, ttl_s=ttl)

    def _find(self, ref: LeaseRef) -> tuple[Outcome, Lease | None]:
        lease = self._leases.get(ref.request_id)
        # Constant-time secret check, and the same answer for "no such id" and "not yours".
        if (
            lease is None
            or not hmac.compare_digest(lease.secret.encode(), ref.lease.encode())
            or lease.block_ids != ref.block_ids
        ):
            return Outcome.UNKNOWN, None
        if self._clock() >= lease.deadline:
            return Outcome.EXPIRED, lease
        return Outcome.OK, lease

    def release(self, ref: LeaseRef) -> Outcome:
        """Forget the caller's lease now; the connector frees its blocks at the next step."""
        outcome, lease = self._find(ref)
        if outcome is Outcome.OK and lease is not None:
            del self._leases[lease.request_id]
        return outcome

    def extend(self, ref: LeaseRef, *, ttl_s: float) -> tuple[Outcome, Lease | None]:
        """Push the deadline to at least now + ``ttl_s`` (capped); never pulls it in, because a
        prefill may already be reading against the current one."""
        outcome, lease = self._find(ref)
        if outcome is Outcome.OK and lease is not None:
            lease.deadline = max(lease.deadline, self._clock() + min(ttl_s, self.max_ttl_s))
        return outcome, lease

    def remaining_s(self, lease: Lease) -> float:
        return lease.deadline - self._clock()

    def forget(self, request_ids: Iterable[str]) -> None:
        """vLLM freed these requests' blocks (read, expired or released)."""
        for request_id in request_ids:
            self._leases.pop(request_id, None)


class LeaseService:
    """Serves the lease calls (``info``, ``release``, ``extend``) against a book.

    What a call decides reaches vLLM only through ``set_deadline(request_id, deadline)``: the
    connector hands that deadline to its workers, which free the blocks once it has passed. A
    release therefore sets a deadline in the past. Answers are plain dicts with a ``status`` of
    ``ok``, ``unknown``, ``expired`` or ``invalid`` (the endpoint maps them to HTTP statuses).
    """

    def __init__(
        self, book: LeaseBook, *, set_deadline: SetDeadline, clock: Clock, default_ttl_s: float
    ) -> None:
        self._book = book
        self._set_deadline = set_deadline
        self._clock = clock
        self._default_ttl_s = default_ttl_s

    def handle(self, op: str, payload: object) -> dict[str, object]:
        try:
            if op == "info":
                return {
                    "status": "ok",
                    "pins": len(self._book),
                    "max_ttl_s": self._book.max_ttl_s,
                    "default_ttl_s": min(self._default_ttl_s, self._book.max_ttl_s),
                }
            if op == "release":
                return self._release(LeaseRef.from_wire(payload))
            if op == "extend":
                return self._extend(ExtendRequest.from_wire(payload))
        except HintError as exc:
            return {"status": "invalid", "message": str(exc)}
        return {"status": "invalid", "message": f"unknown lease operation {op!r}"}

    def _release(self, ref: LeaseRef) -> dict[str, object]:
        outcome = self._book.release(ref)
        if outcome is Outcome.OK:
            self._set_deadline(ref.request_id, self._clock() - 1.0)
        logger.info("lease_release", request_id=ref.request_id, outcome=outcome.value)
        return {"status": outcome.value}

    def _extend(self, extend: ExtendRequest) -> dict[str, object]:
        outcome, lease = self._book.extend(extend.ref, ttl_s=extend.ttl_s)
        logger.info(
            "lease_extend",
            request_id=extend.ref.request_id,
            outcome=outcome.value,
            ttl_s=extend.ttl_s,
        )
        if outcome is not Outcome.OK or lease is None:
            return {"status": outcome.value}
        self._set_deadline(lease.request_id, lease.deadline)
        granted = ExtendResult(expiry=lease.deadline, ttl_s=self._book.remaining_s(lease))
        return {"status": "ok", **granted.to_wire()}
