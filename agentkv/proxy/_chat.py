"""``POST /v1/chat/completions``: map the request onto a session, run one turn, answer.

The turn itself is the SDK's (``AsyncSession.turn`` / ``stream``): the proxy adds only the
mapping from an OpenAI request to a session and the OpenAI shape of the answer.

Streams: the first event is awaited before any byte of the response is sent. By then the P leg
has run and decode has started answering, so every validation, routing, prefill or decode
failure still gets its own status and JSON body. A failure after that cannot change the status;
the connection is then cut without ``data: [DONE]``, so the client sees a broken stream, never a
200 that quietly carries an error.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine, Mapping
from typing import Any, Protocol

from starlette.requests import ClientDisconnect
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from agentkv._core import (
    AsyncCluster,
    AsyncSession,
    HandleState,
    HistoryPlan,
    Message,
    PersistMode,
    Route,
    TextDelta,
    TurnOverrides,
    TurnResult,
    as_offload,
    dumps,
    get_logger,
)
from agentkv.proxy._affinity import HistoryIndex
from agentkv.proxy._config import ProxyConfig
from agentkv.proxy._errors import ProxyError
from agentkv.proxy._ignored import IgnoredFields
from agentkv.proxy._metrics import ProxyMetrics
from agentkv.proxy._prefix_breaks import record_break
from agentkv.proxy._registry import SessionEntry, SessionRegistry
from agentkv.proxy._request import ChatRequest, parse_chat_request
from agentkv.proxy._salt import CacheSalts
from agentkv.proxy._session_key import session_key
from agentkv.proxy._shape import (
    HEADER_FORKED,
    HEADER_HANDLE,
    HEADER_MAX_TOKENS_CLAMPED,
    HEADER_PAIR,
    HEADER_SESSION,
    HEADER_THREAD,
    Completion,
)
from agentkv.proxy._spawn import spawned_fork
from agentkv.proxy._store import SessionStore, StoreUnavailableError
from agentkv.proxy._threads import MAIN, Thread, ThreadIndex, thread_of
from agentkv.proxy._tools import HEADER_TOOL_CALLING, ToolModes, ToolPlan, plan_tools

__all__ = ["AnswerShape", "ChatService", "json_response"]

logger = get_logger("agentkv")

_DONE = b"data: [DONE]\n\n"


def json_response(
    data: Any, *, status: int = 200, headers: dict[str, str] | None = None
) -> Response:
    return Response(dumps(data), status_code=status, headers=headers, media_type="application/json")


def _new_pck_id() -> str:
    """A session id for a new conversation under a ``prompt_cache_key``."""
    return f"pck-{uuid.uuid4().hex}"


def _sse(data: Any) -> bytes:
    return b"data: " + dumps(data) + b"\n\n"


def _discard_pending(session: AsyncSession) -> None:
    """Forget messages appended for a turn that failed or was abandoned.

    A failed ``turn()`` leaves its messages pending so an SDK caller can retry; the proxy's next
    request re-sends the whole history instead, so they must go.
    """
    session.discard_pending()


async def _aclose(events: AsyncIterator[object]) -> None:
    """Close an SDK stream: an abandoned turn commits nothing and frees its session."""
    close = getattr(events, "aclose", None)
    if close is not None:
        await close()


def _clamped(asked: int | None, given: int | None) -> dict[str, str]:
    """The header that says a clamped ``max_tokens`` (the SDK clamped it, and logged why)."""
    if asked is None or given is None:
        return {}
    return {HEADER_MAX_TOKENS_CLAMPED: f"{asked}->{given}"}


class AnswerShape(Protocol):
    """How a turn's answer is written: a chat completion, or a Responses API response.

    One request, one shape: the mapping onto a session and the turn are the same for both.
    """

    def body(self, result: TurnResult, *, message: Message, finish: str) -> dict[str, Any]:
        """The non-streamed answer."""
        ...

    def opening(self) -> list[bytes]:
        """Stream events before the first text."""
        ...

    def delta(self, text: str) -> bytes:
        """A stream event carrying text as decode produced it."""
        ...

    def closing(
        self,
        result: TurnResult,
        *,
        message: Message,
        finish: str,
        translated: bool,
        include_usage: bool,
    ) -> list[bytes]:
        """Stream events after the text (``translated``: the text was held back, ``message``
        is what to show for it)."""
        ...

    def bind(self, session_id: str | None, *, plan: HistoryPlan | None = None) -> None:
        """The request runs on session ``session_id`` (``None``: one-shot), its history mapped
        onto it as ``plan`` (``None``: a new or one-shot session); before any of the answer is
        written."""
        ...

    async def answered(self, *, entry: SessionEntry | None, tools: ToolPlan) -> None:
        """The turn committed its answer on ``entry`` (still checked out; ``None`` for a
        one-shot request), its tools served as ``tools`` planned."""
        ...


class ChatShape:
    """``chat.completion`` bodies and ``chat.completion.chunk`` streams."""

    def __init__(self, *, model: str) -> None:
        self._completion = Completion(model=model)

    def body(self, result: TurnResult, *, message: Message, finish: str) -> dict[str, Any]:
        return self._completion.body(result, message=message, finish_reason=finish)

    def opening(self) -> list[bytes]:
        return [_sse(self._completion.chunk({"role": "assistant", "content": ""}))]

    def delta(self, text: str) -> bytes:
        return _sse(self._completion.chunk({"content": text}))

    def closing(
        self,
        result: TurnResult,
        *,
        message: Message,
        finish: str,
        translated: bool,
        include_usage: bool,
    ) -> list[bytes]:
        chunks = self._completion.final_chunks(
            result,
            include_usage=include_usage,
            message=message if translated else None,
            finish_reason=finish,
        )
        return [*(_sse(chunk) for chunk in chunks), _DONE]

    def bind(self, session_id: str | None, *, plan: HistoryPlan | None = None) -> None:
        del session_id, plan

    async def answered(self, *, entry: SessionEntry | None, tools: ToolPlan) -> None:
        del entry, tools


class _Checkout:
    """The session one request holds for its turn (checked out of the registry, or a one-shot
    session), and how to give it back. Not a checkout: decode's leases are pins' time limits."""

    __slots__ = ("entry", "forked", "new", "plan", "registry", "session", "thread")

    def __init__(
        self,
        session: AsyncSession,
        *,
        entry: SessionEntry | None = None,
        registry: SessionRegistry | None = None,
        plan: HistoryPlan | None = None,
        thread: str | None = None,
    ) -> None:
        self.session = session
        self.entry = entry
        self.registry = registry
        self.plan = plan
        self.thread = thread
        self.forked = plan is not None and plan.forked

    @property
    def request_secret(self) -> str | None:
        """The D leg's secret the shared store recorded with the session's claim, if any."""
        claim = self.entry.claim if self.entry is not None else None
        return claim.secret or None if claim is not None else None

    def committed(self, view: Message | None = None) -> None:
        """Note what the client was shown for the turn's answer when that differs (``view``):
        the session matches its echo against it."""
        if self.plan is not None and view is not None:
            self.session.mark_generated(views={self.plan.keep + len(self.plan.new): view})

    async def release(self, *, failed: bool) -> None:
        if failed and not self.session.closed:
            _discard_pending(self.session)
        if self.entry is None:
            await self.session.aclose()  # one-shot: keep no handle
        else:
            assert self.registry is not None
            await self.registry.checkin(self.entry, failed=failed)

    def headers(self, *, pair: str, handle: HandleState) -> dict[str, str]:
        headers = {HEADER_PAIR: pair, HEADER_HANDLE: handle.value}
        if self.entry is not None:
            headers[HEADER_SESSION] = self.entry.session_id
        if self.thread is not None:
            headers[HEADER_THREAD] = self.thread
        if self.forked:
            headers[HEADER_FORKED] = "1"
        return headers


class _SSEResponse(StreamingResponse):
    """A stream that always runs ``cleanup``, also when the client leaves before the first byte."""

    def __init__(
        self,
        content: AsyncIterator[bytes],
        *,
        headers: dict[str, str],
        cleanup: Callable[[], Coroutine[Any, Any, None]],
    ) -> None:
        super().__init__(content, media_type="text/event-stream", headers=headers)
        self._cleanup = cleanup

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except ClientDisconnect:
            # The client left mid-stream: nothing to answer. Cleanup abandons the turn.
            logger.info("agentkv.proxy.client_disconnected", path=scope.get("path"))
        finally:
            await self._cleanup()


class ChatService:
    """Serves chat completions for one app: parsing, session mapping, turns, answers."""

    def __init__(
        self,
        cluster: AsyncCluster,
        registry: SessionRegistry,
        *,
        config: ProxyConfig,
        metrics: ProxyMetrics,
        store: SessionStore | None = None,
    ) -> None:
        self._cluster = cluster
        self._registry = registry
        self._config = config
        self._metrics = metrics
        # Replicas sharing sessions must salt alike, or a prefill would not share one principal's
        # prefix cache across them and a tier entry one wrote would not load through another
        # (entries keep the salt they were written with). Without a configured secret they
        # share one kept in the store (``SessionStore.shared_secret``), fetched on first use.
        self._salt_store = store if config.cache_salt_secret is None else None
        self._salts: CacheSalts | None = (
            None if self._salt_store is not None else CacheSalts(config.cache_salt_secret)
        )
        self.tool_modes = ToolModes(cluster, configured=config.tool_calling)
        self._histories = HistoryIndex(max_entries=config.max_sessions)
        self._threads = ThreadIndex(max_entries=config.max_sessions)
        self._ignored_fields = IgnoredFields()

    async def _salted(self, extra: Mapping[str, Any], principal: str) -> Mapping[str, Any]:
        """``extra`` with the principal's ``cache_salt`` (``isolate_prefix_caches``)."""
        if not self._config.isolate_prefix_caches:
            return extra
        if self._salts is None:
            assert self._salt_store is not None
            try:
                secret = await self._salt_store.shared_secret()
            except StoreUnavailableError as exc:
                raise ProxyError(
                    503, str(exc), code="state_unavailable", headers={"Retry-After": "1"}
                ) from exc
            self._salts = CacheSalts(secret)
        return {**extra, "cache_salt": self._salts.salt(principal)}

    async def plan(self, body: object) -> tuple[ChatRequest, ToolPlan]:
        """The request in ``body`` and how its tools are served (``ProxyError`` if malformed):
        what a turn would send, before any session is touched."""
        request = parse_chat_request(
            body,
            model=self._cluster.model,
            default_max_tokens=self._config.default_max_tokens,
            ignored_fields=self._ignored_fields,
        )
        mode = await self.tool_modes.mode() if request.tools else None
        tools = plan_tools(
            mode=mode,
            messages=request.messages,
            tools=request.tools,
            tool_choice=request.tool_choice,
            parallel_tool_calls=request.parallel_tool_calls,
            extra=request.extra,
        )
        return request, tools

    async def complete(
        self,
        body: object,
        *,
        principal: str,
        session_header: str | None,
        started: float,
        shape: AnswerShape | None = None,
        offload: PersistMode = "auto",
        route: Route | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> Response:
        """Answer one chat completion request (``ProxyError`` or agentkv errors on failure).

        ``started`` is when the request arrived (``time.perf_counter()``): a plain answer says in
        ``Server-Timing`` how long the SDK's turn took and how long the proxy added around it.
        ``shape`` writes the answer (default: a chat completion; ``/v1/responses`` passes its
        own after translating its request into a chat completion request). ``offload`` is the
        turn's offload option (``X-AgentKV-Offload``: ``always``, the session's ``"disk"``,
        offloads the turn-end KV to decode's file tier right after the answer); ``route`` the
        turn's route (``X-AgentKV-Route``), else the session's.

        The session comes from ``headers`` (the agents' own, ``_session_key``) and the body, on
        the thread of it the request's history belongs to (``_threads``); ``session_header``
        names the registry's session directly instead (a stored response's, for Responses).
        """
        request, tools = await self.plan(body)
        shape = shape or ChatShape(model=self._cluster.model)
        thread = self._thread(principal, session_header, headers or {}, request)
        if thread is None:
            checkout = _Checkout(self._cluster.session())
            try:
                checkout.session.append(*tools.messages)
            except BaseException:
                await checkout.release(failed=True)
                raise
        else:
            checkout = await self._map(principal, thread, request, tools)
        entry = checkout.entry
        shape.bind(entry.session_id if entry is not None else None, plan=checkout.plan)
        overrides: TurnOverrides = {
            "max_tokens": request.max_tokens,
            "temperature": request.temperature,
            "tools": tools.tools,
            "tool_choice": tools.tool_choice,
            "extra_body": await self._salted(tools.extra, principal),
            "oversized_max_tokens": (
                "refuse" if self._config.refuse_oversized_max_tokens else "clamp"
            ),
        }
        if route is not None:
            overrides["route"] = route
        if request.stream:
            return await self._stream(
                checkout,
                request,
                tools,
                overrides,
                started=started,
                principal=principal,
                shape=shape,
                offload=offload,
            )
        turn_started = time.perf_counter()
        try:
            # A one-shot request (no session id) has no next turn: decode pins nothing.
            result = await checkout.session.turn(
                final=checkout.entry is None,
                offload=as_offload(offload),
                request_secret=checkout.request_secret,
                **overrides,
            )
        except BaseException:
            await checkout.release(failed=True)
            raise
        turn_s = time.perf_counter() - turn_started
        try:
            message, finish = await self._answered(
                checkout, request, tools, result, principal=principal, shape=shape
            )
        except BaseException:
            await checkout.release(failed=False)  # the turn committed: the session keeps it
            raise
        await checkout.release(failed=False)
        headers = checkout.headers(pair=result.stats.pair, handle=result.stats.handle_state) | (
            _clamped(result.stats.max_tokens_clamped_from, result.stats.max_tokens)
        )
        if tools.mode is not None:
            headers[HEADER_TOOL_CALLING] = tools.mode.value
        response = json_response(
            shape.body(result, message=message, finish=finish), headers=headers
        )
        total_s = time.perf_counter() - started
        timing = f"turn;dur={turn_s * 1e3:.3f}, proxy;dur={(total_s - turn_s) * 1e3:.3f}"
        if checkout.entry is not None and self._registry.shared:
            # Part of ``proxy``: what the shared session store took before the answer (the
            # claim, and the restore when another replica served the last turn).
            timing += f", store;dur={checkout.entry.store_s * 1e3:.3f}"
        response.headers["Server-Timing"] = timing
        self._metrics.overhead_seconds.observe(total_s - turn_s)
        self._record(result, stream=False, seconds=total_s)
        return response

    async def _answered(
        self,
        checkout: _Checkout,
        request: ChatRequest,
        tools: ToolPlan,
        result: TurnResult,
        *,
        principal: str,
        shape: AnswerShape,
    ) -> tuple[Message, str]:
        """Commit the turn's bookkeeping; the message and finish reason the client gets."""
        message, finish = tools.answer(result)
        checkout.committed(view=message if message is not result.message else None)
        await shape.answered(entry=checkout.entry, tools=tools)
        if request.prompt_cache_key is not None and checkout.entry is not None:
            self._histories.remember(
                principal,
                request.prompt_cache_key,
                [*request.messages, message],
                checkout.entry.session_id,
            )
        return message, finish

    def _thread(
        self,
        principal: str,
        session_header: str | None,
        headers: Mapping[str, str],
        request: ChatRequest,
    ) -> Thread | None:
        """The thread the request runs on (``None``: a one-shot request)."""
        if session_header is not None:
            return Thread(registry_id=session_header, name=thread_of(session_header)[1])
        key = session_key(headers, request.body_session_id)
        cache_key = request.prompt_cache_key
        if key is None and cache_key is not None:
            # A shared prefix, not a conversation: place by the key, find the conversation by
            # its history (``_affinity``).
            found = self._histories.find(principal, cache_key, request.messages)
            return Thread(
                registry_id=found or _new_pck_id(),
                name=MAIN,
                placement=f"{principal}:{cache_key}",
                by_history=True,
            )
        if key is None:
            return None

        def held() -> tuple[Message, ...] | None:
            entry = self._registry.cached(principal, key.session_id)
            if entry is None:
                return None
            transcript = entry.session.transcript
            return (*transcript.messages, *transcript.pending) or None

        return self._threads.resolve(principal, key, request.messages, held=held)

    async def _map(
        self, principal: str, thread: Thread, request: ChatRequest, tools: ToolPlan
    ) -> _Checkout:
        """Check the thread's session out and bring it to the request's history (append, or
        fork)."""
        session_id, placement, by_history = thread.registry_id, thread.placement, thread.by_history
        registry = self._registry
        entry = await registry.checkout(principal, session_id, placement_key=placement)
        try:
            spawned = spawned_fork(
                registry,
                principal,
                thread,
                entry.session,
                messages=tools.messages,
                tools=tools.tools,
            )
            if spawned is not None:
                await registry.adopt(entry, spawned)
            session = entry.session
            if session.transcript.pending:
                _discard_pending(session)
            # The tools the turn renders (in JSON mode they are in the messages instead).
            plan = session.sync_history(tools.messages, tools=tools.tools)
            if plan.echoes:
                self._metrics.echoes.inc(plan.echoes)
            if plan.forked:
                record_break(
                    self._metrics,
                    plan,
                    session_id=session_id,
                    principal=principal,
                    thread=thread.name,
                )
            if plan.forked and by_history:
                # Found by its history (``prompt_cache_key``), yet it does not extend the
                # session: another continuation of that history committed on it first. The two
                # are two conversations now: this one forks into a session of its own, and the
                # session stays with the continuation it holds.
                session_id = _new_pck_id()
                child = session.fork(keep=plan.keep, session_id=f"{principal}:{session_id}")
            elif plan.forked:
                child = session.fork(keep=plan.keep, session_id=session.session_id)
                await registry.replace(entry, child)
                self._forked(child, session_id, principal=principal, plan=plan)
        except BaseException:
            await registry.checkin(entry, failed=True)  # a new session the request never used
            raise
        if plan.forked and by_history:
            await registry.checkin(entry)
            try:
                entry = await registry.checkout(principal, session_id, placement_key=placement)
            except BaseException:
                await child.aclose()
                raise
            await registry.replace(entry, child)
            self._forked(child, session_id, principal=principal, plan=plan)
        name = None if by_history else thread.name
        return _Checkout(entry.session, entry=entry, registry=registry, plan=plan, thread=name)

    def _forked(
        self, child: AsyncSession, session_id: str, *, principal: str, plan: HistoryPlan
    ) -> None:
        self._metrics.forks.inc()
        logger.info(
            "agentkv.proxy.session_forked",
            session_id=session_id,
            principal=principal,
            kept_messages=plan.keep,
            reason=plan.reason,
        )
        child.append(*plan.new)

    @staticmethod
    def _handle_state(first: TextDelta | TurnResult) -> HandleState:
        """What the turn did with the stored handle, as the SDK decided it: a stream's headers
        go out with its first event, before its stats exist, and that event says."""
        if isinstance(first, TurnResult):
            return first.stats.handle_state
        return first.handle_state or HandleState.NONE

    async def _stream(
        self,
        checkout: _Checkout,
        request: ChatRequest,
        tools: ToolPlan,
        overrides: TurnOverrides,
        *,
        started: float,
        principal: str,
        shape: AnswerShape,
        offload: PersistMode = "auto",
    ) -> Response:
        session = checkout.session
        try:
            events = session.stream(
                final=checkout.entry is None,
                offload=as_offload(offload),
                request_secret=checkout.request_secret,
                **overrides,
            )
        except BaseException:
            await checkout.release(failed=True)
            raise
        try:
            first = await anext(events)
        except BaseException:
            await _aclose(events)
            await checkout.release(failed=True)
            raise
        handle = self._handle_state(first)
        state: dict[str, TurnResult] = {}

        async def chunks() -> AsyncGenerator[bytes, None]:
            for opening in shape.opening():
                yield opening
            event: TextDelta | TurnResult = first
            try:
                while isinstance(event, TextDelta):
                    # A reply to be translated (JSON tool calls) is held back until it ends.
                    if tools.protocol is None:
                        yield shape.delta(event.text)
                    event = await anext(events)
            except Exception as exc:
                # Too late for a status: the connection is cut without [DONE] (module docstring).
                logger.warning(
                    "agentkv.proxy.stream_failed",
                    session_id=checkout.entry.session_id if checkout.entry else None,
                    pair=session.pair.name,
                    error=type(exc).__name__,
                    detail=str(exc),
                )
                raise
            state["result"] = event
            message, finish = await self._answered(
                checkout, request, tools, event, principal=principal, shape=shape
            )
            for closing in shape.closing(
                event,
                message=message,
                finish=finish,
                translated=tools.protocol is not None,
                include_usage=request.include_usage,
            ):
                yield closing

        body = chunks()

        async def cleanup() -> None:
            await body.aclose()
            await _aclose(events)
            result = state.get("result")
            await checkout.release(failed=result is None)
            if result is not None:
                self._record(result, stream=True, seconds=time.perf_counter() - started)

        said = first.stats if isinstance(first, TurnResult) else first
        headers = checkout.headers(pair=session.pair.name, handle=handle) | (
            _clamped(said.max_tokens_clamped_from, said.max_tokens)
        )
        if tools.mode is not None:
            headers[HEADER_TOOL_CALLING] = tools.mode.value
        headers["Cache-Control"] = "no-cache"
        headers["X-Accel-Buffering"] = "no"  # reverse proxies (nginx ingress) must not buffer
        return _SSEResponse(body, headers=headers, cleanup=cleanup)

    def _record(self, result: TurnResult, *, stream: bool, seconds: float) -> None:
        stats = result.stats
        metrics = self._metrics
        metrics.request_seconds.labels("true" if stream else "false").observe(seconds)
        metrics.ttft_seconds.observe(stats.ttft_s)
        metrics.turns.labels(stats.handle_state.value).inc()
        metrics.prompt_tokens.inc(stats.prompt_tokens)
        metrics.reused_tokens.inc(stats.reused_tokens)
        metrics.ideal_reused_tokens.inc(stats.ideal_reused_tokens)
        metrics.generated_tokens.inc(stats.generated_tokens)
