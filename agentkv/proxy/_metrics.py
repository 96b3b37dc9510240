"""Prometheus metrics of the proxy, on ``prometheus_client`` (the library vLLM's metrics use).

Every app has a registry of its own (two apps in one process never share numbers, and nothing
lands in prometheus_client's global registry). Counters and histograms are the library's; the
gauges that read live state at scrape time are a collector of callbacks set by :meth:`bind`.
``GET /metrics`` negotiates the format as prometheus_client's own exporters do: the text format
0.0.4 by default, OpenMetrics when the scraper asks for it.

>>> metrics = ProxyMetrics()
>>> metrics.requests.labels("chat", "200").inc()
>>> metrics.value("agentkv_proxy_requests_total", endpoint="chat", code="200")
1.0
>>> body, content_type = metrics.render()
>>> content_type
'text/plain; version=0.0.4; charset=utf-8'
>>> print(body.decode().splitlines()[2])
agentkv_proxy_requests_total{code="200",endpoint="chat"} 1.0
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector

from agentkv._core import get_logger

__all__ = ["ProxyMetrics"]

logger = get_logger("agentkv")

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1)


def _no_sessions() -> int | None:
    return None


def _no_loads() -> dict[str, int]:
    return {}


class _LiveGauges(Collector):
    """Gauges read at scrape time: open sessions, sessions per pair, each prefill's load."""

    def __init__(self) -> None:
        self.sessions: Callable[[], int | None] = _no_sessions
        self.pair_sessions: Callable[[], dict[str, int]] = _no_loads
        self.prefill_tokens: Callable[[], dict[str, int]] = _no_loads

    def describe(self) -> Iterator[GaugeMetricFamily]:
        # Lets the registry refuse a second metric of the same name at registration.
        return self._families(live=False)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        return self._families(live=True)

    def _families(self, *, live: bool) -> Iterator[GaugeMetricFamily]:
        sessions = GaugeMetricFamily("agentkv_proxy_sessions", "Open sessions")
        open_now = self.sessions() if live else None
        if open_now is not None:
            sessions.add_metric([], float(open_now))
        yield sessions
        for name, help_text, label, read in (
            (
                "agentkv_proxy_pair_sessions",
                "Open sessions per pair, in a pool per decode server (one-shots included)",
                "pair",
                self.pair_sessions,
            ),
            (
                "agentkv_proxy_prefill_outstanding_tokens",
                "Prompt tokens sent to each prefill server and not answered yet (its load)",
                "prefill",
                self.prefill_tokens,
            ),
        ):
            family = GaugeMetricFamily(name, help_text, labels=[label])
            for value_label, value in (read() if live else {}).items():
                family.add_metric([value_label], float(value))
            yield family


class ProxyMetrics:
    """Everything ``GET /metrics`` shows. Gauges read live state through :meth:`bind`."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        registry = self.registry
        self.requests = Counter(
            "agentkv_proxy_requests",
            "HTTP requests answered",
            ("endpoint", "code"),
            registry=registry,
        )
        self.request_seconds = Histogram(
            "agentkv_proxy_request_duration_seconds",
            "Time to the full answer of a chat completion (streams: to the last chunk)",
            ("stream",),
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.overhead_seconds = Histogram(
            "agentkv_proxy_overhead_seconds",
            "Time a plain (non-streamed) chat completion spent in the proxy outside the SDK's turn",
            buckets=_OVERHEAD_BUCKETS,
            registry=registry,
        )
        self.commit_seconds = Histogram(
            "agentkv_proxy_store_commit_seconds",
            "Time a turn's commit to the shared session store took (written after the answer)",
            buckets=_OVERHEAD_BUCKETS,
            registry=registry,
        )
        self.commit_failures = Counter(
            "agentkv_proxy_store_commit_failures",
            "Commits to the shared store that stored nothing, or got no answer (refused: the "
            "claim was lost; unreachable: the store was; error: anything else)",
            ("reason",),
            registry=registry,
        )
        self.pins_released = Counter(
            "agentkv_proxy_unreferenced_pins_released",
            "Releases of decode pins no stored session references (commit_refused, commit_lost: "
            "this replica's commit did not land; orphan: an earlier claim ended mid-turn)",
            ("reason",),
            registry=registry,
        )
        self.pins_relieved = Counter(
            "agentkv_proxy_pins_relieved",
            "Idle sessions' decode pins freed because decode's KV memory neared full "
            "(persisted: offloaded to its file tier; released: the next turn recomputes)",
            ("outcome",),
            registry=registry,
        )
        self.ttft_seconds = Histogram(
            "agentkv_proxy_ttft_seconds",
            "Time to the first token of a turn, as the SDK saw it",
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.turns = Counter(
            "agentkv_proxy_turns",
            "Turns run, by what happened to the handle",
            ("handle",),
            registry=registry,
        )
        self.forks = Counter(
            "agentkv_proxy_forks",
            "Requests whose history did not extend their session",
            registry=registry,
        )
        self.prefix_breaks = Counter(
            "agentkv_prefix_breaks",
            "Requests whose history did not extend their thread, by why (system_changed, "
            "tools_changed, messages_changed, regenerated)",
            ("reason",),
            registry=registry,
        )
        self.prefix_break_tokens = Counter(
            "agentkv_prefix_break_lost_tokens",
            "Tokens a thread held past the point where a request's history broke from it",
            ("reason",),
            registry=registry,
        )
        self.echoes = Counter(
            "agentkv_proxy_echo_matches",
            "Echoed assistant messages matched to generated tokens by meaning, not equality",
            registry=registry,
        )
        self.prompt_tokens = Counter(
            "agentkv_proxy_prompt_tokens", "Prompt tokens sent", registry=registry
        )
        self.reused_tokens = Counter(
            "agentkv_proxy_reused_tokens",
            "Prompt tokens prefill did not compute (its own cached_tokens)",
            registry=registry,
        )
        self.ideal_reused_tokens = Counter(
            "agentkv_proxy_ideal_reused_tokens",
            "Tokens a perfect handle would have let prefill reuse",
            registry=registry,
        )
        self.generated_tokens = Counter(
            "agentkv_proxy_generated_tokens", "Tokens generated", registry=registry
        )
        self.sessions_opened = Counter(
            "agentkv_proxy_sessions_opened", "Sessions opened", registry=registry
        )
        self.sessions_closed = Counter(
            "agentkv_proxy_sessions_closed",
            "Sessions closed, by why (deleted, idle, evicted, failed, shutdown)",
            ("reason",),
            registry=registry,
        )
        self.sessions_refused = Counter(
            "agentkv_proxy_sessions_refused",
            "New sessions refused: the key's limit or share (429, 503) or a full store (store)",
            ("status",),
            registry=registry,
        )
        self.system_blocks_dropped = Counter(
            "agentkv_proxy_system_blocks_dropped",
            "Messages API system blocks left out before rendering, by the rule that matched "
            "(lines that differ per session or request, such as Claude Code's billing header)",
            ("rule",),
            registry=registry,
        )
        self.deprecated_names = Counter(
            "agentkv_proxy_deprecated_names",
            "Requests that used a deprecated name, by that name (X-AgentKV-Persist: use "
            "X-AgentKV-Offload); the first of each name is also logged",
            ("old",),
            registry=registry,
        )
        self._deprecations_logged: set[str] = set()
        self._live = _LiveGauges()
        registry.register(self._live)

    def deprecated_name(self, name: str) -> None:
        """Count a request that used the deprecated ``name``; log the first one (a warning an
        operator sees once, not once per request)."""
        self.deprecated_names.labels(name).inc()
        if name not in self._deprecations_logged:
            self._deprecations_logged.add(name)
            logger.warning("agentkv.proxy.deprecated_name", name=name)

    def bind(
        self,
        *,
        sessions: Callable[[], int],
        pair_sessions: Callable[[], dict[str, int]],
        prefill_tokens: Callable[[], dict[str, int]] = dict,
    ) -> None:
        """Connect the gauges to the live state they read at scrape time."""
        self._live.sessions = sessions
        self._live.pair_sessions = pair_sessions
        self._live.prefill_tokens = prefill_tokens

    def value(self, name: str, **labels: str) -> float:
        """One sample's value now (0 for a series not seen yet), by its exposed name."""
        return self.registry.get_sample_value(name, labels) or 0.0

    def render(self, accept: str | None = None) -> tuple[bytes, str]:
        """The exposition and its content type, in the format an ``Accept`` header asks for."""
        encode, content_type = choose_encoder(accept or "")
        return encode(self.registry), content_type
