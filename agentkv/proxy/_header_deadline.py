"""A deadline on reading a request's headers, which uvicorn lacks (slowloris).

uvicorn (0.55) times out a connection only while it idles between requests (its keep-alive
timeout, armed after a response); a client that connects and sends nothing, or part of its
headers, holds the connection, a descriptor and a slot of ``limit_concurrency`` for as long as it
likes, and the body deadline (``_deadline``) starts only once headers are complete. Enough such
clients and every other request gets 503.

``header_deadline_protocol`` subclasses the HTTP protocol uvicorn would pick (``http="auto"``:
httptools where installed, else h11): a connection must complete a request's headers within
``timeout_s`` of connecting, or of its first byte after a response, else it is closed (nothing is
answered: a client that has not finished its request is not reading either). It reads uvicorn's
per-connection ``cycle`` and ``transport``, attributes both of its HTTP protocols have; a test
over real sockets (``tests/fake/test_proxy_slow_clients.py``) fails if that ever changes.
"""

from __future__ import annotations

import asyncio
from typing import Any

__all__ = ["header_deadline_protocol"]


def header_deadline_protocol(timeout_s: float) -> type[asyncio.Protocol]:
    """uvicorn's auto HTTP protocol, closing connections whose headers take over ``timeout_s``."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    base: Any = AutoHTTPProtocol  # a variable mypy will not take as a base class

    class HeaderDeadline(base):  # type: ignore[misc]  # (base is Any on purpose, above)
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            cycle = self.cycle
            super().data_received(data)
            if self.cycle is not cycle:
                # Headers complete: a request started (its body has a deadline of its own).
                self._disarm()
            elif cycle is None or cycle.response_complete:
                # Part of a request's headers, on a new or a kept-alive connection.
                self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            if self._header_timer is None:
                loop = asyncio.get_running_loop()
                self._header_timer = loop.call_later(timeout_s, self._headers_too_slow)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            if not self.transport.is_closing():
                self.transport.close()

    return HeaderDeadline
