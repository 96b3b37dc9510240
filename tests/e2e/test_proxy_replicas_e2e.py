"""Two proxy replicas sharing sessions in a real Redis (``--state``), in front of the real local
pair: an unmodified openai client alternating between them every turn keeps one session at the
ideal reuse, read from the prefill server's own ``cached_tokens``."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx2
import pytest
from openai import OpenAI

from agentkv import AsyncCluster
from agentkv.local._config import ClusterRecord
from agentkv.proxy import ProxyConfig, ProxyServer

pytestmark = pytest.mark.e2e

SYSTEM = "You are the relay warehouse assistant. Answer in one short sentence.\n" + "\n".join(
    f"Shelf {i}: holds relay parcel {i * 37 % 101} for customer {chr(65 + i % 26)}{i}."
    for i in range(24)
)
QUESTIONS = (
    "Which parcel is on shelf 3?",
    "Who is the customer on shelf 7?",
    "Which shelf holds parcel 74?",
    "Summarize your answers.",
)


@pytest.fixture
def replicas(cluster_file: Path, redis_url: str) -> Iterator[list[ProxyServer]]:
    def make() -> AsyncCluster:
        return AsyncCluster.from_file(cluster_file)

    config = ProxyConfig(port=0, state=redis_url)
    with ProxyServer(make, config) as a, ProxyServer(make, config) as b:
        yield [a, b]


def test_an_openai_client_alternating_two_replicas_keeps_the_ideal_reuse(
    replicas: list[ProxyServer], local_cluster: ClusterRecord
) -> None:
    session_id = "relay"
    key = f"sk-relay-{uuid.uuid4().hex}"  # the proxy salts prefix caches per key: nothing cached
    messages: list[dict[str, object]] = [{"role": "system", "content": SYSTEM}]
    cached = []
    for i, question in enumerate(QUESTIONS):
        client = OpenAI(
            base_url=f"{replicas[i % 2].url}/v1",
            api_key=key,
            default_headers={"X-Session-ID": session_id},
            max_retries=0,
        )
        messages.append({"role": "user", "content": question})
        response = client.chat.completions.create(
            model=local_cluster.model, messages=messages, max_tokens=24
        )
        assert response.usage is not None
        assert response.usage.prompt_tokens_details is not None
        cached.append(response.usage.prompt_tokens_details.cached_tokens)
        messages.append(response.choices[0].message.model_dump(exclude_none=True))
    turns = httpx2.get(
        f"{replicas[0].url}/v1/sessions/{session_id}",
        headers={"Authorization": f"Bearer {key}"},
    ).json()["turns"]
    assert [t["handle_state"] for t in turns] == ["none", "attached", "attached", "attached"]
    assert cached == [t["reused_tokens"] for t in turns]
    for turn in turns[1:]:
        assert turn["reused_tokens"] == turn["ideal_reused_tokens"], turn
