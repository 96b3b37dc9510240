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
It costs decode's other sessions their next tokens while it computes, so ``auto`` sends an
append there only while decode's local prefills in flight (this one included) stay within
``RoutePolicy.decode_max_tokens`` (``decode_busy_max_tokens`` while decode is serving other
requests), and only where the cost model says it is the faster way.

Set per session or turn (``route="auto"``), the default is ``pull``: today's path.

>>> policy = RoutePolicy()
>>> policy.decide("auto", new_tokens=40, held_tokens=4096, decode_queued=0, attach=True).route
'decode'
>>> policy.decide("auto", new_tokens=3000, held_tokens=4096, decode_queued=0, attach=True).route
'pull'
>>> policy.decide("auto", new_tokens=40, held_tokens=0, decode_queued=0, attach=False).route
'recompute'
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
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

    Each piece has a fixed cost and a cost per token apart, because on GPUs the fixed costs
    decide (``docs/benchmarks.md``, "Calibration")::

        prefill_s(held, new)  = prefill_fixed_s + new / prefill_tokens_per_s
                                + prefill_s_per_token2 * ((held + new)**2 - held**2)
        transfer_s(tokens)    = transfer_fixed_s + tokens * bytes_per_token / transfer_bytes_per_s
                                (0 for no tokens)
        pull_s(held, new)     = 2 * leg_s + transfer_s(held) + transfer_s(new)
                                + prefill_s(held, new)
        recompute_s(held, new)
                              = 2 * leg_s + prefill_s(0, held + new) + transfer_s(held + new)
        decode_local_s(held, new)
                              = decode_fixed_s + (new + held % block) / decode_tokens_per_s
                                + decode_s_per_token2 * ((held + new)**2 - (held - held % block)**2)
        decode_s(held, new, queued)
                              = leg_s + queued / decode_tokens_per_s + decode_local_s(held, new)

    ``leg_s`` is one request's fixed cost (HTTP, scheduling, the answer's head), and
    ``prefill_fixed_s`` what a P leg costs beyond it (prefill's own step); a pull moves the
    history to prefill and the new blocks back, each a handover with its own fixed cost
    (``transfer_fixed_s``: vLLM's P->D handover takes ~197 ms p50 of which the bytes ~29 ms,
    vllm#51919); a recompute computes the whole prompt (attention makes it superlinear:
    ``prefill_s_per_token2``) and hands all of it over (prefill's own cache may hold part of the
    history: counting all of it over-prices both, never the local route); ``queued`` is decode's
    local prefill already in flight, computed before this one. Decode's prefix cache matches whole
    blocks only, so the local route also recomputes the history's last partial block
    (``held % block``), which a pull carries over. ``decode_local_s`` is also what the local
    prefill costs decode's other sessions: their next token waits once for it.

    The defaults are the local pair's (SmolLM2-135M in bf16 on a 2-core Zen 4 EPYC; cold prefill of
    2,134 tokens ran at 407-438 tokens/s in ``docs/bench/routes-epyc-zen4.json``'s first turns):
    prefill and decode are the same hardware there, so the rates are equal. ``leg_s`` and the
    transfer rate are assumptions, not measured apart (the tier's NIXL write rate stands in for
    the pull), and the fixed and quadratic terms are 0; on that pair the routes measured level
    with an idle decode, and ``auto`` is decided by ``RoutePolicy.decode_max_tokens`` first. On a
    GPU deployment every rate is tens of times off: ``agentkv calibrate`` measures them on the
    servers and writes them into the cluster file (``route_cost``), which the cluster reads.
    """

    leg_s: float = 0.03
    prefill_tokens_per_s: float = 400.0
    decode_tokens_per_s: float = 400.0
    transfer_bytes_per_s: float = 2.0e9
    bytes_per_token: int = 23_040
    # The servers' KV block size when the cluster does not say (vLLM's CPU backend; GPUs: 16).
    block_size: int = 128
    transfer_fixed_s: float = 0.0
    prefill_s_per_token2: float = 0.0
    decode_fixed_s: float = 0.0
    decode_s_per_token2: float = 0.0
    prefill_fixed_s: float = 0.0

    def __post_init__(self) -> None:
        rates = (self.prefill_tokens_per_s, self.decode_tokens_per_s, self.transfer_bytes_per_s)
        sizes = (self.bytes_per_token, self.block_size)
        if not all(math.isfinite(r) and r > 0 for r in rates) or min(sizes) <= 0:
            raise ConfigError("the route cost model's rates and sizes must be positive")
        for name in ("leg_s", "transfer_fixed_s", "prefill_s_per_token2", "decode_fixed_s",
                     "decode_s_per_token2", "prefill_fixed_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ConfigError(f"{name} must not be negative, got {value!r}")

    @classmethod
    def from_wire(cls, raw: object, *, source: str = "route_cost") -> RouteCostModel:
        """From a cluster file's ``route_cost`` object (``agentkv calibrate`` writes it); keys
        it does not know are refused, so that a typo is not silently the default."""
        if not isinstance(raw, Mapping):
            raise ConfigError(f"{source}: 'route_cost' must be an object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ConfigError(f"{source}: unknown route_cost keys {', '.join(map(str, unknown))}")
        try:
            return cls(**{str(k): v for k, v in raw.items()})
        except TypeError as exc:
            raise ConfigError(f"{source}: route_cost is malformed: {exc}") from exc

    def to_wire(self) -> dict[str, float | int]:
        """The fields, for a cluster file (``from_wire`` reads them back)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def prefill_s(self, *, held: int, new: int) -> float:
        """Prefill's compute of ``new`` tokens after ``held`` cached ones."""
        quad = self.prefill_s_per_token2 * ((held + new) ** 2 - held**2)
        return self.prefill_fixed_s + new / self.prefill_tokens_per_s + quad

    def transfer_s(self, tokens: int) -> float:
        """One handover of ``tokens`` tokens' KV (none: free)."""
        if tokens <= 0:
            return 0.0
        return self.transfer_fixed_s + tokens * self.bytes_per_token / self.transfer_bytes_per_s

    def pull_s(self, *, held: int, new: int) -> float:
        return (2 * self.leg_s + self.transfer_s(held) + self.transfer_s(new)
                + self.prefill_s(held=held, new=new))

    def recompute_s(self, *, held: int, new: int) -> float:
        return 2 * self.leg_s + self.prefill_s(held=0, new=held + new) + self.transfer_s(held + new)

    def decode_local_s(self, *, held: int, new: int, block: int | None = None) -> float:
        """Decode's own compute of ``new`` tokens and the history's partial last block: also
        the one-time wait it puts on the next token of decode's other sessions."""
        tail = held % (block or self.block_size)
        quad = self.decode_s_per_token2 * ((held + new) ** 2 - (held - tail) ** 2)
        return self.decode_fixed_s + (new + tail) / self.decode_tokens_per_s + quad

    def decode_s(self, *, held: int, new: int, queued: int = 0, block: int | None = None) -> float:
        return (self.leg_s + queued / self.decode_tokens_per_s
                + self.decode_local_s(held=held, new=new, block=block))

    def pull_beats_local_above(
        self, *, held: int, limit: int, block: int | None = None
    ) -> int | None:
        """The fewest new tokens (up to ``limit``) whose pull is faster than decode computing
        them, after ``held`` tokens; ``None``: decode is faster for every append up to it."""
        return _first_true(
            lambda n: self.pull_s(held=held, new=n) < self.decode_s(held=held, new=n, block=block),
            limit,
        )

    def pull_beats_recompute_above(self, *, new: int, limit: int) -> int | None:
        """The fewest held tokens (up to ``limit``) whose pull, with ``new`` tokens appended,
        is faster than recomputing the whole prompt; ``None`` if none is."""
        return _first_true(
            lambda h: self.pull_s(held=h, new=new) < self.recompute_s(held=h, new=new), limit
        )


def _first_true(holds: Callable[[int], bool], limit: int) -> int | None:
    """The smallest ``n`` in ``[1, limit]`` where ``holds(n)``, for a condition that turns true
    once: on a doubling grid, then by bisection below the first grid point where it holds."""
    if limit < 1:
        return None
    low, high = 0, 1
    while not holds(high):
        if high >= limit:
            return None
        low, high = high, min(2 * high, limit)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if holds(middle) else (middle, high)
    return high


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
            this turn's new tokens included, while it serves nothing else: a larger append, or
            one that would join others past it, is pulled back to prefill. 0 turns the local
            route off for ``auto``.
        decode_busy_max_tokens: the same bound while decode is serving other requests (the
            pool's own in flight there): a local prefill runs between their tokens. On the
            2-core CPU pair, appends every 2 s beside three streaming sessions put those
            sessions' inter-token p90 at 0.94x (32 tokens), 0.95x (64), 1.11x (128) of the
            no-append phases', 62x at 512 (``docs/benchmarks.md``, "Routes"): 64 is the largest
            measured within the 10% they may pay. A GPU decode computes hundreds of tokens in a
            few milliseconds: the same measurement there (``benchmarks/route_itl.py``) sets a
            higher one.
        cost: the cost model ``auto`` compares the routes by: the local pair's defaults, or
            what ``agentkv calibrate`` measured (a cluster file's ``route_cost``).
    """

    decode_max_tokens: int = 512
    decode_busy_max_tokens: int = 64
    cost: RouteCostModel = field(default_factory=RouteCostModel)

    def __post_init__(self) -> None:
        if isinstance(self.cost, Mapping):  # from a saved session (dataclasses.asdict)
            object.__setattr__(self, "cost", RouteCostModel(**self.cost))
        for name in ("decode_max_tokens", "decode_busy_max_tokens"):
            value = getattr(self, name)
            if type(value) is not int or value < 0:
                raise ConfigError(f"{name} must be a non-negative integer, got {value!r}")

    def decide(  # noqa: PLR0911 - one return per rule, in the documented order
        self,
        requested: Route,
        *,
        new_tokens: int,
        held_tokens: int,
        decode_queued: int,
        attach: bool,
        tier: bool = False,
        block_size: int | None = None,
        decode_running: int = 0,
        local_ok: bool = True,
    ) -> RouteDecision:
        """The route of a turn that computes ``new_tokens`` beyond the ``held_tokens`` its
        handle covers on decode.

        ``attach``: the cache policy attaches the session's handle (``CachePolicy.
        decide_attach``); ``tier``: the session's KV waits in decode's file tier instead (a
        prefill loads it); ``decode_queued``: tokens of local prefill in flight on the session's
        decode; ``block_size``: the servers' KV block size, when known; ``decode_running``: other
        requests decode is serving; ``local_ok``: decode runs agentkv's connector (a stock vLLM
        0.32 decode never frees a local turn's pin, ``docs/connector.md``). Rules, in order: no
        local turn on a decode that would keep it pinned for good; an explicit route is taken
        (``pull`` with nothing to pull is ``recompute``); without a handle or a tier entry there
        is nothing to reuse; a tier entry is loaded by prefill; an append over decode's budget
        (its busy budget while it serves others) is pulled; otherwise the cheaper route by the
        cost model.
        """
        reusable = attach or tier
        if requested == "decode" and not local_ok:
            return RouteDecision(
                route="pull" if reusable else "recompute",
                reason="decode lacks agentkv's connector: a turn computed there stays pinned",
            )
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
        if not local_ok:
            return RouteDecision(route="pull", reason="decode lacks agentkv's connector")
        busy = decode_running > 0
        budget = self.decode_busy_max_tokens if busy else self.decode_max_tokens
        if decode_queued + new_tokens > budget:
            return RouteDecision(
                route="pull",
                reason=f"{new_tokens} new + {decode_queued} queued tokens exceed decode's "
                + (f"busy budget of {budget} ({decode_running} requests running)" if busy
                   else f"local budget of {budget}"),
            )
        local = self.cost.decode_s(
            held=held_tokens, new=new_tokens, queued=decode_queued, block=block_size
        )
        pulled = self.cost.pull_s(held=held_tokens, new=new_tokens)
        if local < pulled:
            return RouteDecision(
                route="decode", reason=f"est. {local * 1e3:.0f} ms local vs {pulled * 1e3:.0f} ms"
            )
        return RouteDecision(
            route="pull", reason=f"est. {pulled * 1e3:.0f} ms pull vs {local * 1e3:.0f} ms local"
        )
