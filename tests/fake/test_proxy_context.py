"""The context window through the proxy: an agent's max_tokens 32000 clamped with a header (or
refused on request), and a prompt over the context answered in OpenAI's words on chat
completions and the Responses API (``context_length_exceeded``, on which Codex compacts)."""

from __future__ import annotations

import httpx2
import pytest
import structlog

from agentkv import RetryPolicy
from agentkv.proxy import ProxyConfig, create_app

WINDOW = 512
CLAMPED = "x-agentkv-max-tokens-clamped"


pytestmark = [
    pytest.mark.fake(pairs=1, max_model_len=WINDOW),
    pytest.mark.cluster(retry=RetryPolicy(max_attempts=1)),
]


@pytest.fixture(params=[False], ids=["clamp"])
def refuse(request):
    return request.param


@pytest.fixture
async def http(acluster, refuse):
    app = create_app(acluster, ProxyConfig(refuse_oversized_max_tokens=refuse))
    async with httpx2.AsyncClient(
        transport=httpx2.ASGITransport(app=app),
        base_url="http://proxy",
        headers={"Authorization": "Bearer sk-test"},
    ) as client:
        yield client


def _chat(max_tokens: int, *, text: str = "hello", stream: bool = False) -> dict:
    return {
        "model": "fake-smollm2",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "stream": stream,
    }


async def test_an_agents_max_tokens_is_clamped_and_the_answer_says_so(http):
    with structlog.testing.capture_logs() as logs:
        response = await http.post("/v1/chat/completions", json=_chat(32000))
    assert response.status_code == 200
    prompt = response.json()["usage"]["prompt_tokens"]
    assert response.headers[CLAMPED] == f"32000->{WINDOW - prompt}"
    assert any(e["event"] == "agentkv.max_tokens_clamped" for e in logs)


async def test_max_completion_tokens_and_streams_are_clamped_too(http):
    body = _chat(32000, stream=True)
    body["max_completion_tokens"] = body.pop("max_tokens")
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers[CLAMPED].startswith("32000->")
        assert b"[DONE]" in await response.aread()


async def test_a_max_tokens_that_fits_has_no_header(http):
    response = await http.post("/v1/chat/completions", json=_chat(8))
    assert response.status_code == 200
    assert CLAMPED not in response.headers


async def test_responses_max_output_tokens_is_clamped(http):
    response = await http.post(
        "/v1/responses",
        json={"model": "fake-smollm2", "input": "hello", "max_output_tokens": 32000},
    )
    assert response.status_code == 200
    assert response.headers[CLAMPED].startswith("32000->")


@pytest.mark.parametrize("refuse", [True], ids=["refuse"], indirect=True)
async def test_the_refuse_option_answers_openais_context_error(http, fake):
    response = await http.post("/v1/chat/completions", json=_chat(32000))
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert error["type"] == "invalid_request_error"
    assert error["param"] == "messages"
    assert error["message"].startswith(f"This model's maximum context length is {WINDOW} tokens.")
    assert "in the messages, 32000 in the completion" in error["message"]
    assert fake.decode(0).requests == []
    assert (await http.post("/v1/chat/completions", json=_chat(8))).status_code == 200


async def test_a_prompt_over_the_context_is_openais_context_length_exceeded(http, fake):
    response = await http.post("/v1/chat/completions", json=_chat(8, text="word " * 2000))
    assert response.status_code == 400
    error = response.json()["error"]
    assert error == {
        "message": error["message"],
        "type": "invalid_request_error",
        "param": "messages",
        "code": "context_length_exceeded",
    }
    assert error["message"].startswith(f"This model's maximum context length is {WINDOW} tokens. "
                                       "However, your messages resulted in ")
    assert error["message"].endswith(" tokens. Please reduce the length of the messages.")
    assert fake.decode(0).requests == []


async def test_a_responses_input_over_the_context_names_input(http):
    response = await http.post(
        "/v1/responses",
        json={"model": "fake-smollm2", "input": "word " * 2000, "max_output_tokens": 8},
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("context_length_exceeded", "input")


async def test_the_servers_own_context_400_is_the_same_answer(http, fake):
    """A server that counts otherwise than the SDK still gets the agent its context error."""
    fake.decode(0).fail_next(
        "status", status=400,
        message=f"max_tokens=600 cannot be greater than max_model_len={WINDOW}. Please request "
        "fewer output tokens.",
    )
    response = await http.post("/v1/chat/completions", json=_chat(8))
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "context_length_exceeded"
