"""The file tier inside ``AgentKVConnector``: persist on decode, resume straight into prefill.

Scheduler side (EngineCore process, :class:`TierScheduler`):

* At ``request_finished`` of a pinned D leg it records the request's computed token ids (prompt
  + generated whose KV decode holds), ``cache_salt`` and LoRA name: what a persist must write.
* ``persist`` (a lease operation, through the EngineCore utility ``agentkv_leases``) checks the
  lease, asks every worker to write its shard of the pinned blocks (``collective_rpc``, the
  executor's call to all workers: the worker is a separate process on the CPU build, which forces
  vLLM's multiprocessing executor), commits the manifest, and only then releases the pin. A write
  that fails removes its files and keeps the pin.
* A P leg whose ``kv_transfer_params`` carry a tier reference and no decode handle: the store
  verifies the prefix (tokens, salt, LoRA, fingerprint, per-block checksums of the files) and the
  connector reports that many tokens as an asynchronous external load, as the NIXL pull does; the
  load plan travels to the workers on the step's connector metadata.

Worker side (:class:`TierWorker`): reads the planned blocks into the request's blocks, verifies
their checksums again, and reports the request finished receiving; blocks that did not arrive
intact go to ``get_block_ids_with_load_errors``, so ``kv_load_failure_policy: "recompute"``
recomputes them and they are never served.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from agentkv._wire.hints import HintError, LeaseRef
from agentkv._wire.tier import PersistResult, TierRef, valid_tier_id
from agentkv.connector._tier_store import Manifest, TierError, TierStore

logger = structlog.get_logger("agentkv.connector.tier")

DEFAULT_TIER_BUDGET_BYTES = 4 << 30
# Temporary files younger than this survive a start-up sweep: P and D share one tier dir, and
# one server may start while the other is writing.
TMP_GRACE_S = 120.0

RunOnWorkers = Callable[..., list[Any]]


def tier_config(extra: Any) -> tuple[str | None, int]:
    """(``agentkv_tier_dir``, ``agentkv_tier_budget_bytes``) from a ``KVTransferConfig``."""
    directory = extra.get_from_extra_config("agentkv_tier_dir", None)
    budget = int(extra.get_from_extra_config("agentkv_tier_budget_bytes",
                                             DEFAULT_TIER_BUDGET_BYTES))
    return (str(directory) if directory else None), budget


def fingerprint(vllm_config: Any) -> dict[str, Any]:
    """What must be equal for KV written by one server to be valid on another."""
    model, cache, parallel = vllm_config.model_config, vllm_config.cache_config, \
        vllm_config.parallel_config
    cache_dtype = str(cache.cache_dtype)
    return {
        "model": str(model.model),
        "dtype": str(model.dtype) if cache_dtype == "auto" else cache_dtype,
        "layers": int(model.get_num_layers(parallel)),
        "kv_heads": int(model.get_num_kv_heads(parallel)),
        "head_size": int(model.get_head_size()),
        "block_size": int(cache.block_size),
        "tp": int(parallel.tensor_parallel_size),
    }


@dataclass(frozen=True, kw_only=True, slots=True)
class TokenRecord:
    token_ids: tuple[int, ...]
    cache_salt: str | None
    lora: str | None


@dataclass(frozen=True, kw_only=True, slots=True)
class TierLoad:
    """One request's load, scheduler to workers: file blocks into local blocks, with checksums."""

    entry: str
    block_bytes: int
    file_blocks: tuple[int, ...]
    local_blocks: tuple[int, ...]
    checksums: tuple[tuple[str, ...], ...]  # per rank, for file_blocks


def _lora_name(request: Any) -> str | None:
    lora = getattr(request, "lora_request", None)
    return None if lora is None else str(getattr(lora, "lora_name", lora))


class TierScheduler:
    def __init__(self, *, root: str, budget_bytes: int, vllm_config: Any) -> None:
        self.store = TierStore(root, budget_bytes=budget_bytes)
        self.store.sweep(tmp_grace_s=TMP_GRACE_S)
        self.fingerprint = fingerprint(vllm_config)
        self.block_size = int(vllm_config.cache_config.block_size)
        self._records: dict[str, TokenRecord] = {}
        self._plans: dict[str, tuple[Manifest, int]] = {}  # request id -> (entry, tokens)
        self._loads: dict[str, TierLoad] = {}

    # --- decode: persist --------------------------------------------------------------------

    def record(self, request: Any) -> None:
        """Keep what a persist of this pinned request must write (its Request object goes)."""
        n = int(request.num_computed_tokens)
        self._records[request.request_id] = TokenRecord(
            token_ids=tuple(request.all_token_ids[:n]),
            cache_salt=getattr(request, "cache_salt", None),
            lora=_lora_name(request),
        )

    def forget(self, request_ids: Any) -> None:
        for request_id in request_ids:
            self._records.pop(request_id, None)

    def persist(self, ref: LeaseRef, block_ids: tuple[tuple[int, ...], ...],
                run_on_workers: RunOnWorkers) -> dict[str, object]:
        """Write a pinned handle's blocks; the engine status and, on success, the answer."""
        record = self._records.get(ref.request_id)
        if record is None or not record.token_ids:
            return {"status": "tier_failed", "message": "no token record for this handle"}
        if len(block_ids) != 1:
            return {"status": "tier_failed", "message": "one KV cache group is supported"}
        n_blocks = -(-len(record.token_ids) // self.block_size)
        blocks = list(block_ids[0][:n_blocks])
        if len(blocks) < n_blocks:
            return {"status": "tier_failed", "message": "the handle holds fewer blocks than tokens"}
        entry = self.store.new_id()
        try:
            answers = sorted(run_on_workers(worker_write, args=(entry, blocks)),
                             key=lambda a: int(a["rank"]))
            if [int(a["rank"]) for a in answers] != list(range(len(answers))):
                raise TierError("the workers' ranks are not 0..n-1")
            sizes = {int(a["block_bytes"]) for a in answers}
            if len(sizes) != 1:
                raise TierError("the ranks disagree on the block size in bytes")
            manifest = Manifest(
                id=entry,
                fingerprint=self.fingerprint,
                token_ids=record.token_ids,
                cache_salt=record.cache_salt,
                lora=record.lora,
                block_size=self.block_size,
                block_bytes=sizes.pop(),
                checksums=tuple(tuple(a["checksums"]) for a in answers),
                created=time.time(),
            )
            self.store.check_fits(manifest.data_bytes)
            self.store.commit(manifest)
        except Exception as exc:
            self.store.abort(entry)
            logger.warning("tier_persist_failed", request_id=ref.request_id, error=repr(exc))
            return {"status": "tier_failed", "message": f"tier write failed: {exc}"}
        result = PersistResult(ref=TierRef(id=entry, n_tokens=manifest.n_tokens),
                               bytes=manifest.data_bytes)
        logger.info("tier_persisted", request_id=ref.request_id, id=entry,
                    n_tokens=manifest.n_tokens, bytes=manifest.data_bytes)
        return {"status": "ok", **result.to_wire()}

    def delete(self, payload: object) -> dict[str, object]:
        try:
            entry = valid_tier_id(payload.get("id") if isinstance(payload, Mapping) else None)
        except HintError as exc:
            return {"status": "invalid", "message": str(exc)}
        deleted = self.store.delete(entry)
        logger.info("tier_deleted", id=entry, deleted=deleted)
        return {"status": "ok", "deleted": deleted}

    # --- prefill: resume --------------------------------------------------------------------

    def lookup(self, request: Any, ref: TierRef, num_computed_tokens: int) -> int:
        """Tokens beyond ``num_computed_tokens`` this request may load from ``ref`` (0: none)."""
        prompt = list(request.prompt_token_ids or ())
        first_block = num_computed_tokens // self.block_size
        match = self.store.match(
            ref.id, token_ids=prompt, cache_salt=getattr(request, "cache_salt", None),
            lora=_lora_name(request), fingerprint=self.fingerprint,
            limit=max(0, len(prompt) - 1), first_block=first_block,
        )
        n = 0 if match is None else match.n_tokens
        logger.info("tier_lookup", request_id=request.request_id, id=ref.id, tokens=n,
                    local=num_computed_tokens,
                    reason="missing" if match is None else match.reason)
        if match is None or n <= num_computed_tokens:
            self._plans.pop(request.request_id, None)
            return 0
        self._plans[request.request_id] = (match.manifest, n)
        return n - num_computed_tokens

    def after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> bool:
        """Plan the load of an allocated request; False if it is not a tier load."""
        plan = self._plans.pop(request.request_id, None)
        if plan is None:
            return False
        if num_external_tokens <= 0:
            return True
        manifest, total = plan
        first = (total - num_external_tokens) // self.block_size
        last = -(-total // self.block_size)
        local = blocks.get_block_ids()[0]
        file_blocks = tuple(range(first, last))
        self._loads[request.request_id] = TierLoad(
            entry=manifest.id,
            block_bytes=manifest.block_bytes,
            file_blocks=file_blocks,
            local_blocks=tuple(int(b) for b in local[first:last]),
            checksums=tuple(tuple(r[first:last]) for r in manifest.checksums),
        )
        return True

    def take_loads(self) -> dict[str, TierLoad]:
        loads, self._loads = self._loads, {}
        return loads


class TierWorker:
    """The worker's half: its KV layout and I/O, loads done this step, blocks that failed."""

    def __init__(self, *, root: str, kv_caches: Mapping[str, Any], num_blocks: int,
                 rank: int) -> None:
        from agentkv.connector._tier_io import KVLayout, TierIO

        self.store_root = Path(root).resolve()
        self.store_root.mkdir(parents=True, exist_ok=True)
        self.rank = rank
        self.io = TierIO(KVLayout(kv_caches, num_blocks=num_blocks))
        self.done: set[str] = set()
        self.invalid: set[int] = set()
        logger.info("tier_worker_ready", engine=self.io.engine, rank=rank,
                    block_bytes=self.io.layout.block_bytes)

    def _path(self, entry: str) -> Path:
        return self.store_root / f"{valid_tier_id(entry)}.r{self.rank}.kv"

    def write(self, entry: str, block_ids: list[int]) -> dict[str, Any]:
        path = self._path(entry)
        checksums = self.io.write(TierStore.tmp(path), block_ids)
        return {"rank": self.rank, "block_bytes": self.io.layout.block_bytes,
                "checksums": checksums}

    def load(self, request_id: str, load: TierLoad) -> None:
        good = 0
        if load.block_bytes == self.io.layout.block_bytes and self.rank < len(load.checksums):
            good = self.io.read(self._path(load.entry), load.file_blocks, load.local_blocks,
                                load.checksums[self.rank])
        if good < len(load.local_blocks):
            self.invalid.update(load.local_blocks[good:])
        logger.info("tier_loaded", request_id=request_id, blocks=good,
                    failed=len(load.local_blocks) - good)
        self.done.add(request_id)


def worker_write(worker: Any, entry: str, block_ids: list[int]) -> dict[str, Any]:
    """Run by ``collective_rpc`` in every worker: write this rank's shard of the blocks."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    connector = get_kv_transfer_group()
    tier = getattr(connector, "agentkv_tier_worker", None)
    if tier is None:
        raise RuntimeError("agentkv tier: this worker has no tier configured")
    result: dict[str, Any] = tier.write(entry, block_ids)
    return result
