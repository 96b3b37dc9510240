"""``kv_transfer_params`` in and out: the bodies of both legs, prefill's answer, the handle.

Field names follow vLLM 0.32's NixlConnector (``nixl/pull_scheduler.py``, ``request_finished``)
and its OpenAI server (``chat_completion/protocol.py``, ``renderers/online_renderer.py``):

* P leg: ``max_tokens: 1``, ``stream: false`` and ``kv_transfer_params`` with
  ``do_remote_decode: true`` plus either nulls or the decode node's turn-end handle, and the
  prompt as ``prompt_token_ids`` (vLLM pops it from the params and skips templating). No
  messages: with the ids vLLM renders none (``_reused_prompt_token_ids``), and nothing else
  reads them for a one-token answer that is dropped.
* D leg: prefill's returned params plus ``prompt_token_ids``, and ``return_token_ids: true`` so the
  answer carries the generated ids (vLLM has no way to ask for them without the prompt's echo).
  The messages go along: decode's tool parser counts the history's tool calls in them.
* agentkv's extension (``_hints``): the D leg may carry a pin hint; decode's answer then holds a
  lease acknowledgement, whose secret stays here and in the lease calls (the P leg never sees it).

Raw parameter dicts are built and read here only (decode's answer in ``decode_answer``, with
the helpers below); the rest of agentkv sees ``PrefillResult``, ``DecodeResult`` and
``KVHandle``. A handle is parsed from decode's params by ``_handle`` (and a
saved one's by ``split_params``) and rendered for the next P leg by ``handle_params``, nowhere else.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, TypeGuard

from agentkv._exceptions import MalformedResponseError
from agentkv._log import get_logger
from agentkv._types import KVHandle, Message
from agentkv._wire.hints import (
    HINTS_KEY,
    ExtendResult,
    HintError,
    LeaseAck,
    LeaseRef,
    PinHint,
    for_prefill,
    with_hint,
)
from agentkv._wire.json import dumps
from agentkv._wire.tier import TierLoadReport, TierRef, with_tier

_logger = get_logger("agentkv")

# Decode echoes the prompt's ids (``return_token_ids``, asked for the generated ones): never read.
DECODE_ECHO = "prompt_token_ids"
# A leased handle's deadline for the TTL decode granted (``CachePolicy.lease_deadline``).
LeaseDeadline = Callable[[float], float]

__all__ = [
    "DECODE_ECHO",
    "DecodeResult",
    "PrefillResult",
    "TurnRequest",
    "decode_body",
    "extended_handle",
    "handle_params",
    "lease_ref",
    "parse_prefill",
    "prefill_body",
    "split_params",
]

_NO_HANDLE: Mapping[str, Any] = MappingProxyType(
    {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
)
_LOCATION_FIELDS = ("remote_engine_id", "remote_request_id", "remote_host")
# The params a KVHandle holds as typed fields; the rest of decode's params travel as its extra.
_HANDLE_FIELDS = frozenset(
    {
        *_NO_HANDLE,
        "remote_request_id",
        "remote_num_tokens",
        "remote_blocks_expiry_time",
        HINTS_KEY,
    }
)
# extra_body fields that change what prefill computes or may reuse (vLLM's cache_salt isolates
# prefix-cache hits per tenant: sent only to decode it would silently be ignored by prefill).
_PREFILL_FIELDS = ("cache_salt",)


@dataclass(frozen=True, kw_only=True, slots=True)
class TurnRequest:
    """What a turn asks the model for, apart from the prompt tokens.

    ``messages`` are the OpenAI dicts of the conversation (or a pre-serialized fragment of them),
    for the D leg only: decode's tool parser reads them, even though ``prompt_token_ids``
    replaces their rendering.
    """

    model: str
    messages: Any
    num_messages: int
    max_tokens: int
    temperature: float | None = None
    tools: Sequence[Mapping[str, Any]] | None = None
    tool_choice: Any = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    def summary(self, leg: str) -> str:
        return f"{leg} leg (chat.completions, {self.num_messages} messages)"


@dataclass(frozen=True, kw_only=True, slots=True)
class PrefillResult:
    """Prefill's answer: what it reused, and the params the decode leg must carry.

    ``tier_load`` is how prefill served the tier reference the P leg carried (agentkv's
    connector says so in its answer; ``None`` without a reference or from a stock server).
    """

    prompt_tokens: int
    cached_tokens: int
    # Prefill's params for the D leg: opaque outside this module, read only by decode_body.
    kv_params: Mapping[str, Any] = field(repr=False, compare=False)
    tier_load: TierLoadReport | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class DecodeResult:
    """Decode's answer: the assistant message, its exact token ids, and the turn-end handle."""

    message: Message
    token_ids: tuple[int, ...]
    finish_reason: str
    prompt_tokens: int | None
    handle: KVHandle | None
    # Decode's ``usage.prompt_tokens_details.cached_tokens``, when reported.
    cached_tokens: int | None = None
    # One per generated token, when the request asked for them (``logprobs: true``).
    logprobs: tuple[float, ...] | None = None
    # vLLM's ``stop_reason``: the stop string (or stop token id) that ended the output.
    stop_reason: str | int | None = None


# The decode route's params: nothing to pull, nothing to send.
_LOCAL: Mapping[str, Any] = MappingProxyType(
    {"do_remote_prefill": False, "do_remote_decode": False}
)


def prefill_body(
    request: TurnRequest, *, prompt_ids: Any, handle: KVHandle | None, tier: TierRef | None = None
) -> bytes:
    """The P leg: prefill only (one discarded token), and pull ``handle``'s KV if given.

    ``prompt_ids`` is the prompt's token list, or a pre-serialized fragment of it. Without a
    handle, ``tier`` (an offloaded turn's tier entry) lets prefill load the prompt's prefix from
    the file tier instead.
    """
    params = handle_params(handle) if handle is not None else dict(_NO_HANDLE)
    if handle is None and tier is not None:
        params = with_tier(params, tier)
    params["prompt_token_ids"] = prompt_ids
    body: dict[str, Any] = {
        "model": request.model,
        "messages": [],
        "max_tokens": 1,
        "stream": False,
        "kv_transfer_params": params,
    }
    # Fields that decide which KV prefill may reuse must reach prefill too; sampling settings
    # and the rest only matter where tokens are generated.
    for name in _PREFILL_FIELDS:
        if name in request.extra:
            body[name] = request.extra[name]
    return dumps(body)


def decode_body(
    request: TurnRequest,
    *,
    prompt_ids: Any,
    prefill: PrefillResult | None,
    stream: bool,
    hint: PinHint | None = None,
) -> bytes:
    """The D leg: the real request, carrying prefill's params so decode pulls its blocks.

    Without ``prefill`` (the ``decode`` route) decode computes what its prefix cache lacks
    itself; its params ask for no transfer, and, being there, for the turn-end pin (vLLM pins
    after every finished request that carried params, with bidirectional transfer on).
    ``hint`` tells agentkv's extension on decode whether and how long to pin the turn-end KV.
    """
    kv = prefill.kv_params if prefill is not None else _LOCAL
    params = with_hint(kv, hint) if hint is not None else dict(kv)
    params["prompt_token_ids"] = prompt_ids
    body: dict[str, Any] = {
        **request.extra,
        "model": request.model,
        "messages": request.messages,
        "max_tokens": request.max_tokens,
        "stream": stream,
        "return_token_ids": True,
        "kv_transfer_params": params,
    }
    if request.temperature is not None:
        body["temperature"] = request.temperature
    if request.tools:
        body["tools"] = request.tools
    if request.tool_choice is not None:
        body["tool_choice"] = request.tool_choice
    if stream:
        body["stream_options"] = {"include_usage": True}
    return dumps(body)


# --- parsing -------------------------------------------------------------------------------------


# The parsers read JSON as ``loads`` parses it: objects are dicts, and ``isinstance(x, dict)``
# skips the ABC instance check that ``Mapping`` costs on every field.
def _bad(url: str, leg: str, detail: str) -> MalformedResponseError:
    return MalformedResponseError(f"unexpected {leg} answer", url=url, detail=detail)


def _int(value: object) -> TypeGuard[int]:
    return type(value) is int  # bool is an int subclass; vLLM never sends bools here


_INT_ONLY = frozenset({int})


def _ints(values: list[Any]) -> bool:
    """All exactly ``int`` (checked in C: token and block lists run to thousands)."""
    return set(map(type, values)) <= _INT_ONLY


def _kv_params(data: Mapping[str, Any], url: str, leg: str) -> Mapping[str, Any]:
    params = data.get("kv_transfer_params")
    if params is None:
        hint = (
            "is the NixlConnector configured (kv_role kv_producer/kv_both)?"
            if leg == "prefill"
            else "is bidirectional_kv_xfer on for decode (and, for streams, the agentkv plugin)?"
        )
        raise _bad(url, leg, f"no kv_transfer_params; {hint}")
    if not isinstance(params, dict):
        raise _bad(url, leg, f"kv_transfer_params is {type(params).__name__}, not an object")
    return params


def _block_ids(params: Mapping[str, Any], url: str, leg: str) -> tuple[tuple[int, ...], ...]:
    raw = params.get("remote_block_ids")
    if not isinstance(raw, list):
        raise _bad(url, leg, "kv_transfer_params.remote_block_ids is missing or not a list")
    # vLLM sends one list per KV cache group; accept a flat list (one group) too.
    groups = raw if raw and isinstance(raw[0], list) else [raw]
    out: list[tuple[int, ...]] = []
    for group in groups:
        if not isinstance(group, list) or not _ints(group):
            raise _bad(url, leg, "kv_transfer_params.remote_block_ids holds non-integers")
        out.append(tuple(group))
    return tuple(out)


def _check_location(params: Mapping[str, Any], url: str, leg: str) -> None:
    for name in _LOCATION_FIELDS:
        if not isinstance(params.get(name), str):
            raise _bad(url, leg, f"kv_transfer_params.{name} is missing or not a string")
    if not _int(params.get("remote_port")):
        raise _bad(url, leg, "kv_transfer_params.remote_port is missing or not an integer")


def _usage(data: Mapping[str, Any], url: str, leg: str) -> Mapping[str, Any]:
    usage = data.get("usage")
    if not isinstance(usage, dict):
        raise _bad(url, leg, "no usage object")
    return usage


def parse_prefill(data: Any, *, url: str) -> PrefillResult:
    """Parse the P leg's answer; ``MalformedResponseError`` unless it is what vLLM sends."""
    leg = "prefill"
    if not isinstance(data, dict):
        raise _bad(url, leg, f"the body is {type(data).__name__}, not an object")
    params = _kv_params(data, url, leg)
    if params.get("do_remote_prefill") is not True:
        raise _bad(url, leg, "kv_transfer_params.do_remote_prefill is not true")
    _check_location(params, url, leg)
    _block_ids(params, url, leg)
    usage = _usage(data, url, leg)
    prompt_tokens = usage.get("prompt_tokens")
    if not _int(prompt_tokens):
        raise _bad(url, leg, "usage.prompt_tokens is missing or not an integer")
    # Reuse is prefill's own count. It needs --enable-prompt-tokens-details; without it vLLM
    # still reports prefill's hits in the params it hands to decode.
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    if cached is None:
        cached = params.get("remote_prefill_cached_tokens")
    if cached is not None and not _int(cached):
        raise _bad(url, leg, "cached_tokens is not an integer")
    return PrefillResult(
        prompt_tokens=prompt_tokens,
        cached_tokens=cached or 0,
        # agentkv's key in prefill's answer is for this client only: decode gets its own hint.
        # (a copy only when there is such a key: the parsed dict is ours alone otherwise)
        kv_params=MappingProxyType(for_prefill(params) if HINTS_KEY in params else params),
        tier_load=_tier_load(params, url),
    )


def _tier_load(params: Mapping[str, Any], url: str) -> TierLoadReport | None:
    """Prefill's report on the tier reference; a bad one costs the report, never the turn."""
    try:
        return TierLoadReport.from_params(params)
    except HintError as exc:
        _logger.warning("agentkv.bad_tier_report", url=url, detail=str(exc))
        return None


def _handle(
    params: Mapping[str, Any],
    *,
    url: str,
    pair: str,
    issued_at: float,
    deadline: float,
    lease_deadline: LeaseDeadline | None = None,
) -> KVHandle | None:
    leg = "decode"
    blocks = _block_ids(params, url, leg)
    num_tokens = params.get("remote_num_tokens")
    if not any(blocks) or not num_tokens:
        return None  # decode kept nothing pinned (e.g. an aborted request)
    if params.get("do_remote_decode") is not True:
        raise _bad(url, leg, "kv_transfer_params.do_remote_decode is not true")
    _check_location(params, url, leg)
    if not _int(num_tokens):
        raise _bad(url, leg, "kv_transfer_params.remote_num_tokens is not an integer")
    expiry = params.get("remote_blocks_expiry_time")
    if expiry is not None and not isinstance(expiry, int | float):
        raise _bad(url, leg, "kv_transfer_params.remote_blocks_expiry_time is not a number")
    request_id = params["remote_request_id"]
    ack = _lease_ack(params, blocks, url=url, request_id=request_id)
    extra, _ = split_params(params)
    if ack is not None and ack.ttl_s is not None and lease_deadline is not None:
        deadline = lease_deadline(ack.ttl_s)
    return KVHandle(
        lease_ttl_s=ack.ttl_s if ack is not None else None,
        lease=ack.lease if ack is not None else None,
        pair=pair,
        engine_id=params["remote_engine_id"],
        request_id=request_id,
        block_ids=blocks,
        host=params["remote_host"],
        port=params["remote_port"],
        num_tokens=num_tokens,
        issued_at=issued_at,
        deadline=deadline,
        server_expiry=float(expiry) if expiry is not None else None,
        extra=extra,
    )


def split_params(params: Mapping[str, Any]) -> tuple[Mapping[str, Any], str | None]:
    """A decode handle's params as a ``KVHandle`` keeps them: the fields agentkv does not read
    (its ``extra``), and the lease secret in agentkv's acknowledgement, if any (unchecked: a
    saved file's, whose lease the first turn confirms with decode anyway)."""
    extra = MappingProxyType({k: v for k, v in params.items() if k not in _HANDLE_FIELDS})
    ack = params.get(HINTS_KEY)
    lease = ack.get("lease") if isinstance(ack, dict) else None
    return extra, lease if isinstance(lease, str) else None


def handle_params(handle: KVHandle) -> dict[str, Any]:
    """``handle`` as the next P leg's ``kv_transfer_params`` (without the prompt ids).

    The lease secret is for decode's lease routes only: prefill never sees it.
    """
    return {
        **handle.extra,
        # A decode handle comes back with do_remote_decode already true; the intent, explicit.
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": handle.engine_id,
        "remote_request_id": handle.request_id,
        "remote_block_ids": [list(group) for group in handle.block_ids],
        "remote_host": handle.host,
        "remote_port": handle.port,
        "remote_num_tokens": handle.num_tokens,
        # Prefill declines a pull within 5 s of it, so an extended handle carries the new one.
        "remote_blocks_expiry_time": handle.server_expiry,
    }


def _lease_ack(
    params: Mapping[str, Any],
    blocks: tuple[tuple[int, ...], ...],
    *,
    url: str,
    request_id: str,
) -> LeaseAck | None:
    """agentkv's lease on this pin, with its TTL and secret; ``None`` without a usable one.

    A bad acknowledgement costs the lease (the pin then lives out the server's TTL), never the
    turn: the answer itself is fine.
    """
    try:
        ack = LeaseAck.from_params(params)
        if ack is not None and ack.pinned and ack.lease is not None:
            # A lease we could not present later is no lease.
            LeaseRef(request_id=request_id, block_ids=blocks, lease=ack.lease)
    except HintError as exc:
        _logger.warning("agentkv.bad_lease_ack", url=url, request_id=request_id, detail=str(exc))
        return None
    if ack is None or not ack.pinned:
        return None
    if ack.error is not None:
        _logger.warning("agentkv.hint_ignored", url=url, request_id=request_id, error=ack.error)
    if ack.ttl_s is None:
        _logger.warning(
            "agentkv.bad_lease_ack",
            url=url,
            request_id=request_id,
            detail="a pinned acknowledgement without ttl_s",
        )
        return None
    return ack


def lease_ref(handle: KVHandle) -> LeaseRef:
    """The capability to release or extend a leased handle (``HintError`` if it has none)."""
    if handle.lease is None:
        raise HintError("this handle carries no agentkv lease (stock decode, or not pinned)")
    return LeaseRef(request_id=handle.request_id, block_ids=handle.block_ids, lease=handle.lease)


def extended_handle(handle: KVHandle, result: ExtendResult, *, deadline: float) -> KVHandle:
    """``handle`` after decode extended it: the next P leg must carry the new expiry (prefill
    declines a pull within 5 s of the old one); after a claim, the new lease secret."""
    return dataclasses.replace(
        handle,
        deadline=deadline,
        server_expiry=result.expiry,
        lease_ttl_s=result.ttl_s,
        extends=handle.extends + 1,
        lease=result.lease if result.lease is not None else handle.lease,
    )
