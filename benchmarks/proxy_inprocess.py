"""The proxy's CPU per chat request in process (ASGI, no sockets), less the fake servers' time.

Runs the proxy's app on a fake P/D pair in this process and sends each session's whole history
back, as OpenAI clients do, with ``X-Session-ID``: SESSIONS sessions of TURNS turns on a
~1,000-token system prompt, one request at a time. Reports the median thread CPU per request
minus the time spent inside the fake pair's transport: the proxy's own work plus the SDK's turn.
It runs any revision's tree (httpx before issue 28, httpx2 after), so two trees compare in one
session: ``PYTHONPATH=/tmp/base .venv/bin/python benchmarks/proxy_inprocess.py`` with an export
of the old revision in ``/tmp/base``, then without ``PYTHONPATH``.

    .venv/bin/python benchmarks/proxy_inprocess.py [--sessions 25] [--turns 6]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import logging
import statistics
import time
from typing import Any

import structlog

from agentkv import AsyncCluster
from agentkv.proxy import ProxyConfig, create_app
from agentkv.testing import FakeCluster, ManualClock

try:  # the HTTP library of the tree that runs: httpx2 since issue 28
    importlib.import_module("agentkv._core")
    http: Any = importlib.import_module("httpx2")
except ImportError:
    http = importlib.import_module("httpx")


class Timed(http.AsyncBaseTransport):  # type: ignore[misc]
    """The fake pair's transport, counting the thread CPU spent inside it."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.cpu_s = 0.0

    async def handle_async_request(self, request: Any) -> Any:
        start = time.thread_time()
        try:
            return await self.inner.handle_async_request(request)
        finally:
            self.cpu_s += time.thread_time() - start


async def _run(args: argparse.Namespace) -> list[float]:
    fake = FakeCluster(pairs=2, clock=ManualClock())
    timed = Timed(fake.transport)
    system = "agents reuse the decode node's cache so every later turn starts warm " * 120
    samples = []
    async with AsyncCluster.from_dict(fake.cluster_spec, transport=timed) as cluster:
        app = create_app(cluster, ProxyConfig())
        transport = http.ASGITransport(app=app)
        async with http.AsyncClient(transport=transport, base_url="http://proxy") as client:
            for i in range(args.sessions):
                messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
                for turn in range(args.turns):
                    messages.append({"role": "user", "content": f"Question {turn} of {i}?"})
                    body = {"model": fake.cluster_spec["model"], "messages": messages,
                            "max_tokens": 32, "temperature": 0}
                    cpu, server = time.thread_time(), timed.cpu_s
                    answer = await client.post(
                        "/v1/chat/completions", json=body, headers={"X-Session-ID": f"s{i}"}
                    )
                    used = time.thread_time() - cpu - (timed.cpu_s - server)
                    answer.raise_for_status()
                    messages.append(answer.json()["choices"][0]["message"])
                    if i:  # session 0 warms caches
                        samples.append(used)
                    for fake_server in fake.servers:
                        fake_server.requests.clear()
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=25)
    parser.add_argument("--turns", type=int, default=6)
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    samples = asyncio.run(_run(args))
    print(f"proxy CPU per chat request, median {statistics.median(samples) * 1e3:.3f} ms "
          f"({len(samples)} requests)")


if __name__ == "__main__":
    main()
