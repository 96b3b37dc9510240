"""The SDK against the real local pair: reuse at the ideal, no wrong reuse, forks never reuse.

Reuse is read from the prefill server's own usage (``cached_tokens``), never from our bookkeeping.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

import agentkv
from agentkv import CachePolicy, HandleState, Message

pytestmark = pytest.mark.e2e

BLOCK = 128  # vLLM's CPU backend block size
SYSTEM = "You are a warehouse assistant. Answer in one short sentence.\n" + "\n".join(
    f"Shelf {i}: holds parcel {i * 37 % 101} for customer {chr(65 + i % 26)}{i}." for i in range(40)
)
QUESTIONS = (
    "Which parcel is on shelf 3?",
    "Who is the customer on shelf 7?",
    "Which shelf holds parcel 74?",
    "Summarize your answers.",
    "Is there a shelf 61?",
)
# Never attach a handle: what standard disaggregated serving does.
NO_HANDLE = CachePolicy(min_reuse_tokens=10**9)


def _conversation(cluster_file: Path, policy: CachePolicy) -> list[agentkv.TurnResult]:
    with agentkv.Cluster.from_file(cluster_file) as cluster, cluster.session(
        max_tokens=24, policy=policy
    ) as session:
        session.append(Message.system(SYSTEM))
        return [session.send(question) for question in QUESTIONS]


def test_every_later_turn_reuses_the_block_aligned_ideal_per_prefill(cluster_file: Path) -> None:
    """Turns >= 2 reuse >= 99% of the previous turn's prompt + output, block-aligned, per P."""
    results = _conversation(cluster_file, CachePolicy())
    for previous, result in itertools.pairwise(results):
        stats = result.stats
        ideal = previous.stats.prompt_tokens + previous.stats.generated_tokens - 1
        assert stats.ideal_reused_tokens == ideal
        assert stats.handle_state is HandleState.ATTACHED, stats.handle_reason
        assert stats.reused_tokens >= 0.99 * (ideal // BLOCK * BLOCK), stats
        assert stats.reused_tokens <= stats.prompt_tokens


def test_greedy_outputs_are_identical_with_and_without_reuse(cluster_file: Path) -> None:
    with_reuse = _conversation(cluster_file, CachePolicy())
    without = _conversation(cluster_file, NO_HANDLE)
    assert all(r.stats.handle_state is not HandleState.ATTACHED for r in without)
    assert [r.message.content for r in with_reuse] == [r.message.content for r in without]
    assert [r.token_ids for r in with_reuse] == [r.token_ids for r in without]


def test_an_edited_history_forks_and_never_sends_the_old_handle(cluster_file: Path) -> None:
    with agentkv.Cluster.from_file(cluster_file) as cluster, cluster.session(max_tokens=16) as s:
        s.append(Message.system(SYSTEM))
        s.send(QUESTIONS[0])
        s.send(QUESTIONS[1])
        assert s.handle is not None
        edited = [Message.system(SYSTEM), Message.user("Which parcel is on shelf 4?")]
        with s.fork(messages=edited) as child:
            assert child.handle is None
            forked = child.turn()
        with cluster.session(max_tokens=16) as fresh:
            fresh.append(*edited)
            reference = fresh.turn()
    assert forked.stats.handle_state is HandleState.NONE
    assert forked.message.content == reference.message.content


def test_a_streamed_turn_ends_with_a_handle_the_next_turn_pulls(cluster_file: Path) -> None:
    """The agentkv plugin puts decode's handle on the last streamed chunk (stock vLLM does not)."""
    with agentkv.Cluster.from_file(cluster_file) as cluster, cluster.session(max_tokens=24) as s:
        s.append(Message.system(SYSTEM), Message.user(QUESTIONS[0]))
        pieces = list(s.stream())
        streamed = pieces[-1]
        assert isinstance(streamed, agentkv.TurnResult)
        text = "".join(p.text for p in pieces[:-1] if isinstance(p, agentkv.TextDelta))
        assert text == streamed.message.content
        assert s.handle is not None, "the stream carried no handle"
        following = s.send(QUESTIONS[1])
    stats = following.stats
    assert stats.handle_state is HandleState.ATTACHED, stats.handle_reason
    ideal = streamed.stats.prompt_tokens + streamed.stats.generated_tokens - 1
    assert stats.ideal_reused_tokens == ideal
    assert stats.reused_tokens >= 0.99 * (ideal // BLOCK * BLOCK)
