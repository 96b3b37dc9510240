"""Chat completions through the proxy against the fake pair: reuse, forks, echoes, streams, errors.

The proxy runs in-process behind httpx2's ASGI transport; clients are the real ``openai`` SDK.
"""

from __future__ import annotations

import asyncio

import httpx2
import pytest
from openai import AsyncOpenAI, BadRequestError

from agentkv import AsyncCluster, Message, RetryPolicy
from agentkv.proxy import ProxyConfig, create_app
from agentkv.testing import FakeCluster, ManualClock

SYSTEM = "You are a terse assistant. " + " ".join(f"Fact {i}: item {i} is blue." for i in range(30))
QUESTIONS = ("What colour is item 3?", "And item 7?", "Is item 12 red?", "Summarize.")


pytestmark = pytest.mark.cluster(retry=RetryPolicy(max_attempts=1))


@pytest.fixture
def app(acluster):
    return create_app(acluster, ProxyConfig())


@pytest.fixture
async def http(app):
    async with httpx2.AsyncClient(
        transport=httpx2.ASGITransport(app=app),
        base_url="http://proxy",
        headers={"Authorization": "Bearer sk-test"},
    ) as client:
        yield client


@pytest.fixture
def openai_client(http):
    return AsyncOpenAI(
        base_url="http://proxy/v1", api_key="sk-test", http_client=http, max_retries=0
    )


def _prefill(acluster, fake, headers):
    """The fake prefill server of the pair that answered (named by ``x-agentkv-pair``)."""
    pair = next(p for p in acluster.pairs if p.name == headers["x-agentkv-pair"])
    return fake.server(pair.prefill)


async def _conversation(client, model, *, session="s1", max_tokens=96):
    """Four turns, echoing each answer back as OpenAI users do; returns the raw responses."""
    messages = [{"role": "system", "content": SYSTEM}]
    responses = []
    for question in QUESTIONS:
        messages.append({"role": "user", "content": question})
        raw = await client.chat.completions.with_raw_response.create(
            model=model,
            messages=messages,
            max_tokens=max_tokens,
            extra_headers={"X-Session-ID": session},
        )
        response = raw.parse()
        responses.append((raw.headers, response))
        messages.append(response.choices[0].message.model_dump())
    return messages, responses


async def _sdk_reuse(*, max_tokens=96):
    """The same conversation on the SDK directly, on a fresh fake: reused tokens per turn."""
    fake = FakeCluster(pairs=2, clock=ManualClock())
    async with AsyncCluster.from_dict(fake.cluster_spec, transport=fake.transport) as acluster:
        session = acluster.session(session_id="direct", max_tokens=max_tokens)
        session.append(Message.system(SYSTEM))
        results = [await session.send(q, temperature=None) for q in QUESTIONS]
        await session.aclose()
    return [(r.stats.reused_tokens, r.message.content) for r in results]


async def test_a_4_turn_conversation_reuses_exactly_what_the_sdk_does(openai_client, fake):
    """One turn protocol: cached_tokens and answers equal the SDK's own, turn by turn."""
    _, responses = await _conversation(openai_client, fake.model)
    direct = await _sdk_reuse()
    got = [
        (r.usage.prompt_tokens_details.cached_tokens, r.choices[0].message.content)
        for _, r in responses
    ]
    assert got == direct
    for headers, _ in responses[1:]:
        assert headers["x-agentkv-handle"] == "attached"
        assert "x-agentkv-forked" not in headers
    assert {h["x-agentkv-pair"] for h, _ in responses} == {responses[0][0]["x-agentkv-pair"]}
    assert fake.wrong_reuse_events == 0


async def test_cached_tokens_are_prefills_count_not_decodes(openai_client, fake, acluster):
    """Decode counts KV it received as cached; the answer reports prefill's own count."""
    _, responses = await _conversation(openai_client, fake.model)
    _, last = responses[-1]
    assert 0 < last.usage.prompt_tokens_details.cached_tokens < last.usage.prompt_tokens
    prefill_requests = _prefill(acluster, fake, responses[-1][0]).requests
    assert prefill_requests[-1]["max_tokens"] == 1


# The fake model answers in ~35 tokens; below vLLM's default kv_recompute_threshold (64) prefill
# would recompute them rather than pull, so let it pull everything here.
@pytest.mark.parametrize("fake", [{"kv_recompute_threshold": 1}], indirect=True)
async def test_later_turns_reuse_at_least_the_block_aligned_ideal(openai_client, fake, http):
    _, responses = await _conversation(openai_client, fake.model, max_tokens=128)
    turns = (await http.get("/v1/sessions/s1")).json()["turns"]
    assert [t["turn"] for t in turns] == [1, 2, 3, 4]
    for (_, response), turn in zip(responses[1:], turns[1:], strict=True):
        ideal = turn["ideal_reused_tokens"]
        assert response.usage.prompt_tokens_details.cached_tokens >= ideal // 16 * 16


async def test_an_edited_history_forks_and_never_sends_the_old_handle(
    openai_client, fake, http, acluster
):
    messages, _ = await _conversation(openai_client, fake.model)
    edited = [*messages[:1], {"role": "user", "content": "What colour is item 4?"}, *messages[2:]]
    edited.append({"role": "user", "content": "Go on."})
    raw = await openai_client.chat.completions.with_raw_response.create(
        model=fake.model, messages=edited, max_tokens=16, extra_headers={"X-Session-ID": "s1"}
    )
    assert raw.headers["x-agentkv-forked"] == "1"
    assert raw.headers["x-agentkv-handle"] == "none"
    prefill = _prefill(acluster, fake, raw.headers)
    assert prefill.requests[-1]["kv_transfer_params"]["remote_block_ids"] is None
    assert fake.wrong_reuse_events == 0
    # The fork is now the session: the next extension of it reuses again.
    edited += [raw.parse().choices[0].message.model_dump(), {"role": "user", "content": "More."}]
    raw = await openai_client.chat.completions.with_raw_response.create(
        model=fake.model, messages=edited, max_tokens=16, extra_headers={"X-Session-ID": "s1"}
    )
    assert raw.headers["x-agentkv-handle"] == "attached"
    assert "x-agentkv-forked" not in raw.headers
    assert (await http.get("/v1/sessions/s1")).json()["forks"] == 1


async def test_echoes_with_stripped_text_keep_the_exact_tokens(openai_client, fake):
    """A client that strips whitespace from answers still extends the session, not forks it."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}]
    first = await openai_client.chat.completions.create(
        model=fake.model, messages=messages, max_tokens=40, extra_headers={"X-Session-ID": "e"}
    )
    text = first.choices[0].message.content
    messages += [
        {"role": "assistant", "content": "  " + text.strip() + "\n"},
        {"role": "user", "content": "Next?"},
    ]
    raw = await openai_client.chat.completions.with_raw_response.create(
        model=fake.model, messages=messages, max_tokens=8, extra_headers={"X-Session-ID": "e"}
    )
    assert "x-agentkv-forked" not in raw.headers
    assert raw.headers["x-agentkv-handle"] == "attached"
    assert fake.wrong_reuse_events == 0


async def test_changing_the_tools_forks(openai_client, fake):
    tool = {
        "type": "function",
        "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}},
    }
    messages = [{"role": "user", "content": "Hi"}]
    first = await openai_client.chat.completions.create(
        model=fake.model, messages=messages, max_tokens=8, extra_headers={"X-Session-ID": "t"}
    )
    messages += [first.choices[0].message.model_dump(), {"role": "user", "content": "Again"}]
    raw = await openai_client.chat.completions.with_raw_response.create(
        model=fake.model,
        messages=messages,
        max_tokens=8,
        tools=[tool],
        extra_headers={"X-Session-ID": "t"},
    )
    assert raw.headers["x-agentkv-forked"] == "1"
    assert fake.wrong_reuse_events == 0


async def test_a_streamed_conversation_reuses_like_a_plain_one(openai_client, fake):
    messages = [{"role": "system", "content": SYSTEM}]
    streamed = []
    for question in QUESTIONS:
        messages.append({"role": "user", "content": question})
        raw = await openai_client.chat.completions.with_raw_response.create(
            model=fake.model,
            messages=messages,
            max_tokens=96,
            stream=True,
            stream_options={"include_usage": True},
            extra_headers={"X-Session-ID": "stream"},
        )
        text, usage, finish = "", None, None
        async for chunk in raw.parse():
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                text += choice.delta.content or ""
                finish = choice.finish_reason or finish
        assert finish is not None
        assert raw.headers["content-type"].startswith("text/event-stream")
        streamed.append((usage.prompt_tokens_details.cached_tokens, text, raw.headers))
        messages.append({"role": "assistant", "content": text})
    direct = await _sdk_reuse()
    assert [(c, t) for c, t, _ in streamed] == direct
    assert [h["x-agentkv-handle"] for _, _, h in streamed] == ["none"] + ["attached"] * 3
    assert fake.wrong_reuse_events == 0


async def test_one_shot_requests_keep_no_session(openai_client, fake, http, acluster):
    response = await openai_client.chat.completions.create(
        model=fake.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=8
    )
    assert response.choices[0].message.content
    assert sum(acluster.loads().values()) == 0
    assert (await http.get("/healthz")).json()["sessions"] == 0


async def test_prompt_cache_key_places_conversations_but_does_not_name_one(openai_client, fake):
    """Many conversations under one key: each extends its own session (test_proxy_fields.py)."""
    messages = [{"role": "user", "content": "Hi"}]
    raw = await openai_client.chat.completions.with_raw_response.create(
        model=fake.model, messages=messages, max_tokens=8, extra_body={"prompt_cache_key": "pck"}
    )
    assert raw.headers["x-agentkv-session-id"].startswith("pck-")


async def _keyed(http, messages, **body):
    """One chat completion under ``prompt_cache_key`` "pck"; the raw response."""
    return await http.post(
        "/v1/chat/completions",
        json={"messages": messages, "max_tokens": 16, "prompt_cache_key": "pck", **body},
    )


def _answer(response):
    return response.json()["choices"][0]["message"]


async def test_a_failed_turn_under_a_prompt_cache_key_keeps_the_conversation_s_session(
    http, fake
):
    """Before: finding the session took it off the history index, so after a failed turn the
    retry started a new session and recomputed the whole history."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}]
    first = await _keyed(http, messages)
    assert first.status_code == 200
    session = first.headers["x-agentkv-session-id"]
    messages += [_answer(first), {"role": "user", "content": "And item 7?"}]
    for server in fake.servers:
        if server.role == "prefill":
            server.fail_next("status", status=503)
    assert (await _keyed(http, messages)).status_code == 502
    retry = await _keyed(http, messages)
    assert retry.status_code == 200
    assert retry.headers["x-agentkv-session-id"] == session
    assert "x-agentkv-forked" not in retry.headers
    # The retry is the session's turn 2 (the failed turn may have read the handle, so it is
    # not attached: the SDK's rule), not turn 1 of a new session.
    turns = (await http.get(f"/v1/sessions/{session}")).json()["turns"]
    assert [t["turn"] for t in turns] == [1, 2]
    assert turns[1]["extends"] == 0
    assert fake.wrong_reuse_events == 0


async def test_two_continuations_of_one_history_under_a_prompt_cache_key_keep_a_session_each(
    http, fake
):
    """Both find the session; the registry runs them one after the other, and the second, no
    longer an extension of it, forks into a session of its own instead of taking it over."""
    history = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}]
    first = await _keyed(http, history)
    history.append(_answer(first))
    branches = [[*history, {"role": "user", "content": q}] for q in QUESTIONS[:2]]
    answers = await asyncio.gather(*(_keyed(http, branch) for branch in branches))
    assert [a.status_code for a in answers] == [200, 200]
    ids = [a.headers["x-agentkv-session-id"] for a in answers]
    assert first.headers["x-agentkv-session-id"] in ids
    assert len(set(ids)) == 2
    assert sorted(a.headers.get("x-agentkv-forked", "0") for a in answers) == ["0", "1"]
    # Each continuation goes on on its own session, extending it: nothing forks any more.
    for branch, answer, session in zip(branches, answers, ids, strict=True):
        branch += [_answer(answer), {"role": "user", "content": "Go on."}]
        again = await _keyed(http, branch)
        assert again.headers["x-agentkv-session-id"] == session
        assert again.headers["x-agentkv-handle"] == "attached"
        assert "x-agentkv-forked" not in again.headers
    assert fake.wrong_reuse_events == 0


async def test_a_developer_message_renders_as_system_and_its_session_extends_each_turn(
    openai_client, fake
):
    """Before: 400 for the developer role. Re-sent each turn it is the same message: the
    session extends (handle attached, no fork), with the prompt a system message gives."""
    usage = {}
    for role in ("developer", "system"):
        messages = [{"role": role, "content": SYSTEM}]
        usage[role] = []
        for question in QUESTIONS[:3]:
            messages.append({"role": "user", "content": question})
            raw = await openai_client.chat.completions.with_raw_response.create(
                model=fake.model,
                messages=messages,
                max_tokens=16,
                extra_headers={"X-Session-ID": role},
            )
            response = raw.parse()
            usage[role].append(response.usage.prompt_tokens)
            if len(messages) > 2:
                assert raw.headers["x-agentkv-handle"] == "attached"
                assert "x-agentkv-forked" not in raw.headers
            messages.append(response.choices[0].message.model_dump(exclude_none=True))
    assert usage["developer"] == usage["system"]
    assert fake.wrong_reuse_events == 0


async def test_forged_kv_transfer_params_get_400_and_reach_no_server(openai_client, fake):
    forged = {"do_remote_decode": True, "remote_block_ids": [[1, 2, 3]], "remote_host": "10.0.0.9"}
    for headers in ({"X-Session-ID": "victim"}, {}):
        with pytest.raises(BadRequestError) as info:
            await openai_client.chat.completions.create(
                model=fake.model,
                messages=[{"role": "user", "content": "Hi"}],
                extra_body={"kv_transfer_params": forged},
                extra_headers=headers,
            )
        assert info.value.status_code == 400
        assert info.value.body["code"] == "forbidden_parameter"
    assert all(not server.requests for server in fake.servers)


async def test_a_forged_stream_gets_a_json_400_not_an_event_stream(http):
    response = await http.post(
        "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "Hi"}],
            "stream": True,
            "kv_transfer_params": {},
        },
    )
    assert response.status_code == 400
    assert response.headers["content-type"] == "application/json"
    assert response.json()["error"]["param"] == "kv_transfer_params"


async def test_oversized_bodies_get_413(acluster):
    app = create_app(acluster, ProxyConfig(max_body_bytes=2048))
    async with httpx2.AsyncClient(
        transport=httpx2.ASGITransport(app=app), base_url="http://proxy"
    ) as client:
        body = {"messages": [{"role": "user", "content": "x" * 4096}]}
        response = await client.post("/v1/chat/completions", json=body)
        assert response.status_code == 413
        assert response.json()["error"]["code"] == "too_large"


@pytest.mark.parametrize(("status", "expected"), [(400, 400), (503, 502)])
@pytest.mark.parametrize("stream", [False, True])
async def test_upstream_failures_get_a_status_before_any_stream_starts(
    http, fake, status, expected, stream
):
    """A failed P leg is answered with a JSON error and its status, also for streams."""
    for server in fake.servers:
        if server.role == "prefill":
            server.fail_next("status", status=status)
    response = await http.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "Hi"}], "stream": stream},
        headers={"X-Session-ID": "fails"},
    )
    assert response.status_code == expected
    assert response.headers["content-type"] == "application/json"
    assert "fake-p" not in response.text  # internal URLs stay in the logs
    # Nothing was committed or left pending: the same request then succeeds as turn 1.
    response = await http.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "Hi"}]},
        headers={"X-Session-ID": "fails"},
    )
    assert response.status_code == 200
    session = (await http.get("/v1/sessions/fails")).json()
    assert (session["messages"], session["forks"]) == (2, 0)


async def test_decode_failures_on_streams_are_statuses_too(http, fake):
    for index in range(2):
        fake.decode(index).fail_next("status", status=500)
    response = await http.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "Hi"}], "stream": True},
    )
    assert response.status_code == 502
    assert response.json()["error"]["code"] == "upstream_error"


async def test_unknown_model_paths_and_methods_get_openai_errors(http):
    response = await http.post(
        "/v1/chat/completions",
        json={"model": "gpt-4o", "messages": [{"role": "user", "content": "x"}]},
    )
    assert (response.status_code, response.json()["error"]["code"]) == (404, "model_not_found")
    response = await http.get("/v1/nothing")
    assert response.status_code == 404
    assert "error" in response.json()
    assert (await http.get("/v1/chat/completions")).status_code == 405
    response = await http.post("/v1/chat/completions", content=b"{not json")
    assert response.status_code == 400


async def test_models_healthz_and_metrics(http, fake, openai_client):
    models = await openai_client.models.list()
    assert [m.id for m in models.data] == [fake.model]
    health = await http.get("/healthz")
    assert health.status_code == 200
    assert health.json()["pairs"] == {"pair-0": True, "pair-1": True}
    await _conversation(openai_client, fake.model)
    text = (await http.get("/metrics")).text
    assert 'agentkv_proxy_requests_total{code="200",endpoint="chat"} 4.0' in text
    assert 'agentkv_proxy_turns_total{handle="attached"} 3.0' in text
    assert "agentkv_proxy_sessions 1.0" in text
