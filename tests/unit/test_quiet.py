"""agentkv's vLLM plugin: a spinning reader of vLLM's shared-memory queues naps between checks."""

from __future__ import annotations

import time
import uuid

import pytest

from agentkv.connector import _quiet


@pytest.mark.slow
def test_a_spinning_reader_naps_instead_of_keeping_the_core_busy() -> None:
    zmq = pytest.importorskip("zmq")
    shm_broadcast = pytest.importorskip("vllm.distributed.device_communicators.shm_broadcast")
    _quiet._nap_while_spinning()
    _quiet._nap_while_spinning()  # idempotent: vLLM loads plugins more than once per process
    context = zmq.Context()
    address = f"inproc://agentkv-test-{uuid.uuid4().hex}"
    writer = shm_broadcast.SpinCondition(is_reader=False, context=context, notify_address=address)
    reader = shm_broadcast.SpinCondition(is_reader=True, context=context, notify_address=address)
    try:
        reader.record_read()  # within its 1 s busy period: every wait returns after a nap
        checks = 200
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(checks):
            reader.wait(timeout_ms=1000)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        assert checks * _quiet.SPIN_NAP_S <= wall < 0.9  # napped, and never left the busy path
        assert cpu < wall / 2  # stock sched_yield() spinning uses the whole wall time

        reader.last_read = time.monotonic() - 10  # idle: the stock path, a poll with a timeout
        start = time.perf_counter()
        reader.wait(timeout_ms=50)
        assert time.perf_counter() - start >= 0.04
    finally:
        for condition in (reader, writer):
            for sock in (condition.local_notify_socket, condition.read_cancel_socket,
                         condition.write_cancel_socket):
                if sock is not None:
                    sock.close(linger=0)
        context.term()
