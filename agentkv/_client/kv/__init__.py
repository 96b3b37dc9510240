"""A session's reusable KV: one value, pure transitions, effects as values. No I/O.

What a session holds that its next turn may reuse is one of three things: nothing (``NoKV``,
with the reason the next turn's stats give), a **pin** on decode through a **handle**
(``Pinned``), or a **tier entry** that decode offloaded to its file tier (``OnTier``). Every
event that changes it is a function here, ``(value, inputs, policy, now) -> Step(value,
effects)``: taken for a turn (with the route), turn committed, a tool wait, saved or
snapshotted (a copy is unconfirmed), moved to another pair, closed. The effects (release a pin,
release a lost D leg's request, extend or claim a lease, offload to the tier, delete a tier
entry) are values that one executor (``leasing``) performs; what decode answered comes back
here as the input of the next transition. ``CachePolicy`` and ``RoutePolicy`` are consulted
from this package only: ``_value`` (the value, its effects, what reads it), ``_turn`` (a turn's
transitions) and ``_between`` (between turns, a tool wait, the session's life).

The rules every transition keeps (``tests/unit/test_kv.py`` checks them on random sequences):

* a handle is single use: once a turn took it, no value holds it again;
* a handle a copy also holds (``Pinned.confirmed`` false) is attached only after decode
  confirms it with a claim, which exactly one holder wins;
* a tier entry is carried only by a prompt that starts with exactly its tokens;
* every pin is released at most once, every tier entry deleted at most once, and a closed
  session releases (or deletes) whatever it held;
* a fork gets a copy of its parent's pin as a tier entry of its own (``_fork``), never the
  parent's handle.
"""

from agentkv._client.kv._between import (
    closed,
    detached,
    extend_effects,
    extended,
    handed_out,
    moved,
    offload_effects,
    offloaded,
    pair_failed,
    restored,
    unpin_effects,
    unpinned,
    wait_ended,
    wait_extend,
    wait_tier,
    wants_kv_usage,
)
from agentkv._client.kv._fork import Copy, fork_copy, inherit, inherited
from agentkv._client.kv._turn import (
    RouteFacts,
    Taken,
    committed,
    confirm,
    handle_deadline,
    lease_deadline,
    pin_hint,
    take,
)
from agentkv._client.kv._value import (
    CONFIRM_TTL_S,
    KV,
    NO_KV,
    DeleteTierEntry,
    Effect,
    Effects,
    Extend,
    NoKV,
    Offload,
    OnTier,
    Pinned,
    Release,
    ReleaseRequest,
    Step,
    handle_of,
    leased_pin,
    overdue_s,
    release_sent,
    tier_matches,
    tier_of,
    tokens_digest,
    unconfirmed,
)

__all__ = [
    "CONFIRM_TTL_S",
    "KV",
    "NO_KV",
    "Copy",
    "DeleteTierEntry",
    "Effect",
    "Effects",
    "Extend",
    "NoKV",
    "Offload",
    "OnTier",
    "Pinned",
    "Release",
    "ReleaseRequest",
    "RouteFacts",
    "Step",
    "Taken",
    "closed",
    "committed",
    "confirm",
    "detached",
    "extend_effects",
    "extended",
    "fork_copy",
    "handed_out",
    "handle_deadline",
    "handle_of",
    "inherit",
    "inherited",
    "lease_deadline",
    "leased_pin",
    "moved",
    "offload_effects",
    "offloaded",
    "overdue_s",
    "pair_failed",
    "pin_hint",
    "release_sent",
    "restored",
    "take",
    "tier_matches",
    "tier_of",
    "tokens_digest",
    "unconfirmed",
    "unpin_effects",
    "unpinned",
    "wait_ended",
    "wait_extend",
    "wait_tier",
    "wants_kv_usage",
]
