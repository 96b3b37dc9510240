"""``ChatAgentKV`` on the fake pair: a LangChain tool loop keeps one session and reuses its KV."""

from __future__ import annotations

import asyncio
import itertools

import pytest

pytest.importorskip("langchain_core")

from langchain_core.messages import (
    AIMessage,
    BaseMessage,
    ChatMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)
from langchain_core.tools import tool as lc_tool

from agentkv import Cluster, HandleState, InvalidMessageError
from agentkv._agent.tool_calling import JsonToolCalling, NativeToolCalling
from agentkv.integrations.langchain import ChatAgentKV
from agentkv.testing import FakeCluster, ManualClock


@lc_tool
def add(a: int, b: int) -> int:
    """Add two numbers."""
    return a + b


pytestmark = [
    pytest.mark.fake(pairs=1, block_size=16, kv_recompute_threshold=0),
    pytest.mark.cluster(block_size=16),
]


def run_loop(llm: ChatAgentKV, steps: int) -> tuple[list[BaseMessage], AIMessage]:
    """The usual LangChain loop: call the model, run its tool calls, repeat; then answer."""
    messages: list[BaseMessage] = [SystemMessage("You add."), HumanMessage("Add some numbers.")]
    calling = llm.bind_tools([add], tool_choice="add")
    for _ in range(steps):
        ai = calling.invoke(messages)
        assert ai.tool_calls
        messages.append(ai)
        for call in ai.tool_calls:
            messages.append(ToolMessage(str(add.invoke(call["args"])), tool_call_id=call["id"]))
    final = llm.bind_tools([add], tool_choice="final").invoke(messages)
    return messages, final


def test_a_langchain_tool_loop_reuses_every_previous_turn(cluster, fake):
    llm = ChatAgentKV(cluster=cluster, tool_calling=NativeToolCalling(tool_choice="required"))
    messages, final = run_loop(llm, steps=3)
    assert final.tool_calls == []
    assert isinstance(final.content, str)
    ais = [m for m in messages if isinstance(m, AIMessage)] + [final]
    stats = [ai.response_metadata["agentkv"] for ai in ais]
    assert len({s["session_id"] for s in stats}) == 1
    for previous, current in itertools.pairwise(stats):
        ideal = previous["prompt_tokens"] + previous["generated_tokens"] - 1
        assert current["handle_state"] == HandleState.ATTACHED.value
        assert current["reused_tokens"] == ideal
    assert final.usage_metadata is not None
    assert final.usage_metadata["input_token_details"]["cache_read"] == stats[-1]["reused_tokens"]
    assert fake.wrong_reuse_events == 0
    assert llm.session is not None
    assert len(llm.session.turns) == 4
    llm.close()


def test_a_different_conversation_starts_a_new_session(cluster):
    llm = ChatAgentKV(cluster=cluster)
    first = llm.invoke([HumanMessage("Hello.")])
    old = llm.session
    assert old is not None
    again = llm.invoke([HumanMessage("Hello."), first, HumanMessage("More.")])
    assert llm.session is old
    assert again.response_metadata["agentkv"]["handle_state"] == "attached"
    other = llm.invoke([HumanMessage("Something else.")])
    assert llm.session is not old
    # The first conversation may come back: its session is kept, not closed.
    assert not old.closed
    back = llm.invoke(
        [HumanMessage("Hello."), first, HumanMessage("More."), again, HumanMessage("?")]
    )
    assert llm.session is old
    assert back.response_metadata["agentkv"]["handle_state"] == "attached"
    assert (
        other.response_metadata["agentkv"]["session_id"]
        != back.response_metadata["agentkv"]["session_id"]
    )
    llm.close()
    assert old.closed


def test_idle_sessions_past_the_bound_close_the_least_recently_used(cluster, fake):
    llm = ChatAgentKV(cluster=cluster, max_idle_sessions=2)
    sessions = []
    for topic in ("apples", "boats", "cars"):
        llm.invoke([HumanMessage(f"Tell me about {topic}.")])
        assert llm.session is not None
        sessions.append(llm.session)
    assert [s.closed for s in sessions] == [True, False, False]
    llm.close()
    assert all(s.closed for s in sessions)
    assert fake.decode(0).pinned_handles == 0


def test_unreadable_replies_are_retried_and_still_line_up_with_the_history(cluster, fake):
    """Replies cut by max_tokens are unreadable JSON: the model is told, twice, and the answer's
    id still maps to every message of those turns."""
    llm = ChatAgentKV(cluster=cluster, tool_calling=JsonToolCalling(), max_tokens=3)
    history: list[BaseMessage] = [HumanMessage("Add.")]
    ai = llm.bind_tools([add]).invoke(history)
    assert ai.tool_calls == []
    assert llm.session is not None
    assert len(llm.session.turns) == 3
    session = llm.session
    more = llm.bind_tools([add]).invoke([*history, ai, HumanMessage("Again.")])
    assert llm.session is session
    assert more.response_metadata["agentkv"]["handle_state"] == "attached"
    # The tool instructions went into a system message of their own.
    system = session.transcript.messages[0]
    assert system.role == "system"
    assert "final_answer" in (system.content or "")
    assert fake.wrong_reuse_events == 0


def test_tool_errors_and_async_calls(cluster):
    llm = ChatAgentKV(cluster=cluster, tool_calling=NativeToolCalling(tool_choice="required"))
    calling = llm.bind_tools([add], tool_choice="add")
    messages: list[BaseMessage] = [HumanMessage("Add.")]
    ai = calling.invoke(messages)
    messages += [ai, ToolMessage("it broke", tool_call_id=ai.tool_calls[0]["id"], status="error")]
    second = asyncio.run(calling.ainvoke(messages))
    assert second.tool_calls
    assert llm.session is not None
    assert len(llm.session.turns) == 2  # the same session went on
    tool_message = llm.session.transcript.messages[-2]
    assert (tool_message.role, tool_message.content) == ("tool", "it broke")
    with pytest.raises(InvalidMessageError):
        llm.invoke([HumanMessage("x"), ChatMessage(content="x", role="critic")])


def _solo_answers(
    conversations: list[list[BaseMessage]], max_tokens: int, rounds: int = 1
) -> list[list[str]]:
    """Each conversation alone, on a pair of its own: ``rounds`` calls, each extending the last."""
    answers = []
    for conversation in conversations:
        fake = FakeCluster(pairs=1, clock=ManualClock())
        with Cluster.from_dict(fake.cluster_spec, transport=fake.transport, block_size=16) as c:
            llm = ChatAgentKV(
                cluster=c, max_tokens=max_tokens, extra_body={"min_tokens": max_tokens - 10}
            )
            texts, history = [], list(conversation)
            for _ in range(rounds):
                ai = llm.invoke(history)
                texts.append(str(ai.content))
                history += [ai, HumanMessage("Go on.")]
            llm.close()
        answers.append(texts)
    return answers


def test_batch_items_get_a_session_each_and_answer_as_if_run_alone(cluster, fake):
    """LangChain's ``batch`` calls the model from several threads at once."""
    # Answers long enough that the next turn's pull clears the recompute threshold.
    llm = ChatAgentKV(cluster=cluster, max_tokens=80, extra_body={"min_tokens": 70})
    conversations: list[list[BaseMessage]] = [
        [SystemMessage("Be brief."), HumanMessage(f"Tell me about topic number {i}.")]
        for i in range(6)
    ]
    solo = _solo_answers(conversations, 80, rounds=2)
    for round_ in range(2):  # the second round extends each conversation: each reuses its KV
        answers = llm.batch(conversations, config={"max_concurrency": 6})
        assert [a.content for a in answers] == [texts[round_] for texts in solo]
        assert len({a.response_metadata["agentkv"]["session_id"] for a in answers}) == 6
        conversations = [
            [*conversation, answer, HumanMessage("Go on.")]
            for conversation, answer in zip(conversations, answers, strict=True)
        ]
    assert all(a.response_metadata["agentkv"]["handle_state"] == "attached" for a in answers)
    assert fake.wrong_reuse_events == 0
    llm.close()
    assert fake.decode(0).pinned_handles == 0


def test_conversations_taking_turns_on_one_model_each_keep_their_session(cluster, fake):
    """Two agents sharing one model, or batch items whose calls never overlap: a call for one
    conversation must not close the other's session (that threw its KV away, and its next
    call re-rendered the history: a different prompt, a different answer)."""
    llm = ChatAgentKV(cluster=cluster, max_tokens=40, extra_body={"min_tokens": 30})
    a: list[BaseMessage] = [SystemMessage("Be brief."), HumanMessage("Tell me about apples.")]
    b: list[BaseMessage] = [SystemMessage("Be brief."), HumanMessage("Tell me about boats.")]
    for _ in range(2):
        for history in (a, b):  # strictly one after the other: no call overlaps another
            history += [llm.invoke(history), HumanMessage("Go on.")]
    last_a, last_b = a[-2], b[-2]
    assert isinstance(last_a, AIMessage)
    assert isinstance(last_b, AIMessage)
    for ai in (last_a, last_b):
        assert ai.response_metadata["agentkv"]["handle_state"] == "attached"
    assert len({m.response_metadata["agentkv"]["session_id"] for m in (a[2], a[4])}) == 1
    assert fake.wrong_reuse_events == 0
    llm.close()
    assert fake.decode(0).pinned_handles == 0


async def test_abatch_items_get_a_session_each(cluster, fake):
    llm = ChatAgentKV(cluster=cluster, max_tokens=16, extra_body={"min_tokens": 6})
    conversations = [[HumanMessage(f"Question {i}?")] for i in range(4)]
    answers = await llm.abatch(conversations)
    assert len({a.response_metadata["agentkv"]["session_id"] for a in answers}) == 4
    assert [[a.content] for a in answers] == _solo_answers(conversations, 16)
    llm.close()
    assert fake.wrong_reuse_events == 0
