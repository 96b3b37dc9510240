"""The stream patch: the last chunk before [DONE] gains the handle, every other byte is vLLM's."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from agentkv.connector._stream import DONE_EVENT, add_handle, install

HANDLE = {"do_remote_decode": True, "remote_block_ids": [[1, 2]], "agentkv": {"v": 1}}


@dataclass
class Output:  # the two fields of vLLM's RequestOutput the patch reads
    finished: bool
    kv_transfer_params: dict[str, Any] | None = None


def _chunk(**fields: Any) -> str:
    body = json.dumps({"object": "chat.completion.chunk", **fields}, separators=(",", ":"))
    return f"data: {body}\n\n"


@dataclass
class FakeServing:
    """Stands in for vLLM's OpenAIServingChat: one chunk per output, then usage, then [DONE]."""

    include_usage: bool = True
    closed: list[str] = field(default_factory=list)

    async def chat_completion_stream_generator(
        self, request: Any, result_generator: AsyncIterator[Output], request_id: str
    ) -> AsyncGenerator[str]:
        try:
            async for output in result_generator:
                finish = "stop" if output.finished else None
                yield _chunk(choices=[{"delta": {"content": "x"}, "finish_reason": finish}])
            if self.include_usage:
                yield _chunk(choices=[], usage={"prompt_tokens": 3})
            yield DONE_EVENT
        finally:
            self.closed.append(request_id)


async def _outputs(params: dict[str, Any] | None, n: int = 3) -> AsyncGenerator[Output]:
    for i in range(n):
        last = i == n - 1
        yield Output(finished=last, kv_transfer_params=params if last else None)


async def _collect(serving: FakeServing, params: dict[str, Any] | None) -> list[str]:
    stream = serving.chat_completion_stream_generator(None, _outputs(params), "req")
    return [event async for event in stream]


async def test_the_usage_chunk_carries_the_handle_when_usage_is_requested() -> None:
    plain = await _collect(FakeServing(), HANDLE)
    serving = FakeServing()
    install(serving)
    events = await _collect(serving, HANDLE)
    assert events[-1] == DONE_EVENT
    assert events[:-2] == plain[:-2]  # every earlier chunk is byte-identical
    last = json.loads(events[-2][len("data: ") :])
    assert last["kv_transfer_params"] == HANDLE
    assert last["usage"] == {"prompt_tokens": 3}
    assert (
        events[-2].replace(',"kv_transfer_params":' + json.dumps(HANDLE, separators=(",", ":")), "")
        == plain[-2]
    )


async def test_without_usage_the_finish_reason_chunk_carries_the_handle() -> None:
    serving = FakeServing(include_usage=False)
    install(serving)
    events = await _collect(serving, HANDLE)
    last = json.loads(events[-2][len("data: ") :])
    assert last["choices"][0]["finish_reason"] == "stop"
    assert last["kv_transfer_params"] == HANDLE
    assert all("kv_transfer_params" not in e for e in events[:-2])


async def test_a_request_without_params_streams_unchanged() -> None:
    plain = await _collect(FakeServing(), None)
    serving = FakeServing()
    install(serving)
    assert await _collect(serving, None) == plain


async def test_installing_twice_is_harmless() -> None:
    serving = FakeServing()
    install(serving)
    install(serving)
    events = await _collect(serving, HANDLE)
    assert events[-2].count("kv_transfer_params") == 1


async def test_closing_the_stream_early_closes_vllms_generator() -> None:
    serving = FakeServing()
    install(serving)
    stream = serving.chat_completion_stream_generator(None, _outputs(HANDLE, n=10), "req-x")
    assert (await anext(stream)).startswith("data: ")
    await stream.aclose()
    assert serving.closed == ["req-x"]


def test_error_events_and_non_chunks_are_left_alone() -> None:
    error = 'data: {"error":{"message":"boom"}}\n\n'
    assert add_handle(error, HANDLE) == error
    assert add_handle(DONE_EVENT, HANDLE) == DONE_EVENT
    assert add_handle("data: not json\n\n", HANDLE) == "data: not json\n\n"
    already = _chunk(choices=[], kv_transfer_params={"x": 1})
    assert add_handle(already, HANDLE) == already


def test_a_serving_object_without_the_patch_point_fails_loudly() -> None:
    with pytest.raises(RuntimeError, match="not supported"):
        install(object())

    class Renamed:
        async def chat_completion_stream_generator(
            self, req: Any, results: Any
        ) -> AsyncGenerator[str]:
            yield DONE_EVENT

    with pytest.raises(RuntimeError, match="result_generator"):
        install(Renamed())
