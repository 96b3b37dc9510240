"""A turn's answer in the Responses API's shapes: a ``response`` object, or its stream events.

``usage.input_tokens_details.cached_tokens`` is prefill's own count of prompt tokens it did not
compute, as in chat completions (``_shape``).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from agentkv._core import HistoryPlan, Message, TurnResult, TurnStats, dumps
from agentkv.proxy._entry import SessionEntry
from agentkv.proxy._tools import ToolPlan

__all__ = ["Mint", "OnAnswer", "ResponsesShape"]

# Called once the turn committed: the response id, the session (``None``: one-shot), the plan
# the request's tools were served with.
OnAnswer = Callable[[str, SessionEntry | None, ToolPlan], Awaitable[None]]
# The response's id, once its session is known (``None``: one-shot).
Mint = Callable[[str | None], str]


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

    ``on_answer`` learns of the answer once its turn has committed (the store keeps it);
    ``mint`` makes the response's id once ``bind`` names its session.
    """

    def __init__(
        self,
        *,
        model: str,
        body: Mapping[str, Any],
        principal: str,
        instructions: str | None,
        on_answer: OnAnswer | None,
        mint: Mint,
    ) -> None:
        self._mint = mint
        self.id = mint(None)
        self._message_id = f"msg_{uuid.uuid4().hex}"
        self._created = time.time()
        self._model = model
        self._body = body
        self._principal = principal
        self._instructions = instructions
        self._on_answer = on_answer
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

    def bind(self, session_id: str | None, *, plan: HistoryPlan | None = None) -> None:
        del plan
        self.id = self._mint(session_id)

    async def answered(self, *, entry: SessionEntry | None, tools: ToolPlan) -> None:
        if self._on_answer is not None:
            await self._on_answer(self.id, entry, tools)
