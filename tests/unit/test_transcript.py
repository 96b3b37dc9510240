"""The token-exact, append-only transcript."""

from __future__ import annotations

import itertools
from array import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentkv import InvalidMessageError, Message, PrefixDivergedError
from agentkv._prompt.history import EDITED, NOTHING_NEW, TOOLS_CHANGED
from agentkv._prompt.transcript import Delta, Transcript, TurnPrompt

CLOSING = (2, 3)  # like ChatML's "<|im_end|>", "\n"


def delta_for(transcript: Transcript, size: int = 3, start: int = 100) -> Delta:
    n = len(transcript.pending)
    ids = tuple(range(start, start + size * n + 2))
    return Delta(
        token_ids=ids, offsets=tuple(i * size for i in range(n)), generation_start=size * n
    )


def one_turn(transcript: Transcript, generated=(7, 8, 2), text="ok", finish="stop") -> TurnPrompt:
    prompt = transcript.prompt_for_turn(delta_for(transcript), closing=CLOSING)
    transcript.commit_turn(
        prompt, generated_ids=generated, message=Message.assistant(text), finish_reason=finish
    )
    return prompt


def snapshot(t: Transcript):
    return (t.view(), t.version, t.closing_suffix(CLOSING))


def test_first_turn_commits_prompt_plus_generated():
    t = Transcript([Message.system("s"), Message.user("u")])
    prompt = one_turn(t)
    assert t.token_ids == (*prompt.tolist(), 7, 8, 2)
    assert [m.role for m in t.messages] == ["system", "user", "assistant"]
    assert t.pending == ()
    assert [(s.start, s.end) for s in t.spans] == [(0, 3), (3, 6), (6, 11)]


def test_next_prompt_extends_committed_with_closing_rest_and_delta():
    t = Transcript([Message.user("u")])
    one_turn(t)  # generated ends with 2, the closing's first token
    committed = t.token_ids
    t.append(Message.user("again"))
    prompt = t.prompt_for_turn(delta_for(t, start=200), closing=CLOSING)
    assert tuple(prompt.tolist()[: len(committed)]) == committed
    assert prompt.tolist()[len(committed)] == 3  # only the closing's rest
    assert prompt.spans[0].start == len(committed) + 1


def test_assistant_span_grows_by_the_closing_at_the_next_commit():
    t = Transcript([Message.user("u")])
    one_turn(t)
    end = t.spans[-1].end
    t.append(Message.user("again"))
    one_turn(t)
    assert t.spans[1].end == end + 1 == t.spans[2].start


def test_commit_refuses_a_prompt_that_does_not_extend_the_committed_tokens():
    t = Transcript([Message.user("u")])
    one_turn(t)
    t.append(Message.user("again"))
    good = t.prompt_for_turn(delta_for(t), closing=CLOSING)
    ids = array("i", good.token_ids)
    ids[0] += 1
    bad = TurnPrompt(
        token_ids=ids,
        base_version=good.base_version,
        base_len=good.base_len,
        closing_len=good.closing_len,
        messages=good.messages,
        spans=good.spans,
        generation_start=good.generation_start,
    )
    before = snapshot(t)
    with pytest.raises(PrefixDivergedError):
        t.commit_turn(bad, generated_ids=(1,), message=Message.assistant("x"), finish_reason="stop")
    assert snapshot(t) == before


def test_a_prompt_from_an_older_version_is_refused():
    t = Transcript([Message.user("u")])
    stale = t.prompt_for_turn(delta_for(t))
    t.commit_turn(stale, generated_ids=(1,), message=Message.assistant("x"), finish_reason="stop")
    t.append(Message.user("v"))
    with pytest.raises(PrefixDivergedError):
        t.commit_turn(
            stale, generated_ids=(1,), message=Message.assistant("x"), finish_reason="stop"
        )


def test_nothing_pending_is_an_invalid_turn():
    t = Transcript()
    with pytest.raises(InvalidMessageError):
        t.prompt_for_turn(Delta(token_ids=(), offsets=(), generation_start=0))


def test_append_rejects_non_messages_and_keeps_state():
    t = Transcript([Message.user("u")])
    with pytest.raises(InvalidMessageError):
        t.append({"role": "user", "content": "dict"})  # type: ignore[arg-type]
    assert len(t.pending) == 1


def test_fork_after_an_assistant_keeps_the_exact_tokens():
    t = Transcript([Message.system("s"), Message.user("u")])
    one_turn(t)
    t.append(Message.user("second"))
    one_turn(t, generated=(9, 2), text="two")
    child = t.fork(keep=3)
    assert child.messages == t.messages[:3]
    assert child.token_ids == t.token_ids[: t.spans[2].end]
    assert not child.is_fresh
    assert child.pending == ()
    # the kept assistant message was closed by the second turn: no closing is added again
    assert child.closing_suffix(CLOSING) == ()


def test_fork_of_the_whole_transcript_keeps_the_open_tail():
    t = Transcript([Message.user("u")])
    one_turn(t)
    child = t.fork(keep=2)
    assert child.token_ids == t.token_ids
    assert child.closing_suffix(CLOSING) == t.closing_suffix(CLOSING) == (3,)


def test_fork_ending_on_a_user_message_renders_afresh():
    t = Transcript([Message.system("s"), Message.user("u")])
    one_turn(t)
    child = t.fork(keep=2)
    assert child.is_fresh
    assert child.pending == t.messages[:2]


def test_fork_with_new_messages():
    t = Transcript([Message.user("u")])
    one_turn(t)
    child = t.fork(messages=[Message.user("edited")])
    assert child.is_fresh
    assert child.pending == (Message.user("edited"),)
    with pytest.raises(ValueError, match="exactly one"):
        t.fork()
    with pytest.raises(ValueError, match="keep must be"):
        t.fork(keep=5)


def test_a_history_plan_extends_or_says_what_a_fork_keeps():
    t = Transcript([Message.user("u")])
    one_turn(t)
    history = [*t.messages, Message.user("next")]
    plan = t.plan(history)
    assert (plan.keep, plan.new, plan.forked) == (2, (Message.user("next"),), False)
    edited = t.plan([Message.user("edited"), *history[1:]])
    assert (edited.keep, edited.forked, edited.reason) == (0, True, EDITED)
    assert t.plan(history, tools_changed=True).reason == TOOLS_CHANGED
    assert t.plan(list(t.messages)).reason == NOTHING_NEW


def test_the_transcript_knows_which_messages_were_generated_and_forks_keep_that():
    t = Transcript([Message.user("u")])
    one_turn(t)
    assert t.generated == {1}
    t.mark_generated(views={1: Message.assistant("shown")})
    echo = [Message.user("u"), Message.assistant(" shown "), Message.user("next")]
    assert t.plan(echo).echoes == 1
    child = t.fork(keep=2)
    assert (child.generated, dict(child.views)) == ({1}, {1: Message.assistant("shown")})
    assert t.fork(keep=1).generated == set()
    with pytest.raises(ValueError, match="not in a transcript"):
        t.mark_generated([5])
    with pytest.raises(InvalidMessageError):
        t.mark_generated(views={0: Message.user("not an answer")})


def test_a_view_makes_token_ids_only_when_read_and_is_a_snapshot():
    t = Transcript([Message.user("u")])
    one_turn(t)
    view = t.view()
    assert view._ids is None  # the messages alone cost no Python ints
    assert view.num_tokens == t.num_tokens
    t.append(Message.user("next"))
    one_turn(t)
    assert view.token_ids == t.token_ids[: view.num_tokens] != t.token_ids
    assert view != t.view()
    assert t.view() == t.view()


# --- properties ----------------------------------------------------------------------------------

messages = st.builds(Message.user, st.text(min_size=1, max_size=5))
token_lists = st.lists(st.integers(0, 50), max_size=6)


@st.composite
def steps(draw):
    """A random sequence of operations, some of which fail."""
    ops = []
    for _ in range(draw(st.integers(1, 12))):
        kind = draw(st.sampled_from(["append", "turn", "bad_commit", "stale_commit", "empty"]))
        ops.append((kind, draw(st.lists(messages, min_size=1, max_size=3)), draw(token_lists)))
    return ops


@settings(max_examples=150, deadline=None)
@given(steps())
def test_any_failure_leaves_the_transcript_unchanged_and_commits_only_extend(ops):
    t = Transcript()
    stale = None
    for kind, new, generated in ops:
        before = snapshot(t)
        try:
            if kind == "append":
                t.append(*new)
            elif kind == "empty" and not t.pending:
                t.prompt_for_turn(Delta(token_ids=(), offsets=(), generation_start=0))
            elif kind == "turn":
                t.append(*new)
                previous = t.token_ids
                prompt = t.prompt_for_turn(delta_for(t, start=60), closing=CLOSING)
                stale = prompt
                t.commit_turn(
                    prompt,
                    generated_ids=generated,
                    message=Message.assistant("a"),
                    finish_reason="stop",
                )
                assert t.token_ids[: len(previous)] == previous  # committed prompts only extend
                assert t.token_ids[-len(generated) or len(t.token_ids) :] == tuple(generated or ())
                continue
            elif kind == "stale_commit" and stale is not None:
                t.commit_turn(
                    stale,
                    generated_ids=generated,
                    message=Message.assistant("a"),
                    finish_reason="stop",
                )
            elif kind == "bad_commit" and t.pending:
                prompt = t.prompt_for_turn(delta_for(t), closing=CLOSING)
                ids = array("i", prompt.token_ids)
                if len(ids) and t.num_tokens:
                    ids[t.num_tokens - 1] += 1
                else:
                    continue
                t.commit_turn(
                    TurnPrompt(
                        token_ids=ids,
                        base_version=prompt.base_version,
                        base_len=prompt.base_len,
                        closing_len=prompt.closing_len,
                        messages=prompt.messages,
                        spans=prompt.spans,
                        generation_start=prompt.generation_start,
                    ),
                    generated_ids=generated,
                    message=Message.assistant("a"),
                    finish_reason="stop",
                )
            else:
                continue
        except (PrefixDivergedError, InvalidMessageError):
            assert snapshot(t) == before
        # spans tile the committed tokens in order
        spans = t.spans
        assert all(a.end <= b.start or a == b for a, b in itertools.pairwise(spans))
        assert not spans or spans[-1].end == t.num_tokens


def restored(t: Transcript, **changes) -> Transcript:
    fields = {
        "messages": t.messages,
        "token_ids": t.token_ids,
        "spans": t.spans,
        "pending": t.pending,
        "tail_open": t.tail_open,
        "finish_reason": t.finish_reason,
        "version": t.version,
        "generated": t.generated,
        "views": t.views,
    }
    return Transcript.restore(**{**fields, **changes})


@pytest.mark.parametrize("finish", ["stop", "length"])
def test_a_restored_transcript_continues_exactly_like_the_original(finish):
    t = Transcript([Message.system("s"), Message.user("u")])
    one_turn(t, finish=finish)
    t.append(Message.user("next"))
    copy = restored(t)
    assert snapshot(copy) == snapshot(t)
    one_turn(t)
    one_turn(copy)
    assert snapshot(copy) == snapshot(t)


@pytest.mark.parametrize(
    "changes",
    [
        {"spans": ()},  # one span per message
        {"token_ids": (1, 2)},  # spans past the tokens
        {"version": -1},
    ],
)
def test_restoring_an_inconsistent_transcript_is_refused(changes):
    t = Transcript([Message.user("u")])
    one_turn(t)
    with pytest.raises(ValueError, match="saved"):
        restored(t, **changes)
