"""Decode's answer, JSON or streamed: the assistant message, its exact token ids, the turn-end
handle, and why an answer that carries no handle carries none.

The D leg's body and prefill's answer are ``handoff``'s; this module reads what decode sends back
(``return_token_ids``: the generated ids; the prompt's echo is cut before parsing, see
``http.post_json``'s ``unread``), with the same strictness and the same handle parser.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from agentkv._exceptions import InvalidMessageError, ServerError
from agentkv._types import KVHandle, Message, ToolCall
from agentkv._wire.handoff import (
    DecodeResult,
    LeaseDeadline,
    _bad,
    _handle,
    _int,
    _ints,
    _kv_params,
    _logger,
)

__all__ = ["StreamAccumulator", "no_handle_cause", "parse_decode", "unexplained"]


def _token_ids(value: object, url: str, where: str) -> list[int]:
    if not isinstance(value, list) or not _ints(value):
        raise _bad(
            url, "decode", f"{where} is missing or not a list of integers (return_token_ids)"
        )
    return value


def _tool_calls(raw: object, url: str) -> tuple[ToolCall, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise _bad(url, "decode", "message.tool_calls is not a list")
    try:
        return tuple(ToolCall.from_openai(call) for call in raw)
    except InvalidMessageError as exc:
        raise _bad(url, "decode", f"bad tool call: {exc}") from exc


def _logprobs(choice: Mapping[str, Any], url: str) -> list[float] | None:
    """The sampled tokens' logprobs (``choices[0].logprobs.content[*].logprob``), if present."""
    raw = choice.get("logprobs")
    if raw is None:
        return None
    content = raw.get("content") if isinstance(raw, dict) else None
    if not isinstance(content, list):
        raise _bad(url, "decode", "choices[0].logprobs.content is not a list")
    values = [entry.get("logprob") if isinstance(entry, dict) else None for entry in content]
    if not all(isinstance(v, int | float) for v in values):
        raise _bad(url, "decode", "a logprobs entry has no numeric logprob")
    return [float(v) for v in values]  # type: ignore[arg-type]


def _assistant(content: object, tool_calls: tuple[ToolCall, ...], url: str) -> Message:
    if content is not None and not isinstance(content, str):
        raise _bad(url, "decode", "message.content is not a string")
    if content is None and not tool_calls:
        content = ""
    return Message.assistant(content, tool_calls=tool_calls)


def parse_decode(
    data: Any,
    *,
    url: str,
    pair: str,
    issued_at: float,
    deadline: float,
    lease_deadline: LeaseDeadline | None = None,
) -> DecodeResult:
    """Parse a non-streamed D leg answer into the assistant message, ids and turn-end handle.

    ``deadline``: the handle's; a leased one's is ``lease_deadline(ttl_s)`` when given.
    """
    leg = "decode"
    if not isinstance(data, dict):
        raise _bad(url, leg, f"the body is {type(data).__name__}, not an object")
    choices = data.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise _bad(url, leg, "no choices")
    choice = choices[0]
    message = choice.get("message")
    if not isinstance(message, dict):
        raise _bad(url, leg, "choices[0].message is missing")
    finish_reason = choice.get("finish_reason")
    if not isinstance(finish_reason, str):
        raise _bad(url, leg, "choices[0].finish_reason is missing")
    token_ids = _token_ids(choice.get("token_ids"), url, "choices[0].token_ids")
    stop_reason = choice.get("stop_reason")
    raw_params = data.get("kv_transfer_params")
    params = None if raw_params is None else _kv_params(data, url, leg)
    usage = data.get("usage")
    prompt_tokens = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    cached_tokens = _cached_tokens(usage)
    logprobs = _logprobs(choice, url)
    return DecodeResult(
        message=_assistant(
            message.get("content"), _tool_calls(message.get("tool_calls"), url), url
        ),
        token_ids=tuple(token_ids),
        finish_reason=finish_reason,
        prompt_tokens=prompt_tokens if _int(prompt_tokens) else None,
        cached_tokens=cached_tokens,
        handle=_decode_handle(
            params,
            url=url,
            pair=pair,
            issued_at=issued_at,
            deadline=deadline,
            lease_deadline=lease_deadline,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
            stream=False,
        ),
        logprobs=None if logprobs is None else tuple(logprobs),
        stop_reason=_stop_reason(stop_reason),
    )


def _cached_tokens(usage: object) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens``, when decode reported it (the turns that
    compute on decode read their reuse from it; a D leg's counts the pulled KV too)."""
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return cached if _int(cached) else None


def _stop_reason(value: object) -> str | int | None:
    return value if isinstance(value, str) or _int(value) else None


def no_handle_cause(finish_reason: str | None, stop_reason: object) -> str | None:
    """Why a D leg normally ends without ``kv_transfer_params``; ``None`` if it should have them.

    vLLM checks stop strings in its front end (``v1/engine/output_processor.py``): the engine
    had not finished the request, so it is aborted there, decode pins nothing and the answer
    carries ``kv_transfer_params: null``. Repetition detection ends a request the same way.

    >>> no_handle_cause("stop", "Observation:"), no_handle_cause("stop", None)
    ('stop_string', None)
    """
    if finish_reason == "stop" and isinstance(stop_reason, str):
        return "stop_string"
    if finish_reason in ("repetition", "abort"):
        return finish_reason
    return None


def unexplained(result: DecodeResult) -> bool:
    """An answer without a handle that vLLM would have pinned KV for (not a stop string)."""
    return (
        result.handle is None and no_handle_cause(result.finish_reason, result.stop_reason) is None
    )


def _decode_handle(
    params: Mapping[str, Any] | None,
    *,
    url: str,
    pair: str,
    issued_at: float,
    deadline: float,
    lease_deadline: LeaseDeadline | None,
    finish_reason: str | None,
    stop_reason: object,
    stream: bool,
) -> KVHandle | None:
    """Decode's turn-end handle; ``None`` (a normal turn without one) when it sent no params.

    A turn without a handle still commits its exact tokens; the next turn recomputes what
    prefill's own prefix cache does not hold. The log event says why there was no handle.
    """
    if params is not None:
        return _handle(
            params,
            url=url,
            pair=pair,
            issued_at=issued_at,
            deadline=deadline,
            lease_deadline=lease_deadline,
        )
    cause = no_handle_cause(finish_reason, stop_reason)
    if cause is not None:
        _logger.info(
            "agentkv.turn_without_handle",
            url=url,
            cause=cause,
            stop_reason=stop_reason if isinstance(stop_reason, str) else None,
            detail="vLLM ends such a request in its front end and keeps no KV for a next turn",
        )
    elif stream:
        # Stock vLLM streams carry no handle (vllm#40186).
        _logger.warning(
            "agentkv.stream_without_handle",
            url=url,
            finish_reason=finish_reason,
            hint="enable agentkv's vLLM plugin (AGENTKV_VLLM_PLUGIN=1) on decode servers",
        )
    else:
        _logger.warning(
            "agentkv.turn_without_handle",
            url=url,
            cause="no_kv_transfer_params",
            finish_reason=finish_reason,
            hint="is bidirectional_kv_xfer on for decode (kv_connector_extra_config)?",
        )
    return None


class StreamAccumulator:
    """Builds a ``DecodeResult`` from a streamed D leg, one parsed SSE chunk at a time.

    ``feed`` returns the chunk's text delta ('' if none). Stock vLLM puts no
    ``kv_transfer_params`` on streams; agentkv's plugin adds them (top level) to the last chunk.
    """

    __slots__ = (
        "_cached_tokens",
        "_calls",
        "_finish",
        "_logprobs",
        "_params",
        "_prompt_tokens",
        "_stop_reason",
        "_text",
        "_token_ids",
        "_url",
        "has_tokens",
    )

    def __init__(self, *, url: str) -> None:
        self._url = url
        self._text: list[str] = []
        self._token_ids: list[int] = []
        self._calls: dict[int, dict[str, str]] = {}
        self._finish: str | None = None
        self._params: Mapping[str, Any] | None = None
        self._prompt_tokens: int | None = None
        self._cached_tokens: int | None = None
        self._stop_reason: object = None
        self._logprobs: list[float] | None = None
        self.has_tokens = False

    def feed(self, chunk: Any) -> str:
        url = self._url
        if not isinstance(chunk, dict):
            raise _bad(url, "decode", "a stream chunk is not an object")
        error = chunk.get("error")
        if error is not None:
            # vLLM reports failures inside a 200 stream as {"error": {...}}.
            code = error.get("code") if isinstance(error, dict) else None
            raise ServerError(
                "decode failed mid-stream",
                status_code=code if _int(code) else 500,
                url=url,
                request_summary="decode leg (stream)",
                response_body=str(error),
            )
        if chunk.get("kv_transfer_params") is not None:
            self._params = _kv_params(chunk, url, "decode")
        usage = chunk.get("usage")
        if isinstance(usage, dict) and _int(usage.get("prompt_tokens")):
            self._prompt_tokens = usage["prompt_tokens"]
            self._cached_tokens = _cached_tokens(usage)
        choices = chunk.get("choices")
        if not choices:
            return ""
        if not isinstance(choices, list) or not isinstance(choices[0], dict):
            raise _bad(url, "decode", "stream chunk choices are malformed")
        choice = choices[0]
        self._feed_tokens(choice)
        finish = choice.get("finish_reason")
        if finish is not None:
            if not isinstance(finish, str):
                raise _bad(url, "decode", "finish_reason is not a string")
            self._finish = finish
            self._stop_reason = choice.get("stop_reason")
        delta = choice.get("delta")
        if not isinstance(delta, dict):
            return ""
        for call in delta.get("tool_calls") or ():
            self._add_call(call)
        text = delta.get("content")
        if isinstance(text, str) and text:
            self._text.append(text)
            return text
        return ""

    def _feed_tokens(self, choice: Mapping[str, Any]) -> None:
        url = self._url
        ids = choice.get("token_ids")
        if ids is not None:
            self._token_ids.extend(_token_ids(ids, url, "chunk token_ids"))
            self.has_tokens = self.has_tokens or bool(ids)
        logprobs = _logprobs(choice, url)
        if logprobs is not None:
            self._logprobs = [*(self._logprobs or ()), *logprobs]

    def _add_call(self, call: object) -> None:
        if not isinstance(call, dict) or not _int(call.get("index", 0)):
            raise _bad(self._url, "decode", "a streamed tool call is malformed")
        slot = self._calls.setdefault(call.get("index", 0), {"id": "", "name": "", "arguments": ""})
        if isinstance(call.get("id"), str):
            slot["id"] = call["id"]
        function = call.get("function")
        if isinstance(function, dict):
            if isinstance(function.get("name"), str):
                slot["name"] += function["name"]
            if isinstance(function.get("arguments"), str):
                slot["arguments"] += function["arguments"]

    def result(
        self,
        *,
        pair: str,
        issued_at: float,
        deadline: float,
        lease_deadline: LeaseDeadline | None = None,
    ) -> DecodeResult:
        url = self._url
        if self._finish is None:
            raise _bad(url, "decode", "the stream ended without a finish_reason")
        if not self._token_ids:
            raise _bad(url, "decode", "the stream carried no token_ids (return_token_ids)")
        try:
            calls = tuple(
                ToolCall(id=c["id"], name=c["name"], arguments=c["arguments"])
                for _, c in sorted(self._calls.items())
            )
        except InvalidMessageError as exc:
            raise _bad(url, "decode", f"bad streamed tool call: {exc}") from exc
        text = "".join(self._text)
        return DecodeResult(
            message=_assistant(text if text or not calls else None, calls, url),
            token_ids=tuple(self._token_ids),
            finish_reason=self._finish,
            prompt_tokens=self._prompt_tokens,
            cached_tokens=self._cached_tokens,
            # Without params the text has already reached the caller: failing the turn now
            # would only lose it, so it ends without a handle (the log event says why).
            handle=_decode_handle(
                self._params,
                url=url,
                pair=pair,
                issued_at=issued_at,
                deadline=deadline,
                lease_deadline=lease_deadline,
                finish_reason=self._finish,
                stop_reason=self._stop_reason,
                stream=True,
            ),
            logprobs=None if self._logprobs is None else tuple(self._logprobs),
            stop_reason=_stop_reason(self._stop_reason),
        )
