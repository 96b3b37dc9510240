"""Placement: rendezvous hashing with bounded load; a pure function."""

from __future__ import annotations

import math
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from agentkv._placement import place, rank

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
