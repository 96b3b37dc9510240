"""Decode's book of pinned turn-end handles: who may release or extend which, until when.

Pure (no vLLM, clock and secrets injected) so that the policy is tested as plain functions; the
connector applies its decisions to vLLM's scheduler state.

Security model: a handle's blocks may be released or extended only by a caller that presents the
handle's ``remote_request_id``, its exact ``remote_block_ids`` and the lease secret minted here
(128 random bits) when the handle was pinned. All three travel only in the D leg's answer to the
SDK that sent the request. Anything else is answered "unknown", whether the request id exists or
not, so the routes are no oracle for other sessions' request ids.

A D leg whose answer the client lost carries no secret back, so it is released by the request
id the client chose instead: the SDK sends ``X-Request-Id: agentkv-<sha256(secret)>`` (the tag)
and, to release, presents the secret itself (:class:`~agentkv._wire.hints.RequestRelease`). The tag
travels in the clear (logs, response ids, the handle prefill reads) but names nothing anyone can
act on: only a preimage releases, and only the sender has it. A release that arrives before the
request finished leaves a tombstone for :data:`TOMBSTONE_S`, so the pin is never granted; a
flood of such releases only evicts the oldest tombstones (at most :data:`MAX_TOMBSTONES`), which
costs their pins a full TTL as on stock vLLM, never anyone's KV.
"""

from __future__ import annotations

import dataclasses
import hmac
import math
import secrets
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any, Protocol

from agentkv._core import get_logger
from agentkv._wire.hints import (
    HINTS_KEY,
    ExtendRequest,
    ExtendResult,
    HintError,
    LeaseAck,
    LeaseRef,
    PinHint,
    RequestRelease,
    tag_of_request_id,
)

logger = get_logger("agentkv.connector")

Clock = Callable[[], float]
SetDeadline = Callable[[str, float], None]

# How long a release by request id that found nothing pinned keeps the request from being
# pinned: longer than a D leg runs after its client gave up (vLLM aborts it when the client's
# connection closes; a non-streaming leg may finish first).
TOMBSTONE_S = 600.0
MAX_TOMBSTONES = 16384


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
    withheld: bool = False  # the client released the request before it finished


def decide_pin(params: Mapping[str, object] | None, *, default_ttl_s: float,
               max_ttl_s: float) -> PinDecision:
    """The pin policy for one finished request, from its ``kv_transfer_params``."""
    raw = params.get(HINTS_KEY) if params else None
    if raw is None:
        return PinDecision(pin=True, ttl_s=min(default_ttl_s, max_ttl_s))
    try:
        hint = PinHint.from_wire(raw)
    except HintError as exc:
        return PinDecision(pin=True, ttl_s=min(default_ttl_s, max_ttl_s), error=str(exc))
    if not hint.pin:
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
        self._tags: dict[str, set[str]] = {}  # client tag -> request ids leased under it
        self._tombstones: dict[str, float] = {}  # client tag -> until when, oldest first

    def __len__(self) -> int:
        return len(self._leases)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._leases

    def decide(self, request_id: str, params: Mapping[str, object] | None, *,
               default_ttl_s: float) -> PinDecision:
        """The pin policy for a finished request: its hint, unless its client released it."""
        tag = tag_of_request_id(request_id)
        if tag is not None and self._tombstoned(tag):
            return PinDecision(pin=False, ttl_s=0.0, withheld=True)
        return decide_pin(params, default_ttl_s=default_ttl_s, max_ttl_s=self.max_ttl_s)

    def grant(self, request_id: str, block_ids: tuple[tuple[int, ...], ...], *,
              ttl_s: float) -> tuple[Lease, LeaseAck]:
        """Record a new pin; its deadline is now + ``ttl_s`` (capped)."""
        ttl = min(ttl_s, self.max_ttl_s)
        lease = Lease(request_id=request_id, block_ids=block_ids, secret=self._secret(),
                      deadline=self._clock() + ttl)
        self._leases[request_id] = lease
        tag = tag_of_request_id(request_id)
        if tag is not None:
            self._tags.setdefault(tag, set()).add(request_id)
        return lease, LeaseAck(pinned=True, lease=lease.secret, ttl_s=ttl)

    def release_request(self, release: RequestRelease) -> list[str]:
        """Forget the leases of the requests sent under ``release``'s tag; the ids released.

        None released: the request has not finished (or pinned nothing, or is long gone), so the
        tag is tombstoned and a request finishing under it is not pinned.
        """
        tag = release.tag
        released = sorted(self._tags.pop(tag, ()))
        for request_id in released:
            self._leases.pop(request_id, None)
        if not released:
            self._tombstone(tag)
        return released

    def _tombstoned(self, tag: str) -> bool:
        until = self._tombstones.get(tag)
        return until is not None and self._clock() < until

    def _tombstone(self, tag: str) -> None:
        now = self._clock()
        self._tombstones.pop(tag, None)
        self._tombstones[tag] = now + TOMBSTONE_S
        # Oldest first: drop the expired ones, then the oldest beyond the cap.
        for old in list(self._tombstones):
            if len(self._tombstones) <= MAX_TOMBSTONES and self._tombstones[old] > now:
                break
            del self._tombstones[old]

    def _drop(self, request_id: str) -> None:
        self._leases.pop(request_id, None)
        tag = tag_of_request_id(request_id)
        ids = self._tags.get(tag) if tag is not None else None
        if ids is not None and tag is not None:
            ids.discard(request_id)
            if not ids:
                del self._tags[tag]

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

    def check(self, ref: LeaseRef) -> tuple[Outcome, Lease | None]:
        """Whether ``ref`` is a live lease of its holder (``OK``), without changing it."""
        return self._find(ref)

    def release(self, ref: LeaseRef) -> Outcome:
        """Forget the caller's lease now; the connector frees its blocks at the next step."""
        outcome, lease = self._find(ref)
        if outcome is Outcome.OK and lease is not None:
            self._drop(lease.request_id)
        return outcome

    def extend(self, ref: LeaseRef, *, ttl_s: float) -> tuple[Outcome, Lease | None]:
        """Push the deadline to at least now + ``ttl_s`` (capped); never pulls it in, because a
        prefill may already be reading against the current one."""
        outcome, lease = self._find(ref)
        if outcome is Outcome.OK and lease is not None:
            lease.deadline = max(lease.deadline, self._clock() + min(ttl_s, self.max_ttl_s))
        return outcome, lease

    def claim(self, ref: LeaseRef, *, ttl_s: float) -> tuple[Outcome, Lease | None]:
        """:meth:`extend`, and the lease changes hands: a new secret, the caller's only.

        Of several holders of one handle's secret (a save file loaded twice, a load beside the
        session that saved it) the first claim wins; every other holder's calls are answered
        "unknown" from then on, so no second holder is told the pin is its own and attaches it.
        """
        outcome, lease = self.extend(ref, ttl_s=ttl_s)
        if outcome is Outcome.OK and lease is not None:
            lease.secret = self._secret()
        return outcome, lease

    def remaining_s(self, lease: Lease) -> float:
        return lease.deadline - self._clock()

    def forget(self, request_ids: Iterable[str]) -> None:
        """vLLM freed these requests' blocks (read, expired or released)."""
        for request_id in request_ids:
            self._drop(request_id)


class PinControl(Protocol):
    """How the policy reaches the blocks: vLLM's NIXL scheduler fields, or the fake engine's."""

    def set_deadline(self, request_id: str, deadline: float) -> None: ...

    def unpin(self, request_id: str) -> None: ...


class SchedulerPins:
    """The two fields of vLLM's NIXL scheduler that decide a finished request's blocks.

    vLLM rebinds both to fresh containers at every step, so they are always read through the
    scheduler. Checked once at start: if vLLM renames them, the server refuses to start rather
    than silently ignoring hints.
    """

    def __init__(self, scheduler: Any) -> None:
        for name, kind in (("_reqs_need_send", dict), ("_reqs_not_processed", set)):
            if not isinstance(getattr(scheduler, name, None), kind):
                raise RuntimeError(
                    f"agentkv: vLLM's NIXL scheduler has no {kind.__name__} {name}; this vLLM "
                    "version is not supported by AgentKVConnector"
                )
        self._scheduler = scheduler

    def set_deadline(self, request_id: str, deadline: float) -> None:
        self._scheduler._reqs_need_send[request_id] = deadline

    def unpin(self, request_id: str) -> None:
        # The same bookkeeping vLLM does for an aborted request: the worker stops tracking it.
        self._scheduler._reqs_need_send.pop(request_id, None)
        self._scheduler._reqs_not_processed.add(request_id)


def apply_pin_policy(
    book: LeaseBook,
    control: PinControl,
    *,
    request_id: str,
    params: Mapping[str, object] | None,
    result: tuple[bool, dict[str, Any] | None],
    default_ttl_s: float,
) -> tuple[bool, dict[str, Any] | None]:
    """``request_finished`` with agentkv's pin policy, from stock vLLM's answer ``result``.

    Only decode's turn-end pins are agentkv's; prefill's blocks wait for decode as in vLLM. The
    request's pin hint decides (pin for its TTL, or free the blocks now), unless its client
    released the request by id before it finished (then nothing is pinned).
    """
    delay, out = result
    if not delay or not out or out.get("do_remote_decode") is not True:
        return result
    decision = book.decide(request_id, params, default_ttl_s=default_ttl_s)
    if not decision.pin:
        control.unpin(request_id)
        logger.debug("pin_skipped", request_id=request_id, withheld=decision.withheld)
        return False, {
            **out,
            # The shape stock vLLM sends when it keeps nothing: no blocks, no tokens.
            "remote_block_ids": [[] for _ in out["remote_block_ids"]],
            "remote_num_tokens": 0,
            "remote_blocks_expiry_time": None,
            HINTS_KEY: LeaseAck(pinned=False).to_wire(),
        }
    blocks = tuple(tuple(int(b) for b in group) for group in out["remote_block_ids"])
    lease, ack = book.grant(request_id, blocks, ttl_s=decision.ttl_s)
    if decision.error is not None:
        ack = dataclasses.replace(ack, error=decision.error)
        logger.warning("hint_ignored", request_id=request_id, error=decision.error)
    control.set_deadline(request_id, lease.deadline)
    logger.debug("lease_granted", request_id=request_id, ttl_s=ack.ttl_s)
    return True, {**out, "remote_blocks_expiry_time": lease.deadline, HINTS_KEY: ack.to_wire()}


class LeaseService:
    """Serves the lease calls (``info``, ``release``, ``extend``, ``claim``) against a book.

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
            if op in ("extend", "claim"):
                return self._extend(ExtendRequest.from_wire(payload), claim=op == "claim")
            if op == "release_request":
                return self._release_request(RequestRelease.from_wire(payload))
        except HintError as exc:
            return {"status": "invalid", "message": str(exc)}
        return {"status": "invalid", "message": f"unknown lease operation {op!r}"}

    def _release(self, ref: LeaseRef) -> dict[str, object]:
        outcome = self._book.release(ref)
        if outcome is Outcome.OK:
            self._set_deadline(ref.request_id, self._clock() - 1.0)
        logger.info("lease_release", request_id=ref.request_id, outcome=outcome.value)
        return {"status": outcome.value}

    def _release_request(self, release: RequestRelease) -> dict[str, object]:
        released = self._book.release_request(release)
        for request_id in released:
            self._set_deadline(request_id, self._clock() - 1.0)
        logger.info("lease_release_request", tag=release.tag, released=len(released))
        return {"status": "ok", "released": len(released)}

    def _extend(self, extend: ExtendRequest, *, claim: bool) -> dict[str, object]:
        grow = self._book.claim if claim else self._book.extend
        outcome, lease = grow(extend.ref, ttl_s=extend.ttl_s)
        logger.info(
            "lease_claim" if claim else "lease_extend",
            request_id=extend.ref.request_id,
            outcome=outcome.value,
            ttl_s=extend.ttl_s,
        )
        if outcome is not Outcome.OK or lease is None:
            return {"status": outcome.value}
        self._set_deadline(lease.request_id, lease.deadline)
        granted = ExtendResult(
            expiry=lease.deadline,
            ttl_s=self._book.remaining_s(lease),
            lease=lease.secret if claim else None,
        )
        return {"status": "ok", **granted.to_wire()}
