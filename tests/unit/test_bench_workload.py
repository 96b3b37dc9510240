"""The synthetic workload: deterministic for a seed, sized in tokens, shaped like a tool loop."""

from __future__ import annotations

import asyncio
import json

from hypothesis import given, settings
from hypothesis import strategies as st

from agentkv.bench import BenchConfig
from agentkv.bench._text import STYLES, generate, seeded
from agentkv.bench._workload import _PREAMBLE, build_workload, calibrate

PREAMBLE = len(_PREAMBLE) // 4


async def four_chars(text: str) -> int:
    """A toy tokenizer: one token per four characters."""
    return max(1, len(text) // 4)


def ratios(count=four_chars):
    return asyncio.run(calibrate(count, seed=0))


def tokens(text: str) -> int:
    return len(text) // 4


def test_the_same_seed_gives_the_same_workload_and_another_seed_another():
    config = BenchConfig(sessions=2, turns=4)
    first = build_workload(config, ratios())
    assert build_workload(config, ratios()) == first
    other = build_workload(BenchConfig(sessions=2, turns=4, seed=1), ratios())
    assert other.system != first.system
    assert other.sessions[0].turns[1].user != first.sessions[0].turns[1].user


def test_sessions_differ_from_each_other_but_share_the_system_prompt():
    workload = build_workload(BenchConfig(sessions=3, turns=2), ratios())
    firsts = {s.turns[0].user for s in workload.sessions}
    assert len(firsts) == 3


def test_turn_one_is_the_task_and_later_turns_are_a_tool_result_and_an_instruction():
    workload = build_workload(BenchConfig(sessions=1, turns=6, tool_tokens=200), ratios())
    turns = workload.sessions[0].turns
    assert [t.turn for t in turns] == [1, 2, 3, 4, 5, 6]
    assert turns[0].user.startswith("Task 1:")
    for turn in turns[1:]:
        assert turn.user.startswith('<tool_result name="')
        body = turn.user.split("\n</tool_result>\n")
        assert len(body) == 2
        assert body[1]
        assert 170 <= tokens(turn.user) <= 240


def test_the_system_prompt_lists_tool_schemas_that_parse():
    workload = build_workload(BenchConfig(context_tokens=2048), ratios())
    schemas = [json.loads(line) for line in workload.system.splitlines() if line.startswith("{")]
    names = [s["function"]["name"] for s in schemas]
    assert names[:3] == ["read_file", "run_tests", "search_code"]
    assert len(schemas) >= 10
    assert all(s["type"] == "function" and s["function"]["parameters"] for s in schemas)


@settings(max_examples=25, deadline=None)
@given(context=st.integers(64, 6000), tool=st.integers(16, 2000), output=st.integers(8, 400))
def test_sizes_follow_the_config_in_tokens(context, tool, output):
    config = BenchConfig(sessions=1, turns=3, context_tokens=context, tool_tokens=tool,
                         output_tokens=output, think_time_s=2.0)
    workload = build_workload(config, ratios())
    # Whole schemas and a prose top-up: within a few percent; never less than the preamble.
    assert context * 0.95 - 8 <= tokens(workload.system) <= max(context * 1.05, PREAMBLE) + 8
    for turn in workload.sessions[0].turns:
        assert max(4, output // 4) <= turn.output_tokens <= 4 * output
        assert 1.0 <= turn.think_time_s <= 3.0


def test_calibration_measures_each_style_with_the_given_tokenizer():
    async def two_chars(text: str) -> int:
        return len(text) // 2

    measured = ratios(two_chars)
    assert set(measured) == set(STYLES)
    assert all(1.9 <= value <= 2.1 for value in measured.values())


def test_a_smaller_tokens_per_char_ratio_gives_longer_text_for_the_same_token_budget():
    coarse = build_workload(BenchConfig(), dict.fromkeys(STYLES, 4.0))
    fine = build_workload(BenchConfig(), dict.fromkeys(STYLES, 2.0))
    assert len(coarse.system) > 1.8 * len(fine.system)


def test_generated_text_fits_its_budget_and_is_reproducible():
    for style in STYLES:
        text = generate(style, seeded("x"), 500)
        assert 0 < len(text) <= 500
        assert text == generate(style, seeded("x"), 500)


def test_no_think_time_means_no_pause():
    workload = build_workload(BenchConfig(think_time_s=0.0), ratios())
    assert all(t.think_time_s == 0.0 for s in workload.sessions for t in s.turns)
