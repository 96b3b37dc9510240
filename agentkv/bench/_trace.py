"""Replay of recorded agent traces: Mooncake-style JSONL or kv-cache-tester conversations.

A trace records, per request, its arrival time, input and output lengths and the ids of its
fixed-size token blocks (``hash_ids``: equal ids, equal content). It holds no text. The replay
turns it into the benchmark's sessions of text (``Workload``), so that the prefixes the requests
shared in the original are shared in the replay, and nothing else is:

* **Sessions.** kv-cache-tester files name their conversation (one ``requests`` list each); the
  parent's requests are one session, and each subagent's another (``_trace_read``), all of them
  sessions of one conversation (``ReplaySession.conversation``, ``role``). Mooncake's JSONL has
  no session id, so sessions are inferred, in arrival order: a request continues the session
  whose latest request it extends, that is whose hash ids it starts with (all of them, or all
  but the last when that block was partial) and whose prompt is no longer than its own; the
  longest such match wins, and it must be longer than what the request shares with any other
  session (so a system prompt that two sessions have reached joins no others). Otherwise the
  request starts a session. One ambiguity remains: the first session to reach a shared prompt,
  if its request ends within a block past it, takes the next request that starts with that
  prompt (no other session has shown it to be shared yet).
* **Content** (``_trace_text``). Each hash id maps to a fixed text chunk of one block
  (``block_tokens`` of the served model's tokens, sized with the calibrated characters per token
  of a style chosen by the id; ids scoped to a conversation get their text in its namespace).
  Turn 1's user message is its blocks' text; turn t+1's is the text of the last
  ``input(t+1) - input(t) - output(t)`` tokens of its own blocks (what turn t's prompt and output
  did not hold), at least one token. The model's outputs are generated, at the trace's lengths.
* **Time.** A session starts at its first request's timestamp (a subagent's: the conversation's
  start, plus its entry's ``t``, plus its first request's ``t``), concurrently with the others.
  The pause after a turn is the request's ``think_time`` when the trace has one, else the gap to
  the next request less that request's expected service in the original deployment
  (``ORIGINAL_PREFILL_TOKENS_PER_S``, ``ORIGINAL_DECODE_TOKENS_PER_S``: assumptions, not
  measurements), never negative. The bench waits ``time_scale`` times both.
* **Scale.** ``length_scale`` multiplies every length (blocks included), so a trace of 10k-token
  prompts runs on a small CPU pair. A turn whose prompt and output would not fit
  ``max_model_len`` ends its session there; the clipped requests and skipped sessions are
  counted in the report.

>>> lines = [
...     '{"timestamp": 0, "input_length": 700, "output_length": 20, "hash_ids": [1, 2]}',
...     '{"timestamp": 0, "input_length": 600, "output_length": 10, "hash_ids": [1, 3]}',
...     '{"timestamp": 5000, "input_length": 1100, "output_length": 30, "hash_ids": [1, 2, 4]}',
... ]
>>> trace = parse_trace("\\n".join(lines), name="toy.jsonl")
>>> plan = plan_replay(trace)
>>> [[turn.request for turn in session.turns] for session in plan.sessions]
[[0, 2], [1]]
>>> plan.sessions[0].turns[1].new_tokens  # 1100 - 700 - 20
380
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

from agentkv import ConfigError
from agentkv.bench._trace_plan import ReplayPlan, ReplaySession, ReplayTurn
from agentkv.bench._trace_read import (
    CLAUDE_CODE_TRACE,
    MOONCAKE_BLOCK_TOKENS,
    SAMPLE_TRACE,
    Trace,
    TraceRequest,
    load_trace,
    parse_trace,
)
from agentkv.bench._trace_text import block_text, build_trace_workload, span_text

__all__ = [
    "CLAUDE_CODE_TRACE",
    "MOONCAKE_BLOCK_TOKENS",
    "ORIGINAL_DECODE_TOKENS_PER_S",
    "ORIGINAL_PREFILL_TOKENS_PER_S",
    "SAMPLE_TRACE",
    "ReplayPlan",
    "ReplaySession",
    "ReplayTurn",
    "Trace",
    "TraceRequest",
    "block_text",
    "build_trace_workload",
    "infer_sessions",
    "load_trace",
    "parse_trace",
    "plan_replay",
    "span_text",
]

ORIGINAL_PREFILL_TOKENS_PER_S = 10_000.0
ORIGINAL_DECODE_TOKENS_PER_S = 30.0
"""Assumed speed of the traced deployment, used only to take a request's service time out of the
gap to the session's next request (the client's think time is what remains)."""

# The user message of a continuation is never empty, even when the trace's prompt did not grow
# by the previous output (a retried or trimmed request).
_MIN_NEW_TOKENS = 1
# Room left in max_model_len for the chat template (per message) and the replay's system prompt.
_TEMPLATE_TOKENS_PER_MESSAGE = 8
_TEMPLATE_TOKENS_FIXED = 64


@dataclass(slots=True)
class _Node:
    children: dict[int, _Node] = field(default_factory=dict)
    sessions: set[int] = field(default_factory=set)
    """Sessions whose requests pass through this prefix."""
    ends: set[int] = field(default_factory=set)
    """Sessions whose latest request this prefix continues (its blocks, or all but a partial
    last one)."""


def _partial(request: TraceRequest, block_tokens: int) -> bool:
    return request.input_tokens < len(request.hash_ids) * block_tokens


class _Prefixes:
    """A trie of the requests' hash ids: which sessions reached each prefix, and which prefixes
    each session's latest request can be continued from."""

    def __init__(self, block_tokens: int) -> None:
        self._root = _Node()
        self._block_tokens = block_tokens
        self._ends: dict[int, list[_Node]] = {}
        self._input: dict[int, int] = {}

    def match(self, request: TraceRequest) -> int | None:
        """The session ``request`` continues, if any."""
        path: list[_Node] = []
        node = self._root
        for block in request.hash_ids:
            child = node.children.get(block)
            if child is None:
                break
            path.append(child)
            node = child
        # Sessions reaching a prefix only shrink with its depth: past the deepest prefix two
        # sessions share, every node has one session, which is the only possible match.
        shared = max((depth + 1 for depth, n in enumerate(path) if len(n.sessions) > 1),
                     default=0)
        for depth in range(len(path), shared, -1):
            for session in path[depth - 1].ends:  # at most one (see above)
                if self._input[session] <= request.input_tokens:
                    return session
        return None

    def add(self, request: TraceRequest, session: int) -> None:
        """``request`` is now ``session``'s latest."""
        for old in self._ends.pop(session, []):
            old.ends.discard(session)
        nodes: list[_Node] = []
        node = self._root
        for block in request.hash_ids:
            node = node.children.setdefault(block, _Node())
            node.sessions.add(session)
            nodes.append(node)
        ends = nodes[-1:]
        if len(nodes) > 1 and _partial(request, self._block_tokens):
            ends.append(nodes[-2])
        for node in ends:
            node.ends.add(session)
        self._ends[session] = ends
        self._input[session] = request.input_tokens


def infer_sessions(requests: Sequence[TraceRequest], *, block_tokens: int) -> list[list[int]]:
    """Sessions as lists of positions in ``requests`` (see the module docstring for the rule).

    Requests that name their conversation are grouped by it and their agent (the parent, or
    one of its subagents), in order of time."""
    if requests and all(r.conversation is not None for r in requests):
        groups: dict[tuple[str, str | None], list[int]] = {}
        for position, request in enumerate(requests):
            groups.setdefault((str(request.conversation), request.agent), []).append(position)
        return [sorted(g, key=lambda p: (requests[p].timestamp_s, p)) for g in groups.values()]
    prefixes = _Prefixes(block_tokens)
    sessions: list[list[int]] = []
    for position, request in enumerate(requests):
        chosen = prefixes.match(request)
        if chosen is None:
            chosen = len(sessions)
            sessions.append([])
        sessions[chosen].append(position)
        prefixes.add(request, chosen)
    return sessions


def _matched_blocks(previous: Sequence[int], current: Sequence[int]) -> int:
    matched = 0
    for a, b in zip(previous, current, strict=False):
        if a != b:
            break
        matched += 1
    return matched


# -- planning ------------------------------------------------------------------------------------


def _service_s(request: TraceRequest, cached_tokens: int) -> float:
    uncached = max(0, request.input_tokens - cached_tokens)
    return (uncached / ORIGINAL_PREFILL_TOKENS_PER_S
            + request.output_tokens / ORIGINAL_DECODE_TOKENS_PER_S)


def _scaled(tokens: int, scale: float, low: int) -> int:
    return max(low, round(tokens * scale))


def plan_replay(
    trace: Trace,
    *,
    limit: int | None = None,
    length_scale: float = 1.0,
    max_model_len: int | None = None,
) -> ReplayPlan:
    """The replay of ``trace``'s first ``limit`` requests (all by default): sessions, their
    turns' scaled lengths, new-text spans and pauses; turns that do not fit ``max_model_len``
    (prompt, output and a template allowance) are clipped with the rest of their session."""
    if not 0.0 < length_scale <= 1.0:
        raise ConfigError(f"length_scale must be in (0, 1], got {length_scale}")
    requests = trace.requests[:limit] if limit is not None else trace.requests
    groups = infer_sessions(requests, block_tokens=trace.block_tokens)
    origin = min((r.timestamp_s for r in requests), default=0.0)
    sessions: list[ReplaySession] = []
    clipped = skipped = padded = 0
    for group in groups:
        members = [requests[p] for p in group]
        turns: list[ReplayTurn] = []
        prompt = 0  # the replay's prompt before this turn's user text, scaled tokens
        previous: TraceRequest | None = None
        cached = 0  # the previous request's tokens found in its predecessor's blocks
        for request in members:
            size = _scaled(request.input_tokens, length_scale, 1)
            out = _scaled(request.output_tokens, length_scale, 1)
            if previous is None:
                new = size
            else:
                new = max(_MIN_NEW_TOKENS, size - prompt)
                padded += new - max(0, size - prompt)
            messages = 2 * len(turns) + 2
            needed = (prompt + new + out + _TEMPLATE_TOKENS_FIXED
                      + _TEMPLATE_TOKENS_PER_MESSAGE * messages)
            if max_model_len is not None and needed > max_model_len:
                clipped += len(members) - len(turns)
                if not turns:
                    skipped += 1
                break
            if previous is not None:
                if request.think_time_s is not None:
                    pause = request.think_time_s
                else:
                    gap = request.timestamp_s - previous.timestamp_s
                    pause = gap - _service_s(previous, cached)
                turns[-1] = dataclasses.replace(turns[-1], think_time_s=max(0.0, pause))
                blocks = _matched_blocks(previous.hash_ids, request.hash_ids)
                cached = min(request.input_tokens, blocks * trace.block_tokens)
            turns.append(ReplayTurn(
                turn=len(turns) + 1,
                request=request.index,
                hash_ids=request.hash_ids,
                input_tokens=size,
                output_tokens=out,
                new_start=max(0.0, float(size - new)),
                new_tokens=new,
                think_time_s=0.0,
            ))
            prompt += new + out
            previous = request
        if turns:
            first = members[0]
            sessions.append(ReplaySession(
                index=len(sessions), start_s=first.timestamp_s - origin, turns=tuple(turns),
                conversation=first.conversation, role=first.role, agent_id=first.agent,
                subagent_type=first.subagent_type, scope=first.scope,
            ))
    return ReplayPlan(
        name=trace.name,
        block_tokens=trace.block_tokens,
        length_scale=length_scale,
        sessions=tuple(sessions),
        requests_read=len(requests),
        clipped_requests=clipped,
        skipped_sessions=skipped,
        padded_tokens=padded,
        ignored_entries=trace.ignored_entries,
    )
