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

import uuid
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from starlette.responses import Response

from agentkv._core import Message, Route
from agentkv.proxy._chat import ChatService
from agentkv.proxy._errors import ProxyError
from agentkv.proxy._registry import SessionRegistry
from agentkv.proxy._request import ChatRequest
from agentkv.proxy._responses_request import REFUSED, bad, chat_body
from agentkv.proxy._responses_shape import OnAnswer, ResponsesShape

__all__ = ["ResponseStore", "ResponsesService", "StoredResponse"]


@dataclass(frozen=True, kw_only=True, slots=True)
class StoredResponse:
    """A stored response: whose it is, its session, and the history it ends."""

    principal: str
    session_id: str
    instructions: str | None
    messages: tuple[Message, ...]


class ResponseStore:
    """Stored responses by id, at most ``max_entries`` (scoped by principal).

    When full, a principal holding at least an equal share gives up its own oldest response,
    and any other takes the place of the oldest response of the principal holding the most:
    one key's traffic never pushes out another key's stored responses while it holds
    more of them (as the session registry shares its places, ``_fair``)."""

    def __init__(self, *, max_entries: int) -> None:
        self._max = max_entries
        self._entries: dict[str, StoredResponse] = {}
        self._owned: dict[str, OrderedDict[str, None]] = {}  # principal -> ids, oldest first

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response_id: str, entry: StoredResponse) -> None:
        self._entries[response_id] = entry
        self._owned.setdefault(entry.principal, OrderedDict())[response_id] = None
        while len(self._entries) > self._max:
            principal = entry.principal
            if len(self._owned[principal]) * len(self._owned) < self._max:
                # Under its share: the largest holder gives one up (only when one is full).
                principal = max(self._owned, key=lambda p: len(self._owned[p]))
            owned = self._owned[principal]
            oldest, _ = owned.popitem(last=False)
            del self._entries[oldest]
            if not owned:
                del self._owned[principal]

    def get(self, principal: str, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        return entry if entry is not None and entry.principal == principal else None


class ResponsesService:
    """Serves ``POST /v1/responses`` through a ``ChatService``."""

    def __init__(
        self, chat: ChatService, registry: SessionRegistry, *, model: str, max_entries: int
    ) -> None:
        self._chat = chat
        self._registry = registry
        self._model = model
        self.store = ResponseStore(max_entries=max_entries)

    def _remember(
        self, principal: str, instructions: str | None
    ) -> OnAnswer:
        def remember(
            response_id: str, request: ChatRequest, message: Message, session_id: str | None
        ) -> None:
            if session_id is not None:  # a one-shot request's session is gone already
                self.store.put(
                    response_id,
                    StoredResponse(
                        principal=principal,
                        session_id=session_id,
                        instructions=instructions,
                        messages=(*request.messages, message),
                    ),
                )

        return remember

    async def _history(self, principal: str, response_id: object) -> StoredResponse:
        if not isinstance(response_id, str) or not response_id:
            raise bad("'previous_response_id' must be a string", "previous_response_id")
        stored = self.store.get(principal, response_id)
        if stored is None:
            raise ProxyError(
                404,
                f"Previous response with id '{response_id}' not found.",
                code="previous_response_not_found",
                param="previous_response_id",
            )
        if await self._registry.lookup(principal, stored.session_id) is None:
            raise bad(
                f"Previous response with id '{response_id}' has expired: its session was "
                "closed (idle expiry or deleted); send the whole conversation instead",
                "previous_response_id",
                code="previous_response_expired",
            )
        return stored

    async def create(
        self,
        body: object,
        *,
        principal: str,
        session_header: str | None,
        started: float,
        route: Route | None = None,
    ) -> Response:
        if not isinstance(body, dict):
            raise bad("the request body must be a JSON object")
        for name, reason in REFUSED.items():
            if body.get(name):
                raise bad(reason, name, code="unsupported_parameter")
        instructions = body.get("instructions")
        if instructions is not None and not isinstance(instructions, str):
            raise bad("'instructions' must be a string", "instructions")
        store = body.get("store", True) is not False
        history: Sequence[dict[str, Any]] = []
        previous = body.get("previous_response_id")
        if previous is not None:
            stored = await self._history(principal, previous)
            kept = stored.messages[1:] if stored.instructions is not None else stored.messages
            history = [message.to_openai() for message in kept]
            session_header = stored.session_id
        chat = chat_body(body, history=history)
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
            on_answer=self._remember(principal, instructions) if store else None,
        )
        return await self._chat.complete(
            chat,
            principal=principal,
            session_header=session_header,
            started=started,
            shape=shape,
            route=route,
        )
