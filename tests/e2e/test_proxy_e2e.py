"""``agentkv proxy`` in front of the real local pair, driven by unmodified OpenAI clients.

Reuse is read from the prefill server's own numbers: the proxy reports P's ``cached_tokens`` as
``usage.prompt_tokens_details.cached_tokens`` and never computes it. The ideal for turn N+1 is
turn N's prompt + completion - 1 tokens; the floor asserted is 99% of it, block-aligned.
"""

from __future__ import annotations

import itertools
import re
from typing import Any

import httpx2
import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from langchain_openai import ChatOpenAI
from openai import BadRequestError, OpenAI

from agentkv.local._config import ClusterRecord
from agentkv.proxy import ApiKeys, ProxyServer

KEYS = ApiKeys.parse("alice sk-alice\nbob sk-bob\n")
pytestmark = [pytest.mark.e2e, pytest.mark.proxy(api_keys=KEYS)]

BLOCK = 128  # vLLM's CPU backend block size
MAX_TOKENS = 24
QUESTIONS = (
    "Which parcel is on shelf 3?",
    "Who is the customer on shelf 7?",
    "Which shelf holds parcel 74?",
    "Summarize your answers.",
)
USAGE = re.compile(r"^vllm:kv_cache_usage_perc\{[^}]*\} (\S+)$", re.MULTILINE)


def _system(topic: str) -> str:
    # ~400 tokens, different per test so one test's prefix cache does not serve another's.
    return f"You are the {topic} warehouse assistant. Answer in one short sentence.\n" + "\n".join(
        f"Shelf {i}: holds {topic} parcel {i * 37 % 101} for customer {chr(65 + i % 26)}{i}."
        for i in range(24)
    )


def _client(proxy: ProxyServer, key: str = "sk-alice") -> OpenAI:
    return OpenAI(base_url=f"{proxy.url}/v1", api_key=key, max_retries=0, timeout=600)


def _usage(usage: Any) -> tuple[int, int, int]:
    return usage.prompt_tokens, usage.completion_tokens, usage.prompt_tokens_details.cached_tokens


def _assert_reuse(usages: list[tuple[int, int, int]]) -> None:
    """``(prompt, completion, cached)`` per turn: turns >= 2 reuse >= 99% of the aligned ideal."""
    for (prompt, completion, _), (_, _, cached) in itertools.pairwise(usages):
        ideal = prompt + completion - 1
        assert cached >= 0.99 * (ideal // BLOCK * BLOCK), usages


def _decode_kv_usage(local_cluster: ClusterRecord) -> float:
    text = httpx2.get(f"{local_cluster.pairs[0].decode.url}/metrics", timeout=10).text
    return sum(float(value) for value in USAGE.findall(text))


def test_the_openai_client_gets_reuse_on_every_later_turn(proxy: ProxyServer, model: str) -> None:
    client = _client(proxy)
    messages = [{"role": "system", "content": _system("openai")}]
    usages, handles = [], []
    for question in QUESTIONS:
        messages.append({"role": "user", "content": question})
        raw = client.chat.completions.with_raw_response.create(
            model=model,
            messages=messages,
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_headers={"X-Session-ID": "openai"},
        )
        response = raw.parse()
        usages.append(_usage(response.usage))
        handles.append(raw.headers["x-agentkv-handle"])
        assert "x-agentkv-forked" not in raw.headers
        messages.append(response.choices[0].message.model_dump(exclude_none=True))
    assert handles == ["none", "attached", "attached", "attached"]
    _assert_reuse(usages)


def test_langchain_chatopenai_gets_reuse_on_every_later_turn(
    proxy: ProxyServer, model: str
) -> None:
    llm = ChatOpenAI(
        model=model,
        base_url=f"{proxy.url}/v1",
        api_key="sk-alice",
        max_tokens=MAX_TOKENS,
        temperature=0,
        max_retries=0,
        timeout=600,
        default_headers={"X-Session-ID": "langchain"},
    )
    history = [SystemMessage(_system("langchain"))]
    usages = []
    for question in QUESTIONS:
        history.append(HumanMessage(question))
        answer = llm.invoke(history)
        assert isinstance(answer, AIMessage)
        meta = answer.usage_metadata
        assert meta is not None
        usages.append(
            (
                meta["input_tokens"],
                meta["output_tokens"],
                meta.get("input_token_details", {}).get("cache_read", 0),
            )
        )
        history.append(answer)
    _assert_reuse(usages)


def test_a_streamed_conversation_gets_reuse_on_every_later_turn(
    proxy: ProxyServer, model: str
) -> None:
    """Needs decode to end streams with the handle (agentkv's vLLM plugin, ``agentkv up``)."""
    client = _client(proxy)
    messages = [{"role": "system", "content": _system("stream")}]
    usages, handles = [], []
    for question in QUESTIONS:
        messages.append({"role": "user", "content": question})
        raw = client.chat.completions.with_raw_response.create(
            model=model,
            messages=messages,
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_headers={"X-Session-ID": "stream"},
        )
        handles.append(raw.headers["x-agentkv-handle"])
        text, usage = "", None
        for chunk in raw.parse():
            usage = chunk.usage or usage
            text += "".join(choice.delta.content or "" for choice in chunk.choices)
        assert usage is not None
        assert text
        usages.append(_usage(usage))
        messages.append({"role": "assistant", "content": text})
    assert handles == ["none", "attached", "attached", "attached"]
    _assert_reuse(usages)


def test_forged_kv_transfer_params_get_400(proxy: ProxyServer, model: str) -> None:
    forged = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": "someone-else",
        "remote_block_ids": [[0, 1, 2]],
        "remote_host": "127.0.0.1",
        "remote_port": 1,
    }
    with pytest.raises(BadRequestError) as info:
        _client(proxy).chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=4,
            extra_body={"kv_transfer_params": forged},
            extra_headers={"X-Session-ID": "forged"},
        )
    assert info.value.status_code == 400
    assert info.value.body["param"] == "kv_transfer_params"


def test_unknown_keys_get_401(proxy: ProxyServer) -> None:
    response = httpx2.post(
        f"{proxy.url}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "Hi"}]},
        headers={"Authorization": "Bearer sk-mallory"},
    )
    assert response.status_code == 401


def test_two_keys_with_the_same_session_id_do_not_share_kv(proxy: ProxyServer, model: str) -> None:
    alice, bob = _client(proxy, "sk-alice"), _client(proxy, "sk-bob")
    history = [
        {"role": "system", "content": _system("alice")},
        {"role": "user", "content": QUESTIONS[0]},
    ]
    first = alice.chat.completions.create(
        model=model,
        messages=history,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_headers={"X-Session-ID": "shared"},
    )
    history += [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "user", "content": QUESTIONS[1]},
    ]
    # Bob's conversation differs from its first block, so any reuse would be Alice's KV.
    raw = bob.chat.completions.with_raw_response.create(
        model=model,
        messages=[
            {"role": "system", "content": _system("bob")},
            {"role": "user", "content": QUESTIONS[1]},
        ],
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_headers={"X-Session-ID": "shared"},
    )
    assert raw.headers["x-agentkv-handle"] == "none"
    assert raw.parse().usage.prompt_tokens_details.cached_tokens < BLOCK
    # Alice's session is untouched by Bob's: her next turn still pulls her KV.
    raw = alice.chat.completions.with_raw_response.create(
        model=model,
        messages=history,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_headers={"X-Session-ID": "shared"},
    )
    assert raw.headers["x-agentkv-handle"] == "attached"
    usage = raw.parse().usage
    ideal = first.usage.prompt_tokens + first.usage.completion_tokens - 1
    assert usage.prompt_tokens_details.cached_tokens >= 0.99 * (ideal // BLOCK * BLOCK)


def test_delete_closes_the_session(proxy: ProxyServer, model: str) -> None:
    client = _client(proxy)
    history = [
        {"role": "system", "content": _system("delete")},
        {"role": "user", "content": QUESTIONS[0]},
    ]
    first = client.chat.completions.create(
        model=model,
        messages=history,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_headers={"X-Session-ID": "delete-me"},
    )
    headers = {"Authorization": "Bearer sk-alice"}
    session = httpx2.get(f"{proxy.url}/v1/sessions/delete-me", headers=headers).json()
    assert session["handle"] is not None
    response = httpx2.delete(f"{proxy.url}/v1/sessions/delete-me", headers=headers)
    assert response.status_code == 200
    assert httpx2.get(f"{proxy.url}/v1/sessions/delete-me", headers=headers).status_code == 404
    # The id starts over: no handle is left to send.
    history += [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "user", "content": QUESTIONS[1]},
    ]
    raw = client.chat.completions.with_raw_response.create(
        model=model,
        messages=history,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_headers={"X-Session-ID": "delete-me"},
    )
    assert raw.headers["x-agentkv-handle"] == "none"
    httpx2.delete(f"{proxy.url}/v1/sessions/delete-me", headers=headers)


def test_delete_releases_the_decode_pin(
    proxy: ProxyServer, model: str, local_cluster: ClusterRecord
) -> None:
    """Decode's KV usage falls back once the session holding a pin is deleted.

    The release is the SDK's (``AsyncSession.aclose`` calls agentkv's lease release on decode).
    """
    client = _client(proxy)
    client.chat.completions.create(
        model=model,
        messages=[
            {"role": "system", "content": _system("release")},
            {"role": "user", "content": QUESTIONS[0]},
        ],
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_headers={"X-Session-ID": "release-me"},
    )
    pinned = _decode_kv_usage(local_cluster)
    httpx2.delete(
        f"{proxy.url}/v1/sessions/release-me", headers={"Authorization": "Bearer sk-alice"}
    )
    assert _decode_kv_usage(local_cluster) < pinned


def test_an_agents_max_tokens_32000_is_clamped_to_the_window(
    proxy: ProxyServer, model: str
) -> None:
    """Claude Code and OpenCode ask for 32000 tokens whatever the model; vLLM answers 400 above
    max_model_len. The proxy clamps to what the prompt leaves and says so. Streamed and left
    after the first piece: the answer could run to the whole window on a CPU."""
    with httpx2.stream(
        "POST",
        f"{proxy.url}/v1/chat/completions",
        json={
            "model": model,
            "messages": [{"role": "user", "content": "Say hi."}],
            "max_tokens": 32000,
            "stream": True,
        },
        headers={"Authorization": "Bearer sk-alice"},
        timeout=120,
    ) as response:
        assert response.status_code == 200, response.read()
        asked, given = response.headers["x-agentkv-max-tokens-clamped"].split("->")
        assert asked == "32000"
        assert 0 < int(given) < 8192
        assert next(response.iter_lines()).startswith("data: ")


def test_a_prompt_over_the_window_is_openais_context_length_exceeded(
    proxy: ProxyServer, model: str
) -> None:
    """Refused from the prompt's exact count (a /tokenize call), before any prefill: the code
    Codex compacts its history on."""
    with pytest.raises(BadRequestError) as info:
        _client(proxy).chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "parcel " * 9000}],
            max_tokens=8,
        )
    assert info.value.code == "context_length_exceeded"
    assert info.value.body["param"] == "messages"
    assert "maximum context length is 8192 tokens" in info.value.message
