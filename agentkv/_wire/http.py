"""JSON over a ``Poster``: one POST's parsed answer, a stream's events, the small control calls;
and ``HttpxPoster``, a user's ``httpx2.AsyncClient`` as a ``Poster``.

Only ``HttpxPoster`` catches ``httpx2`` exceptions (``raise_transport_error``); everything above
a ``Poster`` sees agentkv's errors.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator, Mapping
from typing import Any, NoReturn

import httpx2

from agentkv._exceptions import (
    BadRequestError,
    ConfigError,
    ConnectError,
    ConnectionLostError,
    MalformedResponseError,
    RequestTimeoutError,
    ServerError,
    TransportError,
    UpstreamStatusError,
)
from agentkv._wire.json import JSONDecodeError, loads, loads_without
from agentkv._wire.transport import (
    Answer,
    Poster,
    ServerPools,
    Streamed,
    is_poster,
    json_headers,
)

__all__ = [
    "HttpxPoster",
    "exchange",
    "get_ok",
    "make_poster",
    "post_json",
    "raise_transport_error",
    "stream_events",
]

_JSON_HEADERS = {"Content-Type": "application/json"}


def raise_transport_error(exc: Exception, url: str) -> NoReturn:
    """Re-raise an httpx2 error as the matching agentkv error."""
    if isinstance(exc, httpx2.ConnectError | httpx2.ConnectTimeout):
        raise ConnectError(f"cannot connect to {url}: {exc}", url=url) from exc
    if isinstance(exc, httpx2.TimeoutException):
        raise RequestTimeoutError(f"no answer from {url} in time: {exc!r}", url=url) from exc
    if isinstance(exc, httpx2.UnsupportedProtocol | httpx2.InvalidURL):
        raise ConfigError(f"bad server URL {url!r}: {exc}") from exc
    if isinstance(exc, httpx2.TransportError):
        raise ConnectionLostError(f"connection to {url} broke: {exc!r}", url=url) from exc
    raise TransportError(f"request to {url} failed: {exc!r}", url=url) from exc


_HTTPX_ERRORS = (httpx2.HTTPError, httpx2.InvalidURL)


class _HttpxBody:
    """An httpx2 response's body as it arrives (decoded), its errors agentkv's."""

    def __init__(self, response: httpx2.Response, url: str) -> None:
        self._response = response
        self._pieces = response.aiter_bytes()
        self._url = url

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self

    async def __anext__(self) -> bytes:
        try:
            return await anext(self._pieces)
        except _HTTPX_ERRORS as exc:
            raise_transport_error(exc, self._url)

    async def aclose(self) -> None:
        await self._pieces.aclose()
        await self._response.aclose()


class HttpxPoster:
    """A ``Poster`` on an ``httpx2.AsyncClient`` (its auth, proxies, hooks, base URL and
    timeouts apply), through its public API; closes the client only when ``owned``."""

    def __init__(self, client: httpx2.AsyncClient, *, owned: bool = False) -> None:
        self.client = client
        self._owned = owned

    async def _send(
        self,
        method: str,
        url: str,
        body: bytes | None,
        headers: Mapping[str, str] | None,
        timeout_s: float | None,
    ) -> httpx2.Response:
        """The answer once its head is in."""
        timeout = httpx2.USE_CLIENT_DEFAULT if timeout_s is None else timeout_s
        try:
            request = self.client.build_request(
                method, url, content=body, headers=headers, timeout=timeout
            )
            return await self.client.send(request, stream=True)
        except _HTTPX_ERRORS as exc:
            raise_transport_error(exc, url)

    async def _read(self, response: httpx2.Response, url: str) -> Answer:
        try:
            content = await response.aread()
        except _HTTPX_ERRORS as exc:
            raise_transport_error(exc, url)
        finally:
            await response.aclose()
        return Answer(response.status_code, response.headers.raw, content)

    async def post(
        self,
        url: str,
        body: bytes,
        *,
        headers: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> Answer:
        response = await self._send("POST", url, body, json_headers(headers), timeout_s)
        return await self._read(response, url)

    async def post_stream(
        self, url: str, body: bytes, *, headers: Mapping[str, str] | None = None
    ) -> Streamed:
        response = await self._send("POST", url, body, json_headers(headers), None)
        return Streamed(response.status_code, response.headers.raw, _HttpxBody(response, url))

    async def get(self, url: str, *, timeout_s: float | None = None) -> Answer:
        return await self._read(await self._send("GET", url, None, None, timeout_s), url)

    async def aclose(self) -> None:
        if self._owned:
            await self.client.aclose()


def make_poster(
    *,
    transport: httpx2.AsyncBaseTransport | Poster | None,
    http_client: httpx2.AsyncClient | None,
    limits: httpx2.Limits,
    timeout: httpx2.Timeout | float,
) -> Poster:
    """The ``Poster`` a cluster sends with: ``http_client``'s (never closed by it), a
    ``transport`` that is one (the fakes'), an httpx2 ``transport`` in a client of its own, or
    the default (``ServerPools``)."""
    if http_client is not None:
        return HttpxPoster(http_client)
    if transport is None:
        return ServerPools(limits, timeout)
    if is_poster(transport):
        return transport  # type: ignore[return-value]  # checked by its class
    assert isinstance(transport, httpx2.AsyncBaseTransport)
    client = httpx2.AsyncClient(transport=transport, timeout=timeout, trust_env=False)
    return HttpxPoster(client, owned=True)


def _raise_status(
    answer: Answer, url: str, summary: str, sent: bytes, method: str = "POST"
) -> NoReturn:
    """The status error for ``answer``, carrying httpx2's request and response (as
    openai-python's do) built from it: an error's path, not a turn's."""
    status = answer.status
    cls: type[UpstreamStatusError]
    if 400 <= status < 500:
        cls = BadRequestError
    elif status >= 500:
        cls = ServerError
    else:
        cls = UpstreamStatusError
    # ``answer.body`` is decoded already: its content-encoding would decode it again.
    headers = [(k, v) for k, v in answer.headers if k.lower() != b"content-encoding"]
    request = httpx2.Request(method, url, headers=_JSON_HEADERS, content=sent)
    response = httpx2.Response(status, headers=headers, content=answer.body, request=request)
    raise cls(
        f"{summary} failed",
        status_code=status,
        url=url,
        request_summary=summary,
        response_body=response.text,
        request=request,
        response=response,
    )


def _parse(content: bytes, url: str, summary: str, unread: str | None = None) -> Any:
    try:
        return loads(content) if unread is None else loads_without(content, unread)
    except JSONDecodeError as exc:
        raise MalformedResponseError(
            f"{summary}: the answer is not JSON", url=url, detail=f"{exc}; starts {content[:80]!r}"
        ) from exc


async def post_json(
    poster: Poster,
    url: str,
    body: bytes,
    *,
    summary: str,
    headers: Mapping[str, str] | None = None,
    unread: str | None = None,
) -> Any:
    """POST a JSON body and return the parsed JSON answer (an error status raises).

    ``unread``: a key whose list of integers the answer echoes and nobody reads; it is parsed as
    ``null`` (``loads_without``).
    """
    status, raw_headers, content = await poster.post(url, body, headers=headers)
    if status >= 300:
        _raise_status(Answer(status, raw_headers, content), url, summary, body)
    return _parse(content, url, summary, unread)


async def stream_events(
    poster: Poster,
    url: str,
    body: bytes,
    *,
    summary: str,
    headers: Mapping[str, str] | None = None,
    unread: str | None = None,
) -> AsyncGenerator[Any, None]:
    """POST a JSON body and yield each server-sent event's parsed ``data`` until ``[DONE]``.

    ``unread`` as for ``post_json``, in each event. Closing the iterator early closes the
    connection (vLLM then aborts the request).
    """
    status, raw_headers, pieces = await poster.post_stream(url, body, headers=headers)
    async with contextlib.aclosing(pieces):
        if status >= 300:
            content = b"".join([piece async for piece in pieces])
            _raise_status(Answer(status, raw_headers, content), url, summary, body)
        async with contextlib.aclosing(_lines(pieces)) as lines:
            async for line in lines:
                if not line.startswith(b"data:"):
                    continue  # blank separators, comments, "event:" lines
                data = line[5:].strip()
                if data == b"[DONE]":
                    return
                yield _parse(data, url, summary, unread)
    raise MalformedResponseError(f"{summary}: the stream ended before [DONE]", url=url)


async def _lines(pieces: AsyncIterable[bytes]) -> AsyncGenerator[bytes, None]:
    """The lines of a body as its pieces arrive, without their ends (``\\n``, ``\\r\\n`` or
    ``\\r``: server-sent events may end lines with any), a line cut between two pieces joined."""
    rest = b""
    async for piece in pieces:
        lines = (rest + piece).splitlines(keepends=True)
        # The last line may go on in the next piece (its "\r" may be the first half of "\r\n").
        rest = lines.pop() if lines and not lines[-1].endswith(b"\n") else b""
        for line in lines:
            yield line.rstrip(b"\r\n")
    if rest:
        yield rest.rstrip(b"\r\n")


async def get_ok(poster: Poster, url: str, *, timeout_s: float) -> bool:
    """True when ``GET url`` answers 200 within ``timeout_s``; never raises for transport errors."""
    try:
        answer = await poster.get(url, timeout_s=timeout_s)
    except (TransportError, ConfigError):
        return False
    return answer.status == 200


async def exchange(
    poster: Poster,
    method: str,
    url: str,
    *,
    body: bytes | None = None,
    timeout_s: float,
) -> tuple[int, Any]:
    """One small control request (``GET``, or ``POST`` of ``body``): ``(status, parsed JSON
    answer or None)``, whatever the status. For calls whose error statuses are answers
    (agentkv's lease routes); transport errors raise agentkv's ``TransportError`` subclasses.
    """
    if method == "GET":
        answer = await poster.get(url, timeout_s=timeout_s)
    else:
        answer = await poster.post(url, body or b"", timeout_s=timeout_s)
    try:
        data = loads(answer.body) if answer.body else None
    except JSONDecodeError:
        data = None
    return answer.status, data
