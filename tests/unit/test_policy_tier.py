"""CachePolicy.decide_tier and decide_tier_attach: when a pin goes to the file tier, and when a
tier reference is sent. Pure functions of the handle, the clock and what was observed."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agentkv import CachePolicy, ConfigError, HandleState, KVHandle, TierCostModel, TierRef

TIER = TierRef(id="a" * 32, n_tokens=1000)


def handle(*, num_tokens=1000, deadline=450.0, leased=True) -> KVHandle:
    return KVHandle(
        pair="p0",
        engine_id="d",
        request_id="r",
        block_ids=((1, 2),),
        host="h",
        port=1,
        num_tokens=num_tokens,
        issued_at=0.0,
        deadline=deadline,
        lease_ttl_s=480.0 if leased else None,
    )


def decide(policy=None, h=None, **kwargs):
    kwargs.setdefault("now", 0.0)
    kwargs.setdefault("tier_available", True)
    return (policy or CachePolicy()).decide_tier(handle() if h is None else h, **kwargs)


# --- the cost model --------------------------------------------------------------------------


def test_the_cost_model_writes_down_the_measured_numbers():
    cost = TierCostModel()
    assert cost.bytes(2048) == 47_185_920  # 2,048 SmolLM2-135M bf16 tokens: 47.2 MB
    assert cost.persist_s(2048) == pytest.approx(47_185_920 / 2.0e9 + 0.035)
    assert cost.resume_s(2048) < 0.011
    assert cost.recompute_s(2048) == pytest.approx(2048 / 540)


@pytest.mark.parametrize(
    "bad",
    [{"bytes_per_token": 0}, {"write_bytes_per_s": 0}, {"read_bytes_per_s": -1.0},
     {"recompute_tokens_per_s": float("inf")}, {"fsync_s": -0.1}],
)
def test_a_cost_model_without_positive_rates_is_refused(bad):
    with pytest.raises(ConfigError):
        TierCostModel(**bad)


def test_a_policy_from_a_saved_dict_rebuilds_its_cost_model():
    policy = CachePolicy(tier_cost=TierCostModel(recompute_tokens_per_s=40.0))
    again = CachePolicy(**dataclasses.asdict(policy))
    assert again == policy
    assert isinstance(again.tier_cost, TierCostModel)


@pytest.mark.parametrize("bad", [{"persist_after_s": -1.0}, {"persist_kv_usage": 0.0},
                                 {"persist_kv_usage": 1.5}])
def test_bad_tier_thresholds_are_refused(bad):
    with pytest.raises(ConfigError):
        CachePolicy(**bad)


# --- decide_tier -----------------------------------------------------------------------------


def test_no_handle_and_an_expired_handle_are_dropped_never_persisted():
    assert CachePolicy().decide_tier(None, now=0.0, tier_available=True).action == "drop"
    late = decide(h=handle(deadline=10.0), now=10.0, hint="disk")
    assert late.action == "drop"
    assert "deadline" in late.reason


def test_a_handle_without_a_lease_or_a_decode_without_a_tier_keeps_its_pin():
    assert decide(h=handle(leased=False), hint="disk").action == "pin"
    no_tier = decide(hint="disk", tier_available=False)
    assert no_tier.action == "pin"
    assert "no file tier" in no_tier.reason


def test_explicit_hints_win_over_the_wait():
    assert decide(hint="disk", expected_wait_s=0.0).action == "persist"
    assert decide(hint="pin", expected_wait_s=86_400.0).action == "pin"


def test_a_wait_or_idle_time_past_the_threshold_persists_a_shorter_one_keeps_the_pin():
    policy = CachePolicy(persist_after_s=60.0)
    assert decide(policy, expected_wait_s=59.9).action == "pin"
    long_wait = decide(policy, expected_wait_s=60.0)
    assert long_wait.action == "persist"
    assert "a wait of 60.0s" in long_wait.reason
    assert decide(policy, idle_s=120.0).action == "persist"
    assert "idle" in decide(policy, idle_s=120.0).reason


def test_decode_memory_pressure_persists_before_any_wait():
    policy = CachePolicy(persist_kv_usage=0.8)
    assert decide(policy, decode_kv_usage=0.79).action == "pin"
    pressed = decide(policy, decode_kv_usage=0.8)
    assert pressed.action == "persist"
    assert "KV usage" in pressed.reason


def test_a_handle_that_recomputes_as_fast_as_it_loads_is_not_persisted():
    slow_disk = CachePolicy(tier_cost=TierCostModel(read_bytes_per_s=1_000.0))
    decision = decide(slow_disk, expected_wait_s=3600.0)
    assert decision.action == "pin"
    assert "recompute" in decision.reason


def test_the_wait_must_also_cover_the_write():
    slow_write = CachePolicy(
        persist_after_s=1.0, tier_cost=TierCostModel(write_bytes_per_s=1e6, read_bytes_per_s=1e9)
    )
    # 1,000 tokens * 23,040 B at 1 MB/s: 23 s to write.
    assert decide(slow_write, expected_wait_s=10.0).action == "pin"
    assert decide(slow_write, expected_wait_s=30.0).action == "persist"


@pytest.mark.parametrize("bad", [{"expected_wait_s": -1.0}, {"idle_s": float("nan")},
                                 {"hint": "ssd"}])
def test_bad_inputs_are_refused(bad):
    with pytest.raises(ValueError, match="must be"):
        decide(**bad)


@given(
    wait=st.floats(min_value=0, max_value=1e6),
    idle=st.floats(min_value=0, max_value=1e6),
    usage=st.none() | st.floats(min_value=0, max_value=1),
    hint=st.sampled_from(["auto", "pin", "disk"]),
    tier=st.booleans(),
    leased=st.booleans(),
    now=st.floats(min_value=0, max_value=1000),
)
def test_never_persists_past_the_deadline_without_a_lease_without_a_tier_or_against_pin(
    wait, idle, usage, hint, tier, leased, now
):
    h = handle(leased=leased, deadline=450.0)
    decision = CachePolicy().decide_tier(
        h, now=now, expected_wait_s=wait, idle_s=idle, hint=hint, decode_kv_usage=usage,
        tier_available=tier,
    )
    if decision.action == "persist":
        assert now < h.deadline
        assert leased
        assert tier
        assert hint != "pin"
    if hint == "disk" and now < h.deadline and leased and tier:
        assert decision.action == "persist"


# --- decide_tier_attach ----------------------------------------------------------------------


def test_a_tier_ref_whose_tokens_the_prompt_starts_with_is_sent():
    decision = CachePolicy().decide_tier_attach(TIER, prompt_len=1200, prefix_matches=True)
    assert (decision.attach, decision.state) == (True, HandleState.TIER)


def test_a_diverged_prompt_never_carries_the_tier_ref():
    diverged = CachePolicy().decide_tier_attach(TIER, prompt_len=1200, prefix_matches=False)
    assert (diverged.attach, diverged.state) == (False, HandleState.DIVERGED)
    shorter = CachePolicy().decide_tier_attach(TIER, prompt_len=999, prefix_matches=True)
    assert (shorter.attach, shorter.state) == (False, HandleState.DIVERGED)


def test_no_ref_and_a_ref_below_min_reuse_are_not_sent():
    policy = CachePolicy(min_reuse_tokens=2000)
    assert policy.decide_tier_attach(None, prompt_len=10, prefix_matches=False).state is (
        HandleState.NONE
    )
    small = policy.decide_tier_attach(TIER, prompt_len=1200, prefix_matches=True)
    assert (small.attach, small.state) == (False, HandleState.BELOW_THRESHOLD)
