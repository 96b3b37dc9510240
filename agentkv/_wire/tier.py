"""agentkv's file tier for turn-end KV: wire values shared by the SDK and the vLLM connector.

A pinned decode handle can be **offloaded**: decode writes the handle's KV blocks (prompt and
generated tokens it computed) to a file tier on the host and frees its pin. The answer is a
:class:`TierRef` (the **tier entry**): an opaque 128-bit id, the number of tokens the tier holds,
and the entry's secret (only the offloading client learns it; the delete needs it). ``ttl_s`` in
the request asks for a time to live other than the server's default (capped by the server); the
answer says what was granted::

    POST /v1/agentkv/leases/persist  {"remote_request_id", "remote_block_ids", "lease", "ttl_s"?}
    200 {"tier": {"v": 1, "id": "<32 hex>", "n_tokens": 1101, "secret": "...", "bytes": 25367040,
                  "ttl_s": 86400.0}}

The route keeps its first name, ``.../leases/persist`` (:data:`LEGACY_OFFLOAD_PATH`), which every
connector serves and the SDK sends to: SDK and connector may be of different versions. Connectors
from issue 41 on also serve :data:`OFFLOAD_PATH` (``.../leases/offload``), the same call; the SDK
moves to it once no supported connector lacks it.

The next turn's P leg carries the reference inside ``kv_transfer_params`` (and no live decode
handle); prefill then loads the longest prefix of its prompt that the tier holds, verified
token by token and block by block (checksums), and computes only the rest::

    {"do_remote_decode": true, ..., "agentkv": {"v": 1, "tier": {"id": "...", "n_tokens": 1101}}}

Prefill's answer to such a P leg says how the reference served (:class:`TierLoadReport`): the
prompt tokens whose KV came from the entry (or that prefill's own cache already held) and, when
that is less than it could have been, why; the SDK puts that reason into the turn's
``handle_reason``::

    {"do_remote_prefill": true, ..., "agentkv": {"v": 1, "tier_load": {"tokens": 512,
                                                                        "reason": "tokens"}}}

The P leg never carries the secret: loading needs the exact tokens, and the id is 128 random
bits. ``POST /v1/agentkv/tier/delete {"id": ..., "secret": ...}`` answers ``{"deleted": true}``,
or 404 ``unknown_lease`` alike for a missing entry and a wrong secret. Tier usage is in
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
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from agentkv._wire.hints import HINTS_KEY, WIRE_VERSION, HintError, LeaseRef, positive_seconds

__all__ = [
    "LEGACY_OFFLOAD_PATH",
    "OFFLOAD_PATH",
    "TIER_DELETE_PATH",
    "TIER_FAILED",
    "TIER_ID_PATTERN",
    "TIER_KEY",
    "TIER_LOAD_KEY",
    "TIER_UNAVAILABLE",
    "OffloadRequest",
    "OffloadResult",
    "TierDelete",
    "TierLoadReport",
    "TierRef",
    "TierUsage",
    "valid_tier_id",
    "with_tier",
    "with_tier_load",
]

# The offload route: its wire name since wire version 1 (every connector serves it; the SDK sends
# to it), and its name from issue 41 on (served beside it by newer connectors). See the docstring.
LEGACY_OFFLOAD_PATH = "/v1/agentkv/leases/persist"
OFFLOAD_PATH = "/v1/agentkv/leases/offload"
TIER_DELETE_PATH = "/v1/agentkv/tier/delete"
# The key of the tier reference inside ``kv_transfer_params["agentkv"]`` and of the offload answer.
TIER_KEY = "tier"
# The key of prefill's report on a tier reference, in its answer's params (``TierLoadReport``).
TIER_LOAD_KEY = "tier_load"

# Error codes (in hints.LEASE_ERRORS, keyed by the engine status of the same name).
TIER_UNAVAILABLE = "tier_unavailable"  # 501: this server has no tier configured
TIER_FAILED = "tier_write_failed"  # 500: the write failed; the pin is kept

# A tier id is 128 random bits in lowercase hex: it names files under the server's tier root,
# so nothing else is ever accepted (no path can be smuggled in).
TIER_ID_PATTERN = re.compile(r"[0-9a-f]{32}")
# An entry's secret as the server mints it (``secrets.token_urlsafe``); bounded, URL-safe.
TIER_SECRET_PATTERN = re.compile(r"[A-Za-z0-9_-]{16,128}")


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
    if type(value) is not dict and not isinstance(value, Mapping):
        raise HintError(f"{what} must be an object, got {type(value).__name__}")
    return value


def _secret(value: object) -> str:
    if not isinstance(value, str) or not TIER_SECRET_PATTERN.fullmatch(value):
        raise HintError("a tier secret is 16 to 128 URL-safe characters")
    return value


def _agentkv_field(params: Mapping[str, Any] | None, key: str, what: str) -> object:
    """``params["agentkv"][key]``, ``None`` when absent; ``HintError`` for another wire version."""
    raw = params.get(HINTS_KEY) if params else None
    # Parsed JSON is a dict; Mapping's ABC check is for other callers' (and costs a turn more).
    if raw is None or (type(raw) is not dict and not isinstance(raw, Mapping)) or key not in raw:
        return None
    if raw.get("v") != WIRE_VERSION:
        raise HintError(f"{what} has wire version {raw.get('v')!r}")
    return raw[key]


@dataclass(frozen=True, kw_only=True, slots=True)
class TierRef:
    """Where an offloaded handle's KV lives (a tier entry): an opaque id on the servers' shared
    tier, and how many tokens (the handle's prompt + generated tokens that decode computed) it
    holds.

    ``secret`` is the entry's delete capability, as the offload answer gave it to the client
    that offloaded it (``None``: a reference from a P leg, or from a session saved before tier
    secrets, which cannot delete its entry; the entry then expires with its TTL). It is no part
    of the reference's identity and is never shown (``repr``) nor sent to prefill (``to_wire``).
    """

    id: str
    n_tokens: int
    secret: str | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        valid_tier_id(self.id)
        _count(self.n_tokens, "n_tokens")
        if self.secret is not None:
            _secret(self.secret)

    def to_wire(self, *, with_secret: bool = False) -> dict[str, Any]:
        """The reference as a P leg carries it; ``with_secret``: as its owner keeps it (the
        offload answer, a saved session)."""
        wire: dict[str, Any] = {"id": self.id, "n_tokens": self.n_tokens}
        if with_secret and self.secret is not None:
            wire["secret"] = self.secret
        return wire

    @classmethod
    def from_wire(cls, value: object) -> TierRef:
        data = _object(value, "a tier reference")
        secret = data.get("secret")
        return cls(id=valid_tier_id(data.get("id")),
                   n_tokens=_count(data.get("n_tokens"), "n_tokens"),
                   secret=None if secret is None else _secret(secret))

    @classmethod
    def from_params(cls, params: Mapping[str, Any] | None) -> TierRef | None:
        """The tier reference in a P leg's ``kv_transfer_params``; ``None`` when there is none."""
        raw = _agentkv_field(params, TIER_KEY, "the tier reference")
        return None if raw is None else cls.from_wire(raw)


def with_tier(params: Mapping[str, Any], ref: TierRef) -> dict[str, Any]:
    """A copy of a P leg's ``kv_transfer_params`` that resumes from ``ref``."""
    return {**params, HINTS_KEY: {"v": WIRE_VERSION, TIER_KEY: ref.to_wire()}}


# Why a reference served what it did: a short word (also a metric label, so a bounded set on the
# server), and what it means in a turn's ``handle_reason`` ("{tokens}": where the entry stopped
# serving). A word this table lacks (a newer server) still reads as the word itself.
_LOAD_REASONS: Mapping[str, str] = {
    "ok": "the tier served {tokens} tokens",
    "cached": "prefill's own cache already held the tier's {tokens} tokens",
    "missing": "the tier entry is gone (evicted, deleted or unreadable): prefill recomputed it",
    "tokens": "the tier entry differs from the prompt at token {tokens}: prefill recomputed "
    "from there",
    "fingerprint": "the tier entry was written for another model or KV layout: prefill "
    "recomputed it",
    "salt": "the tier entry belongs to another cache_salt: prefill recomputed it",
    "lora": "the tier entry was written with another LoRA adapter: prefill recomputed it",
    "expired": "the tier entry has expired: prefill recomputed it",
    "truncated": "the tier entry's data ends before token {tokens}: prefill recomputed from "
    "there",
    "load_failed": "the tier's blocks from token {tokens} on did not load intact (checksum or "
    "read error): prefill recomputed from there",
}
_REASON_PATTERN = re.compile(r"[a-z][a-z0-9_]{0,31}")
# Reasons that are no shortfall: the entry served all the prompt could take from it.
_SERVED = frozenset({"ok", "cached"})


def _reason(value: object) -> str:
    if not isinstance(value, str) or not _REASON_PATTERN.fullmatch(value):
        raise HintError("a tier load reason is a short lowercase word")
    return value


@dataclass(frozen=True, kw_only=True, slots=True)
class TierLoadReport:
    """How prefill served a P leg's tier reference: ``tokens`` leading prompt tokens had their KV
    from the entry (loaded, or already in prefill's own cache), and ``reason`` says why not more.

    >>> report = TierLoadReport(tokens=512, reason="tokens")
    >>> report.short, report.describe()
    (True, 'the tier entry differs from the prompt at token 512: prefill recomputed from there')
    >>> TierLoadReport.from_params(with_tier_load({}, report)) == report
    True
    """

    tokens: int
    reason: str

    def __post_init__(self) -> None:
        _count(self.tokens, "tokens")
        _reason(self.reason)

    @property
    def short(self) -> bool:
        """Whether the entry served less than the prompt could have taken from it."""
        return self.reason not in _SERVED

    def describe(self) -> str:
        text = _LOAD_REASONS.get(self.reason, "the tier load stopped at token {tokens}: "
                                 + self.reason)
        return text.format(tokens=self.tokens)

    def to_wire(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "reason": self.reason}

    @classmethod
    def from_wire(cls, value: object) -> TierLoadReport:
        data = _object(value, "a tier load report")
        return cls(tokens=_count(data.get("tokens"), "tokens"), reason=_reason(data.get("reason")))

    @classmethod
    def from_params(cls, params: Mapping[str, Any] | None) -> TierLoadReport | None:
        """The report in a P leg's answer (``kv_transfer_params``); ``None`` when there is none."""
        raw = _agentkv_field(params, TIER_LOAD_KEY, "the tier load report")
        return None if raw is None else cls.from_wire(raw)


def with_tier_load(params: Mapping[str, Any], report: TierLoadReport) -> dict[str, Any]:
    """A copy of prefill's answer ``params`` carrying ``report`` (beside any other agentkv key)."""
    raw = params.get(HINTS_KEY)
    ours = dict(raw) if isinstance(raw, Mapping) else {}
    return {**params, HINTS_KEY: {**ours, "v": WIRE_VERSION, TIER_LOAD_KEY: report.to_wire()}}


@dataclass(frozen=True, kw_only=True, slots=True)
class OffloadRequest:
    """``POST`` :data:`LEGACY_OFFLOAD_PATH` (or :data:`OFFLOAD_PATH`): write a leased handle to the
    tier and free its pin.

    ``ttl_s`` asks for the entry's time to live (``None``: the server's default); the server
    caps it at its maximum. ``keep``: write a copy and keep the pin (a fork's own tier entry,
    its parent keeping the pin); only sent to a decode whose info says ``tier.copy`` (an older
    one would ignore the key and free the pin).

    >>> ref = LeaseRef(request_id="r", block_ids=((1,),), lease="s3cret")
    >>> OffloadRequest(ref=ref, ttl_s=600).to_wire()["ttl_s"]
    600.0
    >>> OffloadRequest.from_wire({**ref.to_wire(), "keep": True}).keep
    True
    """

    ref: LeaseRef
    ttl_s: float | None = None
    keep: bool = False

    def __post_init__(self) -> None:
        if self.ttl_s is not None:
            object.__setattr__(self, "ttl_s", positive_seconds(self.ttl_s, "ttl_s"))

    def to_wire(self) -> dict[str, Any]:
        wire = self.ref.to_wire()
        if self.ttl_s is not None:
            wire["ttl_s"] = self.ttl_s
        if self.keep:
            wire["keep"] = True
        return wire

    @classmethod
    def from_wire(cls, value: object) -> OffloadRequest:
        data = _object(value, "an offload request")
        ttl = data.get("ttl_s")
        keep = data.get("keep", False)
        if not isinstance(keep, bool):
            raise HintError("keep must be a boolean")
        return cls(ref=LeaseRef.from_wire(data),
                   ttl_s=None if ttl is None else positive_seconds(ttl, "ttl_s"), keep=keep)


@dataclass(frozen=True, kw_only=True, slots=True)
class OffloadResult:
    """The offload route's 200 answer: the reference (with the entry's secret), the bytes
    written (all ranks) and the time to live the server granted (``None``: an older server)."""

    ref: TierRef
    bytes: int
    ttl_s: float | None = None

    def to_wire(self) -> dict[str, Any]:
        tier = {"v": WIRE_VERSION, **self.ref.to_wire(with_secret=True), "bytes": self.bytes}
        if self.ttl_s is not None:
            tier["ttl_s"] = self.ttl_s
        return {TIER_KEY: tier}

    @classmethod
    def from_wire(cls, value: object) -> OffloadResult:
        answer = _object(value, "an offload answer")
        data = _object(answer.get(TIER_KEY), "an offload answer's tier")
        if data.get("v") != WIRE_VERSION:
            raise HintError(f"the offload answer has wire version {data.get('v')!r}")
        ttl = data.get("ttl_s")
        return cls(ref=TierRef.from_wire(data), bytes=_count(data.get("bytes"), "bytes"),
                   ttl_s=None if ttl is None else positive_seconds(ttl, "ttl_s"))


@dataclass(frozen=True, kw_only=True, slots=True)
class TierDelete:
    """``POST`` :data:`TIER_DELETE_PATH`: remove a tier entry (a session closed), with the
    entry's secret from the offload answer: a wrong one is answered as a missing entry."""

    id: str
    secret: str = field(repr=False)

    def __post_init__(self) -> None:
        valid_tier_id(self.id)
        _secret(self.secret)

    def to_wire(self) -> dict[str, Any]:
        return {"id": self.id, "secret": self.secret}

    @classmethod
    def from_wire(cls, value: object) -> TierDelete:
        data = _object(value, "a tier delete")
        return cls(id=valid_tier_id(data.get("id")), secret=_secret(data.get("secret")))


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


# The names before issue 41 ("persist" meant three things; this call is the tier's offload).
_RENAMED = {
    "PERSIST_PATH": ("LEGACY_OFFLOAD_PATH", LEGACY_OFFLOAD_PATH),
    "PersistRequest": ("OffloadRequest", OffloadRequest),
    "PersistResult": ("OffloadResult", OffloadResult),
}


def __getattr__(name: str) -> Any:
    # PEP 562: the old names still import, with a DeprecationWarning, for one release.
    if name in _RENAMED:
        new, value = _RENAMED[name]
        warnings.warn(
            f"agentkv {name} is deprecated; use {new}", DeprecationWarning, stacklevel=2
        )
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
