"""``ProxyServer``: the proxy on uvicorn, on a ``Portal`` (a loop on a thread), for tests and
benchmarks. It starts ready or not at all, and leaves no thread and no open cluster behind."""

from __future__ import annotations

import threading

import httpx2
import pytest

from agentkv import AsyncCluster
from agentkv.proxy import ProxyServer
from agentkv.testing import FakeCluster


def _proxy_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "agentkv-proxy"]


def test_the_server_answers_once_entered_and_closes_its_cluster_on_exit():
    fake = FakeCluster(pairs=1)
    made: list[AsyncCluster] = []

    def make() -> AsyncCluster:
        made.append(AsyncCluster.from_dict(fake.cluster_spec, transport=fake.transport))
        return made[0]

    with ProxyServer(make) as server:
        assert httpx2.get(f"{server.url}/healthz").status_code == 200
        # The app's state lives on the server's loop: call() runs there.
        assert server.call(lambda: threading.current_thread().name) == "agentkv-proxy"
        assert server.call(made[0].check_health) == {"pair-0": True}
    assert made[0].closed
    assert _proxy_threads() == []
    with pytest.raises(httpx2.ConnectError):
        httpx2.get(f"{server.url}/healthz")


def test_a_cluster_that_cannot_be_made_fails_the_start_and_leaves_no_thread():
    def make() -> AsyncCluster:
        raise OSError("no cluster file")

    with pytest.raises(OSError, match="no cluster file"), ProxyServer(make):
        pass
    assert _proxy_threads() == []
