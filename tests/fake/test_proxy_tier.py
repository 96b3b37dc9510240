"""The proxy and decode's file tier: ``X-AgentKV-Offload`` (off unless allowed, rate-limited per
principal; the deprecated ``X-AgentKV-Persist`` still read), the tier's per-salt share, and the
idle sweep's offload."""

from __future__ import annotations

import httpx2
import pytest
import structlog

from agentkv import HandleState
from agentkv.proxy import ProxyConfig, create_app
from agentkv.proxy._config import key_digest

LONG = {"max_tokens": 96, "min_tokens": 70}


# A clock of its own: advancing the proxy's idle clock (``clock``) must not expire handles.
pytestmark = pytest.mark.fake(pairs=1, own_clock=True, tier=True)


ALLOWED = ProxyConfig(allow_client_offload=True)


def _client(app, key="k") -> httpx2.AsyncClient:
    return httpx2.AsyncClient(
        transport=httpx2.ASGITransport(app=app),
        base_url="http://proxy",
        headers={"Authorization": f"Bearer {key}"},
    )


async def _turn(client, session_id, messages, *, offload=None, stream=False, header=None):
    headers = {"X-Session-ID": session_id}
    if offload is not None:
        headers[header or "X-AgentKV-Offload"] = offload
    response = await client.post(
        "/v1/chat/completions",
        json={"messages": messages, "stream": stream, **LONG},
        headers=headers,
    )
    assert response.status_code == 200, response.text
    if not stream:
        messages.append(response.json()["choices"][0]["message"])
    return response


async def _entry(app, session_id, key="k"):
    return await app.state.registry.lookup("key-" + key_digest(key), session_id)


async def test_the_offload_header_always_offloads_the_turn_and_the_next_turn_loads_it(
    acluster, fake
):
    app = create_app(acluster, ALLOWED)
    async with _client(app) as client:
        history = [{"role": "user", "content": "Tell me about Paris, in detail please."}]
        await _turn(client, "s", history, offload="always")
        session = (await _entry(app, "s")).session
        assert session.tier is not None
        assert fake.decode(0).leased_handles == 0
        fake.prefill(0).restart()  # only the tier can serve the history now
        history.append({"role": "user", "content": "And Rome?"})
        response = await _turn(client, "s", history)
        assert response.headers["x-agentkv-handle"] == HandleState.TIER.value
        assert session.turns[-1].reused_tokens == session.turns[-1].ideal_reused_tokens
    assert fake.wrong_reuse_events == 0


async def test_a_streamed_turn_with_the_offload_header_offloads_too(acluster, fake):
    app = create_app(acluster, ALLOWED)
    async with _client(app) as client:
        history = [{"role": "user", "content": "Tell me about Paris, in detail please."}]
        await _turn(client, "s", history, offload="always", stream=True)
        assert (await _entry(app, "s")).session.tier is not None


@pytest.mark.parametrize("config", [ProxyConfig(), ALLOWED], ids=["default", "allowed"])
async def test_a_bad_offload_header_is_a_400(acluster, config):
    app = create_app(acluster, config)
    async with _client(app) as client:
        response = await client.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "Hi"}]},
            headers={"X-Session-ID": "s", "X-AgentKV-Offload": "ssd"},
        )
        assert response.status_code == 400
        assert response.json()["error"]["param"] == "X-AgentKV-Offload"


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
async def test_by_default_a_client_s_offload_header_writes_nothing_and_the_answer_says_so(
    acluster, fake, stream
):
    app = create_app(acluster, ProxyConfig())
    async with _client(app) as client:
        history = [{"role": "user", "content": "Tell me about Paris, in detail please."}]
        response = await _turn(client, "s", history, offload="always", stream=stream)
        assert response.headers["x-agentkv-offload-ignored"] == "not_allowed"
        assert fake.tier.usage().entries == 0
        assert (await _entry(app, "s")).session.tier is None
        assert fake.decode(0).leased_handles == 1  # served as without the header: pinned
        plain = await _turn(client, "t", [{"role": "user", "content": "Hi, a story please."}])
        assert "x-agentkv-offload-ignored" not in plain.headers  # no header, nothing to notice


async def test_client_offloads_are_rate_limited_per_principal(acluster, fake, clock):
    app = create_app(
        acluster,
        ProxyConfig(allow_client_offload=True, client_offload_per_minute=2),
        clock=clock,
    )
    async with _client(app, "mallory") as mallory, _client(app, "alice") as alice:
        answers = [
            await _turn(mallory, f"m{i}", [{"role": "user", "content": f"Story {i}, long."}],
                        offload="always")
            for i in range(3)
        ]
        ignored = [a.headers.get("x-agentkv-offload-ignored") for a in answers]
        assert ignored == [None, None, "rate_limited"]
        assert fake.tier.usage().entries == 2
        assert (await _entry(app, "m2", "mallory")).session.tier is None
        # One key over its rate does not affect another.
        answer = await _turn(alice, "a", [{"role": "user", "content": "Mine, long."}],
                             offload="always")
        assert "x-agentkv-offload-ignored" not in answer.headers
        assert (await _entry(app, "a", "alice")).session.tier is not None
        clock.advance(30)  # a minute's rate of 2: one offload back after 30 s
        back = await _turn(mallory, "m3", [{"role": "user", "content": "Again, long."}],
                           offload="always")
        assert "x-agentkv-offload-ignored" not in back.headers
        assert fake.tier.usage().entries == 4


async def test_one_key_flooding_the_tier_evicts_only_its_own_entries(acluster, fake):
    app = create_app(acluster, ProxyConfig(allow_client_offload=True,
                                          client_offload_per_minute=100))
    prompt = [{"role": "user", "content": "Tell me about Paris, in detail please."}]
    async with _client(app, "alice") as alice, _client(app, "mallory") as mallory:
        history = list(prompt)
        await _turn(alice, "a", history, offload="always")
        mine = (await _entry(app, "a", "alice")).session.tier
        fake.tier.budget_bytes = 4 * fake.tier.usage().bytes + 1
        for i in range(8):  # twice the whole budget
            await _turn(mallory, f"m{i}", list(prompt), offload="always")
        assert mine.id in fake.tier.entries
        assert fake.tier.usage().bytes <= fake.tier.budget_bytes
        history.append({"role": "user", "content": "And Rome?"})
        response = await _turn(alice, "a", history)
        assert response.headers["x-agentkv-handle"] == HandleState.TIER.value
    assert fake.wrong_reuse_events == 0


async def test_the_sweep_offloads_a_session_idle_past_offload_idle_s_once(acluster, fake, clock):
    app = create_app(acluster, ProxyConfig(offload_idle_s=120), clock=clock)
    registry = app.state.registry
    async with _client(app) as client:
        history = [{"role": "user", "content": "Tell me about Paris, in detail please."}]
        await _turn(client, "s", history)
        session = (await _entry(app, "s")).session
        clock.advance(119)
        assert await registry.offload_idle() == 0
        assert session.handle is not None
        clock.advance(1)
        assert await registry.offload_idle() == 1
        assert session.tier is not None
        assert session.handle is None
        assert fake.decode(0).leased_handles == 0
        assert await registry.offload_idle() == 0  # nothing left to offload
        history.append({"role": "user", "content": "And Rome?"})
        response = await _turn(client, "s", history)
        assert response.headers["x-agentkv-handle"] == HandleState.TIER.value
    assert fake.wrong_reuse_events == 0


async def test_without_offload_idle_s_the_sweep_keeps_the_pin(acluster, fake, clock):
    app = create_app(acluster, ProxyConfig(offload_idle_s=None), clock=clock)
    async with _client(app) as client:
        await _turn(client, "s", [{"role": "user", "content": "Hi there, tell me a story."}])
        clock.advance(500)
        assert await app.state.registry.offload_idle() == 0
        assert fake.decode(0).leased_handles == 1


async def test_a_persist_over_its_key_s_share_is_refused_and_loses_nothing(acluster, fake):
    app = create_app(acluster, ALLOWED)
    prompt = [{"role": "user", "content": "Tell me about Paris, in detail please."}]
    async with _client(app, "alice") as alice, _client(app, "mallory") as mallory:
        await _turn(alice, "a", list(prompt), offload="always")
        mine = (await _entry(app, "a", "alice")).session.tier
        fake.tier.budget_bytes = fake.tier.usage().bytes * 3 // 2  # two keys: a share < one entry
        history = list(prompt)
        await _turn(mallory, "m", history, offload="always")
        session = (await _entry(app, "m", "mallory")).session
        assert session.tier is None  # refused ...
        assert session.handle is not None  # ... and the pin kept
        assert list(fake.tier.entries) == [mine.id]  # nobody else's entry went for it
        history.append({"role": "user", "content": "And Rome?"})
        response = await _turn(mallory, "m", history)
        assert response.headers["x-agentkv-handle"] == HandleState.ATTACHED.value
    assert fake.wrong_reuse_events == 0


# --- the deprecated X-AgentKV-Persist (issue 41: the tier write is an offload) -----------------


@pytest.mark.parametrize("value", ["disk", "always"])
async def test_the_old_header_still_offloads_and_is_counted_as_deprecated(acluster, fake, value):
    app = create_app(acluster, ALLOWED)
    async with _client(app) as client:
        history = [{"role": "user", "content": "Tell me about Paris, in detail please."}]
        await _turn(client, "s", history, offload=value, header="X-AgentKV-Persist")
        assert (await _entry(app, "s")).session.tier is not None
        await _turn(client, "t", [{"role": "user", "content": "Hi, a story please."}],
                    offload="pin", header="X-AgentKV-Persist")
    metrics = app.state.metrics
    assert metrics.value("agentkv_proxy_deprecated_names_total", old="X-AgentKV-Persist") == 2


async def test_the_old_header_is_logged_once_not_per_request(acluster):
    app = create_app(acluster, ProxyConfig())
    with structlog.testing.capture_logs() as logs:
        async with _client(app) as client:
            for sid in ("a", "b", "c"):
                await _turn(client, sid, [{"role": "user", "content": "Hi, a story please."}],
                            offload="auto", header="X-AgentKV-Persist")
    deprecated = [e for e in logs if e["event"] == "agentkv.proxy.deprecated_name"]
    assert [e["name"] for e in deprecated] == ["X-AgentKV-Persist"]
    assert deprecated[0]["log_level"] == "warning"


async def test_the_new_values_never_and_the_old_value_pin_keep_the_pin(acluster, fake):
    app = create_app(acluster, ALLOWED)
    async with _client(app) as client:
        await _turn(client, "a", [{"role": "user", "content": "Hi, a story please."}],
                    offload="never")
        await _turn(client, "b", [{"role": "user", "content": "Hi, a tale please."}],
                    offload="pin", header="X-AgentKV-Persist")
    assert fake.decode(0).leased_handles == 2
    assert fake.tier.usage().entries == 0
    assert app.state.metrics.value("agentkv_proxy_deprecated_names_total",
                                   old="X-AgentKV-Persist") == 1


async def test_an_ignored_ask_under_the_old_name_is_answered_under_both_names(acluster):
    app = create_app(acluster, ProxyConfig())
    async with _client(app) as client:
        old = await _turn(client, "s", [{"role": "user", "content": "Hi, a story please."}],
                          offload="disk", header="X-AgentKV-Persist")
        new = await _turn(client, "t", [{"role": "user", "content": "Hi, a tale please."}],
                          offload="always")
    assert old.headers["x-agentkv-offload-ignored"] == "not_allowed"
    assert old.headers["x-agentkv-persist-ignored"] == "not_allowed"
    assert new.headers["x-agentkv-offload-ignored"] == "not_allowed"
    assert "x-agentkv-persist-ignored" not in new.headers


async def test_old_and_new_headers_that_disagree_are_a_400(acluster):
    app = create_app(acluster, ALLOWED)
    async with _client(app) as client:
        response = await client.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "Hi"}]},
            headers={"X-Session-ID": "s", "X-AgentKV-Offload": "never",
                     "X-AgentKV-Persist": "disk"},
        )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "X-AgentKV-Offload"
