"""The replay's text: each hash id a fixed chunk of one block, each turn the span it adds.

Equal ids in one namespace (``ReplaySession.scope``: the trace, or a conversation whose ids are
scoped to it) give equal text, and any other id a different one, so the replayed prompts share
exactly the prefixes (to within a block) that the trace's requests shared. A subagent's ids are
its parent's namespace: siblings that opened with the same blocks open with the same text.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from agentkv.bench._text import Style, generate, seeded
from agentkv.bench._trace_plan import ReplayPlan, ReplaySession
from agentkv.bench._workload import (
    CharsPerToken,
    SessionOrigin,
    SessionScript,
    TurnScript,
    Workload,
)

__all__ = ["block_text", "build_trace_workload", "span_text"]

_STYLES: tuple[Style, ...] = ("code", "log", "prose")
_SYSTEM = "You are an assistant. Answer the user's last message."


def _style(block: int) -> Style:
    return _STYLES[block % len(_STYLES)]


def block_text(block: int, chars: int, *, scope: str = "") -> str:
    """The text of hash id ``block`` in namespace ``scope``: ``chars`` characters, the same for
    the same id, namespace and size."""
    seed = f"trace-block-{block}" if not scope else f"trace-block-{scope}-{block}"
    text = generate(_style(block), seeded(seed), chars)
    # generate() may stop short (it strips trailing blanks): pad so offsets within a block are
    # the same in every request that holds it.
    return text.ljust(chars)


def span_text(
    hash_ids: Sequence[int],
    start: float,
    end: float,
    *,
    block_tokens: float,
    ratios: CharsPerToken,
    cache: dict[tuple[str, int, int], str] | None = None,
    scope: str = "",
) -> str:
    """The text of tokens ``[start, end)`` of a request whose blocks are ``hash_ids`` (in
    namespace ``scope``), each block ``block_tokens`` tokens long (sized in characters with
    ``ratios``)."""
    if not hash_ids or end <= start:
        return ""
    parts: list[str] = []
    last = len(hash_ids) - 1
    first = min(last, int(start // block_tokens))
    stop = min(last, max(first, math.ceil(end / block_tokens) - 1))
    for index in range(first, stop + 1):
        block = hash_ids[index]
        ratio = ratios[_style(block)]
        chars = max(1, round(block_tokens * ratio))
        key = (scope, block, chars)
        if cache is not None and key in cache:
            text = cache[key]
        else:
            text = block_text(block, chars, scope=scope)
            if cache is not None:
                cache[key] = text
        base = index * block_tokens
        low = max(start, base) - base
        high = min(end, base + block_tokens) - base
        parts.append(text[round(low * ratio):round(high * ratio)])
    return "".join(parts)


def _turn_scripts(
    session: ReplaySession, plan: ReplayPlan, ratios: CharsPerToken,
    cache: dict[tuple[str, int, int], str],
) -> Iterable[TurnScript]:
    for turn in session.turns:
        user = span_text(
            turn.hash_ids, turn.new_start, turn.new_start + turn.new_tokens,
            block_tokens=plan.scaled_block_tokens, ratios=ratios, cache=cache,
            scope=session.scope,
        )
        yield TurnScript(
            turn=turn.turn,
            user=user or ".",
            output_tokens=turn.output_tokens,
            think_time_s=turn.think_time_s,
        )


def _common(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _origins(plan: ReplayPlan, firsts: Sequence[str]) -> list[SessionOrigin | None]:
    """Each named conversation's sessions' roles, and what each one's first message shares with
    those of the conversation's sessions that started before it."""
    out: list[SessionOrigin | None] = []
    for session in plan.sessions:
        if session.conversation is None:
            out.append(None)
            continue
        earlier = [
            other for other in plan.sessions
            if other.conversation == session.conversation
            and (other.start_s, other.index) < (session.start_s, session.index)
        ]
        shared = max((_common(firsts[session.index], firsts[o.index]) for o in earlier),
                     default=0)
        out.append(SessionOrigin(
            conversation=session.conversation, role=session.role, agent_id=session.agent_id,
            subagent_type=session.subagent_type, shared_chars=shared,
        ))
    return out


def build_trace_workload(plan: ReplayPlan, ratios: CharsPerToken) -> Workload:
    """The replay's sessions as text, with the tokenizer's ``ratios`` (see ``calibrate``); the
    sessions of one named conversation form one salt group."""
    cache: dict[tuple[str, int, int], str] = {}
    turns = [tuple(_turn_scripts(s, plan, ratios, cache)) for s in plan.sessions]
    origins = _origins(plan, [t[0].user if t else "" for t in turns])
    groups = {c: f"c{n}" for n, c in enumerate(dict.fromkeys(
        s.conversation for s in plan.sessions if s.conversation is not None
    ))}
    sessions = tuple(
        SessionScript(
            index=session.index,
            turns=session_turns,
            start_s=session.start_s,
            salt_group=None if session.conversation is None else groups[session.conversation],
            origin=origin,
        )
        for session, session_turns, origin in zip(plan.sessions, turns, origins, strict=True)
    )
    return Workload(system=_SYSTEM, sessions=sessions)
