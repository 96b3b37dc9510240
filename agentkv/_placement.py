"""Pure decisions about placement and retries: where a session lives, where each turn prefills,
how a failed turn is retried. Ids and observed load in, a decision out, no I/O.

A session is pinned to a decode server (a pair's, or one of a pool's): between turns its KV lives
there. Each turn's prefill is chosen by ``choose_prefill`` over the prefills' outstanding tokens;
any prefill can pull from any decode (the handle names decode's engine id, host and port, and
vLLM's NIXL connector handshakes with a new remote engine on first use).

Rendezvous (highest-random-weight) hashing ranks the pairs per session id, so a session's pair
does not change when unrelated pairs come and go; the bounded-load rule skips a pair that already
holds more than ``ceil(load_factor * average)`` sessions, so no pair gets a hot spot.

>>> place("session-1", ["a", "b"], loads={}, healthy={"a", "b"}) in {"a", "b"}
True
>>> place("session-1", ["a", "b"], loads={}, healthy=set()) is None
True
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass

from agentkv import _constants as defaults
from agentkv._exceptions import ConfigError

__all__ = ["PrefillWeights", "PrefixHomes", "RetryPolicy", "choose_prefill", "place", "rank"]


@dataclass(frozen=True, kw_only=True, slots=True)
class RetryPolicy:
    """How often and how patiently a turn is retried after transport errors and 5xx answers.

    ``max_attempts`` counts whole attempts at a turn (first try included). Waits grow
    exponentially from ``initial_backoff_s`` to at most ``max_backoff_s``, with up to ``jitter_s``
    of random jitter so that many sessions do not retry in lockstep.

    >>> RetryPolicy(max_attempts=1)  # never retry
    RetryPolicy(max_attempts=1, initial_backoff_s=0.05, max_backoff_s=1.0, jitter_s=0.05)
    """

    max_attempts: int = defaults.RETRY_ATTEMPTS
    initial_backoff_s: float = defaults.RETRY_INITIAL_BACKOFF_S
    max_backoff_s: float = defaults.RETRY_MAX_BACKOFF_S
    jitter_s: float = defaults.RETRY_JITTER_S

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ConfigError(f"max_attempts must be at least 1, got {self.max_attempts}")
        if min(self.initial_backoff_s, self.max_backoff_s, self.jitter_s) < 0:
            raise ConfigError("backoff and jitter must not be negative")


def _score(session_id: str, pair: str) -> int:
    # blake2b, not hash(): placement must agree across processes (PYTHONHASHSEED varies).
    digest = hashlib.blake2b(session_id.encode() + b"\x00" + pair.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def rank(session_id: str, pairs: Sequence[str]) -> list[str]:
    """``pairs`` in this session's rendezvous order, best first."""
    return sorted(pairs, key=lambda pair: (_score(session_id, pair), pair), reverse=True)


def place(
    session_id: str,
    pairs: Sequence[str],
    *,
    loads: Mapping[str, int],
    healthy: Collection[str],
    load_factor: float = defaults.LOAD_FACTOR,
) -> str | None:
    """The pair for a new (or moving) session, or ``None`` when no pair is healthy.

    ``loads`` counts the sessions already on each pair (not this one). A healthy pair is
    eligible while its load is under ``ceil(load_factor * (total + 1) / healthy pairs)``; the
    eligible pair ranked highest for ``session_id`` wins.
    """
    candidates = [pair for pair in pairs if pair in healthy]
    if not candidates:
        return None
    total = sum(loads.get(pair, 0) for pair in candidates) + 1
    capacity = math.ceil(load_factor * total / len(candidates))
    ranked = rank(session_id, candidates)
    for pair in ranked:
        if loads.get(pair, 0) < capacity:
            return pair
    return ranked[0]  # unreachable for load_factor >= 1: capacities sum past total


@dataclass(frozen=True, kw_only=True, slots=True)
class PrefillWeights:
    """How much load a prefill that still caches the session's prefix may carry and still win.

    A prefill's load is its outstanding tokens: prompt tokens it has been sent and has not
    answered yet, less the tokens those requests pull from decode (``AsyncCluster.
    prefill_loads``). The warm prefill (the one that served the session's previous turn, whose
    prefix cache still holds the session's blocks and so pulls less from decode) is kept while
    its load exceeds the least loaded prefill's by less than ``max(slack_tokens, slack_ratio *
    least)``; otherwise the least loaded prefill wins. ``slack_tokens=0, slack_ratio=0`` is pure
    load (warmth counts for nothing, not even between equals).

    What warmth saves is transfer, not compute: a prefill that lacks the prefix pulls all of it
    from decode (every turn's cached tokens are the same either way). On GPUs with RDMA a pull of
    a long context takes a few tens of milliseconds, about what 512 queued tokens of prefill cost,
    so the defaults keep the warm prefill while it is at most 512 tokens (or 10% on a busy pool)
    behind the least loaded. ``benchmarks/placement_sim.py`` measures the balance they give.
    """

    slack_tokens: int = defaults.PREFILL_SLACK_TOKENS
    slack_ratio: float = defaults.PREFILL_SLACK_RATIO

    def __post_init__(self) -> None:
        if self.slack_tokens < 0 or self.slack_ratio < 0:
            raise ValueError("prefill weights must be non-negative")

    def slack(self, least: int) -> float:
        return max(float(self.slack_tokens), self.slack_ratio * least)


def choose_prefill(
    key: str,
    prefills: Sequence[str],
    *,
    loads: Mapping[str, int],
    healthy: Collection[str],
    warm: str | None = None,
    weights: PrefillWeights = PrefillWeights(),
) -> str | None:
    """The prefill for one turn, or ``None`` when no candidate is healthy.

    The warm prefill wins while its load is less than ``weights.slack`` above the least loaded;
    otherwise the least loaded wins, ties broken by the rendezvous rank of ``key`` (pass the
    session id and turn number, so that equal loads spread turns and sessions over the pool).

    >>> choose_prefill("s/1", ["p0", "p1"], loads={"p0": 100, "p1": 0}, healthy={"p0", "p1"},
    ...                warm="p0")
    'p0'
    >>> choose_prefill("s/1", ["p0", "p1"], loads={"p0": 9000, "p1": 0}, healthy={"p0", "p1"},
    ...                warm="p0")
    'p1'
    """
    candidates = [name for name in prefills if name in healthy]
    if not candidates:
        return None
    least = min(loads.get(name, 0) for name in candidates)
    if warm in candidates and loads.get(warm, 0) - least < weights.slack(least):
        return warm
    ranked = rank(key, candidates)
    return min(ranked, key=lambda name: loads.get(name, 0))  # min keeps the first of equals


class PrefixHomes:
    """Which prefill last computed each prompt prefix: where a session's first turn finds it.

    Sessions that share a long prefix with each other but not with anyone's pin (Claude Code's
    subagents share their system prompt and tools, ~10k tokens, and nothing with their parent)
    reuse it only on the prefill whose prefix cache holds it. Each successful P leg records its
    prompt here, in chunks of ``chunk_tokens``, each chunk keyed by a hash chained over the
    chunks before it (and the request's ``cache_salt``: vLLM shares a prefix only within one
    salt); a session's first turn then treats the prefill of its deepest recorded chunk as warm
    (``choose_prefill``'s slack still lets load win). At most ``max_chunks`` chunks are kept,
    the least recently used dropped first. Hash collisions can only misplace a turn, never serve
    wrong KV: the prefix cache itself checks the tokens.

    >>> homes = PrefixHomes(chunk_tokens=4)
    >>> homes.record("p1", None, list(range(10)))
    >>> homes.home(None, [0, 1, 2, 3, 4, 5, 6, 7, 99])
    ('p1', 8)
    >>> homes.home("other-tenant", list(range(10))) is None
    True
    """

    def __init__(
        self,
        *,
        chunk_tokens: int = defaults.PREFIX_HOME_CHUNK_TOKENS,
        max_chunks: int = defaults.PREFIX_HOME_MAX_CHUNKS,
    ) -> None:
        if chunk_tokens < 1 or max_chunks < 1:
            raise ValueError("chunk_tokens and max_chunks must be positive")
        self.chunk_tokens = chunk_tokens
        self._max_chunks = max_chunks
        self._homes: OrderedDict[int, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._homes)

    def _chain(self, salt: str | None, tokens: Sequence[int]) -> Iterator[int]:
        key = hash(("agentkv-prefix", salt))
        size = self.chunk_tokens
        for start in range(0, len(tokens) - size + 1, size):
            key = hash((key, tuple(tokens[start : start + size])))
            yield key

    def record(self, prefill: str, salt: str | None, tokens: Sequence[int]) -> None:
        """``prefill`` computed (or loaded) ``tokens`` under ``salt``: it caches their prefix."""
        homes = self._homes
        for key in self._chain(salt, tokens):
            homes[key] = prefill
            homes.move_to_end(key)
        while len(homes) > self._max_chunks:
            homes.popitem(last=False)

    def home(self, salt: str | None, tokens: Sequence[int]) -> tuple[str, int] | None:
        """The prefill that last computed the longest recorded prefix of ``tokens``, and that
        prefix's length in tokens; ``None`` when no whole chunk was recorded."""
        found: tuple[str, int] | None = None
        for depth, key in enumerate(self._chain(salt, tokens), start=1):
            prefill = self._homes.get(key)
            if prefill is None:
                break
            found = (prefill, depth * self.chunk_tokens)
        return found
