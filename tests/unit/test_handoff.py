"""kv_transfer_params in and out: leg bodies and strict parsing of vLLM's answers."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest

from agentkv import KVHandle, MalformedResponseError, Message, ServerError
from agentkv._wire.decode_answer import StreamAccumulator, parse_decode
from agentkv._wire.handoff import (
    TurnRequest,
    decode_body,
    extended_handle,
    lease_ref,
    parse_prefill,
    prefill_body,
)
from agentkv._wire.hints import ExtendResult
from agentkv._wire.json import fragment

URL = "http://p:8000/v1/chat/completions"
REQUEST = TurnRequest(
    model="m",
    messages=[{"role": "user", "content": "hi"}],
    num_messages=1,
    max_tokens=32,
    temperature=0.0,
    tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
    tool_choice="required",
    extra={"seed": 3},
)

# As vLLM 0.32's NixlConnector.request_finished builds them.
PREFILL_ANSWER = {
    "id": "chatcmpl-1",
    "object": "chat.completion",
    "model": "m",
    "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "x"}, "finish_reason": "length"}
    ],
    "usage": {
        "prompt_tokens": 500,
        "completion_tokens": 1,
        "total_tokens": 501,
        "prompt_tokens_details": {"cached_tokens": 480},
    },
    "kv_transfer_params": {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [[1, 2, 3, 4]],
        "remote_engine_id": "prefill-engine",
        "remote_request_id": "chatcmpl-1",
        "remote_host": "10.0.0.1",
        "remote_port": 5600,
        "tp_size": 1,
        "dcp_size": 1,
        "pp_size": 1,
        "remote_num_tokens": 500,
        "remote_blocks_expiry_time": None,
        "transfer_mode": "pull",
        "remote_prefill_cached_tokens": 480,
    },
}

DECODE_ANSWER = {
    "id": "chatcmpl-2",
    "object": "chat.completion",
    "model": "m",
    "choices": [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "Paris.", "tool_calls": []},
            "finish_reason": "stop",
            "token_ids": [11, 12, 2],
        }
    ],
    "usage": {"prompt_tokens": 500, "completion_tokens": 3, "total_tokens": 503},
    "prompt_token_ids": list(range(500)),
    "kv_transfer_params": {
        "do_remote_prefill": False,
        "do_remote_decode": True,
        "remote_block_ids": [[7, 8, 9, 10]],
        "remote_engine_id": "decode-engine",
        "remote_request_id": "chatcmpl-2",
        "remote_host": "10.0.0.2",
        "remote_port": 5601,
        "tp_size": 1,
        "dcp_size": 1,
        "pp_size": 1,
        "remote_num_tokens": 502,
        "remote_blocks_expiry_time": 12345.5,
        "transfer_mode": "pull",
    },
}


def decode(data):
    return parse_decode(data, url=URL, pair="p0", issued_at=10.0, deadline=460.0)


def test_prefill_body_without_handle_sends_nulls_and_the_prompt_ids():
    body = json.loads(prefill_body(REQUEST, prompt_ids=fragment([1, 2, 3]), handle=None))
    assert body["max_tokens"] == 1
    assert body["stream"] is False
    assert body["kv_transfer_params"] == {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
        "prompt_token_ids": [1, 2, 3],
    }
    # vLLM renders nothing when it has the ids: the P leg carries no messages
    assert body["messages"] == []
    # sampling and tools do not matter for a one-token prefill
    assert "tools" not in body
    assert "temperature" not in body


def test_a_cache_salt_reaches_prefill_but_other_extras_stay_on_decode():
    """A tenant's cache_salt must isolate prefill's prefix cache, where reuse happens."""
    request = dataclasses.replace(REQUEST, extra={"cache_salt": "tenant-a", "top_k": 5})
    prefill = json.loads(prefill_body(request, prompt_ids=fragment([1, 2, 3]), handle=None))
    assert prefill["cache_salt"] == "tenant-a"
    assert "top_k" not in prefill


def test_prefill_body_with_handle_resends_decodes_params_verbatim():
    handle = decode(DECODE_ANSWER).handle
    assert handle is not None
    body = json.loads(prefill_body(REQUEST, prompt_ids=[1, 2], handle=handle))
    params = body["kv_transfer_params"]
    expected = dict(DECODE_ANSWER["kv_transfer_params"], prompt_token_ids=[1, 2])
    assert params == expected


def test_decode_body_carries_prefills_params_and_asks_for_token_ids():
    prefill = parse_prefill(PREFILL_ANSWER, url=URL)
    body = json.loads(decode_body(REQUEST, prompt_ids=[1, 2], prefill=prefill, stream=True))
    assert body["return_token_ids"] is True
    assert body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert body["max_tokens"] == 32
    assert body["tools"] == REQUEST.tools
    assert body["tool_choice"] == "required"
    assert body["seed"] == 3
    assert body["kv_transfer_params"] == dict(
        PREFILL_ANSWER["kv_transfer_params"], prompt_token_ids=[1, 2]
    )


def test_parse_prefill_reads_cached_tokens_from_usage():
    result = parse_prefill(PREFILL_ANSWER, url=URL)
    assert (result.prompt_tokens, result.cached_tokens) == (500, 480)


def test_parse_prefill_falls_back_to_the_params_cached_count():
    data = copy.deepcopy(PREFILL_ANSWER)
    del data["usage"]["prompt_tokens_details"]
    assert parse_prefill(data, url=URL).cached_tokens == 480
    del data["kv_transfer_params"]["remote_prefill_cached_tokens"]
    assert parse_prefill(data, url=URL).cached_tokens == 0


def _without(data, *path):
    data = copy.deepcopy(data)
    target = data
    for key in path[:-1]:
        target = target[key]
    del target[path[-1]]
    return data


def _with(data, value, *path):
    data = copy.deepcopy(data)
    target = data
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return data


@pytest.mark.parametrize(
    ("data", "detail"),
    [
        ([], "not an object"),
        (_without(PREFILL_ANSWER, "kv_transfer_params"), "no kv_transfer_params"),
        (_with(PREFILL_ANSWER, None, "kv_transfer_params"), "no kv_transfer_params"),
        (_with(PREFILL_ANSWER, "x", "kv_transfer_params"), "not an object"),
        (
            _with(PREFILL_ANSWER, False, "kv_transfer_params", "do_remote_prefill"),
            "do_remote_prefill",
        ),
        (_without(PREFILL_ANSWER, "kv_transfer_params", "remote_engine_id"), "remote_engine_id"),
        (_with(PREFILL_ANSWER, "5600", "kv_transfer_params", "remote_port"), "remote_port"),
        (_with(PREFILL_ANSWER, [["a"]], "kv_transfer_params", "remote_block_ids"), "non-integers"),
        (_without(PREFILL_ANSWER, "kv_transfer_params", "remote_block_ids"), "remote_block_ids"),
        (_without(PREFILL_ANSWER, "usage"), "usage"),
        (_with(PREFILL_ANSWER, 1.5, "usage", "prompt_tokens"), "prompt_tokens"),
        (_with(PREFILL_ANSWER, "9", "usage", "prompt_tokens_details", "cached_tokens"), "cached"),
    ],
)
def test_parse_prefill_rejects_what_vllm_would_not_send(data, detail):
    with pytest.raises(MalformedResponseError, match=detail) as info:
        parse_prefill(data, url=URL)
    assert info.value.url == URL


def test_parse_decode_builds_message_ids_and_handle():
    result = decode(DECODE_ANSWER)
    assert result.message == Message.assistant("Paris.")
    assert result.token_ids == (11, 12, 2)
    assert result.finish_reason == "stop"
    handle = result.handle
    assert isinstance(handle, KVHandle)
    assert handle.engine_id == "decode-engine"
    assert handle.request_id == "chatcmpl-2"
    assert handle.block_ids == ((7, 8, 9, 10),)
    assert (handle.host, handle.port) == ("10.0.0.2", 5601)
    assert handle.num_tokens == 502
    assert handle.server_expiry == 12345.5
    assert (handle.issued_at, handle.deadline, handle.pair) == (10.0, 460.0, "p0")
    assert handle.extra["tp_size"] == 1  # the engine's own fields, kept for the next P leg


def test_a_leased_handle_keeps_its_secret_from_prefill_and_from_repr():
    ack = {"v": 1, "pinned": True, "lease": "s3cret-lease", "ttl_s": 60.0}
    handle = decode(_with(DECODE_ANSWER, ack, "kv_transfer_params", "agentkv")).handle
    assert handle is not None
    assert handle.lease_ttl_s == 60.0
    assert lease_ref(handle).lease == "s3cret-lease"
    assert "s3cret" not in repr(handle)
    params = json.loads(prefill_body(REQUEST, prompt_ids=[1], handle=handle))["kv_transfer_params"]
    assert "agentkv" not in params
    assert params == dict(DECODE_ANSWER["kv_transfer_params"], prompt_token_ids=[1])


def test_an_extended_handle_sends_its_new_expiry_and_presents_its_new_secret():
    """Prefill declines a pull near the old expiry; after a claim only the new secret works."""
    ack = {"v": 1, "pinned": True, "lease": "old-secret", "ttl_s": 60.0}
    handle = decode(_with(DECODE_ANSWER, ack, "kv_transfer_params", "agentkv")).handle
    assert handle is not None
    claimed = extended_handle(
        handle, ExtendResult(expiry=99999.0, ttl_s=300.0, lease="new-secret"), deadline=700.0
    )
    assert (claimed.deadline, claimed.lease_ttl_s, claimed.extends) == (700.0, 300.0, 1)
    assert lease_ref(claimed).lease == "new-secret"
    params = json.loads(prefill_body(REQUEST, prompt_ids=[1], handle=claimed))["kv_transfer_params"]
    assert params["remote_blocks_expiry_time"] == 99999.0
    again = extended_handle(claimed, ExtendResult(expiry=99999.5, ttl_s=200.0), deadline=800.0)
    assert lease_ref(again).lease == "new-secret"  # a plain extend keeps the secret


def test_parse_decode_accepts_a_flat_block_list_and_tool_calls():
    data = _with(DECODE_ANSWER, [7, 8], "kv_transfer_params", "remote_block_ids")
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    data = _with(
        data, {"role": "assistant", "content": None, "tool_calls": [call]}, "choices", 0, "message"
    )
    result = decode(data)
    assert result.handle is not None
    assert result.handle.block_ids == ((7, 8),)
    assert result.message.content is None
    assert result.message.tool_calls[0].name == "f"


def test_decode_without_pinned_blocks_gives_no_handle():
    data = _with(DECODE_ANSWER, [], "kv_transfer_params", "remote_block_ids")
    assert decode(data).handle is None
    data = _with(DECODE_ANSWER, 0, "kv_transfer_params", "remote_num_tokens")
    assert decode(data).handle is None


@pytest.mark.parametrize(
    ("data", "detail"),
    [
        ("nope", "not an object"),
        (_with(DECODE_ANSWER, [], "choices"), "no choices"),
        (_without(DECODE_ANSWER, "choices", 0, "token_ids"), "token_ids"),
        (_with(DECODE_ANSWER, [1, "2"], "choices", 0, "token_ids"), "token_ids"),
        (_without(DECODE_ANSWER, "choices", 0, "finish_reason"), "finish_reason"),
        (_without(DECODE_ANSWER, "choices", 0, "message"), "message"),
        (_with(DECODE_ANSWER, 5, "choices", 0, "message", "content"), "content"),
        (_with(DECODE_ANSWER, [{"id": 1}], "choices", 0, "message", "tool_calls"), "tool call"),
        (_with(DECODE_ANSWER, "x", "kv_transfer_params"), "not an object"),
        (_without(DECODE_ANSWER, "kv_transfer_params", "remote_host"), "remote_host"),
        (_with(DECODE_ANSWER, "502", "kv_transfer_params", "remote_num_tokens"), "remote_num"),
        (_with(DECODE_ANSWER, False, "kv_transfer_params", "do_remote_decode"), "do_remote_decode"),
        (_with(DECODE_ANSWER, "x", "kv_transfer_params", "remote_blocks_expiry_time"), "expiry"),
    ],
)
def test_parse_decode_rejects_what_vllm_would_not_send(data, detail):
    with pytest.raises(MalformedResponseError, match=detail):
        decode(data)


@pytest.mark.parametrize(
    ("finish", "stop_reason"), [("stop", "Observation:"), ("repetition", None), ("stop", None)]
)
def test_a_decode_answer_without_params_is_a_turn_without_a_handle(finish, stop_reason):
    """vLLM ends stop-string and repetition requests in its front end: ``kv_transfer_params`` is
    null. That is a normal answer without a handle, not a malformed one."""
    data = _with(DECODE_ANSWER, None, "kv_transfer_params")
    data = _with(data, finish, "choices", 0, "finish_reason")
    data = _with(data, stop_reason, "choices", 0, "stop_reason")
    result = decode(data)
    assert result.handle is None
    assert result.finish_reason == finish
    assert result.stop_reason == stop_reason
    assert result.token_ids


def _chunks():
    base = {"id": "c", "object": "chat.completion.chunk", "model": "m"}
    yield {
        **base,
        "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}],
        "prompt_token_ids": [1, 2, 3],
    }
    yield {**base, "choices": [{"index": 0, "delta": {"content": "Par"}, "token_ids": [11]}]}
    yield {**base, "choices": [{"index": 0, "delta": {"content": "is."}, "token_ids": [12]}]}
    yield {
        **base,
        "choices": [{"index": 0, "delta": {}, "token_ids": [2], "finish_reason": "stop"}],
    }
    yield {
        **base,
        "choices": [],
        "usage": {"prompt_tokens": 500, "completion_tokens": 3},
        "kv_transfer_params": DECODE_ANSWER["kv_transfer_params"],
    }


def test_stream_accumulator_rebuilds_the_non_streamed_result():
    acc = StreamAccumulator(url=URL)
    texts = [acc.feed(chunk) for chunk in _chunks()]
    assert "".join(texts) == "Paris."
    streamed = acc.result(pair="p0", issued_at=10.0, deadline=460.0)
    assert streamed == decode(DECODE_ANSWER)


def test_stream_accumulator_joins_tool_call_pieces():
    acc = StreamAccumulator(url=URL)
    acc.feed(
        {
            "choices": [
                {
                    "delta": {
                        "tool_calls": [
                            {
                                "index": 0,
                                "id": "c1",
                                "type": "function",
                                "function": {"name": "f", "arguments": ""},
                            }
                        ]
                    },
                    "token_ids": [5],
                }
            ]
        }
    )
    acc.feed(
        {
            "choices": [
                {
                    "delta": {"tool_calls": [{"index": 0, "function": {"arguments": '{"a"'}}]},
                    "token_ids": [6],
                }
            ]
        }
    )
    acc.feed(
        {
            "choices": [
                {
                    "delta": {"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]},
                    "token_ids": [2],
                    "finish_reason": "tool_calls",
                }
            ],
            "kv_transfer_params": DECODE_ANSWER["kv_transfer_params"],
        }
    )
    result = acc.result(pair="p0", issued_at=0.0, deadline=1.0)
    assert result.message.tool_calls[0].arguments == '{"a": 1}'
    assert result.message.content is None
    assert result.finish_reason == "tool_calls"


def test_a_stream_without_handle_falls_back_to_no_reuse():
    """Stock vLLM streams carry no handle: the streamed answer stands, the next turn recomputes."""
    acc = StreamAccumulator(url=URL)
    for chunk in list(_chunks())[:-1]:
        acc.feed(chunk)
    result = acc.result(pair="p0", issued_at=0.0, deadline=1.0)
    assert result.handle is None
    assert result.token_ids


def test_a_stream_without_finish_is_malformed():
    acc = StreamAccumulator(url=URL)
    acc.feed(next(_chunks()))
    with pytest.raises(MalformedResponseError, match="finish_reason"):
        acc.result(pair="p0", issued_at=0.0, deadline=1.0)


def test_stream_error_event_is_a_server_error():
    acc = StreamAccumulator(url=URL)
    with pytest.raises(ServerError) as info:
        acc.feed({"error": {"message": "engine dead", "type": "InternalServerError", "code": 500}})
    assert info.value.status_code == 500
