"""How the model is asked for tool calls, and how its replies are read: two protocols.

``JsonToolCalling`` (the default) constrains decoding with vLLM's structured outputs to a JSON list
of ``{"name", "arguments"}`` objects, one schema branch per tool, and describes the tools in the
system prompt. It needs no server flags and no tool syntax in the chat template, so it works with
SmolLM2's plain ChatML; every reply is a valid call by construction. The run ends when the model
calls ``final_answer``.

``NativeToolCalling`` sends OpenAI ``tools`` / ``tool_choice`` and reads the server's parsed
``tool_calls``. It needs a server started with ``--tool-call-parser`` (and
``--enable-auto-tool-choice`` for ``"auto"``), and a model whose template renders tools.

Both keep the prompt append-only: the tool block is part of the first (system) message, the
constraint lives in the decode request only, and the assistant's tool calls stay in the transcript
as the exact tokens the model generated.

>>> from agentkv._agent.tools import ToolSpec
>>> add = ToolSpec(name="add", description="Add two numbers.", parameters={
...     "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
...     "required": ["a", "b"]})
>>> print(describe_tools([add, FINAL_ANSWER]))
- add(a: number, b: number): Add two numbers.
- final_answer(answer: string): Give the final answer to the task and stop.
    answer: the final answer.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from agentkv import _constants as defaults
from agentkv._agent.tools import ToolCallFormatError, ToolDefinitionError, ToolSpec
from agentkv._agent.toolset import ToolResult
from agentkv._types import Message, ToolCall, TurnOverrides, TurnResult
from agentkv._wire.fields import AUTO, FINAL, NONE, REQUIRED

__all__ = [
    "AUTO",
    "FINAL",
    "FINAL_ANSWER",
    "NONE",
    "REQUIRED",
    "JsonToolCalling",
    "ModelReply",
    "NativeToolCalling",
    "ToolCalling",
    "describe_tools",
]

# What the model reads for a tool that returned an empty string.
EMPTY_RESULT = "(the tool returned nothing)"

FINAL_ANSWER = ToolSpec(
    name="final_answer",
    description="Give the final answer to the task and stop.",
    parameters={
        "type": "object",
        "properties": {"answer": {"type": "string", "description": "the final answer."}},
        "required": ["answer"],
        "additionalProperties": False,
    },
)
"""The tool a model calls to end a run, where every reply must be a tool call."""



@dataclass(frozen=True, kw_only=True, slots=True)
class ModelReply:
    """What one assistant turn asked for: tool calls to run, a final answer, or neither.

    ``error`` is set when the reply cannot be read as tool calls (the agent tells the model and
    lets it try again).
    """

    text: str
    calls: tuple[ToolCall, ...] = ()
    answer: str | None = None
    error: ToolCallFormatError | None = None


class ToolCalling(Protocol):
    """A tool-calling protocol: what to add to the prompt, what to ask each turn, how to read it.

    ``choice`` is ``"auto"`` (any tool, or an answer), ``"required"`` (a tool, not the answer
    yet), ``"final"`` (answer now), ``"none"`` (text only) or a tool name (call that tool).
    """

    def instructions(self, tools: Sequence[ToolSpec]) -> str:
        """Text for the system message: the tools and the reply format ('' for none)."""
        ...

    def turn_options(self, tools: Sequence[ToolSpec], *, choice: str) -> TurnOverrides:
        """The per-turn request settings (``tools``, ``tool_choice``, ``extra_body``)."""
        ...

    def parse(self, result: TurnResult) -> ModelReply:
        """Read a finished turn."""
        ...

    def result_message(self, result: ToolResult) -> Message:
        """The message that tells the model a tool's result."""
        ...

    def retry_message(self, error: ToolCallFormatError) -> Message:
        """The message that tells the model its reply could not be read."""
        ...


# --- describing tools ----------------------------------------------------------------------------


def _type_label(schema: Any) -> str:
    if not isinstance(schema, Mapping):
        return "any"
    if "const" in schema or "enum" in schema:
        values = [schema["const"]] if "const" in schema else schema["enum"]
        return " | ".join(json.dumps(v) for v in values)
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            return " | ".join(_type_label(s) for s in schema[key])
    kind = schema.get("type")
    if isinstance(kind, list):
        return " | ".join(map(str, kind))
    if kind == "array":
        return f"list[{_type_label(schema.get('items'))}]"
    return str(kind) if kind else "any"


def _params(spec: ToolSpec) -> list[tuple[str, Mapping[str, Any], bool]]:
    props = spec.parameters.get("properties")
    required = spec.parameters.get("required") or []
    if not isinstance(props, Mapping):
        return []
    return [(name, schema, name in required) for name, schema in props.items()]


def describe_tools(tools: Sequence[ToolSpec]) -> str:
    """One line per tool (signature and summary), then one indented line per described parameter.

    Deterministic: the same specs always give the same text.
    """
    lines = []
    for spec in tools:
        params = _params(spec)
        signature = ", ".join(
            f"{name}{'' if required else '?'}: {_type_label(schema)}"
            for name, schema, required in params
        )
        lines.append(f"- {spec.name}({signature}): {spec.description}".rstrip(": "))
        for name, schema, _ in params:
            description = schema.get("description") if isinstance(schema, Mapping) else None
            if description:
                lines.append(f"    {name}: {description}")
    return "\n".join(lines)


def _example_value(schema: Any) -> Any:
    if not isinstance(schema, Mapping):
        return None
    if "const" in schema:
        return schema["const"]
    if schema.get("enum"):
        return schema["enum"][0]
    if "default" in schema:
        return schema["default"]
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list) and schema[key]:
            return _example_value(schema[key][0])
    examples = {"number": 1, "integer": 1, "boolean": True, "array": [], "object": {}, "null": None}
    return examples.get(str(schema.get("type")), "...")


def example_call(spec: ToolSpec) -> dict[str, Any]:
    """A schema-shaped example call of ``spec`` (required arguments only)."""
    arguments = {name: _example_value(schema) for name, schema, req in _params(spec) if req}
    return {"name": spec.name, "arguments": arguments}


def _arguments_text(call: ToolCall) -> str:
    try:
        arguments = json.loads(call.arguments)
    except json.JSONDecodeError:
        return call.arguments
    if not isinstance(arguments, dict):
        return call.arguments
    return ", ".join(f"{k}={json.dumps(v, ensure_ascii=False)}" for k, v in arguments.items())


def _call_id(turn: int, index: int) -> str:
    return f"call_{turn}_{index}"


# --- JSON via structured outputs -----------------------------------------------------------------


def _call_schema(spec: ToolSpec) -> dict[str, Any]:
    parameters = {k: v for k, v in spec.parameters.items() if k != "$defs"}
    return {
        "additionalProperties": False,
        # The name first: a constrained model writes properties in schema order, and it should
        # choose the tool before its arguments.
        "properties": {"name": {"const": spec.name}, "arguments": parameters},
        "required": ["name", "arguments"],
        "type": "object",
    }


def calls_schema(allowed: Sequence[ToolSpec], *, max_calls: int) -> dict[str, Any]:
    """The JSON schema of a reply: a list of 1..``max_calls`` calls of the ``allowed`` tools."""
    schema: dict[str, Any] = {
        "items": {"anyOf": [_call_schema(spec) for spec in allowed]},
        "maxItems": max_calls,
        "minItems": 1,
        "type": "array",
    }
    # Definitions a tool could not inline (recursive models) resolve from the root.
    defs: dict[str, Any] = {}
    for spec in allowed:
        for name, definition in (spec.parameters.get("$defs") or {}).items():
            if defs.setdefault(name, definition) != definition:
                raise ToolDefinitionError(
                    f"two tools define {name!r} differently; rename one of the models"
                )
    if defs:
        schema["$defs"] = defs
    return schema


@dataclass(frozen=True, kw_only=True, slots=True)
class JsonToolCalling:
    """Tool calls as a JSON list, enforced by vLLM structured outputs (see the module docstring).

    Args:
        max_calls: the most calls one reply may hold (they run in parallel).
        final_tool: the tool that ends the run; its ``answer`` argument is the answer.
    """

    max_calls: int = defaults.JSON_TOOL_MAX_CALLS
    final_tool: ToolSpec = FINAL_ANSWER

    def _allowed(self, tools: Sequence[ToolSpec], choice: str) -> tuple[list[ToolSpec], int]:
        if choice == FINAL:
            return [self.final_tool], 1
        named = [spec for spec in tools if spec.name == choice]
        if named:
            return named, 1
        if choice == REQUIRED and tools:
            return list(tools), self.max_calls
        if choice != AUTO:
            raise ValueError(f"unknown tool choice {choice!r}")
        return [*tools, self.final_tool], self.max_calls

    def instructions(self, tools: Sequence[ToolSpec]) -> str:
        listed = [*tools, self.final_tool]
        example = json.dumps([example_call(tools[0] if tools else self.final_tool)])
        return (
            "You solve the task with tools. Every reply is a JSON list of tool calls; the "
            f"results come back in the next messages. Call {self.final_tool.name} with the "
            f"answer once you know it.\nTools:\n{describe_tools(listed)}\n"
            f"Reply format: {example}"
        )

    def turn_options(self, tools: Sequence[ToolSpec], *, choice: str) -> TurnOverrides:
        if choice == NONE:
            return {}
        allowed, max_calls = self._allowed(tools, choice)
        schema = calls_schema(allowed, max_calls=max_calls)
        return {"extra_body": {"structured_outputs": {"json": schema}}}

    def parse(self, result: TurnResult) -> ModelReply:
        text = result.text
        if result.finish_reason == "length":
            return _format_error(text, "the reply was cut off by max_tokens before it ended")
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            return _format_error(text, f"not JSON ({exc.msg})")
        if isinstance(data, dict):
            data = [data]
        if not isinstance(data, list) or not data:
            return _format_error(text, "not a non-empty JSON list")
        calls: list[ToolCall] = []
        answer: str | None = None
        for index, item in enumerate(data):
            if not (
                isinstance(item, dict)
                and isinstance(item.get("name"), str)
                and item["name"]
                and isinstance(item.get("arguments", {}), dict)
            ):
                return _format_error(text, f"call {index} is not a name and an arguments object")
            arguments = item.get("arguments", {})
            if item["name"] == self.final_tool.name:
                value = arguments.get("answer", "")
                answer = value if isinstance(value, str) else json.dumps(value)
                continue
            calls.append(
                ToolCall(
                    id=_call_id(result.stats.turn, index),
                    name=item["name"],
                    arguments=json.dumps(arguments, ensure_ascii=False),
                )
            )
        return ModelReply(text=text, calls=tuple(calls), answer=answer)

    def result_message(self, result: ToolResult) -> Message:
        verb = "returned" if result.ok else "failed"
        call = result.call
        return Message.tool(
            f"{call.name}({_arguments_text(call)}) {verb}: {result.output}",
            tool_call_id=call.id,
        )

    def retry_message(self, error: ToolCallFormatError) -> Message:
        return Message.user(
            f"Your reply could not be read: {error}. Reply with a JSON list of tool calls."
        )

    def example(
        self, task: str, steps: Sequence[tuple[str, Mapping[str, Any], str]], answer: str
    ) -> tuple[Message, ...]:
        """A worked example as conversation turns, for ``Agent(examples=...)``.

        ``steps`` are ``(tool name, arguments, output)``. Small models follow demonstrated turns
        far better than a description of the format.

        >>> turns = JsonToolCalling().example("2 + 3?", [("add", {"a": 2, "b": 3}, "5")], "5")
        >>> for message in turns:
        ...     print(f"{message.role}: {message.content}")
        user: 2 + 3?
        assistant: [{"name": "add", "arguments": {"a": 2, "b": 3}}]
        tool: add(a=2, b=3) returned: 5
        assistant: [{"name": "final_answer", "arguments": {"answer": "5"}}]
        """
        out = [Message.user(task)]
        for index, (name, arguments, output) in enumerate(steps):
            call = ToolCall(id=f"example_{index}", name=name, arguments=json.dumps(arguments))
            out.append(Message.assistant(_json_text([{"name": name, "arguments": arguments}])))
            out.append(self.result_message(ToolResult(call=call, output=output)))
        final = {"name": self.final_tool.name, "arguments": {"answer": answer}}
        out.append(Message.assistant(_json_text([final])))
        return tuple(out)


def _json_text(value: object) -> str:
    return json.dumps(value, ensure_ascii=False)


def _format_error(text: str, reason: str) -> ModelReply:
    return ModelReply(text=text, error=ToolCallFormatError(reason))


# --- the server's own tool calling ---------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class NativeToolCalling:
    """OpenAI ``tools`` / ``tool_choice``, parsed by the server (see the module docstring).

    Args:
        tool_choice: ``"auto"`` (the model answers in text when done), ``"required"`` or a tool
            name (every reply is a call; ``final_tool`` is added so that the run can end).
        describe_tools: also list the tools in the system message, for chat templates that do
            not render ``tools`` (SmolLM2's does not).
        final_tool: the tool that ends a run when every reply must be a call.
    """

    tool_choice: str = AUTO
    describe_tools: bool = False
    final_tool: ToolSpec = FINAL_ANSWER

    @property
    def _needs_final(self) -> bool:
        return self.tool_choice != AUTO

    def _listed(self, tools: Sequence[ToolSpec]) -> list[ToolSpec]:
        return [*tools, self.final_tool] if self._needs_final else list(tools)

    def instructions(self, tools: Sequence[ToolSpec]) -> str:
        parts = []
        if self.describe_tools:
            parts.append(f"Tools:\n{describe_tools(self._listed(tools))}")
        if self._needs_final:
            parts.append(f"Call {self.final_tool.name} with the answer once you know it.")
        return "\n".join(parts)

    def turn_options(self, tools: Sequence[ToolSpec], *, choice: str) -> TurnOverrides:
        listed = self._listed(tools)
        if not listed:
            return {}
        options: TurnOverrides = {"tools": [spec.to_openai() for spec in listed]}
        if choice == FINAL:
            options["tool_choice"] = _named(self.final_tool.name) if self._needs_final else NONE
        elif choice == NONE:
            options["tool_choice"] = NONE
        elif choice == REQUIRED:
            # Servers cannot exclude one listed tool: the final one stays possible here.
            options["tool_choice"] = REQUIRED
        elif choice == AUTO:
            default = self.tool_choice
            options["tool_choice"] = default if default in (AUTO, "required") else _named(default)
        else:
            options["tool_choice"] = _named(choice)
        return options

    def parse(self, result: TurnResult) -> ModelReply:
        calls: list[ToolCall] = []
        answer: str | None = None
        for index, call in enumerate(result.tool_calls):
            if call.name == self.final_tool.name:
                answer = _answer_argument(call.arguments)
                continue
            # A tool message needs the id it answers; servers that leave it empty get ours.
            calls.append(
                call
                if call.id
                else ToolCall(
                    id=_call_id(result.stats.turn, index), name=call.name, arguments=call.arguments
                )
            )
        if not result.tool_calls:
            answer = result.text
        return ModelReply(text=result.text, calls=tuple(calls), answer=answer)

    def result_message(self, result: ToolResult) -> Message:
        # A tool message needs content (vLLM's templates and our own checks): say it was empty
        # rather than let an empty result end the run.
        return Message.tool(result.output or EMPTY_RESULT, tool_call_id=result.call.id)

    def retry_message(self, error: ToolCallFormatError) -> Message:
        return Message.user(f"Your reply could not be read: {error}. Call a tool.")

    def example(
        self, task: str, steps: Sequence[tuple[str, Mapping[str, Any], str]], answer: str
    ) -> tuple[Message, ...]:
        """A worked example as conversation turns (see ``JsonToolCalling.example``)."""
        out = [Message.user(task)]
        for index, (name, arguments, output) in enumerate(steps):
            call = ToolCall(id=f"example_{index}", name=name, arguments=json.dumps(arguments))
            out.append(Message.assistant(tool_calls=[call]))
            out.append(self.result_message(ToolResult(call=call, output=output)))
        if self._needs_final:
            final = ToolCall(
                id=f"example_{len(steps)}",
                name=self.final_tool.name,
                arguments=json.dumps({"answer": answer}),
            )
            out.append(Message.assistant(tool_calls=[final]))
        else:
            out.append(Message.assistant(answer))
        return tuple(out)


def _named(name: str) -> dict[str, Any]:
    return {"function": {"name": name}, "type": "function"}


def _answer_argument(arguments: str) -> str:
    try:
        data = json.loads(arguments)
    except json.JSONDecodeError:
        return arguments
    value = data.get("answer", "") if isinstance(data, dict) else data
    return value if isinstance(value, str) else json.dumps(value)
