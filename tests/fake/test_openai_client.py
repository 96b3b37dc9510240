"""``agentkv.OpenAI`` / ``agentkv.AsyncOpenAI`` on the fake pair: the openai SDK's clients served
in-process by the proxy's app (sync and async twins): sessions, reuse as prefill counted it,
streams, tools through agentkv's JSON protocol, errors as the SDK's own types, close releases
every pin."""

from __future__ import annotations

import asyncio
import json

import httpx2
import openai
import pytest

import agentkv
from agentkv import AsyncCluster

SYSTEM = "You answer briefly. " + " ".join(f"Rule {i}: be kind to robot {i}." for i in range(30))
QUESTIONS = ("Hello?", "Who is robot 4?", "And robot 9?", "Thanks, bye.")
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


# No tool parser: tools go through agentkv's JSON protocol, as on the local pair.
pytestmark = pytest.mark.fake(pairs=1, kv_recompute_threshold=0, tool_call_parser=None)


def _ideal(previous: openai.types.CompletionUsage) -> int:
    # The previous prompt and what was generated, less the last token (never in decode's KV).
    return previous.prompt_tokens + previous.completion_tokens - 1


def test_the_clients_are_the_openai_sdks_own(cluster):
    with agentkv.OpenAI(cluster) as client:
        assert isinstance(client, openai.OpenAI)
        assert client.model == cluster.model
        assert [model.id for model in client.models.list()] == [cluster.model]
        copy = client.with_options(timeout=5)
        assert isinstance(copy, agentkv.OpenAI)
        assert copy.model == cluster.model
    assert issubclass(agentkv.AsyncOpenAI, openai.AsyncOpenAI)
    with pytest.raises(TypeError):
        agentkv.OpenAI()
    with pytest.raises(TypeError, match="base_url"):
        agentkv.OpenAI(cluster, base_url="http://elsewhere/v1")


def test_a_sync_conversation_reuses_exactly_and_close_releases_the_pin(cluster, fake):
    decode = fake.decode(0)
    client = agentkv.OpenAI(cluster, session_id="ticket-1", max_retries=0)
    messages: list[dict[str, object]] = [{"role": "system", "content": SYSTEM}]
    previous = None
    for question in QUESTIONS:
        messages.append({"role": "user", "content": question})
        raw = client.chat.completions.with_raw_response.create(
            model=client.model, messages=messages, max_tokens=32
        )
        reply = raw.parse()
        assert isinstance(reply, openai.types.chat.ChatCompletion)
        assert raw.headers["x-agentkv-session-id"] == "ticket-1"
        assert "x-agentkv-forked" not in raw.headers
        assert reply.usage is not None
        assert reply.usage.prompt_tokens_details is not None
        cached = reply.usage.prompt_tokens_details.cached_tokens
        if previous is None:
            assert raw.headers["x-agentkv-handle"] == "none"
        else:
            assert raw.headers["x-agentkv-handle"] == "attached"
            assert cached == _ideal(previous)
        previous = reply.usage
        messages.append(reply.choices[0].message.model_dump(exclude_none=True))
    assert decode.pinned_handles == 1
    client.close()
    assert decode.pinned_handles == 0
    assert not cluster._async.closed  # a cluster given to the client is the caller's
    assert fake.wrong_reuse_events == 0


async def test_an_async_conversation_reuses_exactly_and_close_releases_the_pin(acluster, fake):
    decode = fake.decode(0)
    client = agentkv.AsyncOpenAI(acluster, max_retries=0)
    messages: list[dict[str, object]] = [{"role": "system", "content": SYSTEM}]
    previous = None
    for question in QUESTIONS:
        messages.append({"role": "user", "content": question})
        raw = await client.chat.completions.with_raw_response.create(
            model=client.model,
            messages=messages,
            max_tokens=32,
            extra_headers={"X-Session-ID": "ticket-2"},
        )
        reply = raw.parse()
        assert reply.usage is not None
        assert reply.usage.prompt_tokens_details is not None
        if previous is not None:
            assert raw.headers["x-agentkv-handle"] == "attached"
            assert reply.usage.prompt_tokens_details.cached_tokens == _ideal(previous)
        previous = reply.usage
        messages.append(reply.choices[0].message.model_dump(exclude_none=True))
    assert decode.pinned_handles == 1
    await client.close()
    assert decode.pinned_handles == 0
    assert not acluster.closed


def test_a_sync_stream_yields_chunks_and_reuse_in_its_usage(cluster, fake):
    with agentkv.OpenAI(cluster, session_id="s", max_retries=0) as client:
        messages: list[dict[str, object]] = [{"role": "system", "content": SYSTEM}]
        previous = None
        for question in QUESTIONS[:3]:
            messages.append({"role": "user", "content": question})
            stream = client.chat.completions.create(
                model=client.model,
                messages=messages,
                max_tokens=32,
                stream=True,
                stream_options={"include_usage": True},
            )
            text, usage, finish = [], None, None
            for chunk in stream:
                assert isinstance(chunk, openai.types.chat.ChatCompletionChunk)
                usage = chunk.usage or usage
                for choice in chunk.choices:
                    text.append(choice.delta.content or "")
                    finish = choice.finish_reason or finish
            assert "".join(text)
            assert finish in ("stop", "length")
            assert usage is not None
            assert usage.prompt_tokens_details is not None
            if previous is not None:
                assert usage.prompt_tokens_details.cached_tokens == _ideal(previous)
            previous = usage
            messages.append({"role": "assistant", "content": "".join(text)})
    assert fake.wrong_reuse_events == 0


async def test_an_async_stream_abandoned_early_commits_nothing(acluster, fake):
    async with agentkv.AsyncOpenAI(acluster, session_id="s", max_retries=0) as client:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}]
        stream = await client.chat.completions.create(
            model=client.model, messages=messages, max_tokens=32, stream=True
        )
        async for _chunk in stream:
            break
        await stream.close()
        # The abandoned turn left the session as it was: the same request runs on it, unforked.
        raw = await client.chat.completions.with_raw_response.create(
            model=client.model, messages=messages, max_tokens=32
        )
        assert "x-agentkv-forked" not in raw.headers
        assert raw.parse().choices[0].message.content


@pytest.mark.parametrize("stream", [False, True])
async def test_an_async_tool_loop_goes_through_the_json_protocol_and_extends_the_session(
    acluster, fake, stream
):
    async with agentkv.AsyncOpenAI(acluster, session_id="tools", max_retries=0) as client:
        messages: list[dict[str, object]] = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "Weather in Paris?"},
        ]
        raw = await client.chat.completions.with_raw_response.create(
            model=client.model,
            messages=messages,
            tools=[WEATHER],
            tool_choice="required",
            max_tokens=64,
            stream=stream,
            stream_options={"include_usage": True} if stream else openai.omit,
        )
        assert raw.headers["x-agentkv-tool-calling"] == "json"
        if stream:
            calls, usage = [], None
            async for chunk in raw.parse():
                usage = chunk.usage or usage
                for choice in chunk.choices:
                    assert not choice.delta.content
                    calls += [
                        {"id": d.id, "type": "function", "function": d.function.model_dump()}
                        for d in choice.delta.tool_calls or ()
                    ]
            assistant: dict[str, object] = {"role": "assistant", "tool_calls": calls}
        else:
            reply = raw.parse()
            usage = reply.usage
            assert reply.choices[0].finish_reason == "tool_calls"
            assistant = reply.choices[0].message.model_dump(exclude_none=True)
            calls = assistant["tool_calls"]  # type: ignore[assignment]
        assert calls
        assert all(c["function"]["name"] == "get_weather" for c in calls)
        messages.append(assistant)
        for call in calls:
            assert isinstance(json.loads(call["function"]["arguments"]), dict)
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": "Sunny"})
        raw = await client.chat.completions.with_raw_response.create(
            model=client.model, messages=messages, tools=[WEATHER], max_tokens=32
        )
        assert "x-agentkv-forked" not in raw.headers
        assert raw.headers["x-agentkv-handle"] == "attached"
        assert usage is not None
        assert raw.parse().usage.prompt_tokens_details.cached_tokens == _ideal(usage)
    assert fake.wrong_reuse_events == 0


def test_a_sync_tool_call_is_answered_as_openai_answers_it(cluster):
    with agentkv.OpenAI(cluster, max_retries=0) as client:
        reply = client.chat.completions.create(
            model=client.model,
            messages=[{"role": "user", "content": "Weather in Oslo?"}],
            tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            max_tokens=64,
        )
    [call] = reply.choices[0].message.tool_calls or []
    assert call.type == "function"
    assert call.function.name == "get_weather"


def test_sync_refusals_are_the_openai_sdks_error_types(cluster, fake):
    with agentkv.OpenAI(cluster, max_retries=0) as client:
        user = [{"role": "user", "content": "Hi"}]
        with pytest.raises(openai.NotFoundError) as not_found:
            client.chat.completions.create(model="gpt-4o", messages=user)
        assert not_found.value.code == "model_not_found"
        with pytest.raises(openai.BadRequestError) as forbidden:
            client.chat.completions.create(
                model=client.model,
                messages=user,
                extra_body={"kv_transfer_params": {"do_remote_prefill": True}},
            )
        assert forbidden.value.status_code == 400
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model=client.model, messages=user, logprobs=True)
        fake.decode(0).kill()
        with pytest.raises(openai.InternalServerError) as failed:
            client.chat.completions.create(model=client.model, messages=user, max_tokens=8)
        assert failed.value.status_code in (502, 503)
        fake.decode(0).restart()
        # A failure is an answer, not a broken client: the next request is served.
        assert client.chat.completions.create(model=client.model, messages=user, max_tokens=8)


async def test_async_refusals_are_the_openai_sdks_error_types(acluster, fake):
    async with agentkv.AsyncOpenAI(acluster, max_retries=0) as client:
        user = [{"role": "user", "content": "Hi"}]
        with pytest.raises(openai.NotFoundError):
            await client.chat.completions.create(model="gpt-4o", messages=user)
        with pytest.raises(openai.BadRequestError):
            await client.chat.completions.create(model=client.model, messages=user, n=2)
        fake.prefill(0).kill()
        with pytest.raises(openai.InternalServerError):
            await client.chat.completions.create(
                model=client.model, messages=user, max_tokens=8, stream=True
            )
        with pytest.raises(openai.NotFoundError):
            await client.get("/sessions/nope", cast_to=object)


async def test_prompt_cache_key_finds_a_conversation_by_its_history(acluster):
    async with agentkv.AsyncOpenAI(acluster, max_retries=0) as client:
        messages: list[dict[str, object]] = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "Hi"},
        ]
        first = await client.chat.completions.with_raw_response.create(
            model=client.model, messages=messages, max_tokens=16, prompt_cache_key="team-a"
        )
        messages += [
            first.parse().choices[0].message.model_dump(exclude_none=True),
            {"role": "user", "content": "More?"},
        ]
        second = await client.chat.completions.with_raw_response.create(
            model=client.model, messages=messages, max_tokens=16, prompt_cache_key="team-a"
        )
        session = first.headers["x-agentkv-session-id"]
        assert second.headers["x-agentkv-session-id"] == session
        assert second.headers["x-agentkv-handle"] == "attached"


def test_a_client_opened_from_a_cluster_file_owns_and_closes_its_cluster(fake, tmp_path):
    with fake.serve() as served:
        path = tmp_path / "cluster.json"
        path.write_text(json.dumps(served.cluster_spec))
        client = agentkv.OpenAI(str(path), session_id="file", max_retries=0)
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}]
        client.chat.completions.create(model=client.model, messages=messages, max_tokens=16)
        assert fake.decode(0).pinned_handles == 1
        client.close()
        assert fake.decode(0).pinned_handles == 0
        with pytest.raises(RuntimeError):
            client.chat.completions.create(model=client.model, messages=messages)


async def test_an_async_client_opened_from_a_cluster_file_closes_its_cluster(fake, tmp_path):
    with fake.serve() as served:
        path = tmp_path / "cluster.json"
        path.write_text(json.dumps(served.cluster_spec))
        client = agentkv.AsyncOpenAI(path, session_id="file", max_retries=0)
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}]
        await client.chat.completions.create(model=client.model, messages=messages, max_tokens=16)
        assert fake.decode(0).pinned_handles == 1
        await client.close()
        assert fake.decode(0).pinned_handles == 0


class _Slow(httpx2.AsyncBaseTransport):
    """The fake's transport, each request held back while ``slow`` is set."""

    def __init__(self, inner: httpx2.AsyncBaseTransport) -> None:
        self._inner = inner
        self.slow = False

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        if self.slow:
            await asyncio.sleep(1.0)
        return await self._inner.handle_async_request(request)


async def test_a_call_the_caller_gives_up_on_commits_nothing_and_the_session_goes_on(fake):
    """``timeout=`` holds for the in-process transport as for a socket: the call times out, its
    turn is cancelled and commits nothing, so the retry (the same history) extends the session
    as if the call had never been made."""
    transport = _Slow(fake.transport)
    async with (
        AsyncCluster.from_dict(fake.cluster_spec, transport=transport) as cluster,
        agentkv.AsyncOpenAI(cluster, session_id="cancel", max_retries=0) as client,
    ):
        messages = [{"role": "user", "content": "Tell me about ports."}]
        first = await client.chat.completions.create(model=client.model, messages=messages)
        messages += [first.choices[0].message.model_dump(exclude_none=True)]
        messages += [{"role": "user", "content": "And harbours?"}]
        transport.slow = True
        with pytest.raises(openai.APITimeoutError):
            await client.chat.completions.create(
                model=client.model, messages=messages, timeout=0.2
            )
        transport.slow = False
        raw = await client.chat.completions.with_raw_response.create(
            model=client.model, messages=messages
        )
        retry = raw.parse()
        assert raw.headers.get("x-agentkv-forked") is None
        assert raw.headers["x-agentkv-handle"] == "attached"
        assert retry.usage is not None
        assert first.usage is not None
        assert retry.usage.prompt_tokens_details is not None
        assert retry.usage.prompt_tokens_details.cached_tokens == _ideal(first.usage)
    assert fake.wrong_reuse_events == 0
