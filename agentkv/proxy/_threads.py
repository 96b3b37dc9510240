"""Several threads under one session id, each a session of its own.

Coding agents send more than one conversation under one session id, concurrently: Claude Code's
subagents send their parent's id with an agent id of their own, OpenCode's title request (another
system prompt) the main thread's id. Mapped onto the one session, each such request would fork
the main thread's transcript or wait behind its turn. Instead each thread is its own registry
entry (own transcript, own KV, own lock), under an id derived from the session's:

* a thread with an agent id is ``<session>~agent:<agent id>``;
* without one, the thread is told by where its history starts (``start_digest``: the system
  messages it begins with). The first start seen under a session id is the session's own
  thread, keyed by the session id itself, as before threads existed. A new conversation (no
  assistant message yet) starting elsewhere opens a side thread ``<session>~start:<digest>``,
  and each later request finds its own thread by its start. A history of turns starting
  elsewhere that no side thread began is the session's own thread with its system prompt
  changed: it forks that thread (a prefix break, counted as ``system_changed``). At most
  ``MAX_SIDE_THREADS`` side threads a session: past them a request goes to the session's own
  thread too.

Every thread of a session is placed by the session's key (its parent session's, when the client
names one), so they land on the same pair, whose prefill cache holds what they share.

Which start is the session's own is kept in this process (``ThreadIndex``, bounded like the
registry), and read back from the registry's copy of the session when it was forgotten. Replicas
sharing a store each learn it from the first request they see: two first requests of one session
that go to two replicas at once may disagree about which is the session's own (each still runs
on a session of its own start; the other one forks).

>>> from agentkv import Message
>>> from agentkv.proxy._session_key import SessionKey
>>> index = ThreadIndex(max_entries=8)
>>> main = [Message.system("You code."), Message.user("fix it")]
>>> title = [Message.system("Write a title."), Message.user("fix it")]
>>> key = SessionKey(session_id="s1", source="x-session-id")
>>> index.resolve("alice", key, main, held=lambda: None).registry_id
's1'
>>> index.resolve("alice", key, title, held=lambda: None).name.startswith("start:")
True
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from agentkv._core import HistoryPlan, Message
from agentkv.proxy._session_key import SessionKey

__all__ = ["MAIN", "MAX_SIDE_THREADS", "Thread", "ThreadIndex", "start_digest", "thread_of"]

MAIN = "main"
MAX_SIDE_THREADS = 8
_SEPARATOR = "~"


@dataclass(frozen=True, kw_only=True, slots=True)
class Thread:
    """Where one request runs: the registry's id of its thread, and how it is placed.

    Attributes:
        registry_id: the session id the registry keeps the thread under.
        name: ``main``, ``agent:<id>`` or ``start:<digest>`` (the ``X-AgentKV-Thread`` header).
        placement: the placement key of a thread that must share a pair with others (``None``:
            placed by its own id, as a session without threads is).
        by_history: the session was found by its history under a ``prompt_cache_key``, not
            named (``_affinity``): a history that does not extend it is another conversation.
        parent: the registry id of the thread this one was spawned from, as its client named
            it (Codex's ``x-codex-parent-thread-id``, Claude Code's parent agent): a first
            request that carries that thread's history starts as its fork (``_spawn``).
    """

    registry_id: str
    name: str
    placement: str | None = None
    by_history: bool = False
    parent: str | None = None


def start_digest(messages: Sequence[Message]) -> str:
    """Where a history starts: a digest of the system messages it begins with, as the history
    rule reads them (``HistoryPlan.key``)."""
    end = next((i for i, m in enumerate(messages) if m.role != "system"), len(messages))
    return HistoryPlan.key(messages[:end]).hex()[:16]


def thread_of(registry_id: str) -> tuple[str, str]:
    """(session id, thread name) of a registry id, as ``ThreadIndex`` made it."""
    session, sep, name = registry_id.rpartition(_SEPARATOR)
    if sep and session and name.startswith(("agent:", "start:")):
        return session, name
    return registry_id, MAIN


@dataclass(slots=True)
class _Starts:
    main: str
    sides: list[str] = field(default_factory=list)


class ThreadIndex:
    """The start of each session's own thread, and of its side threads; bounded, oldest
    dropped (see the module docstring)."""

    def __init__(self, *, max_entries: int) -> None:
        self._max = max_entries
        self._starts: OrderedDict[tuple[str, str], _Starts] = OrderedDict()

    def resolve(
        self,
        principal: str,
        key: SessionKey,
        messages: Sequence[Message],
        *,
        held: Callable[[], Sequence[Message] | None],
    ) -> Thread:
        """The thread a request of ``key`` with history ``messages`` runs on. ``held`` gives the
        messages of the session's own thread where this process holds a copy (asked only when
        the index forgot it)."""
        session = key.session_id
        placement = f"{principal}:{key.parent_session or session}"
        own_placement = placement if key.parent_session is not None else None
        if key.agent_id is not None:
            name = f"agent:{key.agent_id}"
            parent = None
            if key.parent_id is not None and key.parent_id != key.parent_session:
                parent = (
                    session
                    if key.parent_id == session
                    else f"{session}{_SEPARATOR}agent:{key.parent_id}"
                )
            return Thread(
                registry_id=f"{session}{_SEPARATOR}{name}",
                name=name,
                placement=placement,
                parent=parent,
            )
        start = start_digest(messages)
        slot = (principal, session)
        starts = self._starts.get(slot)
        if starts is None:
            copy = held()
            starts = _Starts(main=start_digest(copy) if copy else start)
            self._starts[slot] = starts
            while len(self._starts) > self._max:
                self._starts.popitem(last=False)
        self._starts.move_to_end(slot)
        if start == starts.main:
            return Thread(registry_id=session, name=MAIN, placement=own_placement)
        if start not in starts.sides:
            fresh = not any(m.role == "assistant" for m in messages)
            if not fresh or len(starts.sides) >= MAX_SIDE_THREADS:
                # A history of turns starting elsewhere is the session's own with its system
                # prompt changed: it forks it, and the break is counted as such.
                return Thread(registry_id=session, name=MAIN, placement=own_placement)
            starts.sides.append(start)
        name = f"start:{start}"
        return Thread(registry_id=f"{session}{_SEPARATOR}{name}", name=name, placement=placement)
