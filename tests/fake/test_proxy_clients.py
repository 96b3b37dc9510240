"""Unmodified OpenAI clients over real HTTP: the ``openai`` SDK and LangChain's ``ChatOpenAI``.

The proxy runs on uvicorn on an ephemeral 127.0.0.1 port, in front of the fake pair.
"""

from __future__ import annotations

import httpx2
import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from openai import OpenAI

from agentkv import AsyncCluster
from agentkv.proxy import ProxyServer

SYSTEM = "You answer briefly. " + " ".join(f"Rule {i}: be kind to robot {i}." for i in range(30))
QUESTIONS = ("Hello?", "Who is robot 4?", "And robot 9?", "Thanks, bye.")


pytestmark = pytest.mark.fake(pairs=1, kv_recompute_threshold=1)


@pytest.fixture(scope="module")
def server(module_fake):
    def make() -> AsyncCluster:
        return AsyncCluster.from_dict(module_fake.cluster_spec, transport=module_fake.transport)

    with ProxyServer(make) as server:
        yield server


def _session_turns(server, session_id, key="sk-test"):
    response = httpx2.get(
        f"{server.url}/v1/sessions/{session_id}", headers={"Authorization": f"Bearer {key}"}
    )
    response.raise_for_status()
    return response.json()["turns"]


def test_the_openai_client_runs_a_4_turn_conversation_with_reuse(server, module_fake):
    client = OpenAI(
        base_url=f"{server.url}/v1",
        api_key="sk-test",
        default_headers={"X-Session-ID": "openai-sync"},
        max_retries=0,
    )
    messages = [{"role": "system", "content": SYSTEM}]
    cached = []
    for question in QUESTIONS:
        messages.append({"role": "user", "content": question})
        raw = client.chat.completions.with_raw_response.create(
            model=module_fake.model, messages=messages, max_tokens=64
        )
        response = raw.parse()
        assert raw.headers["x-agentkv-pair"] == "pair-0"
        cached.append(response.usage.prompt_tokens_details.cached_tokens)
        messages.append(response.choices[0].message.model_dump(exclude_none=True))
    turns = _session_turns(server, "openai-sync")
    assert [t["handle_state"] for t in turns] == ["none", "attached", "attached", "attached"]
    assert cached == [t["reused_tokens"] for t in turns]
    for turn in turns[1:]:
        assert turn["reused_tokens"] >= turn["ideal_reused_tokens"] // 16 * 16
    assert module_fake.wrong_reuse_events == 0


def test_the_openai_client_streams_a_conversation(server, module_fake):
    client = OpenAI(base_url=f"{server.url}/v1", api_key="sk-test", max_retries=0)
    messages = [{"role": "system", "content": SYSTEM}]
    for question in QUESTIONS:
        messages.append({"role": "user", "content": question})
        stream = client.chat.completions.create(
            model=module_fake.model,
            messages=messages,
            max_tokens=64,
            stream=True,
            stream_options={"include_usage": True},
            extra_headers={"X-Session-ID": "openai-stream"},
        )
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert text
        messages.append({"role": "assistant", "content": text})
    turns = _session_turns(server, "openai-stream")
    assert [t["handle_state"] for t in turns] == ["none", "attached", "attached", "attached"]
    assert module_fake.wrong_reuse_events == 0


def test_langchain_chatopenai_runs_a_4_turn_conversation_with_reuse(server, module_fake):
    llm = ChatOpenAI(
        model=module_fake.model,
        base_url=f"{server.url}/v1",
        api_key="sk-test",
        max_tokens=64,
        max_retries=0,
        default_headers={"X-Session-ID": "langchain"},
    )
    history = [SystemMessage(SYSTEM)]
    for question in QUESTIONS:
        history.append(HumanMessage(question))
        answer = llm.invoke(history)
        assert isinstance(answer, AIMessage)
        assert answer.content
        history.append(answer)
    turns = _session_turns(server, "langchain")
    assert [t["handle_state"] for t in turns] == ["none", "attached", "attached", "attached"]
    last = history[-1]
    assert last.usage_metadata["input_token_details"]["cache_read"] == turns[-1]["reused_tokens"]
    assert module_fake.wrong_reuse_events == 0


def test_langchain_streams_and_echoes_tool_calls_without_forking(server, module_fake):
    """LangChain re-serializes tool arguments; the echo still matches the generated call."""

    @tool
    def lookup(robot: int) -> str:
        """Look a robot up."""
        return f"robot {robot} is friendly"

    llm = ChatOpenAI(
        model=module_fake.model,
        base_url=f"{server.url}/v1",
        api_key="sk-test",
        max_tokens=64,
        max_retries=0,
        default_headers={"X-Session-ID": "langchain-tools"},
    ).bind_tools([lookup], tool_choice="lookup")
    history = [SystemMessage(SYSTEM), HumanMessage("Who is robot 4?")]
    answer = llm.invoke(history)
    assert answer.tool_calls, answer
    history.append(answer)
    for call in answer.tool_calls:
        history.append(lookup.invoke(call))
    chunks = list(llm.stream(history))
    assert chunks
    turns = _session_turns(server, "langchain-tools")
    assert len(turns) == 2
    assert turns[1]["handle_state"] == "attached"
    assert module_fake.wrong_reuse_events == 0
