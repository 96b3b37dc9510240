"""The agent loop on the fake pair: append-only turns that reuse the previous turn's KV, tool
errors the model sees, max_steps, streaming events, handles that expire while tools run.

The fake model answers ``tool_choice`` the way vLLM's structured outputs do (a schema-valid call),
so these runs use ``NativeToolCalling``; a named choice makes the model's choice deterministic.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
from collections.abc import Sequence
from typing import Annotated

import pydantic
import pytest

from agentkv import Agent, AgentOptions, AsyncAgent, AsyncCluster, Cluster, HandleState, Message
from agentkv._agent.agent import _AgentCore
from agentkv._agent.events import (
    HandleExpiredEvent,
    RunResult,
    TextEvent,
    ToolCallEvent,
    ToolResultEvent,
    TurnEvent,
)
from agentkv._agent.tool_calling import ModelReply, NativeToolCalling
from agentkv._agent.tools import (
    ToolArgumentsError,
    ToolCallFormatError,
    ToolExecutionError,
    ToolSpec,
    ToolTimeoutError,
    tool,
)
from agentkv._agent.toolset import ToolResult
from agentkv._types import ToolCall, TurnResult
from agentkv.testing import FakeCluster

BLOCK = 16


@tool
def lookup(key: str) -> str:
    """Look a key up."""
    return f"value of {key}"


@tool
def boom(n: int) -> int:
    """Always fails."""
    raise RuntimeError(f"exploded on {n}")


@tool
def picky(n: Annotated[int, pydantic.Field(ge=1000)]) -> int:
    """Wants big numbers (the fake model writes 0..100)."""
    return n


@tool(timeout_s=0.05)
async def slow(n: int) -> int:
    """Never answers in time."""
    await asyncio.sleep(30)
    return n


def forced(name: str) -> NativeToolCalling:
    """Every step calls ``name``; the last step must answer."""
    return NativeToolCalling(tool_choice=name)


pytestmark = [
    # Pulls of any size, so every later turn reuses exactly the previous prompt + output.
    pytest.mark.fake(pairs=1, block_size=BLOCK, kv_recompute_threshold=0),
    pytest.mark.cluster(manual_clock=True, block_size=BLOCK),
]


def assert_every_later_turn_reuses_the_ideal(run: RunResult, fake: FakeCluster) -> None:
    assert fake.wrong_reuse_events == 0
    for previous, current in itertools.pairwise(run.turns):
        ideal = previous.prompt_tokens + previous.generated_tokens - 1
        assert current.ideal_reused_tokens == ideal
        assert current.handle_state is HandleState.ATTACHED, current.handle_reason
        assert current.reused_tokens == ideal, current


def test_a_run_threads_kv_through_every_step_and_ends_with_the_answer(cluster, fake):
    agent = Agent(
        cluster,
        tools=[lookup],
        system="Look things up.",
        max_steps=4,
        tool_calling=forced("lookup"),
    )
    run = agent.run("Find the value of k.")
    assert run.stop_reason == "answer"
    assert isinstance(run.answer, str)
    assert [len(s.results) for s in run.steps] == [1, 1, 1, 0]
    assert all(r.ok and r.output.startswith("value of ") for r in run.tool_results)
    assert_every_later_turn_reuses_the_ideal(run, fake)
    # The transcript holds everything: system, task, each call and its result, the answer.
    roles = [m.role for m in run.messages]
    assert roles == ["system", "user", *["assistant", "tool"] * 3, "assistant"]
    assert "Call final_answer" in (run.messages[0].content or "")
    assert run.messages[-1].tool_calls[0].name == "final_answer"
    for step, message in zip(run.steps[:3], run.messages[3:9:2], strict=True):
        assert message.tool_call_id == step.tool_calls[0].id
        assert message.content == step.results[0].output


def test_tool_exceptions_become_messages_and_the_loop_goes_on(cluster):
    run = Agent(cluster, tools=[boom], max_steps=3, tool_calling=forced("boom")).run("Go.")
    failures = run.tool_results
    assert len(failures) == 2
    assert all(isinstance(r.error, ToolExecutionError) for r in failures)
    assert isinstance(failures[0].error.__cause__, RuntimeError)
    tool_messages = [m for m in run.messages if m.role == "tool"]
    assert [m.content for m in tool_messages] == [r.output for r in failures]
    assert all("raised RuntimeError: exploded on" in (m.content or "") for m in tool_messages)
    assert run.stop_reason == "answer"


@tool
def silent(key: str) -> str:
    """Finds nothing."""
    return ""


def test_a_tool_returning_nothing_is_reported_to_the_model_and_the_loop_goes_on(cluster):
    """An empty result used to make ``InvalidMessageError`` (empty tool content) end the run."""
    run = Agent(cluster, tools=[silent], max_steps=2, tool_calling=forced("silent")).run("Go.")
    (empty,) = run.tool_results
    assert empty.ok
    assert empty.output == ""
    (message,) = [m for m in run.messages if m.role == "tool"]
    assert message.content == "(the tool returned nothing)"
    assert run.stop_reason == "answer"


def test_invalid_arguments_and_timeouts_are_reported_to_the_model(cluster):
    run = Agent(cluster, tools=[picky], max_steps=2, tool_calling=forced("picky")).run("Go.")
    (invalid,) = run.tool_results
    assert isinstance(invalid.error, ToolArgumentsError)
    assert "greater than or equal to 1000" in invalid.output

    run = Agent(cluster, tools=[slow], max_steps=2, tool_calling=forced("slow")).run("Go.")
    (late,) = run.tool_results
    assert isinstance(late.error, ToolTimeoutError)
    assert [m.content for m in run.messages if m.role == "tool"] == [late.output]


def test_max_steps_without_a_forced_answer_stops_and_keeps_the_last_results(cluster):
    agent = Agent(
        cluster,
        tools=[lookup],
        max_steps=2,
        tool_calling=forced("lookup"),
        force_final_answer=False,
    )
    run = agent.run("Go.")
    assert (run.stop_reason, run.answer) == ("max_steps", None)
    assert len(run.steps) == 2
    # The last results were never sent, but they are not lost.
    assert run.messages[-1].role == "tool"
    assert run.messages[-1].content == run.steps[-1].results[0].output


def test_the_event_stream_reports_each_stage_in_order(cluster):
    agent = Agent(cluster, tools=[lookup, boom], max_steps=3, tool_calling=forced("lookup"))
    items = list(agent.stream("Go."))
    assert isinstance(items[-1], RunResult)
    kinds = [type(item).__name__ for item in items[:-1]]
    assert kinds == ["TurnEvent", "ToolCallEvent", "ToolResultEvent"] * 2 + ["TurnEvent"]
    turns = [i for i in items if isinstance(i, TurnEvent)]
    assert [t.stats for t in turns] == list(items[-1].turns)
    calls = [i.call for i in items if isinstance(i, ToolCallEvent)]
    results = [i.result for i in items if isinstance(i, ToolResultEvent)]
    assert [r.call for r in results] == calls


def test_text_answers_stream_as_text_events(cluster):
    """With ``tool_choice="auto"`` the fake model answers in text: the run ends on step 1."""
    agent = Agent(cluster, tools=[lookup], tool_calling=NativeToolCalling())
    items = list(agent.stream("Say something."))
    text = "".join(i.text for i in items if isinstance(i, TextEvent))
    run = items[-1]
    assert isinstance(run, RunResult)
    assert text
    assert run.answer == text
    assert run.stop_reason == "answer"


def test_an_agent_on_a_session_continues_its_conversation(cluster, fake):
    with cluster.session() as session:
        agent = Agent(
            session, tools=[lookup], system="S.", max_steps=2, tool_calling=forced("lookup")
        )
        first = agent.run("One.")
        second = agent.run("Two.")
        assert first.session_id == second.session_id == session.session_id
        assert [m.role for m in second.messages].count("system") == 1
        assert second.messages[: len(first.messages)] == first.messages
        turns = session.turns
    assert len(turns) == 4
    assert turns[2].handle_state is HandleState.ATTACHED
    assert turns[2].reused_tokens == turns[2].ideal_reused_tokens
    assert fake.wrong_reuse_events == 0


def test_tools_that_outlast_the_handle_are_reported_and_the_next_turn_drops_it(cluster, clock):
    @tool
    def wait_long() -> str:
        """Takes longer than the handle lives."""
        clock.advance(500.0)
        return "done"

    agent = Agent(cluster, tools=[wait_long], max_steps=2, tool_calling=forced("wait_long"))
    items = list(agent.stream("Go."))
    (expired,) = [i for i in items if isinstance(i, HandleExpiredEvent)]
    assert expired.step == 1
    assert expired.overdue_s == pytest.approx(500.0 - 450.0)
    run = items[-1]
    assert isinstance(run, RunResult)
    assert run.handle_expiries == 1
    assert run.steps[0].handle_expired
    assert run.turns[1].handle_state is HandleState.EXPIRED


def test_a_long_expected_tool_wait_extends_the_handle_so_the_next_turn_still_pulls(
    cluster, clock, fake
):
    @tool
    def wait_long() -> str:
        """Takes longer than the handle would live unextended."""
        clock.advance(500.0)
        return "done"

    agent = Agent(
        cluster,
        tools=[wait_long],
        max_steps=2,
        tool_calling=forced("wait_long"),
        system="Wait when asked. " * 20,
        expected_tool_s=600.0,
    )
    run = agent.run("Go.")
    assert run.handle_expiries == 0
    assert run.turns[1].handle_state is HandleState.ATTACHED, run.turns[1].handle_reason
    assert run.turns[1].extends == 1
    assert "extended" in run.turns[1].handle_reason
    assert_every_later_turn_reuses_the_ideal(run, fake)


def test_async_agents_on_async_clusters_answer_as_their_sync_twins_do(fake, clock):
    async def scenario() -> tuple[RunResult, list[object]]:
        async with AsyncCluster.from_dict(
            fake.cluster_spec, transport=fake.transport, clock=clock
        ) as cluster:
            agent = AsyncAgent(cluster, tools=[lookup], max_steps=2, tool_calling=forced("lookup"))
            run = await agent.run("Go.")
            events = [item async for item in agent.stream("Go.")]
            with pytest.raises(TypeError, match="use AsyncAgent"):
                Agent(cluster)  # type: ignore[arg-type]
        return run, events

    run, events = asyncio.run(scenario())
    with Cluster.from_dict(fake.cluster_spec, transport=fake.transport, clock=clock) as sync:
        agent = Agent(sync, tools=[lookup], max_steps=2, tool_calling=forced("lookup"))
        threaded = agent.run("Go.")
        threaded_events = list(agent.stream("Go."))
        with pytest.raises(TypeError, match="use Agent"):
            AsyncAgent(sync)  # type: ignore[arg-type]
    assert [type(e) for e in threaded_events] == [type(e) for e in events]
    assert run.answer == threaded.answer
    assert isinstance(events[-1], RunResult)


def test_the_options_are_the_agents_keywords():
    keywords = {
        name
        for name, parameter in inspect.signature(_AgentCore).parameters.items()
        if parameter.kind is inspect.Parameter.KEYWORD_ONLY
    }
    assert keywords == set(AgentOptions.__annotations__)


class TwoCalls:
    """A test protocol: every reply asks for two ``meet`` calls, the second step answers."""

    def __init__(self) -> None:
        self.native = NativeToolCalling()

    def instructions(self, tools: Sequence[ToolSpec]) -> str:
        return ""

    def turn_options(self, tools: Sequence[ToolSpec], *, choice: str):
        return {}

    def parse(self, result: TurnResult) -> ModelReply:
        if result.stats.turn > 1:
            return ModelReply(text=result.text, answer="met")
        calls = tuple(
            ToolCall(id=f"c{i}", name="meet", arguments=f'{{"me": "{me}", "other": "{other}"}}')
            for i, (me, other) in enumerate((("a", "b"), ("b", "a")))
        )
        return ModelReply(text=result.text, calls=calls)

    def result_message(self, result: ToolResult) -> Message:
        return self.native.result_message(result)

    def retry_message(self, error: ToolCallFormatError) -> Message:
        return self.native.retry_message(error)


def test_the_calls_of_one_reply_run_in_parallel(cluster):
    """Each call waits for the other: sequential runs would time out."""
    arrived: dict[str, asyncio.Event] = {}

    @tool
    async def meet(me: str, other: str) -> str:
        """Waits for the other call."""
        arrived.setdefault(me, asyncio.Event()).set()
        await asyncio.wait_for(arrived.setdefault(other, asyncio.Event()).wait(), timeout=2)
        return me

    run = Agent(cluster, tools=[meet], tool_calling=TwoCalls()).run("Meet.")
    assert [r.output for r in run.tool_results] == ["a", "b"]
    assert [m.tool_call_id for m in run.messages if m.role == "tool"] == ["c0", "c1"]

    arrived.clear()
    sequential = Agent(
        cluster,
        tools=[meet],
        tool_calling=TwoCalls(),
        parallel_tool_calls=False,
        tool_timeout_s=0.2,
    ).run("Meet.")
    first, second = sequential.tool_results
    assert isinstance(first.error, ToolTimeoutError)  # waited for a call that had not started
    assert second.ok


class Garbled(TwoCalls):
    """The first reply is unreadable, the second answers."""

    def parse(self, result: TurnResult) -> ModelReply:
        if result.stats.turn == 1:
            return ModelReply(text=result.text, error=ToolCallFormatError("not a call"))
        return ModelReply(text=result.text, answer="fine")


def test_an_unreadable_reply_is_explained_to_the_model_and_retried(cluster):
    run = Agent(cluster, tools=[lookup], tool_calling=Garbled()).run("Go.")
    assert run.answer == "fine"
    assert run.steps[0].error == "not a call"
    assert run.messages[2] == Message.user("Your reply could not be read: not a call. Call a tool.")


def test_bad_agent_arguments_fail_early(cluster):
    with pytest.raises(TypeError, match="Session"):
        Agent(object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_steps"):
        Agent(cluster, max_steps=0)


class Recorder(TwoCalls):
    """Records the choice of every turn; every reply is one ``lookup`` call."""

    def __init__(self) -> None:
        super().__init__()
        self.choices: list[str] = []

    def turn_options(self, tools: Sequence[ToolSpec], *, choice: str):
        self.choices.append(choice)
        return {}

    def parse(self, result: TurnResult) -> ModelReply:
        call = ToolCall(id=f"c{result.stats.turn}", name="lookup", arguments='{"key": "k"}')
        return ModelReply(text=result.text, calls=(call,))


def test_the_answer_is_withheld_until_min_tool_calls_ran_and_forced_at_the_end(cluster):
    recorder = Recorder()
    agent = Agent(cluster, tools=[lookup], tool_calling=recorder, min_tool_calls=2, max_steps=4)
    run = agent.run("Go.")
    assert recorder.choices == ["required", "required", "auto", "final"]
    assert run.stop_reason == "max_steps"  # this protocol never answers
    assert len(run.tool_results) == 4


def test_worked_examples_follow_the_system_prompt_once_per_session(cluster):
    protocol = NativeToolCalling(tool_choice="lookup", describe_tools=True)
    example = protocol.example("Find x.", [("lookup", {"key": "x"}, "value of x")], "value of x")
    with cluster.session() as session:
        agent = Agent(
            session,
            tools=[lookup],
            system="S.",
            examples=example,
            max_steps=2,
            tool_calling=protocol,
        )
        agent.run("Find y.")
        agent.run("Find z.")
        messages = session.transcript.messages
    assert messages[0].role == "system"
    assert "- lookup(key: string): Look a key up." in (messages[0].content or "")
    assert messages[1 : 1 + len(example)] == example
    assert [m.content for m in messages if m.role == "user"] == ["Find x.", "Find y.", "Find z."]
    assert [c.name for c in example[-1].tool_calls] == ["final_answer"]


@pytest.mark.parametrize(
    ("expected_tool_s", "state"), [(None, HandleState.ATTACHED), (600.0, HandleState.TIER)]
)
def test_with_a_tier_only_an_expected_tool_duration_sends_the_pin_to_the_tier(
    clock, expected_tool_s, state
):
    """The tool timeout (60 s by default) bounds a call, it does not predict it: the pin stays.
    An expected duration past ``persist_after_s`` persists it; the next turn loads it."""
    fake = FakeCluster(pairs=1, clock=clock, block_size=BLOCK, kv_recompute_threshold=0, tier=True)
    with Cluster.from_dict(
        fake.cluster_spec, transport=fake.transport, clock=clock, block_size=BLOCK
    ) as cluster:
        agent = Agent(
            cluster,
            tools=[lookup],
            max_steps=2,
            tool_calling=forced("lookup"),
            system="Look it up. " * 20,
            expected_tool_s=expected_tool_s,
        )
        run = agent.run("Go.")
    assert run.turns[1].handle_state is state, run.turns[1].handle_reason
    assert run.turns[1].reused_tokens == run.turns[1].ideal_reused_tokens
    assert fake.wrong_reuse_events == 0
