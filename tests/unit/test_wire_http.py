"""``post_json``/``stream_events`` send the request httpx2 would build, whoever's client."""

from __future__ import annotations

import asyncio

import httpx2
import pytest

from agentkv._wire.http import post_json, stream_events
from agentkv._wire.transport import ClusterClient

URL = "http://127.0.0.1:8000/v1/chat/completions"
BODY = b'{"model":"m"}'


def _sent(client_type: type[httpx2.AsyncClient], **client_options: object) -> list[httpx2.Request]:
    sent: list[httpx2.Request] = []

    def answer(request: httpx2.Request) -> httpx2.Response:
        assert request.content == BODY  # readable without ``read()``, as httpx2 builds it
        sent.append(request)
        if request.headers.get("accept") == "text/event-stream":
            return httpx2.Response(200, content=b"data: {}\n\ndata: [DONE]\n\n")
        return httpx2.Response(200, json={"ok": True})

    async def run() -> None:
        transport = httpx2.MockTransport(answer)
        async with client_type(transport=transport, timeout=7, **client_options) as client:  # type: ignore[arg-type]
            for _ in range(2):  # the second from the cached template
                await post_json(client, URL, BODY, summary="s")
                await post_json(client, URL, BODY, summary="s", headers={"X-Request-Id": "r1"})
                events = stream_events(
                    client, URL, BODY, summary="s", headers={"accept": "text/event-stream"}
                )
                assert [event async for event in events] == [{}]

    asyncio.run(run())
    return sent


def _shape(request: httpx2.Request) -> tuple[object, ...]:
    return (request.method, request.url, request.headers.raw, request.content, request.extensions)


def test_the_cluster_client_sends_what_httpx_builds() -> None:
    """Same headers in the same order, URL, body and timeouts as ``AsyncClient.post`` sends."""
    ours, httpx_own = _sent(ClusterClient), _sent(httpx2.AsyncClient)
    assert [_shape(r) for r in ours] == [_shape(r) for r in httpx_own]
    assert ours[1].headers["x-request-id"] == "r1"
    assert ours[0].headers["content-length"] == str(len(BODY))
    assert ours[0].extensions["timeout"] == httpx2.Timeout(7).as_dict()


@pytest.mark.parametrize("client_type", [ClusterClient, httpx2.AsyncClient])
def test_a_client_s_own_headers_and_cookies_are_sent(client_type: type[httpx2.AsyncClient]) -> None:
    sent = _sent(
        client_type,
        headers={"Authorization": "Bearer t", "content-type": "text/plain"},
        cookies={"route": "a"},
    )
    for request in sent:
        assert request.headers["authorization"] == "Bearer t"
        assert request.headers.get_list("content-type") == ["application/json"]
        assert request.headers["cookie"] == "route=a"
