"""What the local CPU can do, and the serving dtype that is both fast and safe on it.

vLLM's CPU backend runs bf16 natively only with AVX512-BF16 or AMX. Elsewhere (an AVX2-only
CPU, such as many AMD EPYC machines) bf16 is emulated: every operation converts to fp32 and
rounds back, which is slower than fp32 itself and rounds differently in decode (one token at a
time) and in prefill (a whole chunk at once). That difference flipped a greedy choice between a
turn with reuse and one without (docs/cpu.md has the measurements). So ``agentkv up`` serves
bf16 only where the CPU computes it natively, fp32 everywhere else; ``--dtype`` overrides.

``AGENTKV_CPU_ISA=avx2`` makes an AVX-512 machine report only what an AVX2-only CPU has, to
vLLM and to the dtype choice (see ``isa_env``): that reproduces an AVX2 CI machine's kernel
choices and numerics on a developer's machine. It cannot reproduce another CPU's speed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import agentkv.local._isa as _isa_package

DTYPES = ("bfloat16", "float32")
# Each emulated ISA: the cpuinfo flags it keeps, torch's ATen level, oneDNN's ISA cap.
_ISAS: Mapping[str, tuple[str, str]] = {"avx2": ("avx2", "AVX2")}
ISA_ENV = "AGENTKV_CPU_ISA"
# Flags an AVX2-only x86-64 CPU lacks: every AVX-512 and AMX extension, and AVX-VNNI (which
# oneDNN would otherwise use for bf16/int8 on an AVX2 cap).
_BEYOND_AVX2 = ("avx512", "amx", "avx_vnni", "avx10")


@dataclass(frozen=True, kw_only=True)
class CpuInfo:
    """The model name and feature flags of the CPU, as ``/proc/cpuinfo`` reports them."""

    model: str
    flags: frozenset[str]

    @property
    def native_bf16(self) -> bool:
        """Whether bf16 matrix arithmetic runs in hardware (AVX512-BF16 or AMX-BF16)."""
        return bool({"avx512_bf16", "amx_bf16"} & self.flags)

    @property
    def isa(self) -> str:
        """A short name of the widest vector ISA: ``amx``, ``avx512``, ``avx2`` or ``other``."""
        if "amx_bf16" in self.flags:
            return "amx"
        if "avx512f" in self.flags:
            return "avx512"
        return "avx2" if "avx2" in self.flags else "other"

    def limited_to(self, isa: str | None) -> CpuInfo:
        """The same CPU as it looks with ``AGENTKV_CPU_ISA=isa`` (``None``: unchanged).

        >>> cpu = CpuInfo(model="Xeon", flags=frozenset({"avx2", "avx512f", "amx_bf16"}))
        >>> cpu.limited_to("avx2").flags == {"avx2"}, cpu.limited_to("avx2").native_bf16
        (True, False)
        """
        if isa is None:
            return self
        _check_isa(isa)
        kept = frozenset(f for f in self.flags if not f.startswith(_BEYOND_AVX2))
        return CpuInfo(model=f"{self.model} (limited to {isa})", flags=kept)


def parse_cpuinfo(text: str) -> CpuInfo:
    """The first processor's model name and flags.

    >>> parse_cpuinfo("model name\\t: AMD EPYC 7B13\\nflags\\t\\t: fpu avx2 fma\\n").native_bf16
    False
    """
    model, flags = "unknown CPU", frozenset[str]()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and model == "unknown CPU":
            model = value.strip()
        elif key == "flags" and not flags:
            flags = frozenset(value.split())
    return CpuInfo(model=model, flags=flags)


def read_cpu_info(path: Path = Path("/proc/cpuinfo")) -> CpuInfo:
    """This machine's CPU; an unreadable file gives a CPU with no flags (served in fp32)."""
    try:
        return parse_cpuinfo(path.read_text(errors="replace"))
    except OSError:
        return CpuInfo(model="unknown CPU", flags=frozenset())


def default_dtype(cpu: CpuInfo) -> str:
    """The serving dtype for ``cpu``: bf16 where it is native, fp32 elsewhere.

    >>> default_dtype(CpuInfo(model="EPYC", flags=frozenset({"avx2"})))
    'float32'
    >>> default_dtype(CpuInfo(model="Xeon", flags=frozenset({"avx2", "avx512_bf16"})))
    'bfloat16'
    """
    return "bfloat16" if cpu.native_bf16 else "float32"


def _check_isa(isa: str) -> None:
    if isa not in _ISAS:
        from agentkv import ConfigError

        raise ConfigError(f"unknown {ISA_ENV} {isa!r}; known: {', '.join(sorted(_ISAS))}")


def isa_env(isa: str, *, environ: Mapping[str, str]) -> dict[str, str]:
    """Environment that makes a vLLM server run as on a CPU limited to ``isa``.

    Four layers pick kernels by ISA, and each is capped: torch's own kernels and the C++ that
    torch.compile generates (``ATEN_CPU_CAPABILITY``), oneDNN's GEMMs (``ONEDNN_MAX_CPU_ISA``),
    and vLLM's choices (which ``_C`` extension it loads, its attention ISA, its AMX GEMMs), which
    read ``torch.cpu.get_capabilities()``: a ``sitecustomize`` put first on ``PYTHONPATH`` masks
    the flags there before vLLM is imported. vLLM's compile cache gets a folder of its own, since
    its key does not include the ISA the kernels were generated for.
    """
    _check_isa(isa)
    aten, onednn = _ISAS[isa]
    folder = str(Path(_isa_package.__file__).parent)
    python_path = environ.get("PYTHONPATH")
    cache_root = environ.get("VLLM_CACHE_ROOT") or str(Path.home() / ".cache" / "vllm")
    return {
        ISA_ENV: isa,
        "ATEN_CPU_CAPABILITY": aten,
        "ONEDNN_MAX_CPU_ISA": onednn,
        "PYTHONPATH": folder if not python_path else f"{folder}:{python_path}",
        "VLLM_CACHE_ROOT": str(Path(cache_root) / f"agentkv-isa-{isa}"),
    }
