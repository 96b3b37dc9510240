"""Unmodified clients through ``agentkv proxy`` on the real local pair: tools, stop, vLLM fields.

Each client library is used as its users use it. Every answer must be 200 and well formed, no
request may fork its session (``X-AgentKV-Forked`` absent), and every turn >= 2 must reuse the
exact ideal: the previous prompt + generated - 1 tokens (the local pair pulls whatever prefill
lacks: ``kv_recompute_threshold`` 1). One proxy serves the whole module; turns are short.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

import httpx2
import pytest
from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from openai import AsyncOpenAI, OpenAI

from agentkv.proxy import ProxyServer

pytestmark = pytest.mark.e2e

# Room for a JSON tool reply of up to 4 parallel calls (~20 tokens each). Every request sets
# temperature=0: the proxy forwards an omitted temperature as omitted, and vLLM then samples at
# 1.0, where this 135M model may wander off inside a JSON string (a city "Marmirope}},{" ...)
# and run to max_tokens; which request does depended on the engine's RNG state, hence on the
# tests before (2 clean-clone CI failures, once the e2e bench ran more requests first).
MAX_TOKENS = 128
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "the city"}},
            "required": ["city"],
        },
    },
}
SYSTEM = "You are a weather assistant. Use the tools to answer."
REUSE: dict[str, list[tuple[int, int]]] = {}  # client -> (cached, ideal) per turn >= 2


def _report(name: str, cached: int, ideal: int) -> None:
    REUSE.setdefault(name, []).append((cached, ideal))
    sys.stderr.write(f"[reuse] {name}: cached {cached} of ideal {ideal}\n")


def _ideal(previous: Any) -> int:
    return previous.prompt_tokens + previous.completion_tokens - 1


def _check(raw: Any) -> None:
    assert raw.status_code == 200
    assert "x-agentkv-forked" not in raw.headers


def test_models_say_the_local_pair_serves_tools_as_json(proxy: ProxyServer) -> None:
    data = httpx2.get(f"{proxy.url}/v1/models", timeout=60).json()
    assert data["data"][0]["agentkv"]["tool_calling"] == "json"


@pytest.mark.parametrize(
    "choice",
    ["auto", "required", {"type": "function", "function": {"name": "get_weather"}}],
    ids=["auto", "required", "named"],
)
def test_openai_sync_tool_loop(
    proxy: ProxyServer, model: str, choice: Any, request: pytest.FixtureRequest
) -> None:
    """Two steps: a tool call, its result echoed back with the call, then the answer."""
    client = OpenAI(base_url=f"{proxy.url}/v1", api_key="k", max_retries=0, timeout=600)
    request.addfinalizer(client.close)
    name = f"openai-sync-{choice if isinstance(choice, str) else 'named'}"
    messages: list[Any] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "What is the weather in Paris?"},
    ]
    raw = client.chat.completions.with_raw_response.create(
        model=model,
        messages=messages,
        tools=[WEATHER],
        tool_choice=choice,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_headers={"X-Session-ID": name},
    )
    _check(raw)
    first = raw.parse()
    message = first.choices[0].message
    if choice != "auto" or message.tool_calls:
        assert first.choices[0].finish_reason == "tool_calls"
        [call] = message.tool_calls[:1]
        assert call.function.name == "get_weather"
        assert isinstance(json.loads(call.function.arguments), dict)
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"})
    else:
        messages += [message.model_dump(exclude_none=True), {"role": "user", "content": "Ok?"}]
    raw = client.chat.completions.with_raw_response.create(
        model=model,
        messages=messages,
        tools=[WEATHER],
        tool_choice="auto",
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_headers={"X-Session-ID": name},
    )
    _check(raw)
    second = raw.parse()
    assert raw.headers["x-agentkv-handle"] == "attached"
    cached = second.usage.prompt_tokens_details.cached_tokens
    _report(name, cached, _ideal(first.usage))
    assert cached == _ideal(first.usage)


@pytest.mark.parametrize("stream", [False, True])
def test_openai_async_tools_and_a_stop_string(
    proxy: ProxyServer, model: str, stream: bool
) -> None:
    async def run(client: AsyncOpenAI) -> None:
        name = f"openai-async-{'stream' if stream else 'plain'}"
        messages: list[Any] = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "What is the weather in Rome?"},
        ]
        raw = await client.chat.completions.with_raw_response.create(
            model=model,
            messages=messages,
            tools=[WEATHER],
            tool_choice="required",
            # One call is what this turn needs; the test is about the async client and the stop
            # string.
            parallel_tool_calls=False,
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=stream,
            stream_options={"include_usage": True} if stream else None,
            extra_headers={"X-Session-ID": name},
        )
        _check(raw)
        if stream:
            calls: dict[int, dict[str, str]] = {}
            usage, finish = None, None
            async for chunk in raw.parse():
                usage = chunk.usage or usage
                for choice in chunk.choices:
                    finish = choice.finish_reason or finish
                    for delta in choice.delta.tool_calls or ():
                        slot = calls.setdefault(delta.index, {"id": "", "name": "", "args": ""})
                        slot["id"] += delta.id or ""
                        slot["name"] += delta.function.name or ""
                        slot["args"] += delta.function.arguments or ""
            assert finish == "tool_calls"
            tool_calls = [
                {
                    "id": c["id"],
                    "type": "function",
                    "function": {"name": c["name"], "arguments": c["args"]},
                }
                for _, c in sorted(calls.items())
            ]
            messages.append({"role": "assistant", "content": None, "tool_calls": tool_calls})
        else:
            first = raw.parse()
            usage = first.usage
            assert first.choices[0].finish_reason == "tool_calls"
            tool_calls = [c.model_dump() for c in first.choices[0].message.tool_calls]
            messages.append(first.choices[0].message.model_dump(exclude_none=True))
        assert tool_calls
        assert tool_calls[0]["function"]["name"] == "get_weather"
        for call in tool_calls:
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": "Rain"})
        # A ReAct-style stop string on the next turn: a normal turn, no handle after it.
        raw = await client.chat.completions.with_raw_response.create(
            model=model,
            messages=messages,
            tools=[WEATHER],  # the same tools: they are rendered into the prefix
            tool_choice="none",
            max_tokens=MAX_TOKENS,
            temperature=0,
            stop=[" "],
            extra_headers={"X-Session-ID": name},
        )
        _check(raw)
        second = raw.parse()
        assert second.choices[0].finish_reason == "stop"
        cached = second.usage.prompt_tokens_details.cached_tokens
        _report(name, cached, _ideal(usage))
        assert cached == _ideal(usage)
        messages += [
            second.choices[0].message.model_dump(exclude_none=True),
            {"role": "user", "content": "Thanks."},
        ]
        raw = await client.chat.completions.with_raw_response.create(
            model=model,
            messages=messages,
            tools=[WEATHER],
            tool_choice="none",
            max_tokens=8,
            temperature=0,
            extra_headers={"X-Session-ID": name},
        )
        _check(raw)  # after a turn without a handle: extends, recomputes what prefill lacks
        assert raw.headers["x-agentkv-handle"] == "none"

    async def main() -> None:
        # Closed in the loop that opened its connections: left to the garbage collector after
        # asyncio.run, its sockets are never closed (ResourceWarning).
        async with AsyncOpenAI(
            base_url=f"{proxy.url}/v1", api_key="k", max_retries=0, timeout=600
        ) as client:
            await run(client)

    asyncio.run(main())


@tool
def get_weather(city: str) -> str:
    """The current weather in a city."""
    return f"Sunny in {city}"


def test_langchain_bind_tools_loop(proxy: ProxyServer, model: str) -> None:
    llm = ChatOpenAI(
        model=model,
        base_url=f"{proxy.url}/v1",
        api_key="k",  # type: ignore[arg-type]
        max_tokens=MAX_TOKENS,
        temperature=0,
        default_headers={"X-Session-ID": "langchain"},
    ).bind_tools([get_weather], tool_choice="get_weather")
    messages: list[Any] = [SystemMessage(SYSTEM), HumanMessage("Weather in Oslo?")]
    first = llm.invoke(messages)
    assert first.tool_calls
    assert first.tool_calls[0]["name"] == "get_weather"
    messages.append(first)
    for call in first.tool_calls:
        messages.append(ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"]))
    second = llm.invoke(messages)
    usage = first.response_metadata["token_usage"]
    cached = second.response_metadata["token_usage"]["prompt_tokens_details"]["cached_tokens"]
    ideal = usage["prompt_tokens"] + usage["completion_tokens"] - 1
    _report("langchain-openai", cached, ideal)
    assert cached == ideal


def test_raw_request_with_conversation_id_and_vllm_only_fields(
    proxy: ProxyServer, model: str
) -> None:
    """What vLLM's multi-turn benchmark client sends (--send-conversation-id), and more."""
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": "Name three colours."}],
        "max_tokens": 16,
        "conversation_id": "bench-conv-1",
        "top_k": 1,
        "min_tokens": 2,
        "skip_special_tokens": True,
        "ignore_eos": False,
        "request_id": "client-chosen",
        "return_token_ids": True,
        "user": "bench",
    }
    with httpx2.Client(base_url=proxy.url, timeout=600) as http:
        first = http.post("/v1/chat/completions", json=body)
        assert first.status_code == 200, first.text
        assert first.headers["x-agentkv-session-id"] == "bench-conv-1"
        answer = first.json()
        body["messages"] = [
            *body["messages"],
            answer["choices"][0]["message"],
            {"role": "user", "content": "And three more."},
        ]
        second = http.post("/v1/chat/completions", json=body)
        assert second.status_code == 200, second.text
        assert "x-agentkv-forked" not in second.headers
        cached = second.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        usage = answer["usage"]
        ideal = usage["prompt_tokens"] + usage["completion_tokens"] - 1
        _report("raw-conversation-id", cached, ideal)
        assert cached == ideal
        refused = http.post("/v1/chat/completions", json={**body, "echo": True})
        assert refused.status_code == 400
        assert refused.json()["error"]["param"] == "echo"


def test_claude_code_parent_and_subagent_threads_reuse_at_the_ideal(
    proxy: ProxyServer, model: str
) -> None:
    """Claude Code's headers: a parent and a subagent under one session id, turns in flight
    together; each thread's turn 2 reuses its own history at the ideal, on the same pair, and
    neither forks the other."""
    session = {"X-Claude-Code-Session-Id": "cc-e2e-1"}
    agent = {**session, "x-claude-code-agent-id": "agent-e2e-1"}
    system = {"role": "system", "content": "You are a terse coding assistant."}
    threads: dict[str, tuple[dict[str, str], list[dict[str, Any]]]] = {
        "parent": (session, [system, {"role": "user", "content": "Name a sorting algorithm."}]),
        "subagent": (agent, [system, {"role": "user", "content": "Name a search algorithm."}]),
    }

    async def turn(http: httpx2.AsyncClient, name: str) -> httpx2.Response:
        headers, messages = threads[name]
        body = {"model": model, "messages": messages, "max_tokens": 16, "temperature": 0}
        response = await http.post("/v1/chat/completions", json=body, headers=headers)
        assert response.status_code == 200, response.text
        assert "x-agentkv-forked" not in response.headers
        return response

    async def run() -> None:
        async with httpx2.AsyncClient(base_url=proxy.url, timeout=600) as http:
            first = await asyncio.gather(turn(http, "parent"), turn(http, "subagent"))
            for (_, messages), response in zip(threads.values(), first, strict=True):
                messages.append(response.json()["choices"][0]["message"])
                messages.append({"role": "user", "content": "Another one."})
            second = await asyncio.gather(turn(http, "parent"), turn(http, "subagent"))
            assert [r.headers["x-agentkv-thread"] for r in second] == [
                "main",
                "agent:agent-e2e-1",
            ]
            assert len({r.headers["x-agentkv-pair"] for r in (*first, *second)}) == 1
            for name, before, after in zip(threads, first, second, strict=True):
                usage = before.json()["usage"]
                ideal = usage["prompt_tokens"] + usage["completion_tokens"] - 1
                cached = after.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
                _report(f"claude-code-{name}", cached, ideal)
                assert cached == ideal, name

    asyncio.run(run())
