"""The cluster: the public face of a pair pool; opens, loads and restores sessions on it.

``AsyncCluster`` is a thin facade over a ``PairPool`` (``_pool.py``: the pairs, their load and
health, placement, HTTP, lease calls, templates, clock); ``Cluster`` is its sync twin, driving the
same pool on a private event-loop thread (see ``_portal.py``). Both are written once, in
``_Twin``: each only says how a call runs on its side and how a session is handed out.

>>> cluster = Cluster.from_dict({"model": "m", "pairs": [
...     {"name": "p0", "prefill": "http://127.0.0.1:8100", "decode": "http://127.0.0.1:8101"}]})
>>> [pair.name for pair in cluster.pairs]
['p0']
>>> cluster.close()
"""

from __future__ import annotations

import os
import types
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Generic, Self, TypeVar, Unpack

import httpx2

from agentkv import _constants as defaults
from agentkv._client.cluster_spec import merge_options, parse_spec, read_spec
from agentkv._client.leasing import decode_kv_usage, release_request
from agentkv._client.pool import ClusterOptions, PairPool
from agentkv._client.portal import Portal
from agentkv._client.session import (
    AsyncSession,
    Session,
    load_session,
    open_session,
    restore_session,
)
from agentkv._placement import PrefillWeights, RetryPolicy
from agentkv._policy import CachePolicy
from agentkv._route import Route, check_route
from agentkv._types import Pair, SessionOptions
from agentkv._wire.fields import check_extra_body
from agentkv._wire.transport import Poster

__all__ = ["AsyncCluster", "Cluster", "Pair"]

T = TypeVar("T")
SessionT = TypeVar("SessionT", AsyncSession, Session)


class _Twin(Generic[SessionT]):
    """What both twins share, written once: the constructors, the reading, and each session
    call's plan (checks and options: no I/O). A twin says only how a call runs on its side
    (``_run``: inline, or on the sync twin's loop thread) and how an opened session is handed out
    (``_hand_out``); ``tests/unit/test_twins.py`` keeps the rest in step."""

    _pool: PairPool

    def __init__(
        self, pairs: Iterable[Pair], *, model: str, **options: Unpack[ClusterOptions]
    ) -> None:
        self._pool = PairPool(pairs, model=model, **options)
        self._started()

    @classmethod
    def from_dict(cls, spec: Mapping[str, Any], **options: Unpack[ClusterOptions]) -> Self:
        """From a cluster spec ``{"model": ..., "pairs": [{"name", "prefill", "decode"}]}``;
        ``options`` win over the spec's."""
        pairs, model, extra = parse_spec(spec, "cluster spec")
        return cls(pairs, model=model, **merge_options(extra, options))

    @classmethod
    def from_file(cls, path: str | Path, **options: Unpack[ClusterOptions]) -> Self:
        """From a cluster file, as ``agentkv up`` writes it."""
        pairs, model, extra = parse_spec(read_spec(path), str(path))
        return cls(pairs, model=model, **merge_options(extra, options))

    def _started(self) -> None:
        """The twin's own setup, once the pool exists."""

    def _run(self, fn: Callable[[], T]) -> T:
        raise NotImplementedError

    def _hand_out(self, open_: Callable[[], AsyncSession]) -> SessionT:
        raise NotImplementedError

    # --- reading -------------------------------------------------------------------------------

    @property
    def policy(self) -> CachePolicy:
        """The default ``CachePolicy`` of sessions (``session(policy=...)`` overrides it)."""
        return self._pool.policy

    @policy.setter
    def policy(self, policy: CachePolicy) -> None:
        self._pool.policy = policy

    @property
    def model(self) -> str:
        """The served model name, as sent in requests."""
        return self._pool.model

    @property
    def retry(self) -> RetryPolicy:
        return self._pool.retry

    @property
    def clock(self) -> Callable[[], float]:
        """Monotonic seconds: every handle deadline is on this clock."""
        return self._pool.clock

    @property
    def block_size(self) -> int | None:
        return self._pool.block_size

    @property
    def max_model_len(self) -> int | None:
        """The servers' context in tokens, once a turn's rendering or the cluster file said it."""
        return self._pool.max_model_len

    @property
    def prefill_weights(self) -> PrefillWeights:
        return self._pool.prefill_weights

    @property
    def pairs(self) -> tuple[Pair, ...]:
        return self._pool.pairs

    @property
    def closed(self) -> bool:
        return self._pool.closed

    @property
    def pooled(self) -> bool:
        """Whether prefills form a pool that any session's turn may use."""
        return self._pool.pooled

    @property
    def prefills(self) -> dict[str, str]:
        """Prefill servers, name -> URL (without a pool, each pair's, named as the pair)."""
        return self._pool.prefills

    # Load and health change on the pool's loop: the sync twin reads them there.

    def loads(self) -> dict[str, int]:
        """Open sessions per pair (in a pool: per decode server)."""
        return self._run(self._pool.loads)

    def prefill_loads(self) -> dict[str, int]:
        """Outstanding tokens per prefill: prompt tokens in flight that it computes."""
        return self._run(self._pool.prefill_loads)

    def is_healthy(self, pair: str) -> bool:
        return self._run(lambda: self._pool.is_healthy(pair))

    def is_prefill_healthy(self, prefill: str) -> bool:
        return self._run(lambda: self._pool.is_prefill_healthy(prefill))

    # --- sessions ------------------------------------------------------------------------------

    def session(
        self,
        *,
        session_id: str | None = None,
        policy: CachePolicy | None = None,
        max_tokens: int = defaults.MAX_TOKENS,
        temperature: float | None = defaults.TEMPERATURE,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: Any = None,
        extra_body: Mapping[str, Any] | None = None,
        placement_key: str | None = None,
        route: Route = "pull",
        near: Pair | None = None,
    ) -> SessionT:
        """Open a session, placed on a pair by its id. Use it as a context manager (``async
        with`` on ``AsyncCluster``).

        ``max_tokens``, ``temperature``, ``tools``, ``tool_choice`` and ``extra_body`` (more
        sampling fields for the decode request) are defaults that each turn can override.
        ``placement_key`` places the session by that key instead of its id: sessions that share
        a prompt prefix and a key land on the same pair, whose prefill cache holds the prefix.
        ``route`` is how each turn's prompt reaches decode (a turn can override it): ``"pull"``
        (prefill pulls the KV back; the default), ``"decode"`` (the session's decode computes
        the new tokens itself), ``"recompute"``, or ``"auto"`` (the policy chooses per turn,
        ``CachePolicy.route``: short appends on decode, the rest pulled). ``near`` opens it on that
        pair while it is healthy, whatever its load: a session that shares another's prefix (a
        thread of the same agent) finds it in that pair's prefill cache.
        """
        self._pool.check_open()
        check_extra_body(extra_body or {})
        options = SessionOptions(
            max_tokens=max_tokens,
            temperature=temperature,
            tools=tuple(tools) if tools else None,
            tool_choice=tool_choice,
            extra_body=types.MappingProxyType(dict(extra_body or {})),
            route=check_route(route),
        )
        resolved = policy or self._pool.policy
        return self._hand_out(
            lambda: open_session(
                self._pool,
                session_id=session_id,
                policy=resolved,
                options=options,
                placement_key=placement_key,
                near=near,
            )
        )

    def load_session(self, path: str | os.PathLike[str]) -> SessionT:
        """Continue a session saved with ``session.save(path)``; its handle is reused if decode
        confirms it still holds it.

        Placed on its saved pair when that is healthy, another otherwise (the handle is then
        dropped). ``SessionLoadError`` for a missing, corrupt or unknown-version file, or one
        saved on another model.

        >>> session = cluster.load_session("run.json")  # doctest: +SKIP
        """
        return self._hand_out(lambda: load_session(self._pool, path))

    def restore_session(
        self,
        data: Mapping[str, Any] | bytes,
        *,
        confirmed: bool = False,
        drop_handle: str | None = None,
    ) -> SessionT:
        """Continue a session from its ``session.snapshot()`` dict or ``snapshot_bytes()`` (as
        ``load_session`` does from a file): a store of sessions shared by processes keeps these.

        Its handle is claimed from decode before a turn attaches it (one claim call, exclusive:
        of several copies, one attaches), as a loaded one is, unless ``confirmed``: the caller
        knows the snapshot is the session's latest state and that nothing used the handle since
        it was taken (the proxy's shared store knows it from its claims). A handle that a later
        turn consumed, or that was released, names blocks decode may have given to another
        request: say ``confirmed`` only when no such turn or release can have happened.
        ``drop_handle``, a reason: another copy may be using the handle now (its holder stopped
        mid-turn): it is neither attached nor released, and the next turn says why.
        """
        return self._hand_out(
            lambda: restore_session(self._pool, data, confirmed=confirmed, drop_handle=drop_handle)
        )


class AsyncCluster(_Twin[AsyncSession]):
    """Prefill/decode pairs serving one model; opens sessions on them.

    Args:
        pairs: the pairs (at least one, unique names).
        model: the served model name, as sent in requests.
        **options: ``ClusterOptions``: ``transport`` or ``http_client``, ``timeout``,
            ``policy`` (sessions' default ``CachePolicy``), ``retry``, ``clock``,
            ``block_size``, ``load_factor``, ``health_recheck_s``, ``prefill_pool`` (xPyD),
            ``prefill_weights``.

    >>> async def main():  # doctest: +SKIP
    ...     async with AsyncCluster.from_file(".agentkv/cluster.json") as cluster:
    ...         async with cluster.session() as s:
    ...             print((await s.send("Hello!")).text)
    """

    @classmethod
    def _over(cls, pool: PairPool) -> AsyncCluster:
        """The async face of an existing pool (the sync twin's, for what runs on its loop)."""
        cluster = cls.__new__(cls)
        cluster._pool = pool
        return cluster

    def _run(self, fn: Callable[[], T]) -> T:
        return fn()

    def _hand_out(self, open_: Callable[[], AsyncSession]) -> AsyncSession:
        return open_()

    @property
    def http_client(self) -> httpx2.AsyncClient | None:
        """The client given as ``http_client=``; ``None`` when the cluster sends with its own."""
        return self._pool.http_client

    @property
    def poster(self) -> Poster:
        """What every request to the servers goes through (``agentkv._wire.transport``)."""
        return self._pool.poster

    async def check_health(self) -> dict[str, bool]:
        """Probe every pair's ``/health`` now; returns pair name -> healthy."""
        return await self._pool.check_health()

    async def release_request(self, secret: str) -> int:
        """Free what any decode server pinned for the D leg tagged with ``secret`` (a turn's
        ``request_secret``), or, where that leg has not finished yet, keep it from pinning
        anything. Returns how many decode servers took the release.

        For a turn whose answer, and so its handle, was never stored where a next turn finds it
        (a proxy replica whose commit was refused). Best effort: never raises for the servers'
        sake; a pin nobody releases lives out decode's TTL.
        """
        return await release_request(self._pool, secret)

    async def kv_usage(self) -> dict[str, float | None]:
        """Each pair's decode KV memory in use now (0-1, vLLM's ``kv_cache_usage_perc``), by
        pair name; ``None`` where it cannot be read. One ``/metrics`` read per decode server."""
        return await decode_kv_usage(self._pool)

    async def aclose(self) -> None:
        """Close the HTTP client (if the cluster made it). Sessions should be closed first;
        lease calls they left running in the background (releases, tier deletes) are waited
        for first, at most ``LEASE_CALL_TIMEOUT_S`` (5 s), then cancelled."""
        await self._pool.aclose()

    async def __aenter__(self) -> AsyncCluster:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


class Cluster(_Twin[Session]):
    """The sync twin of ``AsyncCluster``: same arguments, blocking calls.

    >>> with Cluster.from_file(".agentkv/cluster.json") as cluster:  # doctest: +SKIP
    ...     with cluster.session() as s:
    ...         s.append(Message.system("Be brief."), Message.user("Capital of France?"))
    ...         print(s.turn().text)
    """

    def _started(self) -> None:
        # The pool lives on this loop thread; ``_async`` is its async face there (the proxy's
        # app that ``agentkv.OpenAI`` runs, the agent).
        self._async = AsyncCluster._over(self._pool)
        self._portal = Portal()

    def _run(self, fn: Callable[[], T]) -> T:
        return self._portal.call(_call(fn))

    def _hand_out(self, open_: Callable[[], AsyncSession]) -> Session:
        self._pool.check_open()
        return Session(self._portal.call(_call(open_)), portal=self._portal)

    def check_health(self) -> dict[str, bool]:
        """Probe every pair's ``/health`` now; returns pair name -> healthy."""
        return self._portal.call(self._pool.check_health())

    def release_request(self, secret: str) -> int:
        """Free what any decode server pinned for the D leg tagged with ``secret``
        (``AsyncCluster.release_request``)."""
        return self._portal.call(release_request(self._pool, secret))

    def kv_usage(self) -> dict[str, float | None]:
        """Each pair's decode KV memory in use now, by pair name (``AsyncCluster.kv_usage``)."""
        return self._portal.call(decode_kv_usage(self._pool))

    def close(self) -> None:
        """Close the HTTP client and stop the cluster's event-loop thread (idempotent)."""
        if self._pool.closed:
            return
        self._portal.call(self._pool.aclose())
        self._portal.close()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


async def _call(fn: Callable[[], T]) -> T:
    """Run a plain function on the cluster's loop thread (cluster state lives there)."""
    return fn()
