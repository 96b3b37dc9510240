"""``agentkv bench`` on the fake pair: the report's shape, and agentkv reusing more than disagg."""

from __future__ import annotations

import asyncio
import json

import httpx2
import pytest

from agentkv.bench import BenchConfig, ClusterTarget, Mode, parse_modes, run_bench
from agentkv.bench._cli import add_parser
from agentkv.testing import FakeCluster

SHORT = {"sessions": 2, "turns": 3, "context_tokens": 256, "tool_tokens": 64, "output_tokens": 72}
SUMMARY_KEYS = {
    "ttft_p50_ms_after_first_turn",
    "ttft_p90_ms_after_first_turn",
    "reuse_vs_ideal",
    "throughput_tokens_per_s",
}
HANDLE_KEYS = {"handle_states_after_first_turn", "evictions", "tier_resumes", "tier_shortfalls"}
TURN_KEYS = {"turn", "ttft_ms", "prompt_tokens", "reused_tokens", "ideal_reused_tokens"}


def fake_pair(**options):
    # Below kv_recompute_threshold missing tokens, prefill recomputes rather than pulls. The fake's
    # blocks are 16 tokens (vLLM CPU: 128, threshold 64): a one-block threshold keeps the same
    # ratio, so the short outputs here (>= 18 tokens) are pulled as long ones are on the real pair.
    return FakeCluster(pairs=1, kv_recompute_threshold=16, **options)


def bench(modes="disagg,affinity,agentkv", *, tier=False, **settings):
    fake = fake_pair(tier=tier)
    config = BenchConfig(modes=parse_modes(modes), **{**SHORT, **settings})
    target = ClusterTarget(spec=fake.cluster_spec, transport=fake.transport)
    return fake, asyncio.run(run_bench(config, target=target))


def later_turns(report, mode, field):
    return [v for row in report["modes"][mode]["turns"][1:] for v in row[field]]


@pytest.fixture(scope="module")
def report():
    fake, report = bench()
    assert fake.wrong_reuse_events == 0
    return report


def test_the_report_has_the_issue_shape(report):
    # No "errors": every turn succeeded.
    assert set(report) == {"config", "modes", "decode", "ratios"}
    assert list(report["modes"]) == ["disagg", "affinity", "agentkv"]
    assert list(report["ratios"]) == ["agentkv_vs_disagg", "agentkv_vs_affinity"]
    for mode, block in report["modes"].items():
        assert set(block) == {"turns", "summary"}
        # The SDK mode also says what became of its handles (no pressure here: nothing lost).
        handles = HANDLE_KEYS if mode == "agentkv" else set()
        assert set(block["summary"]) == SUMMARY_KEYS | handles
        assert [row["turn"] for row in block["turns"]] == [1, 2, 3]
        for row in block["turns"]:
            assert set(row) == TURN_KEYS
            assert all(len(row[k]) == 2 for k in TURN_KEYS - {"turn"})
            assert all(isinstance(v, int) for v in row["prompt_tokens"])
            assert all(v > 0 for v in row["ttft_ms"])
    config = report["config"]
    assert config["sessions"] == 2
    assert config["modes"] == ["disagg", "affinity", "agentkv"]
    assert config["method"]["ttft_streamed"] is True
    assert config["workload"]["system_prompt_tokens"] > 0
    json.dumps(report, allow_nan=False)  # plain JSON, no NaN


def test_agentkv_reuses_more_than_disagg_and_reaches_the_ideal(report):
    agentkv = sum(later_turns(report, "agentkv", "reused_tokens"))
    disagg = sum(later_turns(report, "disagg", "reused_tokens"))
    assert agentkv > disagg
    assert report["modes"]["agentkv"]["summary"]["reuse_vs_ideal"] >= 0.99


def test_every_mode_runs_the_same_workload(report):
    # Outputs have planned, exact lengths: prompts grow identically in every mode.
    prompts = {mode: [row["prompt_tokens"] for row in block["turns"]]
               for mode, block in report["modes"].items()}
    assert prompts["disagg"] == prompts["affinity"] == prompts["agentkv"]
    ideal = [row["ideal_reused_tokens"] for row in report["modes"]["agentkv"]["turns"]]
    assert ideal[0] == [0, 0]
    assert all(v > 0 for row in ideal[1:] for v in row)


def test_disagg_prefill_reuses_nothing(report):
    assert later_turns(report, "disagg", "reused_tokens") == [0] * 4


def test_the_aggregated_reference_runs_on_the_prefill_server():
    fake, report = bench("aggregated,agentkv", sessions=1)
    assert list(report["modes"]) == ["agentkv", "aggregated"]
    rows = report["modes"]["aggregated"]["turns"]
    assert [row["prompt_tokens"][0] > 0 for row in rows] == [True] * 3
    assert "errors" not in report
    assert fake.decode(0).pinned_handles <= 1  # only agentkv's last turn is pinned


def test_the_oracle_computes_only_the_new_tokens_and_pins_nothing():
    fake, report = bench("agentkv,oracle")
    assert fake.wrong_reuse_events == 0
    assert "errors" not in report
    oracle = report["modes"]["oracle"]["turns"]
    block = 16  # FakeCluster's block size
    for row in oracle[1:]:
        # The fill left every whole block of the previous turn in prefill's cache: the timed turn
        # reuses all of them and pulls nothing (at most one block's tail is recomputed).
        for reused, ideal in zip(row["reused_tokens"], row["ideal_reused_tokens"], strict=True):
            assert ideal - block < reused <= ideal
            assert reused % block == 0
    agentkv = report["modes"]["agentkv"]
    assert agentkv["summary"]["reuse_vs_ideal"] >= 0.99
    assert set(report["ratios"]) == {"agentkv_vs_oracle"}
    assert fake.decode(0).pinned_handles <= 2  # agentkv's last turns only; the oracle pins none


def test_a_server_without_streamed_handles_fails_the_agentkv_turns_with_a_hint():
    fake = fake_pair(stream_handles=False)
    config = BenchConfig(modes=(Mode.AGENTKV,), **{**SHORT, "sessions": 1})
    target = ClusterTarget(spec=fake.cluster_spec, transport=fake.transport)
    report = asyncio.run(run_bench(config, target=target))
    # The SDK falls back to no reuse; the benchmark refuses to call that agentkv.
    assert report["errors"] == [{
        "mode": "agentkv", "session": 0, "turn": 1,
        "error": "decode's streamed answer carried no turn-end handle: run the pair with "
        "agentkv's vLLM plugin (as `agentkv up` does) or pass --no-stream",
    }]
    assert [row["ttft_ms"] for row in report["modes"]["agentkv"]["turns"]] == [[None]] * 3


def test_no_stream_mode_works_without_streamed_handles_and_says_so():
    fake = fake_pair(stream_handles=False)
    config = BenchConfig(modes=(Mode.AGENTKV,), stream=False, **{**SHORT, "sessions": 1})
    target = ClusterTarget(spec=fake.cluster_spec, transport=fake.transport)
    report = asyncio.run(run_bench(config, target=target))
    assert "errors" not in report
    assert report["config"]["method"]["ttft_streamed"] is False
    assert report["modes"]["agentkv"]["summary"]["reuse_vs_ideal"] >= 0.99


def test_the_command_writes_json_and_plot_over_real_http(tmp_path, capsys, agentkv_logging):
    import argparse

    fake = fake_pair()
    with fake.serve() as served:
        cluster_file = tmp_path / "cluster.json"
        cluster_file.write_text(json.dumps(served.cluster_spec))
        parser = argparse.ArgumentParser(prog="agentkv")
        add_parser(parser.add_subparsers(dest="command", required=True))
        args = parser.parse_args([
            "bench", "--cluster-file", str(cluster_file), "--modes", "disagg,agentkv",
            "--sessions", "1", "--turns", "2", "--context-tokens", "200", "--tool-tokens", "32",
            "--output-tokens", "16", "--json", str(tmp_path / "out" / "r.json"),
            "--plot", str(tmp_path / "out" / "r.png"),
        ])
        assert args.func(args) == 0
    report = json.loads((tmp_path / "out" / "r.json").read_text())
    assert list(report["modes"]) == ["disagg", "agentkv"]
    assert report["config"]["command"].startswith("agentkv bench --cluster-file ")
    assert (tmp_path / "out" / "r.png").read_bytes()[:4] == b"\x89PNG"
    out, err = capsys.readouterr()
    assert out.splitlines()[0].startswith("mode")
    assert "[bench]" in err
    assert "4/4" in err


def test_concurrent_lanes_with_think_time_give_the_same_workload_and_reuse():
    _, report = bench(concurrency=4, think_time_s=0.01, sessions=3)
    assert "errors" not in report
    prompts = {mode: [row["prompt_tokens"] for row in block["turns"]]
               for mode, block in report["modes"].items()}
    assert prompts["disagg"] == prompts["agentkv"]
    assert report["modes"]["agentkv"]["summary"]["reuse_vs_ideal"] >= 0.99


def test_in_long_pauses_tier_frees_decode_and_resumes_at_the_ideal_while_agentkv_keeps_its_pin():
    """Ten-minute pauses, scaled to milliseconds: the SDK is told the full pause. The tier lane
    holds nothing on decode through a pause and its next turn loads the ideal from the tier; the
    agentkv lane keeps (and extends) its pin; disagg recomputes."""
    fake, report = bench(
        "disagg,agentkv,tier", tier=True, think_time_s=600.0, time_scale=1e-5, sessions=2
    )
    assert "errors" not in report, report.get("errors")
    assert fake.wrong_reuse_events == 0
    tier, pinned = report["modes"]["tier"]["summary"], report["modes"]["agentkv"]["summary"]
    assert tier["paused_decode_tokens_mean"] == 0
    assert tier["paused_tier_tokens_mean"] > 0
    assert pinned["paused_decode_tokens_mean"] > 0
    assert pinned["paused_tier_tokens_mean"] == 0
    assert tier["reuse_vs_ideal"] == pinned["reuse_vs_ideal"] == 1.0
    assert later_turns(report, "tier", "reused_tokens") == later_turns(
        report, "tier", "ideal_reused_tokens"
    )
    assert report["modes"]["disagg"]["summary"]["reuse_vs_ideal"] == 0.0
    assert not fake.tier.ids  # every session closed: nothing left in the tier


class Recording(httpx2.AsyncBaseTransport):
    """Passes requests to the fake pair and keeps each one's host, path and JSON body."""

    def __init__(self, inner):
        self._inner = inner
        self.seen = []

    async def handle_async_request(self, request):
        content = await request.aread()
        body = json.loads(content) if content else None
        self.seen.append((request.url.host, request.url.path, body))
        return await self._inner.handle_async_request(request)


def recorded_bench(modes, **settings):
    fake = fake_pair()
    recording = Recording(fake.transport)
    config = BenchConfig(modes=parse_modes(modes), **{**SHORT, **settings})
    target = ClusterTarget(spec=fake.cluster_spec, transport=recording)
    return fake, recording, config, asyncio.run(run_bench(config, target=target))


def chats(recording, salt_prefix):
    return [
        (host, body)
        for host, path, body in recording.seen
        if path == "/v1/chat/completions" and body.get("cache_salt", "").startswith(salt_prefix)
    ]


def test_the_limit_computes_only_the_new_tokens_on_decode_alone_with_agentkvs_exact_prompts():
    """`--modes limit,agentkv`: a limit turn is one local request to decode, which computes only
    the new tokens and at most a block's tail of the previous turn (whole-block caching); its
    prompts are token for token the ones agentkv's decode legs carry."""
    fake, recording, config, report = recorded_bench("limit,agentkv")
    assert "errors" not in report, report.get("errors")
    assert fake.wrong_reuse_events == 0
    assert list(report["modes"]) == ["agentkv", "limit"]
    block = 16  # FakeCluster's block size
    limit = report["modes"]["limit"]
    for row in limit["turns"][1:]:
        rows = zip(row["prompt_tokens"], row["reused_tokens"], row["ideal_reused_tokens"],
                   strict=True)
        for prompt, cached, ideal in rows:
            new = prompt - (ideal + 1)  # the closing and the new message: all the rest was cached
            assert new <= prompt - cached < new + block
            assert cached % block == 0
    summary = limit["summary"]
    assert 0 <= summary["old_tokens_recomputed_max_after_first_turn"] < block
    assert summary["computed_tokens_mean_after_first_turn"] > 0
    assert list(report["ratios"]) == ["agentkv_vs_limit"]
    assert len(report["ratios"]["agentkv_vs_limit"]["by_turn"]) == 3

    run = config.run_id
    decode_host = httpx2.URL(fake.decode(0).url).host
    for session in range(2):
        legs = chats(recording, f"akvb-{run}-limit-s{session}")
        # Turn t >= 2 is a fill (one token, the previous turn's tokens) then the timed turn.
        assert [body["max_tokens"] == 1 for _, body in legs] == [False, True, False, True, False]
        for host, body in legs:
            assert host == decode_host  # never the prefill server
            # vLLM's token-exact channel only: no transfer flags, no handle, so nothing moves.
            assert set(body["kv_transfer_params"]) == {"prompt_token_ids"}
        turns = [body for _, body in legs if body["max_tokens"] > 1]
        fills = [body for _, body in legs if body["max_tokens"] == 1]
        agentkv = [body for host, body in chats(recording, f"akvb-{run}-agentkv-s{session}")
                   if host == decode_host]
        ids = [body["kv_transfer_params"]["prompt_token_ids"] for body in turns]
        assert ids == [body["kv_transfer_params"]["prompt_token_ids"] for body in agentkv]
        # Each fill is the previous turn's prompt and output, exactly.
        for fill, before, after in zip(fills, ids[:-1], ids[1:], strict=True):
            filled = fill["kv_transfer_params"]["prompt_token_ids"]
            assert filled[: len(before)] == before
            assert after[: len(filled)] == filled
    assert fake.decode(0).pinned_handles <= 2  # agentkv's last turns only; the limit pins none


def test_the_limit_alone_never_reaches_the_prefill_server():
    """Its prompts are rendered by decode's /tokenize too: after the run's calibration (on
    prefill), every request of the limit's lanes goes to decode."""
    fake, recording, _, report = recorded_bench("limit", sessions=1, stream=False)
    assert "errors" not in report, report.get("errors")
    first_turn = next(i for i, (_, path, _) in enumerate(recording.seen)
                      if path == "/v1/chat/completions")
    hosts = {host for host, _, _ in recording.seen[first_turn:]}
    assert hosts == {httpx2.URL(fake.decode(0).url).host}
    assert fake.prefill(0).requests == []
    rows = report["modes"]["limit"]["turns"]
    assert all(row["reused_tokens"][0] > 0 for row in rows[1:])
    assert report["config"]["method"]["limit"].startswith("each turn's exact prompt ids")


def test_the_route_lanes_compute_later_turns_on_decode_and_report_their_ratios():
    """`--modes agentkv,agentkv-decode,agentkv-auto`: the decode lane's turns are one request
    each, to decode (no P leg at all); the auto lane chooses per turn (its first turn has nothing
    to reuse and goes through prefill); both report their ratio to the pull route."""
    fake, recording, config, report = recorded_bench("agentkv,agentkv-decode,agentkv-auto")
    assert "errors" not in report, report.get("errors")
    assert fake.wrong_reuse_events == 0
    assert set(report["ratios"]) == {"agentkv-decode_vs_agentkv", "agentkv-auto_vs_agentkv"}
    run = config.run_id
    prefill_host = httpx2.URL(fake.prefill(0).url).host
    for session in range(2):
        decode_lane = chats(recording, f"akvb-{run}-agentkv-decode-s{session}")
        assert decode_lane
        assert prefill_host not in [host for host, _ in decode_lane]
        auto_lane = chats(recording, f"akvb-{run}-agentkv-auto-s{session}")
        assert auto_lane[0][0] == prefill_host
    for mode in ("agentkv-decode", "agentkv-auto"):
        assert all(r > 0 for r in later_turns(report, mode, "reused_tokens"))
