"""Decode memory pressure through the proxy: idle sessions' pins are freed, the longest idle
first, before decode is full (``agentkv/proxy/_relief.py``).

The fake decode has 128 blocks of 16 tokens; each conversation here pins ~19 of them, so six
finished conversations hold decode at 0.91 and a seventh fails (the fake runs out of blocks,
as a real decode would queue). With relief the seventh is served.
"""

from __future__ import annotations

import httpx2
import pytest

from agentkv import AsyncCluster
from agentkv.proxy import ProxyConfig, create_app
from agentkv.proxy._config import key_digest
from agentkv.proxy._redis_store import RedisSessions
from agentkv.testing import FakeCluster

PRINCIPAL = f"key-{key_digest('sk-test')}"
HEADERS = {"Authorization": "Bearer sk-test"}


def _messages(i, *more):
    system = {"role": "system", "content": f"You answer briefly, robot {i}. " * 12}
    return [system, {"role": "user", "content": f"Hello from {i}?"}, *more]


class Proxy:
    def __init__(self, fake, clock, store=None, transport=None, **config):
        self.fake = fake
        self.cluster = AsyncCluster.from_dict(
            fake.cluster_spec, transport=transport or fake.transport, clock=clock
        )
        self.app = create_app(self.cluster, ProxyConfig(**config), clock=clock, store=store)
        self.store = store
        self.http = httpx2.AsyncClient(
            transport=httpx2.ASGITransport(app=self.app), base_url="http://proxy"
        )
        self.answers = {}

    async def ask(self, i, *, follow_up=False):
        messages = _messages(i)
        if follow_up:
            messages += [self.answers[i], {"role": "user", "content": "And then?"}]
        response = await self.http.post(
            "/v1/chat/completions",
            json={"messages": messages, "max_tokens": 16},
            headers={**HEADERS, "X-Session-ID": f"s{i}"},
        )
        if response.status_code == 200:
            self.answers[i] = response.json()["choices"][0]["message"]
        return response

    async def usage(self):
        return (await self.cluster.kv_usage())["pair-0"]

    async def turns(self, i):
        response = await self.http.get(f"/v1/sessions/s{i}", headers=HEADERS)
        return response.json()["turns"]

    async def aclose(self):
        await self.app.state.registry.close_all()
        await self.http.aclose()
        if self.store is not None:
            await self.store.aclose()
        await self.cluster.aclose()


async def _fill(proxy):
    """Finished conversations until decode is at or above the relief's threshold."""
    for i in range(6):
        assert (await proxy.ask(i)).status_code == 200
    assert await proxy.usage() >= 0.9
    assert proxy.fake.decode(0).pinned_handles == 6


async def test_without_relief_finished_conversations_fill_decode_and_the_next_fails(clock):
    proxy = Proxy(FakeCluster(pairs=1, clock=clock, num_kv_blocks=128), clock)
    await _fill(proxy)
    assert (await proxy.ask(6)).status_code == 502  # no block left on decode
    await proxy.aclose()


async def test_relief_frees_the_longest_idle_pins_until_decode_is_below_its_low_mark(clock):
    proxy = Proxy(FakeCluster(pairs=1, clock=clock, num_kv_blocks=128), clock)
    await _fill(proxy)
    registry = proxy.app.state.registry
    busy = await registry.checkout(PRINCIPAL, "s0")  # a request is on the oldest: untouched
    try:
        freed = await proxy.app.state.relief.relieve()
    finally:
        await registry.checkin(busy)
    assert freed == 1  # ~0.15 a pin: one takes decode from 0.91 below 0.8
    assert await proxy.usage() < 0.8
    handles = {i: registry._entries[(PRINCIPAL, f"s{i}")].session.handle for i in range(6)}
    assert [i for i, handle in handles.items() if handle is None] == [1]
    assert proxy.app.state.metrics.value(
        "agentkv_proxy_pins_relieved_total", outcome="released"
    ) == 1
    assert (await proxy.ask(1, follow_up=True)).status_code == 200  # room again
    turn = (await proxy.turns(1))[-1]
    assert (turn["handle_state"], turn["reused_tokens"] > 0) == ("none", True)  # prefix cache
    assert "unpin" in turn["handle_reason"]
    # s2 is idle the longest now (s0's checkout was a use, s1 just answered).
    assert await proxy.app.state.relief.relieve() >= 1
    assert registry._entries[(PRINCIPAL, "s2")].session.handle is None
    assert (await proxy.ask(6)).status_code == 200
    assert (await proxy.ask(5, follow_up=True)).status_code == 200
    assert (await proxy.turns(5))[-1]["handle_state"] == "attached"
    assert proxy.fake.wrong_reuse_events == 0
    await proxy.aclose()


async def test_below_the_threshold_relief_reads_usage_and_frees_nothing(clock):
    proxy = Proxy(FakeCluster(pairs=1, clock=clock, num_kv_blocks=128), clock)
    for i in range(3):
        await proxy.ask(i)
    assert await proxy.app.state.relief.relieve() == 0
    assert proxy.fake.decode(0).pinned_handles == 3
    await proxy.aclose()


async def test_relief_persists_to_decodes_file_tier_where_it_has_one(clock):
    fake = FakeCluster(pairs=1, clock=clock, num_kv_blocks=128, tier=True)
    proxy = Proxy(fake, clock)
    await _fill(proxy)
    assert await proxy.app.state.relief.relieve() == 1
    assert len(fake.tier.ids) == 1
    assert (await proxy.ask(0, follow_up=True)).status_code == 200
    turn = (await proxy.turns(0))[-1]
    assert turn["handle_state"] == "tier"
    assert turn["reused_tokens"] == turn["ideal_reused_tokens"]
    await proxy.aclose()


async def test_shared_sessions_are_relieved_under_a_claim_and_stop_being_listed_pinned(
    clock, redis_url
):
    store = RedisSessions.from_url(redis_url, lease_s=5.0)
    proxy = Proxy(FakeCluster(pairs=1, clock=clock, num_kv_blocks=128), clock, store=store)
    await _fill(proxy)
    await proxy.app.state.registry.written()
    pinned = await store.pinned_idle(before=1e12, limit=10)
    assert len(pinned) == 6
    assert await proxy.app.state.relief.relieve() == 1
    assert await proxy.usage() < 0.8
    left = await store.pinned_idle(before=1e12, limit=10)
    assert [key for key, _ in left] == [key for key, _ in pinned[1:]]  # the longest idle went
    assert (await proxy.ask(0, follow_up=True)).status_code == 200
    assert (await proxy.turns(0))[-1]["handle_state"] == "none"
    assert proxy.fake.wrong_reuse_events == 0
    await proxy.aclose()


@pytest.mark.parametrize("value", [0.0, 0.05, 1.5])
def test_a_relief_threshold_outside_its_range_is_refused(value):
    from agentkv import ConfigError

    with pytest.raises(ConfigError, match="relieve_kv_usage"):
        ProxyConfig(relieve_kv_usage=value)


class WaitingForCapacity(httpx2.AsyncBaseTransport):
    """The fake's transport, its decode's ``/metrics`` saying a request waits for KV capacity
    (as vLLM's does when a new turn needs more blocks than are free)."""

    def __init__(self, inner):
        self._inner = inner
        self.waiting = False

    async def handle_async_request(self, request):
        response = await self._inner.handle_async_request(request)
        if not self.waiting or request.url.path != "/metrics" or "d0" not in request.url.host:
            return response
        body = await response.aread()
        line = 'vllm:num_requests_waiting_by_reason{engine="0",reason="capacity"} 1.0\n'
        return httpx2.Response(200, headers=response.headers, content=body + line.encode())


async def test_a_request_waiting_for_kv_capacity_counts_as_a_full_decode(clock):
    """A new turn that needs more blocks than are free waits at decode and adds nothing to the
    usage: below the threshold by usage, decode is still full for it, and pins are freed."""
    fake = FakeCluster(pairs=1, clock=clock, num_kv_blocks=128)
    transport = WaitingForCapacity(fake.transport)
    proxy = Proxy(fake, clock, transport=transport)
    for i in range(3):
        await proxy.ask(i)
    assert await proxy.usage() < 0.9
    assert await proxy.app.state.relief.relieve() == 0
    transport.waiting = True
    assert await proxy.usage() == 1.0
    assert await proxy.app.state.relief.relieve() >= 1
    assert fake.decode(0).pinned_handles < 3
    await proxy.aclose()
