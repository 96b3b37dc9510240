"""Map an OpenAI ``messages`` list onto a session's transcript: extend it, or fork it. Pure.

OpenAI clients re-send the whole conversation every turn. When the request starts with every
message the session holds, only the new ones are appended and the decode node's KV is reused.
Anything else (an edited, truncated or regenerated history) forks: the session keeps the longest
common prefix and renders the rest afresh; its old handle is never sent with the new history.

Assistant messages come back as the client's copy of text the model generated. Clients strip
whitespace, turn ``""`` into ``null`` next to tool calls, or re-serialize tool arguments
(LangChain does ``json.dumps(args)``). An echo that says the same thing is matched to the
session's own message, whose exact generated tokens the transcript holds: the text round trip
must not cost the reuse. Only messages the model generated get that tolerance; everything else
must be equal.

>>> from agentkv import Message
>>> held = [Message.user("Hi"), Message.assistant("Hello! ")]
>>> plan = plan_history(held, [Message.user("Hi"), Message.assistant("Hello!"),
...                            Message.user("Bye")], generated={1})
>>> plan.keep, [m.content for m in plan.new], plan.forked
(2, ['Bye'], False)
"""

from __future__ import annotations

from collections.abc import Container, Mapping, Sequence
from dataclasses import dataclass

from agentkv._core import JSONDecodeError, Message, ToolCall, loads

__all__ = ["HistoryPlan", "is_echo", "plan_history"]


@dataclass(frozen=True, kw_only=True, slots=True)
class HistoryPlan:
    """How a request's messages map onto a session.

    Attributes:
        keep: how many of the session's messages the request starts with (after echo matching).
        new: the request's messages after those, to append.
        forked: the request does not extend the session: fork it, keeping ``keep`` messages.
        echoes: how many echoed assistant messages were matched by meaning, not equality.
    """

    keep: int
    new: tuple[Message, ...]
    forked: bool
    echoes: int = 0


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


def plan_history(
    held: Sequence[Message],
    incoming: Sequence[Message],
    *,
    generated: Container[int],
    views: Mapping[int, Message] | None = None,
) -> HistoryPlan:
    """Plan a request: ``held`` are the session's committed messages, ``generated`` the indices
    of those the model generated (echoes of them are matched by meaning). ``views`` holds, for a
    generated message the client was shown translated (tool calls read from JSON the model
    wrote), what it was shown: its echo is matched against that.
    """
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
    # A turn needs at least one message to send: a request that is a prefix of the session
    # (a regenerate) re-sends its last message on the fork.
    keep = min(keep, m - 1)
    return HistoryPlan(keep=keep, new=tuple(incoming[keep:]), forked=True, echoes=echoes)
