"""A private event loop on a thread, through which the sync API drives the async core.

Why not a second, ``httpx2.Client`` implementation: a turn is a small state machine (template
renders, two legs, retries, failover, streaming) and writing it twice would let the twins drift.
Running the one async core on a loop owned by the sync ``Cluster`` costs one thread hop per call
(tens of microseconds, see ``benchmarks/sdk_overhead.py``) and lets both twins share one transport
type and one connection pool. The proxy's ``ProxyServer`` and the fake pair's HTTP host run their
uvicorn servers on a Portal too.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Awaitable, Coroutine, Iterator
from concurrent.futures import Future
from typing import Any, TypeVar

__all__ = ["Portal"]

T = TypeVar("T")


class Portal:
    """Runs coroutines on a dedicated event-loop thread and waits for their results."""

    def __init__(self, *, name: str = "agentkv-loop") -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self._closed = False

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    def call(self, coro: Coroutine[Any, Any, T], *, timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and return its result (re-raising its exception).

        After ``timeout`` seconds the coroutine is cancelled and ``TimeoutError`` raised.
        """
        if self._closed:
            coro.close()
            raise RuntimeError("the cluster is closed")
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("a sync agentkv call from inside its own event loop would deadlock")
        future: Future[T] = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout)
        except BaseException:
            # KeyboardInterrupt or a timeout in the caller: cancel the work, don't leave it running.
            future.cancel()
            raise

    def iterate(self, agen: AsyncIterator[T]) -> Iterator[T]:
        """Iterate an async iterator from this (sync) thread; closing the iterator closes it."""

        async def _next() -> tuple[bool, T | None]:
            try:
                return True, await anext(agen)
            except StopAsyncIteration:
                return False, None

        try:
            while True:
                more, item = self.call(_next())
                if not more:
                    return
                yield item  # type: ignore[misc]  # ``more`` means ``item`` is a T
        finally:
            aclose = getattr(agen, "aclose", None)
            if aclose is not None and not self._closed:
                self.call(_await(aclose()))

    def close(self) -> None:
        """Cancel what still runs on the loop, then stop the loop and its thread."""
        if self._closed:
            return
        self._closed = True
        asyncio.run_coroutine_threadsafe(_shutdown(self._loop), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()


async def _shutdown(loop: asyncio.AbstractEventLoop) -> None:
    tasks = [task for task in asyncio.all_tasks(loop) if task is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await loop.shutdown_asyncgens()


async def _await(awaitable: Awaitable[T]) -> T:
    return await awaitable
