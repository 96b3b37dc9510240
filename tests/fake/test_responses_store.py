"""Stored responses (``previous_response_id``) are references into their sessions: memory O(turns),
gone with their session or a fork that left their history, bounded in bytes, scoped by API key,
and, with ``--state``, continued by any replica (or a restarted one) through Redis."""

from __future__ import annotations

import pickle
import tracemalloc

import httpx2
import openai
import pytest
from openai import AsyncOpenAI
from redis.asyncio import Redis

from agentkv import AsyncCluster
from agentkv.proxy import ProxyConfig, create_app
from agentkv.proxy._redis_store import RedisSessions
from agentkv.proxy._responses_store import ENTRY_BYTES, ResponseIds, ResponseStore, StoredResponse

INSTRUCTIONS = "You answer briefly. " + " ".join(
    f"Rule {i}: be kind to robot {i}." for i in range(30)
)
# Long inputs: a store that copied histories would hold kilobytes more with every turn.
NOTE = " ".join(f"Robot {i} says hello in a long sentence of its own." for i in range(5))


pytestmark = pytest.mark.fake(pairs=1, kv_recompute_threshold=0, tool_call_parser=None)


class Proxy:
    """One proxy app (a replica, with ``redis_url``) and OpenAI clients onto it."""

    def __init__(self, fake, clock, *, redis_url=None, **config):
        self.cluster = AsyncCluster.from_dict(
            fake.cluster_spec, transport=fake.transport, clock=clock
        )
        self.store = None if redis_url is None else RedisSessions.from_url(redis_url, lease_s=5.0)
        self.app = create_app(self.cluster, ProxyConfig(**config), clock=clock, store=self.store)
        self.http = httpx2.AsyncClient(
            transport=httpx2.ASGITransport(app=self.app), base_url="http://proxy"
        )

    def client(self, key="sk-test"):
        return AsyncOpenAI(
            base_url="http://proxy/v1", api_key=key, http_client=self.http, max_retries=0
        )

    @property
    def registry(self):
        return self.app.state.registry

    async def aclose(self):
        await self.registry.close_all()
        await self.http.aclose()
        if self.store is not None:
            await self.store.aclose()
        await self.cluster.aclose()


@pytest.fixture
async def proxy(fake, clock):
    made = Proxy(fake, clock)
    yield made
    await made.aclose()


async def _ask(client, text, previous=None, **body):
    raw = await client.responses.with_raw_response.create(
        model="fake-smollm2",
        instructions=INSTRUCTIONS,
        input=text,
        previous_response_id=previous.id if previous is not None else openai.NOT_GIVEN,
        max_output_tokens=24,
        **body,
    )
    return raw, raw.parse()


def _ideal(previous):
    return previous.usage.input_tokens + previous.usage.output_tokens - 1


async def _expect(code, status, client, previous):
    with pytest.raises(openai.APIStatusError) as refused:
        await _ask(client, "More?", previous)
    assert (refused.value.status_code, refused.value.code) == (status, code)


class Unknown:
    def __init__(self, response_id):
        self.id = response_id


def _held(proxy):
    """What the stored responses hold, measured as their pickled size (a copied history shows)."""
    return sum(len(pickle.dumps(entry)) for entry in proxy.app.state.responses.store.values())


async def test_a_chain_of_n_turns_stores_o_n_bytes_not_a_history_per_turn(proxy, fake):
    client = proxy.client()
    previous = None
    held = {}
    for turn in range(1, 17):
        raw, response = await _ask(client, f"Turn {turn}. {NOTE}", previous)
        assert "x-agentkv-forked" not in raw.headers
        if previous is not None:
            assert response.usage.input_tokens_details.cached_tokens == _ideal(previous)
        previous = response
        held[turn] = _held(proxy)
    # Linear: twice the turns, twice the bytes, and a few hundred bytes a response.
    assert held[16] <= 2.1 * held[8]
    assert held[16] / 16 < 600
    assert proxy.app.state.responses.store.nbytes < 16 * 700
    assert fake.wrong_reuse_events == 0


async def test_the_store_counts_what_its_records_really_hold():
    """``nbytes`` (what the byte bound compares) is what the records take, measured."""
    store = ResponseStore(max_bytes=1 << 30)
    ids = ResponseIds("secret")
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(5000):
            session_id = f"resp-{i // 10:032x}"
            record = StoredResponse(
                principal="alice",
                session_id=session_id,
                count=2 * i + 2,
                instructions=True,
                described=0,
                tail=bytes(8),
            )
            await store.put(ids.mint("alice", session_id), record)
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert 0.75 * held <= store.nbytes <= 1.25 * held, (held, store.nbytes)


async def test_the_byte_bound_drops_the_oldest_responses_first(fake, clock):
    # A record: its bookkeeping, its id, the principal (a key's digest) and the session id.
    size = ENTRY_BYTES + len("resp_") + 48 + len("key-") + 16 + len("resp-") + 32
    proxy = Proxy(fake, clock, responses_max_bytes=3 * size + size // 2)
    try:
        client = proxy.client()
        made = []
        previous = None
        for turn in range(5):
            _, previous = await _ask(client, f"Turn {turn}", previous)
            made.append(previous)
        assert len(proxy.app.state.responses.store) == 3
        for gone in made[:2]:
            await _expect("previous_response_expired", 400, client, gone)
        raw, _ = await _ask(client, "Go on", made[-1])
        assert "x-agentkv-forked" not in raw.headers
        await _expect("previous_response_expired", 400, client, made[2])  # the next oldest
        assert len(proxy.app.state.responses.store) == 3
    finally:
        await proxy.aclose()


async def test_a_deleted_idle_or_evicted_session_drops_its_responses(fake, clock):
    proxy = Proxy(fake, clock, max_sessions=2, session_idle_timeout_s=60.0)
    try:
        client = proxy.client()
        store = proxy.app.state.responses.store
        raw, first = await _ask(client, "Hello?")
        _, second = await _ask(client, "And then?", first)
        session = raw.headers["x-agentkv-session-id"]
        _, other = await _ask(client, "Another conversation")
        assert len(store) == 3
        await proxy.http.delete(
            f"/v1/sessions/{session}", headers={"Authorization": "Bearer sk-test"}
        )
        assert len(store) == 1
        for gone in (first, second):
            await _expect("previous_response_expired", 400, client, gone)
        clock.advance(61.0)
        assert await proxy.registry.sweep() == 1
        assert len(store) == 0
        await _expect("previous_response_expired", 400, client, other)
        # Eviction: a third session pushes the one idle longest out, and its responses.
        _, kept = await _ask(client, "One")
        _, evicted_later = await _ask(client, "Two")
        _, _ = await _ask(client, "Three")
        assert len(store) == 2
        await _expect("previous_response_expired", 400, client, kept)
        _, going_on = await _ask(client, "Two more", evicted_later)
        assert going_on.output_text
        assert store.nbytes == sum(
            ENTRY_BYTES + len(i) + len(e.principal) + len(e.session_id)
            for i, e in store._entries.items()
        )
    finally:
        await proxy.aclose()


async def test_another_api_key_gets_404_and_the_owner_keeps_its_response(proxy):
    mine, theirs = proxy.client("sk-alice"), proxy.client("sk-mallory")
    _, first = await _ask(mine, "Hello?")
    await _expect("previous_response_not_found", 404, theirs, first)
    await _expect("previous_response_not_found", 404, mine, Unknown("resp_" + "0" * 48))
    raw, second = await _ask(mine, "And then?", first)
    assert "x-agentkv-forked" not in raw.headers
    assert second.usage.input_tokens_details.cached_tokens == _ideal(first)


async def test_a_branch_the_session_left_is_expired_never_another_history(proxy):
    client = proxy.client()
    _, first = await _ask(client, "Hello?")
    _, left = await _ask(client, "Tell me about robot 4.", first)
    raw, taken = await _ask(client, "Tell me about robot 9 instead.", first)
    assert raw.headers["x-agentkv-forked"] == "1"  # OpenAI's branching: the session forks
    await _expect("previous_response_expired", 400, client, left)
    raw, _ = await _ask(client, "Go on.", taken)
    assert "x-agentkv-forked" not in raw.headers
    _, again = await _ask(client, "Back to the start.", first)  # its history is still held
    assert again.output_text


async def test_a_fork_the_store_did_not_hear_of_is_caught_by_the_history_tail(proxy):
    """As when a replica lost its claim after storing a response: no hook drops the record."""
    client = proxy.client()
    _, first = await _ask(client, "Hello?")
    _, left = await _ask(client, "Tell me about robot 4.", first)
    proxy.registry.on_fork.clear()
    _, taken = await _ask(client, "Tell me about robot 9 instead.", first)
    assert len(proxy.app.state.responses.store) == 3  # nothing dropped the left branch's record
    await _expect("previous_response_expired", 400, client, left)
    raw, _ = await _ask(client, "Go on.", taken)
    assert "x-agentkv-forked" not in raw.headers


# --- with --state: Redis, two replicas ---------------------------------------------------------


@pytest.fixture
async def replicas(fake, clock, redis_url):
    made = [Proxy(fake, clock, redis_url=redis_url), Proxy(fake, clock, redis_url=redis_url)]
    yield made
    for replica in made:
        await replica.aclose()


async def _response_keys(redis_url):
    redis = Redis.from_url(redis_url)
    try:
        return sorted(await redis.keys("agentkv:r:*"))
    finally:
        await redis.aclose()


async def test_a_second_replica_continues_a_chain_made_on_the_first(replicas, fake):
    previous = None
    for turn in range(6):
        raw, response = await _ask(replicas[turn % 2].client(), f"Turn {turn}", previous)
        assert "x-agentkv-forked" not in raw.headers
        if previous is not None:
            assert raw.headers["x-agentkv-handle"] == "attached"
            assert response.usage.input_tokens_details.cached_tokens == _ideal(previous)
        previous = response
    assert fake.wrong_reuse_events == 0


async def test_a_restarted_replica_continues_a_response_made_before(fake, clock, redis_url):
    before = Proxy(fake, clock, redis_url=redis_url)
    _, first = await _ask(before.client(), "Hello?")
    await before.aclose()  # stopped: its memory is gone, the session lives on in Redis
    after = Proxy(fake, clock, redis_url=redis_url)
    try:
        raw, second = await _ask(after.client(), "And then?", first)
        assert "x-agentkv-forked" not in raw.headers
        assert second.usage.input_tokens_details.cached_tokens == _ideal(first)
    finally:
        await after.aclose()


async def test_another_api_key_gets_404_on_any_replica(replicas):
    _, first = await _ask(replicas[0].client("sk-alice"), "Hello?")
    await _expect("previous_response_not_found", 404, replicas[1].client("sk-mallory"), first)
    _, second = await _ask(replicas[1].client("sk-alice"), "And then?", first)
    assert second.usage.input_tokens_details.cached_tokens == _ideal(first)


async def test_a_removed_shared_session_takes_its_responses_with_it(replicas, redis_url):
    client = replicas[0].client()
    raw, first = await _ask(client, "Hello?")
    _, left = await _ask(replicas[1].client(), "Robot 4?", first)
    _, taken = await _ask(client, "Robot 9 instead?", first)  # a fork on the other replica
    await _expect("previous_response_expired", 400, replicas[1].client(), left)
    assert len(await _response_keys(redis_url)) == 1
    session = raw.headers["x-agentkv-session-id"]
    deleted = await replicas[1].http.delete(
        f"/v1/sessions/{session}", headers={"Authorization": "Bearer sk-test"}
    )
    assert deleted.status_code == 200
    assert await _response_keys(redis_url) == []
    await _expect("previous_response_expired", 400, client, taken)
    # Idle expiry, swept by either replica, takes them too.
    _, other = await _ask(client, "Another conversation")
    await replicas[0].registry.written()
    for replica in replicas:
        replica.registry._wall = lambda: 10.0**12  # far past the idle timeout
    assert sum([await replica.registry.sweep() for replica in replicas]) == 1
    assert await _response_keys(redis_url) == []
    await _expect("previous_response_expired", 400, replicas[1].client(), other)


WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}


@pytest.mark.parametrize(
    "first_input",
    [
        "Weather in Paris?",  # no system message: the tools description is one of its own
        [
            {"role": "developer", "content": "Use the tools."},  # described after the client's
            {"role": "user", "content": "Weather in Paris?"},
        ],
    ],
    ids=["description-added", "description-appended"],
)
async def test_a_json_tool_loop_without_instructions_is_rebuilt_as_the_client_sent_it(
    proxy, fake, first_input
):
    """The session holds the tools description and tool-result notes; the rebuilt history
    does not (the request adds them again), so the continuation extends the session."""
    client = proxy.client()
    first = await client.responses.create(
        model="fake-smollm2",
        input=first_input,
        tools=[WEATHER],
        tool_choice="required",
        max_output_tokens=64,
    )
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls
    previous = first
    for turn in range(2):
        raw = await client.responses.with_raw_response.create(
            model="fake-smollm2",
            previous_response_id=previous.id,
            input=[
                {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny"}
                for call in calls
            ]
            if turn == 0
            else "And tomorrow?",
            tools=[WEATHER],
            max_output_tokens=32,
        )
        assert raw.headers["x-agentkv-tool-calling"] == "json"
        assert "x-agentkv-forked" not in raw.headers
        response = raw.parse()
        assert response.usage.input_tokens_details.cached_tokens == _ideal(previous)
        previous = response
    assert fake.wrong_reuse_events == 0
