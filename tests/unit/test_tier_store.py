"""The KV file tier's store: commit, prefix matching, checksums, budget/LRU, sweep, path safety,
private files, salt digests, expiry and the delete secret."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from agentkv._wire.hints import HintError, LeaseRef, ServerInfo
from agentkv._wire.tier import (
    OffloadRequest,
    OffloadResult,
    TierDelete,
    TierRef,
    TierUsage,
    with_tier,
)
from agentkv.connector._tier_store import (
    Manifest,
    TierError,
    TierStore,
    block_checksum,
    salt_digest,
    secret_digest,
)

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


SECRET = "the-entry-secret-0123"
TTL_S = 3600.0


def _offload(store: TierStore, tokens: list[int], *, salt: str | None = None,
             ranks: int = 1, ttl_s: float = TTL_S) -> Manifest:
    """What the connector does: workers write ``*.tmp`` data files, then the store commits."""
    entry = store.new_id()
    n_blocks = -(-len(tokens) // BS)
    checksums = []
    for rank in range(ranks):
        blocks = [bytes([rank * 16 + b] * BB) for b in range(n_blocks)]
        store.tmp(store.data_path(entry, rank)).write_bytes(b"".join(blocks))
        checksums.append(tuple(block_checksum(b) for b in blocks))
    now = store._clock()
    manifest = Manifest(id=entry, fingerprint=FP, token_ids=tuple(tokens),
                        salt_digest=salt_digest(salt), lora=None, block_size=BS, block_bytes=BB,
                        checksums=tuple(checksums), created=now, expires=now + ttl_s,
                        secret_digest=secret_digest(SECRET))
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
    m = _offload(store, list(range(10)))
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{m.id}.json", f"{m.id}.r0.kv"]
    assert _match(store, m.id, [*range(10), 99, 98]) == 10


def test_only_the_matching_prefix_is_served_and_never_the_whole_prompt(
    tmp_path: Path, clock: Clock
) -> None:
    store = _store(tmp_path, clock)
    m = _offload(store, list(range(10)))
    assert _match(store, m.id, [0, 1, 2, 3, 4, 5, 77, 7, 8, 9, 10]) == 6
    assert _match(store, m.id, list(range(10))) == 9  # vLLM must compute one token
    assert _match(store, m.id, [5, 5, 5]) == 0


def test_another_salt_model_or_adapter_gets_nothing(tmp_path: Path, clock: Clock) -> None:
    store = _store(tmp_path, clock)
    m = _offload(store, list(range(10)), salt="alice")
    assert _match(store, m.id, list(range(12)), salt="bob") == 0
    assert _match(store, m.id, list(range(12)), salt="alice") == 10
    other = store.match(m.id, token_ids=list(range(12)), cache_salt="alice", lora=None,
                        fingerprint={**FP, "dtype": "float32"}, limit=11)
    assert other is not None
    assert other.n_tokens == 0


def test_a_flipped_byte_cuts_the_prefix_at_its_block(tmp_path: Path, clock: Clock) -> None:
    store = _store(tmp_path, clock)
    m = _offload(store, list(range(10)))  # blocks 0, 1, 2 (partial)
    data = store.data_path(m.id, 0)
    raw = bytearray(data.read_bytes())
    raw[BB + 3] ^= 0xFF  # block 1
    data.write_bytes(bytes(raw))
    assert _match(store, m.id, list(range(12))) == BS


def test_a_truncated_file_serves_only_its_whole_intact_blocks(
    tmp_path: Path, clock: Clock
) -> None:
    store = _store(tmp_path, clock)
    m = _offload(store, list(range(10)))
    os.truncate(store.data_path(m.id, 0), 2 * BB - 1)
    assert _match(store, m.id, list(range(12))) == BS


def test_blocks_before_first_block_are_not_reread(tmp_path: Path, clock: Clock) -> None:
    store = _store(tmp_path, clock)
    m = _offload(store, list(range(10)))
    data = store.data_path(m.id, 0)
    raw = bytearray(data.read_bytes())
    raw[0] ^= 0xFF  # block 0, which the request already holds locally
    data.write_bytes(bytes(raw))
    assert _match(store, m.id, list(range(12)), first_block=1) == 10


def test_every_rank_must_be_intact(tmp_path: Path, clock: Clock) -> None:
    store = _store(tmp_path, clock)
    m = _offload(store, list(range(10)), ranks=2)
    os.truncate(store.data_path(m.id, 1), BB)
    assert _match(store, m.id, list(range(12))) == BS


def test_a_corrupt_manifest_is_a_miss_and_is_removed(tmp_path: Path, clock: Clock) -> None:
    store = _store(tmp_path, clock)
    m = _offload(store, list(range(10)))
    store.manifest_path(m.id).write_text("{not json")
    assert _match(store, m.id, list(range(12))) == -1
    assert list(tmp_path.iterdir()) == []


def test_the_budget_evicts_the_least_recently_used_entry(tmp_path: Path, clock: Clock) -> None:
    store = _store(tmp_path, clock, budget=10_000)
    a = _offload(store, list(range(10)))
    one = store.usage().bytes
    store.budget_bytes = 2 * one + one // 2
    clock.now += 10
    b = _offload(store, list(range(10)))
    clock.now += 10
    assert _match(store, a.id, list(range(12))) == 10  # a read refreshes a
    clock.now += 10
    c = _offload(store, list(range(10)))
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
    m = _offload(store, list(range(10)), ranks=2)
    assert store.delete(m.id) is True
    assert list(tmp_path.iterdir()) == []
    assert store.delete(m.id) is False


def test_the_sweep_removes_tmp_files_orphans_and_incomplete_entries(
    tmp_path: Path, clock: Clock
) -> None:
    store = _store(tmp_path, clock)
    good = _offload(store, list(range(10)))
    orphan_data = store.data_path("f" * 32, 0)
    orphan_data.write_bytes(b"x" * BB)
    lonely = _offload(store, list(range(6)))
    store.data_path(lonely.id, 0).unlink()  # manifest without data
    short = _offload(store, list(range(6)))
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
        _offload(store, list(range(10)))
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
        TierDelete.from_wire({"id": bad, "secret": SECRET})
    with pytest.raises(HintError):
        TierRef.from_wire({"id": bad, "n_tokens": 1})


def test_manifest_round_trips(tmp_path: Path, clock: Clock) -> None:
    store = _store(tmp_path, clock)
    m = _offload(store, list(range(10)), salt="s")
    assert Manifest.from_json(json.loads(store.manifest_path(m.id).read_text())) == m


def test_the_tier_wire_values_round_trip() -> None:
    ref = TierRef(id="ab" * 16, n_tokens=1101)
    params = with_tier({"do_remote_decode": True}, ref)
    assert params["agentkv"] == {"v": 1, "tier": {"id": "ab" * 16, "n_tokens": 1101}}
    assert TierRef.from_params(params) == ref
    assert TierRef.from_params({"agentkv": {"v": 1, "persist": True}}) is None
    assert TierRef.from_params(None) is None
    result = OffloadResult(ref=ref, bytes=5)
    assert result.to_wire() == {"tier": {"v": 1, "id": "ab" * 16, "n_tokens": 1101, "bytes": 5}}
    assert OffloadResult.from_wire(result.to_wire()) == result
    usage = TierUsage(bytes=1, entries=1, budget_bytes=2, dir="/t")
    info = ServerInfo(leases=True, stream_handles=True, tier=usage.to_wire())
    assert TierUsage.from_wire(ServerInfo.from_wire(info.to_wire()).tier) == usage
    with pytest.raises(HintError):
        TierRef.from_params({"agentkv": {"v": 2, "tier": ref.to_wire()}})


# --- private entries: modes, salt digest, expiry, the delete secret ---------------------------


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_new_root_is_0700_and_manifests_are_0600(tmp_path: Path, clock: Clock) -> None:
    """Entries hold other sessions' tokens and KV: nobody but the server's user reads them."""
    root = tmp_path / "a" / "tier"
    store = _store(root, clock)
    m = _offload(store, list(range(10)))
    assert _mode(root) == 0o700
    assert _mode(store.manifest_path(m.id)) == 0o600


def test_an_existing_root_keeps_its_mode(tmp_path: Path, clock: Clock) -> None:
    """A root the operator made (it may be shared) is not chmod-ed, only logged."""
    root = tmp_path / "shared"
    root.mkdir(mode=0o755)
    os.chmod(root, 0o755)
    _store(root, clock)
    assert _mode(root) == 0o755


def test_the_manifest_keeps_a_digest_of_the_salt_never_the_salt(
    tmp_path: Path, clock: Clock
) -> None:
    store = _store(tmp_path, clock)
    m = _offload(store, list(range(10)), salt="alice-tenant-salt")
    raw = store.manifest_path(m.id).read_text()
    assert "alice-tenant-salt" not in raw
    assert json.loads(raw)["salt_digest"] == salt_digest("alice-tenant-salt")
    assert SECRET not in raw
    assert _match(store, m.id, list(range(12)), salt="alice-tenant-salt") == 10
    assert _match(store, m.id, list(range(12)), salt="bob") == 0
    assert _match(store, m.id, list(range(12))) == 0  # no salt is not any salt


def test_no_salt_and_the_empty_salt_have_distinct_digests() -> None:
    assert salt_digest(None) != salt_digest("")
    assert salt_digest("a") != secret_digest("a")  # domain-separated


def test_an_expired_entry_is_refused_and_the_sweep_removes_it(
    tmp_path: Path, clock: Clock
) -> None:
    store = _store(tmp_path, clock)
    short = _offload(store, list(range(10)), ttl_s=60)
    long = _offload(store, list(range(10)), ttl_s=600)
    assert _match(store, short.id, list(range(12))) == 10
    clock.now += 60
    match = store.match(short.id, token_ids=list(range(12)), cache_salt=None, lora=None,
                        fingerprint=FP, limit=11)
    assert match is not None
    assert (match.n_tokens, match.reason) == (0, "expired")
    store.sweep(tmp_grace_s=120)  # expired entries go whatever their files' age
    assert store.manifest(short.id) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f"{long.id}.json", f"{long.id}.r0.kv"])
    assert _match(store, long.id, list(range(12))) == 10


def test_delete_needs_the_entry_s_secret(tmp_path: Path, clock: Clock) -> None:
    store = _store(tmp_path, clock)
    m = _offload(store, list(range(10)))
    assert store.delete_owned(m.id, "not-the-secret-at-all") is False
    assert store.manifest(m.id) is not None
    assert store.delete_owned("f" * 32, SECRET) is False  # missing: the same answer
    assert store.delete_owned(m.id, SECRET) is True
    assert list(tmp_path.iterdir()) == []


def test_a_version_1_manifest_is_never_served_and_is_swept(tmp_path: Path, clock: Clock) -> None:
    """Entries of the previous format (raw salt, no expiry, no secret) are unreadable."""
    store = _store(tmp_path, clock)
    m = _offload(store, list(range(10)))
    old = json.loads(store.manifest_path(m.id).read_text())
    old["v"] = 1
    old["cache_salt"] = None
    for key in ("salt_digest", "expires", "secret_digest"):
        del old[key]
    store.manifest_path(m.id).write_text(json.dumps(old))
    store.sweep()
    assert list(tmp_path.iterdir()) == []
    assert _match(store, m.id, list(range(12))) == -1


def test_the_secret_and_the_ttl_travel_to_the_owner_only() -> None:
    """The offload answer carries the secret; the P leg's reference never does; repr hides it."""
    ref = TierRef(id="ab" * 16, n_tokens=7, secret=SECRET)
    answer = OffloadResult(ref=ref, bytes=5, ttl_s=600.0).to_wire()
    assert answer["tier"]["secret"] == SECRET
    assert answer["tier"]["ttl_s"] == 600.0
    parsed = OffloadResult.from_wire(answer)
    assert (parsed.ref.secret, parsed.ttl_s) == (SECRET, 600.0)
    assert "secret" not in with_tier({}, ref)["agentkv"]["tier"]
    assert SECRET not in repr(ref)
    assert SECRET not in repr(TierDelete(id=ref.id, secret=SECRET))
    assert TierRef.from_wire(ref.to_wire(with_secret=True)).secret == SECRET


@pytest.mark.parametrize("body", [
    {"id": "ab" * 16},  # no secret
    {"id": "ab" * 16, "secret": ""},
    {"id": "ab" * 16, "secret": "x" * 200},
    {"id": "ab" * 16, "secret": "has spaces in it!"},
])
def test_a_delete_without_a_well_formed_secret_is_invalid(body: dict[str, str]) -> None:
    with pytest.raises(HintError, match="secret"):
        TierDelete.from_wire(body)


def test_a_offload_request_may_ask_for_a_ttl() -> None:
    lease = LeaseRef(request_id="r", block_ids=((1, 2),), lease="s3cret")
    assert OffloadRequest.from_wire(lease.to_wire()) == OffloadRequest(ref=lease)
    asked = OffloadRequest(ref=lease, ttl_s=600)
    assert OffloadRequest.from_wire(asked.to_wire()) == asked
    for bad in (0, -1, float("inf"), True, "600"):
        with pytest.raises(HintError, match="ttl_s"):
            OffloadRequest.from_wire({**lease.to_wire(), "ttl_s": bad})
