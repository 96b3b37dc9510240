"""An Anthropic Messages request as a chat completion request: one turn, one history rule.

``system`` (a string or text blocks) becomes the first system message, ``role: "system"``
messages stay system messages where they are; text blocks join with a newline (as vLLM joins
text parts), so a message sent as text blocks one turn and as a plain string the next (Claude
Code does that, and moves ``cache_control`` every turn) is the same chat message both times and
the history rule sees an append-only history. ``tool_use`` blocks become the assistant's tool
calls, ``tool_result`` blocks tool messages (before the user's text, as vLLM orders them);
custom tools become function tools. ``thinking`` blocks in the history cannot be kept token-exact
(the proxy never generated them) and are refused, never silently re-rendered; so are images,
documents, server tools and an assistant prefill. Fields that only steer Anthropic's own
features (``thinking``, ``context_management``, ``output_config.effort``, ``metadata``,
``cache_control``) are accepted and have no effect.

>>> chat = chat_body({"max_tokens": 8, "system": [{"type": "text", "text": "Be brief."}],
...                   "messages": [{"role": "user", "content": "Hi"}]}, drops=SystemDrops(()))
>>> chat.body["messages"], chat.body["max_tokens"]
([{'role': 'system', 'content': 'Be brief.'}, {'role': 'user', 'content': 'Hi'}], 8)
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from agentkv._core import get_logger
from agentkv.proxy._errors import ProxyError
from agentkv.proxy._messages_system import SystemDrops

__all__ = ["Translated", "chat_body"]

logger = get_logger("agentkv")

# Read here, or accepted with no effect (Anthropic's own features, client bookkeeping).
_KNOWN = frozenset(
    {
        "model",
        "messages",
        "system",
        "max_tokens",
        "stop_sequences",
        "temperature",
        "top_p",
        "top_k",
        "stream",
        "tools",
        "tool_choice",
        "metadata",
        "thinking",
        "context_management",
        "output_config",
        "service_tier",
        "diagnostics",
        "cache_control",
        "inference_geo",
    }
)
# Features a server would run itself: refused when asked for.
_REFUSED = {
    "mcp_servers": "MCP servers run by the API are not supported; run them in the client",
    "container": "code execution containers are not supported",
}
_EMPTY_RESULT = "(no output)"


def bad(message: str, param: str | None = None) -> ProxyError:
    return ProxyError(400, message, code="invalid_request_error", param=param)


@dataclass(frozen=True, kw_only=True, slots=True)
class Translated:
    """The chat completion request of a Messages request, and the drop rules that fired."""

    body: dict[str, Any]
    dropped: tuple[str, ...] = ()


class _Builder:
    """Walks one request's system and messages into chat messages."""

    def __init__(self, drops: SystemDrops) -> None:
        self._drops = drops
        self.dropped: list[str] = []
        self.messages: list[dict[str, Any]] = []

    def _kept(self, text: str) -> bool:
        rule = self._drops.match(text)
        if rule is not None:
            self.dropped.append(rule)
        return rule is None

    def system(self, system: object, param: str) -> None:
        if system is None:
            return
        if isinstance(system, str):
            texts = [system]
        elif isinstance(system, list):
            texts = [_block_text(block, f"{param}[{i}]") for i, block in enumerate(system)]
        else:
            raise bad(f"'{param}' must be a string or a list of text blocks", param)
        kept = "\n".join(text for text in texts if text and self._kept(text))
        if kept:
            self.messages.append({"role": "system", "content": kept})

    def message(self, message: object, param: str) -> None:
        if not isinstance(message, Mapping):
            raise bad("a message must be an object", param)
        role = message.get("role")
        content = message.get("content")
        if role == "system":
            self.system(content, f"{param}.content")
        elif role == "user":
            self._user(content, f"{param}.content")
        elif role == "assistant":
            self._assistant(content, f"{param}.content")
        else:
            raise bad(f"unknown role {role!r}: user, assistant or system", f"{param}.role")

    def _user(self, content: object, param: str) -> None:
        if isinstance(content, str):
            self.messages.append({"role": "user", "content": content})
            return
        texts: list[str] = []
        for index, block in enumerate(_blocks(content, param)):
            where = f"{param}[{index}]"
            if block.get("type") == "tool_result":
                self.messages.append(_tool_message(block, where))
            else:
                texts.append(_block_text(block, where))
        if texts:
            self.messages.append({"role": "user", "content": "\n".join(texts)})

    def _assistant(self, content: object, param: str) -> None:
        if isinstance(content, str):
            self.messages.append({"role": "assistant", "content": content})
            return
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        for index, block in enumerate(_blocks(content, param)):
            where = f"{param}[{index}]"
            if block.get("type") == "tool_use":
                calls.append(_tool_call(block, where))
            else:
                texts.append(_block_text(block, where))
        text = "\n".join(texts)
        if not text and not calls:
            raise bad("an assistant message needs text or tool_use blocks", param)
        out: dict[str, Any] = {"role": "assistant", "content": text or None}
        if calls:
            out["tool_calls"] = calls
        self.messages.append(out)


def _blocks(content: object, param: str) -> list[Mapping[str, Any]]:
    if not isinstance(content, list) or not all(isinstance(b, Mapping) for b in content):
        raise bad("content must be a string or a list of content blocks", param)
    return list(content)


def _block_text(block: object, param: str) -> str:
    """A text block's text; any other block here is refused with the reason."""
    if not isinstance(block, Mapping):
        raise bad("a content block must be an object", param)
    kind = block.get("type")
    if kind == "text":
        text = block.get("text")
        if not isinstance(text, str):
            raise bad("a text block needs a string 'text'", param)
        return text
    if kind in ("thinking", "redacted_thinking"):
        raise bad(
            "thinking blocks cannot be replayed: this model's history is kept as the exact "
            "tokens it generated, and it generated no thinking blocks; remove them",
            param,
        )
    raise bad(f"content blocks of type {kind!r} are not supported here (text only)", param)


def _tool_call(block: Mapping[str, Any], param: str) -> dict[str, Any]:
    call_id, name, arguments = block.get("id"), block.get("name"), block.get("input", {})
    if not isinstance(call_id, str) or not call_id or not isinstance(name, str) or not name:
        raise bad("a tool_use block needs a string 'id' and 'name'", param)
    if not isinstance(arguments, Mapping):
        raise bad("a tool_use block's 'input' must be an object", param)
    text = json.dumps(arguments, ensure_ascii=False)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": text}}


def _tool_message(block: Mapping[str, Any], param: str) -> dict[str, Any]:
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str) or not call_id:
        raise bad("a tool_result block needs a string 'tool_use_id'", param)
    content = block.get("content", "")
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        text = "\n".join(_block_text(b, f"{param}.content[{i}]") for i, b in enumerate(content))
    else:
        raise bad("a tool_result's content must be a string or text blocks", param)
    is_error = block.get("is_error", False)
    if not isinstance(is_error, bool):
        raise bad("'is_error' must be a boolean", param)
    if is_error:
        text = f"Error: {text}" if text else "Error"
    return {"role": "tool", "tool_call_id": call_id, "content": text or _EMPTY_RESULT}


def _tools(tools: object) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad("'tools' must be a list", "tools")
    out = []
    for index, tool in enumerate(tools):
        param = f"tools[{index}]"
        if not isinstance(tool, Mapping):
            raise bad("a tool must be an object", param)
        kind = tool.get("type")
        if kind not in (None, "custom"):
            raise bad(
                f"server tools ({kind!r}) are not supported: only custom tools, which the "
                "client runs",
                param,
            )
        name, schema = tool.get("name"), tool.get("input_schema")
        if not isinstance(name, str) or not name:
            raise bad("a tool needs a string 'name'", param)
        if not isinstance(schema, Mapping):
            raise bad("a tool needs an 'input_schema' object", param)
        # ``$schema`` names the dialect only; structured outputs need not see it.
        parameters = {k: v for k, v in schema.items() if k != "$schema"}
        function: dict[str, Any] = {"name": name, "parameters": parameters}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out or None


def _tool_choice(choice: object) -> tuple[object, bool]:
    """Anthropic's ``tool_choice`` as chat's, and whether parallel calls are allowed."""
    if choice is None:
        return None, True
    if not isinstance(choice, Mapping):
        raise bad("'tool_choice' must be an object", "tool_choice")
    parallel = choice.get("disable_parallel_tool_use", False) is not True
    kind = choice.get("type")
    if kind == "tool":
        name = choice.get("name")
        if not isinstance(name, str) or not name:
            raise bad("tool_choice of type 'tool' needs a 'name'", "tool_choice")
        return {"type": "function", "function": {"name": name}}, parallel
    mapped = {"auto": "auto", "any": "required", "none": "none"}.get(str(kind))
    if mapped is None:
        raise bad(f"unknown tool_choice type {kind!r}: auto, any, tool or none", "tool_choice")
    return mapped, parallel


def _response_format(config: object) -> dict[str, Any] | None:
    """``output_config.format`` (a JSON schema) as chat's ``response_format``; ``effort`` has
    no counterpart here."""
    if not isinstance(config, Mapping):
        return None
    fmt = config.get("format")
    if not isinstance(fmt, Mapping):
        return None
    if fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), Mapping):
        raise bad("output_config.format must be a json_schema with a 'schema'", "output_config")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


def _sampling(body: Mapping[str, Any], chat: dict[str, Any]) -> None:
    for name in ("temperature", "top_p"):
        value = body.get(name)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise bad(f"'{name}' must be a number", name)
            chat[name] = value
    top_k = body.get("top_k")
    if top_k is not None:
        if type(top_k) is not int:
            raise bad("'top_k' must be an integer", "top_k")
        chat["top_k"] = top_k
    stops = body.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise bad("'stop_sequences' must be a list of non-empty strings", "stop_sequences")
        if stops:
            chat["stop"] = list(stops)


def _tooling(body: Mapping[str, Any], chat: dict[str, Any]) -> None:
    tools = _tools(body.get("tools"))
    choice, parallel = _tool_choice(body.get("tool_choice"))
    if tools:
        chat["tools"] = tools
        if choice is not None:
            chat["tool_choice"] = choice
        if not parallel:
            chat["parallel_tool_calls"] = False
    elif choice not in (None, "auto", "none"):
        raise bad("'tool_choice' asks for a tool but 'tools' is empty", "tool_choice")


def _generation(body: Mapping[str, Any], chat: dict[str, Any]) -> None:
    """How much and how to generate: ``max_tokens`` (required), ``stream``, sampling."""
    max_tokens = body.get("max_tokens")
    if type(max_tokens) is not int or max_tokens < 1:
        raise bad("'max_tokens' must be a positive integer", "max_tokens")
    chat["max_tokens"] = max_tokens
    if body.get("stream") is not None:
        chat["stream"] = body["stream"]
    _sampling(body, chat)


def chat_body(body: object, *, drops: SystemDrops, count_only: bool = False) -> Translated:
    """The chat completion request for a Messages request (``count_only``: for
    ``count_tokens``, which has no ``max_tokens``)."""
    if not isinstance(body, Mapping):
        raise bad("the request body must be a JSON object")
    for name, reason in _REFUSED.items():
        if body.get(name):
            raise bad(reason, name)
    ignored = sorted(str(key) for key in body if key not in _KNOWN and key not in _REFUSED)
    if ignored:
        logger.warning("agentkv.proxy.fields_ignored", fields=ignored, api="messages")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' must be a non-empty list", "messages")
    builder = _Builder(drops)
    builder.system(body.get("system"), "system")
    for index, message in enumerate(messages):
        builder.message(message, f"messages[{index}]")
    if not builder.messages or builder.messages[-1]["role"] == "assistant":
        raise bad(
            "the last message must be the user's (an assistant prefill is not supported)",
            "messages",
        )
    chat: dict[str, Any] = {"messages": builder.messages}
    if body.get("model") is not None:
        chat["model"] = body["model"]
    if not count_only:
        _generation(body, chat)
    _tooling(body, chat)
    response_format = _response_format(body.get("output_config"))
    if response_format is not None:
        chat["response_format"] = response_format
    return Translated(body=chat, dropped=tuple(builder.dropped))
