"""A small soak on the real pair: concurrent sessions with tool pauses lose nothing, pin nothing.

4 sessions x 6 turns run at once on the local pair, each pausing for a random "tool call"
between turns (inside ``tool_wait``, as the agent loop does). Every turn must succeed, every
session's transcript must hold exactly its messages, and after the sessions close decode's own
``vllm:kv_cache_usage_perc`` must be no higher than before they started (their pins released).
"""

from __future__ import annotations

import asyncio
import random
import re
import time
from pathlib import Path

import httpx2
import pytest

import agentkv
from agentkv import HandleState, Message
from agentkv.local._config import ClusterRecord

pytestmark = pytest.mark.e2e

SESSIONS = 4
TURNS = 6
SYSTEM = "You are a terse warehouse assistant.\n" + "\n".join(
    f"Bin {i} holds {i * 13 % 97} units of part P{i}." for i in range(60)
)


def _decode_usage(url: str) -> float:
    text = httpx2.get(f"{url}/metrics", timeout=30).text
    values = re.findall(r"^vllm:kv_cache_usage_perc(?:\{[^}]*\})? (\S+)$", text, re.M)
    return max(float(v) for v in values)


async def _session(cluster: agentkv.AsyncCluster, index: int, rng: random.Random) -> list[str]:
    async with cluster.session(max_tokens=16) as session:
        session.append(Message.system(SYSTEM))
        for turn in range(TURNS):
            result = await session.send(f"Session {index}, question {turn}: bin {turn} holds?")
            if turn:
                assert result.stats.handle_state is HandleState.ATTACHED, result.stats
            async with session.tool_wait(expected_s=2.0):
                await asyncio.sleep(rng.uniform(0.0, 2.0))
            session.append(Message.user(f"(tool output for step {turn}: ok)"))
        return [m.role for m in session.transcript.messages]


def test_concurrent_sessions_with_tool_pauses_lose_nothing_and_leave_no_pins(
    local_cluster: ClusterRecord, cluster_file: Path
) -> None:
    decode = local_cluster.pairs[0].decode.url
    before = _decode_usage(decode)
    rng = random.Random(11)

    async def soak() -> list[list[str]]:
        async with agentkv.AsyncCluster.from_file(cluster_file) as cluster:
            return await asyncio.gather(
                *(_session(cluster, i, random.Random(rng.random())) for i in range(SESSIONS))
            )

    transcripts = asyncio.run(soak())
    # Committed messages; each tool output is a user message sent with the next question.
    expected = ["system", "user", "assistant", *(["user", "user", "assistant"] * (TURNS - 1))]
    for roles in transcripts:
        assert roles == expected
    deadline = time.monotonic() + 15
    after = _decode_usage(decode)
    while after > before and time.monotonic() < deadline:
        time.sleep(0.5)
        after = _decode_usage(decode)
    assert after <= before, f"decode KV usage {before:.4f} before the soak, {after:.4f} after"
