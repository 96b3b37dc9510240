"""The transitions between turns: offload, extend, unpin, a tool wait, the session's life
(see ``agentkv._client.kv``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from agentkv._client.kv._value import (
    KV,
    DeleteTierEntry,
    Effects,
    Extend,
    NoKV,
    Offload,
    OnTier,
    Pinned,
    Release,
    Step,
    _lost,
    _release,
    handle_of,
    tokens_digest,
)
from agentkv._client.offload import OffloadMode, policy_hint
from agentkv._policy import CachePolicy, ExtendDecision, TierDecision
from agentkv._types import HandleState
from agentkv._wire.handoff import extended_handle
from agentkv._wire.hints import ExtendResult
from agentkv._wire.tier import TierRef

# --- between turns --------------------------------------------------------------------------------


def offload_effects(kv: KV, *, reason: str, policy: CachePolicy, now: float) -> Effects:
    """Offload the pin to decode's file tier, if it is a live leased one."""
    handle = handle_of(kv)
    if handle is None or not handle.leased or policy.overdue_s(handle, now=now) is not None:
        return ()
    return (Offload(handle=handle, ttl_s=policy.tier_ttl_s, reason=reason),)


def offloaded(
    kv: KV,
    effect: Offload,
    *,
    ref: TierRef | None,
    gone: bool,
    detail: str,
    tokens: Sequence[int],
) -> Step:
    """What decode answered to ``effect``: written as ``ref`` (the pin freed), gone, or failed.

    ``tokens``: the transcript's token ids, whose prefix the entry holds.
    """
    handle = effect.handle
    ours = isinstance(kv, Pinned) and kv.handle is handle
    if ref is not None:
        if not ours and not isinstance(kv, NoKV):
            # The value moved on meanwhile (a session held prevents it): the entry is nobody's.
            return Step(kv, (DeleteTierEntry(ref=ref, pair=handle.pair, reason="superseded"),))
        digest = tokens_digest(tokens[: ref.n_tokens])
        return Step(OnTier(ref=ref, pair=handle.pair, digest=digest, note=kv.note))
    if gone and ours:
        return Step(
            _lost(
                kv, HandleState.EXPIRED, f"decode no longer holds the handle ({detail or 'gone'})"
            )
        )
    return Step(kv)


def extend_effects(kv: KV, *, ttl_s: float, reason: str) -> Effects:
    """Extend the pin's lease by ``ttl_s``; a handle a copy also holds is claimed by whichever
    call reaches decode first (a plain extend would leave it unclaimed under a new identity)."""
    if not isinstance(kv, Pinned) or not kv.handle.leased:
        return ()
    return (Extend(handle=kv.handle, ttl_s=ttl_s, reason=reason, claim=not kv.confirmed),)


def extended(
    kv: KV,
    effect: Extend,
    *,
    result: ExtendResult | None,
    gone: bool,
    detail: str,
    sent_at: float,
    policy: CachePolicy,
) -> tuple[Step, float | None]:
    """What decode answered to ``effect``; the handle's new deadline (``None``: not extended)."""
    handle = effect.handle
    ours = isinstance(kv, Pinned) and kv.handle is handle
    if result is not None:
        granted = policy.lease_deadline(sent_at=sent_at, ttl_s=result.ttl_s)
        # Decode never shortens a lease; our two estimates of it are both safe, keep the later.
        deadline = max(granted, handle.deadline)
        if not ours:  # a turn took it meanwhile
            return Step(kv), deadline
        assert isinstance(kv, Pinned)
        renewed = extended_handle(handle, result, deadline=deadline)
        return Step(Pinned(handle=renewed, confirmed=kv.confirmed or effect.claim, note=kv.note)), (
            deadline
        )
    if not ours:
        return Step(kv), None
    if gone:
        # On a claim, decode cannot tell "not yours" from "gone", by design: either way, not
        # attached. The reason names both, for a user who loaded one file twice.
        held = " (or another copy of this session claimed it first)" if effect.claim else ""
        return Step(
            _lost(
                kv,
                HandleState.EXPIRED,
                f"decode no longer holds the handle{held} ({detail or 'gone'})",
            )
        ), None
    if effect.confirming:
        return Step(
            _lost(
                kv,
                HandleState.INVALIDATED,
                "decode could not confirm the handle (it is also in a save file)",
            )
        ), None
    return Step(kv), None


def unpin_effects(kv: KV) -> Effects:
    """Release the pin now (decode's memory is needed and it has no tier)."""
    if not isinstance(kv, Pinned) or not kv.handle.leased:
        return ()
    return (Release(handle=kv.handle, reason="unpin"),)


def unpinned(kv: KV, effect: Release, *, freed: bool) -> Step:
    """Decode freed (or no longer held) the pin ``effect`` released: the next turn recomputes."""
    if freed and isinstance(kv, Pinned) and kv.handle is effect.handle:
        return Step(
            _lost(kv, HandleState.NONE, "released while idle: decode's memory was needed (unpin)")
        )
    return Step(kv)


# --- a tool wait ----------------------------------------------------------------------------------


def wait_tier(
    kv: KV,
    *,
    hint: OffloadMode,
    expected_wait_s: float | None,
    idle_s: float | None,
    decode_kv_usage: float | None,
    tier_available: bool,
    policy: CachePolicy,
    now: float,
) -> TierDecision:
    """``CachePolicy.decide_tier`` for the pin: keep it, offload it, or drop it."""
    return policy.decide_tier(
        handle_of(kv),
        now=now,
        expected_wait_s=expected_wait_s,
        idle_s=idle_s,
        hint=policy_hint(hint),
        decode_kv_usage=decode_kv_usage,
        tier_available=tier_available,
    )


def wants_kv_usage(
    decision: TierDecision, *, tier_available: bool, hint: OffloadMode, usage: float | None
) -> bool:
    """Only decode's memory pressure could still move a kept pin to the tier: ask how full."""
    return decision.action == "pin" and tier_available and hint == "auto" and usage is None


def wait_extend(
    kv: KV, *, expected_s: float, offloaded: bool, policy: CachePolicy, now: float
) -> ExtendDecision:
    """Extend a kept pin if the wait would outlast it (``decide_extend``)."""
    if offloaded:
        return ExtendDecision(extend=False, ttl_s=None, reason="persisted to the file tier")
    return policy.decide_extend(handle_of(kv), now=now, expected_wait_s=expected_s)


def wait_ended(
    kv: KV,
    *,
    had_handle: bool,
    offloaded: bool,
    extended: bool,
    extend_reason: str,
    started_at: float,
    policy: CachePolicy,
    now: float,
) -> tuple[Step, bool]:
    """A tool wait ended: whether the KV survived it, noted for the next turn's reason."""
    live = isinstance(kv, Pinned) and policy.overdue_s(kv.handle, now=now) is None
    survived = live or (offloaded and isinstance(kv, OnTier))
    if not had_handle:
        return Step(kv), survived
    how = (
        "persisted to the file tier"
        if offloaded
        else "extended"
        if extended
        else f"not extended: {extend_reason}"
    )
    kept = "kept" if survived else "lost"
    note = f"handle {kept} over a {now - started_at:.1f}s tool wait ({how})"
    return Step(dataclasses.replace(kv, note=note)), survived


# --- the session's life ---------------------------------------------------------------------------


def moved(kv: KV, *, pair: str, policy: CachePolicy, now: float) -> Step:
    """The session moved to ``pair``: a handle into the old decode is never sent again
    (released there while it may still hold it); another host's tier cannot be read here."""
    detail = f"the session moved to pair {pair}"
    if isinstance(kv, Pinned):
        release = _release(kv.handle, reason="moved", policy=policy, now=now, background=False)
        return Step(_lost(kv, HandleState.INVALIDATED, detail), release)
    if isinstance(kv, OnTier) and kv.pair != pair:
        delete = DeleteTierEntry(ref=kv.ref, pair=kv.pair, reason="moved", background=True)
        return Step(_lost(kv, HandleState.INVALIDATED, detail), (delete,))
    return Step(kv)


def pair_failed(kv: KV, *, detail: str, reason: str, policy: CachePolicy, now: float) -> Step:
    """The pair stopped answering: a server that may come back restarted, its block ids reused,
    is never sent a handle again (released, unsent, while decode may still hold it)."""
    if not isinstance(kv, Pinned):
        return Step(kv)
    release = _release(kv.handle, reason=reason, policy=policy, now=now, background=False)
    return Step(_lost(kv, HandleState.INVALIDATED, detail), release)


def handed_out(kv: KV) -> Step:
    """A copy of the session (a save file, a snapshot) now holds the handle too: claimed from
    decode before this session attaches it (one claim call, after a copy only)."""
    if isinstance(kv, Pinned) and kv.handle.leased:
        return Step(dataclasses.replace(kv, confirmed=False))
    return Step(kv)


def restored(kv: KV, *, pair: str, confirmed: bool, drop: str | None) -> Step:
    """How far a restored session's handle is trusted: as it is (``confirmed``), claimed from
    decode first (the default), or not at all (``drop``, the reason: another copy may be using
    it right now, and a pull checks no lease)."""
    if not isinstance(kv, Pinned):
        return Step(kv)
    if kv.handle.pair != pair:
        return Step(_lost(kv, HandleState.INVALIDATED, "the saved handle belongs to another pair"))
    if drop is not None:
        return Step(_lost(kv, HandleState.CONSUMED, drop))
    return Step(dataclasses.replace(kv, confirmed=confirmed))


def closed(kv: KV, *, policy: CachePolicy, now: float, reachable: bool = True) -> Step:
    """The session closed: its pin released (while decode may hold it) and its tier entry
    deleted; nothing is sent where the cluster itself is closed (``reachable`` false)."""
    effects: Effects = ()
    if reachable and isinstance(kv, Pinned):
        effects = _release(kv.handle, reason="close", policy=policy, now=now, background=False)
    elif reachable and isinstance(kv, OnTier):
        effects = (DeleteTierEntry(ref=kv.ref, pair=kv.pair, reason="close"),)
    return Step(NoKV(reason=HandleState.NONE, detail="the session was closed"), effects)


def detached(kv: KV) -> Step:
    """This copy closed without releasing anything: another holder lives on with the KV."""
    del kv
    return Step(NoKV(reason=HandleState.NONE, detail="the session was closed"))
