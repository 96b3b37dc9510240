"""Decode memory pressure: idle sessions' pins freed as a decode's KV memory nears full.

Through the proxy the last turn of every conversation keeps its pin until the session's idle
offload (``--offload-idle``, 120 s) or its idle timeout, whether or not anyone will send the
next turn. Served back to back, finished conversations fill decode with pins nobody reads, and
new turns queue behind them at decode. ``PressureRelief`` watches each decode's
``vllm:kv_cache_usage_perc`` and, at or above ``high``, frees pins of idle sessions on it, the
longest idle first, until it is below ``low`` (at most ``budget`` a pass): offloaded to
decode's file tier where it has one (the next turn loads them back), else released (the next
turn recomputes, from prefill's prefix cache where it still holds the history). A session in
use is never touched; each is checked out as a request would be, so no turn can carry a handle
while decode frees it.

>>> pressured({"pair-0": 0.95, "pair-1": 0.4, "pair-2": None}, high=0.9)
{'pair-0'}
>>> budget(usage=0.95, low=0.8, idle_pins=10)
2
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from typing import Protocol

from agentkv._core import AsyncCluster, get_logger
from agentkv.proxy._entry import Key
from agentkv.proxy._metrics import ProxyMetrics

__all__ = ["PressureRelief", "UnpinTarget", "budget", "pressured"]

logger = get_logger("agentkv")



def pressured(usage: Mapping[str, float | None], *, high: float) -> set[str]:
    """The pairs whose decode's KV usage is at or above ``high`` (unknown usage: not)."""
    return {pair for pair, used in usage.items() if used is not None and used >= high}


def budget(*, usage: float, low: float, idle_pins: int) -> int:
    """How many idle pins one pass frees at most: as many as bring ``usage`` to ``low`` if
    each held an equal share of it (at least one).

    Each share is overestimated (running requests and busy sessions hold memory too), so a pass
    frees too few rather than too many, and the next pass frees more. Usage is read again after
    each free, and the pass stops once it is below ``low``; the budget also bounds a pass when
    that reading lags (decode publishes it from its engine's steps).
    """
    if idle_pins <= 0 or usage <= low:
        return 0
    return max(1, math.ceil(idle_pins * (usage - low) / usage))


class UnpinTarget(Protocol):
    """What relief needs of the registry: idle pinned sessions, and freeing one's pin."""

    async def idle_pinned(
        self, pairs: set[str], *, limit: int
    ) -> list[tuple[Key, float | None]]:
        """Idle sessions whose pins may be on one of ``pairs``, the longest idle first, each
        with its last use (wall clock) where the registry knows it."""
        ...

    async def unpin(self, key: Key, *, used_at: float | None, pairs: set[str]) -> str | None:
        """Free one idle session's pin if it is still idle and on one of ``pairs``:
        ``persisted`` (offloaded: the session's word until issue 41's rename lands), ``released``,
        or ``None`` when nothing was freed."""
        ...


class PressureRelief:
    """Frees idle sessions' pins on decodes whose memory nears full (module docstring)."""

    def __init__(
        self,
        cluster: AsyncCluster,
        target: UnpinTarget,
        *,
        high: float,
        low: float,
        metrics: ProxyMetrics,
        limit: int = 256,
    ) -> None:
        if not 0 < low < high <= 1:
            raise ValueError(f"pressure relief needs 0 < low < high <= 1, got {low}, {high}")
        self._cluster = cluster
        self._target = target
        self._high = high
        self._low = low
        self._metrics = metrics
        self._limit = limit

    async def relieve(self) -> int:
        """One pass: how many sessions' pins were freed."""
        usage = await self._cluster.kv_usage()
        pairs = pressured(usage, high=self._high)
        if not pairs:
            return 0
        started = time.perf_counter()
        before = {pair: usage[pair] for pair in sorted(pairs)}
        keys = await self._target.idle_pinned(pairs, limit=self._limit)
        most = max(usage[pair] or 0.0 for pair in pairs)
        allowed = budget(usage=most, low=self._low, idle_pins=len(keys))
        freed = 0
        for key, used_at in keys:
            if freed >= allowed:
                break
            done = await self._target.unpin(key, used_at=used_at, pairs=pairs)
            if done is None:
                continue
            freed += 1
            self._metrics.pins_relieved.labels(done).inc()
            usage = await self._cluster.kv_usage()
            pairs = {p for p in pairs if (usage.get(p) or 0.0) >= self._low}
            if not pairs:
                break
        logger.info(
            "agentkv.proxy.pressure_relieved",
            kv_usage_before=before,
            kv_usage_after={pair: usage.get(pair) for pair in before},
            candidates=len(keys),
            freed=freed,
            ms=round((time.perf_counter() - started) * 1000.0, 3),
        )
        return freed
