"""The executor of a session's KV effects: lease calls, tier calls, and their answers fed back.

``kv`` decides (pure transitions that return effects); this module performs the effects on the
decode servers through the pool's ``LeaseCalls`` and hands what decode answered back to ``kv``
as the next transition's input. It decides nothing itself.

A turn's KV stays pinned on its decode server for the next turn. Stock vLLM holds it for a fixed
``decoder_kv_blocks_ttl``; agentkv's vLLM extension (``agentkv.connector``) leases the pin to the
session, which then frees it as soon as it is no longer needed (**release**) or keeps it while a
tool runs (**extend**). With a file tier on decode, a pin can also be **offloaded**: decode
writes the KV to files on the host and frees its memory, and the next turn's prefill loads it
from there.

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

import structlog

from agentkv._client import kv
from agentkv._client.pool import PairPool
from agentkv._client.state import SessionState
from agentkv._policy import ExtendDecision, PersistMode, TierDecision
from agentkv._wire.hints import request_tag
from agentkv._wire.lease_calls import GONE, OK, CallResult
from agentkv._wire.tier import TierRef

__all__ = [
    "ToolWait",
    "begin_wait",
    "close",
    "confirm",
    "decode_kv_usage",
    "end_wait",
    "extend",
    "offload",
    "release_request",
    "run",
    "unpin",
]

logger = structlog.get_logger("agentkv")


def _ms(since: float) -> float:
    return round((time.perf_counter() - since) * 1000.0, 3)


# --- performing effects --------------------------------------------------------------------------


async def run(pool: PairPool, state: SessionState, effects: kv.Effects) -> None:
    """Perform ``effects`` in order: background ones started (``aclose()`` of the session waits
    for them), the others awaited; the answers to extends and offloads go back into the KV."""
    for effect in effects:
        if isinstance(effect, kv.Extend):
            await _extend(pool, state, effect)
        elif isinstance(effect, kv.Offload):
            await _offload(pool, state, effect)
        elif isinstance(effect, kv.ReleaseRequest) or effect.background:
            start(pool, state, (effect,))
        else:
            await _perform(pool, state, effect)


def start(pool: PairPool, state: SessionState, effects: kv.Effects) -> None:
    """Perform ``effects`` in the background (a turn ending by cancellation or a closed stream
    cannot wait): only releases and deletes, whose answers change nothing."""
    for effect in effects:
        assert isinstance(effect, kv.Release | kv.ReleaseRequest | kv.DeleteTierEntry)
        pool.leases.track(asyncio.ensure_future(_background(pool, state, effect)))


async def _background(
    pool: PairPool, state: SessionState, effect: kv.Release | kv.ReleaseRequest | kv.DeleteTierEntry
) -> None:
    await _perform(pool, state, effect)


async def _perform(
    pool: PairPool, state: SessionState, effect: kv.Release | kv.ReleaseRequest | kv.DeleteTierEntry
) -> CallResult:
    started = time.perf_counter()
    if isinstance(effect, kv.Release):
        handle = effect.handle
        result = await pool.leases.release(pool.decode_url(handle.pair), handle)
        _log_call(
            "agentkv.release",
            state,
            handle.pair,
            result,
            reason=effect.reason,
            started=started,
            request_id=handle.request_id,
        )
    elif isinstance(effect, kv.ReleaseRequest):
        result = await pool.leases.release_request(effect.decode, effect.secret)
        _log_call(
            "agentkv.release_lost",
            state,
            None,
            result,
            reason=effect.reason,
            started=started,
            decode=effect.decode,
            request_tag=request_tag(effect.secret),
        )
    else:
        ref = effect.ref
        result = await pool.leases.delete_tier(pool.decode_url(effect.pair), ref)
        # A reference saved before tier secrets cannot delete: its entry lives out its TTL.
        _log_call(
            "agentkv.tier_delete",
            state,
            effect.pair,
            result,
            reason=effect.reason,
            started=started,
            expected=ref.secret is None,
            tier_id=ref.id,
        )
    return result


async def _extend(pool: PairPool, state: SessionState, effect: kv.Extend) -> float | None:
    handle = effect.handle
    sent_at = pool.clock()
    started = time.perf_counter()
    result = await pool.leases.extend(
        pool.decode_url(handle.pair), handle, ttl_s=effect.ttl_s, claim=effect.claim
    )
    step, deadline = kv.extended(
        state.kv,
        effect,
        result=result.extended,
        gone=result.outcome == GONE,
        detail=result.detail,
        sent_at=sent_at,
        policy=state.policy,
    )
    state.apply(step)
    _log_call(
        "agentkv.claim" if effect.claim else "agentkv.extend",
        state,
        handle.pair,
        result,
        reason=effect.reason,
        started=started,
        request_id=handle.request_id,
        ttl_s=effect.ttl_s,
        granted_s=None if result.extended is None else round(result.extended.ttl_s, 3),
        deadline_in_s=None if deadline is None else round(deadline - sent_at, 3),
    )
    return deadline


async def _offload(pool: PairPool, state: SessionState, effect: kv.Offload) -> TierRef | None:
    handle = effect.handle
    started = time.perf_counter()
    result = await pool.leases.persist(pool.decode_url(handle.pair), handle, ttl_s=effect.ttl_s)
    persisted = result.persisted
    ref = None if persisted is None else persisted.ref
    step = kv.offloaded(
        state.kv,
        effect,
        ref=ref,
        gone=result.outcome == GONE,
        detail=result.detail,
        tokens=state.transcript.token_ids,
    )
    await run(pool, state, state.apply(step))
    _log_call(
        "agentkv.persist",
        state,
        handle.pair,
        result,
        reason=effect.reason,
        started=started,
        request_id=handle.request_id,
        tier_id=None if ref is None else ref.id,
        n_tokens=None if ref is None else ref.n_tokens,
        bytes=None if persisted is None else persisted.bytes,
        ttl_s=None if persisted is None else persisted.ttl_s,
    )
    return ref


def _log_call(
    event: str,
    state: SessionState,
    pair: str | None,
    result: CallResult,
    *,
    reason: str,
    started: float,
    expected: bool = False,
    **fields: Any,
) -> None:
    """One event per call: info when decode answered as expected, warning otherwise."""
    log = logger.info if expected or result.outcome in (OK, GONE) else logger.warning
    where = {} if pair is None else {"pair": pair}
    log(
        event,
        session_id=state.session_id,
        **where,
        reason=reason,
        outcome=result.outcome,
        status=result.status,
        detail=result.detail,
        ms=_ms(started),
        **fields,
    )


# --- a session's calls ---------------------------------------------------------------------------


async def confirm(
    pool: PairPool, state: SessionState, supported: bool | None, prompt_len: int
) -> None:
    """Claim an unconfirmed handle before a turn takes it (``kv.confirm``)."""
    step = kv.confirm(
        state.kv, prompt_len=prompt_len, supported=supported, policy=state.policy, now=pool.clock()
    )
    await run(pool, state, state.apply(step))


async def extend(pool: PairPool, state: SessionState, ttl_s: float, *, reason: str) -> float | None:
    """Ask decode to keep the session's pin ``ttl_s`` more seconds; the new deadline or ``None``
    (no handle, no lease, or decode no longer holds it: then it is dropped)."""
    for effect in kv.extend_effects(state.kv, ttl_s=ttl_s, reason=reason):
        assert isinstance(effect, kv.Extend)
        return await _extend(pool, state, effect)
    return None


async def offload(pool: PairPool, state: SessionState, *, reason: str) -> TierRef | None:
    """Offload the session's pin to its decode's file tier; the reference or ``None``.

    On success decode has freed the pin: the session holds the tier entry instead. On any
    failure (no tier, a failed write, a lost answer) the pin stays as it was; a handle decode no
    longer holds is dropped.
    """
    effects = kv.offload_effects(state.kv, reason=reason, policy=state.policy, now=pool.clock())
    for effect in effects:
        assert isinstance(effect, kv.Offload)
        return await _offload(pool, state, effect)
    return None


async def unpin(pool: PairPool, state: SessionState) -> bool:
    """Release the session's pin now (``AsyncSession.unpin`` where decode has no tier); whether
    decode freed it (or no longer held it). The next turn recomputes."""
    for effect in kv.unpin_effects(state.kv):
        assert isinstance(effect, kv.Release)
        result = await _perform(pool, state, effect)
        freed = result.outcome in (OK, GONE)
        state.apply(kv.unpinned(state.kv, effect, freed=freed))
        return freed
    return False


async def close(pool: PairPool, state: SessionState) -> None:
    """The session closed: release its pin, delete its tier entry (``kv.closed``)."""
    step = kv.closed(state.kv, policy=state.policy, now=pool.clock(), reachable=not pool.closed)
    await run(pool, state, state.apply(step))


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


# --- tool waits ----------------------------------------------------------------------------------


@dataclass(kw_only=True, slots=True)
class ToolWait:
    """What ``session.tool_wait()`` did around one tool call.

    ``tier_decision`` is the policy's first answer (``decide_tier``: keep the pin, offload it
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
) -> TierDecision:
    """``kv.wait_tier`` with what the pool knows of the pin's decode: whether it has a tier
    (asked once per server, with the lease support) and, when the policy would otherwise keep
    the pin, how full decode's KV memory is now (its ``/metrics``)."""
    handle = state.handle
    available = False
    decode = None
    if handle is not None and handle.leased:
        decode = pool.decode_url(handle.pair)
        available = await pool.leases.supported(decode) is True and pool.leases.tier(decode)

    def decide(usage: float | None) -> TierDecision:
        return kv.wait_tier(
            state.kv,
            hint=hint,
            expected_wait_s=expected_wait_s,
            idle_s=idle_s,
            decode_kv_usage=usage,
            tier_available=available,
            policy=state.policy,
            now=pool.clock(),
        )

    decision = decide(None)
    if kv.wants_kv_usage(decision, tier_available=available, hint=hint, usage=None):
        assert decode is not None
        usage = await pool.leases.kv_usage(decode)
        if usage is not None:
            decision = decide(usage)
    return decision


async def begin_wait(
    pool: PairPool, state: SessionState, *, expected_s: float, offload_mode: PersistMode = "auto"
) -> ToolWait:
    """Start a tool wait: offload the pin to the file tier if the policy says the wait is worth
    it, else extend it if the wait would outlast it. The session is held meanwhile
    (``SessionState.holding``): no turn takes the handle an offload frees."""
    with state.holding("tool wait"):
        now = pool.clock()
        had_handle = state.handle is not None
        tier = await decide_tier(pool, state, hint=offload_mode, expected_wait_s=expected_s)
        persisted = tier.persist and await offload(pool, state, reason="tool_wait") is not None
        decision = kv.wait_extend(
            state.kv, expected_s=expected_s, offloaded=persisted, policy=state.policy, now=now
        )
        extended = False
        if decision.extend and decision.ttl_s is not None:
            extended = await extend(pool, state, decision.ttl_s, reason="tool_wait") is not None
        return ToolWait(
            expected_s=expected_s,
            started_at=now,
            decision=decision,
            extended=extended,
            tier_decision=tier,
            persisted=persisted,
            had_handle=had_handle,
        )


def end_wait(pool: PairPool, state: SessionState, wait: ToolWait) -> None:
    """End a tool wait: note whether the handle survived, for the next turn's stats."""
    now = pool.clock()
    wait.ended_at = now
    step, wait.survived = kv.wait_ended(
        state.kv,
        had_handle=wait.had_handle,
        offloaded=wait.persisted,
        extended=wait.extended,
        extend_reason=wait.decision.reason,
        started_at=wait.started_at,
        policy=state.policy,
        now=now,
    )
    state.apply(step)
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
