"""The decode-pressure workload on the fake pair: the SDK's own tool-wait policy moves pins to the
tier when decode's memory is full, evictions are counted from the handles' real states, and
decode's metrics are sampled through each mode's phase."""

from __future__ import annotations

import asyncio

from agentkv.bench import BenchConfig, ClusterTarget, parse_modes, run_bench
from agentkv.testing import FakeCluster

# Sessions of two turns, ~500 then ~600 tokens: a turn-1 pin holds ~33 of the fake's 16-token
# blocks. Sixteen of them (~530) outgrow a decode of 400 blocks.
TINY = {"turns": 2, "context_tokens": 64, "tool_tokens": 16, "output_tokens": 16}
PRESSURE = {**TINY, "sessions": 16, "think_time_s": 10.0, "time_scale": 1e-4}


def small_decode(**options):
    return FakeCluster(pairs=1, kv_recompute_threshold=16, tier=True, num_kv_blocks=400,
                       **options)


def run(fake, modes, **settings):
    config = BenchConfig(modes=parse_modes(modes), **settings)
    target = ClusterTarget(spec=fake.cluster_spec, transport=fake.transport)
    return asyncio.run(run_bench(config, target=target, decode_sample_s=0.005))


def test_under_decode_pressure_the_sdks_tool_wait_moves_pins_to_the_tier():
    """Ten-second pauses (a millisecond in real time) are far below ``persist_after_s``: only
    decode's memory, read from its /metrics at the pause, can send a pin to the tier. Once
    the pins fill 90% of decode, it does, and those sessions resume from the tier at the ideal;
    affinity holds nothing on decode."""
    fake = small_decode()
    report = run(fake, "affinity,agentkv", **PRESSURE, pause="tool-wait", serial_modes=True)
    assert "errors" not in report, report.get("errors")
    assert fake.wrong_reuse_events == 0
    agentkv = report["modes"]["agentkv"]["summary"]
    assert 0 < agentkv["tier_resumes"] < 16
    assert agentkv["handle_states_after_first_turn"] == {
        "attached": 16 - agentkv["tier_resumes"], "tier": agentkv["tier_resumes"]}
    assert (agentkv["tier_shortfalls"], agentkv["evictions"]) == (0, 0)
    assert agentkv["reuse_vs_ideal"] == 1.0
    assert agentkv["paused_tier_tokens_mean"] > 0
    assert 0.85 <= agentkv["decode_kv_usage_peak"] <= 1.0  # what made the policy persist
    affinity = report["modes"]["affinity"]["summary"]
    assert "evictions" not in affinity
    assert affinity["paused_decode_tokens_mean"] == 0
    assert affinity["decode_kv_usage_peak"] < 0.2  # a turn in flight at most, nothing pinned
    assert report["ratios"]["agentkv_vs_affinity"]["ttft_p50_after_first_turn"] > 0
    decode = fake.decode(0).url
    for phase in ("affinity", "agentkv"):
        sampled = report["decode"]["phases"][phase][decode]
        assert sampled["samples"] >= 3
        assert sampled["preemptions"] == 0  # exported, never incremented by the fake
    assert "tool_wait" in report["config"]["method"]["agentkv"]
    assert fake.decode(0).pinned_handles == 0  # every session closed as its lane ended
    assert not fake.tier.ids


def test_the_same_pressure_with_extended_pins_fills_decode():
    """The reference, ``pause="extend"``, keeps every pin on decode whatever its memory: the
    fake's decode fills up and refuses a D leg (a real one would queue it or preempt)."""
    fake = small_decode()
    report = run(fake, "agentkv", **PRESSURE)
    summary = report["modes"]["agentkv"]["summary"]
    assert summary["tier_resumes"] == 0
    assert summary["paused_tier_tokens_mean"] == 0
    assert report["decode"]["phases"]["run"][fake.decode(0).url]["kv_usage_peak"] >= 0.95
    assert report["errors"]
    assert all("decode" in error["error"] for error in report["errors"])


def test_a_pin_that_expires_during_a_pause_is_counted_as_an_eviction():
    """Decode grants 0.2 s pins and no longer; the pauses last 0.6 s. The SDK's tool wait asks
    for more, is capped, and the next turn finds the handle past its deadline: that turn reuses
    only prefill's own cache, and the report counts it from the turn's handle state."""
    fake = FakeCluster(pairs=1, kv_recompute_threshold=16, decoder_kv_blocks_ttl=0.2,
                       agentkv_max_ttl_s=0.2)
    report = run(fake, "agentkv", **{**TINY, "sessions": 2, "think_time_s": 0.6,
                                     "concurrency": 2, "pause": "tool-wait"})
    assert "errors" not in report, report.get("errors")
    assert fake.wrong_reuse_events == 0
    summary = report["modes"]["agentkv"]["summary"]
    assert summary["handle_states_after_first_turn"] == {"expired": 2}
    assert summary["evictions"] == 2
    assert summary["reuse_vs_ideal"] < 1.0
    # Interleaved (one phase): the run is sampled as a whole, and per mode not at all.
    sampled = report["decode"]["phases"]["run"][fake.decode(0).url]
    assert sampled["samples"] >= 10
    assert "decode_kv_usage_peak" not in summary
