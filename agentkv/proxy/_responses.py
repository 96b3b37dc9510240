"""``POST /v1/responses``: the Responses API, on the same sessions and turns as chat completions.

A Responses request is translated into a chat completion request (``instructions`` and ``input``
items become messages, function tools become chat tools) and served by ``ChatService`` with a
``ResponsesShape`` writing the answer: one mapping onto sessions, one turn, two answer shapes.

* ``previous_response_id`` continues the conversation without the client re-sending it: the
  proxy kept the response's history (the messages it was the answer to, then the answer as the
  client saw it), so the request becomes that history plus the new items, on the response's own
  session, an exact extension of its token-exact transcript. A stored response outlives neither
  its session (idle expiry, ``DELETE``) nor the store's bound; asking for one that is gone is an
  error (404 unknown, 400 expired), never a silent restart.
* ``store: false``, or no ``previous_response_id``: the client re-sends the history as input
  items, matched onto the session named by ``X-Session-ID`` / ``conversation_id`` /
  ``prompt_cache_key`` as chat completions are. A stored response without such a key gets a
  session of its own (``resp-...``), which is what ``previous_response_id`` continues.
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from starlette.responses import Response

from agentkv._json import dumps
from agentkv._types import Message, TurnResult, TurnStats
from agentkv.proxy._chat import ChatService
from agentkv.proxy._errors import ProxyError
from agentkv.proxy._registry import SessionRegistry
from agentkv.proxy._request import ChatRequest

__all__ = ["ResponseStore", "ResponsesService", "ResponsesShape"]

# Responses fields with a chat completion counterpart of another name, or none.
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
    }
)
_REFUSED = {
    "background": "background responses are not supported",
    "conversation": "the Conversations API is not supported; use previous_response_id",
    "prompt": "prompt templates are not supported",
    "top_logprobs": "logprobs are not supported by the proxy",
}


def _bad(message: str, param: str | None = None, code: str = "invalid_value") -> ProxyError:
    return ProxyError(400, message, code=code, param=param)


def _text(content: object, param: str) -> str:
    """The text of a message's content: a string, or a list of text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad("content must be a string or a list of content parts", param)
    texts = []
    for part in content:
        if not isinstance(part, Mapping) or part.get("type") not in (
            "input_text",
            "output_text",
            "text",
        ):
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            raise _bad(f"content parts of type {kind!r} are not supported", param)
        texts.append(str(part.get("text", "")))
    return "".join(texts)


def input_messages(items: object) -> list[dict[str, Any]]:
    """``input`` as chat messages: function calls join the assistant message they follow."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise _bad("'input' must be a string or a list of items", "input")
    out: list[dict[str, Any]] = []
    for index, item in enumerate(items):
        param = f"input[{index}]"
        if not isinstance(item, Mapping):
            raise _bad("an input item must be an object", param)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise _bad(f"unknown role {role!r}", f"{param}.role")
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
            raise _bad(f"input items of type {kind!r} are not supported", f"{param}.type")
    return out


def _chat_tools(tools: object) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise _bad("'tools' must be a list", "tools")
    out = []
    for index, tool in enumerate(tools):
        if not isinstance(tool, Mapping) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, Mapping) else None
            raise _bad(f"tools of type {kind!r} are not supported", f"tools[{index}]")
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
    raise _bad(f"tool_choice {choice!r} is not supported", "tool_choice")


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
    raise _bad(f"text.format {fmt.get('type')!r} is not supported", "text.format")


@dataclass(frozen=True, kw_only=True, slots=True)
class StoredResponse:
    """A stored response: whose it is, its session, and the history it ends."""

    principal: str
    session_id: str
    instructions: str | None
    messages: tuple[Message, ...]


class ResponseStore:
    """Stored responses by id, the most recent ``max_entries`` (scoped by principal)."""

    def __init__(self, *, max_entries: int) -> None:
        self._max = max_entries
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response_id: str, entry: StoredResponse) -> None:
        self._entries[response_id] = entry
        while len(self._entries) > self._max:
            self._entries.popitem(last=False)

    def get(self, principal: str, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        return entry if entry is not None and entry.principal == principal else None


def _usage(stats: TurnStats) -> dict[str, Any]:
    return {
        "input_tokens": stats.prompt_tokens,
        "input_tokens_details": {"cached_tokens": stats.reused_tokens},
        "output_tokens": stats.generated_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": stats.prompt_tokens + stats.generated_tokens,
    }


def _sse(event: dict[str, Any]) -> bytes:
    return b"event: " + str(event["type"]).encode() + b"\ndata: " + dumps(event) + b"\n\n"


class ResponsesShape:
    """A turn's answer as a ``response`` object, or as the Responses API's stream events.

    Also stores the response (``store``) once its turn has committed.
    """

    def __init__(
        self,
        *,
        model: str,
        body: Mapping[str, Any],
        principal: str,
        instructions: str | None,
        store: ResponseStore | None,
    ) -> None:
        self.id = f"resp_{uuid.uuid4().hex}"
        self._message_id = f"msg_{uuid.uuid4().hex}"
        self._created = time.time()
        self._model = model
        self._body = body
        self._principal = principal
        self._instructions = instructions
        self._store = store
        self._sequence = 0
        self._text: list[str] = []
        self._opened = False

    # --- the response object ------------------------------------------------------------------

    def _output(self, message: Message, *, status: str = "completed") -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = []
        if message.content:
            items.append(self._message_item(message.content, status=status))
        for call in message.tool_calls:
            items.append(
                {
                    "type": "function_call",
                    "id": f"fc_{call.id}",
                    "call_id": call.id,
                    "name": call.name,
                    "arguments": call.arguments,
                    "status": status,
                }
            )
        return items

    def _message_item(self, text: str | None, *, status: str) -> dict[str, Any]:
        content = [] if text is None else [self._text_part(text)]
        return {
            "type": "message",
            "id": self._message_id,
            "status": status,
            "role": "assistant",
            "content": content,
        }

    @staticmethod
    def _text_part(text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def _response(
        self,
        *,
        status: str,
        output: list[dict[str, Any]],
        usage: dict[str, Any] | None,
        finish: str | None = None,
    ) -> dict[str, Any]:
        body = self._body
        incomplete = status == "completed" and finish == "length"
        return {
            "id": self.id,
            "object": "response",
            "created_at": self._created,
            "status": "incomplete" if incomplete else status,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "error": None,
            "model": self._model,
            "instructions": self._instructions,
            "output": output,
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "tool_choice": body.get("tool_choice", "auto"),
            "tools": body.get("tools") or [],
            "temperature": body.get("temperature"),
            "top_p": body.get("top_p"),
            "max_output_tokens": body.get("max_output_tokens"),
            "previous_response_id": body.get("previous_response_id"),
            "store": body.get("store", True) is not False,
            "text": body.get("text") or {"format": {"type": "text"}},
            "truncation": body.get("truncation", "disabled"),
            "metadata": body.get("metadata") or {},
            "usage": usage,
        }

    def body(self, result: TurnResult, *, message: Message, finish: str) -> dict[str, Any]:
        return self._response(
            status="completed",
            output=self._output(message),
            usage=_usage(result.stats),
            finish=finish,
        )

    # --- the stream ---------------------------------------------------------------------------

    def _event(self, kind: str, **fields: Any) -> bytes:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return _sse(event)

    def opening(self) -> list[bytes]:
        snapshot = self._response(status="in_progress", output=[], usage=None)
        return [
            self._event("response.created", response=snapshot),
            self._event("response.in_progress", response=snapshot),
        ]

    def _open_message(self) -> list[bytes]:
        self._opened = True
        return [
            self._event(
                "response.output_item.added",
                output_index=0,
                item=self._message_item(None, status="in_progress"),
            ),
            self._event(
                "response.content_part.added",
                item_id=self._message_id,
                output_index=0,
                content_index=0,
                part=self._text_part(""),
            ),
        ]

    def _text_delta(self, text: str) -> list[bytes]:
        events = [] if self._opened else self._open_message()
        self._text.append(text)
        events.append(
            self._event(
                "response.output_text.delta",
                item_id=self._message_id,
                output_index=0,
                content_index=0,
                delta=text,
                logprobs=[],
            )
        )
        return events

    def delta(self, text: str) -> bytes:
        return b"".join(self._text_delta(text))

    def closing(
        self,
        result: TurnResult,
        *,
        message: Message,
        finish: str,
        translated: bool,
        include_usage: bool,
    ) -> list[bytes]:
        del include_usage  # a response always carries its usage
        events: list[bytes] = []
        if translated and message.content:
            events += self._text_delta(message.content)
        index = 0
        if self._opened:
            text = "".join(self._text)
            events += [
                self._event(
                    "response.output_text.done",
                    item_id=self._message_id,
                    output_index=0,
                    content_index=0,
                    text=text,
                    logprobs=[],
                ),
                self._event(
                    "response.content_part.done",
                    item_id=self._message_id,
                    output_index=0,
                    content_index=0,
                    part=self._text_part(text),
                ),
                self._event(
                    "response.output_item.done",
                    output_index=0,
                    item=self._message_item(text, status="completed"),
                ),
            ]
            index = 1
        output = self._output(message)
        for offset, item in enumerate(i for i in output if i["type"] == "function_call"):
            at = index + offset
            events += [
                self._event(
                    "response.output_item.added",
                    output_index=at,
                    item={**item, "arguments": "", "status": "in_progress"},
                ),
                self._event(
                    "response.function_call_arguments.delta",
                    item_id=item["id"],
                    output_index=at,
                    delta=item["arguments"],
                ),
                self._event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=at,
                    arguments=item["arguments"],
                ),
                self._event("response.output_item.done", output_index=at, item=item),
            ]
        final = self._response(
            status="completed", output=output, usage=_usage(result.stats), finish=finish
        )
        events.append(self._event("response.completed", response=final))
        return events

    def answered(self, request: ChatRequest, message: Message, *, session_id: str | None) -> None:
        if self._store is None or session_id is None:
            return
        self._store.put(
            self.id,
            StoredResponse(
                principal=self._principal,
                session_id=session_id,
                instructions=self._instructions,
                messages=(*request.messages, message),
            ),
        )


class ResponsesService:
    """Serves ``POST /v1/responses`` through a ``ChatService``."""

    def __init__(
        self, chat: ChatService, registry: SessionRegistry, *, model: str, max_entries: int
    ) -> None:
        self._chat = chat
        self._registry = registry
        self._model = model
        self.store = ResponseStore(max_entries=max_entries)

    async def _history(self, principal: str, response_id: object) -> StoredResponse:
        if not isinstance(response_id, str) or not response_id:
            raise _bad("'previous_response_id' must be a string", "previous_response_id")
        stored = self.store.get(principal, response_id)
        if stored is None:
            raise ProxyError(
                404,
                f"Previous response with id '{response_id}' not found.",
                code="previous_response_not_found",
                param="previous_response_id",
            )
        if await self._registry.lookup(principal, stored.session_id) is None:
            raise _bad(
                f"Previous response with id '{response_id}' has expired: its session was "
                "closed (idle expiry or deleted); send the whole conversation instead",
                "previous_response_id",
                code="previous_response_expired",
            )
        return stored

    async def create(
        self, body: object, *, principal: str, session_header: str | None, started: float
    ) -> Response:
        if not isinstance(body, dict):
            raise _bad("the request body must be a JSON object")
        for name, reason in _REFUSED.items():
            if body.get(name):
                raise _bad(reason, name, code="unsupported_parameter")
        instructions = body.get("instructions")
        if instructions is not None and not isinstance(instructions, str):
            raise _bad("'instructions' must be a string", "instructions")
        store = body.get("store", True) is not False
        history: Sequence[dict[str, Any]] = []
        previous = body.get("previous_response_id")
        if previous is not None:
            stored = await self._history(principal, previous)
            kept = stored.messages[1:] if stored.instructions is not None else stored.messages
            history = [message.to_openai() for message in kept]
            session_header = stored.session_id
        messages = [
            *([{"role": "system", "content": instructions}] if instructions else []),
            *history,
            *input_messages(body.get("input")),
        ]
        chat: dict[str, Any] = {
            _RENAMED[key] if key in _RENAMED else str(key): value
            for key, value in body.items()
            if key not in _DROPPED and key not in _REFUSED
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
        has_key = session_header is not None or any(
            chat.get(key) for key in ("conversation_id", "session_id", "prompt_cache_key")
        )
        if store and not has_key:
            # A stored response must be continuable: it gets a session of its own.
            session_header = f"resp-{uuid.uuid4().hex}"
        shape = ResponsesShape(
            model=self._model,
            body=body,
            principal=principal,
            instructions=instructions,
            store=self.store if store else None,
        )
        return await self._chat.complete(
            chat,
            principal=principal,
            session_header=session_header,
            started=started,
            shape=shape,
        )
