"""``agentkv bench``: the command-line edge of the benchmark (flags, logging, files, exit code).

Wired into ``agentkv.cli`` with ``add_parser(subparsers)``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx2

from agentkv import ConfigError
from agentkv._core import configure_logging
from agentkv.bench._config import (
    DEFAULT_MODES,
    PAUSES,
    WORKLOADS,
    BenchConfig,
    Mode,
    parse_modes,
)
from agentkv.bench._progress import ProgressBar
from agentkv.bench._report import speedups
from agentkv.bench._roles import role_lines
from agentkv.bench._run import run_bench
from agentkv.bench._target import ClusterTarget, check_spec
from agentkv.bench._trace import (
    CLAUDE_CODE_TRACE,
    SAMPLE_TRACE,
    ReplayPlan,
    load_trace,
    plan_replay,
)

__all__ = ["add_parser", "cmd_bench"]

_DEFAULTS = BenchConfig(run_id="0")
# Flags a named workload may set: flag dest -> BenchConfig field.
_PRESET_FIELDS = {
    "sessions": "sessions",
    "turns": "turns",
    "context_tokens": "context_tokens",
    "think_time": "think_time_s",
    "concurrency": "concurrency",
    "pause": "pause",
    "serial_modes": "serial_modes",
}


def _default(field: str) -> str:
    """The help text's default of ``field``: the plain one, and each named workload's own."""
    plain = getattr(_DEFAULTS, field)
    named = [f"{name}: {values[field]}" for name, values in WORKLOADS.items() if field in values]
    return f"default {plain}" + "".join(f"; {n}" for n in named)


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
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="synthetic",
                   help="named settings for the flags not given: 'pressure' is the decode-"
                   "pressure workload, more sessions than decode's memory keeps pinned, pausing "
                   "as agents do (docs/benchmarks.md, Decode pressure; default %(default)s)")
    p.add_argument("--sessions", type=int,
                   help=f"sessions per mode ({_default('sessions')})")
    p.add_argument("--turns", type=int, help=f"turns per session ({_default('turns')})")
    p.add_argument("--context-tokens", type=int,
                   help="system prompt with tool schemas, in tokens "
                   f"({_default('context_tokens')})")
    p.add_argument("--tool-tokens", type=int, default=_DEFAULTS.tool_tokens,
                   help="tool result per turn, in tokens (default %(default)s)")
    p.add_argument("--output-tokens", type=int, default=_DEFAULTS.output_tokens,
                   help="median model output per turn, in tokens (default %(default)s)")
    p.add_argument("--think-time", type=float,
                   help="mean pause between a session's turns, seconds "
                   f"({_default('think_time_s')})")
    p.add_argument("--time-scale", type=float, default=_DEFAULTS.time_scale,
                   help="pauses last think time x this in real time; the SDK is told the full "
                   "pause (default %(default)s)")
    p.add_argument("--concurrency", type=int, default=None,
                   help=f"turns in flight at once ({_default('concurrency')}; with --trace: "
                   "no cap, the trace's timestamps decide)")
    p.add_argument("--pause", choices=PAUSES,
                   help="what the SDK modes but tier do with decode's pin at a pause: 'extend' "
                   "it to cover the pause (an unlimited pin), or 'tool-wait' as an agent does, "
                   "session.tool_wait(offload='auto') until the next turn: the SDK's policy "
                   "keeps the pin or moves it to decode's file tier when the pause is long or "
                   f"decode's KV memory is full ({_default('pause')})")
    p.add_argument("--serial-modes", action=argparse.BooleanOptionalAction, default=None,
                   help="run the modes one after another instead of interleaved, each with "
                   "decode's memory to itself; decode's sampled KV usage and preemptions are "
                   f"then reported per mode ({_default('serial_modes')})")
    p.add_argument("--seed", type=int, default=_DEFAULTS.seed,
                   help="workload seed (default %(default)s)")
    p.add_argument("--trace", metavar="FILE",
                   help="replay this trace (Mooncake JSONL, or kv-cache-tester conversation "
                   "JSON or a folder of them, subagents included) instead of synthetic sessions; "
                   "'sample' is the shipped Mooncake excerpt, 'claude-code' the shipped Claude "
                   "Code conversations with subagents (docs/benchmarks.md, Trace replay)")
    p.add_argument("--trace-limit", type=int, metavar="N",
                   help="replay only the trace's first N requests")
    p.add_argument("--length-scale", type=float, default=_DEFAULTS.length_scale,
                   help="multiply the trace's lengths by this (default %(default)s)")
    p.add_argument("--max-model-len", type=int, default=_DEFAULTS.max_model_len,
                   help="the served context: trace turns beyond it end their session "
                   "(default %(default)s)")
    out = p.add_mutually_exclusive_group(required=True)
    out.add_argument("--json", metavar="OUT", help="write the report here")
    out.add_argument("--from-report", metavar="JSON",
                     help="run nothing: draw --plot and print the summary of this saved report")
    p.add_argument("--plot", metavar="PNG", help="also write the TTFT-by-turn plot here")
    p.add_argument("--no-stream", action="store_true",
                   help="time whole non-streamed turns (not true TTFT); for servers without "
                   "agentkv's streamed-handle plugin")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument("--log-level", default="warning",
                   choices=("debug", "info", "warning", "error"),
                   help="agentkv events on stderr at or above this level (default %(default)s)")
    p.set_defaults(func=cmd_bench)


def _trace_path(name: str) -> Path:
    path = Path(name)
    shipped = {"sample": SAMPLE_TRACE, "claude-code": CLAUDE_CODE_TRACE}
    return shipped[name] if name in shipped and not path.exists() else path


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


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    """The preset fields: each flag given, else the named workload's value, else the default."""
    preset = WORKLOADS[args.workload]
    out: dict[str, Any] = {}
    for dest, field in _PRESET_FIELDS.items():
        value = getattr(args, dest, None)
        out[field] = value if value is not None else preset.get(field, getattr(_DEFAULTS, field))
    return out


def _config(args: argparse.Namespace, replay: ReplayPlan | None = None) -> BenchConfig:
    modes = parse_modes(args.modes)
    if replay is not None and args.workload != "synthetic":
        raise ConfigError(f"--workload {args.workload} is synthetic sessions: not with --trace")
    settings = _settings(args)
    concurrency = settings["concurrency"]
    if args.concurrency is None and replay is not None:
        # A trace's arrivals set its concurrency: no cap beyond one turn per lane.
        concurrency = len(modes) * len(replay.sessions)
    return BenchConfig(
        modes=modes,
        sessions=settings["sessions"] if replay is None else len(replay.sessions),
        turns=settings["turns"] if replay is None else replay.max_turns,
        context_tokens=settings["context_tokens"],
        tool_tokens=args.tool_tokens,
        output_tokens=args.output_tokens,
        think_time_s=settings["think_time_s"],
        time_scale=args.time_scale,
        concurrency=concurrency,
        seed=args.seed,
        stream=not args.no_stream,
        trace=args.trace,
        trace_limit=args.trace_limit,
        length_scale=args.length_scale,
        max_model_len=args.max_model_len,
        pause=settings["pause"],
        serial_modes=settings["serial_modes"],
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
    return check_spec(spec, where=str(path))


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
    if config.pause != _DEFAULTS.pause:
        argv += ["--pause", config.pause]
    if config.serial_modes:
        argv.append("--serial-modes")
    if plot:
        argv += ["--plot", plot]
    if not config.stream:
        argv.append("--no-stream")
    return shlex.join(argv)


def _configure_logging(level: str) -> None:
    configure_logging(level)


def _fmt(value: float | None, unit: str = "") -> str:
    return "-" if value is None else f"{value:,.1f}{unit}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _pressure_lines(report: Mapping[str, Any]) -> list[str]:
    """What became of the SDK modes' handles, and decode's memory, per phase and server."""
    lines = []
    for mode, block in report["modes"].items():
        s = block["summary"]
        if "evictions" in s:
            states = ", ".join(f"{k} {v}" for k, v in s["handle_states_after_first_turn"].items())
            lines.append(
                f"{mode} handles on turns >= 2: {s['evictions']} evicted, {s['tier_resumes']} "
                f"resumed from the tier ({s['tier_shortfalls']} short); {states or '-'}"
            )
    decode = report.get("decode", {})
    for phase, servers in decode.get("phases", {}).items():
        for server, d in servers.items():
            preempted = "-" if d["preemptions"] is None else d["preemptions"]
            lines.append(
                f"decode {server} during {phase}: KV usage peak {_pct(d['kv_usage_peak'])}, "
                f"mean {_pct(d['kv_usage_mean'])}, {preempted} preemptions "
                f"({d['samples']} samples, every {decode['interval_s']:g} s)"
            )
    return lines


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
    lines += _pressure_lines(report)
    lines += role_lines(report)
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


def _redraw(args: argparse.Namespace) -> int:
    """A saved report's plot and summary, drawn again (after a change of the plot's styles)."""
    try:
        report = json.loads(Path(args.from_report).read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read the report {args.from_report}: {exc}") from exc
    if args.plot:
        from agentkv.bench._plot import plot_ttft

        plot_ttft(report, args.plot)
    print(summary_table(report))
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    """Run the benchmark; 0 when every turn succeeded, 1 when some failed (report written)."""
    if args.from_report:
        return _redraw(args)
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
