"""``TurnLog``: a session's turn stats, converted between objects and their saved form lazily."""

from __future__ import annotations

import pytest

from agentkv import HandleState, TurnStats
from agentkv._client.turn_log import TurnLog, turn_json


def _stats(turn: int, *, state: HandleState = HandleState.ATTACHED) -> TurnStats:
    return TurnStats(
        session_id="s",
        turn=turn,
        pair="pair-0",
        prompt_tokens=100 * turn,
        reused_tokens=90 * turn,
        pulled_tokens=80 * turn,
        computed_tokens=10 * turn,
        generated_tokens=12,
        ideal_reused_tokens=95 * turn,
        ttft_s=0.1,
        prefill_s=0.05,
        decode_s=0.2,
        total_s=0.3,
        handle_state=state,
        prefill="prefill-0",
    )


def test_a_log_round_trips_through_its_saved_form_and_back():
    log = TurnLog()
    turns = [_stats(1, state=HandleState.NONE), _stats(2), _stats(3)]
    for stats in turns:
        log.append(stats)
    saved = log.saved()
    assert saved == [turn_json(t) for t in turns]
    assert saved[0]["handle_state"] == "none"  # the enum's value: JSON as is
    again = TurnLog.restored(saved)
    assert len(again) == 3
    assert again.stats() == turns
    assert list(again) == turns


def test_saved_turns_are_the_callers_copies():
    log = TurnLog()
    log.append(_stats(1))
    saved = log.saved()
    saved[0]["turn"] = 99
    assert log.stats()[0].turn == 1
    raw = [turn_json(_stats(1))]
    restored = TurnLog.restored(raw)
    raw[0]["turn"] = 99
    assert restored.stats()[0].turn == 1


def test_a_restored_log_converts_only_what_is_asked_for():
    """After a restore a snapshot holds the saved turns as they came, plus the new ones."""
    log = TurnLog.restored([turn_json(_stats(1)), turn_json(_stats(2))])
    log.append(_stats(3))
    assert [t["turn"] for t in log.saved()] == [1, 2, 3]
    assert [t.turn for t in log.stats()] == [1, 2, 3]
    assert all(isinstance(t, TurnStats) for t in log.stats())


def test_older_snapshots_without_the_newer_fields_still_load():
    saved = turn_json(_stats(1))
    for newer in ("server_ttft_s", "handle_reason", "retries", "extends", "prefill"):
        del saved[newer]
    (stats,) = TurnLog.restored([saved]).stats()
    assert (stats.retries, stats.prefill) == (0, "")


@pytest.mark.parametrize(
    ("turn", "match"),
    [
        ("a string", "not an object"),
        ({**turn_json(_stats(1)), "unknown": 1}, "not TurnStats'"),
        ({k: v for k, v in turn_json(_stats(1)).items() if k != "pair"}, "not TurnStats'"),
        ({**turn_json(_stats(1)), "handle_state": "maybe"}, "unknown"),
    ],
)
def test_a_turn_that_is_not_a_saved_turn_is_refused_at_restore(turn, match):
    with pytest.raises(ValueError, match=match):
        TurnLog.restored([turn_json(_stats(1)), turn])
