"""Mapping an OpenAI messages list onto a session: extensions append, anything else forks."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from agentkv import Message, ToolCall
from agentkv._prompt.history import is_echo, plan_history

SYSTEM = Message.system("Be brief.")
USER = Message.user("Capital of France?")
ANSWER = Message.assistant("Paris. ")
CALL = Message.assistant(
    None,
    tool_calls=[ToolCall(id="call_1", name="lookup", arguments='{"city": "Paris", "n": 1}')],
)


def test_an_exact_extension_appends_only_the_new_messages():
    held = [SYSTEM, USER, ANSWER]
    new = Message.user("And Spain?")
    plan = plan_history(held, [*held, new], generated={2})
    assert (plan.keep, plan.new, plan.forked) == (3, (new,), False)


def test_a_fresh_session_takes_every_message():
    incoming = [SYSTEM, USER]
    plan = plan_history([], incoming, generated=set())
    assert (plan.keep, plan.new, plan.forked) == (0, tuple(incoming), False)


def test_an_edited_message_forks_at_the_first_difference():
    held = [SYSTEM, USER, ANSWER]
    incoming = [SYSTEM, Message.user("Capital of Italy?"), ANSWER, Message.user("Sure?")]
    plan = plan_history(held, incoming, generated={2})
    assert plan.forked
    assert plan.keep == 1
    assert plan.new == tuple(incoming[1:])


def test_a_regenerate_resends_the_last_message_on_a_fork():
    held = [SYSTEM, USER, ANSWER]
    plan = plan_history(held, [SYSTEM, USER], generated={2})
    assert plan.forked
    assert (plan.keep, plan.new) == (1, (USER,))


def test_echoes_of_generated_messages_match_by_meaning():
    held = [SYSTEM, USER, ANSWER]
    incoming = [SYSTEM, USER, Message.assistant("Paris."), Message.user("Thanks")]
    plan = plan_history(held, incoming, generated={2})
    assert (plan.keep, plan.forked, plan.echoes) == (3, False, 1)


def test_messages_the_client_wrote_must_be_equal():
    """Only generated messages get echo tolerance: a few-shot assistant turn is the client's."""
    held = [SYSTEM, USER, ANSWER]
    incoming = [SYSTEM, USER, Message.assistant("Paris."), Message.user("Thanks")]
    plan = plan_history(held, incoming, generated=set())
    assert plan.forked
    assert plan.keep == 2


def test_reserialized_tool_arguments_are_an_echo():
    """LangChain re-serializes tool arguments with json.dumps, and sends null content."""
    echoed = Message.from_openai(
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {
                        "name": "lookup",
                        "arguments": json.dumps({"n": 1, "city": "Paris"}),
                    },
                }
            ],
        }
    )
    assert is_echo(CALL, echoed)


def test_a_different_tool_call_is_not_an_echo():
    for changed in (
        ToolCall(id="call_2", name="lookup", arguments='{"city": "Paris", "n": 1}'),
        ToolCall(id="call_1", name="search", arguments='{"city": "Paris", "n": 1}'),
        ToolCall(id="call_1", name="lookup", arguments='{"city": "Rome", "n": 1}'),
        ToolCall(id="call_1", name="lookup", arguments="not json"),
    ):
        assert not is_echo(CALL, Message.assistant(None, tool_calls=[changed]))
    assert not is_echo(CALL, Message.assistant("text"))
    assert not is_echo(ANSWER, Message.user("Paris."))


def test_different_text_is_not_an_echo():
    assert not is_echo(ANSWER, Message.assistant("Rome."))


_texts = st.text(alphabet="abc xyz", min_size=1, max_size=6).filter(str.strip)
_messages = st.lists(_texts.map(Message.user), max_size=8)


@given(held=_messages, extra=st.lists(_texts.map(Message.user), min_size=1, max_size=4))
def test_any_extension_is_appended_never_forked(held, extra):
    plan = plan_history(held, [*held, *extra], generated=set())
    assert not plan.forked
    assert plan.keep == len(held)
    assert plan.new == tuple(extra)


@given(held=_messages, incoming=st.lists(_texts.map(Message.user), min_size=1, max_size=8))
def test_a_plan_always_rebuilds_the_request_exactly(held, incoming):
    """Kept messages plus new ones are the request; a fork keeps only a common prefix."""
    plan = plan_history(held, incoming, generated=set())
    assert plan.new, "a turn always has something to send"
    assert list(held[: plan.keep]) + list(plan.new) == incoming
    if not plan.forked:
        assert plan.keep == len(held)
    else:
        assert plan.keep < len(held) or len(incoming) <= len(held)
