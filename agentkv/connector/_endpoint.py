"""agentkv's vLLM endpoint plugin: lease routes and streamed handles, in the API server process.

Loaded by vLLM (entry point ``vllm.endpoint_plugins:agentkv``) only when ``VLLM_PLUGINS`` names
``agentkv``; ``agentkv up`` sets it. Two jobs:

* Routes (under ``/v1`` so ``--api-key`` guards them): ``GET /v1/agentkv/info``,
  ``POST /v1/agentkv/leases/release``, ``POST /v1/agentkv/leases/extend``,
  ``POST /v1/agentkv/leases/claim`` (an extend that rotates the lease secret),
  ``POST /v1/agentkv/requests/release``, ``POST /v1/agentkv/leases/persist`` (the offload,
  also at ``/v1/agentkv/leases/offload``) and
  ``POST /v1/agentkv/tier/delete`` (the file tier, ``_tier``). Each forwards to
  the EngineCore's ``agentkv_leases`` utility (``_engine_rpc``), which asks the connector. One
  decode server serves any number of sessions: a call names its handle by the handle's own
  capability (``_leases``), never by a session id the server would have to trust.
* At start, it patches this server's chat serving object so streams end with the handle
  (``_stream``); a vLLM that lacks the patch point fails the start.
"""

from __future__ import annotations

import asyncio
from argparse import Namespace
from collections.abc import Callable
from typing import Any, Protocol

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse

from agentkv._wire.hints import (
    CLAIM_PATH,
    EXTEND_PATH,
    INFO_PATH,
    RELEASE_PATH,
    RELEASE_REQUEST_PATH,
    ExtendRequest,
    ExtendResult,
    HintError,
    LeaseRef,
    RequestRelease,
    ServerInfo,
    lease_error,
)
from agentkv._wire.tier import (
    LEGACY_OFFLOAD_PATH,
    OFFLOAD_PATH,
    TIER_DELETE_PATH,
    OffloadRequest,
    TierDelete,
)
from agentkv.connector import _stream
from agentkv.connector._engine_rpc import METHOD

# How often the offload route asks whether the workers' tier write has ended: first after 2 ms
# (a small write), then backing off to every 50 ms (a long one costs the engine ~20 calls a s).
_POLL_FIRST_S = 0.002
_POLL_MAX_S = 0.05


def _error(status: str, message: object = None) -> JSONResponse:
    code, body = lease_error(status, message)
    return JSONResponse(body, status_code=code)


class _EngineLink:
    """Calls ``agentkv_leases`` on the engine(s) behind this API server."""

    def __init__(self, engine_client: Any) -> None:
        core = getattr(engine_client, "engine_core", None)
        if core is None or not hasattr(core, "call_utility_async"):
            raise RuntimeError(
                "agentkv: vLLM's engine client has no engine_core.call_utility_async; this vLLM "
                "version is not supported by agentkv's lease routes"
            )
        self._core = core

    async def call(self, op: str, payload: dict[str, Any]) -> dict[str, Any]:
        try:
            # With data parallelism the handle's request lives on one engine: ask all, keep the
            # answer of the engine that knows it.
            call_all = getattr(self._core, "call_utility_all_async", None)
            if call_all is not None:
                answers = await call_all(METHOD, op, payload)
            else:
                answers = [await self._core.call_utility_async(METHOD, op, payload)]
        except Exception as exc:
            # vLLM reports engine-side failures as plain exceptions carrying the message; the
            # method is missing where the general plugin did not run in the engine process.
            if "has no attribute" in str(exc) and METHOD in str(exc):
                return {"status": "unavailable"}
            raise
        return _merge(answers)


def _merge(answers: list[Any]) -> dict[str, Any]:
    ranked = ["ok", "pending", "tier_failed", "expired", "invalid", "unknown", "tier_unavailable",
              "unavailable"]
    good = [a for a in answers if isinstance(a, dict) and a.get("status") in ranked]
    if not good:
        return {"status": "unavailable"}
    return min(good, key=lambda a: ranked.index(a["status"]))


def _link(request: Request) -> _EngineLink | None:
    link = getattr(request.app.state, "agentkv_engine", None)
    return link if isinstance(link, _EngineLink) else None


async def _body(request: Request) -> object:
    try:
        return await request.json()
    except ValueError:
        return None


router = APIRouter()


@router.get(INFO_PATH)
async def info(request: Request) -> JSONResponse:
    link = _link(request)
    answer = await link.call("info", {}) if link is not None else {"status": "unavailable"}
    ok = answer.get("status") == "ok"
    tier = answer.get("tier")
    default, cap = answer.get("default_ttl_s"), answer.get("max_ttl_s")
    return JSONResponse(
        ServerInfo(
            leases=ok,
            stream_handles=bool(getattr(request.app.state, "agentkv_stream_handles", False)),
            default_ttl_s=float(default) if ok and default is not None else None,
            max_ttl_s=float(cap) if ok and cap is not None else None,
            tier=tier if ok and isinstance(tier, dict) else None,
        ).to_wire()
    )


class _Wire(Protocol):
    def to_wire(self) -> dict[str, Any]: ...


async def _forward(
    request: Request, parse: Callable[[object], _Wire], op: str, *, pending_ok: bool = False
) -> dict[str, Any] | JSONResponse:
    """Parse the body with ``parse`` and run ``op`` on the engine: the engine's ``ok`` answer,
    or the error response to send (bad body, no engine, or the engine's refusal)."""
    try:
        payload = parse(await _body(request)).to_wire()
    except HintError as exc:
        return _error("invalid", str(exc))
    link = _link(request)
    if link is None:
        return _error("unavailable")
    answer = await link.call(op, payload)
    if answer.get("status") == "ok" or (pending_ok and answer.get("status") == "pending"):
        return answer
    return _error(str(answer.get("status")), answer.get("message"))


@router.post(RELEASE_PATH)
async def release(request: Request) -> JSONResponse:
    answer = await _forward(request, LeaseRef.from_wire, "release")
    if isinstance(answer, JSONResponse):
        return answer
    return JSONResponse({"released": True})


@router.post(RELEASE_REQUEST_PATH)
async def release_request(request: Request) -> JSONResponse:
    answer = await _forward(request, RequestRelease.from_wire, "release_request")
    if isinstance(answer, JSONResponse):
        return answer
    released = answer.get("released")
    return JSONResponse({"released": released if isinstance(released, int) else 0})


async def _extend(request: Request, op: str) -> JSONResponse:
    answer = await _forward(request, ExtendRequest.from_wire, op)
    if isinstance(answer, JSONResponse):
        return answer
    try:
        result = ExtendResult.from_wire(answer)
    except HintError as exc:
        return _error("internal", f"the engine answered a malformed {op}: {exc}")
    return JSONResponse(result.to_wire())


@router.post(EXTEND_PATH)
async def extend(request: Request) -> JSONResponse:
    return await _extend(request, "extend")


@router.post(CLAIM_PATH)
async def claim(request: Request) -> JSONResponse:
    return await _extend(request, "claim")


# Both names of the route: its first (``.../leases/persist``, what every SDK sends: SDK and
# connector may be of different versions, so it stays) and its name from issue 41 on.
@router.post(LEGACY_OFFLOAD_PATH)
@router.post(OFFLOAD_PATH)
async def offload(request: Request) -> JSONResponse:
    """Offload a pinned handle: start the write, then poll the engine until it is committed (or
    failed).

    Each call is a short engine utility call between steps: the workers write on threads of
    their own, so the engine keeps serving every other session while this route waits.
    """
    answer = await _forward(request, OffloadRequest.from_wire, "offload", pending_ok=True)
    if isinstance(answer, JSONResponse):
        return answer
    link = _link(request)
    delay = _POLL_FIRST_S
    while answer.get("status") == "pending" and link is not None:
        await asyncio.sleep(delay)
        delay = min(delay * 2, _POLL_MAX_S)
        answer = await link.call("offload_poll", {"entry": answer.get("entry")})
    if answer.get("status") != "ok":
        return _error(str(answer.get("status")), answer.get("message"))
    return JSONResponse({"tier": answer.get("tier")})


@router.post(TIER_DELETE_PATH)
async def tier_delete(request: Request) -> JSONResponse:
    answer = await _forward(request, TierDelete.from_wire, "tier_delete")
    if isinstance(answer, JSONResponse):
        return answer
    return JSONResponse({"deleted": bool(answer.get("deleted"))})


class AgentKVEndpointPlugin:
    """The ``vllm.endpoint_plugins`` entry point (vLLM's ``EndpointPlugin`` protocol)."""

    name = "agentkv"
    required_tasks = ("generate",)

    def attach_router(self, app: FastAPI) -> None:
        app.include_router(router)

    async def init_state(self, engine_client: Any, state: Any, args: Namespace) -> None:
        if engine_client is None:  # vLLM's CPU-only render server: no engine, no pins
            return
        state.agentkv_engine = _EngineLink(engine_client)
        serving = getattr(state, "openai_serving_chat", None)
        if serving is not None:
            _stream.install(serving)
            state.agentkv_stream_handles = True
