"""The decode-pressure workload's pure parts: the named workload's flags, eviction counts from
handle states, decode's sampled metrics, and what the summary prints of them."""

from __future__ import annotations

import argparse
import dataclasses
import shlex

import pytest

from agentkv import ConfigError
from agentkv.bench import BenchConfig, Mode
from agentkv.bench._cli import _config, add_parser, command_line, summary_table
from agentkv.bench._decode_watch import DecodeWatch, Reading, parse_reading, summarize_phase
from agentkv.bench._report import build_report, summarize
from agentkv.bench._samples import TurnSample

# Two lines as vLLM 0.32 prints them, among the others of its exposition.
METRICS = """\
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.875
vllm:kv_cache_usage_perc_other{engine="0"} 5.0
# TYPE vllm:num_preemptions counter
vllm:num_preemptions_total{engine="0",model_name="m"} 12.0
vllm:num_preemptions_created{engine="0",model_name="m"} 1.7e+09
vllm:prompt_tokens_total{engine="0",model_name="m"} 999.0
"""


def parse(argv):
    parser = argparse.ArgumentParser(prog="agentkv")
    add_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def test_the_pressure_workload_sets_the_flags_not_given_and_the_given_ones_win():
    config = _config(parse(["bench", "--workload", "pressure", "--json", "x.json"]))
    assert (config.sessions, config.turns, config.concurrency) == (32, 4, 4)
    assert config.context_tokens == 1024
    assert config.think_time_s == 20.0
    assert (config.pause, config.serial_modes) == ("tool-wait", True)
    mine = _config(parse(["bench", "--workload", "pressure", "--sessions", "40", "--pause",
                          "extend", "--no-serial-modes", "--json", "x.json"]))
    assert (mine.sessions, mine.pause, mine.serial_modes, mine.turns) == (40, "extend", False, 4)
    plain = _config(parse(["bench", "--json", "x.json"]))
    assert (plain.sessions, plain.pause, plain.serial_modes) == (2, "extend", False)


def test_the_recorded_command_reruns_the_pressure_workload_without_naming_it():
    args = parse(["bench", "--workload", "pressure", "--modes", "affinity,agentkv",
                  "--json", "x.json"])
    config = _config(args)
    line = command_line(config, cluster_file=args.cluster_file or "c.json", json_out="x.json",
                        plot=None)
    assert "--pause tool-wait" in line
    assert "--serial-modes" in line
    again = _config(parse(shlex.split(line)[1:]))
    assert again == dataclasses.replace(config, run_id=again.run_id)


def test_an_unknown_pause_is_refused():
    with pytest.raises(ConfigError, match="pause must be one of extend, tool-wait"):
        BenchConfig(pause="forever")  # type: ignore[arg-type]


def test_the_help_names_each_flag_and_the_pressure_default(capsys):
    with pytest.raises(SystemExit):
        parse(["bench", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for flag in ("--workload", "--pause", "--serial-modes"):
        assert flag in text
    assert "default 2; pressure: 32" in text


def turn(state, *, turn=2, reused=90, ideal=100, mode=Mode.AGENTKV, session=0, ttft=0.1):
    return TurnSample(mode=mode, session=session, turn=turn, ttft_s=ttft, total_s=1.0,
                      prompt_tokens=200, reused_tokens=reused, ideal_reused_tokens=ideal,
                      generated_tokens=10, handle_state=state)


@pytest.mark.parametrize(
    ("state", "evicted"),
    [("expired", 1), ("consumed", 1), ("invalidated", 1), ("diverged", 1),
     ("attached", 0), ("none", 0), ("below_threshold", 0), ("unused", 0), ("tier", 0)],
)
def test_an_eviction_is_a_turn_whose_handle_could_not_be_used(state, evicted):
    summary = summarize([turn("none", turn=1), turn(state)], handles=True)
    assert summary["evictions"] == evicted
    assert summary["handle_states_after_first_turn"] == {state: 1}  # turn 1 not counted


def test_tier_resumes_and_their_shortfalls_are_counted():
    samples = [turn("tier"), turn("tier", reused=100), turn("tier", reused=0), turn("expired")]
    summary = summarize(samples, handles=True)
    assert (summary["tier_resumes"], summary["tier_shortfalls"]) == (3, 2)
    assert "evictions" not in summarize(samples)


def test_readings_take_the_two_series_and_nothing_that_only_starts_like_them():
    assert parse_reading(METRICS) == Reading(kv_usage=0.875, preemptions=12.0)
    assert parse_reading("") == Reading(kv_usage=None, preemptions=None)
    two_engines = (
        'vllm:kv_cache_usage_perc{engine="0"} 0.25\nvllm:kv_cache_usage_perc{engine="1"} 0.5\n'
        'vllm:num_preemptions_total{engine="0"} 1\nvllm:num_preemptions_total{engine="1"} 2\n'
    )
    assert parse_reading(two_engines) == Reading(kv_usage=0.5, preemptions=3.0)
    assert parse_reading("vllm:kv_cache_usage_perc NaN\n").kv_usage is None


def test_a_phase_counts_preemptions_from_its_first_reading_to_its_last():
    rows = [Reading(kv_usage=0.5, preemptions=4.0), Reading(kv_usage=None, preemptions=None),
            Reading(kv_usage=1.0, preemptions=9.0)]
    assert summarize_phase(rows) == {"samples": 3, "kv_usage_peak": 1.0, "kv_usage_mean": 0.75,
                                     "preemptions": 5}
    restarted = [Reading(kv_usage=0.1, preemptions=9.0), Reading(kv_usage=0.1, preemptions=0.0)]
    assert summarize_phase(restarted)["preemptions"] == 0
    assert summarize_phase([Reading(kv_usage=None, preemptions=None)]) == {
        "samples": 1, "kv_usage_peak": None, "kv_usage_mean": None, "preemptions": None}


def watch():
    w = DecodeWatch(servers=("http://d0", "http://d1"))
    for phase, usage, count in (("affinity", 0.25, 0.0), ("affinity", 0.5, 0.0),
                                ("agentkv", 0.75, 2.0), ("agentkv", 1.0, 5.0)):
        w.record(phase, "http://d0", Reading(kv_usage=usage, preemptions=count))
        w.record(phase, "http://d1", Reading(kv_usage=usage / 2, preemptions=count))
    return w


def test_with_serial_modes_each_mode_gets_its_phases_decode_metrics_and_the_ratio_to_affinity():
    config = BenchConfig(modes=(Mode.AFFINITY, Mode.AGENTKV), sessions=1, turns=2,
                         serial_modes=True)
    samples = [turn("none", mode=mode, turn=t, ttft=ttft)
               for mode, ttfts in ((Mode.AFFINITY, (1.0, 0.4)), (Mode.AGENTKV, (1.0, 0.2)))
               for t, ttft in enumerate(ttfts, start=1)]
    report = build_report(config, samples, environment={}, decode=watch())
    agentkv = report["modes"]["agentkv"]["summary"]
    assert agentkv["decode_kv_usage_peak"] == 1.0
    assert agentkv["decode_kv_usage_mean"] == round((0.875 + 0.4375) / 2, 4)
    assert agentkv["decode_preemptions"] == 6  # 3 on each server
    assert report["modes"]["affinity"]["summary"]["decode_preemptions"] == 0
    assert "evictions" not in report["modes"]["affinity"]["summary"]  # no handle to lose
    assert report["decode"]["phases"]["agentkv"]["http://d1"]["kv_usage_peak"] == 0.5
    assert report["ratios"]["agentkv_vs_affinity"]["ttft_p50_after_first_turn"] == 0.5
    interleaved = build_report(dataclasses.replace(config, serial_modes=False), samples,
                               environment={}, decode=watch())
    assert "decode_kv_usage_peak" not in interleaved["modes"]["agentkv"]["summary"]


def test_the_summary_prints_evictions_and_decode_memory_per_phase():
    config = BenchConfig(modes=(Mode.AFFINITY, Mode.AGENTKV), sessions=1, turns=3,
                         serial_modes=True)
    samples = [turn("none", mode=Mode.AFFINITY, turn=t) for t in (1, 2, 3)] + [
        turn("none", turn=1), turn("expired"), turn("tier", turn=3, reused=0)]
    lines = summary_table(build_report(config, samples, environment={}, decode=watch()))
    assert ("agentkv handles on turns >= 2: 1 evicted, 1 resumed from the tier (1 short); "
            "expired 1, tier 1") in lines
    assert ("decode http://d0 during agentkv: KV usage peak 100.0%, mean 87.5%, 3 preemptions "
            "(2 samples, every 0.5 s)") in lines
    assert "agentkv / affinity TTFT: p50 1.00; by turn 1.00, 1.00, 1.00" in lines
