"""``POST /v1/messages`` and ``/v1/messages/count_tokens``: Anthropic's Messages API on the
same sessions and turns as chat completions.

A Messages request is translated into a chat completion request (``_messages_request``) and
served by ``ChatService`` with a ``MessagesShape`` writing the answer: one mapping onto
sessions, one turn, one history rule (``sync_history``), another answer shape. Claude Code
re-sends the whole conversation every turn, so its turns extend their session like any chat.

The session is ``X-Session-ID``, else Claude Code's own: its ``X-Claude-Code-Session-Id``
header, else the ``session_id`` in ``metadata.user_id`` (a JSON string; before Claude Code
2.1.78, ``user_<sha256>_account_<id>_session_<uuid>``). Without any, a request is a one-shot.

A failure after a stream began is Anthropic's ``error`` event, then the end of the stream; the
turn commits nothing.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Mapping
from typing import Any

from starlette.datastructures import Headers
from starlette.responses import Response, StreamingResponse

from agentkv._core import AsyncCluster, Message, Route, RoutingError, ServerRenderer, get_logger
from agentkv.proxy._chat import ChatService, json_response
from agentkv.proxy._messages_diagnosis import Diagnosis, MessageThreads, previous_message_id
from agentkv.proxy._messages_errors import error_event
from agentkv.proxy._messages_request import chat_body
from agentkv.proxy._messages_shape import MessagesShape, sse
from agentkv.proxy._messages_system import SystemDrops
from agentkv.proxy._metrics import ProxyMetrics
from agentkv.proxy._session_key import claude_code_session_id

__all__ = ["MessagesService", "body_session_id"]

logger = get_logger("agentkv")

def body_session_id(body: object) -> str | None:
    """The session Claude Code names in ``metadata.user_id`` (``_session_key`` reads its two
    forms); in the precedence of ``session_key``, after the agents' session headers.

    >>> body_session_id({"metadata": {"user_id": '{"session_id": "s2"}'}})
    's2'
    >>> body_session_id({"metadata": {"user_id": "plain-user"}}) is None
    True
    """
    metadata = body.get("metadata") if isinstance(body, Mapping) else None
    user_id = metadata.get("user_id") if isinstance(metadata, Mapping) else None
    return claude_code_session_id(user_id)


async def _with_error_event(
    chunks: AsyncIterable[str | bytes | memoryview],
) -> AsyncIterator[str | bytes | memoryview]:
    """The stream's events; a failure after they began becomes an ``error`` event."""
    try:
        async for chunk in chunks:
            yield chunk
    except Exception as exc:  # too late for a status: Anthropic's clients read this event
        yield sse(error_event(exc))


class MessagesService:
    """Serves the Messages API through a ``ChatService``."""

    def __init__(
        self,
        chat: ChatService,
        cluster: AsyncCluster,
        *,
        drops: SystemDrops,
        metrics: ProxyMetrics,
        max_messages: int = 10_000,
    ) -> None:
        """``max_messages``: how many answers' threads are kept for cache diagnostics."""
        self._chat = chat
        self._threads = MessageThreads(max_entries=max_messages)
        self._cluster = cluster
        self._drops = drops
        self._metrics = metrics

    def _translate(self, body: object, *, count_only: bool = False) -> dict[str, Any]:
        translated = chat_body(body, drops=self._drops, count_only=count_only)
        for rule in translated.dropped:
            self._metrics.system_blocks_dropped.labels(rule).inc()
        return translated.body

    async def create(
        self,
        body: object,
        *,
        principal: str,
        headers: Headers,
        started: float,
        route: Route | None = None,
    ) -> Response:
        chat = self._translate(body)
        named = body_session_id(body)
        if named is not None:
            # The chat request's own session field: the session key's precedence puts it after
            # X-Session-ID and X-Claude-Code-Session-Id, and subagents' agent ids still apply.
            chat["session_id"] = named
        previous = previous_message_id(headers.get("anthropic-beta"), body)
        diagnosis = (
            None
            if previous is None
            else Diagnosis(previous_thread=self._threads.thread(principal, previous))
        )

        def remember(message_id: str, session_id: str) -> None:
            self._threads.remember(principal, message_id, session_id)

        response = await self._chat.complete(
            chat,
            principal=principal,
            session_header=None,
            headers=headers,
            started=started,
            shape=MessagesShape(model=self._cluster.model, diagnosis=diagnosis, remember=remember),
            route=route,
        )
        if isinstance(response, StreamingResponse):
            response.body_iterator = _with_error_event(response.body_iterator)
        return response

    async def count_tokens(self, body: object) -> Response:
        """``{"input_tokens": N}``: the prompt a first turn of this request would send, as the
        turn renders it (tools described in the system message where the backend has no tool
        parser)."""
        _, plan = await self._chat.plan(self._translate(body, count_only=True))
        tokens = await self._render(plan.messages, tools=plan.tools)
        return json_response({"input_tokens": tokens})

    async def _render(
        self, messages: tuple[Message, ...], *, tools: tuple[Mapping[str, Any], ...] | None
    ) -> int:
        healthy = [p for p in self._cluster.pairs if self._cluster.is_healthy(p.name)]
        if not healthy:
            raise RoutingError("no healthy pair to count tokens with")
        renderer = ServerRenderer(
            self._cluster.poster, healthy[0].prefill, model=self._cluster.model
        )
        ids = await renderer.render(messages, tools=tools, add_generation_prompt=True)
        return len(ids)
