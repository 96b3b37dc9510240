"""The file tier inside ``AgentKVConnector``: offload on decode, resume straight into prefill.

Scheduler side (EngineCore process, :class:`TierScheduler`):

* At ``request_finished`` of a pinned D leg it records the request's computed token ids (prompt
  + generated whose KV decode holds), ``cache_salt`` and LoRA name: what an offload must write.
* ``offload`` (a lease operation, through the EngineCore utility ``agentkv_leases``) checks the
  lease, asks every worker to write its shard of the pinned blocks (``collective_rpc``, the
  executor's call to all workers: the worker is a separate process on the CPU build, which forces
  vLLM's multiprocessing executor), commits the manifest, and only then releases the pin. A write
  that fails removes its files and keeps the pin. The entry lives until its TTL (the server's
  ``agentkv_tier_ttl_s``, or what the call asked for up to ``agentkv_tier_max_ttl_s``); its
  secret, minted here and kept only as a digest, goes to the offloading client alone and is what
  ``delete`` asks for.
* A P leg whose ``kv_transfer_params`` carry a tier reference and no decode handle: the store
  checks the prefix against the manifest (expiry, tokens, salt, LoRA, fingerprint) and the data
  files' sizes, and the connector reports that many tokens as an asynchronous external load, as
  the NIXL pull does; the load plan travels to the workers on the step's connector metadata. The
  check reads no data: vLLM asks again every step while a request waits for memory, on the
  engine thread, and the manifest is parsed once per request. Every request's state here ends
  with it (:meth:`TierScheduler.finished`, from ``request_finished``, aborts included), which
  also hands back the report that prefill's answer carries (``TierLoadReport``) and counts its
  outcome for the ``vllm:agentkv_tier_lookups`` metric.

Worker side (:class:`TierWorker`): reads the planned blocks into the request's blocks, verifies
their checksums (the only place a load hashes data), and reports the request finished
receiving; blocks that did not arrive intact go to ``get_block_ids_with_load_errors``, so
``kv_load_failure_policy: "recompute"`` recomputes them and they are never served, and the
scheduler's report on the request says ``load_failed`` from there.
"""

from __future__ import annotations

import math
import time
import warnings
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentkv._core import get_logger
from agentkv._wire.hints import HintError, LeaseRef
from agentkv._wire.tier import OffloadResult, TierDelete, TierLoadReport, TierRef, valid_tier_id
from agentkv.connector._tier_store import (
    Manifest,
    TierError,
    TierMatch,
    TierStore,
    granted_ttl,
    new_secret,
    private_dir,
    salt_digest,
    secret_digest,
)
from agentkv.connector._tier_writer import RESULT_KEEP_S, BackgroundWrites

if TYPE_CHECKING:  # torch stays out of the scheduler's process
    from agentkv.connector._tier_io import ClearSlots, TierIO

logger = get_logger("agentkv.connector.tier")

DEFAULT_TIER_BUDGET_BYTES = 4 << 30
# An entry's time to live when the offload call asks for none, and the most it may ask for: a
# session idle for a day has most likely ended without closing (the budget evicts sooner).
DEFAULT_TIER_TTL_S = 24 * 3600.0
DEFAULT_TIER_MAX_TTL_S = 7 * 24 * 3600.0
# Temporary files younger than this survive a sweep: P and D share one tier dir, and one server
# may start while the other is writing.
TMP_GRACE_S = 120.0
# How often the scheduler side sweeps (expired entries) after the start-up sweep.
SWEEP_EVERY_S = 60.0

RunOnWorkers = Callable[..., list[Any]]
# How often the writing thread checks its NIXL write: it sleeps in between, so the worker's
# forward pass keeps the GIL (a spinning check cost other sessions ~270 ms gaps a write).
WRITE_POLL_S = 0.001


@dataclass(frozen=True, kw_only=True, slots=True)
class TierConfig:
    """The tier's ``kv_connector_extra_config``: ``agentkv_tier_dir`` (no tier without it),
    ``agentkv_tier_budget_bytes``, ``agentkv_tier_ttl_s`` and ``agentkv_tier_max_ttl_s``."""

    dir: str | None
    budget_bytes: int = DEFAULT_TIER_BUDGET_BYTES
    ttl_s: float = DEFAULT_TIER_TTL_S
    max_ttl_s: float = DEFAULT_TIER_MAX_TTL_S

    def __post_init__(self) -> None:
        if self.budget_bytes <= 0:
            raise ValueError("agentkv_tier_budget_bytes must be a positive number of bytes")
        if not (math.isfinite(self.ttl_s) and 0 < self.ttl_s <= self.max_ttl_s):
            raise ValueError(
                f"agentkv_tier_ttl_s must be positive and at most agentkv_tier_max_ttl_s "
                f"({self.max_ttl_s}), got {self.ttl_s}"
            )
        if not math.isfinite(self.max_ttl_s):
            raise ValueError("agentkv_tier_max_ttl_s must be a finite number of seconds")

    def ttl(self, requested: float | None) -> float:
        """The TTL an offload gets when it asked for ``requested`` (``None``: the default)."""
        return granted_ttl(requested, default_s=self.ttl_s, max_s=self.max_ttl_s)


def tier_config(extra: Any) -> TierConfig:
    """The tier's settings from a ``KVTransferConfig``'s extra config."""
    directory = extra.get_from_extra_config("agentkv_tier_dir", None)
    return TierConfig(
        dir=str(directory) if directory else None,
        budget_bytes=int(extra.get_from_extra_config("agentkv_tier_budget_bytes",
                                                     DEFAULT_TIER_BUDGET_BYTES)),
        ttl_s=float(extra.get_from_extra_config("agentkv_tier_ttl_s", DEFAULT_TIER_TTL_S)),
        max_ttl_s=float(extra.get_from_extra_config("agentkv_tier_max_ttl_s",
                                                    DEFAULT_TIER_MAX_TTL_S)),
    )


def fingerprint(vllm_config: Any) -> dict[str, Any]:
    """What must be equal for KV written by one server to be valid on another.

    ``weights`` is vLLM's own ``ModelConfig.compute_hash()``: the model path or name, revision,
    quantization, dtype, max_model_len and the whole Hugging Face config after ``hf_overrides``
    (rope scaling included), and not the tokenizer, seed, served name or anything of the KV
    transfer config, so a prefill and a decode server of one pair agree on it (vLLM's
    ``VllmConfig.compute_hash`` would not: it covers the transfer config and the scheduler).
    The rest is the KV layout: dtypes, layers, KV heads, head size, block size, TP, and the
    attention kernel's layout of a block's bytes (``attn_layout``: on the CPU backend its ISA,
    which orders keys differently per kernel and depends on the host's CPU, so two hosts
    sharing one tier directory may disagree).
    """
    model, cache, parallel = vllm_config.model_config, vllm_config.cache_config, \
        vllm_config.parallel_config
    return {
        "attn_layout": attn_layout(vllm_config),
        "model": str(model.model),
        "weights": str(model.compute_hash()),
        "dtype": str(model.dtype),
        "cache_dtype": str(cache.cache_dtype),
        "layers": int(model.get_num_layers(parallel)),
        "kv_heads": int(model.get_num_kv_heads(parallel)),
        "head_size": int(model.get_head_size()),
        "block_size": int(cache.block_size),
        "tp": int(parallel.tensor_parallel_size),
    }


def attn_layout(vllm_config: Any) -> str:
    """How the attention backend lays out a KV block's bytes on this host: ``cpu:<isa>`` with
    vLLM's CPU backend (the ISA it picks for this dtype, block and head size, as its attention
    layers do), else the platform's device type (one layout per backend and device there)."""
    try:
        with warnings.catch_warnings():  # vLLM's own imports warn of deprecations in torch
            warnings.simplefilter("ignore", DeprecationWarning)
            from vllm.platforms import current_platform

            device = str(current_platform.device_type)
            if device != "cpu":
                return device
            from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        model, cache = vllm_config.model_config, vllm_config.cache_config
        isa = _get_attn_isa(model.dtype, int(cache.block_size), int(model.get_head_size()),
                            str(cache.cache_dtype))
    except Exception as exc:  # a vLLM without these: entries still bound to everything else
        logger.warning("tier_attn_layout_unknown", error=repr(exc))
        return "unknown"
    return f"cpu:{isa}"


@dataclass(frozen=True, kw_only=True, slots=True)
class TokenRecord:
    token_ids: tuple[int, ...]
    cache_salt: str | None
    lora: str | None


@dataclass(frozen=True, kw_only=True, slots=True)
class _Offload:
    """A tier write the workers are running: what its commit needs."""

    ref: LeaseRef
    record: TokenRecord
    ttl_s: float | None
    started: float
    keep: bool = False
    """A copy (a fork's entry): the pin stays when it commits."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TierLoad:
    """One request's load, scheduler to workers: file blocks into local blocks, with checksums."""

    entry: str
    block_bytes: int
    file_blocks: tuple[int, ...]
    local_blocks: tuple[int, ...]
    checksums: tuple[tuple[str, ...], ...]  # per rank, for file_blocks


def _lora_name(request: Any) -> str | None:
    """The identity of the request's LoRA adapter, as tier entries are keyed by it: the path
    of its weights (vLLM requires one), else its int id; never its display name, which another
    adapter may take after a restart."""
    lora = getattr(request, "lora_request", None)
    if lora is None:
        return None
    path = getattr(lora, "lora_path", None)
    if path:
        return f"path:{path}"
    return f"id:{int(lora.lora_int_id)}"


class TierScheduler:
    """The scheduler's half: token records, offload and delete, lookups and load plans.

    It has no thread of its own: after the start-up sweep it sweeps again (expired entries,
    leftovers) from the engine's step (:meth:`take_loads`) and from :meth:`offload`, at most
    every :data:`SWEEP_EVERY_S` seconds of ``clock`` (wall clock, as entries' expiries).
    """

    def __init__(self, *, config: TierConfig, vllm_config: Any,
                 clock: Callable[[], float] = time.time) -> None:
        if not config.dir:
            raise ValueError("the tier needs agentkv_tier_dir")
        self.config = config
        self._clock = clock
        self.store = TierStore(config.dir, budget_bytes=config.budget_bytes, clock=clock)
        self.store.sweep(tmp_grace_s=TMP_GRACE_S)
        self._swept_at = clock()
        self.fingerprint = fingerprint(vllm_config)
        self.block_size = int(vllm_config.cache_config.block_size)
        self._records: dict[str, TokenRecord] = {}
        # Per request, from its first lookup until it finishes (or its load is planned):
        self._plans: dict[str, tuple[Manifest, int]] = {}  # request id -> (entry, tokens)
        self._manifests: dict[str, Manifest] = {}  # parsed once, not at every lookup
        self._reports: dict[str, TierLoadReport] = {}  # until the request finishes
        self._loads: dict[str, TierLoad] = {}  # planned this step, for the workers
        self._inflight: dict[str, TierLoad] = {}  # sent to the workers, not yet received
        self._outcomes: Counter[str] = Counter()  # finished requests' reasons, for the metric
        self._offloads: dict[str, _Offload] = {}  # tier writes started, not yet committed

    # --- decode: offload --------------------------------------------------------------------

    def record(self, request: Any) -> None:
        """Keep what an offload of this pinned request must write (its Request object goes)."""
        n = int(request.num_computed_tokens)
        self._records[request.request_id] = TokenRecord(
            token_ids=tuple(request.all_token_ids[:n]),
            cache_salt=getattr(request, "cache_salt", None),
            lora=_lora_name(request),
        )

    def forget(self, request_ids: Any) -> None:
        for request_id in request_ids:
            self._records.pop(request_id, None)

    def maybe_sweep(self) -> None:
        """Sweep the store if the last sweep is :data:`SWEEP_EVERY_S` old."""
        now = self._clock()
        if now - self._swept_at < SWEEP_EVERY_S:
            return
        self._swept_at = now
        try:
            self.store.sweep(tmp_grace_s=TMP_GRACE_S)
        except OSError as exc:  # the root vanished or is unreadable: try again next time
            logger.warning("tier_sweep_failed", error=repr(exc))

    def offload(self, ref: LeaseRef, block_ids: tuple[tuple[int, ...], ...],
                run_on_workers: RunOnWorkers, *, ttl_s: float | None = None,
                keep: bool = False) -> dict[str, object]:
        """Start writing a pinned handle's blocks, to live ``ttl_s`` (capped; ``None``: the
        default): ``{"status": "pending", "entry": id}``, which :meth:`offload_poll` finishes,
        or the engine status of a refusal. The workers write on threads of their own
        (``_tier_writer``): this returns as soon as they have started. ``keep``: a copy, whose
        commit leaves the pin (see :meth:`offload_ref`)."""
        self.maybe_sweep()
        self._abort_stale()
        record = self._records.get(ref.request_id)
        if record is None or not record.token_ids:
            return {"status": "tier_failed", "message": "no token record for this handle"}
        if len(block_ids) != 1:
            return {"status": "tier_failed", "message": "one KV cache group is supported"}
        if any(p.ref.request_id == ref.request_id for p in self._offloads.values()):
            return {"status": "tier_failed", "message": "this handle is already being offloaded"}
        n_blocks = -(-len(record.token_ids) // self.block_size)
        blocks = list(block_ids[0][:n_blocks])
        if len(blocks) < n_blocks:
            return {"status": "tier_failed", "message": "the handle holds fewer blocks than tokens"}
        entry = self.store.new_id()
        try:
            answers = run_on_workers(worker_write_start,
                                     args=(entry, ref.request_id, blocks, len(record.token_ids)))
            self._ranks(answers)
        except Exception as exc:
            self.store.abort(entry)
            logger.warning("tier_offload_failed", request_id=ref.request_id, error=repr(exc))
            return {"status": "tier_failed", "message": f"tier write failed: {exc}"}
        self._offloads[entry] = _Offload(ref=ref, record=record, ttl_s=ttl_s,
                                         started=self._clock(), keep=keep)
        return {"status": "pending", "entry": entry}

    def offload_poll(self, entry: str, run_on_workers: RunOnWorkers) -> dict[str, object]:
        """Where the write :meth:`offload` started stands: ``pending``; ``ok`` with the answer
        (the entry committed, with its secret: free the pin now); or ``tier_failed`` (its
        files removed, the pin kept)."""
        pending = self._offloads.get(entry)
        if pending is None:
            return {"status": "unknown", "message": "no such tier write in progress"}
        ref, record = pending.ref, pending.record
        try:
            answers = self._ranks(run_on_workers(worker_write_poll, args=(entry,)))
            failed = [str(a.get("error")) for a in answers if a.get("state") == "failed"]
            if failed:
                raise TierError("; ".join(failed))
            if any(a.get("state") != "done" for a in answers):
                if any(a.get("state") != "pending" for a in answers):
                    raise TierError("a worker answered an unknown write state")
                return {"status": "pending", "entry": entry}
            del self._offloads[entry]
            sizes = {int(a["block_bytes"]) for a in answers}
            if len(sizes) != 1:
                raise TierError("the ranks disagree on the block size in bytes")
            now, ttl, secret = self._clock(), self.config.ttl(pending.ttl_s), new_secret()
            manifest = Manifest(
                id=entry,
                fingerprint=self.fingerprint,
                token_ids=record.token_ids,
                salt_digest=salt_digest(record.cache_salt),
                lora=record.lora,
                block_size=self.block_size,
                block_bytes=sizes.pop(),
                checksums=tuple(tuple(a["checksums"]) for a in answers),
                created=now,
                expires=now + ttl,
                secret_digest=secret_digest(secret),
            )
            self.store.check_fits(manifest.data_bytes)
            self.store.commit(manifest)
        except Exception as exc:
            self._offloads.pop(entry, None)
            self.store.abort(entry)
            logger.warning("tier_offload_failed", request_id=ref.request_id, error=repr(exc))
            return {"status": "tier_failed", "message": f"tier write failed: {exc}"}
        result = OffloadResult(
            ref=TierRef(id=entry, n_tokens=manifest.n_tokens, secret=secret),
            bytes=manifest.data_bytes, ttl_s=ttl,
        )
        logger.info("tier_offloaded", request_id=ref.request_id, id=entry,
                    n_tokens=manifest.n_tokens, bytes=manifest.data_bytes, ttl_s=ttl,
                    seconds=round(now - pending.started, 3))
        return {"status": "ok", **result.to_wire()}

    def offload_ref(self, entry: str) -> LeaseRef | None:
        """The pin a write in progress frees when it commits (``None`` for a copy)."""
        pending = self._offloads.get(entry)
        return None if pending is None or pending.keep else pending.ref

    @staticmethod
    def _ranks(answers: list[Any]) -> list[dict[str, Any]]:
        answers = sorted(answers, key=lambda a: int(a["rank"]))
        if [int(a["rank"]) for a in answers] != list(range(len(answers))):
            raise TierError("the workers' ranks are not 0..n-1")
        return answers

    def _abort_stale(self) -> None:
        """Give up writes nobody polled for (the offload route died): their files go, and the
        pin stays until its own lease ends."""
        now = self._clock()
        for entry, pending in list(self._offloads.items()):
            if now - pending.started > RESULT_KEEP_S:
                del self._offloads[entry]
                self.store.abort(entry)
                logger.warning("tier_offload_abandoned", request_id=pending.ref.request_id,
                               id=entry)

    def delete(self, payload: object) -> dict[str, object]:
        """Remove an entry for the client that shows its secret; ``unknown`` alike for a
        missing entry and a wrong secret (the route is no oracle for other sessions' ids)."""
        try:
            request = TierDelete.from_wire(payload)
        except HintError as exc:
            return {"status": "invalid", "message": str(exc)}
        deleted = self.store.delete_owned(request.id, request.secret)
        logger.info("tier_deleted", id=request.id, deleted=deleted)
        if not deleted:
            return {"status": "unknown", "message": "no such tier entry, or not yours"}
        return {"status": "ok", "deleted": True}

    # --- prefill: resume --------------------------------------------------------------------

    def lookup(self, request: Any, ref: TierRef, num_computed_tokens: int) -> int:
        """Tokens beyond ``num_computed_tokens`` this request may load from ``ref`` (0: none).

        Runs on the engine thread, every step while the request waits: the manifest is parsed
        once per request, and no data is read (the worker checks each block it loads).
        """
        request_id = request.request_id
        manifest = self._manifests.get(request_id)
        if manifest is None or manifest.id != ref.id:
            manifest = self.store.manifest(ref.id)
        match: TierMatch | None = None
        if manifest is not None:
            self._manifests[request_id] = manifest
            prompt = request.prompt_token_ids or ()
            match = self.store.match_manifest(
                manifest, token_ids=prompt, cache_salt=getattr(request, "cache_salt", None),
                lora=_lora_name(request), fingerprint=self.fingerprint,
                limit=max(0, len(prompt) - 1), verify_data=False,
            )
        n = 0 if match is None else match.n_tokens
        report = _report(match, local=num_computed_tokens)
        if self._reports.get(request_id) != report:  # once, not at every step of a wait
            logger.info("tier_lookup", request_id=request_id, id=ref.id, tokens=n,
                        local=num_computed_tokens, reason=report.reason)
        self._reports[request_id] = report
        if match is None or n <= num_computed_tokens:
            self._plans.pop(request_id, None)
            return 0
        self._plans[request_id] = (match.manifest, n)
        return n - num_computed_tokens

    def after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> bool:
        """Plan the load of an allocated request; False if it is not a tier load."""
        plan = self._plans.pop(request.request_id, None)
        self._manifests.pop(request.request_id, None)
        if plan is None:
            return False
        if num_external_tokens <= 0:
            return True
        manifest, total = plan
        first = (total - num_external_tokens) // self.block_size
        last = -(-total // self.block_size)
        local = blocks.get_block_ids()[0]
        file_blocks = tuple(range(first, last))
        load = TierLoad(
            entry=manifest.id,
            block_bytes=manifest.block_bytes,
            file_blocks=file_blocks,
            local_blocks=tuple(int(b) for b in local[first:last]),
            checksums=tuple(tuple(r[first:last]) for r in manifest.checksums),
        )
        self._loads[request.request_id] = load
        self._inflight[request.request_id] = load
        return True

    def take_loads(self) -> dict[str, TierLoad]:
        """The loads planned since the last step (called once per engine step)."""
        self.maybe_sweep()
        loads, self._loads = self._loads, {}
        return loads

    def load_results(self, *, finished: Iterable[str], invalid: Collection[int]) -> None:
        """What the workers reported this step (``update_connector_output``): a load with a
        block that did not arrive intact is recomputed from that block on, and its report says
        so; a load reported finished is done."""
        if invalid:
            for request_id, load in self._inflight.items():
                bad = next((i for i, b in enumerate(load.local_blocks) if b in invalid), None)
                if bad is not None:
                    self._reports[request_id] = TierLoadReport(
                        tokens=load.file_blocks[bad] * self.block_size, reason="load_failed")
        for request_id in finished:
            self._inflight.pop(request_id, None)

    def finished(self, request_id: str) -> TierLoadReport | None:
        """Forget a finished request (however it finished, aborted too): its plan, manifest and
        loads; its tier report (``None`` if it carried no tier reference), now counted."""
        self._plans.pop(request_id, None)
        self._manifests.pop(request_id, None)
        self._loads.pop(request_id, None)
        self._inflight.pop(request_id, None)
        report = self._reports.pop(request_id, None)
        if report is not None:
            self._outcomes[report.reason] += 1
        return report

    def take_outcomes(self) -> dict[str, int]:
        """Finished requests' tier reasons since the last call, counted (for the metric)."""
        outcomes, self._outcomes = dict(self._outcomes), Counter()
        return outcomes


# The store's reasons that mean the prompt took all it could from the entry.
_SERVED = frozenset({"complete", "limit"})


def _report(match: TierMatch | None, *, local: int) -> TierLoadReport:
    """What a lookup tells the request's answer: the tokens the entry covers and why not more."""
    if match is None:
        return TierLoadReport(tokens=0, reason="missing")
    n = match.n_tokens
    reason = "ok" if match.reason in _SERVED else match.reason
    if reason == "ok" and n <= local:
        reason = "cached"  # prefill's own prefix cache held it all
    try:
        return TierLoadReport(tokens=n, reason=reason)
    except HintError:  # a store reason that is no wire word: still never fail the request
        return TierLoadReport(tokens=n, reason="other")


class TierWorker:
    """The worker's half: its KV layout and I/O, loads done this step, blocks that failed."""

    def __init__(self, *, root: str, kv_caches: Mapping[str, Any], num_blocks: int,
                 rank: int, clear_slots: ClearSlots | None = None) -> None:
        from agentkv.connector._tier_io import KVLayout, TierIO

        self.store_root = Path(root).resolve()
        private_dir(self.store_root)  # the worker may create the root before the scheduler
        self.rank = rank
        self.io = TierIO(KVLayout(kv_caches, num_blocks=num_blocks, clear_slots=clear_slots))
        self.done: set[str] = set()
        self.invalid: set[int] = set()
        self.writes = BackgroundWrites()
        self._write_io: TierIO | None = None
        logger.info("tier_worker_ready", engine=self.io.engine, rank=rank,
                    block_bytes=self.io.layout.block_bytes,
                    last_block="zeroed past the tokens" if clear_slots else "written whole")

    def _path(self, entry: str) -> Path:
        return self.store_root / f"{valid_tier_id(entry)}.r{self.rank}.kv"

    def start_write(self, entry: str, request_id: str, block_ids: list[int],
                    n_tokens: int) -> dict[str, Any]:
        """Start writing this rank's shard of ``request_id``'s blocks, which hold ``n_tokens``
        tokens, on the writing thread (:mod:`~agentkv.connector._tier_writer`)."""
        path = TierStore.tmp(self._path(entry))

        def write() -> dict[str, Any]:
            if self._write_io is None:  # made on the writing thread, used only there
                from agentkv.connector._tier_io import TierIO

                self._write_io = TierIO(self.io.layout, yield_s=WRITE_POLL_S)
            return {"checksums": self._write_io.write(path, block_ids, n_tokens=n_tokens)}

        self.writes.start(entry, request_id, write)
        return {"rank": self.rank}

    def poll_write(self, entry: str) -> dict[str, Any]:
        """Where this rank's write of ``entry`` stands (``_tier_writer.BackgroundWrites.poll``)."""
        return {"rank": self.rank, "block_bytes": self.io.layout.block_bytes,
                **self.writes.poll(entry)}

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


def _tier_worker() -> TierWorker:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    tier = getattr(get_kv_transfer_group(), "agentkv_tier_worker", None)
    if not isinstance(tier, TierWorker):
        raise RuntimeError("agentkv tier: this worker has no tier configured")
    return tier


def worker_write_start(worker: Any, entry: str, request_id: str, block_ids: list[int],
                       n_tokens: int) -> dict[str, Any]:
    """Run by ``collective_rpc`` in every worker: start writing this rank's shard of the
    blocks, which hold ``n_tokens`` tokens (the last block's slots past them written as
    zeros); returns at once."""
    del worker
    return _tier_worker().start_write(entry, request_id, block_ids, n_tokens)


def worker_write_poll(worker: Any, entry: str) -> dict[str, Any]:
    """Run by ``collective_rpc`` in every worker: where this rank's write of ``entry`` stands."""
    del worker
    return _tier_worker().poll_write(entry)
