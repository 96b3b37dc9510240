"""The registry's shared-store half (``agentkv proxy --state``): sessions kept in a
``SessionStore`` that every replica reaches, the registry's own entries a cache in front of it.

* A checkout claims the session in the store after the local lock (one claim per replica at a
  time), and takes the stored snapshot when the cached copy is not exactly it; a checkin commits
  the snapshot and releases the claim. A claim whose lease ran out commits nothing.
* The commit is written behind: ``checkin`` returns at once, so the answer waits for one round
  trip (the claim), not two. The session stays checked out, locally and in the store, until the
  commit lands, so the next request for it, on this replica or another, runs after it; a read
  (``lookup``) that finds the session claimed waits a moment for a commit about to land.
* Dropping a cached copy (local eviction, shutdown, a replica killed) never releases the
  session's pin: another replica continues the session.
* A turn's pin that no stored snapshot will ever reference is released, not left for decode's
  TTL: each claim records its turn's D-leg request secret in the store, and ``_unreferenced``
  releases by it (a refused commit's, an unanswered one's that did not land, and those a claim
  that ended mid-turn left to the next claim). The pin a stored snapshot references is
  released only by a DELETE or the idle sweep, after removing the session from the store under
  a claim: exactly once, on whichever replica removed it. The idle persist moves a pinned
  session's KV to decode's file tier under a claim too, on one replica.

``SharedSessions`` is a base of ``SessionRegistry`` (``_registry``), which owns the entries and
their local lifecycle; the methods here are the ones that talk to the store. What bounds the
store (a cap on new sessions, the sweep that keeps up) is its base, ``StoreBounds``
(``_bounds``).
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable

from agentkv._core import AsyncCluster, AsyncSession, get_logger, kv
from agentkv.proxy._bounds import StoreBounds
from agentkv.proxy._entry import Key, SessionEntry, split_key, store_key
from agentkv.proxy._errors import ProxyError
from agentkv.proxy._metrics import ProxyMetrics
from agentkv.proxy._store import (
    Claim,
    ClaimLostError,
    SessionStore,
    Stored,
    StoreUnavailableError,
)
from agentkv.proxy._unreferenced import UnreferencedPins

__all__ = ["DIRTY_HANDOVER", "READ_PAUSES_S", "SharedSessions"]

logger = get_logger("agentkv")

# The pauses of a read that finds a session claimed elsewhere, about 50 ms in all: long enough
# for a commit written behind an answer to land (a round trip), short enough not to stall
# behind a turn still running there. Real time, whatever clock the registry is given.
READ_PAUSES_S = (0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.02)

# The handle_reason of a turn after a dirty handover (see ``SharedSessions._take``).
DIRTY_HANDOVER = (
    "the replica that held this session stopped mid-turn, and its turn may be using the stored "
    "handle: not attached (nor released) here"
)


class SharedSessions(StoreBounds):
    """The store side of ``SessionRegistry`` (see the module docstring)."""

    # Set by SessionRegistry.__init__.
    _store: SessionStore | None
    _cluster: AsyncCluster
    _metrics: ProxyMetrics
    _clock: Callable[[], float]
    _wall: Callable[[], float]
    _claim_wait_s: float
    _idle_timeout_s: float
    _entries: OrderedDict[Key, SessionEntry]
    _writes: set[asyncio.Task[None]]
    _pins: UnreferencedPins | None  # with a store: pins no stored snapshot references

    # Provided by SessionRegistry: the entries' local lifecycle.
    def _new_entry(self, key: Key, *, placement_key: str | None) -> SessionEntry:
        raise NotImplementedError

    def _fresh_session(self, key: Key, *, placement_key: str | None) -> AsyncSession:
        raise NotImplementedError

    def _opened(self, entry: SessionEntry) -> None:
        raise NotImplementedError

    def _forget(self, entry: SessionEntry) -> None:
        raise NotImplementedError

    def _expired(self, entry: SessionEntry) -> bool:
        raise NotImplementedError

    async def _close(self, entry: SessionEntry, reason: str) -> None:
        raise NotImplementedError

    async def _give_back(self, entry: SessionEntry) -> None:
        raise NotImplementedError

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
            entry.stored(stored.version, stored.data)
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

    async def _claim(self, entry: SessionEntry, *, placement_key: str | None) -> None:
        """Claim the checked-out ``entry`` in the store and make it the stored session."""
        store = self._store
        assert store is not None
        started = time.perf_counter()
        try:
            claim = await store.claim(
                store_key(*entry.key),
                known_version=entry.version,
                wait_s=self._claim_wait_s,
                # The D leg's tag, recorded before the turn: whatever becomes of this replica,
                # what decode pins for the turn can be found and released (module docstring).
                secret=secrets.token_hex(16),
            )
        except TimeoutError as exc:
            raise ProxyError(
                503, str(exc), code="session_busy", headers={"Retry-After": "1"}
            ) from exc
        except StoreUnavailableError as exc:
            raise ProxyError(
                503, str(exc), code="state_unavailable", headers={"Retry-After": "1"}
            ) from exc
        if claim.version == 0:
            await self._admit(entry, claim)
        entry.claim = claim
        self._release_orphans(entry, claim)
        if claim.data is not None:
            self._take(entry, claim)
        elif claim.version == 0 and entry.version != 0:
            # Deleted or expired elsewhere since this copy was made: a new session starts.
            entry.session.detach()
            entry.session = self._fresh_session(entry.key, placement_key=placement_key)
            entry.forks = 0
        if claim.version == 0:
            self._opened(entry)
        entry.version = claim.version
        entry.renewer = asyncio.ensure_future(self._renew(entry, claim))
        entry.store_s = time.perf_counter() - started

    def _take(self, entry: SessionEntry, claim: Claim) -> None:
        """Make ``entry`` the stored session when the claim brought it.

        After a clean handover the stored handle is as the last turn left it: attached at once.
        After a dirty one (the claim then always carries the snapshot, so that a cached copy
        from before that turn is not used either), the previous holder stopped mid-turn, and
        may only be slow: its turn may be pulling the handle right now. Asking decode cannot
        settle it (a prefill's pull checks no lease), so the handle is neither attached nor
        released: this turn recomputes, and the pin lives out its lease."""
        if claim.data is None:
            return
        if claim.dirty:
            entry.load_bytes(claim.data, self._cluster, drop_handle=DIRTY_HANDOVER)
        else:
            entry.load_bytes(claim.data, self._cluster, confirmed=True)
        entry.stored(claim.version, claim.data)

    def _release_orphans(self, entry: SessionEntry, claim: Claim) -> None:
        """Release what the turns of earlier claims that ended mid-turn pinned
        (``Claim.orphans``): no stored snapshot references it (``_unreferenced``)."""
        assert self._pins is not None
        self._pins.orphans(entry.session_id, claim)

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
        await entry.stop_renewing()
        if entry.closed:
            return
        if pinned is None:
            pinned = kv.leased_pin(entry.session._kv) is not None
        started = time.perf_counter()
        data = entry.to_bytes(wall=self._wall())
        # The token ids only grow from turn to turn: the commit sends the new ones when the
        # stored ones are this copy's (see ``SessionEntry.split``).
        tail, kept = entry.split(claim.version, data)
        try:
            entry.version = await store.commit(
                claim,
                data,
                used_at=self._wall() if used_at is None else used_at,
                pinned=pinned,
                tail=tail,
                kept=kept,
            )
            entry.stored(entry.version, data, tail=tail)
            self._metrics.commit_seconds.observe(time.perf_counter() - started)
        except ClaimLostError:
            # Another replica holds the session now: this copy is not the stored one, and the
            # turn's pin is referenced by nothing that will ever be read: released.
            entry.version = -1
            self._metrics.commit_failures.labels("refused").inc()
            logger.warning(
                "agentkv.proxy.commit_refused", session_id=entry.session_id, fence=claim.fence
            )
            if claim.secret:
                assert self._pins is not None
                self._pins.release(entry.session_id, claim.secret, reason="commit_refused")

    async def _write_behind(self, entry: SessionEntry) -> None:
        claim = entry.claim
        try:
            await self._settle(entry)
        except Exception as exc:
            # The answer is out; the store keeps the previous turn, or this one: the reply was
            # lost. The client's next request re-sends this turn's messages, which then fork
            # from what is stored if it is the previous turn: reuse lost, nothing else. The
            # turn's pin is released once the store says the commit never landed.
            entry.version = -1
            unreachable = isinstance(exc, StoreUnavailableError)
            self._metrics.commit_failures.labels("unreachable" if unreachable else "error").inc()
            logger.error(
                "agentkv.proxy.commit_failed",
                session_id=entry.session_id,
                detail=str(exc),
                exc_info=not unreachable,
            )
            if claim is not None and self._pins is not None:
                self._pins.unanswered(entry.session_id, claim)
        finally:
            entry.write = None
            await self._give_back(entry)

    async def written(self) -> None:
        """Wait until every commit written behind an answer has landed (or failed)."""
        while self._writes:
            await asyncio.wait(list(self._writes))

    async def released(self, *, fence_offs: bool = True) -> None:
        """Wait for the background releases of unreferenced pins (``_unreferenced``)."""
        if self._pins is not None:
            await self._pins.settled(fence_offs=fence_offs)

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
            self._release_orphans(entry, claim)
            self._take(entry, claim)
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

    async def _persist_idle_shared(self, idle_s: float) -> int:
        assert self._store is not None
        persisted = 0
        for key, used_at in await self._store.pinned_idle(before=self._wall() - idle_s, limit=1000):
            if await self._persist_stored(split_key(key), used_at=used_at):
                persisted += 1
        return persisted

    async def _idle_pinned_shared(
        self, pairs: set[str], *, limit: int
    ) -> list[tuple[Key, float | None]]:
        """Sessions the store lists as pinned, the longest idle first, not in use here (which
        pair each is on is known only once claimed: ``_persist_stored`` checks)."""
        assert self._store is not None
        del pairs
        listed = await self._store.pinned_idle(before=self._wall(), limit=limit)
        keys = [(split_key(key), used_at) for key, used_at in listed]
        return [(key, used) for key, used in keys if not self._in_use(key)]

    def _in_use(self, key: Key) -> bool:
        entry = self._entries.get(key)
        return entry is not None and entry.users > 0

    async def _persist_stored(
        self, key: Key, *, used_at: float, pairs: set[str] | None = None
    ) -> str | None:
        """Persist one stored session's pinned KV under a claim (skipped when in use anywhere),
        and commit it as no longer pinned whatever decode answered (a decode without a tier is
        not asked again until a turn pins anew). Its last use stays ``used_at``: persisting is
        no use, idle expiry still comes on time. ``persisted``, or ``None`` when nothing was.

        With ``pairs`` (pressure relief): only a pin on one of those pairs' decodes, released
        where decode has no tier (``AsyncSession.unpin``); ``persisted`` or ``released``."""
        store = self._store
        assert store is not None
        cached = self._entries.get(key)
        if cached is not None and cached.users:
            return None
        entry = cached or self._new_entry(key, placement_key=None)
        entry.users += 1
        await entry.lock.acquire()
        try:
            try:
                claim = await store.claim(store_key(*key), known_version=entry.version, wait_s=0.0)
            except TimeoutError:
                return None  # a turn runs on it somewhere: not idle
            self._release_orphans(entry, claim)
            self._take(entry, claim)
            session = entry.session
            handle = kv.handle_of(session._kv)
            elsewhere = pairs is not None and (handle is None or handle.pair not in pairs)
            if claim.version == 0 or elsewhere:
                await store.release(claim)  # removed meanwhile, or not where memory is short
                entry.version = claim.version
                return None
            entry.version = claim.version
            entry.claim = claim
            # Renewed while decode writes the tier, as a turn's claim is (``_claim``): a write
            # longer than the lease would lose it, and the commit after it be refused.
            renewer = entry.renewer = asyncio.ensure_future(self._renew(entry, claim))
            done: str | None = None
            try:
                if not session.closed and handle is not None:
                    if pairs is not None:
                        done = await session.unpin()
                    elif await session.offload() is not None:
                        done = "persisted"
            except BaseException:
                renewer.cancel()  # the claim's lease runs out on its own, as before
                entry.renewer = None
                raise
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
        return await self._sweep_store(before)
