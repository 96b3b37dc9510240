"""``Portal``: the one event loop on a thread that the sync API, the proxy's ``ProxyServer`` and
the fake pair's HTTP host all run on."""

from __future__ import annotations

import asyncio
import threading

import pytest

from agentkv._client.portal import Portal


def _threads(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == name]


def test_a_call_returns_the_coroutines_result_from_the_portals_thread():
    portal = Portal(name="portal-under-test")
    try:

        async def where() -> str:
            return threading.current_thread().name

        assert portal.call(where()) == "portal-under-test"
    finally:
        portal.close()
    assert _threads("portal-under-test") == []


def test_a_call_past_its_timeout_raises_and_cancels_the_work():
    portal = Portal()
    cancelled = threading.Event()

    async def slow() -> None:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    try:
        with pytest.raises(TimeoutError):
            portal.call(slow(), timeout=0.05)
        assert cancelled.wait(5)
    finally:
        portal.close()


def test_a_call_from_the_portals_own_loop_is_refused_not_deadlocked():
    portal = Portal()
    try:

        async def reenter() -> None:
            portal.call(asyncio.sleep(0))

        with pytest.raises(RuntimeError, match="deadlock"):
            portal.call(reenter())
    finally:
        portal.close()


def test_close_cancels_what_still_runs_and_later_calls_are_refused():
    portal = Portal()
    cancelled = threading.Event()

    async def background() -> None:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async def spawn() -> None:
        asyncio.get_running_loop().create_task(background())
        await asyncio.sleep(0)

    portal.call(spawn())
    portal.close()
    assert cancelled.is_set()
    with pytest.raises(RuntimeError, match="closed"):
        portal.call(asyncio.sleep(0))
