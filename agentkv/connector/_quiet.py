"""Let an idle vLLM CPU server sleep: the busy-waits of stock vLLM 0.32, and what we do about them.

Measured on a 2-core machine (docs/idle.md): an idle stock P/D pair burns ~1.5-2 cores.

1. NIXL's progress thread polls with ``pthrDelay = 0`` (a pure busy loop). We keep the thread
   (reads need the target to progress) but let it sleep ``PROGRESS_DELAY_US`` between polls, and
   use UCX's single-threaded backend (``num_threads = 0``). Measured in isolation: idle CPU of an
   agent 51% -> 2.7% of a core, a 16 MB read 0.20 s -> 0.05 s (benchmarks/nixl_progress.py).
2. While any finished request still holds blocks (every turn-end pin on decode, every prefill
   waiting for decode to read), the engine core steps every 1 ms to poll the connector, and each
   step wakes the worker process, which then spins on its shared-memory queue for 1 s. We keep
   the 1 ms cadence whenever a request is running or waiting for KV; when only pins are left we
   wait on the engine's input queue instead, so a new request (or a release hint) wakes the engine
   at once and pin expiry is still checked every ``IDLE_POLL_S``. Frees that only need a NIXL
   notification (the peer has read the blocks) are then applied at the next step.

3. For 1 s after each message a reader of vLLM's shared-memory queues (the worker waiting for
   the scheduler's next step, the engine waiting for the worker's output) spins on the queue,
   calling ``sched_yield()`` between checks. With two servers on two cores, a decode worker
   spinning after a turn's D leg leaves prefill's processes one core for the next turn's P leg:
   ``benchmarks/prefill_after_decode.py`` on the local pair: a P leg of 59 new tokens took 1.06 s
   right after a decode request and 0.24 s when it came 1.5 s later. We keep the 1 s of busy
   waiting but nap ``SPIN_NAP_S`` between checks instead of yielding, so a waiting reader costs
   next to no CPU; a message waits at most one nap longer to be seen.

We do not shorten the 1 s spin itself: vLLM's shared-memory queue wakes readers that stopped
spinning with a ZMQ PUB/SUB socket whose high-water mark is 1, and with a short spin we saw a
lost wakeup deadlock the engine and its worker (each waiting for the other). Napping keeps the
reader on the spinning path, so that wakeup is never needed within the second.
"""

from __future__ import annotations

import functools
import os
import queue
import time
from typing import Any

# NIXL progress thread sleep between polls, in microseconds (NIXL's default: 0, a busy loop).
PROGRESS_DELAY_US = 1000
# How long an engine holding only pins waits for new work before polling its connector again.
# Each poll costs the worker ~1 s of spinning, so this bounds idle CPU to about 1/IDLE_POLL_S.
IDLE_POLL_S = 20.0
# How long a spinning reader of vLLM's shared-memory queues naps between checks;
# AGENTKV_SPIN_NAP_US=0 keeps vLLM's sched_yield() spin.
SPIN_NAP_ENV = "AGENTKV_SPIN_NAP_US"
SPIN_NAP_S = 0.0002

_applied = False


def apply() -> None:
    """Install the patches once per process (vLLM loads plugins in every process)."""
    global _applied  # noqa: PLW0603 - a process-wide, idempotent switch
    if _applied:
        return
    _applied = True
    _quiet_nixl_agent()
    _quiet_engine_loop()
    nap_us = os.environ.get(SPIN_NAP_ENV)
    if nap_us is None or float(nap_us) > 0:
        _nap_while_spinning(SPIN_NAP_S if nap_us is None else float(nap_us) / 1e6)


def _quiet_nixl_agent() -> None:
    import nixl._api as nixl_api
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker

    original = base_worker.nixl_agent_config
    if original is not None and not getattr(original, "_agentkv", False):

        @functools.wraps(original)
        def config(*args: Any, **kwargs: Any) -> Any:
            kwargs["num_threads"] = 0  # UCX's single-threaded backend: no extra pollers
            return original(*args, **kwargs)

        config._agentkv = True  # type: ignore[attr-defined]
        base_worker.nixl_agent_config = config

    bindings = nixl_api.nixlBind
    if isinstance(bindings, _DelayedProgressBindings):
        return
    nixl_api.nixlBind = _DelayedProgressBindings(bindings)


class _DelayedProgressBindings:
    """NIXL's native bindings, except that agents get a progress thread that sleeps between polls.

    ``nixl_agent.__init__`` hard-codes ``pthrDelay = 0`` before constructing the native agent; this
    proxy sets the delay on the config object it is handed. The thread must stay on: a UCX read
    needs the *target* process to progress too (measured: with the thread off, a prefill reading
    decode's blocks waited for decode's next engine step).
    """

    def __init__(self, bindings: Any) -> None:
        self._bindings = bindings

    def __getattr__(self, name: str) -> Any:
        return getattr(self._bindings, name)

    def nixlAgent(self, name: str, config: Any) -> Any:  # noqa: N802 - mirrors the native name
        config.pthrDelay = PROGRESS_DELAY_US
        return self._bindings.nixlAgent(name, config)


def _quiet_engine_loop() -> None:
    from vllm.v1.engine.core import EngineCoreProc

    original = EngineCoreProc._process_engine_step
    if getattr(original, "_agentkv", False):
        return

    def _process_engine_step(self: Any) -> bool:
        scheduler = self.scheduler
        only_pins = (
            not scheduler.has_unfinished_requests()
            and not scheduler.finished_req_ids
            and scheduler.has_requests()
        )
        if not only_pins:
            return bool(original(self))
        outputs, model_executed = self.step_fn()
        for output in outputs.items() if outputs else ():
            self.output_queue.put_nowait(output)
        self.post_step(model_executed)
        if not model_executed:
            try:
                request = self.input_queue.get(timeout=IDLE_POLL_S)
            except queue.Empty:
                pass
            else:
                self._handle_client_request(*request)
        return bool(model_executed)

    _process_engine_step._agentkv = True  # type: ignore[attr-defined]
    EngineCoreProc._process_engine_step = _process_engine_step


def _nap_while_spinning(nap_s: float = SPIN_NAP_S) -> None:
    from vllm.distributed.device_communicators import shm_broadcast

    condition = shm_broadcast.SpinCondition
    original = condition.wait
    if getattr(original, "_agentkv", False):
        return

    @functools.wraps(original)
    def wait(self: Any, timeout_ms: int | None = None) -> None:
        if self.is_reader and time.monotonic() <= self.last_read + self.busy_loop_s:
            time.sleep(nap_s)  # stock: sched_yield(), which keeps the core busy
            return
        original(self, timeout_ms)

    wait._agentkv = True  # type: ignore[attr-defined]
    condition.wait = wait
