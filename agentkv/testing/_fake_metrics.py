"""The fake engine's ``/metrics``: vLLM's own metric definitions on vLLM's own library.

Names, help texts, label names and buckets are those of ``vllm/v1/metrics/loggers.py``
(``PrometheusStatLogger``) and ``vllm/distributed/kv_transfer/kv_connector/v1/nixl/stats.py``
(``NixlPromMetrics``) in vLLM 0.32, created with ``prometheus_client`` as vLLM creates them and in
the same order, so the exposition is what a single-API-server vLLM prints for these metrics:
``_total`` suffixes, sorted labels, ``*_created`` series, the format chosen from ``Accept``. Each
engine has a registry of its own (a restart starts from zero, as a new process would); only the
metrics below are exposed, and the answer is never gzipped.

>>> stats = EngineStats(model_name="m", kv_cache_usage=lambda: 0.25)
>>> stats.prompt_tokens.inc(7)
>>> body, content_type = stats.render()
>>> [line for line in body.decode().splitlines() if line.startswith("vllm:prompt_tokens_total")]
['vllm:prompt_tokens_total{engine="0",model_name="m"} 7.0']
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import choose_encoder

__all__ = ["EngineStats"]

# vLLM's FinishReason, in its order (FINISH_REASON_STRINGS).
_FINISH_REASONS: Final = ("stop", "length", "abort", "error", "repetition")
_LABEL_NAMES: Final = ("model_name", "engine")
# fmt: off
_NIXL_TIME_BUCKETS: Final = (
    0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0,
)
_NIXL_DESCRIPTOR_BUCKETS: Final = (
    10, 20, 30, 50, 75, 100, 200, 400, 1000, 2000, 4000, 10000, 20000, 50000,
)
# fmt: on
_NIXL_BYTES_BUCKETS: Final = tuple(2 ** (10 + i) for i in range(1, 25, 2))  # 2 KiB to 8 GiB


class EngineStats:
    """vLLM's metrics of one fake engine (engine index 0), in a registry of its own."""

    def __init__(self, *, model_name: str, kv_cache_usage: Callable[[], float]) -> None:
        self.registry = CollectorRegistry()
        labels = (model_name, "0")

        def counter(name: str, documentation: str) -> Counter:
            family = Counter(name, documentation, _LABEL_NAMES, registry=self.registry)
            return family.labels(*labels)

        def gauge(name: str, documentation: str) -> Gauge:
            family = Gauge(
                name,
                documentation,
                _LABEL_NAMES,
                registry=self.registry,
                multiprocess_mode="mostrecent",
            )
            return family.labels(*labels)

        def histogram(name: str, documentation: str, buckets: tuple[float, ...]) -> Histogram:
            family = Histogram(
                name, documentation, _LABEL_NAMES, registry=self.registry, buckets=buckets
            )
            return family.labels(*labels)

        # vLLM creates its KV connector's metrics first (NixlPromMetrics.__init__).
        self.nixl_xfer_time = histogram(
            "vllm:nixl_xfer_time_seconds",
            "Histogram of transfer duration for NIXL KV Cache transfers.",
            _NIXL_TIME_BUCKETS[1:],
        )
        self.nixl_post_time = histogram(
            "vllm:nixl_post_time_seconds",
            "Histogram of transfer post time for NIXL KV Cache transfers.",
            _NIXL_TIME_BUCKETS,
        )
        self.nixl_bytes = histogram(
            "vllm:nixl_bytes_transferred",
            "Histogram of bytes transferred per NIXL KV Cache transfers.",
            _NIXL_BYTES_BUCKETS,
        )
        self.nixl_descriptors = histogram(
            "vllm:nixl_num_descriptors",
            "Histogram of number of descriptors per NIXL  KV Cache transfers.",
            _NIXL_DESCRIPTOR_BUCKETS,
        )
        self.nixl_failed_transfers = counter(
            "vllm:nixl_num_failed_transfers",
            "Number of failed NIXL KV Cache transfers, including handshake and notification "
            "failures. NOTE: KV expiry is tracked separately in vllm:nixl_num_kv_expired_reqs.",
        )
        self.nixl_failed_notifications = counter(
            "vllm:nixl_num_failed_notifications",
            "Number of failed NIXL KV Cache notifications. Retained for compatibility; these "
            "failures are also included in vllm:nixl_num_failed_transfers.",
        )
        self.nixl_kv_expired_reqs = counter(
            "vllm:nixl_num_kv_expired_reqs",
            "Number of requests that had their KV expire. NOTE: This metric is tracked on the "
            "P instance.",
        )
        self.nixl_notifications_after_expiry = counter(
            "vllm:nixl_num_notifications_after_expiry",
            "Number of completion notifications for requests that were no longer tracked, "
            "usually because their KV lease expired. The KV blocks may have been reused before "
            "the transfer finished. Counted per notification (one per remote rank), not per "
            "request.",
        )
        # Then PrometheusStatLogger's own, in its order.
        self.requests_running = gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches."
        )
        self.requests_waiting = gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed."
        )
        # vLLM sets it every logging interval; the fake reads its block pool at scrape time.
        gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."
        ).set_function(kv_cache_usage)
        self.prefix_cache_queries = counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
        )
        self.prefix_cache_hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        )
        self.external_prefix_cache_queries = counter(
            "vllm:external_prefix_cache_queries",
            "External prefix cache queries from KV connector cross-instance cache sharing, "
            "in terms of number of queried tokens.",
        )
        self.external_prefix_cache_hits = counter(
            "vllm:external_prefix_cache_hits",
            "External prefix cache hits from KV connector cross-instance cache sharing, "
            "in terms of number of cached tokens.",
        )
        # Never incremented: the fake refuses a request it has no blocks for instead of
        # preempting a running one (``KVCacheFullError``); the counter is there as vLLM has it.
        self.num_preemptions = counter(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine."
        )
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.prompt_tokens_cached = counter(
            "vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external)."
        )
        self.generation_tokens = counter(
            "vllm:generation_tokens", "Number of generation tokens processed."
        )
        request_success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            (*_LABEL_NAMES, "finished_reason"),
            registry=self.registry,
        )
        self.request_success = {
            reason: request_success.labels(*labels, reason) for reason in _FINISH_REASONS
        }

    def record_transfer(self, *, num_bytes: int, num_descriptors: int) -> None:
        """One NIXL read, as the consumer's ``NixlKVConnectorStats`` records it."""
        self.nixl_xfer_time.observe(0.001 + num_bytes / 10e9)
        self.nixl_post_time.observe(0.0001)
        self.nixl_bytes.observe(num_bytes)
        self.nixl_descriptors.observe(num_descriptors)

    def render(self, accept: str | None = None) -> tuple[bytes, str]:
        """The exposition and its content type, in the format an ``Accept`` header asks for."""
        encode, content_type = choose_encoder(accept or "")
        return encode(self.registry), content_type
