"""The file tier through the SDK on the real local pair.

A session whose turn-end KV went to decode's file tier in a pause (decode's pin freed) resumes
after its pin's TTL would have run out: the next turn loads the ideal from the tier, answers as a
never-interrupted session does, and closing the session leaves no file. Reuse is read from the
prefill server's own usage (``cached_tokens``), never from our bookkeeping.

Each test uses its own questions, and the never-interrupted reference runs *after* the tier run,
so that prefill's prefix cache from one run cannot serve another's.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from pathlib import Path

import httpx2
import pytest

import agentkv
from agentkv import CachePolicy, HandleState, Message, TextDelta
from agentkv._wire.hints import INFO_PATH
from agentkv._wire.tier import TierUsage

pytestmark = pytest.mark.e2e

SYSTEM = "You are a depot assistant. Answer in one short sentence.\n" + "\n".join(
    f"Bay {i}: holds crate {i * 29 % 103} for client {chr(66 + i % 24)}{i}." for i in range(30)
)
# A short pin: the resume below comes after it would have expired.
SHORT_PIN = CachePolicy(pin_ttl_s=4.0)


def _tier_files(cluster: agentkv.Cluster, tier_id: str) -> list[Path]:
    decode = cluster.pairs[0].decode
    info = httpx2.get(f"{decode}{INFO_PATH}", timeout=30).json()
    return sorted(Path(TierUsage.from_wire(info["tier"]).dir).glob(f"{tier_id}.*"))


def _reference(cluster: agentkv.Cluster, questions: tuple[str, str]) -> tuple[str, str]:
    """Both answers of a never-interrupted session (turn 2 pulls from decode)."""
    with cluster.session(max_tokens=24) as session:
        session.append(Message.system(SYSTEM))
        first = session.send(questions[0]).text
        second = session.send(questions[1], final=True)
        assert second.stats.handle_state is HandleState.ATTACHED
        return first, second.text


def test_a_session_persisted_in_a_pause_resumes_from_the_tier_at_the_ideal(
    cluster_file: Path,
) -> None:
    questions = ("Which crate is in bay 4?", "And who is the client of bay 9?")
    with agentkv.Cluster.from_file(cluster_file, policy=SHORT_PIN) as cluster:
        session = cluster.session(max_tokens=24)
        session.append(Message.system(SYSTEM))
        first = session.send(questions[0], offload="always")
        ref = session.tier
        assert ref is not None, "the turn's KV was not persisted"
        assert session.handle is None  # decode's pin is freed
        assert ref.n_tokens == first.stats.prompt_tokens + first.stats.generated_tokens - 1
        assert len(_tier_files(cluster, ref.id)) == 2  # the manifest and the blocks
        time.sleep(SHORT_PIN.pin_ttl_s + 1.0)  # past the pin's TTL: only the tier holds the KV

        second = session.send(questions[1], final=True)
        stats = second.stats
        assert stats.handle_state is HandleState.TIER
        # Prefill never computed the generated tokens: reaching the ideal means the tier served.
        assert stats.reused_tokens == stats.ideal_reused_tokens == ref.n_tokens
        session.close()
        assert _tier_files(cluster, ref.id) == []  # closing deletes what the tier held

        assert _reference(cluster, questions) == (first.text, second.text)


def test_a_saved_session_resumes_from_the_tier_in_another_process(
    cluster_file: Path, tmp_path: Path
) -> None:
    """``save`` carries the tier reference: a new cluster client (a restarted process) loads the
    session and its next turn loads the KV from the tier."""
    questions = ("Which crate is in bay 11?", "And which bay holds crate 58?")
    path = tmp_path / "session.json"
    with agentkv.Cluster.from_file(cluster_file) as cluster:
        session = cluster.session(max_tokens=24)
        session.append(Message.system(SYSTEM))
        first = session.send(questions[0])
        ref = session.offload()
        assert ref is not None
        session.save(path)
        session.detach()  # the process goes away; the file lives on
    with agentkv.Cluster.from_file(cluster_file) as restarted:
        session = restarted.load_session(path)
        assert session.tier == ref
        second = session.send(questions[1], final=True)
        stats = second.stats
        assert stats.handle_state is HandleState.TIER
        assert stats.reused_tokens == stats.ideal_reused_tokens == ref.n_tokens
        session.close()
        assert _tier_files(restarted, ref.id) == []
        assert _reference(restarted, questions) == (first.text, second.text)


async def test_decode_streams_other_sessions_while_it_writes_the_tier(cluster_file: Path) -> None:
    """A persist's write runs on the workers' own threads: another session on the same decode
    keeps streaming tokens during it (on the engine thread, as before issue 39, no token could
    come out until the write and its fsync had ended)."""
    long_history = "\n".join(
        f"Ledger line {i}: parcel {i * 37 % 1009} went to shelf {i % 23}, row {i % 7}."
        for i in range(160)
    )
    async with agentkv.AsyncCluster.from_file(cluster_file) as cluster:
        big = cluster.session(max_tokens=4, temperature=0.0)
        await big.send(long_history + "\nWhich shelf holds parcel 37?")
        streamer = cluster.session(max_tokens=120, temperature=0.0,
                                   extra_body={"ignore_eos": True})
        streamer.append(Message.user("Count slowly from one to one thousand."))
        arrivals: list[float] = []
        started = asyncio.Event()
        window: list[float] = []

        async def stream() -> None:
            async for event in streamer.stream(final=True):
                if isinstance(event, TextDelta):
                    arrivals.append(time.perf_counter())
                    if len(arrivals) == 6:
                        started.set()

        async def persist() -> agentkv.TierRef | None:
            await started.wait()
            window.append(time.perf_counter())
            ref = await big.offload()
            window.append(time.perf_counter())
            return ref

        _, ref = await asyncio.gather(stream(), persist())
        await big.aclose()
        await streamer.aclose()
    assert ref is not None, "the persist failed"
    begin, end = window
    during = sum(1 for t in arrivals if begin < t < end)
    gaps = sorted(b - a for a, b in itertools.pairwise(arrivals)
                  if b <= begin or a >= end)
    typical = gaps[len(gaps) // 2]
    # Decode stepped while it wrote: at least a third of the tokens its usual pace would give.
    expected = int((end - begin) / typical / 3)
    assert during >= expected, (during, end - begin, typical)
