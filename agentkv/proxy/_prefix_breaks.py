"""Prefix breaks, diagnosed: why a request did not extend its thread, counted and told.

A request whose history does not extend its thread's (``HistoryPlan.forked``) recomputes from
the point where they differ. Agents break their own prefixes without noticing (a timestamp in
the system prompt, tools re-ordered, an earlier message rewritten); ``record_break`` makes each
one visible: ``agentkv_prefix_breaks_total{reason}``, the tokens lost
(``agentkv_prefix_break_lost_tokens_total{reason}``), and an info event
``agentkv.proxy.prefix_break`` naming the first differing message and the token it starts at.

``cache_miss_reason`` answers Anthropic's cache diagnostics (beta ``cache-diagnosis-2026-04-07``,
request ``diagnostics.previous_message_id``) from the same plan: the value of the response's
``diagnostics.cache_miss_reason``. Pure.

>>> from agentkv import HistoryPlan
>>> plan = HistoryPlan(keep=1, new=(), forked=True, break_reason="system_changed",
...                    diverged_message=0, diverged_token=0, lost_tokens=812)
>>> cache_miss_reason(plan)
{'type': 'system_changed', 'cache_missed_input_tokens': 812}
>>> cache_miss_reason(None, previous_found=False)
{'type': 'previous_message_not_found'}
"""

from __future__ import annotations

from typing import Any

from agentkv._core import HistoryPlan, get_logger
from agentkv.proxy._metrics import ProxyMetrics

__all__ = ["cache_miss_reason", "record_break"]

logger = get_logger("agentkv")


def record_break(
    metrics: ProxyMetrics, plan: HistoryPlan, *, session_id: str, principal: str, thread: str
) -> None:
    """Count ``plan``'s break (it forked) and tell where it fell."""
    reason = plan.break_reason or "messages_changed"
    metrics.prefix_breaks.labels(reason).inc()
    metrics.prefix_break_tokens.labels(reason).inc(plan.lost_tokens)
    logger.info(
        "agentkv.proxy.prefix_break",
        session_id=session_id,
        principal=principal,
        thread=thread,
        reason=reason,
        message_index=plan.diverged_message,
        token_index=plan.diverged_token,
        lost_tokens=plan.lost_tokens,
    )


def cache_miss_reason(
    plan: HistoryPlan | None,
    *,
    previous_found: bool = True,
    model_changed: bool = False,
    prompt_tokens: int | None = None,
) -> dict[str, Any] | None:
    """``diagnostics.cache_miss_reason`` for a request compared with the one that
    ``diagnostics.previous_message_id`` names.

    ``plan``: how the request's history mapped onto the thread that answered the previous
    message (``None``: no plan was made, e.g. the thread is gone); ``previous_found``: that
    message is known; ``model_changed``: it was answered by another model. ``prompt_tokens``,
    the request's prompt length once rendered: ``cache_missed_input_tokens`` is then its tokens
    after the break (Anthropic's meaning); without it, the thread's tokens after the break.
    ``None`` means no divergence (the request extends the previous one), as Anthropic answers
    it; the ``*_changed`` types carry ``cache_missed_input_tokens``, the others do not.
    """
    if not previous_found:
        return {"type": "previous_message_not_found"}
    if model_changed:
        return {"type": "model_changed", "cache_missed_input_tokens": prompt_tokens or 0}
    if plan is None:
        return {"type": "unavailable"}
    if not plan.forked or plan.break_reason in (None, "regenerated"):
        # Extends it, or the same history again: no divergence in structure to name.
        return None
    missed = plan.lost_tokens
    if prompt_tokens is not None and plan.diverged_token is not None:
        missed = max(0, prompt_tokens - plan.diverged_token)
    return {"type": plan.break_reason, "cache_missed_input_tokens": missed}
