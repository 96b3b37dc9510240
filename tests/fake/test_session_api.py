"""The session API: lifecycle, bad input, sync and async twins, cluster files."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest

from agentkv import (
    AsyncCluster,
    CachePolicy,
    Cluster,
    ConfigError,
    HandleState,
    InvalidMessageError,
    Message,
    Pair,
    SessionBusyError,
    SessionClosedError,
    TextDelta,
    TurnResult,
)
from agentkv.testing import FakeCluster, ManualClock


def test_a_closed_session_refuses_everything(cluster):
    s = cluster.session()
    s.close()
    for call in (
        lambda: s.append(Message.user("x")),
        lambda: s.send("x"),
        s.turn,
        s.stream,
        lambda: s.fork(keep=0),
        lambda: s.append_history([]),
    ):
        with pytest.raises(SessionClosedError):
            call()
    s.close()  # closing twice is fine


@pytest.mark.parametrize(
    "bad",
    [
        {"role": "robot", "content": "hi"},
        {"role": "user", "content": ""},
        {"role": "user", "content": None},
        {"role": "user", "content": 3},
        {"role": "user"},
        42,
    ],
)
def test_bad_messages_are_rejected_and_nothing_is_appended(cluster, bad):
    with cluster.session() as s:
        with pytest.raises(InvalidMessageError):
            s.append(Message.user("fine"), bad)
        assert s.transcript.pending == ()


def test_a_turn_needs_something_to_send(cluster):
    with cluster.session() as s:
        with pytest.raises(InvalidMessageError, match="nothing to send"):
            s.turn()
        s.append(Message.user("Hi"))
        s.turn()
        with pytest.raises(InvalidMessageError):
            s.turn()


def test_openai_style_dicts_are_accepted(cluster):
    with cluster.session(max_tokens=8) as s:
        s.append({"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"})
        result = s.turn()
        assert s.transcript.messages[-1] == result.message
        assert [m.role for m in s.transcript.messages] == ["system", "user", "assistant"]


def test_transcript_view_is_a_read_only_snapshot(cluster):
    with cluster.session(max_tokens=8) as s:
        s.send("Hi")
        view = s.transcript
        with pytest.raises(dataclasses.FrozenInstanceError):
            view.token_ids = ()  # type: ignore[misc]
        s.send("Again")
        assert len(view.messages) == 2
        assert len(s.transcript.messages) == 4
        spans = s.transcript.spans
        assert spans[-1].end == len(s.transcript.token_ids)


def test_turn_overrides_reach_the_decode_request(cluster, fake):
    with cluster.session(max_tokens=8, temperature=0.0) as s:
        s.append(Message.user("Hi"))
        s.turn(max_tokens=5, temperature=0.5, extra_body={"seed": 7})
        decode = fake.server(s.pair.decode)
    body = decode.requests[-1]
    assert (body["max_tokens"], body["temperature"], body["seed"]) == (5, 0.5, 7)
    with cluster.session() as s, pytest.raises(TypeError):
        s.turn(max_token=5)  # type: ignore[call-arg]


def test_tool_calls_come_back_typed_and_feed_tool_results(cluster, fake):
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    with cluster.session(tools=tools, max_tokens=60) as s:
        s.append(Message.user("Weather in Paris?"))
        result = s.turn(tool_choice="required")
        assert result.tool_calls
        call = result.tool_calls[0]
        assert call.name == "get_weather"
        json.loads(call.arguments)
        s.append(Message.tool('{"temp": 21}', tool_call_id=call.id))
        answer = s.turn(max_tokens=20)
        assert answer.stats.handle_state is HandleState.ATTACHED
        prefill = fake.server(s.pair.prefill)
    first, second = (r["kv_transfer_params"]["prompt_token_ids"] for r in prefill.requests)
    held = first + list(result.token_ids)
    assert second[: len(held)] == held  # the tool-call turn's exact tokens, then the result
    assert fake.wrong_reuse_events == 0


def test_sessions_spread_over_pairs_and_forks_stay_with_their_parent(cluster):
    sessions = [cluster.session() for _ in range(8)]
    loads = cluster.loads()
    assert sum(loads.values()) == 8
    assert max(loads.values()) <= 5  # ceil(1.25 * 8 / 2)
    child = sessions[0].fork(messages=[Message.user("x")])
    assert child.pair == sessions[0].pair
    for s in [*sessions, child]:
        s.close()
    assert cluster.loads() == {"pair-0": 0, "pair-1": 0}


def test_placement_is_stable_for_a_session_id(fake):
    pairs = []
    for _ in range(2):
        with (
            Cluster.from_dict(fake.cluster_spec, transport=fake.transport) as cluster,
            cluster.session(session_id="user-42") as s,
        ):
            pairs.append(s.pair.name)
    assert pairs[0] == pairs[1]


async def test_the_async_twin_gives_the_same_answers(fake):
    async with (
        AsyncCluster.from_dict(fake.cluster_spec, transport=fake.transport) as cluster,
        cluster.session(session_id="a", max_tokens=20) as s,
    ):
        first = await s.send("What is the capital of France?")
        s.append(Message.user("And Spain?"))
        events = [event async for event in s.stream()]
    other = FakeCluster(pairs=2, clock=ManualClock())
    with (
        Cluster.from_dict(other.cluster_spec, transport=other.transport) as sync_cluster,
        sync_cluster.session(session_id="a", max_tokens=20) as s,
    ):
        again = s.send("What is the capital of France?")
        s.append(Message.user("And Spain?"))
        sync_events = list(s.stream())
    assert first.token_ids == again.token_ids
    assert isinstance(events[-1], TurnResult)
    assert events[-1].token_ids == sync_events[-1].token_ids
    assert all(isinstance(e, TextDelta) for e in events[:-1])


async def test_one_turn_at_a_time_per_session(fake):
    async with (
        AsyncCluster.from_dict(fake.cluster_spec, transport=fake.transport) as cluster,
        cluster.session(max_tokens=10) as s,
    ):
        s.append(Message.user("Hi"))
        s.append(Message.user("there"))
        first = asyncio.ensure_future(s.turn())
        await asyncio.sleep(0)
        with pytest.raises(SessionBusyError):
            await s.turn()
        await first
        assert not s.transcript.pending


async def test_a_cancelled_turn_changes_nothing(fake):
    async with (
        AsyncCluster.from_dict(fake.cluster_spec, transport=fake.transport) as cluster,
        cluster.session(max_tokens=10) as s,
    ):
        s.append(Message.user("Hi"))
        task = asyncio.ensure_future(s.turn())
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert s.transcript.messages == ()
        assert s.transcript.pending == (Message.user("Hi"),)
        assert (await s.turn()).text


def test_cluster_files(tmp_path, fake):
    path = tmp_path / "cluster.json"
    spec = {**fake.cluster_spec, "block_size": 16}
    spec["pairs"][0]["prefill_pid"] = 123  # agentkv up writes more than the SDK needs
    path.write_text(json.dumps(spec))
    with Cluster.from_file(path, transport=fake.transport) as cluster:
        assert [p.name for p in cluster.pairs] == ["pair-0", "pair-1"]
        assert cluster.model == fake.model
        with cluster.session(max_tokens=5) as s:
            assert s.send("Hi").text
    with pytest.raises(ConfigError, match="no cluster file"):
        Cluster.from_file(tmp_path / "missing.json")
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="unreadable"):
        Cluster.from_file(path)


@pytest.mark.parametrize(
    "spec",
    [
        [],
        {"pairs": []},
        {"model": "m", "pairs": []},
        {"model": "m", "pairs": ["x"]},
        {"model": "m", "pairs": [{"name": "a", "prefill": "ftp://x", "decode": "http://y"}]},
        {"model": "m", "pairs": [{"name": "a", "prefill": "http://x"}]},
        {
            "model": "m",
            "pairs": [
                {"name": "a", "prefill": "http://x", "decode": "http://y"},
                {"name": "a", "prefill": "http://z", "decode": "http://w"},
            ],
        },
    ],
)
def test_bad_cluster_specs_are_config_errors(spec):
    with pytest.raises(ConfigError):
        Cluster.from_dict(spec)


def test_explicit_pairs_and_options(fake):
    pairs = [
        Pair(name=p["name"], prefill=p["prefill"] + "/", decode=p["decode"])
        for p in fake.cluster_spec["pairs"]
    ]
    policy = CachePolicy(ttl_margin_s=60)
    with (
        Cluster(pairs, model=fake.model, transport=fake.transport, policy=policy) as cluster,
        cluster.session() as s,
    ):
        assert s.policy == policy
        assert not s.pair.prefill.endswith("/")
    with pytest.raises(ConfigError):
        Cluster(pairs, model="m", block_size=0)


def test_sessions_of_a_closed_cluster_are_closed(fake):
    cluster = Cluster.from_dict(fake.cluster_spec, transport=fake.transport)
    s = cluster.session()
    s.append(Message.user("Hi"))
    cluster.close()
    cluster.close()  # idempotent
    assert s.closed
    with pytest.raises(SessionClosedError):
        s.turn()
    with pytest.raises(SessionClosedError):
        cluster.session()
    s.close()


async def test_async_sessions_of_a_closed_cluster_are_closed(fake):
    cluster = AsyncCluster.from_dict(fake.cluster_spec, transport=fake.transport)
    s = cluster.session()
    s.append(Message.user("Hi"))
    await cluster.aclose()
    with pytest.raises(SessionClosedError):
        await s.turn()
