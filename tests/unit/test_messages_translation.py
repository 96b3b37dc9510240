"""The Messages API's translation into a chat request, its error words and its session keys:
pure functions, no server."""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator
from typing import Any

import pytest
from starlette.datastructures import Headers

from agentkv import ContextLengthError
from agentkv.proxy._cli import add_parser, config_from_args
from agentkv.proxy._errors import ProxyError
from agentkv.proxy._messages import _with_error_event, body_session_id
from agentkv.proxy._messages_errors import anthropic_error
from agentkv.proxy._messages_request import chat_body
from agentkv.proxy._messages_system import DEFAULT_DROPS, SystemDrops
from agentkv.proxy._session_key import session_key

DROPS = SystemDrops(DEFAULT_DROPS)


def _chat(**body: Any) -> dict[str, Any]:
    return chat_body({"max_tokens": 8, **body}, drops=DROPS).body


def test_text_blocks_and_a_string_are_the_same_chat_message():
    blocks = [
        {"type": "text", "text": "Fix the bug.", "cache_control": {"type": "ephemeral"}},
        {"type": "text", "text": "In a.py."},
    ]
    assert (
        _chat(messages=[{"role": "user", "content": blocks}])["messages"]
        == _chat(messages=[{"role": "user", "content": "Fix the bug.\nIn a.py."}])["messages"]
    )


def test_system_blocks_join_and_inline_system_messages_stay_in_place():
    chat = _chat(
        system=[
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.328.f00;"},
            {"type": "text", "text": "You are Claude Code."},
            {"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}},
        ],
        messages=[
            {"role": "user", "content": "Hi"},
            {"role": "system", "content": [{"type": "text", "text": "Reminder."}]},
            {"role": "user", "content": "Go"},
        ],
    )
    assert chat["messages"] == [
        {"role": "system", "content": "You are Claude Code.\nBe brief."},
        {"role": "user", "content": "Hi"},
        {"role": "system", "content": "Reminder."},
        {"role": "user", "content": "Go"},
    ]


def test_the_drop_rules_are_counted_and_can_be_turned_off():
    body = {
        "max_tokens": 8,
        "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=1; cch=ab;"}],
        "messages": [{"role": "user", "content": "Hi"}],
    }
    dropped = chat_body(body, drops=DROPS)
    assert dropped.dropped == DEFAULT_DROPS
    assert dropped.body["messages"] == [{"role": "user", "content": "Hi"}]
    kept = chat_body(body, drops=SystemDrops(()))
    assert kept.dropped == ()
    assert kept.body["messages"][0]["role"] == "system"


def test_tool_use_and_tool_results_become_tool_calls_and_tool_messages():
    chat = _chat(
        messages=[
            {"role": "user", "content": "ls"},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "Running it."},
                    {"type": "tool_use", "id": "t1", "name": "bash", "input": {"cmd": "ls"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Here:"},
                    {"type": "tool_result", "tool_use_id": "t1", "content": "", "is_error": True},
                ],
            },
        ],
        tools=[{"name": "bash", "input_schema": {"$schema": "x", "type": "object"}}],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        stop_sequences=["END"],
        top_k=4,
    )
    assert chat["messages"][1] == {
        "role": "assistant",
        "content": "Running it.",
        "tool_calls": [
            {
                "id": "t1",
                "type": "function",
                "function": {"name": "bash", "arguments": '{"cmd": "ls"}'},
            }
        ],
    }
    assert chat["messages"][2:] == [
        {"role": "tool", "tool_call_id": "t1", "content": "Error"},
        {"role": "user", "content": "Here:"},
    ]
    assert chat["tools"] == [
        {"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}
    ]
    assert chat["tool_choice"] == "required"
    assert chat["parallel_tool_calls"] is False
    assert (chat["stop"], chat["top_k"]) == (["END"], 4)


@pytest.mark.parametrize(
    ("choice", "expected"),
    [
        ({"type": "auto"}, "auto"),
        ({"type": "none"}, "none"),
        ({"type": "tool", "name": "bash"}, {"type": "function", "function": {"name": "bash"}}),
    ],
)
def test_tool_choice_maps_onto_chats(choice, expected):
    chat = _chat(
        messages=[{"role": "user", "content": "Hi"}],
        tools=[{"name": "bash", "input_schema": {"type": "object"}, "defer_loading": True}],
        tool_choice=choice,
    )
    assert chat["tool_choice"] == expected
    assert "parallel_tool_calls" not in chat


def test_anthropic_only_fields_are_accepted_quietly():
    chat = _chat(
        messages=[{"role": "user", "content": "Hi"}],
        thinking={"type": "adaptive"},
        context_management={"edits": []},
        output_config={"effort": "low"},
        metadata={"user_id": "u"},
    )
    assert set(chat) == {"messages", "max_tokens"}


def test_a_context_error_is_said_in_anthropics_words():
    status, body = anthropic_error(
        ContextLengthError(prompt_tokens=9000, max_tokens=None, limit=8192)
    )
    assert status == 400
    assert body == {
        "type": "error",
        "error": {
            "type": "invalid_request_error",
            "message": "prompt is too long: 9000 tokens > 8192 maximum",
        },
    }
    _, body = anthropic_error(ContextLengthError(prompt_tokens=7000, max_tokens=32000, limit=8192))
    assert body["error"]["message"] == (
        "input length and `max_tokens` exceed context limit: 7000 + 32000 > 8192"
    )


@pytest.mark.parametrize(
    ("status", "kind", "sent"),
    [
        (401, "authentication_error", 401),
        (429, "rate_limit_error", 429),
        (503, "overloaded_error", 529),
        (502, "api_error", 502),
    ],
)
def test_statuses_get_anthropics_types(status, kind, sent):
    got, body = anthropic_error(ProxyError(status, "no"))
    assert (got, body["error"]["type"]) == (sent, kind)


def test_the_session_header_wins_over_claude_codes_own():
    headers = Headers({"x-session-id": "mine", "x-claude-code-session-id": "cc"})
    named = body_session_id({"metadata": {"user_id": '{"session_id": "meta"}'}})
    assert named == "meta"
    key = session_key(headers, named)
    assert key is not None
    assert key.session_id == "mine"
    key = session_key(Headers({"x-claude-code-session-id": "cc"}), named)
    assert key is not None
    assert key.session_id == "cc"
    assert body_session_id({"metadata": {"user_id": "plain-user"}}) is None
    assert body_session_id({"metadata": {"user_id": "{bad json"}}) is None


async def test_a_failure_mid_stream_is_an_error_event():
    async def chunks() -> AsyncIterator[bytes]:
        yield b"event: ping\ndata: {}\n\n"
        raise ProxyError(502, "the model server failed")

    out = [chunk async for chunk in _with_error_event(chunks())]
    assert out[-1] == (
        b'event: error\ndata: {"type":"error","error":{"type":"api_error",'
        b'"message":"the model server failed"}}\n\n'
    )


def test_drop_flags_map_onto_the_config():
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    config = config_from_args(parser.parse_args(["proxy", "--drop-system-block", "^cch="]))
    assert config.drop_system_blocks == (*DEFAULT_DROPS, "^cch=")
    args = parser.parse_args(["proxy", "--no-default-system-drops"])
    assert config_from_args(args).drop_system_blocks == ()
