"""Requests the fake vLLM server accepts and refuses: ``prompt_token_ids`` and
``return_token_ids``, ``max_tokens``, and the 400/404 answers vLLM gives (bodies that are
not JSON, prompts over ``max_model_len``, unknown models and routes)."""

from __future__ import annotations

from typing import Any

import httpx2
import pytest
from raw_protocol import (
    CHAT,
    IM_END,
    TOK,
    chatml_ids,
    leg,
    post,
    user,
)

from agentkv.testing import FakeCluster, ManualClock


def test_prompt_token_ids_replace_templating_and_come_back_with_return_token_ids(
    client: httpx2.Client, fake: FakeCluster
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
    client: httpx2.Client, fake: FakeCluster, bad: Any
) -> None:
    body = {"messages": user("x"), "kv_transfer_params": {"prompt_token_ids": bad}}
    response = post(client, fake.prefill(0).url, body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "BadRequestError"
    assert error["param"] == "kv_transfer_params.prompt_token_ids"
    assert error["code"] == 400


def test_max_tokens_cuts_the_reply_with_finish_reason_length(
    client: httpx2.Client, fake: FakeCluster
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


def test_a_body_that_is_not_json_is_a_400_like_fastapi(
    client: httpx2.Client, fake: FakeCluster
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
    client: httpx2.Client, fake: FakeCluster
) -> None:
    response = client.post(fake.prefill(0).url + CHAT, content=b"{}")
    assert response.status_code == 400
    assert "Only 'application/json' is allowed" in response.json()["error"]["message"]


def test_prompts_longer_than_max_model_len_are_a_400(clock: ManualClock) -> None:
    fake = FakeCluster(pairs=1, clock=clock, max_model_len=256)
    with httpx2.Client(transport=fake.transport) as client:
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


def test_an_unknown_model_is_a_404(client: httpx2.Client, fake: FakeCluster) -> None:
    response = post(client, fake.prefill(0).url, {"messages": user("x"), "model": "gpt-9"})
    assert response.status_code == 404
    assert response.json()["error"]["type"] == "NotFoundError"
    assert response.json()["error"]["param"] == "model"


def test_an_unknown_route_is_a_404(client: httpx2.Client, fake: FakeCluster) -> None:
    response = client.get(fake.prefill(0).url + "/v1/nothing")
    assert response.status_code == 404
    assert response.json()["error"]["type"] == "Not Found"
