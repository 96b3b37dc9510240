"""A fork's share of its parent's reusable KV: a copy of the parent's pin on decode's file tier.

A handle is single use (a pull frees the blocks on decode), so a fork cannot send its parent's
handle without taking the KV from the parent. Instead decode writes a copy of the pinned blocks
to its file tier and keeps the pin (``Copy``: an offload with ``keep``): the parent keeps its
pin, the fork holds a tier entry of its own (``OnTier``), which its first turn's prefill loads
and which it deletes like any other (superseded, moved, closed). Two holders, two things held:
the pin's single use and each entry's single delete stay as they are, whatever the order in
which parent and fork turn, move, fork again or close.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from agentkv._client.kv._value import (
    KV,
    DeleteTierEntry,
    NoKV,
    OnTier,
    Pinned,
    Step,
    tokens_digest,
)
from agentkv._policy import CachePolicy
from agentkv._types import HandleState, KVHandle
from agentkv._wire.tier import TierRef

__all__ = ["Copy", "fork_copy", "inherit", "inherited"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Copy:
    """Ask ``handle.pair``'s decode to write a copy of the pin to its file tier and keep the
    pin: the entry becomes a fork's. The parent's pin is not consumed until the copy answers."""

    handle: KVHandle
    ttl_s: float | None
    reason: str = "fork"


def _none(detail: str) -> NoKV:
    return NoKV(reason=HandleState.NONE, detail=f"a fork without its parent's KV: {detail}")


def fork_copy(
    kv: KV,
    *,
    parent_tokens: Sequence[int],
    fork_tokens: Sequence[int],
    fork_pair: str,
    copies: bool,
    policy: CachePolicy,
    now: float,
) -> Copy | NoKV:
    """What a fork whose history is ``fork_tokens``, placed on ``fork_pair``, gets of its
    parent's value ``kv``: a copy to make, or the reason it gets none (its first turn then
    reuses only what its prefill's prefix cache holds).

    ``copies``: the pin's decode writes copies (its info says ``tier.copy``).
    """
    if isinstance(kv, OnTier):
        return _none("the parent's KV is on the tier (a fork copies a pin)")
    if not isinstance(kv, Pinned):
        return _none(f"the parent holds no pin ({kv.detail})")
    handle, n = kv.handle, kv.handle.num_tokens
    refusals = (
        (not handle.leased or not copies, "the parent's decode has no file tier that copies pins"),
        (not kv.confirmed, "a copy of the parent (a save file, a snapshot) holds its pin too"),
        (policy.overdue_s(handle, now=now) is not None, "the parent's pin is past its deadline"),
        (handle.pair != fork_pair,
         f"the fork lives on pair {fork_pair}, the parent's pin on {handle.pair}"),
        (len(fork_tokens) < n or list(fork_tokens[:n]) != list(parent_tokens[:n]),
         "the fork's history does not start with the parent's pinned tokens"),
    )
    refused = next((why for failed, why in refusals if failed), None)
    if refused is not None:
        return _none(refused)
    return Copy(handle=handle, ttl_s=policy.tier_ttl_s)


def inherited(
    effect: Copy, *, ref: TierRef | None, detail: str, fork_tokens: Sequence[int]
) -> KV:
    """The fork's value once decode answered ``effect``: the entry it wrote, or nothing."""
    if ref is None:
        return _none(f"decode did not copy the parent's pin ({detail or 'failed'})")
    if ref.n_tokens > len(fork_tokens):
        return _none("decode copied more tokens than the fork's history holds")
    digest = tokens_digest(fork_tokens[: ref.n_tokens])
    return OnTier(ref=ref, pair=effect.handle.pair, digest=digest)


def inherit(kv: KV, value: KV) -> Step:
    """The fork's copy answered with ``value`` while the fork holds ``kv``: taken when the fork
    holds nothing yet (its first turn has not run); otherwise the copy is nobody's, deleted."""
    if isinstance(kv, NoKV):
        return Step(value)
    if isinstance(value, OnTier):
        delete = DeleteTierEntry(ref=value.ref, pair=value.pair, reason="superseded",
                                 background=True)
        return Step(kv, (delete,))
    return Step(kv)
