"""CachePolicy's decisions for agentkv's decode extension: pin, extend, release (pure)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentkv import CachePolicy, ConfigError, KVHandle
from agentkv._wire.hints import PinHint


def handle(*, deadline=450.0, leased=True, issued_at=0.0) -> KVHandle:
    return KVHandle(
        pair="p0",
        engine_id="d",
        request_id="r",
        block_ids=((1, 2),),
        host="h",
        port=1,
        num_tokens=500,
        issued_at=issued_at,
        deadline=deadline,
        lease_ttl_s=480.0 if leased else None,
    )


# --- pin --------------------------------------------------------------------------------------


def test_a_normal_turn_asks_decode_to_pin_for_the_policys_ttl():
    assert CachePolicy(pin_ttl_s=120).decide_pin(final=False) == PinHint(ttl_s=120.0)


def test_without_a_pin_ttl_decode_keeps_its_own_default():
    assert CachePolicy().decide_pin(final=False) == PinHint(pin=True, ttl_s=None)


def test_a_final_turn_pins_nothing():
    hint = CachePolicy(pin_ttl_s=120).decide_pin(final=True)
    assert hint == PinHint(pin=False)
    assert hint.to_wire() == {"v": 1, "persist": False}


# --- deadlines of leased handles --------------------------------------------------------------


def test_a_leased_deadline_counts_the_granted_ttl_from_the_send_time_less_the_margin():
    assert CachePolicy(ttl_margin_s=30).lease_deadline(sent_at=100.0, ttl_s=300.0) == 370.0


def test_a_short_lease_keeps_half_its_ttl_as_margin():
    """A server TTL below twice the margin must still leave a usable handle."""
    assert CachePolicy(ttl_margin_s=30).lease_deadline(sent_at=0.0, ttl_s=20.0) == 10.0


# --- extend -----------------------------------------------------------------------------------


def test_nothing_to_extend_without_a_leased_handle_within_its_deadline():
    policy = CachePolicy()
    assert not policy.decide_extend(None, now=0.0, expected_wait_s=600).extend
    stock = policy.decide_extend(handle(leased=False), now=0.0, expected_wait_s=600)
    assert (stock.extend, stock.ttl_s) == (False, None)
    assert "stock" in stock.reason
    late = policy.decide_extend(handle(deadline=100.0), now=100.0, expected_wait_s=600)
    assert not late.extend
    assert "deadline" in late.reason


def test_a_wait_that_ends_well_before_the_deadline_is_not_extended():
    policy = CachePolicy(extend_slack_s=30)
    decision = policy.decide_extend(handle(deadline=450.0), now=0.0, expected_wait_s=60)
    assert not decision.extend
    assert "before the deadline" in decision.reason


def test_a_wait_that_would_outlast_the_deadline_is_extended_to_cover_it():
    policy = CachePolicy(ttl_margin_s=30, extend_slack_s=30)
    decision = policy.decide_extend(handle(deadline=450.0), now=400.0, expected_wait_s=40)
    assert decision.extend
    assert decision.ttl_s == 40 + 30 + 30
    assert "outlast" in decision.reason


def test_the_slack_counts_as_part_of_the_wait():
    """A wait estimated to end just before the deadline is a gamble: extend it."""
    policy = CachePolicy(extend_slack_s=30)
    assert policy.decide_extend(handle(deadline=450.0), now=0.0, expected_wait_s=421).extend
    assert not policy.decide_extend(handle(deadline=450.0), now=0.0, expected_wait_s=419).extend


@settings(deadline=None)  # a shared CI core is no place for timing limits
@given(
    now=st.floats(0, 10_000),
    left=st.floats(0.001, 10_000),
    wait=st.floats(0, 10_000),
    margin=st.floats(0, 100),
    slack=st.floats(0, 100),
)
def test_after_a_granted_extend_the_deadline_lies_past_the_expected_wait(
    now, left, wait, margin, slack
):
    """If decode grants what the policy asks, the handle outlives the wait plus the slack."""
    policy = CachePolicy(server_ttl_s=margin + 1, ttl_margin_s=margin, extend_slack_s=slack)
    h = handle(deadline=now + left)
    decision = policy.decide_extend(h, now=now, expected_wait_s=wait)
    if not decision.extend:
        assert now + wait + slack < h.deadline
        return
    assert decision.ttl_s is not None
    after = policy.lease_deadline(sent_at=now, ttl_s=decision.ttl_s)
    assert after >= now + wait + slack - 1e-6 * max(1.0, now + wait)


def test_a_negative_expected_wait_is_an_error():
    with pytest.raises(ValueError, match="expected_wait_s"):
        CachePolicy().decide_extend(handle(), now=0.0, expected_wait_s=-1)


# --- release ----------------------------------------------------------------------------------


def test_only_a_leased_handle_within_its_deadline_and_the_margin_is_released():
    policy = CachePolicy()
    assert policy.decide_release(handle(deadline=450.0), now=449.0)
    # Past our deadline decode may still hold it (our deadline keeps a margin before decode's);
    # a margin later it has freed the blocks itself.
    assert policy.decide_release(handle(deadline=450.0), now=450.0)
    assert not policy.decide_release(handle(deadline=450.0), now=450.0 + policy.ttl_margin_s)
    assert not policy.decide_release(handle(leased=False), now=0.0)  # stock: no release call
    assert not policy.decide_release(None, now=0.0)


def test_a_handle_knows_whether_it_is_leased():
    assert handle().leased
    assert not dataclasses.replace(handle(), lease_ttl_s=None).leased


@pytest.mark.parametrize(
    "kwargs", [{"pin_ttl_s": 0}, {"pin_ttl_s": float("inf")}, {"extend_slack_s": -1}]
)
def test_bad_hint_settings_are_config_errors(kwargs):
    with pytest.raises(ConfigError):
        CachePolicy(**kwargs)
