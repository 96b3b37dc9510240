"""Slow clients: what CLIENTS uploads that stop mid-body cost the proxy, and for how long.

The proxy (uvicorn, ``ProxyServer``, on the fake pair in its own process) is sent CLIENTS requests
that each declare a body of ``max_body_bytes`` (8 MiB), send SENT bytes of it, then stall. The
proxy's resident memory (RSS, ``/proc``) is read before (after a few normal turns), during (once
every upload has stalled), and WAIT seconds after the last byte (default: the body timeout plus
3 s); so is the number of client connections the proxy still holds (its ESTABLISHED sockets on
the port), and how the stalled clients were answered. ``--body-timeout 0`` serves without a body
deadline (as before issue 39): the stalled uploads are then held as long as their clients wait.
``--stall headers`` stops the clients before their headers end instead (slowloris), which no
body deadline reaches: the proxy's header deadline closes them (uvicorn has none;
``--header-timeout 0`` serves without it).

    .venv/bin/python benchmarks/slow_clients.py [--clients 40] [--sent-mib 7]
        [--body-timeout 10] [--header-timeout 10] [--waves 2] [--wait SECONDS]
        [--stall body|headers]
"""

from __future__ import annotations

import argparse
import collections
import logging
import os
import select
import socket
import subprocess
import sys
import time

import httpx2
import psutil
import structlog

from agentkv import AsyncCluster
from agentkv.proxy import ProxyConfig, ProxyServer
from agentkv.testing import FakeCluster

MIB = 1024 * 1024
MODEL = FakeCluster(pairs=1).model


def _serve(args: argparse.Namespace) -> None:
    """Child process: the proxy on the fake pair; prints its port, serves until stdin closes."""
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    fake = FakeCluster(pairs=1)

    def make() -> AsyncCluster:
        return AsyncCluster.from_dict(fake.cluster_spec, transport=fake.transport)

    config = ProxyConfig(
        port=0,
        body_timeout_s=args.body_timeout or None,
        header_timeout_s=args.header_timeout or None,
    )
    with ProxyServer(make, config) as server:
        print(server.port, flush=True)
        sys.stdin.read()


def _rss_mib(process: psutil.Process) -> float:
    return float(process.memory_info().rss) / MIB


def _held(process: psutil.Process, port: int) -> int:
    """The client connections the proxy holds: its ESTABLISHED sockets on the port."""
    return sum(
        1
        for c in process.net_connections(kind="tcp")
        if c.status == psutil.CONN_ESTABLISHED and c.laddr and c.laddr.port == port
    )


def _turn(port: int, i: int) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"Hi {i}"}], "max_tokens": 8}
    answer = httpx2.post(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        json=body,
        headers={"Authorization": "Bearer sk-steady", "X-Session-ID": "steady"},
        timeout=30,
    )
    answer.raise_for_status()


def _stall(port: int, sent: int, declared: int, *, headers_only: bool) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port))
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Authorization: Bearer sk-slow\r\nContent-Type: application/json\r\n"
        f"Content-Length: {declared}\r\n"
    ).encode()
    # Headers cut before their blank line (slowloris), or whole and then part of the body.
    sock.sendall(head if headers_only else head + b"\r\n" + b" " * sent)
    return sock


def _answers(socks: list[socket.socket]) -> collections.Counter[str]:
    """How each stalled client was answered by now: a status, or none (still waiting)."""
    seen: collections.Counter[str] = collections.Counter()
    for sock in socks:
        if not select.select([sock], [], [], 0)[0]:
            seen["none"] += 1
            continue
        first = sock.recv(64)
        seen[first.split()[1].decode() if first.startswith(b"HTTP/") else "closed"] += 1
    return seen


Wave = tuple[float, int, float, int, collections.Counter[str]]


def _wave(args: argparse.Namespace, proxy: psutil.Process, port: int, wait: float) -> Wave:
    """CLIENTS stalled uploads: RSS and connections held during, then ``wait`` s later."""
    headers_only = args.stall == "headers"
    socks = [
        _stall(port, args.sent_mib * MIB, 8 * MIB, headers_only=headers_only)
        for _ in range(args.clients)
    ]
    try:
        stalled_at = time.monotonic()
        time.sleep(1.0)  # the proxy reads what is on the sockets
        during, held_during = _rss_mib(proxy), _held(proxy, port)
        time.sleep(max(0.0, stalled_at + wait - time.monotonic()))
        after, held_after = _rss_mib(proxy), _held(proxy, port)
        return during, held_during, after, held_after, _answers(socks)
    finally:
        for sock in socks:
            sock.close()


def _run(args: argparse.Namespace) -> None:
    child = subprocess.Popen(
        [
            sys.executable,
            __file__,
            "--serve",
            "--body-timeout",
            str(args.body_timeout),
            "--header-timeout",
            str(args.header_timeout),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None
    assert child.stdin is not None
    try:
        port = int(child.stdout.readline())
        proxy = psutil.Process(child.pid)
        for i in range(5):
            _turn(port, i)
        before = _rss_mib(proxy)
        wait = args.wait if args.wait is not None else (args.body_timeout or 10) + 3
        waves = [_wave(args, proxy, port, wait) for _ in range(args.waves)]
        _turn(port, 99)  # still serving
    finally:
        child.stdin.close()
        child.wait(timeout=30)
    deadline = (
        f"{args.body_timeout:g} s body timeout" if args.body_timeout else "no body deadline"
    ) + (
        f", {args.header_timeout:g} s header timeout"
        if args.header_timeout
        else ", none on headers"
    )
    what = (
        "requests stalled in their headers"
        if args.stall == "headers"
        else f"uploads stalled after {args.sent_mib} MiB of 8 MiB"
    )
    print(
        f"{args.clients} {what}, {deadline}; "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}"
    )
    print(f"proxy RSS before {before:5.0f} MiB")
    for number, (during, held_during, after, held_after, answers) in enumerate(waves, start=1):
        print(
            f"wave {number}: during {during:5.0f} MiB, {held_during} connections held; "
            f"{wait:g} s after the last byte {after:5.0f} MiB, {held_after} held; "
            f"answers {dict(sorted(answers.items()))}"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--clients", type=int, default=40)
    parser.add_argument("--sent-mib", type=int, default=7, help="of the 8 MiB each declares")
    parser.add_argument(
        "--body-timeout", type=float, default=10.0, help="the proxy's (0: no deadline)"
    )
    parser.add_argument(
        "--stall",
        choices=("body", "headers"),
        default="body",
        help="where the clients stop: in the body, or before their headers end (slowloris)",
    )
    parser.add_argument("--waves", type=int, default=2, help="of CLIENTS stalled uploads")
    parser.add_argument(
        "--header-timeout", type=float, default=10.0, help="the proxy's (0: no deadline)"
    )
    parser.add_argument("--wait", type=float, help="seconds after the last byte to measure")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        _serve(args)
    else:
        _run(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
