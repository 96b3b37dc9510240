"""The Redis session store on a real Redis: claims with a lease, fencing, exactly-once removal."""

from __future__ import annotations

import asyncio

import pytest
from redis.asyncio import Redis

from agentkv.proxy._redis_store import RedisSessions
from agentkv.proxy._store import ClaimLostError, Stored, StoreUnavailableError, response_group


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


# --- commits that append ---------------------------------------------------------------------


@pytest.fixture
async def raw(redis_url):
    """A plain client on the store's Redis, to look at what it holds."""
    client = Redis.from_url(redis_url)
    yield client
    await client.aclose()


async def _bytes_in(raw) -> int:
    return int((await raw.info("stats"))["total_net_input_bytes"])


async def _turn(store, key, version, data, *, tail, kept):
    claim = await store.claim(key, known_version=version, wait_s=1)
    return await store.commit(claim, data, used_at=1.0, tail=tail, kept=kept)


async def test_a_commit_that_extends_the_stored_tail_sends_and_stores_only_the_new_bytes(
    store, raw
):
    """The head is replaced, the tail appended: Redis receives the head and the new ids, not
    the ids it holds (a turn adds hundreds of ids to thousands)."""
    ids = bytes(range(256)) * 96  # 24 KB: a 6k-token transcript
    version = await _turn(store, "k", 0, b"head-1" + ids, tail=len(ids), kept=0)
    assert await raw.strlen("agentkv:t:k") == len(ids)
    delta = b"\x07" * 1200  # one turn: 300 ids
    data = b"head-two" + ids + delta
    before = await _bytes_in(raw)
    version = await _turn(store, "k", version, data, tail=len(ids + delta), kept=len(ids))
    received = await _bytes_in(raw) - before  # the claim, the commit and one INFO
    assert received < len(b"head-two") + len(delta) + 600 < len(data)
    assert await raw.strlen("agentkv:t:k") == len(ids) + len(delta)
    assert await raw.hget("agentkv:s:k", "snap") == b"head-two"
    assert await raw.hmget("agentkv:s:k", "ver", "tver") == [str(version).encode()] * 2
    assert (await store.peek("k")).data == data


async def test_a_stale_claimant_gets_the_appended_snapshot_byte_for_byte_as_written_whole(store):
    """Whatever mix of appends and rewrites built it, a claim and a peek return exactly the
    last snapshot committed, as a store that only ever rewrote would."""
    ids, version, data = b"", 0, b""
    for turn in range(6):
        delta = bytes([turn]) * (40 + turn)
        kept = len(ids) if turn % 3 else 0  # every third commit a rewrite
        ids += delta
        data = f"head {turn} ".encode() * (turn + 1) + ids
        version = await _turn(store, "appended", version, data, tail=len(ids), kept=kept)
        await _turn(store, "whole", 0, data, tail=0, kept=0)
    stale = await store.claim("appended", known_version=0, wait_s=1)
    assert (stale.version, stale.data) == (version, data)
    await store.release(stale)
    assert (await store.peek("appended")).data == data == (await store.peek("whole")).data
    current = await store.claim("appended", known_version=version, wait_s=1)
    assert current.data is None  # the caller's copy is current: nothing transferred
    await store.release(current)


async def test_a_snapshot_that_does_not_extend_the_stored_tail_rewrites_it(store, raw):
    """A fork or a truncation: the caller says ``kept=0`` and the tail is replaced whole."""
    version = await _turn(store, "k", 0, b"h" + b"a" * 400, tail=400, kept=0)
    version = await _turn(store, "k", version, b"h2" + b"b" * 100, tail=100, kept=0)
    assert await raw.get("agentkv:t:k") == b"b" * 100
    assert (await store.peek("k")).data == b"h2" + b"b" * 100


async def test_an_append_onto_a_tail_not_of_the_claimed_version_is_sent_again_whole(store, raw):
    """The script appends only onto the tail of the claimed version, exactly ``kept`` bytes
    long; otherwise it writes nothing and the commit goes again whole. A hash an older
    agentkv wrote (its snapshot whole in ``snap``, no ``tver``) is read and replaced so."""
    version = await _turn(store, "k", 0, b"h" + b"a" * 40, tail=40, kept=0)
    await raw.append("agentkv:t:k", b"!")  # a tail of another length than the caller's
    version = await _turn(store, "k", version, b"h" + b"a" * 40 + b"b", tail=41, kept=40)
    assert (await store.peek("k")).data == b"h" + b"a" * 40 + b"b"
    # An older agentkv's commit: the whole snapshot in ``snap``, ``ver``, nothing else.
    await raw.hset("agentkv:s:k", mapping={"snap": b"old" + b"c" * 50, "ver": version + 100})
    old = await store.claim("k", known_version=0, wait_s=1)
    assert (old.version, old.data) == (version + 100, b"old" + b"c" * 50)
    await store.commit(old, b"new" + b"c" * 60, used_at=1.0, tail=60, kept=50)
    assert (await store.peek("k")).data == b"new" + b"c" * 60
    assert await raw.get("agentkv:t:k") == b"c" * 60


async def test_a_lost_claim_appends_nothing(store, raw):
    version = await _turn(store, "k", 0, b"h" + b"a" * 40, tail=40, kept=0)
    stale = await store.claim("k", known_version=version, wait_s=1)
    await asyncio.sleep(0.3)  # lease 0.2 s: another replica takes the session
    current = await store.claim("k", known_version=version, wait_s=1)
    with pytest.raises(ClaimLostError):
        await store.commit(stale, b"h" + b"a" * 40 + b"late", used_at=1.0, tail=44, kept=40)
    assert await raw.get("agentkv:t:k") == b"a" * 40
    assert await raw.hget("agentkv:s:k", "ver") == str(version).encode()
    await store.release(current)


async def test_a_removed_session_leaves_no_tail(store, raw):
    await _turn(store, "k", 0, b"h" + b"a" * 40, tail=40, kept=0)
    claim = await store.claim("k", known_version=0, wait_s=1)
    assert await store.remove(claim)
    assert await raw.exists("agentkv:s:k", "agentkv:t:k") == 0


async def test_a_sessions_responses_go_with_a_fork_past_them_and_with_the_session(store, raw):
    await _turn(store, "k", 0, b"h" + b"a" * 40, tail=40, kept=0)
    group = response_group("k")
    for count in (2, 4, 6):
        await store.put_response("k", f"r{count}", b"rec%d" % count, count=count, ttl_s=60.0)
    assert await store.get_response(group, "r4") == b"rec4"
    assert 0 < await raw.pttl(f"agentkv:r:{group}") <= 60_000  # reclaimed if never removed
    await store.drop_responses("k", after=4)  # a fork kept 4 messages
    assert [await store.get_response(group, f"r{c}") for c in (2, 4, 6)] == [b"rec2", b"rec4", None]
    assert await store.get_response(response_group("other"), "r2") is None
    claim = await store.claim("k", known_version=0, wait_s=1)
    assert await store.remove(claim)
    assert await raw.exists(f"agentkv:r:{group}") == 0


async def test_two_replicas_appending_in_turn_never_show_a_head_and_a_tail_of_two_versions(
    redis_url,
):
    """Two stores (two replicas) extend one session in turn, each from the copy it holds or the
    snapshot its claim brought, while a reader peeks all along: every snapshot read is exactly
    the one committed as its version."""
    replicas = [RedisSessions.from_url(redis_url, lease_s=5.0) for _ in range(2)]
    written: dict[int, bytes] = {}  # version (the committing fence) -> the snapshot committed
    done = asyncio.Event()

    async def replica(store, index):
        version, ids = 0, b""
        for turn in range(40):
            claim = await store.claim("k", known_version=version, wait_s=5)
            if claim.data is not None:
                ids = claim.data[claim.data.index(b"|") + 1 :]
            elif claim.version == 0:
                ids = b""
            kept = len(ids) if claim.version else 0
            ids += bytes([index]) * (turn % 7 + 1)
            data = f"replica {index} turn {turn}|".encode() + ids
            written[claim.fence] = data
            version = await store.commit(claim, data, used_at=1.0, tail=len(ids), kept=kept)
            await asyncio.sleep(0)

    async def reader():
        seen = 0
        while not done.is_set():
            stored = await replicas[0].peek("k")
            if stored.data is not None:
                assert stored.data == written[stored.version]
                seen += 1
            await asyncio.sleep(0)
        return seen

    watching = asyncio.ensure_future(reader())
    await asyncio.gather(replica(replicas[0], 0), replica(replicas[1], 1))
    done.set()
    assert await watching > 0
    final = await replicas[1].peek("k")
    assert final.data == written[final.version]
    ids = final.data.split(b"|", 1)[1]  # every turn's ids, none lost to a rewrite
    assert ids.count(b"\x00") == ids.count(b"\x01") == sum(t % 7 + 1 for t in range(40))
    for store in replicas:
        await store.aclose()
