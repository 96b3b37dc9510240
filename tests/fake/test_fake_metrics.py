"""The fake servers' ``/metrics``: vLLM's metric definitions, rendered by vLLM's own library.

``tests/e2e/test_fake_metrics_e2e.py`` holds the same exposition against a real vLLM server's.
"""

from __future__ import annotations

import httpx2
import pytest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from agentkv import Cluster, Message
from agentkv.testing import FakeCluster

LONG = {"max_tokens": 100, "extra_body": {"min_tokens": 70}}  # enough for decode's KV to be pulled
SYSTEM = Message.system("You are a helpful assistant. Answer in one or two sentences. " * 4)


pytestmark = [pytest.mark.fake(pairs=1), pytest.mark.cluster(manual_clock=True, block_size=16)]


@pytest.fixture(autouse=True)
def _two_turns(cluster: Cluster) -> None:
    """What the metrics count: a session of two turns, the second pulling decode's KV."""
    with cluster.session(**LONG) as session:  # type: ignore[arg-type]
        session.append(SYSTEM)
        session.send("What is the capital of France?")
        session.send("And Spain?")


def _scrape(fake: FakeCluster, url: str, **headers: str) -> httpx2.Response:
    with httpx2.Client(transport=fake.transport) as client:
        response = client.get(url + "/metrics", headers=headers)
    assert response.status_code == 200
    return response


def _families(text: str) -> dict[str, Metric]:
    return {family.name: family for family in text_string_to_metric_families(text)}


def _value(family: Metric, sample: str, **labels: str) -> float:
    return next(
        s.value for s in family.samples if s.name == sample and labels.items() <= s.labels.items()
    )


def test_the_exposition_is_prometheus_text_with_vllms_labels_and_buckets(
    fake: FakeCluster,
) -> None:
    response = _scrape(fake, fake.prefill(0).url)
    assert response.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    families = _families(response.text)
    assert families["vllm:prompt_tokens"].type == "counter"
    assert families["vllm:kv_cache_usage_perc"].type == "gauge"
    for name in ("vllm:prompt_tokens", "vllm:nixl_xfer_time_seconds", "vllm:kv_cache_usage_perc"):
        for sample in families[name].samples:
            assert sample.labels["engine"] == "0"
            assert sample.labels["model_name"] == fake.model

    # vLLM's NIXL buckets: the transfer time drops the post time's first bound.
    def bounds(name: str) -> list[str]:
        family = families[name]
        return [s.labels["le"] for s in family.samples if s.name.endswith("_bucket")]

    assert bounds("vllm:nixl_post_time_seconds")[:2] == ["0.001", "0.005"]
    assert bounds("vllm:nixl_xfer_time_seconds")[:2] == ["0.005", "0.01"]
    assert bounds("vllm:nixl_bytes_transferred")[0] == "2048.0"
    assert bounds("vllm:nixl_bytes_transferred")[-2:] == ["8.589934592e+09", "+Inf"]
    reasons = {s.labels["finished_reason"] for s in families["vllm:request_success"].samples}
    assert reasons == {"stop", "length", "abort", "error", "repetition"}
    # prometheus_client adds a creation time to every counter, in vLLM as here.
    assert "vllm:prompt_tokens_created" in families


def test_the_numbers_are_the_engines(fake: FakeCluster) -> None:
    prefill = _families(_scrape(fake, fake.prefill(0).url).text)
    decode = _families(_scrape(fake, fake.decode(0).url).text)
    # Turn 2's prefill pulled decode's turn-end KV; every decode leg pulled prefill's.
    assert _value(prefill["vllm:nixl_bytes_transferred"], "vllm:nixl_bytes_transferred_count") == 1
    assert _value(decode["vllm:nixl_bytes_transferred"], "vllm:nixl_bytes_transferred_count") == 2
    assert _value(prefill["vllm:prompt_tokens"], "vllm:prompt_tokens_total") > 0
    assert _value(prefill["vllm:prefix_cache_hits"], "vllm:prefix_cache_hits_total") > 0
    assert _value(decode["vllm:kv_cache_usage_perc"], "vllm:kv_cache_usage_perc") == 0.0
    finished = decode["vllm:request_success"].samples
    assert sum(s.value for s in finished if s.name == "vllm:request_success_total") == 2


def test_a_scraper_asking_for_openmetrics_gets_it(fake: FakeCluster) -> None:
    accept = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"
    response = _scrape(fake, fake.prefill(0).url, accept=accept)
    assert response.headers["content-type"].startswith("application/openmetrics-text")
    assert response.text.endswith("# EOF\n")
