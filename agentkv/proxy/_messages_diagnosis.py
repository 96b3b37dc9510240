"""Anthropic's cache diagnostics on ``/v1/messages``: why a request did not reuse its cache.

A client that sends ``anthropic-beta: cache-diagnosis-2026-04-07`` and
``diagnostics.previous_message_id`` (the id of an answer it got before) is told in the answer's
``diagnostics.cache_miss_reason`` whether this request extended that one, and if not, what
changed (``_prefix_breaks.cache_miss_reason``: the history rule's own finding, not a guess).

Which thread answered a message is kept per principal (a message id of another API key is not
found), bounded, oldest forgotten, in this process: with replicas, a message answered by another
replica is ``previous_message_not_found``, as Anthropic answers an id it no longer knows.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from agentkv._core import HistoryPlan
from agentkv.proxy._prefix_breaks import cache_miss_reason
from agentkv.proxy._threads import thread_of

__all__ = ["BETA", "Diagnosis", "MessageThreads", "previous_message_id"]

BETA = "cache-diagnosis-2026-04-07"


def previous_message_id(beta: str | None, body: object) -> str | None:
    """The message a request asks to be compared with, when it asks (the beta and the field).

    >>> previous_message_id("cache-diagnosis-2026-04-07", {"diagnostics": {
    ...     "previous_message_id": "msg_1"}})
    'msg_1'
    >>> previous_message_id(None, {"diagnostics": {"previous_message_id": "msg_1"}}) is None
    True
    """
    if beta is None or BETA not in (part.strip() for part in beta.split(",")):
        return None
    diagnostics = body.get("diagnostics") if isinstance(body, Mapping) else None
    value = diagnostics.get("previous_message_id") if isinstance(diagnostics, Mapping) else None
    return value if isinstance(value, str) and value else None


class MessageThreads:
    """Which thread (registry session id) answered each recent message, per principal."""

    def __init__(self, *, max_entries: int) -> None:
        self._max = max_entries
        self._threads: OrderedDict[tuple[str, str], str] = OrderedDict()

    def remember(self, principal: str, message_id: str, session_id: str) -> None:
        self._threads[(principal, message_id)] = session_id
        while len(self._threads) > self._max:
            self._threads.popitem(last=False)

    def thread(self, principal: str, message_id: str) -> str | None:
        return self._threads.get((principal, message_id))


@dataclass(frozen=True, kw_only=True, slots=True)
class Diagnosis:
    """What a request asked to be compared with: the previous message's thread, if known."""

    previous_thread: str | None

    def answer(
        self, session_id: str | None, plan: HistoryPlan | None, *, prompt_tokens: int | None
    ) -> dict[str, Any]:
        """The answer's ``diagnostics`` for a request that ran on ``session_id`` with ``plan``.

        A request on another thread than the previous message's shares none of its history:
        every input token was missed; a side thread is one because its system prompt differs
        (``_threads``), any other because its messages do (a one-shot request, another
        conversation).
        """
        if self.previous_thread is None:
            reason = cache_miss_reason(None, previous_found=False)
        elif session_id != self.previous_thread:
            side = session_id is not None and thread_of(session_id)[1].startswith("start:")
            kind = "system_changed" if side else "messages_changed"
            reason = {"type": kind, "cache_missed_input_tokens": prompt_tokens or 0}
        else:
            reason = cache_miss_reason(plan, prompt_tokens=prompt_tokens)
        return {"cache_miss_reason": reason}
