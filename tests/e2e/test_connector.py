"""agentkv's vLLM extension on the real local pair: streamed handles, persist hints, leases.

Raw HTTP on purpose (no SDK): these tests pin down what the servers do. Facts are read from the
servers themselves: prefill's ``cached_tokens`` for reuse, decode's ``vllm:kv_cache_usage_perc``
for pins. Each test leaves decode with no pin of its own (consumed, released or never made), so
the usage level before a test is the idle level the next one compares against.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx2
import pytest

from agentkv._wire.hints import (
    EXTEND_PATH,
    INFO_PATH,
    RELEASE_PATH,
    RELEASE_REQUEST_PATH,
    ExtendRequest,
    ExtendResult,
    LeaseAck,
    LeaseRef,
    PinHint,
    RequestRelease,
    for_prefill,
    new_request_secret,
    request_tag,
    with_expiry,
    with_hint,
)
from agentkv.local._config import ClusterRecord

pytestmark = pytest.mark.e2e

BLOCK = 128  # vLLM's CPU backend block size
TAIL = 100  # tokens of each first prompt past its last whole block (see Conversation)
NULL_HANDLE = {
    "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
    "remote_block_ids": None, "remote_host": None, "remote_port": None,
}
USAGE = re.compile(r"^vllm:kv_cache_usage_perc\{[^}]*\} (\S+)$", re.MULTILINE)


def _system(topic: str) -> str:
    # ~300 tokens, different per test so one test's prefix cache does not serve another's.
    return f"You are a terse assistant for the {topic} depot. " + " ".join(
        f"Note {i}: the {topic} parcel {i} goes to shelf {i * 7 % 50}." for i in range(14)
    )


@dataclass
class Pair:
    client: httpx2.Client
    p_url: str
    d_url: str
    model: str

    def post(self, url: str, path: str, body: dict[str, Any]) -> httpx2.Response:
        return self.client.post(f"{url}{path}", json=body)

    def chat(
        self, url: str, body: dict[str, Any], headers: dict[str, str] | None = None
    ) -> dict[str, Any]:
        response = self.client.post(f"{url}/v1/chat/completions", json=body, headers=headers)
        assert response.status_code == 200, response.text
        data: dict[str, Any] = response.json()
        return data

    def stream(self, url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
        """A streamed chat completion's chunks; asserts it ends with ``[DONE]``."""
        events: list[str] = []
        with self.client.stream("POST", f"{url}/v1/chat/completions",
                                json={**body, "stream": True}) as response:
            assert response.status_code == 200, response.read()
            events = [line[len("data: "):] for line in response.iter_lines()
                      if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        return [json.loads(event) for event in events[:-1]]

    def tokenize(self, messages: list[dict[str, str]], *, gen: bool) -> list[int]:
        response = self.post(self.p_url, "/tokenize", {
            "messages": messages, "add_generation_prompt": gen, "add_special_tokens": False})
        assert response.status_code == 200, response.text
        tokens: list[int] = response.json()["tokens"]
        return tokens

    def settle(self) -> float:
        """Decode's KV usage once frees it owes are applied: an idle decode applies a prefill's
        read notice or an expiry only at its next step (agentkv's quiet loop polls every 20 s),
        so step it with a plain one-token request first."""
        self.chat(self.d_url, {"model": self.model, "max_tokens": 1,
                               "messages": [{"role": "user", "content": "hi"}]})
        return self.kv_usage()

    def kv_usage(self) -> float:
        text = self.client.get(f"{self.d_url}/metrics").text
        return sum(float(v) for v in USAGE.findall(text))

    def wait_usage(self, ok: Callable[[float], bool], timeout_s: float) -> tuple[float, float]:
        """Poll decode's KV usage until ``ok``; returns (usage, seconds waited)."""
        begin = time.monotonic()
        while True:
            usage = self.kv_usage()
            waited = time.monotonic() - begin
            if ok(usage) or waited > timeout_s:
                return usage, waited
            time.sleep(0.2)


@pytest.fixture(scope="module")
def pair(local_cluster: ClusterRecord) -> Any:
    first = local_cluster.pairs[0]
    with httpx2.Client(timeout=300) as client:
        yield Pair(client=client, p_url=first.prefill.url, d_url=first.decode.url,
                   model=local_cluster.model)


@dataclass
class Conversation:
    """A token-exact conversation: each turn's prompt extends the last turn's prompt + output."""

    pair: Pair
    topic: str
    max_tokens: int = 12
    messages: list[dict[str, str]] = field(default_factory=list)
    prompt: list[int] = field(default_factory=list)
    generated: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        # Pad the prompt to end ~100 tokens into a block: prefill's own prefix cache then stops
        # well short of the turn's end, and what it pulls from decode (the partial block plus the
        # generated tokens) is above vLLM's kv_recompute_threshold (64), so a pull really happens.
        system = _system(self.topic)
        for _ in range(4):
            self.messages = [{"role": "system", "content": system},
                             {"role": "user", "content": "Which shelf holds parcel 3?"}]
            self.prompt = self.pair.tokenize(self.messages, gen=True)
            short = (TAIL - len(self.prompt) % BLOCK) % BLOCK
            if short <= 8:
                break
            system += " ok" * short

    @property
    def local_floor(self) -> int:
        """What prefill's own prefix cache can give for this prompt: its whole blocks."""
        return len(self.prompt) // BLOCK * BLOCK

    def add_user(self, text: str) -> None:
        """Extend the prompt with the turn just generated and a new user message, as a delta."""
        anchor = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                  {"role": "assistant", "content": "a"}]
        closed = self.pair.tokenize(anchor, gen=False)
        extended = self.pair.tokenize([*anchor, {"role": "user", "content": text}], gen=True)
        im_end, newline = closed[-2], closed[-1]
        closing = [newline] if self.generated[-1] == im_end else [im_end, newline]
        self.prompt = self.prompt + self.generated + closing + extended[len(closed):]
        self.messages = [*self.messages, {"role": "assistant", "content": "(see tokens)"},
                         {"role": "user", "content": text}]
        self.generated = []

    @property
    def turn_tokens(self) -> int:
        return len(self.prompt) + len(self.generated)

    def prefill(self, handle: dict[str, Any] | None, *,
                strip: bool = True) -> tuple[dict[str, Any], int]:
        """The P leg; returns prefill's params and its cached (reused) token count."""
        sent = (for_prefill(handle) if strip else handle) if handle else NULL_HANDLE
        params = {**sent,
                  "do_remote_decode": True, "do_remote_prefill": False,
                  "prompt_token_ids": self.prompt}
        data = self.pair.chat(self.pair.p_url, {
            "model": self.pair.model, "messages": self.messages, "max_tokens": 1,
            "stream": False, "temperature": 0.0, "kv_transfer_params": params})
        cached: int = data["usage"]["prompt_tokens_details"]["cached_tokens"]
        return data["kv_transfer_params"], cached

    def _decode_body(self, p_params: dict[str, Any], hint: PinHint | None) -> dict[str, Any]:
        params = {**p_params, "prompt_token_ids": self.prompt}
        return {"model": self.pair.model, "messages": self.messages,
                "max_tokens": self.max_tokens, "temperature": 0.0, "return_token_ids": True,
                "kv_transfer_params": with_hint(params, hint) if hint else params}

    def decode(
        self, p_params: dict[str, Any], hint: PinHint | None, *, request_id: str | None = None
    ) -> dict[str, Any]:
        """A non-streamed D leg; returns decode's turn-end params (the handle)."""
        headers = {"X-Request-Id": request_id} if request_id else None
        data = self.pair.chat(self.pair.d_url, self._decode_body(p_params, hint), headers)
        self.generated = data["choices"][0]["token_ids"]
        params: dict[str, Any] = data["kv_transfer_params"]
        return params

    def decode_stream(self, p_params: dict[str, Any], hint: PinHint | None, *,
                      usage: bool) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """A streamed D leg; returns the handle from the last chunk, and all chunks."""
        body = self._decode_body(p_params, hint)
        if usage:
            body["stream_options"] = {"include_usage": True}
        chunks = self.pair.stream(self.pair.d_url, body)
        self.generated = [
            t for c in chunks for choice in c["choices"] for t in choice.get("token_ids") or []
        ]
        assert all("kv_transfer_params" not in c for c in chunks[:-1])
        return chunks[-1]["kv_transfer_params"], chunks

    def turn(self, handle: dict[str, Any] | None, hint: PinHint | None) -> dict[str, Any]:
        p_params, _ = self.prefill(handle)
        return self.decode(p_params, hint)


def _ideal(turn_tokens: int) -> int:
    """Block-aligned reuse floor on the next turn: the last generated token's KV is never made."""
    return (turn_tokens - 1) // BLOCK * BLOCK


def _release(pair: Pair, handle: dict[str, Any]) -> httpx2.Response:
    return pair.post(pair.d_url, RELEASE_PATH, LeaseRef.from_handle(handle).to_wire())


def test_decode_announces_the_extension(pair: Pair) -> None:
    info = pair.client.get(f"{pair.d_url}{INFO_PATH}").json()
    assert info["v"] == 1
    assert info["leases"] is True
    assert info["stream_handles"] is True
    assert info["max_ttl_s"] >= info["default_ttl_s"] > 0


def test_a_streamed_decode_leg_ends_with_a_handle_that_the_next_prefill_pulls(pair: Pair) -> None:
    """The handle rides on the last chunk (the usage chunk here) and works like a plain one."""
    convo = Conversation(pair, "harbour")
    p_params, _ = convo.prefill(None)
    handle, chunks = convo.decode_stream(p_params, PinHint(ttl_s=120), usage=True)
    assert chunks[-1]["choices"] == []
    assert "usage" in chunks[-1]
    assert handle["do_remote_decode"] is True
    assert any(handle["remote_block_ids"])
    ack = LeaseAck.from_params(handle)
    assert ack is not None
    assert ack.pinned
    assert ack.ttl_s == 120
    turn_one, local = convo.turn_tokens, convo.local_floor
    convo.add_user("And parcel 4?")
    _, cached = convo.prefill(handle, strip=False)  # prefill ignores agentkv's key
    assert cached >= _ideal(turn_one), (cached, turn_one)
    assert cached >= turn_one - 1 > local  # the partial block came from decode


def test_without_usage_the_finish_chunk_carries_the_handle(pair: Pair) -> None:
    convo = Conversation(pair, "orchard")
    p_params, _ = convo.prefill(None)
    handle, chunks = convo.decode_stream(p_params, PinHint(pin=False), usage=False)
    assert chunks[-1]["choices"][0]["finish_reason"] in {"stop", "length"}
    assert LeaseAck.from_params(handle) == LeaseAck(pinned=False)


def test_release_returns_decode_kv_usage_to_idle_within_seconds(pair: Pair) -> None:
    """Also: release or extend with someone else's request id, blocks or secret is refused."""
    idle = pair.settle()
    convo = Conversation(pair, "mill")
    handle = convo.turn(None, PinHint(ttl_s=300))
    pinned = pair.kv_usage()
    assert pinned > idle
    ref = LeaseRef.from_handle(handle)
    blocks = [list(group) for group in ref.block_ids]
    forged = [
        {**ref.to_wire(), "remote_request_id": ref.request_id + "x"},
        {**ref.to_wire(), "remote_block_ids": [[b + 1 for b in group] for group in blocks]},
        {**ref.to_wire(), "remote_block_ids": [group[:-1] for group in blocks]},
        {**ref.to_wire(), "lease": "not-the-secret"},
    ]
    for body in forged:
        assert pair.post(pair.d_url, RELEASE_PATH, body).status_code == 404
        assert pair.post(pair.d_url, EXTEND_PATH, {**body, "ttl_s": 600}).status_code == 404
    assert pair.post(pair.d_url, RELEASE_PATH, {"lease": "x"}).status_code == 400
    assert pair.kv_usage() == pinned  # nothing was freed by the refused calls

    response = _release(pair, handle)
    assert response.status_code == 200, response.text
    usage, waited = pair.wait_usage(lambda u: u <= idle, timeout_s=5)
    assert usage <= idle, (usage, idle, waited)
    assert _release(pair, handle).status_code == 404  # gone: nothing left to release


def test_a_d_leg_is_released_by_the_secret_behind_its_client_chosen_request_id(
    pair: Pair,
) -> None:
    """vLLM names the engine request after X-Request-Id; the connector finds it by the tag."""
    idle = pair.settle()
    convo = Conversation(pair, "granary")
    secret = new_request_secret()
    p_params, _ = convo.prefill(None)
    handle = convo.decode(p_params, PinHint(ttl_s=300), request_id=request_tag(secret))
    assert handle["remote_request_id"].startswith(f"chatcmpl-{request_tag(secret)}-")
    assert pair.kv_usage() > idle
    by_tag = RequestRelease(secret=request_tag(secret)).to_wire()  # the public tag opens nothing
    assert pair.post(pair.d_url, RELEASE_REQUEST_PATH, by_tag).json() == {"released": 0}
    response = pair.post(pair.d_url, RELEASE_REQUEST_PATH, RequestRelease(secret=secret).to_wire())
    assert response.status_code == 200, response.text
    assert response.json() == {"released": 1}
    usage, waited = pair.wait_usage(lambda u: u <= idle, timeout_s=5)
    assert usage <= idle, (usage, idle, waited)
    assert _release(pair, handle).status_code == 404


def test_a_request_released_before_it_finished_is_never_pinned(pair: Pair) -> None:
    idle = pair.settle()
    convo = Conversation(pair, "cellar")
    secret = new_request_secret()
    early = pair.post(pair.d_url, RELEASE_REQUEST_PATH, RequestRelease(secret=secret).to_wire())
    assert early.json() == {"released": 0}
    p_params, _ = convo.prefill(None)
    handle = convo.decode(p_params, PinHint(ttl_s=300), request_id=request_tag(secret))
    assert LeaseAck.from_params(handle) == LeaseAck(pinned=False)
    assert not any(handle["remote_block_ids"])
    assert pair.settle() <= idle


def test_a_final_turn_pins_nothing(pair: Pair) -> None:
    idle = pair.settle()
    convo = Conversation(pair, "quarry")
    handle = convo.turn(None, PinHint(pin=False))
    assert LeaseAck.from_params(handle) == LeaseAck(pinned=False)
    assert not any(handle["remote_block_ids"])
    assert handle["remote_num_tokens"] == 0
    assert pair.settle() <= idle


def test_a_short_ttl_expires_and_an_extended_one_survives(pair: Pair) -> None:
    """Two sessions pinned for 6 s; one is extended during a 'tool call' that outlasts that (the
    extend follows its turn within milliseconds)."""
    ttl = 6.0
    short, kept = Conversation(pair, "forge"), Conversation(pair, "kiln")
    short_handle = short.turn(None, PinHint(ttl_s=ttl))
    kept_handle = kept.turn(None, PinHint(ttl_s=ttl))
    pinned_at = time.monotonic()
    extend = ExtendRequest(ref=LeaseRef.from_handle(kept_handle), ttl_s=60)
    response = pair.post(pair.d_url, EXTEND_PATH, extend.to_wire())
    assert response.status_code == 200, response.text
    result = ExtendResult.from_wire(response.json())
    assert result.expiry > kept_handle["remote_blocks_expiry_time"] + 40
    assert 55 <= result.ttl_s <= 60
    kept_handle = with_expiry(kept_handle, result)

    time.sleep(max(0.0, ttl + 1 - (time.monotonic() - pinned_at)))  # the tool call

    floors = {convo.topic: (convo.turn_tokens, convo.local_floor) for convo in (short, kept)}
    for convo in (short, kept):
        convo.add_user("And parcel 4?")
    short_params, short_cached = short.prefill(short_handle)
    kept_params, kept_cached = kept.prefill(kept_handle)
    # Expired: prefill declines the pull and recomputes (only its own cached prompt blocks count).
    assert short_cached <= floors["forge"][1]
    # Extended: the pull covers the whole previous turn, past prefill's own cache.
    assert kept_cached >= floors["kiln"][0] - 1 > floors["kiln"][1]
    # The recomputed turn is correct: the same output as that prompt prefilled from scratch.
    short.decode(short_params, PinHint(pin=False))
    kept.decode(kept_params, PinHint(pin=False))
    recomputed = short.generated
    short.decode(short.prefill(None)[0], PinHint(pin=False))
    assert recomputed == short.generated
    # The expired lease cannot be released any more (it is being freed, or already is).
    assert _release(pair, short_handle).status_code in {404, 410}


def test_greedy_outputs_are_identical_with_and_without_hints(pair: Pair) -> None:
    runs = []
    for hinted in (True, False):
        convo = Conversation(pair, "granary", max_tokens=16)
        handle = convo.turn(None, PinHint(ttl_s=60) if hinted else None)
        first = convo.generated
        convo.add_user("And parcel 4?")
        last = convo.turn(handle, PinHint(pin=False) if hinted else None)
        runs.append((first, convo.generated))
        if not hinted:
            # Stock behaviour pins the last turn too; the connector still hands out a lease.
            assert _release(pair, last).status_code == 200
    assert runs[0] == runs[1]
