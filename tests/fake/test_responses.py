"""The Responses API (``POST /v1/responses``, ``client.responses.create``) on the fake pair:
``previous_response_id`` continues a session token-exactly, ``store: false`` falls back to
history matching, function tools through agentkv's JSON protocol, streaming events, prefill's
reuse in ``usage.input_tokens_details.cached_tokens``, and gone responses are errors."""

from __future__ import annotations

import json

import openai
import pytest
import structlog
from openai.types.responses import Response

import agentkv
from agentkv import Cluster

INSTRUCTIONS = "You answer briefly. " + " ".join(
    f"Rule {i}: be kind to robot {i}." for i in range(30)
)
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
    "strict": False,
}


pytestmark = pytest.mark.fake(pairs=1, kv_recompute_threshold=0, tool_call_parser=None)


@pytest.fixture
async def client(acluster):
    async with agentkv.AsyncOpenAI(acluster, max_retries=0) as client:
        yield client


def _ideal(previous: Response) -> int:
    assert previous.usage is not None
    return previous.usage.input_tokens + previous.usage.output_tokens - 1


def _cached(response: Response) -> int:
    assert response.usage is not None
    return response.usage.input_tokens_details.cached_tokens


async def test_previous_response_id_continues_the_session_token_exactly(client, fake):
    first = await client.responses.create(
        model=client.model, instructions=INSTRUCTIONS, input="Hello?", max_output_tokens=32
    )
    assert isinstance(first, Response)
    assert first.status in ("completed", "incomplete")
    assert first.output_text
    assert _cached(first) == 0
    previous = first
    for question in ("Who is robot 4?", "And robot 9?"):
        raw = await client.responses.with_raw_response.create(
            model=client.model,
            instructions=INSTRUCTIONS,
            input=question,
            previous_response_id=previous.id,
            max_output_tokens=32,
        )
        assert "x-agentkv-forked" not in raw.headers
        assert raw.headers["x-agentkv-handle"] == "attached"
        response = raw.parse()
        assert response.previous_response_id == previous.id
        assert _cached(response) == _ideal(previous)
        previous = response
    assert fake.wrong_reuse_events == 0


async def test_store_false_falls_back_to_matching_the_resent_history(client):
    items: list[dict[str, object]] = [{"role": "user", "content": "Hello?"}]
    headers = {"X-Session-ID": "stateless"}
    first = await client.responses.create(
        model=client.model,
        instructions=INSTRUCTIONS,
        input=items,
        store=False,
        max_output_tokens=32,
        extra_headers=headers,
    )
    items += [item.model_dump(exclude_none=True) for item in first.output]
    items.append({"role": "user", "content": "And robot 9?"})
    raw = await client.responses.with_raw_response.create(
        model=client.model,
        instructions=INSTRUCTIONS,
        input=items,
        store=False,
        max_output_tokens=32,
        extra_headers=headers,
    )
    assert "x-agentkv-forked" not in raw.headers
    assert _cached(raw.parse()) == _ideal(first)
    # Not stored: it cannot be continued by id.
    with pytest.raises(openai.NotFoundError):
        await client.responses.create(
            model=client.model, input="More?", previous_response_id=first.id
        )


async def test_a_function_tool_loop_continues_by_id_with_the_calls_results(client, fake):
    first = await client.responses.create(
        model=client.model,
        instructions=INSTRUCTIONS,
        input="Weather in Paris?",
        tools=[WEATHER],
        tool_choice="required",
        max_output_tokens=64,
    )
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls
    for call in calls:
        assert call.name == "get_weather"
        assert isinstance(json.loads(call.arguments), dict)
    raw = await client.responses.with_raw_response.create(
        model=client.model,
        instructions=INSTRUCTIONS,
        previous_response_id=first.id,
        input=[
            {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny"}
            for call in calls
        ],
        tools=[WEATHER],
        max_output_tokens=32,
    )
    assert raw.headers["x-agentkv-tool-calling"] == "json"
    assert "x-agentkv-forked" not in raw.headers
    assert _cached(raw.parse()) == _ideal(first)
    assert fake.wrong_reuse_events == 0


async def test_a_streamed_response_sends_the_responses_events_and_can_be_continued(client):
    stream = await client.responses.create(
        model=client.model,
        instructions=INSTRUCTIONS,
        input="Hello?",
        max_output_tokens=32,
        stream=True,
    )
    kinds, deltas, final = [], [], None
    async for event in stream:
        kinds.append(event.type)
        if event.type == "response.output_text.delta":
            deltas.append(event.delta)
        if event.type == "response.completed":
            final = event.response
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert final is not None
    assert final.output_text == "".join(deltas)
    assert final.usage is not None
    second = await client.responses.create(
        model=client.model,
        instructions=INSTRUCTIONS,
        input="And robot 9?",
        previous_response_id=final.id,
        max_output_tokens=16,
    )
    assert _cached(second) == _ideal(final)


async def test_a_streamed_tool_call_arrives_as_function_call_items(client):
    stream = await client.responses.create(
        model=client.model,
        input="Weather in Oslo?",
        tools=[WEATHER],
        tool_choice="required",
        max_output_tokens=64,
        stream=True,
    )
    done = [event.item async for event in stream if event.type == "response.output_item.done"]
    assert done
    assert all(item.type == "function_call" and item.name == "get_weather" for item in done)


async def test_unknown_and_expired_previous_responses_are_openai_errors(client):
    with pytest.raises(openai.NotFoundError) as unknown:
        await client.responses.create(
            model=client.model, input="Hi", previous_response_id="resp_nope"
        )
    assert unknown.value.code == "previous_response_not_found"
    raw = await client.responses.with_raw_response.create(
        model=client.model, input="Hi", max_output_tokens=8
    )
    session = raw.headers["x-agentkv-session-id"]
    assert session.startswith("resp-")
    await client.delete(f"/sessions/{session}", cast_to=object)
    with pytest.raises(openai.BadRequestError) as expired:
        await client.responses.create(
            model=client.model, input="More", previous_response_id=raw.parse().id
        )
    assert expired.value.code == "previous_response_expired"


async def test_hosted_tools_are_dropped_and_the_answer_says_which(client):
    """Codex sends web_search and namespace tools (and client_metadata) on every request: the
    request is served, without them and without a warning."""
    with structlog.testing.capture_logs() as logs:
        raw = await client.responses.with_raw_response.create(
            model=client.model,
            input="Hi",
            max_output_tokens=8,
            tools=[{"type": "web_search"}, {"type": "namespace", "name": "mcp", "tools": []}],
            extra_body={"client_metadata": {"installation_id": "x"}},
        )
    assert raw.headers["x-agentkv-tools-dropped"] == "web_search,namespace"
    assert not [e for e in logs if e["log_level"] == "warning"]
    with pytest.raises(openai.BadRequestError):
        await client.responses.create(model=client.model, input="Hi", tools=[{"name": "f"}])


def test_the_sync_client_continues_responses_by_id(fake):
    with (
        Cluster.from_dict(fake.cluster_spec, transport=fake.transport) as cluster,
        agentkv.OpenAI(cluster, max_retries=0) as client,
    ):
        first = client.responses.create(
            model=client.model, instructions=INSTRUCTIONS, input="Hello?", max_output_tokens=32
        )
        second = client.responses.create(
            model=client.model,
            instructions=INSTRUCTIONS,
            input="And robot 9?",
            previous_response_id=first.id,
            max_output_tokens=32,
        )
        assert _cached(second) == _ideal(first)
        assert fake.decode(0).pinned_handles == 1
    assert fake.decode(0).pinned_handles == 0
