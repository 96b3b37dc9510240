"""Does a conversation history extend a session? The one rule, for every front end. Pure.

OpenAI clients (and the proxy, LangChain, ``append_history``) re-send the whole conversation
every turn. When it starts with every message the session holds, only the new ones are appended
and the decode node's KV is reused. Anything else (an edited, truncated or regenerated history,
or other tools, which templates render into the prefix) does not extend it: the plan then says
how much a fork keeps (the longest common prefix; nothing after a tools change), and the old
handle is never sent with the new history. What a front end does with such a plan is its own:
the proxy forks, LangChain opens another session, ``append_history`` raises.

Assistant messages come back as the client's copy of text the model generated. Clients strip
whitespace, turn ``""`` into ``null`` next to tool calls, or re-serialize tool arguments
(LangChain does ``json.dumps(args)``). An echo that says the same thing is matched to the
session's own message, whose exact generated tokens the transcript holds: the text round trip
must not cost the reuse. Only messages the model generated get that tolerance; everything else
must be equal.

>>> held = [Message.user("Hi"), Message.assistant("Hello! ")]
>>> plan = plan_history(held, [Message.user("Hi"), Message.assistant("Hello!"),
...                            Message.user("Bye")], generated={1})
>>> plan.keep, [m.content for m in plan.new], plan.forked
(2, ['Bye'], False)
"""

from __future__ import annotations

import hashlib
from collections.abc import Container, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from agentkv._types import Message, ToolCall
from agentkv._wire.json import JSONDecodeError, dumps, loads

__all__ = [
    "EDITED",
    "NOTHING_NEW",
    "TOOLS_CHANGED",
    "HistoryPlan",
    "PrefixBreak",
    "echo_form",
    "is_echo",
    "plan_history",
]

# Why a plan forks (``HistoryPlan.reason``); the proxy logs it.
EDITED = "history does not extend the session"
TOOLS_CHANGED = "tools changed"
# The history is the session's, nothing after: a turn has nothing to send (a regenerate).
NOTHING_NEW = "history holds no new message"

PrefixBreak = Literal[
    "system_changed", "tools_changed", "messages_changed", "model_changed", "regenerated"
]
"""Why a history does not extend its session (``HistoryPlan.break_reason``), in the words of
Anthropic's cache diagnostics where they have one: ``system_changed`` (the system messages it
starts with differ), ``tools_changed``, ``messages_changed`` (an earlier message edited or
removed), ``regenerated`` (the session's history again, nothing new: a retry or regenerate).
``model_changed`` is for front ends that compare models: a session serves one model, so a plan
never says it."""


@dataclass(frozen=True, kw_only=True, slots=True)
class HistoryPlan:
    """How a conversation history maps onto a session (``session.sync_history``).

    Attributes:
        keep: how many of the session's messages the history starts with (echoes matched).
        new: the history's messages after those: appended, or (forked) the fork's to send.
        forked: the history does not extend the session; a fork keeping ``keep`` messages does.
        echoes: how many echoed assistant messages were matched by meaning, not equality.
        reason: why it forked, in words (``None`` when it extends the session).
        break_reason: why it forked, as a value to count or act on (``PrefixBreak``).
        diverged_message: the index of the first message where history and session differ
            (the history's length when it stops short of the session); ``None`` when it extends.
        diverged_token: where that message starts in the session's tokens: the prefix before it
            is what the session's KV still holds for the history (a transcript fills it in;
            ``None`` in a plan of messages alone, or when it extends).
        lost_tokens: the session's tokens from there on, which the history does not reuse.
    """

    keep: int
    new: tuple[Message, ...]
    forked: bool
    echoes: int = 0
    reason: str | None = None
    break_reason: PrefixBreak | None = None
    diverged_message: int | None = None
    diverged_token: int | None = None
    lost_tokens: int = 0

    @staticmethod
    def key(messages: Sequence[Message]) -> bytes:
        """A digest of ``messages`` as this rule reads them: a client's echo of a history (its
        generated messages in the client's own form) has the history's key. For finding the
        session a history extends without holding the sessions (the proxy's ``_affinity``).

        >>> key = HistoryPlan.key
        >>> key([Message.assistant("Hi ")]) == key([Message.assistant("Hi")])
        True
        """
        return hashlib.blake2b(dumps([echo_form(m) for m in messages]), digest_size=16).digest()


def _arguments(text: str) -> object:
    try:
        return loads(text)
    except (JSONDecodeError, ValueError):
        return text


def _same_arguments(mine: str, theirs: str) -> bool:
    if mine == theirs:
        return True
    try:
        return bool(loads(mine) == loads(theirs))
    except (JSONDecodeError, ValueError):
        return False


def _same_call(mine: ToolCall, theirs: ToolCall) -> bool:
    return (
        mine.id == theirs.id
        and mine.name == theirs.name
        and _same_arguments(mine.arguments, theirs.arguments)
    )


def is_echo(generated: Message, echoed: Message) -> bool:
    """True when ``echoed`` is a client's copy of the generated assistant message ``generated``."""
    if generated.role != "assistant" or echoed.role != "assistant":
        return False
    if (generated.content or "").strip() != (echoed.content or "").strip():
        return False
    if len(generated.tool_calls) != len(echoed.tool_calls):
        return False
    return all(
        _same_call(mine, theirs)
        for mine, theirs in zip(generated.tool_calls, echoed.tool_calls, strict=True)
    )


def echo_form(message: Message) -> object:
    """A message as ``is_echo`` reads it: two assistant messages one of which is an echo of the
    other have equal forms (a key for finding a session by history without holding it)."""
    return [
        message.role,
        (message.content or "").strip(),
        [[c.id, c.name, _arguments(c.arguments)] for c in message.tool_calls],
        message.tool_call_id,
    ]


def plan_history(
    held: Sequence[Message],
    incoming: Sequence[Message],
    *,
    generated: Container[int],
    views: Mapping[int, Message] | None = None,
    tools_changed: bool = False,
) -> HistoryPlan:
    """Plan a history: ``held`` are the session's messages, ``generated`` the indices of those
    the model generated (echoes of them are matched by meaning). ``views`` holds, for a
    generated message the client was shown translated (tool calls read from JSON the model
    wrote), what it was shown: its echo is matched against that. ``tools_changed``: the
    history comes with other tools than the session's prefix was rendered with.
    """
    if tools_changed:
        return HistoryPlan(
            keep=0,
            new=tuple(incoming),
            forked=True,
            reason=TOOLS_CHANGED,
            break_reason="tools_changed",
            diverged_message=0,
        )
    views = views or {}
    n, m = len(held), len(incoming)
    keep = 0
    echoes = 0
    while keep < min(n, m):
        mine, theirs = held[keep], incoming[keep]
        if mine != theirs:
            if keep not in generated or not is_echo(views.get(keep, mine), theirs):
                break
            echoes += 1
        keep += 1
    if keep == n and m > n:
        return HistoryPlan(keep=n, new=tuple(incoming[n:]), forked=False, echoes=echoes)
    reason = NOTHING_NEW if keep == n == m else EDITED
    diverged = keep
    # A turn needs at least one message to send: a history that is a prefix of the session
    # (a regenerate) re-sends its last message on the fork.
    keep = max(0, min(keep, m - 1))
    return HistoryPlan(
        keep=keep,
        new=tuple(incoming[keep:]),
        forked=True,
        echoes=echoes,
        reason=reason,
        break_reason=_break_reason(held, incoming, diverged),
        diverged_message=diverged,
    )


def _break_reason(
    held: Sequence[Message], incoming: Sequence[Message], diverged: int
) -> PrefixBreak:
    """Name a break at message ``diverged``: in the system messages the histories start with,
    after them, or nowhere (the session's history again)."""
    if diverged == len(held) == len(incoming):
        return "regenerated"
    leading = [m for m in (held, incoming) if diverged < len(m) and m[diverged].role == "system"]
    if leading and all(x.role == "system" for m in (held, incoming) for x in m[:diverged]):
        return "system_changed"
    return "messages_changed"
