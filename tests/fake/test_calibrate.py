"""``agentkv calibrate`` against the fake cluster: every route it times, the file it writes."""

from __future__ import annotations

import json
import math

import pytest

from agentkv import AsyncCluster, Cluster, RouteCostModel
from agentkv.bench._calibrate import CalibrateConfig, calibrate
from agentkv.bench._calibrate_cli import cmd_calibrate
from agentkv.cli import build_parser
from agentkv.testing import FakeCluster


@pytest.fixture
def cluster_file(tmp_path):
    fake = FakeCluster(pairs=1)
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(fake.cluster_spec))
    return fake, path


def test_calibrate_measures_each_route_and_writes_the_model_the_cluster_reads(
    cluster_file, capsys
):
    fake, path = cluster_file
    args = build_parser().parse_args(["calibrate", "--quick", "--cluster-file", str(path)])
    assert cmd_calibrate(args, cluster_file=path, transport=fake.transport) == 0
    out, err = capsys.readouterr()
    assert "calibrate: context 1024 tokens (3/3)" in err
    assert "crossover: after 4096 tokens, a pull beats decode-local prefill above" in out
    assert "crossover: with 64 new tokens, a pull beats a recompute above" in out
    written = json.loads(path.read_text())
    model = RouteCostModel.from_wire(written["route_cost"])
    assert model != RouteCostModel()
    assert math.isfinite(model.transfer_fixed_s)
    # The fake's NIXL metrics count its bytes: ~23,040 a token, less the blocks prefill had.
    assert 15_000 < model.bytes_per_token <= 23_040
    with Cluster.from_file(path) as cluster:
        assert cluster.policy.route.cost == model


async def test_each_length_runs_a_cold_decode_turn_then_pulls_what_it_pinned(cluster_file):
    fake, path = cluster_file
    async with AsyncCluster.from_file(path, transport=fake.transport) as cluster:
        cal = await calibrate(cluster, CalibrateConfig(quick=True))
    assert [r.tokens for r in cal.rows] == sorted(r.tokens for r in cal.rows)
    for row in cal.rows:
        assert not math.isnan(row.decode_cold_s)  # the fake runs agentkv's connector
        assert row.pulled_tokens > row.tokens // 2  # the pull moved what decode pinned
        assert row.decode_append_route == "decode"
    assert cal.nixl_metrics
    assert cal.measured.decode_local


def test_dry_run_leaves_the_cluster_file_alone(cluster_file):
    fake, path = cluster_file
    before = path.read_text()
    report = path.parent / "calibration.json"
    args = build_parser().parse_args(["calibrate", "--lengths", "128", "256", "--dry-run",
                                      "--json", str(report)])
    assert cmd_calibrate(args, cluster_file=path, transport=fake.transport) == 0
    assert path.read_text() == before
    raw = json.loads(report.read_text())
    assert len(raw["rows"]) == 2
    assert RouteCostModel.from_wire(raw["model"]) != RouteCostModel()
    assert set(raw["crossovers"]) >= {"pull_beats_local_above_new_tokens",
                                      "pull_beats_recompute_above_context"}
