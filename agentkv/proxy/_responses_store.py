"""Stored responses (``previous_response_id``): small references into their sessions' histories.

A stored response is not a copy of its history. It names its session, how many of the session's
messages its history is (``count``) and what rebuilding it needs: whether its first message is
the request's ``instructions``, how long a tools description the first message carries
(``_tools.shown_messages``). The history is rebuilt from the session's transcript when the
response is continued (``_responses``), so a conversation of N turns holds N records of a few
hundred bytes, not N histories.

* A record holds only while its session holds that history. A session that closes (idle expiry,
  ``DELETE``, eviction) drops its records; a fork drops those its kept messages do not cover;
  ``tail``, a digest of the history's last two messages, catches what neither saw (a turn lost
  with its replica's claim, whose record was stored before its commit was refused).
* Ids (``ResponseIds``): ``resp_``, the session's group (``response_group``), a nonce and a tag
  (HMAC of the principal, group and nonce, under a secret every replica of a store shares). An
  id whose tag does not verify is not this principal's (404, whoever made it); one that verifies
  but is no longer stored is expired (400). Nothing is kept for the ids dropped.
* Where: ``ResponseStore`` in this process's memory, bounded in bytes (the oldest goes first);
  with a shared ``SessionStore`` (``--state``), ``SharedResponses`` keeps them there, grouped by
  session, so that any replica, or a restarted one, continues any response.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from agentkv._core import Message, dumps, loads
from agentkv.proxy._entry import Key, store_key
from agentkv.proxy._store import SessionStore, response_group

__all__ = [
    "ENTRY_BYTES",
    "ResponseIds",
    "ResponseStore",
    "Responses",
    "SharedResponses",
    "StoredResponse",
    "history_tail",
]

# What one record costs in memory beyond its strings: the record, its slot in the id index and in
# its session's, the id string's header (tests/fake/test_responses.py measures it).
ENTRY_BYTES = 360


def history_tail(messages: Sequence[Message], count: int) -> bytes:
    """A digest of the last two of a history's first ``count`` messages (its last turn)."""
    last = [m.to_openai() for m in messages[max(0, count - 2) : count]]
    return hashlib.blake2b(dumps(last), digest_size=8).digest()


@dataclass(frozen=True, kw_only=True, slots=True)
class StoredResponse:
    """A stored response: whose it is, its session, and where its history ends in it.

    ``count``: the session's first ``count`` messages are its history (the answer last);
    ``instructions``: the first of them is the request's ``instructions`` (a continuation
    brings its own); ``described``: the tools description its first message carries (the
    request's ``ToolPlan.described``); ``tail``: ``history_tail`` of the history.
    """

    principal: str
    session_id: str
    count: int
    instructions: bool
    described: int
    tail: bytes

    def to_bytes(self) -> bytes:
        return dumps(
            [
                self.principal,
                self.session_id,
                self.count,
                self.instructions,
                self.described,
                self.tail.hex(),
            ]
        )

    @classmethod
    def from_bytes(cls, data: bytes) -> StoredResponse:
        principal, session_id, count, instructions, described, tail = loads(data)
        return cls(
            principal=principal,
            session_id=session_id,
            count=count,
            instructions=instructions,
            described=described,
            tail=bytes.fromhex(tail),
        )


class ResponseIds:
    """Response ids that say whose they are (see the module docstring)."""

    _HEX = frozenset("0123456789abcdef")

    def __init__(self, secret: str) -> None:
        self._key = hmac.new(secret.encode(), b"agentkv responses", hashlib.sha256).digest()

    def _tag(self, principal: str, group: str, nonce: str) -> str:
        data = f"{principal}\x00{group}{nonce}".encode()
        return hmac.new(self._key, data, hashlib.sha256).hexdigest()[:16]

    def mint(self, principal: str, session_id: str | None) -> str:
        """An id for a response of ``session_id``; without one (a response not stored), an id
        that names nothing (its tag verifies for no one)."""
        if session_id is None:
            return f"resp_{secrets.token_hex(24)}"
        group = response_group(store_key(principal, session_id))
        nonce = secrets.token_hex(8)
        return f"resp_{group}{nonce}{self._tag(principal, group, nonce)}"

    def group(self, principal: str, response_id: str) -> str | None:
        """The session group of ``response_id`` when the id is one minted for ``principal``."""
        body = response_id[5:]
        if not response_id.startswith("resp_") or len(body) != 48 or not self._HEX.issuperset(body):
            return None
        group, nonce, tag = body[:16], body[16:32], body[32:]
        return group if hmac.compare_digest(tag, self._tag(principal, group, nonce)) else None


class Responses(Protocol):
    """Where stored responses are kept."""

    async def put(self, response_id: str, entry: StoredResponse) -> None: ...

    async def get(self, group: str, response_id: str) -> StoredResponse | None: ...

    async def forked(self, key: Key, *, kept: int) -> None:
        """Session ``key`` was replaced by a fork that keeps its first ``kept`` messages."""
        ...

    async def closed(self, key: Key) -> None:
        """Session ``key`` closed."""
        ...


class ResponseStore:
    """Stored responses in this process's memory, at most ``max_bytes``, shared fairly by keys.

    When full, a principal holding at least an equal share of the bytes gives up its own oldest
    response, and any other takes the place of the oldest response of the principal holding the
    most: one key's traffic never pushes out another key's stored responses while it holds
    more of them (as the session registry shares its places, ``_fair``). ``nbytes`` is what the
    records hold (``ENTRY_BYTES`` each, plus their strings).
    """

    def __init__(self, *, max_bytes: int) -> None:
        self._max = max_bytes
        self._entries: dict[str, StoredResponse] = {}
        self._by_session: dict[Key, dict[str, None]] = {}
        # principal -> its ids, oldest first, and the bytes they hold.
        self._owned: dict[str, OrderedDict[str, None]] = {}
        self._held: dict[str, int] = {}
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def values(self) -> list[StoredResponse]:
        return list(self._entries.values())

    def held(self, principal: str) -> int:
        """The bytes ``principal``'s stored responses hold."""
        return self._held.get(principal, 0)

    @staticmethod
    def _size(response_id: str, entry: StoredResponse) -> int:
        return ENTRY_BYTES + len(response_id) + len(entry.principal) + len(entry.session_id)

    def _drop(self, response_id: str) -> None:
        entry = self._entries.pop(response_id)
        size = self._size(response_id, entry)
        self.nbytes -= size
        principal = entry.principal
        owned = self._owned[principal]
        del owned[response_id]
        self._held[principal] -= size
        if not owned:
            del self._owned[principal], self._held[principal]
        key = (principal, entry.session_id)
        ids = self._by_session.get(key)
        if ids is not None:
            ids.pop(response_id, None)
            if not ids:
                del self._by_session[key]

    async def put(self, response_id: str, entry: StoredResponse) -> None:
        size = self._size(response_id, entry)
        if size > self._max:
            return  # never kept (a bound of 0 stores none): dropping the others would not help
        principal = entry.principal
        while self.nbytes + size > self._max:
            giver = principal
            holders = len(self._owned) + (principal not in self._owned)
            if giver not in self._owned or (self._held[giver] + size) * holders < self._max:
                giver = max(self._held, key=self._held.__getitem__)  # under its share
            self._drop(next(iter(self._owned[giver])))
        self._entries[response_id] = entry
        self._by_session.setdefault((principal, entry.session_id), {})[response_id] = None
        self._owned.setdefault(principal, OrderedDict())[response_id] = None
        self._held[principal] = self._held.get(principal, 0) + size
        self.nbytes += size

    async def get(self, group: str, response_id: str) -> StoredResponse | None:
        del group  # one process: the id alone finds it
        return self._entries.get(response_id)

    async def forked(self, key: Key, *, kept: int) -> None:
        for response_id in list(self._by_session.get(key, ())):
            if self._entries[response_id].count > kept:
                self._drop(response_id)

    async def closed(self, key: Key) -> None:
        for response_id in list(self._by_session.get(key, ())):
            self._drop(response_id)


class SharedResponses:
    """Stored responses in the shared ``SessionStore``: any replica finds any. A session's group
    lives until the store removes the session (``SessionStore.remove`` deletes it), or
    ``ttl_s`` (the session idle timeout) after its latest put."""

    def __init__(self, store: SessionStore, *, ttl_s: float) -> None:
        self._store = store
        self._ttl_s = ttl_s

    async def put(self, response_id: str, entry: StoredResponse) -> None:
        await self._store.put_response(
            store_key(entry.principal, entry.session_id),
            response_id,
            entry.to_bytes(),
            count=entry.count,
            ttl_s=self._ttl_s,
        )

    async def get(self, group: str, response_id: str) -> StoredResponse | None:
        data = await self._store.get_response(group, response_id)
        return None if data is None else StoredResponse.from_bytes(data)

    async def forked(self, key: Key, *, kept: int) -> None:
        await self._store.drop_responses(store_key(*key), after=kept)

    async def closed(self, key: Key) -> None:
        del key  # the store's removal of the session deleted its responses
