"""The route of each turn against the fake P/D cluster: pull, decode-local, recompute, auto.

The ``decode`` route sends a turn to the session's decode alone: its prefix cache holds the
previous turn's pinned blocks, it computes the rest and pins the new turn's KV as a D leg does.
"""

from __future__ import annotations

import asyncio

import httpx2
import pytest
from structlog.testing import capture_logs

from agentkv import (
    CachePolicy,
    Cluster,
    ConfigError,
    HandleState,
    Message,
    RetryPolicy,
    RoutePolicy,
    ServerError,
)
from agentkv.testing import FakeCluster

BLOCK = 16
SYSTEM = Message.system("You are a helpful assistant. Answer in one or two sentences. " * 6)
QUESTIONS = ["What is the capital of France?", "And of Spain?", "Which is bigger?", "Thanks."]
LONG = {"max_tokens": 60, "extra_body": {"min_tokens": 40}}


def open_cluster(fake, clock, **kwargs):
    kwargs.setdefault("retry", RetryPolicy(initial_backoff_s=0, jitter_s=0))
    return Cluster.from_dict(
        fake.cluster_spec, transport=fake.transport, clock=clock, block_size=BLOCK, **kwargs
    )


def converse(cluster, *, route, policy=None, questions=QUESTIONS):
    with cluster.session(session_id="s", route=route, policy=policy, **LONG) as s:
        s.append(SYSTEM)
        return [s.send(q) for q in questions]


def chat_requests(server):
    return [r for r in server.requests if r.get("max_tokens") != 0]


def test_a_decode_turn_sends_one_request_to_decode_and_reuses_its_cache(clock):
    """Turn 2 on the decode route: no P leg, no transfer params to pull, decode's own prefix
    cache covers the previous turn's whole blocks, and the answer carries the next handle."""
    fake = FakeCluster(pairs=1, clock=clock)
    with open_cluster(fake, clock) as cluster:
        results = converse(cluster, route="decode", questions=QUESTIONS[:1])
        # Turn 1 has no handle: decode computes everything itself, too.
        assert len(fake.prefill(0).requests) == 0
        first = results[0].stats
        assert first.route == "decode"
        assert first.prefill == ""
    fake = FakeCluster(pairs=1, clock=clock)
    with open_cluster(fake, clock) as cluster, cluster.session(route="pull", **LONG) as s:
        s.append(SYSTEM)
        s.send(QUESTIONS[0])
        before = len(fake.prefill(0).requests), len(fake.decode(0).requests)
        second = s.send(QUESTIONS[1], route="decode")
        after = len(fake.prefill(0).requests), len(fake.decode(0).requests)
        assert after == (before[0], before[1] + 1)
        body = fake.decode(0).requests[-1]
        params = body["kv_transfer_params"]
        assert params["do_remote_prefill"] is False
        assert params["do_remote_decode"] is False
        assert "remote_block_ids" not in params
        stats = second.stats
        assert stats.route == "decode"
        assert stats.handle_state is HandleState.ATTACHED
        assert stats.pulled_tokens == 0
        # Decode's cache matches whole blocks: the ideal less its partial last block.
        assert stats.reused_tokens == (stats.ideal_reused_tokens + 1) // BLOCK * BLOCK
        assert stats.computed_tokens == stats.prompt_tokens - stats.reused_tokens
        assert s.handle is not None  # decode pinned the new turn's KV
    assert fake.wrong_reuse_events == 0


def test_the_old_pin_is_released_after_a_decode_turn(clock):
    """The new turn's pin holds the blocks it reused; the previous turn's pin is freed right
    after the answer (in the background) rather than left to its TTL."""
    fake = FakeCluster(pairs=1, clock=clock)
    with (
        capture_logs() as logs,
        open_cluster(fake, clock) as cluster,
        cluster.session(route="decode", **LONG) as s,
    ):
        s.append(SYSTEM)
        for question in QUESTIONS:
            s.send(question)
            assert fake.decode(0).pinned_handles <= 2
    released = [e for e in logs if e["event"] == "agentkv.release"]
    assert [e["reason"] for e in released] == ["decode_route"] * 3 + ["close"]
    assert {e["outcome"] for e in released} == {"ok"}
    assert fake.decode(0).pinned_handles == 0


@pytest.mark.parametrize("route", ["decode", "recompute", "auto"])
def test_answers_are_the_same_on_every_route(clock, route):
    """Greedy answers do not depend on the way the prompt reached decode."""
    pulled = converse(open_cluster(FakeCluster(pairs=1, clock=clock), clock), route="pull")
    fake = FakeCluster(pairs=1, clock=clock)
    other = converse(open_cluster(fake, clock), route=route)
    assert [r.token_ids for r in other] == [r.token_ids for r in pulled]
    assert [r.message.content for r in other] == [r.message.content for r in pulled]
    assert fake.wrong_reuse_events == 0


def test_recompute_releases_a_live_handle_unused(clock):
    fake = FakeCluster(pairs=1, clock=clock)
    with open_cluster(fake, clock) as cluster, cluster.session(**LONG) as s:
        s.append(SYSTEM)
        s.send(QUESTIONS[0])
        result = s.send(QUESTIONS[1], route="recompute")
        assert result.stats.route == "recompute"
        assert result.stats.handle_state is HandleState.UNUSED
        assert result.stats.pulled_tokens == 0
        assert fake.prefill(0).requests[-1]["kv_transfer_params"]["remote_block_ids"] is None
        assert fake.decode(0).pinned_handles == 1  # the new turn's only


def test_auto_computes_short_appends_on_decode_and_pulls_long_ones(clock):
    policy = CachePolicy(route=RoutePolicy(decode_max_tokens=64))
    fake = FakeCluster(pairs=1, clock=clock)
    with (
        open_cluster(fake, clock) as cluster,
        cluster.session(route="auto", policy=policy, **LONG) as s,
    ):
        s.append(SYSTEM)
        first = s.send(QUESTIONS[0])
        short = s.send("Why?")
        long = s.send("Explain it again, at length. " * 20)
    assert first.stats.route == "recompute"  # nothing to reuse yet
    assert first.stats.route_reason == "no handle to reuse"
    assert short.stats.route == "decode"
    assert long.stats.route == "pull"
    assert "exceed decode's local budget of 64" in long.stats.route_reason
    assert long.stats.handle_state is HandleState.ATTACHED


def test_the_route_is_kept_by_a_saved_session(clock, tmp_path):
    fake = FakeCluster(pairs=1, clock=clock)
    with open_cluster(fake, clock) as cluster:
        with cluster.session(route="decode", **LONG) as s:
            s.append(SYSTEM)
            s.send(QUESTIONS[0])
            s.save(tmp_path / "s.json")
        with cluster.load_session(tmp_path / "s.json") as loaded:
            assert loaded.send(QUESTIONS[1]).stats.route == "decode"


def test_an_unknown_route_is_refused_before_anything_is_sent(clock):
    fake = FakeCluster(pairs=1, clock=clock)
    with open_cluster(fake, clock) as cluster:
        with pytest.raises(ConfigError, match="route must be one of"):
            cluster.session(route="sideways")
        with cluster.session() as s:
            s.append(SYSTEM)
            with pytest.raises(ConfigError, match="route must be one of"):
                s.send(QUESTIONS[0], route="sideways")
            assert len(s.transcript.messages) == 0
    assert fake.decode(0).requests == []


def test_a_failed_decode_turn_frees_the_handle_and_changes_nothing(clock):
    fake = FakeCluster(pairs=1, clock=clock)
    policy = RetryPolicy(max_attempts=1)
    with open_cluster(fake, clock, retry=policy) as cluster, cluster.session(**LONG) as s:
        s.append(SYSTEM)
        s.send(QUESTIONS[0])
        version = len(s.transcript.messages)
        fake.decode(0).fail_next("status", status=500)
        with pytest.raises(ServerError, match=r"500|failed"):
            s.send(QUESTIONS[1], route="decode")
        assert len(s.transcript.messages) == version
        assert s.handle is None  # single use: a failed turn never sends it again
        assert fake.decode(0).pinned_handles == 0
    assert fake.wrong_reuse_events == 0


def test_a_stock_decode_never_frees_a_local_turns_pin_and_agentkvs_connector_does(clock):
    """vLLM 0.32 pins a turn computed on decode itself but leaves it out of the requests its
    workers track, so not even its TTL frees it; agentkv's connector tracks it like a D leg's."""
    for leases, left in ((False, 1), (True, 0)):
        fake = FakeCluster(pairs=1, clock=clock, leases=leases)
        local = {"do_remote_prefill": False, "do_remote_decode": False}

        async def turn(fake=fake, local=local):
            async with httpx2.AsyncClient(transport=fake.transport) as client:
                return await client.post(
                    fake.decode(0).url + "/v1/chat/completions",
                    json={
                        "model": fake.model,
                        "messages": [{"role": "user", "content": "Hi there."}],
                        "max_tokens": 8,
                        "kv_transfer_params": local,
                    },
                )

        response = asyncio.run(turn())
        assert response.status_code == 200, response.text
        assert response.json()["kv_transfer_params"]["remote_block_ids"]  # pinned
        clock.advance(10_000)  # past every TTL
        fake.decode(0).engine.expire()
        assert fake.decode(0).pinned_handles == left


def test_the_sdk_computes_no_turn_on_a_decode_without_agentkvs_connector(clock):
    fake = FakeCluster(pairs=1, clock=clock, leases=False)
    with open_cluster(fake, clock) as cluster, cluster.session(route="decode", **LONG) as s:
        s.append(SYSTEM)
        first = s.send(QUESTIONS[0])
        second = s.send(QUESTIONS[1])
        auto = s.send(QUESTIONS[2], route="auto")
    assert (first.stats.route, second.stats.route, auto.stats.route) == (
        "recompute",
        "pull",
        "pull",
    )
    assert "lacks agentkv's connector" in second.stats.route_reason
    assert len(fake.prefill(0).requests) == 3
