"""Responses API requests become chat completion requests: items map onto messages the way the
proxy's own answers were shown, so an echoed output extends its session."""

from __future__ import annotations

import pytest

from agentkv.proxy._errors import ProxyError
from agentkv.proxy._responses_request import chat_body, dropped_tools, input_messages


def _call(call_id: str, city: str) -> dict[str, str]:
    return {
        "type": "function_call",
        "call_id": call_id,
        "name": "get_weather",
        "arguments": f'{{"city": "{city}"}}',
    }


def _chat_call(call_id: str, city: str) -> dict[str, object]:
    arguments = f'{{"city": "{city}"}}'
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": arguments},
    }


def test_function_calls_join_the_assistant_message_they_follow():
    text = [{"type": "input_text", "text": "Weather "}, {"type": "input_text", "text": "in Oslo?"}]
    items = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": text},
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Checking."}],
        },
        _call("c1", "Oslo"),
        _call("c2", "Bergen"),
        {"type": "reasoning", "summary": []},
        {"type": "function_call_output", "call_id": "c1", "output": "snow"},
        {
            "type": "function_call_output",
            "call_id": "c2",
            "output": [{"type": "input_text", "text": "rain"}],
        },
    ]
    assert input_messages(items) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [_chat_call("c1", "Oslo"), _chat_call("c2", "Bergen")],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "snow"},
        {"role": "tool", "tool_call_id": "c2", "content": "rain"},
    ]


def test_a_call_without_a_preceding_assistant_message_opens_one():
    [message] = input_messages([{"type": "function_call", "call_id": "c", "name": "f"}])
    assert message["role"] == "assistant"
    assert message["content"] is None
    assert message["tool_calls"][0]["function"] == {"name": "f", "arguments": ""}


def test_the_chat_request_carries_instructions_history_tools_and_format():
    body = {
        "model": "m",
        "instructions": "Be brief.",
        "input": "And Bergen?",
        "max_output_tokens": 16,
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
        "tool_choice": {"type": "function", "name": "f"},
        "text": {"format": {"type": "json_schema", "name": "s", "schema": {"type": "object"}}},
        "store": True,
        "reasoning": {"effort": "low"},
        "top_k": 5,
    }
    history = [{"role": "user", "content": "Oslo?"}, {"role": "assistant", "content": "Snow."}]
    chat = chat_body(body, history=history)
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."},
        *history,
        {"role": "user", "content": "And Bergen?"},
    ]
    assert chat["max_tokens"] == 16
    assert chat["tools"] == [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    ]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert chat["response_format"]["json_schema"]["name"] == "s"
    assert chat["top_k"] == 5  # vLLM's own fields go on to the chat field table
    assert "store" not in chat
    assert "reasoning" not in chat


@pytest.mark.parametrize(
    "body",
    [
        {"input": [{"type": "item_reference", "id": "x"}]},
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
        {"input": [{"role": "critic", "content": "x"}]},
        {"input": 7},
        {"input": "x", "tools": [{"name": "f"}]},
        {"input": "x", "tools": [7]},
        {"input": "x", "tools": {"type": "function"}},
        {"input": "x", "text": {"format": {"type": "grammar"}}},
    ],
)
def test_what_has_no_chat_counterpart_is_refused(body):
    with pytest.raises(ProxyError) as refused:
        chat_body(body, history=[])
    assert refused.value.status == 400


def test_hosted_and_namespaced_tools_are_dropped_and_function_tools_kept():
    """Codex sends web_search and namespace tools on every request: only OpenAI runs them, and
    refusing them would stop Codex, so they are dropped (the answer's header says which)."""
    tools = [
        {"type": "web_search"},
        {"type": "function", "name": "shell", "parameters": {"type": "object"}},
        {"type": "namespace", "name": "mcp", "tools": []},
        {"type": "web_search"},
    ]
    chat = chat_body({"input": "x", "tools": tools, "tool_choice": "auto"}, history=[])
    assert [t["function"]["name"] for t in chat["tools"]] == ["shell"]
    assert dropped_tools(tools) == ["web_search", "namespace"]
    only_hosted = chat_body({"input": "x", "tools": tools[:1], "tool_choice": "auto"}, history=[])
    assert "tools" not in only_hosted
    assert "tool_choice" not in only_hosted
    assert dropped_tools(None) == []
