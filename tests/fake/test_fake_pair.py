"""The fake vLLM P/D cluster speaks vLLM 0.32's protocol and reuses KV as it does.

These tests drive the raw HTTP/JSON protocol with httpx; they are the contract the SDK is
written against.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from agentkv.testing import FakeCluster, FakeTokenizer, ManualClock, render_chat
from agentkv.testing._fake_model import FakeModel
from agentkv.testing._fake_tokenizer import MERGES

CHAT = "/v1/chat/completions"
TOK = FakeTokenizer()
IM_END = TOK.eos_token_id
FIRST_LEG = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
HANDLE_KEYS = {
    "do_remote_prefill",
    "do_remote_decode",
    "remote_block_ids",
    "remote_engine_id",
    "remote_request_id",
    "remote_host",
    "remote_port",
    "tp_size",
    "dcp_size",
    "pp_size",
    "remote_num_tokens",
    "remote_blocks_expiry_time",
    "transfer_mode",
}
# A decode handle from agentkv's connector (the fake's default) also carries the lease ack.
DECODE_HANDLE_KEYS = HANDLE_KEYS | {"agentkv"}


def user(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


def chatml_ids(messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
    return TOK.encode(render_chat(messages, **kwargs))


def prompt_of_length(n: int) -> list[int]:
    """A ChatML prompt of exactly ``n`` tokens (``x`` never merges)."""
    base = chatml_ids(user(""))
    return chatml_ids(user("x" * (n - len(base))))


def next_turn(ids: list[int], generated: list[int], text: str) -> list[int]:
    """Token-exact history: old ids + generated ids (+ <|im_end|>) + the new user turn."""
    tail = [] if generated[-1] == IM_END else [IM_END]
    delta = TOK.encode(f"\n<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n")
    return ids + generated + tail + delta


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(1000.0)


@pytest.fixture
def fake(clock: ManualClock) -> FakeCluster:
    return FakeCluster(pairs=2, clock=clock)


@pytest.fixture
def client(fake: FakeCluster) -> Iterator[httpx.Client]:
    with httpx.Client(transport=fake.transport) as c:
        yield c


def post(client: httpx.Client, url: str, body: dict[str, Any]) -> httpx.Response:
    return client.post(url + CHAT, json=body)


def leg(
    client: httpx.Client,
    url: str,
    ids: list[int],
    params: dict[str, Any] | None,
    **extra: Any,
) -> dict[str, Any]:
    """One token-exact chat completion; asserts success."""
    body: dict[str, Any] = {"messages": user("ignored: prompt_token_ids win"), **extra}
    kv = dict(params or {})
    kv["prompt_token_ids"] = ids
    body["kv_transfer_params"] = kv
    response = post(client, url, body)
    assert response.status_code == 200, response.text
    return response.json()


def turn(
    client: httpx.Client,
    fake: FakeCluster,
    ids: list[int],
    *,
    handle: dict[str, Any] | None = None,
    pair: int = 0,
    **decode_extra: Any,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """P leg then D leg, as the design's protocol describes."""
    p = leg(client, fake.prefill(pair).url, ids, handle or FIRST_LEG, max_tokens=1)
    d = leg(
        client,
        fake.decode(pair).url,
        ids,
        p["kv_transfer_params"],
        return_token_ids=True,
        **decode_extra,
    )
    return p, d


def cached(body: dict[str, Any]) -> int:
    return int(body["usage"]["prompt_tokens_details"]["cached_tokens"])


def metric(client: httpx.Client, url: str, name: str) -> float:
    for line in client.get(url + "/metrics").text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not exposed")


# ------------------------------------------------------------------ tokenizer, templates


def test_tokenizer_round_trips_text_and_special_tokens() -> None:
    text = "<|im_start|>user\nThé cache — 🚀 reuse<|im_end|>\n"
    ids = TOK.encode(text)
    assert ids[0] == TOK.im_start_id
    assert IM_END in ids
    assert TOK.decode(ids) == text
    assert TOK.decode(ids, skip_special_tokens=True) == "user\nThé cache — 🚀 reuse\n"


@given(st.text())
def test_any_text_round_trips_through_canonical_and_byte_encodings(text: str) -> None:
    assert TOK.decode(TOK.encode(text)) == text
    assert TOK.decode(TOK.byte_ids(text)) == text


def test_tokenizer_merges_are_greedy_and_unique() -> None:
    assert len(set(MERGES)) == len(MERGES)
    assert TOK.encode(" the") == [TOK.token_to_id(" the")]
    assert TOK.encode("then") == [TOK.token_to_id("the"), TOK.token_to_id("n")]
    assert TOK.encode("the") != TOK.byte_ids("the")
    assert TOK.decode(TOK.byte_ids("the")) == "the"


def test_model_emits_non_canonical_splits_that_retokenize_differently() -> None:
    model = FakeModel(TOK)
    replies = [model.generate(state, max_tokens=64).token_ids for state in range(20)]
    retokenized = [TOK.encode(TOK.decode(r)) for r in replies]
    assert all(TOK.decode(a) == TOK.decode(b) for a, b in zip(replies, retokenized, strict=True))
    assert any(a != b for a, b in zip(replies, retokenized, strict=True))


def test_tokenize_renders_the_smollm2_chatml_layout(
    client: httpx.Client, fake: FakeCluster
) -> None:
    response = client.post(fake.prefill(0).url + "/tokenize", json={"messages": user("Hi")})
    body = response.json()
    assert set(body) == {"count", "max_model_len", "tokens", "token_strs"}
    assert body["count"] == len(body["tokens"])
    assert body["max_model_len"] == 8192
    assert body["token_strs"] is None
    assert TOK.decode(body["tokens"]) == (
        "<|im_start|>system\n"
        "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_tokenize_keeps_a_given_system_prompt_and_renders_tool_messages(
    client: httpx.Client, fake: FakeCluster
) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "Sunny"},
    ]
    body = {"messages": messages, "add_generation_prompt": False}
    tokens = client.post(fake.prefill(0).url + "/tokenize", json=body).json()["tokens"]
    assert TOK.decode(tokens) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWeather?<|im_end|>\n"
        "<|im_start|>assistant\n<|im_end|>\n"
        "<|im_start|>tool\nSunny<|im_end|>\n"
    )


def test_tokenize_continue_final_message_leaves_the_last_message_open(
    client: httpx.Client, fake: FakeCluster
) -> None:
    messages = [*user("Hi"), {"role": "assistant", "content": "Hel"}]
    body = {"messages": messages, "add_generation_prompt": False, "continue_final_message": True}
    tokens = client.post(fake.prefill(0).url + "/tokenize", json=body).json()["tokens"]
    assert TOK.decode(tokens).endswith("<|im_start|>assistant\nHel")


def test_tokenize_completion_prompt_returns_byte_level_token_strs(
    client: httpx.Client, fake: FakeCluster
) -> None:
    body = {"prompt": "the cache", "return_token_strs": True}
    response = client.post(fake.prefill(0).url + "/tokenize", json=body).json()
    assert response["token_strs"] == ["the", "Ġcache"]
    detok = client.post(fake.prefill(0).url + "/detokenize", json={"tokens": response["tokens"]})
    assert detok.json() == {"prompt": "the cache"}


def test_rerender_template_strips_think_from_past_assistant_turns() -> None:
    history = [
        *user("Q1"),
        {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nA1"},
        *user("Q2"),
    ]
    plain = render_chat(history)
    rerendered = render_chat(history, template="rerender")
    assert "<think>" in plain
    assert "<think>" not in rerendered
    assert "<|im_start|>assistant\nA1<|im_end|>" in rerendered
    # The last assistant message is kept as generated.
    assert "<think>" in render_chat(history[:2], template="rerender", add_generation_prompt=False)


def test_a_rerender_cluster_serves_a_reasoning_model(clock: ManualClock) -> None:
    fake = FakeCluster(pairs=1, clock=clock, chat_template="rerender")
    with httpx.Client(transport=fake.transport) as client:
        reply = post(client, fake.decode(0).url, {"messages": user("Hi")}).json()
        content = reply["choices"][0]["message"]["content"]
        assert content.startswith("<think>\n")
        assert "\n</think>\n\n" in content
        history = {
            "messages": [*user("Hi"), {"role": "assistant", "content": content}, *user("Again")]
        }
        tokens = client.post(fake.decode(0).url + "/tokenize", json=history).json()["tokens"]
        assert "<think>" not in TOK.decode(tokens)


# -------------------------------------------------------------------- token-exact requests


def test_prompt_token_ids_replace_templating_and_come_back_with_return_token_ids(
    client: httpx.Client, fake: FakeCluster
) -> None:
    ids = chatml_ids(user("What is the capital of France?"))
    body = leg(client, fake.decode(0).url, ids, None, return_token_ids=True)
    assert body["usage"]["prompt_tokens"] == len(ids)
    assert body["prompt_token_ids"] == ids
    generated = body["choices"][0]["token_ids"]
    assert generated[-1] == IM_END
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == len(generated)
    assert body["choices"][0]["message"]["content"] == TOK.decode(generated[:-1])
    question = user("What is the capital of France?")
    templated = post(client, fake.decode(1).url, {"messages": question})
    assert templated.json()["usage"]["prompt_tokens"] == len(ids)
    assert templated.json()["prompt_token_ids"] is None
    assert templated.json()["choices"][0]["token_ids"] is None


@pytest.mark.parametrize("bad", [[], [-1], "1 2", [1.5], [True], [10**9]])
def test_invalid_prompt_token_ids_are_a_400_naming_the_parameter(
    client: httpx.Client, fake: FakeCluster, bad: Any
) -> None:
    body = {"messages": user("x"), "kv_transfer_params": {"prompt_token_ids": bad}}
    response = post(client, fake.prefill(0).url, body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "BadRequestError"
    assert error["param"] == "kv_transfer_params.prompt_token_ids"
    assert error["code"] == 400


def test_max_tokens_cuts_the_reply_with_finish_reason_length(
    client: httpx.Client, fake: FakeCluster
) -> None:
    body = leg(client, fake.decode(0).url, chatml_ids(user("Hi")), None, max_tokens=3)
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 3
    long = leg(
        client,
        fake.decode(0).url,
        chatml_ids(user("Hi")),
        None,
        max_tokens=300,
        ignore_eos=True,
        return_token_ids=True,
    )
    assert len(long["choices"][0]["token_ids"]) == 300
    assert IM_END not in long["choices"][0]["token_ids"]


# ------------------------------------------------------------------------- P/D protocol


def test_prefill_leg_answers_with_a_prefill_handle(client: httpx.Client, fake: FakeCluster) -> None:
    ids = prompt_of_length(100)
    p = leg(client, fake.prefill(0).url, ids, FIRST_LEG, max_tokens=1)
    params = p["kv_transfer_params"]
    assert set(params) == HANDLE_KEYS | {"remote_prefill_cached_tokens"}
    assert params["do_remote_prefill"] is True
    assert params["do_remote_decode"] is False
    assert params["remote_engine_id"] == fake.prefill(0).engine_id
    assert params["remote_request_id"].startswith(p["id"] + "-")
    assert params["remote_num_tokens"] == 100
    assert params["remote_blocks_expiry_time"] is None
    assert params["transfer_mode"] == "pull"
    assert (params["tp_size"], params["dcp_size"], params["pp_size"]) == (1, 1, 1)
    assert len(params["remote_block_ids"]) == 1  # one list per KV cache group
    assert len(params["remote_block_ids"][0]) == 7  # ceil(100 / 16)
    assert p["usage"]["completion_tokens"] == 1
    assert p["choices"][0]["finish_reason"] == "length"
    assert fake.prefill(0).pending_prefill_handles == 1


def test_decode_leg_pins_the_turn_end_kv_and_returns_a_decode_handle(
    client: httpx.Client, fake: FakeCluster, clock: ManualClock
) -> None:
    ids = prompt_of_length(100)
    p, d = turn(client, fake, ids)
    handle = d["kv_transfer_params"]
    generated = d["choices"][0]["token_ids"]
    assert set(handle) == DECODE_HANDLE_KEYS
    assert handle["do_remote_decode"] is True
    assert handle["do_remote_prefill"] is False
    assert handle["remote_engine_id"] == fake.decode(0).engine_id
    assert handle["remote_num_tokens"] == 100 + len(generated) - 1
    assert handle["remote_blocks_expiry_time"] == clock() + 480.0
    assert "prompt_token_ids" not in handle
    assert fake.decode(0).pinned_handles == 1
    assert fake.prefill(0).pending_prefill_handles == 0  # D read P's blocks
    assert fake.decode(0).kv_cache_usage > 0
    # P's first token is D's first token: same KV, greedy.
    assert p["choices"][0]["message"]["content"] == TOK.decode(generated[:1])


def test_decode_reports_the_cached_tokens_prefill_passed_on(
    client: httpx.Client, fake: FakeCluster
) -> None:
    ids = prompt_of_length(300)
    leg(client, fake.prefill(0).url, ids, None, max_tokens=1)  # warm P's prefix cache
    p, d = turn(client, fake, ids)
    assert cached(p) == 288  # whole blocks, never the last token
    assert p["kv_transfer_params"]["remote_prefill_cached_tokens"] == 288
    assert cached(d) == 288
    # Without P's figure, D reports its own hit rate: all transferred tokens count.
    p = leg(client, fake.prefill(1).url, ids, FIRST_LEG, max_tokens=1)
    params = {
        k: v for k, v in p["kv_transfer_params"].items() if k != "remote_prefill_cached_tokens"
    }
    d = leg(client, fake.decode(1).url, ids, params)
    assert cached(d) == 300


def test_two_turns_reuse_prompt_plus_generated_minus_one_as_measured_on_vllm(
    clock: ManualClock,
) -> None:
    """DESIGN: 942 prompt + 160 generated tokens, 128-token blocks: turn 2's P caches 1101."""
    fake = FakeCluster(pairs=1, block_size=128, clock=clock)
    with httpx.Client(transport=fake.transport) as client:
        ids = prompt_of_length(942)
        _, d = turn(client, fake, ids, max_tokens=160, ignore_eos=True)
        generated = d["choices"][0]["token_ids"]
        assert len(generated) == 160
        assert d["kv_transfer_params"]["remote_num_tokens"] == 1101
        assert metric(client, fake.decode(0).url, "vllm:kv_cache_usage_perc") == pytest.approx(
            9 / 364
        )
        transfers = "vllm:nixl_bytes_transferred_count"
        assert metric(client, fake.prefill(0).url, transfers) == 0
        ids2 = next_turn(ids, generated, "And Germany?")
        p2, d2 = turn(client, fake, ids2, handle=d["kv_transfer_params"])
        assert cached(p2) == 1101
        assert metric(client, fake.prefill(0).url, transfers) == 1
        assert cached(d2) == 1101
        assert fake.wrong_reuse_events == 0


def test_reused_kv_gives_the_same_output_as_a_cold_run(
    client: httpx.Client, fake: FakeCluster, clock: ManualClock
) -> None:
    ids = prompt_of_length(200)
    _, d = turn(client, fake, ids, max_tokens=100, ignore_eos=True)
    ids2 = next_turn(ids, d["choices"][0]["token_ids"], "More.")
    p2, warm = turn(client, fake, ids2, handle=d["kv_transfer_params"])
    assert cached(p2) == 299
    cold_cluster = FakeCluster(pairs=1, clock=clock)
    with httpx.Client(transport=cold_cluster.transport) as cold_client:
        _, cold = turn(cold_client, cold_cluster, ids2)
    assert cached(cold) == 0
    assert warm["choices"][0]["token_ids"] == cold["choices"][0]["token_ids"]
    assert fake.wrong_reuse_events == 0


def test_wrong_history_with_a_handle_changes_the_output_and_counts_wrong_reuse(
    client: httpx.Client, fake: FakeCluster, clock: ManualClock
) -> None:
    ids = prompt_of_length(200)
    _, d = turn(client, fake, ids, max_tokens=100, ignore_eos=True)
    generated = d["choices"][0]["token_ids"]
    # A history that was edited early on (compacted, re-rendered...) sent with the old handle.
    edited = next_turn(ids, generated, "More.")
    edited[40] = TOK.token_to_id("y")
    p2, wrong = turn(client, fake, edited, handle=d["kv_transfer_params"])
    assert cached(p2) == 299  # vLLM reports the reuse all the same
    # P's pull from D, then D's pull of P's (now wrong) blocks.
    assert fake.wrong_reuse_events == 2
    cold_cluster = FakeCluster(pairs=1, clock=clock)
    with httpx.Client(transport=cold_cluster.transport) as cold_client:
        _, cold = turn(cold_client, cold_cluster, edited)
    assert wrong["choices"][0]["token_ids"] != cold["choices"][0]["token_ids"]


def test_a_pull_below_the_recompute_threshold_recomputes_but_consumes_the_handle(
    client: httpx.Client, fake: FakeCluster
) -> None:
    ids = prompt_of_length(100)
    _, d = turn(client, fake, ids, max_tokens=10, ignore_eos=True)
    ids2 = next_turn(ids, d["choices"][0]["token_ids"], "Ok")
    p2 = leg(client, fake.prefill(0).url, ids2, d["kv_transfer_params"], max_tokens=1)
    # P's own cache has 96 tokens; D would add 109 - 96 = 13 < 64: recompute.
    assert cached(p2) == 96
    assert fake.decode(0).pinned_handles == 0


def test_a_consumed_handle_frees_the_decode_blocks(client: httpx.Client, fake: FakeCluster) -> None:
    ids = prompt_of_length(200)
    _, d = turn(client, fake, ids, max_tokens=100, ignore_eos=True)
    assert fake.decode(0).kv_cache_usage > 0
    ids2 = next_turn(ids, d["choices"][0]["token_ids"], "Next")
    leg(client, fake.prefill(0).url, ids2, d["kv_transfer_params"], max_tokens=1)
    assert fake.decode(0).pinned_handles == 0
    assert metric(client, fake.decode(0).url, "vllm:kv_cache_usage_perc") == 0.0


def test_a_handle_read_twice_returns_whatever_the_freed_blocks_hold(clock: ManualClock) -> None:
    """vLLM does not refuse a second read: D logs it, P gets the blocks' current content."""
    fake = FakeCluster(pairs=2, clock=clock, num_kv_blocks=40)
    with httpx.Client(transport=fake.transport) as client:
        ids = prompt_of_length(150)
        _, d = turn(client, fake, ids, max_tokens=60, ignore_eos=True)
        handle = d["kv_transfer_params"]
        ids2 = next_turn(ids, d["choices"][0]["token_ids"], "Next")
        first = leg(client, fake.prefill(0).url, ids2, handle, max_tokens=1)
        assert cached(first) == 209
        assert fake.wrong_reuse_events == 0
        # D reuses the freed blocks for another request...
        leg(client, fake.decode(0).url, prompt_of_length(600), None, max_tokens=1)
        # ...then the same handle is pulled again (by another prefill server).
        second = leg(client, fake.prefill(1).url, ids2, handle, max_tokens=1)
        assert cached(second) == 209
        assert fake.wrong_reuse_events == 1
        after_expiry = "vllm:nixl_num_notifications_after_expiry_total"
        assert metric(client, fake.decode(0).url, after_expiry) == 1


def test_an_expired_handle_fails_the_prefill_leg_with_a_500(
    client: httpx.Client, fake: FakeCluster
) -> None:
    ids = prompt_of_length(200)
    _, d = turn(client, fake, ids, max_tokens=100, ignore_eos=True)
    fake.advance(480.0)
    assert fake.decode(0).pinned_handles == 0
    ids2 = next_turn(ids, d["choices"][0]["token_ids"], "Next")
    body = {
        "messages": user("x"),
        "max_tokens": 1,
        "kv_transfer_params": {**d["kv_transfer_params"], "prompt_token_ids": ids2},
    }
    response = post(client, fake.prefill(0).url, body)
    assert response.status_code == 500
    assert response.json() == {
        "error": {
            "message": "Internal server error",
            "type": "InternalServerError",
            "param": None,
            "code": 500,
        }
    }
    assert metric(client, fake.prefill(0).url, "vllm:nixl_num_kv_expired_reqs_total") == 1


def test_a_handle_within_five_seconds_of_expiry_is_declined(
    client: httpx.Client, fake: FakeCluster
) -> None:
    ids = prompt_of_length(200)
    _, d = turn(client, fake, ids, max_tokens=100, ignore_eos=True)
    fake.advance(475.5)
    assert fake.decode(0).pinned_handles == 1
    ids2 = next_turn(ids, d["choices"][0]["token_ids"], "Next")
    body = {
        "messages": user("x"),
        "max_tokens": 1,
        "kv_transfer_params": {**d["kv_transfer_params"], "prompt_token_ids": ids2},
    }
    assert post(client, fake.prefill(0).url, body).status_code == 500
    assert fake.decode(0).pinned_handles == 1  # D was never told: it keeps the pin to the TTL
    fake.advance(5.0)
    assert fake.decode(0).pinned_handles == 0


def test_the_decode_server_pins_after_every_request_with_kv_transfer_params(
    client: httpx.Client, fake: FakeCluster
) -> None:
    ids = prompt_of_length(50)
    leg(client, fake.decode(0).url, ids, None)
    assert fake.decode(0).pinned_handles == 0
    turn(client, fake, ids)
    turn(client, fake, prompt_of_length(60))
    assert fake.decode(0).pinned_handles == 2
    leg(client, fake.decode(0).url, ids, {"do_remote_decode": False})
    assert fake.decode(0).pinned_handles == 3


def test_a_handle_from_a_restarted_decode_server_fails_the_pull(
    client: httpx.Client, fake: FakeCluster
) -> None:
    ids = prompt_of_length(200)
    _, d = turn(client, fake, ids, max_tokens=100, ignore_eos=True)
    fake.decode(0).restart()
    assert fake.decode(0).pinned_handles == 0
    ids2 = next_turn(ids, d["choices"][0]["token_ids"], "Next")
    body = {
        "messages": user("x"),
        "max_tokens": 1,
        "kv_transfer_params": {**d["kv_transfer_params"], "prompt_token_ids": ids2},
    }
    assert post(client, fake.prefill(0).url, body).status_code == 500
    assert metric(client, fake.prefill(0).url, "vllm:nixl_num_failed_transfers_total") == 1


def test_kv_cache_usage_follows_pins(client: httpx.Client, fake: FakeCluster) -> None:
    decode = fake.decode(0).url
    assert metric(client, decode, "vllm:kv_cache_usage_perc") == 0.0
    turn(client, fake, prompt_of_length(160))
    assert metric(client, decode, "vllm:kv_cache_usage_perc") > 0.0
    fake.advance(480.0)
    assert metric(client, decode, "vllm:kv_cache_usage_perc") == 0.0


# ------------------------------------------------------------------------------ streaming


def sse_events(response: httpx.Response) -> list[Any]:
    assert response.headers["content-type"].startswith("text/event-stream")
    events = [line.removeprefix("data: ") for line in response.text.split("\n\n") if line]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_stream_chunks_have_vllm_shape(client: httpx.Client, fake: FakeCluster) -> None:
    ids = chatml_ids(user("Hi"))
    body = {
        "messages": user("Hi"),
        "stream": True,
        "return_token_ids": True,
        "stream_options": {"include_usage": True},
    }
    chunks = sse_events(post(client, fake.decode(0).url, body))
    first, *tokens, usage = chunks
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"] == [
        {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
    ]
    assert first["prompt_token_ids"] == ids
    assert all(c["id"] == first["id"] for c in chunks)
    assert [c["choices"][0]["finish_reason"] for c in tokens][-1] == "stop"
    assert "stop_reason" in tokens[-1]["choices"][0]
    assert "stop_reason" not in tokens[0]["choices"][0]
    generated = [t for c in tokens for t in c["choices"][0]["token_ids"]]
    assert generated[-1] == IM_END
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in tokens)
    assert text == TOK.decode(generated, skip_special_tokens=True)
    assert usage["choices"] == []
    assert usage["usage"] == {
        "prompt_tokens": len(ids),
        "total_tokens": len(ids) + len(generated),
        "completion_tokens": len(generated),
        "prompt_tokens_details": {"cached_tokens": 0, "created_cache_tokens": len(ids) // 16 * 16},
    }
    assert "kv_transfer_params" not in usage  # no kv_transfer_params in the request


def test_streamed_decode_leg_puts_the_handle_on_the_last_chunk(
    client: httpx.Client, fake: FakeCluster
) -> None:
    ids = prompt_of_length(100)
    p = leg(client, fake.prefill(0).url, ids, FIRST_LEG, max_tokens=1)
    params = {**p["kv_transfer_params"], "prompt_token_ids": ids}
    body = {"messages": user("x"), "stream": True, "kv_transfer_params": params}
    chunks = sse_events(post(client, fake.decode(0).url, body))
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert set(chunks[-1]["kv_transfer_params"]) == DECODE_HANDLE_KEYS
    assert all("kv_transfer_params" not in c for c in chunks[:-1])

    p = leg(client, fake.prefill(1).url, ids, FIRST_LEG, max_tokens=1)
    params = {**p["kv_transfer_params"], "prompt_token_ids": ids}
    body = {**body, "kv_transfer_params": params, "stream_options": {"include_usage": True}}
    chunks = sse_events(post(client, fake.decode(1).url, body))
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["kv_transfer_params"]["remote_engine_id"] == fake.decode(1).engine_id


def test_stock_vllm_streams_carry_no_handle_but_still_pin(clock: ManualClock) -> None:
    fake = FakeCluster(pairs=1, clock=clock, stream_handles=False, leases=False)
    with httpx.Client(transport=fake.transport) as client:
        ids = prompt_of_length(100)
        p = leg(client, fake.prefill(0).url, ids, FIRST_LEG, max_tokens=1)
        params = {**p["kv_transfer_params"], "prompt_token_ids": ids}
        body = {
            "messages": user("x"),
            "stream": True,
            "kv_transfer_params": params,
            "stream_options": {"include_usage": True},
        }
        chunks = sse_events(post(client, fake.decode(0).url, body))
        assert all("kv_transfer_params" not in c for c in chunks)
        assert fake.decode(0).pinned_handles == 1


# ---------------------------------------------------------------------------------- tools

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
    client: httpx.Client, fake: FakeCluster
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
    client: httpx.Client, fake: FakeCluster
) -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    body = {"messages": user("Weather?"), "tools": [WEATHER], "tool_choice": choice}
    response = post(client, fake.decode(0).url, body).json()
    assert response["choices"][0]["finish_reason"] == "stop"
    (call,) = response["choices"][0]["message"]["tool_calls"]
    assert set(json.loads(call["function"]["arguments"])) == {"city", "days"}


def test_streamed_required_tool_call_announces_then_streams_arguments(
    client: httpx.Client, fake: FakeCluster
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
    with httpx.Client(transport=fake.transport) as client:
        body = {"messages": user("x"), "tools": [WEATHER], "tool_choice": "required"}
        response = post(client, fake.decode(0).url, body)
        assert response.status_code == 400
        assert response.json()["error"]["message"] == (
            'tool_choice="required" requires --tool-call-parser to be set'
        )


# --------------------------------------------------------------------------------- errors


def test_a_body_that_is_not_json_is_a_400_like_fastapi(
    client: httpx.Client, fake: FakeCluster
) -> None:
    response = client.post(
        fake.prefill(0).url + CHAT,
        content=b"not json",
        headers={"content-type": "application/json"},
    )
    assert response.status_code == 400
    assert response.json() == {
        "error": {
            "message": "1 validation error:\n  {'type': 'json_invalid', 'loc': 'body.0', "
            "'msg': 'JSON decode error', 'input': '<dict of 0 items>', "
            "'ctx': {'error': 'Expecting value'}}",
            "type": "Bad Request",
            "param": "body.0",
            "code": 400,
        }
    }


def test_a_body_without_json_content_type_is_rejected(
    client: httpx.Client, fake: FakeCluster
) -> None:
    response = client.post(fake.prefill(0).url + CHAT, content=b"{}")
    assert response.status_code == 400
    assert "Only 'application/json' is allowed" in response.json()["error"]["message"]


def test_prompts_longer_than_max_model_len_are_a_400(clock: ManualClock) -> None:
    fake = FakeCluster(pairs=1, clock=clock, max_model_len=256)
    with httpx.Client(transport=fake.transport) as client:
        templated = post(client, fake.prefill(0).url, {"messages": user("x" * 400)})
        assert templated.status_code == 400
        error = templated.json()["error"]
        assert error["param"] == "input_tokens"
        assert error["message"].startswith(
            "This model's maximum context length is 256 tokens. However, your prompt contains "
            "at least 257 input tokens"
        )
        body = {"messages": user("x"), "kv_transfer_params": {"prompt_token_ids": [5] * 300}}
        exact = post(client, fake.prefill(0).url, body)
        assert exact.status_code == 400
        assert exact.json()["error"]["message"] == (
            "Input length (300) exceeds model's maximum context length (256)."
        )
        too_many = post(client, fake.prefill(0).url, {"messages": user("x"), "max_tokens": 300})
        assert too_many.json()["error"]["param"] == "max_tokens"


def test_an_unknown_model_is_a_404(client: httpx.Client, fake: FakeCluster) -> None:
    response = post(client, fake.prefill(0).url, {"messages": user("x"), "model": "gpt-9"})
    assert response.status_code == 404
    assert response.json()["error"]["type"] == "NotFoundError"
    assert response.json()["error"]["param"] == "model"


def test_an_unknown_route_is_a_404(client: httpx.Client, fake: FakeCluster) -> None:
    response = client.get(fake.prefill(0).url + "/v1/nothing")
    assert response.status_code == 404
    assert response.json()["error"]["type"] == "Not Found"


# --------------------------------------------------------------------------------- faults


def test_fail_next_status_answers_with_vllm_error_body_once(
    client: httpx.Client, fake: FakeCluster
) -> None:
    fake.prefill(0).fail_next("status", status=503, times=2)
    body = {"messages": user("x")}
    for _ in range(2):
        response = post(client, fake.prefill(0).url, body)
        assert response.status_code == 503
        assert response.json()["error"]["type"] == "ServiceUnavailableError"
        assert response.json()["error"]["code"] == 503
    assert post(client, fake.prefill(0).url, body).status_code == 200
    assert len(fake.prefill(0).requests) == 3


def test_timeout_fault_raises_read_timeout_after_the_server_did_the_work(
    client: httpx.Client, fake: FakeCluster
) -> None:
    fake.decode(0).fail_next("timeout")
    ids = prompt_of_length(60)
    p = leg(client, fake.prefill(0).url, ids, FIRST_LEG, max_tokens=1)
    body = {
        "messages": user("x"),
        "kv_transfer_params": {**p["kv_transfer_params"], "prompt_token_ids": ids},
    }
    with pytest.raises(httpx.ReadTimeout):
        post(client, fake.decode(0).url, body)
    assert fake.decode(0).pinned_handles == 1  # a pin the client never heard of


def test_reset_fault_drops_the_connection(client: httpx.Client, fake: FakeCluster) -> None:
    fake.prefill(0).fail_next("reset")
    with pytest.raises(httpx.RemoteProtocolError):
        post(client, fake.prefill(0).url, {"messages": user("x")})


@pytest.mark.parametrize("kind", ["malformed_json", "truncated_json"])
def test_broken_body_faults_give_undecodable_json(
    client: httpx.Client, fake: FakeCluster, kind: str
) -> None:
    fake.prefill(0).fail_next(kind)
    response = post(client, fake.prefill(0).url, {"messages": user("x")})
    assert response.status_code == 200
    with pytest.raises(json.JSONDecodeError):
        response.json()


def test_kv_transfer_params_faults_drop_or_corrupt_the_handle(
    client: httpx.Client, fake: FakeCluster
) -> None:
    ids = prompt_of_length(60)
    fake.prefill(0).fail_next("no_kv_transfer_params")
    missing = leg(client, fake.prefill(0).url, ids, FIRST_LEG, max_tokens=1)
    assert missing["kv_transfer_params"] is None
    fake.prefill(0).fail_next("bad_kv_transfer_params")
    bad = leg(client, fake.prefill(0).url, ids, FIRST_LEG, max_tokens=1)
    assert bad["kv_transfer_params"]["remote_block_ids"] == "corrupted"
    assert bad["kv_transfer_params"]["remote_engine_id"] is None


def test_fault_kinds_are_checked(fake: FakeCluster) -> None:
    with pytest.raises(ValueError, match="unknown fault kind"):
        fake.prefill(0).fail_next("explode")


def test_a_killed_server_refuses_connections_and_a_restart_loses_pins(
    client: httpx.Client, fake: FakeCluster
) -> None:
    turn(client, fake, prompt_of_length(80))
    old_engine = fake.decode(0).engine_id
    fake.decode(0).kill()
    with pytest.raises(httpx.ConnectError):
        client.get(fake.decode(0).url + "/health")
    assert fake.decode(0).pinned_handles == 0
    fake.decode(0).restart()
    assert client.get(fake.decode(0).url + "/health").status_code == 200
    assert fake.decode(0).engine_id != old_engine
    assert metric(client, fake.decode(0).url, "vllm:prompt_tokens_total") == 0


# ----------------------------------------------------------------------- other endpoints


def test_health_models_and_metrics_endpoints(client: httpx.Client, fake: FakeCluster) -> None:
    url = fake.prefill(0).url
    health = client.get(url + "/health")
    assert (health.status_code, health.content) == (200, b"")
    models = client.get(url + "/v1/models").json()
    assert models["object"] == "list"
    assert models["data"][0]["id"] == "fake-smollm2"
    assert models["data"][0]["max_model_len"] == 8192
    assert models["data"][0]["owned_by"] == "vllm"
    text = client.get(url + "/metrics").text
    for name in (
        "vllm:kv_cache_usage_perc",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:external_prefix_cache_hits_total",
        "vllm:nixl_xfer_time_seconds_count",
        "vllm:nixl_bytes_transferred_count",
        "vllm:nixl_num_failed_transfers_total",
        "vllm:nixl_num_kv_expired_reqs_total",
        "vllm:nixl_num_notifications_after_expiry_total",
    ):
        assert f'{name}{{engine="0",model_name="fake-smollm2"}}' in text


def test_prefix_cache_metrics_count_tokens(client: httpx.Client, fake: FakeCluster) -> None:
    ids = prompt_of_length(100)
    url = fake.prefill(0).url
    leg(client, url, ids, None, max_tokens=1)
    leg(client, url, ids, None, max_tokens=1)
    assert metric(client, url, "vllm:prefix_cache_queries_total") == 200
    assert metric(client, url, "vllm:prefix_cache_hits_total") == 96
    assert metric(client, url, "vllm:prompt_tokens_total") == 200


def test_cluster_spec_lists_the_pairs(fake: FakeCluster) -> None:
    assert fake.cluster_spec == {
        "model": "fake-smollm2",
        "pairs": [
            {
                "name": "pair-0",
                "prefill": "http://fake-p0.test:8000",
                "decode": "http://fake-d0.test:8000",
            },
            {
                "name": "pair-1",
                "prefill": "http://fake-p1.test:8000",
                "decode": "http://fake-d1.test:8000",
            },
        ],
    }


def test_advance_needs_a_manual_clock() -> None:
    with pytest.raises(TypeError):
        FakeCluster(pairs=1).advance(1.0)


# ---------------------------------------------------------------- async and concurrency


async def test_hundreds_of_concurrent_sessions_share_one_transport(clock: ManualClock) -> None:
    fake = FakeCluster(pairs=2, clock=clock)

    async def session(client: httpx.AsyncClient, n: int) -> int:
        pair = n % 2
        ids = chatml_ids(user(f"session {n}: " + "x" * 100))
        p = await client.post(
            f"{fake.prefill(pair).url}{CHAT}",
            json={
                "messages": [],
                "max_tokens": 1,
                "kv_transfer_params": {**FIRST_LEG, "prompt_token_ids": ids},
            },
        )
        d = await client.post(
            f"{fake.decode(pair).url}{CHAT}",
            json={
                "messages": [],
                "max_tokens": 80,
                "ignore_eos": True,
                "return_token_ids": True,
                "kv_transfer_params": {**p.json()["kv_transfer_params"], "prompt_token_ids": ids},
            },
        )
        generated = d.json()["choices"][0]["token_ids"]
        ids2 = next_turn(ids, generated, "next")
        p2 = await client.post(
            f"{fake.prefill(pair).url}{CHAT}",
            json={
                "messages": [],
                "max_tokens": 1,
                "kv_transfer_params": {**d.json()["kv_transfer_params"], "prompt_token_ids": ids2},
            },
        )
        return cached(p2.json()) - (len(ids) + len(generated) - 1)

    async with httpx.AsyncClient(transport=fake.transport) as client:
        misses = await asyncio.gather(*(session(client, n) for n in range(300)))
    assert misses == [0] * 300
    assert fake.wrong_reuse_events == 0
    assert fake.decode(0).pinned_handles == fake.decode(1).pinned_handles == 0


# ------------------------------------------------------------------------------ real HTTP


def test_serve_exposes_the_cluster_over_real_http(clock: ManualClock) -> None:
    fake = FakeCluster(pairs=1, clock=clock)
    with fake.serve() as served, httpx.Client(timeout=10) as client:
        spec = served.cluster_spec
        prefill, decode = spec["pairs"][0]["prefill"], spec["pairs"][0]["decode"]
        assert prefill.startswith("http://127.0.0.1:")
        ids = prompt_of_length(60)
        p = leg(client, prefill, ids, FIRST_LEG, max_tokens=1)
        d = leg(client, decode, ids, p["kv_transfer_params"])
        assert set(d["kv_transfer_params"]) == DECODE_HANDLE_KEYS
        fake.decode(0).kill()
        with pytest.raises(httpx.ConnectError):
            client.get(decode + "/health")
        fake.decode(0).restart()
        assert client.get(decode + "/health").status_code == 200


def test_a_rejected_decode_leg_still_frees_the_prefill_blocks(
    client: httpx.Client, fake: FakeCluster
) -> None:
    ids = prompt_of_length(60)
    p = leg(client, fake.prefill(0).url, ids, FIRST_LEG, max_tokens=1)
    assert fake.prefill(0).pending_prefill_handles == 1
    body = {
        "messages": user("x"),
        "model": "other-model",
        "kv_transfer_params": {**p["kv_transfer_params"], "prompt_token_ids": ids},
    }
    assert post(client, fake.decode(0).url, body).status_code == 404
    assert fake.prefill(0).pending_prefill_handles == 0


def test_an_unread_prefill_handle_is_released_after_the_lease(
    client: httpx.Client, fake: FakeCluster
) -> None:
    ids = prompt_of_length(60)
    p = leg(client, fake.prefill(0).url, ids, FIRST_LEG, max_tokens=1)
    fake.advance(30.0)
    assert fake.prefill(0).pending_prefill_handles == 0
    # D still reads the freed blocks (as vLLM would); P logs a late notification.
    d = leg(client, fake.decode(0).url, ids, p["kv_transfer_params"])
    assert d["choices"][0]["finish_reason"] == "stop"
    late = "vllm:nixl_num_notifications_after_expiry_total"
    assert metric(client, fake.prefill(0).url, late) == 1
    # Nothing reused the blocks, so their content is still right; the strict fake counts the
    # read of freed KV as wrong all the same (another request could have had them).
    assert fake.wrong_reuse_events == 1


def test_an_engine_failure_inside_a_stream_is_an_error_event_after_a_200(
    client: httpx.Client, fake: FakeCluster
) -> None:
    ids = prompt_of_length(200)
    _, d = turn(client, fake, ids, max_tokens=100, ignore_eos=True)
    fake.advance(480.0)
    ids2 = next_turn(ids, d["choices"][0]["token_ids"], "Next")
    params = {**d["kv_transfer_params"], "prompt_token_ids": ids2}
    body = {"messages": user("x"), "max_tokens": 1, "stream": True, "kv_transfer_params": params}
    response = post(client, fake.prefill(0).url, body)
    assert response.status_code == 200
    role, error = sse_events(response)
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert error == {
        "error": {
            "message": "Internal server error",
            "type": "InternalServerError",
            "param": None,
            "code": 500,
        }
    }


def test_sync_clients_on_many_threads_share_the_transport(fake: FakeCluster) -> None:
    def session(n: int) -> int:
        with httpx.Client(transport=fake.transport) as client:
            ids = chatml_ids(user(f"thread session {n} " + "x" * 120))
            _, d = turn(client, fake, ids, pair=n % 2, max_tokens=70, ignore_eos=True)
            generated = d["choices"][0]["token_ids"]
            ids2 = next_turn(ids, generated, "go on")
            p2 = leg(client, fake.prefill(n % 2).url, ids2, d["kv_transfer_params"], max_tokens=1)
            return cached(p2) - (len(ids) + len(generated) - 1)

    with ThreadPoolExecutor(max_workers=8) as pool:
        assert list(pool.map(session, range(40))) == [0] * 40


@pytest.mark.parametrize(
    "params",
    [
        {
            "do_remote_decode": True,
            "remote_block_ids": [[99999]],
            "remote_engine_id": "x",
            "remote_request_id": "r",
            "remote_host": "fake-d0.test",
            "remote_port": 5601,
            "remote_num_tokens": 500,
        },
        {
            "do_remote_prefill": True,
            "remote_block_ids": "abc",
            "remote_engine_id": None,
            "remote_request_id": None,
            "remote_host": None,
            "remote_port": None,
        },
        {"do_remote_prefill": True},
        {
            "do_remote_decode": True,
            "remote_block_ids": [[1, 2]],
            "remote_engine_id": [],
            "remote_request_id": {},
            "remote_host": ["h"],
            "remote_port": "p",
            "remote_num_tokens": "many",
        },
    ],
)
def test_malformed_handles_get_an_http_answer_never_an_exception(
    client: httpx.Client, fake: FakeCluster, params: dict[str, Any]
) -> None:
    ids = prompt_of_length(200)
    response = post(
        client,
        fake.prefill(0).url,
        {
            "messages": user("x"),
            "max_tokens": 1,
            "kv_transfer_params": {**params, "prompt_token_ids": ids},
        },
    )
    assert response.status_code in (200, 500)
    assert "choices" in response.json() or "error" in response.json()
