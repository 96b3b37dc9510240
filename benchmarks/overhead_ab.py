"""The SDK's per-turn overhead of two revisions, measured in one run, alternating.

Runs ``benchmarks/sdk_overhead.py`` (turns only) of this checkout and of ``--base`` (a git
revision, checked out into a temporary worktree, each run importing its own tree's ``agentkv``)
one after the other, ``--rounds`` times, and reports each row's median over the rounds and the
ratio. Alternating spreads the machine's drift over both sides, so the ratio holds even where
the absolute numbers move between runs.

    .venv/bin/python benchmarks/overhead_ab.py --base 0ee2cfd [--rounds 3] [--sessions 30]
    .venv/bin/python benchmarks/overhead_ab.py --base 0ee2cfd --replay [--evict]
    .venv/bin/python benchmarks/overhead_ab.py --base 0ee2cfd --over-http
    .venv/bin/python benchmarks/overhead_ab.py --base 0ee2cfd [--replay | --over-http] --stream

``--replay`` and ``--over-http``: both sides run this tree's ``sdk_overhead.py`` in that mode (its
docstring says what each measures), each importing its own tree's SDK: with ``--over-http`` the
fake, this tree's, is served by a child process and each SDK sends with its default transport.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GIT = shutil.which("git") or "git"
ROW = re.compile(r"^(?P<name>\S.*?)\s{2,}(?P<median>[\d.]+)\s+(?P<p99>[\d.]+)$")


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def _run(tree: Path, args: argparse.Namespace) -> dict[str, float]:
    # One harness for both in these modes (older trees' scripts have neither).
    mode = ["--over-http"] if args.over_http else ["--replay"] if args.replay else []
    mode += ["--evict"] if args.evict else []
    mode += ["--stream"] if args.stream else []
    script = (ROOT if mode else tree) / "benchmarks" / "sdk_overhead.py"
    command = [
        sys.executable,
        str(script),
        "--idle-sessions", "1",  # 1, not 0: older revisions have no 0
        "--sessions", str(args.sessions),
        "--turns", str(args.turns),
        *mode,
    ]
    # ``python script.py`` puts the script's folder first on sys.path, not the tree: name it.
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run(command, cwd=tree, env=env, check=True, capture_output=True, text=True)
    rows = {}
    for line in out.stdout.splitlines():
        match = ROW.match(line.strip())
        if match:
            rows[match["name"]] = float(match["median"])
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="git revision to compare against")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sessions", type=int, default=30)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--over-http", action="store_true", help="see the module's doc")
    parser.add_argument("--replay", action="store_true", help="see the module's doc")
    parser.add_argument("--evict", action="store_true", help="with --replay: turns run cold")
    parser.add_argument(
        "--stream", action="store_true", help="with --replay or --over-http: streamed turns"
    )
    args = parser.parse_args()
    if args.over_http and args.replay:
        parser.error("--over-http and --replay are two measurements: run one at a time")
    if args.evict and not args.replay:
        parser.error("--evict goes with --replay")
    if args.stream and not (args.replay or args.over_http):
        parser.error("--stream goes with --replay or --over-http")

    with tempfile.TemporaryDirectory(prefix="agentkv-ab-") as scratch:
        base = Path(scratch) / "base"
        subprocess.run(
            [GIT, "worktree", "add", "--detach", str(base), args.base],
            cwd=ROOT, check=True, capture_output=True,
        )
        try:
            runs: dict[str, list[dict[str, float]]] = {"base": [], "this": []}
            for i in range(args.rounds):
                for side, tree in (("base", base), ("this", ROOT)):
                    print(f"[ab] round {i + 1}/{args.rounds}: {side}", file=sys.stderr, flush=True)
                    runs[side].append(_run(tree, args))
        finally:
            subprocess.run(
                [GIT, "worktree", "remove", "--force", str(base)], cwd=ROOT, check=False
            )

    print(f"SDK overhead per turn, median ms over {args.rounds} alternating rounds ({_cpu()})")
    print(f"{'':36} {args.base[:12]:>12} {'this tree':>12} {'this/base':>10}")
    for name in runs["this"][0]:
        before = statistics.median(r[name] for r in runs["base"] if name in r)
        after = statistics.median(r[name] for r in runs["this"])
        print(f"{name:36} {before:12.3f} {after:12.3f} {after / before:10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
