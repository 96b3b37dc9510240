"""What both session twins share: state, reading, appending, snapshots. No I/O."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

from agentkv._client import kv
from agentkv._client.pool import PairPool
from agentkv._client.save_file import save_state
from agentkv._client.save_file import snapshot as snapshot_state
from agentkv._client.save_file import snapshot_bytes as snapshot_state_bytes
from agentkv._client.state import SessionState
from agentkv._exceptions import (
    InvalidMessageError,
    PrefixDivergedError,
    SessionBusyError,
    SessionClosedError,
)
from agentkv._policy import CachePolicy
from agentkv._prompt.history import NOTHING_NEW, HistoryPlan
from agentkv._prompt.template import tools_key
from agentkv._prompt.transcript import TranscriptView
from agentkv._route import check_route
from agentkv._types import (
    KVHandle,
    Message,
    MessageLike,
    Pair,
    SessionOptions,
    SessionStats,
    TurnOverrides,
    TurnStats,
)
from agentkv._window import check_oversized
from agentkv._wire.fields import check_extra_body
from agentkv._wire.tier import TierRef

__all__ = ["SessionBase", "as_message", "merge_options"]


def as_message(message: MessageLike) -> Message:
    return Message.from_openai(message)


def merge_options(options: SessionOptions, overrides: TurnOverrides) -> SessionOptions:
    """The turn's options; ``InvalidMessageError`` for an ``extra_body`` field that would change
    the prompt's tokens behind the transcript's back (``_fields``)."""
    if not overrides:
        check_extra_body(options.extra_body)
        return options
    unknown = set(overrides) - set(TurnOverrides.__annotations__)
    if unknown:
        raise TypeError(f"unexpected turn argument(s): {', '.join(sorted(unknown))}")
    tools = overrides.get("tools", options.tools)
    extra = overrides.get("extra_body", options.extra_body)
    check_extra_body(extra)
    return SessionOptions(
        max_tokens=overrides.get("max_tokens", options.max_tokens),
        temperature=overrides.get("temperature", options.temperature),
        tools=tuple(tools) if tools else None,
        tool_choice=overrides.get("tool_choice", options.tool_choice),
        extra_body=MappingProxyType(dict(extra)),
        route=check_route(overrides.get("route", options.route)),
        oversized_max_tokens=check_oversized(
            overrides.get("oversized_max_tokens", options.oversized_max_tokens)
        ),
    )


class SessionBase:
    """What both twins share: state, reading, appending. No I/O."""

    _state: SessionState
    _pool: PairPool

    @property
    def session_id(self) -> str:
        return self._state.session_id

    @property
    def pair(self) -> Pair:
        """The pair the session lives on (it moves only when that pair is unhealthy)."""
        return self._state.pair

    @property
    def handle(self) -> KVHandle | None:
        """The decode node's turn-end handle the next turn may pull from, if any."""
        return self._state.handle

    @property
    def tier(self) -> TierRef | None:
        """The session's turn-end KV persisted to decode's file tier (``persist()``), if any.

        The next turn's prefill loads it from there when its prompt starts with the persisted
        tokens; that turn makes it obsolete (it is then deleted), and so does closing the session.
        """
        return self._state.tier

    @property
    def _kv(self) -> kv.KV:
        """What the next turn may reuse (``kv``), for agentkv's own loops (agent, proxy)."""
        return self._state.kv

    @property
    def policy(self) -> CachePolicy:
        return self._state.policy

    @property
    def closed(self) -> bool:
        """True once the session (or its cluster) was closed."""
        return self._state.closed or self._pool.closed

    @property
    def clock(self) -> Callable[[], float]:
        """The monotonic clock the handle's deadlines are on (the cluster's ``clock``).

        >>> session.handle.deadline - session.clock()  # seconds left  # doctest: +SKIP
        """
        return self._pool.clock

    @property
    def transcript(self) -> TranscriptView:
        """A read-only snapshot: messages, their exact token ids and spans, pending messages."""
        return self._state.transcript.view()

    @property
    def turns(self) -> tuple[TurnStats, ...]:
        """Stats of every committed turn, oldest first."""
        return tuple(self._state.turns.stats())

    @property
    def stats(self) -> SessionStats:
        """Totals over the session's turns."""
        return SessionStats.from_turns(self._state.turns.stats())

    def append(self, *messages: MessageLike) -> None:
        """Queue messages (``Message`` values or OpenAI-style dicts) for the next turn.

        All are validated first: on an ``InvalidMessageError`` none is appended. Messages
        appended while a turn runs are not part of it: they wait for the turn after.
        """
        self._check_open()
        parsed = [as_message(m) for m in messages]
        self._state.transcript.append(*parsed)

    def sync_history(
        self,
        messages: Iterable[MessageLike],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> HistoryPlan:
        """Bring the session up to a full conversation history, as OpenAI clients send it.

        When ``messages`` (sent with ``tools``) extend the session, the new ones are appended.
        Echoes of generated messages in the client's own form (whitespace stripped, tool
        arguments re-serialized) count as the session's. Otherwise the session is unchanged
        and the plan says why (``reason``) and what a fork keeps: a history with other tools
        keeps nothing, since templates render tools into the prefix. While a turn runs its
        history is not final: ``SessionBusyError``.

        >>> plan = session.sync_history(request_messages, tools=request_tools)  # doctest: +SKIP
        >>> if plan.forked:  # doctest: +SKIP
        ...     session = session.fork(keep=plan.keep)
        ...     session.append(*plan.new)
        """
        plan = self._plan(messages, tools=tools, check_tools=True)
        if not plan.forked:
            self._state.transcript.append(*plan.new)
        return plan

    def plan_history(
        self,
        messages: Iterable[MessageLike],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> HistoryPlan:
        """What ``sync_history`` would do with ``messages``, without doing it: whether they
        extend the session (``plan.forked`` false) and what is new."""
        return self._plan(messages, tools=tools, check_tools=True)

    def append_history(self, messages: Iterable[MessageLike]) -> int:
        """Bring the session up to a full conversation history (``sync_history``); returns how
        many messages were appended.

        A history that does not extend the session raises ``PrefixDivergedError`` (the stored
        handle is never sent with it): ``fork`` instead. The tools are checked by the turn.
        """
        plan = self._plan(messages, tools=None, check_tools=False)
        if plan.reason == NOTHING_NEW:
            return 0
        if plan.forked:
            raise PrefixDivergedError(
                f"{plan.reason}: it keeps {plan.keep} of the session's "
                f"{len(self._state.transcript.messages)} messages; fork the session instead "
                "of reusing its KV"
            )
        self._state.transcript.append(*plan.new)
        return len(plan.new)

    def mark_generated(
        self, indices: Iterable[int] = (), *, views: Mapping[int, MessageLike] | None = None
    ) -> None:
        """Record that messages ``indices`` (and those in ``views``) were generated by the model:
        their echoes are matched by meaning (``sync_history``). ``views`` holds what the client
        was shown for one where that differs (tool calls translated from JSON the model wrote):
        its echo is matched against that. A turn marks its own answer.

        >>> session.mark_generated(views={index: shown})  # doctest: +SKIP
        """
        self._check_open()
        shown = {index: as_message(m) for index, m in (views or {}).items()}
        self._state.transcript.mark_generated(indices, views=shown)

    def _plan(
        self,
        messages: Iterable[MessageLike],
        *,
        tools: Sequence[Mapping[str, Any]] | None,
        check_tools: bool,
    ) -> HistoryPlan:
        self._check_open()
        state = self._state
        if state.busy:
            raise SessionBusyError(
                f"session {state.session_id} is running a turn: its history is not final"
            )
        parsed = [as_message(m) for m in messages]
        changed = (
            check_tools and state.tools_key is not None and tools_key(tools) != state.tools_key
        )
        return state.transcript.plan(parsed, tools_changed=changed)

    def discard_pending(self) -> int:
        """Forget the messages appended since the last turn; returns how many there were.

        A failed turn leaves its messages pending so that the caller can retry it; a caller that
        re-sends a whole history instead (as OpenAI clients do, see ``append_history``) drops
        them first. While a turn runs, the pending messages are about to change:
        ``SessionBusyError``.
        """
        self._check_open()
        if self._state.busy:
            raise SessionBusyError(f"session {self._state.session_id} is running a turn")
        pending = len(self._state.transcript.pending)
        self._state.transcript.drop_pending(0)
        return pending

    def snapshot(self, *, wall: float | None = None, fenced: bool = False) -> dict[str, Any]:
        """The session as ``save`` writes it, as a JSON-able dict; ``cluster.restore_session``
        continues it. ``wall`` is the wall-clock time of the snapshot (now by default).

        The dict may hold the handle's lease secret: keep it where only its owner can read it.
        As after ``save``, this session's next turn claims the handle from decode before it
        attaches it (a copy may have taken it), unless ``fenced``: the caller guarantees that a
        copy is continued only after this session stops (a store handing sessions over under
        exclusive claims, as the proxy's).
        """
        pool = self._pool
        wall = time.time() if wall is None else wall
        snapshot = snapshot_state(self._state, model=pool.model, now=pool.clock(), wall=wall)
        if not fenced:
            self._handed_out()
        return snapshot

    def snapshot_bytes(self, *, wall: float | None = None, fenced: bool = False) -> bytes:
        """``snapshot()`` as compact bytes (its JSON, the token ids as raw int32 after it), for a
        store that saves a session every turn; ``cluster.restore_session`` takes these too.

        Writing and reading the ids back is a copy instead of about 50 us per 1,000 tokens of
        JSON numbers. The bytes may hold the handle's lease secret, as the dict does.
        """
        pool = self._pool
        wall = time.time() if wall is None else wall
        blob = snapshot_state_bytes(self._state, model=pool.model, now=pool.clock(), wall=wall)
        if not fenced:
            self._handed_out()
        return blob

    def save(self, path: str | os.PathLike[str]) -> None:
        """Save the session to a JSON file, atomically; ``load`` continues it in a new process.

        >>> session.save("run.json")  # doctest: +SKIP
        """
        state = self._state
        if state.busy:
            raise SessionBusyError(f"session {state.session_id} is running a turn")
        save_state(state, path, model=self._pool.model, now=self._pool.clock())
        self._handed_out()

    def _handed_out(self) -> None:
        """A copy of the session (a save file, a snapshot) now holds the handle too: a session
        continued from it may consume or release the pin while this one lives on. Like a loaded
        handle, it is claimed from decode before this session attaches it (one claim call, after
        a copy only); of all the holders, exactly one claim succeeds."""
        self._state.apply(kv.handed_out(self._state.kv))

    def _check_open(self) -> None:
        state = self._state
        if state.closed:
            raise SessionClosedError(f"session {state.session_id} is closed")
        if self._pool.closed:
            raise SessionClosedError(f"session {state.session_id}'s cluster is closed")

    def _abandoned(self) -> bool:
        """A stream holds the session but its caller stopped iterating (it waits at a yield)."""
        stream = self._state.stream
        # ``ag_running`` is true while the generator runs, also while it awaits the server.
        return self._state.busy and stream is not None and not getattr(stream, "ag_running", True)

    def _check_turnable(self, *, abandoned_ok: bool = False) -> None:
        self._check_open()
        if self._state.busy and not (abandoned_ok and self._abandoned()):
            raise SessionBusyError(f"session {self._state.session_id} is already running a turn")
        if not self._state.transcript.pending:
            raise InvalidMessageError("nothing to send: append a message before the turn")

    def __repr__(self) -> str:
        state = self._state
        return (
            f"<{type(self).__name__} {state.session_id} pair={state.pair.name} "
            f"turns={len(state.turns)}{' closed' if state.closed else ''}>"
        )
