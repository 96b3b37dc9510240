"""One fake vLLM OpenAI-compatible server: routing, recorded requests, faults, kill/restart."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any, Literal

from agentkv._core import (
    CLAIM_PATH,
    EXTEND_PATH,
    INFO_PATH,
    LEGACY_OFFLOAD_PATH,
    OFFLOAD_PATH,
    RELEASE_PATH,
    RELEASE_REQUEST_PATH,
    TIER_DELETE_PATH,
)
from agentkv.testing import _fake_endpoints as endpoints
from agentkv.testing import _fake_leases as leases
from agentkv.testing._fake_chat import serve_chat
from agentkv.testing._fake_context import ServerContext
from agentkv.testing._fake_engine import FakeEngine
from agentkv.testing._fake_protocol import ApiError, error_body, parse_json_body
from agentkv.testing._fake_reply import FaultKind, FaultQueue, Reply, apply_fault, injected_status

Role = Literal["prefill", "decode"]
Lifecycle = Callable[[str], None]
CHAT_PATH = "/v1/chat/completions"


class FakeServer:
    """A fake vLLM server of a :class:`FakeCluster` (prefill or decode role).

    Example:
        >>> from agentkv.testing import FakeCluster
        >>> fake = FakeCluster(pairs=1)
        >>> decode = fake.decode(0)
        >>> decode.url, decode.pinned_handles
        ('http://fake-d0.test:8000', 0)
        >>> decode.fail_next("status", status=503)   # the next chat request gets a 503
        >>> decode.kill()                            # every request: httpx2.ConnectError
        >>> decode.restart()                         # alive again, pins and cache lost
    """

    def __init__(
        self,
        *,
        name: str,
        role: Role,
        url: str,
        side_channel: tuple[str, int],
        context: ServerContext,
    ) -> None:
        self.name = name
        self.role: Role = role
        self.url = url
        self.side_channel = side_channel
        self.requests: list[Any] = []
        """Parsed JSON bodies of the chat completion requests this server received."""
        self.request_headers: list[dict[str, str]] = []
        """Their headers (lower-case names), in the same order."""
        self._ctx = context
        self._faults = FaultQueue()
        self._listeners: list[Lifecycle] = []
        self._engine: FakeEngine | None = self._new_engine()

    def __repr__(self) -> str:
        state = "alive" if self.alive else "killed"
        return f"FakeServer({self.name!r}, role={self.role!r}, {state})"

    # --------------------------------------------------------------- public surface

    @property
    def alive(self) -> bool:
        return self._engine is not None

    @property
    def engine(self) -> FakeEngine | None:
        """The running engine (``None`` while killed); a restart replaces it."""
        return self._engine

    @property
    def engine_id(self) -> str | None:
        return None if self._engine is None else self._engine.engine_id

    @property
    def pinned_handles(self) -> int:
        """Turn-end pins held (handles a decode server keeps for the next turn's prefill)."""
        with self._ctx.lock:
            return 0 if self._engine is None else self._engine.pinned(turn_end=True)

    @property
    def leased_handles(self) -> int:
        """Turn-end pins leased through agentkv's extension (releasable, extendable)."""
        with self._ctx.lock:
            return 0 if self._engine is None else self._engine.leases

    @property
    def pending_prefill_handles(self) -> int:
        """Prefill handles not yet read by a decode server (held for ``kv_lease_duration``)."""
        with self._ctx.lock:
            return 0 if self._engine is None else self._engine.pinned(turn_end=False)

    @property
    def kv_cache_usage(self) -> float:
        """What ``vllm:kv_cache_usage_perc`` reports now."""
        with self._ctx.lock:
            return 0.0 if self._engine is None else self._engine.kv_cache_usage

    def fail_next(
        self,
        kind: FaultKind | str,
        *,
        times: int = 1,
        status: int = 500,
        path: str = CHAT_PATH,
        message: str | None = None,
    ) -> None:
        """Make the next ``times`` requests to ``path`` fail with ``kind``.

        ``status`` answers with that HTTP status and vLLM's error body (its message
        ``message``, when given), without processing.
        The other kinds process the request (pins and caches change) and then distort what
        the client sees: ``timeout`` (``httpx2.ReadTimeout``), ``reset``
        (``httpx2.RemoteProtocolError``), ``malformed_json``, ``truncated_json`` (half the
        body), ``no_kv_transfer_params`` (``null``) or ``bad_kv_transfer_params`` (corrupted).
        """
        with self._ctx.lock:
            self._faults.arm(kind, times=times, status=status, path=path, message=message)

    def kill(self) -> None:
        """Stop the server: every request fails to connect, its pins and cache are gone."""
        with self._ctx.lock:
            self._engine = None
            self._faults.clear()
        for listener in list(self._listeners):
            listener("kill")

    def restart(self) -> None:
        """Start again (after :meth:`kill`, or as a crash-restart): a fresh engine, empty cache."""
        with self._ctx.lock:
            self._engine = self._new_engine()
        for listener in list(self._listeners):
            listener("restart")

    def add_lifecycle_listener(self, listener: Lifecycle) -> Callable[[], None]:
        """Call ``listener("kill" | "restart")`` on lifecycle changes; returns a remover."""
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener)

    # ------------------------------------------------------------------- dispatch

    def handle(self, method: str, path: str, headers: Mapping[str, str], body: bytes) -> Reply:
        """Serve one HTTP request (the transport and the HTTP server both call this)."""
        with self._ctx.lock:
            engine = self._engine
            if engine is None:
                return Reply(failure="refused")
            fault = self._faults.take(path)
            if fault is not None and fault.kind == "status":
                if path == CHAT_PATH:
                    self._record(body, headers)
                return injected_status(fault.status, fault.message)
            reply = self._route(engine, method, path, headers, body)
            return reply if fault is None else apply_fault(fault, reply)

    def _route(
        self, engine: FakeEngine, method: str, path: str, headers: Mapping[str, str], body: bytes
    ) -> Reply:
        ctx = self._ctx
        content_type = headers.get("content-type")
        routes: dict[str, tuple[str, Callable[[], Reply]]] = {
            CHAT_PATH: (
                "POST",
                lambda: serve_chat(ctx, engine, self._record(body, headers), headers),
            ),
            "/tokenize": (
                "POST",
                lambda: endpoints.tokenize(ctx, parse_json_body(body, content_type)),
            ),
            "/detokenize": (
                "POST",
                lambda: endpoints.detokenize(ctx, parse_json_body(body, content_type)),
            ),
            "/health": ("GET", endpoints.health),
            "/v1/models": ("GET", lambda: endpoints.models(ctx)),
            "/metrics": ("GET", lambda: endpoints.metrics(engine, headers)),
        }
        if ctx.engine_config.leases or ctx.stream_handles:
            # agentkv's endpoint plugin (it also puts the handles on streams).
            routes[INFO_PATH] = (
                "GET",
                lambda: leases.info(engine, stream_handles=ctx.stream_handles),
            )
            routes[RELEASE_PATH] = ("POST", lambda: leases.release(engine, body))
            routes[EXTEND_PATH] = ("POST", lambda: leases.extend(engine, body))
            routes[CLAIM_PATH] = ("POST", lambda: leases.extend(engine, body, "claim"))
            routes[RELEASE_REQUEST_PATH] = ("POST", lambda: leases.release_request(engine, body))
            # The offload route under its first name (what SDKs send) and its new one.
            routes[LEGACY_OFFLOAD_PATH] = ("POST", lambda: leases.offload(engine, body))
            routes[OFFLOAD_PATH] = routes[LEGACY_OFFLOAD_PATH]
            routes[TIER_DELETE_PATH] = ("POST", lambda: leases.tier_delete(engine, body))
        route = routes.get(path)
        if route is None:
            return endpoints.http_error(404, "Not Found")
        if method.upper() != route[0]:
            return endpoints.http_error(405, "Method Not Allowed")
        try:
            return route[1]()
        except ApiError as exc:
            return Reply.error(exc.status, exc.body())
        except Exception as exc:
            # A server answers 500; it never raises into the client's transport.
            message = f"fake server error: {type(exc).__name__}: {exc}"
            return Reply.error(
                500, error_body(message, err_type="InternalServerError", code=500, param=None)
            )

    def _record(self, body: bytes, headers: Mapping[str, str]) -> Any:
        """Parse a chat body and keep a copy in :attr:`requests` (raises on bad JSON)."""
        data = parse_json_body(body, headers.get("content-type"))
        # The copy parsed again: cheaper than deep-copying the parse (a prompt's ids are thousands
        # of ints, each a call of deepcopy's).
        self.requests.append(json.loads(body))
        self.request_headers.append({k.lower(): v for k, v in headers.items()})
        return data

    def _new_engine(self) -> FakeEngine:
        ctx = self._ctx
        return FakeEngine(
            config=ctx.engine_config,
            tokenizer=ctx.tokenizer,
            model=ctx.fake_model,
            clock=ctx.clock,
            fabric=ctx.fabric,
            side_channel=self.side_channel,
            model_name=ctx.model,
            tier=ctx.tier,
        )
