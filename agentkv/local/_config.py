"""Typed configuration of a local CPU cluster: one place for defaults, read by the CLI and tests."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentkv.local._model import DEFAULT_MODEL

CLUSTER_FILE_ENV = "AGENTKV_CLUSTER"
DEFAULT_CLUSTER_FILE = Path(".agentkv") / "cluster.json"


def default_cluster_file() -> Path:
    """The cluster file path: ``$AGENTKV_CLUSTER`` or ``.agentkv/cluster.json`` here."""
    env = os.environ.get(CLUSTER_FILE_ENV)
    return Path(env) if env else DEFAULT_CLUSTER_FILE


@dataclass(frozen=True, kw_only=True)
class LocalClusterConfig:
    """How ``agentkv up`` starts local vLLM CPU prefill/decode pairs.

    >>> LocalClusterConfig(pairs=1).server_ports(0)
    (18100, 18101)
    """

    pairs: int = 1
    model: str = DEFAULT_MODEL
    cluster_file: Path = field(default_factory=default_cluster_file)
    model_cache_dir: Path | None = None
    host: str = "127.0.0.1"
    base_port: int = 18100  # prefill i: base + 2i, decode i: base + 2i + 1
    base_side_channel_port: int = 15600  # NIXL side channels, same layout
    max_model_len: int = 8192
    kv_cache_gib: int = 1  # VLLM_CPU_KVCACHE_SPACE per server
    # The serving dtype; None picks per CPU (bf16 only where it is native, see _cpu.py).
    dtype: str | None = None
    # Run the servers as on a CPU limited to this ISA ("avx2"; AGENTKV_CPU_ISA, see _cpu.py).
    cpu_isa: str | None = None
    decoder_kv_blocks_ttl: float = 480.0
    # Pull whatever prefill lacks: on loopback a pull costs less than recomputing even a few
    # tokens (benchmarks/pull_vs_recompute.py, docs/cpu.md); vLLM's default is 64.
    kv_recompute_threshold: int = 1
    startup_timeout_s: float = 900.0
    # The agentkv connector (NixlConnector + agentkv policy hooks); False runs stock vLLM.
    agentkv_connector: bool = True
    # agentkv's vLLM plugin settings that let an idle server sleep (docs/idle.md).
    quiet: bool = True
    extra_args: tuple[str, ...] = ()

    def server_ports(self, pair: int) -> tuple[int, int]:
        return self.base_port + 2 * pair, self.base_port + 2 * pair + 1

    def side_channel_ports(self, pair: int) -> tuple[int, int]:
        base = self.base_side_channel_port
        return base + 2 * pair, base + 2 * pair + 1

    @property
    def log_dir(self) -> Path:
        return self.cluster_file.parent.resolve() / "logs"


@dataclass(frozen=True, kw_only=True)
class ServerRecord:
    """One started server as written to the cluster file."""

    url: str
    pid: int
    log: str


@dataclass(frozen=True, kw_only=True)
class PairRecord:
    name: str
    prefill: ServerRecord
    decode: ServerRecord


@dataclass(frozen=True, kw_only=True)
class ClusterRecord:
    """The cluster file: what ``agentkv up`` started, what the SDK connects to."""

    model: str
    pairs: tuple[PairRecord, ...]
    # The dtype the servers run in (None: a cluster file written before it was recorded).
    dtype: str | None = None
    # The ISA the servers were limited to (``--cpu-isa``); None: the CPU's own.
    cpu_isa: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            **({"dtype": self.dtype} if self.dtype else {}),
            **({"cpu_isa": self.cpu_isa} if self.cpu_isa else {}),
            "pairs": [
                {
                    "name": pair.name,
                    "prefill": pair.prefill.url,
                    "decode": pair.decode.url,
                    "prefill_pid": pair.prefill.pid,
                    "decode_pid": pair.decode.pid,
                    "prefill_log": pair.prefill.log,
                    "decode_log": pair.decode.log,
                }
                for pair in self.pairs
            ],
        }

    def write(self, path: Path) -> None:
        """Write atomically (temp file then rename) so a reader never sees half a file."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=2) + "\n")
        tmp.replace(path)

    @classmethod
    def read(cls, path: Path) -> ClusterRecord:
        from agentkv._exceptions import ConfigError

        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"no cluster file at {path}; start one with `agentkv up`") from None
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"cluster file {path} is unreadable: {exc}") from exc
        try:
            pairs = tuple(
                PairRecord(
                    name=str(p["name"]),
                    prefill=ServerRecord(
                        url=str(p["prefill"]), pid=int(p.get("prefill_pid", 0)),
                        log=str(p.get("prefill_log", "")),
                    ),
                    decode=ServerRecord(
                        url=str(p["decode"]), pid=int(p.get("decode_pid", 0)),
                        log=str(p.get("decode_log", "")),
                    ),
                )
                for p in data["pairs"]
            )
            dtype, cpu_isa = data.get("dtype"), data.get("cpu_isa")
            return cls(
                model=str(data["model"]),
                pairs=pairs,
                dtype=None if dtype is None else str(dtype),
                cpu_isa=None if cpu_isa is None else str(cpu_isa),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"cluster file {path} is malformed: {exc!r}") from exc
