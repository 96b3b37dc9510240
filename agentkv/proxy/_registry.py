"""The proxy's open sessions: keyed by (principal, session id), bounded, expiring when idle.

* Scoping: the key includes the principal (the API key's owner), so the same session id under
  two keys is two sessions, and one client can never read or extend another's.
* One request at a time per session: a request checks its session out (waiting behind any request
  already on it) and checks it in when its answer, or its stream, is done.
* Idle expiry: a session unused for ``idle_timeout_s`` is closed, on the periodic ``sweep`` or
  when it is next asked for, whichever comes first.
* Bounded size, shared fairly: opening a session past ``max_sessions`` closes an idle one,
  chosen so that no principal's flood closes another's sessions while it holds more than its
  share (``_fair``); when none may go the request gets 503 (429 past ``max_sessions_per_key``)
  rather than the proxy growing without bound, and only the principal over its share gets it.
* A session whose first turn failed (nothing committed) is closed and forgotten, not kept: a
  failing upstream, or a client sending what cannot be served, fills no place.

Everything runs on the proxy's event loop; nothing here is thread-safe, nothing needs to be.

With a shared ``SessionStore`` (``agentkv proxy --state redis://...``) the registry is a cache in
front of the store, and the store is the truth: ``_shared`` (``SharedSessions``, a base of
``SessionRegistry``) has the rules and the code that talks to the store.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from agentkv._core import AsyncCluster, AsyncSession, Pair, SessionClosedError, get_logger
from agentkv.proxy._bounds import SWEEP_PAGE
from agentkv.proxy._entry import Key, SessionEntry
from agentkv.proxy._errors import ProxyError
from agentkv.proxy._fair import Refusal, SessionTable, choose_victim
from agentkv.proxy._metrics import ProxyMetrics
from agentkv.proxy._shared import SharedSessions
from agentkv.proxy._store import SessionStore
from agentkv.proxy._threads import MAIN, thread_of
from agentkv.proxy._unreferenced import UnreferencedPins

__all__ = ["OnClose", "OnFork", "SessionEntry", "SessionRegistry"]

logger = get_logger("agentkv")

# Told when a session closes (the entry, the reason), and when it is replaced by a fork (the
# entry, how many of its messages the fork keeps): what refers to a session's history (stored
# responses) goes with it.
OnClose = Callable[[SessionEntry, str], Awaitable[None]]
OnFork = Callable[[SessionEntry, int], Awaitable[None]]


class SessionRegistry(SharedSessions):
    """Open sessions of one proxy (see the module docstring for the rules)."""

    def __init__(
        self,
        cluster: AsyncCluster,
        *,
        max_sessions: int,
        idle_timeout_s: float,
        metrics: ProxyMetrics,
        clock: Callable[[], float] = time.monotonic,
        store: SessionStore | None = None,
        claim_wait_s: float = 600.0,
        wall_clock: Callable[[], float] = time.time,
        offload_idle_s: float | None = None,
        max_sessions_per_key: int | None = None,
        max_stored_sessions: int | None = None,
    ) -> None:
        self._max_per_key = max_sessions_per_key
        # With a store: how many sessions it may hold, all replicas together (new ones past it
        # are refused); ``max_sessions`` bounds each replica's copies.
        self._max_stored = max_sessions if max_stored_sessions is None else max_stored_sessions
        self._offload_idle_s = offload_idle_s
        self._cluster = cluster
        self._store = store
        self._claim_wait_s = claim_wait_s
        self._wall = wall_clock
        self._max = max_sessions
        self._sweep_page = SWEEP_PAGE
        self._idle_timeout_s = idle_timeout_s
        self._metrics = metrics
        self._clock = clock
        # Ordered by last checkout, oldest first, per principal too (``_fair``).
        self._entries: SessionTable = SessionTable()
        # Checkins whose commit is still being written behind their answer.
        self._writes: set[asyncio.Task[None]] = set()
        self._pins = None if store is None else UnreferencedPins(cluster, store, metrics)
        self.on_close: list[OnClose] = []
        self.on_fork: list[OnFork] = []

    def __len__(self) -> int:
        return len(self._entries)

    def idle_s(self, entry: SessionEntry) -> float:
        return 0.0 if entry.users else self._clock() - entry.last_used

    def _expired(self, entry: SessionEntry) -> bool:
        return entry.users == 0 and self._clock() - entry.last_used >= self._idle_timeout_s

    @property
    def shared(self) -> bool:
        return self._store is not None

    async def lookup(self, principal: str, session_id: str) -> SessionEntry | None:
        """The open session, without checking it out (``None`` when absent or expired)."""
        if self._store is not None:
            return await self._lookup_shared(principal, session_id)
        entry = self._entries.get((principal, session_id))
        if entry is not None and self._expired(entry):
            await self._close(entry, "idle")
            return None
        return entry

    def cached(self, principal: str, session_id: str) -> SessionEntry | None:
        """This process's copy of a session, as it is (no expiry check, no store read)."""
        return self._entries.get((principal, session_id))

    def _fresh_session(self, key: Key, *, placement_key: str | None) -> AsyncSession:
        principal, session_id = key
        return self._cluster.session(
            session_id=f"{principal}:{session_id}",
            placement_key=placement_key,
            near=self._near(key),
        )

    def _near(self, key: Key) -> Pair | None:
        """The pair of the session whose thread ``key`` is (``_threads``), where this process
        holds it: threads share its prefix, and its prefill's cache holds it. The placement key
        places them alike anyway, but bounded load may spread them."""
        session_id, thread = thread_of(key[1])
        own = None if thread == MAIN else self._entries.get((key[0], session_id))
        return None if own is None or own.session.closed else own.session.pair

    def _new_entry(self, key: Key, *, placement_key: str | None) -> SessionEntry:
        entry = SessionEntry(
            key, self._fresh_session(key, placement_key=placement_key), now=self._clock()
        )
        self._entries[key] = entry
        return entry

    async def checkout(
        self, principal: str, session_id: str, *, placement_key: str | None = None
    ) -> SessionEntry:
        """The session for this key, opened if needed, once no other request is on it.

        Raises ``ProxyError`` (503) when the registry is full of sessions in use, and
        ``SessionClosedError`` when the session was deleted while this request waited.
        """
        key = (principal, session_id)
        if self._store is not None:
            # The claim brings the stored session when this copy is stale: no lookup first,
            # so a turn costs two round trips (claim, commit).
            entry = self._entries.get(key)
        else:
            entry = await self.lookup(principal, session_id)
        if entry is None:
            await self._make_room(principal)
            # Making room may have waited (closing a session), and another request for the same
            # key may have opened it meanwhile: one key, one session.
            entry = self._entries.get(key)
        if entry is None:
            entry = self._new_entry(key, placement_key=placement_key)
            if self._store is None:
                self._opened(entry)
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
        if self._store is not None:
            try:
                await self._claim(entry, placement_key=placement_key)
            except BaseException:
                await self.checkin(entry, failed=True)  # a new one refused leaves no copy
                raise
        return entry

    def _opened(self, entry: SessionEntry) -> None:
        self._metrics.sessions_opened.inc()
        logger.info(
            "agentkv.proxy.session_opened",
            session_id=entry.session_id,
            principal=entry.key[0],
            pair=entry.session.pair.name,
        )

    async def checkin(self, entry: SessionEntry, *, failed: bool = False) -> None:
        """Give the session back; a session deleted meanwhile is closed by its last user.

        With a shared store the commit is written behind the answer: this returns at once, and
        the session stays checked out (here and in the store) until the commit has landed.
        ``failed``: the request's turn failed (or never ran); a session it opened that has no
        turn yet is then dropped, and nothing is stored for it.
        """
        if failed and self._unborn(entry):
            await self._drop_unborn(entry)
            return
        if entry.claim is not None and not entry.closed:
            write = asyncio.get_running_loop().create_task(self._write_behind(entry))
            entry.write = write
            self._writes.add(write)
            write.add_done_callback(self._writes.discard)
            return
        await self._settle(entry)
        await self._give_back(entry)

    def _unborn(self, entry: SessionEntry) -> bool:
        """Nothing was ever committed for this session: no turn here, none stored (and no fork:
        a fork that kept nothing of a history is still that conversation)."""
        if entry.closed or entry.forks or entry.session.turns:
            return False
        claim = entry.claim
        return entry.version == 0 if claim is None else claim.version == 0

    async def _drop_unborn(self, entry: SessionEntry) -> None:
        """Close a session whose first turn failed, unless another request waits for it (that
        one runs the first turn next). In the store: the claim released, nothing written; a
        copy whose claim was refused (busy elsewhere, the store full) is dropped quietly."""
        claimed = entry.claim is not None
        if claimed:
            await self._release_claim(entry)
        if entry.users > 1:
            await self._give_back(entry)
            return
        if self._store is None:
            await self._close(entry, "failed")
            await self._give_back(entry)
            return
        await self._give_back(entry)
        if self._entries.get(entry.key) is entry:
            self._forget(entry)
        if claimed:  # opened in the store by this request (``_claim``): now closed
            self._metrics.sessions_closed.labels("failed").inc()
            logger.info(
                "agentkv.proxy.session_closed",
                session_id=entry.session_id,
                principal=entry.key[0],
                reason="failed",
                turns=0,
            )

    async def _give_back(self, entry: SessionEntry) -> None:
        entry.lock.release()
        entry.users -= 1
        entry.last_used = self._clock()
        entry.offload_tried = False
        if entry.closed and entry.users == 0:
            await entry.session.aclose()

    async def replace(self, entry: SessionEntry, session: AsyncSession) -> None:
        """Swap in a fork of the entry's session (it carries what it kept of the history)."""
        old = entry.session
        entry.session = session
        entry.forks += 1
        await old.aclose()
        transcript = session.transcript  # a fork may queue what it kept, to render it afresh
        kept = len(transcript.messages) + len(transcript.pending)
        for hook in self.on_fork:
            await hook(entry, kept)

    async def adopt(self, entry: SessionEntry, session: AsyncSession) -> None:
        """Swap in ``session`` for the entry's new, unused one: a spawned thread's fork of its
        parent (``_spawn``), which is not a fork of the entry's own history."""
        old = entry.session
        entry.session = session
        await old.aclose()

    async def delete(self, principal: str, session_id: str) -> bool:
        """Close a session (now, or when its in-flight request ends); False if there is none."""
        if self._store is not None:
            return await self._remove(principal, session_id, reason="deleted")
        entry = await self.lookup(principal, session_id)
        if entry is None:
            return False
        await self._close(entry, "deleted")
        return True

    async def sweep(self) -> int:
        """Close every session idle past the timeout; return how many."""
        if self._store is not None:
            return await self._sweep_shared()
        expired = [entry for entry in self._entries.values() if self._expired(entry)]
        for entry in expired:
            await self._close(entry, "idle")
        return len(expired)

    async def offload_idle(self) -> int:
        """Offload the pinned KV of sessions idle past ``offload_idle_s`` to decode's file tier;
        return how many were offloaded.

        Each is checked out as a request would be (its lock held), so no turn can carry the
        handle while decode writes it; a session is tried once per idle period (a decode
        without a tier answers once, not every sweep). With a shared store, the store lists the
        candidates (``pinned_idle``) and any one replica offloads each.
        """
        if self._offload_idle_s is None:
            return 0
        if self._store is not None:
            return await self._persist_idle_shared(self._offload_idle_s)
        offloaded = 0
        now = self._clock()
        for entry in list(self._entries.values()):
            session = entry.session
            if (
                entry.users
                or entry.closed
                or entry.offload_tried
                or now - entry.last_used < self._offload_idle_s
                or session.handle is None
                or session.tier is not None
            ):
                continue
            entry.offload_tried = True
            entry.users += 1
            try:
                async with entry.lock:
                    if not entry.closed and await session.offload() is not None:
                        offloaded += 1
            finally:
                entry.users -= 1
        return offloaded

    async def idle_pinned(
        self, pairs: set[str], *, limit: int
    ) -> list[tuple[Key, float | None]]:
        """Idle sessions whose turn-end KV is pinned on one of ``pairs``' decodes, the longest
        idle first (``PressureRelief``)."""
        if self._store is not None:
            return await self._idle_pinned_shared(pairs, limit=limit)
        idle = [
            entry
            for entry in self._entries.values()
            if not entry.users
            and not entry.closed
            and (handle := entry.session.handle) is not None
            and handle.leased
            and handle.pair in pairs
        ]
        idle.sort(key=lambda entry: entry.last_used)
        return [(entry.key, None) for entry in idle[:limit]]

    async def unpin(self, key: Key, *, used_at: float | None, pairs: set[str]) -> str | None:
        """Free an idle session's pin on one of ``pairs``' decodes (``AsyncSession.unpin``),
        checked out as a request would be; ``None`` when it is in use, gone or elsewhere."""
        if self._store is not None:
            wall = self._wall() if used_at is None else used_at
            return await self._persist_stored(key, used_at=wall, pairs=pairs)
        entry = self._entries.get(key)
        if entry is None or entry.users or entry.closed:
            return None
        entry.users += 1
        try:
            async with entry.lock:
                handle = entry.session.handle
                if entry.closed or handle is None or handle.pair not in pairs:
                    return None
                return await entry.session.unpin()
        finally:
            entry.users -= 1

    async def close_all(self) -> None:
        await self.written()  # a replica that stops first stores the turns it answered
        await self.released(fence_offs=False)
        for entry in list(self._entries.values()):
            if self._store is not None:
                self._forget(entry)  # other replicas continue these sessions
            else:
                await self._close(entry, "shutdown")

    def _forget(self, entry: SessionEntry) -> None:
        """Drop a cached copy of a shared session (its pin stays: the session goes on)."""
        if self._entries.get(entry.key) is entry:
            del self._entries[entry.key]
        if entry.users == 0:
            entry.session.detach()

    async def _make_room(self, principal: str) -> None:
        while True:
            victim = choose_victim(
                self._entries,
                principal,
                max_sessions=self._max,
                max_per_key=self._max_per_key,
                expired=self._expired,
            )
            if victim is None:
                return
            if isinstance(victim, Refusal):
                self._metrics.sessions_refused.labels(str(victim.status)).inc()
                raise ProxyError(
                    victim.status,
                    victim.message,
                    code="too_many_sessions",
                    headers={"Retry-After": "1"},
                )
            if self._store is not None:
                self._forget(victim)
            else:
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
        for hook in self.on_close:
            await hook(entry, reason)
        self._metrics.sessions_closed.labels(reason).inc()
        logger.info(
            "agentkv.proxy.session_closed",
            session_id=entry.session_id,
            principal=entry.key[0],
            reason=reason,
            turns=turns,
        )
