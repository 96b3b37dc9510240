"""The file tier's budget, shared per salt: no tenant's writes evict another's entries while it
holds more than its fair share (the rule in ``_tier_share``, applied by ``TierStore``)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agentkv.connector._tier_share import Held, evictions, fair_share
from agentkv.connector._tier_store import TierError, TierStore
from tests.unit.test_tier_store import Clock, _ids, _offload


@pytest.fixture
def clock() -> Clock:
    return Clock()


def _store(root: Path, clock: Clock) -> tuple[TierStore, int]:
    """A store whose budget holds four 10-token entries; and one entry's size."""
    store = TierStore(root, budget_bytes=10_000, clock=clock, new_id=_ids())  # type: ignore[arg-type]
    probe = _offload(store, list(range(10)), salt="probe")
    one = store.usage().bytes
    store.delete(probe.id)
    store.budget_bytes = 4 * one
    return store, one


def _alive(store: TierStore, ids: list[str]) -> list[str]:
    return [i for i in ids if store.manifest(i) is not None]


def test_one_salt_filling_the_tier_evicts_only_its_own_entries(
    tmp_path: Path, clock: Clock
) -> None:
    store, _ = _store(tmp_path, clock)
    victim = [_offload(store, list(range(10)), salt="alice").id for _ in range(2)]
    clock.now += 10
    flooder = []
    for _ in range(10):  # far more than the whole budget
        clock.now += 1
        flooder.append(_offload(store, list(range(10)), salt="mallory").id)
    assert _alive(store, victim) == victim  # alice's entries survive
    assert _alive(store, flooder) == flooder[-2:]  # mallory churns through its own half
    assert store.usage().bytes <= store.budget_bytes


def test_a_salt_within_its_share_evicts_the_lru_entry_of_a_salt_over_its_share(
    tmp_path: Path, clock: Clock
) -> None:
    store, _ = _store(tmp_path, clock)
    alone = []
    for _ in range(4):  # a lone tenant may use the whole budget
        clock.now += 1
        alone.append(_offload(store, list(range(10)), salt="alice").id)
    assert _alive(store, alone) == alone
    clock.now += 1
    bob = _offload(store, list(range(10)), salt="bob").id
    assert _alive(store, alone) == alone[1:]  # alice's least recently used went
    assert store.manifest(bob) is not None


def test_an_entry_over_its_salt_s_share_is_refused_and_evicts_nobody(
    tmp_path: Path, clock: Clock
) -> None:
    store, one = _store(tmp_path, clock)
    others = [_offload(store, list(range(10)), salt=s).id for s in ("alice", "bob", "carol")]
    store.budget_bytes = 3 * one + one // 2  # four salts: a share is under one entry
    with pytest.raises(TierError, match="share"):
        _offload(store, list(range(10)), salt="mallory")
    assert _alive(store, others) == others
    assert store.usage().entries == 3
    assert sorted(p.suffix for p in tmp_path.iterdir()) == [".json", ".json", ".json",
                                                            ".kv", ".kv", ".kv"]


def test_the_sweep_evicts_only_salts_over_their_share(tmp_path: Path, clock: Clock) -> None:
    store, one = _store(tmp_path, clock)
    alice = [_offload(store, list(range(10)), salt="alice").id for _ in range(3)]
    clock.now += 1
    bob = _offload(store, list(range(10)), salt="bob").id
    store.budget_bytes = 3 * one  # shrunk (a restart with a smaller budget)
    store.sweep()
    assert store.manifest(bob) is not None  # the least recently used, but within its share
    assert len(_alive(store, alice)) == 2


_HELD = st.lists(
    st.tuples(st.sampled_from("ABCD"), st.integers(1, 40)), min_size=1, max_size=12
)


@given(held=_HELD, budget=st.integers(1, 200))
def test_a_write_evicts_another_salt_only_if_that_salt_was_over_its_share(
    held: list[tuple[str, int]], budget: int
) -> None:
    entries = [Held(id=str(i), salt=s, bytes=b, used=float(i)) for i, (s, b) in enumerate(held)]
    new = entries[-1]
    decision = evictions(entries, budget=budget, keep=new.id)
    left = [e for e in entries if e.id not in decision.evict]
    assert new in left
    share = fair_share(budget, len({e.salt for e in entries}))
    for salt in {e.salt for e in entries} - {new.salt}:
        if any(e.salt == salt and e.id in decision.evict for e in entries):
            assert sum(e.bytes for e in entries if e.salt == salt) > share
    if decision.fits:
        assert sum(e.bytes for e in left) <= budget
    else:  # refused: the writer gave up all it had, and the new entry alone is over its share
        assert [e for e in left if e.salt == new.salt] == [new]
        assert new.bytes > fair_share(budget, len({e.salt for e in left}))


@given(held=_HELD, budget=st.integers(1, 200))
def test_the_sweep_always_fits_the_budget(held: list[tuple[str, int]], budget: int) -> None:
    entries = [Held(id=str(i), salt=s, bytes=b, used=float(i)) for i, (s, b) in enumerate(held)]
    decision = evictions(entries, budget=budget)
    assert decision.fits
    assert sum(e.bytes for e in entries if e.id not in decision.evict) <= budget
