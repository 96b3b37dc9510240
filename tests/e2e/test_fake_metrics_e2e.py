"""The fake servers' ``/metrics`` against the real local pair's.

Every sample the fake exposes, a real vLLM server exposes too: same metric, type, help text and
label set (bucket bounds and finish reasons included). Only values may differ.
"""

from __future__ import annotations

import httpx2
import pytest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from agentkv.local._config import ClusterRecord
from agentkv.testing import FakeCluster

pytestmark = pytest.mark.e2e


def _families(text: str) -> dict[str, Metric]:
    return {family.name: family for family in text_string_to_metric_families(text)}


def _series(family: Metric) -> set[tuple[str, frozenset[tuple[str, str]]]]:
    return {(sample.name, frozenset(sample.labels.items())) for sample in family.samples}


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_every_metric_of_the_fake_is_one_of_vllms_own(
    local_cluster: ClusterRecord, role: str
) -> None:
    pair = local_cluster.pairs[0]
    real = _families(httpx2.get(f"{getattr(pair, role).url}/metrics", timeout=10).text)
    fake = FakeCluster(pairs=1, model=local_cluster.model)
    server = fake.prefill(0) if role == "prefill" else fake.decode(0)
    with httpx2.Client(transport=fake.transport) as client:
        faked = _families(client.get(f"{server.url}/metrics").text)
    assert len(faked) > 20
    for name, family in faked.items():
        assert name in real, name
        assert (family.type, family.documentation) == (real[name].type, real[name].documentation)
        assert _series(family) <= _series(real[name]), name
