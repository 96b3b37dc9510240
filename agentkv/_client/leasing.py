"""A session's pinned KV on decode between turns: release, extend, persist, tool waits.

A turn's KV stays pinned on its decode server for the next turn. Stock vLLM holds it for a fixed
``decoder_kv_blocks_ttl``; agentkv's vLLM extension (``agentkv.connector``, wire format in
``_hints``) leases the pin to the session, which then frees it as soon as it is no longer needed
(``release``) or keeps it while a tool runs (``extend``). With a file tier on decode, a pin can
also be **persisted** (``persist``): decode writes the KV to files on the host and frees its
memory, and the next turn's prefill loads it from there (``CachePolicy.decide_tier`` says when).

Everything here is best effort. A decode without the extension is detected once per server and
gets no lease calls (one warning says so); a failed call leaves what stock vLLM does (the pin
lives out its TTL). Neither ever fails a turn, a tool call or a close.

>>> async with cluster.session() as s:  # doctest: +SKIP
...     r = await s.send("Look up the weather in Paris.")
...     async with s.tool_wait(expected_s=600):  # extends the handle if 600 s outlast it
...         weather = await slow_weather_api("Paris")
...     await s.send(Message.tool(weather, tool_call_id=r.tool_calls[0].id))
... # leaving the block released decode's pin of the last turn
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from agentkv._client.pool import PairPool
from agentkv._client.state import SessionState
from agentkv._log import get_logger
from agentkv._policy import ExtendDecision, PersistMode, TierDecision
from agentkv._types import HandleState, KVHandle
from agentkv._wire.handoff import extended_handle
from agentkv._wire.hints import request_tag
from agentkv._wire.lease_calls import GONE, OK, CallResult
from agentkv._wire.tier import TierRef

__all__ = [
    "ToolWait",
    "begin_wait",
    "decode_kv_usage",
    "delete_tier",
    "delete_tier_soon",
    "end_wait",
    "extend_handle",
    "persist_handle",
    "release_handle",
    "release_lost",
    "release_pinned",
    "release_request",
    "release_soon",
]

logger = get_logger("agentkv")


def _ms(since: float) -> float:
    return round((time.perf_counter() - since) * 1000.0, 3)


async def release_handle(
    pool: PairPool, state: SessionState, handle: KVHandle, *, reason: str
) -> None:
    """Ask decode to free ``handle``'s blocks now; never raises for the server's sake.

    Only for a leased handle no P leg has carried (a P leg consumes it).
    """
    started = time.perf_counter()
    result = await pool.leases.release(pool.decode_url(handle.pair), handle)
    _log_lease_call("agentkv.release", state, handle, result, reason=reason, started=started)


async def release_pinned(pool: PairPool, state: SessionState) -> bool:
    """Release the session's pinned handle now and drop it (``AsyncSession.unpin`` where decode
    has no tier); whether decode freed it (or no longer held it). The next turn recomputes."""
    handle = state.handle
    if handle is None or not handle.leased:
        return False
    started = time.perf_counter()
    result = await pool.leases.release(pool.decode_url(handle.pair), handle)
    _log_lease_call("agentkv.release", state, handle, result, reason="unpin", started=started)
    if result.outcome not in (OK, GONE):
        return False
    if state.handle is handle:
        state.drop_handle(
            HandleState.NONE, "released while idle: decode's memory was needed (unpin)"
        )
    return True


def release_soon(
    pool: PairPool, state: SessionState, handle: KVHandle, *, reason: str
) -> asyncio.Task[None]:
    """:func:`release_handle` in the background (from a turn ending by cancellation or a closed
    stream); ``aclose()`` of the session waits for it."""
    task = asyncio.ensure_future(release_handle(pool, state, handle, reason=reason))
    pool.leases.track(task)
    return task


def release_lost(
    pool: PairPool, state: SessionState, decode: str, secret: str, *, reason: str
) -> asyncio.Task[None]:
    """Free, in the background, whatever decode pinned for a D leg whose answer was lost.

    The leg was sent with ``X-Request-Id: request_tag(secret)``; presenting the secret releases
    its pin, or, when decode has not finished the request yet, keeps it from being pinned. A
    background task, because the turn may be ending by cancellation or by its stream being
    closed; ``aclose()`` of the session waits for it.
    """

    async def run() -> None:
        started = time.perf_counter()
        result = await pool.leases.release_request(decode, secret)
        log = logger.info if result.outcome in (OK, GONE) else logger.warning
        log(
            "agentkv.release_lost",
            session_id=state.session_id,
            decode=decode,
            request_tag=request_tag(secret),
            reason=reason,
            outcome=result.outcome,
            status=result.status,
            detail=result.detail,
            ms=_ms(started),
        )

    task = asyncio.ensure_future(run())
    pool.leases.track(task)
    return task


async def release_request(pool: PairPool, secret: str) -> int:
    """Free on every decode server whatever it pinned for the D leg tagged with ``secret``
    (``AsyncCluster.release_request``); how many took the release. Never raises for the
    servers' sake."""
    decodes = sorted({pair.decode for pair in pool.pairs})
    started = time.perf_counter()
    results = await asyncio.gather(*(pool.leases.release_request(d, secret) for d in decodes))
    taken = sum(result.outcome == OK for result in results)
    logger.info(
        "agentkv.release_request",
        request_tag=request_tag(secret),
        decodes=len(decodes),
        taken=taken,
        outcomes=[result.outcome for result in results],
        ms=_ms(started),
    )
    return taken


async def decode_kv_usage(pool: PairPool) -> dict[str, float | None]:
    """Each pair's decode KV memory in use (``AsyncCluster.kv_usage``), one read per server."""
    pairs = pool.pairs
    decodes = sorted({pair.decode for pair in pairs})
    read = await asyncio.gather(*map(pool.leases.kv_usage, decodes))
    usage = dict(zip(decodes, read, strict=True))
    return {pair.name: usage[pair.decode] for pair in pairs}


async def extend_handle(
    pool: PairPool, state: SessionState, ttl_s: float, *, reason: str, claim: bool = False
) -> float | None:
    """Ask decode to keep the session's handle ``ttl_s`` more seconds; the new deadline or
    ``None`` (no handle, no lease, or decode no longer holds it: then it is dropped).

    ``claim``: also take the lease, exclusively (decode rotates its secret): the session's
    handle then carries the new secret, and any other holder of the old one (a copy of the same
    save file) is refused from now on. A claim refused as unknown means another holder took it.
    """
    handle = state.handle
    if handle is None or not handle.leased:
        return None
    # A handle a copy also holds (a save, a load) is claimed by whichever call reaches decode
    # first: a plain extend would leave it unclaimed under a new identity, attached unasked.
    claim = claim or state.unconfirmed is handle
    sent_at = pool.clock()
    started = time.perf_counter()
    result = await pool.leases.extend(
        pool.decode_url(handle.pair), handle, ttl_s=ttl_s, claim=claim
    )
    deadline: float | None = None
    if result.extended is not None:
        granted = state.policy.lease_deadline(sent_at=sent_at, ttl_s=result.extended.ttl_s)
        # Decode never shortens a lease; our two estimates of it are both safe, keep the later.
        deadline = max(granted, handle.deadline)
        if state.handle is handle:  # a turn may have taken it meanwhile
            state.handle = extended_handle(handle, result.extended, deadline=deadline)
            if claim:
                state.unconfirmed = None  # ours alone now: attached without asking again
    elif result.outcome == GONE and state.handle is handle:
        # On a claim, decode cannot tell "not yours" from "gone", by design: either way, not
        # attached. The reason names both, for a user who loaded one file twice.
        held = " (or another copy of this session claimed it first)" if claim else ""
        state.drop_handle(
            HandleState.EXPIRED,
            f"decode no longer holds the handle{held} ({result.detail or 'gone'})",
        )
    _log_lease_call(
        "agentkv.claim" if claim else "agentkv.extend",
        state,
        handle,
        result,
        reason=reason,
        started=started,
        ttl_s=ttl_s,
        granted_s=None if result.extended is None else round(result.extended.ttl_s, 3),
        deadline_in_s=None if deadline is None else round(deadline - sent_at, 3),
    )
    return deadline


async def persist_handle(pool: PairPool, state: SessionState, *, reason: str) -> TierRef | None:
    """Persist the session's handle to its decode's file tier; the reference or ``None``.

    On success decode has freed the pin: the session holds the reference instead (the next
    turn's P leg carries it). Never raises for the server's sake: on any failure (no tier, a
    failed write, a lost answer) the handle stays as it was, pinned; a handle decode no longer
    holds is dropped, as ``extend_handle`` does.
    """
    handle = state.handle
    if (
        handle is None
        or not handle.leased
        or state.policy.overdue_s(handle, now=pool.clock()) is not None
    ):
        return None
    started = time.perf_counter()
    result = await pool.leases.persist(
        pool.decode_url(handle.pair), handle, ttl_s=state.policy.tier_ttl_s
    )
    ref: TierRef | None = None
    if result.persisted is not None:
        ref = result.persisted.ref
        old = state.take_tier()
        if state.handle is handle:
            state.handle = None
        state.set_tier(ref, pair=handle.pair)
        if old is not None:
            delete_tier_soon(pool, state, old[0], pair=old[1], reason="superseded")
    elif result.outcome == GONE and state.handle is handle:
        state.drop_handle(
            HandleState.EXPIRED, f"decode no longer holds the handle ({result.detail or 'gone'})"
        )
    _log_lease_call(
        "agentkv.persist",
        state,
        handle,
        result,
        reason=reason,
        started=started,
        tier_id=None if ref is None else ref.id,
        n_tokens=None if ref is None else ref.n_tokens,
        bytes=None if result.persisted is None else result.persisted.bytes,
        ttl_s=None if result.persisted is None else result.persisted.ttl_s,
    )
    return ref


async def delete_tier(
    pool: PairPool, state: SessionState, ref: TierRef, *, pair: str, reason: str
) -> None:
    """Delete a tier entry the session no longer needs; never raises for the server's sake.

    The delete shows the entry's secret (from the persist answer). A reference loaded from a
    session saved before tier secrets has none: nothing is sent, and the entry lives until its
    TTL on decode (or the tier's budget) removes it."""
    started = time.perf_counter()
    result = await pool.leases.delete_tier(pool.decode_url(pair), ref)
    expected = result.outcome in (OK, GONE) or ref.secret is None
    log = logger.info if expected else logger.warning
    log(
        "agentkv.tier_delete",
        session_id=state.session_id,
        pair=pair,
        tier_id=ref.id,
        reason=reason,
        outcome=result.outcome,
        status=result.status,
        detail=result.detail,
        ms=_ms(started),
    )


def delete_tier_soon(
    pool: PairPool, state: SessionState, ref: TierRef, *, pair: str, reason: str
) -> asyncio.Task[None]:
    """:func:`delete_tier` in the background (after a turn, like a release); ``aclose()`` of
    the session waits for it."""
    task = asyncio.ensure_future(delete_tier(pool, state, ref, pair=pair, reason=reason))
    pool.leases.track(task)
    return task


def _log_lease_call(
    event: str,
    state: SessionState,
    handle: KVHandle,
    result: CallResult,
    *,
    reason: str,
    started: float,
    **fields: Any,
) -> None:
    """One event per lease call: info when decode answered as expected, warning otherwise."""
    log = logger.info if result.outcome in (OK, GONE) else logger.warning
    log(
        event,
        session_id=state.session_id,
        pair=handle.pair,
        request_id=handle.request_id,
        reason=reason,
        outcome=result.outcome,
        status=result.status,
        detail=result.detail,
        ms=_ms(started),
        **fields,
    )


@dataclass(kw_only=True, slots=True)
class ToolWait:
    """What ``session.tool_wait()`` did around one tool call.

    ``tier_decision`` is the policy's first answer (``decide_tier``: keep the pin, persist it
    to the file tier, or drop it); ``persisted`` says whether decode wrote it to the tier (the
    pin is then gone and nothing is extended). ``decision`` is the extend decision for a kept
    pin (extend or not, and why); ``extended`` says whether decode granted the extension. At
    the end, ``survived`` says whether the handle (or its tier entry) is still good for the
    next turn (that turn's ``TurnStats.handle_reason`` says so too).
    """

    expected_s: float
    started_at: float
    decision: ExtendDecision
    extended: bool = False
    tier_decision: TierDecision | None = None
    persisted: bool = False
    had_handle: bool = False
    ended_at: float | None = None
    survived: bool | None = None

    @property
    def waited_s(self) -> float | None:
        """How long the wait took (session clock), once it ended."""
        return None if self.ended_at is None else self.ended_at - self.started_at


async def decide_tier(
    pool: PairPool,
    state: SessionState,
    *,
    hint: PersistMode,
    expected_wait_s: float | None = None,
    idle_s: float | None = None,
    decode_kv_usage: float | None = None,
) -> TierDecision:
    """``CachePolicy.decide_tier`` for the session's handle, with what the pool knows of its
    decode: whether it has a tier (asked once per server, with the lease support) and, when the
    policy would otherwise keep the pin, how full decode's KV memory is now (its ``/metrics``)."""
    handle = state.handle
    tier = False
    decode = None
    if handle is not None and handle.leased:
        decode = pool.decode_url(handle.pair)
        tier = await pool.leases.supported(decode) is True and pool.leases.tier(decode)

    def decide(usage: float | None) -> TierDecision:
        return state.policy.decide_tier(
            handle,
            now=pool.clock(),
            expected_wait_s=expected_wait_s,
            idle_s=idle_s,
            hint=hint,
            decode_kv_usage=usage,
            tier_available=tier,
        )

    decision = decide(decode_kv_usage)
    if decision.action == "pin" and tier and hint == "auto" and decode_kv_usage is None:
        # Only memory pressure could still move it to the tier: ask decode how full it is.
        assert decode is not None
        usage = await pool.leases.kv_usage(decode)
        if usage is not None:
            decision = decide(usage)
    return decision


async def begin_wait(
    pool: PairPool, state: SessionState, *, expected_s: float, persist: PersistMode = "auto"
) -> ToolWait:
    """Start a tool wait: persist the handle to the file tier if the policy says the wait is
    worth it (``decide_tier``), else extend it if the wait would outlast it. The session is
    held meanwhile (``SessionState.holding``): no turn takes the handle a persist frees."""
    with state.holding("tool wait"):
        return await _begin_wait(pool, state, expected_s=expected_s, persist=persist)


async def _begin_wait(
    pool: PairPool, state: SessionState, *, expected_s: float, persist: PersistMode
) -> ToolWait:
    now = pool.clock()
    handle = state.handle
    tier = await decide_tier(pool, state, hint=persist, expected_wait_s=expected_s)
    persisted = False
    if tier.persist:
        persisted = await persist_handle(pool, state, reason="tool_wait") is not None
    decision = (
        ExtendDecision(extend=False, ttl_s=None, reason="persisted to the file tier")
        if persisted
        else state.policy.decide_extend(state.handle, now=now, expected_wait_s=expected_s)
    )
    extended = False
    if decision.extend and decision.ttl_s is not None:
        extended = await extend_handle(pool, state, decision.ttl_s, reason="tool_wait") is not None
    return ToolWait(
        expected_s=expected_s,
        started_at=now,
        decision=decision,
        extended=extended,
        tier_decision=tier,
        persisted=persisted,
        had_handle=handle is not None,
    )


def end_wait(pool: PairPool, state: SessionState, wait: ToolWait) -> None:
    """End a tool wait: note whether the handle survived, for the next turn's stats."""
    now = pool.clock()
    handle = state.handle
    wait.ended_at = now
    live = handle is not None and state.policy.overdue_s(handle, now=now) is None
    wait.survived = live or (
        wait.persisted and state.tier is not None
    )
    if wait.had_handle:
        how = (
            "persisted to the file tier"
            if wait.persisted
            else "extended"
            if wait.extended
            else f"not extended: {wait.decision.reason}"
        )
        kept = "kept" if wait.survived else "lost"
        state.wait_note = f"handle {kept} over a {now - wait.started_at:.1f}s tool wait ({how})"
    logger.info(
        "agentkv.tool_wait",
        session_id=state.session_id,
        expected_s=wait.expected_s,
        waited_s=round(now - wait.started_at, 3),
        extended=wait.extended,
        persisted=wait.persisted,
        survived=wait.survived,
        reason=wait.decision.reason,
    )
