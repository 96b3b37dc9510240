"""Sharing the registry's places between principals: who gives up a session when it is full.

The registry's places are one pool, and without a rule the principal that opens sessions
fastest takes them all: each new session closed the one idle the longest, whoever's it was, so
one key's flood (even of requests that failed upstream) closed every other key's sessions and
lost their stored responses (``previous_response_id``). The rule here:

* A principal's *share* is ``max_sessions`` over the principals holding sessions (the one asking
  included), at least one. It moves with the load: alone, a principal may fill the registry;
  once others come, the next places go to whoever holds fewer.
* When the registry is full, a principal at or over its share makes room from its own
  sessions only (its least recently used idle one); when they are all in use it gets a 503 of
  its own, and nobody else loses anything.
* A principal under its share takes the least recently used idle session of the principal
  holding the most sessions, and only of one holding more than it does: so while any
  principal over its share has an idle session, nobody under it loses one, and places move
  from the largest holders toward the smaller ones, never the other way.
* A session idle past the timeout is dead anyway: any such goes first, whoever's it is.
* ``max_sessions_per_key`` (optional) is a hard cap on top: a principal at it makes room from
  its own sessions or gets a 429, however empty the registry is.

Why the share and not a fixed per-key cap alone: a fixed cap either wastes the registry (one
busy tenant cannot use places nobody else wants) or, set high, protects nobody. The share gives
a lone tenant everything and a crowd equal parts, and the optional cap is there for operators
who want a tenant's footprint bounded whatever the load.

``SessionTable`` is the registry's entries in least-recently-used order with each principal's
in the same order, so finding a principal's oldest idle session does not scan everyone's.
``choose_victim`` is the rule, a pure function of the table.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from agentkv.proxy._entry import Key, SessionEntry

__all__ = ["Refusal", "SessionTable", "choose_victim"]


class SessionTable(OrderedDict[Key, SessionEntry]):
    """Entries by key, least recently used first, indexed by principal too.

    Only ``[key] = entry``, ``del [key]`` and ``move_to_end`` keep the index: the registry uses
    nothing else to change the table."""

    def __init__(self) -> None:
        super().__init__()
        self._owned: dict[str, OrderedDict[Key, SessionEntry]] = {}

    def __setitem__(self, key: Key, entry: SessionEntry) -> None:
        super().__setitem__(key, entry)
        self._owned.setdefault(key[0], OrderedDict())[key] = entry

    def __delitem__(self, key: Key) -> None:
        super().__delitem__(key)
        owned = self._owned[key[0]]
        del owned[key]
        if not owned:
            del self._owned[key[0]]

    def move_to_end(self, key: Key, last: bool = True) -> None:
        super().move_to_end(key, last)
        self._owned[key[0]].move_to_end(key, last)

    def count(self, principal: str) -> int:
        """How many sessions ``principal`` holds here."""
        owned = self._owned.get(principal)
        return 0 if owned is None else len(owned)

    def counts(self) -> dict[str, int]:
        return {principal: len(owned) for principal, owned in self._owned.items()}

    def oldest_idle(self, principal: str | None = None) -> SessionEntry | None:
        """The least recently used session nobody is using (of ``principal``, or anyone's)."""
        entries: OrderedDict[Key, SessionEntry] | None = (
            self if principal is None else self._owned.get(principal)
        )
        if entries is None:
            return None
        return next((e for e in entries.values() if e.users == 0), None)


@dataclass(frozen=True, kw_only=True, slots=True)
class Refusal:
    """No session may be closed for this principal: answer ``status`` with ``message``."""

    status: int
    message: str


def share(table: SessionTable, principal: str, max_sessions: int) -> int:
    """``principal``'s share of ``max_sessions`` (see the module docstring)."""
    principals = len(table.counts()) + (table.count(principal) == 0)
    return max(1, max_sessions // principals)


def choose_victim(
    table: SessionTable,
    principal: str,
    *,
    max_sessions: int,
    max_per_key: int | None,
    expired: Callable[[SessionEntry], bool],
) -> SessionEntry | Refusal | None:
    """The session to close so that ``principal`` can open one; ``None`` when there is room,
    a ``Refusal`` when the rule says no session may go for it."""
    own = table.count(principal)
    if max_per_key is not None and own >= max_per_key:
        return table.oldest_idle(principal) or Refusal(
            status=429,
            message=f"this key holds its limit of {max_per_key} sessions, all in use; "
            "retry when one is done, or delete one",
        )
    if len(table) < max_sessions:
        return None
    oldest = table.oldest_idle()
    if oldest is not None and expired(oldest):
        return oldest
    fair = share(table, principal, max_sessions)
    if own < fair:
        # The largest holder with an idle session, if it holds more than this principal;
        # between equal holders, the session idle the longest.
        candidates = [
            (held, victim)
            for holder, held in table.counts().items()
            if held > own and (victim := table.oldest_idle(holder)) is not None
        ]
        if candidates:
            return max(candidates, key=lambda c: (c[0], -c[1].last_used))[1]
    return table.oldest_idle(principal) or Refusal(
        status=503,
        message=f"all {max_sessions} sessions are in use ({own} of them this key's, whose "
        f"share is {fair}); retry shortly",
    )
