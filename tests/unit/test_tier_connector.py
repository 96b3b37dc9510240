"""The file tier's real classes, without vLLM: ``TierScheduler`` and ``TierWorker`` on small KV.

The scheduler gets a stub ``VllmConfig`` (only what ``fingerprint()`` and its constructor read)
and stub requests; ``offload`` runs the worker's real ``write`` where vLLM would
``collective_rpc`` it; a resume goes ``lookup`` -> ``after_alloc`` -> ``take_loads`` ->
``TierWorker.load`` into another server's blocks, as the connector's metadata carries it, and
``load_results`` / ``finished`` are what ``update_connector_output`` / ``request_finished`` call.

Where the bytes of a slot matter, the KV is written by vLLM's own CPU attention kernel
(``torch.ops._C.cpu_attn_reshape_and_cache``, loaded from the installed vLLM without importing
vLLM): a block's layout is that kernel's (its keys are stored transposed), not a guess.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry, Counter

from agentkv._wire.handoff import TurnRequest, decode_body, parse_prefill
from agentkv._wire.hints import HINTS_KEY, LeaseRef
from agentkv._wire.tier import TierLoadReport, TierRef, with_tier_load
from agentkv.connector._tier import (
    TierLoad,
    TierScheduler,
    TierWorker,
    tier_config,
    worker_write_poll,
    worker_write_start,
)
from agentkv.connector._tier_io import CacheWriter, KVLayout, cpu_attn_clear_slots
from agentkv.connector._tier_stats import (
    METRIC_NAME,
    TIER_STATS_KEY,
    TierLookupMetric,
    tier_reasons,
)

BS = 16  # tokens per block: vLLM's CPU backend runs its "vec16" kernels for it
HEADS = 2
HEAD_SIZE = 32
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
NUM_BLOCKS = 12
DTYPE = torch.bfloat16
ISA = "vec16"

Kernel = Callable[..., None]


# --- stubs of what vLLM hands the connector --------------------------------------------------


def vllm_config(*, weights: str = "weights-hash-1") -> Any:
    """A ``VllmConfig`` with exactly what the tier reads (``fingerprint()``, the constructor)."""
    model = SimpleNamespace(
        model="HuggingFaceTB/SmolLM2-135M-Instruct",
        dtype=DTYPE,
        compute_hash=lambda: weights,
        get_num_layers=lambda parallel: len(LAYERS),
        get_num_kv_heads=lambda parallel: HEADS,
        get_head_size=lambda: HEAD_SIZE,
    )
    return SimpleNamespace(
        model_config=model,
        cache_config=SimpleNamespace(cache_dtype="auto", block_size=BS),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
        lora_config=None,
    )


def scheduler(root: Path, *, weights: str = "weights-hash-1") -> TierScheduler:
    extra = {"agentkv_tier_dir": str(root)}
    config = tier_config(SimpleNamespace(get_from_extra_config=extra.get))
    return TierScheduler(config=config, vllm_config=vllm_config(weights=weights))


def request(request_id: str, tokens: list[int], *, computed: int | None = None,
            salt: str | None = None, lora: Any = None) -> Any:
    """A vLLM ``Request`` as the tier reads it (a D leg's after it ran, or a new P leg's)."""
    return SimpleNamespace(
        request_id=request_id,
        prompt_token_ids=tokens,
        all_token_ids=tokens,
        num_computed_tokens=len(tokens) if computed is None else computed,
        cache_salt=salt,
        lora_request=lora,
    )


class Blocks:
    """vLLM's ``KVCacheBlocks`` as ``update_state_after_alloc`` gets them (one group)."""

    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    def get_block_ids(self) -> tuple[list[int], ...]:
        return (self.ids,)


def kv_caches() -> dict[str, torch.Tensor]:
    """One server's KV: the CPU backend's ``[num_blocks, kv_heads, block_size, 2*head_size]``
    per layer."""
    return {name: torch.zeros(NUM_BLOCKS, HEADS, BS, 2 * HEAD_SIZE, dtype=DTYPE)
            for name in LAYERS}


@pytest.fixture(scope="module")
def kernel() -> Kernel:
    """vLLM's CPU attention cache write (``_C``), or the test is skipped."""
    spec = importlib.util.find_spec("vllm")  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("vLLM is not installed")
    # The build vLLM itself loads on this CPU (``CpuPlatform.import_kernels``): ``_C`` needs
    # AVX512-BF16, and on an AVX2 CPU loading it kills the process (SIGILL), no exception.
    if torch.cpu._is_avx512_supported():
        build = "_C" if torch.cpu._is_avx512_bf16_supported() else "_C_AVX512"
    else:
        build = "_C_AVX2"
    library = Path(next(iter(spec.submodule_search_locations))) / f"{build}.abi3.so"
    try:
        if not hasattr(torch.ops._C, "cpu_attn_reshape_and_cache"):
            torch.ops.load_library(str(library))
        op: Kernel = torch.ops._C.cpu_attn_reshape_and_cache
    except (OSError, RuntimeError, AttributeError) as exc:
        pytest.skip(f"vLLM's CPU kernels are not loadable here: {exc}")
    return op


def clearer(op: Kernel) -> Any:
    writer = CacheWriter(isa=ISA, kv_cache_dtype="auto", k_scale=1.0, v_scale=1.0, dtype=DTYPE)
    return cpu_attn_clear_slots(dict.fromkeys(LAYERS, writer), op)


def write_kv(op: Kernel, kv: dict[str, torch.Tensor], slots: list[int], seed: int) -> None:
    """Write random keys and values into ``slots`` (block * BS + offset) of every layer, as
    the backend's ``do_kv_cache_update`` does."""
    gen = torch.Generator().manual_seed(seed)
    for cache in kv.values():
        key = torch.randn(len(slots), HEADS, HEAD_SIZE, generator=gen).to(DTYPE)
        value = torch.randn(len(slots), HEADS, HEAD_SIZE, generator=gen).to(DTYPE)
        key_cache, value_cache = cache.view(NUM_BLOCKS, HEADS, 2 * BS, HEAD_SIZE).chunk(2, dim=2)
        op(key, value, key_cache, value_cache, torch.tensor(slots, dtype=torch.int64), ISA,
           1.0, 1.0, "auto")


def random_kv(kv: dict[str, torch.Tensor], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for cache in kv.values():
        cache.copy_(torch.randn(cache.shape, generator=gen).to(DTYPE))


def slot_bytes(op: Kernel, first: int) -> torch.Tensor:
    """Per layer block, which bytes hold slots ``first..BS-1``, found by the kernel itself."""
    probe = torch.full((1, HEADS, BS, 2 * HEAD_SIZE), float("nan"), dtype=DTYPE)
    before = probe.view(torch.uint8).clone()
    clearer(op)(LAYERS[0], probe, first)
    return (probe.view(torch.uint8) != before).reshape(-1)


def block_bytes(kv: dict[str, torch.Tensor], block: int) -> list[torch.Tensor]:
    return [cache[block].view(torch.uint8).reshape(-1).clone() for cache in kv.values()]


# --- one decode server and one prefill server on a shared tier dir ---------------------------

TOKENS = list(range(1000, 1000 + 3 * BS))  # a turn's tokens: three full blocks
D_BLOCKS = [2, 5, 7]  # where decode holds them
P_BLOCKS = [9, 3, 10, 4]  # where prefill allocates the next prompt's blocks


class Pair:
    def __init__(self, root: Path, *, clear: Any = None) -> None:
        self.root = root
        self.d_kv, self.p_kv = kv_caches(), kv_caches()
        self.d = scheduler(root)
        self.d_worker = TierWorker(root=str(root), kv_caches=self.d_kv, num_blocks=NUM_BLOCKS,
                                   rank=0, clear_slots=clear)
        self.p = scheduler(root)
        self.p_worker = TierWorker(root=str(root), kv_caches=self.p_kv, num_blocks=NUM_BLOCKS,
                                   rank=0, clear_slots=clear)

    def offload(self, tokens: list[int] = TOKENS, *, salt: str | None = None,
                keep: bool = False) -> str:
        """Decode's pinned turn to the tier (``keep``: a fork's copy); the entry's id."""
        self.d.record(request("d-1", tokens, salt=salt))
        blocks = D_BLOCKS[: -(-len(tokens) // BS)]

        def run_on_workers(method: Callable[..., Any], *, args: tuple[Any, ...]) -> list[Any]:
            # The worker's real calls, in-process.
            calls = {worker_write_start: self.d_worker.start_write,
                     worker_write_poll: self.d_worker.poll_write}
            return [calls[method](*args)]

        ref = LeaseRef(request_id="d-1", block_ids=(tuple(blocks),), lease="secret")
        started = self.d.offload(ref, (tuple(blocks),), run_on_workers, keep=keep)
        assert started["status"] == "pending", started
        # The pin the commit frees: the handle's, unless this is a copy that keeps it.
        assert self.d.offload_ref(str(started["entry"])) == (None if keep else ref)
        answer = self.d.offload_poll(str(started["entry"]), run_on_workers)
        while answer["status"] == "pending":
            time.sleep(0.001)
            answer = self.d.offload_poll(str(started["entry"]), run_on_workers)
        assert answer["status"] == "ok", answer
        tier = answer["tier"]
        assert isinstance(tier, dict)
        return str(tier["id"])

    def resume(self, request_id: str, prompt: list[int], entry: str, *,
               salt: str | None = None, lora: Any = None) -> tuple[int, TierLoad | None]:
        """A P leg with the tier reference: the tokens it loads and the load the worker ran."""
        req = request(request_id, prompt, computed=0, salt=salt, lora=lora)
        n = self.p.lookup(req, TierRef(id=entry, n_tokens=len(TOKENS)), 0)
        if n == 0:
            return 0, None
        assert self.p.after_alloc(req, Blocks(P_BLOCKS), n)
        loads = self.p.take_loads()
        load = loads[request_id]
        self.p_worker.load(request_id, load)
        self.p.load_results(finished=self.p_worker.done, invalid=self.p_worker.invalid)
        return n, load


@pytest.fixture
def pair(tmp_path: Path) -> Pair:
    return Pair(tmp_path / "tier")


def data_file(root: Path, entry: str) -> Path:
    return root / f"{entry}.r0.kv"


# --- the round trip --------------------------------------------------------------------------


def test_a_offloaded_entry_loads_back_byte_for_byte_into_another_servers_blocks(
    pair: Pair,
) -> None:
    random_kv(pair.d_kv, seed=1)
    entry = pair.offload()
    n, load = pair.resume("p-1", [*TOKENS, 1, 2, 3], entry)
    assert n == len(TOKENS)
    assert load is not None
    assert (load.file_blocks, load.local_blocks) == ((0, 1, 2), (9, 3, 10))
    for d_block, p_block in zip(D_BLOCKS, P_BLOCKS, strict=False):
        assert [torch.equal(a, b) for a, b in zip(block_bytes(pair.d_kv, d_block),
                                                   block_bytes(pair.p_kv, p_block),
                                                   strict=True)] == [True, True]
    assert pair.p_worker.done == {"p-1"}
    assert pair.p_worker.invalid == set()
    assert pair.p.finished("p-1") == TierLoadReport(tokens=len(TOKENS), reason="ok")


def test_copies_of_one_pin_are_entries_of_their_own_that_each_load_and_delete_alone(
    pair: Pair,
) -> None:
    """A fork's copy (an offload with ``keep``) leaves the pin to its parent: the connector
    frees no pin at its commit. Two copies of one pin are two entries with their own secrets."""
    random_kv(pair.d_kv, seed=3)
    first, second = pair.offload(keep=True), pair.offload(keep=True)
    assert first != second
    assert pair.resume("p-1", [*TOKENS, 7], first)[0] == len(TOKENS)
    manifest = pair.d.store.manifest(first)
    assert manifest is not None
    pair.d.store.delete(first)
    assert pair.resume("p-2", [*TOKENS, 8], second)[0] == len(TOKENS)


@pytest.mark.slow  # imports vLLM for its CPU kernel (~8 s)
def test_the_last_block_is_written_with_zeros_past_the_tokens_and_its_valid_slots_load_exactly(
    tmp_path: Path, kernel: Kernel,
) -> None:
    """Stale KV of whatever used the last block's free slots never leaves decode in a file."""
    pair = Pair(tmp_path / "tier", clear=clearer(kernel))
    tokens = TOKENS[: 2 * BS + 5]  # the last block holds 5 tokens
    last = D_BLOCKS[2]
    write_kv(kernel, pair.d_kv, [last * BS + s for s in range(5, BS)], seed=7)  # stale
    write_kv(kernel, pair.d_kv, [D_BLOCKS[i // BS] * BS + i % BS for i in range(len(tokens))],
             seed=8)
    stale = block_bytes(pair.d_kv, last)
    tail = slot_bytes(kernel, 5)
    assert 0 < int(tail.sum()) < tail.numel()
    assert all(bool(layer[tail].any()) for layer in stale)  # there is stale KV to keep out

    entry = pair.offload(tokens)

    written = data_file(pair.root, entry).read_bytes()
    layer_bytes = tail.numel()
    last_in_file = torch.frombuffer(bytearray(written[2 * 2 * layer_bytes:]), dtype=torch.uint8)
    for li in range(len(LAYERS)):
        in_file = last_in_file[li * layer_bytes:(li + 1) * layer_bytes]
        assert not bool(in_file[tail].any())  # zeros past the tokens
        assert torch.equal(in_file[~tail], stale[li][~tail])  # the 5 tokens as decode has them
    assert [torch.equal(a, b) for a, b in zip(block_bytes(pair.d_kv, last), stale,
                                               strict=True)] == [True, True]  # decode untouched

    n, load = pair.resume("p-1", [*tokens, 99], entry)
    assert n == len(tokens)
    assert load is not None
    assert load.local_blocks == (9, 3, 10)
    assert pair.p_worker.invalid == set()
    for li, (restored, original) in enumerate(zip(block_bytes(pair.p_kv, 10), stale,
                                                  strict=True)):
        assert torch.equal(restored[~tail], original[~tail]), li
        assert not bool(restored[tail].any()), li
    for d_block, p_block in ((D_BLOCKS[0], 9), (D_BLOCKS[1], 3)):
        assert [torch.equal(a, b) for a, b in zip(block_bytes(pair.d_kv, d_block),
                                                   block_bytes(pair.p_kv, p_block),
                                                   strict=True)] == [True, True]


@pytest.mark.slow  # imports vLLM for its CPU kernel (~8 s)
def test_the_kernel_keeps_keys_transposed_which_is_why_the_tier_asks_it_where_slots_are(
    kernel: Kernel,
) -> None:
    """Zeroing rows ``n..`` of the ``[heads, block_size, 2 * head_size]`` shape would wipe valid
    keys and keep stale ones: the CPU kernels store a head's keys as ``[head_size, block]``."""
    tail = slot_bytes(kernel, 5).reshape(HEADS, 2, BS, HEAD_SIZE * 2)  # bf16: 2 bytes each
    naive = torch.zeros_like(tail)
    naive[:, :, 5:, :] = True
    assert not torch.equal(tail, naive)
    assert bool(tail[:, 1, 5:, :].all())  # values: one row per slot
    assert not bool(tail[:, 1, :5, :].any())


# --- what the engine thread does, and what it never serves -----------------------------------


def test_a_corrupted_block_passes_the_lookup_but_the_worker_reports_it_and_never_serves_it(
    pair: Pair,
) -> None:
    random_kv(pair.d_kv, seed=2)
    entry = pair.offload()
    path = data_file(pair.root, entry)
    data = bytearray(path.read_bytes())
    block = len(data) // 3
    data[block + 100] ^= 0xFF  # file block 1
    path.write_bytes(bytes(data))

    n, load = pair.resume("p-1", [*TOKENS, 1], entry)
    assert n == len(TOKENS)  # the cheap lookup reads no data
    assert load is not None
    assert pair.p_worker.invalid == {3, 10}  # block 1 and everything after it: recomputed
    assert pair.p_worker.done == {"p-1"}
    assert [torch.equal(a, b) for a, b in zip(block_bytes(pair.d_kv, D_BLOCKS[0]),
                                               block_bytes(pair.p_kv, 9),
                                               strict=True)] == [True, True]
    assert pair.p.finished("p-1") == TierLoadReport(tokens=BS, reason="load_failed")


def test_repeated_lookups_of_a_waiting_request_parse_the_manifest_once_and_read_no_data(
    pair: Pair,
) -> None:
    random_kv(pair.d_kv, seed=3)
    entry = pair.offload()
    waiting = request("p-1", [*TOKENS, 1], computed=0)
    ref = TierRef(id=entry, n_tokens=len(TOKENS))
    assert pair.p.lookup(waiting, ref, 0) == len(TOKENS)
    # Behind the engine's back: the manifest no longer parses (a re-read would drop the entry).
    (pair.root / f"{entry}.json").write_text(json.dumps({"v": 0}))
    for _ in range(5):  # the request waits for memory: vLLM asks every step
        assert pair.p.lookup(waiting, ref, 0) == len(TOKENS)
    assert pair.p.finished("p-1") == TierLoadReport(tokens=len(TOKENS), reason="ok")
    # The request is gone and so is its manifest: a new one reads the (broken) file.
    assert pair.p.lookup(request("p-2", [*TOKENS, 1], computed=0), ref, 0) == 0
    assert pair.p.finished("p-2") == TierLoadReport(tokens=0, reason="missing")


@pytest.mark.parametrize("k", [0, 5, BS, 2 * BS + 3])
def test_a_token_mismatch_at_k_serves_only_the_prefix_up_to_the_block_holding_k(
    pair: Pair, k: int
) -> None:
    random_kv(pair.d_kv, seed=4)
    entry = pair.offload()
    prompt = [*TOKENS, 1, 2]
    prompt[k] = -1
    n, load = pair.resume("p-1", prompt, entry)
    assert n == k
    if k:
        assert load is not None
        assert load.file_blocks == tuple(range(-(-k // BS)))
    else:
        assert load is None
    assert pair.p.finished("p-1") == TierLoadReport(tokens=k, reason="tokens")


@pytest.mark.parametrize("other", ["salt", "lora", "fingerprint"])
def test_another_salt_adapter_or_model_gets_nothing(tmp_path: Path, other: str) -> None:
    pair = Pair(tmp_path / "tier")
    random_kv(pair.d_kv, seed=5)
    entry = pair.offload(salt="tenant-a")
    if other == "fingerprint":
        pair.p = scheduler(pair.root, weights="weights-hash-2")
    salt = "tenant-b" if other == "salt" else "tenant-a"
    lora = SimpleNamespace(lora_path="/adapters/a", lora_int_id=1) if other == "lora" else None
    assert pair.resume("p-1", [*TOKENS, 1], entry, salt=salt, lora=lora) == (0, None)
    assert pair.p.finished("p-1") == TierLoadReport(tokens=0, reason=other)
    assert pair.resume("p-2", [*TOKENS, 1], entry, salt="tenant-a")[0] == (
        0 if other == "fingerprint" else len(TOKENS))


def test_plans_of_requests_that_finish_without_blocks_do_not_leak(pair: Pair) -> None:
    """Aborted while waiting: vLLM calls ``request_finished`` but never ``after_alloc``."""
    random_kv(pair.d_kv, seed=6)
    entry = pair.offload()
    ref = TierRef(id=entry, n_tokens=len(TOKENS))
    for i in range(200):
        assert pair.p.lookup(request(f"p-{i}", [*TOKENS, i], computed=0), ref, 0) == len(TOKENS)
    assert len(pair.p._plans) == 200
    for i in range(200):
        pair.p.finished(f"p-{i}")
    state = (pair.p._plans, pair.p._manifests, pair.p._reports, pair.p._loads,
             pair.p._inflight)
    assert state == ({}, {}, {}, {}, {})
    assert pair.p.take_outcomes() == {"ok": 200}
    assert pair.p.take_outcomes() == {}


def test_a_load_is_forgotten_once_received_and_a_local_hit_reports_cached(pair: Pair) -> None:
    random_kv(pair.d_kv, seed=7)
    entry = pair.offload()
    n, _ = pair.resume("p-1", [*TOKENS, 1], entry)
    assert n == len(TOKENS)
    assert (pair.p._plans, pair.p._manifests, pair.p._inflight) == ({}, {}, {})
    assert pair.p.finished("p-1") == TierLoadReport(tokens=len(TOKENS), reason="ok")
    # Prefill's own cache already holds the whole entry: nothing to load, no shortfall.
    local = request("p-2", [*TOKENS, 1], computed=len(TOKENS))
    assert pair.p.lookup(local, TierRef(id=entry, n_tokens=len(TOKENS)), len(TOKENS)) == 0
    report = pair.p.finished("p-2")
    assert report == TierLoadReport(tokens=len(TOKENS), reason="cached")
    assert not report.short


def test_a_kv_layout_the_tier_cannot_address_by_block_is_refused() -> None:
    with pytest.raises(RuntimeError, match="not supported"):
        KVLayout({"a": torch.zeros(NUM_BLOCKS, BS, 2 * HEAD_SIZE)}, num_blocks=NUM_BLOCKS)


# --- where the reason goes: prefill's answer, the SDK, the metric ----------------------------

P_ANSWER = {
    "usage": {"prompt_tokens": 60, "prompt_tokens_details": {"cached_tokens": 16}},
    "kv_transfer_params": {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [[1, 2, 3, 4]],
        "remote_engine_id": "prefill-engine",
        "remote_request_id": "chatcmpl-1",
        "remote_host": "10.0.0.1",
        "remote_port": 5600,
        "remote_num_tokens": 60,
    },
}


def test_prefill_answer_carries_the_report_to_the_sdk_and_not_on_to_decode() -> None:
    report = TierLoadReport(tokens=16, reason="load_failed")
    answer = {**P_ANSWER, "kv_transfer_params": with_tier_load(
        P_ANSWER["kv_transfer_params"], report)}
    prefill = parse_prefill(answer, url="http://p/v1/chat/completions")
    assert prefill.tier_load == report
    assert report.short
    assert "token 16" in report.describe()
    body = json.loads(decode_body(TurnRequest(model="m", messages=[], num_messages=0,
                                              max_tokens=4), prompt_ids=[1, 2],
                                  prefill=prefill, stream=False))
    assert HINTS_KEY not in body["kv_transfer_params"]
    assert parse_prefill(P_ANSWER, url="http://p").tier_load is None


def test_a_malformed_report_costs_the_report_not_the_turn() -> None:
    params = {**P_ANSWER["kv_transfer_params"],
              HINTS_KEY: {"v": 1, "tier_load": {"tokens": -1, "reason": "ok"}}}
    assert parse_prefill({**P_ANSWER, "kv_transfer_params": params}, url="u").tier_load is None


def test_the_metric_counts_finished_tier_requests_by_reason() -> None:
    registry = CollectorRegistry()
    metric = TierLookupMetric(functools.partial(Counter, registry=registry),
                              ["model_name", "engine"], {0: ["m", "0"]})
    metric.observe({TIER_STATS_KEY: tier_reasons({"ok": 2, "load_failed": 1})})
    metric.observe({"transfer_duration": []})  # a step without tier outcomes
    metric.observe({TIER_STATS_KEY: ["ok"]})
    value = functools.partial(registry.get_sample_value, f"{METRIC_NAME}_total")
    assert value({"model_name": "m", "engine": "0", "reason": "ok"}) == 3
    assert value({"model_name": "m", "engine": "0", "reason": "load_failed"}) == 1
