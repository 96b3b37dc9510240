"""What a tier entry is bound to, and who may remove it: the exact weights and KV layout, the
LoRA adapter's identity, a TTL, and the secret only the offloading client learns.

``TierScheduler`` runs here on stub vLLM configs (the attributes ``fingerprint`` reads, and a
``compute_hash`` standing for ``ModelConfig.compute_hash``, which covers the model, revision,
quantization, dtype and the Hugging Face config after ``hf_overrides``) and a stub executor
that writes the data files as the workers do.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from agentkv._wire.hints import LeaseRef
from agentkv._wire.tier import OffloadResult
from agentkv.connector._tier import (
    DEFAULT_TIER_MAX_TTL_S,
    DEFAULT_TIER_TTL_S,
    SWEEP_EVERY_S,
    TierConfig,
    TierScheduler,
    _lora_name,
    fingerprint,
    tier_config,
    worker_write_poll,
    worker_write_start,
)
from agentkv.connector._tier_store import TierStore, block_checksum, salt_digest, secret_digest

BS = 4  # tokens per block
BB = 8  # bytes per block and rank
TOKENS = tuple(range(10))


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def model_config(**fields: Any) -> SimpleNamespace:
    """A ``ModelConfig`` stand-in whose ``compute_hash`` covers what vLLM's does."""
    hashed = {"model": "org/m", "revision": None, "quantization": None, "hf_overrides": {},
              "dtype": "bfloat16", "max_model_len": 8192, **fields}
    digest = hashlib.sha256(json.dumps(hashed, sort_keys=True).encode()).hexdigest()
    return SimpleNamespace(
        **hashed,
        compute_hash=lambda: digest,
        get_num_layers=lambda parallel: 2,
        get_num_kv_heads=lambda parallel: 1,
        get_head_size=lambda: 2,
    )


def vllm_config(*, kv_role: str = "kv_consumer", cache_dtype: str = "auto",
                **model_fields: Any) -> SimpleNamespace:
    return SimpleNamespace(
        model_config=model_config(**model_fields),
        cache_config=SimpleNamespace(cache_dtype=cache_dtype, block_size=BS),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
        kv_transfer_config=SimpleNamespace(kv_role=kv_role, kv_port=14579 if kv_role else 0),
    )


def lora(name: str, path: str, int_id: int = 1) -> SimpleNamespace:
    return SimpleNamespace(lora_name=name, lora_int_id=int_id, lora_path=path)


def request(*, salt: str | None = None, adapter: SimpleNamespace | None = None,
            request_id: str = "req-1") -> SimpleNamespace:
    return SimpleNamespace(request_id=request_id, num_computed_tokens=len(TOKENS),
                           all_token_ids=list(TOKENS), prompt_token_ids=list(TOKENS),
                           cache_salt=salt, lora_request=adapter)


def scheduler(root: Path, clock: Clock, config: Any = None, **tier: Any) -> TierScheduler:
    return TierScheduler(config=TierConfig(dir=str(root), **tier),
                         vllm_config=config or vllm_config(), clock=clock)


def run_on_workers(store: TierStore) -> Any:
    """The executor's ``collective_rpc``: rank 0 writes its ``*.tmp`` data file, 0600, when the
    write starts, and reports it done at the first poll."""
    written: dict[str, list[str]] = {}

    def run(function: Any, *, args: tuple[Any, ...]) -> list[dict[str, Any]]:
        if function is worker_write_poll:
            return [{"rank": 0, "block_bytes": BB, "state": "done",
                     "checksums": written.pop(args[0])}]
        assert function is worker_write_start
        entry, blocks = args[0], args[2]
        data = [bytes([b % 256] * BB) for b in range(len(blocks))]
        path = store.tmp(store.data_path(entry, 0))
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(b"".join(data))
        written[entry] = [block_checksum(d) for d in data]
        return [{"rank": 0}]

    return run


def offload(tier: TierScheduler, req: SimpleNamespace | None = None,
            ttl_s: float | None = None) -> OffloadResult:
    req = req or request()
    tier.record(req)
    ref = LeaseRef(request_id=req.request_id, block_ids=((0, 1, 2),), lease="s3cret")
    run = run_on_workers(tier.store)
    started = tier.offload(ref, ref.block_ids, run, ttl_s=ttl_s)
    assert started["status"] == "pending", started
    answer = tier.offload_poll(str(started["entry"]), run)
    assert answer["status"] == "ok", answer
    return OffloadResult.from_wire(answer)


def match_reason(tier: TierScheduler, entry: str, *, salt: str | None = None,
                 lora_id: str | None = None, fp: Any = None) -> tuple[int, str] | None:
    match = tier.store.match(entry, token_ids=[*TOKENS, 99], cache_salt=salt, lora=lora_id,
                             fingerprint=fp or tier.fingerprint, limit=len(TOKENS))
    return None if match is None else (match.n_tokens, match.reason)


@pytest.fixture
def clock() -> Clock:
    return Clock()


# --- bound to the exact weights and layout ----------------------------------------------------


@pytest.mark.parametrize("change", [
    {"revision": "v2"},
    {"quantization": "fp8"},
    {"hf_overrides": {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}},
    {"cache_dtype": "fp8_e4m3"},
    {"dtype": "float16"},
])
def test_another_revision_quantization_override_or_dtype_changes_the_fingerprint(
    change: dict[str, Any]
) -> None:
    """A server restarted under the same model name with other weights must not match."""
    assert fingerprint(vllm_config(**change)) != fingerprint(vllm_config())


def test_prefill_and_decode_of_one_pair_agree_on_the_fingerprint() -> None:
    """They differ in the KV transfer config (role, ports), which does not change KV bytes."""
    assert fingerprint(vllm_config(kv_role="kv_producer")) == fingerprint(vllm_config())


def test_an_entry_written_under_one_revision_is_refused_under_another(
    tmp_path: Path, clock: Clock
) -> None:
    tier = scheduler(tmp_path, clock)
    entry = offload(tier).ref.id
    assert match_reason(tier, entry) == (len(TOKENS), "complete")
    for other in ({"revision": "v2"}, {"quantization": "awq"}, {"hf_overrides": {"x": 1}}):
        restarted = scheduler(tmp_path, clock, vllm_config(**other))
        assert match_reason(restarted, entry) == (0, "fingerprint")
    assert match_reason(tier, entry) == (len(TOKENS), "complete")  # refused, never removed


def test_an_entry_written_under_another_attention_layout_is_refused(
    tmp_path: Path, clock: Clock
) -> None:
    """The CPU backend's kernels order a block's bytes per ISA (AMX, AVX-512, NEON), chosen by
    the host's CPU: a tier directory shared by two hosts must not mix them."""
    tier = scheduler(tmp_path, clock)
    assert tier.fingerprint["attn_layout"].startswith("cpu:")
    entry = offload(tier).ref.id
    elsewhere = scheduler(tmp_path, clock)
    elsewhere.fingerprint = {**elsewhere.fingerprint, "attn_layout": "cpu:amx-elsewhere"}
    assert match_reason(elsewhere, entry) == (0, "fingerprint")


def test_the_lora_identity_is_its_path_not_its_name(tmp_path: Path, clock: Clock) -> None:
    adapter = lora("support-bot", "/adapters/support-v1")
    assert _lora_name(request(adapter=adapter)) == "path:/adapters/support-v1"
    renamed = lora("renamed", "/adapters/support-v1", int_id=7)
    assert _lora_name(request(adapter=renamed)) == _lora_name(request(adapter=adapter))
    retrained = lora("support-bot", "/adapters/support-v2")
    assert _lora_name(request(adapter=retrained)) != _lora_name(request(adapter=adapter))
    assert _lora_name(request()) is None

    tier = scheduler(tmp_path, clock)
    entry = offload(tier, request(adapter=adapter)).ref.id
    manifest = tier.store.manifest(entry)
    assert manifest is not None
    assert manifest.lora == "path:/adapters/support-v1"
    assert match_reason(tier, entry, lora_id=_lora_name(request(adapter=retrained))) == (
        0, "lora")


# --- private ------------------------------------------------------------------------------------


def test_the_manifest_holds_digests_of_the_salt_and_the_secret_and_is_0600(
    tmp_path: Path, clock: Clock
) -> None:
    root = tmp_path / "tier"
    tier = scheduler(root, clock)
    result = offload(tier, request(salt="tenant-a-salt"))
    secret = result.ref.secret
    assert secret is not None
    path = tier.store.manifest_path(result.ref.id)
    raw = path.read_text()
    assert "tenant-a-salt" not in raw
    assert secret not in raw
    saved = json.loads(raw)
    assert saved["salt_digest"] == salt_digest("tenant-a-salt")
    assert saved["secret_digest"] == secret_digest(secret)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    assert match_reason(tier, result.ref.id, salt="tenant-b-salt") == (0, "salt")
    assert match_reason(tier, result.ref.id, salt="tenant-a-salt") == (len(TOKENS), "complete")


def test_every_offload_mints_its_own_secret(tmp_path: Path, clock: Clock) -> None:
    tier = scheduler(tmp_path, clock)
    first = offload(tier, request(request_id="a")).ref
    second = offload(tier, request(request_id="b")).ref
    assert first.secret is not None
    assert second.secret is not None
    assert first.secret != second.secret


def test_delete_needs_the_secret_and_a_wrong_one_answers_as_a_missing_entry(
    tmp_path: Path, clock: Clock
) -> None:
    tier = scheduler(tmp_path, clock)
    ref = offload(tier).ref
    wrong = tier.delete({"id": ref.id, "secret": "someone-elses-guess"})
    missing = tier.delete({"id": "f" * 32, "secret": ref.secret})
    assert wrong == missing == {"status": "unknown", "message": "no such tier entry, or not yours"}
    assert tier.delete({"id": ref.id})["status"] == "invalid"  # no secret at all
    assert tier.store.manifest(ref.id) is not None
    assert tier.delete({"id": ref.id, "secret": ref.secret}) == {"status": "ok", "deleted": True}
    assert list(tmp_path.iterdir()) == []
    assert tier.delete({"id": ref.id, "secret": ref.secret})["status"] == "unknown"


# --- TTL ------------------------------------------------------------------------------------------


def test_the_ttl_is_the_server_default_or_the_one_asked_for_capped(
    tmp_path: Path, clock: Clock
) -> None:
    tier = scheduler(tmp_path, clock, ttl_s=600.0, max_ttl_s=3600.0)
    assert offload(tier, request(request_id="a")).ttl_s == 600.0
    assert offload(tier, request(request_id="b"), ttl_s=60.0).ttl_s == 60.0
    capped = offload(tier, request(request_id="c"), ttl_s=1e9)
    assert capped.ttl_s == 3600.0
    manifest = tier.store.manifest(capped.ref.id)
    assert manifest is not None
    assert manifest.expires == clock.now + 3600.0


def test_an_expired_entry_is_refused_then_swept_on_the_scheduler_s_timer(
    tmp_path: Path, clock: Clock
) -> None:
    tier = scheduler(tmp_path, clock)
    ref = offload(tier, ttl_s=30.0).ref
    clock.now += 30.0
    assert match_reason(tier, ref.id) == (0, "expired")
    assert tier.store.manifest(ref.id) is not None  # refused, not yet swept
    clock.now += SWEEP_EVERY_S
    tier.take_loads()  # every engine step: sweeps when the last sweep is old enough
    assert list(tmp_path.iterdir()) == []


def test_the_start_up_sweep_removes_expired_entries(tmp_path: Path, clock: Clock) -> None:
    ref = offload(scheduler(tmp_path, clock), ttl_s=30.0).ref
    clock.now += 31.0
    scheduler(tmp_path, clock)  # a restart
    assert not any(p.name.startswith(ref.id) for p in tmp_path.iterdir())


class Extra:
    def __init__(self, **values: Any) -> None:
        self.values = values

    def get_from_extra_config(self, key: str, default: Any) -> Any:
        return self.values.get(key, default)


def test_the_tier_settings_come_from_the_connector_s_extra_config() -> None:
    assert tier_config(Extra()) == TierConfig(dir=None)
    config = tier_config(Extra(agentkv_tier_dir="/t", agentkv_tier_ttl_s=60,
                               agentkv_tier_max_ttl_s=120))
    assert (config.dir, config.ttl_s, config.max_ttl_s) == ("/t", 60.0, 120.0)
    assert (TierConfig(dir="/t").ttl_s, TierConfig(dir="/t").max_ttl_s) == (
        DEFAULT_TIER_TTL_S, DEFAULT_TIER_MAX_TTL_S)
    for bad in ({"agentkv_tier_ttl_s": 0}, {"agentkv_tier_ttl_s": 10, "agentkv_tier_max_ttl_s": 5},
                {"agentkv_tier_budget_bytes": 0}, {"agentkv_tier_max_ttl_s": float("inf")}):
        with pytest.raises(ValueError, match="agentkv_tier_"):
            tier_config(Extra(agentkv_tier_dir="/t", **bad))


def test_the_worker_creates_a_missing_root_0700(tmp_path: Path) -> None:
    """The worker may create the root before the scheduler does (it starts first)."""
    torch = pytest.importorskip("torch")
    from agentkv.connector._tier import TierWorker

    root = tmp_path / "new" / "tier"
    TierWorker(root=str(root), kv_caches={"l0": torch.zeros(4, 1, BS, 4)}, num_blocks=4, rank=0)
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
