"""CachePolicy and RetryPolicy: pure decisions with an injected clock."""

from __future__ import annotations

import pytest

from agentkv import CachePolicy, ConfigError, HandleState, KVHandle, RetryPolicy


def handle(*, num_tokens=500, issued_at=0.0, policy=None) -> KVHandle:
    policy = policy or CachePolicy()
    return KVHandle(
        pair="p0",
        engine_id="d",
        request_id="r",
        block_ids=((1, 2),),
        host="h",
        port=1,
        num_tokens=num_tokens,
        issued_at=issued_at,
        deadline=policy.deadline(issued_at),
    )


def test_deadline_is_server_ttl_minus_margin_from_the_send_time():
    assert CachePolicy(server_ttl_s=480, ttl_margin_s=30).deadline(100.0) == 550.0


def test_no_handle_is_not_attached():
    decision = CachePolicy().decide_attach(None, prompt_len=600, now=0.0)
    assert (decision.attach, decision.state) == (False, HandleState.NONE)


def test_a_valid_handle_is_attached_until_its_deadline():
    policy = CachePolicy(server_ttl_s=480, ttl_margin_s=30)
    h = handle(policy=policy)
    assert policy.decide_attach(h, prompt_len=600, now=449.9).attach
    late = policy.decide_attach(h, prompt_len=600, now=450.0)
    assert (late.attach, late.state) == (False, HandleState.EXPIRED)
    assert "deadline" in late.reason


def test_expiry_is_one_rule_that_every_decision_agrees_with():
    """Attach, extend and the tier drop a handle at the same instant overdue_s reports it."""
    policy = CachePolicy(server_ttl_s=480, ttl_margin_s=30)
    h = handle(policy=policy)
    for now, overdue in ((449.9, None), (450.0, 0.0), (452.5, 2.5)):
        assert policy.overdue_s(h, now=now) == overdue
        expired = overdue is not None
        assert policy.decide_attach(h, prompt_len=600, now=now).attach is not expired
        tier = policy.decide_tier(h, now=now, tier_available=False)
        assert (tier.action == "drop") is expired


def test_below_the_recompute_threshold_is_not_attached():
    policy = CachePolicy(recompute_threshold=64)
    decision = policy.decide_attach(handle(num_tokens=63), prompt_len=100, now=0.0)
    assert (decision.attach, decision.state) == (False, HandleState.BELOW_THRESHOLD)
    assert policy.decide_attach(handle(num_tokens=64), prompt_len=100, now=0.0).attach


def test_min_reuse_tokens_raises_the_floor():
    policy = CachePolicy(recompute_threshold=64, min_reuse_tokens=200)
    assert not policy.decide_attach(handle(num_tokens=150), prompt_len=300, now=0.0).attach


def test_a_handle_covering_the_whole_prompt_is_diverged():
    decision = CachePolicy().decide_attach(handle(num_tokens=500), prompt_len=500, now=0.0)
    assert (decision.attach, decision.state) == (False, HandleState.DIVERGED)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"server_ttl_s": 0},
        {"ttl_margin_s": 480},
        {"ttl_margin_s": -1},
        {"recompute_threshold": -1},
        {"min_reuse_tokens": -5},
    ],
)
def test_bad_cache_policies_are_config_errors(kwargs):
    with pytest.raises(ConfigError):
        CachePolicy(**kwargs)


@pytest.mark.parametrize("kwargs", [{"max_attempts": 0}, {"initial_backoff_s": -1}])
def test_bad_retry_policies_are_config_errors(kwargs):
    with pytest.raises(ConfigError):
        RetryPolicy(**kwargs)
