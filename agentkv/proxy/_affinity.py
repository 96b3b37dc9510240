"""Conversations that share a ``prompt_cache_key``, told apart by their history.

In OpenAI's API ``prompt_cache_key`` names a shared prefix, not a conversation: many
conversations send the same key. Keying sessions by it would serialize them behind each other
and fork them every turn. Instead the key places their sessions (on one pair, whose prefill cache
holds the shared prefix), and each request finds its own conversation by its history: the
session whose last answer the request echoes.

Finding is a look, not a take: the entry stays until a turn on that session commits, so a turn
that fails leaves the conversation where it was and its retry finds the session again. The
commit replaces the history it extended with the one the session holds now.

>>> from agentkv import Message
>>> index = HistoryIndex(max_entries=8)
>>> turn1 = [Message.user("Hi"), Message.assistant("Hello!")]
>>> index.remember("alice", "k", turn1, "s-1")
>>> request = [Message.user("Hi"), Message.assistant(" Hello!"), Message.user("Bye")]
>>> index.find("alice", "k", request), index.find("alice", "k", request)
('s-1', 's-1')
>>> index.remember("alice", "k", [*request, Message.assistant("Bye!")], "s-1")
>>> index.find("alice", "k", request) is None  # the session holds the next turn now
True
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

from agentkv._core import HistoryPlan, Message, dumps

__all__ = ["HistoryIndex"]


def _digest(principal: str, key: str, messages: Sequence[Message]) -> bytes:
    # Keyed by how an echo reads (the session's own history rule): a client's copy of the
    # answer finds the session that generated it.
    data = dumps([principal, key]) + HistoryPlan.key(messages)
    return hashlib.blake2b(data, digest_size=16).digest()


def _extended(messages: Sequence[Message]) -> Sequence[Message] | None:
    """The part of a request's history a session may hold: up to its last answer."""
    last = max((i for i, m in enumerate(messages) if m.role == "assistant"), default=-1)
    return None if last < 0 else messages[: last + 1]


class HistoryIndex:
    """Which session holds a history ending in a generated answer; bounded, oldest dropped."""

    def __init__(self, *, max_entries: int) -> None:
        self._max = max_entries
        self._entries: OrderedDict[bytes, str] = OrderedDict()

    def remember(
        self, principal: str, key: str, history: Sequence[Message], session_id: str
    ) -> None:
        """``history`` (a request's messages, then the answer just committed) is now held by
        ``session_id``; the history the request extended, if that session held it, is not."""
        extended = _extended(history[:-1])
        if extended is not None:
            old = _digest(principal, key, extended)
            if self._entries.get(old) == session_id:
                del self._entries[old]
        digest = _digest(principal, key, history)
        self._entries[digest] = session_id
        self._entries.move_to_end(digest)
        while len(self._entries) > self._max:
            self._entries.popitem(last=False)

    def find(self, principal: str, key: str, messages: Sequence[Message]) -> str | None:
        """The session whose history the request extends, left on the index (see the module
        docstring): two requests continuing one history both find it, and the session's
        registry runs them one after the other; the second then forks (``ChatService``)."""
        extended = _extended(messages)
        if extended is None:
            return None
        return self._entries.get(_digest(principal, key, extended))
