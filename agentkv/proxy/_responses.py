"""``POST /v1/responses``: the Responses API, on the same sessions and turns as chat completions.

A Responses request is translated into a chat completion request (``instructions`` and ``input``
items become messages, function tools become chat tools) and served by ``ChatService`` with a
``ResponsesShape`` writing the answer: one mapping onto sessions, one turn, two answer shapes.

* ``previous_response_id`` continues the conversation without the client re-sending it: a
  stored response is a reference into its session (``_responses_store``), its history rebuilt
  from the session's transcript as the client saw it (generated messages as shown, the tools
  description and tool result notes taken out), so the request becomes that history plus the
  new items, on the response's own session, an exact extension of its token-exact transcript.
  A stored response outlives neither its session (idle expiry, ``DELETE``, eviction), nor a
  fork of it that drops its history, nor the store's bound; asking for one that is gone is an
  error (404 not this principal's, 400 expired), never a silent restart or another history.
* ``store: false``, or no ``previous_response_id``: the client re-sends the history as input
  items, matched onto the session named by ``X-Session-ID`` / ``conversation_id`` /
  ``prompt_cache_key`` as chat completions are. A stored response without such a key gets a
  session of its own (``resp-...``), which is what ``previous_response_id`` continues.
"""

from __future__ import annotations

import secrets
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from starlette.responses import Response

from agentkv._core import Message, Route, TranscriptView, get_logger
from agentkv.proxy._chat import ChatService
from agentkv.proxy._entry import SessionEntry
from agentkv.proxy._errors import ProxyError
from agentkv.proxy._registry import SessionRegistry
from agentkv.proxy._responses_request import REFUSED, bad, chat_body, dropped_tools
from agentkv.proxy._responses_shape import OnAnswer, ResponsesShape
from agentkv.proxy._responses_store import (
    ResponseIds,
    Responses,
    ResponseStore,
    SharedResponses,
    StoredResponse,
    history_tail,
)
from agentkv.proxy._session_key import session_key
from agentkv.proxy._shape import HEADER_TOOLS_DROPPED
from agentkv.proxy._store import SessionStore, StoreUnavailableError
from agentkv.proxy._tools import ToolPlan, shown_messages

__all__ = ["ResponsesService"]

logger = get_logger("agentkv")


def _unavailable(exc: StoreUnavailableError) -> ProxyError:
    return ProxyError(503, str(exc), code="state_unavailable", headers={"Retry-After": "1"})


def _shown(view: TranscriptView, stored: StoredResponse) -> list[Message]:
    """The history of ``stored`` as its client saw it, from its session's transcript."""
    held = view.messages[: stored.count]
    shown = shown_messages(
        [view.views.get(i, m) for i, m in enumerate(held)], described=stored.described
    )
    return shown[1:] if stored.instructions else shown


class ResponsesService:
    """Serves ``POST /v1/responses`` through a ``ChatService``."""

    def __init__(
        self,
        chat: ChatService,
        registry: SessionRegistry,
        *,
        model: str,
        max_bytes: int,
        store: SessionStore | None = None,
        secret: str | None = None,
        ttl_s: float = 600.0,
    ) -> None:
        self._chat = chat
        self._registry = registry
        self._model = model
        self.store: Responses = (
            ResponseStore(max_bytes=max_bytes)
            if store is None
            else SharedResponses(store, ttl_s=ttl_s)
        )
        # Replicas of one store mint ids alike: the configured secret, else the store's.
        self._secret_store = store if secret is None else None
        self._ids: ResponseIds | None = (
            None if self._secret_store is not None else ResponseIds(secret or secrets.token_hex(32))
        )
        registry.on_close.append(self._closed)
        registry.on_fork.append(self._forked)

    async def _closed(self, entry: SessionEntry, reason: str) -> None:
        del reason
        await self.store.closed(entry.key)

    async def _forked(self, entry: SessionEntry, kept: int) -> None:
        try:
            await self.store.forked(entry.key, kept=kept)
        except StoreUnavailableError as exc:
            # What it dropped is caught when continued anyway (``tail``), or ends with its session.
            logger.warning(
                "agentkv.proxy.responses_not_dropped", session_id=entry.session_id, detail=str(exc)
            )

    async def _response_ids(self) -> ResponseIds:
        if self._ids is None:
            assert self._secret_store is not None
            try:
                self._ids = ResponseIds(await self._secret_store.shared_secret())
            except StoreUnavailableError as exc:
                raise _unavailable(exc) from exc
        return self._ids

    def _remember(self, principal: str, instructions: str | None) -> OnAnswer:
        async def remember(response_id: str, entry: SessionEntry | None, tools: ToolPlan) -> None:
            if entry is None or entry.closed:  # one-shot, or closed meanwhile: nothing to continue
                return
            messages = entry.session.transcript.messages
            stored = StoredResponse(
                principal=principal,
                session_id=entry.session_id,
                count=len(messages),
                instructions=bool(instructions),
                described=tools.described,
                tail=history_tail(messages, len(messages)),
            )
            try:
                await self.store.put(response_id, stored)
            except StoreUnavailableError as exc:
                # The answer stands; continuing it by id will say it expired.
                logger.error(
                    "agentkv.proxy.response_not_stored",
                    session_id=entry.session_id,
                    detail=str(exc),
                )

        return remember

    async def _history(self, principal: str, response_id: object) -> tuple[str, list[Message]]:
        """The session and the history (as its client saw it) that ``response_id`` ends."""
        if not isinstance(response_id, str) or not response_id:
            raise bad("'previous_response_id' must be a string", "previous_response_id")
        group = (await self._response_ids()).group(principal, response_id)
        try:
            stored = None if group is None else await self.store.get(group, response_id)
        except StoreUnavailableError as exc:
            raise _unavailable(exc) from exc
        if group is None or (stored is not None and stored.principal != principal):
            raise ProxyError(
                404,
                f"Previous response with id '{response_id}' not found.",
                code="previous_response_not_found",
                param="previous_response_id",
            )
        if stored is None:
            raise self._expired(
                response_id,
                "its session was closed (idle expiry, deleted or evicted), or the store's bound "
                "dropped it",
            )
        entry = await self._registry.lookup(principal, stored.session_id)
        if entry is None:
            raise self._expired(
                response_id, "its session was closed (idle expiry, deleted or evicted)"
            )
        view = entry.session.transcript
        if stored.count > len(view.messages) or (
            history_tail(view.messages, stored.count) != stored.tail
        ):
            # Never another history under this id: a fork dropped it (or its turn was lost).
            raise self._expired(
                response_id,
                "its session no longer holds its history (it went on from an earlier response)",
            )
        return stored.session_id, _shown(view, stored)

    @staticmethod
    def _expired(response_id: str, why: str) -> ProxyError:
        return bad(
            f"Previous response with id '{response_id}' has expired: {why}; send the whole "
            "conversation instead",
            "previous_response_id",
            code="previous_response_expired",
        )

    @staticmethod
    def _minter(principal: str, ids: ResponseIds | None) -> Callable[[str | None], str]:
        """Ids of stored responses name their session; others name nothing."""
        if ids is None:
            return lambda _: f"resp_{secrets.token_hex(24)}"
        return lambda session_id: ids.mint(principal, session_id)

    async def create(
        self,
        body: object,
        *,
        principal: str,
        headers: Mapping[str, str],
        started: float,
        route: Route | None = None,
    ) -> Response:
        """Answer one Responses request; its session comes from ``headers`` as on chat
        (``_session_key``), from ``previous_response_id``, or is minted for a stored one."""
        if not isinstance(body, dict):
            raise bad("the request body must be a JSON object")
        for name, reason in REFUSED.items():
            if body.get(name):
                raise bad(reason, name, code="unsupported_parameter")
        instructions = body.get("instructions")
        if instructions is not None and not isinstance(instructions, str):
            raise bad("'instructions' must be a string", "instructions")
        store = body.get("store", True) is not False
        ids = await self._response_ids() if store else None
        session_header: str | None = None
        history: Sequence[dict[str, Any]] = []
        previous = body.get("previous_response_id")
        if previous is not None:
            session_header, shown = await self._history(principal, previous)
            history = [message.to_openai() for message in shown]
        chat = chat_body(body, history=history)
        has_key = (
            session_header is not None
            or session_key(headers) is not None
            or any(
                chat.get(key) for key in ("conversation_id", "session_id", "prompt_cache_key")
            )
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
            mint=self._minter(principal, ids),
        )
        response = await self._chat.complete(
            chat,
            principal=principal,
            session_header=session_header,
            headers=headers,
            started=started,
            shape=shape,
            route=route,
        )
        dropped = dropped_tools(body.get("tools"))
        if dropped:
            response.headers[HEADER_TOOLS_DROPPED] = ",".join(dropped)
            logger.info("agentkv.proxy.tools_dropped", types=dropped)
        return response
