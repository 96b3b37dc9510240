"""``agentkv bench``: the command-line edge of the benchmark (flags, logging, files, exit code).

Wired into ``agentkv.cli`` with ``add_parser(subparsers)``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import shlex
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx2
import structlog

from agentkv import ConfigError
from agentkv.bench._config import DEFAULT_MODES, BenchConfig, Mode, parse_modes
from agentkv.bench._modes import ClusterTarget
from agentkv.bench._progress import ProgressBar
from agentkv.bench._report import speedups
from agentkv.bench._run import run_bench
from agentkv.bench._trace import SAMPLE_TRACE, ReplayPlan, load_trace, plan_replay

__all__ = ["add_parser", "cmd_bench"]

_DEFAULTS = BenchConfig(run_id="0")


def add_parser(subparsers: Any) -> None:
    """Register ``bench`` on the ``agentkv`` command's subparsers."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "bench",
        help="multi-turn agent benchmark: modes side by side, TTFT and reuse per turn",
        description="Run the same synthetic agent sessions in several serving modes, interleaved, "
        "and report TTFT, prefill reuse and throughput per mode and turn (docs/benchmarks.md).",
    )
    p.add_argument("--cluster-file", help="cluster file (default $AGENTKV_CLUSTER or "
                   ".agentkv/cluster.json)")
    p.add_argument("--modes", default=",".join(m.value for m in DEFAULT_MODES),
                   help=f"comma-separated: {', '.join(Mode)} (default %(default)s)")
    p.add_argument("--sessions", type=int, default=_DEFAULTS.sessions,
                   help="sessions per mode (default %(default)s)")
    p.add_argument("--turns", type=int, default=_DEFAULTS.turns,
                   help="turns per session (default %(default)s)")
    p.add_argument("--context-tokens", type=int, default=_DEFAULTS.context_tokens,
                   help="system prompt with tool schemas, in tokens (default %(default)s)")
    p.add_argument("--tool-tokens", type=int, default=_DEFAULTS.tool_tokens,
                   help="tool result per turn, in tokens (default %(default)s)")
    p.add_argument("--output-tokens", type=int, default=_DEFAULTS.output_tokens,
                   help="median model output per turn, in tokens (default %(default)s)")
    p.add_argument("--think-time", type=float, default=_DEFAULTS.think_time_s,
                   help="mean pause between a session's turns, seconds (default %(default)s)")
    p.add_argument("--time-scale", type=float, default=_DEFAULTS.time_scale,
                   help="pauses last think time x this in real time; the SDK is told the full "
                   "pause (default %(default)s)")
    p.add_argument("--concurrency", type=int, default=None,
                   help=f"turns in flight at once (default {_DEFAULTS.concurrency}; with --trace: "
                   "no cap, the trace's timestamps decide)")
    p.add_argument("--seed", type=int, default=_DEFAULTS.seed,
                   help="workload seed (default %(default)s)")
    p.add_argument("--trace", metavar="FILE",
                   help="replay this trace (Mooncake JSONL, or kv-cache-tester conversation "
                   "JSON or a folder of them) instead of synthetic sessions; 'sample' is the "
                   "shipped Mooncake excerpt (docs/benchmarks.md, Trace replay)")
    p.add_argument("--trace-limit", type=int, metavar="N",
                   help="replay only the trace's first N requests")
    p.add_argument("--length-scale", type=float, default=_DEFAULTS.length_scale,
                   help="multiply the trace's lengths by this (default %(default)s)")
    p.add_argument("--max-model-len", type=int, default=_DEFAULTS.max_model_len,
                   help="the served context: trace turns beyond it end their session "
                   "(default %(default)s)")
    p.add_argument("--json", required=True, metavar="OUT", help="write the report here")
    p.add_argument("--plot", metavar="PNG", help="also write the TTFT-by-turn plot here")
    p.add_argument("--no-stream", action="store_true",
                   help="time whole non-streamed turns (not true TTFT); for servers without "
                   "agentkv's streamed-handle plugin")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument("--log-level", default="warning",
                   choices=("debug", "info", "warning", "error"),
                   help="structlog events on stderr at or above this level (default %(default)s)")
    p.set_defaults(func=cmd_bench)


def _trace_path(name: str) -> Path:
    path = Path(name)
    return SAMPLE_TRACE if name == "sample" and not path.exists() else path


def _replay(args: argparse.Namespace) -> ReplayPlan | None:
    """The planned trace replay of ``--trace``, or ``None`` for synthetic sessions."""
    if not args.trace:
        return None
    if args.trace_limit is not None and args.trace_limit < 1:
        raise ConfigError(f"--trace-limit must be >= 1, got {args.trace_limit}")
    plan = plan_replay(load_trace(_trace_path(args.trace)), limit=args.trace_limit,
                       length_scale=args.length_scale, max_model_len=args.max_model_len)
    if not plan.sessions:
        raise ConfigError(f"no session of {args.trace} fits --max-model-len {args.max_model_len}"
                          " (lower --length-scale)")
    return plan


def _config(args: argparse.Namespace, replay: ReplayPlan | None = None) -> BenchConfig:
    modes = parse_modes(args.modes)
    concurrency = args.concurrency
    if concurrency is None:
        # A trace's arrivals set its concurrency: no cap beyond one turn per lane.
        concurrency = (_DEFAULTS.concurrency if replay is None
                       else len(modes) * len(replay.sessions))
    return BenchConfig(
        modes=modes,
        sessions=args.sessions if replay is None else len(replay.sessions),
        turns=args.turns if replay is None else replay.max_turns,
        context_tokens=args.context_tokens,
        tool_tokens=args.tool_tokens,
        output_tokens=args.output_tokens,
        think_time_s=args.think_time,
        time_scale=args.time_scale,
        concurrency=concurrency,
        seed=args.seed,
        stream=not args.no_stream,
        trace=args.trace,
        trace_limit=args.trace_limit,
        length_scale=args.length_scale,
        max_model_len=args.max_model_len,
    )


def _cluster_file(args: argparse.Namespace) -> Path:
    if args.cluster_file:
        return Path(args.cluster_file)
    from agentkv.local._config import default_cluster_file

    return default_cluster_file()


def _read_spec(path: Path) -> dict[str, Any]:
    try:
        spec = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"no cluster file at {path}; start one with `agentkv up`") from None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cluster file {path} is unreadable: {exc}") from exc
    if not isinstance(spec, dict) or not spec.get("pairs") or not spec.get("model"):
        raise ConfigError(f"cluster file {path} has no 'model' and 'pairs'")
    return spec


def command_line(config: BenchConfig, *, cluster_file: Path, json_out: str,
                 plot: str | None) -> str:
    """The command that reruns ``config`` (recorded in the report)."""
    argv = [
        "agentkv", "bench", "--cluster-file", str(cluster_file),
        "--modes", ",".join(m.value for m in config.modes),
    ]
    if config.trace is None:
        argv += [
            "--sessions", str(config.sessions), "--turns", str(config.turns),
            "--context-tokens", str(config.context_tokens),
            "--tool-tokens", str(config.tool_tokens),
            "--output-tokens", str(config.output_tokens),
            "--think-time", f"{config.think_time_s:g}",
        ]
    else:
        argv += ["--trace", config.trace]
        if config.trace_limit is not None:
            argv += ["--trace-limit", str(config.trace_limit)]
        argv += ["--length-scale", f"{config.length_scale:g}",
                 "--max-model-len", str(config.max_model_len)]
    argv += [
        "--time-scale", f"{config.time_scale:g}",
        "--concurrency", str(config.concurrency), "--seed", str(config.seed), "--json", json_out,
    ]
    if plot:
        argv += ["--plot", plot]
    if not config.stream:
        argv.append("--no-stream")
    return shlex.join(argv)


def _configure_logging(level: str) -> None:
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelNamesMapping()[
            level.upper()]),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
    )


def _fmt(value: float | None, unit: str = "") -> str:
    return "-" if value is None else f"{value:,.1f}{unit}"


def summary_table(report: Mapping[str, Any]) -> str:
    """A plain-text table of each mode's summary and speedup over disagg."""
    ratio = speedups(report)
    lines = ["mode        TTFT p50 (ms)  TTFT p90 (ms)  reuse/ideal  tokens/s  vs disagg"]
    for mode, block in report["modes"].items():
        s = block["summary"]
        reuse = s["reuse_vs_ideal"]
        lines.append(
            f"{mode:<10}  {_fmt(s['ttft_p50_ms_after_first_turn']):>13}  "
            f"{_fmt(s['ttft_p90_ms_after_first_turn']):>13}  "
            f"{'-' if reuse is None else f'{100 * reuse:.1f}%':>11}  "
            f"{_fmt(s['throughput_tokens_per_s']):>8}  "
            f"{_fmt(ratio.get(mode), 'x'):>9}"
        )
    for mode, block in report["modes"].items():
        s = block["summary"]
        if "paused_decode_tokens_mean" in s:
            lines.append(
                f"{mode} through a pause: {_fmt(s['paused_decode_tokens_mean'])} tokens pinned "
                f"on decode, {_fmt(s['paused_tier_tokens_mean'])} in the file tier (mean)"
            )
    for mode, block in report["modes"].items():
        s = block["summary"]
        if "computed_tokens_mean_after_first_turn" in s:
            old = s["old_tokens_recomputed_max_after_first_turn"]
            lines.append(
                f"{mode} computed per turn >= 2: {_fmt(s['computed_tokens_mean_after_first_turn'])}"
                f" tokens (mean), at most {'-' if old is None else old} of them from the "
                "previous turn (prefix caching keeps whole blocks only)"
            )
    workload = report.get("config", {}).get("workload", {})
    if workload.get("kind") == "trace":
        lines.append(
            f"trace {workload['file']}: {workload['requests']} requests in "
            f"{workload['sessions']} sessions; {workload['clipped_requests']} requests clipped, "
            f"{workload['skipped_sessions']} sessions skipped (max-model-len)"
        )
    for name, block in report.get("ratios", {}).items():
        turns = ", ".join("-" if r is None else f"{r:.2f}" for r in block["by_turn"])
        overall = block["ttft_p50_after_first_turn"]
        p50 = "-" if overall is None else f"{overall:.2f}"
        lines.append(f"{name.replace('_vs_', ' / ')} TTFT: p50 {p50}; by turn {turns}")
    return "\n".join(lines)


def cmd_bench(args: argparse.Namespace) -> int:
    """Run the benchmark; 0 when every turn succeeded, 1 when some failed (report written)."""
    replay = _replay(args)
    config = _config(args, replay)
    cluster_file = _cluster_file(args)
    spec = _read_spec(cluster_file)
    _configure_logging(args.log_level)
    total = config.total_turns if replay is None else len(config.modes) * replay.requests
    progress = None if args.no_progress else ProgressBar(total)

    async def main() -> dict[str, Any]:
        transport = httpx2.AsyncHTTPTransport(
            limits=httpx2.Limits(max_connections=256, max_keepalive_connections=64)
        )
        try:
            return await run_bench(config, target=ClusterTarget(spec=spec, transport=transport),
                                   on_turn=progress.update if progress else None, replay=replay)
        finally:
            await transport.aclose()

    if progress:
        progress.start()
    try:
        report = asyncio.run(main())
    finally:
        if progress:
            progress.close()
    report["config"]["command"] = command_line(config, cluster_file=cluster_file,
                                               json_out=args.json, plot=args.plot)
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    if args.plot:
        from agentkv.bench._plot import plot_ttft

        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        plot_ttft(report, args.plot)
    print(summary_table(report))
    errors = report.get("errors", [])
    if errors:
        print(f"{len(errors)} turn(s) failed; first: {errors[0]['error']}", file=sys.stderr)
        return 1
    return 0
