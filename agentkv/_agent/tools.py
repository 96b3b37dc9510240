"""``@tool``: a typed Python function becomes a tool with a JSON schema and validated arguments.

The schema comes from the type hints (through pydantic), descriptions from the docstring. Tool
definitions are rendered into the prompt prefix every turn, so they are *canonical*: keys sorted
at every level (except parameter order, which follows the signature), titles dropped, local
``$ref`` s inlined. The same function gives the same bytes in every process, and the prompt
prefix never moves.

>>> @tool
... def add(a: float, b: float) -> float:
...     '''Add two numbers.
...
...     Args:
...         a: the first number.
...         b: the second number.
...     '''
...     return a + b
>>> add.spec.to_openai()["function"]["parameters"]["properties"]["a"]
{'description': 'the first number.', 'type': 'number'}
>>> add(2, 3)  # still a plain function
5
>>> add.validate('{"a": 2, "b": "x"}')
Traceback (most recent call last):
...
agentkv.ToolArgumentsError: invalid arguments for tool 'add': b: Input should be a valid ...
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, ParamSpec, TypeVar, overload

import pydantic
from pydantic.fields import FieldInfo
from pydantic_core import to_jsonable_python

from agentkv._agent.docstrings import parse_docstring
from agentkv._exceptions import AgentKVError

__all__ = [
    "Tool",
    "ToolArgumentsError",
    "ToolCallFormatError",
    "ToolDefinitionError",
    "ToolError",
    "ToolExecutionError",
    "ToolSpec",
    "ToolTimeoutError",
    "UnknownToolError",
    "canonical_schema",
    "serialize_output",
    "tool",
]

P = ParamSpec("P")
R = TypeVar("R")

# Schema keywords that are annotations for humans, not constraints: dropped to keep prompts short.
_NOISE_KEYS = frozenset({"title"})
# Mappings whose keys are names (parameter or definition names), not schema keywords.
_NAME_MAPS = frozenset({"properties", "$defs", "definitions", "patternProperties"})


# --- errors ---------------------------------------------------------------------------------------


class ToolError(AgentKVError):
    """A tool could not be defined, called or run.

    Inside an agent run these never escape: they become tool-result messages the model reads.

    Attributes:
        tool: the tool's name, when known.
    """

    def __init__(self, message: str, *, tool: str | None = None) -> None:
        super().__init__(message)
        self.tool = tool


class ToolDefinitionError(ToolError):
    """A function cannot be made into a tool (a parameter lacks a type hint, names clash)."""


class UnknownToolError(ToolError):
    """The model called a tool that does not exist."""


class ToolArgumentsError(ToolError):
    """The model's arguments are not valid JSON or do not match the tool's schema."""


class ToolTimeoutError(ToolError):
    """The tool ran past its timeout.

    Attributes:
        timeout_s: the timeout it ran past.
    """

    def __init__(self, message: str, *, tool: str | None = None, timeout_s: float) -> None:
        super().__init__(message, tool=tool)
        self.timeout_s = timeout_s


class ToolExecutionError(ToolError):
    """The tool raised; the original exception is ``__cause__``."""


class ToolCallFormatError(ToolError):
    """The model's reply cannot be read as tool calls in the format the agent asked for."""


# --- specs and canonical schemas -----------------------------------------------------------------


def canonical_schema(schema: Any) -> Any:
    """A JSON schema in canonical form: sorted keys, no titles, local ``$ref`` s inlined.

    Parameter order (the keys of ``properties``) is kept: it is the signature's order, and the
    order in which a constrained model writes the arguments.

    >>> canonical_schema({"type": "object", "title": "T", "properties": {"b": {}, "a": {}}})
    {'properties': {'b': {}, 'a': {}}, 'type': 'object'}
    """
    if isinstance(schema, Mapping):
        defs = schema.get("$defs")
        resolved = _inline_refs(schema, defs) if isinstance(defs, Mapping) else schema
        return _sorted(resolved, in_names=False)
    return _sorted(schema, in_names=False)


def _sorted(value: Any, *, in_names: bool) -> Any:
    if isinstance(value, Mapping):
        if in_names:
            return {str(k): _sorted(v, in_names=False) for k, v in value.items()}
        return {
            str(k): _sorted(v, in_names=k in _NAME_MAPS)
            for k, v in sorted(value.items())
            if k not in _NOISE_KEYS or isinstance(v, Mapping)
        }
    if isinstance(value, list | tuple):
        return [_sorted(v, in_names=False) for v in value]
    return value


def _inline_refs(schema: Mapping[str, Any], defs: Mapping[str, Any]) -> Mapping[str, Any]:
    """Replace ``#/$defs/X`` references by their definitions; keep ``$defs`` if one recurses."""

    def resolve(value: Any, seen: frozenset[str]) -> Any:
        if isinstance(value, Mapping):
            ref = value.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                name = ref.removeprefix("#/$defs/")
                if name in seen or name not in defs:
                    raise _Recursive
                rest = {k: v for k, v in value.items() if k != "$ref"}
                return {**resolve(defs[name], seen | {name}), **resolve(rest, seen)}
            return {k: resolve(v, seen) for k, v in value.items() if k != "$defs"}
        if isinstance(value, list):
            return [resolve(v, seen) for v in value]
        return value

    try:
        resolved: Mapping[str, Any] = resolve(schema, frozenset())
    except _Recursive:
        return schema
    return resolved


class _Recursive(Exception):  # noqa: N818 - internal control flow, never raised to callers
    pass


@dataclass(frozen=True, kw_only=True, slots=True)
class ToolSpec:
    """What the model is told about a tool: its name, description and parameter schema.

    ``parameters`` is kept canonical (see ``canonical_schema``), so two specs of the same tool
    serialize to the same bytes.

    >>> spec = ToolSpec(name="now", description="The time.", parameters={"type": "object"})
    >>> ToolSpec.from_openai(spec.to_openai()) == spec
    True
    """

    name: str
    description: str = ""
    parameters: Mapping[str, Any]

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ToolDefinitionError("a tool needs a non-empty name")
        if not isinstance(self.parameters, Mapping):
            raise ToolDefinitionError(f"tool {self.name!r}: parameters must be a JSON schema")
        object.__setattr__(self, "parameters", canonical_schema(self.parameters))

    def to_openai(self) -> dict[str, Any]:
        """The OpenAI ``tools`` entry, keys in canonical order."""
        function: dict[str, Any] = {"description": self.description, "name": self.name}
        function["parameters"] = json.loads(json.dumps(self.parameters))
        return {"function": function, "type": "function"}

    @classmethod
    def from_openai(cls, data: Mapping[str, Any]) -> ToolSpec:
        """From an OpenAI ``tools`` entry (``{"type": "function", "function": {...}}``)."""
        function = data.get("function", data)
        if not isinstance(function, Mapping):
            raise ToolDefinitionError("a tool entry needs a 'function' object")
        parameters = function.get("parameters") or {"type": "object", "properties": {}}
        return cls(
            name=function.get("name", ""),
            description=function.get("description") or "",
            parameters=parameters,
        )


# --- tools ---------------------------------------------------------------------------------------


def serialize_output(value: object) -> str:
    """A tool's return value as the text the model reads; deterministic.

    Strings are kept; anything else is JSON with sorted keys (pydantic models, dataclasses and
    the like through pydantic's encoder).

    >>> serialize_output({"b": 1, "a": [1.5, None]})
    '{"a": [1.5, null], "b": 1}'
    """
    if isinstance(value, str):
        return value
    return json.dumps(to_jsonable_python(value), sort_keys=True, ensure_ascii=False)


class Tool(Generic[P, R]):
    """A function the model can call: a ``ToolSpec`` plus argument validation and a timeout.

    Create tools with ``@tool``. Calling the tool object calls the function unchanged;
    ``await tool.run(arguments)`` validates JSON arguments first and applies the timeout.
    """

    def __init__(
        self,
        function: Callable[P, R],
        *,
        name: str | None = None,
        description: str | None = None,
        timeout_s: float | None = None,
    ) -> None:
        if not callable(function):
            raise ToolDefinitionError(f"@tool needs a function, got {type(function).__name__}")
        self.function = function
        self.name: str = name or str(getattr(function, "__name__", ""))
        if not self.name.isidentifier():
            raise ToolDefinitionError(f"tool name {self.name!r} is not an identifier")
        if timeout_s is not None and timeout_s <= 0:
            raise ToolDefinitionError(f"tool {self.name!r}: timeout_s must be positive")
        self.timeout_s = timeout_s
        self.is_async = inspect.iscoroutinefunction(function)
        doc = parse_docstring(inspect.getdoc(function))
        self._model = _arguments_model(function, self.name, doc.params)
        self.spec = ToolSpec(
            name=self.name,
            description=description if description is not None else doc.summary,
            parameters=self._model.model_json_schema(),
        )
        functools.update_wrapper(self, function)

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        return self.function(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<Tool {self.name}>"

    def validate(self, arguments: str | Mapping[str, Any]) -> dict[str, Any]:
        """Parse and validate the model's arguments (JSON text or a dict) into keyword arguments.

        Raises ``ToolArgumentsError`` with pydantic's reasons, which the model can act on.
        """
        try:
            if isinstance(arguments, str):
                model = self._model.model_validate_json(arguments or "{}")
            else:
                model = self._model.model_validate(dict(arguments))
        except pydantic.ValidationError as exc:
            raise ToolArgumentsError(
                f"invalid arguments for tool {self.name!r}: {_reasons(exc)}", tool=self.name
            ) from None
        return {name: getattr(model, name) for name in type(model).model_fields}

    async def run(
        self, arguments: str | Mapping[str, Any], *, timeout_s: float | None = None
    ) -> Any:
        """Validate ``arguments`` and run the function, sync ones on a worker thread.

        The tool's own ``timeout_s`` wins over the one given here. A sync function that times out
        keeps running on its thread (Python cannot stop it); its result is dropped.

        Raises ``ToolArgumentsError``, ``ToolTimeoutError`` or ``ToolExecutionError``.
        """
        kwargs = self.validate(arguments)
        limit = self.timeout_s if self.timeout_s is not None else timeout_s
        function: Callable[..., Any] = self.function
        scope = asyncio.timeout(limit)
        try:
            async with scope:
                if self.is_async:
                    return await function(**kwargs)
                return await asyncio.to_thread(function, **kwargs)
        except TimeoutError as exc:
            if not scope.expired():
                raise ToolExecutionError(
                    f"tool {self.name!r} raised TimeoutError: {exc}", tool=self.name
                ) from exc
            raise ToolTimeoutError(
                f"tool {self.name!r} timed out after {limit:g} s",
                tool=self.name,
                timeout_s=limit or 0.0,
            ) from None
        except Exception as exc:
            raise ToolExecutionError(
                f"tool {self.name!r} raised {type(exc).__name__}: {exc}", tool=self.name
            ) from exc


def _reasons(exc: pydantic.ValidationError) -> str:
    parts = []
    for error in exc.errors(include_url=False):
        where = ".".join(str(p) for p in error["loc"]) or "arguments"
        parts.append(f"{where}: {error['msg']}")
    return "; ".join(parts)


def _arguments_model(
    function: Callable[..., Any], name: str, docs: Mapping[str, str]
) -> type[pydantic.BaseModel]:
    try:
        signature = inspect.signature(function)
        hints = typing.get_type_hints(function, include_extras=True)
    except (TypeError, ValueError, NameError) as exc:
        raise ToolDefinitionError(f"tool {name!r}: cannot read its signature: {exc}") from exc
    fields: dict[str, Any] = {}
    for param in signature.parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD, param.POSITIONAL_ONLY):
            raise ToolDefinitionError(
                f"tool {name!r}: parameter {param.name!r} must be a plain or keyword-only "
                "parameter (the model passes arguments by name)"
            )
        if param.name not in hints:
            raise ToolDefinitionError(f"tool {name!r}: parameter {param.name!r} needs a type hint")
        annotation = hints[param.name]
        doc = docs.get(param.name)
        if doc and not _has_description(annotation):
            annotation = typing.Annotated[annotation, pydantic.Field(description=doc)]
        default = ... if param.default is param.empty else param.default
        fields[param.name] = (annotation, default)
    try:
        return pydantic.create_model(
            f"{name}_arguments",
            __config__=pydantic.ConfigDict(extra="forbid"),
            **fields,
        )
    except (pydantic.PydanticSchemaGenerationError, TypeError, NameError) as exc:
        raise ToolDefinitionError(f"tool {name!r}: unsupported parameter type: {exc}") from exc


def _has_description(annotation: Any) -> bool:
    if typing.get_origin(annotation) is not typing.Annotated:
        return False
    return any(
        isinstance(meta, FieldInfo) and meta.description for meta in typing.get_args(annotation)
    )


@overload
def tool(function: Callable[P, R], /) -> Tool[P, R]: ...


@overload
def tool(
    *, name: str | None = None, description: str | None = None, timeout_s: float | None = None
) -> Callable[[Callable[P, R]], Tool[P, R]]: ...


def tool(
    function: Callable[P, R] | None = None,
    /,
    *,
    name: str | None = None,
    description: str | None = None,
    timeout_s: float | None = None,
) -> Tool[P, R] | Callable[[Callable[P, R]], Tool[P, R]]:
    """Make a typed function (sync or async) a tool: ``@tool`` or ``@tool(name=..., ...)``.

    Every parameter needs a type hint; ``Annotated[..., pydantic.Field(...)]`` adds constraints
    and descriptions, the docstring's ``Args:`` section adds descriptions too.

    >>> @tool(timeout_s=5.0)
    ... async def fetch(url: str) -> str:
    ...     '''Fetch a web page.'''
    ...     return "<html>"
    >>> fetch.name, fetch.spec.description, fetch.timeout_s
    ('fetch', 'Fetch a web page.', 5.0)
    """
    if function is not None:
        return Tool(function)

    def wrap(fn: Callable[P, R]) -> Tool[P, R]:
        return Tool(fn, name=name, description=description, timeout_s=timeout_s)

    return wrap
