"""The proxy's open sessions: keyed by (principal, session id), bounded, expiring when idle.

* Scoping: the key includes the principal (the API key's owner), so the same session id under
  two keys is two sessions, and one client can never read or extend another's.
* One request at a time per session: a request checks its session out (waiting behind any request
  already on it) and checks it in when its answer, or its stream, is done.
* Idle expiry: a session unused for ``idle_timeout_s`` is closed, on the periodic ``sweep`` or
  when it is next asked for, whichever comes first.
* Bounded size: opening a session past ``max_sessions`` closes the one idle the longest; when
  every session is in use the request gets 503 rather than the proxy growing without bound.

Everything runs on the proxy's event loop; nothing here is thread-safe, nothing needs to be.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable

import structlog

from agentkv._cluster import AsyncCluster
from agentkv._exceptions import SessionClosedError
from agentkv._session import AsyncSession
from agentkv._types import Message
from agentkv.proxy._errors import ProxyError
from agentkv.proxy._metrics import ProxyMetrics

__all__ = ["SessionEntry", "SessionRegistry"]

logger = structlog.get_logger("agentkv")

Key = tuple[str, str]


class SessionEntry:
    """One open session and the proxy's bookkeeping around it.

    ``generated`` holds the indices of the session's messages the model generated (their echoes
    are matched by meaning, see ``_mapping``); ``tools_key`` the tools its transcript was rendered
    with (``None`` before the first turn).
    """

    __slots__ = (
        "closed",
        "created_at",
        "forks",
        "generated",
        "key",
        "last_used",
        "lock",
        "session",
        "tools_key",
        "users",
        "views",
    )

    def __init__(self, key: Key, session: AsyncSession, *, now: float) -> None:
        self.key = key
        self.session = session
        self.generated: set[int] = set()
        # What the client was shown for a generated message, where it differs (tool calls
        # translated from the JSON the model wrote): echoes are matched against it.
        self.views: dict[int, Message] = {}
        self.tools_key: str | None = None
        self.lock = asyncio.Lock()
        self.users = 0
        self.last_used = now
        self.created_at = time.time()
        self.forks = 0
        self.closed = False

    @property
    def session_id(self) -> str:
        return self.key[1]


class SessionRegistry:
    """Open sessions of one proxy (see the module docstring for the rules)."""

    def __init__(
        self,
        cluster: AsyncCluster,
        *,
        max_sessions: int,
        idle_timeout_s: float,
        metrics: ProxyMetrics,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._cluster = cluster
        self._max = max_sessions
        self._idle_timeout_s = idle_timeout_s
        self._metrics = metrics
        self._clock = clock
        # Ordered by last checkout, oldest first: eviction scans from the front.
        self._entries: OrderedDict[Key, SessionEntry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def idle_s(self, entry: SessionEntry) -> float:
        return 0.0 if entry.users else self._clock() - entry.last_used

    def _expired(self, entry: SessionEntry) -> bool:
        return entry.users == 0 and self._clock() - entry.last_used >= self._idle_timeout_s

    async def lookup(self, principal: str, session_id: str) -> SessionEntry | None:
        """The open session, without checking it out (``None`` when absent or expired)."""
        entry = self._entries.get((principal, session_id))
        if entry is not None and self._expired(entry):
            await self._close(entry, "idle")
            return None
        return entry

    async def checkout(
        self, principal: str, session_id: str, *, placement_key: str | None = None
    ) -> SessionEntry:
        """The session for this key, opened if needed, once no other request is on it.

        Raises ``ProxyError`` (503) when the registry is full of sessions in use, and
        ``SessionClosedError`` when the session was deleted while this request waited.
        """
        key = (principal, session_id)
        entry = await self.lookup(principal, session_id)
        if entry is None:
            await self._make_room()
            # Making room may have waited (closing a session), and another request for the same
            # key may have opened it meanwhile: one key, one session.
            entry = self._entries.get(key)
        if entry is None:
            session = self._cluster.session(
                session_id=f"{principal}:{session_id}", placement_key=placement_key
            )
            entry = SessionEntry(key, session, now=self._clock())
            self._entries[key] = entry
            self._metrics.sessions_opened.inc()
            logger.info(
                "agentkv.proxy.session_opened",
                session_id=session_id,
                principal=principal,
                pair=session.pair.name,
            )
        else:
            self._entries.move_to_end(key)
        entry.users += 1
        try:
            await entry.lock.acquire()
        except BaseException:
            entry.users -= 1
            raise
        if entry.closed:
            await self.checkin(entry)
            raise SessionClosedError(f"session {session_id} was closed")
        return entry

    async def checkin(self, entry: SessionEntry) -> None:
        """Give the session back; a session deleted meanwhile is closed by its last user."""
        entry.lock.release()
        entry.users -= 1
        entry.last_used = self._clock()
        if entry.closed and entry.users == 0:
            await entry.session.aclose()

    async def replace(self, entry: SessionEntry, session: AsyncSession, *, keep: int) -> None:
        """Swap in a fork of the entry's session that kept its first ``keep`` messages."""
        old = entry.session
        entry.session = session
        entry.generated = {index for index in entry.generated if index < keep}
        entry.views = {index: view for index, view in entry.views.items() if index < keep}
        entry.forks += 1
        if not session.transcript.token_ids:
            entry.tools_key = None  # rendered afresh: the next turn may bring any tools
        await old.aclose()

    async def delete(self, principal: str, session_id: str) -> bool:
        """Close a session (now, or when its in-flight request ends); False if there is none."""
        entry = await self.lookup(principal, session_id)
        if entry is None:
            return False
        await self._close(entry, "deleted")
        return True

    async def sweep(self) -> int:
        """Close every session idle past the timeout; return how many."""
        expired = [entry for entry in self._entries.values() if self._expired(entry)]
        for entry in expired:
            await self._close(entry, "idle")
        return len(expired)

    async def close_all(self) -> None:
        for entry in list(self._entries.values()):
            await self._close(entry, "shutdown")

    async def _make_room(self) -> None:
        while len(self._entries) >= self._max:
            victim = next((e for e in self._entries.values() if e.users == 0), None)
            if victim is None:
                raise ProxyError(
                    503,
                    f"all {self._max} sessions are in use; retry shortly",
                    code="too_many_sessions",
                    headers={"Retry-After": "1"},
                )
            await self._close(victim, "idle" if self._expired(victim) else "evicted")

    async def _close(self, entry: SessionEntry, reason: str) -> None:
        if self._entries.get(entry.key) is entry:
            del self._entries[entry.key]
        if entry.closed:
            return
        entry.closed = True
        session = entry.session
        turns = len(session.turns)
        if entry.users == 0:
            await session.aclose()
        self._metrics.sessions_closed.inc(reason)
        logger.info(
            "agentkv.proxy.session_closed",
            session_id=entry.session_id,
            principal=entry.key[0],
            reason=reason,
            turns=turns,
        )
