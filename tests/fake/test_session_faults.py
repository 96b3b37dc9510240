"""Faults: retries, consumed handles, malformed answers, dead pairs.

A failed turn changes nothing; a handle that a failed attempt may have read is never sent again.
"""

from __future__ import annotations

import pytest
from structlog.testing import capture_logs

from agentkv import (
    BadRequestError,
    Cluster,
    ConnectionLostError,
    ContextLengthError,
    HandleState,
    MalformedResponseError,
    Message,
    NoHealthyPairError,
    RequestTimeoutError,
    RetryPolicy,
    ServerError,
    TextDelta,
)
from agentkv.testing import FakeCluster

SYSTEM = Message.system("You are a helpful assistant. Answer in one or two sentences. " * 4)
LONG = {"max_tokens": 100, "extra_body": {"min_tokens": 70}}
FAST_RETRY = RetryPolicy(max_attempts=3, initial_backoff_s=0, jitter_s=0)


pytestmark = pytest.mark.cluster(manual_clock=True, block_size=16, retry=FAST_RETRY)


def servers(fake, session):
    return fake.server(session.pair.prefill), fake.server(session.pair.decode)


def started(cluster, fake):
    """A session one turn in, with a handle stored."""
    s = cluster.session(**LONG)
    s.append(SYSTEM)
    s.send("What is the capital of France? Tell me about its history.")
    assert s.handle is not None
    return s, *servers(fake, s)


def reference_answer(clock):
    """The second turn's answer on a healthy cluster, to compare faulty runs against."""
    fake = FakeCluster(pairs=1, clock=clock)
    with Cluster.from_dict(fake.cluster_spec, transport=fake.transport, clock=clock) as cluster:
        s, _, _ = started(cluster, fake)
        return s.send("And Spain?").token_ids


@pytest.mark.parametrize("kind", ["status", "timeout", "reset"])
def test_prefill_failures_are_retried_without_resending_the_handle(cluster, fake, clock, kind):
    s, prefill, _ = started(cluster, fake)
    prefill.fail_next(kind, status=503)
    result = s.send("And Spain?")
    assert result.stats.retries == 1
    # 503: never processed; timeout/reset: prefill processed it and read the handle
    assert result.stats.handle_state is HandleState.CONSUMED
    assert fake.wrong_reuse_events == 0
    roles = [m.role for m in s.transcript.messages]
    assert roles == ["system", "user", "assistant", "user", "assistant"]
    assert result.token_ids == reference_answer(clock)
    handles_sent = [
        r["kv_transfer_params"].get("remote_block_ids") is not None for r in prefill.requests
    ]
    assert handles_sent == [False, True, False]


@pytest.mark.parametrize("kind", ["status", "timeout", "reset"])
def test_a_decode_failure_reruns_the_turn_without_the_consumed_handle(cluster, fake, clock, kind):
    s, prefill, decode = started(cluster, fake)
    decode.fail_next(kind, status=500)
    result = s.send("And Spain?")
    assert result.stats.retries == 1
    assert result.stats.handle_state is HandleState.CONSUMED
    assert len(prefill.requests) == 3  # turn 1, then turn 2 twice: the whole turn re-ran
    assert fake.wrong_reuse_events == 0
    assert result.token_ids == reference_answer(clock)
    assert len(s.transcript.messages) == 5  # no duplicate assistant message


def test_tokenize_failures_are_retried(cluster, fake):
    with cluster.session(max_tokens=10) as s:
        prefill, _ = servers(fake, s)
        prefill.fail_next("status", status=502, path="/tokenize")
        s.append(Message.user("Hi"))
        assert s.turn().stats.retries == 1


def test_retries_are_logged(cluster, fake):
    s, prefill, _ = started(cluster, fake)
    prefill.fail_next("status", status=503)
    with capture_logs() as logs:
        s.send("And Spain?")
    retries = [e for e in logs if e["event"] == "agentkv.retry"]
    assert len(retries) == 1
    assert retries[0]["error"] == "ServerError"


@pytest.mark.parametrize(
    ("kind", "error"),
    [("status", ServerError), ("timeout", RequestTimeoutError), ("reset", ConnectionLostError)],
)
def test_when_retries_run_out_the_turn_fails_and_changes_nothing(cluster, fake, kind, error):
    s, prefill, _ = started(cluster, fake)
    before = s.transcript
    prefill.fail_next(kind, times=3, status=500)
    with pytest.raises(error):
        s.send("And Spain?")
    assert s.transcript == before  # send() took its message back too
    assert s.handle is None  # an attempt may have consumed it
    assert len(s.turns) == 1
    result = s.send("And Spain?")  # the session still works
    assert len(s.transcript.messages) == 5
    assert result.stats.handle_state is HandleState.CONSUMED
    assert fake.wrong_reuse_events == 0


@pytest.mark.parametrize(
    ("leg", "kind"),
    [
        (leg, kind)
        for leg in ("prefill", "decode")
        for kind in (
            "malformed_json",
            "truncated_json",
            "no_kv_transfer_params",
            "bad_kv_transfer_params",
        )
        # A decode answer without params is a turn without a handle (test_stop_strings.py).
        if (leg, kind) != ("decode", "no_kv_transfer_params")
    ],
)
def test_malformed_answers_are_typed_errors_and_leave_the_transcript(cluster, fake, leg, kind):
    s, prefill, decode = started(cluster, fake)
    s.append(Message.user("And Spain?"))
    before = s.transcript
    (prefill if leg == "prefill" else decode).fail_next(kind)
    with pytest.raises(MalformedResponseError):
        s.turn()
    assert s.transcript == before
    assert len(prefill.requests) == 2  # not retried
    assert s.turn().text  # recovers on the next try
    assert fake.wrong_reuse_events == 0


def test_a_bad_request_is_not_retried(cluster, fake):
    with cluster.session(max_tokens=10) as s:
        prefill, _ = servers(fake, s)
        prefill.fail_next("status", status=400)
        s.append(Message.user("Hi"))
        with pytest.raises(BadRequestError) as info:
            s.turn()
        assert info.value.status_code == 400
        assert len(prefill.requests) == 1
        assert s.transcript.pending == (Message.user("Hi"),)


def test_a_prompt_over_the_model_length_is_a_context_length_error_before_any_leg(clock):
    """Known from the prompt's exact count; before, vLLM's 400 came back as a BadRequestError."""
    fake = FakeCluster(pairs=1, clock=clock, max_model_len=64)
    with (
        Cluster.from_dict(fake.cluster_spec, transport=fake.transport) as cluster,
        cluster.session() as s,
        pytest.raises(ContextLengthError) as caught,
    ):
        s.send("word " * 200)
    assert caught.value.limit == 64
    assert caught.value.prompt_tokens > 64
    assert fake.prefill(0).requests == fake.decode(0).requests == []


def test_a_dead_pair_moves_the_session_and_keeps_the_transcript(cluster, fake):
    s, prefill, _ = started(cluster, fake)
    old = s.pair
    prefill.kill()
    result = s.send("And Spain?")
    assert s.pair != old
    assert result.stats.pair == s.pair.name
    assert result.stats.handle_state is HandleState.INVALIDATED
    assert result.stats.reused_tokens == 0  # recomputed on the new pair
    assert len(s.transcript.messages) == 5
    nxt = s.send("And Italy?")
    assert nxt.stats.handle_state is HandleState.ATTACHED
    assert nxt.stats.reused_tokens == nxt.stats.ideal_reused_tokens
    assert fake.wrong_reuse_events == 0
    assert cluster.loads() == {old.name: 0, s.pair.name: 1}


def test_a_dead_decode_moves_the_session_too(cluster, fake):
    s, _, decode = started(cluster, fake)
    old = s.pair
    decode.kill()
    result = s.send("And Spain?")
    assert s.pair != old
    assert result.stats.retries >= 1


def test_no_healthy_pair_is_a_routing_error_and_recovers_after_restart(cluster, fake, clock):
    s, _, _ = started(cluster, fake)
    before = s.transcript
    for server in fake.servers:
        server.kill()
    with pytest.raises(NoHealthyPairError):
        s.send("And Spain?")
    assert s.transcript == before
    for server in fake.servers:
        server.restart()
    clock.advance(10.0)  # past the health recheck interval
    result = s.send("And Spain?")
    assert result.stats.handle_state in {HandleState.INVALIDATED, HandleState.NONE}


def test_a_cluster_with_no_reachable_pair(clock):
    spec = {
        "model": "m",
        "pairs": [
            {"name": "gone", "prefill": "http://nowhere.test:1", "decode": "http://x.test:2"}
        ],
    }
    fake = FakeCluster(pairs=1, clock=clock)
    with Cluster.from_dict(spec, transport=fake.transport, retry=FAST_RETRY) as cluster:
        assert cluster.check_health() == {"gone": False}
        with cluster.session() as s, pytest.raises(NoHealthyPairError):
            s.send("Hi")


def test_a_stream_broken_after_text_is_not_retried(cluster, fake):
    s, _, decode = started(cluster, fake)
    s.append(Message.user("And Spain?"))
    before = s.transcript
    decode.fail_next("truncated_json")
    events = []

    def consume():
        events.extend(s.stream())  # extend keeps what arrived before the error

    with pytest.raises(MalformedResponseError):
        consume()
    assert all(isinstance(e, TextDelta) for e in events)
    assert s.transcript == before
    assert s.turn().text


def test_leaving_a_stream_early_commits_nothing(cluster, fake):
    s, _, _ = started(cluster, fake)
    s.append(Message.user("And Spain?"))
    before = s.transcript
    stream = s.stream()
    assert isinstance(next(stream), TextDelta)
    stream.close()
    assert s.transcript == before
    assert s.turn().stats.handle_state is HandleState.CONSUMED
    assert fake.wrong_reuse_events == 0


def test_a_handle_dropped_because_prefill_refused_the_connection_is_released_on_decode(
    cluster, fake, clock
):
    """Prefill never got the P leg, so the handle was never read: decode must not keep it."""
    s, prefill, decode = started(cluster, fake)
    assert decode.leased_handles == 1
    prefill.kill()
    result = s.send("And Spain?")
    assert result.stats.handle_state is HandleState.INVALIDATED
    assert servers(fake, s)[0] is not prefill  # the session moved to the healthy pair
    assert decode.leased_handles == 0  # released now, not after its 480 s TTL
    assert result.token_ids == reference_answer(clock)
    assert fake.wrong_reuse_events == 0
