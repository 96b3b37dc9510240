"""Request parsing and error bodies, with vLLM 0.32's status codes, types and messages.

Error bodies are vLLM's ``ErrorResponse``: ``{"error": {"message", "type", "param", "code"}}``.

* Body/schema errors (FastAPI ``RequestValidationError``): ``type: "Bad Request"``, the message
  lists pydantic errors (``entrypoints/serve/exception_handling/handlers/validation.py``).
* ``VLLMValidationError`` from validators and the renderer: ``type: "BadRequestError"``, the
  message ends with ``(parameter=..., value=...)`` (``vllm/exceptions.py`` ``__str__``).
* Unknown model: 404 ``NotFoundError`` with ``param: "model"``.
* A request that fails in the engine: 500 ``InternalServerError`` "Internal server error".
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, Final

JSON_CONTENT_TYPE: Final = "application/json"


class ApiError(Exception):
    """An error the fake answers with vLLM's error body."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        err_type: str = "BadRequestError",
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.err_type = err_type
        self.param = param

    def body(self) -> dict[str, Any]:
        return error_body(self.message, err_type=self.err_type, code=self.status, param=self.param)


def error_body(message: str, *, err_type: str, code: int, param: str | None) -> dict[str, Any]:
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def status_error_type(status: int) -> str:
    """The ``type`` vLLM uses for an error raised with this status."""
    known = {
        400: "BadRequestError",
        404: "NotFoundError",
        422: "UnprocessableEntityError",
        500: "InternalServerError",
        501: "NotImplementedError",
        503: "ServiceUnavailableError",
    }
    if status in known:
        return known[status]
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Error"


def vllm_validation_error(
    message: str, *, parameter: str | None = None, value: Any = None
) -> ApiError:
    """A ``VLLMValidationError`` turned into a response, message suffix included."""
    extras = []
    if parameter is not None:
        extras.append(f"parameter={parameter}")
    if value is not None:
        extras.append(f"value={value}")
    text = f"{message} ({', '.join(extras)})" if extras else message
    return ApiError(text, param=parameter)


def _summarize(value: Any) -> Any:
    if isinstance(value, str):
        return value if len(value) <= 200 else value[:200] + "...[truncated]"
    if isinstance(value, list | tuple | dict | set):
        return f"<{type(value).__name__} of {len(value)} items>"
    return str(value)


def schema_error(
    err_type: str, loc: tuple[str | int, ...], msg: str, value: Any, **ctx: Any
) -> ApiError:
    """One pydantic/FastAPI validation error, as vLLM's validation handler formats it."""
    param = ".".join(str(p) for p in loc)
    err: dict[str, Any] = {"type": err_type, "loc": param, "msg": msg, "input": _summarize(value)}
    if ctx:
        err["ctx"] = ctx
    return ApiError(f"1 validation error:\n  {err}", err_type="Bad Request", param=param)


def parse_json_body(body: bytes, content_type: str | None) -> Any:
    """``validate_json_request`` plus FastAPI's body decoding."""
    media_type = (content_type or "").split(";", 1)[0].strip().lower()
    if media_type != JSON_CONTENT_TYPE:
        raise ApiError(
            "1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed",
            err_type="Bad Request",
        )
    try:
        return json.loads(body)
    except json.JSONDecodeError as exc:
        raise schema_error(
            "json_invalid", ("body", exc.pos), "JSON decode error", {}, error=exc.msg
        ) from exc
    except UnicodeDecodeError as exc:
        raise schema_error("json_invalid", ("body", 0), "JSON decode error", {}) from exc


@dataclass(frozen=True, kw_only=True)
class ChatRequest:
    """The fields of a ``ChatCompletionRequest`` the fake acts on."""

    messages: list[dict[str, Any]]
    model: str | None
    max_tokens: int | None
    max_tokens_param: str
    min_tokens: int
    ignore_eos: bool
    stream: bool
    include_usage: bool
    continuous_usage: bool
    tools: list[dict[str, Any]] | None
    tool_choice: str | dict[str, Any]
    add_generation_prompt: bool
    continue_final_message: bool
    return_token_ids: bool
    echo: bool
    kv_transfer_params: dict[str, Any] | None
    prompt_token_ids: Any
    request_id: str | None
    chat_template: Any
    chat_template_kwargs: Any
    cache_salt: str | None = None
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    # ``structured_outputs.json``: the schema decoding is constrained to.
    json_schema: Any = None


_TYPE_ERRORS: Final[dict[type, tuple[str, str]]] = {
    int: ("int_type", "integer"),
    bool: ("bool_type", "boolean"),
    str: ("string_type", "string"),
    list: ("list_type", "list"),
    dict: ("dict_type", "dictionary"),
}


def _field(data: Mapping[str, Any], name: str, kind: type, default: Any) -> Any:
    """A typed optional field; ``null`` means the default, as for pydantic optionals."""
    value = data.get(name)
    if value is None:
        return default
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        code, label = _TYPE_ERRORS[kind]
        raise schema_error(code, ("body", name), f"Input should be a valid {label}", value)
    return value


def parse_chat_request(data: Any) -> ChatRequest:
    """Schema checks and the ``model_validator(mode="before")`` checks of the request model."""
    if not isinstance(data, dict):
        raise schema_error(
            "model_attributes_type",
            ("body",),
            "Input should be a valid dictionary or object to extract fields from",
            data,
        )
    if "messages" not in data:
        raise schema_error("missing", ("body", "messages"), "Field required", data)
    messages = _field(data, "messages", list, None)
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise schema_error(
                "model_type", ("body", "messages", i), "Input should be a valid message", message
            )
    stream = bool(_field(data, "stream", bool, False))
    if data.get("stream_options") and not stream:
        raise vllm_validation_error(
            "Stream options can only be defined when `stream=True`.", parameter="stream_options"
        )
    stream_options = _field(data, "stream_options", dict, None) or {}
    tools, tool_choice = _tool_fields(data)
    if data.get("continue_final_message") and data.get("add_generation_prompt"):
        raise vllm_validation_error(
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
        )
    kv_params = _field(data, "kv_transfer_params", dict, None)
    prompt_token_ids = None
    if kv_params is not None:
        kv_params = dict(kv_params)
        prompt_token_ids = kv_params.pop("prompt_token_ids", None)
    max_completion = _field(data, "max_completion_tokens", int, None)
    max_tokens = _field(data, "max_tokens", int, None)
    if max_completion is not None:
        max_tokens, max_tokens_param = max_completion, "max_completion_tokens"
    else:
        max_tokens_param = "max_tokens"
    n = _field(data, "n", int, 1)
    if n not in (None, 1):
        raise vllm_validation_error("fake-smollm2 serves n=1 only.", parameter="n", value=n)
    return ChatRequest(
        messages=messages,
        model=_field(data, "model", str, None),
        max_tokens=max_tokens,
        max_tokens_param=max_tokens_param,
        min_tokens=_field(data, "min_tokens", int, 0) or 0,
        ignore_eos=bool(_field(data, "ignore_eos", bool, False)),
        stream=stream,
        include_usage=bool(stream_options.get("include_usage")),
        continuous_usage=bool(stream_options.get("include_usage"))
        and bool(stream_options.get("continuous_usage_stats")),
        tools=tools,
        tool_choice=tool_choice,
        add_generation_prompt=bool(_field(data, "add_generation_prompt", bool, True)),
        continue_final_message=bool(_field(data, "continue_final_message", bool, False)),
        return_token_ids=bool(_field(data, "return_token_ids", bool, None)),
        echo=bool(_field(data, "echo", bool, False)),
        kv_transfer_params=kv_params,
        prompt_token_ids=prompt_token_ids,
        request_id=_field(data, "request_id", str, None),
        cache_salt=_field(data, "cache_salt", str, None),
        stop=_stop(data.get("stop")),
        json_schema=(_field(data, "structured_outputs", dict, None) or {}).get("json"),
        include_stop_str_in_output=bool(_field(data, "include_stop_str_in_output", bool, False)),
        chat_template=data.get("chat_template"),
        chat_template_kwargs=data.get("chat_template_kwargs"),
    )


def _stop(value: Any) -> tuple[str, ...]:
    """``StopParam``: a string, a list of strings, or null."""
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise schema_error("string_type", ("body", "stop"), "Input should be a valid string", value)
    return tuple(value)


def _tool_fields(data: dict[str, Any]) -> tuple[list[dict[str, Any]] | None, Any]:
    """``check_tool_usage`` of ``ChatCompletionRequest``."""
    tools = _field(data, "tools", list, None)
    if tools == []:
        raise vllm_validation_error(
            "`tools` must not be an empty array. "
            "Either provide at least one tool or omit the field entirely.",
            parameter="tools",
        )
    for i, tool in enumerate(tools or []):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise schema_error(
                "missing", ("body", "tools", i, "function", "name"), "Field required", tool
            )
    choice = data.get("tool_choice", "auto" if tools else "none")
    if choice == "none" or choice is None:
        return tools, "none"
    if tools is None:
        raise vllm_validation_error(
            "When using `tool_choice`, `tools` must be set.", parameter="tool_choice"
        )
    if choice not in ("auto", "required") and not isinstance(choice, dict):
        raise vllm_validation_error(
            f"Invalid value for `tool_choice`: {choice}! "
            'Only named tools, "none", "auto" or "required" are supported.',
            parameter="tool_choice",
        )
    if isinstance(choice, dict):
        _check_named_choice(choice, tools)
    return tools, choice


def _check_named_choice(choice: dict[str, Any], tools: list[dict[str, Any]]) -> None:
    usage = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'
    function = choice.get("function")
    if not isinstance(function, dict):
        raise vllm_validation_error(
            f"Invalid value for `function`: `{function}` in `tool_choice`! {usage}",
            parameter="tool_choice.function",
        )
    if "name" not in function:
        raise vllm_validation_error(
            f"Expected field `name` in `function` in `tool_choice`! {usage}",
            parameter="tool_choice.function.name",
        )
    name = function["name"]
    if not isinstance(name, str) or not name:
        raise vllm_validation_error(
            f"Invalid `name` in `function`: `{name}` in `tool_choice`! {usage}",
            parameter="tool_choice.function.name",
        )
    if not any(t["function"]["name"] == name for t in tools):
        raise vllm_validation_error(
            "The tool specified in `tool_choice` does not match any of the specified `tools`",
            parameter="tool_choice",
        )
