"""OpenAI tool calling through the proxy, on any backend: the server's parser, or agentkv's JSON.

Decided once per served model (``ToolModes``):

* ``native``: the backend parses tool calls (``--enable-auto-tool-choice --tool-call-parser``):
  ``tools`` and ``tool_choice`` pass through, and its ``tool_calls`` come back as they are.
* ``json``: the backend has no parser (the local pair: SmolLM2's template has no tool syntax).
  The proxy uses agentkv's structured-output protocol (``JsonToolCalling``): the tools are
  described in the system message, decoding is constrained to a JSON list of calls (plus
  ``final_answer``, the text answer, under ``tool_choice: "auto"``), and the reply is
  translated into ``message.tool_calls``. The session keeps the JSON the model generated as its
  exact tokens; the client's echo of the translated message is matched to it (``views``), so a
  tool loop extends the session like any chat.

``auto`` (the default) probes the backend once: a one-token ``tool_choice: "auto"`` request to a
prefill server; vLLM's 400 for a missing parser means ``json``.

Every step of the translation is deterministic, so the messages of turn N+1 render to an
extension of turn N's tokens.
"""

from __future__ import annotations

import asyncio
import enum
import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from agentkv._core import (
    AUTO,
    NONE,
    REQUIRED,
    AsyncCluster,
    BadRequestError,
    JsonToolCalling,
    Message,
    ToolCall,
    ToolDefinitionError,
    ToolSpec,
    TurnResult,
    get_logger,
    post_json,
)
from agentkv.proxy._errors import ProxyError

__all__ = ["ToolMode", "ToolModes", "ToolPlan", "plan_tools", "shown_messages"]

logger = get_logger("agentkv")

HEADER_TOOL_CALLING = "X-AgentKV-Tool-Calling"


class ToolMode(enum.StrEnum):
    NATIVE = "native"
    JSON = "json"


class ToolModes:
    """The tool-calling mode of the served model: configured, or probed once and kept."""

    def __init__(self, cluster: AsyncCluster, *, configured: str = "auto") -> None:
        self._cluster = cluster
        self._mode = None if configured == "auto" else ToolMode(configured)
        self._lock = asyncio.Lock()

    @property
    def known(self) -> ToolMode | None:
        return self._mode

    async def mode(self) -> ToolMode:
        if self._mode is not None:
            return self._mode
        async with self._lock:
            if self._mode is None:
                self._mode = await self._probe()
                logger.info("agentkv.proxy.tool_calling", mode=self._mode.value)
            return self._mode

    async def _probe(self) -> ToolMode:
        pair = self._cluster.pairs[0]
        body = {
            "model": self._cluster.model,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 1,
            "tools": [{"type": "function", "function": {"name": "probe", "parameters": {}}}],
            "tool_choice": "auto",
        }
        try:
            await post_json(
                self._cluster.poster,
                pair.prefill + "/v1/chat/completions",
                json.dumps(body).encode(),
                summary="tool parser probe",
            )
        except BadRequestError:
            # vLLM: '"auto" tool choice requires --enable-auto-tool-choice and
            # --tool-call-parser to be set'.
            return ToolMode.JSON
        return ToolMode.NATIVE


def _bad(message: str, param: str) -> ProxyError:
    return ProxyError(400, message, code="invalid_value", param=param)


def _specs(tools: Sequence[Mapping[str, Any]]) -> list[ToolSpec]:
    specs = []
    for tool in tools:
        function = tool.get("function")
        if tool.get("type", "function") != "function" or not isinstance(function, Mapping):
            raise _bad("only function tools are supported", "tools")
        try:
            specs.append(
                ToolSpec(
                    name=str(function.get("name") or ""),
                    description=str(function.get("description") or ""),
                    parameters=function.get("parameters") or {"type": "object"},
                )
            )
        except ToolDefinitionError as exc:
            raise _bad(str(exc), "tools") from exc
    return specs


def _choice(tool_choice: Any, names: Sequence[str]) -> str:
    """OpenAI's ``tool_choice`` as a ``JsonToolCalling`` choice."""
    if tool_choice in (None, "auto"):
        return AUTO
    if tool_choice in ("none", "required"):
        return NONE if tool_choice == "none" else REQUIRED
    function = tool_choice.get("function") if isinstance(tool_choice, Mapping) else None
    name = function.get("name") if isinstance(function, Mapping) else None
    if not isinstance(name, str) or name not in names:
        raise _bad("'tool_choice' names no tool in 'tools'", "tool_choice")
    return name


def _arguments_text(arguments: str) -> str:
    try:
        data = json.loads(arguments)
    except json.JSONDecodeError:
        return arguments
    if not isinstance(data, dict):
        return arguments
    return ", ".join(f"{k}={json.dumps(v, ensure_ascii=False)}" for k, v in data.items())


@dataclass(frozen=True, kw_only=True, slots=True)
class ToolPlan:
    """How one request's tools are served: the session's messages and the turn's settings.

    ``messages`` are what the session holds (in ``json`` mode: the tools described in the
    system message, tool results naming their call); ``tools``/``tool_choice``/``extra`` go to
    the turn. ``answer`` turns the model's reply into what the client sees. ``described``: how
    long the tools' description in the first message is (0: none; ``shown_messages`` undoes it).
    """

    mode: ToolMode | None
    messages: tuple[Message, ...]
    tools: tuple[Mapping[str, Any], ...] | None
    tool_choice: Any
    extra: Mapping[str, Any] = field(default_factory=dict)
    protocol: JsonToolCalling | None = None
    described: int = 0

    def answer(self, result: TurnResult) -> tuple[Message, str]:
        """The assistant message and finish reason the client gets for ``result``."""
        if self.protocol is None:
            return result.message, result.finish_reason
        reply = self.protocol.parse(result)
        if reply.error is not None:
            logger.warning(
                "agentkv.proxy.tool_reply_unreadable",
                reason=str(reply.error),
                finish_reason=result.finish_reason,
                generated_tokens=len(result.token_ids),
                text=result.text[:500],
            )
            return result.message, result.finish_reason  # not a call: show the model's text
        calls = tuple(
            ToolCall(id=f"call_{uuid.uuid4().hex[:24]}", name=c.name, arguments=c.arguments)
            for c in reply.calls
        )
        message = Message.assistant(reply.answer if reply.answer else None, tool_calls=calls)
        return message, "tool_calls" if calls else "stop"


def _describe(messages: Sequence[Message], instructions: str) -> list[Message]:
    """The tools described in the system message (the first message; one is added if none)."""
    out = list(messages)
    if out and out[0].role == "system" and isinstance(out[0].content, str):
        out[0] = Message.system(f"{out[0].content}\n\n{instructions}")
    else:
        out.insert(0, Message.system(instructions))
    return out


def _name_results(messages: list[Message]) -> list[Message]:
    """Tool results say which call they answer, as ``JsonToolCalling`` writes them."""
    calls: dict[str, ToolCall] = {}
    out = []
    for message in messages:
        for call in message.tool_calls:
            calls[call.id] = call
        answered = calls.get(message.tool_call_id or "") if message.role == "tool" else None
        if answered is not None and isinstance(message.content, str):
            text = f"{_result_note(answered)}{message.content}"
            out.append(Message.tool(text, tool_call_id=answered.id))
        else:
            out.append(message)
    return out


def plan_tools(
    *,
    mode: ToolMode | None,
    messages: Sequence[Message],
    tools: Sequence[Mapping[str, Any]] | None,
    tool_choice: Any,
    parallel_tool_calls: bool,
    extra: Mapping[str, Any],
) -> ToolPlan:
    """Plan a request's tool calling (``mode`` is ``None`` when the request has no tools)."""
    if not tools or mode is not ToolMode.JSON:
        return ToolPlan(
            mode=mode if tools else None,
            messages=tuple(messages),
            tools=tuple(tools) if tools else None,
            tool_choice=tool_choice,
            extra=extra,
        )
    if "structured_outputs" in extra or "response_format" in extra:
        raise _bad(
            "this model's tools use structured outputs: 'response_format' and "
            "'structured_outputs' cannot be combined with 'tools'",
            "response_format",
        )
    specs = _specs(tools)
    protocol = JsonToolCalling(max_calls=4 if parallel_tool_calls else 1)
    choice = _choice(tool_choice, [s.name for s in specs])
    try:
        options = protocol.turn_options(specs, choice=choice)
    except (ToolDefinitionError, ValueError) as exc:
        raise _bad(str(exc), "tools") from exc
    description = protocol.instructions(specs)
    session_messages = _name_results(_describe(messages, description))
    return ToolPlan(
        mode=mode,
        messages=tuple(session_messages),
        tools=None,
        tool_choice=None,
        extra={**extra, **options.get("extra_body", {})},
        protocol=None if choice == NONE else protocol,
        described=len(description),
    )


def _result_note(call: ToolCall) -> str:
    return f"{call.name}({_arguments_text(call.arguments)}) returned: "


def shown_messages(messages: Sequence[Message], *, described: int) -> list[Message]:
    """The messages a client sent, from those its request's ``ToolPlan`` made (its generated
    messages as the client was shown them): ``_describe`` and ``_name_results`` undone.

    ``described`` is the plan's: 0 when nothing was rewritten. Exact, since both rewrites are:
    the description is the first message's last ``described`` characters (after a blank line,
    or the whole message when it was added), and a tool result that answers a call the messages
    hold starts with ``_result_note`` of that call, whose text depends only on the call.
    """
    if not described:
        return list(messages)
    out = list(messages)
    first = out[0] if out else None
    if first is not None and first.role == "system" and isinstance(first.content, str):
        if len(first.content) == described:
            del out[0]
        else:
            out[0] = Message.system(first.content[: -(described + 2)])
    calls: dict[str, ToolCall] = {}
    for index, message in enumerate(out):
        for call in message.tool_calls:
            calls[call.id] = call
        answered = calls.get(message.tool_call_id or "") if message.role == "tool" else None
        if answered is not None and isinstance(message.content, str):
            note = _result_note(answered)
            if message.content.startswith(note):
                out[index] = Message.tool(message.content[len(note) :], tool_call_id=answered.id)
    return out
