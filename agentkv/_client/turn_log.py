"""A session's per-turn stats, each kept in whichever form was last needed: ``TurnStats`` objects
for reading, their saved (JSON) form for snapshots.

A proxy sharing sessions through a store snapshots a session after every turn and, when replicas
alternate, restores it before every turn. Converting every turn's stats both ways each time made
those O(turns) in Python objects; here a turn is converted only when the other form is asked for,
and stays converted, so a snapshot after a restore converts only the turns added since, and stats
nobody reads are never built. Each turn is held once, in one form.

>>> log = TurnLog.restored([])  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from agentkv._types import HandleState, TurnStats

__all__ = ["TurnLog", "turn_json"]

_FIELDS = tuple(f.name for f in dataclasses.fields(TurnStats))
_NAMES = frozenset(_FIELDS)
_REQUIRED = frozenset(
    f.name
    for f in dataclasses.fields(TurnStats)
    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
)
_HANDLE_STATES = frozenset(state.value for state in HandleState)


def turn_json(stats: TurnStats) -> dict[str, Any]:
    """``stats`` as a snapshot holds it (plain values; dataclasses.asdict would deep-copy)."""
    saved = {name: getattr(stats, name) for name in _FIELDS}
    saved["handle_state"] = stats.handle_state.value
    return saved


def _checked(saved: object) -> dict[str, Any]:
    """A saved turn's own copy, with the fields ``TurnStats`` takes; ``ValueError`` if not."""
    if not isinstance(saved, Mapping):
        raise ValueError("a saved turn is not an object")
    keys = saved.keys()
    if not (keys >= _REQUIRED and keys <= _NAMES):
        raise ValueError(f"a saved turn has the fields {sorted(keys)}, not TurnStats'")
    if saved["handle_state"] not in _HANDLE_STATES:
        raise ValueError(f"a saved turn's handle_state {saved['handle_state']!r} is unknown")
    return dict(saved)


class TurnLog:
    """The stats of a session's turns, in order (see the module docstring)."""

    __slots__ = ("_turns",)

    def __init__(self) -> None:
        self._turns: list[TurnStats | dict[str, Any]] = []

    @classmethod
    def restored(cls, saved: Sequence[object]) -> TurnLog:
        """The log of a snapshot's ``turns``; ``ValueError`` for one that is not a saved turn."""
        log = cls()
        log._turns = [_checked(turn) for turn in saved]
        return log

    def append(self, stats: TurnStats) -> None:
        self._turns.append(stats)

    def __len__(self) -> int:
        return len(self._turns)

    def stats(self) -> list[TurnStats]:
        """Every turn's ``TurnStats``."""
        turns = self._turns
        for index, turn in enumerate(turns):
            if isinstance(turn, dict):
                turns[index] = TurnStats(
                    **{**turn, "handle_state": HandleState(turn["handle_state"])}
                )
        return turns  # type: ignore[return-value]  # every item is a TurnStats now

    def __iter__(self) -> Iterator[TurnStats]:
        return iter(self.stats())

    def saved(self) -> list[dict[str, Any]]:
        """Every turn as a snapshot holds it (copies: the caller may keep or change them)."""
        turns = self._turns
        for index, turn in enumerate(turns):
            if not isinstance(turn, dict):
                turns[index] = turn_json(turn)
        return [dict(turn) for turn in turns]  # type: ignore[arg-type]  # all dicts now
