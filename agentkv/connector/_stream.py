"""Streamed chat completions end with the turn-end handle (vLLM sends none: vllm#40186).

vLLM computes a finished request's ``kv_transfer_params`` in the engine and hands them to the API
server on the last ``RequestOutput``; the non-streaming path copies them into the response, the
streaming path drops them. We wrap the serving object's ``chat_completion_stream_generator``:

* its ``result_generator`` argument is tapped to catch the final output's ``kv_transfer_params``;
* the SSE events it yields pass through untouched, except the last one before ``data: [DONE]``
  (the usage chunk with ``stream_options.include_usage``, else the chunk carrying
  ``finish_reason``), which gains a top-level ``"kv_transfer_params"`` key, spliced into the JSON
  text so every other byte is as vLLM wrote it.

Only events produced after the request finished are held back (to learn which one is last), so
text deltas stream with no added latency. The patch is per serving instance (the API server's own
``OpenAIServingChat``), and ``install`` raises at server start if vLLM's method is gone or its
signature changed, rather than streaming without handles.
"""

from __future__ import annotations

import contextlib
import inspect
import json
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from typing import Any

DONE_EVENT = "data: [DONE]\n\n"
_PREFIX = "data: "
_KEY = "kv_transfer_params"
_TARGET = "chat_completion_stream_generator"


def add_handle(event: str, params: Mapping[str, Any]) -> str:
    """``event`` with a top-level ``kv_transfer_params``; unchanged unless it is a chunk object.

    >>> add_handle('data: {"object":"chat.completion.chunk","choices":[]}\\n\\n', {"a": 1})
    'data: {"object":"chat.completion.chunk","choices":[],"kv_transfer_params":{"a":1}}\\n\\n'
    """
    if not event.startswith(_PREFIX) or not event.endswith("\n\n"):
        return event
    body = event[len(_PREFIX) : -2]
    try:
        chunk = json.loads(body)
    except ValueError:
        return event
    # Error events ({"error": ...}) stay as they are, and so does a chunk that already has the
    # key (a vLLM that fixed #40186).
    if not isinstance(chunk, dict) or chunk.get("object") != "chat.completion.chunk" or (
        _KEY in chunk
    ):
        return event
    stripped = body.rstrip()
    value = json.dumps(dict(params), separators=(",", ":"), ensure_ascii=False)
    return f"{_PREFIX}{stripped[:-1]},\"{_KEY}\":{value}}}\n\n"


class _FinalParams:
    """Passes vLLM's ``RequestOutput`` stream through, remembering the finished one's params."""

    def __init__(self, source: AsyncIterator[Any]) -> None:
        self._source = source
        self.finished = False
        self.params: Mapping[str, Any] | None = None

    async def outputs(self) -> AsyncGenerator[Any]:
        try:
            async for output in self._source:
                if getattr(output, "finished", False):
                    self.finished = True
                    params = getattr(output, _KEY, None)
                    self.params = params if isinstance(params, Mapping) else None
                yield output
        finally:
            # Closing the source is what makes vLLM abort a request whose client went away.
            aclose = getattr(self._source, "aclose", None)
            if aclose is not None:
                await aclose()


async def with_final_handle(
    events: AsyncGenerator[str], tap: _FinalParams
) -> AsyncGenerator[str]:
    """Re-yield ``events``, adding ``tap``'s params to the last event before ``[DONE]``."""
    held: str | None = None
    async with contextlib.aclosing(events) as stream:
        async for event in stream:
            if event == DONE_EVENT:
                if held is not None:
                    yield add_handle(held, tap.params) if tap.params is not None else held
                    held = None
                yield event
                continue
            if held is not None:
                yield held
                held = None
            if tap.finished:
                held = event  # maybe the last one: wait for the next event to know
            else:
                yield event
    if held is not None:
        yield held


def _check_signature(function: Any) -> None:
    names = list(inspect.signature(function).parameters)
    if names[:2] != ["request", "result_generator"]:
        raise RuntimeError(
            f"agentkv: vLLM's OpenAIServingChat.{_TARGET} takes {names}, not (request, "
            "result_generator, ...); this vLLM version is not supported by agentkv's stream patch"
        )


def install(serving: Any) -> None:
    """Make ``serving`` (the API server's ``OpenAIServingChat``) end streams with the handle."""
    original = getattr(serving, _TARGET, None)
    if original is None or not inspect.isasyncgenfunction(original):
        raise RuntimeError(
            f"agentkv: {type(serving).__name__} has no async generator {_TARGET}; this vLLM "
            "version is not supported by agentkv's stream patch (streams would carry no handle)"
        )
    if getattr(original, "_agentkv", False):
        return
    _check_signature(original)

    async def stream_with_handle(
        request: Any, result_generator: AsyncIterator[Any], *args: Any, **kwargs: Any
    ) -> AsyncGenerator[str]:
        tap = _FinalParams(result_generator)
        events = original(request, tap.outputs(), *args, **kwargs)
        async with contextlib.aclosing(with_final_handle(events, tap)) as stream:
            async for event in stream:
                yield event

    stream_with_handle._agentkv = True  # type: ignore[attr-defined]
    # An instance attribute: only this serving object changes, not the class.
    setattr(serving, _TARGET, stream_with_handle)
