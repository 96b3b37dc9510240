"""Several threads under one session id, the agents' own headers, prefix breaks counted.

Claude Code's subagents send their parent's session id with an agent id of their own, concurrently
with the parent; OpenCode's title request (another system prompt) the main thread's id. Each is a
thread of its own: none replaces, extends or forks another's transcript, none waits behind
another, and all are placed on their session's pair.
"""

from __future__ import annotations

import asyncio

import httpx2
import pytest

from agentkv import AsyncCluster
from agentkv.proxy import ProxyConfig, create_app
from agentkv.proxy._redis_store import RedisSessions
from agentkv.testing import ManualClock

SYSTEM = "You are a coding agent. " + " ".join(f"Rule {i}: keep diffs small." for i in range(20))
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a command",
            "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}},
        },
    }
]


pytestmark = pytest.mark.fake(pairs=4)


class SlowTransport(httpx2.AsyncBaseTransport):
    """The fake's transport with a pause before each request: turns that overlap for real."""

    def __init__(self, inner: httpx2.AsyncBaseTransport, delay_s: float) -> None:
        self._inner = inner
        self._delay_s = delay_s

    async def handle_async_request(self, request):
        await asyncio.sleep(self._delay_s)
        return await self._inner.handle_async_request(request)


@pytest.fixture
def transport(fake):
    """Every request 50 ms late: threads that waited behind one another would add up."""
    return SlowTransport(fake.transport, 0.05)


def _client(app) -> httpx2.AsyncClient:
    return httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://proxy")


async def _turn(client, headers, messages, **body):
    response = await client.post(
        "/v1/chat/completions",
        json={"messages": messages, "max_tokens": 32, **body},
        headers=headers,
    )
    assert response.status_code == 200, response.text
    messages.append(response.json()["choices"][0]["message"])
    return response


def _conversation(task: str, system: str = SYSTEM) -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": task}]


CC = {"X-Claude-Code-Session-Id": "cc-1"}


def _agent(agent_id: str, parent: str | None = None) -> dict[str, str]:
    headers = {**CC, "x-claude-code-agent-id": agent_id}
    if parent is not None:
        headers["x-claude-code-parent-agent-id"] = parent
    return headers


async def test_a_parent_and_its_subagents_run_concurrently_each_on_its_own_thread(acluster, fake):
    """Same session id, other agent ids, in flight together: all succeed, none forks another,
    each reuses its own history on its next turn, all on the session's pair."""
    app = create_app(acluster, ProxyConfig())
    main = _conversation("Refactor the parser.")
    subs = {"a1": _conversation("Find the parser's tests."), "a2": _conversation("Read lexer.py")}
    async with _client(app) as client:
        first = await _turn(client, CC, main, tools=TOOLS)
        assert first.headers["x-agentkv-thread"] == "main"
        main.append({"role": "user", "content": "Go on."})
        replies = await asyncio.gather(
            _turn(client, CC, main, tools=TOOLS),
            *(_turn(client, _agent(a), m, tools=TOOLS) for a, m in subs.items()),
        )
        assert [r.headers["x-agentkv-thread"] for r in replies] == ["main", "agent:a1", "agent:a2"]
        assert [r.headers["x-agentkv-session-id"] for r in replies] == [
            "cc-1",
            "cc-1~agent:a1",
            "cc-1~agent:a2",
        ]
        assert replies[0].headers["x-agentkv-handle"] == "attached"
        for messages in (main, *subs.values()):
            messages.append({"role": "user", "content": "Next."})
        second = await asyncio.gather(
            _turn(client, CC, main, tools=TOOLS),
            _turn(client, _agent("a1"), subs["a1"], tools=TOOLS),
            _turn(client, _agent("a2", parent="a1"), subs["a2"], tools=TOOLS),
        )
        for response in (*replies, *second):
            assert "x-agentkv-forked" not in response.headers
        assert {r.headers["x-agentkv-handle"] for r in second} == {"attached"}
        assert len({r.headers["x-agentkv-pair"] for r in (first, *replies, *second)}) == 1
        session = (await client.get("/v1/sessions/cc-1")).json()
        sub = (await client.get("/v1/sessions/cc-1~agent:a1")).json()
    assert (session["thread"], session["messages"], session["forks"]) == ("main", 7, 0)
    assert (sub["session"], sub["thread"], sub["messages"], sub["forks"]) == (
        "cc-1",
        "agent:a1",
        5,
        0,
    )
    assert app.state.metrics.value("agentkv_prefix_breaks_total", reason="system_changed") == 0
    assert fake.wrong_reuse_events == 0


async def test_threads_do_not_wait_behind_each_other(acluster):
    """A subagent's turn runs while its parent's does: together they take about one turn."""
    app = create_app(acluster, ProxyConfig())
    async with _client(app) as client:
        solo = asyncio.get_running_loop().time()
        await _turn(client, CC, _conversation("warm up"))
        one_turn = asyncio.get_running_loop().time() - solo
        started = asyncio.get_running_loop().time()
        await asyncio.gather(
            _turn(client, _agent("b1"), _conversation("one")),
            _turn(client, _agent("b2"), _conversation("two")),
            _turn(client, _agent("b3"), _conversation("three")),
        )
        together = asyncio.get_running_loop().time() - started
    assert together < 2.5 * one_turn


async def test_a_title_request_under_the_main_threads_id_is_a_side_thread(acluster, fake):
    """OpenCode's title request (another system prompt, same x-session-id) neither forks the
    main thread nor waits for it; the main thread's next turn reuses its own KV."""
    app = create_app(acluster, ProxyConfig())
    headers = {"x-session-id": "oc-1", "x-session-affinity": "oc-1"}
    main = _conversation("Add a --verbose flag.")
    title = _conversation("Add a --verbose flag.", system="Generate a short title.")
    async with _client(app) as client:
        opened = await asyncio.gather(_turn(client, headers, main), _turn(client, headers, title))
        assert opened[0].headers["x-agentkv-thread"] == "main"
        side = opened[1].headers["x-agentkv-thread"]
        assert side.startswith("start:")
        assert opened[1].headers["x-agentkv-session-id"] == f"oc-1~{side}"
        main.append({"role": "user", "content": "Also -q."})
        title.append({"role": "user", "content": "Shorter."})
        later = await asyncio.gather(_turn(client, headers, main), _turn(client, headers, title))
        assert [r.headers["x-agentkv-thread"] for r in later] == ["main", side]
        for response in later:
            assert response.headers["x-agentkv-handle"] == "attached"
            assert "x-agentkv-forked" not in response.headers
        assert len({r.headers["x-agentkv-pair"] for r in (*opened, *later)}) == 1
        session = (await client.get("/v1/sessions/oc-1")).json()
    assert (session["messages"], session["forks"]) == (5, 0)
    assert app.state.metrics.value("agentkv_proxy_forks_total") == 0
    assert fake.wrong_reuse_events == 0


async def _break(client, headers, messages):
    before = list(messages)
    await _turn(client, headers, messages)
    return before


async def test_prefix_breaks_are_counted_by_reason_with_the_tokens_lost(acluster):
    app = create_app(acluster, ProxyConfig())
    metrics = app.state.metrics

    def breaks(reason):
        return metrics.value("agentkv_prefix_breaks_total", reason=reason)

    def lost(reason):
        return metrics.value("agentkv_prefix_break_lost_tokens_total", reason=reason)

    headers = {"X-Session-ID": "pb"}
    async with _client(app) as client:
        messages = _conversation("Hello?")
        await _turn(client, headers, messages)
        messages.append({"role": "user", "content": "More?"})
        await _turn(client, headers, messages)
        assert sum(breaks(r) for r in ("system_changed", "messages_changed")) == 0
        # An earlier message edited.
        edited = [*messages[:1], {"role": "user", "content": "Hi?"}, *messages[2:]]
        edited.append({"role": "user", "content": "And?"})
        response = await _turn(client, headers, edited)
        assert response.headers["x-agentkv-forked"] == "1"
        assert breaks("messages_changed") == 1
        assert lost("messages_changed") > 0
        # The system prompt changed in a history of turns: the session's own thread forks.
        changed = [{"role": "system", "content": "Be terse."}, *edited[1:]]
        changed.append({"role": "user", "content": "Ok?"})
        response = await _turn(client, headers, changed)
        assert response.headers["x-agentkv-thread"] == "main"
        assert breaks("system_changed") == 1
        assert lost("system_changed") > 0
        # Other tools.
        changed.append({"role": "user", "content": "Tools now."})
        await _turn(client, headers, changed, tools=TOOLS)
        assert breaks("tools_changed") == 1
    body, _ = metrics.render()
    assert b'agentkv_prefix_breaks_total{reason="tools_changed"} 1.0' in body


async def test_threads_in_a_shared_store_continue_on_another_replica(fake, redis_url):
    """A thread is a session entry like any other: stored under its own key, claimed on its own,
    continued by another replica with its KV."""
    clock = ManualClock()
    replicas = []
    for _ in range(2):
        acluster = AsyncCluster.from_dict(fake.cluster_spec, transport=fake.transport, clock=clock)
        store = RedisSessions.from_url(redis_url, lease_s=5.0)
        app = create_app(acluster, ProxyConfig(), clock=clock, store=store)
        replicas.append((acluster, store, app, _client(app)))
    a, b = (r[3] for r in replicas)
    try:
        main = _conversation("Plan the change.")
        sub = _conversation("Search for callers.")
        await asyncio.gather(_turn(a, CC, main), _turn(b, _agent("x1"), sub))
        main.append({"role": "user", "content": "Next?"})
        sub.append({"role": "user", "content": "Next?"})
        crossed = await asyncio.gather(_turn(b, CC, main), _turn(a, _agent("x1"), sub))
        for response in crossed:
            assert response.headers["x-agentkv-handle"] == "attached"
            assert "x-agentkv-forked" not in response.headers
        assert [r.headers["x-agentkv-session-id"] for r in crossed] == ["cc-1", "cc-1~agent:x1"]
        assert crossed[0].headers["x-agentkv-pair"] == crossed[1].headers["x-agentkv-pair"]
        stored = (await a.get("/v1/sessions/cc-1~agent:x1")).json()
        assert (stored["thread"], stored["messages"]) == ("agent:x1", 5)
    finally:
        for acluster, store, app, client in replicas:
            await app.state.registry.close_all()
            await client.aclose()
            await store.aclose()
            await acluster.aclose()
    assert fake.wrong_reuse_events == 0


CODEX = {"session-id": "cx-1", "thread-id": "cx-1"}
SPAWNED = {
    "session-id": "cx-1",
    "thread-id": "t-2",
    "x-codex-parent-thread-id": "cx-1",
    "x-openai-subagent": "collab_spawn",
}


@pytest.mark.fake(pairs=1, tier=True)
async def test_a_codex_spawned_thread_with_its_parents_history_loads_a_copy_of_its_kv(
    acluster, fake
):
    """Codex's spawn_agent gives the new thread its parent's history: its first request starts
    as the parent thread's fork, loading a copy of the parent's pin from decode's tier; the
    parent keeps its pin. A subagent that starts a conversation of its own stays fresh."""
    app = create_app(acluster, ProxyConfig())
    main = _conversation("Refactor the parser.")
    async with _client(app) as client:
        await _turn(client, CODEX, main, tools=TOOLS)
        fake.prefill(0).restart()  # prefill's cache cold: reuse only from decode or the tier
        spawned = [*main, {"role": "user", "content": "You are a worker: write the tests."}]
        child = await _turn(client, SPAWNED, spawned, tools=TOOLS)
        assert child.headers["x-agentkv-thread"] == "agent:t-2"
        assert child.headers["x-agentkv-handle"] == "tier"
        main.append({"role": "user", "content": "Go on."})
        assert (await _turn(client, CODEX, main, tools=TOOLS)).headers["x-agentkv-handle"] == (
            "attached"
        )
        spawned.append({"role": "user", "content": "Next."})
        again = await _turn(client, SPAWNED, spawned, tools=TOOLS)
        assert again.headers["x-agentkv-handle"] == "attached"
        fresh = await _turn(
            client, {**SPAWNED, "thread-id": "t-3"}, _conversation("Explore the repo.")
        )
        assert fresh.headers["x-agentkv-handle"] == "none"
        sub = (await client.get("/v1/sessions/cx-1~agent:t-2")).json()
    assert (sub["thread"], sub["messages"], sub["forks"]) == ("agent:t-2", 7, 0)
    assert fake.wrong_reuse_events == 0


@pytest.mark.fake(pairs=1, tier=True)
async def test_another_key_naming_a_parent_thread_gets_no_fork_of_it(acluster, fake):
    """Spawn headers that name another key's session find nothing: the parent is looked up under
    the requester's own key, so its history and KV stay its owner's; the thread opens fresh."""
    app = create_app(acluster, ProxyConfig())
    owner = {**CODEX, "Authorization": "Bearer owner-key"}
    hostile = {**SPAWNED, "Authorization": "Bearer hostile-key"}
    main = _conversation("Refactor the parser.")
    async with _client(app) as client:
        await _turn(client, owner, main, tools=TOOLS)
        spawned = [*main, {"role": "user", "content": "You are a worker: write the tests."}]
        stolen = await _turn(client, hostile, spawned, tools=TOOLS)
        assert stolen.headers["x-agentkv-handle"] == "none"
        main.append({"role": "user", "content": "Go on."})
        again = await _turn(client, owner, main, tools=TOOLS)
        assert again.headers["x-agentkv-handle"] == "attached"
    assert fake.tier.ids == []  # no copy of the owner's pin was written for anyone
    assert fake.wrong_reuse_events == 0
