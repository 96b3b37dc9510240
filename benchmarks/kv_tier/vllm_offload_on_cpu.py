"""Why vLLM 0.32's own KV offloading cannot run on the CPU build: each blocker, triggered.

    .venv/bin/python benchmarks/kv_tier/vllm_offload_on_cpu.py

Evidence for the design study docs/design/kv-tier.md (issue 20). In-process, no server, no
model, no files. It calls, on this machine's CPU platform:

1. ``TieringOffloadingSpec.get_worker`` (inherited from ``CPUOffloadingSpec``), which vLLM's
   OffloadingConnector calls from ``register_kv_caches`` at engine start-up: it raises the
   platform check (``vllm/v1/kv_offload/cpu/spec.py``);
2. the device <-> host copy handler behind that worker, built with CPU KV tensors: it fails its
   ``is_cuda or is_xpu`` assertion (``vllm/v1/kv_offload/cpu/gpu_worker.py``);
3. the copy kernel ``torch.ops._C_cache_ops.swap_blocks_batch`` after the CPU platform has loaded
   its kernels: it does not exist, and no shared library of the CPU wheel contains the name;
4. the first CUDA call of ``SimpleCPUOffloadConnector``'s worker
   (``torch.cuda.Stream.priority_range()``, ``vllm/v1/simple_kv_offload/worker.py``);

and prints the platform's answers (``is_cuda_alike``, ``is_xpu``, ``is_pin_memory_available``)
and the default of ``offload_prompt_only`` (True: generated tokens are never offloaded).
"""

from __future__ import annotations

import traceback
from pathlib import Path
from typing import Any


def _where(exc: BaseException) -> str:
    """``path/inside/site-packages.py:line`` of the frame that raised."""
    frame = traceback.extract_tb(exc.__traceback__)[-1]
    path = frame.filename.split("site-packages/")[-1]
    return f"{path}:{frame.lineno}: {(frame.line or '').strip()}"


def _config(extra: dict[str, Any]) -> Any:
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    return OffloadingConfig(
        groups=(OffloadingGroupConfig(128, ("l0",), 0),),
        worker_kv_bytes_per_block=4096,
        enable_kv_cache_events=False,
        extra_config=extra,
        engine_id="probe",
        model=OffloadingModelConfig("probe", "bfloat16"),
        cache=OffloadingCacheConfig(128, 1),
        parallel=OffloadingParallelConfig(0, 1, 1, 1, 1, 1, 0, 1, None, True),
    )


def platform() -> None:
    from vllm.platforms import current_platform

    print(
        f"platform {type(current_platform).__name__}: is_cuda_alike="
        f"{current_platform.is_cuda_alike()} is_xpu={current_platform.is_xpu()} "
        f"is_pin_memory_available={current_platform.is_pin_memory_available()}"
    )


def spec_get_worker() -> None:
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    spec = TieringOffloadingSpec(_config({"cpu_bytes_to_use": 1 << 20}))
    print("1. offload_prompt_only default:", spec.offload_prompt_only)
    try:
        spec.get_worker(None)
    except Exception as exc:
        print(f"1. TieringOffloadingSpec.get_worker -> {type(exc).__name__}: {exc}")
        print(f"   raised at {_where(exc)}")
    else:
        print("1. TieringOffloadingSpec.get_worker returned a worker")


def copy_handler() -> None:
    import torch
    from vllm.v1.kv_offload.base import CanonicalKVCacheRef
    from vllm.v1.kv_offload.cpu.gpu_worker import SingleDirectionOffloadingHandler

    kv = torch.zeros(4, 4096, dtype=torch.int8)  # canonical int8 [blocks, bytes] KV view
    host = torch.zeros(4, 4096, dtype=torch.int8)
    try:
        SingleDirectionOffloadingHandler(
            [kv], [host], 1, [[CanonicalKVCacheRef(0, 4096)]], gpu_to_cpu=True
        )
    except AssertionError as exc:
        print(f"2. copy handler with CPU KV tensors -> AssertionError at {_where(exc)}")
    else:
        print("2. copy handler accepted CPU KV tensors")


def copy_kernel() -> None:
    import torch
    import vllm
    from vllm.platforms import current_platform

    current_platform.import_kernels()
    present = hasattr(torch.ops._C_cache_ops, "swap_blocks_batch")
    print(f"3. torch.ops._C_cache_ops.swap_blocks_batch after import_kernels(): present={present}")
    for lib in sorted(Path(vllm.__file__).parent.glob("*.so")):
        found = b"swap_blocks" in lib.read_bytes()
        print(f"   {lib.name}: contains 'swap_blocks': {found}")


def simple_offload_stream() -> None:
    import torch

    try:
        torch.cuda.Stream.priority_range()
    except Exception as exc:
        print(f"4. torch.cuda.Stream.priority_range() -> {type(exc).__name__}: {exc}")
    else:
        print("4. torch.cuda.Stream.priority_range() works")


def main() -> None:
    platform()
    spec_get_worker()
    copy_handler()
    copy_kernel()
    simple_offload_stream()


if __name__ == "__main__":
    main()
