"""Slow and vanishing clients over real HTTP: the proxy on uvicorn (``ProxyServer``) in front of the
fake pair, and raw sockets that send headers and part of a body, then stall, trickle or leave.

A stalled upload gets 408 within the body deadline and its connection is closed; a slow but
steady one is served; one that leaves mid-body is a 499 logged at info, never a 500; past
``max_connections`` uvicorn answers 503, and the proxy serves normally once the stalls are cut;
a connection stalled before its headers end is closed at the header deadline, and one kept alive
between requests is not.
"""

from __future__ import annotations

import json
import logging
import select
import socket
import time
from collections.abc import Iterator

import httpx2
import pytest
from structlog.testing import capture_logs

import agentkv
from agentkv import AsyncCluster, Cluster
from agentkv.proxy import ProxyConfig, ProxyServer
from agentkv.testing import FakeCluster

TIMEOUT_S = 0.5
HEADER_TIMEOUT_S = 0.5
RATE = 20_000  # bytes/s
CHAT = "/v1/chat/completions"


pytestmark = pytest.mark.fake(pairs=1)


def _server(fake: FakeCluster, *, max_connections: int | None = None) -> ProxyServer:
    def make() -> AsyncCluster:
        return AsyncCluster.from_dict(fake.cluster_spec, transport=fake.transport)

    config = ProxyConfig(
        port=0,
        body_timeout_s=TIMEOUT_S,
        body_min_rate=RATE,
        header_timeout_s=HEADER_TIMEOUT_S,
        max_connections=max_connections,
    )
    return ProxyServer(make, config)


@pytest.fixture
def server(fake: FakeCluster) -> Iterator[ProxyServer]:
    with _server(fake) as server:
        yield server


def _chat_body(fake: FakeCluster, *, padding: int = 0) -> bytes:
    body = {"model": fake.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    # JSON allows whitespace after the value: a body as large as wanted, still valid.
    return json.dumps(body).encode() + b" " * padding


def _head(server: ProxyServer, length: int, *, key: str = "sk-slow") -> bytes:
    return (
        f"POST {CHAT} HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n"
        f"Authorization: Bearer {key}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\n\r\n"
    ).encode()


def _stalled(
    server: ProxyServer, *, declared: int = 1_000_000, sent: int = 10_000
) -> socket.socket:
    """A connection that sent its headers and ``sent`` bytes of a ``declared``-byte body."""
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(_head(server, declared) + b" " * sent)
    return sock


def _answer(sock: socket.socket, *, within_s: float) -> tuple[int, dict[str, str], bytes]:
    """The response read to the server's close: status, headers, body. Fails if it never closes."""
    sock.settimeout(within_s)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *lines = head.decode().split("\r\n")
    headers = {name.lower(): value for name, _, value in (h.partition(": ") for h in lines)}
    return int(status_line.split()[1]), headers, body


def _requests(server: ProxyServer, code: str) -> float:
    assert server.app is not None
    metrics = server.app.state.metrics
    total = "agentkv_proxy_requests_total"
    return float(server.call(lambda: metrics.value(total, endpoint="chat", code=code)))


def _eventually(check: object, *, within_s: float = 5.0) -> None:
    assert callable(check)
    deadline = time.monotonic() + within_s
    while not check():
        assert time.monotonic() < deadline, "not within the time allowed"
        time.sleep(0.01)


def test_an_upload_stalled_mid_body_gets_408_within_the_deadline_and_is_disconnected(server):
    started = time.monotonic()
    with _stalled(server) as sock:
        status, headers, body = _answer(sock, within_s=TIMEOUT_S + 5)
    waited = time.monotonic() - started
    assert status == 408
    assert headers["connection"] == "close"
    error = json.loads(body)["error"]
    assert (error["code"], error["type"]) == ("body_timeout", "invalid_request_error")
    assert "10000 bytes" in error["message"]
    # Its 10 kB earned half a second at 20 kB/s: cut by the gap rule, at TIMEOUT_S.
    assert TIMEOUT_S * 0.9 <= waited < TIMEOUT_S + 1.0
    _eventually(lambda: server.open_connections() == 0)
    assert _requests(server, "408") == 1


def test_a_trickle_that_never_pauses_long_is_cut_once_behind_the_minimum_rate(server):
    started = time.monotonic()
    answer = b""
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(_head(server, 100_000))
        # A byte every 50 ms: no gap near TIMEOUT_S, but 20 bytes/s against RATE.
        while not answer and time.monotonic() - started < TIMEOUT_S + 5:
            if select.select([sock], [], [], 0.05)[0]:
                answer = sock.recv(65536)
            else:
                sock.sendall(b" ")
    assert answer.startswith(b"HTTP/1.1 408 "), answer
    assert time.monotonic() - started < TIMEOUT_S + 1.0


def test_a_slow_but_steady_upload_is_served(server, fake):
    body = _chat_body(fake, padding=60_000)
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(_head(server, len(body)))
        # 2 kB every 50 ms (40 kB/s, twice RATE): three times TIMEOUT_S in all, never cut.
        for offset in range(0, len(body), 2000):
            sock.sendall(body[offset : offset + 2000])
            time.sleep(0.05)
        assert time.monotonic() - started > 3 * TIMEOUT_S
        sock.shutdown(socket.SHUT_WR)
        status, _, answer = _answer(sock, within_s=10)
    assert status == 200, answer
    assert json.loads(answer)["choices"][0]["message"]["role"] == "assistant"


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_a_client_that_leaves_mid_body_is_a_499_logged_at_info_not_a_500(server):
    uvicorn_errors = _Records()
    logging.getLogger("uvicorn.error").addHandler(uvicorn_errors)
    try:
        with capture_logs() as logs:
            with _stalled(server):
                time.sleep(0.05)  # the app is reading its body
            _eventually(lambda: _requests(server, "499") == 1)
    finally:
        logging.getLogger("uvicorn.error").removeHandler(uvicorn_errors)
    left = [e for e in logs if e["event"] == "agentkv.proxy.client_disconnected"]
    assert left == [
        {"event": "agentkv.proxy.client_disconnected", "endpoint": "chat", "status": 499,
         "log_level": "info"}
    ]  # fmt: skip
    assert [e for e in logs if e["log_level"] in ("error", "critical", "exception")] == []
    assert _requests(server, "500") == 0
    # uvicorn logs an app's exception through logging: nothing reached it.
    assert [r for r in uvicorn_errors.records if r.levelno >= logging.ERROR] == []
    assert server.open_connections() == 0


def test_past_max_connections_requests_get_503_and_clients_are_served_once_stalls_are_cut(fake):
    with _server(fake, max_connections=3) as server:
        stalled = [_stalled(server) for _ in range(2)]
        _eventually(lambda: server.open_connections() == 2)
        # The third connection, its own included, reaches the limit.
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(_head(server, 10) + b"{}        ")
            status, _, body = _answer(sock, within_s=5)
        assert (status, body) == (503, b"Service Unavailable")
        for sock in stalled:
            assert _answer(sock, within_s=TIMEOUT_S + 5)[0] == 408
            sock.close()
        _eventually(lambda: server.open_connections() == 0)
        answer = httpx2.post(
            f"{server.url}{CHAT}",
            content=_chat_body(fake),
            headers={"Authorization": "Bearer sk-ok", "Content-Type": "application/json"},
        )
        assert answer.status_code == 200


def test_many_stalled_uploads_let_go_of_their_connections_and_others_are_served_meanwhile(
    server, fake
):
    stalled = [_stalled(server, declared=4_000_000, sent=300_000) for _ in range(20)]
    try:
        _eventually(lambda: server.open_connections() == 20)
        # Another tenant's conversation goes on while they stall.
        with httpx2.Client(base_url=server.url, headers={"X-Session-ID": "steady"}) as client:
            for turn in range(2):
                answer = client.post(
                    CHAT,
                    headers={"Authorization": "Bearer sk-other"},
                    content=_chat_body(fake),
                )
                assert answer.status_code == 200, (turn, answer.text)
        # 300 kB earned 15 s at RATE, but no gap may last over TIMEOUT_S.
        statuses = [_answer(sock, within_s=TIMEOUT_S + 5)[0] for sock in stalled]
        assert statuses == [408] * 20
        _eventually(lambda: server.open_connections() == 0)
    finally:
        for sock in stalled:
            sock.close()


def test_the_in_process_client_never_waits_on_the_body_deadline(fake):
    # A deadline no socket could meet: the in-process transport's bodies are whole at once.
    config = ProxyConfig(body_timeout_s=1e-9, body_min_rate=1)
    with (
        Cluster.from_dict(fake.cluster_spec, transport=fake.transport) as cluster,
        agentkv.OpenAI(cluster, config=config, session_id="in-process") as client,
    ):
        messages = [{"role": "user", "content": "Hello?"}]
        plain = client.chat.completions.create(model=fake.model, messages=messages)
        assert plain.choices[0].message.content
        chunks = list(
            client.chat.completions.create(model=fake.model, messages=messages, stream=True)
        )
        assert chunks


def _served(sock: socket.socket, request: bytes) -> int:
    """Send ``request`` on a kept-alive connection; its answer's status (read to its end)."""
    sock.sendall(request)
    sock.settimeout(10)
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(
        next(
            h.split(b":")[1] for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")
        )
    )
    while len(body) < length:
        body += sock.recv(65536)
    return int(head.split()[1])


def test_connections_stalled_before_their_headers_end_are_closed_at_the_header_deadline(server):
    started = time.monotonic()
    silent = socket.create_connection(("127.0.0.1", server.port))
    partial = socket.create_connection(("127.0.0.1", server.port))
    partial.sendall(_head(server, 100)[:40])  # the request line and part of a header
    with silent, partial:
        _eventually(lambda: server.open_connections() == 2)
        for sock in (silent, partial):
            sock.settimeout(HEADER_TIMEOUT_S + 5)
            assert sock.recv(65536) == b""  # closed, nothing answered
    assert HEADER_TIMEOUT_S * 0.9 <= time.monotonic() - started < HEADER_TIMEOUT_S + 1.0
    _eventually(lambda: server.open_connections() == 0)


def test_a_kept_alive_connection_idles_past_the_header_deadline_but_not_in_its_next_headers(
    server, fake
):
    body = _chat_body(fake)
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        assert _served(sock, _head(server, len(body)) + body) == 200
        time.sleep(HEADER_TIMEOUT_S * 2)  # idle between requests: the keep-alive timeout's
        assert _served(sock, _head(server, len(body)) + body) == 200
        started = time.monotonic()
        sock.sendall(_head(server, len(body))[:40])
        sock.settimeout(HEADER_TIMEOUT_S + 5)
        assert sock.recv(65536) == b""
        assert time.monotonic() - started < HEADER_TIMEOUT_S + 1.0
