"""What the tier's budget check costs at every commit, on decode's engine thread.

    .venv/bin/python benchmarks/kv_tier/budget_scan.py [--entries 200]

``TierStore.commit`` ends with ``enforce_budget``, which lists the root's entries, their sizes
and (for the per-salt share) their salts. This fills a temporary tier with ``--entries`` small
committed entries over 20 salts and times ``enforce_budget`` on a fresh store (salts read from
the manifests) and again (salts cached). No server, no model.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from agentkv.connector._tier_store import Manifest, TierStore, block_checksum, salt_digest


def _commit(store: TierStore, salt: str, now: float) -> None:
    entry = store.new_id()
    blocks = [bytes([b]) * 64 for b in range(4)]
    store.tmp(store.data_path(entry, 0)).write_bytes(b"".join(blocks))
    store.commit(Manifest(
        id=entry, fingerprint={"model": "m"}, token_ids=tuple(range(16)),
        salt_digest=salt_digest(salt), lora=None, block_size=4, block_bytes=64,
        checksums=(tuple(block_checksum(b) for b in blocks),), created=now,
        expires=now + 3600, secret_digest="0" * 64,
    ))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=200)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="agentkv-budget-"))
    store = TierStore(root, budget_bytes=1 << 40)
    for i in range(args.entries):
        _commit(store, f"salt-{i % 20}", time.time())
    fresh = TierStore(root, budget_bytes=1 << 40)
    for label in ("fresh store", "salts cached"):
        started = time.perf_counter()
        fresh.enforce_budget()
        print(f"{args.entries} entries, {label}: enforce_budget "
              f"{(time.perf_counter() - started) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
