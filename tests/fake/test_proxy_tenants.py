"""Tenants sharing one proxy: no key's flood, failures or busy sessions cost another key its
sessions, and a shared store stays bounded with a sweep that keeps up (issue 39, items 2, 8)."""

from __future__ import annotations

import asyncio

import httpx2
import pytest
from redis.asyncio import Redis

from agentkv import AsyncCluster
from agentkv.proxy import ApiKeys, ProxyConfig, create_app
from agentkv.proxy._entry import store_key
from agentkv.proxy._errors import ProxyError
from agentkv.proxy._metrics import ProxyMetrics
from agentkv.proxy._redis_store import RedisSessions
from agentkv.proxy._registry import SessionRegistry
from agentkv.proxy._responses_store import ResponseStore, StoredResponse
from agentkv.proxy._salt import CacheSalts

KEYS = ApiKeys.parse("alice sk-alice\nbob sk-bob\ncarol sk-carol\n")
SECRET = "tenants-test-secret"
AUTH = {name: {"Authorization": f"Bearer sk-{name}"} for name in ("alice", "bob", "carol")}


pytestmark = pytest.mark.fake(kv_recompute_threshold=1)


class PrefillFailsFor(httpx2.AsyncBaseTransport):
    """The fake's transport, with every prefill request of one principal answered 503 (its
    ``cache_salt`` says whose it is): an upstream that fails one key's requests only."""

    def __init__(self, inner: httpx2.AsyncBaseTransport, principal: str) -> None:
        self._inner = inner
        self._salt = CacheSalts(SECRET).salt(principal).encode()
        self.on = True
        self.failed = 0

    async def handle_async_request(self, request):
        failing = self.on and request.url.host.startswith("fake-p")
        if failing and self._salt in request.content:
            self.failed += 1
            return httpx2.Response(
                503,
                json={"error": {"message": "overloaded", "type": "ServiceUnavailableError"}},
            )
        return await self._inner.handle_async_request(request)


def _client(app, name: str) -> httpx2.AsyncClient:
    return httpx2.AsyncClient(
        transport=httpx2.ASGITransport(app=app), base_url="http://proxy", headers=AUTH[name]
    )


def _chat(session_id: str, text: str = "Hi") -> dict[str, object]:
    return {"messages": [{"role": "user", "content": text}], "max_tokens": 8}


async def test_one_keys_failing_requests_close_no_other_keys_session_nor_its_responses(fake):
    """The report's repro: 55 requests under one key that fail upstream, interleaved with
    another key's conversation, leave that conversation's session and its
    ``previous_response_id`` intact (they used to close it: each failure kept a session)."""
    failing = PrefillFailsFor(fake.transport, "alice")
    async with AsyncCluster.from_dict(fake.cluster_spec, transport=failing) as cluster:
        config = ProxyConfig(api_keys=KEYS, max_sessions=5, cache_salt_secret=SECRET)
        app = create_app(cluster, config)
        async with _client(app, "alice") as alice, _client(app, "bob") as bob:
            first = await bob.post("/v1/responses", json={"input": "Hello", "max_output_tokens": 8})
            assert first.status_code == 200, first.text
            previous = first.json()["id"]
            for i in range(0, 55, 5):
                # Five at a time, so that they also hold places while they fail: each gets
                # 502 (upstream) or, past alice's share of places in use, a 503 of her own.
                refused = await asyncio.gather(
                    *(
                        alice.post(
                            "/v1/chat/completions", json=_chat(f"a{j}"),
                            headers={"X-Session-ID": f"a{j}"},
                        )
                        for j in range(i, i + 5)
                    )
                )
                assert {r.status_code for r in refused} <= {502, 503}, refused[0].text
                if i % 10 == 0:  # bob goes on meanwhile
                    more = await bob.post(
                        "/v1/responses",
                        json={"input": f"More {i}", "previous_response_id": previous,
                              "max_output_tokens": 8},
                    )
                    assert more.status_code == 200, more.text
                    assert more.headers["x-agentkv-handle"] != "none"  # its session went on
                    previous = more.json()["id"]
            last = await bob.post(
                "/v1/responses",
                json={"input": "Still there?", "previous_response_id": previous,
                      "max_output_tokens": 8},
            )
            assert last.status_code == 200, last.text
            assert last.headers["x-agentkv-handle"] != "none"
    assert failing.failed >= 40
    assert len(app.state.registry) == 1  # bob's; none of alice's failures kept a session
    metrics = app.state.metrics
    assert metrics.value("agentkv_proxy_sessions_closed_total", reason="evicted") == 0
    failed = metrics.value("agentkv_proxy_sessions_closed_total", reason="failed")
    refused = metrics.value("agentkv_proxy_sessions_refused_total", status="503")
    assert failed + refused == 55


async def test_one_keys_responses_never_push_out_another_keys_previous_response_ids():
    entry_bytes = ResponseStore._size("ali-0", _response("ali"))  # every id here: 5 + 3 + 1
    store = ResponseStore(max_bytes=4 * entry_bytes)

    async def put(principal: str, response_id: str) -> None:
        await store.put(response_id, _response(principal))

    async def kept(principal: str) -> list[int]:
        ids = [f"{principal}-{i}" for i in range(10)]
        return [i for i, rid in enumerate(ids) if await store.get("", rid) is not None]

    await put("bob", "bob-1")
    for i in range(10):
        await put("ali", f"ali-{i}")
    assert len(store) == 4
    assert await store.get("", "bob-1") is not None
    assert await kept("ali") == [7, 8, 9]
    # A newcomer under its share takes the place of the largest holder's oldest.
    await put("cat", "cat-1")
    assert await kept("ali") == [8, 9]
    assert await store.get("", "bob-1") is not None
    assert await store.get("", "cat-1") is not None


def _response(principal: str) -> StoredResponse:
    return StoredResponse(
        principal=principal, session_id="s", count=2, instructions=False, described=0, tail=b""
    )


async def _open(registry: SessionRegistry, principal: str, session_id: str):
    entry = await registry.checkout(principal, session_id)
    await registry.checkin(entry)
    return entry


async def test_a_key_over_its_share_evicts_its_own_sessions_before_anyone_elses(fake):
    async with AsyncCluster.from_dict(fake.cluster_spec, transport=fake.transport) as cluster:
        registry = SessionRegistry(
            cluster, max_sessions=4, idle_timeout_s=600, metrics=ProxyMetrics()
        )
        await _open(registry, "bob", "x")  # the oldest: plain LRU would close it first
        for name in ("a", "b", "c"):
            await _open(registry, "alice", name)
        # Full. Alice holds 3 of 4 (her share is 2 while two keys hold sessions): her own
        # least recently used idle session goes, not bob's older one.
        await _open(registry, "alice", "d")
        assert sorted(registry._entries) == [
            ("alice", "b"), ("alice", "c"), ("alice", "d"), ("bob", "x")
        ]
        # Bob, under his share, takes a place from the largest holder (alice), her oldest.
        await _open(registry, "bob", "y")
        assert sorted(registry._entries) == [
            ("alice", "c"), ("alice", "d"), ("bob", "x"), ("bob", "y")
        ]
        # At their shares now, each makes room from their own sessions.
        await _open(registry, "bob", "z")
        await _open(registry, "alice", "e")
        assert sorted(registry._entries) == [
            ("alice", "d"), ("alice", "e"), ("bob", "y"), ("bob", "z")
        ]


async def test_a_key_whose_sessions_are_all_busy_gets_its_own_503_and_others_are_served(fake):
    async with AsyncCluster.from_dict(fake.cluster_spec, transport=fake.transport) as cluster:
        registry = SessionRegistry(
            cluster, max_sessions=4, idle_timeout_s=600, metrics=ProxyMetrics()
        )
        await _open(registry, "carol", "c")
        busy = [await registry.checkout("alice", f"a{i}") for i in range(3)]
        # Alice is over her share (4 // 2) with every session in use: she waits, carol's idle
        # session is not hers to take.
        with pytest.raises(ProxyError) as info:
            await registry.checkout("alice", "a3")
        assert info.value.status == 503
        assert info.value.headers["Retry-After"] == "1"
        assert ("carol", "c") in registry._entries
        # Another key is still served (from the largest holders with an idle session).
        bob = await registry.checkout("bob", "b")
        await registry.checkin(bob)
        assert ("bob", "b") in registry._entries
        for entry in busy:
            await registry.checkin(entry)


async def test_a_key_at_its_own_cap_gets_429_while_others_still_open_sessions(fake):
    async with AsyncCluster.from_dict(fake.cluster_spec, transport=fake.transport) as cluster:
        app = create_app(cluster, ProxyConfig(max_sessions=100, max_sessions_per_key=2))
        registry = app.state.registry
        busy = [await registry.checkout("alice", f"a{i}") for i in range(2)]
        with pytest.raises(ProxyError) as info:
            await registry.checkout("alice", "a2")
        assert (info.value.status, info.value.code) == (429, "too_many_sessions")
        assert info.value.headers["Retry-After"] == "1"
        await _open(registry, "bob", "b")
        # An idle one of her own makes room under her cap.
        await registry.checkin(busy[0])
        await _open(registry, "alice", "a2")
        assert sorted(k for k in registry._entries if k[0] == "alice") == [
            ("alice", "a1"), ("alice", "a2")
        ]
        await registry.checkin(busy[1])
        assert app.state.metrics.value("agentkv_proxy_sessions_refused_total", status="429") == 1


async def test_a_failed_first_turn_leaves_no_session_and_a_failed_later_turn_keeps_it(fake):
    failing = PrefillFailsFor(fake.transport, "alice")
    failing.on = False
    async with AsyncCluster.from_dict(fake.cluster_spec, transport=failing) as cluster:
        app = create_app(cluster, ProxyConfig(api_keys=KEYS, cache_salt_secret=SECRET))
        async with _client(app, "alice") as alice:
            history = [{"role": "user", "content": "Hi"}]
            ok = await alice.post(
                "/v1/chat/completions",
                json={"messages": history, "max_tokens": 8},
                headers={"X-Session-ID": "kept"},
            )
            assert ok.status_code == 200
            history += [ok.json()["choices"][0]["message"], {"role": "user", "content": "And?"}]
            failing.on = True
            for session_id, messages in (("kept", history), ("new", history[:1])):
                refused = await alice.post(
                    "/v1/chat/completions",
                    json={"messages": messages, "max_tokens": 8},
                    headers={"X-Session-ID": session_id},
                )
                assert refused.status_code == 502
            assert (await alice.get("/v1/sessions/new")).status_code == 404
            kept = await alice.get("/v1/sessions/kept")
            assert kept.status_code == 200
            assert len(kept.json()["turns"]) == 1
    assert len(app.state.registry) == 1
    assert app.state.metrics.value("agentkv_proxy_sessions_closed_total", reason="failed") == 1


class RecordingStore(RedisSessions):
    """A Redis store that records the keys it was asked to claim."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.claimed: list[str] = []

    async def claim(self, key, *, known_version, wait_s, secret=""):
        self.claimed.append(key)
        return await super().claim(
            key, known_version=known_version, wait_s=wait_s, secret=secret
        )


class Replica:
    """One proxy replica on the shared Redis, with its own cluster client."""

    def __init__(self, fake, redis_url, *, transport=None, **config) -> None:
        self.cluster = AsyncCluster.from_dict(
            fake.cluster_spec, transport=transport or fake.transport
        )
        self.store = RecordingStore(Redis.from_url(redis_url, socket_timeout=None), lease_s=5.0)
        self.app = create_app(
            self.cluster,
            ProxyConfig(api_keys=KEYS, cache_salt_secret=SECRET, **config),
            store=self.store,
        )
        self.registry = self.app.state.registry

    def client(self, name: str) -> httpx2.AsyncClient:
        return _client(self.app, name)

    async def aclose(self) -> None:
        await self.registry.close_all()
        await self.store.aclose()
        await self.cluster.aclose()


@pytest.fixture
async def replicas(fake, redis_url):
    made: list[Replica] = []

    def make(**config) -> Replica:
        made.append(Replica(fake, redis_url, **config))
        return made[-1]

    yield make
    for replica in made:
        await replica.aclose()


async def _stored(redis_url: str) -> int:
    """How many sessions the store's idle index holds (every stored session is in it)."""
    admin = Redis.from_url(redis_url)
    try:
        return int(await admin.zcard("agentkv:idle"))
    finally:
        await admin.aclose()


async def _stored_keys(redis_url: str) -> list[bytes]:
    admin = Redis.from_url(redis_url)
    try:
        return sorted(await admin.keys("agentkv:[slt]:*"))
    finally:
        await admin.aclose()


async def test_a_failed_first_turn_stores_nothing_in_redis(fake, redis_url, replicas):
    failing = PrefillFailsFor(fake.transport, "alice")
    replica = replicas(transport=failing)
    async with replica.client("alice") as alice, replica.client("bob") as bob:
        refused = await alice.post(
            "/v1/chat/completions", json=_chat("new"), headers={"X-Session-ID": "new"}
        )
        assert refused.status_code == 502
        await replica.registry.written()
        assert await _stored_keys(redis_url) == []  # no snapshot, no lock, no tail
        assert await replica.store.count() == 0
        assert len(replica.registry) == 0
        assert (await alice.get("/v1/sessions/new")).status_code == 404
        ok = await bob.post(
            "/v1/chat/completions", json=_chat("b"), headers={"X-Session-ID": "b"}
        )
        assert ok.status_code == 200
        await replica.registry.written()
    assert await replica.store.count() == 1
    peeked = await replica.store.peek(store_key("alice", "new"))
    assert (peeked.version, peeked.data) == (0, None)


async def test_the_store_holds_at_most_max_stored_sessions_across_replicas(replicas):
    a, b = replicas(max_stored_sessions=2), replicas(max_stored_sessions=2)
    async with a.client("alice") as on_a, b.client("bob") as on_b:
        for client, session_id in ((on_a, "s1"), (on_b, "s2")):
            response = await client.post(
                "/v1/chat/completions", json=_chat(session_id),
                headers={"X-Session-ID": session_id},
            )
            assert response.status_code == 200
        for replica in (a, b):
            await replica.registry.written()
        full = await on_a.post(
            "/v1/chat/completions", json=_chat("s3"), headers={"X-Session-ID": "s3"}
        )
        assert full.status_code == 503, full.text
        assert full.json()["error"]["code"] == "too_many_sessions"
        assert full.headers["Retry-After"] == "15"
        assert ("alice", "s3") not in a.registry._entries  # refused: no copy
        # Stored sessions go on, on either replica.
        more = await on_b.post(
            "/v1/chat/completions",
            json={
                "messages": [
                    {"role": "user", "content": "s2"}, {"role": "user", "content": "On"}
                ],
                "max_tokens": 8,
            },
            headers={"X-Session-ID": "s2"},
        )
        assert more.status_code == 200
        assert (await on_b.delete("/v1/sessions/s2")).status_code == 200
        again = await on_a.post(
            "/v1/chat/completions", json=_chat("s3"), headers={"X-Session-ID": "s3"}
        )
        assert again.status_code == 200
    assert a.app.state.metrics.value("agentkv_proxy_sessions_refused_total", status="store") == 1


async def _store_sessions(replica: Replica, count: int) -> None:
    """``count`` sessions stored (committed without a turn: cheap, nothing upstream)."""

    async def one(i: int) -> None:
        entry = await replica.registry.checkout("alice", f"idle-{i}")
        await replica.registry.checkin(entry)

    for start in range(0, count, 10):
        await asyncio.gather(*(one(i) for i in range(start, min(count, start + 10))))
    await replica.registry.written()
    for key in list(replica.registry._entries):
        replica.registry._forget(replica.registry._entries[key])


async def test_one_sweep_tick_removes_more_than_a_page_of_idle_sessions(replicas, redis_url):
    """The sweep used to stop after 1,000 keys a tick, fleet-wide: a backlog never drained."""
    replica = replicas()
    await _store_sessions(replica, 1005)
    assert await _stored(redis_url) == 1005
    replica.registry._wall = lambda: 10.0**12  # far past the idle timeout
    assert await replica.registry.sweep() == 1005
    assert await _stored(redis_url) == 0


async def test_two_replicas_sweeping_together_never_claim_the_same_key(replicas, redis_url):
    a, b = replicas(), replicas()
    await _store_sessions(a, 40)
    for replica in (a, b):
        replica.registry._wall = lambda: 10.0**12
        replica.registry._sweep_page = 7  # several pages each
        replica.store.claimed.clear()
    swept = await asyncio.gather(a.registry.sweep(), b.registry.sweep())
    assert sum(swept) == 40
    assert await _stored(redis_url) == 0
    assert not set(a.store.claimed) & set(b.store.claimed)
    assert len(a.store.claimed) + len(b.store.claimed) == 40  # each key claimed once


async def test_take_idle_hands_each_idle_key_to_one_caller_until_its_hold_ends(redis_url):
    store = RedisSessions.from_url(redis_url)
    try:
        for i, used_at in enumerate((1.0, 2.0, 3.0, 50.0)):
            claim = await store.claim(f"k{i}", known_version=0, wait_s=0.0)
            await store.commit(claim, b"snapshot", used_at=used_at)
        assert await store.count() == 4
        first = await store.take_idle(before=10.0, limit=2, hold_s=0.2)
        second = await store.take_idle(before=10.0, limit=2, hold_s=60.0)
        assert (first, second) == (["k0", "k1"], ["k2"])  # k3 is not idle yet
        assert await store.take_idle(before=10.0, limit=2, hold_s=60.0) == []
        await asyncio.sleep(0.3)  # the first caller never removed its keys: handed out again
        assert await store.take_idle(before=10.0, limit=5, hold_s=60.0) == ["k0", "k1"]
    finally:
        await store.aclose()
