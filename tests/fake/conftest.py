"""Fixtures of the fake-pair tier: a manual clock and a two-pair fake cluster on it.

A module that needs another cluster defines its own ``fake`` (pytest's nearest fixture wins);
one test changes the options with ``@pytest.mark.parametrize("fake", [{...}], indirect=True)``.
Find a session's servers by its pair's URLs (``fake.server(session.pair.decode)``), never by
parsing names.
"""

from __future__ import annotations

from typing import Any

import pytest

from agentkv.testing import FakeCluster, ManualClock


@pytest.fixture
def clock() -> ManualClock:
    """The clock of the test: handles, leases and TTLs move only when it is advanced."""
    return ManualClock()


@pytest.fixture
def fake(request: pytest.FixtureRequest, clock: ManualClock) -> FakeCluster:
    """Two fake prefill/decode pairs on ``clock``; an indirect parameter overrides options."""
    options: dict[str, Any] = {"pairs": 2, **getattr(request, "param", {})}
    return FakeCluster(clock=clock, **options)
