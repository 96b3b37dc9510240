"""What bounds a shared store (``agentkv proxy --state``): how many sessions it holds, and an idle
sweep that keeps up with them.

* A new session (a claim of version 0) is refused while the store holds ``max_stored_sessions``
  (``SessionStore.count``): 503 ``too_many_sessions``, its claim released. Without it, each
  replica's ``--max-sessions`` bounded only its own copies, and the store grew with every
  session id any client sent.
* A session whose first turn failed is never stored: its claim is released, nothing committed
  (``SessionRegistry.checkin(failed=True)``).
* The idle sweep takes its keys from the store a page at a time (``SessionStore.take_idle``),
  each key handed to one replica only for ``SWEEP_HOLD_S``, and keeps taking pages while they
  come full, up to ``SWEEP_PAGES`` a tick, removing ``SWEEP_PARALLEL`` at a time. It used to read
  the same first 1,000 idle keys on every replica each tick: replicas raced for the same keys,
  and the fleet removed at most 1,000 per tick whatever the backlog.

``StoreBounds`` is a base of ``SharedSessions`` (``_shared``).
"""

from __future__ import annotations

import asyncio

from agentkv._core import get_logger
from agentkv.proxy._entry import SessionEntry, split_key
from agentkv.proxy._errors import ProxyError
from agentkv.proxy._metrics import ProxyMetrics
from agentkv.proxy._store import Claim, SessionStore, StoreUnavailableError

__all__ = ["SWEEP_HOLD_S", "SWEEP_PAGE", "SWEEP_PAGES", "SWEEP_PARALLEL", "StoreBounds"]

logger = get_logger("agentkv")

# The idle sweep, per replica and tick: pages of keys taken from the store, at most this many
# pages, each key removed under a claim, this many at a time (each removal is three round trips
# and a pin release on decode: in parallel they overlap). A key taken is not handed to another
# replica for ``SWEEP_HOLD_S``: long enough for a page to be removed; a key left over (its
# replica gone, or the session in use) is taken again after it.
SWEEP_PAGE = 1000
SWEEP_PAGES = 20
SWEEP_PARALLEL = 16
SWEEP_HOLD_S = 60.0


class StoreBounds:
    """The store's bounds, for ``SharedSessions`` (see the module docstring)."""

    # Set by SessionRegistry.__init__.
    _store: SessionStore | None
    _metrics: ProxyMetrics
    _max_stored: int
    _sweep_page: int

    # Provided by SharedSessions.
    async def _remove(
        self, principal: str, session_id: str, *, reason: str, idle_before: float | None = None
    ) -> bool:
        raise NotImplementedError

    async def _admit(self, entry: SessionEntry, claim: Claim) -> None:
        """Refuse a new session (its claim released) while the store holds its limit.

        One more round trip, on a session's first turn only. The count is of stored sessions:
        first turns still running can pass it together, by at most one each."""
        store = self._store
        assert store is not None
        try:
            stored = await store.count()
            if stored < self._max_stored:
                return
            await store.release(claim)
        except StoreUnavailableError as exc:
            raise ProxyError(
                503, str(exc), code="state_unavailable", headers={"Retry-After": "1"}
            ) from exc
        self._metrics.sessions_refused.labels("store").inc()
        logger.warning("agentkv.proxy.store_full", session_id=entry.session_id, stored=stored)
        raise ProxyError(
            503,
            f"the session store holds its limit of {self._max_stored} sessions; retry when "
            "idle ones have expired, or continue an existing session",
            code="too_many_sessions",
            headers={"Retry-After": "15"},
        )

    async def _release_claim(self, entry: SessionEntry) -> None:
        """Give the entry's claim back without writing (a turn that left nothing to store)."""
        store, claim = self._store, entry.claim
        if store is None or claim is None:
            return
        entry.claim = None
        await entry.stop_renewing()
        try:
            await store.release(claim)
        except StoreUnavailableError as exc:
            # The lease runs out on its own; nothing was stored either way.
            logger.warning(
                "agentkv.proxy.release_failed", session_id=entry.session_id, detail=str(exc)
            )

    async def _sweep_store(self, before: float) -> int:
        """Remove the stored sessions last used before ``before`` that this replica is handed;
        return how many it removed."""
        store = self._store
        assert store is not None
        gate = asyncio.Semaphore(SWEEP_PARALLEL)

        async def remove(key: str) -> bool:
            async with gate:
                principal, session_id = split_key(key)
                return await self._remove(principal, session_id, reason="idle", idle_before=before)

        closed = 0
        for _ in range(SWEEP_PAGES):
            keys = await store.take_idle(before=before, limit=self._sweep_page, hold_s=SWEEP_HOLD_S)
            done = await asyncio.gather(*(remove(key) for key in keys), return_exceptions=True)
            closed += sum(result is True for result in done)
            failure = next((r for r in done if isinstance(r, BaseException)), None)
            if failure is not None:
                raise failure  # its keys are taken again once their hold ends; the sweeper logs
            if len(keys) < self._sweep_page:
                break
        return closed
