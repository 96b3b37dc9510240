"""A Responses API request as a chat completion request: messages, tools, output format.

``instructions`` becomes the first system message; ``input`` items become messages (a
``function_call`` joins the assistant message it follows, a ``function_call_output`` is a tool
message, ``developer`` is ``system``); function tools become chat tools, and tools of any other
type are dropped (``dropped_tools``: hosted tools such as ``web_search`` and Codex's
``namespace`` groups, which only OpenAI's servers run); ``text.format`` becomes
``response_format``. Fields with no chat counterpart are dropped or refused here; the rest go
through the chat field table (``_request``).

>>> chat_body({"input": "Hi", "max_output_tokens": 8}, history=[])
{'max_tokens': 8, 'messages': [{'role': 'user', 'content': 'Hi'}]}
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from agentkv.proxy._errors import ProxyError

__all__ = ["REFUSED", "bad", "chat_body", "dropped_tools", "input_messages"]

_RENAMED = {"max_output_tokens": "max_tokens"}
_DROPPED = frozenset(
    {
        "input",
        "instructions",
        "previous_response_id",
        "store",
        "tools",
        "tool_choice",
        "text",
        "include",
        "reasoning",
        "truncation",
        "metadata",
        "service_tier",
        "safety_identifier",
        "stream_options",
        "max_tool_calls",
        "prompt_cache_retention",
        "user",
        "client_metadata",  # Codex's, on every request (``_ignored``)
    }
)
REFUSED = {
    "background": "background responses are not supported",
    "conversation": "the Conversations API is not supported; use previous_response_id",
    "prompt": "prompt templates are not supported",
    "top_logprobs": "logprobs are not supported by the proxy",
}


def bad(message: str, param: str | None = None, code: str = "invalid_value") -> ProxyError:
    return ProxyError(400, message, code=code, param=param)


def _text(content: object, param: str) -> str:
    """The text of a message's content: a string, or a list of text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad("content must be a string or a list of content parts", param)
    texts = []
    for part in content:
        if not isinstance(part, Mapping) or part.get("type") not in (
            "input_text",
            "output_text",
            "text",
        ):
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            raise bad(f"content parts of type {kind!r} are not supported", param)
        texts.append(str(part.get("text", "")))
    return "".join(texts)


def input_messages(items: object) -> list[dict[str, Any]]:
    """``input`` as chat messages: function calls join the assistant message they follow."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise bad("'input' must be a string or a list of items", "input")
    out: list[dict[str, Any]] = []
    for index, item in enumerate(items):
        param = f"input[{index}]"
        if not isinstance(item, Mapping):
            raise bad("an input item must be an object", param)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad(f"unknown role {role!r}", f"{param}.role")
            text = _text(item.get("content"), f"{param}.content")
            out.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind == "function_call":
            call = {
                "id": item.get("call_id"),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments", "")},
            }
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _text(output, f"{param}.output")
            out.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": text})
        elif kind == "reasoning":
            continue  # the model's own reasoning summary: nothing to render
        else:
            raise bad(f"input items of type {kind!r} are not supported", f"{param}.type")
    return out


def _tool_types(tools: object) -> list[str]:
    """Each tool's ``type``; 400 for a list that is not one of typed objects."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise bad("'tools' must be a list", "tools")
    types = []
    for index, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, Mapping) else None
        if not isinstance(kind, str) or not kind:
            raise bad("a tool must be an object with a 'type'", f"tools[{index}]")
        types.append(kind)
    return types


def dropped_tools(tools: object) -> list[str]:
    """The types of the tools the proxy drops from a request (in order, once each): every type
    but ``function``. Hosted tools run on OpenAI's servers, and a model served here can call
    only what its client runs; Codex sends ``web_search`` and ``namespace`` on every request,
    and refusing them would stop it, so they go and the answer says so."""
    return list(dict.fromkeys(kind for kind in _tool_types(tools) if kind != "function"))


def _chat_tools(tools: object) -> list[dict[str, Any]] | None:
    types = _tool_types(tools)
    out = []
    for tool, kind in zip(tools if isinstance(tools, list) else (), types, strict=True):
        if kind != "function":
            continue  # dropped_tools
        function = {"name": tool.get("name"), "parameters": tool.get("parameters") or {}}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out or None


def _chat_tool_choice(choice: object) -> object:
    if isinstance(choice, Mapping) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    if choice is None or isinstance(choice, str):
        return choice
    raise bad(f"tool_choice {choice!r} is not supported", "tool_choice")


def _response_format(text: object) -> object:
    """``text.format`` as chat's ``response_format`` (``None``: plain text)."""
    if not isinstance(text, Mapping):
        return None
    fmt = text.get("format")
    if not isinstance(fmt, Mapping) or fmt.get("type") in (None, "text"):
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        schema = {"name": fmt.get("name", "schema"), "schema": fmt.get("schema") or {}}
        if "strict" in fmt:
            schema["strict"] = fmt["strict"]
        return {"type": "json_schema", "json_schema": schema}
    raise bad(f"text.format {fmt.get('type')!r} is not supported", "text.format")


def chat_body(body: Mapping[str, Any], *, history: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The chat completion request for ``body``, after ``history`` (a stored response's)."""
    instructions = body.get("instructions")
    messages = [
        *([{"role": "system", "content": instructions}] if instructions else []),
        *history,
        *input_messages(body.get("input")),
    ]
    chat: dict[str, Any] = {
        _RENAMED[key] if key in _RENAMED else str(key): value
        for key, value in body.items()
        if key not in _DROPPED and key not in REFUSED
    }
    chat["messages"] = messages
    tools = _chat_tools(body.get("tools"))
    if tools:
        chat["tools"] = tools
        if body.get("tool_choice") is not None:
            chat["tool_choice"] = _chat_tool_choice(body.get("tool_choice"))
    response_format = _response_format(body.get("text"))
    if response_format is not None:
        chat["response_format"] = response_format
    return chat
