"""Tool calling on the fake: ``tool_choice`` required and named, OpenAI tool calls (whole
and streamed), and the tool parser vLLM needs for them."""

from __future__ import annotations

import json

import httpx2
from raw_protocol import (
    IM_END,
    TOK,
    post,
    sse_events,
    user,
)

from agentkv.testing import FakeCluster, ManualClock

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city", "days"],
        },
    },
}


def test_required_tool_choice_returns_openai_tool_calls(
    client: httpx2.Client, fake: FakeCluster
) -> None:
    body = {
        "messages": user("Weather in Paris?"),
        "tools": [WEATHER],
        "tool_choice": "required",
        "return_token_ids": True,
    }
    response = post(client, fake.decode(0).url, body).json()
    choice = response["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] == ""
    (call,) = message["tool_calls"]
    assert call["id"].startswith("chatcmpl-tool-")
    assert call["type"] == "function"
    assert call["function"]["name"] == "get_weather"
    arguments = json.loads(call["function"]["arguments"])
    assert isinstance(arguments["city"], str)
    assert isinstance(arguments["days"], int)
    text = TOK.decode(choice["token_ids"], skip_special_tokens=True)
    assert json.loads(text) == [{"name": "get_weather", "parameters": arguments}]
    assert choice["token_ids"][-1] == IM_END


def test_named_tool_choice_returns_the_call_and_finishes_with_stop(
    client: httpx2.Client, fake: FakeCluster
) -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    body = {"messages": user("Weather?"), "tools": [WEATHER], "tool_choice": choice}
    response = post(client, fake.decode(0).url, body).json()
    assert response["choices"][0]["finish_reason"] == "stop"
    (call,) = response["choices"][0]["message"]["tool_calls"]
    assert set(json.loads(call["function"]["arguments"])) == {"city", "days"}


def test_streamed_required_tool_call_announces_then_streams_arguments(
    client: httpx2.Client, fake: FakeCluster
) -> None:
    body = {
        "messages": user("Weather?"),
        "tools": [WEATHER],
        "tool_choice": "required",
        "stream": True,
    }
    chunks = sse_events(post(client, fake.decode(0).url, body))
    calls = [
        c["choices"][0]["delta"]["tool_calls"][0]
        for c in chunks[1:]
        if c["choices"] and "tool_calls" in c["choices"][0]["delta"]
    ]
    assert calls[0]["id"].startswith("chatcmpl-tool-")
    assert calls[0]["function"]["name"] == "get_weather"
    assert all(c["function"]["name"] is None for c in calls[1:])
    arguments = "".join(c["function"]["arguments"] for c in calls)
    assert set(json.loads(arguments)) == {"city", "days"}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_tool_choice_needs_a_tool_parser(clock: ManualClock) -> None:
    fake = FakeCluster(pairs=1, clock=clock, tool_call_parser=None)
    with httpx2.Client(transport=fake.transport) as client:
        body = {"messages": user("x"), "tools": [WEATHER], "tool_choice": "required"}
        response = post(client, fake.decode(0).url, body)
        assert response.status_code == 400
        assert response.json()["error"]["message"] == (
            'tool_choice="required" requires --tool-call-parser to be set'
        )
