"""Conversations that share a ``prompt_cache_key``, told apart by their history.

In OpenAI's API ``prompt_cache_key`` names a shared prefix, not a conversation: many
conversations send the same key. Keying sessions by it would serialize them behind each other
and fork them every turn. Instead the key places their sessions (on one pair, whose prefill cache
holds the shared prefix), and each request finds its own conversation by its history: the
session whose last answer the request echoes.

>>> from agentkv import Message
>>> index = HistoryIndex(max_entries=8)
>>> turn1 = [Message.user("Hi")]
>>> index.remember("alice", "k", [*turn1, Message.assistant("Hello!")], "s-1")
>>> index.claim("alice", "k", [*turn1, Message.assistant(" Hello!"), Message.user("Bye")])
's-1'
>>> index.claim("alice", "k", [*turn1, Message.assistant("Hello!"), Message.user("Bye")]) is None
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


class HistoryIndex:
    """Which session holds a history ending in a generated answer; bounded, oldest dropped."""

    def __init__(self, *, max_entries: int) -> None:
        self._max = max_entries
        self._entries: OrderedDict[bytes, str] = OrderedDict()

    def remember(
        self, principal: str, key: str, history: Sequence[Message], session_id: str
    ) -> None:
        """``history`` (ending with the answer just given) is now held by ``session_id``."""
        self._entries[_digest(principal, key, history)] = session_id
        self._entries.move_to_end(_digest(principal, key, history))
        while len(self._entries) > self._max:
            self._entries.popitem(last=False)

    def claim(self, principal: str, key: str, messages: Sequence[Message]) -> str | None:
        """The session whose history the request extends, taken off the index (one claimant)."""
        last = max((i for i, m in enumerate(messages) if m.role == "assistant"), default=-1)
        if last < 0:
            return None
        return self._entries.pop(_digest(principal, key, messages[: last + 1]), None)
