"""Appends while a turn runs: queued for the next turn or refused, never half-applied."""

from __future__ import annotations

import asyncio

import pytest

from agentkv import (
    AsyncCluster,
    HandleState,
    Message,
    RetryPolicy,
    ServerError,
    SessionBusyError,
)
from agentkv.testing import FakeCluster, ManualClock

SYSTEM = Message.system("You are a helpful assistant. Answer in one or two sentences. " * 3)


def open_cluster(fake: FakeCluster, **options: object) -> AsyncCluster:
    return AsyncCluster.from_dict(
        fake.cluster_spec, transport=fake.transport, block_size=16, **options
    )


async def running(task: asyncio.Task[object], session: object) -> None:
    """Let ``task`` start its turn and suspend on the server (the prompt render first)."""
    for _ in range(3):
        await asyncio.sleep(0)
    assert session._state.busy  # type: ignore[attr-defined]
    assert not task.done()


async def test_a_message_appended_while_a_turn_runs_is_queued_for_the_next_turn():
    fake = FakeCluster(pairs=1, clock=ManualClock())
    async with open_cluster(fake) as cluster, cluster.session(max_tokens=20) as s:
        s.append(SYSTEM, Message.user("What is the capital of France?"))
        turn = asyncio.create_task(s.turn())
        await running(turn, s)
        s.append(Message.user("And of Spain?"))  # lands while the prompt is being rendered
        first = await turn
        roles = [m.role for m in s.transcript.messages]
        assert roles == ["system", "user", "assistant"]
        assert s.transcript.pending == (Message.user("And of Spain?"),)
        second = await s.turn()
    assert first.stats.turn == 1
    assert second.stats.handle_state is HandleState.ATTACHED
    assert [m.role for m in s.transcript.messages][-2:] == ["user", "assistant"]
    assert fake.wrong_reuse_events == 0


async def test_append_history_while_a_turn_runs_is_refused_and_changes_nothing():
    fake = FakeCluster(pairs=1, clock=ManualClock())
    async with open_cluster(fake) as cluster, cluster.session(max_tokens=20) as s:
        s.append(SYSTEM, Message.user("Hi"))
        turn = asyncio.create_task(s.turn())
        await running(turn, s)
        with pytest.raises(SessionBusyError):
            s.append_history([SYSTEM, Message.user("Hi"), Message.user("More")])
        await turn
        assert s.transcript.pending == ()
        assert len(s.transcript.messages) == 3


async def test_a_failed_send_takes_back_only_its_own_message():
    """A message appended while ``send`` ran stays queued when that send fails."""
    fake = FakeCluster(pairs=1, clock=ManualClock())
    once = RetryPolicy(max_attempts=1)
    async with open_cluster(fake, retry=once) as cluster, cluster.session(max_tokens=20) as s:
        s.append(SYSTEM)
        fake.decode(0).fail_next("status", status=503)
        send = asyncio.create_task(s.send("Hi"))
        await running(send, s)
        s.append(Message.user("Queued meanwhile"))
        with pytest.raises(ServerError):
            await send
        assert s.transcript.pending == (SYSTEM, Message.user("Queued meanwhile"))


async def test_leaving_an_async_stream_early_frees_the_session_for_the_next_turn_at_once():
    fake = FakeCluster(pairs=1, clock=ManualClock())
    async with open_cluster(fake) as cluster:
        s = cluster.session(max_tokens=40)
        s.append(SYSTEM, Message.user("Tell me a long story."))
        stream = s.stream(extra_body={"min_tokens": 30})
        async for _ in stream:
            break  # the caller lost interest; ``stream`` is still referenced, never collected
        result = await s.send("Something shorter, then.")
        assert [m.role for m in s.transcript.messages] == ["system", "user", "user", "assistant"]
        assert result.stats.turn == 1  # the abandoned turn committed nothing
        s.append(Message.user("Go on."))
        async for _ in s.stream():
            break
        await s.aclose()  # closing also ends the abandoned stream
        assert not s._state.busy
