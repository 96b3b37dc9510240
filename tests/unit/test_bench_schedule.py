"""Interleaving: round-robin lanes, bounded concurrency, failures end only their own lane."""

from __future__ import annotations

import asyncio

from agentkv.bench import Mode
from agentkv.bench._schedule import Lane, interleave, run_lanes
from agentkv.bench._workload import TurnScript

MODES = (Mode.DISAGG, Mode.AFFINITY, Mode.AGENTKV)


def scripts(n, think=0.0):
    return [TurnScript(turn=t, user="u", output_tokens=8, think_time_s=think)
            for t in range(1, n + 1)]


def test_the_mode_order_rotates_from_session_to_session():
    order = interleave(3, MODES)
    assert [m for s, m in order if s == 0] == [Mode.DISAGG, Mode.AFFINITY, Mode.AGENTKV]
    assert [m for s, m in order if s == 1] == [Mode.AFFINITY, Mode.AGENTKV, Mode.DISAGG]
    assert [m for s, m in order if s == 2] == [Mode.AGENTKV, Mode.DISAGG, Mode.AFFINITY]


def make_lanes(log, *, turns=3, fail=None, think=0.0, delay=0.0, active=None):
    lanes = []
    for session, mode in interleave(2, MODES[:2]):
        async def run(script, session=session, mode=mode):
            if active is not None:
                active[0] += 1
                active[1] = max(active[1], active[0])
            await asyncio.sleep(delay)
            if active is not None:
                active[0] -= 1
            log.append((session, mode.value, script.turn))
            return (session, mode, script.turn) != fail
        lanes.append(Lane(session=session, mode=mode, turns=scripts(turns, think), run=run))
    return lanes


def test_one_worker_runs_strict_round_robin_by_turn():
    log = []
    asyncio.run(run_lanes(make_lanes(log), concurrency=1))
    assert [turn for _, _, turn in log] == [1] * 4 + [2] * 4 + [3] * 4
    assert log[:4] == [(0, "disagg", 1), (0, "affinity", 1), (1, "affinity", 1), (1, "disagg", 1)]


def test_a_failed_turn_ends_its_lane_and_the_others_finish():
    log = []
    lanes = make_lanes(log, fail=(0, Mode.DISAGG, 2))
    asyncio.run(run_lanes(lanes, concurrency=1))
    assert [t for s, m, t in log if (s, m) == (0, "disagg")] == [1, 2]
    assert [t for s, m, t in log if (s, m) == (1, "disagg")] == [1, 2, 3]
    assert all(lane.done for lane in lanes)


def test_concurrency_bounds_the_turns_in_flight():
    log, active = [], [0, 0]
    asyncio.run(run_lanes(make_lanes(log, delay=0.01, active=active), concurrency=2))
    assert active[1] == 2
    assert len(log) == 12


def test_think_time_delays_a_lanes_next_turn():
    log = []

    async def timed():
        loop = asyncio.get_running_loop()
        start = loop.time()
        await run_lanes(make_lanes(log, turns=2, think=0.05), concurrency=4)
        return loop.time() - start

    assert asyncio.run(timed()) >= 0.05
    assert len(log) == 8


def test_no_lanes_returns_at_once_and_leaves_no_worker_behind():
    """Nothing to run must not wait for a "last lane finished" that never comes."""

    async def run():
        await asyncio.wait_for(run_lanes([], concurrency=3), timeout=1.0)
        return asyncio.all_tasks() - {asyncio.current_task()}

    assert asyncio.run(run()) == set()
