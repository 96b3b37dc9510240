"""The anthropic SDK, unmodified, through ``agentkv proxy``'s Messages API on the real local pair.

Create, stream, and a two-turn tool loop whose second turn reuses the first's KV at the ideal
(the previous prompt + generated - 1 tokens, as ``cache_read_input_tokens``), the way Claude
Code re-sends its history: a message sent as text blocks one turn comes back as a plain string
the next, with ``cache_control`` moved, and the billing line differs from the first turn's (it
is dropped). One proxy serves the module; turns are short.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import anthropic
import pytest

from agentkv.proxy import ProxyServer

pytestmark = pytest.mark.e2e

SYSTEM = "You are a coding agent. Use the tools to answer."
BILLING = "x-anthropic-billing-header: cc_version=2.1.328.{}; cc_entrypoint=sdk-cli;"
BASH = {
    "name": "bash",
    "description": "Run a shell command and return its output.",
    "input_schema": {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "type": "object",
        "properties": {"command": {"type": "string", "description": "the command"}},
        "required": ["command"],
    },
}
# temperature 0: the 135M model sampled at 1.0 may wander inside a JSON string.
SAMPLING = {"temperature": 0}


@pytest.fixture
def client(proxy: ProxyServer) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=proxy.url, api_key="k", max_retries=0, timeout=600) as client:
        yield client


def _ideal(previous: anthropic.types.Message) -> int:
    usage = previous.usage
    return usage.input_tokens + (usage.cache_read_input_tokens or 0) + usage.output_tokens - 1


def test_create_and_stream(client: anthropic.Anthropic, model: str) -> None:
    message = client.messages.create(
        model=model,
        max_tokens=16,
        system=SYSTEM,
        messages=[{"role": "user", "content": "Say hello."}],
        extra_body=SAMPLING,
    )
    assert message.content[0].type == "text"
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert message.usage.output_tokens > 0
    with client.messages.stream(
        model=model,
        max_tokens=16,
        system=SYSTEM,
        messages=[{"role": "user", "content": "Say hello."}],
        extra_body=SAMPLING,
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == message.content[0].text


def test_a_tool_loop_reuses_at_the_ideal(client: anthropic.Anthropic, model: str) -> None:
    headers = {"X-Claude-Code-Session-Id": "e2e-messages-loop"}
    first_system: list[Any] = [
        {"type": "text", "text": BILLING.format("a1f")},
        {"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}},
    ]
    question = [{"type": "text", "text": "List the files.", "cache_control": {"type": "ephemeral"}}]
    raw = client.messages.with_raw_response.create(
        model=model,
        max_tokens=64,
        system=first_system,
        tools=[BASH],
        tool_choice={"type": "tool", "name": "bash"},
        messages=[{"role": "user", "content": question}],
        extra_headers=headers,
        extra_body=SAMPLING,
    )
    first = raw.parse()
    assert first.stop_reason == "tool_use"
    [use] = [block for block in first.content if block.type == "tool_use"]
    assert use.name == "bash"
    second_system = [
        {"type": "text", "text": BILLING.format("b2c")},
        {"type": "text", "text": SYSTEM},
    ]
    messages: list[Any] = [
        {"role": "user", "content": "List the files."},
        {"role": "assistant", "content": [block.model_dump() for block in first.content]},
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": use.id,
                    "content": "README.md setup.py",
                    "cache_control": {"type": "ephemeral"},
                }
            ],
        },
    ]
    with client.messages.with_streaming_response.create(
        model=model,
        max_tokens=32,
        system=second_system,
        tools=[BASH],
        messages=messages,
        stream=True,
        extra_headers=headers,
        extra_body=SAMPLING,
    ) as response:
        assert "x-agentkv-forked" not in response.headers
        assert response.headers["x-agentkv-handle"] == "attached"
        events = list(response.parse())
    [delta] = [event for event in events if event.type == "message_delta"]
    cached = delta.usage.cache_read_input_tokens
    sys.stderr.write(f"[reuse] messages tool loop: cached {cached} of ideal {_ideal(first)}\n")
    assert cached == _ideal(first)
    assert events[-1].type == "message_stop"


def test_count_tokens_matches_the_first_turn(client: anthropic.Anthropic, model: str) -> None:
    request: dict[str, Any] = {
        "model": model,
        "system": SYSTEM,
        "tools": [BASH],
        "messages": [{"role": "user", "content": "List the files."}],
    }
    counted = client.messages.count_tokens(**request)
    message = client.messages.create(max_tokens=8, extra_body=SAMPLING, **request)
    assert counted.input_tokens == message.usage.input_tokens + (
        message.usage.cache_read_input_tokens or 0
    )
