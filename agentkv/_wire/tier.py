"""agentkv's file tier for turn-end KV: wire values shared by the SDK and the vLLM connector.

A pinned decode handle can be **persisted**: decode writes the handle's KV blocks (prompt and
generated tokens it computed) to a file tier on the host and frees its pin. The answer is a
:class:`TierRef`, an opaque 128-bit id and the number of tokens the tier holds::

    POST /v1/agentkv/leases/persist  {"remote_request_id", "remote_block_ids", "lease"}
    200 {"tier": {"v": 1, "id": "<32 hex>", "n_tokens": 1101, "bytes": 25367040}}

The next turn's P leg carries the reference inside ``kv_transfer_params`` (and no live decode
handle); prefill then loads the longest prefix of its prompt that the tier holds, verified
token by token and block by block (checksums), and computes only the rest::

    {"do_remote_decode": true, ..., "agentkv": {"v": 1, "tier": {"id": "...", "n_tokens": 1101}}}

``POST /v1/agentkv/tier/delete {"id": ...}`` answers ``{"deleted": bool}``. Tier usage is in
``GET /v1/agentkv/info`` under ``"tier"`` (:class:`TierUsage`). Errors use the lease routes'
table (``hints.LEASE_ERRORS``): 501 ``tier_unavailable`` (no tier configured), 500
``tier_write_failed`` (the pin is kept).

Pure: no I/O, no vLLM import.

>>> ref = TierRef(id="0" * 32, n_tokens=10)
>>> with_tier({"do_remote_decode": True}, ref)["agentkv"]
{'v': 1, 'tier': {'id': '00000000000000000000000000000000', 'n_tokens': 10}}
>>> TierRef.from_params(with_tier({}, ref)) == ref
True
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from agentkv._wire.hints import HINTS_KEY, WIRE_VERSION, HintError

__all__ = [
    "PERSIST_PATH",
    "TIER_DELETE_PATH",
    "TIER_FAILED",
    "TIER_ID_PATTERN",
    "TIER_KEY",
    "TIER_UNAVAILABLE",
    "PersistResult",
    "TierDelete",
    "TierRef",
    "TierUsage",
    "valid_tier_id",
    "with_tier",
]

PERSIST_PATH = "/v1/agentkv/leases/persist"
TIER_DELETE_PATH = "/v1/agentkv/tier/delete"
# The key of the tier reference inside ``kv_transfer_params["agentkv"]`` and of the persist answer.
TIER_KEY = "tier"

# Error codes (in hints.LEASE_ERRORS, keyed by the engine status of the same name).
TIER_UNAVAILABLE = "tier_unavailable"  # 501: this server has no tier configured
TIER_FAILED = "tier_write_failed"  # 500: the write failed; the pin is kept

# A tier id is 128 random bits in lowercase hex: it names files under the server's tier root,
# so nothing else is ever accepted (no path can be smuggled in).
TIER_ID_PATTERN = re.compile(r"[0-9a-f]{32}")


def valid_tier_id(value: object) -> str:
    """``value`` if it is a well-formed tier id, else :class:`HintError`."""
    if not isinstance(value, str) or not TIER_ID_PATTERN.fullmatch(value):
        raise HintError("a tier id is 32 lowercase hex characters")
    return value


def _count(value: object, what: str) -> int:
    if type(value) is not int or value < 0:
        raise HintError(f"{what} must be a non-negative integer")
    return value


def _object(value: object, what: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise HintError(f"{what} must be an object, got {type(value).__name__}")
    return value


@dataclass(frozen=True, kw_only=True, slots=True)
class TierRef:
    """Where a persisted handle's KV lives: an opaque id on the servers' shared tier, and how
    many tokens (the handle's prompt + generated tokens that decode computed) it holds."""

    id: str
    n_tokens: int

    def __post_init__(self) -> None:
        valid_tier_id(self.id)
        _count(self.n_tokens, "n_tokens")

    def to_wire(self) -> dict[str, Any]:
        return {"id": self.id, "n_tokens": self.n_tokens}

    @classmethod
    def from_wire(cls, value: object) -> TierRef:
        data = _object(value, "a tier reference")
        return cls(id=valid_tier_id(data.get("id")), n_tokens=_count(data.get("n_tokens"),
                                                                      "n_tokens"))

    @classmethod
    def from_params(cls, params: Mapping[str, Any] | None) -> TierRef | None:
        """The tier reference in a P leg's ``kv_transfer_params``; ``None`` when there is none."""
        if not params:
            return None
        raw = params.get(HINTS_KEY)
        if not isinstance(raw, Mapping) or TIER_KEY not in raw:
            return None
        if raw.get("v") != WIRE_VERSION:
            raise HintError(f"the tier reference has wire version {raw.get('v')!r}")
        return cls.from_wire(raw[TIER_KEY])


def with_tier(params: Mapping[str, Any], ref: TierRef) -> dict[str, Any]:
    """A copy of a P leg's ``kv_transfer_params`` that resumes from ``ref``."""
    return {**params, HINTS_KEY: {"v": WIRE_VERSION, TIER_KEY: ref.to_wire()}}


@dataclass(frozen=True, kw_only=True, slots=True)
class PersistResult:
    """The persist route's 200 answer: the reference and the bytes written (all ranks)."""

    ref: TierRef
    bytes: int

    def to_wire(self) -> dict[str, Any]:
        return {TIER_KEY: {"v": WIRE_VERSION, **self.ref.to_wire(), "bytes": self.bytes}}

    @classmethod
    def from_wire(cls, value: object) -> PersistResult:
        data = _object(_object(value, "a persist answer").get(TIER_KEY), "a persist answer's tier")
        if data.get("v") != WIRE_VERSION:
            raise HintError(f"the persist answer has wire version {data.get('v')!r}")
        return cls(ref=TierRef.from_wire(data), bytes=_count(data.get("bytes"), "bytes"))


@dataclass(frozen=True, kw_only=True, slots=True)
class TierDelete:
    """``POST`` :data:`TIER_DELETE_PATH`: remove a persisted entry (a session closed)."""

    id: str

    def __post_init__(self) -> None:
        valid_tier_id(self.id)

    def to_wire(self) -> dict[str, Any]:
        return {"id": self.id}

    @classmethod
    def from_wire(cls, value: object) -> TierDelete:
        return cls(id=valid_tier_id(_object(value, "a tier delete").get("id")))


@dataclass(frozen=True, kw_only=True, slots=True)
class TierUsage:
    """A server's tier in ``GET /v1/agentkv/info`` (``"tier"``; ``null`` without a tier)."""

    bytes: int
    entries: int
    budget_bytes: int
    dir: str

    def to_wire(self) -> dict[str, Any]:
        return {"bytes": self.bytes, "entries": self.entries, "budget_bytes": self.budget_bytes,
                "dir": self.dir}

    @classmethod
    def from_wire(cls, value: object) -> TierUsage:
        data = _object(value, "tier usage")
        directory = data.get("dir")
        if not isinstance(directory, str):
            raise HintError("tier usage has no 'dir'")
        return cls(bytes=_count(data.get("bytes"), "bytes"),
                   entries=_count(data.get("entries"), "entries"),
                   budget_bytes=_count(data.get("budget_bytes"), "budget_bytes"), dir=directory)
