"""The ``agentkv`` command line: ``up``, ``down``, ``status``, ``demo``, ``proxy``, ``bench``,
``calibrate``.

Environment variables are read here and nowhere else (``AGENTKV_CLUSTER``, ``AGENTKV_CPU_ISA``);
everything below the CLI takes typed config objects.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import httpx2

from agentkv import AgentKVError, ConfigError
from agentkv._core import INFO_PATH, HintError, ServerInfo, TierUsage, configure_logging
from agentkv.local._config import (
    LONG_CONTEXT_KV_CACHE_GIB,
    LONG_CONTEXT_LEN,
    ClusterRecord,
    LocalClusterConfig,
    default_cluster_file,
)
from agentkv.local._cpu import DTYPES, ISA_ENV
from agentkv.local._launch import server_healthy, serving_dtype, start_cluster, stop_cluster
from agentkv.local._model import DEFAULT_MODEL, MODELS, prepare_model
from agentkv.local._procs import group_cpu_percent, pid_alive


def _progress(message: str) -> None:
    print(f"[agentkv] {message}", file=sys.stderr, flush=True)


def _cluster_file(args: argparse.Namespace) -> Path:
    given = getattr(args, "cluster_file", None)
    return Path(given) if given else default_cluster_file()


def _local_config(args: argparse.Namespace) -> LocalClusterConfig:
    config = LocalClusterConfig(cluster_file=_cluster_file(args))
    overrides = {
        name: getattr(args, name)
        for name in ("pairs", "prefill", "decode", "model", "base_port", "base_side_channel_port",
                     "kv_cache_gib", "decode_kv_cache_gib",
                     "decoder_kv_blocks_ttl", "kv_recompute_threshold", "max_model_len",
                     "startup_timeout_s", "dtype")
        if getattr(args, name, None) is not None
    }
    isa = getattr(args, "cpu_isa", None) or os.environ.get(ISA_ENV) or None
    if isa:
        overrides["cpu_isa"] = isa
    if getattr(args, "long_context", False):
        if args.max_model_len is not None:
            raise ConfigError("pass --long-context or --max-model-len, not both")
        overrides["max_model_len"] = LONG_CONTEXT_LEN
        if args.kv_cache_gib is None:
            overrides["kv_cache_gib"] = LONG_CONTEXT_KV_CACHE_GIB
    if getattr(args, "stock_connector", False):
        overrides["agentkv_connector"] = False
    if getattr(args, "model_cache_dir", None):
        overrides["model_cache_dir"] = Path(args.model_cache_dir)
    return replace(config, **overrides)


def cmd_up(args: argparse.Namespace) -> int:
    record = start_cluster(_local_config(args), progress=_progress)
    print(json.dumps(record.to_json(), indent=2))
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    stop_cluster(_local_config(args), progress=_progress)
    return 0


def cmd_prepare_model(args: argparse.Namespace) -> int:
    config = _local_config(args)
    print(prepare_model(config.model, dtype=serving_dtype(config),
                        cache_dir=config.model_cache_dir, progress=_progress))
    return 0


def tier_usage(client: httpx2.Client, url: str) -> TierUsage | None:
    """A server's file tier usage from ``GET /v1/agentkv/info``; ``None`` without a tier (or
    without agentkv's extension, or when it cannot be asked)."""
    try:
        response = client.get(url + INFO_PATH, timeout=2.0)
        if response.status_code != 200:
            return None
        info = ServerInfo.from_wire(response.json())
        return None if info.tier is None else TierUsage.from_wire(info.tier)
    except (httpx2.HTTPError, ValueError, HintError):
        return None


def _tier_text(tier: object) -> str:
    if not isinstance(tier, dict):
        return "tier -"
    usage = TierUsage.from_wire(tier)
    return (f"tier {usage.bytes / 1e6:.1f}/{usage.budget_bytes / 1e6:.0f} MB "
            f"({usage.entries} entries)")


def cmd_status(args: argparse.Namespace) -> int:
    record = ClusterRecord.read(_cluster_file(args))
    servers = record.servers
    alive = [s.pid for _, _, s in servers if pid_alive(s.pid)]
    cpu = group_cpu_percent(alive, window_s=args.window) if alive else {}
    rows: list[dict[str, object]] = []
    with httpx2.Client() as client:
        for name, role, server in servers:
            healthy = server_healthy(server.url)
            tier = tier_usage(client, server.url) if healthy else None
            rows.append({
                "pair": name, "role": role, "url": server.url, "pid": server.pid,
                "alive": pid_alive(server.pid), "healthy": healthy,
                "cpu_percent": round(cpu.get(server.pid, 0.0), 1), "log": server.log,
                "tier": None if tier is None else tier.to_wire(),
            })
    up = sum(1 for row in rows if row["healthy"])
    if args.json:
        print(json.dumps({"model": record.model, "servers": rows}, indent=2))
    else:
        print(f"model {record.model}; {up}/{len(rows)} servers healthy "
              f"(CPU over {args.window:.0f} s, % of one core)")
        for row in rows:
            state = "up" if row["healthy"] else ("starting?" if row["alive"] else "DOWN")
            print(f"  {row['pair']!s:10} {row['role']!s:8} {row['url']!s:24} "
                  f"pid {row['pid']!s:<8} {state:9} cpu {row['cpu_percent']:5.1f}% "
                  f"{_tier_text(row['tier'])}")
    return 0 if up else 1


def cmd_demo(args: argparse.Namespace) -> int:
    if args.chat:
        from agentkv.local._demo import run_demo

        return run_demo(_cluster_file(args), turns=args.turns)
    from agentkv.local._demo_agent import run_agent_demo

    return run_agent_demo(_cluster_file(args), out=sys.stdout)


def cmd_calibrate(args: argparse.Namespace) -> int:
    from agentkv.bench._calibrate_cli import cmd_calibrate as run_calibrate

    return run_calibrate(args, cluster_file=_cluster_file(args))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="agentkv", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log every turn to stderr")
    sub = parser.add_subparsers(dest="command", required=True)

    def with_dtype(p: argparse.ArgumentParser) -> None:
        p.add_argument("--dtype", choices=DTYPES, help="serving dtype (default: bfloat16 where "
                       "the CPU has AVX512-BF16 or AMX, float32 elsewhere; docs/cpu.md)")
        p.add_argument("--cpu-isa", choices=("avx2",), help="run as on a CPU limited to this "
                       f"ISA, to reproduce its kernels and numerics (default ${ISA_ENV})")

    def with_cluster_file(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
        p.add_argument("--cluster-file", help="cluster file (default $AGENTKV_CLUSTER or "
                       ".agentkv/cluster.json)")
        return p

    up = with_cluster_file(sub.add_parser("up", help="start local CPU prefill/decode pairs"))
    up.add_argument("--pairs", type=int, help="number of P/D pairs (default 1)")
    up.add_argument("--prefill", type=int, help="start a pool instead of pairs: this many "
                    "prefill servers (with --decode; any prefill serves any session)")
    up.add_argument("--decode", type=int, help="decode servers of the pool (with --prefill)")
    up.add_argument("--model", choices=sorted(MODELS), help=f"default {DEFAULT_MODEL}")
    up.add_argument("--model-cache-dir", help="where prepared models live "
                    "(default ~/.cache/agentkv/models)")
    up.add_argument("--base-port", type=int, help="first HTTP port (default 18100)")
    up.add_argument("--base-side-channel-port", type=int, help="first NIXL port (default 15600)")
    up.add_argument("--kv-cache-gib", type=int, help="KV cache per server in GiB (default 1)")
    up.add_argument("--decode-kv-cache-gib", type=float,
                    help="KV cache of each decode server in GiB, fractions allowed (default: "
                    "--kv-cache-gib); a small decode puts its pinned KV under pressure "
                    "(docs/benchmarks.md, Decode pressure)")
    up.add_argument("--decoder-kv-blocks-ttl", type=float,
                    help="seconds decode pins turn-end KV (default 480)")
    up.add_argument("--kv-recompute-threshold", type=int, help="below this many missing tokens "
                    "prefill recomputes instead of pulling from decode (default "
                    f"{LocalClusterConfig.kv_recompute_threshold}; docs/operations.md)")
    up.add_argument("--max-model-len", type=int, help="the context in tokens (default 8192); "
                    "beyond the model's own, YaRN rope scaling stretches it")
    up.add_argument("--long-context", action="store_true",
                    help=f"a {LONG_CONTEXT_LEN}-token window (YaRN), enough for a coding "
                    f"agent's default prompt; KV cache {LONG_CONTEXT_KV_CACHE_GIB} GiB per "
                    "server unless --kv-cache-gib")
    up.add_argument("--startup-timeout-s", type=float, help="default 900")
    up.add_argument("--stock-connector", action="store_true",
                    help="run vLLM's NixlConnector without the agentkv extension")
    with_dtype(up)
    up.set_defaults(func=cmd_up)

    down = with_cluster_file(sub.add_parser("down", help="stop the servers `up` started"))
    down.set_defaults(func=cmd_down)

    status = with_cluster_file(sub.add_parser("status", help="health and CPU of each server"))
    status.add_argument("--json", action="store_true")
    status.add_argument("--window", type=float, default=2.0, help="CPU sampling window (s)")
    status.set_defaults(func=cmd_status)

    demo = with_cluster_file(sub.add_parser("demo", help="run the example tool agent"))
    demo.add_argument("--chat", action="store_true",
                      help="a plain multi-turn chat instead of the tool agent")
    demo.add_argument("--turns", type=int, default=4, help="turns of the --chat demo")
    demo.set_defaults(func=cmd_demo)

    from agentkv.bench._calibrate_cli import add_parser as add_calibrate
    from agentkv.bench._cli import add_parser as add_bench
    from agentkv.proxy._cli import add_parser as add_proxy

    add_proxy(sub)
    add_bench(sub)
    add_calibrate(sub).set_defaults(func=cmd_calibrate)

    prep = sub.add_parser("prepare-model", help="prepare a local model into the cache")
    prep.add_argument("--model", choices=sorted(MODELS), default=DEFAULT_MODEL)
    prep.add_argument("--model-cache-dir")
    with_dtype(prep)
    prep.set_defaults(func=cmd_prepare_model)
    return parser


def _configure_logging(verbose: bool) -> None:
    # The library only emits events; the CLI decides where they go: stderr, so that stdout
    # carries just the command's output (tables, JSON).
    configure_logging(logging.INFO if verbose else logging.WARNING)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _configure_logging(args.verbose)
    try:
        return int(args.func(args))
    except AgentKVError as exc:
        print(f"agentkv: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
