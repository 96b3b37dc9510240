"""The proxy and the route of a turn: ``X-AgentKV-Route``, chat completions and responses."""

from __future__ import annotations

import httpx2
import pytest

from agentkv.proxy import ProxyConfig, create_app
from agentkv.proxy._config import key_digest

LONG = {"max_tokens": 60, "min_tokens": 40}


pytestmark = pytest.mark.fake(pairs=1)


def _client(app) -> httpx2.AsyncClient:
    return httpx2.AsyncClient(
        transport=httpx2.ASGITransport(app=app),
        base_url="http://proxy",
        headers={"Authorization": "Bearer k"},
    )


async def _turn(client, messages, *, route=None, stream=False):
    headers = {"X-Session-ID": "s"}
    if route is not None:
        headers["X-AgentKV-Route"] = route
    response = await client.post(
        "/v1/chat/completions",
        json={"messages": messages, "stream": stream, **LONG},
        headers=headers,
    )
    assert response.status_code == 200, response.text
    if not stream:
        messages.append(response.json()["choices"][0]["message"])
    return response


@pytest.mark.parametrize("stream", [False, True])
async def test_the_route_header_sends_the_turn_to_decode_alone(acluster, fake, stream):
    app = create_app(acluster, ProxyConfig())
    async with _client(app) as client:
        history = [{"role": "user", "content": "Tell me about Paris, in detail please."}]
        await _turn(client, history)
        history.append({"role": "user", "content": "And Madrid?"})
        prefills = len(fake.prefill(0).requests)
        await _turn(client, history, route="decode", stream=stream)
        assert len(fake.prefill(0).requests) == prefills
        entry = await app.state.registry.lookup("key-" + key_digest("k"), "s")
        stats = entry.session.turns[-1]
        assert stats.route == "decode"
        assert stats.turn == 2
        assert stats.reused_tokens > 0
    assert fake.wrong_reuse_events == 0


async def test_a_bad_route_header_is_a_400(acluster, fake):
    app = create_app(acluster, ProxyConfig())
    async with _client(app) as client:
        response = await client.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "Hi"}]},
            headers={"X-Session-ID": "s", "X-AgentKV-Route": "sideways"},
        )
        assert response.status_code == 400
        assert response.json()["error"]["param"] == "X-AgentKV-Route"
    assert fake.decode(0).requests == []


async def test_the_responses_api_takes_the_route_header(acluster, fake):
    app = create_app(acluster, ProxyConfig())
    async with _client(app) as client:
        first = await client.post(
            "/v1/responses", json={"input": "Tell me about Paris, in detail please.", **_out()}
        )
        assert first.status_code == 200, first.text
        prefills = len(fake.prefill(0).requests)
        second = await client.post(
            "/v1/responses",
            json={"input": "And Madrid?", "previous_response_id": first.json()["id"], **_out()},
            headers={"X-AgentKV-Route": "decode"},
        )
        assert second.status_code == 200, second.text
        assert len(fake.prefill(0).requests) == prefills
    assert fake.wrong_reuse_events == 0


def _out():
    return {"max_output_tokens": 60}
