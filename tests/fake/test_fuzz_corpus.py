"""Every failure the session fuzzer found, replayed step by step as a regression test.

Each sequence is the shrunk example hypothesis printed, written against ``SessionMachine``'s
rules; the machine's invariants run after every step as in the fuzzer. The fix each needed is
named in its docstring (docs/reliability.md has the list).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tests.fake.fuzz_sessions import SessionMachine

Step = Callable[[SessionMachine, dict[str, Any]], Any]


def replay(*steps: Step) -> None:
    machine = SessionMachine()
    names: dict[str, Any] = {}
    try:
        for step in steps:
            step(machine, names)
            for check in (
                machine.no_wrong_kv,
                machine.transcripts_are_complete,
                machine.no_pin_once_all_sessions_are_closed,
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
