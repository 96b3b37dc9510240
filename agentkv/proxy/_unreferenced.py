"""Decode pins that no stored session references, released instead of living out decode's TTL.

With a shared store a turn's answer goes out before its commit (written behind), so a turn can
pin KV on decode that no snapshot ever names: its commit was refused (the claim lapsed), got no
answer (the store unreachable), or never ran (the replica died). Each claim records the request
secret its turn's D leg is tagged with (``SessionStore.claim(secret=...)``), and
``UnreferencedPins`` releases by it (``AsyncCluster.release_request``):

* a refused commit: at once, its own (``commit_refused``);
* a commit without an answer: only once the store says it did not land (``fence_off``), asked
  with backoff until it answers (``commit_lost``). Releasing blindly would free the blocks of a
  stored handle under the next turn's pull: wrong KV;
* a claim that ended mid-turn: its secret reaches the next claim (``Claim.orphans``), which
  releases it (``orphan``). A release that reaches decode before that leg ends keeps decode from
  pinning anything for it.

Everything runs in the background: a request never waits for a release.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

from agentkv._core import AsyncCluster, get_logger
from agentkv.proxy._metrics import ProxyMetrics
from agentkv.proxy._store import Claim, CommitFate, SessionStore, StoreUnavailableError

__all__ = ["FENCE_OFF_FOR_S", "FENCE_OFF_PAUSES_S", "UnreferencedPins"]

logger = get_logger("agentkv")

# How a replica whose commit got no answer asks the store again whether it landed: pauses
# doubling from the first to the last, for as long as decode could still hold the turn's pin
# (its TTL, 480 s by default, and a margin). Past that there is nothing left to release.
FENCE_OFF_PAUSES_S = (0.5, 30.0)
FENCE_OFF_FOR_S = 600.0


class UnreferencedPins:
    """One replica's background releases of unreferenced pins (see the module docstring)."""

    def __init__(self, cluster: AsyncCluster, store: SessionStore, metrics: ProxyMetrics) -> None:
        self._cluster = cluster
        self._store = store
        self._metrics = metrics
        self._releases: set[asyncio.Task[None]] = set()
        self._fence_offs: set[asyncio.Task[None]] = set()

    def orphans(self, session_id: str, claim: Claim) -> None:
        """Release what the turns of earlier claims that ended mid-turn pinned."""
        for secret in claim.orphans:
            self.release(session_id, secret, reason="orphan")

    def release(self, session_id: str, secret: str, *, reason: str) -> None:
        """Release what decode pinned for the D leg tagged with ``secret``."""

        async def release() -> None:
            taken = await self._cluster.release_request(secret)
            self._metrics.pins_released.labels(reason).inc()
            logger.info(
                "agentkv.proxy.pin_released", session_id=session_id, reason=reason, decodes=taken
            )

        self._start(release(), self._releases)

    def unanswered(self, session_id: str, claim: Claim) -> None:
        """A commit under ``claim`` got no answer: find out whether it landed, and release its
        turn's pin only when it certainly did not."""
        self._start(self._fence_off(session_id, claim), self._fence_offs)

    async def _fence_off(self, session_id: str, claim: Claim) -> None:
        pause, waited = FENCE_OFF_PAUSES_S[0], 0.0
        while waited < FENCE_OFF_FOR_S:
            await asyncio.sleep(pause)
            waited += pause
            pause = min(pause * 2, FENCE_OFF_PAUSES_S[1])
            try:
                fate = await self._store.fence_off(claim)
            except StoreUnavailableError:
                continue
            logger.info(
                "agentkv.proxy.commit_settled",
                session_id=session_id,
                fence=claim.fence,
                fate=fate.value,
            )
            if fate is CommitFate.LOST and claim.secret:
                self.release(session_id, claim.secret, reason="commit_lost")
            return
        logger.warning(
            "agentkv.proxy.commit_unsettled", session_id=session_id, fence=claim.fence
        )

    @staticmethod
    def _start(work: Coroutine[Any, Any, None], tasks: set[asyncio.Task[None]]) -> None:
        task = asyncio.ensure_future(work)
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    async def settled(self, *, fence_offs: bool = True) -> None:
        """Wait for the releases under way; with ``fence_offs`` false, cancel the commits still
        asking the store whether they landed (a replica stopping: its claims stay in the store,
        and the next claimant releases their pins as orphans)."""
        while self._releases or self._fence_offs:
            if not fence_offs:
                for task in self._fence_offs:
                    task.cancel()
            await asyncio.wait([*self._releases, *self._fence_offs])
