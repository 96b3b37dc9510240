"""The real local vLLM CPU prefill/decode pair, started once for the whole test session.

If ``AGENTKV_TEST_CLUSTER`` names the cluster file of a running pair (``agentkv up``), the tests
use it and leave it running; otherwise the fixture starts a pair on its own ports and stops it,
by process id, when the session ends. ``model`` and ``proxy`` are the served model's name and an
``agentkv proxy`` in front of the pair, shared by the modules that talk to it over HTTP.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from agentkv.local._config import ClusterRecord, LocalClusterConfig
from agentkv.local._launch import existing_cluster, start_cluster, stop_cluster

if TYPE_CHECKING:
    from agentkv.proxy import ProxyServer


def _progress(message: str) -> None:
    sys.stderr.write(f"[e2e] {message}\n")


@pytest.fixture(scope="session")
def local_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterRecord]:
    given = os.environ.get("AGENTKV_TEST_CLUSTER")
    if given:
        record = existing_cluster(LocalClusterConfig(cluster_file=Path(given)))
        if record is None:
            pytest.fail(f"AGENTKV_TEST_CLUSTER={given} names no running, healthy cluster")
        yield record
        return
    config = LocalClusterConfig(
        cluster_file=tmp_path_factory.mktemp("cluster") / "cluster.json",
        base_port=18300,
        base_side_channel_port=15800,
    )
    record = start_cluster(config, progress=_progress)
    try:
        yield record
    finally:
        stop_cluster(config, progress=_progress)


@pytest.fixture(scope="session")
def cluster_file(local_cluster: ClusterRecord, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("cf") / "cluster.json"
    local_cluster.write(path)
    return path


@pytest.fixture(scope="session")
def model(local_cluster: ClusterRecord) -> str:
    """The served model's name, as clients send it."""
    return local_cluster.model


@pytest.fixture(scope="module")
def proxy(request: pytest.FixtureRequest, cluster_file: Path) -> Iterator[ProxyServer]:
    """``agentkv proxy`` on the local pair, on a free port, one per module (its turns are short);
    ``@pytest.mark.proxy(...)`` in the module's ``pytestmark`` sets ``ProxyConfig`` fields."""
    from agentkv import AsyncCluster
    from agentkv.proxy import ProxyConfig, ProxyServer

    options: dict[str, Any] = {}
    for mark in reversed(list(request.node.iter_markers("proxy"))):
        options.update(mark.kwargs)

    def make() -> AsyncCluster:
        return AsyncCluster.from_file(cluster_file)

    with ProxyServer(make, ProxyConfig(port=0, **options)) as server:
        yield server
