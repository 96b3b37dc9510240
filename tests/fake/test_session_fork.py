"""Forks carry their parent's KV: decode copies the parent's pin to its file tier and keeps it.

Facts come from the fake servers (pins, leases, the tier's entries, the P legs'
``kv_transfer_params``, ``fake.wrong_reuse_events``), not from the SDK's bookkeeping. Prefill's
prefix cache is made cold before a fork's first turn, so its reuse can only come from the copy.
"""

from __future__ import annotations

import asyncio

import pytest
from structlog.testing import capture_logs

from agentkv import AsyncCluster, Cluster, HandleState, Message, RetryPolicy
from agentkv.testing import FakeCluster

SYSTEM = Message.system("You are a helpful assistant. Answer in one or two sentences. " * 4)
LONG = {"max_tokens": 100, "extra_body": {"min_tokens": 70}}
ONE_ATTEMPT = RetryPolicy(max_attempts=1)
pytestmark = [
    pytest.mark.fake(pairs=1, tier=True),
    pytest.mark.cluster(manual_clock=True, block_size=16, retry=ONE_ATTEMPT),
]


def tier_refs(server):
    return [
        (body["kv_transfer_params"].get("agentkv") or {}).get("tier") for body in server.requests
    ]


def copies(logs):
    return [entry for entry in logs if entry["event"] == "agentkv.fork_copy"]


def test_a_fork_loads_a_copy_of_its_parents_pin_and_the_parent_keeps_the_pin(cluster, fake):
    decode, prefill = fake.decode(0), fake.prefill(0)
    with cluster.session(**LONG) as parent:
        parent.append(SYSTEM)
        parent.send("What is the capital of France?")
        handle = parent.handle
        with cluster.session(**LONG) as plain:  # the same history, computed from scratch
            plain.append(SYSTEM)
            plain.send("What is the capital of France?")
        child = parent.fork()
        prefill.restart()  # a cold prefix cache: reuse can only come from decode or the tier
        first = child.send("And of Spain?").stats
        assert parent.handle is handle  # the copy took nothing from the parent
        assert decode.leased_handles == 2  # the parent's pin and the fork's new one
        assert first.handle_state is HandleState.TIER, first.handle_reason
        assert tier_refs(prefill)[-1]["n_tokens"] == handle.num_tokens
        assert first.reused_tokens == first.ideal_reused_tokens == handle.num_tokens
        # The parent's next turn still pulls its own pin.
        again = parent.send("And of Italy?").stats
        assert again.handle_state is HandleState.ATTACHED
        assert again.reused_tokens >= again.ideal_reused_tokens  # the fork warmed prefill too
        child.close()
    assert fake.tier.ids == []  # the fork's turn superseded its entry, which was deleted
    assert decode.pinned_handles == 0
    assert fake.wrong_reuse_events == 0


def test_a_fork_without_a_copy_says_why_and_reuses_only_prefill_s_cache(cluster, fake):
    with cluster.session(**LONG) as parent:
        parent.append(SYSTEM)
        parent.send("What is the capital of France?")
        with capture_logs() as logs:
            child = parent.fork(copy_kv=False)
        assert copies(logs) == []
        fake.prefill(0).restart()
        stats = child.send("And of Spain?").stats
        assert stats.handle_state is HandleState.NONE
        assert stats.reused_tokens == 0 < stats.ideal_reused_tokens
        child.close()
    assert fake.tier.ids == []


def test_a_fork_of_a_truncated_history_gets_no_copy(cluster, fake):
    with cluster.session(**LONG) as parent:
        parent.append(SYSTEM)
        parent.send("What is the capital of France?")
        parent.send("And of Spain?")
        with capture_logs() as logs:
            child = parent.fork(keep=3)  # system, user, assistant: the first turn only
        assert copies(logs) == []
        stats = child.send("And of Italy?").stats
        assert stats.handle_state is HandleState.NONE
        assert "does not start with the parent's pinned tokens" in stats.handle_reason
        child.close()
    assert fake.tier.ids == []


def test_a_fork_closed_before_its_first_turn_deletes_its_copy(cluster, fake):
    with cluster.session(**LONG) as parent:
        parent.append(SYSTEM)
        parent.send("What is the capital of France?")
        child = parent.fork()
        parent.extend_handle(1.0)  # waits for the copy (a call on the parent's pin)
        assert len(fake.tier.ids) == 1
        child.close()
        assert fake.tier.ids == []
        assert parent.send("And of Spain?").stats.handle_state is HandleState.ATTACHED


def test_a_fork_outlives_its_parent_and_a_fork_of_a_fork_copies_again(cluster, fake):
    with cluster.session(**LONG) as parent:
        parent.append(SYSTEM)
        parent.send("What is the capital of France?")
        child = parent.fork()
    assert fake.decode(0).pinned_handles == 0  # the parent's close released its pin
    fake.prefill(0).restart()
    stats = child.send("And of Spain?").stats
    assert stats.handle_state is HandleState.TIER
    grandchild = child.fork()
    fake.prefill(0).restart()
    assert grandchild.send("And of Italy?").stats.handle_state is HandleState.TIER
    assert child.send("And of Portugal?").stats.handle_state is HandleState.ATTACHED
    grandchild.close()
    child.close()
    assert fake.tier.ids == []
    assert fake.decode(0).pinned_handles == 0
    assert fake.wrong_reuse_events == 0


def test_a_decode_without_copies_gets_no_keep_request(clock):
    fake = FakeCluster(pairs=1, clock=clock)  # no tier: info says no tier, so no copy
    cluster = Cluster.from_dict(
        fake.cluster_spec, transport=fake.transport, clock=clock, block_size=16, retry=ONE_ATTEMPT
    )
    with cluster, cluster.session(**LONG) as parent:
        parent.append(SYSTEM)
        parent.send("What is the capital of France?")
        with capture_logs() as logs:
            child = parent.fork()
            stats = child.send("And of Spain?").stats
        assert copies(logs) == []
        assert stats.handle_state is HandleState.NONE
        assert "no file tier that copies pins" in stats.handle_reason
        assert parent.send("And of Italy?").stats.handle_state is HandleState.ATTACHED
        child.close()


async def test_the_parent_s_next_turn_waits_for_the_copy_and_both_reuse(fake, clock):
    async with AsyncCluster.from_dict(
        fake.cluster_spec, transport=fake.transport, clock=clock, block_size=16
    ) as cluster, cluster.session(**LONG) as parent:
        parent.append(SYSTEM)
        await parent.send("What is the capital of France?")
        child = parent.fork()
        with capture_logs() as logs:
            mine, theirs = await asyncio.gather(
                parent.send("And of Italy?"), child.send("And of Spain?")
            )
        assert mine.stats.handle_state is HandleState.ATTACHED
        assert theirs.stats.handle_state is HandleState.TIER
        [copy] = [e for e in logs if e["event"] == "agentkv.fork_copy"]
        assert copy["outcome"] == "ok"
        assert copy["n_tokens"] == theirs.stats.ideal_reused_tokens
        await child.aclose()
    assert fake.tier.ids == []
    assert fake.decode(0).pinned_handles == 0
    assert fake.wrong_reuse_events == 0
