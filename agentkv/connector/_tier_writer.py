"""Tier writes off the engine: a worker writes a pinned handle's blocks on a thread of its own.

An offload used to write on the EngineCore thread (``collective_rpc`` waited for every worker's
write and fsync): every session served by that decode stalled for the length of the write, so
one client asking for ``X-AgentKV-Offload: always`` on every turn slowed every tenant. Now the
scheduler's ``offload`` only starts the write (:meth:`BackgroundWrites.start`, a quick
``collective_rpc``) and returns; the API server's offload route then polls
(:meth:`BackgroundWrites.poll`, quick too) between engine steps until every rank is done, and
only then does the scheduler commit the manifest and free the pin.

What keeps the written KV right while the engine runs on: the blocks stay pinned until the
commit, and a pin's blocks are freed only when the worker reports the request in
``finished_sending`` (its lease expired or was released, or a prefill read them). While a write
of a request is running, :meth:`BackgroundWrites.hold` keeps that request out of
``finished_sending`` and reports it once the write has ended: no block is freed, and so none is
reused, while it is being read for the file.

The writing thread has its own :class:`~agentkv.connector._tier_io.TierIO` (its own NIXL agent):
the worker's loads keep the other one on the worker's thread.
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from agentkv._core import get_logger

logger = get_logger("agentkv.connector.tier")

# A finished write's result waits this long for its poll (the route polls within milliseconds;
# a route that died leaves it, and the scheduler aborts the entry after the same time).
RESULT_KEEP_S = 600.0

# The writing thread's nice value: below the engine's, so it takes what the forward pass leaves.
WRITER_NICE = 10

Write = Callable[[], dict[str, Any]]


def _lower_priority() -> None:
    """Let the engine's forward pass preempt the writing thread where they share a core (the
    CPU build binds a worker to its cores): Linux schedules threads as tasks, each its own
    nice value."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICE)
    except (AttributeError, OSError) as exc:  # not Linux, or not permitted: write as is
        logger.debug("tier_writer_priority_unchanged", error=repr(exc))


class BackgroundWrites:
    """One worker's tier writes in flight, on one thread, and the requests they hold."""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._jobs: dict[str, tuple[Future[dict[str, Any]], str, float]] = {}  # entry -> job
        self._writing: Counter[str] = Counter()  # request id -> writes running
        self._held: set[str] = set()  # finished sending while written: reported later

    def start(self, entry: str, request_id: str, write: Write) -> None:
        """Run ``write`` (which writes ``entry``'s data file from ``request_id``'s blocks) on
        the writing thread; :meth:`poll` tells when it has ended."""
        with self._lock:
            if entry in self._jobs:
                raise ValueError(f"tier entry {entry} is already being written")
            self._drop_stale()
            self._writing[request_id] += 1
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="agentkv-tier",
                                                initializer=_lower_priority)
            future = self._pool.submit(write)
            self._jobs[entry] = (future, request_id, self._clock())
        # Registered after the job: a write that ends at once still finds its job.
        future.add_done_callback(lambda _: self._ended(request_id))

    def _ended(self, request_id: str) -> None:
        with self._lock:
            self._writing[request_id] -= 1
            if self._writing[request_id] <= 0:
                del self._writing[request_id]

    def poll(self, entry: str) -> dict[str, Any]:
        """``{"state": "pending"}``, ``{"state": "done", **result}`` or ``{"state": "failed",
        "error": ...}``; a finished write's result is handed out once."""
        with self._lock:
            job = self._jobs.get(entry)
            if job is None:
                return {"state": "failed", "error": f"no tier write of {entry} on this worker"}
            future = job[0]
            if not future.done():
                return {"state": "pending"}
            del self._jobs[entry]
        exc = future.exception()
        if exc is not None:
            logger.warning("tier_write_failed", entry=entry, error=repr(exc))
            return {"state": "failed", "error": f"{type(exc).__name__}: {exc}"}
        return {"state": "done", **future.result()}

    def hold(self, finished_sending: Collection[str]) -> set[str]:
        """``finished_sending`` as the scheduler may see it now: without the requests whose
        blocks are being written, and with those held back earlier whose writes have ended."""
        with self._lock:
            self._held |= {r for r in finished_sending if r in self._writing}
            released = {r for r in self._held if r not in self._writing}
            self._held -= released
            return {r for r in finished_sending if r not in self._held} | released

    def _drop_stale(self) -> None:
        """Forget finished results nobody polled for (their route died); under the lock."""
        now = self._clock()
        for entry, (future, _, started) in list(self._jobs.items()):
            if future.done() and now - started > RESULT_KEEP_S:
                del self._jobs[entry]

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
