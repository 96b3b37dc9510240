"""Tool-calling protocols: what each asks the server for, and how replies are read."""

from __future__ import annotations

import json

import pytest

from agentkv import HandleState, Message, ToolCall, TurnResult, TurnStats
from agentkv._agent.tool_calling import (
    FINAL_ANSWER,
    JsonToolCalling,
    NativeToolCalling,
    calls_schema,
    describe_tools,
)
from agentkv._agent.tools import ToolDefinitionError, ToolExecutionError, ToolSpec, tool
from agentkv._agent.toolset import ToolResult


@tool
def add(a: int, b: int) -> int:
    """Add two numbers.

    Args:
        a: the first.
    """
    return a + b


@tool
def echo(text: str, loud: bool = False) -> str:
    """Say it back."""
    return text


SPECS = (add.spec, echo.spec)


def _result(
    text: str = "", *, calls: tuple[ToolCall, ...] = (), finish: str = "stop", turn: int = 3
) -> TurnResult:
    stats = TurnStats(
        session_id="s",
        turn=turn,
        pair="p",
        prompt_tokens=10,
        reused_tokens=0,
        pulled_tokens=0,
        computed_tokens=10,
        generated_tokens=5,
        ideal_reused_tokens=0,
        ttft_s=0.1,
        prefill_s=0.05,
        decode_s=0.05,
        total_s=0.1,
        handle_state=HandleState.NONE,
    )
    message = Message.assistant(text if text or not calls else None, tool_calls=calls)
    return TurnResult(message=message, token_ids=(1, 2), finish_reason=finish, stats=stats)


def test_tools_are_described_one_line_each_with_parameter_notes():
    assert describe_tools(SPECS) == (
        "- add(a: integer, b: integer): Add two numbers.\n"
        "    a: the first.\n"
        "- echo(text: string, loud?: boolean): Say it back."
    )


def test_json_instructions_list_the_tools_the_final_tool_and_an_example():
    text = JsonToolCalling().instructions(SPECS)
    assert "- final_answer(answer: string)" in text
    assert text.endswith('Reply format: [{"name": "add", "arguments": {"a": 1, "b": 1}}]')
    assert text == JsonToolCalling().instructions(SPECS)


def test_json_turns_constrain_decoding_to_a_list_of_calls():
    options = JsonToolCalling(max_calls=3).turn_options(SPECS, choice="auto")
    schema = options["extra_body"]["structured_outputs"]["json"]
    assert schema["type"] == "array"
    assert (schema["minItems"], schema["maxItems"]) == (1, 3)
    branches = schema["items"]["anyOf"]
    assert [b["properties"]["name"]["const"] for b in branches] == ["add", "echo", "final_answer"]
    # The name comes first: a constrained model writes properties in schema order.
    assert list(branches[0]["properties"]) == ["name", "arguments"]
    assert branches[0]["properties"]["arguments"] == add.spec.parameters
    assert "tools" not in options  # nothing the chat template would render


def test_json_final_and_named_choices_allow_one_call_of_one_tool():
    protocol = JsonToolCalling()
    final = protocol.turn_options(SPECS, choice="final")["extra_body"]["structured_outputs"]
    named = protocol.turn_options(SPECS, choice="echo")["extra_body"]["structured_outputs"]
    for constraint, name in ((final, "final_answer"), (named, "echo")):
        schema = constraint["json"]
        assert schema["maxItems"] == 1
        assert [b["properties"]["name"]["const"] for b in schema["items"]["anyOf"]] == [name]
    assert protocol.turn_options(SPECS, choice="none") == {}
    with pytest.raises(ValueError, match="unknown tool choice"):
        protocol.turn_options(SPECS, choice="nope")


def _tree(leaf_type: str) -> dict[str, object]:
    node = {"properties": {"child": {"$ref": "#/$defs/Node"}, "leaf": {"type": leaf_type}}}
    return {"$defs": {"Node": node}, "properties": {"root": {"$ref": "#/$defs/Node"}}}


def test_recursive_definitions_are_hoisted_to_the_root_and_must_agree():
    one = ToolSpec(name="one", parameters=_tree("string"))
    schema = calls_schema([one], max_calls=1)
    assert "child" in schema["$defs"]["Node"]["properties"]
    assert "$defs" not in schema["items"]["anyOf"][0]["properties"]["arguments"]
    other = ToolSpec(name="two", parameters=_tree("integer"))
    with pytest.raises(ToolDefinitionError, match="Node"):
        calls_schema([one, other], max_calls=1)


def test_json_replies_become_calls_with_ids_unique_in_the_session():
    reply = JsonToolCalling().parse(
        _result(
            '[{"name":"add","arguments":{"a":1,"b":2}},{"name":"echo","arguments":{"text":"é"}}]'
        )
    )
    assert reply.error is None
    assert reply.answer is None
    assert reply.calls == (
        ToolCall(id="call_3_0", name="add", arguments='{"a": 1, "b": 2}'),
        ToolCall(id="call_3_1", name="echo", arguments='{"text": "é"}'),
    )


def test_a_final_answer_call_ends_the_run():
    reply = JsonToolCalling().parse(
        _result('[{"name":"final_answer","arguments":{"answer":"42"}}]')
    )
    assert (reply.answer, reply.calls) == ("42", ())
    single = JsonToolCalling().parse(_result('{"name":"final_answer","arguments":{"answer":7}}'))
    assert single.answer == "7"


@pytest.mark.parametrize(
    ("text", "finish", "reason"),
    [
        ('[{"name":"add","argu', "length", "cut off by max_tokens"),
        ("not json", "stop", "not JSON"),
        ("[]", "stop", "non-empty JSON list"),
        ('[{"arguments":{}}]', "stop", "call 0 is not a name"),
    ],
)
def test_unreadable_json_replies_are_errors_the_model_is_told_about(text, finish, reason):
    protocol = JsonToolCalling()
    reply = protocol.parse(_result(text, finish=finish))
    assert reply.error is not None
    assert reason in str(reply.error)
    note = protocol.retry_message(reply.error)
    assert note.role == "user"
    assert reason in (note.content or "")


def test_json_tool_results_name_the_call_they_answer():
    protocol = JsonToolCalling()
    call = ToolCall(id="call_1_0", name="add", arguments='{"a": 1, "b": 2}')
    ok = protocol.result_message(ToolResult(call=call, output="3"))
    assert ok == Message.tool("add(a=1, b=2) returned: 3", tool_call_id="call_1_0")
    failed = protocol.result_message(
        ToolResult(call=call, output="error: boom", error=ToolExecutionError("boom"))
    )
    assert failed.content == "add(a=1, b=2) failed: error: boom"


def test_native_required_adds_the_final_tool_and_forces_it_at_the_end():
    protocol = NativeToolCalling(tool_choice="required", describe_tools=True)
    auto = protocol.turn_options(SPECS, choice="auto")
    final = protocol.turn_options(SPECS, choice="final")
    names = [t["function"]["name"] for t in auto["tools"]]
    assert names == ["add", "echo", "final_answer"]
    assert auto["tools"] == final["tools"]  # the tools (and so the prompt) never change
    assert auto["tool_choice"] == "required"
    assert final["tool_choice"] == {"function": {"name": "final_answer"}, "type": "function"}
    assert "- final_answer(answer: string)" in protocol.instructions(SPECS)


def test_native_auto_answers_in_text_and_ends_with_tool_choice_none():
    protocol = NativeToolCalling()
    assert protocol.instructions(SPECS) == ""
    options = protocol.turn_options(SPECS, choice="auto")
    assert [t["function"]["name"] for t in options["tools"]] == ["add", "echo"]
    assert options["tool_choice"] == "auto"
    assert protocol.turn_options(SPECS, choice="final")["tool_choice"] == "none"
    assert protocol.parse(_result("It is 3.")).answer == "It is 3."


def test_native_replies_keep_the_server_ids_and_read_the_final_answer():
    protocol = NativeToolCalling(tool_choice="required")
    calls = (
        ToolCall(id="srv-1", name="add", arguments='{"a": 1, "b": 2}'),
        ToolCall(id="", name="echo", arguments='{"text": "x"}'),
    )
    reply = protocol.parse(_result(calls=calls))
    assert [c.id for c in reply.calls] == ["srv-1", "call_3_1"]
    assert reply.answer is None
    final = ToolCall(id="srv-2", name="final_answer", arguments=json.dumps({"answer": "3"}))
    assert protocol.parse(_result(calls=(final,))).answer == "3"
    result = ToolResult(call=calls[0], output="3")
    assert protocol.result_message(result) == Message.tool("3", tool_call_id="srv-1")


def test_the_final_tool_is_a_plain_string_answer():
    assert FINAL_ANSWER.parameters["required"] == ["answer"]
    assert FINAL_ANSWER.parameters["properties"]["answer"]["type"] == "string"


def test_required_means_a_tool_now_and_not_the_answer():
    constraint = JsonToolCalling(max_calls=2).turn_options(SPECS, choice="required")
    schema = constraint["extra_body"]["structured_outputs"]["json"]
    assert [b["properties"]["name"]["const"] for b in schema["items"]["anyOf"]] == ["add", "echo"]
    assert schema["maxItems"] == 2
    native = NativeToolCalling(tool_choice="required").turn_options(SPECS, choice="required")
    assert native["tool_choice"] == "required"


def test_worked_examples_are_turns_in_the_protocols_own_format():
    steps = [("add", {"a": 2, "b": 3}, "5")]
    json_turns = JsonToolCalling().example("2 + 3?", steps, "5")
    assert [m.role for m in json_turns] == ["user", "assistant", "tool", "assistant"]
    assert json_turns[1].content == '[{"name": "add", "arguments": {"a": 2, "b": 3}}]'
    assert json_turns[2].content == "add(a=2, b=3) returned: 5"
    auto = NativeToolCalling().example("2 + 3?", steps, "5")
    assert auto[1].tool_calls == (
        ToolCall(id="example_0", name="add", arguments='{"a": 2, "b": 3}'),
    )
    assert auto[2] == Message.tool("5", tool_call_id="example_0")
    assert auto[-1] == Message.assistant("5")
