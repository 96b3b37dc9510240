"""What the user sees: the progress bar, the plot file, the summary table, the CLI flags."""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import shlex

import pytest

from agentkv.bench import BenchConfig, Mode, plot_ttft
from agentkv.bench._cli import _config, add_parser, cmd_bench, command_line, summary_table
from agentkv.bench._progress import ProgressBar
from agentkv.bench._samples import TurnSample


def sample(ok=True):
    return TurnSample(mode=Mode.AGENTKV, session=1, turn=2, ttft_s=0.25, total_s=1.0,
                      prompt_tokens=900, reused_tokens=880, ideal_reused_tokens=880,
                      generated_tokens=10, error=None if ok else "boom")


def test_progress_writes_a_line_per_turn_when_not_on_a_terminal():
    out = io.StringIO()
    times = iter([0.0, 10.0, 20.0])
    bar = ProgressBar(2, stream=out, clock=lambda: next(times))
    bar.start()
    bar.update(sample())
    bar.update(sample(ok=False))
    bar.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 3
    assert "1/2" in lines[1]
    assert "~10s left" in lines[1]
    assert "agentkv s1 t2: ttft 250 ms, reused 880/900" in lines[1]
    assert lines[2].endswith("FAILED")
    assert "#" * 24 in lines[2]


def report(turns=3):
    rows = [{"turn": t, "ttft_ms": [1000.0 * t, 2000.0 * t], "prompt_tokens": [1, 1],
             "reused_tokens": [0, 0], "ideal_reused_tokens": [0, 0]} for t in range(1, turns + 1)]
    summary = {"ttft_p50_ms_after_first_turn": 3000.0, "ttft_p90_ms_after_first_turn": 5000.0,
               "reuse_vs_ideal": 0.0, "throughput_tokens_per_s": 12.5}
    fast = [{**row, "ttft_ms": [100.0, None]} for row in rows]
    return {
        "config": {"turns": turns, "sessions": 2, "context_tokens": 2048, "tool_tokens": 256},
        "modes": {
            "disagg": {"turns": rows, "summary": summary},
            "agentkv": {"turns": fast, "summary": {**summary, "ttft_p50_ms_after_first_turn": 300.0,
                                                   "reuse_vs_ideal": 0.999}},
        },
    }


def test_the_plot_is_a_png_file(tmp_path):
    path = plot_ttft(report(), tmp_path / "ttft.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_summary_table_shows_each_mode_and_its_speedup_over_disagg():
    table = summary_table(report())
    assert table.splitlines()[1].split()[0] == "disagg"
    assert "10.0x" in table.splitlines()[2]
    assert "99.9%" in table


def parse(argv):
    parser = argparse.ArgumentParser(prog="agentkv")
    add_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def test_the_flags_map_onto_the_config_and_back_to_the_same_command():
    argv = ["bench", "--cluster-file", "c.json", "--modes", "agentkv,disagg", "--sessions", "3",
            "--turns", "5", "--context-tokens", "1024", "--tool-tokens", "128",
            "--output-tokens", "32", "--think-time", "1.5", "--time-scale", "0.25",
            "--concurrency", "2", "--seed", "7",
            "--json", "out.json", "--plot", "out.png", "--no-stream"]
    args = parse(argv)
    config = _config(args)
    assert config == BenchConfig(modes=(Mode.DISAGG, Mode.AGENTKV), sessions=3, turns=5,
                                 context_tokens=1024, tool_tokens=128, output_tokens=32,
                                 think_time_s=1.5, time_scale=0.25, concurrency=2, seed=7,
                                 stream=False,
                                 run_id=config.run_id)
    line = command_line(config, cluster_file=args.cluster_file, json_out="out.json",
                        plot="out.png")
    again = parse(shlex.split(line)[1:])
    reparsed = _config(again)
    assert reparsed == dataclasses.replace(config, run_id=reparsed.run_id)


def test_the_defaults_are_the_issue_targets_full_run():
    config = _config(parse(["bench", "--json", "x.json"]))
    assert (config.turns, config.context_tokens, config.stream) == (8, 2048, True)
    assert config.modes == (Mode.DISAGG, Mode.AFFINITY, Mode.AGENTKV)


def test_json_output_is_required():
    with pytest.raises(SystemExit):
        parse(["bench"])


def test_the_summary_table_prints_what_the_limit_computed_and_agentkv_over_the_limit():
    base = report()
    limit_summary = {**base["modes"]["agentkv"]["summary"], "ttft_p50_ms_after_first_turn": 250.0,
                     "computed_tokens_mean_after_first_turn": 301.5,
                     "old_tokens_recomputed_max_after_first_turn": 127}
    data = {
        **base,
        "modes": {**base["modes"], "limit": {"turns": base["modes"]["agentkv"]["turns"],
                                             "summary": limit_summary}},
        "ratios": {"agentkv_vs_limit": {"ttft_p50_after_first_turn": 1.2,
                                        "by_turn": [None, 1.1, 1.3]}},
    }
    lines = summary_table(data).splitlines()
    assert lines[3].split()[0] == "limit"
    assert "limit computed per turn >= 2: 301.5 tokens (mean), at most 127 of them" in lines[4]
    assert lines[5] == "agentkv / limit TTFT: p50 1.20; by turn -, 1.10, 1.30"


def test_every_mode_has_a_colour_and_a_marker_of_its_own():
    from agentkv.bench._plot import STYLES, style_of

    styles = [style_of(mode.value) for mode in Mode]
    assert len({color for color, _ in styles}) == len(Mode)
    assert len({marker for _, marker in styles}) == len(Mode)
    assert set(STYLES) >= {mode.value for mode in Mode}
    taken = set(styles)
    spare = style_of("a-mode-added-later", taken=taken)
    assert spare not in taken
    assert style_of("another-new-one", taken=taken | {spare}) != spare


def test_from_report_redraws_a_saved_report_without_running(tmp_path, capsys):
    saved = tmp_path / "saved.json"
    saved.write_text(json.dumps(report()))
    args = parse(["bench", "--from-report", str(saved), "--plot", str(tmp_path / "again.png")])
    assert cmd_bench(args) == 0
    assert (tmp_path / "again.png").read_bytes().startswith(b"\x89PNG")
    assert "agentkv" in capsys.readouterr().out
