"""The TTFT cost model: KV sizes and FLOPs from model shapes, and what a pull saves."""

from __future__ import annotations

import pytest

from agentkv.bench._cost import (
    P5EN_AS_PUBLISHED,
    P5EN_EFA_HALF_RATE,
    P5EN_EFA_LINE_RATE,
    QWEN3_32B,
    SMOLLM2_135M,
    Link,
    predict,
)


def test_kv_bytes_per_token_follow_the_model_shapes():
    assert QWEN3_32B.kv_bytes_per_token == 256 * 1024
    # 30 layers x 3 KV heads x 64 x (K, V) x bf16: what the local pair moves per token.
    assert SMOLLM2_135M.kv_bytes_per_token == 23_040


def test_prefill_flops_are_linear_plus_causal_attention():
    model = QWEN3_32B
    one = model.prefill_flops(new=1, cached=0)
    assert one == pytest.approx(2 * 31.2e9 + 4 * 64 * 64 * 128, rel=1e-9)
    # Appending to a long context costs attention over it, not a re-prefill.
    assert model.prefill_flops(new=100, cached=10_000) < 0.02 * model.prefill_flops(
        new=10_100, cached=0
    )
    split = model.prefill_flops(new=600, cached=0) + model.prefill_flops(new=400, cached=600)
    assert split == pytest.approx(model.prefill_flops(new=1000, cached=0))


def test_with_nothing_reusable_a_pull_cannot_help():
    free = Link(name="x", flops_per_s=1e15, bytes_per_s=1e12, fixed_s=0.0, pull_setup_s=0.0)
    p = predict(QWEN3_32B, free, prompt_tokens=4096, new_tokens=4096)
    assert p.speedup == pytest.approx(1.0)


def test_the_fit_reproduces_the_published_qwen3_32b_run():
    # Published (1P1D p5en, EFA; ~120-160 new tokens a turn): TTFT 158 -> 778 ms cold and
    # 122 -> 460 ms with the pull from 2k to 24k, "about 1.6x" at the longest prompt.
    short = predict(QWEN3_32B, P5EN_AS_PUBLISHED, prompt_tokens=2048, new_tokens=140)
    long = predict(QWEN3_32B, P5EN_AS_PUBLISHED, prompt_tokens=24576, new_tokens=140)
    assert short.ttft_cold_s == pytest.approx(0.158, rel=0.15)
    assert long.ttft_cold_s == pytest.approx(0.778, rel=0.05)
    assert long.ttft_pull_s == pytest.approx(0.460, rel=0.05)
    assert long.speedup == pytest.approx(1.6, rel=0.1)


def test_the_speedup_grows_with_the_reused_context_and_the_link():
    for link in (P5EN_AS_PUBLISHED, P5EN_EFA_HALF_RATE, P5EN_EFA_LINE_RATE):
        speedups = [predict(QWEN3_32B, link, prompt_tokens=n, new_tokens=140).speedup
                    for n in (2048, 8192, 24576)]
        assert speedups == sorted(speedups)
    at_24k = [predict(QWEN3_32B, link, prompt_tokens=24576, new_tokens=140).speedup
              for link in (P5EN_AS_PUBLISHED, P5EN_EFA_HALF_RATE, P5EN_EFA_LINE_RATE)]
    assert at_24k == sorted(at_24k)


def test_bad_token_counts_are_refused():
    with pytest.raises(ValueError, match="new_tokens"):
        predict(QWEN3_32B, P5EN_AS_PUBLISHED, prompt_tokens=10, new_tokens=0)
