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
from collections.abc import Sequence
from typing import Any

from agentkv._client import kv
from agentkv._client.pool import PairPool
from agentkv._client.state import SessionState
from agentkv._log import get_logger
from agentkv._wire.hints import request_tag
from agentkv._wire.lease_calls import GONE, OK, CallResult
from agentkv._wire.tier import TierRef

__all__ = [
    "close",
    "decode_kv_usage",
    "extend",
    "log_call",
    "offload",
    "release_request",
    "run",
    "settle",
    "take",
    "unpin",
]

logger = get_logger("agentkv")


def _ms(since: float) -> float:
    return round((time.perf_counter() - since) * 1000.0, 3)


# --- performing effects --------------------------------------------------------------------------


async def run(pool: PairPool, state: SessionState, effects: kv.Effects) -> None:
    """Perform ``effects`` in order: background ones started (``aclose()`` of the session waits
    for them), the others awaited; the answers to extends and offloads go back into the KV."""
    if effects:
        await settle(pool, state)
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
        log_call(
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
        log_call(
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
        log_call(
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
    log_call(
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
    await settle(pool, state)
    handle = effect.handle
    started = time.perf_counter()
    result = await pool.leases.offload(pool.decode_url(handle.pair), handle, ttl_s=effect.ttl_s)
    offloaded = result.offloaded
    ref = None if offloaded is None else offloaded.ref
    step = kv.offloaded(
        state.kv,
        effect,
        ref=ref,
        gone=result.outcome == GONE,
        detail=result.detail,
        tokens=state.transcript.token_ids,
    )
    await run(pool, state, state.apply(step))
    log_call(
        "agentkv.offload",
        state,
        handle.pair,
        result,
        reason=effect.reason,
        started=started,
        request_id=handle.request_id,
        tier_id=None if ref is None else ref.id,
        n_tokens=None if ref is None else ref.n_tokens,
        bytes=None if offloaded is None else offloaded.bytes,
        ttl_s=None if offloaded is None else offloaded.ttl_s,
    )
    return ref


def log_call(
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


async def settle(pool: PairPool, state: SessionState) -> None:
    """Finish what forks do with this session's KV (``forking``): the copies of its pin for its
    forks are written before anything here consumes the pin; its own copy of its parent's pin,
    once written, becomes its value (``kv.inherit``)."""
    while pending := [job for job in state.forks if not job.finished]:
        await asyncio.wait([job.start() for job in pending])
    state.forks.clear()  # all finished
    job = state.inherit
    if job is None:
        return
    if state.closed and job.drop():  # closed before it started: nothing is written
        state.inherit = None
        return
    copy = job.start()
    await asyncio.wait((copy,))  # never raises; a copy cancelled with the cluster gives nothing
    if state.inherit is not job:
        return
    state.inherit = None
    value: kv.KV = kv.NoKV(detail="a fork without its parent's KV: the copy was cancelled")
    if not copy.cancelled() and copy.exception() is None:
        value = copy.result()
    for effect in state.apply(kv.inherit(state.kv, value)):
        start(pool, state, (effect,))


async def take(
    pool: PairPool,
    state: SessionState,
    prompt: Sequence[int],
    facts: kv.RouteFacts,
    *,
    supported: bool | None,
) -> kv.Taken:
    """Take the session's KV for a turn of ``prompt`` (``kv.take``), a handle a copy also holds
    claimed first (``kv.confirm``); a handle not attached is released."""
    await settle(pool, state)
    policy = state.policy
    if kv.unconfirmed(state.kv):
        step = kv.confirm(
            state.kv, prompt_len=len(prompt), supported=supported, policy=policy, now=pool.clock()
        )
        if effects := state.apply(step):
            await run(pool, state, effects)
    step, taken = kv.take(state.kv, prompt=prompt, facts=facts, policy=policy, now=pool.clock())
    if effects := state.apply(step):
        await run(pool, state, effects)
    return taken


async def extend(pool: PairPool, state: SessionState, ttl_s: float, *, reason: str) -> float | None:
    """Ask decode to keep the session's pin ``ttl_s`` more seconds; the new deadline or ``None``
    (no handle, no lease, or decode no longer holds it: then it is dropped)."""
    await settle(pool, state)
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
    await settle(pool, state)
    for effect in kv.unpin_effects(state.kv):
        assert isinstance(effect, kv.Release)
        result = await _perform(pool, state, effect)
        freed = result.outcome in (OK, GONE)
        state.apply(kv.unpinned(state.kv, effect, freed=freed))
        return freed
    return False


async def close(pool: PairPool, state: SessionState) -> None:
    """The session closed: release its pin, delete its tier entry (``kv.closed``)."""
    await settle(pool, state)
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
