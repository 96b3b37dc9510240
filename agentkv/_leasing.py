"""A session's pinned KV on decode between turns: release, extend, tool waits.

A turn's KV stays pinned on its decode server for the next turn. Stock vLLM holds it for a fixed
``decoder_kv_blocks_ttl``; agentkv's vLLM extension (``agentkv.connector``, wire format in
``_hints``) leases the pin to the session, which then frees it as soon as it is no longer needed
(``release``) or keeps it while a tool runs (``extend``).

Everything here is best effort. A decode without the extension is detected once per server and
gets no lease calls (one warning says so); a failed call leaves what stock vLLM does (the pin
lives out its TTL). Neither ever fails a turn, a tool call or a close.

>>> async with cluster.session() as s:  # doctest: +SKIP
...     r = await s.send("Look up the weather in Paris.")
...     async with s.tool_wait(expected_s=600):  # extends the handle if 600 s outlast it
...         weather = await slow_weather_api("Paris")
...     await s.send(Message.tool(weather, tool_call_id=r.tool_calls[0].id))
... # leaving the block released decode's pin of the last turn
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httpx
import structlog

from agentkv._exceptions import TransportError
from agentkv._handoff import extended_handle, lease_ref
from agentkv._hints import (
    EXTEND_PATH,
    INFO_PATH,
    RELEASE_PATH,
    RELEASE_REQUEST_PATH,
    ExtendRequest,
    ExtendResult,
    HintError,
    RequestRelease,
    ServerInfo,
    request_tag,
)
from agentkv._http import exchange
from agentkv._json import dumps
from agentkv._policy import ExtendDecision
from agentkv._types import HandleState, KVHandle

if TYPE_CHECKING:
    from agentkv._state import SessionState

__all__ = [
    "LeaseCalls",
    "ToolWait",
    "begin_wait",
    "end_wait",
    "extend_handle",
    "release_handle",
    "release_lost",
    "release_soon",
]

logger = structlog.get_logger("agentkv")

# How long a decode found without agentkv's extension is taken at its word before it is asked
# again (cluster clock).
RECHECK_UNSUPPORTED_S = 60.0

# Lease calls answer in milliseconds; a decode that takes longer is in trouble, and a close
# must not hang on it.
_CALL_TIMEOUT_S = 5.0

# Outcomes of a lease call, as logged (``outcome``).
OK = "ok"
GONE = "gone"  # 404/410: decode holds nothing for this handle (consumed, expired, released)
UNAVAILABLE = "unavailable"  # 501: decode runs the plugin with a stock connector
FAILED = "failed"  # transport error, 5xx, or an answer we cannot read


@dataclass(frozen=True, kw_only=True, slots=True)
class _CallResult:
    outcome: str
    status: int | None
    detail: str = ""
    extended: ExtendResult | None = None


def _error_code(data: Any) -> str:
    error = data.get("error") if isinstance(data, dict) else None
    code = error.get("code") if isinstance(error, dict) else None
    return str(code) if code is not None else ""


def _outcome(status: int) -> str:
    if status in (404, 410):
        return GONE
    if status == 501:
        return UNAVAILABLE
    return FAILED


class LeaseCalls:
    """The lease routes of a cluster's decode servers, and which servers have them.

    One per cluster: whether a decode runs agentkv's extension is asked once per server
    (``GET /v1/agentkv/info``). A "yes" is kept until the server is marked down (it may come
    back restarted, with another build: :meth:`forget`); a "no" also for at most
    :data:`RECHECK_UNSUPPORTED_S`, so a decode restarted with the extension is found.
    """

    def __init__(
        self, client: httpx.AsyncClient, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._client = client
        self._clock = clock
        self._support: dict[str, bool] = {}
        self._unsupported_at: dict[str, float] = {}
        self._warned: set[str] = set()
        self._asking: dict[str, asyncio.Task[bool | None]] = {}
        self._lost: set[asyncio.Task[None]] = set()

    async def supported(self, decode: str) -> bool | None:
        """Whether ``decode`` has agentkv's extension: ``None`` when it could not be asked (it is
        asked again next time)."""
        known = self._support.get(decode)
        if known is False and self._clock() - self._unsupported_at[decode] >= RECHECK_UNSUPPORTED_S:
            known = None  # ask again: it may have been restarted with the extension
        if known is not None:
            return known
        task = self._asking.get(decode)
        if task is None:
            task = asyncio.ensure_future(self._ask(decode))
            self._asking[decode] = task
            task.add_done_callback(lambda _: self._asking.pop(decode, None))
        # Shielded: one caller giving up (a cancelled turn) must not cancel the others' answer.
        return await asyncio.shield(task)

    async def _ask(self, decode: str) -> bool | None:
        try:
            status, data = await exchange(
                self._client, "GET", decode + INFO_PATH, timeout_s=_CALL_TIMEOUT_S
            )
        except TransportError as exc:
            logger.debug("agentkv.leases_unknown", decode=decode, detail=str(exc))
            return None
        if status == 200:
            try:
                info = ServerInfo.from_wire(data)
            except HintError as exc:
                reason = f"unreadable {INFO_PATH} answer: {exc}"
            else:
                if info.leases:
                    self._support[decode] = True
                    self._warned.discard(decode)
                    logger.debug(
                        "agentkv.leases_available",
                        decode=decode,
                        default_ttl_s=info.default_ttl_s,
                        max_ttl_s=info.max_ttl_s,
                    )
                    return True
                reason = "the agentkv plugin runs, but decode's KV connector is vLLM's own"
        elif status == 404:
            reason = f"no agentkv plugin on decode ({INFO_PATH} answered 404)"
        else:
            logger.debug("agentkv.leases_unknown", decode=decode, status=status)
            return None
        self._support[decode] = False
        self._unsupported_at[decode] = self._clock()
        if decode in self._warned:
            return False
        self._warned.add(decode)
        logger.warning(
            "agentkv.leases_unavailable",
            decode=decode,
            reason=reason,
            fallback="stock vLLM: turn-end KV is pinned for the server's TTL; no release or extend",
            hint="run decode with AgentKVConnector and VLLM_PLUGINS=agentkv (docs/connector.md)",
        )
        return False

    def forget(self, decode: str) -> None:
        """``decode`` went down: ask again once it is back (a restart may change the answer)."""
        self._support.pop(decode, None)

    async def _call(self, url: str, body: dict[str, Any]) -> tuple[int, Any] | _CallResult:
        try:
            return await exchange(
                self._client, "POST", url, body=dumps(body), timeout_s=_CALL_TIMEOUT_S
            )
        except TransportError as exc:
            return _CallResult(outcome=FAILED, status=None, detail=str(exc))

    async def release(self, decode: str, handle: KVHandle) -> _CallResult:
        answer = await self._call(decode + RELEASE_PATH, lease_ref(handle).to_wire())
        if isinstance(answer, _CallResult):
            return answer
        status, data = answer
        if status == 200:
            return _CallResult(outcome=OK, status=status)
        return _CallResult(outcome=_outcome(status), status=status, detail=_error_code(data))

    async def release_request(self, decode: str, secret: str) -> _CallResult:
        answer = await self._call(
            decode + RELEASE_REQUEST_PATH, RequestRelease(secret=secret).to_wire()
        )
        if isinstance(answer, _CallResult):
            return answer
        status, data = answer
        if status == 200:
            released = data.get("released") if isinstance(data, dict) else None
            return _CallResult(outcome=OK, status=status, detail=f"released {released}")
        return _CallResult(outcome=_outcome(status), status=status, detail=_error_code(data))

    def track(self, task: asyncio.Task[None]) -> None:
        """Keep a background release alive until it is done (:meth:`settle` waits for it)."""
        self._lost.add(task)
        task.add_done_callback(self._lost.discard)

    async def settle(self) -> None:
        """Wait for the releases of lost D legs still in flight (a close waits for them)."""
        while self._lost:
            await asyncio.gather(*list(self._lost), return_exceptions=True)

    async def extend(self, decode: str, handle: KVHandle, *, ttl_s: float) -> _CallResult:
        request = ExtendRequest(ref=lease_ref(handle), ttl_s=ttl_s)
        answer = await self._call(decode + EXTEND_PATH, request.to_wire())
        if isinstance(answer, _CallResult):
            return answer
        status, data = answer
        if status != 200:
            return _CallResult(outcome=_outcome(status), status=status, detail=_error_code(data))
        try:
            result = ExtendResult.from_wire(data)
        except HintError as exc:
            return _CallResult(outcome=FAILED, status=status, detail=str(exc))
        return _CallResult(outcome=OK, status=status, extended=result)


def _ms(since: float) -> float:
    return round((time.perf_counter() - since) * 1000.0, 3)


async def release_handle(state: SessionState, handle: KVHandle, *, reason: str) -> None:
    """Ask decode to free ``handle``'s blocks now; never raises for the server's sake.

    Only for a leased handle no P leg has carried (a P leg consumes it).
    """
    cluster = state.cluster
    started = time.perf_counter()
    result = await cluster._leases.release(cluster._decode_url(handle.pair), handle)
    _log_lease_call("agentkv.release", state, handle, result, reason=reason, started=started)


def release_soon(state: SessionState, handle: KVHandle, *, reason: str) -> asyncio.Task[None]:
    """:func:`release_handle` in the background (from a turn ending by cancellation or a closed
    stream); ``aclose()`` of the session waits for it."""
    task = asyncio.ensure_future(release_handle(state, handle, reason=reason))
    state.cluster._leases.track(task)
    return task


def release_lost(
    state: SessionState, decode: str, secret: str, *, reason: str
) -> asyncio.Task[None]:
    """Free, in the background, whatever decode pinned for a D leg whose answer was lost.

    The leg was sent with ``X-Request-Id: request_tag(secret)``; presenting the secret releases
    its pin, or, when decode has not finished the request yet, keeps it from being pinned. A
    background task, because the turn may be ending by cancellation or by its stream being
    closed; ``aclose()`` of the session waits for it.
    """
    cluster = state.cluster

    async def run() -> None:
        started = time.perf_counter()
        result = await cluster._leases.release_request(decode, secret)
        log = logger.info if result.outcome in (OK, GONE) else logger.warning
        log(
            "agentkv.release_lost",
            session_id=state.session_id,
            decode=decode,
            request_tag=request_tag(secret),
            reason=reason,
            outcome=result.outcome,
            status=result.status,
            detail=result.detail,
            ms=_ms(started),
        )

    task = asyncio.ensure_future(run())
    cluster._leases.track(task)
    return task


async def extend_handle(state: SessionState, ttl_s: float, *, reason: str) -> float | None:
    """Ask decode to keep the session's handle ``ttl_s`` more seconds; the new deadline or
    ``None`` (no handle, no lease, or decode no longer holds it: then it is dropped)."""
    handle = state.handle
    if handle is None or not handle.leased:
        return None
    cluster = state.cluster
    sent_at = cluster.clock()
    started = time.perf_counter()
    result = await cluster._leases.extend(cluster._decode_url(handle.pair), handle, ttl_s=ttl_s)
    deadline: float | None = None
    if result.extended is not None:
        granted = state.policy.lease_deadline(sent_at=sent_at, ttl_s=result.extended.ttl_s)
        # Decode never shortens a lease; our two estimates of it are both safe, keep the later.
        deadline = max(granted, handle.deadline)
        if state.handle is handle:  # a turn may have taken it meanwhile
            state.handle = extended_handle(handle, result.extended, deadline=deadline)
    elif result.outcome == GONE and state.handle is handle:
        state.drop_handle(
            HandleState.EXPIRED, f"decode no longer holds the handle ({result.detail or 'gone'})"
        )
    _log_lease_call(
        "agentkv.extend",
        state,
        handle,
        result,
        reason=reason,
        started=started,
        ttl_s=ttl_s,
        granted_s=None if result.extended is None else round(result.extended.ttl_s, 3),
        deadline_in_s=None if deadline is None else round(deadline - sent_at, 3),
    )
    return deadline


def _log_lease_call(
    event: str,
    state: SessionState,
    handle: KVHandle,
    result: _CallResult,
    *,
    reason: str,
    started: float,
    **fields: Any,
) -> None:
    """One event per lease call: info when decode answered as expected, warning otherwise."""
    log = logger.info if result.outcome in (OK, GONE) else logger.warning
    log(
        event,
        session_id=state.session_id,
        pair=handle.pair,
        request_id=handle.request_id,
        reason=reason,
        outcome=result.outcome,
        status=result.status,
        detail=result.detail,
        ms=_ms(started),
        **fields,
    )


@dataclass(kw_only=True, slots=True)
class ToolWait:
    """What ``session.tool_wait()`` did around one tool call.

    ``decision`` is the policy's at the start (extend or not, and why); ``extended`` says whether
    decode granted the extension. At the end, ``survived`` says whether the handle is still good
    for the next turn (that turn's ``TurnStats.handle_reason`` says so too).
    """

    expected_s: float
    started_at: float
    decision: ExtendDecision
    extended: bool = False
    had_handle: bool = False
    ended_at: float | None = None
    survived: bool | None = None

    @property
    def waited_s(self) -> float | None:
        """How long the wait took (session clock), once it ended."""
        return None if self.ended_at is None else self.ended_at - self.started_at


async def begin_wait(state: SessionState, *, expected_s: float) -> ToolWait:
    now = state.cluster.clock()
    handle = state.handle
    decision = state.policy.decide_extend(handle, now=now, expected_wait_s=expected_s)
    extended = False
    if decision.extend and decision.ttl_s is not None:
        extended = await extend_handle(state, decision.ttl_s, reason="tool_wait") is not None
    return ToolWait(
        expected_s=expected_s,
        started_at=now,
        decision=decision,
        extended=extended,
        had_handle=handle is not None,
    )


def end_wait(state: SessionState, wait: ToolWait) -> None:
    now = state.cluster.clock()
    handle = state.handle
    wait.ended_at = now
    wait.survived = handle is not None and now < handle.deadline
    if wait.had_handle:
        how = "extended" if wait.extended else f"not extended: {wait.decision.reason}"
        kept = "kept" if wait.survived else "lost"
        state.wait_note = f"handle {kept} over a {now - wait.started_at:.1f}s tool wait ({how})"
    logger.info(
        "agentkv.tool_wait",
        session_id=state.session_id,
        expected_s=wait.expected_s,
        waited_s=round(now - wait.started_at, 3),
        extended=wait.extended,
        survived=wait.survived,
        reason=wait.decision.reason,
    )
