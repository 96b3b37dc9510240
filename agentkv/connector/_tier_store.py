"""The file tier's store: where offloaded turn-end KV lives on the host, and its hygiene.

Pure (no vLLM, no torch; clock injected) so that it is tested as plain code. The connector's
scheduler side owns one store per server; the workers write and read the data files it names.

Layout under the configured root (``kv_connector_extra_config.agentkv_tier_dir``; never a path a
client sent: entries are named by a 128-bit random id, checked against ``TIER_ID_PATTERN``)::

    <root>/<id>.r<rank>.kv      KV blocks of tensor-parallel rank <rank>, block-major, layer-minor
    <root>/<id>.json            the manifest (written last: the commit point of an entry)

Writes go to ``*.tmp``, are fsynced and renamed. The manifest records the exact token ids, a
digest of the ``cache_salt`` (never the salt), the LoRA adapter's identity, a fingerprint of the
exact weights and KV layout, one checksum per block and rank, an expiry (wall clock) and a digest
of the entry's secret (the delete capability, :meth:`TierStore.delete_owned`). A load takes only
the prefix of a prompt that the entry really holds, for the same salt, adapter and weights, only
before the expiry, and only blocks whose bytes still hash to what was written. A byte budget
evicts least recently used entries (by last write or read: the manifest's mtime), each salt
within its fair share (``_tier_share``): no tenant's writes evict another's entries while it
holds more than its share.
:meth:`TierStore.sweep` (at start-up, then periodically: ``TierScheduler``) removes expired
entries, temporary files, data without a manifest, manifests without (complete) data or that do
not parse (manifests of an older version included), and enforces the budget: a crash leaves
nothing a restart does not clean.

Folders are created 0700 and files 0600: entries hold other sessions' KV and token ids.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentkv._core import get_logger
from agentkv._wire.tier import TIER_ID_PATTERN, TierUsage
from agentkv.connector._tier_share import Eviction, Held, evictions

logger = get_logger("agentkv.connector.tier")

MANIFEST_VERSION = 2  # 2: salt and secret digests, expiry, weights hash; 1 is swept as unreadable
CHECKSUM_BYTES = 16  # blake2b digest size: a checksum against damage, not an authenticator
FILE_MODE = 0o600
DIR_MODE = 0o700


def block_checksum(data: bytes | memoryview) -> str:
    return hashlib.blake2b(data, digest_size=CHECKSUM_BYTES).hexdigest()


def salt_digest(cache_salt: str | None) -> str:
    """What a manifest keeps of a request's ``cache_salt``: a domain-separated SHA-256 (no salt
    at all has a digest too, distinct from the empty salt's)."""
    body = b"\0" if cache_salt is None else b"\1" + cache_salt.encode()
    return hashlib.sha256(b"agentkv-tier-salt\0" + body).hexdigest()


def secret_digest(secret: str) -> str:
    """What a manifest keeps of an entry's secret (the delete capability)."""
    return hashlib.sha256(b"agentkv-tier-secret\0" + secret.encode()).hexdigest()


def new_secret() -> str:
    """A fresh entry secret: 128 random bits, URL-safe (``TIER_SECRET_PATTERN``)."""
    return secrets.token_urlsafe(16)


def granted_ttl(requested: float | None, *, default_s: float, max_s: float) -> float:
    """An entry's time to live: the one asked for, capped at ``max_s``; ``default_s`` when none
    was asked for."""
    return min(default_s if requested is None else float(requested), max_s)


def private_dir(path: Path) -> None:
    """Create ``path`` (and its parents) with the leaf readable by its owner only. An existing
    folder keeps its mode (it may be shared, or not ours to change); one that others can read
    or write is logged."""
    path.mkdir(parents=True, exist_ok=True, mode=DIR_MODE)
    with contextlib.suppress(OSError):
        mode = path.stat().st_mode & 0o777
        if mode & 0o077:
            logger.warning("tier_dir_not_private", dir=str(path), mode=oct(mode))


class TierError(Exception):
    """A tier operation that cannot be done (budget, I/O); the message says why."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Manifest:
    """What one entry holds: ``n_tokens`` tokens of KV, ``block_size`` tokens per block, one
    data file per rank of ``n_blocks * block_bytes`` bytes, ``checksums[rank][block]``."""

    id: str
    fingerprint: Mapping[str, Any]
    token_ids: tuple[int, ...]
    salt_digest: str  # salt_digest(cache_salt)
    lora: str | None  # the adapter's identity (``_tier._lora_name``), not its display name
    block_size: int
    block_bytes: int
    checksums: tuple[tuple[str, ...], ...]
    created: float
    expires: float  # wall clock, as ``created``
    secret_digest: str  # secret_digest(the entry's secret)

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
            "salt_digest": self.salt_digest,
            "lora": self.lora,
            "block_size": self.block_size,
            "block_bytes": self.block_bytes,
            "checksums": [list(r) for r in self.checksums],
            "created": self.created,
            "expires": self.expires,
            "secret_digest": self.secret_digest,
        }

    @classmethod
    def from_json(cls, data: object) -> Manifest:
        """Parse a manifest; :class:`ValueError` for anything malformed."""
        if not isinstance(data, dict) or data.get("v") != MANIFEST_VERSION:
            raise ValueError(f"not a version-{MANIFEST_VERSION} manifest")
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
            salt_digest=_str(data["salt_digest"]),
            lora=_opt_str(data.get("lora")),
            block_size=_positive(data["block_size"]),
            block_bytes=_positive(data["block_bytes"]),
            checksums=tuple(tuple(r) for r in checksums),
            created=float(data["created"]),
            expires=float(data["expires"]),
            secret_digest=_str(data["secret_digest"]),
        )
        if any(len(r) != manifest.n_blocks for r in manifest.checksums):
            raise ValueError("one checksum per block and rank")
        return manifest


def _opt_str(value: object) -> str | None:
    if value is not None and not isinstance(value, str):
        raise ValueError("expected a string")
    return value


def _str(value: object) -> str:
    if not isinstance(value, str):
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
        private_dir(self.root)
        self.budget_bytes = budget_bytes
        self._clock = clock
        self._new_id = new_id
        # Entry id -> its salt's digest, read once per entry (a committed manifest never
        # changes): the budget groups entries by salt at every commit.
        self._salts: dict[str, str] = {}

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
        evict least recently used entries beyond the budget, within the salts' shares.

        :class:`TierError` (the entry removed again) when its salt is over its share and has
        nothing else to evict: the write must not evict other salts' entries.
        """
        for rank in range(manifest.ranks):
            tmp = self.tmp(self.data_path(manifest.id, rank))
            size = tmp.stat().st_size
            if size != manifest.n_blocks * manifest.block_bytes:
                raise TierError(f"rank {rank} wrote {size} bytes, expected "
                                f"{manifest.n_blocks * manifest.block_bytes}")
            tmp.replace(self.data_path(manifest.id, rank))
        target = self.manifest_path(manifest.id)
        tmp = self.tmp(target)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, FILE_MODE)
        with os.fdopen(fd, "w") as f:
            json.dump(manifest.to_json(), f, separators=(",", ":"))
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(target)
        self.touch(manifest.id)  # its LRU position: on the store's clock
        _fsync_dir(self.root)
        self._salts[manifest.id] = manifest.salt_digest
        if not self.enforce_budget(keep=manifest.id).fits:
            self.delete(manifest.id)
            raise TierError(
                f"{manifest.data_bytes} bytes do not fit this salt's share of the tier budget "
                f"of {self.budget_bytes} bytes (other salts' entries are not evicted for it)"
            )

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
        in any rank's file. ``None``: no such entry. No tokens (``reason``): the entry has
        expired, or belongs to other weights or layout, salt or adapter. A hit refreshes the
        entry's LRU position.
        """
        manifest = self.manifest(entry)
        if manifest is None:
            return None
        return self.match_manifest(manifest, token_ids=token_ids, cache_salt=cache_salt,
                                   lora=lora, fingerprint=fingerprint, limit=limit,
                                   first_block=first_block)

    def match_manifest(self, manifest: Manifest, *, token_ids: Sequence[int],
                       cache_salt: str | None, lora: str | None,
                       fingerprint: Mapping[str, Any], limit: int, first_block: int = 0,
                       verify_data: bool = True) -> TierMatch:
        """:meth:`match` on a manifest read before (the connector keeps it per request).

        ``verify_data=False`` is the cheap check for the engine thread: the manifest's fields
        and each rank's data file size (whole blocks present), but no data read or hashed. The
        worker verifies every block's checksum after its read anyway, and a block that fails is
        recomputed (``get_block_ids_with_load_errors``), never served. Refusals: ``"expired"``
        (past the entry's TTL), ``"fingerprint"``, ``"salt"``, ``"lora"``; a short file:
        ``"truncated"``.
        """
        entry = manifest.id
        if manifest.expires <= self._clock():  # the sweep removes it
            return TierMatch(manifest=manifest, n_tokens=0, reason="expired")
        if dict(manifest.fingerprint) != dict(fingerprint):
            return TierMatch(manifest=manifest, n_tokens=0, reason="fingerprint")
        if not hmac.compare_digest(manifest.salt_digest, salt_digest(cache_salt)):
            return TierMatch(manifest=manifest, n_tokens=0, reason="salt")
        if manifest.lora != lora:
            return TierMatch(manifest=manifest, n_tokens=0, reason="lora")
        stop = min(manifest.n_tokens, len(token_ids))
        n = stop  # the usual case, compared at C speed; else the first difference
        if tuple(token_ids[:stop]) != manifest.token_ids[:stop]:
            n = next(i for i in range(stop) if manifest.token_ids[i] != token_ids[i])
        reason = "complete" if n == manifest.n_tokens else "tokens"
        if n > limit:
            n, reason = limit, "limit"
        blocks = -(-n // manifest.block_size)
        if verify_data:
            good, cut = self._verified_blocks(manifest, first_block, blocks), "checksum"
        else:
            good, cut = self._present_blocks(manifest, blocks), "truncated"
        if good < blocks:
            n, reason = min(n, good * manifest.block_size), cut
        self.touch(entry)
        return TierMatch(manifest=manifest, n_tokens=n, reason=reason)

    def _present_blocks(self, manifest: Manifest, last: int) -> int:
        """The number of leading blocks (up to ``last``) that every rank's data file holds in
        full, by the files' sizes (nothing read)."""
        good = last
        for rank in range(manifest.ranks):
            try:
                size = self.data_path(manifest.id, rank).stat().st_size
            except OSError:
                return 0
            good = min(good, size // manifest.block_bytes)
        return good

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

    def delete_owned(self, entry: str, secret: str) -> bool:
        """Remove an entry for a client that shows its secret; False (nothing removed) for a
        missing entry and a wrong secret alike."""
        manifest = self.manifest(entry)
        if manifest is None or not hmac.compare_digest(manifest.secret_digest,
                                                       secret_digest(secret)):
            return False
        return self.delete(entry)

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

    def _entries(self) -> list[Held]:
        """Every committed entry: its salt's digest, bytes and last use.

        One listing of the root, not one per entry: this runs at every commit, on decode's
        engine thread, and a glob per entry made it quadratic in the entries held.
        """
        manifests: dict[str, float] = {}
        sizes: dict[str, int] = {}
        with os.scandir(self.root) as listing:
            for item in listing:
                entry, _, rest = item.name.partition(".")
                if rest != "json" and not (rest.startswith("r") and rest.endswith(".kv")):
                    continue
                if not TIER_ID_PATTERN.fullmatch(entry):
                    continue
                try:
                    stat = item.stat(follow_symlinks=False)
                except OSError:
                    continue
                sizes[entry] = sizes.get(entry, 0) + stat.st_size
                if rest == "json":
                    manifests[entry] = stat.st_mtime
        out = [Held(id=entry, salt=self._salt(entry), bytes=sizes[entry], used=used)
               for entry, used in manifests.items()]
        self._salts = {k: v for k, v in self._salts.items() if k in manifests}
        return out

    def _salt(self, entry: str) -> str:
        salt = self._salts.get(entry)
        if salt is None:
            try:
                salt = _str(json.loads(self.manifest_path(entry).read_bytes())["salt_digest"])
            except (OSError, ValueError, KeyError, TypeError):
                return ""  # unreadable: a group of its own until the sweep removes it
            self._salts[entry] = salt
        return salt

    def usage(self) -> TierUsage:
        entries = self._entries()
        return TierUsage(bytes=sum(e.bytes for e in entries), entries=len(entries),
                         budget_bytes=self.budget_bytes, dir=str(self.root))

    def enforce_budget(self, *, keep: str | None = None) -> Eviction:
        """Evict least recently used entries (never ``keep``, the entry just written) until usage
        fits the budget, each salt within its share (``_tier_share.evictions``)."""
        entries = self._entries()
        decision = evictions(entries, budget=self.budget_bytes, keep=keep)
        for entry in decision.evict:
            self.delete(entry)
        if decision.evict:
            gone = set(decision.evict)
            logger.info("tier_evicted", ids=list(decision.evict), budget=self.budget_bytes,
                        bytes=sum(e.bytes for e in entries if e.id not in gone))
        return decision

    def sweep(self, *, tmp_grace_s: float = 0.0) -> list[Path]:
        """Cleanup, at start-up and then periodically: expired entries, temporary files, orphans
        and broken entries (an older manifest version included); then the budget.

        Temporary and orphan files younger than ``tmp_grace_s`` stay: another server sharing
        the root may be writing them right now. An expired entry goes whatever its files' age.
        """
        removed: list[Path] = []
        manifests: dict[str, Manifest | None] = {}
        expired: set[str] = set()
        now = self._clock()
        young = now - tmp_grace_s
        for path in sorted(self.root.iterdir()):  # <id>.json sorts before <id>.r<rank>.kv
            name = path.name
            entry = name.split(".", 1)[0]
            if not path.is_file() or not TIER_ID_PATTERN.fullmatch(entry):
                continue  # not ours: leave it alone
            if entry not in manifests:
                manifests[entry] = self._complete(entry)
            manifest = manifests[entry]
            if manifest is not None and manifest.expires <= now:
                path.unlink(missing_ok=True)
                removed.append(path)
                expired.add(entry)
                continue
            try:
                if tmp_grace_s > 0 and path.stat().st_mtime > young:
                    continue
            except OSError:
                continue
            if name.endswith(".tmp") or manifest is None:
                path.unlink(missing_ok=True)
                removed.append(path)
        self.enforce_budget()
        if removed:
            logger.info("tier_swept", removed=len(removed), expired=sorted(expired))
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
