"""A session handed over between copies: snapshot, restore, detach; and the public calls the apps
use instead of reaching into a session (a proxy replica, the agent loop)."""

from __future__ import annotations

import asyncio
import json

import pytest

from agentkv import (
    AsyncCluster,
    Cluster,
    HandleState,
    Message,
    RetryPolicy,
    Session,
    SessionBusyError,
    SessionClosedError,
    SessionLoadError,
)
from agentkv.testing import FakeCluster

SYSTEM = Message.system("You are a helpful assistant. Answer in one or two sentences. " * 4)
QUESTIONS = ["What is the capital of France?", "And what about Spain?", "Which is bigger?"]
FAST_RETRY = RetryPolicy(initial_backoff_s=0, jitter_s=0)


def open_cluster(fake, clock):
    return Cluster.from_dict(
        fake.cluster_spec, transport=fake.transport, clock=clock, block_size=16, retry=FAST_RETRY
    )


def two_turns(cluster):
    s = cluster.session(session_id="s", max_tokens=40)
    s.append(SYSTEM)
    for question in QUESTIONS[:2]:
        s.send(question)
    assert s.handle is not None
    return s


def pinned(fake):
    return sum(fake.decode(i).pinned_handles for i in range(2))


def uninterrupted(clock):
    """The third turn of a session that never changed hands."""
    cluster = open_cluster(FakeCluster(pairs=2, clock=clock), clock)
    with cluster, two_turns(cluster) as s:
        return s.send(QUESTIONS[2])


def test_a_snapshot_is_json_and_a_restored_session_continues_with_the_handle(fake, clock):
    with open_cluster(fake, clock) as cluster:
        s = two_turns(cluster)
        data = json.loads(json.dumps(s.snapshot()))  # what a shared store keeps
        s.detach()
    with open_cluster(fake, clock) as cluster, cluster.restore_session(data) as again:
        assert isinstance(again, Session)
        assert again.session_id == "s"
        assert again.transcript == s.transcript
        assert again.turns == s.turns
        result = again.send(QUESTIONS[2])
    assert result.stats.handle_state is HandleState.ATTACHED
    expected = uninterrupted(clock)
    assert result.token_ids == expected.token_ids
    assert result.stats.reused_tokens == expected.stats.reused_tokens > 0
    assert fake.wrong_reuse_events == 0


def test_snapshot_bytes_restore_the_same_session_and_continue_with_the_handle(fake, clock):
    """The compact form a shared store keeps: the JSON with the token ids as raw int32."""
    with open_cluster(fake, clock) as cluster:
        s = two_turns(cluster)
        s.append(Message.user("queued, not yet sent"))
        blob = s.snapshot_bytes()
        as_dict = s.snapshot()
        expected = s.transcript
        s.discard_pending()
        s.detach()
    assert isinstance(blob, bytes)
    with open_cluster(fake, clock) as cluster:
        from_bytes = cluster.restore_session(blob)
        from_dict = cluster.restore_session(as_dict)
        assert from_bytes.transcript == from_dict.transcript == expected
        assert from_bytes.transcript.pending == (Message.user("queued, not yet sent"),)
        assert from_bytes.turns == from_dict.turns == s.turns
        # The same handle (its times are converted through each restore's own wall clock).
        assert from_bytes.handle is not None
        assert from_dict.handle is not None
        assert from_bytes.handle.request_id == from_dict.handle.request_id
        assert from_bytes.handle.block_ids == from_dict.handle.block_ids
        from_dict.detach()
        from_bytes.discard_pending()
        with from_bytes:
            result = from_bytes.send(QUESTIONS[2])
    assert result.stats.handle_state is HandleState.ATTACHED
    assert result.token_ids == uninterrupted(clock).token_ids
    assert fake.wrong_reuse_events == 0


@pytest.mark.parametrize(
    ("damage", "match"),
    [
        (lambda blob: b"{" + blob[1:], "not a saved agentkv session"),
        (lambda blob: blob[:-1], "bytes of token ids"),
        (lambda blob: blob + b"\0\0\0\0", "bytes of token ids"),
        (lambda blob: blob[:30], "corrupt"),
    ],
)
def test_damaged_snapshot_bytes_are_a_session_load_error(fake, clock, damage, match):
    with open_cluster(fake, clock) as cluster:
        s = two_turns(cluster)
        blob = s.snapshot_bytes()
        with pytest.raises(SessionLoadError, match=match):
            cluster.restore_session(damage(blob))
        s.close()


def test_detach_keeps_the_pin_on_decode_and_frees_the_place_close_releases_it(fake, clock):
    with open_cluster(fake, clock) as cluster:
        kept = two_turns(cluster)
        assert cluster.loads()[kept.pair.name] == 1
        kept.detach()
        kept.detach()  # idempotent
        assert kept.closed
        assert kept.handle is None
        assert cluster.loads()[kept.pair.name] == 0
        assert pinned(fake) == 1  # the copy holding the snapshot will send or release it
        with pytest.raises(SessionClosedError):
            kept.send("more")
        closed = cluster.session(session_id="c", max_tokens=40)
        closed.send("Hello there.")
        assert pinned(fake) == 2
        closed.close()
        assert pinned(fake) == 1  # a close releases the pin


async def test_the_async_twin_restores_from_a_snapshot_and_loads_from_a_file(fake, clock, tmp_path):
    async with AsyncCluster.from_dict(
        fake.cluster_spec, transport=fake.transport, clock=clock, retry=FAST_RETRY
    ) as cluster:
        s = cluster.session(session_id="s", max_tokens=40)
        s.append(SYSTEM)
        await s.send(QUESTIONS[0])
        s.save(tmp_path / "s.json")
        snapshot = s.snapshot(wall=123.0)
        assert snapshot["saved_at"] == 123.0
        s.detach()
        restored = cluster.restore_session(snapshot)
        assert restored.transcript == s.transcript
        restored.detach()
        async with cluster.load_session(tmp_path / "s.json") as loaded:
            result = await loaded.send(QUESTIONS[1])
    assert result.stats.handle_state is HandleState.ATTACHED


def test_load_session_refuses_a_corrupt_snapshot_and_a_closed_cluster(fake, clock, tmp_path):
    cluster = open_cluster(fake, clock)
    with pytest.raises(SessionLoadError):
        cluster.restore_session({"format": "agentkv.session", "version": 2})
    cluster.close()
    with pytest.raises(SessionClosedError):
        cluster.load_session(tmp_path / "none.json")
    with pytest.raises(SessionClosedError):
        cluster.restore_session({})


def test_discard_pending_forgets_what_a_failed_turn_left_queued(fake, clock):
    with open_cluster(fake, clock) as cluster, cluster.session(max_tokens=20) as s:
        s.append(SYSTEM, Message.user("Hi"))
        assert s.discard_pending() == 2
        assert s.transcript.pending == ()
        assert s.discard_pending() == 0
        s.append(Message.user("Hello again"))
        s.turn()
        assert [m.role for m in s.transcript.messages] == ["user", "assistant"]


async def test_discard_pending_while_a_turn_runs_is_refused(fake, clock):
    async with (
        AsyncCluster.from_dict(fake.cluster_spec, transport=fake.transport, clock=clock) as cluster,
        cluster.session(max_tokens=20) as s,
    ):
        s.append(Message.user("Hi"))
        turn = asyncio.create_task(s.turn())
        for _ in range(3):
            await asyncio.sleep(0)
        assert not turn.done()
        with pytest.raises(SessionBusyError):
            s.discard_pending()
        await turn
        assert s.transcript.pending == ()


def test_a_session_tells_the_clock_its_handle_deadlines_are_on(fake, clock):
    with open_cluster(fake, clock) as cluster, cluster.session(max_tokens=20) as s:
        assert s.clock is clock
        s.send("Hi")
        assert s.handle is not None
        left = s.handle.deadline - s.clock()
        clock.advance(10.0)
        assert s.handle.deadline - s.clock() == pytest.approx(left - 10.0)
