"""The cluster: prefill/decode pairs, their health, session placement, and the HTTP clients.

``AsyncCluster`` holds the state and does the I/O; ``Cluster`` is its sync twin, driving the same
core on a private event-loop thread (see ``_portal.py``).

>>> cluster = Cluster.from_dict({"model": "m", "pairs": [
...     {"name": "p0", "prefill": "http://127.0.0.1:8100", "decode": "http://127.0.0.1:8101"}]})
>>> [pair.name for pair in cluster.pairs]
['p0']
>>> cluster.close()
"""

from __future__ import annotations

import asyncio
import time
import types
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import structlog

from agentkv._exceptions import ConfigError, NoHealthyPairError, SessionClosedError
from agentkv._fields import check_extra_body
from agentkv._http import get_ok
from agentkv._json import JSONDecodeError, loads
from agentkv._leasing import LeaseCalls
from agentkv._placement import PrefillWeights, choose_prefill, place
from agentkv._policy import CachePolicy, RetryPolicy
from agentkv._portal import Portal
from agentkv._session import AsyncSession, Session, SessionOptions
from agentkv._template import ChatTemplate, ServerRenderer
from agentkv._transport import ClusterClient, ServerPools

__all__ = ["AsyncCluster", "Cluster", "Pair"]

logger = structlog.get_logger("agentkv")

# Long reads on purpose: a cold multi-thousand-token prefill on CPU takes minutes.
DEFAULT_TIMEOUT = httpx.Timeout(connect=5.0, read=600.0, write=60.0, pool=60.0)
# vLLM's API server (uvicorn) closes idle connections after VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s by
# default; keeping ours for less means we never send on a connection the server is closing (a
# failed P leg costs the turn its handle). The limits apply to each server (agentkv._transport).
DEFAULT_LIMITS = httpx.Limits(
    max_connections=1024, max_keepalive_connections=256, keepalive_expiry=4.0
)
_HEALTH_TIMEOUT_S = 2.0

T = TypeVar("T")


@dataclass(frozen=True, kw_only=True, slots=True)
class Pair:
    """One prefill server and the decode server it hands off to.

    >>> Pair(name="p0", prefill="http://127.0.0.1:8100/", decode="http://127.0.0.1:8101").prefill
    'http://127.0.0.1:8100'
    """

    name: str
    prefill: str
    decode: str

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError("a pair needs a non-empty name")
        for role in ("prefill", "decode"):
            url = getattr(self, role)
            if not isinstance(url, str) or not url.startswith(("http://", "https://")):
                raise ConfigError(f"pair {self.name!r}: {role} must be an http(s) URL, got {url!r}")
            object.__setattr__(self, role, url.rstrip("/"))


def _servers(raw: object, role: str, source: str) -> list[tuple[str, str]]:
    """A pool's list of servers: URLs, or ``{"name", "url"}`` objects."""
    if not isinstance(raw, list) or not raw:
        raise ConfigError(f"{source}: '{role}' must be a non-empty list")
    servers = []
    for index, item in enumerate(raw):
        name, url = f"{role}{index}", item
        if isinstance(item, Mapping):
            name, url = item.get("name", name), item.get("url")
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{source}: {role}[{index}] needs a non-empty name")
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ConfigError(f"{source}: {role}[{index}] must be an http(s) URL, got {url!r}")
        servers.append((name, url.rstrip("/")))
    if len({name for name, _ in servers}) != len(servers):
        raise ConfigError(f"{source}: duplicate names in '{role}'")
    return servers


def _parse_spec(spec: object, source: str) -> tuple[list[Pair], str, dict[str, Any]]:
    if not isinstance(spec, Mapping):
        raise ConfigError(
            f"{source}: a cluster spec is an object with 'model' and 'pairs' "
            "(or 'prefill' and 'decode' lists, a pool)"
        )
    model = spec.get("model")
    if not isinstance(model, str) or not model:
        raise ConfigError(f"{source}: 'model' must be a non-empty string")
    extra: dict[str, Any] = {}
    if "block_size" in spec:
        extra["block_size"] = spec["block_size"]
    threshold = spec.get("kv_recompute_threshold")
    if threshold is not None:
        # The servers' own threshold: handles are worth attaching down to it (the local pair
        # pulls whatever prefill lacks: 1), not only down to vLLM's default 64.
        if type(threshold) is not int or threshold < 0:
            raise ConfigError(
                f"{source}: 'kv_recompute_threshold' must be a non-negative integer"
            )
        extra["policy"] = CachePolicy(recompute_threshold=threshold)
    if "pairs" not in spec and ("prefill" in spec or "decode" in spec):
        prefills = _servers(spec.get("prefill"), "prefill", source)
        decodes = _servers(spec.get("decode"), "decode", source)
        extra["prefill_pool"] = dict(prefills)
        # In a pool a "pair" is a decode server; each turn picks its prefill from the pool.
        return (
            [Pair(name=name, prefill=prefills[0][1], decode=url) for name, url in decodes],
            model,
            extra,
        )
    raw_pairs = spec.get("pairs")
    if not isinstance(raw_pairs, list) or not raw_pairs:
        raise ConfigError(f"{source}: 'pairs' must be a non-empty list")
    pairs = []
    for index, raw in enumerate(raw_pairs):
        if not isinstance(raw, Mapping):
            raise ConfigError(f"{source}: pairs[{index}] is not an object")
        pairs.append(
            Pair(
                name=raw.get("name", f"pair{index}"),
                prefill=raw.get("prefill"),  # type: ignore[arg-type]  # Pair validates
                decode=raw.get("decode"),  # type: ignore[arg-type]
            )
        )
    return pairs, model, extra


def _read_spec(path: str | Path) -> object:
    try:
        return loads(Path(path).read_bytes())
    except FileNotFoundError:
        raise ConfigError(f"no cluster file at {path}; start one with `agentkv up`") from None
    except (OSError, JSONDecodeError) as exc:
        raise ConfigError(f"cluster file {path} is unreadable: {exc}") from exc


class AsyncCluster:
    """Prefill/decode pairs serving one model; opens sessions on them.

    Args:
        pairs: the pairs (at least one, unique names).
        model: the served model name, as sent in requests.
        transport: an httpx async transport for the default client (tests pass a fake's).
        http_client: use this client instead; the cluster does not close it.
        timeout: the default client's timeouts.
        policy: the default ``CachePolicy`` of sessions.
        retry: the ``RetryPolicy`` of turns.
        clock: monotonic seconds, for handle deadlines (tests pass a manual clock).
        block_size: the servers' KV block size, when known; sharpens ``TurnStats.pulled_tokens``.
        load_factor: bounded-load placement: a pair takes at most this times the average.
        health_recheck_s: how long an unhealthy pair is left alone before it is probed again.
        prefill_pool: a pool (xPyD): prefill name -> URL. Each pair is then a decode server and
            every turn picks its prefill from the pool by load (``choose_prefill``).
        prefill_weights: how strongly a turn prefers the prefill that served the session last.

    >>> async def main():  # doctest: +SKIP
    ...     async with AsyncCluster.from_file(".agentkv/cluster.json") as cluster:
    ...         async with cluster.session() as s:
    ...             print((await s.send("Hello!")).text)
    """

    def __init__(
        self,
        pairs: Iterable[Pair],
        *,
        model: str,
        transport: httpx.AsyncBaseTransport | None = None,
        http_client: httpx.AsyncClient | None = None,
        timeout: httpx.Timeout | float = DEFAULT_TIMEOUT,
        policy: CachePolicy | None = None,
        retry: RetryPolicy | None = None,
        clock: Callable[[], float] = time.monotonic,
        block_size: int | None = None,
        load_factor: float = 1.25,
        health_recheck_s: float = 5.0,
        prefill_pool: Mapping[str, str] | None = None,
        prefill_weights: PrefillWeights | None = None,
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
        if load_factor < 1.0:
            raise ConfigError(f"load_factor must be at least 1, got {load_factor}")
        if http_client is not None and transport is not None:
            raise ConfigError("pass transport= or http_client=, not both")
        self.model = model
        self.policy = policy or CachePolicy()
        self.retry = retry or RetryPolicy()
        self.clock = clock
        self.block_size = block_size
        self._load_factor = load_factor
        self._health_recheck_s = health_recheck_s
        self._owns_client = http_client is None
        self._client = http_client or ClusterClient(
            transport=transport or ServerPools(DEFAULT_LIMITS), timeout=timeout
        )
        self._loads = dict.fromkeys(self._pairs, 0)
        self._down: dict[str, float] = {}
        self._pooled = prefill_pool is not None
        if prefill_pool is not None and not prefill_pool:
            raise ConfigError("a prefill pool needs at least one server")
        # Prefill servers by name: the pool's, or each pair's own (named as the pair).
        self._prefills: dict[str, str] = (
            {name: url.rstrip("/") for name, url in prefill_pool.items()}
            if prefill_pool is not None
            else {pair.name: pair.prefill for pair in self._pairs.values()}
        )
        self.prefill_weights = prefill_weights or PrefillWeights()
        # Outstanding tokens per prefill: sent, not answered yet (what a turn adds, see _turn).
        self._prefill_loads = dict.fromkeys(self._prefills, 0)
        self._prefill_down: dict[str, float] = {}
        self._templates: dict[str, ChatTemplate] = {}
        self._probes: dict[str, asyncio.Task[bool]] = {}
        self._leases = LeaseCalls(self._client, clock=clock)
        self._closed = False

    @classmethod
    def from_dict(cls, spec: Mapping[str, Any], **options: Any) -> AsyncCluster:
        """From a cluster spec ``{"model": ..., "pairs": [{"name", "prefill", "decode"}]}``."""
        pairs, model, extra = _parse_spec(spec, "cluster spec")
        return cls(pairs, model=model, **{**extra, **options})

    @classmethod
    def from_file(cls, path: str | Path, **options: Any) -> AsyncCluster:
        """From a cluster file, as ``agentkv up`` writes it."""
        pairs, model, extra = _parse_spec(_read_spec(path), str(path))
        return cls(pairs, model=model, **{**extra, **options})

    # --- reading -------------------------------------------------------------------------------

    @property
    def pairs(self) -> tuple[Pair, ...]:
        return tuple(self._pairs.values())

    @property
    def http_client(self) -> httpx.AsyncClient:
        return self._client

    @property
    def closed(self) -> bool:
        return self._closed

    def loads(self) -> dict[str, int]:
        """Open sessions per pair (in a pool: per decode server)."""
        return dict(self._loads)

    @property
    def pooled(self) -> bool:
        """Whether prefills form a pool that any session's turn may use."""
        return self._pooled

    @property
    def prefills(self) -> dict[str, str]:
        """Prefill servers, name -> URL (without a pool, each pair's, named as the pair)."""
        return dict(self._prefills)

    def prefill_loads(self) -> dict[str, int]:
        """Outstanding tokens per prefill: prompt tokens in flight that it computes."""
        return dict(self._prefill_loads)

    def is_healthy(self, pair: str) -> bool:
        return pair not in self._down

    def is_prefill_healthy(self, prefill: str) -> bool:
        return prefill not in self._prefill_down

    # --- sessions ------------------------------------------------------------------------------

    def session(
        self,
        *,
        session_id: str | None = None,
        policy: CachePolicy | None = None,
        max_tokens: int = 256,
        temperature: float | None = 0.0,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: Any = None,
        extra_body: Mapping[str, Any] | None = None,
        placement_key: str | None = None,
    ) -> AsyncSession:
        """Open a session, placed on a pair by its id. Use it as an async context manager.

        ``max_tokens``, ``temperature``, ``tools``, ``tool_choice`` and ``extra_body`` (more
        sampling fields for the decode request) are defaults that each turn can override.
        ``placement_key`` places the session by that key instead of its id: sessions that share
        a prompt prefix and a key land on the same pair, whose prefill cache holds the prefix.
        """
        self._check_open()
        check_extra_body(extra_body or {})
        options = SessionOptions(
            max_tokens=max_tokens,
            temperature=temperature,
            tools=tuple(tools) if tools else None,
            tool_choice=tool_choice,
            extra_body=types.MappingProxyType(dict(extra_body or {})),
        )
        return AsyncSession._open(
            self,
            session_id=session_id,
            policy=policy or self.policy,
            options=options,
            placement_key=placement_key,
        )

    # --- used by sessions ----------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise SessionClosedError("the cluster is closed; sessions need an open cluster")

    def _template(self, prefill_url: str) -> ChatTemplate:
        template = self._templates.get(prefill_url)
        if template is None:
            renderer = ServerRenderer(self._client, prefill_url, model=self.model)
            template = self._templates[prefill_url] = ChatTemplate(renderer)
        return template

    def _choose_prefill(
        self, key: str, pair: Pair, *, warm: str | None, exclude: Collection[str] = ()
    ) -> str:
        """This turn's prefill (a name): the pair's own, or the pool's best by load."""
        if not self._pooled:
            return pair.name
        names = [name for name in self._prefills if name not in exclude]
        now = self.clock()
        # A prefill marked down is tried again once the recheck interval has passed.
        healthy = [
            name
            for name in names
            if now - self._prefill_down.get(name, -float("inf")) >= self._health_recheck_s
        ]
        name = choose_prefill(
            key,
            names,
            loads=self._prefill_loads,
            healthy=healthy,
            warm=warm,
            weights=self.prefill_weights,
        )
        if name is None:
            raise NoHealthyPairError(f"no healthy prefill among {', '.join(self._prefills)}")
        return name

    def _prefill_url(self, name: str) -> str:
        return self._prefills[name]

    def _prefill_begin(self, name: str, tokens: int) -> None:
        self._prefill_loads[name] += tokens

    def _prefill_end(self, name: str, tokens: int) -> None:
        self._prefill_loads[name] = max(0, self._prefill_loads[name] - tokens)

    def _mark_prefill_down(self, name: str, *, reason: str) -> None:
        if name not in self._prefill_down:
            logger.warning("agentkv.prefill_unhealthy", prefill=name, reason=reason)
        self._prefill_down[name] = self.clock()

    def _mark_prefill_up(self, name: str) -> None:
        if self._prefill_down.pop(name, None) is not None:
            logger.info("agentkv.prefill_healthy", prefill=name)

    async def _probe_prefill(self, name: str) -> bool:
        ok = await get_ok(
            self._client, self._prefills[name] + "/health", timeout_s=_HEALTH_TIMEOUT_S
        )
        if ok:
            self._mark_prefill_up(name)
        else:
            self._mark_prefill_down(name, reason="health check failed")
        return ok

    def _acquire(self, session_id: str, *, near: Pair | None = None) -> Pair:
        """Place a new session; on ``near`` if healthy (a fork shares its parent's cache)."""
        if near is not None and self.is_healthy(near.name):
            name: str | None = near.name
        else:
            name = place(
                session_id,
                list(self._pairs),
                loads=self._loads,
                healthy=[p for p in self._pairs if p not in self._down],
                load_factor=self._load_factor,
            )
        if name is None:
            # Nothing known healthy: start optimistic on the ranked pair; the first turn probes.
            name = place(session_id, list(self._pairs), loads=self._loads, healthy=self._pairs)
            assert name is not None
        self._loads[name] += 1
        return self._pairs[name]

    def _decode_url(self, pair: str) -> str:
        return self._pairs[pair].decode

    def _release(self, pair: Pair) -> None:
        self._loads[pair.name] = max(0, self._loads[pair.name] - 1)

    def _mark_down(self, pair: Pair, *, reason: str) -> None:
        if pair.name not in self._down:
            self._down[pair.name] = self.clock()
            self._leases.forget(pair.decode)
            logger.warning("agentkv.pair_unhealthy", pair=pair.name, reason=reason)

    def _mark_up(self, pair: Pair) -> None:
        if self._down.pop(pair.name, None) is not None:
            logger.info("agentkv.pair_healthy", pair=pair.name)

    async def _probe(self, pair: Pair) -> bool:
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
        urls = [pair.decode] if self._pooled else [pair.prefill, pair.decode]
        checks = [get_ok(self._client, u + "/health", timeout_s=_HEALTH_TIMEOUT_S) for u in urls]
        ok = all(await asyncio.gather(*checks))
        if ok:
            self._mark_up(pair)
        else:
            self._mark_down(pair, reason="health check failed")
            self._down[pair.name] = self.clock()  # restart the recheck interval
        return ok

    async def _pair_for(self, session_id: str, current: Pair) -> Pair:
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
            await asyncio.gather(*(self._probe(pair) for pair in stale))
        if len(self._down) == len(self._pairs):
            # Everything is down: probe all now rather than fail on stale marks.
            await asyncio.gather(*(self._probe(pair) for pair in self.pairs))
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

    # --- lifecycle -----------------------------------------------------------------------------

    async def check_health(self) -> dict[str, bool]:
        """Probe every pair's ``/health`` now; returns pair name -> healthy."""
        results = await asyncio.gather(*(self._probe(pair) for pair in self.pairs))
        return dict(zip(self._pairs, results, strict=True))

    async def aclose(self) -> None:
        """Close the HTTP client (if the cluster made it). Sessions should be closed first."""
        if self._closed:
            return
        self._closed = True
        if self._owns_client:
            await self._client.aclose()

    async def __aenter__(self) -> AsyncCluster:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


class Cluster:
    """The sync twin of ``AsyncCluster``: same arguments, blocking calls.

    >>> with Cluster.from_file(".agentkv/cluster.json") as cluster:  # doctest: +SKIP
    ...     with cluster.session() as s:
    ...         s.append(Message.system("Be brief."), Message.user("Capital of France?"))
    ...         print(s.turn().text)
    """

    def __init__(
        self,
        pairs: Iterable[Pair],
        *,
        model: str,
        transport: httpx.AsyncBaseTransport | None = None,
        http_client: httpx.AsyncClient | None = None,
        timeout: httpx.Timeout | float = DEFAULT_TIMEOUT,
        policy: CachePolicy | None = None,
        retry: RetryPolicy | None = None,
        clock: Callable[[], float] = time.monotonic,
        block_size: int | None = None,
        load_factor: float = 1.25,
        health_recheck_s: float = 5.0,
        prefill_pool: Mapping[str, str] | None = None,
        prefill_weights: PrefillWeights | None = None,
    ) -> None:
        self._async = AsyncCluster(
            pairs,
            model=model,
            transport=transport,
            http_client=http_client,
            timeout=timeout,
            policy=policy,
            retry=retry,
            clock=clock,
            block_size=block_size,
            load_factor=load_factor,
            health_recheck_s=health_recheck_s,
            prefill_pool=prefill_pool,
            prefill_weights=prefill_weights,
        )
        self._portal = Portal()

    @classmethod
    def from_dict(cls, spec: Mapping[str, Any], **options: Any) -> Cluster:
        """From a cluster spec ``{"model": ..., "pairs": [{"name", "prefill", "decode"}]}``."""
        pairs, model, extra = _parse_spec(spec, "cluster spec")
        return cls(pairs, model=model, **{**extra, **options})

    @classmethod
    def from_file(cls, path: str | Path, **options: Any) -> Cluster:
        """From a cluster file, as ``agentkv up`` writes it."""
        pairs, model, extra = _parse_spec(_read_spec(path), str(path))
        return cls(pairs, model=model, **{**extra, **options})

    @property
    def pairs(self) -> tuple[Pair, ...]:
        return self._async.pairs

    @property
    def model(self) -> str:
        return self._async.model

    def loads(self) -> dict[str, int]:
        """Open sessions per pair (in a pool: per decode server)."""
        return self._portal.call(_call(self._async.loads))

    def prefill_loads(self) -> dict[str, int]:
        """Outstanding tokens per prefill."""
        return self._portal.call(_call(self._async.prefill_loads))

    def session(
        self,
        *,
        session_id: str | None = None,
        policy: CachePolicy | None = None,
        max_tokens: int = 256,
        temperature: float | None = 0.0,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: Any = None,
        extra_body: Mapping[str, Any] | None = None,
    ) -> Session:
        """Open a session (see ``AsyncCluster.session``). Use it as a context manager."""
        self._async._check_open()

        def _open() -> AsyncSession:
            return self._async.session(
                session_id=session_id,
                policy=policy,
                max_tokens=max_tokens,
                temperature=temperature,
                tools=tools,
                tool_choice=tool_choice,
                extra_body=extra_body,
            )

        return Session(self._portal.call(_call(_open)), portal=self._portal)

    def check_health(self) -> dict[str, bool]:
        """Probe every pair's ``/health`` now; returns pair name -> healthy."""
        return self._portal.call(self._async.check_health())

    def close(self) -> None:
        """Close the HTTP client and stop the cluster's event-loop thread (idempotent)."""
        if self._async.closed:
            return
        self._portal.call(self._async.aclose())
        self._portal.close()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


async def _call(fn: Callable[[], T]) -> T:
    """Run a plain function on the cluster's loop thread (cluster state lives there)."""
    return fn()
