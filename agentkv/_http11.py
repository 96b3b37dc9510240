"""One HTTP/1.1 client connection on an asyncio protocol, parsed by httptools (llhttp).

The loop calls the protocol back when bytes or the server's close arrive, so nothing polls: a
connection the server closed while idle is known closed before it is picked again, and a response
costs a few callbacks and one parse in C. One exchange at a time (no pipelining).

Errors are httpx's, as httpcore raises them: ``RemoteProtocolError`` for a server that closes
before answering in full or answers what is not HTTP, ``ReadTimeout``/``WriteTimeout``,
``WriteError`` for writing to a closed connection.
"""

# httpx's timeouts are per phase (connect, write, read, pool); each is applied where that phase
# waits, so these functions take the phase's timeout.
# ruff: noqa: ASYNC109

from __future__ import annotations

import asyncio
import typing
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

import httptools
import httpx

__all__ = ["Connection", "Exchange", "wait_for"]

T = TypeVar("T")

# Stop reading from the socket while this much of a response body waits for its reader.
_HIGH_WATER = 1 << 20


async def wait_for(
    future: asyncio.Future[T], timeout: float | None, error: Callable[[], Exception]
) -> T:
    """Await ``future``; after ``timeout`` seconds cancel it and raise ``error()`` instead
    (callers then discard what the future belonged to)."""
    if timeout is None:
        return await future
    loop = asyncio.get_running_loop()
    expired = False

    def expire() -> None:
        nonlocal expired
        if not future.done():
            expired = True
            future.cancel()

    handle = loop.call_later(timeout, expire)
    try:
        return await future
    except asyncio.CancelledError:
        if expired:
            raise error() from None
        raise
    finally:
        handle.cancel()


class Exchange:
    """The response side of one request: head, then body chunks as the parser produces them."""

    def __init__(self, connection: Connection) -> None:
        self._connection = connection
        self.status = 0
        self.reason = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.head_done = False
        self.complete = False
        self.keep_alive = False
        self.error: Exception | None = None
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._waiter: asyncio.Future[None] | None = None

    # --- fed by the connection ---

    def wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def body(self, chunk: bytes) -> None:
        self._chunks.append(chunk)
        self._buffered += len(chunk)
        if self._buffered > _HIGH_WATER:
            self._connection.pause_reading()
        self.wake()

    def fail(self, error: Exception) -> None:
        if not self.complete and self.error is None:
            self.error = error
        self.wake()

    # --- read by the caller ---

    async def _wait(self, timeout: float | None) -> None:
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await wait_for(self._waiter, timeout, lambda: httpx.ReadTimeout("timed out reading"))
        finally:
            self._waiter = None

    async def head(self, timeout: float | None) -> None:
        """Wait for the status line and headers."""
        while not self.head_done:
            if self.error is not None:
                raise self.error
            await self._wait(timeout)

    async def chunks(self, timeout: float | None) -> AsyncIterator[bytes]:
        """The body, in the pieces that have arrived by each step; ends when the message does."""
        while True:
            if self._chunks:
                data = b"".join(self._chunks)
                self._chunks.clear()
                if self._buffered > _HIGH_WATER:
                    self._connection.resume_reading()
                self._buffered = 0
                yield data
            elif self.complete:
                return
            elif self.error is not None:
                raise self.error
            else:
                await self._wait(timeout)


class Connection(asyncio.Protocol):
    """An HTTP/1.1 connection; ``send()`` writes a request and returns its exchange."""

    def __init__(self) -> None:
        self._transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._exchange: Exchange | None = None
        self._until_close = False
        self._head_request = False
        self._write_ready: asyncio.Future[None] | None = None
        self.lost = False  # the loop reported the connection closed
        self._retired = False  # we closed it, or are closing it
        self.on_lost: Callable[[Connection], None] | None = None
        self.expires_at = 0.0  # loop time after which an idle connection is not reused

    # --- asyncio.Protocol ---

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses; they have its methods.
        self._transport = typing.cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if self._exchange is None or self._exchange.complete:
            # Bytes nobody asked for: the connection's state is unknown, so it is not reused.
            self.close()
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._exchange.fail(httpx.RemoteProtocolError("the server switched protocols"))
            self.close()
        except httptools.HttpParserError as exc:
            self._exchange.fail(httpx.RemoteProtocolError(f"malformed HTTP response: {exc}"))
            self.close()

    def eof_received(self) -> bool | None:
        return None  # close the transport; connection_lost reports it

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        exchange = self._exchange
        if exchange is not None and not exchange.complete:
            if exchange.head_done and self._until_close:
                exchange.complete = True  # a body delimited by the server's close
                exchange.wake()
            elif exchange.head_done:
                exchange.fail(
                    httpx.RemoteProtocolError(
                        "peer closed connection without sending complete message body"
                    )
                )
            else:
                exchange.fail(
                    httpx.RemoteProtocolError("Server disconnected without sending a response.")
                )
        if self._write_ready is not None and not self._write_ready.done():
            self._write_ready.set_result(None)
        if self.on_lost is not None:
            self.on_lost(self)

    def pause_writing(self) -> None:
        self._write_ready = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._write_ready is not None and not self._write_ready.done():
            self._write_ready.set_result(None)
        self._write_ready = None

    # --- httptools callbacks ---

    def on_message_begin(self) -> None:
        if self._exchange is not None and self._exchange.complete:
            # A second answer to one request: the stream is out of step, so retire it.
            self.close()

    def on_status(self, status: bytes) -> None:
        if self._exchange is not None:
            self._exchange.reason += status

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._exchange is not None:
            self._exchange.headers.append((name, value))

    def on_headers_complete(self) -> None:
        exchange = self._exchange
        if exchange is None:
            return
        status = self._parser.get_status_code()
        if 100 <= status < 200:
            # An interim answer (100 Continue, 103 Early Hints): the real one follows.
            exchange.headers.clear()
            exchange.reason = b""
            return
        exchange.status = status
        exchange.head_done = True
        if self._head_request:
            # llhttp cannot be told the request was HEAD and would wait for the body the headers
            # announce: the answer ends here, and the connection, its parser out of step, retires.
            exchange.complete = True
            exchange.wake()
            return
        framed = {name.lower() for name, _ in exchange.headers} & {
            b"content-length",
            b"transfer-encoding",
        }
        self._until_close = not framed and status not in (204, 304)
        exchange.wake()

    def on_body(self, body: bytes) -> None:
        if self._exchange is not None:
            self._exchange.body(body)

    def on_message_complete(self) -> None:
        exchange = self._exchange
        if exchange is None or not exchange.head_done:
            return  # the end of an interim answer
        exchange.complete = True
        exchange.keep_alive = self._parser.should_keep_alive()
        exchange.wake()

    # --- used by the pool ---

    def pause_reading(self) -> None:
        if self._transport is not None:
            self._transport.pause_reading()

    def resume_reading(self) -> None:
        if self._transport is not None and not self.lost:
            self._transport.resume_reading()

    @property
    def usable(self) -> bool:
        """Neither closed by the server nor retired by us."""
        return not (self.lost or self._retired)

    def reusable(self, exchange: Exchange) -> bool:
        """True when ``exchange`` ended cleanly and the connection may carry another."""
        return exchange.complete and exchange.keep_alive and self.usable

    def close(self) -> None:
        self._retired = True
        if self._transport is not None and not self.lost:
            self._transport.close()

    async def send(self, request: httpx.Request, *, write_timeout: float | None) -> Exchange:
        """Write ``request`` and return the exchange its response will arrive on."""
        if not self.usable or self._transport is None:
            raise httpx.WriteError("the connection is closed")
        self._exchange = exchange = Exchange(self)
        self._until_close = False
        self._head_request = request.method == "HEAD"
        url = request.url
        head = [request.method.encode("ascii"), b" ", url.raw_path, b" HTTP/1.1\r\n"]
        for name, value in request.headers.raw:
            head += (name, b": ", value, b"\r\n")
        head.append(b"\r\n")
        try:
            body: bytes | None = request.content
        except httpx.RequestNotRead:
            body = None
        if body is not None:
            self._write(b"".join(head) + body)
            await self._drain(write_timeout)
            return exchange
        self._write(b"".join(head))
        chunked = request.headers.get("transfer-encoding", "").lower() == "chunked"
        assert isinstance(request.stream, httpx.AsyncByteStream)
        async for chunk in request.stream:
            if chunk:
                self._write(b"%x\r\n%b\r\n" % (len(chunk), chunk) if chunked else chunk)
                await self._drain(write_timeout)
        if chunked:
            self._write(b"0\r\n\r\n")
        await self._drain(write_timeout)
        return exchange

    def _write(self, data: bytes) -> None:
        if self.lost or self._transport is None:
            raise httpx.WriteError("the server closed the connection while the request was sent")
        self._transport.write(data)

    async def _drain(self, timeout: float | None) -> None:
        if self._write_ready is not None:
            await wait_for(
                self._write_ready, timeout, lambda: httpx.WriteTimeout("timed out writing")
            )
