"""Runs at interpreter start in a vLLM server limited with ``AGENTKV_CPU_ISA`` (``_cpu.isa_env``).

It masks the CPU flags torch reports (``torch.cpu.get_capabilities()``, which vLLM reads to pick
its ``_C`` extension, attention ISA and AMX GEMMs) down to what an AVX2-only CPU has, then runs
any other ``sitecustomize`` further down the path, as if this one were not here.
"""

import os
import sys

_BEYOND_AVX2 = ("avx512", "amx", "avx_vnni", "avx10")


def _limit_torch() -> None:
    import torch
    import torch.cpu

    read = torch._C._cpu._get_cpu_capability

    def limited() -> dict[str, object]:
        return {
            name: (False if name.startswith(_BEYOND_AVX2) else value)
            for name, value in read().items()
        }

    torch._C._cpu._get_cpu_capability = limited
    torch.cpu.get_capabilities.cache_clear()


def _chain() -> None:
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


if os.environ.get("AGENTKV_CPU_ISA") == "avx2":
    _limit_torch()
_chain()
