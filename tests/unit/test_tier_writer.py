"""Tier writes off the engine thread (``_tier_writer``): a write runs on the worker's writing
thread, its request's blocks are not freed while it runs, and the scheduler commits only what
every rank finished, aborting what failed or was abandoned."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from agentkv._wire.hints import LeaseRef
from agentkv.connector._tier import (
    TierConfig,
    TierScheduler,
    worker_write_poll,
    worker_write_start,
)
from agentkv.connector._tier_store import block_checksum
from agentkv.connector._tier_writer import RESULT_KEEP_S, WRITER_NICE, BackgroundWrites

BS = 4
BB = 64


class Gate:
    """A write that waits until the test lets it end (or fail)."""

    def __init__(self) -> None:
        self.go = threading.Event()
        self.fail = False

    def __call__(self) -> dict[str, Any]:
        assert self.go.wait(5)
        if self.fail:
            raise OSError("disk full")
        return {"checksums": ["c0"]}


def wait_done(writes: BackgroundWrites, entry: str) -> dict[str, Any]:
    for _ in range(500):
        answer = writes.poll(entry)
        if answer["state"] != "pending":
            return answer
        threading.Event().wait(0.01)
    raise AssertionError("the write never ended")


def test_a_request_finished_while_written_is_held_until_the_write_ends() -> None:
    writes = BackgroundWrites()
    gate = Gate()
    writes.start("e1", "req-1", gate)
    # Its lease lapsed (or a prefill read it) during the write: the scheduler must not free
    # the blocks yet; another request goes through.
    assert writes.hold({"req-1", "req-2"}) == {"req-2"}
    assert writes.hold(set()) == set()
    gate.go.set()
    assert wait_done(writes, "e1") == {"state": "done", "checksums": ["c0"]}
    assert writes.hold(set()) == {"req-1"}  # reported once, now that the write ended
    assert writes.hold(set()) == set()
    writes.shutdown()


def test_a_request_not_finished_during_its_write_is_not_reported_by_it() -> None:
    writes = BackgroundWrites()
    gate = Gate()
    writes.start("e1", "req-1", gate)
    gate.go.set()
    wait_done(writes, "e1")
    assert writes.hold(set()) == set()
    assert writes.hold({"req-1"}) == {"req-1"}  # freed later, as any pin
    writes.shutdown()


def test_a_failed_write_is_reported_once_and_releases_its_hold() -> None:
    writes = BackgroundWrites()
    gate = Gate()
    gate.fail = True
    writes.start("e1", "req-1", gate)
    assert writes.poll("e1") == {"state": "pending"}
    assert writes.hold({"req-1"}) == set()
    gate.go.set()
    answer = wait_done(writes, "e1")
    assert answer["state"] == "failed"
    assert "disk full" in answer["error"]
    assert writes.hold(set()) == {"req-1"}
    assert writes.poll("e1")["state"] == "failed"  # handed out once: now unknown
    second = Gate()
    writes.start("e2", "req-2", second)
    with pytest.raises(ValueError, match="already"):
        writes.start("e2", "req-2", Gate())
    second.go.set()
    writes.shutdown()


# --- the scheduler: start, poll, commit or abort ----------------------------------------------


class Workers:
    """The executor's ``collective_rpc`` over one rank whose writes the test lets end."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.done = False
        self.failed = False
        self.started: list[tuple[Any, ...]] = []

    def __call__(self, function: Any, *, args: tuple[Any, ...]) -> list[dict[str, Any]]:
        if function is worker_write_start:
            entry, _request_id, blocks, _n = args
            self.started.append(args)
            path = self.store.tmp(self.store.data_path(entry, 0))
            path.write_bytes(bytes(BB * len(blocks)))
            return [{"rank": 0}]
        assert function is worker_write_poll
        if self.failed:
            return [{"rank": 0, "block_bytes": BB, "state": "failed", "error": "EIO"}]
        if not self.done:
            return [{"rank": 0, "block_bytes": BB, "state": "pending"}]
        n = len(self.started[-1][2])
        return [{"rank": 0, "block_bytes": BB, "state": "done",
                 "checksums": [block_checksum(bytes(BB))] * n}]


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def tier(root: Path, clock: Clock) -> TierScheduler:
    model = SimpleNamespace(model="org/m", dtype="float32", compute_hash=lambda: "w",
                            get_num_layers=lambda parallel: 1,
                            get_num_kv_heads=lambda parallel: 1, get_head_size=lambda: 2)
    config = SimpleNamespace(
        model_config=model,
        cache_config=SimpleNamespace(block_size=BS, cache_dtype="auto"),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
        kv_transfer_config=SimpleNamespace(kv_role="kv_consumer", kv_port=0),
    )
    scheduler = TierScheduler(config=TierConfig(dir=str(root)), vllm_config=config, clock=clock)
    scheduler.record(SimpleNamespace(request_id="d-1", num_computed_tokens=2 * BS,
                                     all_token_ids=list(range(2 * BS)), cache_salt=None,
                                     lora_request=None))
    return scheduler


REF = LeaseRef(request_id="d-1", block_ids=((3, 7),), lease="s3cret")


def test_offload_returns_while_the_workers_write_and_commits_when_they_are_done(
    tmp_path: Path,
) -> None:
    clock = Clock()
    scheduler = tier(tmp_path, clock)
    workers = Workers(scheduler.store)
    started = scheduler.offload(REF, REF.block_ids, workers)
    assert started["status"] == "pending"
    entry = str(started["entry"])
    assert workers.started == [(entry, "d-1", [3, 7], 2 * BS)]
    assert scheduler.offload_ref(entry) == REF
    # A second offload of the same handle while the first is written: refused, not doubled.
    again = scheduler.offload(REF, REF.block_ids, workers)
    assert again["status"] == "tier_failed"
    assert "already" in str(again["message"])
    assert scheduler.offload_poll(entry, workers) == {"status": "pending", "entry": entry}
    assert scheduler.store.manifest(entry) is None  # nothing visible before the commit
    workers.done = True
    answer = scheduler.offload_poll(entry, workers)
    assert answer["status"] == "ok"
    assert scheduler.store.manifest(entry) is not None
    assert scheduler.offload_poll(entry, workers)["status"] == "unknown"


def test_a_write_that_fails_on_a_worker_leaves_no_entry(tmp_path: Path) -> None:
    clock = Clock()
    scheduler = tier(tmp_path, clock)
    workers = Workers(scheduler.store)
    entry = str(scheduler.offload(REF, REF.block_ids, workers)["entry"])
    workers.failed = True
    answer = scheduler.offload_poll(entry, workers)
    assert answer["status"] == "tier_failed"
    assert "EIO" in str(answer["message"])
    assert list(tmp_path.glob(f"{entry}.*")) == []
    assert scheduler.offload_ref(entry) is None


def test_a_write_nobody_polls_for_is_abandoned(tmp_path: Path) -> None:
    clock = Clock()
    scheduler = tier(tmp_path, clock)
    workers = Workers(scheduler.store)
    entry = str(scheduler.offload(REF, REF.block_ids, workers)["entry"])
    clock.now += RESULT_KEEP_S + 1
    # The next offload sweeps it: its files go, and the handle may be offloaded again.
    assert scheduler.offload(REF, REF.block_ids, workers)["status"] == "pending"
    assert scheduler.offload_ref(entry) is None
    assert list(tmp_path.glob(f"{entry}.*")) == []


@pytest.mark.skipif(not hasattr(os, "getpriority"), reason="thread priorities are Linux's")
def test_the_writing_thread_yields_the_core_to_the_engine() -> None:
    writes = BackgroundWrites()
    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    def write() -> dict[str, Any]:
        return {"nice": os.getpriority(os.PRIO_PROCESS, threading.get_native_id())}

    writes.start("e1", "req-1", write)
    assert wait_done(writes, "e1")["nice"] == min(base + WRITER_NICE, 19)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == base
    writes.shutdown()
