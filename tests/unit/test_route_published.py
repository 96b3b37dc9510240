"""The route cost model, fed published GPU figures, prices and picks what they measured.

Sources (``/work/shared/DESIGN.md`` section 7, ``docs/benchmarks.md`` "Calibration"): llm-d's
``guides/p2p-kv-cache-sharing/benchmark-results/gpt-oss-120b-h200.md`` (pull vs recompute on
H200), vllm#51919 / vllm#50913 (vLLM's P->D handover: ~197 ms p50, ~29 ms of it the transfer;
167 MB in 38.7 ms on average), and measurements on one H200 (prefill of the Qwen3-8B and -32B
shapes, copies at 55 GB/s, a decode step's delay when a session's new tokens join it).
The fit is the one ``agentkv calibrate`` runs on its own measurements (``_calibrate_fit``).
"""

from __future__ import annotations

import pytest

from agentkv import RouteCostModel, RoutePolicy
from agentkv.bench._calibrate_fit import Measurements, fit_line, fit_model, fit_quadratic

MS = 1e-3
# gpt-oss-120b: 36 layers x 8 KV heads x 64 x (K, V) x bf16 (nominal: the fitted rate is per
# byte, so only its unit depends on it).
GPT_OSS_BYTES = 36 * 8 * 64 * 2 * 2
LLM_D_RECOMPUTE = [(2048, 70.6), (8192, 205), (16384, 426), (32768, 983), (49152, 1695)]
LLM_D_PULL = [(2048, 49.0), (8192, 120), (16384, 196), (32768, 376), (49152, 551)]
H200_PREFILL_8B = [(1024, 37), (4096, 133), (16384, 640), (32768, 1526)]
H200_PREFILL_32B = [(1024, 130), (4096, 538), (16384, 2477), (32768, 5865)]
# One session's new tokens in a 32-session decode step at 4k context (8B shape): the delay every
# other session's next token takes, once.
H200_DECODE_TAX_8B = [(16, 6.0), (64, 6.6), (256, 9.4), (1024, 31)]
KIB = 1024


def _seconds(points):
    return tuple((n, ms * MS) for n, ms in points)


@pytest.fixture(scope="module")
def llm_d() -> RouteCostModel:
    # llm-d's pull is one request that pulls a prefix: the "handover" of our fit.
    measured = Measurements.cold(_seconds(LLM_D_RECOMPUTE), handover=_seconds(LLM_D_PULL))
    return fit_model(measured, base=RouteCostModel(bytes_per_token=GPT_OSS_BYTES), block_size=16)


@pytest.mark.parametrize(("tokens", "pull_ms", "recompute_ms"), [
    (n, p, r) for (n, r), (_, p) in zip(LLM_D_RECOMPUTE, LLM_D_PULL, strict=True)
])
def test_llm_d_h200_pull_and_recompute_are_priced_within_7_percent(
    llm_d, tokens, pull_ms, recompute_ms
):
    pull = llm_d.leg_s + llm_d.transfer_s(tokens)
    recompute = llm_d.leg_s + llm_d.prefill_s(held=0, new=tokens)
    assert pull == pytest.approx(pull_ms * MS, rel=0.07)
    assert recompute == pytest.approx(recompute_ms * MS, rel=0.07)
    assert pull < recompute
    # And the routes: the pull is the faster way at every published context.
    assert llm_d.pull_s(held=tokens, new=64) < llm_d.recompute_s(held=tokens, new=64)


def test_llm_d_h200_fit_separates_fixed_and_per_token_costs(llm_d):
    # ~27 ms of a pull is fixed, ~10.6 us a token (a straight line through the published pulls).
    assert llm_d.leg_s + llm_d.transfer_fixed_s == pytest.approx(0.0275, abs=0.002)
    per_token = GPT_OSS_BYTES / llm_d.transfer_bytes_per_s
    assert per_token == pytest.approx(10.6e-6, rel=0.05)
    # Recompute bends up with the context: attention's quadratic term is fitted, not zero.
    assert llm_d.prefill_s_per_token2 > 0
    crossover = llm_d.pull_beats_recompute_above(new=0, limit=49_152)
    assert crossover is not None
    assert crossover <= 2048


def _vllm_handover_model(**overrides) -> RouteCostModel:
    """vllm#51919's handover (197 ms p50, 29 ms of it moving the bytes) at vllm#50913's rate
    (167 MB in 38.7 ms on average), on an H200 prefilling the 8B shape."""
    prefill = fit_quadratic(_seconds(H200_PREFILL_8B))
    # Measured at one context (4k): the tax grows with the append, not with the context, so a
    # line (the model's quadratic term is attention's, over the context).
    tax_fixed, tax_per_token = fit_line(_seconds(H200_DECODE_TAX_8B))
    values = {
        "leg_s": prefill.fixed,
        "prefill_tokens_per_s": 1 / prefill.per_token,
        "prefill_s_per_token2": prefill.per_token2,
        "transfer_fixed_s": 0.197 - 0.029,
        "transfer_bytes_per_s": 167e6 / 0.0387,
        "bytes_per_token": 128 * KIB,
        "block_size": 16,
        "decode_fixed_s": tax_fixed,
        "decode_tokens_per_s": 1 / tax_per_token,
    }
    return RouteCostModel(**(values | overrides))


def test_vllm_handover_is_mostly_fixed_cost_a_bandwidth_only_model_misses():
    gpu = _vllm_handover_model()
    tokens = round(0.029 * gpu.transfer_bytes_per_s / gpu.bytes_per_token)  # 29 ms of bytes
    assert gpu.transfer_s(tokens) == pytest.approx(0.197, rel=0.01)
    bandwidth_only = _vllm_handover_model(transfer_fixed_s=0.0)
    assert bandwidth_only.transfer_s(tokens) < gpu.transfer_s(tokens) / 6


@pytest.mark.parametrize(("shape", "points", "bytes_per_token"), [
    ("8B", H200_PREFILL_8B, 128 * KIB),
    ("32B", H200_PREFILL_32B, 256 * KIB),
])
def test_h200_moving_a_prefix_at_55_gbps_is_14_to_38_times_cheaper_than_recomputing_it(
    shape, points, bytes_per_token
):
    prefill = fit_quadratic(_seconds(points))
    model = RouteCostModel(
        leg_s=prefill.fixed, prefill_tokens_per_s=1 / prefill.per_token,
        prefill_s_per_token2=prefill.per_token2, transfer_bytes_per_s=55e9,
        bytes_per_token=bytes_per_token,
    )
    ratios = []
    for tokens, ms in points:
        recompute = model.leg_s + model.prefill_s(held=0, new=tokens)
        assert recompute == pytest.approx(ms * MS, rel=0.1), shape
        ratios.append(recompute / model.transfer_s(tokens))
    assert min(ratios) >= 13, (shape, ratios)
    assert max(ratios) <= 39, (shape, ratios)


def test_h200_decode_step_tax_of_64_new_tokens_is_6_6_ms_against_a_200_ms_handover():
    gpu = _vllm_handover_model()
    tax = gpu.decode_local_s(held=4096, new=64)
    assert tax == pytest.approx(6.6 * MS, rel=0.1)
    assert tax < gpu.transfer_s(1) / 25
    for new, ms in H200_DECODE_TAX_8B:
        assert gpu.decode_local_s(held=4096, new=new) == pytest.approx(ms * MS, rel=0.2)


def test_on_the_gpu_figures_auto_computes_appends_on_decode_the_handover_decides():
    gpu = _vllm_handover_model()
    policy = RoutePolicy(decode_max_tokens=4096, decode_busy_max_tokens=1024, cost=gpu)
    decision = policy.decide(
        "auto", new_tokens=64, held_tokens=4096, decode_queued=0, attach=True,
        block_size=16, decode_running=31,
    )
    assert decision.route == "decode", decision.reason
    # Decode's own compute beats two ~170 ms handovers for any append within the context: the
    # local route's bound is its cost to the others (the budgets), not its session's latency.
    assert gpu.pull_beats_local_above(held=4096, limit=32_768 - 4096, block=16) is None
    # Where the CPU pair's defaults pull (a long append after a partial block), the GPU computes.
    cpu = RoutePolicy(decode_max_tokens=4096, decode_busy_max_tokens=1024)
    args = {"new_tokens": 500, "held_tokens": 4096 + 127, "decode_queued": 0, "attach": True}
    assert cpu.decide("auto", **args).route == "pull"
    assert policy.decide("auto", **args).route == "decode"


def test_a_slow_decode_has_a_crossover_in_new_tokens():
    # Decode ten times slower at prefill than prefill (a busy or small decode): long appends pull.
    slow = _vllm_handover_model(decode_tokens_per_s=4000.0)
    crossover = slow.pull_beats_local_above(held=4096, limit=32_768, block=16)
    assert crossover is not None
    assert 500 < crossover < 4000
    assert slow.pull_s(held=4096, new=crossover) < slow.decode_s(held=4096, new=crossover)
    assert slow.pull_s(held=4096, new=crossover - 1) >= slow.decode_s(held=4096, new=crossover - 1)
