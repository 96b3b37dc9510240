"""A turn's transitions: confirm, take (with the route), commit (see ``agentkv._client.kv``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from agentkv._client.kv._between import offload_effects
from agentkv._client.kv._value import (
    CONFIRM_TTL_S,
    KV,
    DeleteTierEntry,
    Effect,
    Effects,
    Extend,
    NoKV,
    OnTier,
    Pinned,
    Release,
    Step,
    _lost,
    _release,
    handle_of,
    tier_matches,
)
from agentkv._policy import CachePolicy
from agentkv._route import Route, RouteDecision
from agentkv._types import HandleState, KVHandle
from agentkv._wire.decode_answer import no_handle_cause
from agentkv._wire.hints import PinHint
from agentkv._wire.tier import TierRef

# --- a turn ---------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class RouteFacts:
    """What the pool knows of the turn's decode when the route is chosen."""

    route: Route
    decode_queued: int
    decode_running: int
    block_size: int | None
    local_ok: bool


@dataclass(frozen=True, kw_only=True, slots=True)
class Taken:
    """What a turn does with the session's KV, and the way its prompt goes.

    ``sent``: the handle the turn reuses (the P leg carries it on the ``pull`` route; decode's
    cache holds its blocks on the ``decode`` route); ``state``/``reason``: what the stats say;
    ``extends``: how often the handle was extended; ``tier``: the tier reference the P leg sends
    instead of a handle; ``route``: ``RoutePolicy.decide``'s answer.
    """

    sent: KVHandle | None
    state: HandleState
    reason: str
    extends: int
    tier: TierRef | None
    route: RouteDecision


_CONSUMED = NoKV(reason=HandleState.CONSUMED, detail="a failed turn may have read the handle")


def confirm(
    kv: KV, *, prompt_len: int, supported: bool | None, policy: CachePolicy, now: float
) -> Step:
    """Before a turn takes an unconfirmed handle (from a save file, or one a copy holds): claim it
    from decode (``Extend(claim=True)``), or, on stock vLLM, which cannot confirm it, drop it.

    The file may outlive the pin, and decode may have handed the blocks to other requests; a
    pull is positional and checks nothing. Of concurrent claims exactly one succeeds.
    """
    if not isinstance(kv, Pinned) or kv.confirmed:
        return Step(kv)
    handle = kv.handle
    if not policy.decide_attach(handle, prompt_len=prompt_len, now=now).attach:
        return Step(kv)  # not attached anyway (expired, diverged, ...): the turn says why
    if supported is not True or not handle.leased:
        return Step(
            _lost(
                kv,
                HandleState.INVALIDATED,
                "a handle from a save file is never attached on stock vLLM: decode cannot "
                "confirm it still holds the blocks",
            )
        )
    return Step(
        kv,
        (
            Extend(
                handle=handle,
                ttl_s=CONFIRM_TTL_S,
                reason="confirm_loaded",
                claim=True,
                confirming=True,
            ),
        ),
    )


def take(
    kv: KV, *, prompt: Sequence[int], facts: RouteFacts, policy: CachePolicy, now: float
) -> tuple[Step, Taken]:
    """Take the session's KV for a turn of ``prompt`` and choose its route.

    A handle is single use: once taken, the value no longer holds it (a prefill may read it
    whatever happens next); one not attached is released. A tier entry stays until the turn
    commits: a prefill only reads it, so a retry may send it again.
    """
    handle = handle_of(kv)
    prompt_len = len(prompt)
    decision = policy.decide_attach(handle, prompt_len=prompt_len, now=now)
    state, reason = decision.state, decision.reason
    unsent: KVHandle | None = None
    tier: TierRef | None = None
    new: KV = kv
    if isinstance(kv, OnTier):
        tier_decision = policy.decide_tier_attach(
            kv.ref, prompt_len=prompt_len, prefix_matches=tier_matches(kv, prompt)
        )
        state, reason = tier_decision.state, tier_decision.reason
        tier = kv.ref if tier_decision.attach else None
    elif isinstance(kv, NoKV):
        state, reason = kv.reason, kv.detail
    elif decision.attach:
        new = _CONSUMED if kv.note is None else _lost(kv, _CONSUMED.reason, _CONSUMED.detail)
    else:
        new = _lost(kv, decision.state, decision.reason)
        if policy.decide_release(handle, now=now):
            unsent = handle
    sent = handle if decision.attach else None
    held = sent.num_tokens if sent is not None else 0
    routed = policy.route.decide(
        facts.route,
        new_tokens=prompt_len - held,
        held_tokens=held,
        decode_queued=facts.decode_queued,
        attach=sent is not None,
        tier=tier is not None,
        block_size=facts.block_size,
        decode_running=facts.decode_running,
        local_ok=facts.local_ok,
    )
    if routed.route == "recompute" and sent is not None:
        state, reason = HandleState.UNUSED, "the route is recompute"
        unsent, sent = sent, None
    if routed.route != "pull":
        tier = None  # stays on the session: no prefill runs (decode), or none is to load it
    if kv.note:
        reason = f"{reason}; {kv.note}" if reason else kv.note
    if new.note is not None:
        new = dataclasses.replace(new, note=None)
    effects: Effects = ()
    if unsent is not None:
        effects = (Release(handle=unsent, reason=state.value),)
    taken = Taken(
        sent=sent,
        state=state,
        reason=reason,
        extends=handle.extends if handle is not None else 0,
        tier=tier,
        route=routed,
    )
    return Step(new, effects), taken


def pin_hint(policy: CachePolicy, *, final: bool) -> PinHint:
    """The D leg's ask: pin the turn's KV for the next turn, or nothing on a final turn."""
    return policy.decide_pin(final=final)


def lease_deadline(policy: CachePolicy, *, sent_at: float, ttl_s: float) -> float:
    """Our deadline for a pin decode leased ``ttl_s`` seconds to a request sent at ``sent_at``."""
    return policy.lease_deadline(sent_at=sent_at, ttl_s=ttl_s)


def handle_deadline(policy: CachePolicy, issued_at: float) -> float:
    """Our deadline for a stock decode's pin of a D leg sent at ``issued_at``."""
    return policy.deadline(issued_at)


def committed(
    kv: KV,
    *,
    handle: KVHandle | None,
    final: bool,
    finish_reason: str | None,
    stop_reason: object,
    closed: bool,
    offload: bool,
    policy: CachePolicy,
    now: float,
) -> Step:
    """A turn committed and decode pinned its KV as ``handle`` (or nothing).

    The turn's own KV supersedes a tier entry (deleted, in the background). A session closed
    while the turn ran releases the new pin at once; ``offload``: the caller asked for the tier
    right after the turn (the pin stays if the write fails).
    """
    if handle is not None and not (closed or offload or isinstance(kv, OnTier)):
        return Step(Pinned(handle=handle))  # the common case, first: a turn's CPU counts
    effects: list[Effect] = []
    if isinstance(kv, OnTier):
        effects.append(DeleteTierEntry(ref=kv.ref, pair=kv.pair, reason="used", background=True))
    new: KV
    if handle is None:
        if final:
            detail = "the previous turn was final: decode pinned nothing"
        else:
            cause = no_handle_cause(finish_reason, stop_reason)
            detail = (
                f"the previous turn ended on a {cause.replace('_', ' ')}: vLLM kept no KV for it"
                if cause is not None
                else "decode returned no handle"
            )
        new = NoKV(reason=HandleState.NONE, detail=detail)
    elif closed:
        # Nobody will send the new handle.
        new = NoKV(reason=HandleState.NONE, detail="the session was closed")
        effects.extend(
            _release(handle, reason="closed_during_turn", policy=policy, now=now, background=False)
        )
    else:
        new = Pinned(handle=handle)
        if offload:
            effects.extend(offload_effects(new, reason="turn", policy=policy, now=now))
    return Step(new, tuple(effects))
