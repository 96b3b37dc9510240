"""The Redis session store on a real Redis: claims with a lease, fencing, exactly-once removal."""

from __future__ import annotations

import asyncio

import pytest

from agentkv.proxy._redis_store import RedisSessions
from agentkv.proxy._store import ClaimLostError, Stored, StoreUnavailableError


@pytest.fixture
async def store(redis_url):
    store = RedisSessions.from_url(redis_url, lease_s=0.2)
    yield store
    await store.aclose()


async def test_a_claim_commits_and_the_next_claim_gets_the_data_only_when_its_copy_is_stale(store):
    claim = await store.claim("k", known_version=0, wait_s=1)
    assert (claim.version, claim.data) == (0, None)
    version = await store.commit(claim, b"one", used_at=1.0)
    assert version == claim.fence
    stale = await store.claim("k", known_version=0, wait_s=1)
    assert (stale.version, stale.data) == (version, b"one")
    await store.release(stale)
    fresh = await store.claim("k", known_version=version, wait_s=1)
    assert (fresh.version, fresh.data) == (version, None)  # the caller's copy is current
    assert fresh.fence > stale.fence > claim.fence
    await store.release(fresh)
    assert await store.peek("k") == Stored(version=version, data=b"one", claimed=False)


async def test_peek_says_whether_a_claim_is_held_without_taking_one(store):
    """Readers wait a moment on ``claimed`` for a commit written behind an answer."""
    assert await store.peek("k") == Stored(version=0, data=None, claimed=False)
    claim = await store.claim("k", known_version=0, wait_s=1)
    assert await store.peek("k") == Stored(version=0, data=None, claimed=True)
    version = await store.commit(claim, b"one", used_at=1.0)
    assert await store.peek("k") == Stored(version=version, data=b"one", claimed=False)
    again = await store.claim("k", known_version=version, wait_s=1)
    assert await store.peek("k") == Stored(version=version, data=b"one", claimed=True)
    await store.release(again)


async def test_a_held_session_cannot_be_claimed_until_released(store):
    first = await store.claim("k", known_version=0, wait_s=1)
    with pytest.raises(TimeoutError):
        await store.claim("k", known_version=0, wait_s=0.0)
    waiter = asyncio.ensure_future(store.claim("k", known_version=0, wait_s=5))
    await asyncio.sleep(0.02)
    assert not waiter.done()
    await store.commit(first, b"a", used_at=1.0)
    second = await waiter
    assert second.data == b"a"
    await store.release(second)


async def test_a_stale_holders_commit_and_remove_are_refused_after_its_lease_ran_out(store):
    """The fencing token: the holder whose lease expired can overwrite nothing."""
    stale = await store.claim("k", known_version=0, wait_s=1)
    await asyncio.sleep(0.3)  # lease 0.2 s, not renewed
    current = await store.claim("k", known_version=0, wait_s=1)
    assert current.fence > stale.fence
    with pytest.raises(ClaimLostError):
        await store.commit(stale, b"stale", used_at=1.0)
    assert not await store.remove(stale)
    assert not await store.renew(stale)
    await store.release(stale)  # a no-op: it must not free the current holder's lock
    with pytest.raises(TimeoutError):
        await store.claim("k", known_version=0, wait_s=0.0)
    await store.commit(current, b"current", used_at=1.0)
    assert (await store.peek("k")).data == b"current"


async def test_renewal_keeps_a_claim_past_its_lease(store):
    claim = await store.claim("k", known_version=0, wait_s=1)
    for _ in range(4):
        await asyncio.sleep(0.08)
        assert await store.renew(claim)
    with pytest.raises(TimeoutError):
        await store.claim("k", known_version=0, wait_s=0.0)
    await store.commit(claim, b"x", used_at=1.0)


async def test_racing_claimants_hold_the_session_one_at_a_time(store):
    holders = 0
    peak = 0
    order = []

    async def work(i):
        nonlocal holders, peak
        claim = await store.claim("k", known_version=0, wait_s=10)
        holders += 1
        peak = max(peak, holders)
        await asyncio.sleep(0.005)
        holders -= 1
        order.append(claim.fence)
        await store.commit(claim, str(i).encode(), used_at=float(i))

    await asyncio.gather(*(work(i) for i in range(20)))
    assert peak == 1
    assert order == sorted(order)  # fences grow with every claim


async def test_removal_happens_exactly_once_and_an_idle_sweep_loses_to_a_recent_use(store):
    claim = await store.claim("k", known_version=0, wait_s=1)
    await store.commit(claim, b"s", used_at=100.0)
    assert await store.idle(before=101.0, limit=10) == ["k"]
    assert await store.idle(before=100.0, limit=10) == []
    # A sweep that saw the session idle, but a request used it before the sweep claimed it.
    sweep = await store.claim("k", known_version=0, wait_s=1)
    assert not await store.remove(sweep, idle_before=100.0)
    assert await store.peek("k") != (0, None)
    results = []
    for _ in range(2):
        claim = await store.claim("k", known_version=0, wait_s=1)
        results.append(await store.remove(claim))
        await store.release(claim)
    assert results == [True, False]
    assert await store.peek("k") == Stored(version=0, data=None, claimed=False)
    assert await store.idle(before=1e12, limit=10) == []


async def test_a_claim_says_when_the_one_before_it_ended_without_a_commit_or_release(store):
    """``dirty``: its holder may have run a turn that never reached the store (and consumed the
    stored handle). The dirty claim carries the snapshot even to a caller whose copy is
    current, so that copy is not used as if nothing had happened."""
    first = await store.claim("k", known_version=0, wait_s=1)
    assert not first.dirty  # nothing stored yet: nothing to distrust
    version = await store.commit(first, b"one", used_at=1.0)
    clean = await store.claim("k", known_version=version, wait_s=1)
    assert (clean.dirty, clean.data) == (False, None)
    await store.release(clean)  # a holder that changed nothing
    again = await store.claim("k", known_version=version, wait_s=1)
    assert (again.dirty, again.data) == (False, None)
    await asyncio.sleep(0.3)  # lease 0.2 s: the holder died mid-turn
    dirty = await store.claim("k", known_version=version, wait_s=1)
    assert (dirty.dirty, dirty.version, dirty.data) == (True, version, b"one")
    version = await store.commit(dirty, b"two", used_at=2.0)
    after = await store.claim("k", known_version=version, wait_s=1)
    assert (after.dirty, after.data) == (False, None)  # a commit ends it cleanly
    # An idle sweep that lost to a recent use changed nothing either.
    assert not await store.remove(after, idle_before=1.0)
    last = await store.claim("k", known_version=version, wait_s=1)
    assert not last.dirty
    await store.release(last)


async def test_a_redis_that_accepts_but_never_answers_is_unavailable_within_the_timeout():
    """The store bounds every call itself (redis-py's own socket timeout is off): a server that
    hangs is StoreUnavailableError after ``timeout_s``, not a request stuck forever."""
    accepted = []

    async def silent(reader, writer):
        accepted.append(writer)
        await reader.read()  # read what comes, answer nothing

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    store = RedisSessions.from_url(f"redis://127.0.0.1:{port}/0", timeout_s=0.2)
    try:
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(StoreUnavailableError):
            await store.claim("k", known_version=0, wait_s=5)
        with pytest.raises(StoreUnavailableError):
            await store.ping()
        assert loop.time() - started < 2.0
        assert accepted
    finally:
        await store.aclose()
        for writer in accepted:
            writer.close()
        server.close()
        await server.wait_closed()
