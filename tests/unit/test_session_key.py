"""Sessions from the agents' own headers, threads by agent id or start, prefix-break reasons."""

from __future__ import annotations

import pytest

from agentkv import Message
from agentkv._prompt.history import plan_history
from agentkv.proxy._errors import ProxyError
from agentkv.proxy._prefix_breaks import cache_miss_reason
from agentkv.proxy._session_key import SESSION_SOURCES, claude_code_session_id, session_key
from agentkv.proxy._threads import MAX_SIDE_THREADS, ThreadIndex, thread_of

HEADERS = [s for s in SESSION_SOURCES if s is not None]


@pytest.mark.parametrize("name", HEADERS)
def test_each_agents_header_alone_names_the_session(name):
    key = session_key({name: " s-1 "})
    assert key is not None
    assert (key.session_id, key.source, key.agent_id) == ("s-1", name, None)


def test_the_precedence_is_the_documented_table():
    """Every source outranks the ones after it; the body's id sits after Claude Code's header."""
    sources = list(SESSION_SOURCES)
    for i, higher in enumerate(sources):
        for lower in sources[i + 1 :]:
            headers = {h: h or "body" for h in (higher, lower) if h is not None}
            body = "body" if None in (higher, lower) else None
            key = session_key(headers, body)
            assert key is not None
            assert key.session_id == (higher or "body"), (higher, lower)
    assert session_key({}) is None
    assert session_key({"x-agentkv-route": "pull"}) is None


def test_claude_code_subagents_are_threads_of_their_parents_session():
    key = session_key(
        {
            "x-claude-code-session-id": "cc",
            "x-claude-code-agent-id": "a2",
            "x-claude-code-parent-agent-id": "a1",
        }
    )
    assert key is not None
    assert (key.session_id, key.agent_id, key.parent_id) == ("cc", "a2", "a1")


def test_a_codex_thread_other_than_its_session_is_a_thread_of_it():
    own = session_key({"session-id": "s", "thread-id": "s"})
    spawned = session_key({"session-id": "s", "thread-id": "t2", "x-codex-parent-thread-id": "s"})
    assert own is not None
    assert own.agent_id is None
    assert spawned is not None
    assert (spawned.session_id, spawned.agent_id, spawned.parent_id) == ("s", "t2", "s")


def test_a_child_session_names_its_parent_session_for_placement():
    key = session_key({"x-session-id": "child", "x-parent-session-id": "parent"})
    assert key is not None
    assert (key.session_id, key.parent_session) == ("child", "parent")


@pytest.mark.parametrize("bad", ["", "   ", "x" * 257, "a\nb"])
@pytest.mark.parametrize("name", ["x-claude-code-session-id", "x-claude-code-agent-id"])
def test_a_malformed_id_is_a_400(name, bad):
    headers = {"x-claude-code-session-id": "ok", name: bad}
    with pytest.raises(ProxyError) as caught:
        session_key(headers)
    assert caught.value.status == 400


def test_claude_codes_metadata_user_id_in_both_forms():
    assert claude_code_session_id('{"device_id":"d","session_id":"u-1"}') == "u-1"
    legacy = "user_" + "ab" * 32 + "_account_acc-7_session_0f4e-11"
    assert claude_code_session_id(legacy) == "0f4e-11"
    for other in (None, 7, "", "{not json", '{"session_id": 3}', "[1]", "someone"):
        assert claude_code_session_id(other) is None


SYSTEM = Message.system("You write code.")
TITLE = Message.system("Write a five word title.")
KEY = session_key({"x-session-id": "s"})


def _resolve(index, messages, key=KEY, held=None):
    assert key is not None
    return index.resolve("alice", key, messages, held=lambda: held)


def test_threads_without_agent_ids_are_told_by_where_they_start():
    index = ThreadIndex(max_entries=4)
    main = _resolve(index, [SYSTEM, Message.user("fix it")])
    title = _resolve(index, [TITLE, Message.user("fix it")])
    assert (main.registry_id, main.name, main.placement) == ("s", "main", None)
    assert title.registry_id == f"s~{title.name}"
    assert title.name.startswith("start:")
    assert title.placement == "alice:s"  # placed as the session's own thread is
    again = [SYSTEM, Message.user("fix it"), Message.assistant("done"), Message.user("more")]
    assert _resolve(index, again).registry_id == "s"
    assert _resolve(index, [TITLE, Message.user("other")]).registry_id == title.registry_id
    assert thread_of(title.registry_id) == ("s", title.name)
    assert thread_of("s") == ("s", "main")


def test_a_history_of_turns_that_starts_elsewhere_is_the_sessions_own_thread():
    """Its system prompt changed: it forks that thread, it opens no side thread."""
    index = ThreadIndex(max_entries=4)
    _resolve(index, [SYSTEM, Message.user("a")])
    changed = [TITLE, Message.user("a"), Message.assistant("b"), Message.user("c")]
    assert _resolve(index, changed).registry_id == "s"


def test_side_threads_are_bounded_per_session():
    index = ThreadIndex(max_entries=4)
    _resolve(index, [SYSTEM, Message.user("a")])
    names = {
        _resolve(index, [Message.system(f"side {i}"), Message.user("a")]).name
        for i in range(MAX_SIDE_THREADS + 3)
    }
    assert len(names) == MAX_SIDE_THREADS + 1  # the sides, then the session's own
    assert "main" in names


def test_a_forgotten_session_reads_its_own_start_from_the_registrys_copy():
    index = ThreadIndex(max_entries=1)
    held = [SYSTEM, Message.user("a"), Message.assistant("b")]
    title = _resolve(index, [TITLE, Message.user("a")], held=held)
    assert title.name.startswith("start:")


def test_agent_threads_are_keyed_by_session_and_agent():
    index = ThreadIndex(max_entries=4)
    key = session_key({"x-claude-code-session-id": "cc", "x-claude-code-agent-id": "a1"})
    thread = _resolve(index, [SYSTEM, Message.user("a")], key=key)
    assert (thread.registry_id, thread.name, thread.placement) == (
        "cc~agent:a1",
        "agent:a1",
        "alice:cc",
    )


HELD = [SYSTEM, Message.user("one"), Message.assistant("two")]


@pytest.mark.parametrize(
    ("incoming", "tools_changed", "reason", "at"),
    [
        (
            [TITLE, Message.user("one"), Message.assistant("two"), Message.user("x")],
            False,
            "system_changed",
            0,
        ),
        (
            [SYSTEM, Message.user("uno"), Message.assistant("two"), Message.user("x")],
            False,
            "messages_changed",
            1,
        ),
        ([SYSTEM, Message.user("one")], False, "messages_changed", 2),
        ([*HELD, Message.user("x")], True, "tools_changed", 0),
        (HELD, False, "regenerated", 3),
    ],
)
def test_a_break_names_its_reason_and_where_it_fell(incoming, tools_changed, reason, at):
    plan = plan_history(HELD, incoming, generated={2}, tools_changed=tools_changed)
    assert plan.forked
    assert (plan.break_reason, plan.diverged_message) == (reason, at)


def test_an_extension_is_no_break():
    plan = plan_history(HELD, [*HELD, Message.user("x")], generated={2})
    assert (plan.break_reason, plan.diverged_message, plan.lost_tokens) == (None, None, 0)
    assert cache_miss_reason(plan) is None


def test_cache_miss_reasons_in_anthropics_words():
    plan = plan_history(HELD, [TITLE, Message.user("x")], generated={2})
    assert cache_miss_reason(plan) == {"type": "system_changed", "cache_missed_input_tokens": 0}
    assert cache_miss_reason(plan, previous_found=False) == {"type": "previous_message_not_found"}
    assert cache_miss_reason(None) == {"type": "unavailable"}
    assert cache_miss_reason(plan, model_changed=True, prompt_tokens=90) == {
        "type": "model_changed",
        "cache_missed_input_tokens": 90,
    }
    regenerated = plan_history(HELD, HELD, generated={2})
    assert cache_miss_reason(regenerated) is None
