"""Decode's memory during a run: its KV usage and preemptions, sampled from ``/metrics``.

Every ``interval_s`` one GET per decode server reads two series of vLLM's exposition:
``vllm:kv_cache_usage_perc`` (a gauge, 0-1: pinned turn-end KV counts, as running requests do)
and ``vllm:num_preemptions_total`` (a counter: running requests the scheduler pushed back for
lack of blocks). The readings are grouped by phase (a mode, when modes run one at a time, else
the whole run) and summarized as peak and mean usage and the preemptions the phase added.

>>> text = 'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5\\n'
>>> parse_reading(text + 'vllm:num_preemptions_total{engine="0",model_name="m"} 3.0\\n')
Reading(kv_usage=0.5, preemptions=3.0)
>>> summarize_phase([Reading(kv_usage=0.25, preemptions=3.0),
...                  Reading(kv_usage=0.75, preemptions=5.0)])
{'samples': 2, 'kv_usage_peak': 0.75, 'kv_usage_mean': 0.5, 'preemptions': 2}
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx2

from agentkv._core import sample_values

__all__ = [
    "DEFAULT_INTERVAL_S",
    "DecodeWatch",
    "Reading",
    "parse_reading",
    "summarize_phase",
    "watch_decode",
]

KV_USAGE = "vllm:kv_cache_usage_perc"
PREEMPTIONS = "vllm:num_preemptions_total"
DEFAULT_INTERVAL_S = 0.5


@dataclass(frozen=True, kw_only=True, slots=True)
class Reading:
    """One scrape of one decode server: KV usage (the fullest engine) and its preemption count
    (summed over engines); ``None`` for a series the server did not export."""

    kv_usage: float | None
    preemptions: float | None


def parse_reading(text: str) -> Reading:
    """The two series of a ``/metrics`` answer (``sample_values``: a scan of their lines, not a
    parse of vLLM's tens of kilobytes of histograms, read twice a second)."""
    usage = sample_values(text, KV_USAGE)
    preemptions = sample_values(text, PREEMPTIONS)
    return Reading(kv_usage=max(usage) if usage else None,
                   preemptions=sum(preemptions) if preemptions else None)


def summarize_phase(readings: Sequence[Reading]) -> dict[str, Any]:
    """Samples, peak and mean KV usage, and the preemptions between the first and last reading
    of one server in one phase (``None`` where the series was missing)."""
    usage = [r.kv_usage for r in readings if r.kv_usage is not None]
    counts = [r.preemptions for r in readings if r.preemptions is not None]
    return {
        "samples": len(readings),
        "kv_usage_peak": round(max(usage), 4) if usage else None,
        "kv_usage_mean": round(statistics.fmean(usage), 4) if usage else None,
        # A restarted server starts its counter again: never a negative count.
        "preemptions": round(max(0.0, counts[-1] - counts[0])) if counts else None,
    }


@dataclass(kw_only=True)
class DecodeWatch:
    """The readings of a run, by phase and server."""

    servers: tuple[str, ...]
    interval_s: float = DEFAULT_INTERVAL_S
    readings: dict[str, dict[str, list[Reading]]] = field(default_factory=dict)

    def record(self, phase: str, server: str, reading: Reading) -> None:
        self.readings.setdefault(phase, {}).setdefault(server, []).append(reading)

    def summary(self) -> dict[str, Any]:
        """``{"interval_s", "phases": {phase: {server: summary}}}`` (see ``summarize_phase``):
        one block per decode server, so that a pool's servers stay apart."""
        return {
            "interval_s": self.interval_s,
            "phases": {
                phase: {server: summarize_phase(rows) for server, rows in servers.items()}
                for phase, servers in self.readings.items()
            },
        }

    def peak(self, phase: str) -> dict[str, Any] | None:
        """The phase over all servers: the highest peak, the mean of the means, the summed
        preemptions (``None`` when nothing was read in it)."""
        servers = [summarize_phase(rows) for rows in self.readings.get(phase, {}).values()]
        if not servers:
            return None
        peaks = [s["kv_usage_peak"] for s in servers if s["kv_usage_peak"] is not None]
        means = [s["kv_usage_mean"] for s in servers if s["kv_usage_mean"] is not None]
        counts = [s["preemptions"] for s in servers if s["preemptions"] is not None]
        return {
            "samples": sum(s["samples"] for s in servers),
            "kv_usage_peak": max(peaks) if peaks else None,
            "kv_usage_mean": round(statistics.fmean(means), 4) if means else None,
            "preemptions": sum(counts) if counts else None,
        }


async def _scrape(client: httpx2.AsyncClient, url: str, timeout_s: float) -> Reading | None:
    try:
        response = await client.get(url + "/metrics", timeout=timeout_s)
    except httpx2.HTTPError:
        return None
    if response.status_code != 200:
        return None
    return parse_reading(response.text)


@contextlib.asynccontextmanager
async def watch_decode(
    client: httpx2.AsyncClient, watch: DecodeWatch, *, phase: str
) -> AsyncIterator[DecodeWatch]:
    """Sample ``watch.servers`` every ``watch.interval_s`` while the block (the ``phase``)
    runs, and once at its start and end, so that the phase's preemptions are counted from edge
    to edge. A failed scrape is skipped: the watch documents the run, it never fails it."""

    async def sample() -> None:
        readings = await asyncio.gather(
            *(_scrape(client, url, watch.interval_s * 4) for url in watch.servers)
        )
        for url, reading in zip(watch.servers, readings, strict=True):
            if reading is not None:
                watch.record(phase, url, reading)

    async def loop() -> None:
        while True:
            await asyncio.sleep(watch.interval_s)
            await sample()

    await sample()
    task = asyncio.create_task(loop())
    try:
        yield watch
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await sample()
