"""The proxy's sessions: key scoping, DELETE, idle expiry, a bounded registry, abandoned streams."""

from __future__ import annotations

import asyncio

import httpx2
import pytest

from agentkv import AsyncCluster
from agentkv.proxy import ApiKeys, ProxyConfig, create_app
from agentkv.proxy._errors import ProxyError
from agentkv.proxy._metrics import ProxyMetrics
from agentkv.proxy._registry import SessionRegistry
from agentkv.testing import FakeCluster, ManualClock

KEYS = ApiKeys.parse("alice sk-alice\nbob sk-bob\n")


# A clock of its own: advancing the proxy's idle clock (``clock``) must not expire handles.
pytestmark = pytest.mark.fake(own_clock=True)


def _prefill(acluster, fake, headers):
    """The fake prefill server of the pair that answered (named by ``x-agentkv-pair``)."""
    pair = next(p for p in acluster.pairs if p.name == headers["x-agentkv-pair"])
    return fake.server(pair.prefill)


def _client(app, key: str | None = None) -> httpx2.AsyncClient:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx2.AsyncClient(
        transport=httpx2.ASGITransport(app=app), base_url="http://proxy", headers=headers
    )


async def _turn(client, session_id, messages, **body):
    response = await client.post(
        "/v1/chat/completions",
        json={"messages": messages, "max_tokens": 96, **body},
        headers={"X-Session-ID": session_id},
    )
    assert response.status_code == 200, response.text
    data = response.json()
    messages.append(data["choices"][0]["message"])
    return response


async def test_requests_without_a_known_key_get_401(acluster):
    app = create_app(acluster, ProxyConfig(api_keys=KEYS))
    body = {"messages": [{"role": "user", "content": "Hi"}]}
    for key in (None, "sk-mallory"):
        async with _client(app, key) as client:
            for method, path, json in (
                ("POST", "/v1/chat/completions", body),
                ("GET", "/v1/models", None),
                ("GET", "/v1/sessions/s", None),
                ("DELETE", "/v1/sessions/s", None),
            ):
                response = await client.request(method, path, json=json)
                assert response.status_code == 401, (key, path)
                assert response.json()["error"]["type"] == "authentication_error"
                assert response.headers["www-authenticate"] == "Bearer"
    async with _client(app) as client:  # probes and scrapes need no key
        assert (await client.get("/healthz")).status_code == 200
        assert (await client.get("/metrics")).status_code == 200


async def test_the_same_session_id_under_two_keys_is_two_sessions(acluster, fake):
    """Bob's "s" never sees, extends or pulls Alice's "s" KV."""
    app = create_app(acluster, ProxyConfig(api_keys=KEYS))
    async with _client(app, "sk-alice") as alice, _client(app, "sk-bob") as bob:
        alice_history = [{"role": "user", "content": "My secret is 1234. Remember it."}]
        await _turn(alice, "s", alice_history)
        alice_history.append({"role": "user", "content": "What is my secret?"})
        bob_history = [{"role": "user", "content": "What is my secret?"}]
        response = await _turn(bob, "s", bob_history)
        assert response.headers["x-agentkv-handle"] == "none"
        assert "x-agentkv-forked" not in response.headers
        # Bob's request carried no handle at all, let alone Alice's.
        prefill = _prefill(acluster, fake, response.headers)
        assert prefill.requests[-1]["kv_transfer_params"]["remote_block_ids"] is None
        response = await _turn(alice, "s", alice_history)
        assert response.headers["x-agentkv-handle"] == "attached"
        assert "x-agentkv-forked" not in response.headers
        assert (await alice.get("/v1/sessions/s")).json()["totals"]["turns"] == 2
        assert (await bob.get("/v1/sessions/s")).json()["totals"]["turns"] == 1
        # Deleting Bob's leaves Alice's.
        assert (await bob.delete("/v1/sessions/s")).status_code == 200
        assert (await alice.get("/v1/sessions/s")).status_code == 200
    assert fake.wrong_reuse_events == 0


async def test_without_configured_keys_sessions_are_still_scoped_by_the_key_presented(acluster):
    app = create_app(acluster, ProxyConfig())
    async with _client(app, "sk-one") as one, _client(app, "sk-two") as two:
        await _turn(one, "shared", [{"role": "user", "content": "Hi"}])
        assert (await two.get("/v1/sessions/shared")).status_code == 404
        assert (await one.get("/v1/sessions/shared")).status_code == 200


async def test_get_reports_the_sessions_turns(acluster):
    app = create_app(acluster, ProxyConfig())
    async with _client(app, "k") as client:
        history = [{"role": "system", "content": "Be brief. " * 40}]
        for question in ("Hi", "And?", "Then?"):
            history.append({"role": "user", "content": question})
            await _turn(client, "g", history)
        data = (await client.get("/v1/sessions/g")).json()
    assert data["id"] == "g"
    assert data["messages"] == 7
    assert data["handle"]["num_tokens"] > 0
    assert [t["handle_state"] for t in data["turns"]] == ["none", "attached", "attached"]
    assert data["totals"]["turns"] == 3
    assert data["totals"]["reused_tokens"] == sum(t["reused_tokens"] for t in data["turns"])


async def test_delete_closes_the_session_and_frees_its_place(acluster, fake):
    app = create_app(acluster, ProxyConfig())
    async with _client(app, "k") as client:
        history = [{"role": "user", "content": "Hi"}]
        await _turn(client, "d", history)
        entry = await app.state.registry.lookup("key-" + _digest("k"), "d")
        session = entry.session
        assert sum(acluster.loads().values()) == 1
        response = await client.delete("/v1/sessions/d")
        assert response.json() == {"id": "d", "object": "agentkv.session.deleted", "deleted": True}
        assert session.closed
        assert session.handle is None
        assert sum(acluster.loads().values()) == 0
        assert (await client.get("/v1/sessions/d")).status_code == 404
        assert (await client.delete("/v1/sessions/d")).status_code == 404
        # The id can be used again: a new session, no handle.
        history.append({"role": "user", "content": "Again"})
        response = await _turn(client, "d", history)
        assert response.headers["x-agentkv-handle"] == "none"


async def test_idle_sessions_expire_and_release_their_handles(acluster, clock):
    app = create_app(acluster, ProxyConfig(session_idle_timeout_s=60), clock=clock)
    registry = app.state.registry
    async with _client(app, "k") as client:
        history = [{"role": "user", "content": "Hi"}]
        await _turn(client, "idle", history)
        await _turn(client, "busy", [{"role": "user", "content": "Hi"}])
        entry = await registry.lookup("key-" + _digest("k"), "idle")
        clock.advance(45)
        await _turn(client, "busy", [{"role": "user", "content": "Hi again"}])
        clock.advance(30)
        assert await registry.sweep() == 1  # "idle" (75 s), not "busy" (30 s)
        assert entry.session.closed
        assert entry.session.handle is None
        assert (await client.get("/v1/sessions/idle")).status_code == 404
        assert (await client.get("/v1/sessions/busy")).status_code == 200
        # Expiry also happens on access, without waiting for the sweeper.
        clock.advance(61)
        history.append({"role": "user", "content": "Still there?"})
        response = await _turn(client, "busy", history)
        assert response.headers["x-agentkv-handle"] == "none"
    assert sum(acluster.loads().values()) == 1
    assert app.state.metrics.value("agentkv_proxy_sessions_closed_total", reason="idle") == 2


async def test_a_flood_of_sessions_stays_bounded_evicting_the_oldest_idle_first(acluster, clock):
    app = create_app(acluster, ProxyConfig(max_sessions=5), clock=clock)
    async with _client(app, "k") as client:
        for i in range(40):
            clock.advance(1)
            await _turn(client, f"flood-{i}", [{"role": "user", "content": f"Hi {i}"}])
        assert len(app.state.registry) == 5
        assert (await client.get("/v1/sessions/flood-34")).status_code == 404
        assert (await client.get("/v1/sessions/flood-35")).status_code == 200
        # Using an old session makes it the newest: it survives the next eviction.
        await _turn(client, "flood-35", [{"role": "user", "content": "Hi 35"}])
        await _turn(client, "flood-new", [{"role": "user", "content": "Hi"}])
        assert (await client.get("/v1/sessions/flood-35")).status_code == 200
        assert (await client.get("/v1/sessions/flood-36")).status_code == 404
    assert sum(acluster.loads().values()) == 5
    assert app.state.metrics.value("agentkv_proxy_sessions_closed_total", reason="evicted") == 36


async def test_a_full_registry_of_busy_sessions_answers_503(acluster):
    registry = SessionRegistry(acluster, max_sessions=2, idle_timeout_s=60, metrics=ProxyMetrics())
    first = await registry.checkout("p", "a")
    await registry.checkout("p", "b")
    with pytest.raises(ProxyError) as info:
        await registry.checkout("p", "c")
    assert info.value.status == 503
    assert info.value.headers["Retry-After"] == "1"
    await registry.checkin(first)
    assert (await registry.checkout("p", "c")).session_id == "c"
    assert len(registry) == 2


async def test_concurrent_requests_on_one_session_run_one_after_the_other(acluster, fake):
    app = create_app(acluster, ProxyConfig())
    async with _client(app, "k") as client:
        base = [{"role": "user", "content": "Hi"}]
        await _turn(client, "c", base)
        bodies = [[*base, {"role": "user", "content": f"Question {i}"}] for i in range(2)]
        responses = await asyncio.gather(
            *(
                client.post(
                    "/v1/chat/completions",
                    json={"messages": b, "max_tokens": 8},
                    headers={"X-Session-ID": "c"},
                )
                for b in bodies
            )
        )
    assert [r.status_code for r in responses] == [200, 200]
    # Both extend turn 1, so the second to run diverges from the first's answer and forks.
    assert sorted(r.headers.get("x-agentkv-forked", "0") for r in responses) == ["0", "1"]
    assert fake.wrong_reuse_events == 0


async def test_a_stream_the_client_abandons_commits_nothing_and_frees_the_session(acluster):
    app = create_app(acluster, ProxyConfig())
    history = [{"role": "user", "content": "Hi"}]
    async with _client(app, "k") as client:
        await _turn(client, "abandon", history)
    history.append({"role": "user", "content": "Tell me a story"})
    body = httpx2.Request(
        "POST",
        "http://proxy/v1/chat/completions",
        json={"messages": history, "stream": True, "max_tokens": 64},
    ).content
    sent: list[dict] = []

    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message):
        sent.append(message)
        if message["type"] == "http.response.body" and len(sent) > 2:
            raise OSError("client went away")

    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.4"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/chat/completions",
        "raw_path": b"/v1/chat/completions",
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"authorization", b"Bearer k"),
            (b"x-session-id", b"abandon"),
            (b"content-type", b"application/json"),
        ],
        "client": ("127.0.0.1", 1),
        "server": ("proxy", 80),
        "state": {},
    }
    await app(scope, receive, send)  # a client leaving is not the proxy's error
    assert sent[0]["status"] == 200
    entry = await app.state.registry.lookup("key-" + _digest("k"), "abandon")
    assert entry.users == 0
    assert not entry.lock.locked()
    assert entry.session.transcript.pending == ()
    assert len(entry.session.turns) == 1
    # The client retries the same request: an extension, not a fork.
    async with _client(app, "k") as client:
        response = await client.post(
            "/v1/chat/completions",
            json={"messages": history, "max_tokens": 8},
            headers={"X-Session-ID": "abandon"},
        )
    assert response.status_code == 200
    assert "x-agentkv-forked" not in response.headers


def _digest(key: str) -> str:
    from agentkv.proxy._config import key_digest

    return key_digest(key)


@pytest.mark.parametrize("stream", [False, True])
async def test_one_shot_requests_ask_decode_to_pin_nothing(stream):
    """No session id: no next turn. The D leg says so (a final turn), so decode pins nothing and
    no release call is needed (one that a lost connection would skip)."""
    fake = FakeCluster(pairs=1, clock=ManualClock())
    async with AsyncCluster.from_dict(fake.cluster_spec, transport=fake.transport) as acluster:
        app = create_app(acluster, ProxyConfig())
        async with _client(app) as client:
            response = await client.post(
                "/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "Hi"}], "stream": stream},
            )
            assert response.status_code == 200, response.text
    assert fake.decode(0).requests[-1]["kv_transfer_params"]["agentkv"]["persist"] is False
    assert fake.decode(0).pinned_handles == 0


def _salts(server) -> list[object]:
    return [body.get("cache_salt") for body in server.requests]


async def test_each_key_gets_its_own_prefix_cache_salt_on_both_legs(acluster, fake):
    """No key's requests can hit (and so time) another key's cached prefix (issue 15.7)."""
    app = create_app(acluster, ProxyConfig(api_keys=KEYS))
    async with _client(app, "sk-alice") as alice, _client(app, "sk-bob") as bob:
        await _turn(alice, "a", [{"role": "user", "content": "Shared system prompt. Hi"}])
        await _turn(alice, "a2", [{"role": "user", "content": "Shared system prompt. Hi"}])
        await _turn(bob, "b", [{"role": "user", "content": "Shared system prompt. Hi"}])
    legs = [s for server in fake.servers for s in _salts(server)]
    assert len(legs) == 6
    assert all(isinstance(salt, str) and salt for salt in legs)
    assert len(set(legs)) == 2  # one salt per key, the same on every leg of that key


async def test_the_prefix_cache_can_be_shared_across_keys_when_asked(acluster, fake):
    app = create_app(acluster, ProxyConfig(api_keys=KEYS, isolate_prefix_caches=False))
    async with _client(app, "sk-alice") as alice:
        await _turn(alice, "a", [{"role": "user", "content": "Hi"}])
    assert [s for server in fake.servers for s in _salts(server)] == [None, None]


async def test_metrics_can_be_put_behind_the_api_keys(acluster):
    app = create_app(acluster, ProxyConfig(api_keys=KEYS, metrics_need_key=True))
    async with _client(app) as anonymous, _client(app, "sk-alice") as alice:
        assert (await anonymous.get("/metrics")).status_code == 401
        assert (await alice.get("/metrics")).status_code == 200
        assert (await anonymous.get("/healthz")).status_code == 200


def test_metrics_behind_keys_needs_keys():
    from agentkv import ConfigError

    with pytest.raises(ConfigError, match="api_keys"):
        ProxyConfig(metrics_need_key=True)
