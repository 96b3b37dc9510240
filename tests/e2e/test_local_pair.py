"""The local pair speaks vLLM's bidirectional P/D protocol: turn-end KV flows back from decode.

These tests use raw HTTP on purpose (no SDK): they pin down what the servers do, so a change in
vLLM shows up here before it shows up as a mystery in the SDK.
"""

from __future__ import annotations

from typing import Any

import httpx2
import pytest

from agentkv.local._config import ClusterRecord

pytestmark = pytest.mark.e2e

BLOCK = 128  # vLLM's CPU backend block size
NULL_HANDLE = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
SYSTEM = "You are a terse assistant. " + " ".join(
    f"Note {i}: the parcel with number {i} goes to shelf {i * 7 % 50}." for i in range(25)
)


def _chat(client: httpx2.Client, url: str, body: dict[str, Any]) -> dict[str, Any]:
    response = client.post(f"{url}/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    data: dict[str, Any] = response.json()
    return data


def _tokenize(
    client: httpx2.Client, url: str, messages: list[dict[str, str]], gen: bool
) -> list[int]:
    response = client.post(
        f"{url}/tokenize",
        json={"messages": messages, "add_generation_prompt": gen, "add_special_tokens": False},
    )
    assert response.status_code == 200, response.text
    tokens: list[int] = response.json()["tokens"]
    return tokens


def test_turn_two_prefill_pulls_the_turn_end_kv_back_from_decode(
    local_cluster: ClusterRecord,
) -> None:
    """P's cached tokens on turn 2 cover turn 1's prompt and output, pulled from D's pins."""
    pair = local_cluster.pairs[0]
    p_url, d_url = pair.prefill.url, pair.decode.url
    model = local_cluster.model
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Which shelf holds parcel 3?"},
    ]
    with httpx2.Client(timeout=300) as client:
        prompt = _tokenize(client, p_url, messages, gen=True)
        base = {"model": model, "messages": messages, "temperature": 0.0}
        p1 = _chat(
            client,
            p_url,
            {
                **base,
                "max_tokens": 1,
                "stream": False,
                "kv_transfer_params": {**NULL_HANDLE, "prompt_token_ids": prompt},
            },
        )
        assert p1["kv_transfer_params"]["do_remote_prefill"] is True
        d1 = _chat(
            client,
            d_url,
            {
                **base,
                "max_tokens": 24,
                "return_token_ids": True,
                "kv_transfer_params": {**p1["kv_transfer_params"], "prompt_token_ids": prompt},
            },
        )
        handle = d1["kv_transfer_params"]
        generated = d1["choices"][0]["token_ids"]
        assert handle["do_remote_decode"] is True
        assert handle["remote_num_tokens"] == len(prompt) + len(generated) - 1 or (
            handle["remote_num_tokens"] == len(prompt) + len(generated)
        )
        # Turn 2's prompt is a token-exact extension: turn 1's prompt and output, the template's
        # closing tokens, then the new user message's tokens (rendered as a delta).
        anchor = [
            {"role": "system", "content": "s"},
            {"role": "user", "content": "u"},
            {"role": "assistant", "content": "a"},
        ]
        closed = _tokenize(client, p_url, anchor, gen=False)
        extended = _tokenize(
            client, p_url, [*anchor, {"role": "user", "content": "And parcel 4?"}], gen=True
        )
        assert extended[: len(closed)] == closed
        im_end, newline = closed[-2], closed[-1]
        closing = [newline] if generated[-1] == im_end else [im_end, newline]
        prompt2 = prompt + generated + closing + extended[len(closed) :]
        p2 = _chat(
            client,
            p_url,
            {
                **base,
                "max_tokens": 1,
                "stream": False,
                "kv_transfer_params": {**handle, "prompt_token_ids": prompt2},
            },
        )
    cached = p2["usage"]["prompt_tokens_details"]["cached_tokens"]
    turn_one = len(prompt) + len(generated)
    block_aligned_ideal = (turn_one - 1) // BLOCK * BLOCK
    assert cached >= block_aligned_ideal, (cached, turn_one)
    # More than the local prefix cache alone could give: the partial block came from decode.
    assert cached > len(prompt) // BLOCK * BLOCK
