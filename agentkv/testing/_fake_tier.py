"""The file tier of a fake cluster: offloaded turn-end KV, kept as ``connector/_tier*.py`` do.

Both servers of the local pair mount one tier directory; here one :class:`FakeTier` is shared by
every server of a :class:`FakeCluster` (``FakeCluster(tier=True)``) and survives their restarts,
as files do. What is faithful to the real store (``_tier_store.TierStore``):

* an entry holds the exact token ids decode computed for the pinned request (prompt + generated
  - 1), a digest of its ``cache_salt`` (never the salt), its KV blocks, an expiry and a digest
  of its secret, under a 128-bit random id;
* the offload answer carries the entry's secret and granted TTL (``ttl_s`` asked for, capped at
  ``max_ttl_s``; ``ttl_s`` of the tier when none was asked for); a delete needs the secret, and
  a wrong one is answered as a missing entry (404 ``unknown_lease``);
* a load takes the longest common prefix of the entry's tokens and the prompt, at most
  ``prompt - 1`` tokens, for the same salt only, before the entry's expiry only, and stops at
  the first block that is missing (a truncated file) or whose content no longer matches its
  checksum (a damaged file): such a block is recomputed, never served; why it stopped where it
  did is the connector's reason (``TierLoadReport``: ``ok``, ``missing``, ``salt``, ``tokens``,
  ``truncated`` from the file's size at lookup, ``load_failed`` from the worker's checksum);
* expired entries are removed at the next tier operation (the real store's periodic sweep);
* a byte budget with least-recently-used eviction (by last write or read), each salt within its
  fair share, by the connector's own rule (``_tier_share.evictions``): a writer over its share
  evicts only its own entries; an entry larger than the budget, or over its salt's share with
  nothing of its own left to evict, fails the write (500 ``tier_write_failed``, the pin is kept,
  nothing of another salt is evicted);
* usage (bytes, entries, budget, dir) for ``GET /v1/agentkv/info``.

Tests damage entries with :meth:`FakeTier.corrupt` (a flipped byte), :meth:`FakeTier.truncate`
and :meth:`FakeTier.drop` (files removed behind the servers' backs).
"""

from __future__ import annotations

import hmac
import itertools
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from agentkv._core import OffloadResult, TierRef, TierUsage
from agentkv.connector._tier import DEFAULT_TIER_MAX_TTL_S, DEFAULT_TIER_TTL_S
from agentkv.connector._tier_share import Held, evictions
from agentkv.connector._tier_store import granted_ttl, new_secret, salt_digest, secret_digest
from agentkv.testing._fake_kv import BlockContent

__all__ = ["FakeTier", "TierEntry", "TierFullError"]

DEFAULT_BUDGET_BYTES = 4 << 30


class TierFullError(RuntimeError):
    """The entry does not fit the tier's budget, or its salt's share of it (the real store's
    ``TierError``)."""


def _checksum(block: BlockContent) -> int:
    return hash((block.ctx, tuple(block.tokens)))


@dataclass(slots=True)
class TierEntry:
    """One offloaded handle: its tokens, salt digest, KV blocks and a checksum per block, its
    expiry (on the cluster's clock) and its secret's digest."""

    id: str
    token_ids: tuple[int, ...]
    salt_digest: str
    blocks: list[BlockContent]
    checksums: list[int]
    bytes: int
    expires: float
    secret_digest: str
    used: int = 0
    loads: int = field(default=0)

    @property
    def n_tokens(self) -> int:
        return len(self.token_ids)


class FakeTier:
    """An in-memory file tier shared by a fake cluster's servers.

    Example:
        >>> from agentkv.testing import FakeCluster
        >>> fake = FakeCluster(pairs=1, tier=True)
        >>> fake.tier.usage().entries
        0
    """

    def __init__(
        self,
        *,
        block_size: int,
        bytes_per_token: int,
        budget_bytes: int = DEFAULT_BUDGET_BYTES,
        directory: str = "/fake/agentkv/tier",
        clock: Callable[[], float] = time.monotonic,
        ttl_s: float = DEFAULT_TIER_TTL_S,
        max_ttl_s: float = DEFAULT_TIER_MAX_TTL_S,
    ) -> None:
        if budget_bytes <= 0:
            raise ValueError("the tier budget must be a positive number of bytes")
        if not 0 < ttl_s <= max_ttl_s:
            raise ValueError("the tier's TTL must be positive and at most its maximum")
        self.block_size = block_size
        self.bytes_per_token = bytes_per_token
        self.budget_bytes = budget_bytes
        self.dir = directory
        self.ttl_s = ttl_s
        self.max_ttl_s = max_ttl_s
        self._clock = clock
        self.entries: dict[str, TierEntry] = {}
        self.evicted: list[str] = []
        self._tick = itertools.count(1)

    # --- what tests look at and do -------------------------------------------------------------

    @property
    def ids(self) -> list[str]:
        """The ids of the committed entries, oldest use first."""
        return [e.id for e in sorted(self.entries.values(), key=lambda e: e.used)]

    def usage(self) -> TierUsage:
        self.sweep()
        return TierUsage(
            bytes=sum(e.bytes for e in self.entries.values()),
            entries=len(self.entries),
            budget_bytes=self.budget_bytes,
            dir=self.dir,
        )

    def corrupt(self, entry: str, *, block: int = 0) -> None:
        """Flip a byte of ``block``'s data: its checksum no longer matches."""
        content = self.entries[entry].blocks[block]
        content.tokens[0] = content.tokens[0] ^ 1 if content.tokens else 1

    def truncate(self, entry: str, *, blocks: int) -> None:
        """Cut the data file after ``blocks`` blocks (a crash mid-copy, a full disk)."""
        del self.entries[entry].blocks[blocks:]

    def drop(self, entry: str) -> None:
        """Remove the entry's files behind the servers' backs."""
        del self.entries[entry]

    # --- what the engines do -------------------------------------------------------------------

    def sweep(self) -> list[str]:
        """Remove the entries past their expiry; their ids."""
        now = self._clock()
        expired = [e.id for e in self.entries.values() if e.expires <= now]
        for entry in expired:
            del self.entries[entry]
        return expired

    def write(
        self,
        *,
        token_ids: Sequence[int],
        cache_salt: str | None,
        blocks: Sequence[BlockContent],
        ttl_s: float | None = None,
    ) -> OffloadResult:
        """Commit a new entry to live ``ttl_s`` (capped; ``None``: the tier's default), then
        evict least recently used others beyond the budget, each salt within its share."""
        self.sweep()
        n_blocks = -(-len(token_ids) // self.block_size)
        nbytes = n_blocks * self.block_size * self.bytes_per_token
        if nbytes > self.budget_bytes:
            raise TierFullError(f"{nbytes} bytes exceed the tier budget of {self.budget_bytes}")
        copies = [b.copy() for b in blocks[:n_blocks]]
        ttl = granted_ttl(ttl_s, default_s=self.ttl_s, max_s=self.max_ttl_s)
        secret = new_secret()
        entry = TierEntry(
            id=secrets.token_hex(16),
            token_ids=tuple(token_ids),
            salt_digest=salt_digest(cache_salt),
            blocks=copies,
            checksums=[_checksum(b) for b in copies],
            bytes=nbytes,
            expires=self._clock() + ttl,
            secret_digest=secret_digest(secret),
            used=next(self._tick),
        )
        self.entries[entry.id] = entry
        held = [
            Held(id=e.id, salt=e.salt_digest, bytes=e.bytes, used=float(e.used))
            for e in self.entries.values()
        ]
        decision = evictions(held, budget=self.budget_bytes, keep=entry.id)
        for old in decision.evict:
            del self.entries[old]
            self.evicted.append(old)
        if not decision.fits:
            del self.entries[entry.id]
            raise TierFullError(
                f"{nbytes} bytes do not fit this salt's share of the tier budget of "
                f"{self.budget_bytes} bytes (other salts' entries are not evicted for it)"
            )
        return OffloadResult(
            ref=TierRef(id=entry.id, n_tokens=entry.n_tokens, secret=secret),
            bytes=nbytes,
            ttl_s=ttl,
        )

    def delete(self, entry: str, secret: str) -> bool:
        """Remove ``entry`` for the holder of its secret; False for a missing entry and a wrong
        secret alike."""
        self.sweep()
        found = self.entries.get(entry)
        if found is None or not hmac.compare_digest(found.secret_digest, secret_digest(secret)):
            return False
        del self.entries[entry]
        return True

    def match(
        self, ref: TierRef, *, prompt: Sequence[int], cache_salt: str | None, first_block: int
    ) -> tuple[int, list[BlockContent], str]:
        """The tokens a prompt may load from ``ref``, the entry's blocks (copies), and why not
        more (a ``TierLoadReport`` reason).

        The longest common prefix of the entry's tokens and the prompt, at most ``prompt - 1``,
        cut at the first missing or damaged block from ``first_block`` on.
        """
        self.sweep()
        entry = self.entries.get(ref.id)
        if entry is None:
            return 0, [], "missing"
        if not hmac.compare_digest(entry.salt_digest, salt_digest(cache_salt)):
            return 0, [], "salt"
        n = 0
        stop = min(entry.n_tokens, len(prompt))
        while n < stop and entry.token_ids[n] == prompt[n]:
            n += 1
        reason = "ok" if n == entry.n_tokens else "tokens"
        if n > len(prompt) - 1:
            n, reason = max(0, len(prompt) - 1), "ok"
        bs = self.block_size
        needed = -(-n // bs)
        for index in range(first_block, needed):
            if index >= len(entry.blocks):  # the lookup sees the short file
                n, reason = min(n, index * bs), "truncated"
                break
            if _checksum(entry.blocks[index]) != entry.checksums[index]:  # the worker's check
                n, reason = min(n, index * bs), "load_failed"
                break
        entry.used = next(self._tick)
        entry.loads += 1
        return n, [b.copy() for b in entry.blocks[: -(-n // bs)]], reason
