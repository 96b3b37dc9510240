"""Interleaving: the (session, mode) lanes take turns round-robin, so noise hits all modes alike.

The runners wait in one FIFO queue; ``concurrency`` workers take the next runner, run one turn and
put the runner back at the end of the queue (after its think time). With one worker and no think
time that is strict round-robin: turn 1 of every (session, mode), then turn 2 of every one, and so
on, in the starting order. The starting order rotates the modes from session to session, so no
mode always runs right after another.

>>> from agentkv.bench._config import Mode
>>> [(s, m.value) for s, m in interleave(2, (Mode.DISAGG, Mode.AGENTKV))]
[(0, 'disagg'), (0, 'agentkv'), (1, 'agentkv'), (1, 'disagg')]
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from agentkv.bench._config import Mode
from agentkv.bench._workload import TurnScript

__all__ = ["Lane", "interleave", "run_lanes"]


def interleave(sessions: int, modes: Sequence[Mode]) -> list[tuple[int, Mode]]:
    """The starting order of the (session, mode) lanes."""
    order: list[tuple[int, Mode]] = []
    for session in range(sessions):
        shift = session % len(modes)
        order.extend((session, mode) for mode in [*modes[shift:], *modes[:shift]])
    return order


@dataclass(kw_only=True)
class Lane:
    """One session in one mode: its turns still to run, and the coroutine that runs one."""

    session: int
    mode: Mode
    turns: list[TurnScript]
    run: Callable[[TurnScript], Awaitable[bool]]
    """Runs a turn; returns False when the lane must stop (the turn failed)."""
    start_s: float = 0.0
    """The lane joins the queue this long after the start (times ``time_scale``)."""
    done: bool = field(default=False)


async def run_lanes(
    lanes: Sequence[Lane], *, concurrency: int, time_scale: float = 1.0
) -> None:
    """Run every lane's turns, interleaved, at most ``concurrency`` turns at a time; a lane's
    pause after a turn, and its start, last their time times ``time_scale``."""
    if not lanes:
        return
    queue: asyncio.Queue[Lane] = asyncio.Queue()
    loop = asyncio.get_running_loop()
    for lane in lanes:
        if lane.start_s * time_scale > 0:
            loop.call_later(lane.start_s * time_scale, queue.put_nowait, lane)
        else:
            queue.put_nowait(lane)
    remaining = len(lanes)
    finished = asyncio.Event()

    async def worker() -> None:
        nonlocal remaining
        while True:
            lane = await queue.get()
            script = lane.turns.pop(0)
            keep_going = await lane.run(script)
            if not keep_going or not lane.turns:
                lane.done = True
                remaining -= 1
                if remaining == 0:
                    finished.set()
            elif script.think_time_s > 0:
                loop.call_later(script.think_time_s * time_scale, queue.put_nowait, lane)
            else:
                queue.put_nowait(lane)

    async with asyncio.TaskGroup() as group:
        workers = [group.create_task(worker()) for _ in range(min(concurrency, len(lanes)))]
        await finished.wait()
        for task in workers:
            task.cancel()
