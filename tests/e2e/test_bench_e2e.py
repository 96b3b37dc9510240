"""``agentkv bench`` on the real local pair: report shape, honest baselines, agentkv's reuse.

Short on purpose (2 sessions x 3 turns, small prompts): the full benchmark is a command
(docs/benchmarks.md), not a test.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx2
import pytest

from agentkv.bench import BenchConfig, ClusterTarget, Mode, run_bench

pytestmark = pytest.mark.e2e

BLOCK = 128  # vLLM's CPU backend block size


@pytest.fixture(scope="module")
def report(cluster_file: Path):
    spec = json.loads(cluster_file.read_text())
    # Five-minute pauses, run in a fraction of a second: the SDK is told the full pause.
    config = BenchConfig(modes=(Mode.DISAGG, Mode.AFFINITY, Mode.AGENTKV, Mode.LIMIT, Mode.TIER),
                         sessions=2, turns=2, context_tokens=256, tool_tokens=64,
                         output_tokens=16, think_time_s=300.0, time_scale=0.001)

    async def run():
        transport = httpx2.AsyncHTTPTransport()
        try:
            return await run_bench(config, target=ClusterTarget(spec=spec, transport=transport))
        finally:
            await transport.aclose()

    return asyncio.run(run())


def column(report, mode, field):
    return [row[field] for row in report["modes"][mode]["turns"]]


def test_the_report_has_the_issue_shape(report):
    assert "errors" not in report, report.get("errors")
    assert list(report["modes"]) == ["disagg", "affinity", "agentkv", "limit", "tier"]
    for block in report["modes"].values():
        assert [row["turn"] for row in block["turns"]] == [1, 2]
        for row in block["turns"]:
            assert all(len(row[k]) == 2 for k in
                       ("ttft_ms", "prompt_tokens", "reused_tokens", "ideal_reused_tokens"))
        assert block["summary"]["ttft_p50_ms_after_first_turn"] > 0


def test_cache_salts_keep_disagg_prefill_cold_and_the_modes_apart(report):
    """P's own cached_tokens: 0 on every disagg turn (token-exact prompts, a fresh salt each
    turn), and 0 on every mode's first turn although all modes send the same tokens."""
    assert column(report, "disagg", "reused_tokens") == [[0, 0]] * 2
    for mode in report["modes"]:
        assert column(report, mode, "reused_tokens")[0] == [0, 0]


def test_agentkv_reuses_more_than_disagg_and_affinity_at_the_ideal(report):
    agentkv = column(report, "agentkv", "reused_tokens")[1:]
    affinity = column(report, "affinity", "reused_tokens")[1:]
    ideal = column(report, "agentkv", "ideal_reused_tokens")[1:]
    assert sum(map(sum, agentkv)) > sum(map(sum, column(report, "disagg", "reused_tokens")))
    for got, aff, best in zip(agentkv, affinity, ideal, strict=True):
        for g, a, b in zip(got, aff, best, strict=True):
            assert g >= 0.99 * (b // BLOCK * BLOCK)
            assert g >= a  # the pull adds the generated tokens prefill never saw


def test_every_mode_ran_the_same_prompts(report):
    prompts = {mode: column(report, mode, "prompt_tokens") for mode in report["modes"]}
    assert prompts["disagg"] == prompts["affinity"] == prompts["agentkv"] == prompts["tier"]
    assert prompts["limit"] == prompts["agentkv"]  # the SDK's exact ids, on one server


def test_the_limit_recomputes_at_most_a_block_of_the_previous_turn(report):
    """Decode's own cached_tokens on the limit's turns >= 2: every whole block of the previous
    turn's prompt and output (filled off the clock), so it computed the new tokens and less than
    one block of old ones."""
    got = column(report, "limit", "reused_tokens")[1:]
    ideal = column(report, "limit", "ideal_reused_tokens")[1:]
    for row, best in zip(got, ideal, strict=True):
        for g, b in zip(row, best, strict=True):
            assert b + 1 - BLOCK < g <= b + 1
            assert g % BLOCK == 0
    assert report["modes"]["limit"]["summary"]["old_tokens_recomputed_max_after_first_turn"] < BLOCK
    assert "agentkv_vs_limit" in report["ratios"]


def test_through_a_pause_the_tier_holds_the_kv_and_decode_holds_nothing(report):
    """The tier lane's KV sits in decode's file tier through each pause (decode's pin freed),
    and its next turn loads the whole ideal from there; the agentkv lane keeps its pin."""
    tier = report["modes"]["tier"]["summary"]
    assert tier["paused_decode_tokens_mean"] == 0
    assert tier["paused_tier_tokens_mean"] > 0
    assert report["modes"]["agentkv"]["summary"]["paused_decode_tokens_mean"] > 0
    got = column(report, "tier", "reused_tokens")[1:]
    ideal = column(report, "tier", "ideal_reused_tokens")[1:]
    assert got == ideal
