"""Messages validate themselves; the package exports exactly its public names."""

from __future__ import annotations

import pytest

import agentkv
from agentkv import InvalidMessageError, Message, SessionStats, ToolCall


def test_all_is_sorted_and_exactly_the_public_names():
    public = {name for name in vars(agentkv) if not name.startswith("_")}
    public -= {"annotations"}  # from __future__
    # subpackages imported by the package's own modules are attributes, not exports
    public -= {name for name in public if type(getattr(agentkv, name)).__name__ == "module"}

    # ruff's isort-style order (RUF022): CONSTANTS, then Classes, then functions, each sorted.
    def kind(name: str) -> tuple[int, str]:
        return (0 if name.isupper() else 1 if name[0].isupper() else 2, name)

    assert agentkv.__all__ == sorted(agentkv.__all__, key=kind)
    # the openai drop-ins are imported on first use (they need the proxy extra)
    assert set(agentkv.__all__) == public | agentkv._LAZY
    for name in agentkv.__all__:
        assert getattr(agentkv, name) is not None


def test_role_constructors_and_openai_round_trip():
    call = ToolCall(id="c1", name="f", arguments='{"x": 1}')
    messages = [
        Message.system("s"),
        Message.user("u", name="bob"),
        Message.assistant("a"),
        Message.assistant(None, tool_calls=[call]),
        Message.tool("42", tool_call_id="c1"),
    ]
    for message in messages:
        assert Message.from_openai(message.to_openai()) == message


def test_text_parts_are_joined_and_null_extras_ignored():
    message = Message.from_openai(
        {
            "role": "assistant",
            "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            "refusal": None,
            "annotations": [],
        }
    )
    assert message.content == "a\nb"


@pytest.mark.parametrize(
    "data",
    [
        {"role": "robot", "content": "x"},
        {"content": "x"},
        {"role": "user"},
        {"role": "user", "content": ""},
        {"role": "user", "content": 5},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]},
        {"role": "system", "content": None},
        {"role": "assistant", "content": None},
        {"role": "tool", "content": "x"},
        {"role": "user", "content": "x", "tool_call_id": "c"},
        {"role": "user", "content": "x", "surprise": 1},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "function": {}}]},
        {"role": "assistant", "content": None, "tool_calls": "nope"},
        {"role": "user", "content": "undecodable \udcff bytes"},  # lone surrogate: not UTF-8
        {
            "role": "assistant",
            "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "\ud800"}}],
        },
        "just text",
    ],
)
def test_bad_messages_are_invalid_message_errors(data):
    with pytest.raises(InvalidMessageError):
        Message.from_openai(data)


def test_session_stats_of_no_turns():
    stats = SessionStats.from_turns([])
    assert stats.turns == 0
    assert stats.reuse_ratio is None


def test_a_sessions_lifecycle_is_one_value_and_a_close_waits_for_the_running_turn():
    from agentkv._client.state import Lifecycle, SessionState

    state = SessionState.__new__(SessionState)
    state.phase = Lifecycle.IDLE
    state.begin_turn()
    assert (state.phase, state.busy, state.closed) == (Lifecycle.RUNNING, True, False)
    with pytest.raises(AssertionError):
        state.begin_turn()
    state.close()  # closed while the turn runs: it finishes, then the session is closed
    assert (state.phase, state.busy, state.closed) == (Lifecycle.CLOSING, True, True)
    state.end_turn()
    assert (state.phase, state.busy, state.closed) == (Lifecycle.CLOSED, False, True)
    state.close()
    assert state.phase is Lifecycle.CLOSED
    idle = SessionState.__new__(SessionState)
    idle.phase = Lifecycle.IDLE
    idle.close()
    assert (idle.phase, idle.busy, idle.closed) == (Lifecycle.CLOSED, False, True)
