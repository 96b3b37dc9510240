"""The real local vLLM CPU prefill/decode pair, started once for the whole test session.

If ``AGENTKV_TEST_CLUSTER`` names the cluster file of a running pair (``agentkv up``), the tests
use it and leave it running; otherwise the fixture starts a pair on its own ports and stops it,
by process id, when the session ends.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentkv.local._config import ClusterRecord, LocalClusterConfig
from agentkv.local._launch import existing_cluster, start_cluster, stop_cluster


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
