"""The calibration's pure parts: the fit, the crossovers, the cluster file's ``route_cost``."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agentkv import CachePolicy, Cluster, ConfigError, RouteCostModel, RoutePolicy
from agentkv._route import _first_true
from agentkv.bench._calibrate import CalibrateConfig, choose_lengths, tax_rows
from agentkv.bench._calibrate_cli import crossovers, write_route_cost
from agentkv.bench._calibrate_fit import Measurements, fit_line, fit_model, fit_quadratic

SPEC = {"model": "m", "pairs": [{"name": "p0", "prefill": "http://127.0.0.1:8100",
                                 "decode": "http://127.0.0.1:8101"}]}


def test_the_default_model_prices_as_before_the_fixed_costs():
    """No calibration: the local pair's assumed rates, the formulas of before (fixed and
    quadratic terms 0), so ``auto`` decides as it did."""
    cost = RouteCostModel()
    for held, new in [(0, 40), (4096, 40), (4096 + 127, 500), (10_000, 3000)]:
        moved = (held + new) * 23_040 / 2e9
        assert cost.pull_s(held=held, new=new) == pytest.approx(0.06 + moved + new / 400)
        assert cost.decode_s(held=held, new=new, queued=7) == pytest.approx(
            0.03 + (7 + new + held % 128) / 400)


def test_a_quadratic_is_recovered_and_never_bends_down():
    truth = [(n, 0.02 + 3e-5 * n + 4e-10 * n * n) for n in (1024, 4096, 16384, 32768)]
    fitted = fit_quadratic(truth)
    assert fitted.fixed == pytest.approx(0.02, rel=1e-6)
    assert fitted.per_token == pytest.approx(3e-5, rel=1e-6)
    assert fitted.per_token2 == pytest.approx(4e-10, rel=1e-6)
    # Concave noise would fit a negative attention term: a line instead.
    concave = [(1000, 1.0), (2000, 1.8), (3000, 2.4)]
    assert fit_quadratic(concave).per_token2 == 0
    # Two lengths: a line; one length: through the origin.
    assert fit_quadratic([(100, 1.0), (200, 1.5)]).per_token == pytest.approx(0.005)
    assert fit_line([(100, 1.0), (100, 1.2)]) == (0.0, pytest.approx(0.011))


def test_fit_model_recovers_the_model_that_made_the_times():
    """Each request kind's fixed cost apart: the smallest intercept is the leg."""
    truth = RouteCostModel(leg_s=0.004, prefill_fixed_s=0.01, prefill_tokens_per_s=20_000,
                           prefill_s_per_token2=3e-10, transfer_fixed_s=0.15,
                           transfer_bytes_per_s=5e9, bytes_per_token=131_072,
                           decode_tokens_per_s=30_000, decode_s_per_token2=5e-10, block_size=16)
    lengths = (1024, 4096, 8192, 16384)
    # Decode's turns: cold ones, and appends of 64 tokens after n + 5 held (a partial block of
    # 5, which decode computes again: n cached, 69 computed).
    cold = [(0, n, truth.decode_s(held=0, new=n)) for n in lengths]
    appends = [(n, 69, truth.decode_s(held=n + 5, new=64)) for n in lengths]
    measured = Measurements(
        prefill=tuple((0, n, truth.leg_s + truth.prefill_s(held=0, new=n)) for n in lengths),
        handover=tuple((n, truth.leg_s + truth.transfer_s(n)) for n in lengths),
        decode_local=tuple(cold + appends),
    )
    fitted = fit_model(measured, base=RouteCostModel(bytes_per_token=131_072), block_size=16)
    for name, value in truth.to_wire().items():
        assert getattr(fitted, name) == pytest.approx(value, rel=1e-4, abs=1e-12), name


def test_nixl_metrics_set_the_bytes_per_token_and_the_rate():
    measured = Measurements(prefill=((0, 100, 0.5), (0, 200, 0.75), (0, 400, 1.25)),
                            handover=((100, 0.2), (200, 0.2), (400, 0.21)),
                            transfer_bytes=7e6 * 700, transfer_seconds=0.7, transfer_tokens=700)
    fitted = fit_model(measured)
    assert fitted.bytes_per_token == 7_000_000
    assert fitted.transfer_bytes_per_s == pytest.approx(7e9)


@given(st.integers(0, 5000), st.integers(1, 5000))
def test_first_true_finds_the_smallest_of_a_once_turning_condition(threshold, limit):
    found = _first_true(lambda n: n >= threshold, limit)
    expected = max(threshold, 1) if max(threshold, 1) <= limit else None
    assert found == expected


def test_crossovers_of_the_default_model():
    # Equal rates on one machine: decode's local prefill is cheaper than a pull for any append,
    # and without a handover's fixed cost a pull beats recomputing any context at once.
    cross = crossovers(RouteCostModel(), max_model_len=8192)
    assert cross["pull_beats_local_above_new_tokens"] is None
    assert cross["pull_beats_recompute_above_context"] == 1
    # A decode 4x slower: 0.03 + n / 100 > 0.06 + (4096 + n) * 23040 / 2e9 + n / 400 above 10.3.
    slow = RouteCostModel(decode_tokens_per_s=100.0)
    assert crossovers(slow, max_model_len=8192)["pull_beats_local_above_new_tokens"] == 11


def test_route_cost_is_refused_unless_known_and_valid():
    with pytest.raises(ConfigError, match="unknown route_cost keys leg_ms"):
        RouteCostModel.from_wire({"leg_ms": 3})
    with pytest.raises(ConfigError, match="transfer_fixed_s must not be negative"):
        RouteCostModel.from_wire({"transfer_fixed_s": -1.0})
    with pytest.raises(ConfigError, match="must be an object"):
        RouteCostModel.from_wire([1])


def test_the_cluster_file_carries_the_calibration_to_route_policy(tmp_path):
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps({**SPEC, "kv_recompute_threshold": 1}))
    with Cluster.from_file(path) as cluster:
        assert cluster.policy.route == RoutePolicy()
    model = RouteCostModel(leg_s=0.002, transfer_fixed_s=0.17, prefill_tokens_per_s=30_000.0,
                           prefill_s_per_token2=4e-10, decode_fixed_s=0.006)
    write_route_cost(path, model)
    written = json.loads(path.read_text())
    assert written["kv_recompute_threshold"] == 1  # the rest of the file is kept
    with Cluster.from_file(path) as cluster:
        assert cluster.policy.route.cost == model
        assert cluster.policy.recompute_threshold == 1
        # A session saved with it (dataclasses.asdict) reads back the same model.
        assert CachePolicy(route={"cost": written["route_cost"]}).route.cost == model
    path.write_text(json.dumps({**SPEC, "route_cost": {"leg": 1}}))
    with pytest.raises(ConfigError, match="unknown route_cost keys leg"):
        Cluster.from_file(path)


def test_lengths_are_capped_by_the_served_context():
    assert choose_lengths(CalibrateConfig(), max_model_len=8192) == (256, 1024, 2048, 4096)
    assert choose_lengths(CalibrateConfig(quick=True), max_model_len=None) == (128, 512, 1024)
    assert choose_lengths(CalibrateConfig(max_length=2048), max_model_len=None) == (
        256, 1024, 2048)
    with pytest.raises(ConfigError, match="two context lengths"):
        choose_lengths(CalibrateConfig(), max_model_len=600)


def test_an_appends_tax_is_the_gap_it_opens_over_the_streams_median():
    times = [0.0, 0.02, 0.04, 0.06, 0.08, 0.20, 0.22, 0.24, 0.26, 0.33, 0.35]
    rows = tax_rows(times, [(64, 0.09, 0.19), (16, 0.27, 0.32), (8, 5.0, 5.1)])
    assert [(r.new, round(r.gap_s, 3), round(r.itl_s, 3), round(r.tax_s, 3)) for r in rows] == [
        (64, 0.12, 0.02, 0.1), (16, 0.07, 0.02, 0.05)]  # the append after the stream: no row
    assert tax_rows(times, []) == ()
    assert tax_rows([0.0, 0.1], [(64, 0.0, 0.2)]) == ()  # no quiet gap to compare with
