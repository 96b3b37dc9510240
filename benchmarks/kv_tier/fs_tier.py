"""vLLM's own file tier on the CPU build: the scheduler half of its tiering stack runs.

    .venv/bin/python benchmarks/kv_tier/fs_tier.py

Evidence for the design study docs/design/kv-tier.md (issue 20). vLLM 0.32's
``TieringOffloadingSpec`` cannot start on the CPU build (see ``vllm_offload_on_cpu.py``: its
*worker*, the device <-> primary-tier copy, is CUDA/XPU only), but its *manager* runs. This drives
``TieringOffloadingSpec.get_manager()`` in-process, with a CPU primary tier (a ``/dev/shm`` mmap)
and the ``fs`` secondary tier, using chunks sized like one 128-token block of SmolLM2-135M in
bf16 (2,949,120 bytes):

1. store 3 chunks (random bytes written into the primary tier, as the worker would) and wait
   until the fs tier has written them to files;
2. build a fresh manager with another engine id and an empty primary tier (a simulated
   restart), look the chunks up by key until the fs tier has promoted them (lookups answer
   "retry" meanwhile) and compare the promoted bytes with the stored ones;
3. shut down and count the files left behind: the fs tier has no eviction or delete.

It also prints the file layout (relative to the tier root). The root is a
``tempfile.TemporaryDirectory()``, removed at the end; no vLLM server or model is involved.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any

LAYERS, KV_HEADS, HEAD_SIZE, BLOCK_TOKENS = 30, 3, 64, 128  # SmolLM2-135M, CPU block size
CHUNK_BYTES = LAYERS * 2 * KV_HEADS * BLOCK_TOKENS * HEAD_SIZE * 2  # K+V, bf16
N_CHUNKS = 3
POLL_S = 0.005


def make_spec(engine_id: str, root: Path) -> Any:
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    config = OffloadingConfig(
        groups=(OffloadingGroupConfig(BLOCK_TOKENS, ("l0",), 0),),
        worker_kv_bytes_per_block=CHUNK_BYTES,
        enable_kv_cache_events=False,
        extra_config={
            "cpu_bytes_to_use": 64 * CHUNK_BYTES,
            "secondary_tiers": [
                {"type": "fs", "root_dir": str(root), "n_read_threads": 2, "n_write_threads": 2}
            ],
        },
        engine_id=engine_id,
        model=OffloadingModelConfig("smollm2", "bfloat16"),
        cache=OffloadingCacheConfig(BLOCK_TOKENS, 1),
        parallel=OffloadingParallelConfig(0, 1, 1, 1, 1, 1, 0, 1, None, True),
    )
    return TieringOffloadingSpec(config)


def chunk_files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.bin"))


def store(root: Path, engine_id: str, keys: list[Any], payload: list[bytes]) -> None:
    """Write chunks into a manager's primary tier, as its worker would, and let it cascade them."""
    from vllm.v1.kv_offload.base import ReqContext, ScheduleEndContext

    manager = make_spec(engine_id, root).get_manager()
    view = manager.primary_tier.get_kv_memoryview()
    raw = view.cast("B")
    ctx = ReqContext(req_id="r1")
    manager.on_new_request(ctx)
    stored = manager.prepare_store(keys, ctx)
    for chunk_id, data in zip(stored.store_spec.chunk_ids, payload, strict=True):
        offset = int(chunk_id) * view.strides[0]
        raw[offset : offset + CHUNK_BYTES] = data
    start = time.perf_counter()
    manager.complete_store(keys, ctx)
    while manager.has_pending_work():
        manager.on_schedule_end(ScheduleEndContext((), ()))
        time.sleep(POLL_S)
    # The fs tier's writers use this view; once they are done, release it, or the region cannot
    # be unmapped at shutdown ("cannot close exported pointers exist").
    raw.release()
    view.release()
    files = chunk_files(root)
    print(
        f"stored {len(keys)} chunks to the fs tier in {1e3 * (time.perf_counter() - start):.1f}"
        f" ms; files: {len(files)}, e.g. <root>/{files[0].relative_to(root)}"
    )
    manager.on_request_finished(ctx)
    manager.shutdown()


def restore(root: Path, engine_id: str, keys: list[Any], payload: list[bytes]) -> None:
    """A fresh manager (empty primary tier) finds the chunks in the fs tier and promotes them."""
    from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext

    manager = make_spec(engine_id, root).get_manager()
    ctx = ReqContext(req_id="r2")
    manager.on_new_request(ctx)
    start = time.perf_counter()
    first = results = [manager.lookup(k, ctx) for k in keys]
    waiting = (LookupResult.RETRY, LookupResult.HIT_PENDING)  # promotion started / in flight
    while any(r in waiting for r in results) and time.perf_counter() - start < 10:
        manager.on_schedule_end(ScheduleEndContext((), ()))
        time.sleep(POLL_S)
        results = [manager.lookup(k, ctx) for k in keys]
    print(
        "  first lookup",
        [r.name for r in first],
        "-> after promotion",
        [r.name for r in results],
        f"in {1e3 * (time.perf_counter() - start):.1f} ms",
    )
    if not all(r is LookupResult.HIT for r in results):
        manager.on_request_finished(ctx)
        manager.shutdown()
        return
    loaded = manager.prepare_load(keys, ctx)
    view = manager.primary_tier.get_kv_memoryview()
    raw = view.cast("B")
    equal = True
    for chunk_id, data in zip(loaded.chunk_ids, payload, strict=True):
        offset = int(chunk_id) * view.strides[0]
        equal &= bytes(raw[offset : offset + CHUNK_BYTES]) == data
    raw.release()
    view.release()
    print("  promoted bytes equal the stored bytes:", equal)
    manager.complete_load(keys, ctx)
    manager.on_request_finished(ctx)
    manager.shutdown()


def main() -> None:
    from vllm.v1.kv_offload.base import make_offload_key

    hashes = [os.urandom(32) for _ in range(N_CHUNKS)]
    keys = [make_offload_key(h, 0) for h in hashes]
    payload = [os.urandom(CHUNK_BYTES) for _ in keys]
    print(f"chunk = {CHUNK_BYTES} B (one 128-token block of SmolLM2-135M, bf16); {N_CHUNKS} chunks")
    # The primary tier is /dev/shm/vllm_offload_<engine id>.mmap: unique ids, checked afterwards.
    suffix = os.urandom(4).hex()
    with tempfile.TemporaryDirectory(prefix="agentkv-fs-tier-") as tmp:
        root = Path(tmp)
        store(root, f"kvtier-a-{suffix}", keys, payload)
        print("restart (fresh manager, empty primary tier):")
        restore(root, f"kvtier-b-{suffix}", keys, payload)
        files = chunk_files(root)
        with files[0].open("r+b") as f:  # same length, one byte flipped
            byte = f.read(1)
            f.seek(0)
            f.write(bytes([byte[0] ^ 0xFF]))
        damaged = [h.hex() for h in hashes].index(files[0].stem)
        print(f"restart after flipping one byte of chunk {damaged}'s file:")
        restore(root, f"kvtier-c-{suffix}", keys, payload)
        os.truncate(files[0], CHUNK_BYTES // 2)
        print("restart after truncating that file to half its length:")
        restore(root, f"kvtier-d-{suffix}", keys, payload)
        print("  the truncated file still exists:", files[0].exists())
        print("chunk files left after shutdown:", len(chunk_files(root)))
    shm = Path("/dev/shm")  # noqa: S108 - vLLM's fixed location, only listed here
    print("primary-tier mmaps left in /dev/shm:", len(list(shm.glob(f"vllm_offload_*{suffix}*"))))
    print("temporary directory removed:", not root.exists())


if __name__ == "__main__":
    main()
