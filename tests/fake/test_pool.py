"""Pools (xPyD): a session pinned to its decode server, each turn's prefill chosen by load; and
closing a pool under the lease calls it still runs in the background."""

from __future__ import annotations

import asyncio
import gc
import itertools

import httpx2
import pytest

from agentkv import (
    AsyncCluster,
    Cluster,
    ConfigError,
    HandleState,
    Message,
    PrefillWeights,
    RetryPolicy,
)
from agentkv._wire.tier import TIER_DELETE_PATH
from agentkv.testing import FakeCluster

SYSTEM = Message.system("You are a helpful assistant. Answer in one or two sentences. " * 4)
QUESTIONS = [
    "What is the capital of France? Explain the history of the city in detail please.",
    "And what about Spain?",
    "Which of the two is bigger?",
    "Thanks. Summarize everything so far.",
    "One more thing: which river runs through each?",
    "And their populations?",
]
# Long enough answers that prefill pulls rather than recomputes (kv_recompute_threshold).
LONG = {"max_tokens": 100, "extra_body": {"min_tokens": 70}}
FAST_RETRY = RetryPolicy(initial_backoff_s=0, jitter_s=0)


def open_pool(fake, clock, **kwargs):
    kwargs.setdefault("retry", FAST_RETRY)
    return Cluster.from_dict(
        fake.pool_spec, transport=fake.transport, clock=clock, block_size=16, **kwargs
    )


def server(fake, name):
    return next(s for s in fake.servers if s.name == name)


def run_turns(session, questions):
    results = []
    for question in questions:
        session.append(Message.user(question))
        results.append(session.turn(**LONG))
    return results


def assert_ideal(results, *, shared_prefixes=False):
    for result in results:
        stats = result.stats
        if stats.turn >= 2:
            assert stats.handle_state is HandleState.ATTACHED, stats
            if shared_prefixes:  # other sessions' identical turns may sit in prefill's cache
                assert stats.reused_tokens >= stats.ideal_reused_tokens, stats
            else:
                assert stats.reused_tokens == stats.ideal_reused_tokens, stats


def test_a_pool_session_stays_on_its_decode_and_spreads_turns_over_prefills_at_the_ideal(clock):
    fake = FakeCluster(prefills=2, decodes=1, clock=clock)
    pure_load = PrefillWeights(slack_tokens=0, slack_ratio=0.0)
    with open_pool(fake, clock, prefill_weights=pure_load) as cluster:
        assert [pair.name for pair in cluster.pairs] == ["fake-d0"]
        with cluster.session(session_id="spread") as s:
            s.append(SYSTEM)
            results = run_turns(s, QUESTIONS)
    assert {r.stats.pair for r in results} == {"fake-d0"}
    assert {r.stats.prefill for r in results} == {"fake-p0", "fake-p1"}
    assert_ideal(results)
    # A turn on a prefill that did not serve the previous one pulled everything it reused.
    for before, after in itertools.pairwise(results):
        if after.stats.prefill != before.stats.prefill:
            assert after.stats.pulled_tokens == after.stats.reused_tokens
    assert fake.wrong_reuse_events == 0


def test_the_warm_prefill_is_kept_when_the_pool_is_idle(clock):
    fake = FakeCluster(prefills=3, decodes=1, clock=clock)
    with open_pool(fake, clock) as cluster, cluster.session(session_id="warm") as s:
        s.append(SYSTEM)
        results = run_turns(s, QUESTIONS)
        assert cluster.prefill_loads() == {"fake-p0": 0, "fake-p1": 0, "fake-p2": 0}
    assert len({r.stats.prefill for r in results}) == 1
    assert_ideal(results)


def test_a_prefill_killed_between_turns_costs_no_reuse(clock):
    """The KV is on decode: another prefill pulls the same handle; nothing is recomputed."""
    fake = FakeCluster(prefills=2, decodes=1, clock=clock)
    with open_pool(fake, clock) as cluster, cluster.session(session_id="kill-p") as s:
        s.append(SYSTEM)
        first = run_turns(s, QUESTIONS[:2])
        used = first[-1].stats.prefill
        server(fake, used).kill()
        after = run_turns(s, QUESTIONS[2:4])
        assert not cluster._async.is_prefill_healthy(used)
    assert {r.stats.prefill for r in after} == {"fake-p0", "fake-p1"} - {used}
    assert_ideal([*first, *after])
    assert after[0].stats.retries == 0
    assert after[0].stats.pulled_tokens == after[0].stats.reused_tokens  # all from decode
    assert fake.wrong_reuse_events == 0


def test_a_decode_killed_between_turns_moves_the_session_and_recomputes_once(clock):
    fake = FakeCluster(prefills=2, decodes=2, clock=clock)
    with open_pool(fake, clock) as cluster, cluster.session(session_id="kill-d") as s:
        s.append(SYSTEM)
        first = run_turns(s, QUESTIONS[:2])
        old = s.pair.name
        server(fake, old).kill()
        moved, settled = run_turns(s, QUESTIONS[2:4])
    assert moved.stats.pair != old
    assert settled.stats.pair == moved.stats.pair
    assert moved.stats.handle_state is not HandleState.ATTACHED
    assert moved.stats.pulled_tokens == 0
    assert_ideal([*first, settled])
    assert fake.wrong_reuse_events == 0


async def test_concurrent_sessions_balance_decodes_and_use_every_prefill(clock):
    fake = FakeCluster(prefills=3, decodes=2, clock=clock)
    async with AsyncCluster.from_dict(
        fake.pool_spec, transport=fake.transport, clock=clock, block_size=16, retry=FAST_RETRY
    ) as cluster:
        sessions = [cluster.session(session_id=f"s{i}") for i in range(24)]
        assert max(cluster.loads().values()) <= 15  # bounded load: ceil(1.25 * 24 / 2)

        async def converse(session):
            session.append(SYSTEM)
            out = []
            for question in QUESTIONS[:3]:
                session.append(Message.user(question))
                out.append(await session.turn(**LONG))
            return out

        results = [r for rs in await asyncio.gather(*map(converse, sessions)) for r in rs]
        assert set(cluster.prefill_loads().values()) == {0}
        for session in sessions:
            await session.aclose()
        assert set(cluster.loads().values()) == {0}
    assert {r.stats.prefill for r in results} == {"fake-p0", "fake-p1", "fake-p2"}
    assert_ideal(results, shared_prefixes=True)
    assert fake.wrong_reuse_events == 0


def test_pool_specs_accept_urls_or_named_servers_and_refuse_bad_ones():
    cluster = Cluster.from_dict(
        {
            "model": "m",
            "prefill": ["http://p0:8000", {"name": "px", "url": "http://p1:8000/"}],
            "decode": ["http://d0:8000"],
        }
    )
    try:
        assert cluster._async.prefills == {"prefill0": "http://p0:8000", "px": "http://p1:8000"}
        assert [(p.name, p.decode) for p in cluster.pairs] == [("decode0", "http://d0:8000")]
        assert cluster._async.pooled
    finally:
        cluster.close()
    for bad in (
        {"model": "m", "prefill": [], "decode": ["http://d0:8000"]},
        {"model": "m", "prefill": ["http://p0:8000"]},
        {"model": "m", "prefill": ["ftp://p0"], "decode": ["http://d0:8000"]},
        {
            "model": "m",
            "prefill": ["http://a", {"name": "prefill0", "url": "http://b"}],
            "decode": ["http://d0:8000"],
        },
    ):
        with pytest.raises(ConfigError):
            Cluster.from_dict(bad)


# --- closing the pool under background lease calls ---------------------------------------------


class HeldDeletes(httpx2.AsyncBaseTransport):
    """The fake's transport, holding each tier delete until ``go`` is set: a background call
    still running when the cluster closes."""

    def __init__(self, inner):
        self._inner = inner
        self.go = asyncio.Event()
        self.held = 0

    async def handle_async_request(self, request):
        if request.url.path == TIER_DELETE_PATH:
            self.held += 1
            await self.go.wait()
        return await self._inner.handle_async_request(request)


@pytest.fixture
async def loop_errors():
    """What asyncio's exception handler is given during the test ("Task exception was never
    retrieved" among them, once the task is collected)."""
    loop = asyncio.get_running_loop()
    errors = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _, context: errors.append(context))
    yield errors
    loop.set_exception_handler(previous)


async def collected():
    """Let whatever the close left running finish, and collect it: a task that failed with
    nobody to retrieve it reports to the exception handler then."""
    for _ in range(10):
        await asyncio.sleep(0)
    gc.collect()


async def _resume_from_tier(cluster):
    """A session whose second turn loads from the tier, leaving it open: its tier entry's
    delete is sent in the background after that turn."""
    session = cluster.session(**LONG)
    session.append(SYSTEM)
    await session.send(QUESTIONS[0])
    assert await session.offload() is not None
    result = await session.send(QUESTIONS[1])
    assert result.stats.handle_state is HandleState.TIER
    return session


async def test_a_script_raising_inside_the_cluster_after_a_tier_resume_closes_cleanly(
    clock, loop_errors
):
    """Before: the cluster closed its HTTP client under the tier delete, which failed, and
    asyncio printed "Task exception was never retrieved" after the script's own error."""
    fake = FakeCluster(pairs=1, clock=clock, tier=True)

    async def script():
        async with AsyncCluster.from_dict(
            fake.cluster_spec, transport=fake.transport, clock=clock
        ) as cluster:
            await _resume_from_tier(cluster)
            raise RuntimeError("the script's own error")

    with pytest.raises(RuntimeError, match="the script's own error"):
        await script()
    await collected()
    assert loop_errors == []
    assert fake.tier.ids == []  # the delete landed before the client closed


async def test_closing_waits_for_a_lease_call_still_running_then_closes(clock, loop_errors):
    fake = FakeCluster(pairs=1, clock=clock, tier=True)
    held = HeldDeletes(fake.transport)
    cluster = AsyncCluster.from_dict(fake.cluster_spec, transport=held, clock=clock)
    await _resume_from_tier(cluster)
    await asyncio.sleep(0)
    assert held.held == 1
    asyncio.get_running_loop().call_later(0.05, held.go.set)
    await cluster.aclose()
    await collected()
    assert loop_errors == []
    assert fake.tier.ids == []


async def test_a_lease_call_still_running_past_the_bound_is_cancelled_not_left_failing(
    clock, loop_errors
):
    fake = FakeCluster(pairs=1, clock=clock, tier=True)
    held = HeldDeletes(fake.transport)
    cluster = AsyncCluster.from_dict(fake.cluster_spec, transport=held, clock=clock)
    await _resume_from_tier(cluster)
    await asyncio.sleep(0)
    pool = cluster._pool
    await asyncio.wait_for(pool.leases.aclose(settle_s=0.05), 1.0)
    await cluster.aclose()
    await collected()
    assert loop_errors == []
    assert held.held == 1
    assert len(fake.tier.ids) == 1  # never deleted: its TTL removes it


SUBAGENT = Message.system(
    "You are a file search specialist. Use Glob, Grep and Read; report paths and lines. " * 6
)


def test_siblings_start_on_the_prefill_that_computed_their_shared_prefix(clock):
    """Claude Code's subagents share their system prompt and tools with each other, not with
    their parent: the second one's first turn goes where the first one's prompt was computed
    and reuses it, although the session's own rank (and the idle pool) would pick the other."""
    from agentkv._placement import rank

    fake = FakeCluster(prefills=2, decodes=1, clock=clock)
    with open_pool(fake, clock) as cluster:
        with cluster.session(session_id="explore-1") as first:
            first.append(SUBAGENT)
            first.append(Message.user("Find where the retry policy is defined."))
            one = first.turn(**LONG).stats
        # A sibling whose own first turn would rank the other prefill first.
        sibling = next(
            f"explore-{n}"
            for n in itertools.count(2)
            if rank(f"explore-{n}/1", ["fake-p0", "fake-p1"])[0] != one.prefill
            and rank(f"explore-{str(n)[:-1]}stranger/1", ["fake-p0", "fake-p1"])[0] != one.prefill
        )
        with cluster.session(session_id=sibling) as second:
            second.append(SUBAGENT)
            second.append(Message.user("Find every caller of choose_prefill."))
            two = second.turn(**LONG).stats
        # A stranger (no recorded prefix) is placed by its rank, as before.
        with cluster.session(session_id=sibling[:-1] + "stranger") as stranger:
            stranger.append(Message.system("Something else entirely. " * 8))
            stranger.append(Message.user("Hello"))
            other = stranger.turn(**LONG).stats
    assert two.prefill == one.prefill
    assert one.reused_tokens == 0
    assert two.reused_tokens >= len(SUBAGENT.content) // 2, two  # the shared system prompt
    assert other.prefill != one.prefill
    assert len(cluster._async._pool.prefix_homes) > 0


async def test_siblings_started_together_share_the_prefill_computing_their_prefix(clock):
    """Claude Code starts its Explore agents at once: the second one's first turn finds the
    prefill the first one's P leg was just sent to (recorded when sent, not when answered)."""
    fake = FakeCluster(prefills=2, decodes=1, clock=clock)
    async with AsyncCluster.from_dict(
        fake.pool_spec, transport=fake.transport, clock=clock, block_size=16, retry=FAST_RETRY
    ) as cluster:

        async def explore(name: str, task: str):
            async with cluster.session(session_id=name) as s:
                s.append(SUBAGENT)
                s.append(Message.user(task))
                return (await s.turn(**LONG)).stats

        for round_ in range(4):  # rendezvous ranks differ per id: several pairs of siblings
            first, second = await asyncio.gather(
                explore(f"e{round_}-a", "Find the retry policy."),
                explore(f"e{round_}-b", "Find the callers."),
            )
            assert first.prefill == second.prefill, (round_, first.prefill, second.prefill)
    assert fake.wrong_reuse_events == 0
