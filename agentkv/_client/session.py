"""Sessions: a conversation pinned to one prefill/decode pair, its KV threaded from turn to turn.

``AsyncSession`` does the I/O; ``Session`` is its sync twin, driving the same core on the
cluster's event-loop thread. Both share ``_SessionBase``, which does none.

>>> with cluster.session() as s:  # doctest: +SKIP
...     s.append(Message.system("You are terse."), Message.user("Capital of France?"))
...     print(s.turn().text)                 # "Paris."
...     print(s.send("And of Spain?").text)  # reuses turn 1's KV from the decode node
...     print(s.send("Thanks!", final=True).text)  # the last turn: decode pins nothing
...     print(s.stats.reuse_ratio)

With agentkv's vLLM extension on decode, a session also manages its pinned KV there: a final turn
pins nothing, ``tool_wait()`` keeps the handle alive through a long tool call, and closing the
session releases what is still pinned (see ``_leasing.py``).
"""

from __future__ import annotations

import contextlib
import math
import os
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable, Iterator, Mapping
from types import MappingProxyType
from typing import Any, Protocol, Unpack

import structlog

from agentkv._client.leasing import (
    ToolWait,
    begin_wait,
    delete_tier,
    end_wait,
    extend_handle,
    persist_handle,
    release_handle,
)
from agentkv._client.persist import load_state, restore, restore_bytes, save_state
from agentkv._client.persist import snapshot as snapshot_state
from agentkv._client.persist import snapshot_bytes as snapshot_state_bytes
from agentkv._client.pool import PairPool
from agentkv._client.portal import Portal
from agentkv._client.state import SessionState
from agentkv._client.turn import TurnRunner
from agentkv._exceptions import (
    InvalidMessageError,
    SessionBusyError,
    SessionClosedError,
)
from agentkv._policy import CachePolicy, PersistMode, check_persist_mode
from agentkv._prompt.transcript import Transcript, TranscriptView
from agentkv._types import (
    KVHandle,
    Message,
    MessageLike,
    Pair,
    SessionOptions,
    SessionStats,
    TextDelta,
    TurnOverrides,
    TurnResult,
    TurnStats,
)
from agentkv._wire.fields import check_extra_body
from agentkv._wire.tier import TierRef

__all__ = [
    "AsyncSession",
    "AsyncSessionHost",
    "Session",
    "SessionHost",
    "SessionOptions",
    "TurnOverrides",
    "load_session",
    "open_session",
    "restore_session",
]

logger = structlog.get_logger("agentkv")


class AsyncSessionHost(Protocol):
    """What ``AsyncSession.load`` needs of a cluster (``AsyncCluster`` is one)."""

    def load_session(self, path: str | os.PathLike[str]) -> AsyncSession: ...

    def restore_session(
        self,
        data: Mapping[str, Any] | bytes,
        *,
        confirmed: bool = False,
        drop_handle: str | None = None,
    ) -> AsyncSession: ...


class SessionHost(Protocol):
    """What ``Session.load`` needs of a cluster (``Cluster`` is one)."""

    def load_session(self, path: str | os.PathLike[str]) -> Session: ...


def _as_message(message: MessageLike) -> Message:
    return Message.from_openai(message)


def _merge(options: SessionOptions, overrides: TurnOverrides) -> SessionOptions:
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
    )


class _SessionBase:
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
        parsed = [_as_message(m) for m in messages]
        self._state.transcript.append(*parsed)

    def append_history(self, messages: Iterable[MessageLike]) -> int:
        """Bring the session up to a full conversation history (as OpenAI clients send it).

        ``messages`` must start with every message the session already holds; the rest are
        appended. Returns how many were appended. An edited history raises
        ``PrefixDivergedError`` (the stored handle is never sent with it): ``fork`` instead.
        While a turn runs the history is about to change: ``SessionBusyError``.
        """
        self._check_open()
        if self._state.busy:
            raise SessionBusyError(
                f"session {self._state.session_id} is running a turn: its history is not final"
            )
        parsed = [_as_message(m) for m in messages]
        known = self._state.transcript.match_prefix(parsed)
        self._state.transcript.append(*parsed[known:])
        return len(parsed) - known

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
        state = self._state
        if state.handle is not None and state.handle.leased:
            state.unconfirmed = state.handle

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


class AsyncSession(_SessionBase):
    """A conversation on one prefill/decode pair, async. Open with ``AsyncCluster.session()``.

    >>> async with cluster.session(max_tokens=128) as s:  # doctest: +SKIP
    ...     s.append(Message.user("Hi!"))
    ...     r = await s.turn()
    ...     s.append({"role": "user", "content": "Tell me more."})
    ...     async for event in s.stream(max_tokens=64):
    ...         if isinstance(event, TextDelta):
    ...             print(event.text, end="")
    """

    def __init__(self, state: SessionState, *, pool: PairPool) -> None:
        self._state = state
        self._pool = pool

    @classmethod
    def load(cls, path: str | os.PathLike[str], cluster: AsyncSessionHost) -> AsyncSession:
        """Continue a session saved with ``save``; its handle is reused if still valid.

        The same as ``cluster.load_session(path)``. Raises ``SessionLoadError`` for a missing,
        corrupt or unknown-version file.

        >>> session = AsyncSession.load("run.json", cluster)  # doctest: +SKIP
        """
        return cluster.load_session(path)

    async def turn(
        self,
        *,
        final: bool = False,
        persist: PersistMode = "auto",
        **overrides: Unpack[TurnOverrides],
    ) -> TurnResult:
        """Send the pending messages and return the assistant's answer.

        Keyword arguments override the session's defaults for this turn: ``max_tokens``,
        ``temperature``, ``tools``, ``tool_choice``, ``extra_body``. A failed turn raises and
        leaves the transcript (pending messages included) as it was.

        ``final=True`` says no turn follows: decode (with agentkv's extension) pins nothing for a
        next one. The session stays open; a further turn just recomputes.

        ``persist="disk"`` says the next turn is far off: right after this one, the turn-end KV
        is persisted to decode's file tier and decode's pin freed (``persist()``); ``"auto"``
        and ``"pin"`` keep the pin.
        """
        options = _merge(self._state.options, overrides)
        check_persist_mode(persist)
        await self._close_abandoned()
        self._check_turnable()
        self._state.begin_turn()
        try:
            runner = TurnRunner(
                self._pool, self._state, options, stream=False, final=final, persist=persist
            )
            async with contextlib.aclosing(runner.events()) as events:
                async for event in events:
                    if isinstance(event, TurnResult):
                        return event
        finally:
            self._state.end_turn()
        raise AssertionError("a turn ended without a result")  # pragma: no cover

    async def send(
        self,
        message: str | MessageLike,
        /,
        *,
        final: bool = False,
        persist: PersistMode = "auto",
        **overrides: Unpack[TurnOverrides],
    ) -> TurnResult:
        """Append ``message`` (text is a user message) and run a turn; on failure, un-append it."""
        self._check_open()
        check_persist_mode(persist)
        keep = len(self._state.transcript.pending)
        self.append(Message.user(message) if isinstance(message, str) else message)
        try:
            return await self.turn(final=final, persist=persist, **overrides)
        except BaseException:
            # Only this message: others appended while the turn ran stay queued.
            self._state.transcript.drop_pending(keep, count=1)
            raise

    def stream(
        self,
        *,
        final: bool = False,
        persist: PersistMode = "auto",
        **overrides: Unpack[TurnOverrides],
    ) -> AsyncIterator[TextDelta | TurnResult]:
        """Run a turn: ``TextDelta`` pieces as decode produces them, then the ``TurnResult``.

        The turn-end handle is stored as for ``turn()`` (``final`` too). Leaving the loop early
        abandons the turn (nothing is committed), and the session is free at once: the next
        ``turn()``, ``send()``, ``stream()`` or ``aclose()`` closes the abandoned stream
        (``await stream.aclose()`` does it yourself). A stream is not retried once text was
        yielded.
        """
        options = _merge(self._state.options, overrides)
        check_persist_mode(persist)
        self._check_turnable(abandoned_ok=True)
        holder: list[AsyncGenerator[TextDelta | TurnResult, None]] = []
        stream = self._stream(options, final=final, persist=persist, holder=holder)
        holder.append(stream)
        return stream

    async def _close_abandoned(self) -> None:
        stream = self._state.stream
        if stream is not None and self._abandoned():
            await stream.aclose()  # its ``finally`` frees the session

    async def _stream(
        self,
        options: SessionOptions,
        *,
        final: bool,
        persist: PersistMode,
        holder: list[AsyncGenerator[TextDelta | TurnResult, None]],
    ) -> AsyncGenerator[TextDelta | TurnResult, None]:
        await self._close_abandoned()
        self._check_turnable()
        state = self._state
        state.begin_turn()
        state.stream = holder[0]
        try:
            runner = TurnRunner(
                self._pool, state, options, stream=True, final=final, persist=persist
            )
            async with contextlib.aclosing(runner.events()) as events:
                async for event in events:
                    yield event
        finally:
            state.end_turn()
            if state.stream is holder[0]:
                state.stream = None

    async def extend_handle(self, ttl_s: float) -> float | None:
        """Ask decode to keep the stored handle at least ``ttl_s`` more seconds.

        Returns the handle's new deadline (session clock), or ``None`` when nothing was extended:
        no handle, a decode without agentkv's extension, a failed call, or a handle decode no
        longer holds (it is then dropped, and the next turn says why). Never raises for the
        server's sake. ``tool_wait()`` decides the TTL for you.
        """
        self._check_open()
        if not (math.isfinite(ttl_s) and ttl_s > 0):
            raise ValueError(f"ttl_s must be a positive number of seconds, got {ttl_s}")
        return await extend_handle(self._pool, self._state, ttl_s, reason="explicit")

    async def persist(self) -> TierRef | None:
        """Persist the stored handle to decode's file tier now, and free decode's pin.

        Returns the tier reference (also ``session.tier``), or ``None`` when nothing was
        persisted: no handle, a decode without agentkv's extension or without a tier, a failed
        write or call (the pin then stays as it was). Never raises for the server's sake. The
        next turn's prefill loads the persisted KV from the tier.

        >>> ref = await session.persist()  # the user went for lunch  # doctest: +SKIP
        """
        self._check_open()
        with self._state.holding("persist"):
            return await persist_handle(self._pool, self._state, reason="explicit")

    @contextlib.asynccontextmanager
    async def tool_wait(
        self, *, expected_s: float, persist: PersistMode = "auto"
    ) -> AsyncIterator[ToolWait]:
        """Wrap a tool call (or any pause between turns) of about ``expected_s`` seconds.

        On entry the policy decides what the handle does during the wait
        (``CachePolicy.decide_tier``): with ``persist="auto"``, a wait of at least
        ``policy.persist_after_s`` on a decode with a file tier persists it there (decode's
        memory is freed; the next turn loads it back in milliseconds); ``"disk"`` always
        persists where a tier exists, ``"pin"`` never does. A kept pin is extended when the
        wait would outlast its deadline (``decide_extend``). On exit the yielded ``ToolWait``
        says whether the handle (or its tier entry) survived, and so does the next turn's
        ``handle_reason``. Never raises for the server's sake.

        >>> async with session.tool_wait(expected_s=300) as wait:  # doctest: +SKIP
        ...     output = await run_tool(call)
        >>> wait.survived, wait.persisted  # doctest: +SKIP
        (True, True)
        """
        self._check_open()
        check_persist_mode(persist)
        wait = await begin_wait(self._pool, self._state, expected_s=expected_s, persist=persist)
        try:
            yield wait
        finally:
            end_wait(self._pool, self._state, wait)

    def fork(
        self,
        *,
        keep: int | None = None,
        messages: Iterable[MessageLike] | None = None,
        session_id: str | None = None,
    ) -> AsyncSession:
        """A new session from the first ``keep`` messages, or from ``messages``; no handle.

        The child lives on this session's pair when it is healthy (its prefill may still cache
        the shared prefix). When the kept messages end with an assistant message, the child keeps
        their exact tokens; otherwise its first turn renders them afresh.
        """
        self._check_open()
        state = self._state
        parsed = None if messages is None else [_as_message(m) for m in messages]
        transcript = state.transcript.fork(keep=keep, messages=parsed)
        child = open_session(
            self._pool,
            session_id=session_id,
            policy=state.policy,
            options=state.options,
            transcript=transcript,
            near=state.pair,
        )
        if not transcript.is_fresh:
            child._state.tools_key = state.tools_key
        return child

    async def aclose(self) -> None:
        """Close the session: release its handle on decode and free its place on the pair.

        The release (agentkv's extension only) is best effort: a decode that cannot be reached
        keeps the pin until its TTL, and the close still succeeds.
        """
        state = self._state
        if state.closed:
            return
        await self._close_abandoned()
        state.close()
        # Releases of this session's lost D legs, still in flight: done before close returns.
        pool = self._pool
        await pool.leases.settle()
        handle, state.handle = state.handle, None
        tier = state.take_tier()
        pool.release(state.pair)
        if (
            handle is not None
            and not pool.closed
            and state.policy.decide_release(handle, now=pool.clock())
        ):
            await release_handle(pool, state, handle, reason="close")
        if tier is not None and not pool.closed:
            await delete_tier(pool, state, tier[0], pair=tier[1], reason="close")

    def detach(self) -> None:
        """Close this copy of the session without releasing its handle on decode.

        For a session that lives on elsewhere: another process (a proxy replica sharing
        sessions) holds its snapshot and will send or release the handle (or delete its tier
        entry). Frees this copy's place on its pair; idempotent.
        """
        state = self._state
        if not state.closed:
            state.close()
            state.handle = None
            state.take_tier()
            self._pool.release(state.pair)

    async def __aenter__(self) -> AsyncSession:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


class Session(_SessionBase):
    """The sync twin of ``AsyncSession``. Open with ``Cluster.session()``; not thread-safe.

    >>> with cluster.session() as s:  # doctest: +SKIP
    ...     s.append(Message.user("Tell me a story."))
    ...     for event in s.stream():
    ...         if isinstance(event, TextDelta):
    ...             print(event.text, end="")
    """

    def __init__(self, inner: AsyncSession, *, portal: Portal) -> None:
        self._inner = inner
        self._state = inner._state
        self._pool = inner._pool
        self._portal = portal

    @classmethod
    def load(cls, path: str | os.PathLike[str], cluster: SessionHost) -> Session:
        """Continue a session saved with ``save`` (see ``AsyncSession.load``); the same as
        ``cluster.load_session(path)``.

        >>> with Session.load("run.json", cluster) as s:  # doctest: +SKIP
        ...     print(s.send("Where were we?").text)
        """
        return cluster.load_session(path)

    def turn(
        self,
        *,
        final: bool = False,
        persist: PersistMode = "auto",
        **overrides: Unpack[TurnOverrides],
    ) -> TurnResult:
        """Send the pending messages and return the answer (see ``AsyncSession.turn``)."""
        self._check_open()
        return self._portal.call(self._inner.turn(final=final, persist=persist, **overrides))

    def send(
        self,
        message: str | MessageLike,
        /,
        *,
        final: bool = False,
        persist: PersistMode = "auto",
        **overrides: Unpack[TurnOverrides],
    ) -> TurnResult:
        """Append ``message`` and run a turn (see ``AsyncSession.send``)."""
        self._check_open()
        return self._portal.call(
            self._inner.send(message, final=final, persist=persist, **overrides)
        )

    def stream(
        self,
        *,
        final: bool = False,
        persist: PersistMode = "auto",
        **overrides: Unpack[TurnOverrides],
    ) -> Iterator[TextDelta | TurnResult]:
        """Run a turn: text deltas, then the ``TurnResult`` (see ``AsyncSession.stream``)."""
        return self._portal.iterate(
            self._inner.stream(final=final, persist=persist, **overrides)
        )

    def extend_handle(self, ttl_s: float) -> float | None:
        """Keep the stored handle ``ttl_s`` more seconds (see ``AsyncSession.extend_handle``)."""
        self._check_open()
        return self._portal.call(self._inner.extend_handle(ttl_s))

    def persist(self) -> TierRef | None:
        """Persist the stored handle to decode's file tier now (see ``AsyncSession.persist``)."""
        self._check_open()
        return self._portal.call(self._inner.persist())

    @contextlib.contextmanager
    def tool_wait(
        self, *, expected_s: float, persist: PersistMode = "auto"
    ) -> Iterator[ToolWait]:
        """Wrap a tool call of about ``expected_s`` seconds (see ``AsyncSession.tool_wait``).

        >>> with session.tool_wait(expected_s=300) as wait:  # doctest: +SKIP
        ...     output = run_tool(call)
        """
        self._check_open()
        check_persist_mode(persist)
        state = self._state
        pool = self._pool
        wait = self._portal.call(
            begin_wait(pool, state, expected_s=expected_s, persist=persist)
        )

        async def _end() -> None:
            end_wait(pool, state, wait)

        try:
            yield wait
        finally:
            if not pool.closed:  # else the loop thread is gone, and the session with it
                self._portal.call(_end())

    def fork(
        self,
        *,
        keep: int | None = None,
        messages: Iterable[MessageLike] | None = None,
        session_id: str | None = None,
    ) -> Session:
        """A new session without a handle (see ``AsyncSession.fork``)."""

        async def _fork() -> AsyncSession:
            return self._inner.fork(keep=keep, messages=messages, session_id=session_id)

        self._check_open()
        return Session(self._portal.call(_fork()), portal=self._portal)

    def close(self) -> None:
        """Close the session: forget its handle and free its place on the pair."""
        if self._pool.closed:
            self._state.close()  # the loop thread is gone; so is everything it held
            self._state.handle = None
            self._state.take_tier()
        elif not self._state.closed:
            self._portal.call(self._inner.aclose())

    def detach(self) -> None:
        """Close this copy without releasing its handle (see ``AsyncSession.detach``)."""
        if self._pool.closed:
            self._state.close()  # the loop thread is gone; so is everything it held
            self._state.handle = None
        elif not self._state.closed:

            async def _detach() -> None:
                self._inner.detach()

            self._portal.call(_detach())

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def open_session(
    pool: PairPool,
    *,
    session_id: str | None,
    policy: CachePolicy,
    options: SessionOptions,
    transcript: Transcript | None = None,
    near: Pair | None = None,
    placement_key: str | None = None,
) -> AsyncSession:
    """A new session on ``pool``, placed by ``placement_key`` or its id (``near`` when healthy).

    Call it on the pool's event loop: it takes a place on a pair.
    """
    sid = session_id or uuid.uuid4().hex
    state = SessionState(
        session_id=sid,
        pair=pool.acquire(placement_key or sid, near=near),
        policy=policy,
        options=options,
        transcript=transcript or Transcript(),
    )
    return AsyncSession(state, pool=pool)


def load_session(pool: PairPool, path: str | os.PathLike[str]) -> AsyncSession:
    """The session saved at ``path``, placed on ``pool`` (see ``_persist.load_state``)."""
    return AsyncSession(load_state(path, pool), pool=pool)


def restore_session(
    pool: PairPool,
    data: Mapping[str, Any] | bytes,
    *,
    confirmed: bool = False,
    drop_handle: str | None = None,
) -> AsyncSession:
    """The session from a ``snapshot()`` dict or ``snapshot_bytes()``, placed on ``pool`` (see
    ``_persist.restore``)."""
    if isinstance(data, bytes):
        state = restore_bytes(data, pool, confirmed=confirmed, drop_handle=drop_handle)
    else:
        state = restore(data, pool, confirmed=confirmed, drop_handle=drop_handle)
    return AsyncSession(state, pool=pool)
