"""Agent frameworks on ``agentkv.OpenAI`` / ``agentkv.AsyncOpenAI`` on the real local pair.

Each framework runs its own agent loop, unmodified, on the calculator task of ``agentkv demo``
(after the same worked example, given as conversation history in the framework's own message
types). Every run must make at least two tool calls; no call may fork its session; every call
from the 2nd on must reuse >= 95% of the ideal (the previous prompt + generated - 1 tokens); and
the greedy run must answer exactly as a run without reuse does (handles never sent).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import agentkv
from agentkv import AsyncCluster, CachePolicy, Cluster, HandleState

pytestmark = pytest.mark.e2e

SYSTEM = "You are a careful calculator. Do one operation per step."
EXAMPLE_TASK = "Compute (2 + 3) * 4 - 1."
EXAMPLE_STEPS = (("add", {"a": 2, "b": 3}, "5"), ("multiply", {"a": 5, "b": 4}, "20"))
EXAMPLE_ANSWER = "20 - 1 = 19."
TASK = "Compute (17 + 25) * 3."
NO_HANDLE = CachePolicy(min_reuse_tokens=10**9)
MAX_CALLS = 6


def add(a: int, b: int) -> int:
    """Add two numbers."""
    return a + b


def multiply(a: int, b: int) -> int:
    """Multiply two numbers."""
    return a * b


def subtract(a: int, b: int) -> int:
    """Subtract b from a."""
    return a - b


def check_session(name: str, session: Any) -> None:
    turns = session["turns"]
    sys.stderr.write(f"[reuse] {name}: {len(turns)} calls, forks {session['forks']}\n")
    assert session["forks"] == 0
    for previous, turn in itertools.pairwise(turns):
        ideal = previous["prompt_tokens"] + previous["generated_tokens"] - 1
        sys.stderr.write(f"[reuse] {name}: cached {turn['reused_tokens']} of ideal {ideal}\n")
        assert turn["reused_tokens"] >= 0.95 * ideal, turn


# --- LangChain: create_agent on ChatOpenAI(client=agentkv.OpenAI(...)), via the proxy, ChatAgentKV


def _turns_of(stats: Any) -> dict[str, Any]:
    turns = [
        {
            "prompt_tokens": t.prompt_tokens,
            "generated_tokens": t.generated_tokens,
            "reused_tokens": t.reused_tokens,
        }
        for t in stats
    ]
    forks = sum(1 for t in stats if t.handle_state == HandleState.DIVERGED)
    return {"turns": turns, "forks": forks}


@contextlib.contextmanager
def _langchain_model(cluster_file: Path, policy: CachePolicy, wiring: str) -> Iterator[Any]:
    """A LangChain chat model, wired as ``wiring`` says, and how to read its session after."""
    from langchain_openai import ChatOpenAI

    from agentkv._agent.tool_calling import JsonToolCalling
    from agentkv.integrations.langchain import ChatAgentKV

    options: dict[str, Any] = {"max_tokens": 96, "temperature": 0}
    parallel = {"parallel_tool_calls": False}
    if wiring == "drop-in":
        with (
            Cluster.from_file(cluster_file, policy=policy) as cluster,
            agentkv.OpenAI(cluster, session_id="langchain", max_retries=0) as client,
        ):
            llm = ChatOpenAI(
                model=client.model,
                api_key="unused",
                client=client.chat.completions,
                root_client=client,
                model_kwargs=parallel,
                **options,
            )
            yield llm, lambda: client.get("/sessions/langchain", cast_to=object)
    else:
        with Cluster.from_file(cluster_file, policy=policy) as cluster:
            kv = ChatAgentKV(cluster=cluster, tool_calling=JsonToolCalling(max_calls=1), **options)
            yield kv, lambda: _turns_of(kv.session.turns if kv.session else ())
            kv.close()


def _langchain_run(cluster_file: Path, policy: CachePolicy, wiring: str) -> tuple[list[Any], Any]:
    from langchain.agents import create_agent
    from langchain.agents.middleware import ModelCallLimitMiddleware
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
    from langchain_core.tools import tool

    history: list[Any] = [HumanMessage(EXAMPLE_TASK)]
    for index, (name, args, result) in enumerate(EXAMPLE_STEPS):
        call_id = f"example_{index}"
        history += [
            AIMessage("", tool_calls=[{"name": name, "args": args, "id": call_id}]),
            ToolMessage(result, tool_call_id=call_id),
        ]
    history += [AIMessage(EXAMPLE_ANSWER), HumanMessage(TASK)]
    with _langchain_model(cluster_file, policy, wiring) as (llm, read_session):
        agent = create_agent(
            llm,
            tools=[tool(add), tool(multiply), tool(subtract)],
            system_prompt=SYSTEM,
            middleware=[ModelCallLimitMiddleware(run_limit=MAX_CALLS, exit_behavior="end")],
        )
        result = agent.invoke({"messages": history}, {"recursion_limit": 100})
        session = read_session()
    return result["messages"][len(history) :], session


# The proxy over HTTP is the drop-in's app behind a socket: LangChain through it is
# tests/e2e/test_proxy_clients_e2e.py's bind_tools loop, so it is not run a third time here.
@pytest.mark.parametrize("wiring", ["drop-in", "chat-agentkv"])
def test_langchain_create_agent_reuses_every_call(cluster_file: Path, wiring: str) -> None:
    pytest.importorskip("langchain.agents")
    messages, session = _langchain_run(cluster_file, CachePolicy(), wiring)
    calls = [call for m in messages for call in getattr(m, "tool_calls", None) or ()]
    assert len(calls) >= 2, messages
    check_session(f"langchain create_agent ({wiring})", session)
    baseline, _ = _langchain_run(cluster_file, NO_HANDLE, wiring)

    def said(run: list[Any]) -> list[Any]:
        return [
            (m.content, [(c["name"], c["args"]) for c in getattr(m, "tool_calls", None) or ()])
            for m in run
        ]

    assert said(messages) == said(baseline)


# --- pydantic-ai: OpenAIChatModel on OpenAIProvider(openai_client=agentkv.AsyncOpenAI(...)) ----


async def _pydantic_ai_run(cluster_file: Path, policy: CachePolicy) -> tuple[list[Any], Any]:
    from pydantic_ai import Agent, UsageLimits, capture_run_messages
    from pydantic_ai.exceptions import UsageLimitExceeded
    from pydantic_ai.messages import (
        ModelRequest,
        ModelResponse,
        TextPart,
        ToolCallPart,
        ToolReturnPart,
        UserPromptPart,
    )
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    history: list[Any] = [ModelRequest(parts=[UserPromptPart(EXAMPLE_TASK)])]
    for index, (name, args, result) in enumerate(EXAMPLE_STEPS):
        call_id = f"example_{index}"
        history += [
            ModelResponse(parts=[ToolCallPart(name, args, tool_call_id=call_id)]),
            ModelRequest(parts=[ToolReturnPart(name, result, tool_call_id=call_id)]),
        ]
    history.append(ModelResponse(parts=[TextPart(EXAMPLE_ANSWER)]))
    async with (
        AsyncCluster.from_file(cluster_file, policy=policy) as cluster,
        agentkv.AsyncOpenAI(cluster, session_id="pydantic-ai", max_retries=0) as client,
    ):
        model = OpenAIChatModel(client.model, provider=OpenAIProvider(openai_client=client))
        agent = Agent(
            model,
            tools=[add, multiply, subtract],
            system_prompt=SYSTEM,
            model_settings={"max_tokens": 96, "temperature": 0, "parallel_tool_calls": False},
        )
        # The framework's own request limit ends a run whose model keeps calling tools, as
        # LangChain's call-limit middleware does above: the calls it made are what is checked.
        with capture_run_messages() as messages, contextlib.suppress(UsageLimitExceeded):
            await agent.run(
                TASK, message_history=history, usage_limits=UsageLimits(request_limit=MAX_CALLS)
            )
        session = await client.get("/sessions/pydantic-ai", cast_to=object)
    return messages[len(history) :], session


def test_pydantic_ai_on_the_drop_in_reuses_every_call(cluster_file: Path) -> None:
    pytest.importorskip("pydantic_ai")
    messages, session = asyncio.run(_pydantic_ai_run(cluster_file, CachePolicy()))
    calls = [p for m in messages for p in m.parts if p.part_kind == "tool-call"]
    assert len(calls) >= 2, messages
    check_session("pydantic-ai", session)
    baseline, _ = asyncio.run(_pydantic_ai_run(cluster_file, NO_HANDLE))

    def said(run: list[Any]) -> list[Any]:
        return [
            (p.part_kind, getattr(p, "content", None), getattr(p, "args", None))
            for m in run
            for p in m.parts
            if p.part_kind in ("text", "tool-call")
        ]

    assert said(messages) == said(baseline)


# --- OpenAI Agents SDK: Agent on OpenAIResponsesModel / OpenAIChatCompletionsModel(openai_client=
# agentkv.AsyncOpenAI(...)) ----------------------------------------------------------------------


async def _openai_agents_run(
    cluster_file: Path, policy: CachePolicy, api: str
) -> tuple[list[Any], Any]:
    import json

    from agents import (
        Agent,
        MaxTurnsExceeded,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)  # no trace export: nothing leaves the machine
    history: list[Any] = [{"role": "user", "content": EXAMPLE_TASK}]
    for index, (name, args, result) in enumerate(EXAMPLE_STEPS):
        call_id = f"example_{index}"
        history += [
            {
                "type": "function_call",
                "call_id": call_id,
                "name": name,
                "arguments": json.dumps(args),
            },
            {"type": "function_call_output", "call_id": call_id, "output": result},
        ]
    history += [
        {"role": "assistant", "content": EXAMPLE_ANSWER},
        {"role": "user", "content": TASK},
    ]
    async with (
        AsyncCluster.from_file(cluster_file, policy=policy) as cluster,
        agentkv.AsyncOpenAI(cluster, session_id="openai-agents", max_retries=0) as client,
    ):
        model_class = OpenAIResponsesModel if api == "responses" else OpenAIChatCompletionsModel
        agent = Agent(
            name="calculator",
            instructions=SYSTEM,
            model=model_class(model=client.model, openai_client=client),
            tools=[function_tool(add), function_tool(multiply), function_tool(subtract)],
            model_settings=ModelSettings(max_tokens=96, temperature=0, parallel_tool_calls=False),
        )
        # The SDK's own turn limit ends a run whose model keeps calling tools, as the limits of
        # LangChain and pydantic-ai do above: the calls it made are what is checked.
        try:
            items = (await Runner.run(agent, history, max_turns=MAX_CALLS)).new_items
        except MaxTurnsExceeded as stopped:
            items = stopped.run_data.new_items if stopped.run_data else []
        session = await client.get("/sessions/openai-agents", cast_to=object)
    return items, session


@pytest.mark.parametrize("api", ["responses", "chat-completions"])
def test_openai_agents_sdk_on_the_drop_in_reuses_every_call(cluster_file: Path, api: str) -> None:
    pytest.importorskip("agents")
    from agents import ItemHelpers

    items, session = asyncio.run(_openai_agents_run(cluster_file, CachePolicy(), api))
    assert sum(item.type == "tool_call_item" for item in items) >= 2, items
    check_session(f"openai-agents ({api})", session)
    baseline, _ = asyncio.run(_openai_agents_run(cluster_file, NO_HANDLE, api))

    def said(run: list[Any]) -> list[Any]:
        return [
            (item.raw_item.name, item.raw_item.arguments)
            if item.type == "tool_call_item"
            else ItemHelpers.text_message_output(item)
            for item in run
            if item.type in ("tool_call_item", "message_output_item")
        ]

    assert said(items) == said(baseline)
