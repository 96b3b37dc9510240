"""``AgentKVConnector``'s stats: NIXL's transfer stats and metrics, plus the tier's lookups.

The vLLM-bound half of ``_tier_stats`` (which says how these reach the API server's
``/metrics``): vLLM builds these classes from the connector class on both sides of the process
boundary.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import (
    NixlKVConnectorStats,
    NixlPromMetrics,
)

from agentkv.connector._tier_stats import TIER_STATS_KEY, TierLookupMetric, tier_summary

__all__ = ["AgentKVConnectorStats", "AgentKVPromMetrics"]


class AgentKVConnectorStats(NixlKVConnectorStats):  # type: ignore[misc]  # vLLM is untyped here
    """NIXL's transfer stats and the tier's lookup reasons in one container (``_tier_stats``):
    vLLM aggregates the workers' and the scheduler side's stats into one object, so both carry
    every key."""

    def __post_init__(self) -> None:
        given = self.data
        self.reset()
        for key, values in (given or {}).items():
            self.data[key] = list(values)

    def reset(self) -> None:
        super().reset()
        self.data[TIER_STATS_KEY] = []

    def is_empty(self) -> bool:
        return bool(super().is_empty()) and not self.data[TIER_STATS_KEY]

    def aggregate(self, other: Any) -> Any:
        for key, values in other.data.items():
            self.data.setdefault(key, []).extend(values)
        return self

    def reduce(self) -> dict[str, int | float]:
        return {**super().reduce(), **tier_summary(self.data)}


class AgentKVPromMetrics(NixlPromMetrics):  # type: ignore[misc]  # vLLM is untyped here
    """NIXL's metrics and ``vllm:agentkv_tier_lookups_total`` (``_tier_stats``)."""

    def __init__(self, vllm_config: Any, metric_types: Any, labelnames: Any,
                 per_engine_labelvalues: Any) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._tier = TierLookupMetric(self._counter_cls, labelnames, per_engine_labelvalues)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        super().observe(transfer_stats_data, engine_idx)
        self._tier.observe(transfer_stats_data, engine_idx)
