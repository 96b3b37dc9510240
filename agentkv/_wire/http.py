"""HTTP exchanges with the servers, and the mapping of httpx2's errors onto agentkv's tree.

Only this module catches ``httpx2`` exceptions; everything above it sees ``agentkv`` errors.
"""

from __future__ import annotations

import contextlib
import functools
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
from agentkv._wire.transport import ClusterClient, PostTransport, parsed_url

__all__ = ["exchange", "get_ok", "post_json", "raise_transport_error", "stream_events"]

_JSON_HEADERS = {"content-type": "application/json"}


@functools.lru_cache(maxsize=512)
def _template(
    url: str, client_headers: tuple[tuple[bytes, bytes], ...], names: tuple[str, ...]
) -> tuple[httpx2.URL, httpx2.Headers, tuple[tuple[str, str], ...]] | None:
    """The URL and the headers httpx2 builds for a JSON POST to ``url``, less Content-Length
    (also as the ``(name, value)`` pairs it sends); ``None`` if a header in ``names`` would
    replace one of them."""
    merged = httpx2.Headers(list(client_headers))
    merged.update(_JSON_HEADERS)  # as httpx2 merges them
    built = httpx2.Request("POST", url, headers=merged)
    del built.headers["Content-Length"]
    if any(name in built.headers for name in names):
        return None
    return built.url, built.headers, tuple(built.headers.multi_items())


def _cluster_template(
    client: httpx2.AsyncClient, url: str, headers: Mapping[str, str] | None
) -> tuple[httpx2.URL, httpx2.Headers, tuple[tuple[str, str], ...]] | None:
    """The per-URL template, for the cluster's own client (others build their own requests: a
    user's client may hold cookies, or a base URL, ...)."""
    if type(client) is not ClusterClient or client.cookies:
        return None
    return _template(url, tuple(client.headers.raw), tuple(headers) if headers else ())


def _request(
    client: httpx2.AsyncClient, url: str, body: bytes, headers: Mapping[str, str] | None
) -> httpx2.Request:
    """The request ``client.build_request`` builds, built from a per-URL template for the
    cluster's own client: httpx2 merges and normalizes every header on every request (~20 us),
    though a session sends the same ones to a handful of URLs. Others build their own (a user's
    client may hold cookies, or a base URL, ...)."""
    template = _cluster_template(client, url, headers)
    if template is None:
        return client.build_request(
            "POST", parsed_url(url), content=body, headers={**_JSON_HEADERS, **(headers or {})}
        )
    parsed, template_headers, _ = template
    # Copying an ``httpx2.Headers`` skips the normalizing; the template is never changed.
    request = httpx2.Request(
        "POST",
        parsed,
        headers=template_headers,
        stream=httpx2.ByteStream(body),
        extensions={"timeout": client.timeout.as_dict()},
    )
    for name, value in (headers or {}).items():
        request.headers[name] = value
    request.headers["Content-Length"] = str(len(body))
    request.read()  # ``request.content`` readable, as for a request built with ``content=``
    return request


def raise_transport_error(exc: httpx2.HTTPError, url: str) -> NoReturn:
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


def _raise_status(response: httpx2.Response, url: str, summary: str) -> NoReturn:
    status = response.status_code
    body = response.text
    cls: type[UpstreamStatusError]
    if 400 <= status < 500:
        cls = BadRequestError
    elif status >= 500:
        cls = ServerError
    else:
        cls = UpstreamStatusError
    raise cls(
        f"{summary} failed",
        status_code=status,
        url=url,
        request_summary=summary,
        response_body=body,
        request=response.request,
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
    client: httpx2.AsyncClient,
    url: str,
    body: bytes,
    *,
    summary: str,
    headers: Mapping[str, str] | None = None,
    unread: str | None = None,
) -> Any:
    """POST a JSON body and return the parsed JSON answer.

    ``unread``: a key whose list of integers the answer echoes and nobody reads; it is parsed as
    ``null`` (``loads_without``).

    The cluster's own client on a ``PostTransport`` (its default one, the fakes') posts through
    its ``post`` (the same request, no httpx2 request or response built unless the answer is an
    error status or compressed); any other client or transport, through httpx2's ``send``.
    """
    try:
        direct = _direct(client, url, headers, len(body))
        if direct is not None:
            poster, sent = direct
            status, raw_headers, content = await poster.post(
                url, body, sent, client.timeout.as_dict()
            )
            if status < 300 and not _encoded(raw_headers):
                return _parse(content, url, summary, unread)
            # An error, or a body to decode as its headers say: httpx2's response, as sent.
            response = httpx2.Response(
                status,
                headers=raw_headers,
                content=content,
                request=_request(client, url, body, headers),
            )
        else:
            response = await client.send(_request(client, url, body, headers))
    except httpx2.HTTPError as exc:
        raise_transport_error(exc, url)
    if response.status_code >= 300:
        _raise_status(response, url, summary)
    return _parse(response.content, url, summary, unread)


def _direct(
    client: httpx2.AsyncClient, url: str, headers: Mapping[str, str] | None, length: int
) -> tuple[PostTransport, list[tuple[str, str]]] | None:
    """The transport whose own ``post``/``post_stream`` takes this request, and the headers
    httpx2 would send with a body of ``length`` bytes (``_request``'s); ``None`` where httpx2's
    path takes it (another client, a transport that is no ``PostTransport``, an ``https`` URL, a
    header that replaces one of the template's)."""
    poster = client.poster if type(client) is ClusterClient else None
    if poster is None or not url.startswith("http://"):
        return None
    template = _cluster_template(client, url, headers)
    if template is None:
        return None
    if client.is_closed:
        raise RuntimeError("Cannot send a request, as the client has been closed.")
    sent = [
        *template[2],
        *((name.lower(), value) for name, value in (headers or {}).items()),
        ("content-length", str(length)),
    ]
    return poster, sent


def _encoded(raw_headers: list[tuple[bytes, bytes]]) -> bool:
    """Whether the body came compressed (``content-encoding`` other than identity)."""
    return any(
        name.lower() == b"content-encoding" and value.strip().lower() != b"identity"
        for name, value in raw_headers
    )


async def stream_events(
    client: httpx2.AsyncClient,
    url: str,
    body: bytes,
    *,
    summary: str,
    headers: Mapping[str, str] | None = None,
    unread: str | None = None,
) -> AsyncGenerator[Any, None]:
    """POST a JSON body and yield each server-sent event's parsed ``data`` until ``[DONE]``.

    ``unread`` as for ``post_json``, in each event.

    Closing the iterator early closes the connection (vLLM then aborts the request).
    """
    try:
        async with _event_lines(client, url, body, headers, summary) as lines:
            async for line in lines:
                if not line.startswith(b"data:"):
                    continue  # blank separators, comments, "event:" lines
                data = line[5:].strip()
                if data == b"[DONE]":
                    return
                yield _parse(data, url, summary, unread)
    except httpx2.HTTPError as exc:
        raise_transport_error(exc, url)
    raise MalformedResponseError(f"{summary}: the stream ended before [DONE]", url=url)


@contextlib.asynccontextmanager
async def _event_lines(
    client: httpx2.AsyncClient,
    url: str,
    body: bytes,
    headers: Mapping[str, str] | None,
    summary: str,
) -> AsyncIterator[AsyncIterator[bytes]]:
    """The lines of a stream's answer as they arrive, once its status says it has events (an
    error status raises with the answer's body); the answer is closed on leaving.

    The cluster's own client on a ``PostTransport`` splits the body's pieces itself
    (``_lines``); an error status, a compressed body and any other client go through httpx2's
    response, which decodes the body as its headers say."""
    direct = _direct(client, url, headers, len(body))
    if direct is None:
        response = await client.send(_request(client, url, body, headers), stream=True)
    else:
        poster, sent = direct
        status, raw_headers, stream = await poster.post_stream(
            url, body, sent, client.timeout.as_dict()
        )
        if status < 300 and not _encoded(raw_headers):
            async with contextlib.aclosing(stream), contextlib.aclosing(_lines(stream)) as lines:
                yield lines
            return
        response = httpx2.Response(
            status, headers=raw_headers, stream=stream, request=_request(client, url, body, headers)
        )
    async with contextlib.aclosing(response):
        if response.status_code >= 300:
            await response.aread()
            _raise_status(response, url, summary)
        async with contextlib.aclosing(
            line.encode() async for line in response.aiter_lines()
        ) as lines:
            yield lines


async def _lines(pieces: AsyncIterable[bytes]) -> AsyncGenerator[bytes, None]:
    """The lines of a body as its pieces arrive, without their ends (``\\n``, ``\\r\\n`` or
    ``\\r``: server-sent events may end lines with any; httpx2's ``aiter_lines`` splits the same
    way), a line cut between two pieces joined."""
    rest = b""
    async for piece in pieces:
        lines = (rest + piece).splitlines(keepends=True)
        # The last line may go on in the next piece (its "\r" may be the first half of "\r\n").
        rest = lines.pop() if lines and not lines[-1].endswith(b"\n") else b""
        for line in lines:
            yield line.rstrip(b"\r\n")
    if rest:
        yield rest.rstrip(b"\r\n")


async def get_ok(client: httpx2.AsyncClient, url: str, *, timeout_s: float) -> bool:
    """True when ``GET url`` answers 200 within ``timeout_s``; never raises for transport errors."""
    try:
        response = await client.get(url, timeout=timeout_s)
    except httpx2.HTTPError:
        return False
    return response.status_code == 200


async def exchange(
    client: httpx2.AsyncClient,
    method: str,
    url: str,
    *,
    body: bytes | None = None,
    timeout_s: float,
) -> tuple[int, Any]:
    """One small control request: ``(status, parsed JSON answer or None)``, whatever the status.

    For calls whose error statuses are answers (agentkv's lease routes); transport errors raise
    agentkv's ``TransportError`` subclasses.
    """
    try:
        response = await client.request(
            method,
            parsed_url(url),
            content=body,
            headers=_JSON_HEADERS if body is not None else None,
            timeout=timeout_s,
        )
    except httpx2.HTTPError as exc:
        raise_transport_error(exc, url)
    try:
        data = loads(response.content) if response.content else None
    except JSONDecodeError:
        data = None
    return response.status_code, data
