"""Every failure the fuzzers found, replayed step by step as a regression test.

Each sequence is the shrunk example hypothesis printed, written against the machine's rules
(``SessionMachine`` of ``fuzz_sessions.py``, ``ReplicaMachine`` of ``fuzz_replicas.py``); the
machine's invariants run after every step as in the fuzzer. The fix each needed is named in its
docstring (docs/reliability.md has the list). The same six, as transition tables on the pure
value (``agentkv._client.kv``), are in ``tests/unit/test_kv_corpus.py``; these replays stay as
integration tests through the real turn, pool and HTTP stack.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tests.fake.fuzz_replicas import ReplicaMachine
from tests.fake.fuzz_sessions import SessionMachine

Step = Callable[[SessionMachine, dict[str, Any]], Any]


def replay(*steps: Step, threshold: int = 64, tier: bool = False) -> None:
    machine = SessionMachine()
    machine.configure(threshold, tier)
    names: dict[str, Any] = {}
    try:
        for step in steps:
            step(machine, names)
            for check in (
                machine.no_wrong_kv,
                machine.a_handle_is_single_use,
                machine.transcripts_are_complete,
                machine.no_pin_once_all_sessions_are_closed,
            ):
                check()
    finally:
        machine.teardown()


def replay_replicas(*steps: Callable[[ReplicaMachine], Any]) -> None:
    machine = ReplicaMachine()
    try:
        for step in steps:
            step(machine)
            for check in (
                machine.no_wrong_kv,
                machine.a_handle_is_single_use,
                machine.the_store_holds_a_prefix_of_what_the_client_was_answered,
            ):
                check()
    finally:
        machine.teardown()


def test_a_saved_copy_closed_early_left_the_original_pulling_released_kv() -> None:
    """The fuzzer's shrunk sequence: save -> load -> close the copy (an early release of the pin
    the original still named) -> the original's turn, cancelled after decode finished."""
    replay(
        lambda m, n: n.__setitem__("s0", m.open_session()),
        lambda m, n: m.send(n["s0"], "Tell me about Paris.", "long"),
        lambda m, n: n.__setitem__("s1", m.save_and_load(n["s0"])),
        lambda m, n: m.close(n["s1"], False, "Tell me about Paris."),
        lambda m, n: m.cancel_after_decode(n["s0"], "Tell me about Paris."),
    )


def test_a_session_moved_off_a_dead_prefill_left_its_pin_on_the_live_decode() -> None:
    """The long run's failure ("decode 0 still pins" once every session was closed), reduced:
    the pair's prefill dies, the pair is marked down (by another session's turn or the health
    check), the session moves and drops its handle. Fixed: a handle dropped unsent because the
    session moved, or because its pair stopped answering, is released on its decode."""

    def kill_prefill(m: SessionMachine, n: dict[str, Any]) -> None:
        m.fake.server(n["s0"].session.pair.prefill).kill()

    replay(
        lambda m, n: n.__setitem__("s0", m.open_session()),
        lambda m, n: m.send(n["s0"], "Tell me about Paris.", "long"),
        kill_prefill,
        lambda m, n: m.run(m.cluster.check_health()),
        lambda m, n: m.send(n["s0"], "Tell me about Spain.", "long"),
        lambda m, n: m.close(n["s0"], False, "Tell me about tea."),
    )


def test_a_session_closed_inside_its_handles_safety_margin_left_the_pin() -> None:
    """The second long run's failure (flaky: it depended on where the clock stood at teardown),
    reduced: our deadline keeps a margin before decode's; a close inside it did not release.
    Fixed: a leased handle is released at close (and when dropped unsent) past our deadline
    too."""

    def to_the_margin(m: SessionMachine, n: dict[str, Any]) -> None:
        handle = n["s0"].session.handle
        m.clock.advance(handle.deadline - m.clock() + 0.5)

    replay(
        lambda m, n: n.__setitem__("s0", m.open_session()),
        lambda m, n: m.send(n["s0"], "Tell me about Paris.", "long"),
        to_the_margin,
        lambda m, n: m.close(n["s0"], False, "Tell me about tea."),
    )


@pytest.mark.parametrize("variant", ["two_loads", "load_beside_original"])
def test_holders_of_one_save_file_sending_at_once_both_attached_its_handle(variant: str) -> None:
    """Issue 26's concurrent rule, shrunk: save, load (twice, or once beside the original),
    then both holders' first turns through ``asyncio.gather``. Both were told the pin was theirs
    (the loaded handle was confirmed with an extend, which answers every holder of the secret):
    two P legs carried the one handle, and with threshold 1 the second pulled the partial block
    the first had freed (``wrong_reuse_events`` 1). Fixed: the confirmation is a claim, which
    rotates the secret; exactly one holder attaches, the other recomputes and says why."""
    texts = ["Hi.", "Tell me about tea.", "Tell me about KV."]
    replay(
        lambda m, n: n.__setitem__("s0", m.open_session()),
        lambda m, n: m.send(n["s0"], "Tell me about Paris.", "long"),
        lambda m, n: m.holders_of_one_save_file_send_at_once(n["s0"], variant, texts, 0),
        threshold=1,
    )


def test_a_turn_started_while_a_persist_is_answered_attached_the_persisted_handle() -> None:
    """``session.offload()`` and ``session.send()`` on one session through ``asyncio.gather``,
    the persist first, decode's answer to it one scheduling point late (decode has written the
    KV to its tier and freed the pin; the SDK does not know yet). ``persist()`` checked that no
    turn ran, but marked nothing: the turn started, took the handle and its P leg pulled the freed
    blocks (``wrong_reuse_events`` 1). Fixed: a persist (and a tool wait's lease calls) holds
    the session as a turn does, so the turn is refused with ``SessionBusyError``."""
    replay(
        lambda m, n: n.__setitem__("s0", m.open_session()),
        lambda m, n: m.send(n["s0"], "Tell me about Paris.", "long"),
        lambda m, n: m.persist_races_a_turn(n["s0"], "Tell me about Spain.", True, 1),
        tier=True,
    )


def test_a_replica_stalled_mid_turn_past_its_claim_shared_its_handle_with_the_other() -> None:
    """The replica fuzzer's shrunk sequence: replica 0 takes the session's claim and its handle,
    then stalls before its P leg (a process paused past its claim's lease). Its claim lapses;
    replica 1, waiting on the same conversation, claims it (dirty: the last claim ended without
    a commit), confirms the stored handle with decode (still pinned) and attaches it; replica 0
    wakes and its P leg pulls the same handle (two P legs, wrong KV). Fixed: after a dirty
    handover nothing is attached (the previous holder may only be slow; a pull checks no
    lease, so no call to decode can settle it)."""
    replay_replicas(
        lambda m: m.race("Tell me about robot 4.", 0, "resume"),
        lambda m: m.stall(0),
        lambda m: m.race("Tell me about robot 4.", 0, "resume"),
    )
