"""Two ``agentkv proxy --state redis://`` processes on one real Redis, in front of the fake pair
served over real HTTP: an unmodified openai client alternates between them every turn, and one
replica is killed by pid (SIGKILL) in the middle of the conversation."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx2
import pytest
from openai import OpenAI

from agentkv.testing import FakeCluster, ManualClock

pytestmark = pytest.mark.slow

SYSTEM = "You answer briefly. " + " ".join(f"Rule {i}: be kind to robot {i}." for i in range(30))
QUESTIONS = ("Hello?", "Who is robot 4?", "And robot 9?", "Thanks, bye.", "Robot 12?")
AUTH = {"Authorization": "Bearer sk-test"}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class _Replica:
    def __init__(self, cluster_file, redis_url):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        code = "import sys; from agentkv.cli import main; sys.exit(main(sys.argv[1:]))"
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-c",
                code,
                "proxy",
                "--cluster-file",
                str(cluster_file),
                "--port",
                str(self.port),
                "--state",
                redis_url,
                "--log-level",
                "warning",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={**os.environ, "PYTHONPATH": os.getcwd()},
        )

    def wait_ready(self):
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert self.process.poll() is None, "the proxy exited while starting"
            try:
                if httpx2.get(f"{self.url}/healthz", timeout=1).status_code == 200:
                    return
            except httpx2.TransportError:
                pass
            time.sleep(0.1)
        pytest.fail("the proxy did not become ready")

    def stop(self, sig=signal.SIGTERM):
        if self.process.poll() is None:
            self.process.send_signal(sig)  # by pid: only the process this test started
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@pytest.fixture
def replicas(tmp_path, redis_url) -> Iterator[tuple[FakeCluster, list[_Replica]]]:
    fake = FakeCluster(pairs=1, clock=ManualClock(), kv_recompute_threshold=1)
    with fake.serve() as served:
        cluster_file = tmp_path / "cluster.json"
        cluster_file.write_text(json.dumps(served.cluster_spec))
        made = [_Replica(cluster_file, redis_url) for _ in range(2)]
        try:
            for replica in made:
                replica.wait_ready()
            yield fake, made
        finally:
            for replica in made:
                replica.stop()


def test_a_replica_killed_by_pid_mid_conversation_loses_nothing(replicas):
    fake, (a, b) = replicas
    messages = [{"role": "system", "content": SYSTEM}]

    def ask(replica, question):
        client = OpenAI(
            base_url=f"{replica.url}/v1",
            api_key="sk-test",
            default_headers={"X-Session-ID": "killed"},
            max_retries=0,
        )
        messages.append({"role": "user", "content": question})
        response = client.chat.completions.create(
            model=fake.model, messages=messages, max_tokens=48
        )
        messages.append(response.choices[0].message.model_dump(exclude_none=True))

    ask(a, QUESTIONS[0])
    ask(b, QUESTIONS[1])
    ask(a, QUESTIONS[2])
    # Killed between turns: once its last turn is stored. (A commit is written behind its
    # answer; a replica killed before it lands loses that turn's reuse, which
    # test_proxy_replicas.py tests. On a loaded machine SIGKILL could otherwise beat it.)
    deadline = time.monotonic() + 10
    while len(httpx2.get(f"{b.url}/v1/sessions/killed", headers=AUTH).json()["turns"]) < 3:
        assert time.monotonic() < deadline, "replica A's third turn never reached the store"
        time.sleep(0.01)
    a.stop(signal.SIGKILL)
    ask(b, QUESTIONS[3])
    ask(b, QUESTIONS[4])
    session = httpx2.get(f"{b.url}/v1/sessions/killed", headers=AUTH).json()
    turns = session["turns"]
    assert len(turns) == len(QUESTIONS)
    assert [t["handle_state"] for t in turns] == ["none"] + ["attached"] * (len(turns) - 1)
    for turn in turns[1:]:
        assert turn["reused_tokens"] == turn["ideal_reused_tokens"], turn
    metrics = httpx2.get(f"{b.url}/metrics").text
    forks = [line for line in metrics.splitlines() if line.startswith("agentkv_proxy_forks_total")]
    assert forks == ["agentkv_proxy_forks_total 0.0"]  # never incremented: no fork
    assert fake.wrong_reuse_events == 0
