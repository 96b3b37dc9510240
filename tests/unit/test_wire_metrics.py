"""``sample_values`` reads what ``prometheus_client``'s parser reads, for the series it is asked."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from prometheus_client.parser import text_string_to_metric_families

from agentkv._wire.metrics import sample_values
from agentkv.testing._fake_metrics import EngineStats

USAGE = "vllm:kv_cache_usage_perc"
PREEMPTIONS = "vllm:num_preemptions"


def parsed(text: str, name: str) -> list[float]:
    return [
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and math.isfinite(sample.value)
    ]


@given(
    usage=st.lists(st.floats(0, 1), min_size=0, max_size=3),
    preempted=st.integers(0, 10**6),
    label=st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12),
    openmetrics=st.booleans(),
)
def test_the_scan_reads_what_the_parser_reads(
    usage: list[float], preempted: int, label: str, openmetrics: bool
) -> None:
    registry = CollectorRegistry()
    gauge = Gauge(USAGE, "KV-cache usage.", ["engine", "model_name"], registry=registry)
    for engine, value in enumerate(usage):
        gauge.labels(str(engine), label).set(value)
    counter = Counter(PREEMPTIONS, "Preemptions.", ["model_name"], registry=registry)
    counter.labels(label).inc(preempted)
    text = (generate_openmetrics if openmetrics else generate_latest)(registry).decode()
    assert sample_values(text, USAGE) == parsed(text, USAGE)
    # The counter's samples are named ..._total (and ..._created): never the bare name.
    assert sample_values(text, PREEMPTIONS + "_total") == parsed(text, PREEMPTIONS + "_total")
    assert sample_values(text, PREEMPTIONS) == []


def test_the_scan_reads_the_fake_engines_exposition_as_the_parser_does() -> None:
    stats = EngineStats(model_name="m", kv_cache_usage=lambda: 0.375)
    text = stats.render()[0].decode()
    for name in (USAGE, "vllm:num_preemptions_total", "vllm:prompt_tokens_total"):
        assert sample_values(text, name) == parsed(text, name)
    assert sample_values(text, USAGE) == [0.375]
