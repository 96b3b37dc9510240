"""The tier's metric: P legs' tier references by outcome, on the API server's ``/metrics``.

The connector's scheduler side runs in the EngineCore process, whose Prometheus registry is not
the API server's. vLLM carries a connector's own stats across, and this is how NIXL's
``vllm:nixl_*`` metrics get there: every step the scheduler aggregates the connector's
``get_kv_connector_stats()`` (the workers' and the scheduler side's) into
``SchedulerStats.kv_connector_stats``, a plain dict; the API server rebuilds it with the
connector class's ``build_kv_connector_stats`` (its periodic log line) and records it with the
metrics that the class's ``build_prom_metrics`` registered. ``AgentKVConnector`` extends NIXL's
container and metrics by one list and one counter (this module is their pure part, no vLLM)::

    {"transfer_duration": [...], ..., "agentkv_tier_lookups": ["ok", "tokens", "ok"]}

    vllm:agentkv_tier_lookups_total{engine="0",model_name="...",reason="ok"} 2.0

One reason per finished request that carried a tier reference (``TierLoadReport.reason``: a
bounded set of words, so a bounded set of series). The name takes vLLM's prefix as NIXL's do:
vLLM unregisters ``vllm:`` collectors when it sets its metrics up again in one process.

>>> tier_summary({TIER_STATS_KEY: ["ok", "tokens", "ok"]})
{'Tier lookups ok': 2, 'Tier lookups tokens': 1}
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["METRIC_NAME", "TIER_STATS_KEY", "TierLookupMetric", "tier_reasons", "tier_summary"]

TIER_STATS_KEY = "agentkv_tier_lookups"
METRIC_NAME = "vllm:agentkv_tier_lookups"


def tier_reasons(outcomes: Mapping[str, int]) -> list[str]:
    """Counted outcomes (``TierScheduler.take_outcomes``) as the stats' list of reasons."""
    return [reason for reason, n in sorted(outcomes.items()) for _ in range(n)]


def tier_counts(data: Mapping[str, Any]) -> Counter[str]:
    values = data.get(TIER_STATS_KEY) or ()
    return Counter(str(reason) for reason in values)


def tier_summary(data: Mapping[str, Any]) -> dict[str, int]:
    """The tier's part of vLLM's periodic "KV Transfer metrics" log line."""
    return {f"Tier lookups {reason}": n for reason, n in sorted(tier_counts(data).items())}


class TierLookupMetric:
    """The counter ``vllm:agentkv_tier_lookups_total``, per engine and reason.

    ``counter_cls`` is the counter class vLLM hands a connector's metrics (``metric_types``);
    ``labelnames`` and ``per_engine_labelvalues`` are vLLM's (model name, engine index), the
    reason is the last label.
    """

    def __init__(self, counter_cls: Callable[..., Any], labelnames: Sequence[str],
                 per_engine_labelvalues: Mapping[int, Sequence[object]]) -> None:
        self._counter = counter_cls(
            name=METRIC_NAME,
            documentation="P legs that carried a KV file tier reference, by how it served: "
            "ok, cached (prefill held it already) or why it was cut (missing, expired, tokens, "
            "salt, lora, fingerprint, truncated, load_failed); recomputed tokens are never "
            "served from the tier.",
            labelnames=[*labelnames, "reason"],
        )
        self._labels = per_engine_labelvalues

    def observe(self, data: Mapping[str, Any], engine_idx: int = 0) -> None:
        labels = self._labels[engine_idx]
        for reason, n in tier_counts(data).items():
            self._counter.labels(*labels, reason).inc(n)
