"""The fake's tokenizer, model and chat templates, and ``/tokenize``: the token-exact
layer the SDK's transcript is built on (SmolLM2's ChatML, as vLLM renders it)."""

from __future__ import annotations

import re

import httpx2
from hypothesis import given
from hypothesis import strategies as st
from raw_protocol import (
    IM_END,
    TOK,
    post,
    user,
)

from agentkv.testing import FakeCluster, ManualClock, render_chat
from agentkv.testing._fake_model import FakeModel
from agentkv.testing._fake_tokenizer import MERGES, FakeTokenizer


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
    client: httpx2.Client, fake: FakeCluster
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
    client: httpx2.Client, fake: FakeCluster
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
    client: httpx2.Client, fake: FakeCluster
) -> None:
    messages = [*user("Hi"), {"role": "assistant", "content": "Hel"}]
    body = {"messages": messages, "add_generation_prompt": False, "continue_final_message": True}
    tokens = client.post(fake.prefill(0).url + "/tokenize", json=body).json()["tokens"]
    assert TOK.decode(tokens).endswith("<|im_start|>assistant\nHel")


def test_tokenize_completion_prompt_returns_byte_level_token_strs(
    client: httpx2.Client, fake: FakeCluster
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
    with httpx2.Client(transport=fake.transport) as client:
        reply = post(client, fake.decode(0).url, {"messages": user("Hi")}).json()
        content = reply["choices"][0]["message"]["content"]
        assert content.startswith("<think>\n")
        assert "\n</think>\n\n" in content
        history = {
            "messages": [*user("Hi"), {"role": "assistant", "content": content}, *user("Again")]
        }
        tokens = client.post(fake.decode(0).url + "/tokenize", json=history).json()["tokens"]
        assert "<think>" not in TOK.decode(tokens)


class _BytesOnly(FakeTokenizer):
    """The fake's tokenizer without merges: one id per byte (a tokenizer of the same interface)."""

    def encode(self, text: str) -> list[int]:
        specials = {"<|im_start|>": [self.im_start_id], "<|im_end|>": [self.eos_token_id]}
        ids: list[int] = []
        for part in re.split(r"(<\|im_start\|>|<\|im_end\|>)", text):
            ids += specials.get(part) or self.byte_ids(part)
        return ids


def test_a_fake_cluster_serves_with_the_tokenizer_it_is_given() -> None:
    """``benchmarks/proxy_memory.py`` gives it SmolLM2's real tokenizer this way."""
    tokenizer = _BytesOnly()
    fake = FakeCluster(pairs=1, clock=ManualClock(), tokenizer=tokenizer)
    with httpx2.Client(transport=fake.transport) as client:
        url = fake.prefill(0).url + "/tokenize"
        tokens = client.post(url, json={"messages": user("Hi")}).json()["tokens"]
    assert tokens == tokenizer.encode(render_chat(user("Hi")))
    assert tokens != TOK.encode(render_chat(user("Hi")))
