"""A clock the test controls, for handle expiry without sleeping."""

from __future__ import annotations

import threading


class ManualClock:
    """A monotonic clock that only moves when told to.

    Pass it to :class:`FakeCluster` to test handle expiry deterministically.

    Example:
        >>> clock = ManualClock()
        >>> clock()
        0.0
        >>> clock.advance(480.0)
        >>> clock()
        480.0
    """

    def __init__(self, start: float = 0.0) -> None:
        self._now = start
        self._lock = threading.Lock()

    def __call__(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        """Move the clock forward by ``seconds`` (which must not be negative)."""
        if seconds < 0:
            raise ValueError("a monotonic clock cannot go backwards")
        with self._lock:
            self._now += seconds

    def __repr__(self) -> str:
        return f"ManualClock(now={self._now})"
