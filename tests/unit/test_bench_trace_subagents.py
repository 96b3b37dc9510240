"""Claude Code replay: subagents read as sessions of their conversation, started when the trace
starts them, sharing with their siblings (and nothing with their parent) exactly the prefixes the
trace's hash ids share; parent and subagent turns reported apart."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentkv import ConfigError
from agentkv.bench import Mode
from agentkv.bench._cli import _replay, summary_table
from agentkv.bench._roles import ROLE_GROUPS, role_lines, role_report, session_roles
from agentkv.bench._samples import TurnSample
from agentkv.bench._trace import (
    CLAUDE_CODE_TRACE,
    build_trace_workload,
    load_trace,
    parse_trace,
    plan_replay,
)
from tests.unit.test_bench_trace import parse

RATIOS = {"schema": 4.0, "code": 4.0, "log": 4.0, "prose": 4.0}
BLOCK = 16


def lcp(a, b):
    """Common prefix length of two sequences (strings by bisection, fast on long texts)."""
    if isinstance(a, str):
        low, high = 0, min(len(a), len(b))
        while low < high:
            mid = (low + high + 1) // 2
            if a[:mid] == b[:mid]:
                low = mid
            else:
                high = mid - 1
        return low
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def request(t, size, out, ids, think=None):
    entry = {"t": t, "type": "n", "in": size, "out": out, "hash_ids": ids}
    if think is not None:
        entry["think_time"] = think
    return entry


CONVERSATION = {
    "id": "conv", "block_size": BLOCK, "hash_id_scope": "local",
    "requests": [
        request(0.0, 40, 8, [1, 2, 3], think=0.0),
        {"t": 10.0, "type": "subagent", "agent_id": "agent_001", "subagent_type": "Explore",
         "duration_ms": 9000, "requests": [
             request(0.0, 64, 4, [50, 51, 52, 53], think=0.0),
             request(3.0, 90, 4, [50, 51, 52, 53, 54, 55], think=2.5),
         ]},
        {"t": 11.5, "type": "subagent", "agent_id": "agent_002", "subagent_type": "Explore",
         "requests": [request(0.5, 60, 4, [50, 51, 52, 60], think=0.0)]},
        request(30.0, 100, 8, [1, 2, 3, 4, 5, 6, 7], think=12.0),
    ],
}


def test_subagents_are_sessions_of_their_conversation_started_when_the_trace_starts_them():
    trace = parse_trace(json.dumps(CONVERSATION), name="c.json")
    assert [(r.timestamp_s, r.role, r.agent) for r in trace.requests] == [
        (0.0, "parent", None), (10.0, "subagent", "agent_001"), (13.0, "subagent", "agent_001"),
        (12.0, "subagent", "agent_002"), (30.0, "parent", None),
    ]
    assert trace.ignored_entries == 0
    plan = plan_replay(trace)
    found = [(s.role, s.agent_id, s.subagent_type, s.start_s, [t.request for t in s.turns])
             for s in plan.sessions]
    assert found == [
        ("parent", None, None, 0.0, [0, 4]),
        ("subagent", "agent_001", "Explore", 10.0, [1, 2]),
        ("subagent", "agent_002", "Explore", 12.0, [3]),
    ]
    assert {s.conversation for s in plan.sessions} == {"conv"}
    # Think times are the trace's, each before the request that records it.
    assert plan.sessions[0].turns[0].think_time_s == 12.0
    assert plan.sessions[1].turns[0].think_time_s == 2.5
    assert plan.summary()["subagent_sessions"] == 2


def test_the_workload_keeps_one_salt_group_per_conversation_and_what_siblings_share():
    other = {**CONVERSATION, "id": "other"}
    plan = plan_replay(parse_trace(json.dumps([CONVERSATION, other]), name="two"))
    workload = build_trace_workload(plan, RATIOS)
    assert [s.salt_group for s in workload.sessions] == ["c0"] * 3 + ["c1"] * 3
    origins = [s.origin for s in workload.sessions]
    assert [(o.conversation, o.role) for o in origins if o] == [
        ("conv", "parent"), ("conv", "subagent"), ("conv", "subagent"),
        ("other", "parent"), ("other", "subagent"), ("other", "subagent"),
    ]
    # The second sibling opens with the first one's three blocks (4 chars a token), not more;
    # the first shares (almost) nothing with the parent, which started before it.
    shared = [o.shared_chars for o in origins if o]
    assert 3 * BLOCK * 4 <= shared[2] < 4 * BLOCK * 4
    assert shared[0] == 0
    assert shared[1] < BLOCK * 4
    # Local ids mean nothing across conversations: the same ids, other text.
    assert workload.sessions[0].turns[0].user != workload.sessions[3].turns[0].user


@pytest.mark.parametrize("entry", [
    {"t": 1.0, "type": "subagent", "requests": []},  # no agent_id
    {"t": "soon", "type": "subagent", "agent_id": "a", "requests": []},
    {"t": -1.0, "type": "subagent", "agent_id": "a", "requests": []},
    {"t": 1.0, "type": "subagent", "agent_id": "a"},  # no requests list
    {"t": 1.0, "type": "subagent", "agent_id": "a", "subagent_type": 3, "requests": []},
    {"t": 1.0, "type": "subagent", "agent_id": "a", "requests": [{"in": 5, "hash_ids": [1]}]},
])
def test_malformed_subagent_entries_are_config_errors(entry):
    conversation = {**CONVERSATION, "requests": [request(0.0, 40, 8, [1, 2, 3]), entry]}
    with pytest.raises(ConfigError):
        parse_trace(json.dumps(conversation), name="bad")


# -- shared prefixes, siblings included ----------------------------------------------------------


@st.composite
def conversations(draw):
    """A parent and 1-3 subagents: siblings open with one common block prefix (their system
    prompt and tools), then their own; no subagent shares a block with the parent. Each turn
    keeps the previous prompt's whole blocks and grows by the output and new text."""
    fresh = iter(range(2, 10**6))
    common = [next(fresh) for _ in range(draw(st.integers(1, 4)))]

    def turns(prefix):
        size = len(prefix) * BLOCK + draw(st.integers(1, 3 * BLOCK))
        ids = prefix + [next(fresh) for _ in range(-(-size // BLOCK) - len(prefix))]
        out, t = [], 0.0
        for _ in range(draw(st.integers(1, 3))):
            gen = draw(st.integers(1, 2 * BLOCK))
            out.append(request(t, size, gen, list(ids), think=draw(st.sampled_from([0.0, 2.0]))))
            t += draw(st.integers(1, 30))
            kept = ids[: size // BLOCK]
            size += gen + draw(st.integers(1, 3 * BLOCK))
            ids = kept + [next(fresh) for _ in range(-(-size // BLOCK) - len(kept))]
        return out

    entries = turns([1])
    for number in range(draw(st.integers(1, 3))):
        entries.append({"t": float(draw(st.integers(0, 20))), "type": "subagent",
                        "agent_id": f"agent_{number}", "subagent_type": "Explore",
                        "requests": turns(list(common))})
    return {"id": "gen", "block_size": BLOCK, "hash_id_scope": "local", "requests": entries}


def replayed_texts(plan):
    """Every request's replayed text (user messages and placeholder outputs no turn shares)."""
    workload = build_trace_workload(plan, RATIOS)
    out = {}
    for session, script in zip(plan.sessions, workload.sessions, strict=True):
        text = ""
        for turn, step in zip(session.turns, script.turns, strict=True):
            text += step.user
            out[turn.request] = text
            text += chr(0x4E00 + 64 * session.index + turn.turn) * (4 * step.output_tokens)
    return out


def assert_prefixes_match(trace, plan, block, *, across_sessions_only=False):
    """For every pair of requests of a conversation (parent-parent, parent-subagent,
    sibling-sibling), the replayed texts share what the hash ids share, to within a block."""
    texts = replayed_texts(plan)
    kept = [r for r in trace.requests if r.index in texts]
    pairs = 0
    for a in kept:
        for b in kept:
            if a.conversation != b.conversation or a.index >= b.index:
                continue
            if across_sessions_only and a.agent == b.agent:
                continue
            shared_tokens = lcp(texts[a.index], texts[b.index]) / 4
            shared_blocks = lcp(a.hash_ids, b.hash_ids) * block
            assert abs(shared_tokens - shared_blocks) <= block, (a, b)
            pairs += 1
    return pairs


@settings(max_examples=60, deadline=None)
@given(conversations())
def test_replayed_sessions_share_the_prefixes_the_trace_shares_siblings_included(conversation):
    trace = parse_trace(json.dumps(conversation), name="gen.json")
    plan = plan_replay(trace)
    assert plan.requests == len(trace.requests)
    assert assert_prefixes_match(trace, plan, BLOCK) >= 1


def test_the_claude_code_excerpt_is_shipped_with_its_source_and_licence():
    readme = (CLAUDE_CODE_TRACE / "README.md").read_text()
    assert "Apache-2.0" in readme
    assert "94f6046dfd9c0c8bc0cdb24a5aa6579bac8669bf" in readme  # the source's commit
    assert (CLAUDE_CODE_TRACE.parent / "LICENSE-APACHE-2.0").exists()
    trace = load_trace(CLAUDE_CODE_TRACE)
    parents = {r.conversation for r in trace.requests}
    agents = {(r.conversation, r.agent, r.subagent_type) for r in trace.requests if r.agent}
    assert parents == {"trace_0274", "trace_0277", "trace_0291"}
    assert len(agents) == 9
    assert sum(kind == "Explore" for *_, kind in agents) == 8


def test_in_the_excerpt_siblings_share_their_first_blocks_and_nothing_with_their_parent():
    trace = load_trace(CLAUDE_CODE_TRACE)
    firsts = {}
    for r in trace.requests:
        firsts.setdefault((r.conversation, r.agent), r)
    for conversation in ("trace_0274", "trace_0277", "trace_0291"):
        parent = {i for r in trace.requests
                  if r.conversation == conversation and r.agent is None for i in r.hash_ids}
        explore = [r for (c, agent), r in firsts.items()
                   if c == conversation and agent and r.subagent_type == "Explore"]
        for sub in (r for r in trace.requests if r.conversation == conversation and r.agent):
            assert not parent & set(sub.hash_ids)
        for a in explore:
            for b in explore:
                if a is not b:
                    share = lcp(a.hash_ids, b.hash_ids) / min(len(a.hash_ids), len(b.hash_ids))
                    assert 0.95 <= share < 1.0


def test_the_excerpt_replay_reproduces_what_its_sessions_share():
    """Across the sessions of a conversation (parent-subagent, sibling-sibling). Within one
    session a real prompt need not hold the previous output verbatim (Claude Code drops thinking
    blocks), which the replay's generated outputs cannot follow to the token: the generated
    traces above check that case."""
    trace = load_trace(CLAUDE_CODE_TRACE)
    plan = plan_replay(trace, length_scale=0.125)  # 8-token blocks: every request fits in RAM
    assert (len(plan.sessions), plan.subagents, plan.requests) == (12, 9, len(trace.requests))
    pairs = assert_prefixes_match(trace, plan, plan.scaled_block_tokens, across_sessions_only=True)
    assert pairs > 3000


def test_the_claude_code_flag_selects_the_shipped_excerpt():
    plan = _replay(parse(["bench", "--trace", "claude-code", "--length-scale", "0.03",
                          "--json", "o.json"]))
    assert plan is not None
    assert plan.name == "claude_code"
    assert plan.subagents == 9


# -- the report ----------------------------------------------------------------------------------


def sample(mode, session, turn, *, ttft, reused, ideal):
    return TurnSample(mode=mode, session=session, turn=turn, ttft_s=ttft, total_s=ttft + 0.1,
                      prompt_tokens=500, reused_tokens=reused, ideal_reused_tokens=ideal,
                      generated_tokens=4)


def test_the_report_keeps_parent_and_subagent_turns_apart():
    plan = plan_replay(parse_trace(json.dumps(CONVERSATION), name="c.json"))
    workload = build_trace_workload(plan, RATIOS)
    sessions = session_roles(workload, [0, 0, 300])  # the second sibling may find 300 tokens
    samples = []
    for mode, reuse in ((Mode.AGENTKV, 1.0), (Mode.LIMIT, 0.5)):
        samples += [
            sample(mode, 0, 1, ttft=0.9, reused=0, ideal=0),
            sample(mode, 0, 2, ttft=0.2 / reuse, reused=int(200 * reuse), ideal=200),
            sample(mode, 1, 1, ttft=0.8, reused=0, ideal=0),
            sample(mode, 1, 2, ttft=0.3, reused=100, ideal=100),
            sample(mode, 2, 1, ttft=0.4, reused=int(300 * reuse), ideal=0),
        ]
    report = role_report((Mode.AGENTKV, Mode.LIMIT), samples, sessions)
    assert [s["role"] for s in report["sessions"]] == ["parent", "subagent", "subagent"]
    agentkv = report["roles"]["agentkv"]
    assert list(agentkv) == list(ROLE_GROUPS)
    assert agentkv["parent_turns_2_plus"] == {
        "turns": 1, "ttft_p50_ms": 200.0, "ttft_p90_ms": 200.0, "reuse_vs_ideal": 1.0}
    # Both first turns count for TTFT; only the sibling with something to find for reuse.
    assert agentkv["subagent_first_turns"]["turns"] == 2
    assert agentkv["subagent_first_turns"]["ttft_p50_ms"] == pytest.approx(600.0)
    assert agentkv["subagent_first_turns"]["reuse_vs_ideal"] == 1.0
    assert report["roles"]["limit"]["subagent_first_turns"]["reuse_vs_ideal"] == 0.5
    assert report["roles"]["limit"]["subagent_turns_2_plus"]["reuse_vs_ideal"] == 1.0
    assert report["role_ratios"]["agentkv_vs_limit"]["parent_turns_2_plus"] == 0.5
    text = "\n".join(role_lines(report))
    assert "subagent turn 1" in text
    assert "agentkv / limit TTFT p50 by role" in text


def test_old_reports_without_roles_still_print(tmp_path):
    report = {"modes": {"agentkv": {"turns": [], "summary": {
        "ttft_p50_ms_after_first_turn": 10.0, "ttft_p90_ms_after_first_turn": 20.0,
        "reuse_vs_ideal": 0.9, "throughput_tokens_per_s": 5.0}}}}
    assert role_lines(report) == []
    assert "by role" not in summary_table(report)
