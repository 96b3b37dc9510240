"""A spawned thread that carries its parent thread's history starts as the parent's fork.

Codex's multi-agent spawn (``spawn_agent``; its requests say ``x-openai-subagent:
collab_spawn``) gives the new thread its parent's history by default, under the session's
``session-id`` with a ``thread-id`` of its own and the parent's in ``x-codex-parent-thread-id``.
As a session of its own the thread would compute that history afresh; as the parent's fork
(``AsyncSession.fork``) it gets a copy of the parent's pinned KV on decode's file tier, which its
first turn's prefill loads. The parent keeps its pin and its transcript.

Only a thread's first request, and only when its history extends the parent's (the history
rule, ``plan_history``): a subagent that starts a conversation of its own (Claude Code's) is a
fresh session as before. A parent in the middle of a turn has no final history: the thread then
starts fresh too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from agentkv._core import AsyncSession, Message, SessionBusyError, get_logger
from agentkv.proxy._registry import SessionRegistry
from agentkv.proxy._threads import Thread

__all__ = ["spawned_fork"]

logger = get_logger("agentkv.proxy")


def spawned_fork(
    registry: SessionRegistry,
    principal: str,
    thread: Thread,
    fresh: AsyncSession,
    *,
    messages: Sequence[Message],
    tools: Sequence[Mapping[str, Any]] | None,
) -> AsyncSession | None:
    """The parent thread's fork to run ``thread``'s first request of ``messages`` on, in place
    of ``fresh`` (the session the registry just opened for it); ``None``: run it on ``fresh``."""
    if thread.parent is None or fresh.transcript.messages or fresh.transcript.pending:
        return None
    parent = registry.cached(principal, thread.parent)
    if parent is None or parent.session.closed or not parent.session.transcript.messages:
        return None
    try:
        plan = parent.session.plan_history(messages, tools=tools)
    except SessionBusyError:
        return None
    if plan.forked:
        return None
    child = parent.session.fork(session_id=fresh.session_id)
    logger.info(
        "agentkv.proxy.thread_spawned",
        session_id=thread.registry_id,
        parent=thread.parent,
        principal=principal,
        inherited_messages=len(parent.session.transcript.messages),
    )
    return child
