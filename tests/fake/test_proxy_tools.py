"""OpenAI tool calling through the proxy on the fake pair: a backend without a tool parser gets
agentkv's JSON protocol (translated both ways), one with a parser gets its own; a tool loop
extends its session exactly (no fork, turn 2 reuses turn 1's KV). Also the field classes and
session keys of requests that reach a turn."""

from __future__ import annotations

import json

import httpx2
import pytest
from openai import AsyncOpenAI

from agentkv import AsyncCluster, InvalidMessageError, Message
from agentkv.proxy import ProxyConfig, create_app
from agentkv.testing import FakeCluster

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
SYSTEM = "You are a weather assistant. " + " ".join(f"City {i} is far." for i in range(30))


pytestmark = [
    pytest.mark.fake(pairs=1, kv_recompute_threshold=0),
    pytest.mark.fake_variants(
        pytest.param({"tool_call_parser": None}, id="no-parser"),
        pytest.param({"tool_call_parser": "hermes"}, id="parser"),
    ),
]


@pytest.fixture
async def client(acluster):
    app = create_app(acluster, ProxyConfig())
    async with httpx2.AsyncClient(
        transport=httpx2.ASGITransport(app=app), base_url="http://proxy"
    ) as http:
        yield AsyncOpenAI(base_url="http://proxy/v1", api_key="k", http_client=http)


def _mode(fake: FakeCluster) -> str:
    return "native" if fake.tool_call_parser else "json"


async def test_models_say_how_tools_are_served(client, fake):
    models = await client.models.list()
    assert models.data[0].model_extra["agentkv"]["tool_calling"] == _mode(fake)


@pytest.mark.parametrize("choice", ["required", NAMED], ids=["required", "named"])
@pytest.mark.parametrize("stream", [False, True])
async def test_a_two_step_tool_loop_extends_the_session_exactly(client, fake, choice, stream):
    """Before: 400 from the backend without a parser ("requires --tool-call-parser")."""
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Weather in Paris?"},
    ]
    headers = {"X-Session-ID": "loop"}
    raw = await client.chat.completions.with_raw_response.create(
        model=fake.model,
        messages=messages,
        tools=[WEATHER],
        tool_choice=choice,
        max_tokens=64,
        stream=stream,
        stream_options={"include_usage": True} if stream else None,
        extra_headers=headers,
    )
    assert raw.headers["x-agentkv-tool-calling"] == _mode(fake)
    if stream:
        calls, finish, usage = {}, None, None
        async for chunk in raw.parse():
            usage = chunk.usage or usage
            for c in chunk.choices:
                finish = c.finish_reason or finish
                assert not c.delta.content  # the JSON the model wrote never leaks as text
                for d in c.delta.tool_calls or ():
                    calls[d.index] = {
                        "id": d.id,
                        "type": "function",
                        "function": {"name": d.function.name, "arguments": d.function.arguments},
                    }
        tool_calls = [calls[i] for i in sorted(calls)]
        assistant = {"role": "assistant", "content": None, "tool_calls": tool_calls}
    else:
        response = raw.parse()
        usage, finish = response.usage, response.choices[0].finish_reason
        tool_calls = [c.model_dump() for c in response.choices[0].message.tool_calls]
        assistant = response.choices[0].message.model_dump(exclude_none=True)
    named = isinstance(choice, dict)
    assert finish == ("stop" if named and fake.tool_call_parser else "tool_calls")
    assert tool_calls
    for call in tool_calls:
        assert call["id"]
        assert call["function"]["name"] == "get_weather"
        assert isinstance(json.loads(call["function"]["arguments"]), dict)
    messages.append(assistant)
    for call in tool_calls:
        messages.append({"role": "tool", "tool_call_id": call["id"], "content": "Sunny"})
    raw = await client.chat.completions.with_raw_response.create(
        model=fake.model,
        messages=messages,
        tools=[WEATHER],
        tool_choice="none" if fake.tool_call_parser is None else "required",
        max_tokens=32,
        extra_headers=headers,
    )
    assert "x-agentkv-forked" not in raw.headers
    assert raw.headers["x-agentkv-handle"] == "attached"
    cached = raw.parse().usage.prompt_tokens_details.cached_tokens
    assert cached == usage.prompt_tokens + usage.completion_tokens - 1
    assert fake.wrong_reuse_events == 0


async def test_auto_gives_calls_or_an_answer_as_openai_shapes_them(client, fake):
    if fake.tool_call_parser is None:
        response = await client.chat.completions.create(
            model=fake.model,
            messages=[{"role": "user", "content": "Weather in Oslo?"}],
            tools=[WEATHER],
            tool_choice="auto",
            max_tokens=64,
        )
        choice = response.choices[0]
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls"
        else:
            assert choice.message.content
            assert choice.finish_reason == "stop"


async def test_conversation_id_is_a_session_key(client, fake):
    raw = await client.chat.completions.with_raw_response.create(
        model=fake.model,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=8,
        extra_body={"conversation_id": "conv-1", "request_id": "x", "user": "u"},
    )
    assert raw.headers["x-agentkv-session-id"] == "conv-1"


async def test_conversations_sharing_a_prompt_cache_key_do_not_fork_each_other(client, fake):
    """Before: one session per key, so two conversations forked each other every turn."""
    histories = {
        name: [{"role": "system", "content": SYSTEM}, {"role": "user", "content": name}]
        for name in ("first question", "second question")
    }
    for _ in range(3):
        for messages in histories.values():
            raw = await client.chat.completions.with_raw_response.create(
                model=fake.model,
                messages=messages,
                max_tokens=16,
                extra_body={"prompt_cache_key": "shared"},
            )
            assert "x-agentkv-forked" not in raw.headers
            answer = raw.parse().choices[0].message
            messages += [answer.model_dump(exclude_none=True), {"role": "user", "content": "Go"}]
            if len(messages) > 4:
                assert raw.headers["x-agentkv-handle"] == "attached"
    assert fake.wrong_reuse_events == 0


@pytest.mark.parametrize(
    "extra",
    [{"echo": True}, {"chat_template_kwargs": {"x": 1}}, {"n": 2}, {"prompt_token_ids": [1]}],
)
async def test_the_sdk_refuses_token_changing_fields_on_every_path(fake, extra):
    """Before: echo/n/chat_template_kwargs went to vLLM and put wrong KV behind the transcript."""
    [name] = extra
    async with AsyncCluster.from_dict(fake.cluster_spec, transport=fake.transport) as cluster:
        session = cluster.session(max_tokens=8)
        session.append(Message.user("Hi"))
        with pytest.raises(InvalidMessageError, match=name):
            await session.turn(extra_body=extra)
        with pytest.raises(InvalidMessageError, match=name):
            cluster.session(extra_body=extra)
        assert session.transcript.pending == (Message.user("Hi"),)
        assert all(not server.requests for server in fake.servers)
