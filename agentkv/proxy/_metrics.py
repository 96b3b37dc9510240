"""Prometheus metrics of the proxy, in the text exposition format (version 0.0.4).

A few dozen lines instead of a dependency: the proxy exports counters, gauges read at scrape time
and fixed-bucket histograms, all kept per app (two apps in one process never share numbers).

>>> metrics = ProxyMetrics()
>>> metrics.requests.inc("chat", "200")
>>> print(metrics.render().splitlines()[2])
agentkv_proxy_requests_total{endpoint="chat",code="200"} 1
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable, Sequence

__all__ = ["CONTENT_TYPE", "Counter", "Gauge", "Histogram", "ProxyMetrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(names: Sequence[str], values: Sequence[str], extra: str = "") -> str:
    parts = [f'{name}="{_escape(value)}"' for name, value in zip(names, values, strict=True)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _number(value: float) -> str:
    if value == math.inf:
        return "+Inf"
    return str(int(value)) if float(value).is_integer() else repr(float(value))


class _Metric:
    kind = ""

    def __init__(self, name: str, help_text: str, labels: Sequence[str] = ()) -> None:
        self.name = name
        self.help = help_text
        self.labels = tuple(labels)

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]

    def samples(self) -> Iterable[str]:
        raise NotImplementedError


class Counter(_Metric):
    """A monotonically increasing count, per label values."""

    kind = "counter"

    def __init__(self, name: str, help_text: str, labels: Sequence[str] = ()) -> None:
        super().__init__(name, help_text, labels)
        self._values: dict[tuple[str, ...], float] = {}

    def inc(self, *label_values: str, amount: float = 1.0) -> None:
        self._values[label_values] = self._values.get(label_values, 0.0) + amount

    def value(self, *label_values: str) -> float:
        return self._values.get(label_values, 0.0)

    def samples(self) -> Iterable[str]:
        for values, total in self._values.items():
            yield f"{self.name}{_labels(self.labels, values)} {_number(total)}"


class Gauge(_Metric):
    """A value read at scrape time from a callback returning ``{label values: value}``."""

    kind = "gauge"

    def __init__(
        self,
        name: str,
        help_text: str,
        read: Callable[[], dict[tuple[str, ...], float]],
        labels: Sequence[str] = (),
    ) -> None:
        super().__init__(name, help_text, labels)
        self._read = read

    def samples(self) -> Iterable[str]:
        for values, value in self._read().items():
            yield f"{self.name}{_labels(self.labels, values)} {_number(value)}"


class Histogram(_Metric):
    """Observations counted in fixed cumulative buckets, plus their sum and count."""

    kind = "histogram"

    def __init__(
        self,
        name: str,
        help_text: str,
        buckets: Sequence[float] = _LATENCY_BUCKETS,
        labels: Sequence[str] = (),
    ) -> None:
        super().__init__(name, help_text, labels)
        self._bounds = tuple(sorted(buckets))
        self._series: dict[tuple[str, ...], tuple[list[int], list[float]]] = {}

    def observe(self, value: float, *label_values: str) -> None:
        counts, total = self._series.setdefault(
            label_values, ([0] * (len(self._bounds) + 1), [0.0])
        )
        counts[bisect.bisect_left(self._bounds, value)] += 1
        total[0] += value

    def samples(self) -> Iterable[str]:
        for values, (counts, total) in self._series.items():
            running = 0
            for bound, count in zip((*self._bounds, math.inf), counts, strict=True):
                running += count
                le = f'le="{_number(bound)}"'
                yield f"{self.name}_bucket{_labels(self.labels, values, le)} {running}"
            yield f"{self.name}_sum{_labels(self.labels, values)} {_number(total[0])}"
            yield f"{self.name}_count{_labels(self.labels, values)} {running}"


def _none() -> dict[tuple[str, ...], float]:
    return {}


class ProxyMetrics:
    """Everything ``GET /metrics`` shows. Gauges read live state through ``bind``."""

    def __init__(self) -> None:
        self.requests = Counter(
            "agentkv_proxy_requests_total", "HTTP requests answered", ("endpoint", "code")
        )
        self.request_seconds = Histogram(
            "agentkv_proxy_request_duration_seconds",
            "Time to the full answer of a chat completion (streams: to the last chunk)",
            labels=("stream",),
        )
        self.overhead_seconds = Histogram(
            "agentkv_proxy_overhead_seconds",
            "Time a plain (non-streamed) chat completion spent in the proxy outside the SDK's turn",
            buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1),
        )
        self.ttft_seconds = Histogram(
            "agentkv_proxy_ttft_seconds", "Time to the first token of a turn, as the SDK saw it"
        )
        self.turns = Counter(
            "agentkv_proxy_turns_total", "Turns run, by what happened to the handle", ("handle",)
        )
        self.forks = Counter(
            "agentkv_proxy_forks_total", "Requests whose history did not extend their session"
        )
        self.echoes = Counter(
            "agentkv_proxy_echo_matches_total",
            "Echoed assistant messages matched to generated tokens by meaning, not equality",
        )
        self.prompt_tokens = Counter("agentkv_proxy_prompt_tokens_total", "Prompt tokens sent")
        self.reused_tokens = Counter(
            "agentkv_proxy_reused_tokens_total",
            "Prompt tokens prefill did not compute (its own cached_tokens)",
        )
        self.ideal_reused_tokens = Counter(
            "agentkv_proxy_ideal_reused_tokens_total",
            "Tokens a perfect handle would have let prefill reuse",
        )
        self.generated_tokens = Counter("agentkv_proxy_generated_tokens_total", "Tokens generated")
        self.sessions_opened = Counter("agentkv_proxy_sessions_opened_total", "Sessions opened")
        self.sessions_closed = Counter(
            "agentkv_proxy_sessions_closed_total",
            "Sessions closed, by why (deleted, idle, evicted, shutdown)",
            ("reason",),
        )
        self.sessions = Gauge("agentkv_proxy_sessions", "Open sessions", _none)
        self.pair_sessions = Gauge(
            "agentkv_proxy_pair_sessions",
            "Open sessions per pair, in a pool per decode server (one-shots included)",
            _none,
            ("pair",),
        )
        self.prefill_tokens = Gauge(
            "agentkv_proxy_prefill_outstanding_tokens",
            "Prompt tokens sent to each prefill server and not answered yet (its load)",
            _none,
            ("prefill",),
        )

    def bind(
        self,
        *,
        sessions: Callable[[], int],
        pair_sessions: Callable[[], dict[str, int]],
        prefill_tokens: Callable[[], dict[str, int]] = dict,
    ) -> None:
        """Connect the gauges to the live state they read at scrape time."""
        self.sessions = Gauge(
            self.sessions.name, self.sessions.help, lambda: {(): float(sessions())}
        )
        self.pair_sessions = Gauge(
            self.pair_sessions.name,
            self.pair_sessions.help,
            lambda: {(name,): float(n) for name, n in pair_sessions().items()},
            ("pair",),
        )
        self.prefill_tokens = Gauge(
            self.prefill_tokens.name,
            self.prefill_tokens.help,
            lambda: {(name,): float(n) for name, n in prefill_tokens().items()},
            ("prefill",),
        )

    def _all(self) -> tuple[_Metric, ...]:
        return (
            self.requests,
            self.request_seconds,
            self.overhead_seconds,
            self.ttft_seconds,
            self.turns,
            self.forks,
            self.echoes,
            self.prompt_tokens,
            self.reused_tokens,
            self.ideal_reused_tokens,
            self.generated_tokens,
            self.sessions_opened,
            self.sessions_closed,
            self.sessions,
            self.pair_sessions,
            self.prefill_tokens,
        )

    def render(self) -> str:
        lines: list[str] = []
        for metric in self._all():
            lines.extend(metric.header())
            lines.extend(metric.samples())
        return "\n".join(lines) + "\n"
