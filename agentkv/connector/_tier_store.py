"""The file tier's store: where persisted turn-end KV lives on the host, and its hygiene.

Pure (no vLLM, no torch; clock injected) so that it is tested as plain code. The connector's
scheduler side owns one store per server; the workers write and read the data files it names.

Layout under the configured root (``kv_connector_extra_config.agentkv_tier_dir``; never a path a
client sent: entries are named by a 128-bit random id, checked against ``TIER_ID_PATTERN``)::

    <root>/<id>.r<rank>.kv      KV blocks of tensor-parallel rank <rank>, block-major, layer-minor
    <root>/<id>.json            the manifest (written last: the commit point of an entry)

Writes go to ``*.tmp``, are fsynced and renamed. The manifest records the exact token ids, the
``cache_salt``, the LoRA name, a model/layout fingerprint and one checksum per block and rank, so a
load takes only the prefix of a prompt that the entry really holds, and only blocks whose bytes
still hash to what was written. A byte budget evicts least recently used entries (by last write
or read: the manifest's mtime). :meth:`TierStore.sweep`, run at start-up, removes temporary files,
data without a manifest, manifests without (complete) data or that do not parse, and enforces
the budget: a crash leaves nothing a restart does not clean.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from agentkv._wire.tier import TIER_ID_PATTERN, TierUsage

logger = structlog.get_logger("agentkv.connector.tier")

MANIFEST_VERSION = 1
CHECKSUM_BYTES = 16  # blake2b digest size: a checksum against damage, not an authenticator


def block_checksum(data: bytes | memoryview) -> str:
    return hashlib.blake2b(data, digest_size=CHECKSUM_BYTES).hexdigest()


class TierError(Exception):
    """A tier operation that cannot be done (budget, I/O); the message says why."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Manifest:
    """What one entry holds: ``n_tokens`` tokens of KV, ``block_size`` tokens per block, one
    data file per rank of ``n_blocks * block_bytes`` bytes, ``checksums[rank][block]``."""

    id: str
    fingerprint: Mapping[str, Any]
    token_ids: tuple[int, ...]
    cache_salt: str | None
    lora: str | None
    block_size: int
    block_bytes: int
    checksums: tuple[tuple[str, ...], ...]
    created: float

    @property
    def n_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def n_blocks(self) -> int:
        return -(-self.n_tokens // self.block_size)

    @property
    def ranks(self) -> int:
        return len(self.checksums)

    @property
    def data_bytes(self) -> int:
        return self.ranks * self.n_blocks * self.block_bytes

    def to_json(self) -> dict[str, Any]:
        return {
            "v": MANIFEST_VERSION,
            "id": self.id,
            "fingerprint": dict(self.fingerprint),
            "token_ids": list(self.token_ids),
            "cache_salt": self.cache_salt,
            "lora": self.lora,
            "block_size": self.block_size,
            "block_bytes": self.block_bytes,
            "checksums": [list(r) for r in self.checksums],
            "created": self.created,
        }

    @classmethod
    def from_json(cls, data: object) -> Manifest:
        """Parse a manifest; :class:`ValueError` for anything malformed."""
        if not isinstance(data, dict) or data.get("v") != MANIFEST_VERSION:
            raise ValueError("not a version-1 manifest")
        tokens = data["token_ids"]
        checksums = data["checksums"]
        fingerprint = data["fingerprint"]
        if not (isinstance(tokens, list) and all(type(t) is int for t in tokens)):
            raise ValueError("token_ids")
        if not isinstance(fingerprint, dict):
            raise ValueError("fingerprint")
        if not (isinstance(checksums, list) and checksums
                and all(isinstance(r, list) and all(isinstance(c, str) for c in r)
                        for r in checksums)):
            raise ValueError("checksums")
        manifest = cls(
            id=str(data["id"]),
            fingerprint=fingerprint,
            token_ids=tuple(tokens),
            cache_salt=_opt_str(data.get("cache_salt")),
            lora=_opt_str(data.get("lora")),
            block_size=_positive(data["block_size"]),
            block_bytes=_positive(data["block_bytes"]),
            checksums=tuple(tuple(r) for r in checksums),
            created=float(data["created"]),
        )
        if any(len(r) != manifest.n_blocks for r in manifest.checksums):
            raise ValueError("one checksum per block and rank")
        return manifest


def _opt_str(value: object) -> str | None:
    if value is not None and not isinstance(value, str):
        raise ValueError("expected a string")
    return value


def _positive(value: object) -> int:
    if type(value) is not int or value <= 0:
        raise ValueError("expected a positive integer")
    return value


@dataclass(frozen=True, kw_only=True, slots=True)
class TierMatch:
    """The part of an entry a request may load: its first ``n_tokens`` tokens (verified)."""

    manifest: Manifest
    n_tokens: int
    reason: str  # why not more: "complete", "limit", "tokens", "checksum", "truncated", ...


class TierStore:
    """One tier root: entries by id, a byte budget with LRU eviction, and the start-up sweep."""

    def __init__(self, root: Path | str, *, budget_bytes: int,
                 clock: Callable[[], float] = time.time,
                 new_id: Callable[[], str] = lambda: secrets.token_hex(16)) -> None:
        if budget_bytes <= 0:
            raise ValueError("the tier budget must be a positive number of bytes")
        self.root = Path(root).resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        self.budget_bytes = budget_bytes
        self._clock = clock
        self._new_id = new_id

    # --- names ------------------------------------------------------------------------------

    def new_id(self) -> str:
        entry = self._new_id()
        if not TIER_ID_PATTERN.fullmatch(entry):
            raise ValueError("tier ids are 32 lowercase hex characters")
        return entry

    def data_path(self, entry: str, rank: int) -> Path:
        return self.root / f"{_checked(entry)}.r{int(rank)}.kv"

    def manifest_path(self, entry: str) -> Path:
        return self.root / f"{_checked(entry)}.json"

    @staticmethod
    def tmp(path: Path) -> Path:
        return path.with_name(path.name + ".tmp")

    # --- write ------------------------------------------------------------------------------

    def check_fits(self, nbytes: int) -> None:
        if nbytes > self.budget_bytes:
            raise TierError(f"{nbytes} bytes exceed the tier budget of {self.budget_bytes}")

    def commit(self, manifest: Manifest) -> None:
        """Make an entry whose data files were written (and fsynced) as ``*.tmp`` visible, then
        evict the least recently used other entries beyond the budget."""
        for rank in range(manifest.ranks):
            tmp = self.tmp(self.data_path(manifest.id, rank))
            size = tmp.stat().st_size
            if size != manifest.n_blocks * manifest.block_bytes:
                raise TierError(f"rank {rank} wrote {size} bytes, expected "
                                f"{manifest.n_blocks * manifest.block_bytes}")
            tmp.replace(self.data_path(manifest.id, rank))
        target = self.manifest_path(manifest.id)
        tmp = self.tmp(target)
        with tmp.open("w") as f:
            json.dump(manifest.to_json(), f, separators=(",", ":"))
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(target)
        self.touch(manifest.id)  # its LRU position: on the store's clock
        _fsync_dir(self.root)
        self.enforce_budget(keep=manifest.id)

    def abort(self, entry: str) -> None:
        """Remove whatever a failed write of ``entry`` left."""
        for path in self.root.glob(f"{_checked(entry)}.*"):
            path.unlink(missing_ok=True)

    # --- read -------------------------------------------------------------------------------

    def manifest(self, entry: str) -> Manifest | None:
        """The committed manifest of ``entry``; ``None`` if absent. A manifest that does not
        parse is removed with its data (it can never be served)."""
        path = self.manifest_path(entry)
        try:
            manifest = Manifest.from_json(json.loads(path.read_bytes()))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            logger.warning("tier_manifest_corrupt", id=entry, error=str(exc))
            self.delete(entry)
            return None
        return manifest if manifest.id == entry else None

    def match(self, entry: str, *, token_ids: Sequence[int], cache_salt: str | None,
              lora: str | None, fingerprint: Mapping[str, Any], limit: int,
              first_block: int = 0) -> TierMatch | None:
        """How much of ``entry`` a request with these prompt tokens may load.

        The answer is the longest prefix of ``token_ids`` equal to the entry's tokens, capped at
        ``limit``, and cut at the first block (from ``first_block`` on; earlier blocks the
        request already has) whose bytes are missing or do not hash to the manifest's checksum
        in any rank's file. ``None``: no such entry, or it belongs to another model, layout,
        salt or adapter. A hit refreshes the entry's LRU position.
        """
        manifest = self.manifest(entry)
        if manifest is None:
            return None
        if (dict(manifest.fingerprint) != dict(fingerprint) or manifest.cache_salt != cache_salt
                or manifest.lora != lora):
            return TierMatch(manifest=manifest, n_tokens=0, reason="mismatch")
        n = 0
        stop = min(manifest.n_tokens, len(token_ids))
        while n < stop and manifest.token_ids[n] == token_ids[n]:
            n += 1
        reason = "complete" if n == manifest.n_tokens else "tokens"
        if n > limit:
            n, reason = limit, "limit"
        blocks = -(-n // manifest.block_size)
        good = self._verified_blocks(manifest, first_block, blocks)
        if good < blocks:
            n, reason = min(n, good * manifest.block_size), "checksum"
        self.touch(entry)
        return TierMatch(manifest=manifest, n_tokens=n, reason=reason)

    def _verified_blocks(self, manifest: Manifest, first: int, last: int) -> int:
        """The number of leading blocks (up to ``last``) that are intact in every rank's file,
        checking only blocks ``first`` .. ``last - 1``."""
        good = last
        for rank in range(manifest.ranks):
            try:
                with self.data_path(manifest.id, rank).open("rb") as f:
                    for block in range(first, good):
                        f.seek(block * manifest.block_bytes)
                        data = f.read(manifest.block_bytes)
                        if (len(data) != manifest.block_bytes
                                or block_checksum(data) != manifest.checksums[rank][block]):
                            good = block
                            break
            except OSError:
                return min(good, first)
        return good

    def touch(self, entry: str) -> None:
        now = self._clock()
        with contextlib.suppress(OSError):
            os.utime(self.manifest_path(entry), (now, now))

    # --- hygiene ----------------------------------------------------------------------------

    def delete(self, entry: str) -> bool:
        """Remove an entry (manifest first, so it is never half-visible); True if it existed."""
        existed = False
        manifest = self.manifest_path(entry)
        if manifest.exists():
            manifest.unlink(missing_ok=True)
            existed = True
        for path in self.root.glob(f"{_checked(entry)}.*"):
            path.unlink(missing_ok=True)
            existed = True
        return existed

    def _entries(self) -> list[tuple[float, str, int]]:
        """(last use, id, bytes) of every committed entry, oldest first."""
        out = []
        for path in self.root.glob("*.json"):
            entry = path.name[: -len(".json")]
            if not TIER_ID_PATTERN.fullmatch(entry):
                continue
            try:
                used = path.stat().st_mtime
                size = path.stat().st_size + sum(
                    p.stat().st_size for p in self.root.glob(f"{entry}.r*.kv"))
            except OSError:
                continue
            out.append((used, entry, size))
        return sorted(out)

    def usage(self) -> TierUsage:
        entries = self._entries()
        return TierUsage(bytes=sum(e[2] for e in entries), entries=len(entries),
                         budget_bytes=self.budget_bytes, dir=str(self.root))

    def enforce_budget(self, *, keep: str | None = None) -> list[str]:
        """Evict least recently used entries (never ``keep``) until usage fits the budget."""
        entries = self._entries()
        total = sum(e[2] for e in entries)
        evicted = []
        for _, entry, size in entries:
            if total <= self.budget_bytes:
                break
            if entry == keep:
                continue
            self.delete(entry)
            total -= size
            evicted.append(entry)
        if evicted:
            logger.info("tier_evicted", ids=evicted, bytes=total, budget=self.budget_bytes)
        return evicted

    def sweep(self, *, tmp_grace_s: float = 0.0) -> list[Path]:
        """Start-up cleanup: temporary files, orphans and broken entries; then the budget.

        Temporary and orphan files younger than ``tmp_grace_s`` stay: another server sharing
        the root may be writing them right now.
        """
        removed: list[Path] = []
        manifests: dict[str, Manifest | None] = {}
        young = self._clock() - tmp_grace_s
        for path in sorted(self.root.iterdir()):
            name = path.name
            entry = name.split(".", 1)[0]
            if not path.is_file() or not TIER_ID_PATTERN.fullmatch(entry):
                continue  # not ours: leave it alone
            try:
                if tmp_grace_s > 0 and path.stat().st_mtime > young:
                    continue
            except OSError:
                continue
            if name.endswith(".tmp"):
                path.unlink(missing_ok=True)
                removed.append(path)
                continue
            if entry not in manifests:
                manifests[entry] = self._complete(entry)
            if manifests[entry] is None:
                path.unlink(missing_ok=True)
                removed.append(path)
        self.enforce_budget()
        if removed:
            logger.info("tier_swept", removed=len(removed))
        return removed

    def _complete(self, entry: str) -> Manifest | None:
        """The entry's manifest if it parses and every rank's data file has the right size."""
        try:
            manifest = Manifest.from_json(json.loads(self.manifest_path(entry).read_bytes()))
        except (OSError, ValueError, KeyError, TypeError):
            return None
        for rank in range(manifest.ranks):
            try:
                size = self.data_path(entry, rank).stat().st_size
            except OSError:
                return None
            if size != manifest.n_blocks * manifest.block_bytes:
                return None
        return manifest if manifest.id == entry else None


def _checked(entry: str) -> str:
    if not TIER_ID_PATTERN.fullmatch(entry):
        raise ValueError("tier ids are 32 lowercase hex characters")
    return entry


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
