"""``agentkv bench``: a multi-turn agent workload, served in several modes side by side.

The modes (``Mode``) run the same deterministic workload in one run, interleaved, and the report
gives TTFT, reuse and throughput per mode and turn (``docs/benchmarks.md``).

>>> import asyncio
>>> from agentkv.bench import BenchConfig, ClusterTarget, run_bench
>>> from agentkv.testing import FakeCluster
>>> fake = FakeCluster(pairs=1)
>>> target = ClusterTarget(spec=fake.cluster_spec, transport=fake.transport)
>>> config = BenchConfig(sessions=1, turns=2, context_tokens=256)
>>> report = asyncio.run(run_bench(config, target=target))  # doctest: +SKIP
>>> sorted(report["modes"])  # doctest: +SKIP
['affinity', 'agentkv', 'disagg']
"""

from agentkv.bench._config import DEFAULT_MODES, BenchConfig, Mode, parse_modes
from agentkv.bench._plot import plot_ttft
from agentkv.bench._run import run_bench
from agentkv.bench._target import ClusterTarget

__all__ = [
    "DEFAULT_MODES",
    "BenchConfig",
    "ClusterTarget",
    "Mode",
    "parse_modes",
    "plot_ttft",
    "run_bench",
]
