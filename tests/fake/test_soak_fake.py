"""A smaller run of ``benchmarks/soak_fake.py``: concurrent sessions lose nothing, leak nothing."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

_SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "soak_fake.py"


@pytest.fixture(scope="module")
def soak_fake() -> Iterator[ModuleType]:
    spec = importlib.util.spec_from_file_location("soak_fake", _SCRIPT)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


async def test_concurrent_sessions_with_tool_delays_fail_no_turn_and_leave_no_pin(soak_fake):
    report = await soak_fake.soak(sessions=16, turns=5, max_delay_s=0.01, seed=1)
    assert report.turns_ok == 16 * 5
    assert report.turns_failed == 0
    assert report.lost_or_duplicated_messages == 0
    assert report.wrong_reuse_events == 0
    assert report.pinned_handles_after_close == 0  # final turns pin nothing, closes release
    assert report.leased_handles_after_close == 0
    assert report.handle_states["attached"] == 16 * 4
    assert soak_fake.passed(report)


async def test_retryable_faults_during_a_soak_fail_no_turn_and_leave_no_pin(soak_fake):
    report = await soak_fake.soak(sessions=16, turns=5, max_delay_s=0.01, fault_every=3, seed=2)
    assert report.faults_injected > 0
    assert report.retries == report.faults_injected  # each faulted turn met exactly one
    assert report.turns_ok == 16 * 5
    assert report.turns_failed == 0
    assert report.lost_or_duplicated_messages == 0
    assert report.wrong_reuse_events == 0
    # D legs whose answers were lost are released by the request id the SDK chose for them.
    assert report.pinned_handles_after_close == 0
    assert report.pinned_handles_after_ttl == 0
    assert soak_fake.passed(report)


def test_the_script_exits_zero_and_prints_the_report(soak_fake, capsys):
    assert soak_fake.main(["--sessions", "4", "--turns", "3", "--max-tool-delay", "0"]) == 0
    assert "turns_failed" in capsys.readouterr().out
