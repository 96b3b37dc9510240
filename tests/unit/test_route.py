"""The route policy: a pure function of the turn's sizes, decode's queue and the cost model."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agentkv import CachePolicy, ConfigError, RouteCostModel, RoutePolicy
from agentkv._route import ROUTES, check_route

POLICY = RoutePolicy()


def decide(
    requested="auto",
    *,
    new=40,
    held=4096,
    queued=0,
    attach=True,
    tier=False,
    decode_running=0,
    policy=POLICY,
):
    return policy.decide(
        requested,
        new_tokens=new,
        held_tokens=held,
        decode_queued=queued,
        attach=attach,
        tier=tier,
        decode_running=decode_running,
    )


def test_an_explicit_route_is_taken():
    assert decide("decode").route == "decode"
    assert decide("pull").route == "pull"
    assert decide("recompute").route == "recompute"
    assert decide("decode", new=10**6).reason == "asked for"


def test_pull_with_nothing_to_pull_recomputes():
    decision = decide("pull", attach=False)
    assert (decision.route, decision.reason) == ("recompute", "no handle to reuse")


def test_auto_without_a_handle_recomputes_and_with_a_tier_entry_pulls():
    assert decide(attach=False).route == "recompute"
    assert decide(attach=False, tier=True).route == "pull"


def test_auto_keeps_decodes_local_prefill_within_its_budget():
    fast = RouteCostModel(decode_tokens_per_s=1e6)  # the cost model never in the way here
    policy = RoutePolicy(decode_max_tokens=512, cost=fast)
    assert decide(new=512, policy=policy).route == "decode"
    over = decide(new=513, policy=policy)
    assert over.route == "pull"
    assert over.reason == "513 new + 0 queued tokens exceed decode's local budget of 512"
    assert decide(new=300, queued=300, policy=policy).route == "pull"
    assert decide(new=1, policy=RoutePolicy(decode_max_tokens=0)).route == "pull"


def test_auto_follows_the_cost_model():
    # A decode far slower at prefill than prefill is (and a fast link): pulling wins.
    slow = RoutePolicy(cost=RouteCostModel(decode_tokens_per_s=10.0, leg_s=0.0))
    decision = decide(new=100, policy=slow)
    assert decision.route == "pull"
    assert decision.reason.startswith("est. ")
    assert decide(new=40).route == "decode"
    # Decode recomputes the history's partial last block, which a pull carries over.
    assert decide(new=40, held=4096 + 127).route == "pull"


def test_the_cost_model_prices_each_route():
    cost = RouteCostModel(
        leg_s=0.01,
        prefill_tokens_per_s=1000.0,
        decode_tokens_per_s=500.0,
        transfer_bytes_per_s=1e9,
        bytes_per_token=1000,
        block_size=128,
    )
    assert cost.pull_s(held=1000, new=100) == pytest.approx(0.02 + 1100 * 1e-6 + 0.1)
    # Decode recomputes the history's partial last block: 1000 % 128 = 104 tokens.
    assert cost.decode_s(held=1000, new=100, queued=50) == pytest.approx(0.01 + 254 / 500)
    assert cost.decode_s(held=1000, new=100, block=16) == pytest.approx(0.01 + 108 / 500)


@given(
    new=st.integers(0, 10**6),
    held=st.integers(0, 10**6),
    queued=st.integers(0, 10**6),
    attach=st.booleans(),
    tier=st.booleans(),
    budget=st.integers(0, 10**5),
    running=st.integers(0, 3),
)
def test_auto_never_goes_local_past_the_budget_or_reuses_nothing_by_pulling(
    new, held, queued, attach, tier, budget, running
):
    policy = RoutePolicy(decode_max_tokens=budget, decode_busy_max_tokens=budget // 2)
    decision = decide(
        new=new, held=held, queued=queued, attach=attach, tier=tier, policy=policy,
        decode_running=running,
    )
    assert decision.route in ("pull", "decode", "recompute")
    assert decision.reason
    if decision.route == "decode":
        assert attach
        assert not tier
        assert new + queued <= (budget // 2 if running else budget)
    if decision.route == "pull":
        assert attach or tier
    if not (attach or tier):
        assert decision.route == "recompute"


def test_bad_settings_are_refused():
    with pytest.raises(ConfigError):
        RoutePolicy(decode_max_tokens=-1)
    with pytest.raises(ConfigError):
        RouteCostModel(decode_tokens_per_s=0.0)
    with pytest.raises(ConfigError):
        RouteCostModel(leg_s=-1.0)
    with pytest.raises(ConfigError, match="route must be one of"):
        check_route("sideways")
    assert [check_route(route) for route in ROUTES] == list(ROUTES)


def test_a_saved_policy_round_trips_through_its_dict():
    policy = CachePolicy(route=RoutePolicy(decode_max_tokens=128, cost=RouteCostModel(leg_s=0.5)))
    assert CachePolicy(**dataclasses.asdict(policy)) == policy


def test_while_decode_serves_others_auto_keeps_to_the_busy_budget():
    """A local prefill runs between decode's other requests' tokens: while any run there, the
    busy budget applies (64 tokens by default)."""
    assert decide(new=200, decode_running=0).route == "decode"
    busy = decide(new=200, decode_running=3)
    assert busy.route == "pull"
    assert busy.reason == (
        "200 new + 0 queued tokens exceed decode's busy budget of 64 (3 requests running)"
    )
    assert decide(new=40, decode_running=3).route == "decode"
    strict = RoutePolicy(decode_busy_max_tokens=0)
    assert decide(new=1, decode_running=1, policy=strict).route == "pull"
    with pytest.raises(ConfigError, match="decode_busy_max_tokens"):
        RoutePolicy(decode_busy_max_tokens=-1)


def test_no_turn_is_computed_on_a_decode_that_would_keep_it_pinned():
    """A stock vLLM 0.32 decode never frees a local turn's pin: without agentkv's connector
    there, neither an explicit nor an automatic decode route."""
    stock = POLICY.decide(
        "decode", new_tokens=40, held_tokens=4096, decode_queued=0, attach=True, local_ok=False
    )
    assert stock.route == "pull"
    assert "lacks agentkv's connector" in stock.reason
    fresh = POLICY.decide(
        "decode", new_tokens=40, held_tokens=0, decode_queued=0, attach=False, local_ok=False
    )
    assert fresh.route == "recompute"
    auto = POLICY.decide(
        "auto", new_tokens=40, held_tokens=4096, decode_queued=0, attach=True, local_ok=False
    )
    assert auto.route == "pull"
