"""Which prefill/decode pair a session lives on: a pure function of its id and the cluster's state.

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
from collections.abc import Collection, Mapping, Sequence

__all__ = ["place", "rank"]


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
    load_factor: float = 1.25,
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
