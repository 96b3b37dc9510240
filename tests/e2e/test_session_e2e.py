"""The SDK against the real local pair: reuse at the ideal, no wrong reuse, forks never reuse.

Reuse is read from the prefill server's own usage (``cached_tokens``), never from our bookkeeping.
"""

from __future__ import annotations

import asyncio
import itertools
import re
import tempfile
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx2
import pytest

import agentkv
from agentkv import CachePolicy, HandleState, Message
from agentkv._client import kv
from agentkv.local._config import ClusterRecord
from agentkv.testing import logprob_drift, teacher_forced_logprobs, tie_gap

pytestmark = pytest.mark.e2e

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
# Turns of the conversations the reuse and equality tests run: three later turns each, enough to
# see every later turn reuse; a fifth cost ~30 s of CI over five conversations and their checks.
CONVERSATION_TURNS = 4
# Never attach a handle: what standard disaggregated serving does.
NO_HANDLE = CachePolicy(min_reuse_tokens=10**9)


Turn = tuple[agentkv.TurnResult, list[int]]  # a turn's result and its exact prompt ids

# How far decode's logprobs may lie from a cold, teacher-forced prefill of the same tokens, per
# serving dtype. Derived from benchmarks/cpu_dtype.py's measurements (docs/cpu.md, "How the
# equality test tells drift from wrong KV"): the largest drift seen on any CPU, with reuse and
# without alike, was 0.19 nats in bf16 (0.17 on Zen 4, 0.13 with AVX2 emulation) and 2e-5 in
# fp32; a turn sent with another prefix's handle moved them by 2.98-3.11 nats in every
# configuration. Each tolerance is about 2x the largest drift (bf16: 2.1x; fp32: 5x, as 2e-5 is
# the resolution of those measurements), so the check has room for the drift and none for wrong
# KV: 7.5x below it in bf16, 30,000x in fp32.
DRIFT_TOLERANCE = {"bfloat16": 0.4, "float32": 1e-4}
OTHER_SYSTEM = "You are a librarian. Answer in one short sentence.\n" + "\n".join(
    f"Row {i}: the book {i * 13 % 97} by author {chr(90 - i % 26)}{i * 3}." for i in range(40)
)
LOGPROBS = {"logprobs": True}


def _prompt_of(
    session: agentkv.Session | agentkv.AsyncSession, result: agentkv.TurnResult
) -> list[int]:
    """The exact prompt of the turn just committed: the transcript minus the generated ids."""
    tokens = session.transcript.token_ids
    generated = result.token_ids
    assert tokens[len(tokens) - len(generated):] == generated
    return list(tokens[: len(tokens) - len(generated)])


def _fresh_salt() -> dict[str, str]:
    """A prefix cache of the session's own: the module's other conversations send the same
    tokens, and prefill may reuse their blocks beyond the ideal."""
    return {"cache_salt": uuid.uuid4().hex}


def _conversation(
    cluster_file: Path, policy: CachePolicy, *, salted: bool = False, route: agentkv.Route = "pull"
) -> list[Turn]:
    extra_body = {**LOGPROBS, **(_fresh_salt() if salted else {})}
    with agentkv.Cluster.from_file(cluster_file) as cluster, cluster.session(
        max_tokens=24, policy=policy, extra_body=extra_body, route=route
    ) as session:
        session.append(Message.system(SYSTEM))
        turns = []
        for question in QUESTIONS[:CONVERSATION_TURNS]:
            result = session.send(question)
            turns.append((result, _prompt_of(session, result)))
        return turns


def _tolerance(cluster: ClusterRecord) -> float:
    return DRIFT_TOLERANCE[cluster.dtype or "bfloat16"]


def _reference(cluster: ClusterRecord, prompt: list[int], generated: Sequence[int]) -> Any:
    return teacher_forced_logprobs(
        cluster.pairs[0].prefill.url, model=cluster.model, prompt_ids=prompt,
        generated_ids=generated,
    )


def _assert_no_wrong_kv(cluster: ClusterRecord, turns: list[Turn]) -> None:
    """Every turn's logprobs lie within the dtype's drift of a cold recompute of its tokens."""
    tolerance = _tolerance(cluster)
    for number, (result, prompt) in enumerate(turns, start=1):
        assert result.logprobs is not None
        report = logprob_drift(
            result.logprobs, _reference(cluster, prompt, result.token_ids), result.token_ids
        )
        assert report.within(tolerance), (
            f"turn {number}: logprobs {report.max_abs:.3f} nats from a cold recompute at token "
            f"{report.worst_position} (tolerance {tolerance}): wrong KV behind the prompt"
        )


def _block_size(url: str) -> int:
    metrics = httpx2.get(url + "/metrics", timeout=10).text
    found = re.search(r'^vllm:cache_config_info\{[^}]*block_size="(\d+)"', metrics, re.MULTILINE)
    assert found is not None, "the server's /metrics has no cache_config_info"
    return int(found[1])


def _kv_usage(url: str) -> float:
    metrics = httpx2.get(url + "/metrics", timeout=10).text
    found = re.search(r"^vllm:kv_cache_usage_perc\{[^}]*\} (\S+)$", metrics, re.MULTILINE)
    assert found is not None, "the server's /metrics has no kv_cache_usage_perc"
    return float(found[1])


def test_every_later_turn_reuses_exactly_the_ideal_per_prefill(cluster_file: Path) -> None:
    """Turns >= 2 reuse exactly the previous turn's prompt + output - 1, as prefill counts it.

    The local pair pulls whatever prefill lacks (``kv_recompute_threshold`` 1): partial blocks
    and generated tokens come from decode, so nothing of the ideal is recomputed.
    """
    results = [result for result, _ in _conversation(cluster_file, CachePolicy(), salted=True)]
    for previous, result in itertools.pairwise(results):
        stats = result.stats
        ideal = previous.stats.prompt_tokens + previous.stats.generated_tokens - 1
        assert stats.ideal_reused_tokens == ideal
        assert stats.handle_state is HandleState.ATTACHED, stats.handle_reason
        assert stats.reused_tokens == ideal, stats


def test_greedy_outputs_with_reuse_equal_outputs_without_it(
    local_cluster: ClusterRecord, cluster_file: Path
) -> None:
    """Greedy answers with reuse are the answers without it, token for token, unless the first
    difference is a near-tie that the dtype's rounding can flip; and no turn of either run has
    logprobs further from a cold recompute than that rounding (wrong KV moves them by nats)."""
    with_reuse = _conversation(cluster_file, CachePolicy())
    without = _conversation(cluster_file, NO_HANDLE)
    assert all(r.stats.handle_state is HandleState.ATTACHED for r, _ in with_reuse[1:])
    assert all(r.stats.handle_state is not HandleState.ATTACHED for r, _ in without)
    _assert_same_answers(local_cluster, with_reuse, without)


def test_the_decode_route_reuses_decodes_own_cache_and_answers_as_a_pull_does(
    local_cluster: ClusterRecord, cluster_file: Path
) -> None:
    """Turns >= 2 on the decode route send one request, to decode, which reuses the previous
    turn's whole blocks from its own prefix cache (the pinned turn-end KV) and computes the rest;
    the answers are the pulled run's, with no logprob further from a cold recompute than the
    dtype's rounding. Every pin the route left on decode is freed by the session's close (vLLM
    tracks such a local request only through agentkv's connector: untracked, it would hold its
    blocks for good)."""
    decode = local_cluster.pairs[0].decode.url
    before = _kv_usage(decode)
    local = _conversation(cluster_file, CachePolicy(), salted=True, route="decode")
    assert _kv_usage(decode) <= before, "the decode route left KV pinned on decode"
    pulled = _conversation(cluster_file, CachePolicy(), salted=True)
    block = _block_size(decode)
    for result, _ in local[1:]:
        stats = result.stats
        assert (stats.route, stats.prefill, stats.pulled_tokens) == ("decode", "", 0)
        assert stats.handle_state is HandleState.ATTACHED, stats.handle_reason
        ideal = stats.ideal_reused_tokens
        assert ideal // block * block <= stats.reused_tokens <= ideal + 1, stats
    _assert_same_answers(local_cluster, local, pulled)


def _assert_same_answers(cluster: ClusterRecord, runs: list[Turn], others: list[Turn]) -> None:
    """No wrong KV in either run, and the same greedy answers up to a first difference at a
    near-tie (after which the prompts differ and nothing more is compared)."""
    local_cluster, with_reuse, without = cluster, runs, others
    _assert_no_wrong_kv(local_cluster, with_reuse)
    _assert_no_wrong_kv(local_cluster, without)
    tolerance = _tolerance(local_cluster)
    for number, ((a, prompt), (b, _)) in enumerate(zip(with_reuse, without, strict=True), 1):
        if a.token_ids == b.token_ids:
            assert a.message.content == b.message.content
            continue
        # The runs part here: later turns have different prompts and are not comparable.
        # Both runs stop on the same max_tokens, so differing answers differ at some token.
        pairs = zip(a.token_ids, b.token_ids, strict=False)
        index = next(i for i, (x, y) in enumerate(pairs) if x != y)
        at = _reference(local_cluster, prompt, a.token_ids[: index + 1])[index]
        gap = tie_gap(at, a.token_ids[index], b.token_ids[index])
        assert gap <= tolerance, (
            f"turn {number} differs at token {index} ({a.message.content!r} vs "
            f"{b.message.content!r}) and the two tokens are {gap:.3f} nats apart: no near-tie"
        )
        break


def test_two_loads_of_one_save_racing_their_first_turns_attach_the_handle_once(
    local_cluster: ClusterRecord, cluster_file: Path, tmp_path: Path
) -> None:
    """As a new user would: save, detach, load the file twice, send both first turns at once.
    Decode's claim is exclusive: one attaches, the other recomputes and says why; both answers
    are the greedy answer (or part at a near-tie) and lie within drift of a cold recompute."""
    path = tmp_path / "session.json"
    extra_body = {**LOGPROBS, **_fresh_salt()}
    with agentkv.Cluster.from_file(cluster_file) as cluster:
        session = cluster.session(max_tokens=24, extra_body=extra_body)
        session.append(Message.system(SYSTEM))
        for question in QUESTIONS[:2]:
            session.send(question)
        session.save(path)
        session.detach()

    async def race() -> list[Turn]:
        async with agentkv.AsyncCluster.from_file(cluster_file) as cluster:
            copies = [agentkv.AsyncSession.load(path, cluster) for _ in range(2)]
            results = await asyncio.gather(*(c.send(QUESTIONS[2]) for c in copies))
            turns = [(r, _prompt_of(c, r)) for r, c in zip(results, copies, strict=True)]
            for copy in copies:
                await copy.aclose()
            return turns

    turns = asyncio.run(race())
    states = [result.stats.handle_state for result, _ in turns]
    assert sorted(states) == [HandleState.ATTACHED, HandleState.EXPIRED], states
    loser = next(result for result, _ in turns if result.stats.handle_state is not
                 HandleState.ATTACHED)
    assert "another copy of this session claimed it" in loser.stats.handle_reason
    assert loser.stats.pulled_tokens == 0
    _assert_no_wrong_kv(local_cluster, turns)
    (a, prompt), (b, _) = turns
    if a.token_ids != b.token_ids:
        index = next(i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=False))
                     if x != y)
        at = _reference(local_cluster, prompt, a.token_ids[: index + 1])[index]
        assert tie_gap(at, a.token_ids[index], b.token_ids[index]) <= _tolerance(local_cluster)


def test_a_deliberately_wrong_handle_fails_the_drift_check(local_cluster: ClusterRecord) -> None:
    """The check above is not vacuous: another session's handle behind a prompt fails it.

    Prefill pulls ``min(handle, prompt) - its own cached tokens``, and the SDK attaches no handle
    longer than the prompt. So the victim gets a fresh salt (prefill holds its turn 1's 640
    tokens of whole blocks, not the earlier tests' conversations), and the donor's handle (~700
    tokens) ends between those blocks and the victim's turn-2 prompt (~750): the tokens between
    are pulled from the donor.
    """
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "cluster.json"
        local_cluster.write(path)
        with agentkv.Cluster.from_file(path) as cluster, cluster.session(
            max_tokens=24, extra_body={**LOGPROBS, **_fresh_salt()}
        ) as victim, cluster.session(max_tokens=24, extra_body=LOGPROBS) as donor:
            victim.append(Message.system(SYSTEM))
            donor.append(Message.system(OTHER_SYSTEM))
            first = victim.send(QUESTIONS[0])
            donor.send("Which book is in row 3?")
            assert donor.handle is not None
            donor_tokens = len(donor.transcript.token_ids)
            # Deliberately wrong: the donor's pin behind the victim's prompt.
            victim._state.apply(kv.Step(kv.Pinned(handle=donor.handle)))
            donor._state.apply(kv.detached(donor._state.kv))
            wrong = victim.send(QUESTIONS[1])
            assert wrong.stats.handle_state is HandleState.ATTACHED
            prompt = _prompt_of(victim, wrong)
    assert donor_tokens <= len(prompt)
    # Prefill reused more than the whole blocks of turn 1 it held: the rest came from the donor.
    block = _block_size(local_cluster.pairs[0].prefill.url)
    assert wrong.stats.reused_tokens > first.stats.prompt_tokens // block * block
    with pytest.raises(AssertionError, match="wrong KV behind the prompt"):
        _assert_no_wrong_kv(local_cluster, [(wrong, prompt)])


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
    with agentkv.Cluster.from_file(cluster_file) as cluster, cluster.session(
        max_tokens=24, extra_body=_fresh_salt()
    ) as s:
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
    assert stats.reused_tokens == ideal


def test_a_fork_loads_a_copy_of_its_parents_pin_and_answers_as_a_fork_without_it(
    local_cluster: ClusterRecord, cluster_file: Path
) -> None:
    """``fork()`` copies the parent's pin to decode's file tier (decode keeps the pin): the
    fork's first turn loads the whole parent history from the tier, answers as a fork without
    the copy does (greedy, within the dtype's drift of a cold recompute), and the parent's next
    turn still pulls its own pin."""
    extra_body = {**LOGPROBS, **_fresh_salt()}
    with agentkv.Cluster.from_file(cluster_file) as cluster, cluster.session(
        max_tokens=24, extra_body=extra_body
    ) as parent:
        parent.append(Message.system(SYSTEM))
        parent.send(QUESTIONS[0])
        parent.send(QUESTIONS[1])
        runs: list[list[Turn]] = []
        for copy_kv in (True, False):
            # The fork without the copy under a salt of its own: prefill's cache of the first
            # fork's prompt would otherwise serve it.
            salt = {} if copy_kv else {"extra_body": {**LOGPROBS, **_fresh_salt()}}
            with parent.fork(copy_kv=copy_kv) as child:
                result = child.send(QUESTIONS[2], **salt)
                runs.append([(result, _prompt_of(child, result))])
        after = parent.send(QUESTIONS[3]).stats
    with_copy, without = runs[0][0][0].stats, runs[1][0][0].stats
    assert with_copy.handle_state is HandleState.TIER, with_copy.handle_reason
    assert with_copy.reused_tokens == with_copy.ideal_reused_tokens > 0, with_copy
    assert without.handle_state is HandleState.NONE
    assert without.reused_tokens == 0
    assert after.handle_state is HandleState.ATTACHED, after.handle_reason
    assert after.reused_tokens == after.ideal_reused_tokens
    _assert_same_answers(local_cluster, runs[0], runs[1])
