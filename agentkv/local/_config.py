"""Typed configuration of a local CPU cluster: one place for defaults, read by the CLI and tests."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from agentkv.local._model import DEFAULT_MODEL

CLUSTER_FILE_ENV = "AGENTKV_CLUSTER"
DEFAULT_CLUSTER_FILE = Path(".agentkv") / "cluster.json"
# ``agentkv up --long-context``: a window that holds a coding agent's default prompt (Claude
# Code's is ~12.6k tokens), by YaRN rope scaling of the model's 8k (``_launch.context_args``).
LONG_CONTEXT_LEN = 32768
# Its KV cache per server: 32k tokens of SmolLM2-135M take 1.4 GiB in fp32 (30 layers, 3 KV
# heads of 64), and vLLM refuses to start when one whole-window request does not fit.
LONG_CONTEXT_KV_CACHE_GIB = 2


def default_cluster_file() -> Path:
    """The cluster file path: ``$AGENTKV_CLUSTER`` or ``.agentkv/cluster.json`` here."""
    env = os.environ.get(CLUSTER_FILE_ENV)
    return Path(env) if env else DEFAULT_CLUSTER_FILE


@dataclass(frozen=True, kw_only=True)
class LocalClusterConfig:
    """How ``agentkv up`` starts local vLLM CPU prefill/decode pairs, or a pool.

    ``prefill``/``decode`` (both or neither) start a pool of that many servers instead of pairs:
    prefill i and decode i keep the ports of pair i.

    >>> LocalClusterConfig(pairs=1).server_ports(0)
    (18100, 18101)
    >>> LocalClusterConfig(prefill=2, decode=1).servers
    [('prefill-0', 'prefill', 0), ('prefill-1', 'prefill', 1), ('decode-0', 'decode', 0)]
    """

    pairs: int = 1
    prefill: int | None = None
    decode: int | None = None
    model: str = DEFAULT_MODEL
    cluster_file: Path = field(default_factory=default_cluster_file)
    model_cache_dir: Path | None = None
    host: str = "127.0.0.1"
    base_port: int = 18100  # prefill i: base + 2i, decode i: base + 2i + 1
    base_side_channel_port: int = 15600  # NIXL side channels, same layout
    max_model_len: int = 8192
    kv_cache_gib: int = 1  # VLLM_CPU_KVCACHE_SPACE per server
    # The decode servers' KV cache in GiB (None: ``kv_cache_gib``). A fraction is allowed: a
    # small decode is how the bench's decode-pressure workload makes pins compete for memory.
    decode_kv_cache_gib: float | None = None
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
    # The file tier for offloaded turn-end KV, shared by prefill and decode (docs/connector.md);
    # None: ``tier`` next to the cluster file. Only with the agentkv connector.
    tier_dir: Path | None = None
    tier_budget_bytes: int = 4 << 30
    # agentkv's vLLM plugin settings that let an idle server sleep (docs/idle.md).
    quiet: bool = True
    extra_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        from agentkv import ConfigError

        if (self.prefill is None) != (self.decode is None):
            raise ConfigError("a pool needs both --prefill and --decode")
        if (self.prefill is not None and self.prefill < 1) or (
            self.decode is not None and self.decode < 1
        ):
            raise ConfigError("a pool needs at least one prefill and one decode server")
        for name in ("kv_cache_gib", "decode_kv_cache_gib"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ConfigError(f"{name} must be a positive number of GiB, got {value!r}")

    @property
    def pool(self) -> bool:
        return self.prefill is not None

    def kv_cache_gib_of(self, role: str) -> float:
        """The KV cache of a ``role`` server in GiB: ``decode_kv_cache_gib`` for decode, when
        given, else ``kv_cache_gib``.

        >>> LocalClusterConfig(decode_kv_cache_gib=0.25).kv_cache_gib_of("decode")
        0.25
        >>> LocalClusterConfig(decode_kv_cache_gib=0.25).kv_cache_gib_of("prefill")
        1
        """
        if role == "decode" and self.decode_kv_cache_gib is not None:
            return self.decode_kv_cache_gib
        return self.kv_cache_gib

    @property
    def servers(self) -> list[tuple[str, str, int]]:
        """(name, role, index) of every server, prefills first; ports follow the index."""
        if not self.pool:
            return [
                (f"pair-{i}", role, i) for i in range(self.pairs) for role in ("prefill", "decode")
            ]
        return [
            *((f"prefill-{i}", "prefill", i) for i in range(self.prefill or 0)),
            *((f"decode-{i}", "decode", i) for i in range(self.decode or 0)),
        ]

    def server_ports(self, pair: int) -> tuple[int, int]:
        return self.base_port + 2 * pair, self.base_port + 2 * pair + 1

    def side_channel_ports(self, pair: int) -> tuple[int, int]:
        base = self.base_side_channel_port
        return base + 2 * pair, base + 2 * pair + 1

    @property
    def log_dir(self) -> Path:
        return self.cluster_file.parent.resolve() / "logs"

    @property
    def resolved_tier_dir(self) -> Path | None:
        """Where the servers keep offloaded KV: ``tier_dir``, or ``tier`` by the cluster file."""
        if not self.agentkv_connector:
            return None
        return (self.tier_dir or self.cluster_file.parent / "tier").resolve()


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
class PoolServerRecord:
    """One server of a pool: its name (``prefill-0``), role and process."""

    name: str
    role: str
    server: ServerRecord


@dataclass(frozen=True, kw_only=True)
class ClusterRecord:
    """The cluster file: what ``agentkv up`` started, what the SDK connects to.

    Pairs, or a pool (``pool`` non-empty, ``pairs`` empty): ``{"prefill": [...], "decode":
    [...]}`` with each server's name, url, pid and log.
    """

    model: str
    pairs: tuple[PairRecord, ...] = ()
    pool: tuple[PoolServerRecord, ...] = ()
    # The dtype the servers run in (None: a cluster file written before it was recorded).
    dtype: str | None = None
    # The ISA the servers were limited to (``--cpu-isa``); None: the CPU's own.
    cpu_isa: str | None = None
    # The servers' kv_recompute_threshold: the SDK attaches handles down to it (None: not
    # recorded, the SDK assumes vLLM's default).
    kv_recompute_threshold: int | None = None
    # The servers' shared KV file tier (None: no tier, or not recorded) and its byte budget.
    tier_dir: str | None = None
    tier_budget_bytes: int | None = None
    # Each role's KV cache in GiB, as started (None: not recorded).
    kv_cache_gib: float | None = None
    decode_kv_cache_gib: float | None = None
    # The servers' context (``--max-model-len``): the SDK clamps ``max_tokens`` to what a
    # prompt leaves of it without asking (None: not recorded; the SDK asks ``/v1/models``).
    max_model_len: int | None = None

    @property
    def servers(self) -> list[tuple[str, str, ServerRecord]]:
        """(name, role, server) of every server: pair name for pairs, server name in a pool."""
        if self.pool:
            return [(s.name, s.role, s.server) for s in self.pool]
        return [
            (pair.name, role, server)
            for pair in self.pairs
            for role, server in (("prefill", pair.prefill), ("decode", pair.decode))
        ]

    def with_pids(self, pids: Mapping[tuple[str, str], int]) -> ClusterRecord:
        """The record with new pids for the (name, role) servers in ``pids``."""

        def renewed(name: str, role: str, server: ServerRecord) -> ServerRecord:
            pid = pids.get((name, role))
            return server if pid is None else replace(server, pid=pid)

        return replace(
            self,
            pairs=tuple(
                replace(
                    pair,
                    prefill=renewed(pair.name, "prefill", pair.prefill),
                    decode=renewed(pair.name, "decode", pair.decode),
                )
                for pair in self.pairs
            ),
            pool=tuple(
                replace(s, server=renewed(s.name, s.role, s.server)) for s in self.pool
            ),
        )

    def to_json(self) -> dict[str, Any]:
        head = {
            "model": self.model,
            **({"dtype": self.dtype} if self.dtype else {}),
            **({"cpu_isa": self.cpu_isa} if self.cpu_isa else {}),
            **(
                {"kv_recompute_threshold": self.kv_recompute_threshold}
                if self.kv_recompute_threshold is not None
                else {}
            ),
            **(
                {"tier": {"dir": self.tier_dir, "budget_bytes": self.tier_budget_bytes}}
                if self.tier_dir is not None
                else {}
            ),
            **(
                {"kv_cache_gib": {"prefill": self.kv_cache_gib,
                                  "decode": self.decode_kv_cache_gib}}
                if self.kv_cache_gib is not None and self.decode_kv_cache_gib is not None
                else {}
            ),
            **({"max_model_len": self.max_model_len} if self.max_model_len is not None else {}),
        }
        if self.pool:
            return {
                **head,
                **{
                    role: [
                        {"name": s.name, "url": s.server.url, "pid": s.server.pid,
                         "log": s.server.log}
                        for s in self.pool
                        if s.role == role
                    ]
                    for role in ("prefill", "decode")
                },
            }
        return {
            **head,
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
        from agentkv import ConfigError

        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"no cluster file at {path}; start one with `agentkv up`") from None
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"cluster file {path} is unreadable: {exc}") from exc
        try:
            if "pairs" not in data and "prefill" in data:
                pool = tuple(
                    PoolServerRecord(
                        name=str(s["name"]),
                        role=role,
                        server=ServerRecord(
                            url=str(s["url"]), pid=int(s.get("pid", 0)), log=str(s.get("log", ""))
                        ),
                    )
                    for role in ("prefill", "decode")
                    for s in data[role]
                )
                dtype, cpu_isa = data.get("dtype"), data.get("cpu_isa")
                threshold = data.get("kv_recompute_threshold")
                return cls(
                    model=str(data["model"]),
                    pool=pool,
                    dtype=None if dtype is None else str(dtype),
                    cpu_isa=None if cpu_isa is None else str(cpu_isa),
                    kv_recompute_threshold=None if threshold is None else int(threshold),
                    **_tier_fields(data),
                    **_kv_cache_fields(data),
                    **_context_fields(data),
                )
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
            threshold = data.get("kv_recompute_threshold")
            return cls(
                model=str(data["model"]),
                pairs=pairs,
                dtype=None if dtype is None else str(dtype),
                cpu_isa=None if cpu_isa is None else str(cpu_isa),
                kv_recompute_threshold=None if threshold is None else int(threshold),
                **_tier_fields(data),
                **_kv_cache_fields(data),
                **_context_fields(data),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"cluster file {path} is malformed: {exc!r}") from exc


def _tier_fields(data: Mapping[str, Any]) -> dict[str, Any]:
    tier = data.get("tier")
    if not isinstance(tier, Mapping):
        return {}
    budget = tier.get("budget_bytes")
    return {"tier_dir": str(tier["dir"]),
            "tier_budget_bytes": None if budget is None else int(budget)}


def _context_fields(data: Mapping[str, Any]) -> dict[str, Any]:
    length = data.get("max_model_len")
    return {} if length is None else {"max_model_len": int(length)}


def _kv_cache_fields(data: Mapping[str, Any]) -> dict[str, Any]:
    sizes = data.get("kv_cache_gib")
    if not isinstance(sizes, Mapping):
        return {}
    return {"kv_cache_gib": float(sizes["prefill"]),
            "decode_kv_cache_gib": float(sizes["decode"])}
