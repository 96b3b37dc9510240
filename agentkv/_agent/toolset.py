"""A set of tools in canonical order, and running the calls a model asked for.

``run`` never raises a ``ToolError``: an unknown name, bad arguments, an exception or a timeout
becomes a ``ToolResult`` whose ``output`` (``"error: ..."``) tells the model what went wrong, so
the loop goes on.

>>> import asyncio
>>> from agentkv._agent.tools import tool
>>> @tool
... def double(x: int) -> int:
...     '''Double a number.'''
...     return 2 * x
>>> tools = ToolSet([double])
>>> result = asyncio.run(tools.run(ToolCall(id="c1", name="double", arguments='{"x": 21}')))
>>> result.output, result.ok
('42', True)
>>> tools.get("triple")
Traceback (most recent call last):
...
agentkv.UnknownToolError: unknown tool 'triple'; the tools are: double
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from agentkv._agent.tools import (
    Tool,
    ToolDefinitionError,
    ToolError,
    ToolSpec,
    UnknownToolError,
    serialize_output,
)
from agentkv._log import get_logger
from agentkv._types import ToolCall

__all__ = ["ToolResult", "ToolSet"]

logger = get_logger("agentkv")


@dataclass(frozen=True, kw_only=True, slots=True)
class ToolResult:
    """The outcome of one tool call.

    ``output`` is the text the model reads (the serialized value, or ``"error: ..."``), before
    the tool-calling protocol frames it; ``value`` is what the function returned (``None`` on
    error); ``error`` is the ``ToolError`` when it failed.
    """

    call: ToolCall
    output: str
    value: Any = field(default=None, compare=False)
    error: ToolError | None = field(default=None, compare=False)
    duration_s: float = field(default=0.0, compare=False)

    @property
    def ok(self) -> bool:
        return self.error is None


class ToolSet:
    """Tools by name, sorted, so their specs serialize the same whatever order they came in.

    Args:
        tools: ``Tool`` objects (from ``@tool``); names must be unique.
        max_output_chars: longer outputs are cut (the model's context is finite), with a note.
    """

    def __init__(
        self, tools: Iterable[Tool[..., Any]], *, max_output_chars: int | None = None
    ) -> None:
        by_name: dict[str, Tool[..., Any]] = {}
        for item in tools:
            if not isinstance(item, Tool):
                raise ToolDefinitionError(
                    f"expected a @tool function, got {type(item).__name__}; decorate it with "
                    "@agentkv.tool"
                )
            if item.name in by_name:
                raise ToolDefinitionError(f"two tools are named {item.name!r}")
            by_name[item.name] = item
        self._tools = dict(sorted(by_name.items()))
        self._max_output_chars = max_output_chars

    def __len__(self) -> int:
        return len(self._tools)

    def __contains__(self, name: object) -> bool:
        return name in self._tools

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._tools)

    @property
    def specs(self) -> tuple[ToolSpec, ...]:
        """The tools' specs, sorted by name."""
        return tuple(t.spec for t in self._tools.values())

    def get(self, name: str) -> Tool[..., Any]:
        tool = self._tools.get(name)
        if tool is None:
            known = ", ".join(self._tools) or "(none)"
            raise UnknownToolError(f"unknown tool {name!r}; the tools are: {known}", tool=name)
        return tool

    async def run(self, call: ToolCall, *, timeout_s: float | None = None) -> ToolResult:
        """Run one call; failures become a result with ``error`` set (see the module docstring)."""
        started = time.perf_counter()
        try:
            value = await self.get(call.name).run(call.arguments, timeout_s=timeout_s)
        except ToolError as exc:
            duration = time.perf_counter() - started
            logger.info(
                "agentkv.tool_failed",
                tool=call.name,
                call_id=call.id,
                error=type(exc).__name__,
                detail=str(exc),
                duration_ms=round(duration * 1000, 3),
            )
            return ToolResult(call=call, output=f"error: {exc}", error=exc, duration_s=duration)
        duration = time.perf_counter() - started
        return ToolResult(
            call=call, output=self._clip(serialize_output(value)), value=value, duration_s=duration
        )

    def _clip(self, text: str) -> str:
        limit = self._max_output_chars
        if limit is None or len(text) <= limit:
            return text
        return f"{text[:limit]}... [cut: {len(text) - limit} more characters]"

    async def run_many(
        self, calls: Sequence[ToolCall], *, parallel: bool = True, timeout_s: float | None = None
    ) -> AsyncIterator[tuple[int, ToolResult]]:
        """Run ``calls`` (concurrently when ``parallel``); yield ``(index, result)`` as each ends.

        Leaving the iteration early cancels the calls still running.
        """
        if not parallel:
            for index, call in enumerate(calls):
                yield index, await self.run(call, timeout_s=timeout_s)
            return
        tasks = {
            asyncio.ensure_future(self.run(call, timeout_s=timeout_s)): index
            for index, call in enumerate(calls)
        }
        try:
            pending = set(tasks)
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in sorted(done, key=tasks.__getitem__):
                    yield tasks[task], task.result()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
