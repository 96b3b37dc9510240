"""The KV file tier's store: commit, prefix matching, checksums, budget/LRU, sweep, path safety."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from agentkv._wire.hints import HintError, ServerInfo
from agentkv._wire.tier import PersistResult, TierDelete, TierRef, TierUsage, with_tier
from agentkv.connector._tier_store import Manifest, TierError, TierStore, block_checksum

BS = 4  # tokens per block
BB = 8  # bytes per block and rank
FP = {"model": "m", "dtype": "bfloat16", "layers": 2, "kv_heads": 1, "head_size": 2,
      "block_size": BS, "tp": 1}


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def _ids() -> object:
    n = 0

    def new() -> str:
        nonlocal n
        n += 1
        return f"{n:032x}"

    return new


@pytest.fixture
def clock() -> Clock:
    return Clock()


def _store(root: Path, clock: Clock, budget: int = 10_000) -> TierStore:
    return TierStore(root, budget_bytes=budget, clock=clock, new_id=_ids())  # type: ignore[arg-type]


def _persist(store: TierStore, tokens: list[int], *, salt: str | None = None,
             ranks: int = 1) -> Manifest:
    """What the connector does: workers write ``*.tmp`` data files, then the store commits."""
    entry = store.new_id()
    n_blocks = -(-len(tokens) // BS)
    checksums = []
    for rank in range(ranks):
        blocks = [bytes([rank * 16 + b] * BB) for b in range(n_blocks)]
        store.tmp(store.data_path(entry, rank)).write_bytes(b"".join(blocks))
        checksums.append(tuple(block_checksum(b) for b in blocks))
    manifest = Manifest(id=entry, fingerprint=FP, token_ids=tuple(tokens), cache_salt=salt,
                        lora=None, block_size=BS, block_bytes=BB, checksums=tuple(checksums),
                        created=0.0)
    store.commit(manifest)
    return manifest


def _match(store: TierStore, entry: str, prompt: list[int], *, salt: str | None = None,
           first_block: int = 0) -> int:
    match = store.match(entry, token_ids=prompt, cache_salt=salt, lora=None, fingerprint=FP,
                        limit=len(prompt) - 1, first_block=first_block)
    return -1 if match is None else match.n_tokens


def test_a_committed_entry_serves_the_exact_prefix_of_a_longer_prompt(
    tmp_path: Path, clock: Clock
) -> None:
    store = _store(tmp_path, clock)
    m = _persist(store, list(range(10)))
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{m.id}.json", f"{m.id}.r0.kv"]
    assert _match(store, m.id, [*range(10), 99, 98]) == 10


def test_only_the_matching_prefix_is_served_and_never_the_whole_prompt(
    tmp_path: Path, clock: Clock
) -> None:
    store = _store(tmp_path, clock)
    m = _persist(store, list(range(10)))
    assert _match(store, m.id, [0, 1, 2, 3, 4, 5, 77, 7, 8, 9, 10]) == 6
    assert _match(store, m.id, list(range(10))) == 9  # vLLM must compute one token
    assert _match(store, m.id, [5, 5, 5]) == 0


def test_another_salt_model_or_adapter_gets_nothing(tmp_path: Path, clock: Clock) -> None:
    store = _store(tmp_path, clock)
    m = _persist(store, list(range(10)), salt="alice")
    assert _match(store, m.id, list(range(12)), salt="bob") == 0
    assert _match(store, m.id, list(range(12)), salt="alice") == 10
    other = store.match(m.id, token_ids=list(range(12)), cache_salt="alice", lora=None,
                        fingerprint={**FP, "dtype": "float32"}, limit=11)
    assert other is not None
    assert other.n_tokens == 0


def test_a_flipped_byte_cuts_the_prefix_at_its_block(tmp_path: Path, clock: Clock) -> None:
    store = _store(tmp_path, clock)
    m = _persist(store, list(range(10)))  # blocks 0, 1, 2 (partial)
    data = store.data_path(m.id, 0)
    raw = bytearray(data.read_bytes())
    raw[BB + 3] ^= 0xFF  # block 1
    data.write_bytes(bytes(raw))
    assert _match(store, m.id, list(range(12))) == BS


def test_a_truncated_file_serves_only_its_whole_intact_blocks(
    tmp_path: Path, clock: Clock
) -> None:
    store = _store(tmp_path, clock)
    m = _persist(store, list(range(10)))
    os.truncate(store.data_path(m.id, 0), 2 * BB - 1)
    assert _match(store, m.id, list(range(12))) == BS


def test_blocks_before_first_block_are_not_reread(tmp_path: Path, clock: Clock) -> None:
    store = _store(tmp_path, clock)
    m = _persist(store, list(range(10)))
    data = store.data_path(m.id, 0)
    raw = bytearray(data.read_bytes())
    raw[0] ^= 0xFF  # block 0, which the request already holds locally
    data.write_bytes(bytes(raw))
    assert _match(store, m.id, list(range(12)), first_block=1) == 10


def test_every_rank_must_be_intact(tmp_path: Path, clock: Clock) -> None:
    store = _store(tmp_path, clock)
    m = _persist(store, list(range(10)), ranks=2)
    os.truncate(store.data_path(m.id, 1), BB)
    assert _match(store, m.id, list(range(12))) == BS


def test_a_corrupt_manifest_is_a_miss_and_is_removed(tmp_path: Path, clock: Clock) -> None:
    store = _store(tmp_path, clock)
    m = _persist(store, list(range(10)))
    store.manifest_path(m.id).write_text("{not json")
    assert _match(store, m.id, list(range(12))) == -1
    assert list(tmp_path.iterdir()) == []


def test_the_budget_evicts_the_least_recently_used_entry(tmp_path: Path, clock: Clock) -> None:
    store = _store(tmp_path, clock, budget=10_000)
    a = _persist(store, list(range(10)))
    one = store.usage().bytes
    store.budget_bytes = 2 * one + one // 2
    clock.now += 10
    b = _persist(store, list(range(10)))
    clock.now += 10
    assert _match(store, a.id, list(range(12))) == 10  # a read refreshes a
    clock.now += 10
    c = _persist(store, list(range(10)))
    assert store.manifest(b.id) is None  # b was least recently used
    assert store.manifest(a.id) is not None
    assert store.manifest(c.id) is not None
    usage = store.usage()
    assert usage.entries == 2
    assert usage.bytes <= store.budget_bytes


def test_an_entry_larger_than_the_budget_is_refused(tmp_path: Path, clock: Clock) -> None:
    store = _store(tmp_path, clock, budget=10)
    with pytest.raises(TierError):
        store.check_fits(11)


def test_delete_removes_every_file_of_an_entry(tmp_path: Path, clock: Clock) -> None:
    store = _store(tmp_path, clock)
    m = _persist(store, list(range(10)), ranks=2)
    assert store.delete(m.id) is True
    assert list(tmp_path.iterdir()) == []
    assert store.delete(m.id) is False


def test_the_sweep_removes_tmp_files_orphans_and_incomplete_entries(
    tmp_path: Path, clock: Clock
) -> None:
    store = _store(tmp_path, clock)
    good = _persist(store, list(range(10)))
    orphan_data = store.data_path("f" * 32, 0)
    orphan_data.write_bytes(b"x" * BB)
    lonely = _persist(store, list(range(6)))
    store.data_path(lonely.id, 0).unlink()  # manifest without data
    short = _persist(store, list(range(6)))
    os.truncate(store.data_path(short.id, 0), 1)  # data of the wrong size
    store.tmp(store.data_path("e" * 32, 0)).write_bytes(b"half")
    foreign = tmp_path / "notes.txt"
    foreign.write_text("not ours")
    store.sweep()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f"{good.id}.json", f"{good.id}.r0.kv", "notes.txt"])


def test_the_sweep_spares_young_tmp_files_of_a_peer_server(tmp_path: Path, clock: Clock) -> None:
    store = _store(tmp_path, clock)
    young = store.tmp(store.data_path("e" * 32, 0))
    young.write_bytes(b"half")
    os.utime(young, (clock.now - 5, clock.now - 5))
    store.sweep(tmp_grace_s=60)
    assert young.exists()
    clock.now += 120
    store.sweep(tmp_grace_s=60)
    assert not young.exists()


def test_the_sweep_enforces_the_budget(tmp_path: Path, clock: Clock) -> None:
    store = _store(tmp_path, clock)
    for _ in range(3):
        clock.now += 1
        _persist(store, list(range(10)))
    one = store.usage().bytes // 3
    smaller = TierStore(tmp_path, budget_bytes=one + 1, clock=clock)
    smaller.sweep()
    assert smaller.usage().entries == 1


@pytest.mark.parametrize("bad", ["../etc/passwd", "A" * 32, "0" * 31, "/tmp/x", "0" * 32 + "/"])
def test_only_well_formed_ids_name_files(tmp_path: Path, clock: Clock, bad: str) -> None:
    store = _store(tmp_path, clock)
    with pytest.raises(ValueError, match="tier ids"):
        store.data_path(bad, 0)
    with pytest.raises(ValueError, match="tier ids"):
        store.delete(bad)
    with pytest.raises(HintError):
        TierDelete.from_wire({"id": bad})
    with pytest.raises(HintError):
        TierRef.from_wire({"id": bad, "n_tokens": 1})


def test_manifest_round_trips(tmp_path: Path, clock: Clock) -> None:
    store = _store(tmp_path, clock)
    m = _persist(store, list(range(10)), salt="s")
    assert Manifest.from_json(json.loads(store.manifest_path(m.id).read_text())) == m


def test_the_tier_wire_values_round_trip() -> None:
    ref = TierRef(id="ab" * 16, n_tokens=1101)
    params = with_tier({"do_remote_decode": True}, ref)
    assert params["agentkv"] == {"v": 1, "tier": {"id": "ab" * 16, "n_tokens": 1101}}
    assert TierRef.from_params(params) == ref
    assert TierRef.from_params({"agentkv": {"v": 1, "persist": True}}) is None
    assert TierRef.from_params(None) is None
    result = PersistResult(ref=ref, bytes=5)
    assert result.to_wire() == {"tier": {"v": 1, "id": "ab" * 16, "n_tokens": 1101, "bytes": 5}}
    assert PersistResult.from_wire(result.to_wire()) == result
    usage = TierUsage(bytes=1, entries=1, budget_bytes=2, dir="/t")
    info = ServerInfo(leases=True, stream_handles=True, tier=usage.to_wire())
    assert TierUsage.from_wire(ServerInfo.from_wire(info.to_wire()).tier) == usage
    with pytest.raises(HintError):
        TierRef.from_params({"agentkv": {"v": 2, "tier": ref.to_wire()}})
