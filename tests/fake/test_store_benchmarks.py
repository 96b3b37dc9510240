"""The Redis store's benchmarks, run small: they keep running, and say what the docs quote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

_BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _run(script: str, *args: str) -> list[str]:
    # The checkout's agentkv, not the one installed (a git worktree shares another's venv).
    path = os.pathsep.join(filter(None, [str(_BENCHMARKS.parent), os.environ.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, str(_BENCHMARKS / script), *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, "PYTHONPATH": path},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.splitlines()


def _row(lines: list[str], mode: str) -> list[float]:
    (line,) = [line for line in lines if line.split()[:1] == [mode]]
    return [float(value) for value in line.split()[1:]]


@pytest.mark.timeout(300)
def test_redis_replicas_runs_every_mode_in_its_own_processes_and_times_the_store():
    lines = _run("redis_replicas.py", "--sessions", "2", "--turns", "3", "--rounds", "1")
    assert lines[0].startswith("CPU: ")
    for mode in ("memory", "memory-2"):
        assert _row(lines, mode)[-1] == 0.0  # no store, no store time
    for mode in ("redis-1", "redis-2"):
        assert _row(lines, mode)[-1] > 0.0  # Server-Timing: store, from the replicas


@pytest.mark.timeout(300)
def test_redis_state_counts_about_two_round_trips_a_turn():
    lines = _run("redis_state.py", "--sessions", "2", "--turns", "3", "--rounds", "1")
    for mode in ("redis-1", "redis-2"):
        # Claim and commit; in a run this short the idle sweeper's occasional read shows too.
        assert 2.0 <= _row(lines, mode)[-1] < 3.0
    assert any(line.startswith("components (median):") for line in lines)
    (per_turn,) = [line for line in lines if line.startswith("commit per turn (median):")]
    figures = json.loads(per_turn.split(":", 1)[1])
    # An appending commit sends the head and the turn's ids, not the 24 KB of ids stored.
    assert figures["ids_kept_bytes"] >= 4 * 5000
    assert figures["append_bytes_in"] < figures["whole_bytes_in"] - figures["ids_kept_bytes"] + 1000
