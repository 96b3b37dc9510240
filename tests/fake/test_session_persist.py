"""Persistence: a saved session continues in a new process, reusing its handle only while valid."""

from __future__ import annotations

import asyncio
import json
import os

import pytest

from agentkv import (
    AsyncCluster,
    AsyncSession,
    Cluster,
    HandleState,
    Message,
    RequestTimeoutError,
    RetryPolicy,
    Session,
    SessionBusyError,
    SessionError,
    SessionLoadError,
)
from agentkv._client.save_file import write_atomic
from agentkv.testing import FakeCluster
from tests.fake.old_saves import as_version_3

SYSTEM = Message.system("You are a helpful assistant. Answer in one or two sentences. " * 4)
LONG = {"max_tokens": 100, "extra_body": {"min_tokens": 70}}
QUESTIONS = [
    "What is the capital of France? Tell me about its history.",
    "And what about Spain?",
    "Which of the two is bigger?",
]
FAST_RETRY = RetryPolicy(initial_backoff_s=0, jitter_s=0)


def open_cluster(fake, clock):
    return Cluster.from_dict(
        fake.cluster_spec, transport=fake.transport, clock=clock, block_size=16, retry=FAST_RETRY
    )


def uninterrupted(clock):
    """The three answers of a session that never stopped."""
    fake = FakeCluster(pairs=1, clock=clock)
    with open_cluster(fake, clock) as cluster, cluster.session(session_id="s", **LONG) as s:
        s.append(SYSTEM)
        return [s.send(q).token_ids for q in QUESTIONS]


def two_turns_saved(fake, clock, path):
    """A process that ran two turns, saved, and died (its cluster closed, session not)."""
    with open_cluster(fake, clock) as cluster:
        s = cluster.session(session_id="s", **LONG)
        s.append(SYSTEM)
        for question in QUESTIONS[:2]:
            s.send(question)
        assert s.handle is not None
        s.save(path)
        return s.transcript, s.turns, s.pair.name


def test_a_loaded_session_reuses_the_saved_handle_and_answers_as_if_never_stopped(
    fake, clock, tmp_path
):
    path = tmp_path / "session.json"
    transcript, turns, pair = two_turns_saved(fake, clock, path)
    with open_cluster(fake, clock) as cluster, Session.load(path, cluster) as s:
        assert s.session_id == "s"
        assert s.pair.name == pair
        assert s.transcript == transcript
        assert s.turns == turns
        result = s.send(QUESTIONS[2])
        assert result.stats.handle_state is HandleState.ATTACHED
        assert result.stats.reused_tokens == result.stats.ideal_reused_tokens > 0
    assert result.token_ids == uninterrupted(clock)[2]
    assert fake.wrong_reuse_events == 0


def test_a_file_saved_before_version_3_loads_its_handle_from_decodes_params(
    fake, clock, tmp_path
):
    """Version 2 files stored the params decode sent; their lease secret still confirms."""
    path = tmp_path / "session.json"
    two_turns_saved(fake, clock, path)
    data = as_version_3(json.loads(path.read_text()))
    handle = data["handle"]
    handle["params"] = {
        "do_remote_prefill": False,
        "do_remote_decode": True,
        "remote_block_ids": handle["block_ids"],
        "remote_engine_id": handle["engine_id"],
        "remote_request_id": handle["request_id"],
        "remote_host": handle["host"],
        "remote_port": handle["port"],
        "remote_num_tokens": handle["num_tokens"],
        "remote_blocks_expiry_time": handle["server_expiry"],
        **handle.pop("extra"),
        "agentkv": {"v": 1, "pinned": True, "lease": handle.pop("lease"), "ttl_s": 60.0},
    }
    data["version"] = 2
    path.write_text(json.dumps(data))
    with open_cluster(fake, clock) as cluster, Session.load(path, cluster) as s:
        assert s.handle is not None
        assert "agentkv" not in s.handle.extra
        result = s.send(QUESTIONS[2])
        assert result.stats.handle_state is HandleState.ATTACHED
    assert result.token_ids == uninterrupted(clock)[2]
    assert fake.wrong_reuse_events == 0


def test_a_handle_past_its_deadline_by_wall_clock_is_not_attached_and_the_turn_recomputes(
    fake, clock, tmp_path
):
    path = tmp_path / "session.json"
    two_turns_saved(fake, clock, path)
    data = json.loads(path.read_text())
    data["kv"]["handle"]["deadline_wall"] = data["saved_at"] - 1.0  # the agent was down too long
    path.write_text(json.dumps(data))
    with open_cluster(fake, clock) as cluster, Session.load(path, cluster) as s:
        result = s.send(QUESTIONS[2])
    assert result.stats.handle_state is HandleState.EXPIRED
    assert result.token_ids == uninterrupted(clock)[2]
    assert fake.wrong_reuse_events == 0


def test_a_handle_decode_freed_behind_our_back_costs_a_retry_never_a_wrong_answer(
    fake, clock, tmp_path
):
    """Decode's clock ran on (its pin expired) while ours says the handle is still good."""
    path = tmp_path / "session.json"
    two_turns_saved(fake, clock, path)
    clock.advance(3600.0)  # decode's TTL ran out; the wall clock (our deadline) did not move
    with open_cluster(fake, clock) as cluster, Session.load(path, cluster) as s:
        result = s.send(QUESTIONS[2])
    # Decode is asked before the handle is attached: it no longer holds it, so no pull is tried.
    assert result.stats.handle_state is HandleState.EXPIRED
    assert result.stats.retries == 0
    assert result.token_ids == uninterrupted(clock)[2]
    assert fake.wrong_reuse_events == 0


def test_a_saved_pair_the_new_cluster_lacks_moves_the_session_and_drops_the_handle(clock, tmp_path):
    path = tmp_path / "session.json"
    two_turns_saved(FakeCluster(pairs=2, clock=clock), clock, path)
    data = json.loads(path.read_text())
    data["pair"] = data["kv"]["handle"]["pair"] = "gone"
    path.write_text(json.dumps(data))
    other = FakeCluster(pairs=1, clock=clock)
    with open_cluster(other, clock) as cluster, Session.load(path, cluster) as s:
        assert s.handle is None
        result = s.send(QUESTIONS[2])
    assert result.stats.handle_state is HandleState.INVALIDATED
    assert result.token_ids == uninterrupted(clock)[2]


def test_pending_messages_options_and_policy_survive_a_save(fake, clock, tmp_path):
    path = tmp_path / "session.json"
    with open_cluster(fake, clock) as cluster:
        s = cluster.session(max_tokens=7, temperature=None, extra_body={"min_tokens": 3})
        s.append(SYSTEM, Message.user("Hi"))
        s.save(path)
        policy = s.policy
    with open_cluster(fake, clock) as cluster, Session.load(path, cluster) as s:
        assert s.transcript.pending == (SYSTEM, Message.user("Hi"))
        assert s.policy == policy
        result = s.turn()
        assert 3 <= len(result.token_ids) <= 7


def test_the_file_is_readable_by_its_owner_only(fake, clock, tmp_path):
    path = tmp_path / "session.json"
    two_turns_saved(fake, clock, path)
    assert os.stat(path).st_mode & 0o077 == 0  # the params may hold a lease secret


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (b"{not json", "not JSON"),
        (b"\xff\xfe", "not JSON"),
        (b"[]", "not a saved agentkv session"),
        (b'{"format": "agentkv.session", "version": 99}', "version 99"),
        (b'{"format": "agentkv.session", "version": 1}', "missing"),
    ],
)
def test_a_corrupt_or_unknown_file_is_a_session_load_error(fake, clock, tmp_path, content, match):
    path = tmp_path / "session.json"
    path.write_bytes(content)
    with open_cluster(fake, clock) as cluster:
        with pytest.raises(SessionLoadError, match=match):
            Session.load(path, cluster)
        assert cluster.loads() == {"pair-0": 0, "pair-1": 0}  # no place taken on a pair


def test_a_file_with_inconsistent_fields_is_a_session_load_error(fake, clock, tmp_path):
    path = tmp_path / "session.json"
    two_turns_saved(fake, clock, path)
    data = json.loads(path.read_text())
    data["transcript"]["spans"][-1] = [0, 10**9]  # past the saved tokens
    path.write_text(json.dumps(data))
    with open_cluster(fake, clock) as cluster, pytest.raises(SessionLoadError, match="corrupt"):
        Session.load(path, cluster)
    assert issubclass(SessionLoadError, SessionError)


def test_a_missing_file_is_a_session_load_error(fake, clock, tmp_path):
    with open_cluster(fake, clock) as cluster, pytest.raises(SessionLoadError, match="no saved"):
        Session.load(tmp_path / "nope.json", cluster)


def test_a_crash_in_the_middle_of_a_write_leaves_the_previous_file(tmp_path):
    path = tmp_path / "session.json"
    path.write_bytes(b"previous")

    def chunks():
        yield b'{"half": '
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_atomic(path, chunks())
    assert path.read_bytes() == b"previous"
    assert os.listdir(tmp_path) == ["session.json"]  # no temporary file left behind


def test_a_save_that_fails_before_the_rename_keeps_the_last_good_save(
    fake, clock, tmp_path, monkeypatch
):
    path = tmp_path / "session.json"
    transcript, _, _ = two_turns_saved(fake, clock, path)
    with open_cluster(fake, clock) as cluster:
        s = Session.load(path, cluster)
        s.send(QUESTIONS[2])

        def crash(fd):
            raise OSError("power cut")

        monkeypatch.setattr(os, "fsync", crash)
        with pytest.raises(OSError, match="power cut"):
            s.save(path)
        monkeypatch.undo()
        assert os.listdir(tmp_path) == ["session.json"]
        restored = Session.load(path, cluster)
        assert restored.transcript == transcript  # the two-turn save, whole


async def test_the_async_twin_saves_and_loads_too(fake, clock, tmp_path):
    path = tmp_path / "session.json"
    async with AsyncCluster.from_dict(
        fake.cluster_spec, transport=fake.transport, clock=clock, retry=FAST_RETRY
    ) as cluster:
        s = cluster.session(session_id="s", **LONG)
        s.append(SYSTEM)
        for question in QUESTIONS[:2]:
            await s.send(question)
        s.save(path)
        async with AsyncSession.load(path, cluster) as again:
            result = await again.send(QUESTIONS[2])
    assert result.stats.handle_state is HandleState.ATTACHED
    assert result.token_ids == uninterrupted(clock)[2]


async def test_a_session_cannot_be_saved_while_a_turn_runs(fake, clock, tmp_path):
    async with AsyncCluster.from_dict(
        fake.cluster_spec, transport=fake.transport, clock=clock
    ) as cluster:
        s = cluster.session(max_tokens=5)
        s.append(Message.user("Hi"))
        stream = s.stream()
        await anext(stream)  # the turn is running
        with pytest.raises(SessionBusyError):
            s.save(tmp_path / "s.json")
        await stream.aclose()
        assert not (tmp_path / "s.json").exists()


# --- a handle from a file is never trusted on its word (issue 15, item 1) -----------------------


def _fill_decode(cluster, n=6):
    """Other tenants run long turns on the same decode node, taking whatever blocks are free."""
    for i in range(n):
        with cluster.session(session_id=f"other-{i}", max_tokens=60) as other:
            other.append(Message.user(f"Tenant {i}: write a long story about topic {i}. " * 6))
            other.turn(extra_body={"min_tokens": 50})


def test_a_handle_released_by_close_is_never_attached_after_a_load(clock, tmp_path):
    """save -> close (releases decode's pin) -> other tenants take the blocks -> load -> send."""
    fake = FakeCluster(pairs=1, clock=clock, num_kv_blocks=90)
    path = tmp_path / "session.json"
    with open_cluster(fake, clock) as cluster:
        s = cluster.session(session_id="s", **LONG)
        s.append(SYSTEM)
        for question in QUESTIONS[:2]:
            s.send(question)
        s.save(path)
        s.close()  # releases decode's pin: the file still names its blocks
        assert fake.decode(0).leased_handles == 0
        _fill_decode(cluster)
        with Session.load(path, cluster) as again:
            result = again.send(QUESTIONS[2])
    assert fake.wrong_reuse_events == 0
    assert result.stats.handle_state is not HandleState.ATTACHED
    assert "decode no longer holds" in result.stats.handle_reason
    assert result.token_ids == uninterrupted(clock)[2]


def test_a_file_loaded_twice_attaches_its_handle_at_most_once(clock, tmp_path):
    fake = FakeCluster(pairs=1, clock=clock, num_kv_blocks=90)
    path = tmp_path / "session.json"
    two_turns_saved(fake, clock, path)
    with open_cluster(fake, clock) as cluster:
        with Session.load(path, cluster) as first:
            assert first.send(QUESTIONS[2]).stats.handle_state is HandleState.ATTACHED
        _fill_decode(cluster)
        with Session.load(path, cluster) as second:  # the crash-and-reload case
            result = second.send(QUESTIONS[2])
    assert result.stats.handle_state is not HandleState.ATTACHED
    assert fake.wrong_reuse_events == 0
    assert result.token_ids == uninterrupted(clock)[2]


@pytest.mark.parametrize("prefills", [1, 2])
async def test_copies_of_one_file_racing_their_first_turns_attach_the_handle_once(
    clock, tmp_path, prefills
):
    """Two loads of one save file and the session that saved it, first turns sent at once:
    each is told decode still holds the pin, but the first pull frees what a second would read.
    Decode's claim is exclusive (it rotates the lease secret): exactly one attaches, the others
    recompute and say why. With two prefills both pulls could run in parallel."""
    fake = FakeCluster(prefills=prefills, decodes=1, clock=clock)
    path = tmp_path / "session.json"
    async with AsyncCluster.from_dict(
        fake.cluster_spec, transport=fake.transport, clock=clock, block_size=16, retry=FAST_RETRY
    ) as cluster:
        original = cluster.session(session_id="s", **LONG)
        original.append(SYSTEM)
        for question in QUESTIONS[:2]:
            await original.send(question)
        original.save(path)
        copies = [original, AsyncSession.load(path, cluster), AsyncSession.load(path, cluster)]
        results = await asyncio.gather(*(c.send(QUESTIONS[2]) for c in copies))
        for copy in copies:
            await copy.aclose()
    states = [r.stats.handle_state for r in results]
    assert states.count(HandleState.ATTACHED) == 1, states
    for result in results:
        if result.stats.handle_state is not HandleState.ATTACHED:
            assert "another copy of this session claimed it" in result.stats.handle_reason
    assert fake.wrong_reuse_events == 0
    expected = uninterrupted(clock)[2]
    assert all(r.token_ids == expected for r in results)
    assert fake.decode(0).pinned_handles == 0


def test_on_stock_vllm_a_loaded_handle_is_never_attached(clock, tmp_path):
    """Stock decode has no lease to ask about: a handle from a file cannot be confirmed."""
    fake = FakeCluster(pairs=1, clock=clock, leases=False, stream_handles=False)
    path = tmp_path / "session.json"
    two_turns_saved(fake, clock, path)
    with open_cluster(fake, clock) as cluster, Session.load(path, cluster) as s:
        result = s.send(QUESTIONS[2])
    assert result.stats.handle_state is HandleState.INVALIDATED
    assert "stock vLLM" in result.stats.handle_reason
    assert result.token_ids == uninterrupted(clock)[2]
    assert fake.wrong_reuse_events == 0


def test_a_consumed_or_released_handle_is_never_saved(fake, clock, tmp_path):
    once = RetryPolicy(max_attempts=1)
    with Cluster.from_dict(
        fake.cluster_spec, transport=fake.transport, clock=clock, block_size=16, retry=once
    ) as cluster:
        s = cluster.session(session_id="s", **LONG)
        s.append(SYSTEM)
        s.send(QUESTIONS[0])
        s.append(Message.user(QUESTIONS[1]))
        fake.decode(0).fail_next("timeout")  # the P leg read (consumed) the handle; D's answer lost
        with pytest.raises(RequestTimeoutError):
            s.turn(max_tokens=100)
        assert s.handle is None
        s.save(tmp_path / "a.json")
        s.close()
        s.save(tmp_path / "b.json")
    for name in ("a.json", "b.json"):
        assert json.loads((tmp_path / name).read_text())["kv"]["kind"] == "none"


def test_a_file_saved_for_another_model_is_a_session_load_error(fake, clock, tmp_path):
    path = tmp_path / "session.json"
    two_turns_saved(fake, clock, path)
    other = FakeCluster(pairs=2, clock=clock, model="another-model")
    with open_cluster(other, clock) as cluster:
        with pytest.raises(SessionLoadError, match="another-model"):
            Session.load(path, cluster)
        assert cluster.loads() == {"pair-0": 0, "pair-1": 0}


def test_a_file_saved_under_another_tokenizer_is_a_session_load_error(fake, clock, tmp_path):
    """Same model name, another tokenizer or chat template: the saved token ids mean nothing."""
    path = tmp_path / "session.json"
    two_turns_saved(fake, clock, path)
    data = json.loads(path.read_text())
    assert data["model"] == fake.model
    assert isinstance(data["tokenizer"], str)
    data["tokenizer"] = "0123456789abcdef"  # what another tokenizer's fingerprint looks like
    path.write_text(json.dumps(data))
    with open_cluster(fake, clock) as cluster, Session.load(path, cluster) as s:
        with pytest.raises(SessionLoadError, match="tokenizer"):
            s.send(QUESTIONS[2])
        assert len(s.turns) == 2  # nothing sent, nothing committed
    assert fake.wrong_reuse_events == 0


def test_a_live_session_whose_saved_copy_consumed_its_handle_never_attaches_it(clock, tmp_path):
    """Found by the fuzzer (tests/fake/fuzz_corpus): save -> load a copy -> the copy's turn
    consumes the handle (decode frees it) -> the original, still open, attached it and pulled
    freed blocks. After a save the original confirms its handle with decode like a loaded one."""
    fake = FakeCluster(pairs=1, clock=clock, num_kv_blocks=90)
    path = tmp_path / "session.json"
    with open_cluster(fake, clock) as cluster:
        original = cluster.session(session_id="s", **LONG)
        original.append(SYSTEM)
        for question in QUESTIONS[:2]:
            original.send(question)
        original.save(path)
        with Session.load(path, cluster) as copy:
            assert copy.send(QUESTIONS[2]).stats.handle_state is HandleState.ATTACHED
        _fill_decode(cluster)
        result = original.send(QUESTIONS[2])
        original.close()
    assert fake.wrong_reuse_events == 0
    assert result.stats.handle_state is not HandleState.ATTACHED
    assert result.token_ids == uninterrupted(clock)[2]


def test_a_live_session_whose_saved_copy_was_closed_early_never_attaches_the_released_handle(
    clock, tmp_path
):
    """An early release, not an expiry: the copy's close frees the pin the original still names."""
    fake = FakeCluster(pairs=1, clock=clock, num_kv_blocks=90)
    path = tmp_path / "session.json"
    with open_cluster(fake, clock) as cluster:
        original = cluster.session(session_id="s", **LONG)
        original.append(SYSTEM)
        for question in QUESTIONS[:2]:
            original.send(question)
        original.save(path)
        Session.load(path, cluster).close()  # releases decode's pin long before its TTL
        assert fake.decode(0).leased_handles == 0
        _fill_decode(cluster)
        result = original.send(QUESTIONS[2])
        original.close()
    assert fake.wrong_reuse_events == 0
    assert "decode no longer holds" in result.stats.handle_reason
    assert result.token_ids == uninterrupted(clock)[2]


def test_after_a_save_the_original_still_attaches_a_handle_decode_confirms(fake, clock, tmp_path):
    with open_cluster(fake, clock) as cluster, cluster.session(session_id="s", **LONG) as s:
        s.append(SYSTEM)
        for question in QUESTIONS[:2]:
            s.send(question)
        s.save(tmp_path / "session.json")
        result = s.send(QUESTIONS[2])
    assert result.stats.handle_state is HandleState.ATTACHED
    assert fake.wrong_reuse_events == 0
