"""How agentkv talks HTTP: the ``Poster`` interface, and its default on aiohttp's public client.

Every request agentkv sends its servers is a JSON POST (a turn's tokenize, P leg and D leg,
decode's lease routes), answered whole or streamed, or a small GET (health, info, metrics).
``Poster`` is that and nothing more, raising agentkv's own errors (``TransportError``'s
subclasses, ``ConfigError`` for a URL it cannot send to), mapped once from its library's:

* ``ServerPools`` (here): the default, one ``aiohttp.ClientSession`` with a limit per server;
* ``HttpxPoster`` (``_wire.http``): a user's ``httpx2.AsyncClient`` (``http_client=``);
* ``agentkv.testing.FakeTransport``: the fake cluster, so a session on it runs this code path.

Why aiohttp: httpcore's pool (httpx2's default) asks every idle connection whether it was closed
on each request start and close, under anyio's locks, with the pure-Python h11 parser: ~6 ms of
CPU per request at 64 concurrent sessions on 2 cores (``docs/proxy.md``). aiohttp's connection is
an asyncio protocol (the loop reports a close), llhttp parses in C, and idle connections are kept
per (host, port) (``benchmarks/transport_cpu.py``, ``docs/benchmarks.md``).

``httpx2.Limits``' ``max_connections`` applies per server (a place is held from the request's
start until its body is read or closed), idle connections close after ``keepalive_expiry``.
``httpx2.Timeout``'s ``pool`` bounds the wait for a place, ``connect`` the connect (with DNS:
``connect`` + ``pool``), ``read`` each wait for bytes, ``write`` each piece of a large body.
A server that closes the connection before answering in full is a lost connection, never a
connect error (a live server must not be marked down for it); a POST is never re-sent. Bodies
stream as they arrive; closing one before its end closes its connection. HTTP(S)_PROXY is not
read (the servers are the cluster's own): pass ``http_client=`` for that.
"""

from __future__ import annotations

import asyncio
import functools
import typing
from collections.abc import AsyncIterator, Mapping
from typing import NamedTuple
from urllib.parse import urlsplit

import aiohttp
import httpx2

from agentkv._exceptions import (
    ConfigError,
    ConnectError,
    ConnectionLostError,
    RequestTimeoutError,
    TransportError,
)

__all__ = [
    "Answer",
    "Body",
    "Poster",
    "ServerPools",
    "Streamed",
    "is_poster",
    "json_headers",
]

_JSON_HEADERS: Mapping[str, str] = {"Content-Type": "application/json"}
# A body above this is sent in pieces of it, each write bounded by the write timeout (a small
# one fits the socket's buffer at once; aiohttp also warns on a bytes body above 1 MiB).
_PIECE = 1 << 18


class Answer(NamedTuple):
    """An answer read whole."""

    status: int
    headers: list[tuple[bytes, bytes]]
    """As sent (``content-encoding`` says how the server compressed ``body``)."""
    body: bytes
    """Decoded: never compressed."""


class Body(typing.Protocol):
    """A body as it arrives, piece by piece; ``aclose`` before its end closes the connection."""

    def __aiter__(self) -> AsyncIterator[bytes]: ...

    async def aclose(self) -> None: ...


class Streamed(NamedTuple):
    """An answer whose body arrives as it comes; whoever takes it closes ``body``."""

    status: int
    headers: list[tuple[bytes, bytes]]
    body: Body


@typing.runtime_checkable
class Poster(typing.Protocol):
    """What agentkv sends its servers: a JSON body POSTed (answered whole or as it arrives), or a
    GET. ``headers`` are added to the request's own (``Content-Type: application/json`` on a
    POST); ``timeout_s`` bounds each phase of this request (``None``: the poster's own timeouts).
    Failures raise agentkv's ``TransportError`` subclasses; every status is an answer."""

    async def post(
        self,
        url: str,
        body: bytes,
        *,
        headers: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> Answer: ...

    async def post_stream(
        self, url: str, body: bytes, *, headers: Mapping[str, str] | None = None
    ) -> Streamed:
        """The answer once its head is in; its body as it arrives."""
        ...

    async def get(self, url: str, *, timeout_s: float | None = None) -> Answer: ...

    async def aclose(self) -> None: ...


def json_headers(headers: Mapping[str, str] | None) -> Mapping[str, str]:
    """A JSON POST's headers: ``Content-Type: application/json`` unless ``headers`` name their
    own, and ``headers``."""
    if not headers:
        return _JSON_HEADERS
    sent = dict(_JSON_HEADERS)
    for name, value in headers.items():
        if name.lower() == "content-type":
            del sent["Content-Type"]
        sent[name] = value
    return sent


def is_poster(transport: object) -> bool:
    """Whether ``transport`` is a ``Poster`` by its class: a wrapper that forwards unknown
    attributes (``__getattr__``) to one is not, so its own methods see every request."""
    return all(
        callable(getattr(type(transport), name, None))
        for name in ("post", "post_stream", "get", "aclose")
    )


def _error(exc: BaseException, url: str) -> TransportError | ConfigError:
    """agentkv's error for an aiohttp (or socket) one, the more specific kinds first."""
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return ConnectError(f"cannot connect to {url}: timed out connecting", url=url)
    if isinstance(exc, aiohttp.SocketTimeoutError):
        return RequestTimeoutError(f"no answer from {url} in time: timed out reading", url=url)
    if isinstance(exc, aiohttp.ClientConnectorError):  # refused, DNS, ...
        return ConnectError(f"cannot connect to {url}: {exc}", url=url)
    if isinstance(exc, aiohttp.InvalidURL):
        return ConfigError(f"bad server URL {url!r}: {exc}")
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        detail = "Server disconnected without sending a response."
    elif isinstance(exc, aiohttp.ClientPayloadError):
        detail = f"incomplete message body: {exc}"
    elif isinstance(exc, aiohttp.ClientResponseError):  # an answer aiohttp cannot parse
        detail = f"malformed HTTP response: {exc!r}"
    elif isinstance(exc, aiohttp.ClientConnectionError | OSError):  # reset, close mid-request
        detail = f"the connection broke: {exc!r}"
    else:
        return TransportError(f"request to {url} failed: {exc!r}", url=url)
    return ConnectionLostError(f"connection to {url} broke: {detail}", url=url)


_AIOHTTP_ERRORS = (aiohttp.ClientError, OSError)


@functools.lru_cache(maxsize=512)
def _server(url: str) -> tuple[str, int]:
    """``url``'s (host, port), parsed once per URL (a session talks to a handful)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise ConfigError(f"bad server URL {url!r}: the scheme must be http or https")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError as exc:
        raise ConfigError(f"bad server URL {url!r}: {exc}") from None
    return parts.hostname or "", port


@functools.lru_cache(maxsize=64)
def _timeout(
    connect: float | None, read: float | None, pool: float | None
) -> aiohttp.ClientTimeout:
    return aiohttp.ClientTimeout(
        total=None,
        # Bounds DNS and connect together; the connect alone is sock_connect (the wait for a
        # place is ServerPools', before aiohttp sees the request).
        connect=None if connect is None or pool is None else connect + pool,
        sock_connect=connect,
        sock_read=read,
    )


async def _pieces(
    body: bytes, deadline: asyncio.Timeout, write_s: float | None
) -> AsyncIterator[bytes]:
    """``body`` in pieces, each one's write (until aiohttp asks for the next) within
    ``write_s``: aiohttp has no write timeout of its own."""
    loop = asyncio.get_running_loop()
    view = memoryview(body)
    for start in range(0, len(view), _PIECE):
        if write_s is not None:
            deadline.reschedule(loop.time() + write_s)
        yield bytes(view[start : start + _PIECE])
        deadline.reschedule(None)


class _Place:
    """A request's place under its server's limit, given back once."""

    __slots__ = ("_limit",)

    def __init__(self, limit: asyncio.Semaphore | None) -> None:
        self._limit = limit

    def release(self) -> None:
        limit, self._limit = self._limit, None
        if limit is not None:
            limit.release()


class _Body:
    """An aiohttp body as it arrives. Its own iterator, not an async generator: one left
    unfinished (a stream closed at [DONE]) would be closed by a task of asyncio's."""

    def __init__(self, response: aiohttp.ClientResponse, place: _Place, url: str) -> None:
        self._response = response
        self._place = place
        self._url = url

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self

    async def __anext__(self) -> bytes:
        try:
            chunk = await self._response.content.readany()
        except _AIOHTTP_ERRORS as exc:
            raise _error(exc, self._url) from exc
        if not chunk:
            raise StopAsyncIteration
        return chunk

    async def aclose(self) -> None:
        response = self._response
        if response.content.is_eof():
            response.release()
        else:
            response.close()  # the rest of the body is still on the wire
        self._place.release()


class ServerPools:
    """The default ``Poster``: one ``aiohttp.ClientSession``; ``limits`` apply to each server."""

    def __init__(self, limits: httpx2.Limits, timeout: httpx2.Timeout | float) -> None:
        self._limits = limits
        phases = httpx2.Timeout(timeout)
        self._phases = (phases.connect, phases.read, phases.write, phases.pool)
        self._session: aiohttp.ClientSession | None = None
        self._places: dict[tuple[str, int], asyncio.Semaphore] = {}
        self._closed = False

    def _open(self) -> aiohttp.ClientSession:
        # aiohttp binds the session to the running loop: made at the first request.
        connector = aiohttp.TCPConnector(
            limit=0,  # the limit is per server, and ServerPools' own (its pool timeout)
            keepalive_timeout=self._limits.keepalive_expiry or 0.0,
        )
        self._session = aiohttp.ClientSession(
            connector=connector,
            cookie_jar=aiohttp.DummyCookieJar(),
            timeout=aiohttp.ClientTimeout(total=None),
        )
        return self._session

    async def _place(self, server: tuple[str, int], pool: float | None, url: str) -> _Place:
        """Wait, at most ``pool`` s, for a place under ``server``'s limit."""
        limit = self._places.get(server)
        if limit is None:
            if self._limits.max_connections is None:
                return _Place(None)
            limit = self._places[server] = asyncio.Semaphore(self._limits.max_connections)
        if limit.locked():
            try:
                async with asyncio.timeout(pool):
                    await limit.acquire()
            except TimeoutError:
                raise RequestTimeoutError(
                    f"no answer from {url} in time: timed out waiting for a connection", url=url
                ) from None
        else:
            await limit.acquire()  # a free place: taken at once
        return _Place(limit)

    async def _send(
        self,
        method: str,
        url: str,
        body: bytes | None,
        headers: Mapping[str, str] | None,
        timeout_s: float | None,
    ) -> tuple[aiohttp.ClientResponse, _Place]:
        """Send a request under its server's limit: the answer's head, and the place it holds."""
        if self._closed:
            raise RuntimeError("Cannot send a request, as the cluster's HTTP client is closed.")
        if timeout_s is None:
            connect, read, write, pool = self._phases
        else:
            connect = read = write = pool = timeout_s
        place = await self._place(_server(url), pool, url)
        session = self._session or self._open()
        deadline = asyncio.timeout(None)
        data: bytes | AsyncIterator[bytes] | None = body
        if body is not None and len(body) > _PIECE:
            data = _pieces(body, deadline, write)
        try:
            async with deadline:
                response = await session.request(
                    method,
                    url,
                    data=data,
                    headers=headers,
                    allow_redirects=False,
                    compress=None,
                    timeout=_timeout(connect, read, pool),
                )
        except BaseException as exc:
            place.release()
            if deadline.expired():  # (TimeoutError is an OSError)
                raise RequestTimeoutError(f"timed out writing to {url}", url=url) from None
            if isinstance(exc, _AIOHTTP_ERRORS):
                raise _error(exc, url) from exc
            raise
        if response.status == 101:
            response.close()
            place.release()
            raise ConnectionLostError(f"{url}: the server switched protocols", url=url)
        return response, place

    async def _read(
        self,
        method: str,
        url: str,
        body: bytes | None,
        headers: Mapping[str, str] | None,
        timeout_s: float | None,
    ) -> Answer:
        response, place = await self._send(method, url, body, headers, timeout_s)
        try:
            content = await response.read()
        except BaseException as exc:
            response.close()  # the rest of the body is still on the wire (or cancelled)
            if isinstance(exc, _AIOHTTP_ERRORS):
                raise _error(exc, url) from exc
            raise
        finally:
            place.release()
        response.release()
        return Answer(response.status, list(response.raw_headers), content)

    async def post(
        self,
        url: str,
        body: bytes,
        *,
        headers: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> Answer:
        return await self._read("POST", url, body, json_headers(headers), timeout_s)

    async def post_stream(
        self, url: str, body: bytes, *, headers: Mapping[str, str] | None = None
    ) -> Streamed:
        response, place = await self._send("POST", url, body, json_headers(headers), None)
        return Streamed(response.status, list(response.raw_headers), _Body(response, place, url))

    async def get(self, url: str, *, timeout_s: float | None = None) -> Answer:
        return await self._read("GET", url, None, None, timeout_s)

    async def aclose(self) -> None:
        self._closed = True
        session, self._session = self._session, None
        if session is not None:
            await session.close()
