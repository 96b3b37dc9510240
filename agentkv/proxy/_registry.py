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

With a shared ``SessionStore`` (``agentkv proxy --state redis://...``) the registry is a cache in
front of the store, and the store is the truth (see ``_store``):

* A checkout claims the session in the store after the local lock (one claim per replica at a
  time), and takes the stored snapshot when the cached copy is not exactly it; a checkin commits
  the snapshot and releases the claim. A claim whose lease ran out commits nothing.
* The commit is written behind: ``checkin`` returns at once, so the answer waits for one round
  trip (the claim), not two. The session stays checked out, locally and in the store, until the
  commit lands, so the next request for it, on this replica or another, runs after it; a read
  (``lookup``) that finds the session claimed waits a moment for a commit about to land.
* Dropping a cached copy (local eviction, shutdown, a replica killed) never releases the
  session's pin: another replica continues the session. Only a DELETE or the idle sweep, after
  removing the session from the store under a claim, releases it: exactly once, on whichever
  replica removed it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import structlog

from agentkv import AsyncCluster, AsyncSession, Message, SessionClosedError
from agentkv._wire.json import dumps, loads
from agentkv.proxy._errors import ProxyError
from agentkv.proxy._metrics import ProxyMetrics
from agentkv.proxy._store import (
    Claim,
    ClaimLostError,
    SessionStore,
    Stored,
    StoreUnavailableError,
)

__all__ = ["SessionEntry", "SessionRegistry"]

logger = structlog.get_logger("agentkv")

Key = tuple[str, str]

# The pauses of a read that finds a session claimed elsewhere, about 50 ms in all: long enough
# for a commit written behind an answer to land (a round trip), short enough not to stall
# behind a turn still running there. Real time, whatever clock the registry is given.
READ_PAUSES_S = (0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.02)


class SessionEntry:
    """One open session and the proxy's bookkeeping around it.

    ``generated`` holds the indices of the session's messages the model generated (their echoes
    are matched by meaning, see ``_mapping``); ``tools_key`` the tools its transcript was rendered
    with (``None`` before the first turn).
    """

    __slots__ = (
        "claim",
        "closed",
        "created_at",
        "forks",
        "generated",
        "key",
        "last_used",
        "lock",
        "persist_tried",
        "renewer",
        "session",
        "store_s",
        "tools_key",
        "users",
        "version",
        "views",
        "write",
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
        # The idle sweep tried to persist this session's pin (reset when a request uses it).
        self.persist_tried = False
        # With a shared store: the stored version this copy is, the claim held while checked out.
        self.version = 0
        self.claim: Claim | None = None
        self.renewer: asyncio.Task[None] | None = None
        # The checkin writing this entry's commit behind its answer (shared store only).
        self.write: asyncio.Task[None] | None = None
        # Seconds the request holding this entry waited on the shared store (the claim, with the
        # restore when the copy was stale; the commit comes after the answer): the proxy reports
        # it in ``Server-Timing: store``.
        self.store_s = 0.0

    @property
    def session_id(self) -> str:
        return self.key[1]

    def to_bytes(self, *, wall: float) -> bytes:
        """The entry as the shared store keeps it: the session's snapshot and the mapping."""
        return dumps(
            {
                "session": self.session.snapshot(wall=wall),
                "generated": sorted(self.generated),
                "views": {str(i): view.to_openai() for i, view in self.views.items()},
                "tools_key": self.tools_key,
                "forks": self.forks,
                "created_at": self.created_at,
            }
        )

    def load_bytes(self, data: bytes, cluster: AsyncCluster) -> None:
        """Replace this copy with the stored one (the old copy is detached, its pin kept)."""
        stored: dict[str, Any] = loads(data)
        session = cluster.restore_session(stored["session"])
        self.session.detach()
        self.session = session
        self.generated = set(stored["generated"])
        self.views = {int(i): Message.from_openai(v) for i, v in stored["views"].items()}
        self.tools_key = stored["tools_key"]
        self.forks = stored["forks"]
        self.created_at = stored["created_at"]


def store_key(principal: str, session_id: str) -> str:
    """The shared store's key of a session: unambiguous whatever either part contains."""
    return f"{len(principal)}:{principal}:{session_id}"


def _split_key(key: str) -> tuple[str, str]:
    length, _, rest = key.partition(":")
    n = int(length)
    return rest[:n], rest[n + 1 :]


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
        store: SessionStore | None = None,
        claim_wait_s: float = 600.0,
        wall_clock: Callable[[], float] = time.time,
        persist_idle_s: float | None = None,
    ) -> None:
        self._persist_idle_s = persist_idle_s
        self._cluster = cluster
        self._store = store
        self._claim_wait_s = claim_wait_s
        self._wall = wall_clock
        self._max = max_sessions
        self._idle_timeout_s = idle_timeout_s
        self._metrics = metrics
        self._clock = clock
        # Ordered by last checkout, oldest first: eviction scans from the front.
        self._entries: OrderedDict[Key, SessionEntry] = OrderedDict()
        # Checkins whose commit is still being written behind their answer.
        self._writes: set[asyncio.Task[None]] = set()

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

    async def _lookup_shared(self, principal: str, session_id: str) -> SessionEntry | None:
        assert self._store is not None
        key = (principal, session_id)
        entry = self._entries.get(key)
        if entry is not None:
            await self._written(entry)  # a commit written behind an answer from here
        if entry is not None and entry.claim is not None:
            # A turn runs here now: what is stored is the state before it; nothing to wait for.
            stored = await self._store.peek(store_key(principal, session_id))
        else:
            stored = await self._peek(store_key(principal, session_id))
        entry = self._entries.get(key)
        if stored.data is None:
            if entry is not None and entry.users == 0:
                self._forget(entry)
            return None
        if entry is None:
            entry = self._new_entry(key, placement_key=None)
        if entry.version != stored.version and entry.users == 0:
            entry.load_bytes(stored.data, self._cluster)
            entry.version = stored.version
        return entry

    async def _peek(self, key: str) -> Stored:
        """The stored session; while another replica holds it, wait a moment (``READ_PAUSES_S``)
        for the commit that an answer already sent may still be writing."""
        assert self._store is not None
        stored = await self._store.peek(key)
        for pause in READ_PAUSES_S:
            if not stored.claimed:
                break
            await asyncio.sleep(pause)
            stored = await self._store.peek(key)
        return stored

    @staticmethod
    async def _written(entry: SessionEntry) -> None:
        """Wait until no checkin of ``entry`` is still writing behind its answer."""
        if entry.write is not None:
            await asyncio.wait([entry.write])

    def _fresh_session(self, key: Key, *, placement_key: str | None) -> AsyncSession:
        principal, session_id = key
        return self._cluster.session(
            session_id=f"{principal}:{session_id}", placement_key=placement_key
        )

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
            await self._make_room()
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
                await self.checkin(entry)
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

    async def _claim(self, entry: SessionEntry, *, placement_key: str | None) -> None:
        """Claim the checked-out ``entry`` in the store and make it the stored session."""
        store = self._store
        assert store is not None
        started = time.perf_counter()
        try:
            claim = await store.claim(
                store_key(*entry.key), known_version=entry.version, wait_s=self._claim_wait_s
            )
        except TimeoutError as exc:
            raise ProxyError(
                503, str(exc), code="session_busy", headers={"Retry-After": "1"}
            ) from exc
        except StoreUnavailableError as exc:
            raise ProxyError(
                503, str(exc), code="state_unavailable", headers={"Retry-After": "1"}
            ) from exc
        entry.claim = claim
        if claim.data is not None:
            entry.load_bytes(claim.data, self._cluster)
        elif claim.version == 0 and entry.version != 0:
            # Deleted or expired elsewhere since this copy was made: a new session starts.
            entry.session.detach()
            entry.session = self._fresh_session(entry.key, placement_key=placement_key)
            entry.generated, entry.views, entry.tools_key, entry.forks = set(), {}, None, 0
        if claim.version == 0:
            self._opened(entry)
        entry.version = claim.version
        entry.renewer = asyncio.ensure_future(self._renew(entry, claim))
        entry.store_s = time.perf_counter() - started

    async def _renew(self, entry: SessionEntry, claim: Claim) -> None:
        store = self._store
        assert store is not None
        period = store.lease_s / 3
        while True:
            await asyncio.sleep(period)
            if not await store.renew(claim):
                logger.warning(
                    "agentkv.proxy.claim_lost", session_id=entry.session_id, fence=claim.fence
                )
                return

    async def _settle(
        self, entry: SessionEntry, *, used_at: float | None = None, pinned: bool | None = None
    ) -> None:
        """Commit the entry to the store and release its claim (checkin, shared mode).

        ``used_at`` is the session's last use (now: a request just used it); ``pinned`` whether
        its KV is pinned on decode, a candidate for the idle persist (by default: it holds a
        leased handle and no tier entry)."""
        store, claim = self._store, entry.claim
        if store is None or claim is None:
            return
        entry.claim = None
        renewer, entry.renewer = entry.renewer, None
        if renewer is not None:
            renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await renewer
        if entry.closed:
            return
        if pinned is None:
            handle, session = entry.session.handle, entry.session
            pinned = handle is not None and handle.leased and session.tier is None
        started = time.perf_counter()
        try:
            entry.version = await store.commit(
                claim,
                entry.to_bytes(wall=self._wall()),
                used_at=self._wall() if used_at is None else used_at,
                pinned=pinned,
            )
            self._metrics.commit_seconds.observe(time.perf_counter() - started)
        except ClaimLostError:
            # Another replica holds the session now: this copy is not the stored one.
            entry.version = -1
            self._metrics.commit_failures.labels("refused").inc()
            logger.warning(
                "agentkv.proxy.commit_refused", session_id=entry.session_id, fence=claim.fence
            )

    async def checkin(self, entry: SessionEntry) -> None:
        """Give the session back; a session deleted meanwhile is closed by its last user.

        With a shared store the commit is written behind the answer: this returns at once, and
        the session stays checked out (here and in the store) until the commit has landed.
        """
        if entry.claim is not None and not entry.closed:
            write = asyncio.get_running_loop().create_task(self._write_behind(entry))
            entry.write = write
            self._writes.add(write)
            write.add_done_callback(self._writes.discard)
            return
        await self._settle(entry)
        await self._give_back(entry)

    async def _write_behind(self, entry: SessionEntry) -> None:
        try:
            await self._settle(entry)
        except StoreUnavailableError as exc:
            # The answer is out; the store keeps the previous turn. The client's next request
            # re-sends this turn's messages, which then fork from what is stored: reuse lost,
            # nothing else. The claim's lease runs out on its own.
            entry.version = -1
            self._metrics.commit_failures.labels("unreachable").inc()
            logger.error(
                "agentkv.proxy.commit_failed", session_id=entry.session_id, detail=str(exc)
            )
        except Exception:
            entry.version = -1
            logger.exception("agentkv.proxy.commit_failed", session_id=entry.session_id)
        finally:
            entry.write = None
            await self._give_back(entry)

    async def _give_back(self, entry: SessionEntry) -> None:
        entry.lock.release()
        entry.users -= 1
        entry.last_used = self._clock()
        entry.persist_tried = False
        if entry.closed and entry.users == 0:
            await entry.session.aclose()

    async def written(self) -> None:
        """Wait until every commit written behind an answer has landed (or failed)."""
        while self._writes:
            await asyncio.wait(list(self._writes))

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
        if self._store is not None:
            return await self._remove(principal, session_id, reason="deleted")
        entry = await self.lookup(principal, session_id)
        if entry is None:
            return False
        await self._close(entry, "deleted")
        return True

    async def _remove(
        self, principal: str, session_id: str, *, reason: str, idle_before: float | None = None
    ) -> bool:
        """Remove a stored session under a claim; the one replica that removed it releases its
        pin. ``False`` when there was none (or, for the sweep, it was used meanwhile)."""
        store = self._store
        assert store is not None
        key = (principal, session_id)
        cached = self._entries.get(key)
        if idle_before is not None and cached is not None and cached.users:
            return False  # in use here: not idle (and the sweep must not wait for it)
        entry = cached or self._new_entry(key, placement_key=None)
        entry.users += 1
        await entry.lock.acquire()
        try:
            claim = await store.claim(
                store_key(*key),
                known_version=entry.version,
                wait_s=0.0 if idle_before is not None else self._claim_wait_s,
            )
        except TimeoutError:
            entry.lock.release()
            entry.users -= 1
            return False  # in use elsewhere: not idle, or deleted once that request ends
        try:
            if claim.data is not None:
                entry.load_bytes(claim.data, self._cluster)
            removed = claim.version != 0 and await store.remove(claim, idle_before=idle_before)
        finally:
            await store.release(claim)
            entry.lock.release()
            entry.users -= 1
        if not removed:
            if claim.version == 0:
                self._forget(entry)
            return False
        await self._close(entry, reason)
        return True

    async def sweep(self) -> int:
        """Close every session idle past the timeout; return how many."""
        if self._store is not None:
            return await self._sweep_shared()
        expired = [entry for entry in self._entries.values() if self._expired(entry)]
        for entry in expired:
            await self._close(entry, "idle")
        return len(expired)

    async def persist_idle(self) -> int:
        """Persist the pinned KV of sessions idle past ``persist_idle_s`` to decode's file tier;
        return how many were persisted.

        Each is checked out as a request would be (its lock held), so no turn can carry the
        handle while decode writes it; a session is tried once per idle period (a decode
        without a tier answers once, not every sweep). With a shared store, the store lists the
        candidates (``pinned_idle``) and any one replica persists each.
        """
        if self._persist_idle_s is None:
            return 0
        if self._store is not None:
            return await self._persist_idle_shared(self._persist_idle_s)
        persisted = 0
        now = self._clock()
        for entry in list(self._entries.values()):
            session = entry.session
            if (
                entry.users
                or entry.closed
                or entry.persist_tried
                or now - entry.last_used < self._persist_idle_s
                or session.handle is None
                or session.tier is not None
            ):
                continue
            entry.persist_tried = True
            entry.users += 1
            try:
                async with entry.lock:
                    if not entry.closed and await session.persist() is not None:
                        persisted += 1
            finally:
                entry.users -= 1
        return persisted

    async def _persist_idle_shared(self, idle_s: float) -> int:
        assert self._store is not None
        persisted = 0
        for key, used_at in await self._store.pinned_idle(before=self._wall() - idle_s, limit=1000):
            if await self._persist_stored(_split_key(key), used_at=used_at):
                persisted += 1
        return persisted

    async def _persist_stored(self, key: Key, *, used_at: float) -> bool:
        """Persist one stored session's pinned KV under a claim (skipped when in use anywhere),
        and commit it as no longer pinned whatever decode answered (a decode without a tier is
        not asked again until a turn pins anew). Its last use stays ``used_at``: persisting is
        no use, idle expiry still comes on time."""
        store = self._store
        assert store is not None
        cached = self._entries.get(key)
        if cached is not None and cached.users:
            return False
        entry = cached or self._new_entry(key, placement_key=None)
        entry.users += 1
        await entry.lock.acquire()
        try:
            try:
                claim = await store.claim(store_key(*key), known_version=entry.version, wait_s=0.0)
            except TimeoutError:
                return False  # a turn runs on it somewhere: not idle
            if claim.data is not None:
                entry.load_bytes(claim.data, self._cluster)
            if claim.version == 0:  # removed meanwhile
                await store.release(claim)
                entry.version = 0
                return False
            entry.version = claim.version
            entry.claim = claim
            session = entry.session
            done = (
                not session.closed
                and session.handle is not None
                and session.tier is None
                and await session.persist() is not None
            )
            await self._settle(entry, used_at=used_at, pinned=False)
            return done
        finally:
            entry.lock.release()
            entry.users -= 1
            if cached is None and entry.users == 0 and self._entries.get(key) is entry:
                self._forget(entry)  # a copy made for this only: the store keeps the session

    async def _sweep_shared(self) -> int:
        assert self._store is not None
        for entry in [e for e in self._entries.values() if self._expired(e)]:
            self._forget(entry)  # a cached copy only: the store decides what is idle
        before = self._wall() - self._idle_timeout_s
        closed = 0
        for key in await self._store.idle(before=before, limit=1000):
            principal, session_id = _split_key(key)
            if await self._remove(principal, session_id, reason="idle", idle_before=before):
                closed += 1
        return closed

    async def close_all(self) -> None:
        await self.written()  # a replica that stops first stores the turns it answered
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
        self._metrics.sessions_closed.labels(reason).inc()
        logger.info(
            "agentkv.proxy.session_closed",
            session_id=entry.session_id,
            principal=entry.key[0],
            reason=reason,
            turns=turns,
        )
