"""``agentkv bench --trace`` on the fake pair: a real trace excerpt replayed end to end."""

from __future__ import annotations

import argparse
import asyncio
import json

import pytest

from agentkv.bench import BenchConfig, ClusterTarget, parse_modes, run_bench
from agentkv.bench._cli import add_parser, summary_table
from agentkv.bench._trace import CLAUDE_CODE_TRACE, SAMPLE_TRACE, load_trace, plan_replay
from agentkv.testing import FakeCluster


def fake_pair():
    # As in test_bench_fake: a one-block recompute threshold on the fake's 16-token blocks.
    return FakeCluster(pairs=1, kv_recompute_threshold=16)


@pytest.fixture(scope="module")
def replayed():
    plan = plan_replay(load_trace(SAMPLE_TRACE), limit=40, length_scale=0.05)
    fake = fake_pair()
    config = BenchConfig(modes=parse_modes("disagg,agentkv"), sessions=len(plan.sessions),
                         turns=plan.max_turns, time_scale=0.0, concurrency=64,
                         trace="sample", trace_limit=40, length_scale=0.05)
    target = ClusterTarget(spec=fake.cluster_spec, transport=fake.transport)
    report = asyncio.run(run_bench(config, target=target, replay=plan))
    return plan, fake, report


def test_the_replay_runs_every_request_of_the_excerpt_in_every_mode(replayed):
    plan, fake, report = replayed
    assert "errors" not in report, report.get("errors")
    assert fake.wrong_reuse_events == 0
    for block in report["modes"].values():
        ran = [v for row in block["turns"] for v in row["prompt_tokens"] if v is not None]
        assert len(ran) == plan.requests == 40


def test_the_report_labels_the_workload_as_the_trace(replayed):
    plan, _, report = replayed
    workload = report["config"]["workload"]
    assert workload["kind"] == "trace"
    assert workload["file"] == "mooncake_conversation_sample.jsonl"
    assert (workload["requests"], workload["sessions"]) == (40, len(plan.sessions))
    assert report["config"]["trace"] == "sample"
    assert "trace" in report["config"]["method"]


def test_every_mode_replays_the_same_prompts_and_agentkv_reuses_the_history(replayed):
    _, _, report = replayed
    prompts = {m: [row["prompt_tokens"] for row in b["turns"]] for m, b in report["modes"].items()}
    assert prompts["disagg"] == prompts["agentkv"]
    agentkv = report["modes"]["agentkv"]["summary"]["reuse_vs_ideal"]
    assert report["modes"]["disagg"]["summary"]["reuse_vs_ideal"] == 0.0
    assert agentkv > 0.9


def test_the_command_replays_a_trace_over_real_http(tmp_path, capsys, agentkv_logging):
    fake = fake_pair()
    with fake.serve() as served:
        cluster_file = tmp_path / "cluster.json"
        cluster_file.write_text(json.dumps(served.cluster_spec))
        parser = argparse.ArgumentParser(prog="agentkv")
        add_parser(parser.add_subparsers(dest="command", required=True))
        args = parser.parse_args([
            "bench", "--cluster-file", str(cluster_file), "--modes", "agentkv",
            "--trace", "sample", "--trace-limit", "12", "--length-scale", "0.03",
            "--time-scale", "0", "--json", str(tmp_path / "r.json"),
        ])
        assert args.func(args) == 0
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["config"]["workload"]["requests"] == 12
    assert "--trace sample --trace-limit 12 --length-scale 0.03" in report["config"]["command"]
    out, err = capsys.readouterr()
    assert "trace mooncake_conversation_sample.jsonl: 12 requests in" in out
    assert "12/12" in err


def test_subagents_of_one_conversation_find_their_siblings_prefix_but_disagg_does_not():
    """The Claude Code excerpt on the fake pair: a conversation's sessions share a cache salt
    (one user), so a later Explore sibling's first turn finds the first one's prefix in
    prefill's cache; disagg's fresh salt per P leg finds nothing."""
    path = CLAUDE_CODE_TRACE / "trace_0277.json"
    plan = plan_replay(load_trace(path), limit=20, length_scale=0.03)
    fake = fake_pair()
    config = BenchConfig(modes=parse_modes("disagg,affinity"), sessions=len(plan.sessions),
                         turns=plan.max_turns, time_scale=0.0, concurrency=1,
                         trace=str(path), trace_limit=20, length_scale=0.03)
    target = ClusterTarget(spec=fake.cluster_spec, transport=fake.transport)
    report = asyncio.run(run_bench(config, target=target, replay=plan))
    assert "errors" not in report, report.get("errors")
    assert [s["role"] for s in report["sessions"]] == ["parent"] + ["subagent"] * 3
    assert report["sessions"][2]["first_turn_ideal_reused_tokens"] > 300
    firsts = {m: g["subagent_first_turns"] for m, g in report["roles"].items()}
    assert firsts["disagg"]["reuse_vs_ideal"] == 0.0
    assert firsts["affinity"]["reuse_vs_ideal"] > 0.8
    assert "subagent turn 1" in summary_table(report)


def test_on_a_pool_a_subagent_starts_on_the_prefill_that_computed_its_siblings_prefix():
    """A conversation's sessions share one client in each mode (``_share``): the pool's
    placement sees what the first sibling's prefill computed and sends the next ones there."""
    path = CLAUDE_CODE_TRACE / "trace_0277.json"
    plan = plan_replay(load_trace(path), limit=20, length_scale=0.03)
    fake = FakeCluster(prefills=2, decodes=1, kv_recompute_threshold=16)
    config = BenchConfig(modes=parse_modes("affinity,agentkv"), sessions=len(plan.sessions),
                         turns=plan.max_turns, time_scale=0.0, concurrency=1,
                         trace=str(path), trace_limit=20, length_scale=0.03)
    target = ClusterTarget(spec=fake.cluster_spec, transport=fake.transport)
    report = asyncio.run(run_bench(config, target=target, replay=plan))
    assert "errors" not in report, report.get("errors")
    for mode in ("affinity", "agentkv"):
        assert report["roles"][mode]["subagent_first_turns"]["reuse_vs_ideal"] > 0.8, mode
        first_turns = report["modes"][mode]["turns"][0]["prefill"]  # per session
        assert len(set(first_turns[1:])) == 1, first_turns  # the three Explore siblings
