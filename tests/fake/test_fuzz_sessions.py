"""The session fuzzer (``fuzz_sessions.py``), bounded for the normal run; its corpus replayed.

``AGENTKV_FUZZ_EXAMPLES=300 nice -n 10 pytest tests/fake/test_fuzz_sessions.py -s`` runs it
longer with fresh randomness and prints the figures recorded in docs/reliability.md (the
concurrent rules' firings among them).
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

from tests.fake.fuzz_sessions import Counters, SessionMachine, examples

pytestmark = pytest.mark.slow  # a fuzzer: thousands of steps on the fake pair

SessionMachine.TestCase.settings = settings(
    max_examples=examples(),
    stateful_step_count=int(os.environ.get("AGENTKV_FUZZ_STEPS", "40")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    database=None,
    derandomize=not os.environ.get("AGENTKV_FUZZ_EXAMPLES"),
)


class TestSessionFuzz(SessionMachine.TestCase):  # type: ignore[name-defined,misc]
    """Random sequences of session operations never read wrong KV, lose a message or a pin."""

    @classmethod
    def tearDownClass(cls) -> None:
        print(f"\nfuzz: {Counters.summary()}")  # the long run's figures
