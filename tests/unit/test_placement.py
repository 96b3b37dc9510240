"""Placement: rendezvous hashing with bounded load; a pure function."""

from __future__ import annotations

import math
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentkv._placement import PrefillWeights, choose_prefill, place, rank

PAIRS = ["pair0", "pair1", "pair2", "pair3"]
ids = st.text(min_size=1, max_size=30)


@given(ids)
def test_placement_is_stable_for_a_session_id(session_id):
    loads = {"pair0": 3, "pair1": 2}
    first = place(session_id, PAIRS, loads=loads, healthy=set(PAIRS))
    assert first == place(session_id, list(reversed(PAIRS)), loads=loads, healthy=set(PAIRS))


@given(ids, st.sampled_from(PAIRS))
def test_losing_an_unrelated_pair_does_not_move_a_session(session_id, lost):
    before = place(session_id, PAIRS, loads={}, healthy=set(PAIRS))
    healthy = set(PAIRS) - {lost}
    after = place(session_id, PAIRS, loads={}, healthy=healthy)
    if before != lost:
        assert after == before
    else:
        assert after in healthy


@given(ids)
def test_only_healthy_pairs_are_chosen_and_none_when_none_is(session_id):
    assert place(session_id, PAIRS, loads={}, healthy={"pair2"}) == "pair2"
    assert place(session_id, PAIRS, loads={}, healthy=set()) is None


@settings(max_examples=20, deadline=None)
@given(st.lists(ids, min_size=50, max_size=300, unique=True))
def test_bounded_load_keeps_every_pair_under_the_cap(session_ids):
    loads: Counter[str] = Counter()
    for n, sid in enumerate(session_ids):
        pair = place(sid, PAIRS, loads=loads, healthy=set(PAIRS), load_factor=1.25)
        assert pair is not None
        loads[pair] += 1
        assert max(loads.values()) <= math.ceil(1.25 * (n + 1) / len(PAIRS))


def test_an_overloaded_first_choice_is_skipped():
    sid = "session-x"
    best, second = rank(sid, PAIRS)[:2]
    loads = {best: 10}
    assert place(sid, PAIRS, loads=loads, healthy=set(PAIRS)) == second


def test_spread_is_roughly_even_without_load_feedback():
    counts = Counter(place(f"s{i}", PAIRS, loads={}, healthy=set(PAIRS)) for i in range(4000))
    assert min(counts.values()) > 800


# --- prefill choice (pools) --------------------------------------------------------------------

PREFILLS = ["p0", "p1", "p2"]
loads_st = st.dictionaries(st.sampled_from(PREFILLS), st.integers(0, 100_000))


@given(ids, loads_st, st.sampled_from([*PREFILLS, None]))
def test_a_prefill_is_the_least_loaded_or_the_warm_one_within_the_slack(key, loads, warm):
    weights = PrefillWeights(slack_tokens=1000, slack_ratio=0.5)
    chosen = choose_prefill(
        key, PREFILLS, loads=loads, healthy=set(PREFILLS), warm=warm, weights=weights
    )
    least = min(loads.get(p, 0) for p in PREFILLS)
    if chosen == warm:
        assert loads.get(warm, 0) - least < max(1000, 0.5 * least)
    else:
        assert loads.get(chosen, 0) == least
        assert warm is None or loads.get(warm, 0) - least >= max(1000, 0.5 * least)


def test_the_warm_prefill_wins_when_loads_are_close_and_loses_when_they_are_not():
    weights = PrefillWeights(slack_tokens=2048, slack_ratio=0.25)
    healthy = set(PREFILLS)
    close = {"p0": 2047, "p1": 0, "p2": 10}
    assert (
        choose_prefill("k", PREFILLS, loads=close, healthy=healthy, warm="p0", weights=weights)
        == "p0"
    )
    far = {"p0": 2048, "p1": 0, "p2": 10}
    assert (
        choose_prefill("k", PREFILLS, loads=far, healthy=healthy, warm="p0", weights=weights)
        == "p1"
    )
    # On a busy pool the slack is proportional: 25% of the least loaded.
    busy = {"p0": 12_400, "p1": 10_000, "p2": 10_000}
    assert (
        choose_prefill("k", PREFILLS, loads=busy, healthy=healthy, warm="p0", weights=weights)
        == "p0"
    )


def test_a_dead_warm_prefill_is_never_chosen_and_none_when_all_are_dead():
    assert choose_prefill("k", PREFILLS, loads={}, healthy={"p2"}, warm="p0") == "p2"
    assert choose_prefill("k", PREFILLS, loads={}, healthy=set(), warm="p0") is None


def test_equal_loads_spread_turns_over_the_pool_by_key():
    """Without a warm prefill, ties go by the key's rendezvous rank: turns spread evenly."""
    counts = Counter(
        choose_prefill(f"s/{i}", PREFILLS, loads={}, healthy=set(PREFILLS)) for i in range(3000)
    )
    assert set(counts) == set(PREFILLS)
    assert max(counts.values()) < 1.15 * min(counts.values())


def test_pure_load_weights_ignore_warmth():
    weights = PrefillWeights(slack_tokens=0, slack_ratio=0.0)
    loads = {"p0": 1, "p1": 0, "p2": 0}
    assert (
        choose_prefill(
            "k", PREFILLS, loads=loads, healthy=set(PREFILLS), warm="p0", weights=weights
        )
        != "p0"
    )
    # Between equals the key's rank decides, not warmth.
    for warm in PREFILLS:
        assert (
            choose_prefill(
                "k", PREFILLS, loads={}, healthy=set(PREFILLS), warm=warm, weights=weights
            )
            == rank("k", PREFILLS)[0]
        )


def test_negative_weights_are_refused():
    with pytest.raises(ValueError, match="non-negative"):
        PrefillWeights(slack_tokens=-1)


def test_prefix_homes_keep_the_deepest_prefix_the_latest_prefill_and_a_bounded_record():
    from agentkv._placement import PrefixHomes

    homes = PrefixHomes(chunk_tokens=2, max_chunks=4)
    homes.record("p0", "salt", [1, 2, 3, 4, 5])  # chunks (1,2), (3,4); the tail is not whole
    assert homes.home("salt", [1, 2, 3, 4, 9, 9]) == ("p0", 4)
    assert homes.home("salt", [1, 2, 7, 7]) == ("p0", 2)
    assert homes.home("salt", [2, 1, 3, 4]) is None  # the chain: (3,4) counts after (1,2) only
    assert homes.home(None, [1, 2, 3, 4]) is None  # another salt
    homes.record("p1", "salt", [1, 2])  # p1 computed the shorter prefix since
    assert homes.home("salt", [1, 2, 3, 4]) == ("p0", 4)
    assert homes.home("salt", [1, 2, 8, 8]) == ("p1", 2)
    homes.record("p1", "salt", [5, 6, 7, 8, 9, 10])  # 3 more chunks: the oldest ones go
    assert len(homes) == 4
    assert homes.home("salt", [5, 6, 7, 8]) == ("p1", 4)
    assert homes.home("salt", [1, 2, 3, 4]) == ("p1", 2)  # (3,4) after (1,2) was dropped
