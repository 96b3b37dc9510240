"""Sessions and agentkv's decode extension, on the fake pair: what decode holds, and for how long.

Facts are read from the fake decode server (its pins, leases and KV usage, the bodies it got),
not from the SDK's bookkeeping. The fake decides pins with ``AgentKVConnector``'s own code
(``apply_pin_policy``, ``LeaseBook``, ``LeaseService`` in ``agentkv/connector/_leases.py``), not a
copy of it; ``tests/unit/test_connector_policy.py`` tests that code on vLLM's scheduler fields.
"""

from __future__ import annotations

import httpx2
import pytest
from structlog.testing import capture_logs

from agentkv import AsyncCluster, CachePolicy, Cluster, HandleState, Message, RetryPolicy
from agentkv._wire.handoff import lease_ref
from agentkv._wire.hints import EXTEND_PATH, RELEASE_PATH, ExtendRequest, LeaseRef
from agentkv.testing import FakeCluster

SYSTEM = Message.system("You are a helpful assistant. Answer in one or two sentences. " * 4)
QUESTIONS = [
    "What is the capital of France? Explain the history of the city in detail please.",
    "And what about Spain?",
    "Which of the two is bigger?",
]
# Enough generated tokens that decode's handle is worth a pull (kv_recompute_threshold 64).
LONG = {"max_tokens": 100, "extra_body": {"min_tokens": 70}}


ONE_ATTEMPT = RetryPolicy(max_attempts=1)
pytestmark = [
    pytest.mark.fake(pairs=1),
    pytest.mark.cluster(manual_clock=True, block_size=16, retry=ONE_ATTEMPT),
]


def open_cluster(fake, clock, **kwargs):
    kwargs.setdefault("retry", ONE_ATTEMPT)
    return Cluster.from_dict(
        fake.cluster_spec, transport=fake.transport, clock=clock, block_size=16, **kwargs
    )


def events(logs, name):
    return [entry for entry in logs if entry["event"] == name]


def hints(server):
    """The agentkv hint each chat request to ``server`` carried (None: none)."""
    return [body["kv_transfer_params"].get("agentkv") for body in server.requests]


# --- persist: how long decode pins a turn ------------------------------------------------------


def test_closing_a_session_releases_its_pin_and_decode_usage_returns_to_idle(cluster, fake):
    decode = fake.decode(0)
    idle = decode.kv_cache_usage
    with capture_logs() as logs, cluster.session(**LONG) as s:
        s.append(SYSTEM)
        for question in QUESTIONS:
            s.send(question)
        assert (decode.pinned_handles, decode.leased_handles) == (1, 1)
        assert decode.kv_cache_usage > idle
    assert (decode.pinned_handles, decode.leased_handles) == (0, 0)
    assert decode.kv_cache_usage == idle
    [release] = events(logs, "agentkv.release")
    assert (release["reason"], release["outcome"], release["status"]) == ("close", "ok", 200)


async def test_an_async_close_has_released_the_pin_when_it_returns(fake, clock):
    decode = fake.decode(0)
    async with AsyncCluster.from_dict(
        fake.cluster_spec, transport=fake.transport, clock=clock
    ) as cluster:
        s = cluster.session(**LONG)
        s.append(SYSTEM)
        await s.send(QUESTIONS[0])
        assert decode.pinned_handles == 1
        await s.aclose()
        assert decode.pinned_handles == 0
        assert s.handle is None


def test_normal_turns_ask_decode_to_persist_and_a_final_turn_pins_nothing(cluster, fake):
    prefill, decode = fake.prefill(0), fake.decode(0)
    with cluster.session(**LONG) as s:
        s.append(SYSTEM)
        s.send(QUESTIONS[0])
        last = s.send(QUESTIONS[1], final=True)
        assert s.handle is None
        assert decode.pinned_handles == 0
        assert decode.kv_cache_usage == 0.0
        assert last.stats.handle_state is HandleState.ATTACHED  # it still used turn 1's KV
        again = s.send(QUESTIONS[2])  # a session may go on after a final turn: it recomputes
        assert decode.pinned_handles == 1
    assert hints(decode) == [
        {"v": 1, "persist": True},
        {"v": 1, "persist": False},
        {"v": 1, "persist": True},
    ]
    # The P leg never carries a hint, nor the lease secret of the handle it sends.
    assert hints(prefill) == [None, None, None]
    assert again.stats.handle_state is HandleState.NONE
    assert "final" in again.stats.handle_reason
    assert decode.pinned_handles == 0  # the close released the last turn's pin


def test_a_streamed_final_turn_pins_nothing(cluster, fake):
    with cluster.session(**LONG) as s:
        s.append(SYSTEM, Message.user(QUESTIONS[0]))
        *_, result = list(s.stream(final=True))
        assert result.text
        assert s.handle is None
        assert fake.decode(0).pinned_handles == 0


@pytest.mark.parametrize(("cap", "granted"), [(3600.0, 120.0), (60.0, 60.0)])
def test_the_deadline_follows_the_ttl_decode_granted(clock, cap, granted):
    """The hint asks for pin_ttl_s; decode caps it; the SDK believes decode."""
    fake = FakeCluster(pairs=1, clock=clock, agentkv_max_ttl_s=cap)
    policy = CachePolicy(pin_ttl_s=120, ttl_margin_s=10)
    clock.advance(1000.0)
    with open_cluster(fake, clock, policy=policy) as cluster, cluster.session(**LONG) as s:
        s.append(SYSTEM)
        with capture_logs() as logs:
            s.send(QUESTIONS[0])
        assert hints(fake.decode(0)) == [{"v": 1, "persist": True, "ttl_s": 120.0}]
        assert s.handle is not None
        assert s.handle.leased
        assert s.handle.lease_ttl_s == granted
        assert s.handle.deadline == 1000.0 + granted - 10
        assert s.handle.server_expiry == 1000.0 + granted
        [turn] = events(logs, "agentkv.turn")
        assert turn["leased"] is True


def test_a_streamed_turn_s_deadline_follows_the_ttl_decode_granted(clock):
    fake = FakeCluster(pairs=1, clock=clock, agentkv_max_ttl_s=60.0)
    policy = CachePolicy(pin_ttl_s=120, ttl_margin_s=10)
    clock.advance(1000.0)
    with open_cluster(fake, clock, policy=policy) as cluster, cluster.session(**LONG) as s:
        s.append(SYSTEM, Message.user(QUESTIONS[0]))
        *_, result = list(s.stream())
        assert result.text
        assert s.handle is not None
        assert s.handle.lease_ttl_s == 60.0
        assert s.handle.deadline == 1000.0 + 60.0 - 10


# --- extend: keeping a handle through a tool call ---------------------------------------------


def short_ttl(clock):
    """A decode that pins for 20 s: our deadline for its handles is 10 s after the D leg."""
    return FakeCluster(pairs=1, clock=clock, decoder_kv_blocks_ttl=20.0)


def test_an_extended_handle_survives_a_long_tool_wait_and_the_next_turn_pulls_it(clock):
    fake = short_ttl(clock)
    prefill = fake.prefill(0)
    with open_cluster(fake, clock) as cluster, cluster.session(**LONG) as s:
        s.append(SYSTEM)
        s.send(QUESTIONS[0])
        with capture_logs() as logs:
            with s.tool_wait(expected_s=40) as wait:
                clock.advance(40.0)  # the tool runs twice decode's TTL
            nxt = s.send(QUESTIONS[1])
    assert (wait.extended, wait.survived, wait.waited_s) == (True, True, 40.0)
    assert wait.decision.ttl_s == 40 + 30 + 30  # wait + slack + margin
    stats = nxt.stats
    assert stats.handle_state is HandleState.ATTACHED
    assert stats.reused_tokens == stats.ideal_reused_tokens
    assert stats.pulled_tokens > 0
    assert stats.extends == 1
    assert "kept over a 40.0s tool wait (extended)" in stats.handle_reason
    assert s.stats.extends == 1
    # The P leg carried the extended expiry: prefill declines a pull within 5 s of the old one.
    sent = prefill.requests[-1]["kv_transfer_params"]
    assert sent["remote_blocks_expiry_time"] == 100.0
    assert "agentkv" not in sent
    assert fake.wrong_reuse_events == 0
    [extend] = events(logs, "agentkv.extend")
    assert (extend["outcome"], extend["reason"], extend["granted_s"]) == ("ok", "tool_wait", 100.0)


@pytest.mark.parametrize("with_tool_wait", [True, False])
def test_an_unextended_handle_expires_and_the_next_turn_recomputes_the_same_answer(
    clock, with_tool_wait
):
    policy = CachePolicy(extend_slack_s=0)  # a 1 s estimate then ends before the deadline
    fake = short_ttl(clock)
    with open_cluster(fake, clock, policy=policy) as cluster, cluster.session(**LONG) as s:
        s.append(SYSTEM)
        s.send(QUESTIONS[0])
        with capture_logs() as logs:
            if with_tool_wait:
                with s.tool_wait(expected_s=1) as wait:
                    clock.advance(40.0)  # the estimate was wrong
                assert (wait.extended, wait.survived) == (False, False)
            else:
                clock.advance(40.0)
            assert fake.decode(0).pinned_handles == 0  # decode's own TTL ran out
            expired = s.send(QUESTIONS[1])
    assert expired.stats.handle_state is HandleState.EXPIRED
    assert expired.stats.pulled_tokens == 0
    assert "deadline" in expired.stats.handle_reason
    if with_tool_wait:
        assert "lost over a 40.0s tool wait (not extended" in expired.stats.handle_reason
    assert events(logs, "agentkv.extend") == []
    assert events(logs, "agentkv.release") == []  # past its deadline: nothing to release
    assert fake.wrong_reuse_events == 0
    # The same conversation with no reuse at all answers the same.
    never = CachePolicy(min_reuse_tokens=10**9)
    with (
        open_cluster(short_ttl(clock), clock, policy=never) as cluster,
        cluster.session(**LONG) as again,
    ):
        again.append(SYSTEM)
        again.send(QUESTIONS[0])
        assert again.send(QUESTIONS[1]).token_ids == expired.token_ids


def test_a_short_tool_wait_needs_no_extend(cluster, fake, clock):
    with cluster.session(**LONG) as s:
        s.append(SYSTEM)
        s.send(QUESTIONS[0])
        with capture_logs() as logs, s.tool_wait(expected_s=5) as wait:
            clock.advance(5.0)
        assert (wait.extended, wait.survived) == (False, True)
        assert "before the deadline" in wait.decision.reason
        assert events(logs, "agentkv.extend") == []
        assert s.send(QUESTIONS[1]).stats.handle_state is HandleState.ATTACHED


def test_extend_handle_moves_the_deadline_and_the_server_expiry(cluster, fake, clock):
    with cluster.session(**LONG) as s:
        s.append(SYSTEM)
        s.send(QUESTIONS[0])
        before = s.handle
        assert before is not None
        deadline = s.extend_handle(1000)
        assert deadline == 1000 - 30
        assert s.handle is not None
        assert (s.handle.deadline, s.handle.server_expiry, s.handle.extends) == (970, 1000, 1)
        assert s.handle.request_id == before.request_id
        clock.advance(600.0)  # past decode's default TTL (480 s)
        assert fake.decode(0).pinned_handles == 1
        nxt = s.send(QUESTIONS[1])
    assert nxt.stats.handle_state is HandleState.ATTACHED
    assert nxt.stats.reused_tokens == nxt.stats.ideal_reused_tokens


def test_extend_handle_never_shortens_a_lease(cluster):
    with cluster.session(**LONG) as s:
        s.append(SYSTEM)
        s.send(QUESTIONS[0])
        assert s.handle is not None
        deadline = s.handle.deadline
        assert s.extend_handle(5) == deadline
        assert s.handle.server_expiry == 480.0


def test_a_handle_decode_lost_is_dropped_on_extend_and_the_next_turn_says_why(cluster, fake):
    with cluster.session(**LONG) as s:
        s.append(SYSTEM)
        s.send(QUESTIONS[0])
        fake.decode(0).restart()  # pins and leases gone
        assert s.extend_handle(300) is None
        assert s.handle is None
        nxt = s.send(QUESTIONS[1])
    assert nxt.stats.handle_state is HandleState.EXPIRED
    assert "no longer holds" in nxt.stats.handle_reason
    assert "unknown_lease" in nxt.stats.handle_reason


async def test_the_async_tool_wait_extends_too(fake, clock):
    fake = short_ttl(clock)
    async with (
        AsyncCluster.from_dict(fake.cluster_spec, transport=fake.transport, clock=clock) as cluster,
        cluster.session(**LONG) as s,
    ):
        s.append(SYSTEM)
        await s.send(QUESTIONS[0])
        async with s.tool_wait(expected_s=40) as wait:
            clock.advance(40.0)
        assert (wait.extended, wait.survived) == (True, True)
        nxt = await s.send(QUESTIONS[1])
        assert nxt.stats.handle_state is HandleState.ATTACHED
        assert await s.extend_handle(10) is not None


# --- release: handles dropped unsent, dead decode servers, other sessions ----------------------


def test_a_handle_dropped_below_the_recompute_threshold_is_released(cluster, fake):
    with capture_logs() as logs, cluster.session(max_tokens=2) as s:
        s.append(Message.user("Hi"))
        s.turn()
        result = s.send("Again")
        assert result.stats.handle_state is HandleState.BELOW_THRESHOLD
        assert fake.decode(0).pinned_handles == 1  # this turn's, not the dropped one too
    reasons = [(e["reason"], e["outcome"]) for e in events(logs, "agentkv.release")]
    assert reasons == [("below_threshold", "ok"), ("close", "ok")]


def test_a_dead_decode_does_not_make_close_fail(cluster, fake):
    with capture_logs() as logs:
        with cluster.session(**LONG) as s:
            s.append(SYSTEM)
            s.send(QUESTIONS[0])
            fake.decode(0).kill()
        assert s.closed
    [release] = events(logs, "agentkv.release")
    assert (release["outcome"], release["log_level"]) == ("failed", "warning")


def test_another_sessions_handle_cannot_be_released_or_extended(cluster, fake):
    decode = fake.decode(0)
    client = httpx2.Client(transport=fake.transport)
    with cluster.session(**LONG) as a, cluster.session(**LONG) as b:
        for s in (a, b):
            s.append(SYSTEM)
            s.send(QUESTIONS[0])
        assert a.handle is not None
        assert b.handle is not None
        mine, theirs = lease_ref(a.handle), lease_ref(b.handle)
        forged = [
            LeaseRef(request_id=mine.request_id, block_ids=mine.block_ids, lease=theirs.lease),
            LeaseRef(request_id=mine.request_id, block_ids=theirs.block_ids, lease=mine.lease),
            LeaseRef(request_id=theirs.request_id, block_ids=mine.block_ids, lease=mine.lease),
        ]
        for ref in forged:
            released = client.post(decode.url + RELEASE_PATH, json=ref.to_wire())
            extended = client.post(
                decode.url + EXTEND_PATH, json=ExtendRequest(ref=ref, ttl_s=900).to_wire()
            )
            for answer in (released, extended):
                assert answer.status_code == 404
                assert answer.json()["error"]["code"] == "unknown_lease"
        assert decode.leased_handles == 2
        a.close()
        assert decode.leased_handles == 1  # a's own release freed a's pin only
        nxt = b.send(QUESTIONS[1])
    assert nxt.stats.handle_state is HandleState.ATTACHED
    assert nxt.stats.reused_tokens == nxt.stats.ideal_reused_tokens
    client.close()


# --- stock vLLM: detected once, never a lease call, never a failure ----------------------------


@pytest.mark.parametrize(
    "stream_handles", [False, True], ids=["no-plugin-404", "plugin-stock-connector"]
)
def test_on_stock_decode_the_sdk_warns_once_and_behaves_as_before(clock, stream_handles):
    fake = FakeCluster(pairs=1, clock=clock, leases=False, stream_handles=stream_handles)
    decode = fake.decode(0)
    with capture_logs() as logs, open_cluster(fake, clock) as cluster:
        with cluster.session(**LONG) as s:
            s.append(SYSTEM)
            s.send(QUESTIONS[0])
            assert s.handle is not None
            assert not s.handle.leased
            assert s.extend_handle(600) is None
            with s.tool_wait(expected_s=900) as wait:
                clock.advance(10.0)
            assert (wait.extended, wait.survived) == (False, True)
            assert "stock" in wait.decision.reason
            nxt = s.send(QUESTIONS[1])
            last = s.send(QUESTIONS[2], final=True)
        with cluster.session(**LONG) as other:
            other.append(SYSTEM)
            other.send(QUESTIONS[0])
    assert nxt.stats.handle_state is HandleState.ATTACHED
    assert nxt.stats.reused_tokens == nxt.stats.ideal_reused_tokens
    assert last.stats.handle_state is HandleState.ATTACHED
    assert len(events(logs, "agentkv.leases_unavailable")) == 1
    assert events(logs, "agentkv.release") == []
    assert events(logs, "agentkv.extend") == []
    # Known stock: D legs go out exactly as without agentkv's extension.
    assert hints(decode) == [None] * 4
    # Stock vLLM keeps both sessions' last pins until its TTL.
    assert decode.pinned_handles == 2
