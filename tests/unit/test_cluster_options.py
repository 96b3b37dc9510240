"""Cluster options: one typed list for both twins, the spec's options overridden by the call's."""

from __future__ import annotations

import inspect

import pytest

from agentkv import AsyncCluster, CachePolicy, Cluster
from agentkv._client.pool import ClusterOptions, PairPool

SPEC = {
    "model": "m",
    "kv_recompute_threshold": 1,
    "block_size": 16,
    "pairs": [{"name": "p0", "prefill": "http://p:8000", "decode": "http://d:8000"}],
}


def test_the_options_are_the_pools_keywords() -> None:
    keywords = set(inspect.signature(PairPool).parameters) - {"pairs", "model"}
    assert keywords == set(ClusterOptions.__annotations__)


def test_options_given_to_from_dict_win_over_the_specs() -> None:
    with Cluster.from_dict(SPEC) as cluster:
        assert cluster.policy.recompute_threshold == 1
        assert cluster.block_size == 16
    policy = CachePolicy(recompute_threshold=64)
    with Cluster.from_dict(SPEC, policy=policy, block_size=32) as cluster:
        assert cluster.policy is policy
        assert cluster.block_size == 32


async def test_an_unknown_option_is_a_type_error_for_both_twins() -> None:
    with pytest.raises(TypeError, match="load_factr"):
        AsyncCluster.from_dict(SPEC, load_factr=2.0)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="load_factr"):
        Cluster.from_dict(SPEC, load_factr=2.0)  # type: ignore[call-arg]
