"""Anthropic's Messages API (``POST /v1/messages``) through the proxy on the fake pair, with the
anthropic SDK unmodified: answers in Anthropic's shape, Claude Code's re-sent histories (text
blocks one turn, a plain string the next) extend their session at the ideal reuse, a tool loop
on both tool-calling modes, stream events in Anthropic's order, errors in Anthropic's shape
with nothing committed, and Claude Code's billing line dropped and counted."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import anthropic
import httpx2
import pytest

import agentkv
from agentkv import AsyncCluster, Cluster
from agentkv.proxy import ProxyConfig, create_app
from agentkv.testing import FakeCluster

SYSTEM = "You are a coding agent. " + " ".join(f"Rule {i}: keep file {i} tidy." for i in range(30))
BILLING = "x-anthropic-billing-header: cc_version=2.1.328.{}; cc_entrypoint=sdk-cli;"
BASH = {
    "name": "bash",
    "description": "Run a shell command.",
    "input_schema": {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "type": "object",
        "properties": {"command": {"type": "string"}},
        "required": ["command"],
    },
    "cache_control": {"type": "ephemeral"},
}


NO_PARSER = pytest.param({"tool_call_parser": None}, id="no-parser")
HERMES = pytest.param({"tool_call_parser": "hermes"}, id="parser")
pytestmark = [
    pytest.mark.fake(pairs=1, kv_recompute_threshold=0),
    pytest.mark.fake_variants(NO_PARSER, HERMES),
]


class Proxy:
    """An app on a fake pair, its raw HTTP client and an anthropic SDK client on it."""

    def __init__(self, fake: FakeCluster, app: Any, http: httpx2.AsyncClient) -> None:
        self.fake = fake
        self.app = app
        self.http = http
        self.sdk = anthropic.AsyncAnthropic(
            base_url="http://proxy", api_key="k", http_client=http, max_retries=0
        )

    def metric(self, name: str, **labels: str) -> float:
        return float(self.app.state.metrics.value(name, **labels))


@pytest.fixture
def config() -> ProxyConfig:
    return ProxyConfig()


@pytest.fixture
async def proxy(fake, acluster, config):
    app = create_app(acluster, config)
    async with httpx2.AsyncClient(
        transport=httpx2.ASGITransport(app=app), base_url="http://proxy"
    ) as http:
        yield Proxy(fake, app, http)


def _ideal(previous: anthropic.types.Message) -> int:
    usage = previous.usage
    prompt = usage.input_tokens + (usage.cache_read_input_tokens or 0)
    return prompt + usage.output_tokens - 1


def _blocks(text: str) -> list[dict[str, Any]]:
    return [{"type": "text", "text": text, "cache_control": {"type": "ephemeral"}}]


@pytest.mark.parametrize("fake", [NO_PARSER], indirect=True)
async def test_create_answers_in_anthropics_shape(proxy):
    message = await proxy.sdk.messages.create(
        model=proxy.fake.model,
        max_tokens=16,
        system=[{"type": "text", "text": SYSTEM}],
        messages=[{"role": "user", "content": "Hello?"}],
        metadata={"user_id": "someone"},
        # The SDK 2.x has no sampling keywords: clients pass them in the body.
        extra_body={
            "temperature": 0.0,
            "top_p": 1.0,
            "top_k": 5,
            "stop_sequences": ["\n\n\n"],
            "thinking": {"type": "adaptive"},
            "context_management": {"edits": []},
            "output_config": {"effort": "high"},
        },
        extra_headers={"anthropic-beta": "interleaved-thinking-2025-05-14"},
    )
    assert message.id.startswith("msg_")
    assert message.type == "message"
    assert message.role == "assistant"
    assert message.model == proxy.fake.model
    assert message.content[0].type == "text"
    assert message.content[0].text
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert message.usage.cache_read_input_tokens == 0
    assert message.usage.cache_creation_input_tokens == 0
    assert message.usage.input_tokens > 0
    assert message.usage.output_tokens > 0


@pytest.mark.parametrize("fake", [NO_PARSER], indirect=True)
async def test_text_blocks_then_a_string_extend_the_session_at_the_ideal(proxy):
    """Claude Code sends a message as text blocks, then as a plain string with cache_control
    moved: the same chat message, so turn 2 reuses turn 1's KV whole."""
    headers = {"X-Claude-Code-Session-Id": "cc-1"}
    system = [{"type": "text", "text": BILLING.format("a1f")}, *_blocks(SYSTEM)]
    first = await proxy.sdk.messages.create(
        model=proxy.fake.model,
        max_tokens=24,
        system=system,
        messages=[{"role": "user", "content": _blocks("Which rule is 7?")}],
        extra_headers=headers,
    )
    answer = first.content[0].text
    raw = await proxy.sdk.messages.with_raw_response.create(
        model=proxy.fake.model,
        max_tokens=24,
        system=[{"type": "text", "text": BILLING.format("a1f")}, {"type": "text", "text": SYSTEM}],
        messages=[
            {"role": "user", "content": "Which rule is 7?"},
            {"role": "assistant", "content": [{"type": "text", "text": answer}]},
            {"role": "user", "content": _blocks("And rule 9?")},
        ],
        extra_headers=headers,
    )
    assert "x-agentkv-forked" not in raw.headers
    assert raw.headers["x-agentkv-session-id"] == "cc-1"
    second = await raw.parse()
    assert second.usage.cache_read_input_tokens == _ideal(first)
    assert proxy.fake.wrong_reuse_events == 0


@pytest.mark.parametrize("fake", [NO_PARSER], indirect=True)
async def test_the_session_id_comes_from_metadata_user_id(proxy):
    user_id = json.dumps({"device_id": "d", "account_uuid": "", "session_id": "cc-meta"})
    kwargs: dict[str, Any] = {"model": proxy.fake.model, "max_tokens": 16, "system": SYSTEM}
    kwargs["metadata"] = {"user_id": user_id}
    first = await proxy.sdk.messages.create(messages=[{"role": "user", "content": "Hi"}], **kwargs)
    raw = await proxy.sdk.messages.with_raw_response.create(
        messages=[
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": first.content[0].text},
            {"role": "user", "content": "Bye"},
        ],
        **kwargs,
    )
    assert raw.headers["x-agentkv-session-id"] == "cc-meta"
    assert (await raw.parse()).usage.cache_read_input_tokens == _ideal(first)


@pytest.mark.parametrize("fake", [NO_PARSER], indirect=True)
async def test_a_subagent_is_a_thread_of_its_own_beside_its_parent(proxy):
    """Claude Code's subagent sends its parent's session id and an agent id, with another
    billing suffix and its own system prompt, while the parent's turn runs: each continues its
    own history at the ideal, neither forks the other, both on one pair."""
    session = {"X-Claude-Code-Session-Id": "cc-sub"}
    child = {**session, "x-claude-code-agent-id": "agent-7"}
    explore = "You are an Explore subagent. " + SYSTEM

    async def turn(headers, system, messages):
        raw = await proxy.sdk.messages.with_raw_response.create(
            model=proxy.fake.model, max_tokens=16, system=system, messages=messages,
            extra_headers=headers,
        )
        return raw.headers, await raw.parse()

    parent_system = [{"type": "text", "text": BILLING.format("a1f")}, *_blocks(SYSTEM)]
    child_system = [
        {"type": "text", "text": BILLING.format("9c2") + " cc_is_subagent=true;"},
        *_blocks(explore),
    ]
    (p_headers, p1), (c_headers, c1) = await asyncio.gather(
        turn(session, parent_system, [{"role": "user", "content": "Plan the fix."}]),
        turn(child, child_system, [{"role": "user", "content": "Find the bug."}]),
    )
    assert p_headers["x-agentkv-thread"] == "main"
    assert c_headers["x-agentkv-thread"] == "agent:agent-7"
    assert p_headers["x-agentkv-pair"] == c_headers["x-agentkv-pair"]
    (p_headers, p2), (c_headers, c2) = await asyncio.gather(
        turn(session, parent_system, [
            {"role": "user", "content": "Plan the fix."},
            {"role": "assistant", "content": p1.content[0].text},
            {"role": "user", "content": "Go on."},
        ]),
        turn(child, child_system, [
            {"role": "user", "content": "Find the bug."},
            {"role": "assistant", "content": c1.content[0].text},
            {"role": "user", "content": "Look deeper."},
        ]),
    )
    assert "x-agentkv-forked" not in p_headers
    assert "x-agentkv-forked" not in c_headers
    assert p2.usage.cache_read_input_tokens == _ideal(p1)
    assert c2.usage.cache_read_input_tokens == _ideal(c1)
    assert proxy.fake.wrong_reuse_events == 0


@pytest.mark.parametrize("stream", [False, True])
async def test_a_tool_loop_extends_the_session_exactly(proxy, stream):
    headers = {"X-Session-ID": "tools"}
    messages: list[dict[str, Any]] = [{"role": "user", "content": "List the files."}]
    kwargs: dict[str, Any] = {
        "model": proxy.fake.model,
        "system": SYSTEM,
        "tools": [BASH],
        "extra_headers": headers,
    }
    choice = {"type": "tool", "name": "bash", "disable_parallel_tool_use": True}
    if stream:
        async with proxy.sdk.messages.stream(
            max_tokens=64, messages=messages, tool_choice=choice, **kwargs
        ) as events:
            first = await events.get_final_message()
    else:
        first = await proxy.sdk.messages.create(
            max_tokens=64, messages=messages, tool_choice=choice, **kwargs
        )
    assert first.stop_reason == "tool_use"
    uses = [block for block in first.content if block.type == "tool_use"]
    assert len(uses) == 1
    assert uses[0].name == "bash"
    assert isinstance(uses[0].input, dict)
    messages += [
        {"role": "assistant", "content": [block.model_dump() for block in first.content]},
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": uses[0].id,
                    "content": [{"type": "text", "text": "a.py b.py"}],
                    "cache_control": {"type": "ephemeral"},
                }
            ],
        },
    ]
    raw = await proxy.sdk.messages.with_raw_response.create(
        max_tokens=32, messages=messages, tool_choice={"type": "auto"}, **kwargs
    )
    assert "x-agentkv-forked" not in raw.headers
    assert raw.headers["x-agentkv-handle"] == "attached"
    second = await raw.parse()
    assert second.usage.cache_read_input_tokens == _ideal(first)
    assert proxy.fake.wrong_reuse_events == 0


@pytest.mark.parametrize("fake", [NO_PARSER], indirect=True)
@pytest.mark.parametrize(
    ("choice", "reason"),
    [({"type": "any"}, "tool_use"), ({"type": "none"}, None)],
    ids=["any", "none"],
)
async def test_tool_choice_any_calls_and_none_answers(proxy, choice, reason):
    message = await proxy.sdk.messages.create(
        model=proxy.fake.model,
        max_tokens=48,
        tools=[BASH],
        tool_choice=choice,
        messages=[{"role": "user", "content": "List the files."}],
    )
    if reason == "tool_use":
        assert message.stop_reason == "tool_use"
        assert any(block.type == "tool_use" for block in message.content)
    else:
        assert all(block.type == "text" for block in message.content)
        assert message.stop_reason in ("end_turn", "max_tokens")


def _events(text: str) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for chunk in text.split("\n\n"):
        if not chunk.strip():
            continue
        event, data = chunk.split("\n", 1)
        assert event.startswith("event: ")
        assert data.startswith("data: ")
        payload = json.loads(data[len("data: ") :])
        assert payload["type"] == event[len("event: ") :]
        out.append((payload["type"], payload))
    return out


@pytest.mark.parametrize("fake", [NO_PARSER], indirect=True)
async def test_a_stream_sends_anthropics_events_in_order(proxy):
    body = {
        "model": proxy.fake.model,
        "max_tokens": 16,
        "stream": True,
        "messages": [{"role": "user", "content": "Hello?"}],
    }
    response = await proxy.http.post("/v1/messages?beta=true", json=body)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = _events(response.text)
    kinds = [kind for kind, _ in events]
    assert kinds[:3] == ["message_start", "ping", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[3:-3]) == {"content_block_delta"}
    deltas = [e["delta"] for kind, e in events if kind == "content_block_delta"]
    assert all(d["type"] == "text_delta" for d in deltas)
    final = dict(events)["message_delta"]
    assert final["delta"]["stop_reason"] in ("end_turn", "max_tokens")
    assert final["usage"]["output_tokens"] > 0
    async with proxy.sdk.messages.stream(
        model=proxy.fake.model, max_tokens=16, messages=[{"role": "user", "content": "Hello?"}]
    ) as stream:
        text = "".join([piece async for piece in stream.text_stream])
        message = await stream.get_final_message()
    assert text == message.content[0].text == "".join(d["text"] for d in deltas)


@pytest.mark.parametrize("fake", [HERMES], indirect=True)
async def test_count_tokens_is_the_first_turns_prompt(proxy):
    request: dict[str, Any] = {
        "model": proxy.fake.model,
        "system": [{"type": "text", "text": BILLING.format("b2c")}, *_blocks(SYSTEM)],
        "messages": [{"role": "user", "content": "List the files."}],
        "tools": [BASH],
    }
    counted = await proxy.sdk.messages.count_tokens(**request)
    message = await proxy.sdk.messages.create(max_tokens=8, **request)
    assert counted.input_tokens == message.usage.input_tokens
    assert (
        proxy.metric(
            "agentkv_proxy_system_blocks_dropped_total", rule="^x-anthropic-billing-header:"
        )
        == 2
    )


async def _first_turns(proxy: Proxy) -> list[int]:
    """Two Claude Code sessions whose billing lines differ: what each first turn reused."""
    cached = []
    for session, suffix in (("s-a", "a1f"), ("s-b", "9c0")):
        message = await proxy.sdk.messages.create(
            model=proxy.fake.model,
            max_tokens=8,
            system=[{"type": "text", "text": BILLING.format(suffix)}, *_blocks(SYSTEM)],
            messages=[{"role": "user", "content": "Hi"}],
            extra_headers={"X-Claude-Code-Session-Id": session},
        )
        cached.append(message.usage.cache_read_input_tokens or 0)
    return cached


@pytest.mark.parametrize("fake", [NO_PARSER], indirect=True)
async def test_the_billing_line_is_dropped_so_sessions_share_their_prefix(proxy):
    first, second = await _first_turns(proxy)
    assert first == 0
    assert second > 500  # the system prompt both share, from prefill's prefix cache
    assert (
        proxy.metric(
            "agentkv_proxy_system_blocks_dropped_total", rule="^x-anthropic-billing-header:"
        )
        == 2
    )


@pytest.mark.parametrize("fake", [NO_PARSER], indirect=True)
@pytest.mark.parametrize("config", [ProxyConfig(drop_system_blocks=())])
async def test_without_the_rule_the_billing_line_keeps_sessions_apart(proxy):
    first, second = await _first_turns(proxy)
    assert first == 0
    assert second < 64  # only the blocks before the billing line's suffix


BAD_BODIES = [
    pytest.param({"messages": [{"role": "user", "content": "Hi"}]}, id="no-max-tokens"),
    pytest.param({"max_tokens": 8, "messages": []}, id="no-messages"),
    pytest.param({"max_tokens": 8, "messages": "Hi"}, id="messages-not-a-list"),
    pytest.param({"max_tokens": 8, "messages": [{"role": "bot", "content": "Hi"}]}, id="role"),
    pytest.param(
        {"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "image"}]}]},
        id="image",
    ),
    pytest.param(
        {
            "max_tokens": 8,
            "messages": [
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm"}]},
                {"role": "user", "content": "Go on"},
            ],
        },
        id="thinking-block",
    ),
    pytest.param(
        {
            "max_tokens": 8,
            "messages": [{"role": "user", "content": "Hi"}],
            "tools": [{"type": "web_search_20250305", "name": "web_search"}],
        },
        id="server-tool",
    ),
    pytest.param(
        {
            "max_tokens": 8,
            "messages": [{"role": "user", "content": "Hi"}],
            "tools": [{"type": "bash_20250124", "name": "bash"}],
        },
        id="bash-tool",
    ),
    pytest.param(
        {
            "max_tokens": 8,
            "messages": [{"role": "user", "content": "Hi"}],
            "tools": [BASH],
            "tool_choice": {"type": "sometimes"},
        },
        id="tool-choice",
    ),
    pytest.param(
        {
            "max_tokens": 8,
            "messages": [
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hel"},
            ],
        },
        id="assistant-prefill",
    ),
    pytest.param(
        {
            "max_tokens": 8,
            "messages": [
                {"role": "user", "content": [{"type": "tool_result", "content": "x"}]},
            ],
        },
        id="tool-result-without-id",
    ),
    pytest.param(
        {"max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}], "top_k": 0.5},
        id="top-k",
    ),
    pytest.param({"max_tokens": 8, "messages": [{"role": "user", "content": ""}]}, id="empty"),
]


@pytest.mark.parametrize("fake", [NO_PARSER], indirect=True)
@pytest.mark.parametrize("body", BAD_BODIES)
async def test_a_malformed_body_is_a_400_in_anthropics_shape_and_commits_nothing(proxy, body):
    response = await proxy.http.post(
        "/v1/messages", json=body, headers={"X-Session-ID": "bad", "x-api-key": "k"}
    )
    assert response.status_code == 400, response.text
    data = response.json()
    assert data["type"] == "error"
    assert data["error"]["type"] == "invalid_request_error"
    assert data["error"]["message"]
    assert (await proxy.http.get("/v1/sessions/bad", headers={"x-api-key": "k"})).status_code == 404


@pytest.mark.parametrize("fake", [NO_PARSER], indirect=True)
async def test_errors_before_the_body_is_read_are_anthropics_too(proxy):
    invalid = await proxy.http.post("/v1/messages", content=b"{not json")
    assert invalid.status_code == 400
    assert invalid.json()["error"]["type"] == "invalid_request_error"
    big = await proxy.http.post("/v1/messages", content=b"x" * (9 * 1024 * 1024))
    assert big.status_code == 413
    assert big.json() == {
        "type": "error",
        "error": {"type": "request_too_large", "message": big.json()["error"]["message"]},
    }
    other = await proxy.http.post(
        "/v1/messages",
        json={
            "model": "claude-opus-4",
            "max_tokens": 8,
            "messages": [{"role": "user", "content": "Hi"}],
        },
    )
    assert other.status_code == 404
    assert other.json()["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.NotFoundError):
        await proxy.sdk.messages.create(
            model="claude-opus-4", max_tokens=8, messages=[{"role": "user", "content": "Hi"}]
        )


@pytest.mark.parametrize("fake", [NO_PARSER], indirect=True)
async def test_api_keys_are_read_from_x_api_key_too(fake, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("alice sk-alice\n")
    config = ProxyConfig(api_keys=agentkv.proxy.ApiKeys.from_file(keys))
    async with AsyncCluster.from_dict(fake.cluster_spec, transport=fake.transport) as cluster:
        app = create_app(cluster, config)
        async with httpx2.AsyncClient(
            transport=httpx2.ASGITransport(app=app), base_url="http://proxy"
        ) as http:
            body = {"max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]}
            refused = await http.post("/v1/messages", json=body, headers={"x-api-key": "sk-bob"})
            assert refused.status_code == 401
            assert refused.json()["error"]["type"] == "authentication_error"
            sdk = anthropic.AsyncAnthropic(
                base_url="http://proxy", api_key="sk-alice", http_client=http, max_retries=0
            )
            message = await sdk.messages.create(model=fake.model, **body)
            assert message.content


@pytest.mark.parametrize("fake", [NO_PARSER], indirect=True)
async def test_agentkv_async_anthropic_serves_messages_in_process(fake):
    """``agentkv.AsyncAnthropic`` is the anthropic SDK's client, on the proxy's own app."""
    cluster = AsyncCluster.from_dict(fake.cluster_spec, transport=fake.transport)
    async with cluster, agentkv.AsyncAnthropic(cluster, session_id="s", max_retries=0) as sdk:
        assert isinstance(sdk, anthropic.AsyncAnthropic)
        messages: list[dict[str, Any]] = [{"role": "user", "content": "Hi"}]
        first = await sdk.messages.create(
            model=sdk.model, max_tokens=16, system=SYSTEM, messages=messages
        )
        messages += [
            {"role": "assistant", "content": [b.model_dump() for b in first.content]},
            {"role": "user", "content": "Bye"},
        ]
        async with sdk.messages.stream(
            model=sdk.model, max_tokens=16, system=SYSTEM, messages=messages
        ) as stream:
            second = await stream.get_final_message()
        assert second.usage.cache_read_input_tokens == _ideal(first)


@pytest.mark.parametrize("fake", [NO_PARSER], indirect=True)
def test_agentkv_anthropic_is_the_sync_twin(fake):
    cluster = Cluster.from_dict(fake.cluster_spec, transport=fake.transport)
    with cluster, agentkv.Anthropic(cluster, max_retries=0) as sdk:
        assert isinstance(sdk, anthropic.Anthropic)
        message = sdk.messages.create(
            model=sdk.model, max_tokens=8, messages=[{"role": "user", "content": "Hi"}]
        )
        assert message.content[0].type == "text"
        assert (
            sdk.messages.count_tokens(
                model=sdk.model, messages=[{"role": "user", "content": "Hi"}]
            ).input_tokens
            == message.usage.input_tokens
        )


@pytest.mark.parametrize("fake", [NO_PARSER], indirect=True)
@pytest.mark.parametrize("stream", [False, True])
async def test_a_stop_sequence_is_named_in_the_answer(proxy, stream):
    request: dict[str, Any] = {
        "model": proxy.fake.model,
        "max_tokens": 60,
        "system": SYSTEM,
        "messages": [{"role": "user", "content": "Tell me about rule 3."}],
    }
    reference = (await proxy.sdk.messages.create(**request)).content[0].text
    words = reference.split(" ")
    assert len(words) > 6, reference
    stop = " " + words[4]
    request["extra_body"] = {"stop_sequences": [stop]}
    if stream:
        async with proxy.sdk.messages.stream(**request) as events:
            message = await events.get_final_message()
    else:
        message = await proxy.sdk.messages.create(**request)
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", stop)
    assert message.content[0].text == reference[: reference.index(stop)]


@pytest.mark.parametrize("fake", [NO_PARSER], indirect=True)
async def test_cache_diagnostics_name_what_broke_the_prefix(proxy):
    """With Anthropic's cache-diagnosis beta, an answer says whether the request extended the
    message it names (``null``), and if not, what changed and how many input tokens missed."""
    beta = {"anthropic-beta": "cache-diagnosis-2026-04-07", "X-Claude-Code-Session-Id": "cc-d"}

    async def post(messages, previous=None, headers=beta):
        body: dict[str, Any] = {"model": proxy.fake.model, "max_tokens": 12, "system": SYSTEM,
                                "messages": messages}
        if previous is not None:
            body["diagnostics"] = {"previous_message_id": previous}
        response = await proxy.http.post("/v1/messages", json=body, headers=headers)
        assert response.status_code == 200, response.text
        return response.json()

    first = await post([{"role": "user", "content": "Which rule is 3?"}])
    assert "diagnostics" not in first  # not asked for
    history = [
        {"role": "user", "content": "Which rule is 3?"},
        {"role": "assistant", "content": first["content"][0]["text"]},
        {"role": "user", "content": "And rule 4?"},
    ]
    second = await post(history, previous=first["id"])
    assert second["diagnostics"] == {"cache_miss_reason": None}
    edited = [{"role": "user", "content": "Which rule is 5?"}, *history[1:]]
    third = await post(edited, previous=second["id"])
    reason = third["diagnostics"]["cache_miss_reason"]
    assert reason["type"] == "messages_changed"
    prompt = third["usage"]["input_tokens"] + third["usage"]["cache_read_input_tokens"]
    assert 0 < reason["cache_missed_input_tokens"] <= prompt
    unknown = await post(history, previous="msg_unknown")
    assert unknown["diagnostics"] == {"cache_miss_reason": {"type": "previous_message_not_found"}}
    # Another API key cannot learn of this key's messages.
    other = await post(history, previous=second["id"],
                       headers={**beta, "Authorization": "Bearer another-key"})
    assert other["diagnostics"]["cache_miss_reason"] == {"type": "previous_message_not_found"}
