"""A turn's answer in Anthropic's Messages shapes: a ``message`` object, or its stream events.

``usage.cache_read_input_tokens`` is prefill's own count of prompt tokens it did not compute
(what the turn reused, ``TurnStats.reused_tokens``) and ``input_tokens`` the rest, so their sum
is the prompt, as Anthropic defines it; nothing is written to a cache on request here, so
``cache_creation_input_tokens`` is 0. Tool calls are ``tool_use`` blocks under the ids the turn
gave them (the client echoes them back in ``tool_result`` blocks).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import Any

from agentkv._core import HistoryPlan, Message, TurnResult, TurnStats, dumps
from agentkv.proxy._entry import SessionEntry
from agentkv.proxy._messages_diagnosis import Diagnosis
from agentkv.proxy._tools import ToolPlan

__all__ = ["MessagesShape", "sse", "stop_reason"]


def sse(event: dict[str, Any]) -> bytes:
    """One Anthropic stream event: its ``event:`` line names its type."""
    return b"event: " + str(event["type"]).encode() + b"\ndata: " + dumps(event) + b"\n\n"


def stop_reason(result: TurnResult, message: Message, finish: str) -> tuple[str, str | None]:
    """Anthropic's ``stop_reason`` and ``stop_sequence`` for a turn's chat finish reason."""
    if finish == "length":
        return "max_tokens", None
    if message.tool_calls or finish == "tool_calls":
        return "tool_use", None
    if result.stop_sequence is not None:
        return "stop_sequence", result.stop_sequence
    return "end_turn", None


def _usage(stats: TurnStats | None) -> dict[str, int]:
    if stats is None:
        return {
            "input_tokens": 0,
            "output_tokens": 0,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
        }
    return {
        "input_tokens": stats.prompt_tokens - stats.reused_tokens,
        "output_tokens": stats.generated_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": stats.reused_tokens,
    }


def _input(arguments: str) -> dict[str, Any]:
    try:
        data = json.loads(arguments)
    except json.JSONDecodeError:
        data = None
    # A model's arguments that are no JSON object cannot be a tool_use input; shown whole.
    return data if isinstance(data, dict) else {"arguments": arguments}


def _content(message: Message) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if message.content:
        blocks.append({"type": "text", "text": message.content})
    blocks += [
        {"type": "tool_use", "id": call.id, "name": call.name, "input": _input(call.arguments)}
        for call in message.tool_calls
    ]
    return blocks


class MessagesShape:
    """``message`` bodies and Anthropic's stream events (``ChatService``'s ``AnswerShape``)."""

    def __init__(
        self,
        *,
        model: str,
        diagnosis: Diagnosis | None = None,
        remember: Callable[[str, str], None] | None = None,
    ) -> None:
        """``diagnosis``: the request asked for cache diagnostics (``_messages_diagnosis``);
        ``remember(message id, session id)`` is told which session answered, once committed."""
        self.id = f"msg_{uuid.uuid4().hex}"
        self._model = model
        self._index = 0
        self._text_open = False
        self._diagnosis = diagnosis
        self._remember = remember
        self._session_id: str | None = None
        self._plan: HistoryPlan | None = None

    def _message(
        self,
        content: list[dict[str, Any]],
        reason: tuple[str | None, str | None],
        stats: TurnStats | None,
    ) -> dict[str, Any]:
        message: dict[str, Any] = {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self._model,
            "content": content,
            "stop_reason": reason[0],
            "stop_sequence": reason[1],
            "usage": _usage(stats),
        }
        if self._diagnosis is not None:
            message["diagnostics"] = self._diagnosis.answer(
                self._session_id,
                self._plan,
                prompt_tokens=stats.prompt_tokens if stats is not None else None,
            )
        return message

    def body(self, result: TurnResult, *, message: Message, finish: str) -> dict[str, Any]:
        reason = stop_reason(result, message, finish)
        return self._message(_content(message), reason, result.stats)

    # --- the stream ---------------------------------------------------------------------------

    def opening(self) -> list[bytes]:
        start = {"type": "message_start", "message": self._message([], (None, None), None)}
        return [sse(start), sse({"type": "ping"})]

    def delta(self, text: str) -> bytes:
        if not text:
            return b""
        events = b""
        if not self._text_open:
            self._text_open = True
            events += sse(
                {
                    "type": "content_block_start",
                    "index": self._index,
                    "content_block": {"type": "text", "text": ""},
                }
            )
        delta = {"type": "text_delta", "text": text}
        return events + sse({"type": "content_block_delta", "index": self._index, "delta": delta})

    def _stop_block(self) -> bytes:
        event = sse({"type": "content_block_stop", "index": self._index})
        self._index += 1
        return event

    def closing(
        self,
        result: TurnResult,
        *,
        message: Message,
        finish: str,
        translated: bool,
        include_usage: bool,
    ) -> list[bytes]:
        del include_usage  # an Anthropic stream always says its usage
        events: list[bytes] = []
        if translated and message.content:
            events.append(self.delta(message.content))
        if self._text_open:
            events.append(self._stop_block())
        for call in message.tool_calls:
            block = {"type": "tool_use", "id": call.id, "name": call.name, "input": {}}
            arguments = dumps(_input(call.arguments)).decode()
            events += [
                sse({"type": "content_block_start", "index": self._index, "content_block": block}),
                sse(
                    {
                        "type": "content_block_delta",
                        "index": self._index,
                        "delta": {"type": "input_json_delta", "partial_json": arguments},
                    }
                ),
                self._stop_block(),
            ]
        reason, sequence = stop_reason(result, message, finish)
        delta = {"stop_reason": reason, "stop_sequence": sequence}
        events += [
            sse({"type": "message_delta", "delta": delta, "usage": _usage(result.stats)}),
            sse({"type": "message_stop"}),
        ]
        return events

    def bind(self, session_id: str | None, *, plan: HistoryPlan | None = None) -> None:
        self._session_id = session_id
        self._plan = plan

    async def answered(self, *, entry: SessionEntry | None, tools: ToolPlan) -> None:
        del tools
        if entry is not None and self._remember is not None:
            self._remember(self.id, entry.session_id)
