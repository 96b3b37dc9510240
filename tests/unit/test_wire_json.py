"""``loads_without``: an echoed list of ints is skipped, never anything else."""

from __future__ import annotations

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from agentkv._wire.json import JSONDecodeError, loads, loads_without

_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**60), 2**60) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12,
)


def test_the_echoed_list_is_read_as_null_and_the_rest_parsed() -> None:
    answer = {"choices": [{"token_ids": [7, 8]}], "prompt_token_ids": [1, -2, 3], "usage": {}}
    data = loads_without(orjson.dumps(answer), "prompt_token_ids")
    assert data == {**answer, "prompt_token_ids": None}


def test_spaced_json_from_another_server_is_skipped_too() -> None:
    data = loads_without(b'{"prompt_token_ids":[1, 2,\n 3], "x": 1}', "prompt_token_ids")
    assert data == {"prompt_token_ids": None, "x": 1}


@pytest.mark.parametrize("value", [None, [], [[1, 2]], ["1", "2"], [1.5], {"a": [1]}], ids=repr)
def test_a_value_that_is_not_a_plain_int_list_is_parsed_as_sent(value: object) -> None:
    body = orjson.dumps({"prompt_token_ids": value, "y": [4]})
    expected = {"prompt_token_ids": None if value == [] else value, "y": [4]}
    assert loads_without(body, "prompt_token_ids") == expected


@given(rest=st.dictionaries(st.text(), _JSON, max_size=5), ids=st.lists(st.integers(0, 10**6)))
def test_only_the_echo_changes_whatever_the_strings_hold(
    rest: dict[str, object], ids: list[int]
) -> None:
    """Strings that spell the key (escaped quotes) or hold brackets are left as they are."""
    rest = {k: v for k, v in rest.items() if k != "prompt_token_ids"}
    rest["s"] = '"prompt_token_ids":[1]'
    body = orjson.dumps({**rest, "prompt_token_ids": ids})
    assert loads_without(body, "prompt_token_ids") == {**rest, "prompt_token_ids": None}


def test_an_answer_without_the_key_parses_as_loads_does() -> None:
    body = b'{"a":[1,2],"b":"prompt_token_ids"}'
    assert loads_without(body, "prompt_token_ids") == loads(body)


def test_a_broken_answer_still_raises_the_json_error() -> None:
    with pytest.raises(JSONDecodeError):
        loads_without(b'{"prompt_token_ids":[1,2],', "prompt_token_ids")
