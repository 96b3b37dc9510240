"""``agentkv calibrate``: the command-line edge (flags, the table, the cluster file).

Wired into ``agentkv.cli`` with ``add_parser(subparsers)``. The fitted model goes into the cluster
file as its ``route_cost`` object, which ``Cluster.from_file`` reads into ``CachePolicy.route``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx2

from agentkv import AsyncCluster, ConfigError, RouteCostModel
from agentkv._core import JSONDecodeError, Poster, loads
from agentkv.bench._calibrate import CalibrateConfig, Calibration, calibrate

__all__ = ["add_parser", "cmd_calibrate", "crossovers", "render", "write_route_cost"]

# The held context at which the new-token crossover is given, and the append at which the
# context crossover is: a tool result on a coding agent's history.
CROSSOVER_HELD = 4096
CROSSOVER_NEW = 64


def crossovers(model: RouteCostModel, *, max_model_len: int | None) -> dict[str, int | None]:
    """Where the model's routes cross: the new tokens above which a pull beats decode's local
    prefill (after ``CROSSOVER_HELD`` tokens), and the context above which a pull beats a
    recompute (with ``CROSSOVER_NEW`` new tokens); ``None``: not within the context."""
    context = max_model_len or 32_768
    held = min(CROSSOVER_HELD, context // 2)
    return {
        "held": held,
        "pull_beats_local_above_new_tokens": model.pull_beats_local_above(
            held=held, limit=context - held),
        "new": CROSSOVER_NEW,
        "pull_beats_recompute_above_context": model.pull_beats_recompute_above(
            new=CROSSOVER_NEW, limit=context - CROSSOVER_NEW),
    }


def _ms(seconds: float) -> str:
    return "-" if math.isnan(seconds) else f"{seconds * 1e3:.0f}"  # NaN: not measured


def render(cal: Calibration) -> str:
    """The measurements beside the model's prices, the model, and its crossovers."""
    m = cal.model
    lines = ["context  P leg cold  handover  decode cold | pull P leg (pulled)  "
             "decode +append | model: P leg  handover  decode cold  pull P leg"]
    for r in cal.rows:
        pull_model = m.leg_s + m.transfer_s(r.pulled_tokens) + m.prefill_s(
            held=r.tokens, new=64)
        lines.append(
            f"{r.tokens:7d}  {_ms(r.recompute_prefill_s):>10}  {_ms(r.recompute_handover_s):>8}"
            f"  {_ms(r.decode_cold_s):>11} | {_ms(r.pull_prefill_s):>10} ({r.pulled_tokens:5d})"
            f"  {_ms(r.decode_append_s):>14}"
            f" | {_ms(m.leg_s + m.prefill_s(held=0, new=r.tokens)):>12}"
            f"  {_ms(m.leg_s + m.transfer_s(r.tokens)):>8}"
            f"  {_ms(m.decode_s(held=0, new=r.tokens)):>11}  {_ms(pull_model):>10}"
        )
    lines.append("(ms; P leg cold and handover: a recompute turn's legs; decode cold: a turn on "
                 "the decode route alone; pull: the next turn's P leg with the handle)")
    if cal.tax:
        lines.append("decode-route append beside a streaming session (its next token waits once):")
        for t in cal.tax:
            lines.append(f"  {t.new:5d} new tokens: append {_ms(t.append_s)} ms, gap "
                         f"{_ms(t.gap_s)} ms over the stream's median {_ms(t.itl_s)} ms: "
                         f"+{_ms(t.tax_s)} ms "
                         f"(model: {_ms(m.decode_local_s(held=256, new=t.new))})")
    lines.append(
        f"model: leg {m.leg_s * 1e3:.1f} ms; prefill {m.prefill_fixed_s * 1e3:.1f} ms + "
        f"{m.prefill_tokens_per_s:,.0f} tokens/s "
        f"+ {m.prefill_s_per_token2 * 1e9:.3f} ns/token^2; handover "
        f"{m.transfer_fixed_s * 1e3:.1f} ms + {m.transfer_bytes_per_s / 1e9:.2f} GB/s at "
        f"{m.bytes_per_token:,} B/token; decode-local {m.decode_fixed_s * 1e3:.1f} ms + "
        f"{m.decode_tokens_per_s:,.0f} tokens/s + {m.decode_s_per_token2 * 1e9:.3f} ns/token^2"
    )
    cross = crossovers(m, max_model_len=cal.max_model_len)
    local, recompute = (cross["pull_beats_local_above_new_tokens"],
                        cross["pull_beats_recompute_above_context"])
    lines.append(
        f"crossover: after {cross['held']} tokens, a pull beats decode-local prefill above "
        + (f"{local} new tokens" if local else "no append within the context (decode's "
           "budgets decide)")
    )
    lines.append(
        f"crossover: with {cross['new']} new tokens, a pull beats a recompute above "
        + (f"{recompute} tokens of context" if recompute else "no context within the window")
    )
    lines.extend(f"note: {note}" for note in cal.notes)
    return "\n".join(lines)


def write_route_cost(path: Path, model: RouteCostModel) -> None:
    """Set the cluster file's ``route_cost`` (the rest kept as it was), atomically."""
    try:
        spec: Any = loads(path.read_bytes())
    except (OSError, JSONDecodeError) as exc:
        raise ConfigError(f"cluster file {path} is unreadable: {exc}") from exc
    if not isinstance(spec, dict):
        raise ConfigError(f"cluster file {path} is not an object")
    spec["route_cost"] = model.to_wire()
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as out:
        json.dump(spec, out, indent=2)
        out.write("\n")
    os.replace(tmp, path)


def _progress(message: str) -> None:
    print(f"[agentkv] {message}", file=sys.stderr, flush=True)


def cmd_calibrate(args: argparse.Namespace, *, cluster_file: Path,
                  transport: httpx2.AsyncBaseTransport | Poster | None = None) -> int:
    """Run the calibration, print it, write the model into ``cluster_file`` (``transport``:
    what the cluster sends through; tests pass the fake's)."""
    config = CalibrateConfig(
        lengths=tuple(args.lengths) if args.lengths else None,
        max_length=args.max_length,
        quick=args.quick,
    )

    async def run() -> Calibration:
        options: dict[str, Any] = {} if transport is None else {"transport": transport}
        async with AsyncCluster.from_file(cluster_file, **options) as cluster:
            return await calibrate(cluster, config, progress=_progress)

    cal = asyncio.run(run())
    print(render(cal))
    if args.json:
        raw = {**dataclasses.asdict(cal),
               "crossovers": crossovers(cal.model, max_model_len=cal.max_model_len)}
        Path(args.json).write_text(json.dumps(raw, indent=2) + "\n")
    if not args.dry_run:
        write_route_cost(cluster_file, cal.model)
        _progress(f"calibrate: route_cost written to {cluster_file}")
    return 0


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """The ``calibrate`` subcommand (``agentkv.cli`` sets its ``func``)."""
    p: argparse.ArgumentParser = sub.add_parser(
        "calibrate", help="measure the route cost model on this cluster, into its cluster file")
    p.add_argument("--cluster-file", help="cluster file (default $AGENTKV_CLUSTER or "
                   ".agentkv/cluster.json)")
    p.add_argument("--quick", action="store_true",
                   help="the fewest lengths (128, 512, 1024 tokens) and one append size")
    p.add_argument("--lengths", type=int, nargs="+", help="context lengths to measure (tokens)")
    p.add_argument("--max-length", type=int, help="the longest context measured "
                   "(default: the served context, 32768 at most)")
    p.add_argument("--dry-run", action="store_true", help="print, leave the cluster file alone")
    p.add_argument("--json", help="also write the measurements, the model and the crossovers "
                   "here")
    return p
