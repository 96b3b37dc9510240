"""A chat completions request body, checked and parsed into a ``ChatRequest``.

Every field vLLM 0.32's ``ChatCompletionRequest`` accepts is accepted, in one of three ways
(the table is ``agentkv._wire.fields``, shared with the SDK; docs/proxy.md lists it):

* **passed** to the decode leg when it only shapes sampling or the output (``seed``, ``stop``, ...);
* **refused** with 400 (``forbidden_parameter``) when it could change the prompt's tokens behind
  the session's back or address KV (``kv_transfer_params``, ``chat_template``, ``echo``, ...);
* **ignored** when it has no meaning here, as vLLM ignores fields it does not know: the agents'
  known fields (``user``, ``metadata``, ``store``, Codex's ``client_metadata``: ``_ignored``)
  quietly, an unknown field with a structlog warning (``agentkv.proxy.fields_ignored``) the
  first time the app sees it.

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

from agentkv._core import (
    PASSED_FIELDS,
    ROUTES,
    InvalidMessageError,
    Message,
    PersistMode,
    Route,
    get_logger,
    refusal,
)
from agentkv.proxy._errors import ProxyError
from agentkv.proxy._ignored import IgnoredFields
from agentkv.proxy._session_key import session_key

__all__ = ["ChatRequest", "parse_chat_request", "session_id_from"]

logger = get_logger("agentkv")

# Read by the proxy itself.
_HANDLED = frozenset(
    {
        "conversation_id",
        "logprobs",
        "max_completion_tokens",
        "max_tokens",
        "messages",
        "model",
        "n",
        "prompt_cache_key",
        "session_id",
        "stream",
        "stream_options",
        "temperature",
        "tool_choice",
        "tools",
        "top_logprobs",
    }
)
# Fields the proxy sets itself for every request: a client's value could address KV or lift the
# per-key isolation of prefix caches.
_PROXY_SET = {"cache_salt": "is set by the proxy (prefix caches are isolated per API key)"}
# OpenAI's API refuses a longer key ("string_above_max_length"); its SDK does not check it.
_MAX_PROMPT_CACHE_KEY = 64


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
    # ``conversation_id`` (vLLM's multi-turn convention), else the body's ``session_id``.
    body_session_id: str | None = None
    parallel_tool_calls: bool = True
    extra: Mapping[str, Any] = field(default_factory=dict)
    ignored: tuple[str, ...] = ()


def _bad(message: str, param: str | None = None, code: str = "invalid_value") -> ProxyError:
    return ProxyError(400, message, code=code, param=param)


def _positive_int(body: Mapping[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if type(value) is not int or value < 1:
        raise _bad(f"'{name}' must be a positive integer", name)
    return value


def _check_fields(body: Mapping[str, Any]) -> tuple[str, ...]:
    """Refuse what must not reach a turn; return the names of the ignored fields."""
    if "kv_transfer_params" in body:
        raise _bad(
            "'kv_transfer_params' is set by the proxy and may not come from a client",
            "kv_transfer_params",
            code="forbidden_parameter",
        )
    ignored = []
    for key, value in body.items():
        name = str(key)
        if name in _PROXY_SET and value is not None:
            raise _bad(f"'{name}' {_PROXY_SET[name]}", name, code="forbidden_parameter")
        reason = refusal(name, value)
        if reason is not None:
            raise _bad(reason, name, code="forbidden_parameter")
        if name not in _HANDLED and name not in PASSED_FIELDS and name not in _PROXY_SET:
            ignored.append(name)
    if body.get("logprobs") or body.get("top_logprobs"):
        raise _bad("logprobs are not supported by the proxy", "logprobs")
    return tuple(ignored)


def _optional_str(body: Mapping[str, Any], name: str) -> str | None:
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise _bad(f"'{name}' must be a string", name)
    return value or None


def _messages(raw: object) -> tuple[Message, ...]:
    if not isinstance(raw, list) or not raw:
        raise _bad("'messages' must be a non-empty list", "messages")
    developer = False
    messages: list[Message] = []
    try:
        for message in raw:
            if isinstance(message, Mapping) and message.get("role") == "developer":
                # OpenAI's developer role, as vLLM renders it for a chat template without one
                # (SmolLM2's, Llama's, Qwen's): a system message (``vllm/renderers/hf.py``,
                # ``_convert_developer_to_system``).
                developer = True
                message = {**message, "role": "system"}  # noqa: PLW2901 - the message, mapped
            messages.append(Message.from_openai(message))
    except InvalidMessageError as exc:
        raise _bad(str(exc), "messages", code="invalid_message") from exc
    return _consolidated(messages) if developer else tuple(messages)


def _consolidated(messages: list[Message]) -> tuple[Message, ...]:
    """After that conversion vLLM merges every system message into one, first
    (``_consolidate_system_messages``: some templates take a system message only there); so
    does the proxy, so that the transcript holds the tokens vLLM would render. Re-sent next
    turn, the same messages merge the same way: the history rule sees the same message."""
    systems = [m for m in messages if m.role == "system"]
    if len(systems) == 1 and messages[0].role == "system":
        return tuple(messages)
    merged = Message.system("\n\n".join(m.content for m in systems if m.content))
    return (merged, *(m for m in messages if m.role != "system"))


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


def parse_chat_request(
    body: object,
    *,
    model: str,
    default_max_tokens: int,
    ignored_fields: IgnoredFields | None = None,
) -> ChatRequest:
    """Check ``body`` (parsed JSON) and parse it; ``ProxyError`` (400/404) when it is refused.

    ``ignored_fields`` remembers which unknown fields were warned about (an app's own; without
    it every request's are)."""
    if not isinstance(body, Mapping):
        raise _bad("the request body must be a JSON object")
    ignored = _check_fields(body)
    # As vLLM does ("fields were present in the request but ignored"), once per field.
    (ignored_fields or IgnoredFields()).report(ignored)
    requested = body.get("model")
    if requested is not None and requested != model:
        raise ProxyError(
            404, f"the model '{requested}' does not exist", code="model_not_found", param="model"
        )
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
    cache_key = _optional_str(body, "prompt_cache_key")
    if cache_key is not None and len(cache_key) > _MAX_PROMPT_CACHE_KEY:
        # Said as OpenAI says it: a client that works against OpenAI works here.
        raise _bad(
            "Invalid 'prompt_cache_key': string too long. Expected a string with maximum "
            f"length {_MAX_PROMPT_CACHE_KEY}, but got a string with length {len(cache_key)} "
            "instead.",
            "prompt_cache_key",
            code="string_above_max_length",
        )
    body_session = _optional_str(body, "conversation_id") or _optional_str(body, "session_id")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise _bad("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    return ChatRequest(
        messages=_messages(body.get("messages")),
        max_tokens=max_tokens or default_max_tokens,
        temperature=None if temperature is None else float(temperature),
        tools=_tools(body.get("tools")),
        tool_choice=body.get("tool_choice"),
        stream=stream,
        include_usage=_stream_options(body, stream),
        prompt_cache_key=cache_key,
        body_session_id=body_session,
        parallel_tool_calls=parallel is not False,
        extra=MappingProxyType(
            {k: v for k, v in body.items() if k in PASSED_FIELDS and k != "parallel_tool_calls"}
        ),
        ignored=ignored,
    )


def session_id_from(header: str | None, request: ChatRequest) -> str | None:
    """The session key of a request carrying only ``X-Session-ID`` (``header``) and its body:
    the header, else the body's ``conversation_id``, else its ``session_id``; else none
    (``prompt_cache_key`` is a shared prefix, not a conversation). The whole precedence, the
    agents' own headers included, is ``_session_key.session_key``."""
    headers = {} if header is None else {"x-session-id": header}
    key = session_key(headers, request.body_session_id)
    return None if key is None else key.session_id


OFFLOAD_HEADER = "X-AgentKV-Offload"
# The header's name until issue 41; still read for one release (counted and logged as deprecated).
LEGACY_OFFLOAD_HEADER = "X-AgentKV-Persist"


def offload_from(header: str | None, *, legacy: str | None = None) -> PersistMode:
    """The turn's offload option from ``X-AgentKV-Offload: always | never | auto`` (absent:
    ``auto``); ``legacy`` is the deprecated ``X-AgentKV-Persist`` (``disk | pin | auto``).

    ``always``: the client knows the next turn is far off, so the turn-end KV is offloaded to
    decode's file tier right after the answer; ``never``: keep it pinned in decode's memory. Both
    headers take both vocabularies; sent together they must agree (else 400).

    >>> offload_from("always"), offload_from(None, legacy="pin"), offload_from(None)
    ('disk', 'pin', 'auto')
    """
    mode = _offload_mode(header, OFFLOAD_HEADER)
    old = _offload_mode(legacy, LEGACY_OFFLOAD_HEADER)
    if mode is not None and old is not None and mode != old:
        raise _bad(
            f"{OFFLOAD_HEADER} and {LEGACY_OFFLOAD_HEADER} disagree; send only {OFFLOAD_HEADER}",
            OFFLOAD_HEADER,
        )
    return mode or old or "auto"


def _offload_mode(header: str | None, name: str) -> PersistMode | None:
    if header is None:
        return None
    mode = _OFFLOAD_MODES.get(header.strip().lower())
    if mode is None:
        raise _bad(f"{name} is always, never or auto", name)
    return mode


# Header values onto the session's offload option (today's session words: "disk" offloads,
# "pin" keeps the pin). The old values disk and pin stay accepted for one release.
_OFFLOAD_MODES: Mapping[str, PersistMode] = {
    "always": "disk",
    "never": "pin",
    "auto": "auto",
    "disk": "disk",
    "pin": "pin",
}


def route_from(header: str | None) -> Route | None:
    """The turn's route from ``X-AgentKV-Route: auto | pull | decode | recompute`` (absent:
    the session's own, ``pull`` unless the proxy was told otherwise).

    ``auto`` lets agentkv's policy choose per turn: a short append is computed on the session's
    decode itself (nothing moves, one request), a longer one pulled back to prefill.
    """
    if header is None:
        return None
    route = header.strip().lower()
    if route not in ROUTES:
        raise _bad(f"X-AgentKV-Route is one of {', '.join(ROUTES)}", "X-AgentKV-Route")
    return route
