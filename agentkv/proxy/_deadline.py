"""A deadline on reading a request's body: a client that stalls mid-upload gets 408, not a slot.

uvicorn reads a body only as fast as the client sends it and waits for the rest forever, while the
app holds what arrived (up to ``max_body_bytes`` a request): 40 clients that stop mid-upload held
the proxy's memory and connections until they left. ``BodyDeadline`` wraps an HTTP request's
``receive``: each piece of the body must arrive before the deadline ``BodyPace`` computes, else
the read raises a 408 ``ProxyError`` (``Connection: close``), which the endpoint answers like any
refusal; the handler's frames, and with them what was read so far, are released at once.

Why a gap *and* a rate, not a total deadline alone: a total deadline long enough for an 8 MiB
upload on a slow link keeps a stalled client for as long; a gap alone (nginx's
``client_body_timeout``) lets a client trickle a byte a few seconds forever. So a piece may come at
most ``timeout_s`` after the previous one, and the body as a whole gets ``timeout_s`` plus a
second per ``min_rate`` bytes received (Apache's ``mod_reqtimeout`` ``MinRate``): a steady
upload at ``min_rate`` or faster is never cut, a stall is cut ``timeout_s`` after its last byte
(sooner once it falls behind the rate), and no body holds a connection longer than
``timeout_s + max_body_bytes / min_rate``.

Freed is not given back: glibc keeps the freed pieces of 40 cut 7 MiB uploads in its heaps (the
proxy's RSS stayed near its peak, reused by the next wave but never returned). So once a request
whose body was not read to its end (cut, left, refused as too large) has ended having read
``_TRIM_AFTER_BYTES`` or more, the middleware asks glibc's ``malloc_trim`` to return free pages to
the system: a second later, once for all such requests of that second (one call on the event
loop, never on the path of a request read whole). Elsewhere than glibc this does nothing.

The deadline is loop time from when the app first sees the request (its headers complete). It
costs one timer per ``receive`` until the body is complete, then nothing: the in-process
transport's direct endpoints (``app.state.endpoints``) skip middleware and never see it.

>>> pace = BodyPace(timeout_s=10.0, min_rate=1000.0)
>>> pace.deadline(started=0.0, last=0.0, received=0)
10.0
>>> pace.deadline(started=0.0, last=2.0, received=5000)  # 5 s earned, but a gap is 10 s at most
12.0
>>> pace.deadline(started=0.0, last=14.0, received=6000)  # behind its rate: 10 + 6
16.0
>>> BodyPace(timeout_s=10.0, min_rate=None).deadline(started=0.0, last=9.0, received=10**6)
10.0
"""

from __future__ import annotations

import asyncio
import ctypes
from collections.abc import Callable
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from agentkv.proxy._errors import ProxyError

__all__ = ["BodyDeadline", "BodyPace"]

_TRIM_AFTER_BYTES = 1024 * 1024
_TRIM_DELAY_S = 1.0


def _malloc_trim() -> Callable[[], object] | None:
    """glibc's ``malloc_trim(0)``, or ``None`` where the C library has none (musl, macOS)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError, TypeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return lambda: trim(0)


_GLIBC_TRIM = _malloc_trim()


@dataclass(frozen=True, kw_only=True, slots=True)
class BodyPace:
    """How fast a request body must arrive (the module docstring says why both bounds).

    Attributes:
        timeout_s: the longest gap between two pieces of a body, and its head start.
        min_rate: bytes a second that earn a body more time; ``None``: the whole body within
            ``timeout_s``.
    """

    timeout_s: float
    min_rate: float | None

    def deadline(self, *, started: float, last: float, received: int) -> float:
        """When the next piece must have arrived, on the clock ``started`` and ``last`` are on."""
        if self.min_rate is None:
            return started + self.timeout_s
        return min(last + self.timeout_s, started + self.timeout_s + received / self.min_rate)


class _PacedReceive:
    """One request's ``receive``, with the deadline on each piece of its body."""

    __slots__ = ("_done", "_last", "_pace", "_receive", "_received", "_started", "_whole")

    def __init__(self, receive: Receive, pace: BodyPace) -> None:
        self._receive = receive
        self._pace = pace
        self._started = self._last = asyncio.get_running_loop().time()
        self._received = 0
        self._whole = False  # the body's last piece came
        self._done = False  # no deadline any more: the body is whole, or the client left

    @property
    def abandoned_bytes(self) -> int:
        """What was read of a body never read to its end (0 for a whole one)."""
        return 0 if self._whole else self._received

    async def __call__(self) -> Message:
        if self._done:
            # After the body, receive only says the client left: no deadline on that.
            return await self._receive()
        deadline = self._pace.deadline(
            started=self._started, last=self._last, received=self._received
        )
        timeout = asyncio.timeout_at(deadline)
        try:
            async with timeout:
                message = await self._receive()
        except TimeoutError:
            if not timeout.expired():
                raise
            raise self._too_slow() from None
        if message["type"] == "http.request":
            body = message.get("body", b"")
            if body:
                self._received += len(body)
                self._last = asyncio.get_running_loop().time()
            self._whole = self._done = not message.get("more_body", False)
        else:
            self._done = True
        return message

    def _too_slow(self) -> ProxyError:
        pace = self._pace
        rule = (
            f"within {pace.timeout_s:g} s"
            if pace.min_rate is None
            else f"with no gap over {pace.timeout_s:g} s, at {pace.min_rate:g} bytes/s or faster"
        )
        return ProxyError(
            408,
            f"the request body arrived too slowly ({self._received} bytes; send it {rule})",
            code="body_timeout",
            # The rest of the body may still come: closing is the only way not to read it.
            headers={"Connection": "close"},
        )


class BodyDeadline:
    """ASGI middleware: HTTP requests' bodies must arrive at ``pace`` (``None``: no deadline).

    ``trim`` returns freed memory to the system after abandoned bodies (default: glibc's
    ``malloc_trim``, where there is one).
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        pace: BodyPace | None,
        trim: Callable[[], object] | None = _GLIBC_TRIM,
    ) -> None:
        self._app = app
        self._pace = pace
        self._trim = trim
        self._trim_pending = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self._pace is None:
            await self._app(scope, receive, send)
            return
        paced = _PacedReceive(receive, self._pace)
        try:
            await self._app(scope, paced, send)
        finally:
            # By now the handler's frames, and the pieces they held, are gone.
            if paced.abandoned_bytes >= _TRIM_AFTER_BYTES:
                self._trim_soon()

    def _trim_soon(self) -> None:
        if self._trim is None or self._trim_pending:
            return
        self._trim_pending = True
        asyncio.get_running_loop().call_later(_TRIM_DELAY_S, self._trim_now)

    def _trim_now(self) -> None:
        self._trim_pending = False
        if self._trim is not None:
            self._trim()
