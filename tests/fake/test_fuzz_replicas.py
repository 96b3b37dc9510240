"""The replica fuzzer (``fuzz_replicas.py``), bounded for the normal run.

``AGENTKV_FUZZ_EXAMPLES=300 nice -n 10 pytest tests/fake/test_fuzz_replicas.py -s`` runs it
longer with fresh randomness and prints its figures.
"""

from __future__ import annotations

import asyncio
import os

import pytest
from hypothesis import HealthCheck, settings

from agentkv.proxy._redis_store import RedisSessions
from agentkv.proxy._store import Claim, ClaimLostError, CommitFate, Stored
from agentkv.testing import ManualClock
from tests.fake.fuzz_replicas import Counters, MemoryStore, ReplicaMachine

pytestmark = pytest.mark.slow  # a fuzzer: thousands of steps on the fake pair

ReplicaMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("AGENTKV_FUZZ_EXAMPLES", "0")) or 80,
    stateful_step_count=int(os.environ.get("AGENTKV_FUZZ_STEPS", "30")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    database=None,
    derandomize=not os.environ.get("AGENTKV_FUZZ_EXAMPLES"),
)


class TestReplicaFuzz(ReplicaMachine.TestCase):  # type: ignore[name-defined,misc]
    """Two replicas serving one conversation, paused, killed and fenced off mid-commit, never
    read wrong KV, attach one handle twice, or store what the client was not answered."""

    @classmethod
    def tearDownClass(cls) -> None:
        print(f"\nfuzz replicas: {Counters.summary()}")  # the long run's figures


async def test_the_fuzzers_memory_store_answers_as_the_redis_store_does(redis_url):
    """``MemoryStore`` is the Redis scripts ported to a dict: the same calls on both stores get
    the same answers (fences, versions, snapshots, dirty claims, refusals, idle lists), so what
    the fuzzer finds through it holds for ``--state redis://``."""
    memory = MemoryStore(clock=ManualClock(), lease_s=0.2)
    redis = RedisSessions.from_url(redis_url, lease_s=0.2)

    async def lapse():
        memory.advance(1.0)
        await asyncio.sleep(0.3)  # Redis's PX lease, in real time

    async def both(call):
        answers = []
        for store in (memory, redis):
            try:
                answers.append(await call(store))
            except (ClaimLostError, TimeoutError) as exc:
                answers.append(type(exc).__name__)
        assert answers[0] == answers[1], answers
        return answers[0]

    first = await both(lambda s: s.claim("k", known_version=0, wait_s=0.0))
    assert first == Claim(key="k", fence=1, version=0)
    assert await both(lambda s: s.claim("k", known_version=0, wait_s=0.0)) == "TimeoutError"
    assert (await both(lambda s: s.peek("k"))).claimed
    assert await both(lambda s: s.renew(first)) is True
    assert await both(lambda s: s.commit(first, b"one", used_at=100.0, pinned=True)) == 1
    clean = await both(lambda s: s.claim("k", known_version=1, wait_s=0.0))
    assert (clean.data, clean.dirty) == (None, False)
    await both(lambda s: s.release(clean))
    stale = await both(lambda s: s.claim("k", known_version=0, wait_s=0.0))
    assert (stale.data, stale.dirty) == (b"one", False)
    await lapse()  # its holder died: no commit, no release
    assert await both(lambda s: s.renew(stale)) is False
    dirty = await both(lambda s: s.claim("k", known_version=1, wait_s=0.0))
    assert (dirty.data, dirty.dirty) == (b"one", True)
    assert await both(lambda s: s.commit(stale, b"late", used_at=200.0)) == "ClaimLostError"
    assert await both(lambda s: s.commit(dirty, b"two", used_at=300.0)) == dirty.fence
    assert await both(lambda s: s.idle(before=400.0, limit=10)) == ["k"]
    assert await both(lambda s: s.pinned_idle(before=400.0, limit=10)) == []
    sweep = await both(lambda s: s.claim("k", known_version=dirty.fence, wait_s=0.0))
    assert await both(lambda s: s.remove(sweep, idle_before=250.0)) is False  # used since
    gone = await both(lambda s: s.claim("k", known_version=dirty.fence, wait_s=0.0))
    assert gone.dirty is False
    assert await both(lambda s: s.remove(gone)) is True
    assert await both(lambda s: s.peek("k")) == Stored(version=0, data=None, claimed=False)
    # Commits that append to the stored tail, one that rewrites it, and a lost one.
    new = await both(lambda s: s.claim("k", known_version=0, wait_s=0.0))
    one = await both(lambda s: s.commit(new, b"h1" + b"a" * 8, used_at=500.0, tail=8))
    grow = await both(lambda s: s.claim("k", known_version=one, wait_s=0.0))
    two = b"h2" + b"a" * 8 + b"b" * 4
    assert await both(lambda s: s.commit(grow, two, used_at=501.0, tail=12, kept=8)) == grow.fence
    stale = await both(lambda s: s.claim("k", known_version=0, wait_s=0.0))
    assert (stale.version, stale.data) == (grow.fence, two)
    await lapse()
    taken = await both(lambda s: s.claim("k", known_version=grow.fence, wait_s=0.0))
    assert (taken.dirty, taken.data) == (True, two)
    late = b"h3" + b"a" * 8 + b"b" * 4 + b"c"
    assert await both(lambda s: s.commit(stale, late, used_at=502.0, tail=13, kept=12)) == (
        "ClaimLostError"
    )
    fork = b"h4" + b"a" * 3
    assert await both(lambda s: s.commit(taken, fork, used_at=503.0, tail=3)) == taken.fence
    assert (await both(lambda s: s.peek("k"))).data == fork
    # Only a commit clears the dirty mark, and the secrets of the claims that ended mid-turn
    # (their turns' pins) reach every later claim until one commits.
    mid = await both(lambda s: s.claim("k", known_version=0, wait_s=0.0, secret="s1"))
    await lapse()
    sweep = await both(lambda s: s.claim("k", known_version=mid.version, wait_s=0.0))
    assert (sweep.dirty, sweep.orphans) == (True, ("s1",))
    assert await both(lambda s: s.remove(sweep, idle_before=0.0)) is False  # used since
    after = await both(lambda s: s.claim("k", known_version=mid.version, wait_s=0.0, secret="s2"))
    assert (after.dirty, after.orphans) == (True, ("s1",))
    await both(lambda s: s.release(after))  # its turn pinned nothing: its secret is dropped
    lost = await both(lambda s: s.claim("k", known_version=mid.version, wait_s=0.0, secret="s3"))
    assert (lost.dirty, lost.orphans) == (True, ("s1",))
    # A commit without an answer: fenced off, it never lands, and the mark stays.
    assert await both(lambda s: s.fence_off(lost)) is CommitFate.LOST
    assert await both(lambda s: s.commit(lost, b"h5", used_at=600.0)) == "ClaimLostError"
    landed = await both(lambda s: s.claim("k", known_version=mid.version, wait_s=0.0, secret="s4"))
    assert (landed.dirty, landed.orphans) == (True, ("s1",))
    assert await both(lambda s: s.commit(landed, b"h6", used_at=601.0)) == landed.fence
    assert await both(lambda s: s.fence_off(landed)) is CommitFate.LANDED
    clean = await both(lambda s: s.claim("k", known_version=landed.fence, wait_s=0.0, secret="s5"))
    assert (clean.dirty, clean.orphans) == (False, ())
    await lapse()
    later = await both(lambda s: s.claim("k", known_version=landed.fence, wait_s=0.0))
    assert (later.dirty, later.orphans) == (True, ("s5",))
    assert await both(lambda s: s.fence_off(clean)) is CommitFate.SUPERSEDED
    await redis.aclose()
