"""``@tool``: schemas from type hints and docstrings, argument validation, deterministic output,
and running calls (errors become results, parallel calls overlap, timeouts hold)."""

from __future__ import annotations

import asyncio
import enum
import importlib.metadata
import json
import os
import subprocess
import sys
import threading
import time
import tomllib
from pathlib import Path
from typing import Annotated, Literal

import pydantic
import pytest
from hypothesis import given
from hypothesis import strategies as st

from agentkv import AgentKVError, ToolCall
from agentkv._agent.docstrings import parse_docstring
from agentkv._agent.tools import (
    ToolArgumentsError,
    ToolDefinitionError,
    ToolError,
    ToolExecutionError,
    ToolSpec,
    ToolTimeoutError,
    UnknownToolError,
    canonical_schema,
    serialize_output,
    tool,
)
from agentkv._agent.toolset import ToolSet


class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


class Point(pydantic.BaseModel):
    x: int
    y: int = 0


@tool
def search(
    query: str,
    limit: int = 10,
    kinds: list[Literal["file", "dir"]] | None = None,
    color: Color = Color.RED,
    near: Point | None = None,
) -> list[str]:
    """Search the index.

    Longer explanation, on two
    lines.

    Args:
        query: what to look for.
        limit (int): at most this many
            results.
        kinds: which kinds of entries.

    Returns:
        the matching paths.
    """
    return [query] * limit


def _echo(text: str) -> str:
    return text


def _call(name: str, arguments: object = None) -> ToolCall:
    return ToolCall(id="c1", name=name, arguments=json.dumps(arguments or {}))


# --- schemas ------------------------------------------------------------------------------------


def test_the_schema_follows_the_type_hints_and_the_docstring():
    spec = search.spec
    assert spec.name == "search"
    assert spec.description == "Search the index.\nLonger explanation, on two lines."
    params = spec.parameters
    assert list(params["properties"]) == ["query", "limit", "kinds", "color", "near"]
    assert params["required"] == ["query"]
    assert params["additionalProperties"] is False
    props = params["properties"]
    assert props["query"] == {"description": "what to look for.", "type": "string"}
    assert props["limit"] == {
        "default": 10,
        "description": "at most this many results.",
        "type": "integer",
    }
    assert props["color"] == {"default": "red", "enum": ["red", "blue"], "type": "string"}
    # Nested models are inlined (no $ref left for small schema consumers), titles dropped.
    near = props["near"]["anyOf"][0]
    assert near["properties"] == {"x": {"type": "integer"}, "y": {"default": 0, "type": "integer"}}
    assert "$defs" not in params
    assert "title" not in json.dumps(params)


def test_annotated_field_descriptions_win_over_the_docstring():
    @tool
    def f(x: Annotated[int, pydantic.Field(description="from Field", ge=0)]) -> int:
        """F.

        Args:
            x: from the docstring.
        """
        return x

    assert f.spec.parameters["properties"]["x"] == {
        "description": "from Field",
        "minimum": 0,
        "type": "integer",
    }


def test_sphinx_docstrings_are_read_too():
    doc = parse_docstring(
        """Do it.

        :param a: the first
            one.
        :param int b: the second.
        :returns: nothing.
        """
    )
    assert doc.summary == "Do it."
    assert doc.params == {"a": "the first one.", "b": "the second."}


def test_numpy_docstrings_are_read_and_their_sections_stay_out_of_the_description():
    @tool
    def add(a: int, b: float = 0.0) -> float:
        """Add two numbers.

        Exactly.

        Parameters
        ----------
        a : int
            the first number.
        b : float, optional
            the second
            number.

        Returns
        -------
        float
            the sum.

        Examples
        --------
        >>> add(1, 2)
        3.0
        """
        return a + b

    assert add.spec.description == "Add two numbers.\nExactly."
    props = add.spec.parameters["properties"]
    assert props["a"]["description"] == "the first number."
    assert props["b"]["description"] == "the second number."


def test_other_google_sections_are_dropped_whatever_their_case():
    doc = parse_docstring(
        """Look it up.

        args:
            key: which one.

        Keyword Args:
            fresh: skip the cache.

        Note:
            Slow on a cold cache.

        See also:
            the index.
        """
    )
    assert doc.summary == "Look it up."
    assert doc.params == {"key": "which one.", "fresh": "skip the cache."}


def test_a_line_starting_with_a_rest_role_stays_in_the_summary():
    doc = parse_docstring(
        """Fetch the page.

        Answers a
        :class:`Page` object.

        :param url: the :class:`URL` to fetch.
        :rtype: Page
        """
    )
    assert doc.summary == "Fetch the page.\nAnswers a :class:`Page` object."
    assert doc.params == {"url": "the :class:`URL` to fetch."}


def test_the_docstring_parser_is_pinned_exactly():
    """Tool descriptions are bytes of every cached prompt prefix: a parser upgrade that renders
    them differently must be a deliberate change, never one a fresh install brings along."""
    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    pins = [d for d in pyproject["project"]["dependencies"] if d.startswith("docstring-parser")]
    assert pins == [f"docstring-parser=={importlib.metadata.version('docstring-parser')}"]


def test_the_decorator_takes_options_and_keeps_the_function_callable():
    @tool(name="shout", description="Upper-case a word.", timeout_s=2.0)
    async def upper(word: str) -> str:
        return word.upper()

    assert (upper.name, upper.spec.description, upper.timeout_s) == (
        "shout",
        "Upper-case a word.",
        2.0,
    )
    assert upper.is_async
    assert asyncio.run(upper("hi")) == "HI"
    assert search("x", limit=2) == ["x", "x"]


def test_functions_that_cannot_be_tools_are_refused_at_definition():
    def untyped(x):  # type: ignore[no-untyped-def]
        return x

    def star(*args: int) -> int:
        return 0

    def positional(x: int, /) -> int:
        return x

    for function in (untyped, star, positional):
        with pytest.raises(ToolDefinitionError):
            tool(function)
    with pytest.raises(ToolDefinitionError, match="identifier"):
        tool(name="not a name")(positional)
    with pytest.raises(ToolDefinitionError, match="two tools"):
        ToolSet([search, tool(name="search")(_echo)])
    with pytest.raises(ToolDefinitionError, match="@tool"):
        ToolSet([untyped])  # type: ignore[list-item]


def test_tool_errors_hang_off_the_one_tree():
    for cls in (
        ToolDefinitionError,
        UnknownToolError,
        ToolArgumentsError,
        ToolExecutionError,
        ToolTimeoutError,
    ):
        assert issubclass(cls, ToolError)
    assert issubclass(ToolError, AgentKVError)


# --- argument validation ------------------------------------------------------------------------


def test_valid_arguments_are_parsed_into_keyword_arguments():
    kwargs = search.validate('{"query": "q", "kinds": ["file"], "color": "blue"}')
    assert kwargs["query"] == "q"
    assert kwargs["limit"] == 10
    assert kwargs["kinds"] == ["file"]
    assert kwargs["color"] is Color.BLUE
    assert search.validate({"query": "q", "near": {"x": 1}})["near"] == Point(x=1)


@pytest.mark.parametrize(
    ("arguments", "reason"),
    [
        ('{"limit": 3}', "query: Field required"),
        ('{"query": "q", "limit": "many"}', "limit: Input should be a valid integer"),
        ('{"query": "q", "kinds": ["link"]}', "kinds.0: Input should be 'file' or 'dir'"),
        ('{"query": "q", "bogus": 1}', "bogus: Extra inputs are not permitted"),
        ('{"query": "q"', "Invalid JSON"),
        ('["q"]', "Input should be an object"),
    ],
)
def test_invalid_arguments_say_what_is_wrong(arguments, reason):
    with pytest.raises(ToolArgumentsError, match="invalid arguments for tool 'search'") as info:
        search.validate(arguments)
    assert reason in str(info.value)
    assert info.value.tool == "search"


# --- deterministic serialization ----------------------------------------------------------------


def test_tool_order_and_key_order_do_not_change_the_serialized_specs():
    @tool
    def alpha(b: int, a: int) -> int:
        """A."""
        return a + b

    first = [s.to_openai() for s in ToolSet([search, alpha]).specs]
    second = [s.to_openai() for s in ToolSet([alpha, search]).specs]
    assert json.dumps(first) == json.dumps(second)
    assert [t["function"]["name"] for t in first] == ["alpha", "search"]
    # Parameter order is the signature's, everything else sorted.
    assert list(first[0]["function"]["parameters"]["properties"]) == ["b", "a"]
    assert list(first[0]["function"]) == ["description", "name", "parameters"]


@pytest.mark.slow
def test_the_spec_bytes_are_the_same_in_another_process():
    """A prefix rendered by one worker must match another's: no hash-seed or import-order drift."""
    code = (
        f"import json, sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
        "from test_tools import search; print(json.dumps(search.spec.to_openai()))"
    )
    outputs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONHASHSEED": seed},
        ).stdout.strip()
        for seed in ("1", "2")
    }
    assert outputs == {json.dumps(search.spec.to_openai())}


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=5),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=4)
    ),
    max_leaves=20,
)


@given(_json)
def test_canonical_schemas_are_idempotent_and_ignore_key_insertion_order(schema):
    once = canonical_schema(schema)
    assert canonical_schema(once) == once
    if isinstance(schema, dict):
        shuffled = dict(reversed(list(schema.items())))
        assert json.dumps(canonical_schema(shuffled)) == json.dumps(once)


def test_spec_round_trips_through_openai_form():
    spec = search.spec
    assert ToolSpec.from_openai(spec.to_openai()) == spec
    with pytest.raises(ToolDefinitionError):
        ToolSpec(name="", parameters={})


def test_outputs_serialize_deterministically():
    assert serialize_output("plain text") == "plain text"
    assert (
        serialize_output({"b": 1, "a": {"d": 2, "c": None}}) == '{"a": {"c": null, "d": 2}, "b": 1}'
    )
    assert serialize_output(Point(x=1)) == '{"x": 1, "y": 0}'
    assert serialize_output([Color.RED, 1.5]) == '["red", 1.5]'
    assert serialize_output(None) == "null"


# --- running calls ------------------------------------------------------------------------------


def test_each_kind_of_failure_becomes_a_result_the_model_can_read():
    @tool
    def boom(x: int) -> int:
        """Fails."""
        raise ValueError(f"bad {x}")

    @tool(timeout_s=0.05)
    async def slow() -> str:
        """Never ends in time."""
        await asyncio.sleep(10)
        return "late"

    tools = ToolSet([boom, slow])

    async def run_all() -> list:
        return [
            await tools.run(_call("nope")),
            await tools.run(_call("boom", {"x": "x"})),
            await tools.run(_call("boom", {"x": 3})),
            await tools.run(_call("slow")),
        ]

    unknown, invalid, raised, late = asyncio.run(run_all())
    assert isinstance(unknown.error, UnknownToolError)
    assert unknown.output == "error: unknown tool 'nope'; the tools are: boom, slow"
    assert isinstance(invalid.error, ToolArgumentsError)
    assert "x: Input should be a valid integer" in invalid.output
    assert isinstance(raised.error, ToolExecutionError)
    assert raised.output == "error: tool 'boom' raised ValueError: bad 3"
    assert isinstance(raised.error.__cause__, ValueError)
    assert isinstance(late.error, ToolTimeoutError)
    assert late.error.timeout_s == 0.05
    assert late.output == "error: tool 'slow' timed out after 0.05 s"
    assert not any(r.ok for r in (unknown, invalid, raised, late))


@pytest.mark.slow
def test_a_sync_tool_that_hangs_times_out_without_blocking_the_loop():
    release = threading.Event()

    @tool
    def stuck() -> str:
        """Waits on a thread."""
        release.wait(5)
        return "done"

    tools = ToolSet([stuck])
    try:
        result = asyncio.run(tools.run(_call("stuck"), timeout_s=0.05))
    finally:
        release.set()
    assert isinstance(result.error, ToolTimeoutError)


def test_long_outputs_are_cut_with_a_note():
    @tool
    def big() -> str:
        """Much text."""
        return "x" * 50

    result = asyncio.run(ToolSet([big], max_output_chars=10).run(_call("big")))
    assert result.output == "xxxxxxxxxx... [cut: 40 more characters]"
    assert result.value == "x" * 50


def test_parallel_calls_overlap_and_report_in_completion_order():
    """Two calls that each wait for the other can only finish if they run at the same time."""
    events: dict[str, asyncio.Event] = {}

    @tool
    async def meet(me: str, other: str, delay: float) -> str:
        """Waits for the other call."""
        events[me].set()
        await asyncio.wait_for(events[other].wait(), timeout=2)
        await asyncio.sleep(delay)
        return me

    async def scenario() -> list[tuple[int, str]]:
        events.update(a=asyncio.Event(), b=asyncio.Event())
        calls = [
            _call("meet", {"me": "a", "other": "b", "delay": 0.05}),
            _call("meet", {"me": "b", "other": "a", "delay": 0.0}),
        ]
        return [(i, r.output) async for i, r in ToolSet([meet]).run_many(calls)]

    assert asyncio.run(scenario()) == [(1, "b"), (0, "a")]


def test_sequential_calls_run_one_after_the_other_in_order():
    log: list[str] = []

    @tool
    def note(word: str) -> str:
        """Notes a word."""
        log.append(word)
        time.sleep(0.01)
        return word

    async def scenario() -> list[int]:
        calls = [_call("note", {"word": w}) for w in "abc"]
        return [i async for i, _ in ToolSet([note]).run_many(calls, parallel=False)]

    assert asyncio.run(scenario()) == [0, 1, 2]
    assert log == ["a", "b", "c"]


def test_leaving_run_many_early_cancels_the_calls_still_running():
    @tool
    async def wait(seconds: float) -> float:
        """Sleeps."""
        await asyncio.sleep(seconds)
        return seconds

    async def scenario() -> tuple[int, list[asyncio.Task[object]]]:
        calls = [_call("wait", {"seconds": 0.0}), _call("wait", {"seconds": 30.0})]
        stream = ToolSet([wait]).run_many(calls)
        first, _ = await anext(stream)
        await stream.aclose()
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        return first, others

    first, leftover = asyncio.run(scenario())
    assert first == 0
    assert leftover == []


def test_a_tool_raising_timeout_error_itself_is_not_reported_as_our_timeout():
    @tool
    async def flaky() -> str:
        """Its own backend timed out."""
        raise TimeoutError("backend")

    result = asyncio.run(ToolSet([flaky]).run(_call("flaky"), timeout_s=10))
    assert isinstance(result.error, ToolExecutionError)
    assert result.output == "error: tool 'flaky' raised TimeoutError: backend"
