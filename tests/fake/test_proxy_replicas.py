"""Proxy replicas sharing sessions in a real Redis (``--state``), in front of the fake pair.

Each replica is its own app with its own cluster client (as separate processes are); only Redis
and the servers are shared.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import socket
import time

import httpx2
import pytest
from openai import AsyncOpenAI
from redis.asyncio import Redis

from agentkv import AsyncCluster, Message
from agentkv._wire.tier import LEGACY_OFFLOAD_PATH
from agentkv.proxy import ProxyConfig, create_app
from agentkv.proxy._redis_store import RedisSessions
from agentkv.proxy._shared import DIRTY_HANDOVER
from agentkv.proxy._store import ClaimLostError
from agentkv.testing import FakeCluster, ManualClock

SYSTEM = "You answer briefly. " + " ".join(f"Rule {i}: be kind to robot {i}." for i in range(30))
QUESTIONS = ("Hello?", "Who is robot 4?", "And robot 9?", "Thanks, bye.", "One more?", "Bye!")


pytestmark = pytest.mark.fake(kv_recompute_threshold=1)


class SlowTransport(httpx2.AsyncBaseTransport):
    """The fake's transport with a pause before each request: turns that take a while, so
    that requests on two replicas really overlap."""

    def __init__(self, inner, delay_s):
        self._inner = inner
        self._delay_s = delay_s

    async def handle_async_request(self, request):
        await asyncio.sleep(self._delay_s)
        return await self._inner.handle_async_request(request)


class SlowPersists(httpx2.AsyncBaseTransport):
    """The fake's transport with a pause before each persist: decode writing the tier for a
    while."""

    def __init__(self, inner, delay_s):
        self._inner = inner
        self._delay_s = delay_s

    async def handle_async_request(self, request):
        if request.url.path == LEGACY_OFFLOAD_PATH:
            await asyncio.sleep(self._delay_s)
        return await self._inner.handle_async_request(request)


class CountingTransport(httpx2.AsyncBaseTransport):
    """The fake's transport, counting the requests this replica sends by path."""

    def __init__(self, inner):
        self._inner = inner
        self.paths = collections.Counter()

    async def handle_async_request(self, request):
        self.paths[request.url.path] += 1
        return await self._inner.handle_async_request(request)


class Replica:
    """One proxy replica: an app, its own cluster client, its own Redis connection."""

    def __init__(
        self, fake, clock, redis_url, *, delay_s=0.0, store=None, transport=None, **config
    ):
        transport = transport or fake.transport
        transport = SlowTransport(transport, delay_s) if delay_s else transport
        self.sent = CountingTransport(transport)
        self.cluster = AsyncCluster.from_dict(fake.cluster_spec, transport=self.sent, clock=clock)
        self.store = store or RedisSessions.from_url(redis_url, lease_s=5.0)
        self.app = create_app(self.cluster, ProxyConfig(**config), clock=clock, store=self.store)
        self.http = httpx2.AsyncClient(
            transport=httpx2.ASGITransport(app=self.app), base_url="http://proxy"
        )

    def openai(self, session_id):
        return AsyncOpenAI(
            base_url="http://proxy/v1",
            api_key="sk-test",
            http_client=self.http,
            default_headers={"X-Session-ID": session_id},
            max_retries=0,
        )

    async def turns(self, session_id):
        response = await self.http.get(
            f"/v1/sessions/{session_id}", headers={"Authorization": "Bearer sk-test"}
        )
        response.raise_for_status()
        return response.json()["turns"]

    async def aclose(self, *, release=True):
        if release:
            await self.app.state.registry.close_all()
        await self.http.aclose()
        await self.store.aclose()
        await self.cluster.aclose()


@pytest.fixture
async def replicas(fake, clock, redis_url):
    made = [Replica(fake, clock, redis_url), Replica(fake, clock, redis_url)]
    yield made
    for replica in made:
        await replica.aclose()


async def _ask(replica, session_id, messages, question, **body):
    messages.append({"role": "user", "content": question})
    response = await replica.openai(session_id).chat.completions.create(
        model="fake-smollm2", messages=messages, max_tokens=48, **body
    )
    messages.append(response.choices[0].message.model_dump(exclude_none=True))
    return response


def _assert_ideal(turns):
    assert [t["handle_state"] for t in turns] == ["none"] + ["attached"] * (len(turns) - 1)
    for turn in turns[1:]:
        assert turn["reused_tokens"] == turn["ideal_reused_tokens"], turn


async def test_an_openai_client_alternating_replicas_every_turn_keeps_the_ideal_reuse(
    replicas, fake
):
    messages = [{"role": "system", "content": SYSTEM}]
    for i, question in enumerate(QUESTIONS):
        await _ask(replicas[i % 2], "alt", messages, question)
    turns = await replicas[0].turns("alt")
    assert turns == await replicas[1].turns("alt")
    assert len(turns) == len(QUESTIONS)
    _assert_ideal(turns)
    for replica in replicas:
        assert replica.app.state.metrics.value("agentkv_proxy_forks_total") == 0
    assert fake.wrong_reuse_events == 0
    # No salt secret configured: the replicas share one from Redis, so one principal's prefix
    # cache (and its tier entries) serve it whichever replica it reaches.
    salts = {
        body.get("cache_salt")
        for i in range(2)
        for server in (fake.prefill(i), fake.decode(i))
        for body in server.requests
    }
    assert len(salts) == 1
    assert None not in salts


async def test_a_clean_handover_attaches_the_stored_handle_without_asking_decode(replicas):
    """Each claim says whether the one before it ended cleanly (a commit). Then the stored
    handle is exactly what the turn that stored it left, and the replica taking the session
    over attaches it as that replica would have: no confirming extend call to decode."""
    messages = [{"role": "system", "content": SYSTEM}]
    for i, question in enumerate(QUESTIONS):
        await _ask(replicas[i % 2], "clean", messages, question)
    _assert_ideal(await replicas[0].turns("clean"))
    assert not any(path.endswith("/extend") for r in replicas for path in r.sent.paths)


async def test_a_replica_gone_mid_conversation_loses_nothing(fake, clock, redis_url, replicas):
    """Replica A answers two turns and disappears without a goodbye (its copies, claims and
    connections just stop); B continues the same conversation: no fork, nothing lost, the
    handle A's last turn stored is the one B's turn attaches."""
    a, b = replicas
    messages = [{"role": "system", "content": SYSTEM}]
    await _ask(a, "gone", messages, QUESTIONS[0])
    await _ask(a, "gone", messages, QUESTIONS[1])
    await a.app.state.registry.written()  # killed between turns, after its commit landed
    pinned = fake.decode(0).pinned_handles + fake.decode(1).pinned_handles
    await a.aclose(release=False)  # like a killed process: releases nothing
    replicas.remove(a)
    assert fake.decode(0).pinned_handles + fake.decode(1).pinned_handles == pinned
    for question in QUESTIONS[2:]:
        await _ask(b, "gone", messages, question)
    turns = await b.turns("gone")
    assert len(turns) == len(QUESTIONS)
    _assert_ideal(turns)
    assert b.app.state.metrics.value("agentkv_proxy_forks_total") == 0


class HeldCommits:
    """A replica's store whose commits wait for ``go``: a replica that dies between sending an
    answer and storing it is one whose commit never lands."""

    def __init__(self, inner):
        self._inner = inner
        self.lease_s = inner.lease_s
        self.go = asyncio.Event()
        self.held = 0
        self.refused = 0

    def __getattr__(self, name):
        return getattr(self._inner, name)

    async def commit(self, claim, data, *, used_at, pinned=False, tail=0, kept=0):
        self.held += 1
        await self.go.wait()
        try:
            return await self._inner.commit(
                claim, data, used_at=used_at, pinned=pinned, tail=tail, kept=kept
            )
        except ClaimLostError:
            self.refused += 1
            raise


async def test_a_replica_dying_between_its_answer_and_its_commit_loses_only_reuse(
    fake, clock, redis_url
):
    """The commit is written behind the answer. If the replica dies before it lands, the stored
    session lacks that turn: the next request, on another replica once the dead one's claim
    lapsed, re-sends the turn's messages as new input and recomputes (nothing is lost, no wrong
    KV). The dead replica's late commit is refused: the session was taken over."""
    held = HeldCommits(RedisSessions.from_url(redis_url, lease_s=0.3))
    a = Replica(fake, clock, redis_url, store=held)
    b = Replica(fake, clock, redis_url)
    messages = [{"role": "system", "content": SYSTEM}]
    held.go.set()
    await _ask(a, "dies", messages, QUESTIONS[0])
    await a.app.state.registry.written()
    held.go.clear()
    # The answer comes back while its commit is held: it does not wait for it.
    answer = await asyncio.wait_for(_ask(a, "dies", messages, QUESTIONS[1]), 5)
    assert answer.choices[0].message.content
    for _ in range(100):
        if held.held == 2:
            break
        await asyncio.sleep(0.01)
    assert held.held == 2
    # A is dead from here: its second commit does not land while B serves the next turn.
    await _ask(b, "dies", messages, QUESTIONS[2])
    turns = await b.turns("dies")
    assert len(turns) == 2  # A's first turn, then B's: A's second never reached the store
    # The stored handle is turn 1's, whose pin A's second turn consumed: B must not attach it,
    # nor even ask decode (A might only be slow, its pull still to come).
    assert turns[1]["handle_state"] == "consumed"
    assert turns[1]["handle_reason"] == DIRTY_HANDOVER
    assert fake.wrong_reuse_events == 0
    held.go.set()
    await a.app.state.registry.written()
    assert held.refused == 1
    refused = a.app.state.metrics.value(
        "agentkv_proxy_store_commit_failures_total", reason="refused"
    )
    assert refused == 1
    assert await b.turns("dies") == turns
    await a.aclose(release=False)
    await b.aclose()


async def test_a_turn_lost_before_its_commit_is_not_undone_by_an_older_cached_copy(
    fake, clock, redis_url
):
    """A serves turn 1 and keeps its copy; B serves turn 2 (consuming turn 1's pin) and dies
    before its commit. The next request is A's again: its cached copy is exactly the stored
    version, but B's claim ended without a commit, so A must not attach turn 1's handle from
    it: decode may have given those blocks to another request."""
    held = HeldCommits(RedisSessions.from_url(redis_url, lease_s=0.3))
    a = Replica(fake, clock, redis_url)
    b = Replica(fake, clock, redis_url, store=held)
    messages = [{"role": "system", "content": SYSTEM}]
    await _ask(a, "older", messages, QUESTIONS[0])
    await a.app.state.registry.written()
    await _ask(b, "older", messages, QUESTIONS[1])  # its commit is held: B is dead from here
    await _ask(a, "older", messages, QUESTIONS[2])
    turns = await a.turns("older")
    assert len(turns) == 2  # A's first turn, then its third: B's never reached the store
    # A dirty handover: the handle is neither attached nor asked about (B may only be slow).
    assert turns[1]["handle_state"] == "consumed"
    assert turns[1]["handle_reason"] == DIRTY_HANDOVER
    lease_calls = ("/extend", "/claim")
    assert not any(path.endswith(lease_calls) for path in a.sent.paths.elements())
    assert fake.wrong_reuse_events == 0
    held.go.set()
    await b.app.state.registry.written()
    assert held.refused == 1
    await _ask(a, "older", messages, QUESTIONS[3])  # and the session goes on at the ideal
    assert (await a.turns("older"))[-1]["handle_state"] == "attached"
    await a.aclose()
    await b.aclose(release=False)


async def test_concurrent_requests_for_one_session_through_both_replicas_serialize(
    fake, clock, redis_url
):
    """Two requests with the same history at once, one per replica: the second runs after the
    first committed, sees its answer in the stored session and forks from it (exactly what one
    replica does with two such requests); nothing is overwritten."""
    replicas = [Replica(fake, clock, redis_url, delay_s=0.05) for _ in range(2)]
    a, b = replicas
    history = [{"role": "system", "content": SYSTEM}]
    await _ask(a, "race", history, QUESTIONS[0])
    await asyncio.gather(
        _ask(a, "race", list(history), QUESTIONS[1]),
        _ask(b, "race", list(history), QUESTIONS[1]),
    )
    forks = sum(r.app.state.metrics.value("agentkv_proxy_forks_total") for r in replicas)
    # The later request saw the earlier one's committed turn (its history does not extend it).
    # Unserialized, both would have extended turn 1 and one commit would have overwritten the
    # other: no fork at all.
    assert forks == 1
    turns = await a.turns("race")
    assert turns == await b.turns("race")
    for replica in replicas:
        await replica.aclose()


async def test_delete_through_one_replica_releases_the_pin_once_and_both_forget(replicas, fake):
    a, b = replicas
    messages = [{"role": "system", "content": SYSTEM}]
    await _ask(a, "del", messages, QUESTIONS[0])
    await _ask(b, "del", messages, QUESTIONS[1])
    assert fake.decode(0).pinned_handles + fake.decode(1).pinned_handles == 1
    auth = {"Authorization": "Bearer sk-test"}
    assert (await b.http.delete("/v1/sessions/del", headers=auth)).status_code == 200
    assert fake.decode(0).pinned_handles + fake.decode(1).pinned_handles == 0
    for replica in replicas:
        assert (await replica.http.delete("/v1/sessions/del", headers=auth)).status_code == 404
        assert (await replica.http.get("/v1/sessions/del", headers=auth)).status_code == 404
    closed = sum(
        r.app.state.metrics.value("agentkv_proxy_sessions_closed_total", reason="deleted")
        for r in replicas
    )
    assert closed == 1


async def test_idle_expiry_releases_the_pin_exactly_once_whichever_replica_sweeps(
    replicas, fake, redis_url
):
    a, b = replicas
    messages = [{"role": "system", "content": SYSTEM}]
    await _ask(a, "idle", messages, QUESTIONS[0])
    await a.app.state.registry.written()  # stored (and in the idle index) once it lands
    assert fake.decode(0).pinned_handles + fake.decode(1).pinned_handles == 1
    for replica in replicas:
        replica.app.state.registry._wall = lambda: 10.0**12  # far past the idle timeout
    swept = await asyncio.gather(*(r.app.state.registry.sweep() for r in replicas))
    assert sorted(swept) == [0, 1]
    assert fake.decode(0).pinned_handles + fake.decode(1).pinned_handles == 0
    auth = {"Authorization": "Bearer sk-test"}
    assert (await b.http.get("/v1/sessions/idle", headers=auth)).status_code == 404


async def test_a_turn_costs_two_redis_round_trips_on_the_same_or_the_other_replica(
    replicas, redis_url
):
    """The hot path: one claim (with the snapshot only when the copy is stale), one commit."""
    import redis

    admin = redis.Redis.from_url(redis_url)

    def commands():
        # Requests the proxy sent: its scripts and its plain reads (a script's own commands are
        # counted too by INFO, but run inside the one round trip).
        stats = admin.info("commandstats")
        sent = ("cmdstat_evalsha", "cmdstat_eval", "cmdstat_zrangebyscore")
        return sum(int(v["calls"]) for k, v in stats.items() if k in sent)

    a, b = replicas
    messages = [{"role": "system", "content": SYSTEM}]
    await _ask(a, "rtt", messages, QUESTIONS[0])
    await _ask(b, "rtt", messages, QUESTIONS[1])  # both replicas have connected and loaded scripts
    for replica, question in ((b, QUESTIONS[2]), (a, QUESTIONS[3])):
        for settled in replicas:
            await settled.app.state.registry.written()
        admin.config_resetstat()
        await _ask(replica, "rtt", messages, question)
        await replica.app.state.registry.written()  # the commit is written behind the answer
        assert commands() == 2  # claim, commit
    admin.close()


async def test_an_unreachable_redis_answers_503_and_fails_the_readiness_probe(fake, clock):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # nothing listens here once the socket closes
    replica = Replica(fake, clock, f"redis://127.0.0.1:{port}/0")
    try:
        response = await replica.http.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "Hi"}]},
            headers={"X-Session-ID": "down"},
        )
        assert response.status_code == 503, response.text
        assert response.json()["error"]["code"] == "state_unavailable"
        health = await replica.http.get("/healthz")
        assert health.status_code == 503
        assert health.json()["state"] == "unreachable"
    finally:
        await replica.aclose(release=False)


def _timing(response):
    parts = (part.strip().split(";dur=") for part in response.headers["server-timing"].split(","))
    return {name: float(ms) for name, ms in parts}


async def test_server_timing_says_what_the_shared_store_took(replicas, fake, clock):
    """``store`` is part of ``proxy``: the claim (with the restore on the other replica), the
    snapshot and the commit. A replica without a store reports none."""
    messages = [{"role": "system", "content": SYSTEM}]
    timings = []
    for i, question in enumerate(QUESTIONS[:3]):
        messages.append({"role": "user", "content": question})
        raw = (
            await replicas[i % 2]
            .openai("timed")
            .chat.completions.with_raw_response.create(
                model="fake-smollm2", messages=messages, max_tokens=8
            )
        )
        messages.append(raw.parse().choices[0].message.model_dump(exclude_none=True))
        timings.append(_timing(raw))
    for timing in timings:
        assert set(timing) == {"turn", "proxy", "store"}
        assert 0 < timing["store"] <= timing["proxy"]
    cluster = AsyncCluster.from_dict(fake.cluster_spec, transport=fake.transport, clock=clock)
    app = create_app(cluster, ProxyConfig(), clock=clock)
    transport = httpx2.ASGITransport(app=app)
    async with httpx2.AsyncClient(transport=transport, base_url="http://p") as c:
        alone = await c.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "Hi."}], "max_tokens": 4},
            headers={"X-Session-ID": "solo"},
        )
        await app.state.registry.close_all()
    await cluster.aclose()
    assert set(_timing(alone)) == {"turn", "proxy"}


async def test_an_idle_persist_longer_than_the_claim_s_lease_keeps_its_claim(clock, redis_url):
    """Before: the idle persist held its claim without renewing it, so a tier write longer than
    the lease lost it: the commit after it was refused, and the store still listed the session
    as pinned, with the handle that decode had just freed."""
    fake = FakeCluster(pairs=1, clock=ManualClock(), tier=True)
    store = RedisSessions.from_url(redis_url, lease_s=0.3)
    a = Replica(
        fake,
        clock,
        redis_url,
        store=store,
        transport=SlowPersists(fake.transport, 1.0),
        offload_idle_s=60.0,
    )
    b = Replica(fake, clock, redis_url)
    messages = [{"role": "system", "content": SYSTEM}]
    await _ask(a, "long-write", messages, QUESTIONS[0])
    registry = a.app.state.registry
    await registry.written()
    now = time.time()
    registry._wall = lambda: now + 120.0
    assert await registry.offload_idle() == 1
    refused = a.app.state.metrics.value(
        "agentkv_proxy_store_commit_failures_total", reason="refused"
    )
    assert refused == 0
    assert await store.pinned_idle(before=now + 1000.0, limit=10) == []
    await _ask(b, "long-write", messages, QUESTIONS[1])
    turns = await b.turns("long-write")
    assert [t["handle_state"] for t in turns] == ["none", "tier"]
    assert fake.wrong_reuse_events == 0
    await a.aclose()
    await b.aclose()


async def test_an_idle_shared_session_is_offloaded_once_by_one_replica_and_resumes_anywhere(
    clock, redis_url
):
    """With ``--state``, the store lists sessions whose KV is pinned; once idle past
    ``offload_idle_s`` one replica (whichever gets the claim) offloads it to decode's tier, and
    the next turn, on the other replica, loads it from there. Persisting is no use: the session
    still expires on time."""
    fake = FakeCluster(pairs=1, clock=ManualClock(), tier=True)
    a = Replica(fake, clock, redis_url, offload_idle_s=60.0)
    b = Replica(fake, clock, redis_url, offload_idle_s=60.0)
    messages = [{"role": "system", "content": SYSTEM}]
    await _ask(a, "nap", messages, QUESTIONS[0])
    await a.app.state.registry.written()
    assert fake.decode(0).pinned_handles == 1
    now = time.time()
    for replica in (a, b):
        replica.app.state.registry._wall = lambda: now + 30.0  # not idle long enough yet
    assert [await r.app.state.registry.offload_idle() for r in (a, b)] == [0, 0]
    for replica in (a, b):
        replica.app.state.registry._wall = lambda: now + 120.0
    done = await asyncio.gather(*(r.app.state.registry.offload_idle() for r in (a, b)))
    assert sorted(done) == [0, 1]
    assert fake.decode(0).pinned_handles == 0
    assert len(fake.tier.ids) == 1
    assert [await r.app.state.registry.offload_idle() for r in (a, b)] == [0, 0]  # once
    # Still idle since the answer, not since the persist.
    assert await a.store.idle(before=now + 1.0, limit=10)
    await _ask(b, "nap", messages, QUESTIONS[1])
    turns = await b.turns("nap")
    assert [t["handle_state"] for t in turns] == ["none", "tier"]
    assert turns[1]["reused_tokens"] == turns[1]["ideal_reused_tokens"]
    assert fake.wrong_reuse_events == 0
    await a.aclose()
    await b.aclose()


async def test_an_entry_reads_both_its_binary_form_and_the_json_an_older_replica_wrote(fake, clock):
    """Replicas of two versions may share a store while they are upgraded."""
    from agentkv._wire.json import dumps
    from agentkv.proxy._entry import SessionEntry

    cluster = AsyncCluster.from_dict(fake.cluster_spec, transport=fake.transport, clock=clock)
    session = cluster.session(session_id="p:s", max_tokens=24)
    session.append(Message.system(SYSTEM))
    await session.send(QUESTIONS[0])
    entry = SessionEntry(("p", "s"), session, now=0.0)
    entry.forks = 1
    shown = Message.assistant("shown")
    session.mark_generated(views={2: shown})
    legacy_snapshot = session.snapshot()
    # An older agentkv's snapshot knew nothing generated: its entry kept that beside it.
    del legacy_snapshot["transcript"]["generated"], legacy_snapshot["transcript"]["views"]
    legacy = dumps(
        {
            "session": legacy_snapshot,
            "generated": [2],
            "views": {"2": shown.to_openai()},
            "tools_key": "tools",
            "forks": 1,
            "created_at": entry.created_at,
        }
    )
    for stored in (entry.to_bytes(wall=time.time()), legacy):
        copy = SessionEntry(("p", "s"), cluster.session(), now=0.0)
        copy.load_bytes(stored, cluster, confirmed=True)
        assert copy.session.transcript == session.transcript
        assert copy.session.transcript.generated == {2}
        assert copy.session.transcript.views == {2: shown}
        assert copy.session.handle is not None
        assert copy.session.handle.request_id == session.handle.request_id
        assert copy.forks == 1
        copy.session.detach()
    await session.aclose()
    await cluster.aclose()


async def test_a_write_behind_cancelled_while_stopping_its_renewer_commits_nothing(
    fake, clock, redis_url
):
    """Cancelling the write behind an answer (a shutdown) while it waits for its claim's
    renewer to stop ends it there: the cancellation is not swallowed into a commit."""
    store = HeldCommits(RedisSessions.from_url(redis_url, lease_s=5.0))
    store.go.set()
    a = Replica(fake, clock, redis_url, store=store)
    registry = a.app.state.registry

    async def slow_to_stop(entry, claim):
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            await asyncio.sleep(0.05)
            raise

    registry._renew = slow_to_stop
    await _ask(a, "cut", [{"role": "system", "content": SYSTEM}], QUESTIONS[0])
    (write,) = registry._writes
    await asyncio.sleep(0.01)  # the write now waits for the renewer to stop
    write.cancel()
    await asyncio.wait([write])
    assert write.cancelled()
    assert store.held == 0  # no commit was attempted
    await a.aclose(release=False)


class RecordedCommits:
    """A replica's store noting each commit's ``tail`` and ``kept`` (how much of the stored
    token ids it said it extends)."""

    def __init__(self, inner):
        self._inner = inner
        self.lease_s = inner.lease_s
        self.commits = []

    def __getattr__(self, name):
        return getattr(self._inner, name)

    async def commit(self, claim, data, *, used_at, pinned=False, tail=0, kept=0):
        version = await self._inner.commit(
            claim, data, used_at=used_at, pinned=pinned, tail=tail, kept=kept
        )
        self.commits.append((tail, kept))
        return version


async def test_replicas_commit_each_turn_by_appending_its_token_ids_to_the_stored_ones(
    fake, clock, redis_url
):
    """After the first turn every commit extends the stored ids, whether the replica served the
    turn before (its own copy) or took the snapshot the other one committed (its claim's), and
    Redis holds exactly the session's ids: the turns keep their ideal reuse."""
    stores = [RecordedCommits(RedisSessions.from_url(redis_url, lease_s=5.0)) for _ in range(2)]
    a, b = (Replica(fake, clock, redis_url, store=store) for store in stores)
    messages = [{"role": "system", "content": SYSTEM}]
    for replica in (a, a, b, b, a):
        await _ask(replica, "appends", messages, QUESTIONS[len(messages) // 2])
    await a.app.state.registry.written()
    await b.app.state.registry.written()
    commits = stores[0].commits[:2] + stores[1].commits + stores[0].commits[2:]
    assert commits[0][1] == 0  # nothing stored before the first turn
    for (tail, _), (next_tail, kept) in itertools.pairwise(commits):
        assert 0 < kept == tail < next_tail  # each turn appends to what the one before stored
    raw = Redis.from_url(redis_url)
    try:
        (key,) = await raw.keys("agentkv:t:*")
        assert await raw.strlen(key) == commits[-1][0]
    finally:
        await raw.aclose()
    _assert_ideal(await b.turns("appends"))
    await a.aclose()
    await b.aclose()
