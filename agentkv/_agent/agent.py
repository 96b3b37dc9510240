"""The agent loop: model turn, tool calls, tool results appended, next turn; append-only.

Every step only *appends* to the session (tool results, or a note when the reply could not be
read), so each turn's prompt starts with the previous turn's prompt and output, and the prefill
pulls that KV from the decode node instead of recomputing it.

>>> with agentkv.Cluster.from_file(".agentkv/cluster.json") as cluster:  # doctest: +SKIP
...     agent = agentkv.Agent(cluster, tools=[add, multiply], system="You do arithmetic.")
...     result = agent.run("What is (17 + 25) * 3?")
...     print(result.answer, [t.reused_tokens for t in result.turns])

Twins, as sessions are: ``Agent`` wraps a ``Session``/``Cluster`` (``run``, ``stream``);
``AsyncAgent`` wraps an ``AsyncSession``/``AsyncCluster`` (``await run``, ``async for ... in
stream``), with the same arguments. With a cluster each run opens a session and closes it at the
end; with a session, runs continue its conversation.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping
from contextlib import AsyncExitStack
from dataclasses import replace
from typing import Any, TypedDict, Unpack

from agentkv import _constants as defaults
from agentkv._agent.events import (
    AgentEvent,
    AgentStep,
    HandleExpiredEvent,
    RunResult,
    TextEvent,
    ToolCallEvent,
    ToolResultEvent,
    TurnEvent,
)
from agentkv._agent.tool_calling import AUTO, FINAL, REQUIRED, JsonToolCalling, ToolCalling
from agentkv._agent.tools import Tool
from agentkv._agent.toolset import ToolResult, ToolSet
from agentkv._client import kv
from agentkv._client.cluster import AsyncCluster, Cluster
from agentkv._client.offload import OffloadMode
from agentkv._client.portal import Portal
from agentkv._client.session import AsyncSession, Session, TurnOverrides
from agentkv._log import get_logger
from agentkv._types import Message, MessageLike, TextDelta, TurnResult
from agentkv._wire.fields import check_extra_body

__all__ = ["Agent", "AgentOptions", "AsyncAgent"]

logger = get_logger("agentkv")

AsyncTarget = AsyncSession | AsyncCluster
_Items = AsyncIterator[AgentEvent | RunResult]


class AgentOptions(TypedDict, total=False):
    """The keyword arguments of ``AsyncAgent`` and ``Agent`` (documented on ``AsyncAgent``)."""

    tools: Iterable[Tool[..., Any]]
    system: str | None
    examples: Iterable[MessageLike]
    max_steps: int
    min_tool_calls: int
    tool_calling: ToolCalling | None
    max_tokens: int
    parallel_tool_calls: bool
    tool_timeout_s: float | None
    expected_tool_s: float | None
    max_output_chars: int | None
    force_final_answer: bool
    extra_body: Mapping[str, Any] | None


class _AgentCore:
    """What both twins are: the options (``AsyncAgent`` documents them) and the loop, which runs
    on an async session or cluster (the sync twin's on its portal)."""

    def __init__(
        self,
        target: AsyncTarget,
        /,
        *,
        tools: Iterable[Tool[..., Any]] = (),
        system: str | None = None,
        examples: Iterable[MessageLike] = (),
        max_steps: int = defaults.AGENT_MAX_STEPS,
        min_tool_calls: int = 0,
        tool_calling: ToolCalling | None = None,
        max_tokens: int = defaults.MAX_TOKENS,
        parallel_tool_calls: bool = True,
        tool_timeout_s: float | None = defaults.AGENT_TOOL_TIMEOUT_S,
        expected_tool_s: float | None = None,
        max_output_chars: int | None = defaults.AGENT_MAX_OUTPUT_CHARS,
        force_final_answer: bool = True,
        extra_body: Mapping[str, Any] | None = None,
    ) -> None:
        if max_steps < 1:
            raise ValueError(f"max_steps must be at least 1, got {max_steps}")
        self._target = target
        self.tools = ToolSet(tools, max_output_chars=max_output_chars)
        self.tool_calling: ToolCalling = tool_calling or JsonToolCalling()
        self.max_steps = max_steps
        self.min_tool_calls = min_tool_calls
        self.max_tokens = max_tokens
        self.parallel_tool_calls = parallel_tool_calls
        self.tool_timeout_s = tool_timeout_s
        self.expected_tool_s = expected_tool_s if expected_tool_s is not None else tool_timeout_s
        # A timeout bounds a tool call, it does not predict it: only an expected duration the
        # caller gave may send the pin to the file tier (CachePolicy.decide_tier).
        self._offload: OffloadMode = "auto" if expected_tool_s is not None else "never"
        self.force_final_answer = force_final_answer
        self._extra_body = dict(extra_body or {})
        check_extra_body(self._extra_body)  # fail at construction, not on the first turn
        self.examples = tuple(Message.from_openai(m) for m in examples)
        instructions = self.tool_calling.instructions(self.tools.specs)
        # The tool instructions first, the caller's prompt (and any worked example) last: small
        # models follow what is closest to the conversation.
        self.system_prompt = "\n\n".join(p for p in (instructions, system) if p)

    # --- the loop ---------------------------------------------------------------------------------

    async def _items(self, task: str, *, stream: bool) -> _Items:
        target = self._target
        if isinstance(target, AsyncSession):
            async for item in self._loop(target, task, stream=stream):
                yield item
            return
        async with target.session(max_tokens=self.max_tokens) as session:
            async for item in self._loop(session, task, stream=stream):
                yield item

    def _overrides(self, choice: str) -> TurnOverrides:
        overrides = self.tool_calling.turn_options(self.tools.specs, choice=choice)
        extra = {**self._extra_body, **overrides.get("extra_body", {})}
        overrides["max_tokens"] = self.max_tokens
        if extra:
            overrides["extra_body"] = extra
        return overrides

    async def _loop(self, session: AsyncSession, task: str, *, stream: bool) -> _Items:
        view = session.transcript
        if not view.messages and not view.pending:
            system = (Message.system(self.system_prompt),) if self.system_prompt else ()
            session.append(*system, *self.examples)
        session.append(Message.user(task))
        steps: list[AgentStep] = []
        for index in range(1, self.max_steps + 1):
            box = _Box()
            async for event in self._step(session, index, self._choice(index, steps), box, stream):
                yield event
            steps.append(box.step)
            self._log_step(session, box.step)
            if box.step.answer is not None:
                break
        yield self._finish(session, steps)

    def _choice(self, index: int, steps: list[AgentStep]) -> str:
        if index == self.max_steps and self.force_final_answer:
            return FINAL
        if sum(len(step.results) for step in steps) < self.min_tool_calls:
            return REQUIRED
        return AUTO

    async def _step(
        self, session: AsyncSession, index: int, choice: str, box: _Box, stream: bool
    ) -> AsyncIterator[AgentEvent]:
        """One step: the model turn, then its tool calls; the ``AgentStep`` goes in ``box``."""
        overrides = self._overrides(choice)
        result: TurnResult | None = None
        if stream:
            async for piece in session.stream(**overrides):
                if isinstance(piece, TextDelta):
                    yield TextEvent(step=index, text=piece.text)
                else:
                    result = piece
        else:
            result = await session.turn(**overrides)
        assert result is not None  # a turn always ends with its result
        yield TurnEvent(step=index, text=result.text, stats=result.stats)
        reply = self.tool_calling.parse(result)
        step = AgentStep(index=index, text=result.text, stats=result.stats, tool_calls=reply.calls)
        if reply.error is not None:
            session.append(self.tool_calling.retry_message(reply.error))
            box.step = replace(step, error=str(reply.error))
            return
        if reply.answer is not None or not reply.calls:
            box.step = replace(
                step, answer=reply.answer if reply.answer is not None else reply.text
            )
            return
        for call in reply.calls:
            yield ToolCallEvent(step=index, call=call)
        started = time.perf_counter()
        results: list[ToolResult | None] = [None] * len(reply.calls)
        async with AsyncExitStack() as waiting:
            if self.expected_tool_s is not None:
                await waiting.enter_async_context(
                    session.tool_wait(expected_s=self.expected_tool_s, offload=self._offload)
                )
            async for position, tool_result in self.tools.run_many(
                reply.calls, parallel=self.parallel_tool_calls, timeout_s=self.tool_timeout_s
            ):
                results[position] = tool_result
                yield ToolResultEvent(step=index, result=tool_result)
        done = tuple(r for r in results if r is not None)
        session.append(*(self.tool_calling.result_message(r) for r in done))
        tools_s = time.perf_counter() - started
        overdue = kv.overdue_s(session._kv, policy=session.policy, now=_clock(session)())
        if overdue is not None:
            logger.warning(
                "agentkv.handle_expired_during_tools",
                session_id=session.session_id,
                step=index,
                tools_ms=round(tools_s * 1000, 3),
                overdue_ms=round(overdue * 1000, 3),
            )
            yield HandleExpiredEvent(step=index, overdue_s=overdue)
        box.step = replace(step, results=done, tools_s=tools_s, handle_expired=overdue is not None)

    @staticmethod
    def _finish(session: AsyncSession, steps: list[AgentStep]) -> RunResult:
        view = session.transcript
        answer = steps[-1].answer if steps else None
        run = RunResult(
            answer=answer,
            stop_reason="answer" if answer is not None else "max_steps",
            steps=tuple(steps),
            messages=(*view.messages, *view.pending),
            session_id=session.session_id,
        )
        stats = run.stats
        logger.info(
            "agentkv.agent_run",
            session_id=run.session_id,
            steps=len(run.steps),
            stop_reason=run.stop_reason,
            tool_calls=len(run.tool_results),
            reused_tokens=stats.reused_tokens,
            ideal_reused_tokens=stats.ideal_reused_tokens,
        )
        return run

    @staticmethod
    def _log_step(session: AsyncSession, step: AgentStep) -> None:
        logger.info(
            "agentkv.agent_step",
            session_id=session.session_id,
            step=step.index,
            turn=step.stats.turn,
            tool_calls=len(step.tool_calls),
            tool_errors=sum(not r.ok for r in step.results),
            tools_ms=round(step.tools_s * 1000, 3),
            format_error=step.error,
            answered=step.answer is not None,
        )


class AsyncAgent(_AgentCore):
    """A tool-using agent on an agentkv session (see the module docstring).

    Args:
        target: an ``AsyncSession`` (runs continue its conversation) or an ``AsyncCluster``
            (each run on a new session, closed at its end).
        tools: ``@tool`` functions; their order does not matter (specs are sorted by name).
        system: the system prompt; it follows the protocol's tool instructions. Used when
            the session is empty (a new session, or a fresh one per run with a cluster).
        examples: worked examples as messages after the system prompt (few-shot turns, see
            ``JsonToolCalling.example``); also only when the session is empty.
        max_steps: the most model turns per run. With ``force_final_answer`` the last one must
            give the answer.
        min_tool_calls: the model may not answer before this many tool calls ran (with
            ``JsonToolCalling`` the final tool is withheld until then): for tasks known to need
            tools, and small models that answer too early.
        tool_calling: the protocol (``JsonToolCalling()`` by default, see ``_tool_calling``).
        max_tokens: per model turn.
        parallel_tool_calls: run the calls of one reply concurrently.
        tool_timeout_s: per call, unless the tool sets its own.
        expected_tool_s: how long one step's tool calls are expected to take (default: the
            tool timeout). Around the tools the session's policy extends the decode handle when
            the wait would outlast it (``Session.tool_wait``), so a long tool does not cost the
            next turn its reuse.
        max_output_chars: tool outputs longer than this are cut before the model sees them.
        force_final_answer: make the last step an answer rather than more tool calls.
        extra_body: more fields for every decode request (merged under the protocol's).
    """

    def __init__(self, target: AsyncTarget, /, **options: Unpack[AgentOptions]) -> None:
        if not isinstance(target, AsyncSession | AsyncCluster):
            twin = " (use Agent for it)" if isinstance(target, Session | Cluster) else ""
            raise TypeError(
                f"AsyncAgent needs an AsyncSession or AsyncCluster, "
                f"not {type(target).__name__}{twin}"
            )
        super().__init__(target, **options)

    async def run(self, task: str) -> RunResult:
        """Run ``task`` to a final answer or ``max_steps``; return the ``RunResult``."""
        return await _last(self._items(task, stream=False))

    async def stream(self, task: str) -> _Items:
        """Run ``task``, yielding events as they happen, then the ``RunResult``.

        Model text is streamed (``TextEvent``). Leaving the loop early abandons the run.
        """
        async for item in self._items(task, stream=True):
            yield item


class Agent(_AgentCore):
    """The sync twin of ``AsyncAgent``: the same agent, and options, on a ``Session`` or
    ``Cluster``. ``run`` and ``stream`` block; the loop runs on the session's event-loop thread,
    as the sync session's turns do."""

    def __init__(self, target: Session | Cluster, /, **options: Unpack[AgentOptions]) -> None:
        if not isinstance(target, Session | Cluster):
            twin = " (use AsyncAgent for it)" if isinstance(target, AsyncTarget) else ""
            raise TypeError(f"Agent needs a Session or Cluster, not {type(target).__name__}{twin}")
        self._portal: Portal = target._portal
        super().__init__(target._inner if isinstance(target, Session) else target._async, **options)

    def run(self, task: str) -> RunResult:
        """Run ``task`` to a final answer or ``max_steps``; return the ``RunResult``."""
        return self._portal.call(_last(self._items(task, stream=False)))

    def stream(self, task: str) -> Iterator[AgentEvent | RunResult]:
        """Run ``task``, yielding events as they happen, then the ``RunResult``.

        Model text is streamed (``TextEvent``). Leaving the loop early abandons the run.
        """
        return self._portal.iterate(self._items(task, stream=True))


class _Box:
    """Where ``AsyncAgent._step`` (an async generator, which cannot return) leaves its step."""

    step: AgentStep


def _clock(session: AsyncSession) -> Callable[[], float]:
    # The session's handle deadlines are on its cluster's clock (injectable in tests).
    return session.clock


async def _last(items: _Items) -> RunResult:
    async for item in items:
        if isinstance(item, RunResult):
            return item
    raise AssertionError("an agent run ended without a result")  # pragma: no cover
