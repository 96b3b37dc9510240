"""A session's reusable KV: one value, pure transitions, effects as values. No I/O.

What a session holds that its next turn may reuse is one of three things: nothing (``NoKV``,
with the reason the next turn's stats give), a **pin** on decode through a **handle**
(``Pinned``), or a **tier entry** that decode offloaded to its file tier (``OnTier``). Every
event that changes it is a function here, ``(value, inputs, policy, now) -> Step(value,
effects)``: taken for a turn (with the route), turn committed, a tool wait, saved or
snapshotted (a copy is unconfirmed), moved to another pair, closed. The effects (release a pin,
release a lost D leg's request, extend or claim a lease, offload to the tier, delete a tier
entry) are values that one executor (``leasing``) performs; what decode answered comes back
here as the input of the next transition. ``CachePolicy`` and ``RoutePolicy`` are consulted
from this module only.

The rules every transition keeps (``tests/unit/test_kv.py`` checks them on random sequences):

* a handle is single use: once a turn took it, no value holds it again;
* a handle a copy also holds (``Pinned.confirmed`` false) is attached only after decode
  confirms it with a claim, which exactly one holder wins;
* a tier entry is carried only by a prompt that starts with exactly its tokens;
* every pin is released at most once, every tier entry deleted at most once, and a closed
  session releases (or deletes) whatever it held.
"""

from __future__ import annotations

import dataclasses
import hashlib
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, TypeAlias

from agentkv import _constants as defaults
from agentkv._policy import CachePolicy, ExtendDecision, PersistMode, TierDecision
from agentkv._route import Route, RouteDecision
from agentkv._types import HandleState, KVHandle
from agentkv._wire.decode_answer import no_handle_cause
from agentkv._wire.handoff import extended_handle
from agentkv._wire.hints import ExtendResult, PersistHint
from agentkv._wire.tier import TierRef

__all__ = [
    "KV",
    "NO_KV",
    "DeleteTierEntry",
    "Effect",
    "Extend",
    "NoKV",
    "Offload",
    "OnTier",
    "Pinned",
    "Release",
    "ReleaseRequest",
    "RouteFacts",
    "Step",
    "Taken",
    "tokens_digest",
]

CONFIRM_TTL_S = defaults.CONFIRM_TTL_S


def tokens_digest(tokens: Iterable[int]) -> str:
    """A digest of exact token ids: what a tier entry holds, checked against the next prompt."""
    return hashlib.blake2b(array("q", tokens).tobytes(), digest_size=16).hexdigest()


# --- the value ------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class NoKV:
    """Nothing to reuse; ``reason`` and ``detail`` are what the next turn's stats say
    (``handle_state``, ``handle_reason``). ``note``: what the last tool wait did, told too."""

    reason: HandleState = HandleState.NONE
    detail: str = "no stored handle"
    note: str | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class Pinned:
    """Decode pins the last turn's KV; ``handle`` reaches it.

    ``confirmed`` false: a copy of the session (a save file, a snapshot) holds the handle too,
    so it is attached only once a claim (decode rotates the lease secret) says it is ours.
    """

    handle: KVHandle
    confirmed: bool = True
    note: str | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class OnTier:
    """The last turn's KV offloaded to the file tier of ``pair``'s decode (the delete goes
    there); ``digest`` is ``tokens_digest`` of the exact tokens it holds."""

    ref: TierRef
    pair: str
    digest: str
    note: str | None = None


KV: TypeAlias = NoKV | Pinned | OnTier
NO_KV = NoKV()


# --- the effects ----------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class Release:
    """Ask ``handle.pair``'s decode to free the pin; ``background``: the caller does not wait."""

    handle: KVHandle
    reason: str
    background: bool = False


@dataclass(frozen=True, kw_only=True, slots=True)
class ReleaseRequest:
    """Free whatever ``decode`` pinned for the D leg tagged with ``secret`` (its answer was lost);
    always in the background."""

    decode: str
    secret: str
    reason: str


@dataclass(frozen=True, kw_only=True, slots=True)
class Extend:
    """Ask decode to keep ``handle`` ``ttl_s`` more seconds; ``claim``: and take the lease
    exclusively; ``confirming``: a failed call means the handle cannot be trusted."""

    handle: KVHandle
    ttl_s: float
    reason: str
    claim: bool = False
    confirming: bool = False


@dataclass(frozen=True, kw_only=True, slots=True)
class Offload:
    """Ask decode to write ``handle``'s blocks to its file tier (and free the pin)."""

    handle: KVHandle
    ttl_s: float | None
    reason: str


@dataclass(frozen=True, kw_only=True, slots=True)
class DeleteTierEntry:
    """Delete the tier entry ``ref`` on ``pair``'s decode."""

    ref: TierRef
    pair: str
    reason: str
    background: bool = False


Effect: TypeAlias = Release | ReleaseRequest | Extend | Offload | DeleteTierEntry
Effects: TypeAlias = tuple[Effect, ...]


class Step(NamedTuple):
    """A transition's result: the new value and what must be done for it."""

    kv: KV
    effects: Effects = ()


# --- reading the value ----------------------------------------------------------------------------


def handle_of(kv: KV) -> KVHandle | None:
    return kv.handle if isinstance(kv, Pinned) else None


def tier_of(kv: KV) -> TierRef | None:
    return kv.ref if isinstance(kv, OnTier) else None


def leased_pin(kv: KV) -> KVHandle | None:
    """The handle of a pin decode leased to the session (one it can release, extend, offload)."""
    return kv.handle if isinstance(kv, Pinned) and kv.handle.leased else None


def tier_matches(kv: KV, prompt: Sequence[int]) -> bool:
    """Whether ``prompt`` starts with exactly the tokens ``kv``'s tier entry holds."""
    return (
        isinstance(kv, OnTier)
        and len(prompt) >= kv.ref.n_tokens
        and tokens_digest(prompt[: kv.ref.n_tokens]) == kv.digest
    )


def overdue_s(kv: KV, *, policy: CachePolicy, now: float) -> float | None:
    """Seconds the pin is past its deadline (``None``: live, or none): the agent's warning."""
    return policy.overdue_s(handle_of(kv), now=now)


def _lost(kv: KV, reason: HandleState, detail: str) -> NoKV:
    return NoKV(reason=reason, detail=detail, note=kv.note)


def _release(
    handle: KVHandle | None, *, reason: str, policy: CachePolicy, now: float, background: bool
) -> Effects:
    if handle is not None and policy.decide_release(handle, now=now):
        return (Release(handle=handle, reason=reason, background=background),)
    return ()


def release_sent(
    handle: KVHandle | None,
    *,
    reason: str,
    policy: CachePolicy,
    now: float,
    background: bool = False,
) -> Effects:
    """A handle a turn took (``Taken.sent``) that no prefill will read now: released while decode
    may still hold it (a turn failed, or the decode route read its blocks from decode's cache)."""
    return _release(handle, reason=reason, policy=policy, now=now, background=background)


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
        new = _lost(kv, HandleState.CONSUMED, "a failed turn may have read the handle")
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


def pin_hint(policy: CachePolicy, *, final: bool) -> PersistHint:
    """The D leg's ask: pin the turn's KV for the next turn, or nothing on a final turn."""
    return policy.decide_persist(final=final)


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
    hint: PersistMode,
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
        hint=hint,
        decode_kv_usage=decode_kv_usage,
        tier_available=tier_available,
    )


def wants_kv_usage(
    decision: TierDecision, *, tier_available: bool, hint: PersistMode, usage: float | None
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
