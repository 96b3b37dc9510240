"""Agent frameworks on ``agentkv.OpenAI`` / ``agentkv.AsyncOpenAI``, on the fake pair: each
framework's own loop, unmodified (its built-in call limit ends the run: the fake's tool choices
are arbitrary), extends one session call after call: no fork, and every call from the 2nd on
reuses exactly the ideal (the previous prompt and what was generated, less the last token)."""

from __future__ import annotations

import contextlib
import itertools
from typing import Any

import pytest

import agentkv
from agentkv import AsyncCluster, Cluster

SYSTEM = "You are a calculator."
TASK = "Compute (17 + 25) * 3."  # the fake answers it with tool calls, call after call
CALLS = 4


def add(a: int, b: int) -> int:
    """Add two numbers."""
    return a + b


def multiply(a: int, b: int) -> int:
    """Multiply two numbers."""
    return a * b


pytestmark = pytest.mark.fake(pairs=1, kv_recompute_threshold=0, tool_call_parser=None)


def _assert_exact_reuse(session: Any) -> None:
    assert session["forks"] == 0
    turns = session["turns"]
    assert len(turns) == CALLS
    for previous, turn in itertools.pairwise(turns):
        ideal = previous["prompt_tokens"] + previous["generated_tokens"] - 1
        assert turn["handle_state"] == "attached"
        assert turn["ideal_reused_tokens"] == ideal
        assert turn["reused_tokens"] == ideal


def test_a_langchain_create_agent_on_chat_openai_extends_one_session(fake):
    pytest.importorskip("langchain.agents")
    from langchain.agents import create_agent
    from langchain.agents.middleware import ModelCallLimitMiddleware
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    with (
        Cluster.from_dict(fake.cluster_spec, transport=fake.transport) as cluster,
        agentkv.OpenAI(cluster, session_id="langchain", max_retries=0) as client,
    ):
        llm = ChatOpenAI(
            model=client.model,
            api_key="unused",
            client=client.chat.completions,
            root_client=client,
            max_tokens=96,
            temperature=0,
        )
        agent = create_agent(
            llm,
            tools=[tool(add), tool(multiply)],
            system_prompt=SYSTEM,
            middleware=[ModelCallLimitMiddleware(run_limit=CALLS, exit_behavior="end")],
        )
        result = agent.invoke({"messages": [("user", TASK)]}, {"recursion_limit": 100})
        assert any(getattr(m, "tool_calls", None) for m in result["messages"])
        _assert_exact_reuse(client.get("/sessions/langchain", cast_to=object))
    assert fake.wrong_reuse_events == 0


async def test_a_pydantic_ai_agent_on_openai_chat_model_extends_one_session(fake):
    pytest.importorskip("pydantic_ai")
    from pydantic_ai import Agent, UsageLimits
    from pydantic_ai.exceptions import UsageLimitExceeded
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    async with (
        AsyncCluster.from_dict(fake.cluster_spec, transport=fake.transport) as cluster,
        agentkv.AsyncOpenAI(cluster, session_id="pydantic-ai", max_retries=0) as client,
    ):
        model = OpenAIChatModel(client.model, provider=OpenAIProvider(openai_client=client))
        agent = Agent(
            model,
            tools=[add, multiply],
            system_prompt=SYSTEM,
            model_settings={"max_tokens": 96, "temperature": 0},
        )
        # The fake calls tools until the limit: the calls made are what is checked.
        with contextlib.suppress(UsageLimitExceeded):
            await agent.run(TASK, usage_limits=UsageLimits(request_limit=CALLS))
        _assert_exact_reuse(await client.get("/sessions/pydantic-ai", cast_to=object))
    assert fake.wrong_reuse_events == 0


@pytest.mark.parametrize("api", ["responses", "chat-completions"])
async def test_an_openai_agents_sdk_agent_extends_one_session(fake, api):
    pytest.importorskip("agents")
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

    set_tracing_disabled(True)  # no trace export: the run never leaves the process
    async with (
        AsyncCluster.from_dict(fake.cluster_spec, transport=fake.transport) as cluster,
        agentkv.AsyncOpenAI(cluster, session_id="openai-agents", max_retries=0) as client,
    ):
        model_class = OpenAIResponsesModel if api == "responses" else OpenAIChatCompletionsModel
        agent = Agent(
            name="calculator",
            instructions=SYSTEM,
            model=model_class(model=client.model, openai_client=client),
            tools=[function_tool(add), function_tool(multiply)],
            model_settings=ModelSettings(max_tokens=96, temperature=0),
        )
        # The fake calls tools until the SDK's own turn limit: the calls made are what is checked.
        with pytest.raises(MaxTurnsExceeded) as stopped:
            await Runner.run(agent, TASK, max_turns=CALLS)
        assert stopped.value.run_data is not None
        items = stopped.value.run_data.new_items
        assert sum(item.type == "tool_call_item" for item in items) >= 2, items
        _assert_exact_reuse(await client.get("/sessions/openai-agents", cast_to=object))
    assert fake.wrong_reuse_events == 0
