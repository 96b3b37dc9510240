"""agentkv's lease routes on a fake server, as ``agentkv/connector/_endpoint.py`` serves them.

``GET /v1/agentkv/info``, ``POST /v1/agentkv/leases/release``, ``/extend``, ``/claim``,
``/persist`` (the offload; also ``/offload``), ``/v1/agentkv/requests/release`` and
``/v1/agentkv/tier/delete``: bodies, statuses and error codes as the endpoint plugin answers
them; the decisions are the real connector's (``LeaseService`` on the engine's ``LeaseBook``, see
``FakeEngine.lease_op``). A server with the plugin but a stock connector
(``FakeCluster(leases=False)`` with ``stream_handles``) answers ``leases: false`` and 501; one
without the plugin has no such routes (404).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, Protocol

from agentkv._core import (
    ExtendRequest,
    ExtendResult,
    HintError,
    LeaseRef,
    OffloadRequest,
    OffloadResult,
    RequestRelease,
    ServerInfo,
    TierDelete,
    lease_error,
)
from agentkv.testing._fake_engine import FakeEngine
from agentkv.testing._fake_reply import Reply


def _error(status: str, message: object = None) -> Reply:
    code, body = lease_error(status, message)
    return Reply.error(code, body)


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
    tier = answer.get("tier")
    return Reply(
        json=ServerInfo(
            leases=ok,
            stream_handles=stream_handles,
            default_ttl_s=float(default) if ok and isinstance(default, int | float) else None,
            max_ttl_s=float(cap) if ok and isinstance(cap, int | float) else None,
            tier=tier if ok and isinstance(tier, dict) else None,
        ).to_wire()
    )


class _Wire(Protocol):
    def to_wire(self) -> dict[str, Any]: ...


def _forward(
    engine: FakeEngine, body: bytes, parse: Callable[[object], _Wire], op: str
) -> dict[str, Any] | Reply:
    """As the endpoint plugin's ``_forward``: the engine's ``ok`` answer, or the error reply."""
    try:
        payload = parse(_body(body)).to_wire()
    except HintError as exc:
        return _error("invalid", str(exc))
    answer = engine.lease_op(op, payload)
    if answer.get("status") != "ok":
        return _error(str(answer.get("status")), answer.get("message"))
    return answer


def release(engine: FakeEngine, body: bytes) -> Reply:
    answer = _forward(engine, body, LeaseRef.from_wire, "release")
    return answer if isinstance(answer, Reply) else Reply(json={"released": True})


def release_request(engine: FakeEngine, body: bytes) -> Reply:
    answer = _forward(engine, body, RequestRelease.from_wire, "release_request")
    if isinstance(answer, Reply):
        return answer
    released = answer.get("released")
    return Reply(json={"released": released if isinstance(released, int) else 0})


def extend(engine: FakeEngine, body: bytes, op: str = "extend") -> Reply:
    """``extend`` or ``claim`` (the same body and answer; a claim's carries the new secret)."""
    answer = _forward(engine, body, ExtendRequest.from_wire, op)
    if isinstance(answer, Reply):
        return answer
    return Reply(json=ExtendResult.from_wire(answer).to_wire())


def offload(engine: FakeEngine, body: bytes) -> Reply:
    answer = _forward(engine, body, OffloadRequest.from_wire, "offload")
    if isinstance(answer, Reply):
        return answer
    return Reply(json={"tier": OffloadResult.from_wire(answer).to_wire()["tier"]})


def tier_delete(engine: FakeEngine, body: bytes) -> Reply:
    answer = _forward(engine, body, TierDelete.from_wire, "tier_delete")
    if isinstance(answer, Reply):
        return answer
    return Reply(json={"deleted": bool(answer.get("deleted"))})
