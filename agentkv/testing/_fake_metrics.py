"""Prometheus exposition of the fake engine's counters, under vLLM's metric names.

Names, help texts, label names and buckets are copied from ``vllm/v1/metrics/loggers.py`` and
``vllm/distributed/kv_transfer/kv_connector/v1/nixl/stats.py`` (vLLM 0.32). As with
``prometheus_client``, counters gain a ``_total`` suffix and labels are sorted. The
``*_created`` series prometheus_client adds are left out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

_FINISH_REASONS: Final = ("stop", "length", "abort", "error", "repetition")
# fmt: off
_XFER_TIME_BUCKETS: Final = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0,
)
_POST_TIME_BUCKETS: Final = (0.001, *_XFER_TIME_BUCKETS)
_BYTES_BUCKETS: Final = tuple(float(2 ** (10 + i)) for i in range(1, 25, 2))
_DESCRIPTOR_BUCKETS: Final = (
    10.0, 20.0, 30.0, 50.0, 75.0, 100.0, 200.0, 400.0, 1000.0, 2000.0, 4000.0, 10000.0,
    20000.0, 50000.0,
)
# fmt: on


@dataclass
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    count: int = 0
    total: float = 0.0

    def observe(self, value: float) -> None:
        if not self.counts:
            self.counts = [0] * len(self.buckets)
        for i, upper in enumerate(self.buckets):
            if value <= upper:
                self.counts[i] += 1
        self.count += 1
        self.total += value


@dataclass
class EngineStats:
    """Counters one fake engine keeps (reset when the server restarts, as a process would)."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    prompt_tokens_cached: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0
    request_success: dict[str, int] = field(default_factory=dict)
    nixl_failed_transfers: int = 0
    nixl_failed_notifications: int = 0
    nixl_kv_expired_reqs: int = 0
    nixl_notifications_after_expiry: int = 0
    nixl_xfer_time: Histogram = field(default_factory=lambda: Histogram(_XFER_TIME_BUCKETS))
    nixl_post_time: Histogram = field(default_factory=lambda: Histogram(_POST_TIME_BUCKETS))
    nixl_bytes: Histogram = field(default_factory=lambda: Histogram(_BYTES_BUCKETS))
    nixl_descriptors: Histogram = field(default_factory=lambda: Histogram(_DESCRIPTOR_BUCKETS))

    def record_finish(self, reason: str) -> None:
        self.request_success[reason] = self.request_success.get(reason, 0) + 1

    def record_transfer(self, *, num_bytes: int, num_descriptors: int) -> None:
        self.nixl_xfer_time.observe(0.001 + num_bytes / 10e9)
        self.nixl_post_time.observe(0.0001)
        self.nixl_bytes.observe(float(num_bytes))
        self.nixl_descriptors.observe(float(num_descriptors))


def render_metrics(stats: EngineStats, *, model: str, kv_cache_usage: float) -> str:
    """The text ``GET /metrics`` returns."""
    labels = f'engine="0",model_name="{model}"'
    out: list[str] = []

    def family(name: str, kind: str, doc: str, samples: list[tuple[str, str, float]]) -> None:
        out.append(f"# HELP {name} {doc}")
        out.append(f"# TYPE {name} {kind}")
        out.extend(f"{sample}{{{lbl}}} {float(value)!r}" for sample, lbl, value in samples)

    def gauge(name: str, doc: str, value: float) -> None:
        family(name, "gauge", doc, [(name, labels, value)])

    def counter(name: str, doc: str, value: float) -> None:
        family(f"{name}_total", "counter", doc, [(f"{name}_total", labels, value)])

    def histogram(name: str, doc: str, h: Histogram) -> None:
        counts = h.counts or [0] * len(h.buckets)
        samples = [
            (f"{name}_bucket", f'engine="0",le="{upper!r}",model_name="{model}"', float(c))
            for upper, c in zip(h.buckets, counts, strict=True)
        ]
        samples.append((f"{name}_bucket", f'engine="0",le="+Inf",model_name="{model}"', h.count))
        samples.append((f"{name}_count", labels, h.count))
        samples.append((f"{name}_sum", labels, h.total))
        family(name, "histogram", doc, samples)

    gauge("vllm:num_requests_running", "Number of requests in model execution batches.", 0)
    gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", 0)
    gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", kv_cache_usage)
    counter(
        "vllm:prefix_cache_queries",
        "Prefix cache queries, in terms of number of queried tokens.",
        stats.prefix_cache_queries,
    )
    counter(
        "vllm:prefix_cache_hits",
        "Prefix cache hits, in terms of number of cached tokens.",
        stats.prefix_cache_hits,
    )
    counter(
        "vllm:external_prefix_cache_queries",
        "External prefix cache queries from KV connector cross-instance cache sharing, "
        "in terms of number of queried tokens.",
        stats.external_prefix_cache_queries,
    )
    counter(
        "vllm:external_prefix_cache_hits",
        "External prefix cache hits from KV connector cross-instance cache sharing, "
        "in terms of number of cached tokens.",
        stats.external_prefix_cache_hits,
    )
    counter("vllm:prompt_tokens", "Number of prefill tokens processed.", stats.prompt_tokens)
    counter(
        "vllm:prompt_tokens_cached",
        "Number of cached prompt tokens (local + external).",
        stats.prompt_tokens_cached,
    )
    counter(
        "vllm:generation_tokens", "Number of generation tokens processed.", stats.generation_tokens
    )
    family(
        "vllm:request_success_total",
        "counter",
        "Count of successfully processed requests.",
        [
            (
                "vllm:request_success_total",
                f'engine="0",finished_reason="{reason}",model_name="{model}"',
                stats.request_success.get(reason, 0),
            )
            for reason in _FINISH_REASONS
        ],
    )
    histogram(
        "vllm:nixl_xfer_time_seconds",
        "Histogram of transfer duration for NIXL KV Cache transfers.",
        stats.nixl_xfer_time,
    )
    histogram(
        "vllm:nixl_post_time_seconds",
        "Histogram of transfer post time for NIXL KV Cache transfers.",
        stats.nixl_post_time,
    )
    histogram(
        "vllm:nixl_bytes_transferred",
        "Histogram of bytes transferred per NIXL KV Cache transfers.",
        stats.nixl_bytes,
    )
    histogram(
        "vllm:nixl_num_descriptors",
        "Histogram of number of descriptors per NIXL  KV Cache transfers.",
        stats.nixl_descriptors,
    )
    counter(
        "vllm:nixl_num_failed_transfers",
        "Number of failed NIXL KV Cache transfers, including handshake and notification "
        "failures. NOTE: KV expiry is tracked separately in vllm:nixl_num_kv_expired_reqs.",
        stats.nixl_failed_transfers + stats.nixl_failed_notifications,
    )
    counter(
        "vllm:nixl_num_failed_notifications",
        "Number of failed NIXL KV Cache notifications. Retained for compatibility; these "
        "failures are also included in vllm:nixl_num_failed_transfers.",
        stats.nixl_failed_notifications,
    )
    counter(
        "vllm:nixl_num_kv_expired_reqs",
        "Number of requests that had their KV expire. NOTE: This metric is tracked on the "
        "P instance.",
        stats.nixl_kv_expired_reqs,
    )
    counter(
        "vllm:nixl_num_notifications_after_expiry",
        "Number of completion notifications for requests that were no longer tracked, usually "
        "because their KV lease expired. The KV blocks may have been reused before the "
        "transfer finished. Counted per notification (one per remote rank), not per request.",
        stats.nixl_notifications_after_expiry,
    )
    return "\n".join(out) + "\n"
