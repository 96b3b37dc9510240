"""Sessions against the fake P/D cluster: KV threaded from turn to turn, exactly and only safely."""

from __future__ import annotations

import pytest
from structlog.testing import capture_logs

from agentkv import (
    CachePolicy,
    Cluster,
    HandleState,
    Message,
    PrefixDivergedError,
    RetryPolicy,
    TextDelta,
    TurnResult,
)
from agentkv.testing import FakeCluster

SYSTEM = Message.system("You are a helpful assistant. Answer in one or two sentences. " * 4)
QUESTIONS = [
    "What is the capital of France? Explain the history of the city in detail please.",
    "And what about Spain?",
    "Which of the two is bigger?",
    "Thanks. Summarize everything so far.",
]


NO_BACKOFF = RetryPolicy(initial_backoff_s=0, jitter_s=0)
pytestmark = pytest.mark.cluster(manual_clock=True, block_size=16, retry=NO_BACKOFF)


def open_cluster(fake, clock, **kwargs):
    kwargs.setdefault("retry", NO_BACKOFF)
    return Cluster.from_dict(
        fake.cluster_spec, transport=fake.transport, clock=clock, block_size=16, **kwargs
    )


def servers(fake, session):
    return fake.server(session.pair.prefill), fake.server(session.pair.decode)


# Decode's turn-end KV is pulled only when prefill lacks at least kv_recompute_threshold (64) of
# its tokens: turns here generate enough for that (prefill's own cache covers the rest).
LONG = {"max_tokens": 100, "extra_body": {"min_tokens": 70}}


def converse(cluster, *, policy=None):
    with cluster.session(session_id="fixed", policy=policy, **LONG) as s:
        s.append(SYSTEM)
        results = [s.send(q) for q in QUESTIONS]
        return results, s.transcript


def test_turns_after_the_first_reuse_exactly_the_ideal(cluster, fake):
    """Turn N+1's prefill reports as cached exactly turn N's prompt + generated - 1 tokens."""
    results, _ = converse(cluster)
    first, *later = [r.stats for r in results]
    assert first.handle_state is HandleState.NONE
    assert first.reused_tokens == 0
    for stats in later:
        assert stats.handle_state is HandleState.ATTACHED
        assert stats.ideal_reused_tokens > 0
        assert stats.reused_tokens == stats.ideal_reused_tokens
        assert 0 < stats.pulled_tokens <= stats.reused_tokens
        assert stats.computed_tokens == stats.prompt_tokens - stats.reused_tokens
    assert fake.wrong_reuse_events == 0


def test_answers_are_identical_with_and_without_reuse(clock):
    """Greedy outputs do not depend on where the KV came from (the fake's output follows its KV)."""
    with open_cluster(FakeCluster(pairs=1, clock=clock), clock) as cluster:
        reused, transcript = converse(cluster)
    never = CachePolicy(min_reuse_tokens=10**9)
    with open_cluster(FakeCluster(pairs=1, clock=clock), clock) as cluster:
        recomputed, transcript_again = converse(cluster, policy=never)
    assert [r.stats.handle_state for r in recomputed[1:]] == [HandleState.BELOW_THRESHOLD] * 3
    assert [r.token_ids for r in reused] == [r.token_ids for r in recomputed]
    assert [r.text for r in reused] == [r.text for r in recomputed]
    assert transcript.token_ids == transcript_again.token_ids


def test_every_prompt_extends_what_decode_holds(cluster, fake):
    """The ids sent to prefill on turn N+1 start with turn N's prompt ids + generated ids."""
    with cluster.session(max_tokens=40) as s:
        s.append(SYSTEM)
        results = [s.send(q) for q in QUESTIONS[:3]]
        prefill, decode = servers(fake, s)
    sent = [body["kv_transfer_params"]["prompt_token_ids"] for body in prefill.requests]
    for before, after, result in zip(sent, sent[1:], results, strict=False):
        held = before + list(result.token_ids)
        assert after[: len(held)] == held
    # the decode leg gets the same ids and asks for the generated ones back
    assert [b["kv_transfer_params"]["prompt_token_ids"] for b in decode.requests] == sent
    assert all(b["return_token_ids"] is True for b in decode.requests)


def test_a_streamed_turn_stores_the_handle_and_the_next_turn_reuses_it(cluster, fake):
    with cluster.session(**LONG) as s:
        s.append(SYSTEM, Message.user(QUESTIONS[0]))
        events = list(s.stream())
        *deltas, result = events
        assert all(isinstance(d, TextDelta) for d in deltas)
        assert isinstance(result, TurnResult)
        assert "".join(d.text for d in deltas) == result.text
        assert s.handle is not None
        assert s.handle.num_tokens == result.stats.prompt_tokens + len(result.token_ids) - 1
        nxt = s.send(QUESTIONS[1])
    assert nxt.stats.handle_state is HandleState.ATTACHED
    assert nxt.stats.reused_tokens == nxt.stats.ideal_reused_tokens
    assert fake.wrong_reuse_events == 0


def test_a_streams_first_delta_says_what_the_turn_did_with_the_handle(cluster, fake):
    """A caller answering before the turn ends (the proxy's headers) reads the real decision."""
    with cluster.session(**LONG) as s:
        s.append(SYSTEM)
        states = []
        for question in QUESTIONS[:2]:
            s.append(Message.user(question))
            *deltas, result = list(s.stream())
            assert [d.handle_state for d in deltas[1:]] == [None] * (len(deltas) - 1)
            assert deltas[0].handle_state is result.stats.handle_state
            states.append(deltas[0].handle_state)
    assert states == [HandleState.NONE, HandleState.ATTACHED]


def test_streamed_and_plain_turns_give_the_same_answer(clock):
    outputs = []
    for stream in (False, True):
        with (
            open_cluster(FakeCluster(pairs=1, clock=clock), clock) as cluster,
            cluster.session(max_tokens=30) as s,
        ):
            s.append(SYSTEM, Message.user(QUESTIONS[0]))
            result = list(s.stream())[-1] if stream else s.turn()
            outputs.append(result.token_ids)
    assert outputs[0] == outputs[1]


def test_an_expired_handle_is_not_attached(cluster, fake, clock):
    with cluster.session(**LONG) as s:
        s.append(SYSTEM)
        s.send(QUESTIONS[0])
        assert s.handle is not None
        clock.advance(460.0)  # past our deadline (480 s - 30 s margin), before the server's
        result = s.send(QUESTIONS[1])
    assert result.stats.handle_state is HandleState.EXPIRED
    assert "deadline" in result.stats.handle_reason
    assert result.stats.pulled_tokens == 0
    assert fake.wrong_reuse_events == 0


def test_a_handle_below_the_recompute_threshold_is_not_attached(cluster):
    with cluster.session(max_tokens=2) as s:
        s.append(Message.user("Hi"))
        s.turn()
        assert s.handle is not None
        assert s.handle.num_tokens < 64
        result = s.send("Again")
    assert result.stats.handle_state is HandleState.BELOW_THRESHOLD


def test_an_edited_history_is_refused_and_never_sends_the_handle(cluster, fake):
    with cluster.session(**LONG) as s:
        s.append(SYSTEM)
        s.send(QUESTIONS[0])
        prefill, _ = servers(fake, s)
        sent_before = len(prefill.requests)
        edited = [m.to_openai() for m in s.transcript.messages]
        edited[1]["content"] = "What is the capital of Germany?"
        with pytest.raises(PrefixDivergedError):
            s.append_history([*edited, {"role": "user", "content": QUESTIONS[1]}])
        assert len(prefill.requests) == sent_before
        assert s.transcript.pending == ()
        # the way forward is a fork: a new transcript, no handle
        child = s.fork(messages=[*edited, {"role": "user", "content": QUESTIONS[1]}])
        with child:
            result = child.turn()
    assert result.stats.handle_state is HandleState.NONE
    assert "remote_block_ids" not in {
        k for k, v in prefill.requests[-1]["kv_transfer_params"].items() if v is not None
    }
    assert fake.wrong_reuse_events == 0


def test_append_history_appends_only_the_new_tail(cluster):
    with cluster.session(max_tokens=20) as s:
        s.append(SYSTEM)
        s.send(QUESTIONS[0])
        history = [m.to_openai() for m in s.transcript.messages]
        assert s.append_history([*history, {"role": "user", "content": "more"}]) == 1
        assert s.turn().stats.handle_state is not HandleState.DIVERGED


def test_changing_tools_mid_session_is_a_divergence(cluster):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    with cluster.session(max_tokens=10) as s:
        s.append(Message.user("Hi"))
        s.turn()
        s.append(Message.user("Use a tool"))
        with pytest.raises(PrefixDivergedError, match="tools"):
            s.turn(tools=tools)
        assert len(s.transcript.pending) == 1


def test_a_fork_keeps_exact_tokens_and_prefills_from_the_local_cache(cluster, fake):
    with cluster.session(**LONG) as s:
        s.append(SYSTEM)
        s.send(QUESTIONS[0])
        s.send(QUESTIONS[1])
        child = s.fork(keep=3)  # system, user, assistant
        assert child.pair == s.pair
        assert child.handle is None
        assert (
            child.transcript.token_ids == s.transcript.token_ids[: len(child.transcript.token_ids)]
        )
        with child:
            result = child.send("Tell me something else.")
    assert result.stats.handle_state is HandleState.NONE
    assert result.stats.reused_tokens > 0  # the parent's prompts are in prefill's prefix cache
    assert fake.wrong_reuse_events == 0


def test_rerendering_template_sessions_stay_token_exact(clock):
    """With a template that drops past reasoning, reuse stays exact (no wrong reuse)."""
    fake = FakeCluster(pairs=1, clock=clock, chat_template="rerender")
    with open_cluster(fake, clock) as cluster:
        results, _ = converse(cluster)
    assert all(r.stats.reused_tokens == r.stats.ideal_reused_tokens for r in results[1:])
    assert fake.wrong_reuse_events == 0


def test_each_turn_logs_one_event_with_stable_fields(cluster):
    with capture_logs() as logs, cluster.session(**LONG) as s:
        s.append(SYSTEM)
        s.send(QUESTIONS[0])
        s.send(QUESTIONS[1])
    turns = [e for e in logs if e["event"] == "agentkv.turn"]
    assert len(turns) == 2
    for field in (
        "session_id",
        "turn",
        "pair",
        "prompt_tokens",
        "reused_tokens",
        "ideal_reused_tokens",
        "ttft_ms",
        "handle_state",
    ):
        assert field in turns[1]
    assert turns[1]["handle_state"] == "attached"
    assert turns[1]["reused_tokens"] == turns[1]["ideal_reused_tokens"]


def test_session_stats_aggregate_the_turns(cluster):
    with cluster.session(**LONG) as s:
        s.append(SYSTEM)
        for q in QUESTIONS:
            s.send(q)
        stats = s.stats
    assert stats.turns == 4
    assert stats.reuse_ratio == 1.0
    assert stats.median_warm_ttft_s is not None
    assert stats.reused_tokens == sum(t.reused_tokens for t in s.turns)


def test_closing_a_session_forgets_its_handle(cluster):
    with cluster.session(**LONG) as s:
        s.append(SYSTEM)
        s.send(QUESTIONS[0])
        assert s.handle is not None
    assert s.closed
    assert s.handle is None


def test_a_cache_salt_isolates_prefills_prefix_cache(clock):
    """Salted sessions share cached blocks only with the same salt (vLLM's cache_salt)."""
    fake = FakeCluster(pairs=1, clock=clock)

    def first_turn_reuse(salt):
        extra = {"cache_salt": salt} if salt else None
        with open_cluster(fake, clock) as cluster, cluster.session(extra_body=extra) as s:
            s.append(SYSTEM)
            return s.send(QUESTIONS[0]).stats.reused_tokens

    assert first_turn_reuse(None) == 0
    assert first_turn_reuse(None) > 0
    assert first_turn_reuse("tenant-a") == 0
    assert first_turn_reuse("tenant-a") > 0


def test_sync_history_extends_with_echoes_and_plans_a_fork_for_other_tools(cluster):
    """One rule for every front end: an echo of a generated answer in the client's form extends
    the session (its exact tokens kept); other tools never do (templates render them first)."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    with cluster.session(max_tokens=10) as s:
        s.append(Message.user("Hi"))
        answer = s.turn().message
        echoed = Message.assistant(f"  {answer.content}  ")
        history = [Message.user("Hi"), echoed, Message.user("More")]
        changed = s.sync_history(history, tools=tools)
        assert (changed.forked, changed.keep, changed.reason) == (True, 0, "tools changed")
        assert s.transcript.pending == ()  # a plan that forks changes nothing
        plan = s.sync_history(history)
        assert (plan.forked, plan.keep, plan.echoes) == (False, 2, 1)
        assert s.transcript.pending == (Message.user("More"),)
        assert s.transcript.messages[1] == answer  # the session's own message, not the echo
        assert s.turn().stats.handle_state is not HandleState.DIVERGED


def test_an_echo_of_a_message_the_caller_appended_must_be_equal(cluster):
    with cluster.session(max_tokens=10) as s:
        s.append(Message.user("Hi"), Message.assistant("Few-shot. "), Message.user("Go"))
        s.turn()
        history = [Message.user("Hi"), Message.assistant("Few-shot."), Message.user("Go")]
        plan = s.sync_history(history)
        assert (plan.forked, plan.keep) == (True, 1)
        with pytest.raises(PrefixDivergedError, match="keeps 1"):
            s.append_history(history)
