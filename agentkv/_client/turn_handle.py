"""A turn's stored handle: taken off the session (single use), confirmed, released, re-dated.

The decisions are ``CachePolicy``'s; these functions apply them to a session's state, and call
the pool for the lease calls they need. ``TurnRunner`` (``turn.py``) calls them around its legs.
"""

from __future__ import annotations

from dataclasses import dataclass

from agentkv import _constants as defaults
from agentkv._client.leasing import extend_handle, release_handle
from agentkv._client.pool import PairPool
from agentkv._client.state import SessionState
from agentkv._prompt.transcript import TurnPrompt
from agentkv._route import Route, RouteDecision
from agentkv._types import HandleState, KVHandle, Pair
from agentkv._wire.tier import TierRef

__all__ = ["TakenHandle", "confirm_loaded", "release_unsent", "take_handle"]

_CONFIRM_TTL_S = defaults.CONFIRM_TTL_S


@dataclass(frozen=True, kw_only=True, slots=True)
class TakenHandle:
    """What a turn does with the session's stored handle, and the way its prompt goes.

    ``sent``: the handle the turn reuses (or ``None``): the P leg carries it on the ``pull``
    route, decode's cache holds its blocks on the ``decode`` route; ``state`` and ``reason``:
    what the stats say; ``extends``: how often it was extended; ``unsent``: a handle dropped
    unsent, to release; ``tier``: the file-tier reference the P leg sends instead of a handle;
    ``route``: the route's decision (``RoutePolicy.decide``).
    """

    sent: KVHandle | None
    state: HandleState
    reason: str
    extends: int
    unsent: KVHandle | None
    tier: TierRef | None
    route: RouteDecision


def take_handle(
    pool: PairPool,
    state: SessionState,
    prompt: TurnPrompt,
    *,
    pair: Pair,
    route: Route,
    agentkv_decode: bool,
) -> TakenHandle:
    """Take the stored handle off the session for a turn of ``prompt``, and choose its route
    (``route`` as asked: ``"auto"`` lets the policy choose; ``agentkv_decode``: decode runs
    agentkv's connector, without which no turn is computed there).

    The tier reference (a persisted turn whose tokens the prompt starts with) stays on the
    session until the turn commits: a prefill only reads the tier, so a retry may send it again.
    """
    handle = state.handle
    now = pool.clock()
    prompt_len = len(prompt)
    decision = state.policy.decide_attach(handle, prompt_len=prompt_len, now=now)
    handle_state, reason = decision.state, decision.reason
    unsent: KVHandle | None = None
    tier: TierRef | None = None
    if handle is None and state.tier is not None:
        tier_decision = state.policy.decide_tier_attach(
            state.tier,
            prompt_len=prompt_len,
            prefix_matches=state.tier_matches(prompt.token_ids),
        )
        handle_state, reason = tier_decision.state, tier_decision.reason
        tier = state.tier if tier_decision.attach else None
    elif handle is None and state.lost is not None:
        handle_state, reason = state.lost
    elif decision.attach:
        # Single use: once a prefill may have read it, it is gone whatever happens next.
        state.drop_handle(HandleState.CONSUMED, "a failed turn may have read the handle")
    else:
        state.drop_handle(decision.state, decision.reason)
        if state.policy.decide_release(handle, now=now):
            unsent = handle
    sent = handle if decision.attach else None
    held = sent.num_tokens if sent is not None else 0
    routed = state.policy.route.decide(
        route,
        new_tokens=prompt_len - held,
        held_tokens=held,
        decode_queued=pool.decode_queued(pair),
        attach=sent is not None,
        tier=tier is not None,
        block_size=pool.block_size,
        decode_running=pool.decode_running(pair),
        local_ok=agentkv_decode,
    )
    if routed.route == "recompute" and sent is not None:
        handle_state, reason = HandleState.UNUSED, "the route is recompute"
        unsent, sent = sent, None
    if routed.route != "pull":
        tier = None  # stays on the session: no prefill runs (decode), or none is to load it
    note, state.wait_note = state.wait_note, None
    if note:
        reason = f"{reason}; {note}" if reason else note
    return TakenHandle(
        sent=sent,
        state=handle_state,
        reason=reason,
        extends=handle.extends if handle is not None else 0,
        unsent=unsent,
        tier=tier,
        route=routed,
    )


async def release_unsent(
    pool: PairPool, state: SessionState, handle: KVHandle | None, *, reason: str
) -> None:
    """Release a handle no prefill read, if decode may still hold it."""
    if handle is not None and state.policy.decide_release(handle, now=pool.clock()):
        await release_handle(pool, state, handle, reason=reason)


async def confirm_loaded(
    pool: PairPool, state: SessionState, supported: bool | None, prompt_len: int
) -> None:
    """A handle read from a save file is attached only once decode confirms it still holds it.

    The file may outlive the pin: the session was closed (which released it), a later turn
    of the saved session consumed it, or the same file was loaded before. Decode has freed
    those blocks and may have handed them to other requests; the pull is positional and
    checks nothing, so attaching such a handle would load another tenant's KV. Nor may two
    holders of the file (two loads, or a load beside the session that saved it) both attach
    it, even at the same moment: the first pull frees what the second reads. With agentkv's
    extension, a claim call is the check: decode answers only for the exact request id,
    block ids and lease secret it still holds, keeps the pin past prefill's expiry margin,
    and rotates the secret, so of concurrent claims exactly one succeeds and every other
    holder recomputes. On stock vLLM nothing can confirm it, so it is never attached.
    """
    handle = state.handle
    if handle is None or handle is not state.unconfirmed:
        return
    if not state.policy.decide_attach(handle, prompt_len=prompt_len, now=pool.clock()).attach:
        return  # not attached anyway (expired, diverged, ...): the turn says why
    state.unconfirmed = None
    if supported is not True or not handle.leased:
        state.drop_handle(
            HandleState.INVALIDATED,
            "a handle from a save file is never attached on stock vLLM: decode cannot "
            "confirm it still holds the blocks",
        )
        return
    await extend_handle(pool, state, _CONFIRM_TTL_S, reason="confirm_loaded", claim=True)
    if state.handle is handle:  # not extended, not dropped: the call failed
        state.drop_handle(
            HandleState.INVALIDATED,
            "decode could not confirm the handle (it is also in a save file)",
        )
