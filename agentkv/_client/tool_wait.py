"""A tool wait (``session.tool_wait()``): offload or extend the pin around it, as ``kv`` decides.

What the policy needs to know of the pin's decode (whether it has a file tier, how full its KV
memory is) is asked here; ``kv.wait_tier`` and ``kv.wait_extend`` decide, and ``leasing``
performs the offload or the extend.
"""

from __future__ import annotations

from dataclasses import dataclass

from agentkv._client import kv
from agentkv._client.leasing import extend, offload
from agentkv._client.offload import OffloadMode
from agentkv._client.pool import PairPool
from agentkv._client.state import SessionState
from agentkv._log import get_logger
from agentkv._policy import ExtendDecision, TierDecision

__all__ = ["ToolWait", "begin_wait", "decide_tier", "end_wait"]

logger = get_logger("agentkv")


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
    hint: OffloadMode,
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
    pool: PairPool, state: SessionState, *, expected_s: float, mode: OffloadMode = "auto"
) -> ToolWait:
    """Start a tool wait: offload the pin to the file tier if the policy says the wait is worth
    it, else extend it if the wait would outlast it. The session is held meanwhile
    (``SessionState.holding``): no turn takes the handle an offload frees."""
    with state.holding("tool wait"):
        now = pool.clock()
        had_handle = state.handle is not None
        tier = await decide_tier(pool, state, hint=mode, expected_wait_s=expected_s)
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
