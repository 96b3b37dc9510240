"""A listening TCP socket for a uvicorn server that is handed its socket (``sockets=[...]``).

asyncio turns Nagle's algorithm off (``TCP_NODELAY``) on each connection it accepts, but only
when the socket says it is TCP: ``socket.socket(AF_INET, SOCK_STREAM)`` leaves the protocol 0,
accepted connections inherit it, and asyncio leaves them alone. uvicorn writes an answer's
headers and its body in two writes; with Nagle on, the body waits for the client to acknowledge
the headers, and a client on a kept-alive connection delays that acknowledgement by ~40 ms
(Linux's delayed ACK), on every request after a connection's first few: a turn of
``benchmarks/sdk_overhead.py --over-http`` (three POSTs to the fake pair's ``serve()``) took
51.8 ms of wall time before this module, 9.1 ms after (2-core AMD EPYC). (uvloop sets
``TCP_NODELAY`` whatever the protocol; the standard loop does not.)

>>> sock = listening_socket("127.0.0.1", 0)
>>> sock.proto == socket.IPPROTO_TCP, sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) > 0
(True, True)
>>> sock.close()
"""

from __future__ import annotations

import socket

__all__ = ["listening_socket"]


def listening_socket(host: str, port: int, *, backlog: int = 2048) -> socket.socket:
    """A non-blocking TCP socket listening on ``(host, port)`` (port 0: one the OS chooses) whose
    accepted connections send without Nagle's delay."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # Linux copies it to accepted connections; the protocol above makes asyncio set it too.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((host, port))
        sock.listen(backlog)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock
