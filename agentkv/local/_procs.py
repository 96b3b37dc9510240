"""Process helpers for the servers we start: liveness, stop by process id, CPU use from /proc.

Every server is started in its own session, so its process group id equals its pid. Stopping
signals that group (the API server and the EngineCore processes vLLM forks) and never looks
processes up by name.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterable
from pathlib import Path

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie still answers kill(0); it is not a server.
    return _proc_state(pid) not in ("Z", "X", None)


def _proc_state(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[0]


def group_pids(pgid: int) -> list[int]:
    """The live processes of a process group (our server and its children)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            pids.append(int(entry.name))
    return pids


def stop_group(pgid: int, *, timeout_s: float = 30.0) -> bool:
    """SIGTERM the group led by ``pgid``, wait, then SIGKILL what is left. True if all gone."""
    for sig, wait in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return True
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            _reap(pgid)
            if not group_pids(pgid):
                return True
            time.sleep(0.2)
    return not group_pids(pgid)


def _reap(pid: int) -> None:
    # Our own children must be reaped or they linger as zombies.
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def _cpu_ticks(pids: Iterable[int]) -> int:
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime + stime
    return total


def group_cpu_percent(pgids: Iterable[int], *, window_s: float = 2.0) -> dict[int, float]:
    """CPU use of each process group over ``window_s``, in percent of one core."""
    groups = {pgid: group_pids(pgid) for pgid in pgids}
    before = {pgid: _cpu_ticks(pids) for pgid, pids in groups.items()}
    start = time.monotonic()
    time.sleep(window_s)
    elapsed = time.monotonic() - start
    return {
        pgid: 100.0 * (_cpu_ticks(pids) - before[pgid]) / _CLOCK_TICKS / elapsed
        for pgid, pids in groups.items()
    }
