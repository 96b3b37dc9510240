"""Which way a turn's prompt reaches decode: decided per turn, as a pure function.

==========  ===============================================  ==================================
route       what is computed, what moves                      requests before the first token
==========  ===============================================  ==================================
pull        prefill pulls the session's KV back from decode   P leg, then D leg (decode pulls
            and computes the new tokens                        the new blocks from prefill)
decode      decode computes the new tokens itself: its own     D leg only
            prefix cache holds the pinned turn-end blocks;
            nothing moves
recompute   prefill computes what its own cache lacks          P leg, then D leg
==========  ===============================================  ==================================

``decode`` never reuses wrong KV: decode's prefix cache matches blocks by the hash of their
tokens, so a history that differs is recomputed, where a pull is positional and checks nothing.
It costs decode's other sessions a share of its steps while it computes, so ``auto`` sends an
append there only while decode's local prefills in flight (this one included) stay within
``RoutePolicy.decode_max_tokens``, and only where the cost model says it is the faster way.

>>> policy = RoutePolicy()
>>> policy.decide("auto", new_tokens=300, held_tokens=4000, decode_queued=0, attach=True).route
'decode'
>>> policy.decide("auto", new_tokens=3000, held_tokens=4000, decode_queued=0, attach=True).route
'pull'
>>> policy.decide("auto", new_tokens=300, held_tokens=0, decode_queued=0, attach=False).route
'recompute'
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal, TypeAlias, get_args

from agentkv._exceptions import ConfigError

__all__ = [
    "ROUTES",
    "Route",
    "RouteCostModel",
    "RouteDecision",
    "RoutePolicy",
    "TakenRoute",
    "check_route",
]

Route: TypeAlias = Literal["auto", "pull", "decode", "recompute"]
TakenRoute: TypeAlias = Literal["pull", "decode", "recompute"]
ROUTES: tuple[Route, ...] = get_args(Route)


def check_route(route: object) -> Route:
    """``route`` if it is one of ``ROUTES``, else ``ConfigError``."""
    if route not in ROUTES:
        raise ConfigError(f"route must be one of {', '.join(ROUTES)}; got {route!r}")
    return route


@dataclass(frozen=True, kw_only=True, slots=True)
class RouteCostModel:
    """Time to the first token of an append of ``new`` tokens to ``held`` tokens of KV on decode.

    ::

        pull_s(held, new)     = 2 * leg_s + (held + new) * bytes_per_token / transfer_bytes_per_s
                                + new / prefill_tokens_per_s
        decode_s(new, queued) = leg_s + (queued + new) / decode_tokens_per_s

    ``leg_s`` is one request's fixed cost (HTTP, scheduling, the answer's head); a pull moves the
    history to prefill and the new blocks back (prefill's own cache may hold part of the
    history: counting all of it over-prices the pull, never the local route); ``queued`` is
    decode's local prefill already in flight, computed before this one.

    The defaults are the local pair's (SmolLM2-135M in bf16; ``docs/benchmarks.md``, "Routes",
    has the run): prefill and decode are the same hardware, so their rates are equal; on a GPU
    deployment both rates are tens of times higher and a decode GPU's local prefill of a few
    hundred tokens costs milliseconds, while ``leg_s`` and the transfer stay: the local route
    wins by more.
    """

    leg_s: float = 0.03
    prefill_tokens_per_s: float = 540.0
    decode_tokens_per_s: float = 540.0
    transfer_bytes_per_s: float = 2.0e9
    bytes_per_token: int = 23_040

    def __post_init__(self) -> None:
        rates = (self.prefill_tokens_per_s, self.decode_tokens_per_s, self.transfer_bytes_per_s)
        if not all(math.isfinite(r) and r > 0 for r in rates) or self.bytes_per_token <= 0:
            raise ConfigError("the route cost model's rates and sizes must be positive")
        if not (math.isfinite(self.leg_s) and self.leg_s >= 0):
            raise ConfigError(f"leg_s must not be negative, got {self.leg_s}")

    def pull_s(self, *, held: int, new: int) -> float:
        moved = (held + new) * self.bytes_per_token / self.transfer_bytes_per_s
        return 2 * self.leg_s + moved + new / self.prefill_tokens_per_s

    def decode_s(self, *, new: int, queued: int = 0) -> float:
        return self.leg_s + (queued + new) / self.decode_tokens_per_s


@dataclass(frozen=True, kw_only=True, slots=True)
class RouteDecision:
    """The route a turn takes, and why."""

    route: TakenRoute
    reason: str


@dataclass(frozen=True, kw_only=True, slots=True)
class RoutePolicy:
    """How ``auto`` chooses a turn's route.

    Attributes:
        decode_max_tokens: the most tokens of local prefill in flight on one decode server,
            this turn's new tokens included: a larger append, or one that would join others
            past it, is pulled back to prefill. It bounds what decode's other sessions wait for
            between two of their tokens (``docs/benchmarks.md``, "Routes", measures their
            inter-token latency against it). 0 turns the local route off for ``auto``.
        cost: the cost model ``auto`` compares the routes by.
    """

    decode_max_tokens: int = 512
    cost: RouteCostModel = field(default_factory=RouteCostModel)

    def __post_init__(self) -> None:
        if isinstance(self.cost, Mapping):  # from a saved session (dataclasses.asdict)
            object.__setattr__(self, "cost", RouteCostModel(**self.cost))
        if type(self.decode_max_tokens) is not int or self.decode_max_tokens < 0:
            raise ConfigError(
                f"decode_max_tokens must be a non-negative integer, got {self.decode_max_tokens!r}"
            )

    def decide(  # noqa: PLR0911 - one return per rule, in the documented order
        self,
        requested: Route,
        *,
        new_tokens: int,
        held_tokens: int,
        decode_queued: int,
        attach: bool,
        tier: bool = False,
    ) -> RouteDecision:
        """The route of a turn that computes ``new_tokens`` beyond the ``held_tokens`` its
        handle covers on decode.

        ``attach``: the cache policy attaches the session's handle (``CachePolicy.
        decide_attach``); ``tier``: the session's KV waits in decode's file tier instead (a
        prefill loads it); ``decode_queued``: tokens of local prefill in flight on the session's
        decode. Rules, in order: an explicit route is taken (``pull`` with nothing to pull is
        ``recompute``); without a handle or a tier entry there is nothing to reuse; a tier entry
        is loaded by prefill; an append over decode's budget is pulled; otherwise the cheaper
        route by the cost model.
        """
        reusable = attach or tier
        if requested == "decode":
            return RouteDecision(route="decode", reason="asked for")
        if requested == "recompute":
            return RouteDecision(route="recompute", reason="asked for")
        if not reusable:
            return RouteDecision(route="recompute", reason="no handle to reuse")
        if requested == "pull":
            return RouteDecision(route="pull", reason="asked for")
        if tier:
            return RouteDecision(route="pull", reason="the KV is in decode's file tier")
        budget = self.decode_max_tokens
        if decode_queued + new_tokens > budget:
            return RouteDecision(
                route="pull",
                reason=f"{new_tokens} new + {decode_queued} queued tokens exceed decode's "
                f"local budget of {budget}",
            )
        local = self.cost.decode_s(new=new_tokens, queued=decode_queued)
        pulled = self.cost.pull_s(held=held_tokens, new=new_tokens)
        if local < pulled:
            return RouteDecision(
                route="decode", reason=f"est. {local * 1e3:.0f} ms local vs {pulled * 1e3:.0f} ms"
            )
        return RouteDecision(
            route="pull", reason=f"est. {pulled * 1e3:.0f} ms pull vs {local * 1e3:.0f} ms local"
        )
