"""Fixtures of the protocol tests: the fake's raw HTTP/JSON, driven with a plain httpx2 client.

``fake`` (two pairs) comes from ``tests/fake/conftest.py``; here its clock starts at 1000 s, so
that an absolute deadline (``remote_blocks_expiry_time``) can never pass for a duration.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx2
import pytest

from agentkv.testing import FakeCluster, ManualClock


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(1000.0)


@pytest.fixture
def client(fake: FakeCluster) -> Iterator[httpx2.Client]:
    with httpx2.Client(transport=fake.transport) as c:
        yield c
