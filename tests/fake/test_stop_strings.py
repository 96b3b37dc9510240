"""A D leg that ends on a stop string is a normal turn without a handle (vLLM 0.32's semantics).

vLLM checks stop strings in its front end: the request is aborted there, decode pins nothing and
the answer carries ``kv_transfer_params: null``, ``finish_reason: "stop"`` and the string as
``stop_reason``. The turn commits the tokens exactly as generated (the stop string's tokens
included); the next turn's prompt extends them and prefill recomputes what it does not hold.
"""

from __future__ import annotations

import json

import httpx2
import pytest
from openai import AsyncOpenAI
from structlog.testing import capture_logs

from agentkv import AsyncCluster, HandleState, Message, RetryPolicy, TextDelta, TurnResult
from agentkv.proxy import ProxyConfig, create_app
from agentkv.testing import FakeCluster, ManualClock

SYSTEM = "You are a terse assistant. " + " ".join(f"Fact {i}: item {i} is blue." for i in range(20))
QUESTION = "Tell me about item 3 and the cache."


def _fake() -> FakeCluster:
    return FakeCluster(pairs=1, clock=ManualClock())


async def _reference_text() -> str:
    """What the fake model answers to QUESTION with no stop string (it is deterministic)."""
    fake = _fake()
    async with AsyncCluster.from_dict(fake.cluster_spec, transport=fake.transport) as cluster:
        session = cluster.session(max_tokens=60)
        session.append(Message.system(SYSTEM))
        return (await session.send(QUESTION)).text


async def _stop_word() -> tuple[str, str]:
    """A stop string from the middle of the reference answer, and the text before it."""
    text = await _reference_text()
    words = text.split(" ")
    assert len(words) > 6, text
    stop = " " + words[4]
    return stop, text[: text.index(stop)]


async def _decode_body(fake: FakeCluster, stop: object, *, include: bool = False) -> dict:
    body = {
        "model": fake.model,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}],
        "max_tokens": 60,
        "return_token_ids": True,
        "stop": stop,
        "include_stop_str_in_output": include,
        "kv_transfer_params": {"do_remote_decode": False, "do_remote_prefill": False},
    }
    url = fake.cluster_spec["pairs"][0]["decode"] + "/v1/chat/completions"
    async with httpx2.AsyncClient(transport=fake.transport) as client:
        return (await client.post(url, json=body)).json()


async def test_the_fake_ends_on_a_stop_string_as_vllm_does():
    """Text cut before the string, ids up to the one completing it, no kv_transfer_params."""
    stop, before = await _stop_word()
    fake = _fake()
    data = await _decode_body(fake, [stop])
    choice = data["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["stop_reason"] == stop
    assert choice["message"]["content"] == before
    assert data["kv_transfer_params"] is None
    assert fake.decode(0).pinned_handles == 0
    tok = fake.tokenizer
    generated = tok.decode(choice["token_ids"], skip_special_tokens=True)
    assert generated.startswith(before + stop)
    assert not tok.decode(choice["token_ids"][:-1], skip_special_tokens=True).startswith(
        before + stop
    )
    included = (await _decode_body(_fake(), stop, include=True))["choices"][0]["message"]["content"]
    assert included == before + stop


async def test_the_fake_streams_with_a_stop_buffer_and_no_handle():
    stop, before = await _stop_word()
    fake = _fake()
    url = fake.cluster_spec["pairs"][0]["decode"] + "/v1/chat/completions"
    body = {
        "model": fake.model,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}],
        "max_tokens": 60,
        "stream": True,
        "stop": [stop],
        "kv_transfer_params": {"do_remote_decode": False, "do_remote_prefill": False},
    }
    async with httpx2.AsyncClient(transport=fake.transport) as client:
        events = (await client.post(url, json=body)).text.split("\n\n")
    chunks = [json.loads(e[6:]) for e in events if e.startswith("data: {")]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == before
    assert all("kv_transfer_params" not in c for c in chunks)
    last = [c for c in chunks if c["choices"]][-1]["choices"][0]
    assert (last["finish_reason"], last["stop_reason"]) == ("stop", stop)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_stop_string_turn_commits_exact_tokens_and_the_next_turn_extends_them(stream):
    """Before: MalformedResponseError ("no kv_transfer_params ... bidirectional_kv_xfer")."""
    stop, before = await _stop_word()
    fake = _fake()
    async with AsyncCluster.from_dict(
        fake.cluster_spec, transport=fake.transport, retry=RetryPolicy(max_attempts=1)
    ) as cluster:
        session = cluster.session(max_tokens=60)
        session.append(Message.system(SYSTEM), Message.user(QUESTION))
        with capture_logs() as logs:
            if stream:
                events = [e async for e in session.stream(extra_body={"stop": [stop]})]
                assert "".join(e.text for e in events if isinstance(e, TextDelta)) == before
                result = events[-1]
                assert isinstance(result, TurnResult)
            else:
                result = await session.turn(extra_body={"stop": [stop]})
        assert result.text == before
        assert result.finish_reason == "stop"
        assert session.handle is None
        causes = [e for e in logs if e["event"] == "agentkv.turn_without_handle"]
        assert [e["cause"] for e in causes] == ["stop_string"]
        assert not [e for e in logs if e["event"] == "agentkv.stream_without_handle"]
        view = session.transcript
        generated = view.token_ids[view.spans[-1].start :]
        assert fake.tokenizer.decode(list(generated), skip_special_tokens=True).endswith(
            before + stop
        )
        committed = list(view.token_ids)
        second = await session.send("Go on.")
        assert second.stats.handle_state is HandleState.NONE
        assert "stop string" in second.stats.handle_reason
        assert list(session.transcript.token_ids[: len(committed)]) == committed
        await session.aclose()
    assert fake.wrong_reuse_events == 0
    assert fake.decode(0).pinned_handles == 0


async def test_a_decode_answer_without_params_names_bidirectional_as_the_cause():
    """No stop string and no params: a turn without a handle, with a warning that says why."""
    fake = FakeCluster(pairs=1, clock=ManualClock(), bidirectional_kv_xfer=False)
    async with AsyncCluster.from_dict(fake.cluster_spec, transport=fake.transport) as cluster:
        session = cluster.session(max_tokens=20)
        with capture_logs() as logs:
            result = await session.send("Hi")
        assert result.text
        assert session.handle is None
        [event] = [e for e in logs if e["event"] == "agentkv.turn_without_handle"]
        assert event["cause"] == "no_kv_transfer_params"
        assert "bidirectional" in event["hint"]
        await session.aclose()


@pytest.mark.parametrize("stream", [False, True])
async def test_a_react_loop_with_a_stop_string_works_through_the_proxy(stream):
    stop, before = await _stop_word()
    fake = _fake()
    async with AsyncCluster.from_dict(fake.cluster_spec, transport=fake.transport) as cluster:
        app = create_app(cluster, ProxyConfig())
        async with httpx2.AsyncClient(
            transport=httpx2.ASGITransport(app=app), base_url="http://proxy"
        ) as http:
            client = AsyncOpenAI(base_url="http://proxy/v1", api_key="k", http_client=http)
            messages = [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": QUESTION},
            ]
            for turn in range(2):
                raw = await client.chat.completions.with_raw_response.create(
                    model=fake.model,
                    messages=messages,
                    max_tokens=60,
                    stop=[stop],
                    stream=stream,
                    extra_headers={"X-Session-ID": "react"},
                )
                assert "x-agentkv-forked" not in raw.headers
                if stream:
                    text = ""
                    async for chunk in raw.parse():
                        for choice in chunk.choices:
                            text += choice.delta.content or ""
                else:
                    text = raw.parse().choices[0].message.content
                if turn == 0:
                    assert text == before
                messages += [
                    {"role": "assistant", "content": text},
                    {"role": "user", "content": "Observation: nothing found."},
                ]
    assert fake.wrong_reuse_events == 0
