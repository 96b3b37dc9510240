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
    requested="auto", *, new=200, held=4000, queued=0, attach=True, tier=False, policy=POLICY
):
    return policy.decide(
        requested,
        new_tokens=new,
        held_tokens=held,
        decode_queued=queued,
        attach=attach,
        tier=tier,
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
    policy = RoutePolicy(decode_max_tokens=512)
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
    assert decide(new=100).route == "decode"


def test_the_cost_model_prices_each_route():
    cost = RouteCostModel(
        leg_s=0.01,
        prefill_tokens_per_s=1000.0,
        decode_tokens_per_s=500.0,
        transfer_bytes_per_s=1e9,
        bytes_per_token=1000,
    )
    assert cost.pull_s(held=1000, new=100) == pytest.approx(0.02 + 1100 * 1e-6 + 0.1)
    assert cost.decode_s(new=100, queued=50) == pytest.approx(0.01 + 0.3)


@given(
    new=st.integers(0, 10**6),
    held=st.integers(0, 10**6),
    queued=st.integers(0, 10**6),
    attach=st.booleans(),
    tier=st.booleans(),
    budget=st.integers(0, 10**5),
)
def test_auto_never_goes_local_past_the_budget_or_reuses_nothing_by_pulling(
    new, held, queued, attach, tier, budget
):
    policy = RoutePolicy(decode_max_tokens=budget)
    decision = decide(new=new, held=held, queued=queued, attach=attach, tier=tier, policy=policy)
    assert decision.route in ("pull", "decode", "recompute")
    assert decision.reason
    if decision.route == "decode":
        assert attach
        assert not tier
        assert new + queued <= budget
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
