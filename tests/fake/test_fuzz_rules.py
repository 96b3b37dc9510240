"""The fuzzers' concurrent rules really run their operations at once.

A rule that awaited one operation after the other would pass every invariant and test nothing:
each test here fires one rule on a fresh machine and checks that the operations' requests were
in flight together (``fuzz_sessions.interleaved``), or that a request really waited on the other
replica's claim.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.fake import fuzz_replicas, fuzz_sessions
from tests.fake.fuzz_replicas import ReplicaMachine
from tests.fake.fuzz_sessions import HOLDERS, SessionMachine

TEXTS = ["Hi.", "Tell me about tea.", "Tell me about KV."]


def _fire(rule: str, fire: Any, *, tier: bool = False, overlaps: bool = True) -> None:
    """Fire ``rule`` once; ``overlaps``: whether its operations' requests must be in flight
    together (``False``: the session must keep them apart, one refused while the other runs)."""
    machine = SessionMachine()
    machine.configure(1, tier)
    try:
        t = machine.open_session()
        machine.send(t, "Tell me about Paris.", "long")
        fired = fuzz_sessions.Counters.concurrent.get(rule, 0)
        overlapped = fuzz_sessions.Counters.overlapped.get(rule, 0)
        fire(machine, t)
        assert fuzz_sessions.Counters.concurrent.get(rule, 0) == fired + 1
        assert fuzz_sessions.Counters.overlapped.get(rule, 0) == overlapped + overlaps, (
            f"{rule}: the operations ran one after the other"
            if overlaps
            else f"{rule}: the operations ran at once on one session"
        )
        machine.no_wrong_kv()
        machine.a_handle_is_single_use()
        machine.transcripts_are_complete()
    finally:
        machine.teardown()


@pytest.mark.parametrize("variant", HOLDERS)
def test_holders_of_one_save_file_send_their_first_turns_at_once(variant: str) -> None:
    _fire(
        "holders_of_one_save_file",
        lambda m, t: m.holders_of_one_save_file_send_at_once(t, variant, TEXTS, 0),
    )


@pytest.mark.parametrize("persist_first", [True, False])
def test_a_persist_and_a_turn_of_one_session_are_fired_together_and_kept_apart(
    persist_first: bool,
) -> None:
    """Both start on one loop at once; the session lets one run and refuses the other
    (``SessionBusyError``): when they overlapped, the turn took the handle the persist freed."""
    _fire(
        "persist_races_a_turn",
        lambda m, t: m.persist_races_a_turn(t, TEXTS[0], persist_first, 1),
        tier=True,
        overlaps=False,
    )


@pytest.mark.parametrize("wait_first", [True, False])
def test_a_tool_wait_persist_and_a_loaded_copys_turn_run_at_once(wait_first: bool) -> None:
    _fire(
        "tool_wait_persist_races_a_load",
        lambda m, t: m.tool_wait_persist_races_a_load(t, TEXTS[0], wait_first, 1),
        tier=True,
    )


def test_a_request_waits_on_the_claim_of_a_replica_paused_before_its_commit() -> None:
    """Replica 0 answers while its commit is held; the client's request through replica 1 waits
    on the claim until replica 0 is killed (its commit in flight) and the claim lapses."""
    counters = fuzz_replicas.Counters
    machine = ReplicaMachine()
    try:
        races, overlapped = counters.races, counters.races_overlapped
        killed = counters.unblocked.get("kill", 0)
        machine.pause(0)
        machine.race("Tell me about robot 4.", 0, "kill")
        assert (counters.races, counters.races_overlapped) == (races + 1, overlapped + 1)
        assert counters.unblocked.get("kill", 0) == killed + 1
        assert machine.lost["killed"] == 1
        machine.no_wrong_kv()
        machine.a_handle_is_single_use()
        machine.the_store_holds_a_prefix_of_what_the_client_was_answered()
    finally:
        machine.teardown()
