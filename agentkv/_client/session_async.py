"""``AsyncSession``: a session's I/O (turns, streams, handle upkeep, close), and opening one."""

from __future__ import annotations

import contextlib
import math
import os
import uuid
import warnings
from collections.abc import AsyncGenerator, AsyncIterator, Iterable, Mapping
from typing import Any, Literal, Protocol, Unpack

from agentkv._client import forking, kv, leasing
from agentkv._client import tool_wait as waits
from agentkv._client.offload import OffloadMode, check_offload
from agentkv._client.pool import PairPool
from agentkv._client.save_file import load_state, restore, restore_bytes
from agentkv._client.session_base import SessionBase, as_message, merge_options
from agentkv._client.state import SessionState
from agentkv._client.tool_wait import ToolWait
from agentkv._client.turn import TurnRunner
from agentkv._policy import CachePolicy, PersistMode
from agentkv._prompt.transcript import Transcript
from agentkv._types import (
    Message,
    MessageLike,
    Pair,
    SessionOptions,
    TextDelta,
    TurnOverrides,
    TurnResult,
)
from agentkv._wire.tier import TierRef

__all__ = ["AsyncSession", "AsyncSessionHost", "load_session", "open_session", "restore_session"]


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


class AsyncSession(SessionBase):
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
        offload: OffloadMode = "auto",
        request_secret: str | None = None,
        persist: PersistMode | None = None,
        **overrides: Unpack[TurnOverrides],
    ) -> TurnResult:
        """Send the pending messages and return the assistant's answer.

        Keyword arguments override the session's defaults for this turn: ``max_tokens``,
        ``temperature``, ``tools``, ``tool_choice``, ``extra_body``. A failed turn raises and
        leaves the transcript (pending messages included) as it was.

        ``final=True`` says no turn follows: decode (with agentkv's extension) pins nothing for a
        next one. The session stays open; a further turn just recomputes.

        ``offload="always"``: the next turn is far off, so the turn-end KV goes to decode's file
        tier right after this one (``offload()``); ``"auto"`` and ``"never"`` keep the pin.

        ``request_secret`` tags the turn's D leg (``X-Request-Id``) for a caller that records it
        elsewhere before the turn, as a proxy replica does in its session store: should the
        turn's answer never be stored anywhere, ``cluster.release_request(secret)`` frees what
        decode pinned for it. By default each D leg gets a fresh secret of its own.
        """
        options = merge_options(self._state.options, overrides)
        mode = check_offload(offload, persist)
        await self._close_abandoned()
        self._check_turnable()
        self._state.begin_turn()
        try:
            runner = TurnRunner(
                self._pool,
                self._state,
                options,
                stream=False,
                final=final,
                offload=mode,
                request_secret=request_secret,
            )
            result = None
            async with contextlib.aclosing(runner.events()) as events:
                # Run to the end, not closed at the result: closing throws GeneratorExit through
                # each of the turn's nested generators (~40 us of a turn's CPU); after the
                # result they have nothing left to do.
                async for event in events:
                    if isinstance(event, TurnResult):
                        result = event
        finally:
            self._state.end_turn()
        if result is None:  # pragma: no cover - the events end with the result or raise
            raise AssertionError("a turn ended without a result")
        return result

    async def send(
        self,
        message: str | MessageLike,
        /,
        *,
        final: bool = False,
        offload: OffloadMode = "auto",
        request_secret: str | None = None,
        persist: PersistMode | None = None,
        **overrides: Unpack[TurnOverrides],
    ) -> TurnResult:
        """Append ``message`` (text is a user message) and run a turn; on failure, un-append it."""
        self._check_open()
        mode = check_offload(offload, persist)
        keep = len(self._state.transcript.pending)
        self.append(Message.user(message) if isinstance(message, str) else message)
        try:
            return await self.turn(
                final=final, offload=mode, request_secret=request_secret, **overrides
            )
        except BaseException:
            # Only this message: others appended while the turn ran stay queued.
            self._state.transcript.drop_pending(keep, count=1)
            raise

    def stream(
        self,
        *,
        final: bool = False,
        offload: OffloadMode = "auto",
        request_secret: str | None = None,
        persist: PersistMode | None = None,
        **overrides: Unpack[TurnOverrides],
    ) -> AsyncIterator[TextDelta | TurnResult]:
        """Run a turn: ``TextDelta`` pieces as decode produces them, then the ``TurnResult``.

        The turn-end handle is stored as for ``turn()`` (``final`` too). Leaving the loop early
        abandons the turn (nothing is committed), and the session is free at once: the next
        ``turn()``, ``send()``, ``stream()`` or ``aclose()`` closes the abandoned stream
        (``await stream.aclose()`` does it yourself). A stream is not retried once text was
        yielded. ``request_secret`` as for ``turn()``.
        """
        options = merge_options(self._state.options, overrides)
        mode = check_offload(offload, persist)
        self._check_turnable(abandoned_ok=True)
        holder: list[AsyncGenerator[TextDelta | TurnResult, None]] = []
        stream = self._stream(
            options, final=final, offload=mode, holder=holder, request_secret=request_secret
        )
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
        offload: OffloadMode,
        holder: list[AsyncGenerator[TextDelta | TurnResult, None]],
        request_secret: str | None,
    ) -> AsyncGenerator[TextDelta | TurnResult, None]:
        await self._close_abandoned()
        self._check_turnable()
        state = self._state
        state.begin_turn()
        state.stream = holder[0]
        try:
            runner = TurnRunner(
                self._pool,
                state,
                options,
                stream=True,
                final=final,
                offload=offload,
                request_secret=request_secret,
            )
            async with contextlib.aclosing(runner.events()) as events:
                async for event in events:
                    yield event
        finally:
            state.end_turn()
            if state.stream is holder[0]:
                state.stream = None

    async def extend_handle(self, ttl_s: float) -> float | None:
        """Ask decode to keep the pin at least ``ttl_s`` more seconds: the handle's new deadline
        (session clock), or ``None``: no pin, a stock decode, a failed call, or a pin decode no
        longer holds (then dropped; the next turn says why). Never raises for the server's sake.
        """
        self._check_open()
        if not (math.isfinite(ttl_s) and ttl_s > 0):
            raise ValueError(f"ttl_s must be a positive number of seconds, got {ttl_s}")
        return await leasing.extend(self._pool, self._state, ttl_s, reason="explicit")

    async def offload(self) -> TierRef | None:
        """Offload the pin to decode's file tier now, and free decode's memory; the tier
        reference (also ``session.tier``), which the next turn's prefill loads, or ``None``: no
        pin, no extension or tier on decode, a failed write or call (the pin then stays).

        >>> ref = await session.offload()  # the user went for lunch  # doctest: +SKIP
        """
        self._check_open()
        with self._state.holding("offload"):
            return await leasing.offload(self._pool, self._state, reason="explicit")

    async def persist(self) -> TierRef | None:
        """Deprecated name of ``offload()``."""
        warnings.warn("session.persist() is deprecated: use offload()", DeprecationWarning, 2)
        return await self.offload()

    async def unpin(self) -> Literal["persisted", "released"] | None:
        """Free the decode memory this session's next turn would reuse, now.

        Offloaded to decode's file tier where it has one, else released (the next turn
        recomputes). ``None`` when nothing was pinned or the release failed. For an idle session
        while decode's memory is nearly full (the proxy's pressure relief).
        """
        self._check_open()
        with self._state.holding("unpin"):
            if await leasing.offload(self._pool, self._state, reason="unpin") is not None:
                return "persisted"
            return "released" if await leasing.unpin(self._pool, self._state) else None

    @contextlib.asynccontextmanager
    async def tool_wait(
        self,
        *,
        expected_s: float,
        offload: OffloadMode = "auto",
        persist: PersistMode | None = None,
    ) -> AsyncIterator[ToolWait]:
        """Wrap a tool call (or any pause between turns) of about ``expected_s`` seconds.

        On entry the policy decides what the handle does during the wait
        (``CachePolicy.decide_tier``): with ``offload="auto"``, a wait of at least
        ``policy.persist_after_s`` on a decode with a file tier offloads it there (decode's
        memory is freed; the next turn loads it back in milliseconds); ``"always"`` always
        offloads where a tier exists, ``"never"`` never does (``persist=``, ``"pin"`` and
        ``"disk"``: the old words, deprecated). A kept pin is extended when the wait would
        outlast its deadline (``decide_extend``). On exit the yielded ``ToolWait``
        says whether the handle (or its tier entry) survived, and so does the next turn's
        ``handle_reason``. Never raises for the server's sake.

        >>> async with session.tool_wait(expected_s=300) as wait:  # doctest: +SKIP
        ...     output = await run_tool(call)
        >>> wait.survived, wait.persisted  # doctest: +SKIP
        (True, True)
        """
        self._check_open()
        mode = check_offload(offload, persist, stacklevel=4)
        wait = await waits.begin_wait(self._pool, self._state, expected_s=expected_s, mode=mode)
        try:
            yield wait
        finally:
            waits.end_wait(self._pool, self._state, wait)

    def fork(
        self,
        *,
        keep: int | None = None,
        messages: Iterable[MessageLike] | None = None,
        session_id: str | None = None,
        copy_kv: bool = True,
    ) -> AsyncSession:
        """A new session from the first ``keep`` messages, or from ``messages`` (neither: the
        whole history).

        The child lives on this session's pair when it is healthy. When the kept messages end
        with an assistant message, the child keeps their exact tokens; otherwise its first turn
        renders them afresh. With ``copy_kv`` (the default), a child that keeps this session's whole
        history gets a copy of its pinned KV: decode writes the pin's blocks to its file tier
        and keeps the pin, and the child's first turn loads them from there instead of
        computing them (``handle_state`` ``tier``). This session keeps its pin; its next turn
        waits for the copy to be written. Without a tier that copies (an older connector, none
        configured), or when the history differs, the child's first turn reuses only what its
        prefill's prefix cache holds, and its ``handle_reason`` says why.
        """
        self._check_open()
        state = self._state
        parsed = None if messages is None else [as_message(m) for m in messages]
        if keep is None and parsed is None:
            keep = len(state.transcript.messages)
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
        if transcript.token_ids == state.transcript.token_ids:
            child._state.ideal_base = state.ideal_base  # what a perfect handle would give it
        if copy_kv:
            forking.start_copy(self._pool, state, child._state)
        return child

    async def aclose(self) -> None:
        """Close the session: release its pin (or delete its tier entry) and free its place on
        the pair. Best effort: an unreachable decode keeps the pin until its TTL."""
        state, pool = self._state, self._pool
        if state.closed:
            return
        await self._close_abandoned()
        state.close()
        await pool.leases.settle()  # releases of lost D legs still in flight: done first
        pool.release(state.pair)
        await leasing.close(pool, state)

    def detach(self) -> None:
        """Close this copy without releasing its KV, for a session that lives on elsewhere (a
        proxy replica's snapshot will send or release it). Frees its place; idempotent."""
        state = self._state
        if not state.closed:
            state.close()
            state.apply(kv.detached(state.kv))
            self._pool.release(state.pair)

    async def __aenter__(self) -> AsyncSession:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


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
    """The session saved at ``path``, placed on ``pool`` (see ``save_file.load_state``)."""
    return AsyncSession(load_state(path, pool), pool=pool)


def restore_session(
    pool: PairPool,
    data: Mapping[str, Any] | bytes,
    *,
    confirmed: bool = False,
    drop_handle: str | None = None,
) -> AsyncSession:
    """The session from a ``snapshot()`` dict or ``snapshot_bytes()``, placed on ``pool`` (see
    ``save_file.restore``)."""
    if isinstance(data, bytes):
        state = restore_bytes(data, pool, confirmed=confirmed, drop_handle=drop_handle)
    else:
        state = restore(data, pool, confirmed=confirmed, drop_handle=drop_handle)
    return AsyncSession(state, pool=pool)
