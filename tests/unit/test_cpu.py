"""The serving dtype per CPU, and the ISA limit that reproduces an AVX2-only CPU elsewhere."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from agentkv import ConfigError
from agentkv.local._config import LocalClusterConfig
from agentkv.local._cpu import CpuInfo, default_dtype, isa_env, parse_cpuinfo
from agentkv.local._launch import plan_servers, serving_dtype

EPYC = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7B13
flags\t\t: fpu sse2 avx avx2 fma bmi2
processor\t: 1
model name\t: AMD EPYC 7B13
flags\t\t: fpu sse2 avx avx2 fma bmi2
"""
SAPPHIRE = """model name\t: Intel(R) Xeon(R) Processor
flags\t\t: avx avx2 avx512f avx512_bf16 amx_tile amx_bf16 avx_vnni
"""
CASCADE = """model name\t: Intel(R) Xeon(R) Gold 6248
flags\t\t: avx avx2 avx512f avx512bw avx512_vnni
"""


@pytest.mark.parametrize(
    ("cpuinfo", "dtype", "isa"),
    [(EPYC, "float32", "avx2"), (SAPPHIRE, "bfloat16", "amx"), (CASCADE, "float32", "avx512")],
)
def test_bf16_is_served_only_where_the_cpu_computes_it_natively(
    cpuinfo: str, dtype: str, isa: str
) -> None:
    cpu = parse_cpuinfo(cpuinfo)
    assert default_dtype(cpu) == dtype
    assert cpu.isa == isa


def test_an_isa_limit_hides_every_extension_beyond_avx2() -> None:
    cpu = parse_cpuinfo(SAPPHIRE).limited_to("avx2")
    assert cpu.flags == {"avx", "avx2"}
    assert default_dtype(cpu) == "float32"
    with pytest.raises(ConfigError, match="unknown AGENTKV_CPU_ISA"):
        parse_cpuinfo(SAPPHIRE).limited_to("sse2")


def test_an_unreadable_cpuinfo_serves_the_safe_dtype() -> None:
    assert default_dtype(CpuInfo(model="unknown CPU", flags=frozenset())) == "float32"


def test_servers_run_in_the_configured_dtype_and_limited_isa(tmp_path: Path) -> None:
    config = LocalClusterConfig(cluster_file=tmp_path / "c.json", dtype="float32", cpu_isa="avx2")
    assert serving_dtype(config) == "float32"
    for plan in plan_servers(config, model_path=tmp_path):
        assert plan.argv[plan.argv.index("--dtype") + 1] == "float32"
        assert plan.env["ATEN_CPU_CAPABILITY"] == "avx2"
        assert plan.env["ONEDNN_MAX_CPU_ISA"] == "AVX2"
        assert plan.env["PYTHONPATH"].split(":")[0].endswith("agentkv/local/_isa")
        assert plan.env["VLLM_CACHE_ROOT"].endswith("agentkv-isa-avx2")
    limited = replace(config, dtype=None)
    assert serving_dtype(limited) == "float32", "an AVX2 limit never picks emulated bf16"


def test_isa_env_keeps_an_existing_python_path() -> None:
    env = isa_env("avx2", environ={"PYTHONPATH": "/a:/b", "VLLM_CACHE_ROOT": "/c"})
    assert env["PYTHONPATH"].endswith(":/a:/b")
    assert env["VLLM_CACHE_ROOT"] == "/c/agentkv-isa-avx2"


@pytest.mark.slow
def test_the_isa_limit_reaches_torch_in_a_new_interpreter() -> None:
    """The sitecustomize masks the flags torch (and so vLLM) reads, before anything imports."""
    pytest.importorskip("torch")
    env = {**os.environ, **isa_env("avx2", environ=os.environ)}
    code = (
        "import torch; c = torch.cpu; "
        "print(c._is_avx512_supported(), c._is_amx_tile_supported(), c._is_avx2_supported())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["False", "False", "True"]
