"""The JSON report: the issue's exact shape, nulls for missing turns, honest summaries."""

from __future__ import annotations

import pytest

from agentkv.bench import BenchConfig, Mode
from agentkv.bench._report import (
    build_report,
    median_by_turn,
    percentile,
    ratios,
    speedups,
    summarize,
)
from agentkv.bench._samples import TurnSample


def sample(mode=Mode.AGENTKV, session=0, turn=1, ttft=1.0, reused=0, ideal=0, error=None,
           prompt=100, generated=10, total=2.0):
    return TurnSample(mode=mode, session=session, turn=turn, ttft_s=ttft, total_s=total,
                      prompt_tokens=prompt, reused_tokens=reused, ideal_reused_tokens=ideal,
                      generated_tokens=generated, error=error)


def test_percentile_interpolates_linearly_like_numpy():
    assert percentile([5.0], 0.9) == 5.0
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 0.5) == 3.0
    assert percentile([10.0, 0.0], 0.25) == 2.5
    with pytest.raises(ValueError, match="no values"):
        percentile([], 0.5)


def test_summary_counts_turns_two_and_later_only():
    samples = [
        sample(turn=1, ttft=100.0),  # turn 1 never counts: nothing to reuse yet
        sample(turn=2, ttft=1.0, reused=90, ideal=100),
        sample(turn=3, ttft=3.0, reused=190, ideal=200),
    ]
    summary = summarize(samples)
    assert summary["ttft_p50_ms_after_first_turn"] == 2000.0
    assert summary["ttft_p90_ms_after_first_turn"] == 2800.0
    assert summary["reuse_vs_ideal"] == round(280 / 300, 5)
    assert summary["throughput_tokens_per_s"] == 5.0  # 30 tokens over 3 turns of 2 s


def test_failed_turns_are_left_out_of_the_summary():
    samples = [sample(turn=2, ttft=1.0, reused=100, ideal=100), sample(turn=3, error="boom")]
    assert summarize(samples)["ttft_p50_ms_after_first_turn"] == 1000.0
    assert summarize([sample(turn=1)]) == {
        "ttft_p50_ms_after_first_turn": None,
        "ttft_p90_ms_after_first_turn": None,
        "reuse_vs_ideal": None,
        "throughput_tokens_per_s": 5.0,
    }


def test_the_report_has_exactly_the_issue_shape_with_one_value_per_session():
    config = BenchConfig(modes=(Mode.DISAGG, Mode.AGENTKV), sessions=2, turns=2, run_id="r")
    samples = [
        sample(mode=mode, session=s, turn=t, ttft=0.5 * t, reused=10 * t, ideal=20 * (t - 1))
        for mode in config.modes for s in range(2) for t in (1, 2)
    ]
    report = build_report(config, samples, environment={"cluster": {"model": "m"}})
    assert set(report) == {"config", "modes"}
    assert report["config"]["cluster"] == {"model": "m"}
    assert report["config"]["sessions"] == 2
    assert list(report["modes"]) == ["disagg", "agentkv"]
    block = report["modes"]["agentkv"]
    assert set(block) == {"turns", "summary"}
    assert block["turns"][1] == {
        "turn": 2,
        "ttft_ms": [1000.0, 1000.0],
        "prompt_tokens": [100, 100],
        "reused_tokens": [20, 20],
        "ideal_reused_tokens": [20, 20],
    }
    issue = {
        "ttft_p50_ms_after_first_turn",
        "ttft_p90_ms_after_first_turn",
        "reuse_vs_ideal",
        "throughput_tokens_per_s",
    }
    assert set(report["modes"]["disagg"]["summary"]) == issue
    # An SDK mode also counts what became of its decode handle (issue 27's evictions).
    assert set(block["summary"]) == issue | {
        "handle_states_after_first_turn", "evictions", "tier_resumes", "tier_shortfalls",
    }


def test_missing_and_failed_turns_are_null_and_listed_under_errors():
    config = BenchConfig(modes=(Mode.AGENTKV,), sessions=2, turns=2, run_id="r")
    samples = [sample(session=0, turn=1), sample(session=1, turn=1, error="ServerError: 500")]
    report = build_report(config, samples, environment={})
    rows = report["modes"]["agentkv"]["turns"]
    assert rows[0]["ttft_ms"] == [1000.0, None]
    assert rows[1]["prompt_tokens"] == [None, None]
    assert report["errors"] == [
        {"mode": "agentkv", "session": 1, "turn": 1, "error": "ServerError: 500"}
    ]


def test_speedups_and_medians_read_the_report():
    report = {"modes": {
        "disagg": {"summary": {"ttft_p50_ms_after_first_turn": 1000.0},
                   "turns": [{"ttft_ms": [1.0, 3.0, None]}, {"ttft_ms": [None]}]},
        "agentkv": {"summary": {"ttft_p50_ms_after_first_turn": 125.0}, "turns": []},
    }}
    assert speedups(report) == {"disagg": 1.0, "agentkv": 8.0}
    assert speedups({"modes": {"agentkv": report["modes"]["agentkv"]}}) == {}
    assert median_by_turn(report["modes"]["disagg"]) == [2.0, None]


def _mode(p50, by_turn):
    return {"summary": {"ttft_p50_ms_after_first_turn": p50},
            "turns": [{"ttft_ms": [v]} for v in by_turn]}


def test_ratios_put_agentkv_against_the_oracle_and_disagg_per_turn():
    report = {"modes": {
        "disagg": _mode(400.0, [500.0, 400.0, 800.0]),
        "agentkv": _mode(110.0, [500.0, 100.0, None]),
        "oracle": _mode(100.0, [400.0, 100.0, 120.0]),
    }}
    assert ratios(report) == {
        "agentkv_vs_oracle": {"ttft_p50_after_first_turn": 1.1, "by_turn": [1.25, 1.0, None]},
        "agentkv_vs_disagg": {"ttft_p50_after_first_turn": 0.275, "by_turn": [1.0, 0.25, None]},
    }
    # Only the references that ran; nothing without agentkv.
    assert list(ratios({"modes": {k: report["modes"][k] for k in ("agentkv", "disagg")}})) == [
        "agentkv_vs_disagg"]
    assert ratios({"modes": {"oracle": report["modes"]["oracle"]}}) == {}


def test_the_report_carries_ratios_when_the_oracle_ran():
    config = BenchConfig(modes=(Mode.AGENTKV, Mode.ORACLE), sessions=1, turns=2)
    samples = [
        sample(mode=mode, turn=turn, ttft=ttft)
        for mode, ttfts in ((Mode.AGENTKV, (2.0, 0.3)), (Mode.ORACLE, (2.0, 0.2)))
        for turn, ttft in enumerate(ttfts, start=1)
    ]
    report = build_report(config, samples, environment={})
    assert report["ratios"] == {
        "agentkv_vs_oracle": {"ttft_p50_after_first_turn": 1.5, "by_turn": [1.0, 1.5]}}
    solo = build_report(BenchConfig(modes=(Mode.AGENTKV,), sessions=1, turns=2),
                        [s for s in samples if s.mode is Mode.AGENTKV], environment={})
    assert "ratios" not in solo


def test_ratios_put_agentkv_against_the_limit_first_then_the_other_references():
    report = {"modes": {
        "disagg": _mode(800.0, [900.0, 800.0, 1600.0]),
        "agentkv": _mode(120.0, [900.0, 110.0, 130.0]),
        "oracle": _mode(150.0, [900.0, 140.0, 160.0]),
        "limit": _mode(100.0, [880.0, 100.0, None]),
    }}
    assert ratios(report) == {
        "agentkv_vs_limit": {"ttft_p50_after_first_turn": 1.2, "by_turn": [1.023, 1.1, None]},
        "agentkv_vs_oracle": {"ttft_p50_after_first_turn": 0.8, "by_turn": [1.0, 0.786, 0.812]},
        "agentkv_vs_disagg": {"ttft_p50_after_first_turn": 0.15,
                              "by_turn": [1.0, 0.138, 0.081]},
    }
    # A limit with no measured turn >= 2 gives no overall ratio, not a division by zero.
    empty = {"modes": {"agentkv": report["modes"]["agentkv"], "limit": _mode(None, [None] * 3)}}
    assert ratios(empty) == {
        "agentkv_vs_limit": {"ttft_p50_after_first_turn": None, "by_turn": [None] * 3}}


def test_the_report_carries_ratios_when_only_the_limit_ran_as_a_reference():
    config = BenchConfig(modes=(Mode.AGENTKV, Mode.LIMIT), sessions=2, turns=3, run_id="r")
    ttfts = {Mode.AGENTKV: (2.0, 0.33, 0.36), Mode.LIMIT: (2.0, 0.3, 0.3)}
    samples = [
        sample(mode=mode, session=s, turn=turn, ttft=ttft + 0.01 * s)
        for mode in config.modes
        for s in range(2)
        for turn, ttft in enumerate(ttfts[mode], start=1)
    ]
    report = build_report(config, samples, environment={})
    assert list(report["modes"]) == ["agentkv", "limit"]
    block = report["ratios"]["agentkv_vs_limit"]
    assert list(report["ratios"]) == ["agentkv_vs_limit"]
    assert block["by_turn"] == [1.0, round(335 / 305, 3), round(365 / 305, 3)]
    assert block["ttft_p50_after_first_turn"] == round(350.0 / 305.0, 3)


def test_the_limit_summary_says_what_its_turns_computed_and_how_much_of_it_was_old():
    """prompt - cached is what a turn computed; (ideal + 1) - cached is what of the previous
    turn's prompt and output it recomputed (below the block size for whole-block caching)."""
    samples = [
        sample(mode=Mode.LIMIT, turn=1, prompt=500, reused=0, ideal=0),
        # The previous turn: 515 + 1 tokens; 512 cached (whole blocks of 16), 4 recomputed.
        sample(mode=Mode.LIMIT, turn=2, prompt=654, reused=512, ideal=515),
        sample(mode=Mode.LIMIT, turn=3, prompt=899, reused=752, ideal=757),
        sample(mode=Mode.LIMIT, turn=4, error="boom"),
    ]
    summary = summarize(samples, computed=True)
    assert summary["computed_tokens_mean_after_first_turn"] == (142 + 147) / 2
    assert summary["old_tokens_recomputed_max_after_first_turn"] == 6
    assert "computed_tokens_mean_after_first_turn" not in summarize(samples)
    nothing = summarize(samples[:1], computed=True)
    assert nothing["computed_tokens_mean_after_first_turn"] is None
    assert nothing["old_tokens_recomputed_max_after_first_turn"] is None
    # Only the limit's block carries them: the other modes keep the issue's shape.
    config = BenchConfig(modes=(Mode.AGENTKV, Mode.LIMIT), sessions=1, turns=3, run_id="r")
    others = [sample(mode=Mode.AGENTKV, turn=t, prompt=p, reused=r, ideal=r)
              for t, p, r in ((1, 500, 0), (2, 654, 515), (3, 899, 757))]
    report = build_report(config, samples[:3] + others, environment={})
    assert "computed_tokens_mean_after_first_turn" in report["modes"]["limit"]["summary"]
    assert "computed_tokens_mean_after_first_turn" not in report["modes"]["agentkv"]["summary"]
