"""NIXL progress-thread delay: idle CPU of an agent and the time of a 16 MB DRAM read.

    .venv/bin/python benchmarks/nixl_progress.py            # stock delay (0) vs 1 ms vs 10 ms

Two processes, as a prefill and a decode server are: the target registers a buffer and then
polls its notifications only once a second, so the read must be progressed by the target's NIXL
progress thread (as in vLLM, where an idle engine does not step). NIXL's Python wrapper hard-codes
``pthrDelay = 0``; agentkv's vLLM plugin sets it (agentkv/connector/_quiet.py), and so does this.
"""

from __future__ import annotations

import multiprocessing as mp
import sys
import time
from typing import Any

SIZE = 1 << 22  # float32 elements: 16 MB


def _agent(name: str, delay_us: int) -> Any:
    import nixl._api as nixl_api

    from agentkv.connector._quiet import _DelayedProgressBindings

    if delay_us >= 0 and not isinstance(nixl_api.nixlBind, _DelayedProgressBindings):
        import agentkv.connector._quiet as quiet

        quiet.PROGRESS_DELAY_US = delay_us
        nixl_api.nixlBind = _DelayedProgressBindings(nixl_api.nixlBind)
    config = nixl_api.nixl_agent_config(enable_prog_thread=True, num_threads=0, backends=["UCX"])
    return nixl_api.nixl_agent(name, config)


def _target(delay_us: int, meta_queue: Any, done_queue: Any) -> None:
    import torch

    agent = _agent("target", delay_us)
    tensor = torch.arange(SIZE, dtype=torch.float32)
    agent.register_memory(agent.get_reg_descs(tensor))
    meta_queue.put((agent.get_agent_metadata(), tensor.data_ptr(), tensor.numel() * 4))
    cpu = time.process_time()
    time.sleep(3)
    done_queue.put((time.process_time() - cpu) / 3)
    deadline = time.time() + 20
    while time.time() < deadline and not agent.get_new_notifs():
        time.sleep(1.0)


def _read(delay_us: int, meta: bytes, address: int, size: int) -> float:
    import torch

    agent = _agent("initiator", delay_us)
    tensor = torch.zeros(SIZE, dtype=torch.float32)
    agent.register_memory(agent.get_reg_descs(tensor))
    peer = agent.add_remote_agent(meta)
    remote = agent.get_xfer_descs([(address, size, 0)], "DRAM")
    handle = agent.initialize_xfer("READ", agent.get_xfer_descs(tensor), remote, peer, b"done")
    start = time.perf_counter()
    agent.transfer(handle)
    while (state := agent.check_xfer_state(handle)) != "DONE":
        if state == "ERR" or time.perf_counter() - start > 15:
            return float("nan")
    assert float(tensor[12345]) == 12345.0
    return time.perf_counter() - start


def measure(delay_us: int) -> tuple[float, float]:
    context = mp.get_context("spawn")
    meta_queue, done_queue = context.Queue(), context.Queue()
    target = context.Process(target=_target, args=(delay_us, meta_queue, done_queue))
    target.start()
    meta, address, size = meta_queue.get()
    idle = done_queue.get()
    seconds = _read(delay_us, meta, address, size)
    target.join(5)
    target.kill()
    return idle, seconds


def main() -> int:
    print(f"{'pthrDelay (us)':>15} {'idle CPU (% core)':>18} {'16 MB read (ms)':>16}")
    for delay in (0, 1000, 10000):
        idle, seconds = measure(delay)
        print(f"{delay:>15} {100 * idle:>18.1f} {1000 * seconds:>16.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
