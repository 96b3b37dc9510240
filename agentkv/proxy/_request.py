"""A chat completions request body, checked and parsed into a ``ChatRequest``.

Parameters are allow-listed, not deny-listed: a vLLM extension field the proxy does not know
(``kv_transfer_params``, ``chat_template``, ``prompt_token_ids``, ...) could change the prompt's
tokens behind the session's back or address KV the client does not own, so anything unknown is
refused with a 400 naming it. ``kv_transfer_params`` gets its own message: it is the one field a
client could use to read another session's KV blocks.

>>> request = parse_chat_request({"model": "m", "messages": [{"role": "user", "content": "hi"}],
...                               "temperature": 0.2, "seed": 7}, model="m", default_max_tokens=64)
>>> request.max_tokens, request.temperature, dict(request.extra)
(64, 0.2, {'seed': 7})
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from agentkv._exceptions import InvalidMessageError
from agentkv._types import Message
from agentkv.proxy._errors import ProxyError

__all__ = ["ChatRequest", "parse_chat_request", "session_id_from"]

# Sampling fields passed to the decode leg unchanged (vLLM validates their values).
_PASSED = frozenset(
    {
        "frequency_penalty",
        "ignore_eos",
        "logit_bias",
        "min_p",
        "min_tokens",
        "parallel_tool_calls",
        "presence_penalty",
        "repetition_penalty",
        "response_format",
        "seed",
        "stop",
        "stop_token_ids",
        "top_k",
        "top_p",
    }
)
# OpenAI fields with no meaning for a vLLM backend; accepted so that clients sending them work.
_IGNORED = frozenset(
    {
        "metadata",
        "prompt_cache_key",
        "prompt_cache_retention",
        "safety_identifier",
        "service_tier",
        "store",
        "user",
    }
)
_HANDLED = frozenset(
    {
        "logprobs",
        "max_completion_tokens",
        "max_tokens",
        "messages",
        "model",
        "n",
        "stream",
        "stream_options",
        "temperature",
        "tool_choice",
        "tools",
        "top_logprobs",
    }
)
_MAX_SESSION_ID = 256


@dataclass(frozen=True, kw_only=True, slots=True)
class ChatRequest:
    """What a client asked for, in the terms of ``AsyncSession.turn``'s overrides."""

    messages: tuple[Message, ...]
    max_tokens: int
    temperature: float | None = None
    tools: tuple[Mapping[str, Any], ...] | None = None
    tool_choice: Any = None
    stream: bool = False
    include_usage: bool = False
    prompt_cache_key: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)


def _bad(message: str, param: str | None = None, code: str = "invalid_value") -> ProxyError:
    return ProxyError(400, message, code=code, param=param)


def _positive_int(body: Mapping[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if type(value) is not int or value < 1:
        raise _bad(f"'{name}' must be a positive integer", name)
    return value


def _check_fields(body: Mapping[str, Any]) -> None:
    if "kv_transfer_params" in body:
        raise _bad(
            "'kv_transfer_params' is set by the proxy and may not come from a client",
            "kv_transfer_params",
            code="forbidden_parameter",
        )
    for name in body:
        if name not in _HANDLED and name not in _PASSED and name not in _IGNORED:
            raise _bad(f"unsupported parameter '{name}'", str(name), code="unsupported_parameter")
    if body.get("logprobs") or body.get("top_logprobs"):
        raise _bad("logprobs are not supported by the proxy", "logprobs")


def _messages(raw: object) -> tuple[Message, ...]:
    if not isinstance(raw, list) or not raw:
        raise _bad("'messages' must be a non-empty list", "messages")
    try:
        return tuple(Message.from_openai(message) for message in raw)
    except InvalidMessageError as exc:
        raise _bad(str(exc), "messages", code="invalid_message") from exc


def _tools(raw: object) -> tuple[Mapping[str, Any], ...] | None:
    if raw is None:
        return None
    if not isinstance(raw, list) or not all(isinstance(tool, Mapping) for tool in raw):
        raise _bad("'tools' must be a list of objects", "tools")
    return tuple(raw) or None


def _stream_options(body: Mapping[str, Any], stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise _bad("'stream_options' is only allowed with 'stream': true", "stream_options")
    if not isinstance(options, Mapping):
        raise _bad("'stream_options' must be an object", "stream_options")
    include = options.get("include_usage", False)
    if not isinstance(include, bool):
        raise _bad("'stream_options.include_usage' must be a boolean", "stream_options")
    return include


def parse_chat_request(body: object, *, model: str, default_max_tokens: int) -> ChatRequest:
    """Check ``body`` (parsed JSON) and parse it; ``ProxyError`` (400/404) when it is refused."""
    if not isinstance(body, Mapping):
        raise _bad("the request body must be a JSON object")
    _check_fields(body)
    requested = body.get("model")
    if requested is not None and requested != model:
        raise ProxyError(
            404, f"the model '{requested}' does not exist", code="model_not_found", param="model"
        )
    n = body.get("n")
    if n is not None and n != 1:
        raise _bad("only 'n': 1 is supported", "n")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise _bad("'stream' must be a boolean", "stream")
    temperature = body.get("temperature")
    if temperature is not None and (
        isinstance(temperature, bool) or not isinstance(temperature, int | float)
    ):
        raise _bad("'temperature' must be a number", "temperature")
    max_tokens = _positive_int(body, "max_completion_tokens") or _positive_int(body, "max_tokens")
    cache_key = body.get("prompt_cache_key")
    if cache_key is not None and not isinstance(cache_key, str):
        raise _bad("'prompt_cache_key' must be a string", "prompt_cache_key")
    return ChatRequest(
        messages=_messages(body.get("messages")),
        max_tokens=max_tokens or default_max_tokens,
        temperature=None if temperature is None else float(temperature),
        tools=_tools(body.get("tools")),
        tool_choice=body.get("tool_choice"),
        stream=stream,
        include_usage=_stream_options(body, stream),
        prompt_cache_key=cache_key or None,
        extra=MappingProxyType({k: v for k, v in body.items() if k in _PASSED}),
    )


def session_id_from(header: str | None, request: ChatRequest) -> str | None:
    """The session key: the ``X-Session-ID`` header, else ``prompt_cache_key``, else none."""
    raw = header if header is not None else request.prompt_cache_key
    if raw is None:
        return None
    session_id = raw.strip()
    if not session_id or len(session_id) > _MAX_SESSION_ID or not session_id.isprintable():
        raise _bad(
            f"a session id is 1 to {_MAX_SESSION_ID} printable characters",
            "X-Session-ID",
            code="invalid_session_id",
        )
    return session_id
