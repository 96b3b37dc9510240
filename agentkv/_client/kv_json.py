"""A session's reusable KV (``kv.KV``) in a save file: one tagged object, and the older fields.

Since version 4 a save file holds ``"kv": {"kind": "none" | "pinned" | "tier", ...}``; files of
versions 1-3 spread the same over ``handle``, ``tier``, ``lost`` and ``wait_note``, and still
load. A handle's deadlines live on the session's monotonic clock, which means nothing to another
process: the file stores them as wall-clock times and loading converts them back, so a handle
that ran out while the agent was down is not attached (the turn recomputes).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from agentkv._client.kv import KV, NO_KV, NoKV, OnTier, Pinned
from agentkv._exceptions import SessionLoadError
from agentkv._types import HandleState, KVHandle
from agentkv._wire.handoff import split_params
from agentkv._wire.tier import TierRef

__all__ = ["kv_from_json", "kv_to_json", "saved_field", "saved_optional"]


def saved_field(data: Mapping[str, Any], key: str, kind: type | tuple[type, ...]) -> Any:
    """``data[key]`` if it is a ``kind``, else ``SessionLoadError``."""
    value = data.get(key)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise SessionLoadError(f"saved session: {key!r} is missing or of the wrong type")
    return value


def saved_optional(data: Mapping[str, Any], key: str, kind: type | tuple[type, ...]) -> Any:
    """``data[key]`` if it is a ``kind``, ``None`` if absent or null, else ``SessionLoadError``."""
    return None if data.get(key) is None else saved_field(data, key, kind)


_field, _optional = saved_field, saved_optional


def _handle_json(handle: KVHandle, *, now: float, wall: float) -> dict[str, Any]:
    return {
        "pair": handle.pair,
        "engine_id": handle.engine_id,
        "request_id": handle.request_id,
        "block_ids": [list(group) for group in handle.block_ids],
        "host": handle.host,
        "port": handle.port,
        "num_tokens": handle.num_tokens,
        # Monotonic times mean nothing to another process: stored as wall-clock times.
        "issued_at_wall": wall + (handle.issued_at - now),
        "deadline_wall": wall + (handle.deadline - now),
        "server_expiry": handle.server_expiry,
        "lease_ttl_s": handle.lease_ttl_s,
        "extends": handle.extends,
        "lease": handle.lease,
        "extra": dict(handle.extra),
    }


def kv_to_json(kv: KV, *, now: float, wall: float) -> dict[str, Any]:
    """``kv`` as the save file's tagged object (``now``: the session clock's time, ``wall``:
    the wall clock's). A handle's lease secret and a tier entry's secret are in it."""
    body: dict[str, Any]
    if isinstance(kv, Pinned):
        body = {"kind": "pinned", "handle": _handle_json(kv.handle, now=now, wall=wall)}
    elif isinstance(kv, OnTier):
        body = {
            "kind": "tier",
            **kv.ref.to_wire(with_secret=True),
            "pair": kv.pair,
            "digest": kv.digest,
        }
    else:
        body = {"kind": "none", "reason": kv.reason.value, "detail": kv.detail}
    body["note"] = kv.note
    return body


def _handle(data: Mapping[str, Any], *, now: float, wall: float) -> KVHandle:
    if "params" in data:  # version 2 and older: decode's params as sent, lease secret inside
        extra, lease = split_params(_field(data, "params", dict))
    else:
        extra = MappingProxyType(dict(_field(data, "extra", dict)))
        lease = _optional(data, "lease", str)
    return KVHandle(
        pair=_field(data, "pair", str),
        engine_id=_field(data, "engine_id", str),
        request_id=_field(data, "request_id", str),
        block_ids=tuple(tuple(int(b) for b in group) for group in _field(data, "block_ids", list)),
        host=_field(data, "host", str),
        port=_field(data, "port", int),
        num_tokens=_field(data, "num_tokens", int),
        issued_at=now + (_field(data, "issued_at_wall", (int, float)) - wall),
        deadline=now + (_field(data, "deadline_wall", (int, float)) - wall),
        server_expiry=_optional(data, "server_expiry", (int, float)),
        lease_ttl_s=_optional(data, "lease_ttl_s", (int, float)),
        extends=_field(data, "extends", int),
        lease=lease,
        extra=extra,
    )


def _tier(data: Mapping[str, Any], note: str | None) -> OnTier:
    return OnTier(
        ref=TierRef.from_wire(data),
        pair=_field(data, "pair", str),
        digest=_field(data, "digest", str),
        note=note,
    )


def kv_from_json(saved: Mapping[str, Any], *, now: float, wall: float) -> KV:  # noqa: PLR0911 - one return per kind and per older field
    """The KV of a save file's dict ``saved``: its tagged ``kv`` object, or (versions 1-3) its
    ``handle``, ``tier``, ``lost`` and ``wait_note`` fields."""
    data = _optional(saved, "kv", dict)
    if data is not None:
        note = _optional(data, "note", str)
        kind = data.get("kind")
        if kind == "pinned":
            return Pinned(
                handle=_handle(_field(data, "handle", dict), now=now, wall=wall), note=note
            )
        if kind == "tier":
            return _tier(data, note)
        if kind == "none":
            reason = HandleState(_field(data, "reason", str))
            return NoKV(reason=reason, detail=_field(data, "detail", str), note=note)
        raise SessionLoadError(f"saved session: unknown kv kind {kind!r}")
    note = _optional(saved, "wait_note", str)
    raw_handle = _optional(saved, "handle", dict)
    if raw_handle is not None:
        return Pinned(handle=_handle(raw_handle, now=now, wall=wall), note=note)
    raw_tier = _optional(saved, "tier", dict)
    if raw_tier is not None:
        return _tier(raw_tier, note)
    raw_lost = _optional(saved, "lost", list)
    if raw_lost is None:
        return NoKV(note=note) if note else NO_KV
    return NoKV(reason=HandleState(raw_lost[0]), detail=str(raw_lost[1]), note=note)
