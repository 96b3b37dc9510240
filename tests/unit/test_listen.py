"""``listening_socket``: connections accepted on the standard asyncio loop send without Nagle's
delay (the proxy's ``ProxyServer`` and the fake pair's HTTP host hand uvicorn this socket)."""

from __future__ import annotations

import asyncio
import socket

import pytest

from agentkv._core import listening_socket


class _Capture(asyncio.Protocol):
    nodelay: asyncio.Future[int]

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        sock = transport.get_extra_info("socket")
        self.nodelay.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        transport.close()


async def _accepted_nodelay(sock: socket.socket) -> int:
    loop = asyncio.get_running_loop()
    accepted: asyncio.Future[int] = loop.create_future()

    def protocol() -> _Capture:
        capture = _Capture()
        capture.nodelay = accepted
        return capture

    server = await loop.create_server(protocol, sock=sock)
    try:
        host, port = sock.getsockname()[:2]
        _, writer = await asyncio.open_connection(host, port)
        try:
            return await asyncio.wait_for(accepted, timeout=10)
        finally:
            writer.close()
    finally:
        server.close()
        await server.wait_closed()


def test_accepted_connections_have_nodelay_on_the_standard_loop() -> None:
    assert asyncio.run(_accepted_nodelay(listening_socket("127.0.0.1", 0))) > 0


def test_a_plain_stream_socket_would_not() -> None:
    """What the helper is for: asyncio only sets TCP_NODELAY on sockets that say they are TCP."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    sock.setblocking(False)
    if sock.proto == socket.IPPROTO_TCP:  # pragma: no cover - a platform that fills it in
        pytest.skip("this platform reports the protocol of a plain stream socket")
    assert asyncio.run(_accepted_nodelay(sock)) == 0


def test_a_taken_port_raises() -> None:
    taken = listening_socket("127.0.0.1", 0)
    try:
        with pytest.raises(OSError, match="in use"):
            listening_socket("127.0.0.1", taken.getsockname()[1])
    finally:
        taken.close()
