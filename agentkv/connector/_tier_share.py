"""Who the file tier evicts when it is over its byte budget: each salt's fair share.

Pure (no I/O): the store (``_tier_store.TierStore``) and the fake pair's tier
(``agentkv.testing._fake_tier``) both decide with :func:`evictions`, so the two cannot drift.

Entries are grouped by the digest of the ``cache_salt`` they were written with: the proxy gives
each principal (API key) its own salt, so a salt is a tenant. With ``n`` salts holding entries,
each salt's share is ``budget // n``. The share is *max-min fair* and *work conserving*: a salt
may hold more than its share while the tier has room (a lone tenant gets the whole budget), and
the shares always sum to at most the budget, so when the tier is over budget some salt is over
its share. The rule, applied one eviction at a time until usage fits:

* a writer over its share evicts its own least recently used entries, and never another salt's;
  if nothing of its own is left to evict (the new entry alone is over its share) the write is
  refused (``fits=False``) and the writer's pin stays;
* a writer within its share (and the periodic sweep, which has no writer) evicts the least
  recently used entry among the salts over their share.

Why no configured per-salt cap or floor: a cap leaves the budget idle when few tenants offload,
and a floor makes the shares sum past the budget, which means someone within their share would
have to be evicted. The share shrinks as salts arrive; a principal cannot grow its share by
writing more, only by having more salts, and salts are the proxy's to hand out (one per key).

>>> a = [Held(id="a1", salt="A", bytes=60, used=1.0), Held(id="a2", salt="A", bytes=30, used=2.0)]
>>> evictions([*a, Held(id="b1", salt="B", bytes=30, used=3.0)], budget=100, keep="b1")
Eviction(evict=('a1',), fits=True)
>>> evictions([*a, Held(id="a3", salt="A", bytes=30, used=3.0)], budget=100, keep="a3")
Eviction(evict=('a1',), fits=True)
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Eviction", "Held", "evictions", "fair_share"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Held:
    """One committed entry as the budget sees it: its salt's digest, its size, its last use."""

    id: str
    salt: str
    bytes: int
    used: float


@dataclass(frozen=True, kw_only=True, slots=True)
class Eviction:
    """The entries to evict, least recently used first; ``fits`` is False when usage still
    exceeds the budget after them and the writer may evict nothing more (refuse the write)."""

    evict: tuple[str, ...]
    fits: bool


def fair_share(budget: int, salts: int) -> int:
    """Each salt's share of ``budget`` bytes when ``salts`` salts hold entries."""
    return budget // max(1, salts)


def evictions(entries: Sequence[Held], *, budget: int, keep: str | None = None) -> Eviction:
    """What to evict so that ``entries`` fit ``budget``; ``keep`` is the entry just written
    (never evicted: its salt is the writer's), ``None`` for a sweep."""
    usage: Counter[str] = Counter()
    for entry in entries:
        usage[entry.salt] += entry.bytes
    total = sum(usage.values())
    writer = next((e.salt for e in entries if e.id == keep), None)
    candidates = sorted((e for e in entries if e.id != keep), key=lambda e: (e.used, e.id))
    evicted: list[str] = []
    while total > budget:
        share = fair_share(budget, len(usage))
        if writer is not None and usage[writer] > share:
            victim = next((e for e in candidates if e.salt == writer), None)
        else:
            victim = next((e for e in candidates if usage[e.salt] > share), None)
        if victim is None:
            return Eviction(evict=tuple(evicted), fits=False)
        candidates.remove(victim)
        evicted.append(victim.id)
        total -= victim.bytes
        usage[victim.salt] -= victim.bytes
        if usage[victim.salt] <= 0 and not any(e.salt == victim.salt for e in candidates):
            del usage[victim.salt]  # one salt fewer: the others' shares grow
    return Eviction(evict=tuple(evicted), fits=True)
