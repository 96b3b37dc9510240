"""The reusable KV's value, its effects, and what reads it (see ``agentkv._client.kv``)."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, TypeAlias

from agentkv import _constants as defaults
from agentkv._policy import CachePolicy
from agentkv._types import HandleState, KVHandle
from agentkv._wire.tier import TierRef

CONFIRM_TTL_S = defaults.CONFIRM_TTL_S


def tokens_digest(tokens: Iterable[int]) -> str:
    """A digest of exact token ids: what a tier entry holds, checked against the next prompt."""
    return hashlib.blake2b(array("q", tokens).tobytes(), digest_size=16).hexdigest()


# --- the value ------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class NoKV:
    """Nothing to reuse; ``reason`` and ``detail`` are what the next turn's stats say
    (``handle_state``, ``handle_reason``). ``note``: what the last tool wait did, told too."""

    reason: HandleState = HandleState.NONE
    detail: str = "no stored handle"
    note: str | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class Pinned:
    """Decode pins the last turn's KV; ``handle`` reaches it.

    ``confirmed`` false: a copy of the session (a save file, a snapshot) holds the handle too,
    so it is attached only once a claim (decode rotates the lease secret) says it is ours.
    """

    handle: KVHandle
    confirmed: bool = True
    note: str | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class OnTier:
    """The last turn's KV offloaded to the file tier of ``pair``'s decode (the delete goes
    there); ``digest`` is ``tokens_digest`` of the exact tokens it holds."""

    ref: TierRef
    pair: str
    digest: str
    note: str | None = None


KV: TypeAlias = NoKV | Pinned | OnTier
NO_KV = NoKV()


# --- the effects ----------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class Release:
    """Ask ``handle.pair``'s decode to free the pin; ``background``: the caller does not wait."""

    handle: KVHandle
    reason: str
    background: bool = False


@dataclass(frozen=True, kw_only=True, slots=True)
class ReleaseRequest:
    """Free whatever ``decode`` pinned for the D leg tagged with ``secret`` (its answer was lost);
    always in the background."""

    decode: str
    secret: str
    reason: str


@dataclass(frozen=True, kw_only=True, slots=True)
class Extend:
    """Ask decode to keep ``handle`` ``ttl_s`` more seconds; ``claim``: and take the lease
    exclusively; ``confirming``: a failed call means the handle cannot be trusted."""

    handle: KVHandle
    ttl_s: float
    reason: str
    claim: bool = False
    confirming: bool = False


@dataclass(frozen=True, kw_only=True, slots=True)
class Offload:
    """Ask decode to write ``handle``'s blocks to its file tier (and free the pin)."""

    handle: KVHandle
    ttl_s: float | None
    reason: str


@dataclass(frozen=True, kw_only=True, slots=True)
class DeleteTierEntry:
    """Delete the tier entry ``ref`` on ``pair``'s decode."""

    ref: TierRef
    pair: str
    reason: str
    background: bool = False


Effect: TypeAlias = Release | ReleaseRequest | Extend | Offload | DeleteTierEntry
Effects: TypeAlias = tuple[Effect, ...]


class Step(NamedTuple):
    """A transition's result: the new value and what must be done for it."""

    kv: KV
    effects: Effects = ()


# --- reading the value ----------------------------------------------------------------------------


def handle_of(kv: KV) -> KVHandle | None:
    return kv.handle if isinstance(kv, Pinned) else None


def tier_of(kv: KV) -> TierRef | None:
    return kv.ref if isinstance(kv, OnTier) else None


def unconfirmed(kv: KV) -> bool:
    """A pin a copy of the session also holds: ``confirm`` claims it before a turn takes it."""
    return isinstance(kv, Pinned) and not kv.confirmed


def leased_pin(kv: KV) -> KVHandle | None:
    """The handle of a pin decode leased to the session (one it can release, extend, offload)."""
    return kv.handle if isinstance(kv, Pinned) and kv.handle.leased else None


def tier_matches(kv: KV, prompt: Sequence[int]) -> bool:
    """Whether ``prompt`` starts with exactly the tokens ``kv``'s tier entry holds."""
    return (
        isinstance(kv, OnTier)
        and len(prompt) >= kv.ref.n_tokens
        and tokens_digest(prompt[: kv.ref.n_tokens]) == kv.digest
    )


def overdue_s(kv: KV, *, policy: CachePolicy, now: float) -> float | None:
    """Seconds the pin is past its deadline (``None``: live, or none): the agent's warning."""
    return policy.overdue_s(handle_of(kv), now=now)


def _lost(kv: KV, reason: HandleState, detail: str) -> NoKV:
    return NoKV(reason=reason, detail=detail, note=kv.note)


def _release(
    handle: KVHandle | None, *, reason: str, policy: CachePolicy, now: float, background: bool
) -> Effects:
    if handle is not None and policy.decide_release(handle, now=now):
        return (Release(handle=handle, reason=reason, background=background),)
    return ()


def release_sent(
    handle: KVHandle | None,
    *,
    reason: str,
    policy: CachePolicy,
    now: float,
    background: bool = False,
) -> Effects:
    """A handle a turn took (``Taken.sent``) that no prefill will read now: released while decode
    may still hold it (a turn failed, or the decode route read its blocks from decode's cache)."""
    return _release(handle, reason=reason, policy=policy, now=now, background=background)
