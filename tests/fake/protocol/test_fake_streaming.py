"""Streamed chat completions on the fake: vLLM's chunk shapes, the decode handle on the
last chunk (agentkv's plugin) or none (stock vLLM), and an engine failure inside a stream
(an error event after a 200)."""

from __future__ import annotations

import httpx2
from raw_protocol import (
    DECODE_HANDLE_KEYS,
    FIRST_LEG,
    IM_END,
    TOK,
    chatml_ids,
    leg,
    next_turn,
    post,
    prompt_of_length,
    sse_events,
    turn,
    user,
)

from agentkv.testing import FakeCluster, ManualClock


def test_stream_chunks_have_vllm_shape(client: httpx2.Client, fake: FakeCluster) -> None:
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
    client: httpx2.Client, fake: FakeCluster
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
    with httpx2.Client(transport=fake.transport) as client:
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


def test_an_engine_failure_inside_a_stream_is_an_error_event_after_a_200(
    client: httpx2.Client, fake: FakeCluster
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
