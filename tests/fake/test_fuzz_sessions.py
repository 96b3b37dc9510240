"""The session fuzzer (``fuzz_sessions.py``), bounded for the normal run; its corpus replayed.

``AGENTKV_FUZZ_EXAMPLES=2000 pytest tests/fake/test_fuzz_sessions.py -s`` runs it longer and
prints the figures recorded in docs/reliability.md.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

from tests.fake.fuzz_sessions import Counters, SessionMachine, examples

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
        print(  # the long run's figures
            f"\nfuzz: sequences={Counters.sequences} steps={Counters.steps} "
            f"turns_ok={Counters.turns_ok} turns_failed={Counters.turns_failed} "
            f"errors={dict(sorted(Counters.errors.items()))}"
        )
