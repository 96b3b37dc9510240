"""The proxy and decode's file tier: ``X-AgentKV-Persist`` and the idle sweep's persist."""

from __future__ import annotations

import httpx2
import pytest

from agentkv import AsyncCluster, HandleState
from agentkv.proxy import ProxyConfig, create_app
from agentkv.proxy._config import key_digest
from agentkv.testing import FakeCluster, ManualClock

LONG = {"max_tokens": 96, "min_tokens": 70}


@pytest.fixture
def fake():
    # A clock of its own: advancing the proxy's idle clock (``clock``) must not expire handles.
    return FakeCluster(pairs=1, clock=ManualClock(), tier=True)


@pytest.fixture
async def cluster(fake):
    async with AsyncCluster.from_dict(fake.cluster_spec, transport=fake.transport) as cluster:
        yield cluster


def _client(app) -> httpx2.AsyncClient:
    return httpx2.AsyncClient(
        transport=httpx2.ASGITransport(app=app),
        base_url="http://proxy",
        headers={"Authorization": "Bearer k"},
    )


async def _turn(client, session_id, messages, *, persist=None, stream=False):
    headers = {"X-Session-ID": session_id}
    if persist is not None:
        headers["X-AgentKV-Persist"] = persist
    response = await client.post(
        "/v1/chat/completions",
        json={"messages": messages, "stream": stream, **LONG},
        headers=headers,
    )
    assert response.status_code == 200, response.text
    if not stream:
        messages.append(response.json()["choices"][0]["message"])
    return response


async def _entry(app, session_id):
    return await app.state.registry.lookup("key-" + key_digest("k"), session_id)


async def test_the_persist_header_disk_persists_the_turn_and_the_next_turn_loads_it(
    cluster, fake
):
    app = create_app(cluster, ProxyConfig())
    async with _client(app) as client:
        history = [{"role": "user", "content": "Tell me about Paris, in detail please."}]
        await _turn(client, "s", history, persist="disk")
        session = (await _entry(app, "s")).session
        assert session.tier is not None
        assert fake.decode(0).leased_handles == 0
        fake.prefill(0).restart()  # only the tier can serve the history now
        history.append({"role": "user", "content": "And Rome?"})
        response = await _turn(client, "s", history)
        assert response.headers["x-agentkv-handle"] == HandleState.TIER.value
        assert session.turns[-1].reused_tokens == session.turns[-1].ideal_reused_tokens
    assert fake.wrong_reuse_events == 0


async def test_a_streamed_turn_with_the_persist_header_persists_too(cluster, fake):
    app = create_app(cluster, ProxyConfig())
    async with _client(app) as client:
        history = [{"role": "user", "content": "Tell me about Paris, in detail please."}]
        await _turn(client, "s", history, persist="disk", stream=True)
        assert (await _entry(app, "s")).session.tier is not None


async def test_a_bad_persist_header_is_a_400(cluster):
    app = create_app(cluster, ProxyConfig())
    async with _client(app) as client:
        response = await client.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "Hi"}]},
            headers={"X-Session-ID": "s", "X-AgentKV-Persist": "ssd"},
        )
        assert response.status_code == 400
        assert response.json()["error"]["param"] == "X-AgentKV-Persist"


async def test_the_sweep_persists_a_session_idle_past_persist_idle_s_once(cluster, fake, clock):
    app = create_app(cluster, ProxyConfig(persist_idle_s=120), clock=clock)
    registry = app.state.registry
    async with _client(app) as client:
        history = [{"role": "user", "content": "Tell me about Paris, in detail please."}]
        await _turn(client, "s", history)
        session = (await _entry(app, "s")).session
        clock.advance(119)
        assert await registry.persist_idle() == 0
        assert session.handle is not None
        clock.advance(1)
        assert await registry.persist_idle() == 1
        assert session.tier is not None
        assert session.handle is None
        assert fake.decode(0).leased_handles == 0
        assert await registry.persist_idle() == 0  # nothing left to persist
        history.append({"role": "user", "content": "And Rome?"})
        response = await _turn(client, "s", history)
        assert response.headers["x-agentkv-handle"] == HandleState.TIER.value
    assert fake.wrong_reuse_events == 0


async def test_without_persist_idle_s_the_sweep_keeps_the_pin(cluster, fake, clock):
    app = create_app(cluster, ProxyConfig(persist_idle_s=None), clock=clock)
    async with _client(app) as client:
        await _turn(client, "s", [{"role": "user", "content": "Hi there, tell me a story."}])
        clock.advance(500)
        assert await app.state.registry.persist_idle() == 0
        assert fake.decode(0).leased_handles == 1
