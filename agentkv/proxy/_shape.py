"""OpenAI response bodies and stream chunks built from a ``TurnResult``; session stats as JSON.

``usage.prompt_tokens_details.cached_tokens`` is the prefill server's own count of prompt tokens
it did not compute (its local prefix cache plus what it pulled from decode): the reuse the turn
really had. The decode server's count would say nearly every token was cached, because KV it
received from prefill counts as a hit there.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Any

from agentkv._core import HandleState, Message, TurnResult, TurnStats

__all__ = [
    "HEADER_FORKED",
    "HEADER_HANDLE",
    "HEADER_MAX_TOKENS_CLAMPED",
    "HEADER_PAIR",
    "HEADER_SESSION",
    "HEADER_THREAD",
    "HEADER_TOOLS_DROPPED",
    "Completion",
    "turn_stats_json",
]

HEADER_PAIR = "X-AgentKV-Pair"
HEADER_HANDLE = "X-AgentKV-Handle"
HEADER_FORKED = "X-AgentKV-Forked"
HEADER_SESSION = "X-AgentKV-Session-ID"
# The thread of its session a request ran on (``_threads``): main, agent:<id>, start:<digest>.
HEADER_THREAD = "X-AgentKV-Thread"
# The types of tools a Responses request sent that the proxy dropped (``web_search,namespace``).
HEADER_TOOLS_DROPPED = "X-AgentKV-Tools-Dropped"
# ``<asked>-><given>``: the request's max_tokens was above what its prompt left of the context.
HEADER_MAX_TOKENS_CLAMPED = "X-AgentKV-Max-Tokens-Clamped"


def _message(message: Message) -> dict[str, Any]:
    out: dict[str, Any] = {
        "role": "assistant",
        "content": message.content if message.content or not message.tool_calls else None,
        "refusal": None,
    }
    if message.tool_calls:
        out["tool_calls"] = [call.to_openai() for call in message.tool_calls]
    return out


def _usage(stats: TurnStats) -> dict[str, Any]:
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.generated_tokens,
        "total_tokens": stats.prompt_tokens + stats.generated_tokens,
        "prompt_tokens_details": {"cached_tokens": stats.reused_tokens},
    }


class Completion:
    """One completion's identity (id, model, creation time) and the bodies that carry it."""

    __slots__ = ("created", "id", "model")

    def __init__(self, *, model: str) -> None:
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.model = model
        self.created = int(time.time())

    def body(
        self,
        result: TurnResult,
        *,
        message: Message | None = None,
        finish_reason: str | None = None,
    ) -> dict[str, Any]:
        """The ``chat.completion`` object of a finished turn (``message`` and ``finish_reason``
        replace the result's when the proxy translated its tool calls)."""
        return {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": [
                {
                    "index": 0,
                    "message": _message(message or result.message),
                    "logprobs": None,
                    "finish_reason": finish_reason or result.finish_reason,
                }
            ],
            "usage": _usage(result.stats),
            "system_fingerprint": None,
        }

    def chunk(self, delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
        """A ``chat.completion.chunk`` carrying ``delta``."""
        return {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [
                {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            ],
        }

    def final_chunks(
        self,
        result: TurnResult,
        *,
        include_usage: bool,
        message: Message | None = None,
        finish_reason: str | None = None,
    ) -> list[dict[str, Any]]:
        """The chunks after the text: the held-back answer of a translated reply (``message``),
        tool calls (one delta each, whole), the finish, the usage."""
        chunks = []
        if message is not None and message.content:
            chunks.append(self.chunk({"content": message.content}))
        calls = (message or result.message).tool_calls
        if calls:
            deltas = [{"index": index, **call.to_openai()} for index, call in enumerate(calls)]
            chunks.append(self.chunk({"tool_calls": deltas}))
        chunks.append(self.chunk({}, finish_reason or result.finish_reason))
        if include_usage:
            chunks.append(
                {
                    "id": self.id,
                    "object": "chat.completion.chunk",
                    "created": self.created,
                    "model": self.model,
                    "choices": [],
                    "usage": _usage(result.stats),
                }
            )
        return chunks


def turn_stats_json(stats: TurnStats) -> dict[str, Any]:
    """A turn's stats as JSON (``GET /v1/sessions/{id}``)."""
    out = dataclasses.asdict(stats)
    out["handle_state"] = HandleState(stats.handle_state).value
    out["reuse_ratio"] = stats.reuse_ratio
    return out
