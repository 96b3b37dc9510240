"""agentkv's lease routes on a fake server, as ``agentkv/connector/_endpoint.py`` serves them.

``GET /v1/agentkv/info``, ``POST /v1/agentkv/leases/release`` and ``/extend``: bodies, statuses
and error codes as the endpoint plugin answers them; the decisions are the real connector's
(``LeaseService`` on the engine's ``LeaseBook``, see ``FakeEngine.lease_op``). A server with the
plugin but a stock connector (``FakeCluster(leases=False)`` with ``stream_handles``) answers
``leases: false`` and 501; one without the plugin has no such routes (404).
"""

from __future__ import annotations

import json
from typing import Any, Final

from agentkv._hints import (
    INVALID_REQUEST,
    LEASE_EXPIRED,
    LEASES_UNAVAILABLE,
    UNKNOWN_LEASE,
    ExtendRequest,
    ExtendResult,
    HintError,
    LeaseRef,
    ServerInfo,
)
from agentkv.testing._fake_engine import FakeEngine
from agentkv.testing._fake_reply import Reply

_ERRORS: Final = {
    "unknown": (404, UNKNOWN_LEASE, "no such lease, or not yours"),
    "expired": (410, LEASE_EXPIRED, "the lease has expired; its blocks are being freed"),
    "invalid": (400, INVALID_REQUEST, "not a lease request"),
    "unavailable": (
        501,
        LEASES_UNAVAILABLE,
        "this server's KV connector is not AgentKVConnector; hints are ignored",
    ),
}


def _error(status: str, message: object = None) -> Reply:
    code, name, default = _ERRORS.get(status, (500, "internal", f"lease call answered {status}"))
    text = message if isinstance(message, str) and message else default
    return Reply.error(code, {"error": {"code": name, "message": text}})


def _body(body: bytes) -> Any:
    # FastAPI's request.json(), with the endpoint's "not JSON: treat as no body".
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None


def info(engine: FakeEngine, *, stream_handles: bool) -> Reply:
    answer = engine.lease_op("info", {})
    ok = answer.get("status") == "ok"
    default, cap = answer.get("default_ttl_s"), answer.get("max_ttl_s")
    return Reply(
        json=ServerInfo(
            leases=ok,
            stream_handles=stream_handles,
            default_ttl_s=float(default) if ok and isinstance(default, int | float) else None,
            max_ttl_s=float(cap) if ok and isinstance(cap, int | float) else None,
        ).to_wire()
    )


def release(engine: FakeEngine, body: bytes) -> Reply:
    try:
        ref = LeaseRef.from_wire(_body(body))
    except HintError as exc:
        return _error("invalid", str(exc))
    answer = engine.lease_op("release", ref.to_wire())
    if answer.get("status") != "ok":
        return _error(str(answer.get("status")), answer.get("message"))
    return Reply(json={"released": True})


def extend(engine: FakeEngine, body: bytes) -> Reply:
    try:
        request = ExtendRequest.from_wire(_body(body))
    except HintError as exc:
        return _error("invalid", str(exc))
    answer = engine.lease_op("extend", request.to_wire())
    if answer.get("status") != "ok":
        return _error(str(answer.get("status")), answer.get("message"))
    return Reply(json=ExtendResult.from_wire(answer).to_wire())
