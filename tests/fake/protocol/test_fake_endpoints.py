"""The fake's other endpoints (``/health``, ``/v1/models``, ``/metrics``) and the
cluster's own accessors (``cluster_spec``, ``server``, ``advance``)."""

from __future__ import annotations

import httpx2
import pytest
from raw_protocol import (
    leg,
    metric,
    prompt_of_length,
)

from agentkv.testing import FakeCluster


def test_health_models_and_metrics_endpoints(client: httpx2.Client, fake: FakeCluster) -> None:
    url = fake.prefill(0).url
    health = client.get(url + "/health")
    assert (health.status_code, health.content) == (200, b"")
    models = client.get(url + "/v1/models").json()
    assert models["object"] == "list"
    assert models["data"][0]["id"] == "fake-smollm2"
    assert models["data"][0]["max_model_len"] == 8192
    assert models["data"][0]["owned_by"] == "vllm"
    text = client.get(url + "/metrics").text
    for name in (
        "vllm:kv_cache_usage_perc",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:external_prefix_cache_hits_total",
        "vllm:nixl_xfer_time_seconds_count",
        "vllm:nixl_bytes_transferred_count",
        "vllm:nixl_num_failed_transfers_total",
        "vllm:nixl_num_kv_expired_reqs_total",
        "vllm:nixl_num_notifications_after_expiry_total",
    ):
        assert f'{name}{{engine="0",model_name="fake-smollm2"}}' in text


def test_prefix_cache_metrics_count_tokens(client: httpx2.Client, fake: FakeCluster) -> None:
    ids = prompt_of_length(100)
    url = fake.prefill(0).url
    leg(client, url, ids, None, max_tokens=1)
    leg(client, url, ids, None, max_tokens=1)
    assert metric(client, url, "vllm:prefix_cache_queries_total") == 200
    assert metric(client, url, "vllm:prefix_cache_hits_total") == 96
    assert metric(client, url, "vllm:prompt_tokens_total") == 200


def test_cluster_spec_lists_the_pairs(fake: FakeCluster) -> None:
    assert fake.cluster_spec == {
        "model": "fake-smollm2",
        "pairs": [
            {
                "name": "pair-0",
                "prefill": "http://fake-p0.test:8000",
                "decode": "http://fake-d0.test:8000",
            },
            {
                "name": "pair-1",
                "prefill": "http://fake-p1.test:8000",
                "decode": "http://fake-d1.test:8000",
            },
        ],
    }


def test_server_finds_the_server_answering_at_a_url(fake: FakeCluster) -> None:
    """What a test knows of a server is a URL (a pair's, a request's): that finds it."""
    pairs = fake.cluster_spec["pairs"]
    assert fake.server(pairs[1]["prefill"]) is fake.prefill(1)
    assert fake.server(pairs[0]["decode"] + "/") is fake.decode(0)
    assert fake.server(f"{fake.decode(1).url}/v1/chat/completions?x=1") is fake.decode(1)
    with pytest.raises(KeyError, match="fake-d2"):
        fake.server("http://fake-d2.test:8000")
    with pytest.raises(KeyError):
        fake.server("http://fake-d0.test:9000")  # the host alone is not enough


def test_advance_needs_a_manual_clock() -> None:
    with pytest.raises(TypeError):
        FakeCluster(pairs=1).advance(1.0)
