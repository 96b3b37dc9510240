"""Status errors carry the exchange they came from, as openai-python's ``APIStatusError`` does:
the request, the response and its headers (``retry-after``, ``x-request-id``)."""

from __future__ import annotations

import contextlib

import httpx2
import pytest

from agentkv import BadRequestError, ServerError
from agentkv._wire.http import HttpxPoster, post_json
from agentkv.proxy._errors import ProxyError


def _answering(status: int, headers: dict[str, str]) -> HttpxPoster:
    def handle(request: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(status, headers=headers, json={"error": {"message": "busy now"}})

    return HttpxPoster(httpx2.AsyncClient(transport=httpx2.MockTransport(handle)), owned=True)


async def test_a_status_error_carries_the_request_and_the_response():
    headers = {"retry-after": "3", "x-request-id": "req-42"}
    async with contextlib.aclosing(_answering(503, headers)) as poster:
        with pytest.raises(ServerError) as caught:
            await post_json(poster, "http://d:8000/v1/chat/completions", b"{}", summary="decode")
    error = caught.value
    assert error.response is not None
    assert error.request is not None
    assert error.request.url == "http://d:8000/v1/chat/completions"
    assert (error.status_code, error.request_id, error.retry_after_s) == (503, "req-42", 3.0)


async def test_without_those_headers_the_properties_are_none():
    async with contextlib.aclosing(
        _answering(400, {"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"})
    ) as poster:
        with pytest.raises(BadRequestError) as caught:
            await post_json(poster, "http://p:8000/v1/completions", b"{}", summary="prefill")
    assert (caught.value.request_id, caught.value.retry_after_s) == (None, None)
    assert ServerError("x", status_code=500).retry_after_s is None


async def test_the_proxy_passes_a_model_servers_retry_after_on():
    async with contextlib.aclosing(_answering(429, {"retry-after": "1.5"})) as poster:
        with pytest.raises(BadRequestError) as refused:
            await post_json(poster, "http://d:8000/v1/chat/completions", b"{}", summary="decode")
    async with contextlib.aclosing(_answering(503, {"retry-after": "2"})) as poster:
        with pytest.raises(ServerError) as failed:
            await post_json(poster, "http://d:8000/v1/chat/completions", b"{}", summary="decode")
    rejected = ProxyError.from_exception(refused.value)
    assert (rejected.status, rejected.message, rejected.headers) == (
        429,
        "busy now",
        {"Retry-After": "1.5"},
    )
    upstream = ProxyError.from_exception(failed.value)
    assert (upstream.status, upstream.headers) == (502, {"Retry-After": "2"})
