"""The pair pool: the servers under every session, and the services a turn calls.

``PairPool`` holds the prefill/decode pairs (or a prefill pool and decode servers, xPyD), their
load and health, the placement of sessions and of each turn's prefill, the HTTP client, the calls
to decode's lease routes, the chat templates (one per prefill server) and the clock. It knows
nothing of sessions: a session's state is a value (``_state``), a turn (``_turn``) directs the
work and calls the pool for every server it needs. ``AsyncCluster`` and ``Cluster`` are the public
faces of one pool.

Everything here runs on the event loop the pool was created for (the sync twin's loop thread).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import TypedDict

import httpx2

from agentkv import _constants as defaults
from agentkv._exceptions import ConfigError, NoHealthyPairError, SessionClosedError
from agentkv._log import get_logger
from agentkv._placement import PrefillWeights, PrefixHomes, RetryPolicy, choose_prefill, place
from agentkv._policy import CachePolicy
from agentkv._prompt.template import ChatTemplate, ServerRenderer
from agentkv._types import Pair
from agentkv._wire.http import get_ok, make_poster
from agentkv._wire.lease_calls import LeaseCalls
from agentkv._wire.transport import Poster

__all__ = ["DEFAULT_LIMITS", "DEFAULT_TIMEOUT", "ClusterOptions", "PairPool"]

logger = get_logger("agentkv")

DEFAULT_TIMEOUT = defaults.TIMEOUT
DEFAULT_LIMITS = defaults.LIMITS
_HEALTH_TIMEOUT_S = defaults.HEALTH_TIMEOUT_S
_CLOSE_SETTLE_S = defaults.CLOSE_SETTLE_S


class ClusterOptions(TypedDict, total=False):
    """The keyword options of ``Cluster`` and ``AsyncCluster`` (and of their ``from_dict`` and
    ``from_file``), all optional; the defaults are ``PairPool``'s.

    Attributes:
        transport: a ``Poster`` (tests pass a fake's) or an httpx2 transport to send through.
        http_client: send through this ``httpx2.AsyncClient``; the cluster does not close it.
        timeout: the default client's timeouts (``DEFAULT_TIMEOUT``: long reads, a cold prefill
            on CPU takes minutes).
        policy: the default ``CachePolicy`` of sessions.
        retry: the ``RetryPolicy`` of turns.
        clock: monotonic seconds, for handle deadlines (tests pass a manual clock).
        block_size: the servers' KV block size, when known; sharpens ``TurnStats.pulled_tokens``.
        load_factor: bounded-load placement: a pair takes at most this times the average (1.25).
        health_recheck_s: how long an unhealthy pair is left alone before it is probed again (5).
        prefill_pool: a pool (xPyD): prefill name -> URL. Each pair is then a decode server and
            every turn picks its prefill from the pool by load (``choose_prefill``).
        prefill_weights: how strongly a turn prefers the prefill that served the session last.
        max_model_len: the servers' context in tokens (a cluster file's ``max_model_len``),
            for servers whose ``/tokenize`` answers do not say it (vLLM's do).
    """

    transport: httpx2.AsyncBaseTransport | Poster | None
    http_client: httpx2.AsyncClient | None
    timeout: httpx2.Timeout | float
    policy: CachePolicy | None
    retry: RetryPolicy | None
    clock: Callable[[], float]
    block_size: int | None
    load_factor: float
    health_recheck_s: float
    prefill_pool: Mapping[str, str] | None
    prefill_weights: PrefillWeights | None
    max_model_len: int | None


class PairPool:
    """Pairs serving one model: load, health, placement, HTTP, lease calls, templates, clock.

    The options are ``ClusterOptions`` (the facades pass them through; the pool validates them).
    """

    def __init__(
        self,
        pairs: Iterable[Pair],
        *,
        model: str,
        transport: httpx2.AsyncBaseTransport | Poster | None = None,
        http_client: httpx2.AsyncClient | None = None,
        timeout: httpx2.Timeout | float = DEFAULT_TIMEOUT,
        policy: CachePolicy | None = None,
        retry: RetryPolicy | None = None,
        clock: Callable[[], float] = time.monotonic,
        block_size: int | None = None,
        load_factor: float = defaults.LOAD_FACTOR,
        health_recheck_s: float = defaults.HEALTH_RECHECK_S,
        prefill_pool: Mapping[str, str] | None = None,
        prefill_weights: PrefillWeights | None = None,
        max_model_len: int | None = None,
    ) -> None:
        self._pairs: dict[str, Pair] = {}
        for pair in pairs:
            if pair.name in self._pairs:
                raise ConfigError(f"duplicate pair name {pair.name!r}")
            self._pairs[pair.name] = pair
        if not self._pairs:
            raise ConfigError("a cluster needs at least one pair")
        if not isinstance(model, str) or not model:
            raise ConfigError("model must be a non-empty string")
        if block_size is not None and (type(block_size) is not int or block_size < 1):
            raise ConfigError(f"block_size must be a positive integer, got {block_size!r}")
        if max_model_len is not None and (type(max_model_len) is not int or max_model_len < 1):
            raise ConfigError(f"max_model_len must be a positive integer, got {max_model_len!r}")
        if load_factor < 1.0:
            raise ConfigError(f"load_factor must be at least 1, got {load_factor}")
        if http_client is not None and transport is not None:
            raise ConfigError("pass transport= or http_client=, not both")
        if prefill_pool is not None and not prefill_pool:
            raise ConfigError("a prefill pool needs at least one server")
        self.model = model
        self.policy = policy or CachePolicy()
        self.retry = retry or RetryPolicy()
        self.clock = clock
        self.block_size = block_size
        self._max_model_len = max_model_len
        self.prefill_weights = prefill_weights or PrefillWeights()
        self._load_factor = load_factor
        self._health_recheck_s = health_recheck_s
        self._owns_client = http_client is None
        self.http_client = http_client
        # Every request to the servers goes through it (``_wire.transport``).
        self.poster = make_poster(
            transport=transport, http_client=http_client, limits=DEFAULT_LIMITS, timeout=timeout
        )
        self._loads = dict.fromkeys(self._pairs, 0)
        self._down: dict[str, float] = {}
        self.pooled = prefill_pool is not None
        # Prefill servers by name: the pool's, or each pair's own (named as the pair).
        self._prefills: dict[str, str] = (
            {name: url.rstrip("/") for name, url in prefill_pool.items()}
            if prefill_pool is not None
            else {pair.name: pair.prefill for pair in self._pairs.values()}
        )
        # Outstanding tokens per prefill: sent, not answered yet (what a turn adds, see _turn).
        self._prefill_loads = dict.fromkeys(self._prefills, 0)
        # Tokens of local prefill in flight per decode server (the ``decode`` route's turns).
        self._decode_queued = dict.fromkeys(self._pairs, 0)
        # Requests in flight per decode server (every route's D leg).
        self._decode_running = dict.fromkeys(self._pairs, 0)
        self._prefill_down: dict[str, float] = {}
        self._templates: dict[str, ChatTemplate] = {}
        self._probes: dict[str, asyncio.Task[bool]] = {}
        self.leases = LeaseCalls(self.poster, clock=clock)
        self.prefix_homes = PrefixHomes()  # pooled only: what each prefill computed last
        self.closed = False

    # --- reading -------------------------------------------------------------------------------

    @property
    def pairs(self) -> tuple[Pair, ...]:
        return tuple(self._pairs.values())

    def decode_url(self, pair: str) -> str:
        """The decode server of the pair called ``pair`` (where its handles' KV is pinned)."""
        return self._pairs[pair].decode

    @property
    def prefills(self) -> dict[str, str]:
        """Prefill servers, name -> URL (without a pool, each pair's, named as the pair)."""
        return dict(self._prefills)

    def loads(self) -> dict[str, int]:
        """Open sessions per pair (in a pool: per decode server)."""
        return dict(self._loads)

    def prefill_loads(self) -> dict[str, int]:
        """Outstanding tokens per prefill: prompt tokens in flight that it computes."""
        return dict(self._prefill_loads)

    def is_healthy(self, pair: str) -> bool:
        return pair not in self._down

    def is_prefill_healthy(self, prefill: str) -> bool:
        return prefill not in self._prefill_down

    def check_open(self) -> None:
        if self.closed:
            raise SessionClosedError("the cluster is closed; sessions need an open cluster")

    def template(self, prefill_url: str) -> ChatTemplate:
        """The chat template as ``prefill_url`` renders it (cached: its anchor renders too)."""
        template = self._templates.get(prefill_url)
        if template is None:
            renderer = ServerRenderer(self.poster, prefill_url, model=self.model)
            template = self._templates[prefill_url] = ChatTemplate(renderer)
        return template

    @property
    def max_model_len(self) -> int | None:
        """The servers' context: as a server's renders said it (every server serves the same
        model), else as configured; ``None`` while unknown."""
        for template in self._templates.values():
            if template.max_model_len is not None:
                return template.max_model_len
        return self._max_model_len

    # --- placement of sessions -----------------------------------------------------------------

    def acquire(self, key: str, *, near: Pair | None = None) -> Pair:
        """Place a new session by ``key``; on ``near`` if healthy (a fork shares its parent's
        cache)."""
        if near is not None and self.is_healthy(near.name):
            name: str | None = near.name
        else:
            name = place(
                key,
                list(self._pairs),
                loads=self._loads,
                healthy=[p for p in self._pairs if p not in self._down],
                load_factor=self._load_factor,
            )
        if name is None:
            # Nothing known healthy: start optimistic on the ranked pair; the first turn probes.
            name = place(key, list(self._pairs), loads=self._loads, healthy=self._pairs)
            assert name is not None
        self._loads[name] += 1
        return self._pairs[name]

    def release(self, pair: Pair) -> None:
        """A session left ``pair`` (closed or detached)."""
        self._loads[pair.name] = max(0, self._loads[pair.name] - 1)

    async def pair_for(self, session_id: str, current: Pair) -> Pair:
        """``current`` while it is healthy; otherwise a healthy pair to move the session to."""
        if self.is_healthy(current.name):
            return current
        now = self.clock()
        stale = [
            self._pairs[name]
            for name, since in self._down.items()
            if now - since >= self._health_recheck_s
        ]
        if stale:
            await asyncio.gather(*(self.probe(pair) for pair in stale))
        if len(self._down) == len(self._pairs):
            # Everything is down: probe all now rather than fail on stale marks.
            await asyncio.gather(*(self.probe(pair) for pair in self.pairs))
        if self.is_healthy(current.name):
            return current
        loads = dict(self._loads)
        loads[current.name] = max(0, loads[current.name] - 1)
        name = place(
            session_id,
            list(self._pairs),
            loads=loads,
            healthy=[p for p in self._pairs if p not in self._down],
            load_factor=self._load_factor,
        )
        if name is None:
            raise NoHealthyPairError(
                f"no healthy prefill/decode pair among {', '.join(self._pairs)}"
            )
        self._loads = loads
        self._loads[name] += 1
        logger.warning("agentkv.session_moved", session_id=session_id, old=current.name, new=name)
        return self._pairs[name]

    # --- placement of a turn's prefill ---------------------------------------------------------

    def choose_prefill(
        self, key: str, pair: Pair, *, warm: str | None, exclude: Collection[str] = (),
        prompt: Sequence[int] = (), salt: str | None = None,
    ) -> str:
        """This turn's prefill (a name): the pair's own, or the pool's best by load; without a
        ``warm`` one (a session's first turn) the prefill that last computed the longest prefix
        of ``prompt`` under ``salt`` counts as warm (``PrefixHomes``)."""
        if not self.pooled:
            return pair.name
        if warm is None and prompt:
            home = self.prefix_homes.home(salt, prompt)
            warm = None if home is None else home[0]
        names = [name for name in self._prefills if name not in exclude]
        now = self.clock()
        # A prefill marked down is tried again once the recheck interval has passed.
        down = self._prefill_down
        healthy = [n for n in names if now - down.get(n, -math.inf) >= self._health_recheck_s]
        name = choose_prefill(key, names, loads=self._prefill_loads, healthy=healthy, warm=warm,
                              weights=self.prefill_weights)
        if name is None:
            raise NoHealthyPairError(f"no healthy prefill among {', '.join(self._prefills)}")
        return name

    def prefill_url(self, name: str) -> str:
        return self._prefills[name]

    def prefill_begin(self, name: str, tokens: int) -> None:
        """``tokens`` more for prefill ``name`` to compute (a request sent to it)."""
        self._prefill_loads[name] += tokens

    def prefill_end(self, name: str, tokens: int) -> None:
        """The request ``prefill_begin`` counted is answered (or failed)."""
        self._prefill_loads[name] = max(0, self._prefill_loads[name] - tokens)

    def decode_queued(self, pair: Pair) -> int:
        """Tokens this pool's turns are computing on ``pair``'s decode itself (the ``decode``
        route), sent and not answered yet."""
        return self._decode_queued[pair.name]

    def decode_running(self, pair: Pair) -> int:
        """Requests this pool's turns have in flight on ``pair``'s decode (D legs, any route)."""
        return self._decode_running[pair.name]

    def decode_begin(self, pair: Pair, tokens: int) -> None:
        """A D leg starts on ``pair``'s decode, computing ``tokens`` itself (the decode route)."""
        self._decode_queued[pair.name] += tokens
        self._decode_running[pair.name] += 1

    def decode_end(self, pair: Pair, tokens: int) -> None:
        self._decode_queued[pair.name] = max(0, self._decode_queued[pair.name] - tokens)
        self._decode_running[pair.name] = max(0, self._decode_running[pair.name] - 1)

    # --- health --------------------------------------------------------------------------------

    def mark_down(self, pair: Pair, *, reason: str) -> None:
        if pair.name not in self._down:
            self._down[pair.name] = self.clock()
            self.leases.forget(pair.decode)
            logger.warning("agentkv.pair_unhealthy", pair=pair.name, reason=reason)

    def _mark_up(self, pair: Pair) -> None:
        if self._down.pop(pair.name, None) is not None:
            logger.info("agentkv.pair_healthy", pair=pair.name)

    async def probe(self, pair: Pair) -> bool:
        """GET /health on both servers of ``pair`` (one probe in flight per pair)."""
        task = self._probes.get(pair.name)
        if task is None:
            task = asyncio.ensure_future(self._probe_now(pair))
            self._probes[pair.name] = task
            task.add_done_callback(lambda _: self._probes.pop(pair.name, None))
        return await asyncio.shield(task)

    async def _probe_now(self, pair: Pair) -> bool:
        # In a pool a pair is its decode server: prefills have their own health (a dead
        # prefill must not move sessions off a live decode, where their KV is).
        urls = [pair.decode] if self.pooled else [pair.prefill, pair.decode]
        checks = [get_ok(self.poster, u + "/health", timeout_s=_HEALTH_TIMEOUT_S) for u in urls]
        ok = all(await asyncio.gather(*checks))
        if ok:
            self._mark_up(pair)
        else:
            self.mark_down(pair, reason="health check failed")
            self._down[pair.name] = self.clock()  # restart the recheck interval
        return ok

    def mark_prefill_down(self, name: str, *, reason: str) -> None:
        if name not in self._prefill_down:
            logger.warning("agentkv.prefill_unhealthy", prefill=name, reason=reason)
        self._prefill_down[name] = self.clock()

    def _mark_prefill_up(self, name: str) -> None:
        if self._prefill_down.pop(name, None) is not None:
            logger.info("agentkv.prefill_healthy", prefill=name)

    async def probe_prefill(self, name: str) -> bool:
        ok = await get_ok(
            self.poster, self._prefills[name] + "/health", timeout_s=_HEALTH_TIMEOUT_S
        )
        if ok:
            self._mark_prefill_up(name)
        else:
            self.mark_prefill_down(name, reason="health check failed")
        return ok

    async def check_health(self) -> dict[str, bool]:
        """Probe every pair's ``/health`` now; returns pair name -> healthy."""
        results = await asyncio.gather(*(self.probe(pair) for pair in self.pairs))
        return dict(zip(self._pairs, results, strict=True))

    # --- lifecycle -----------------------------------------------------------------------------

    async def aclose(self) -> None:
        """Close the HTTP client (if the pool made it), once the lease calls still running in
        the background (releases, tier deletes) are done, or cancelled past
        ``CLOSE_SETTLE_S``: closed under them they failed, and asyncio logged each failure as
        a task exception never retrieved."""
        if self.closed:
            return
        self.closed = True
        await self.leases.aclose(settle_s=_CLOSE_SETTLE_S)
        probes = list(self._probes.values())
        for task in probes:
            task.cancel()
        await asyncio.gather(*probes, return_exceptions=True)
        if self._owns_client:
            await self.poster.aclose()
