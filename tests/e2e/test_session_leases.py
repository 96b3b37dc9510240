"""The SDK's use of agentkv's decode extension on the real local pair: what decode keeps pinned.

Read from decode's own ``vllm:kv_cache_usage_perc`` (``GET /metrics``), never from our bookkeeping.
A decode applies a prefill's read notice only at its next engine step (an idle one polls every
20 s), so levels are compared after a one-token plain request has stepped it (``settle``); a
release wakes the engine itself, so the level after a close is read without one.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx2
import pytest

import agentkv
from agentkv import HandleState, Message
from agentkv.local._config import ClusterRecord

pytestmark = pytest.mark.e2e

USAGE = re.compile(r"^vllm:kv_cache_usage_perc\{[^}]*\} (\S+)$", re.MULTILINE)
# Different from the other e2e modules' prompts, so their prefix cache does not serve these.
SYSTEM = "You are the lease clerk of a harbour. Answer in one short sentence.\n" + "\n".join(
    f"Berth {i}: ship {i * 53 % 97} leaves at {i % 24:02d}:{i * 7 % 60:02d}." for i in range(30)
)
QUESTIONS = ("Which ship is at berth 4?", "When does it leave?", "Which berth is free?")


class Decode:
    def __init__(self, client: httpx2.Client, url: str, model: str) -> None:
        self.client, self.url, self.model = client, url, model

    def usage(self) -> float:
        text = self.client.get(f"{self.url}/metrics").text
        return sum(float(v) for v in USAGE.findall(text))

    def settle(self) -> float:
        response = self.client.post(
            f"{self.url}/v1/chat/completions",
            json={
                "model": self.model,
                "max_tokens": 1,
                "messages": [{"role": "user", "content": "hi"}],
            },
        )
        assert response.status_code == 200, response.text
        return self.usage()

    def wait_for(self, level: float, *, timeout_s: float) -> tuple[float, float]:
        """Poll until usage is back to ``level`` (half a block of slack); (usage, seconds)."""
        begin = time.monotonic()
        while True:
            usage, waited = self.usage(), time.monotonic() - begin
            if usage <= level + 0.5 / 364 or waited > timeout_s:
                return usage, waited
            time.sleep(0.1)


@pytest.fixture(scope="module")
def decode(local_cluster: ClusterRecord) -> Iterator[Decode]:
    url = local_cluster.pairs[0].decode.url
    with httpx2.Client(timeout=300) as client:
        info = client.get(f"{url}/v1/agentkv/info")
        if info.status_code != 200 or not info.json().get("leases"):
            pytest.skip("the pair's decode runs without agentkv's extension")
        yield Decode(client, url, local_cluster.model)


def test_closing_a_three_turn_session_returns_decode_to_idle_within_seconds(
    cluster_file: Path, decode: Decode
) -> None:
    idle = decode.settle()
    with agentkv.Cluster.from_file(cluster_file) as cluster:
        session = cluster.session(max_tokens=16)
        session.append(Message.system(SYSTEM))
        results = [session.send(question) for question in QUESTIONS]
        assert all(r.stats.handle_state is HandleState.ATTACHED for r in results[1:])
        assert session.handle is not None
        assert session.handle.leased
        held = decode.usage()
        assert held > idle  # the last turn's pin (stock vLLM: for 480 s)
        session.close()
        usage, waited = decode.wait_for(idle, timeout_s=5.0)
    assert usage <= idle + 0.5 / 364, (idle, held, usage)
    assert waited < 5.0


def test_a_final_turn_pins_nothing(cluster_file: Path, decode: Decode) -> None:
    idle = decode.settle()
    with agentkv.Cluster.from_file(cluster_file) as cluster, cluster.session(max_tokens=16) as s:
        s.append(Message.system(SYSTEM))
        s.send(QUESTIONS[0])
        last = s.send(QUESTIONS[1], final=True)
        assert last.stats.handle_state is HandleState.ATTACHED
        assert s.handle is None
        # Nothing left to release: the level is idle before the session closes.
        assert decode.settle() <= idle + 0.5 / 364
