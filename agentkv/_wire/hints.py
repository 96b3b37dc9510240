"""agentkv's cache hints and lease calls: typed values and wire form, shared by SDK and server.

The SDK knows what vLLM's decode node cannot: whether a session will send another turn, and how
long its tool call will run. It says so in two ways, both understood only by agentkv's vLLM
extension (``agentkv.connector``); a stock server ignores them (``kv_transfer_params`` is an open
dict and vLLM reads only its own keys), so they are always safe to send.

1. **Pin hint**, on the D leg, inside ``kv_transfer_params`` under the namespaced key
   ``"agentkv"``: pin this request's turn-end KV for ``ttl_s`` seconds, or do not pin it at all
   (the session's last turn, a one-shot request)::

       {"agentkv": {"v": 1, "persist": true, "ttl_s": 120.0}}
       {"agentkv": {"v": 1, "persist": false}}

   The wire key stays ``"persist"`` (SDK and connector of different versions must understand each
   other); in code the hint is a :class:`PinHint` and its flag ``pin``.

   Decode answers with an acknowledgement under the same key in its returned
   ``kv_transfer_params`` (:class:`LeaseAck`): ``{"v": 1, "pinned": true, "lease": "<secret>",
   "ttl_s": 120.0}``. No ``"agentkv"`` key in the answer means the extension is absent.

2. **Lease calls**, HTTP on the decode server that holds the handle (:data:`RELEASE_PATH`,
   :data:`EXTEND_PATH`, :data:`CLAIM_PATH`), with a :class:`LeaseRef` (the handle's
   ``remote_request_id``, ``remote_block_ids`` and lease secret) as the body. They are calls and
   not hints on a later request because release must work when there is no later request (a
   closed session), and extend must answer with the new deadline before the tool call ends.
   A **claim** is an extend that also rotates the secret: of several holders of one handle (a
   save file loaded twice, a load beside the session that saved it), exactly one claim succeeds
   and every other holder's secret is void from then on, so at most one of them attaches it.

Everything here is pure: no I/O, no clock, no vLLM import.

>>> hint = PinHint(ttl_s=90)
>>> with_hint({"do_remote_prefill": True}, hint)["agentkv"]
{'v': 1, 'persist': True, 'ttl_s': 90.0}
>>> PinHint.from_wire({"v": 1, "persist": False})
PinHint(pin=False, ttl_s=None)
"""

from __future__ import annotations

import hashlib
import math
import re
import secrets
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "CLAIM_PATH",
    "EXTEND_PATH",
    "HINTS_KEY",
    "INFO_PATH",
    "LEASE_ERRORS",
    "RELEASE_PATH",
    "RELEASE_REQUEST_PATH",
    "REQUEST_TAG_PREFIX",
    "WIRE_VERSION",
    "ExtendRequest",
    "ExtendResult",
    "HintError",
    "LeaseAck",
    "LeaseRef",
    "PinHint",
    "RequestRelease",
    "ServerInfo",
    "for_prefill",
    "new_request_secret",
    "positive_seconds",
    "request_tag",
    "tag_of_request_id",
    "with_expiry",
    "with_hint",
]

HINTS_KEY = "agentkv"
WIRE_VERSION = 1

# Under /v1 so that vLLM's --api-key guards them like the completions routes.
INFO_PATH = "/v1/agentkv/info"
RELEASE_PATH = "/v1/agentkv/leases/release"
EXTEND_PATH = "/v1/agentkv/leases/extend"
# Extend and take the lease for oneself: decode answers with a new secret, the old one is void.
CLAIM_PATH = "/v1/agentkv/leases/claim"
# Release by the secret behind a D leg's client-chosen request id (see :class:`RequestRelease`).
RELEASE_REQUEST_PATH = "/v1/agentkv/requests/release"

# Error codes in {"error": {"code": ..., "message": ...}} answers of the lease routes.
UNKNOWN_LEASE = "unknown_lease"  # 404: no such pin, or not the caller's (indistinguishable)
LEASE_EXPIRED = "lease_expired"  # 410: the caller's pin, but its deadline has passed
INVALID_REQUEST = "invalid_request"  # 400: the body is not a lease reference
LEASES_UNAVAILABLE = "leases_unavailable"  # 501: the server runs without AgentKVConnector

# The one table of lease-call errors: the engine's status -> (HTTP status, code, message). The
# endpoint plugin and the fake servers both answer from it.
LEASE_ERRORS: Mapping[str, tuple[int, str, str]] = {
    "unknown": (404, UNKNOWN_LEASE, "no such lease, or not yours"),
    "expired": (410, LEASE_EXPIRED, "the lease has expired; its blocks are being freed"),
    "invalid": (400, INVALID_REQUEST, "not a lease request"),
    "unavailable": (
        501,
        LEASES_UNAVAILABLE,
        "this server's KV connector is not AgentKVConnector; hints are ignored",
    ),
    # The file tier (agentkv/_wire/tier.py; the codes are spelled out to keep this module first).
    "tier_unavailable": (501, "tier_unavailable", "this server has no KV file tier configured"),
    "tier_failed": (500, "tier_write_failed", "writing the KV to the tier failed; still pinned"),
}


def lease_error(status: str, message: object = None) -> tuple[int, dict[str, Any]]:
    """The HTTP status and body of a lease route's answer for an engine ``status``."""
    code, name, default = LEASE_ERRORS.get(
        status, (500, "internal", f"lease call answered {status}")
    )
    text = message if isinstance(message, str) and message else default
    return code, {"error": {"code": name, "message": text}}


# A D leg's client-chosen request id (vLLM's ``X-Request-Id``) is this prefix and the SHA-256 of
# a secret only the client knows. vLLM names the engine request ``chatcmpl-{X-Request-Id}`` plus
# ``-`` and 8 random characters (unless VLLM_DISABLE_REQUEST_ID_RANDOMIZATION is set).
REQUEST_TAG_PREFIX = "agentkv-"
_ENGINE_ID = re.compile(r"chatcmpl-(agentkv-[0-9a-f]{64})(?:-[0-9A-Za-z]{1,16})?")


def new_request_secret() -> str:
    """A fresh secret for one D leg (128 random bits, as hex: base64's pure-Python layers cost a
    cold turn ~8 us more, and decode takes any short string)."""
    return secrets.token_hex(16)


def request_tag(secret: str) -> str:
    """The request id a D leg is sent with: ``agentkv-`` + hex SHA-256 of its secret.

    >>> request_tag("s3cret")[:20]
    'agentkv-1ec1c26b50d5'
    """
    return REQUEST_TAG_PREFIX + hashlib.sha256(secret.encode()).hexdigest()


def tag_of_request_id(request_id: str) -> str | None:
    """The client's tag inside vLLM's engine request id, or ``None`` (not chosen by agentkv).

    >>> tag = request_tag("s3cret")
    >>> tag_of_request_id(f"chatcmpl-{tag}-1a2b3c4d") == tag
    True
    >>> tag_of_request_id("chatcmpl-0f1e2d-1a2b3c4d") is None
    True
    """
    match = _ENGINE_ID.fullmatch(request_id)
    return match.group(1) if match else None


class HintError(ValueError):
    """A hint, lease reference or lease answer is malformed (wrong type, range or version)."""


def positive_seconds(value: object, what: str) -> float:
    """``value`` as a positive, finite number of seconds, else :class:`HintError`."""
    # bool is an int subclass; a JSON true is never a duration.
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise HintError(f"{what} must be a number, got {type(value).__name__}")
    number = float(value)
    if not math.isfinite(number) or number <= 0:
        raise HintError(f"{what} must be a positive finite number of seconds, got {value!r}")
    return number


def _object(value: object, what: str) -> Mapping[str, Any]:
    # Parsed JSON is a dict: its exact type answers before Mapping's ABC check.
    if type(value) is not dict and not isinstance(value, Mapping):
        raise HintError(f"{what} must be an object, got {type(value).__name__}")
    return value


def _version(data: Mapping[str, Any], what: str) -> None:
    version = data.get("v")
    if version != WIRE_VERSION:
        raise HintError(f"{what} has wire version {version!r}; this agentkv speaks {WIRE_VERSION}")


_INT_ONLY = frozenset({int})  # bool is an int subclass; a JSON true is never a block id


def _block_ids(value: object) -> tuple[tuple[int, ...], ...]:
    """vLLM's ``remote_block_ids``: one list of block ids per KV cache group."""
    if not isinstance(value, list | tuple) or not value:
        raise HintError("remote_block_ids must be a non-empty list of block-id lists")
    groups = value if isinstance(value[0], list | tuple) else [value]  # a flat list: one group
    out = []
    for group in groups:
        # Checked in C (types as a set, then the minimum): a handle holds hundreds of blocks.
        if not isinstance(group, list | tuple) or not (
            set(map(type, group)) <= _INT_ONLY and (not group or min(group) >= 0)
        ):
            raise HintError("remote_block_ids must hold lists of non-negative integers")
        out.append(group if type(group) is tuple else tuple(group))
    if not any(out):
        raise HintError("remote_block_ids names no block")
    return tuple(out)


def _text(value: object, what: str, *, limit: int = 512) -> str:
    if not isinstance(value, str) or not value or len(value) > limit:
        raise HintError(f"{what} must be a non-empty string of at most {limit} characters")
    return value


# The wire key of the pin flag: "persist" since wire version 1, kept so that SDKs and connectors of
# different versions understand each other (the word in code is "pin").
_PIN_KEY = "persist"


@dataclass(frozen=True, kw_only=True, slots=True)
class PinHint:
    """What decode does with a D leg's turn-end KV: pin it for ``ttl_s`` seconds, or not at all.

    ``ttl_s=None`` keeps the server's default (``decoder_kv_blocks_ttl``); the server caps it at its
    ``agentkv_max_ttl_s``. Send ``PinHint(pin=False)`` on a session's last turn.
    """

    pin: bool = True
    ttl_s: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.pin, bool):
            raise HintError("pin must be a bool")
        if self.ttl_s is not None:
            if not self.pin:
                raise HintError("ttl_s has no meaning when pin is false")
            object.__setattr__(self, "ttl_s", positive_seconds(self.ttl_s, "ttl_s"))

    @property
    def persist(self) -> bool:
        """Deprecated: the old name of :attr:`pin`."""
        warnings.warn(
            "PinHint.persist is deprecated; read PinHint.pin", DeprecationWarning, stacklevel=2
        )
        return self.pin

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {"v": WIRE_VERSION, _PIN_KEY: self.pin}
        if self.ttl_s is not None:
            wire["ttl_s"] = self.ttl_s
        return wire

    @classmethod
    def from_wire(cls, value: object) -> PinHint:
        data = _object(value, f"kv_transfer_params.{HINTS_KEY}")
        _version(data, "the pin hint")
        pin = data.get(_PIN_KEY, True)
        if not isinstance(pin, bool):
            raise HintError(f"{_PIN_KEY} must be a bool")
        ttl = data.get("ttl_s")
        return cls(pin=pin, ttl_s=None if ttl is None else positive_seconds(ttl, "ttl_s"))


class _PersistHint:
    """Deprecated: :class:`PinHint` under its old name, which took ``persist=`` for ``pin=``.

    Calling it builds a :class:`PinHint` (so equality with new hints holds); ``isinstance``
    checks must use :class:`PinHint`.
    """

    def __new__(cls, *, persist: bool = True, ttl_s: float | None = None) -> PinHint:  # type: ignore[misc]
        return PinHint(pin=persist, ttl_s=ttl_s)

    from_wire = PinHint.from_wire


def __getattr__(name: str) -> Any:
    # PEP 562: the old class name still imports, with a DeprecationWarning, for one release.
    if name == "PersistHint":
        warnings.warn(
            "agentkv PersistHint is deprecated; use PinHint (pin= for persist=)",
            DeprecationWarning,
            stacklevel=2,
        )
        return _PersistHint
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def with_hint(params: Mapping[str, Any], hint: PinHint) -> dict[str, Any]:
    """A copy of a D leg's ``kv_transfer_params`` carrying ``hint``."""
    return {**params, HINTS_KEY: hint.to_wire()}


def for_prefill(params: Mapping[str, Any]) -> dict[str, Any]:
    """A decode handle as the next P leg sends it: without agentkv's key (the lease secret is for
    decode's lease routes only; prefill ignores the key but need not see it)."""
    return {k: v for k, v in params.items() if k != HINTS_KEY}


def with_expiry(params: Mapping[str, Any], result: ExtendResult) -> dict[str, Any]:
    """A decode handle after a successful extend: prefill declines a pull within 5 s of the handle's
    ``remote_blocks_expiry_time``, so the next P leg must carry the extended deadline. After a
    claim the handle also carries the new lease secret (the old one no longer works)."""
    extended = {**params, "remote_blocks_expiry_time": result.expiry}
    if result.lease is not None:
        ack = params.get(HINTS_KEY)
        extended[HINTS_KEY] = {**(ack if isinstance(ack, Mapping) else {}), "lease": result.lease}
    return extended


@dataclass(frozen=True, kw_only=True, slots=True)
class LeaseAck:
    """Decode's answer to a pin hint, read from the D leg's returned ``kv_transfer_params``.

    ``lease`` is the secret that, with the handle's request id and block ids, authorizes release and
    extend. ``error`` says why a malformed hint was ignored (decode then pinned as stock vLLM does).
    """

    pinned: bool
    lease: str | None = None
    ttl_s: float | None = None
    error: str | None = None

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {"v": WIRE_VERSION, "pinned": self.pinned}
        if self.lease is not None:
            wire["lease"] = self.lease
        if self.ttl_s is not None:
            wire["ttl_s"] = self.ttl_s
        if self.error is not None:
            wire["error"] = self.error
        return wire

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> LeaseAck | None:
        """The acknowledgement in D's returned params; ``None`` when the extension is absent."""
        if HINTS_KEY not in params:
            return None
        data = _object(params[HINTS_KEY], f"kv_transfer_params.{HINTS_KEY}")
        _version(data, "the lease acknowledgement")
        pinned = data.get("pinned")
        if not isinstance(pinned, bool):
            raise HintError("the lease acknowledgement has no boolean 'pinned'")
        lease = data.get("lease")
        ttl = data.get("ttl_s")
        error = data.get("error")
        if pinned and lease is None:
            raise HintError("a pinned lease acknowledgement carries no lease secret")
        return cls(
            pinned=pinned,
            lease=None if lease is None else _text(lease, "lease"),
            ttl_s=None if ttl is None else positive_seconds(ttl, "ttl_s"),
            error=None if error is None else str(error),
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class LeaseRef:
    """The capability to release or extend one pinned handle: only its holder knows all three.

    >>> params = {"remote_request_id": "chatcmpl-1-ab", "remote_block_ids": [[4, 5]],
    ...           "agentkv": {"v": 1, "pinned": True, "lease": "s3cret", "ttl_s": 60}}
    >>> LeaseRef.from_handle(params).to_wire()
    {'remote_request_id': 'chatcmpl-1-ab', 'remote_block_ids': [[4, 5]], 'lease': 's3cret'}
    """

    request_id: str
    block_ids: tuple[tuple[int, ...], ...]
    lease: str

    def __post_init__(self) -> None:
        _text(self.request_id, "remote_request_id")
        object.__setattr__(self, "block_ids", _block_ids(self.block_ids))
        _text(self.lease, "lease")

    @classmethod
    def from_handle(cls, params: Mapping[str, Any]) -> LeaseRef:
        """From a pinned handle's ``kv_transfer_params`` as decode returned them."""
        ack = LeaseAck.from_params(params)
        if ack is None or ack.lease is None:
            raise HintError("this handle carries no agentkv lease (stock decode, or not pinned)")
        return cls(
            request_id=_text(params.get("remote_request_id"), "remote_request_id"),
            block_ids=_block_ids(params.get("remote_block_ids")),
            lease=ack.lease,
        )

    def to_wire(self) -> dict[str, Any]:
        return {
            "remote_request_id": self.request_id,
            "remote_block_ids": [list(group) for group in self.block_ids],
            "lease": self.lease,
        }

    @classmethod
    def from_wire(cls, value: object) -> LeaseRef:
        data = _object(value, "a lease reference")
        return cls(
            request_id=_text(data.get("remote_request_id"), "remote_request_id"),
            block_ids=_block_ids(data.get("remote_block_ids")),
            lease=_text(data.get("lease"), "lease"),
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class ExtendRequest:
    """Keep a pinned handle at least ``ttl_s`` more seconds from now (a lease never shrinks)."""

    ref: LeaseRef
    ttl_s: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "ttl_s", positive_seconds(self.ttl_s, "ttl_s"))

    def to_wire(self) -> dict[str, Any]:
        return {**self.ref.to_wire(), "ttl_s": self.ttl_s}

    @classmethod
    def from_wire(cls, value: object) -> ExtendRequest:
        data = _object(value, "an extend request")
        return cls(ref=LeaseRef.from_wire(data), ttl_s=positive_seconds(data.get("ttl_s"), "ttl_s"))


@dataclass(frozen=True, kw_only=True, slots=True)
class ExtendResult:
    """The extended lease: ``expiry`` is decode's ``perf_counter`` deadline (for the handle sent to
    prefill, see :func:`with_expiry`); ``ttl_s`` is what is left of it now, capped by the server.
    ``lease`` is the new secret after a claim (``None`` after a plain extend)."""

    expiry: float
    ttl_s: float
    lease: str | None = None

    def __post_init__(self) -> None:
        if self.lease is not None:
            _text(self.lease, "lease")

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {"remote_blocks_expiry_time": self.expiry, "ttl_s": self.ttl_s}
        if self.lease is not None:
            wire["lease"] = self.lease
        return wire

    @classmethod
    def from_wire(cls, value: object) -> ExtendResult:
        data = _object(value, "an extend answer")
        expiry = data.get("remote_blocks_expiry_time")
        if isinstance(expiry, bool) or not isinstance(expiry, int | float):
            raise HintError("an extend answer has no numeric remote_blocks_expiry_time")
        lease = data.get("lease")
        return cls(expiry=float(expiry), ttl_s=positive_seconds(data.get("ttl_s"), "ttl_s"),
                   lease=None if lease is None else _text(lease, "lease"))


@dataclass(frozen=True, kw_only=True, slots=True)
class RequestRelease:
    """Release whatever decode pinned for the D leg sent with ``request_tag(secret)``.

    For a D leg whose answer (and so its handle and lease) the client never got: a timeout or
    reset after decode finished, an unreadable answer, a stream left or cancelled. Decode frees
    the request's pin if it holds one; if the request has not finished yet, it remembers the tag
    for a while and pins nothing when it does.
    """

    secret: str

    def __post_init__(self) -> None:
        _text(self.secret, "request_secret")

    @property
    def tag(self) -> str:
        return request_tag(self.secret)

    def to_wire(self) -> dict[str, Any]:
        return {"v": WIRE_VERSION, "request_secret": self.secret}

    @classmethod
    def from_wire(cls, value: object) -> RequestRelease:
        data = _object(value, "a request release")
        _version(data, "a request release")
        return cls(secret=_text(data.get("request_secret"), "request_secret"))


@dataclass(frozen=True, kw_only=True, slots=True)
class ServerInfo:
    """``GET`` :data:`INFO_PATH`: what this server's agentkv extension can do.

    ``leases`` is false where the plugin runs but the connector is stock vLLM's (hints ignored).
    """

    leases: bool
    stream_handles: bool
    default_ttl_s: float | None = None
    max_ttl_s: float | None = None
    # The file tier's usage (``tier.TierUsage.to_wire()``), or None: no tier on this server.
    tier: Mapping[str, Any] | None = None

    def to_wire(self) -> dict[str, Any]:
        return {
            "v": WIRE_VERSION,
            "leases": self.leases,
            "stream_handles": self.stream_handles,
            "default_ttl_s": self.default_ttl_s,
            "max_ttl_s": self.max_ttl_s,
            "tier": None if self.tier is None else dict(self.tier),
        }

    @classmethod
    def from_wire(cls, value: object) -> ServerInfo:
        data = _object(value, "the agentkv info answer")
        _version(data, "the agentkv info answer")
        leases, streams = data.get("leases"), data.get("stream_handles")
        if not isinstance(leases, bool) or not isinstance(streams, bool):
            raise HintError("the agentkv info answer lacks boolean 'leases'/'stream_handles'")
        default, cap = data.get("default_ttl_s"), data.get("max_ttl_s")
        tier = data.get("tier")
        return cls(
            leases=leases,
            stream_handles=streams,
            default_ttl_s=None if default is None else positive_seconds(default, "default_ttl_s"),
            max_ttl_s=None if cap is None else positive_seconds(cap, "max_ttl_s"),
            tier=None if tier is None else _object(tier, "the agentkv info answer's tier"),
        )
