"""The ASGI app: routes, authentication, body limits, error answers, the idle-session sweeper.

>>> from agentkv import AsyncCluster
>>> from agentkv.testing import FakeCluster
>>> fake = FakeCluster(pairs=1)
>>> cluster = AsyncCluster.from_dict(fake.cluster_spec, transport=fake.transport)
>>> app = create_app(cluster, ProxyConfig())
>>> sorted(route.path for route in app.routes)  # doctest: +NORMALIZE_WHITESPACE
['/healthz', '/metrics', '/v1/chat/completions', '/v1/messages', '/v1/messages/count_tokens',
 '/v1/models', '/v1/responses', '/v1/sessions/{session_id:path}']
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from agentkv._core import AsyncCluster, JSONDecodeError, get_logger, loads
from agentkv.proxy._chat import ChatService, json_response
from agentkv.proxy._config import ProxyConfig, key_digest
from agentkv.proxy._deadline import BodyDeadline, BodyPace
from agentkv.proxy._errors import ProxyError
from agentkv.proxy._messages import MessagesService
from agentkv.proxy._messages_errors import anthropic_error, proxy_error
from agentkv.proxy._messages_system import SystemDrops
from agentkv.proxy._metrics import ProxyMetrics
from agentkv.proxy._offload_gate import IGNORED_HEADER, LEGACY_IGNORED_HEADER, OffloadGate
from agentkv.proxy._open_store import open_store
from agentkv.proxy._registry import SessionEntry, SessionRegistry
from agentkv.proxy._relief import PressureRelief
from agentkv.proxy._request import LEGACY_OFFLOAD_HEADER, offload_from, route_from
from agentkv.proxy._responses import ResponsesService
from agentkv.proxy._shape import turn_stats_json
from agentkv.proxy._store import SessionStore
from agentkv.proxy._threads import thread_of

__all__ = ["create_app"]

logger = get_logger("agentkv")

Handler = Callable[[Request], Awaitable[Response]]
_ANONYMOUS = "anonymous"
_CLIENT_GONE = 499


def _principal(request: Request, config: ProxyConfig) -> str:
    """Who is asking: the API key's owner. Without configured keys, the presented key's digest.

    Sessions are scoped by this, with or without ``--api-keys``: two clients that present
    different keys never share a session id by accident.
    """
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    # Anthropic's clients send their key as ``x-api-key``.
    token = token.strip() if scheme.lower() == "bearer" else ""
    token = token or request.headers.get("x-api-key", "").strip()
    keys = config.api_keys
    if keys is None:
        return f"key-{key_digest(token)}" if token else _ANONYMOUS
    principal = keys.principal(token) if token else None
    if principal is None:
        raise ProxyError(
            401,
            "a valid API key is required (Authorization: Bearer KEY)"
            if not token
            else "invalid API key",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )
    return principal


async def _read_json(request: Request, limit: int) -> object:
    """The body as JSON; 413 past ``limit`` bytes (checked before and while reading)."""
    too_large = ProxyError(413, f"the request body is larger than {limit} bytes", code="too_large")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large
    parts: list[bytes] = []
    size = 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise too_large
        parts.append(part)
    try:
        return loads(b"".join(parts))
    except (JSONDecodeError, ValueError):
        raise ProxyError(400, "the request body is not valid JSON", code="invalid_json") from None


class _Proxy:
    """The app's state and handlers (one instance per app, no globals)."""

    def __init__(
        self,
        cluster: AsyncCluster,
        config: ProxyConfig,
        *,
        clock: Callable[[], float],
        store: SessionStore | None,
    ) -> None:
        self.cluster = cluster
        self.config = config
        self.clock = clock
        self.metrics = ProxyMetrics()
        self.offload_gate = OffloadGate(
            allowed=config.allow_client_offload,
            per_minute=config.client_offload_per_minute,
            clock=clock,
        )
        # A store the app opened (from config.state) is the app's to close.
        self.owned_store = (
            open_store(config.state, lease_s=config.state_lease_s)
            if store is None and config.state is not None
            else None
        )
        self.store = store or self.owned_store
        self.registry = SessionRegistry(
            cluster,
            max_sessions=config.max_sessions,
            idle_timeout_s=config.session_idle_timeout_s,
            metrics=self.metrics,
            clock=clock,
            store=self.store,
            offload_idle_s=config.offload_idle_s,
            max_sessions_per_key=config.max_sessions_per_key,
            max_stored_sessions=config.max_stored_sessions,
        )
        config_ = self.config
        self.relief = (
            None
            if config_.relieve_kv_usage is None
            else PressureRelief(
                cluster,
                self.registry,
                high=config_.relieve_kv_usage,
                low=config_.relieve_kv_usage - config_.relieve_margin,
                metrics=self.metrics,
            )
        )
        self.metrics.bind(
            sessions=lambda: len(self.registry),
            pair_sessions=cluster.loads,
            prefill_tokens=cluster.prefill_loads,
        )
        self.chat = ChatService(
            cluster, self.registry, config=config, metrics=self.metrics, store=self.store
        )
        # A stored response is a reference into its session (its history is rebuilt from the
        # session's transcript): a few hundred bytes, whatever the conversation's length. In
        # memory they are bounded in bytes; with a shared store they live there, with their
        # sessions.
        self.responses = ResponsesService(
            self.chat,
            self.registry,
            model=cluster.model,
            max_bytes=config.responses_max_bytes,
            store=self.store,
            secret=config.cache_salt_secret,
            ttl_s=config.session_idle_timeout_s,
        )
        self.messages = MessagesService(
            self.chat,
            cluster,
            drops=SystemDrops(config.drop_system_blocks),
            metrics=self.metrics,
            max_messages=config.max_sessions,
        )

    def endpoint(self, name: str, handler: Handler, *, anthropic: bool = False) -> Handler:
        """Wrap ``handler``: every exception becomes an OpenAI-style error with its status
        (``anthropic``: Anthropic's error shape and statuses, for the Messages routes)."""

        async def wrapped(request: Request) -> Response:
            try:
                response = await handler(request)
            except Exception as exc:
                # Built in a call of its own: nothing in this frame (which the traceback holds)
                # keeps the exception, so a refused upload's frames and bytes go with ``exc``.
                response = _error_response(name, exc, anthropic=anthropic)
            self.metrics.requests.labels(name, str(response.status_code)).inc()
            return response

        return wrapped

    async def chat_completions(self, request: Request) -> Response:
        started = time.perf_counter()
        principal = _principal(request, self.config)
        body = await _read_json(request, self.config.max_body_bytes)
        legacy = request.headers.get(LEGACY_OFFLOAD_HEADER)
        offload = offload_from(request.headers.get("x-agentkv-offload"), legacy=legacy)
        if legacy is not None:
            self.metrics.deprecated_name(LEGACY_OFFLOAD_HEADER)
        route = route_from(request.headers.get("x-agentkv-route"))
        admission = self.offload_gate.admit(principal, offload)  # bad headers cost no offload
        response = await self.chat.complete(
            body,
            principal=principal,
            session_header=None,
            headers=request.headers,
            started=started,
            offload=admission.mode,
            route=route,
        )
        if admission.ignored is not None:
            response.headers[IGNORED_HEADER] = admission.ignored
            if legacy is not None:  # a client of the old name reads the old answer header
                response.headers[LEGACY_IGNORED_HEADER] = admission.ignored
        return response

    async def create_response(self, request: Request) -> Response:
        started = time.perf_counter()
        principal = _principal(request, self.config)
        body = await _read_json(request, self.config.max_body_bytes)
        return await self.responses.create(
            body,
            principal=principal,
            headers=request.headers,
            started=started,
            route=route_from(request.headers.get("x-agentkv-route")),
        )

    async def create_message(self, request: Request) -> Response:
        started = time.perf_counter()
        principal = _principal(request, self.config)
        body = await _read_json(request, self.config.max_body_bytes)
        return await self.messages.create(
            body,
            principal=principal,
            headers=request.headers,
            started=started,
            route=route_from(request.headers.get("x-agentkv-route")),
        )

    async def count_tokens(self, request: Request) -> Response:
        _principal(request, self.config)
        body = await _read_json(request, self.config.max_body_bytes)
        return await self.messages.count_tokens(body)

    async def models(self, request: Request) -> Response:
        _principal(request, self.config)
        # How tool calls are served (decided once per served model; see _tools).
        mode = await self.chat.tool_modes.mode()
        return json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.cluster.model,
                        "object": "model",
                        "created": 0,
                        "owned_by": "agentkv",
                        "agentkv": {"tool_calling": mode.value},
                    }
                ],
            }
        )

    async def healthz(self, request: Request) -> Response:
        del request
        pairs = {pair.name: self.cluster.is_healthy(pair.name) for pair in self.cluster.pairs}
        ok = any(pairs.values())
        body: dict[str, Any] = {
            "status": "ok" if ok else "unavailable",
            "pairs": pairs,
            "sessions": len(self.registry),
        }
        if self.store is not None:
            # A replica that cannot reach the shared state cannot serve a session: not ready.
            try:
                state_ok = await asyncio.wait_for(self.store.ping(), timeout=2.0)
            except Exception:  # any failure to reach it means the same: not ready
                state_ok = False
            body["state"] = "ok" if state_ok else "unreachable"
            ok = ok and state_ok
            body["status"] = "ok" if ok else "unavailable"
        return json_response(body, status=200 if ok else 503)

    async def metrics_text(self, request: Request) -> Response:
        if self.config.metrics_need_key:
            _principal(request, self.config)  # 401 without a valid key
        body, content_type = self.metrics.render(request.headers.get("accept"))
        return Response(body, media_type=content_type)

    async def _entry(self, request: Request) -> tuple[str, str, SessionEntry]:
        principal = _principal(request, self.config)
        session_id = request.path_params["session_id"]
        entry = await self.registry.lookup(principal, session_id)
        if entry is None:
            raise ProxyError(404, f"no session '{session_id}'", code="session_not_found")
        return principal, session_id, entry

    async def get_session(self, request: Request) -> Response:
        *_, entry = await self._entry(request)
        return json_response(self._session_json(entry))

    async def delete_session(self, request: Request) -> Response:
        principal, session_id, _ = await self._entry(request)
        await self.registry.delete(principal, session_id)
        return json_response(
            {"id": session_id, "object": "agentkv.session.deleted", "deleted": True}
        )

    async def session(self, request: Request) -> Response:
        if request.method == "DELETE":
            return await self.delete_session(request)
        return await self.get_session(request)

    def _session_json(self, entry: SessionEntry) -> dict[str, Any]:
        session = entry.session
        handle = session.handle
        turns = session.turns
        stats = session.stats
        session_id, thread = thread_of(entry.session_id)
        return {
            "id": entry.session_id,
            "object": "agentkv.session",
            "session": session_id,
            "thread": thread,
            "created": int(entry.created_at),
            "pair": session.pair.name,
            "busy": entry.users > 0,
            "idle_s": round(self.registry.idle_s(entry), 3),
            "forks": entry.forks,
            "messages": len(session.transcript.messages),
            "handle": None
            if handle is None
            else {
                "num_tokens": handle.num_tokens,
                "expires_in_s": round(handle.remaining_s(self.cluster.clock()), 3),
            },
            "totals": {
                "turns": stats.turns,
                "prompt_tokens": stats.prompt_tokens,
                "reused_tokens": stats.reused_tokens,
                "ideal_reused_tokens": stats.ideal_reused_tokens,
                "generated_tokens": stats.generated_tokens,
                "reuse_ratio": stats.reuse_ratio,
                "median_ttft_s": stats.median_ttft_s,
                "median_warm_ttft_s": stats.median_warm_ttft_s,
            },
            "turns": [turn_stats_json(t) for t in turns],
        }

    async def sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.sweep_interval_s)
            try:
                closed = await self.registry.sweep()
                offloaded = await self.registry.offload_idle()
            except Exception:  # never let one bad close stop the sweeper
                logger.exception("agentkv.proxy.sweep_failed")
                continue
            if closed or offloaded:
                logger.info(
                    "agentkv.proxy.swept",
                    closed=closed,
                    offloaded=offloaded,
                    open=len(self.registry),
                )

    async def relieve_forever(self, relief: PressureRelief) -> None:
        while True:
            await asyncio.sleep(self.config.relieve_interval_s)
            try:
                await relief.relieve()
            except Exception:  # never let one failed pass stop the relief
                logger.exception("agentkv.proxy.relief_failed")

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        del app
        sweeper = asyncio.create_task(self.sweep_forever(), name="agentkv-proxy-sweeper")
        relief = (
            None
            if self.relief is None
            else asyncio.create_task(self.relieve_forever(self.relief), name="agentkv-relief")
        )
        logger.info(
            "agentkv.proxy.started",
            model=self.cluster.model,
            pairs=[pair.name for pair in self.cluster.pairs],
            auth=self.config.api_keys is not None,
        )
        try:
            yield
        finally:
            for task in (sweeper, relief):
                if task is not None:
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
            await self.registry.close_all()
            if self.owned_store is not None:
                await self.owned_store.aclose()
            logger.info("agentkv.proxy.stopped")


def _error_response(endpoint: str, exc: Exception, *, anthropic: bool = False) -> Response:
    """The answer to ``exc``, logged: 5xx as failures, 4xx as refusals, a client gone as 499
    (``anthropic``: in Anthropic's error shape)."""
    if isinstance(exc, ClientDisconnect):
        # The client left before its request was read: no one to answer, nothing failed. 499 is
        # nginx's status for it, for the requests metric (uvicorn sends nothing to a closed socket).
        logger.info("agentkv.proxy.client_disconnected", endpoint=endpoint, status=_CLIENT_GONE)
        return Response(status_code=_CLIENT_GONE)
    error = (
        proxy_error(exc)
        if anthropic
        else ProxyError.from_exception(
            exc, input_param="input" if endpoint == "responses" else "messages"
        )
    )
    if error.status >= 500:
        logger.error(
            "agentkv.proxy.request_failed",
            endpoint=endpoint,
            status=error.status,
            error=type(exc).__name__,
            detail=str(exc),
            exc_info=not isinstance(exc, ProxyError) and error.status == 500,
        )
    else:
        logger.info(
            "agentkv.proxy.request_refused",
            endpoint=endpoint,
            status=error.status,
            code=error.code,
            detail=error.message,
        )
    if anthropic:
        status, body = anthropic_error(exc)
        return json_response(body, status=status, headers=error.headers)
    return json_response(error.body(), status=error.status, headers=error.headers)


async def _http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own refusals (unknown path, wrong method) in the OpenAI error shape."""
    del request
    status = exc.status_code if isinstance(exc, HTTPException) else 500
    headers = dict(exc.headers or {}) if isinstance(exc, HTTPException) else None
    detail = exc.detail if isinstance(exc, HTTPException) else "internal error"
    error = ProxyError(status, str(detail), code="not_found" if status == 404 else None)
    return json_response(error.body(), status=status, headers=headers)


def create_app(
    cluster: AsyncCluster,
    config: ProxyConfig | None = None,
    *,
    clock: Callable[[], float] = time.monotonic,
    store: SessionStore | None = None,
) -> Starlette:
    """The proxy as an ASGI app serving ``cluster``; run it with any ASGI server.

    The app does not own the cluster: close it after the app stops. ``clock`` (monotonic seconds)
    drives idle expiry; tests pass a manual one. ``app.state.registry`` holds the open sessions,
    ``app.state.responses`` serves ``/v1/responses`` (its ``store``: the stored responses);
    ``app.state.endpoints`` maps ``(method, path)`` of the hot endpoints to their handlers (what
    ``agentkv.OpenAI`` serves in-process without the app's routing).
    ``store`` shares sessions with other replicas (default: the one ``config.state`` names, or
    none: sessions in this process's memory).
    """
    config = config or ProxyConfig()
    proxy = _Proxy(cluster, config, clock=clock, store=store)
    chat = proxy.endpoint("chat", proxy.chat_completions)
    responses = proxy.endpoint("responses", proxy.create_response)
    messages = proxy.endpoint("messages", proxy.create_message, anthropic=True)
    count_tokens = proxy.endpoint("count_tokens", proxy.count_tokens, anthropic=True)
    routes = [
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/responses", responses, methods=["POST"]),
        Route("/v1/messages", messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
        Route("/v1/models", proxy.endpoint("models", proxy.models), methods=["GET"]),
        Route(
            "/v1/sessions/{session_id:path}",
            proxy.endpoint("sessions", proxy.session),
            methods=["GET", "DELETE"],
        ),
        Route("/healthz", proxy.endpoint("healthz", proxy.healthz), methods=["GET"]),
        Route("/metrics", proxy.endpoint("metrics", proxy.metrics_text), methods=["GET"]),
    ]
    pace = (
        None
        if config.body_timeout_s is None
        else BodyPace(timeout_s=config.body_timeout_s, min_rate=config.body_min_rate)
    )
    app = Starlette(
        routes=routes,
        # Middleware, not _read_json: the in-process transport's direct endpoints, whose body is
        # whole before they run, skip it and pay nothing.
        middleware=[Middleware(BodyDeadline, pace=pace)],
        lifespan=proxy.lifespan,
        exception_handlers={HTTPException: _http_error},
    )
    app.state.registry = proxy.registry
    app.state.metrics = proxy.metrics
    app.state.relief = proxy.relief
    app.state.responses = proxy.responses
    # The hot endpoints, for an in-process transport to call without the app's routing.
    app.state.endpoints = {
        ("POST", "/v1/chat/completions"): chat,
        ("POST", "/v1/responses"): responses,
        ("POST", "/v1/messages"): messages,
        ("POST", "/v1/messages/count_tokens"): count_tokens,
    }
    return app
