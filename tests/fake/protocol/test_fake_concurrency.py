"""Many clients at once on one fake (async sessions, threads) and the fake served over real
HTTP: reuse stays exact and nothing is left pinned."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import httpx2
import pytest
from raw_protocol import (
    CHAT,
    DECODE_HANDLE_KEYS,
    FIRST_LEG,
    cached,
    chatml_ids,
    leg,
    next_turn,
    prompt_of_length,
    turn,
    user,
)

from agentkv.testing import FakeCluster, ManualClock


async def test_hundreds_of_concurrent_sessions_share_one_transport(clock: ManualClock) -> None:
    fake = FakeCluster(pairs=2, clock=clock)

    async def session(client: httpx2.AsyncClient, n: int) -> int:
        pair = n % 2
        ids = chatml_ids(user(f"session {n}: " + "x" * 100))
        p = await client.post(
            f"{fake.prefill(pair).url}{CHAT}",
            json={
                "messages": [],
                "max_tokens": 1,
                "kv_transfer_params": {**FIRST_LEG, "prompt_token_ids": ids},
            },
        )
        d = await client.post(
            f"{fake.decode(pair).url}{CHAT}",
            json={
                "messages": [],
                "max_tokens": 80,
                "ignore_eos": True,
                "return_token_ids": True,
                "kv_transfer_params": {**p.json()["kv_transfer_params"], "prompt_token_ids": ids},
            },
        )
        generated = d.json()["choices"][0]["token_ids"]
        ids2 = next_turn(ids, generated, "next")
        p2 = await client.post(
            f"{fake.prefill(pair).url}{CHAT}",
            json={
                "messages": [],
                "max_tokens": 1,
                "kv_transfer_params": {**d.json()["kv_transfer_params"], "prompt_token_ids": ids2},
            },
        )
        return cached(p2.json()) - (len(ids) + len(generated) - 1)

    async with httpx2.AsyncClient(transport=fake.transport) as client:
        misses = await asyncio.gather(*(session(client, n) for n in range(300)))
    assert misses == [0] * 300
    assert fake.wrong_reuse_events == 0
    assert fake.decode(0).pinned_handles == fake.decode(1).pinned_handles == 0


def test_serve_exposes_the_cluster_over_real_http(clock: ManualClock) -> None:
    fake = FakeCluster(pairs=1, clock=clock)
    with fake.serve() as served, httpx2.Client(timeout=10) as client:
        spec = served.cluster_spec
        prefill, decode = spec["pairs"][0]["prefill"], spec["pairs"][0]["decode"]
        assert prefill.startswith("http://127.0.0.1:")
        ids = prompt_of_length(60)
        p = leg(client, prefill, ids, FIRST_LEG, max_tokens=1)
        d = leg(client, decode, ids, p["kv_transfer_params"])
        assert set(d["kv_transfer_params"]) == DECODE_HANDLE_KEYS
        fake.decode(0).kill()
        with pytest.raises(httpx2.ConnectError):
            client.get(decode + "/health")
        fake.decode(0).restart()
        assert client.get(decode + "/health").status_code == 200


def test_served_streams_are_chunked_event_by_event_as_vllms(clock: ManualClock) -> None:
    """A stream goes out as vLLM sends one: chunked, no length, its events written apart."""
    fake = FakeCluster(pairs=1, clock=clock)
    body = {
        "model": fake.model,
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 8,
        "stream": True,
    }
    with fake.serve() as served, httpx2.Client(timeout=10) as client:
        decode = served.cluster_spec["pairs"][0]["decode"]
        with client.stream("POST", decode + CHAT, json=body) as response:
            assert response.headers["transfer-encoding"] == "chunked"
            assert "content-length" not in response.headers
            events = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert len(events) > 3
    assert events[-1] == "data: [DONE]"


def test_sync_clients_on_many_threads_share_the_transport(fake: FakeCluster) -> None:
    def session(n: int) -> int:
        with httpx2.Client(transport=fake.transport) as client:
            ids = chatml_ids(user(f"thread session {n} " + "x" * 120))
            _, d = turn(client, fake, ids, pair=n % 2, max_tokens=70, ignore_eos=True)
            generated = d["choices"][0]["token_ids"]
            ids2 = next_turn(ids, generated, "go on")
            p2 = leg(client, fake.prefill(n % 2).url, ids2, d["kv_transfer_params"], max_tokens=1)
            return cached(p2) - (len(ids) + len(generated) - 1)

    with ThreadPoolExecutor(max_workers=8) as pool:
        assert list(pool.map(session, range(40))) == [0] * 40
