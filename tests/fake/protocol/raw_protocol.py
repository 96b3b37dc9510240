"""Speaking vLLM's raw HTTP/JSON to the fake P/D pair: token-exact legs and turns, the
first leg's ``kv_transfer_params``, handle key sets, metrics and SSE events.

These helpers drive the protocol the way the SDK does; the tests in this folder are the
contract the SDK is written against.
"""

from __future__ import annotations

import json
from typing import Any

import httpx2

from agentkv.testing import FakeCluster, FakeTokenizer, render_chat

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


def post(client: httpx2.Client, url: str, body: dict[str, Any]) -> httpx2.Response:
    return client.post(url + CHAT, json=body)


def leg(
    client: httpx2.Client,
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
    client: httpx2.Client,
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


def metric(client: httpx2.Client, url: str, name: str) -> float:
    for line in client.get(url + "/metrics").text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not exposed")


def sse_events(response: httpx2.Response) -> list[Any]:
    assert response.headers["content-type"].startswith("text/event-stream")
    events = [line.removeprefix("data: ") for line in response.text.split("\n\n") if line]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]
