"""``CopyJob``: one fork's copy of its parent's pin, run once, awaited by parent and fork alike.

Kept apart from ``forking`` (which runs the copy) so that ``SessionState`` can hold jobs without
importing the executor.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from agentkv._client import kv

__all__ = ["CopyJob"]


class CopyJob:
    """One fork's copy of its parent's pin: run once, awaited by parent and fork alike."""

    def __init__(self, run: Callable[[], Awaitable[kv.KV]]) -> None:
        self._run = run
        self._task: asyncio.Task[kv.KV] | None = None
        self._dropped = False

    @property
    def finished(self) -> bool:
        return self._dropped or (self._task is not None and self._task.done())

    def start(self) -> asyncio.Future[kv.KV]:
        """The running copy (started now, on the running loop, if it was not yet)."""
        if self._dropped:
            done: asyncio.Future[kv.KV] = asyncio.get_running_loop().create_future()
            done.set_result(kv.NoKV(detail="a fork without its parent's KV: closed before it"))
            return done
        if self._task is None:
            self._task = asyncio.ensure_future(self._run())
        return self._task

    def drop(self) -> bool:
        """Give the copy up if it has not started (the fork closed first): whether it was."""
        if self._task is None:
            self._dropped = True
        return self._dropped
