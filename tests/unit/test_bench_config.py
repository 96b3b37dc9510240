"""BenchConfig and mode parsing: typed, validated once, canonical order."""

from __future__ import annotations

import pytest

from agentkv import ConfigError
from agentkv.bench import BenchConfig, Mode, parse_modes


def test_modes_come_back_in_canonical_order_whatever_the_input_order():
    assert parse_modes(" agentkv , disagg,affinity") == (Mode.DISAGG, Mode.AFFINITY, Mode.AGENTKV)
    assert BenchConfig(modes=(Mode.AGENTKV, Mode.DISAGG)).modes == (Mode.DISAGG, Mode.AGENTKV)


@pytest.mark.parametrize("text", ["", " , ", "disagg,robot", "agentkv,agentkv"])
def test_bad_mode_lists_are_refused_with_a_config_error(text):
    with pytest.raises(ConfigError):
        parse_modes(text)


@pytest.mark.parametrize(
    "field",
    [
        {"sessions": 0},
        {"turns": 0},
        {"concurrency": 0},
        {"context_tokens": 10},
        {"tool_tokens": 1},
        {"output_tokens": 2},
        {"sessions": 1.5},
        {"think_time_s": -1.0},
        {"modes": ()},
        {"modes": (Mode.DISAGG, Mode.DISAGG)},
        {"run_id": "a/b"},
        {"run_id": "x" * 40},
    ],
)
def test_out_of_range_settings_fail_on_construction(field):
    with pytest.raises(ConfigError):
        BenchConfig(**field)


def test_every_run_gets_its_own_salt_prefix_by_default():
    assert BenchConfig().run_id != BenchConfig().run_id


def test_to_json_is_plain_data_with_mode_names():
    data = BenchConfig(modes=(Mode.AGENTKV,), run_id="r1").to_json()
    assert data["modes"] == ["agentkv"]
    assert data["run_id"] == "r1"
    assert BenchConfig(sessions=3, turns=4, modes=parse_modes("disagg,agentkv")).total_turns == 24
