"""Trace replay: sessions inferred as documented, prefixes shared as in the trace, time and
lengths scaled, turns that do not fit clipped and counted."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import shlex
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentkv import ConfigError
from agentkv.bench import BenchConfig, Mode
from agentkv.bench._cli import _config, _replay, add_parser, command_line
from agentkv.bench._schedule import Lane, run_lanes
from agentkv.bench._trace import (
    ORIGINAL_DECODE_TOKENS_PER_S,
    ORIGINAL_PREFILL_TOKENS_PER_S,
    SAMPLE_TRACE,
    Trace,
    TraceRequest,
    build_trace_workload,
    infer_sessions,
    load_trace,
    parse_trace,
    plan_replay,
)
from agentkv.bench._workload import TurnScript

# A toy tokenizer's calibration: four characters a token in every style.
RATIOS = {"schema": 4.0, "code": 4.0, "log": 4.0, "prose": 4.0}
BLOCK = 16


def mooncake(*rows):
    """JSONL of Mooncake requests from (timestamp_ms, input, output, hash_ids) rows."""
    return "\n".join(
        json.dumps({"timestamp": t, "input_length": i, "output_length": o, "hash_ids": h})
        for t, i, o, h in rows
    )


def lcp(a, b):
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


# -- a generator of traces with known sessions ----------------------------------------------------


@st.composite
def traces(draw):
    """Sessions sharing a system prefix of whole blocks; each turn keeps the previous prompt's
    whole blocks, its partial block gets a new id (as Mooncake's hashing does), and the prompt
    grows by the previous output and a new user message. Returns (trace, sessions)."""
    system = list(range(draw(st.integers(0, 2))))
    fresh = iter(range(1000, 10**6))
    sessions = []
    rows = []
    for _ in range(draw(st.integers(1, 4))):
        start = draw(st.integers(0, 20_000))
        # At least one whole block past the shared system prefix (see the docs' ambiguity note).
        size = len(system) * BLOCK + draw(st.integers(BLOCK + 1, 4 * BLOCK))
        ids = system + [next(fresh) for _ in range(-(-size // BLOCK) - len(system))]
        members = []
        stamp = start
        for _ in range(draw(st.integers(1, 4))):
            out = draw(st.integers(1, 2 * BLOCK))
            members.append((stamp, size, out, tuple(ids)))
            stamp += draw(st.integers(0, 60_000))
            new = draw(st.integers(1, 3 * BLOCK))
            kept = ids[: size // BLOCK]
            size += out + new
            ids = kept + [next(fresh) for _ in range(-(-size // BLOCK) - len(kept))]
        sessions.append(members)
        rows.extend(members)
    order = sorted(range(len(rows)), key=lambda i: rows[i][0])
    requests = tuple(
        TraceRequest(index=pos, timestamp_s=rows[i][0] / 1000, input_tokens=rows[i][1],
                     output_tokens=rows[i][2], hash_ids=rows[i][3])
        for pos, i in enumerate(order)
    )
    where = {i: pos for pos, i in enumerate(order)}
    expected, offset = [], 0
    for members in sessions:
        expected.append(sorted(where[offset + k] for k in range(len(members))))
        offset += len(members)
    return Trace(name="gen", block_tokens=BLOCK, requests=requests), expected


@settings(max_examples=150, deadline=None)
@given(traces())
def test_sessions_are_inferred_from_hash_id_prefixes_as_documented(case):
    trace, expected = case
    found = infer_sessions(trace.requests, block_tokens=BLOCK)
    assert sorted(found) == sorted(expected)


def streams(trace):
    """Every request's replayed token stream (toy tokenizer: 4 characters a token), with each
    model output a placeholder no other turn shares."""
    plan = plan_replay(trace)
    workload = build_trace_workload(plan, RATIOS)
    out = {}
    for session, script in zip(plan.sessions, workload.sessions, strict=True):
        text = ""
        for turn, step in zip(session.turns, script.turns, strict=True):
            text += step.user
            out[turn.request] = text
            text += chr(0x4E00 + 64 * session.index + turn.turn) * (4 * step.output_tokens)
    return plan, out


@settings(max_examples=100, deadline=None)
@given(traces())
def test_replayed_prompts_share_the_prefixes_the_trace_shares_to_within_a_block(case):
    trace, _ = case
    plan, texts = streams(trace)
    assert plan.padded_tokens == 0
    for a in trace.requests:
        assert len(texts[a.index]) == 4 * a.input_tokens  # lengths as in the trace
        for b in trace.requests:
            shared_tokens = lcp(texts[a.index], texts[b.index]) / 4
            shared_blocks = lcp(a.hash_ids, b.hash_ids) * BLOCK
            assert abs(shared_tokens - shared_blocks) <= BLOCK, (a, b)


def test_equal_hash_ids_give_equal_text_and_different_ids_different_text():
    rows = (0, 48, 4, [7, 8, 9]), (0, 48, 4, [7, 8, 5])
    plan = plan_replay(parse_trace(mooncake(*rows), name="t", block_tokens=BLOCK))
    first, second = (s.turns[0].user for s in build_trace_workload(plan, RATIOS).sessions)
    assert first[: 2 * 64] == second[: 2 * 64]
    assert first[2 * 64:] != second[2 * 64:]
    assert len(first) == len(second) == 3 * 64


def test_a_prefix_two_sessions_reached_never_joins_a_third_to_them():
    rows = [
        (0, 1300, 10, [0, 1, 2]),  # session A
        (1, 900, 10, [0, 5]),  # session B: all but its partial last block is [0]
        (2, 1300, 10, [0, 20, 21]),  # extends B's [0], but A has block 0 too: a shared prompt
        (3, 1400, 10, [0, 5, 7]),  # extends B's whole list: B's next turn
    ]
    trace = parse_trace(mooncake(*rows), name="t")
    assert infer_sessions(trace.requests, block_tokens=512) == [[0], [1, 3], [2]]


def test_the_longest_match_wins_and_a_shorter_prompt_is_not_a_continuation():
    rows = [
        (0, 1100, 10, [0, 1, 2]),  # session A
        (0, 600, 10, [0, 5]),  # session B
        (10, 1700, 10, [0, 1, 2, 3]),  # extends A's whole list
        (20, 1000, 10, [0, 1, 9]),  # extends A's [0, 1] but is shorter than A's 1700: new
        (30, 2100, 10, [0, 1, 2, 3, 4]),  # extends A again
    ]
    trace = parse_trace(mooncake(*rows), name="t")
    assert infer_sessions(trace.requests, block_tokens=512) == [[0, 2, 4], [1], [3]]


def test_turn_texts_are_the_trace_growth_and_padding_is_counted():
    rows = [(0, 40, 8, [1, 2, 3]), (1000, 70, 8, [1, 2, 4, 5, 6]), (2000, 70, 8, [1, 2, 4, 5, 6])]
    plan = plan_replay(parse_trace(mooncake(*rows), name="t"), length_scale=1.0)
    turns = plan.sessions[0].turns
    assert [t.new_tokens for t in turns] == [40, 70 - 48, 1]
    assert plan.padded_tokens == 1  # the retried request's prompt did not grow: one token added


def test_think_time_is_the_gap_less_the_expected_service_never_negative():
    rows = [
        (0, 1024, 60, [1, 2]), (100_000, 2048, 30, [1, 2, 3, 4]),
        (100_100, 3000, 1, [1, 2, 3, 4, 5, 6]),
    ]
    plan = plan_replay(parse_trace(mooncake(*rows), name="t"))
    first, second, last = plan.sessions[0].turns
    service = 1024 / ORIGINAL_PREFILL_TOKENS_PER_S + 60 / ORIGINAL_DECODE_TOKENS_PER_S
    assert first.think_time_s == pytest.approx(100.0 - service)
    assert second.think_time_s == 0.0  # 0.1 s gap, 1 s of decode: never negative
    assert last.think_time_s == 0.0


def test_sessions_start_at_their_first_timestamp_and_lengths_scale():
    rows = [(5000, 1024, 100, [1, 2]), (9000, 1000, 50, [3, 4])]
    plan = plan_replay(parse_trace(mooncake(*rows), name="t"), length_scale=0.25)
    assert [s.start_s for s in plan.sessions] == [0.0, 4.0]
    assert [(s.turns[0].input_tokens, s.turns[0].output_tokens) for s in plan.sessions] == [
        (256, 25), (250, 12)
    ]
    assert plan.scaled_block_tokens == 128


def test_turns_that_do_not_fit_the_model_end_their_session_and_are_counted():
    rows = [
        (0, 1000, 100, [1, 2]), (1, 2000, 100, [1, 3, 4, 5]),
        (2, 6000, 100, [1, 3, 4, 5, *range(6, 14)]),
        (3, 9000, 10, [50 + k for k in range(18)]),
    ]
    plan = plan_replay(parse_trace(mooncake(*rows), name="t"), max_model_len=4096)
    assert [len(s.turns) for s in plan.sessions] == [2]
    assert (plan.clipped_requests, plan.skipped_sessions) == (2, 1)
    assert plan.summary()["clipped_requests"] == 2
    assert plan_replay(parse_trace(mooncake(*rows), name="t"), length_scale=0.25,
                       max_model_len=4096).clipped_requests == 0


def test_the_limit_takes_the_first_requests():
    rows = [(k, 100, 5, [k]) for k in range(10)]
    plan = plan_replay(parse_trace(mooncake(*rows), name="t"), limit=4)
    assert (plan.requests_read, plan.requests) == (4, 4)


KV_CACHE_TESTER = {
    "id": "conv-a",
    "block_size": 64,
    "requests": [
        {"t": 0.0, "type": "s", "in": 100, "out": 20, "hash_ids": [1, 2]},
        {"type": "compaction"},
        {"t": 30.0, "type": "n", "in": 150, "out": 10, "hash_ids": [1, 3, 4], "think_time": 7.5},
    ],
}


def test_kv_cache_tester_conversations_keep_their_ids_block_size_and_think_times(tmp_path):
    other = {**KV_CACHE_TESTER, "id": "conv-b"}
    (tmp_path / "a.json").write_text(json.dumps(KV_CACHE_TESTER))
    (tmp_path / "b.json").write_text(json.dumps(other))
    trace = load_trace(tmp_path)
    assert (trace.block_tokens, trace.ignored_entries, len(trace.requests)) == (64, 2, 4)
    plan = plan_replay(trace)
    # Named conversations are sessions even where the hash ids say nothing (or the same).
    assert [[t.request for t in s.turns] for s in plan.sessions] == [[0, 1], [2, 3]]
    assert plan.sessions[0].turns[0].think_time_s == 7.5
    one = parse_trace(json.dumps(KV_CACHE_TESTER), name="one.json")
    assert [r.conversation for r in one.requests] == ["conv-a", "conv-a"]


@pytest.mark.parametrize("text", ["", "{\"timestamp\": 1}", "[1, 2]", "not json"])
def test_malformed_traces_are_config_errors(text):
    with pytest.raises(ConfigError):
        parse_trace(text, name="bad")


def test_the_shipped_sample_is_a_real_mooncake_excerpt_with_multi_turn_sessions():
    trace = load_trace(SAMPLE_TRACE)
    assert (len(trace.requests), trace.block_tokens) == (299, 512)
    plan = plan_replay(trace)
    assert (len(plan.sessions), plan.max_turns) == (70, 12)
    assert sum(len(s.turns) >= 3 for s in plan.sessions) == 68
    readme = (SAMPLE_TRACE.parent / "README.md").read_text()
    assert "Apache-2.0" in readme
    assert "conversation_trace.jsonl" in readme
    assert "5a371794b81d7fc7487ec8a02a2c631bcc7fbdf8" in readme  # the source file's blob


def test_lanes_start_at_their_scaled_offsets_and_a_zero_scale_waits_for_nothing():
    started = {}

    async def main(scale):
        t0 = time.monotonic()

        def lane(name, start):
            async def run(script):
                started[name] = time.monotonic() - t0
                return True

            return Lane(session=0, mode=Mode.AGENTKV, start_s=start, run=run,
                        turns=[TurnScript(turn=1, user="u", output_tokens=1, think_time_s=0.0)])

        await run_lanes([lane("now", 0.0), lane("later", 2.0)], concurrency=2, time_scale=scale)

    asyncio.run(main(0.1))
    assert started["now"] < 0.19
    assert 0.19 <= started["later"] < 1.5  # 2 s x 0.1, not 2 s
    asyncio.run(main(0.0))
    assert started["later"] < 0.5


def parse(argv):
    parser = argparse.ArgumentParser(prog="agentkv")
    add_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def test_the_trace_flags_map_onto_the_config_and_back_to_the_same_command():
    args = parse(["bench", "--trace", "sample", "--trace-limit", "60", "--length-scale", "0.05",
                  "--time-scale", "0", "--max-model-len", "4096", "--json", "o.json"])
    replay = _replay(args)
    config = _config(args, replay)
    assert replay is not None
    assert (config.trace, config.trace_limit, config.length_scale) == ("sample", 60, 0.05)
    assert (config.sessions, config.turns) == (len(replay.sessions), replay.max_turns)
    assert config.concurrency == len(config.modes) * len(replay.sessions)  # the trace decides
    assert config.time_scale == 0.0
    line = command_line(config, cluster_file="c.json", json_out="o.json", plot=None)
    assert "--sessions" not in line
    again = parse(shlex.split(line)[1:])
    reparsed = _config(again, _replay(again))
    assert reparsed == dataclasses.replace(config, run_id=reparsed.run_id)


def test_trace_settings_are_checked():
    with pytest.raises(ConfigError):
        BenchConfig(length_scale=0.0)
    with pytest.raises(ConfigError):
        BenchConfig(trace_limit=0)
    with pytest.raises(ConfigError):
        plan_replay(load_trace(SAMPLE_TRACE), length_scale=2.0)
    with pytest.raises(ConfigError, match="fits"):
        _replay(parse(["bench", "--trace", "sample", "--max-model-len", "256", "--json", "o"]))
