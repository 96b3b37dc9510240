"""Sessions and decode's file tier, on the fake pair: persist frees decode, resume reuses.

Facts come from the fake servers (pins, leases, KV usage, the tier's entries, the P legs'
``kv_transfer_params``) and from ``fake.wrong_reuse_events``, not from the SDK's bookkeeping.
The fake tier keeps entries as ``agentkv/connector/_tier_store.py`` does (token-exact prefix,
at most prompt - 1 tokens, a checksum per block, a byte budget with LRU eviction).
"""

from __future__ import annotations

import dataclasses
import json

import httpx2
import pytest
from structlog.testing import capture_logs

from agentkv import (
    AsyncCluster,
    CachePolicy,
    Cluster,
    ConfigError,
    HandleState,
    Message,
    RetryPolicy,
    TierRef,
)
from agentkv._client import kv
from agentkv._wire.handoff import lease_ref
from agentkv._wire.tier import LEGACY_OFFLOAD_PATH, TIER_DELETE_PATH
from agentkv.testing import FakeCluster
from tests.fake.old_saves import as_version_3

SYSTEM = Message.system("You are a helpful assistant. Answer in one or two sentences. " * 4)
QUESTIONS = [
    "What is the capital of France? Explain the history of the city in detail please.",
    "And what about Spain?",
    "Which of the two is bigger?",
]
LONG = {"max_tokens": 100, "extra_body": {"min_tokens": 70}}


ONE_ATTEMPT = RetryPolicy(max_attempts=1)
pytestmark = [
    pytest.mark.fake(pairs=1, tier=True),
    pytest.mark.cluster(manual_clock=True, block_size=16, retry=ONE_ATTEMPT),
]


def open_cluster(fake, clock, **kwargs):
    kwargs.setdefault("retry", ONE_ATTEMPT)
    return Cluster.from_dict(
        fake.cluster_spec, transport=fake.transport, clock=clock, block_size=16, **kwargs
    )


def events(logs, name):
    return [entry for entry in logs if entry["event"] == name]


def tier_refs(server):
    """The tier reference each chat request to ``server`` carried (None: none)."""
    return [
        (body["kv_transfer_params"].get("agentkv") or {}).get("tier") for body in server.requests
    ]


def prefill_cache_cold(fake):
    """Forget prefill's prefix cache, so that reuse can only come from decode or the tier."""
    fake.prefill(0).restart()


# --- persist ---------------------------------------------------------------------------------


def test_persist_frees_decode_and_the_next_turn_reuses_the_ideal_from_the_tier(cluster, fake):
    decode, prefill = fake.decode(0), fake.prefill(0)
    idle = decode.kv_cache_usage
    with cluster.session(**LONG) as s:
        s.append(SYSTEM)
        s.send(QUESTIONS[0])
        assert decode.leased_handles == 1
        ref = s.offload()
        assert isinstance(ref, TierRef)
        assert s.tier == ref
        assert s.handle is None
        assert (decode.pinned_handles, decode.leased_handles) == (0, 0)
        assert decode.kv_cache_usage == idle
        assert fake.tier.ids == [ref.id]
        prefill_cache_cold(fake)
        result = s.send(QUESTIONS[1])
        stats = result.stats
        assert stats.handle_state is HandleState.TIER
        assert stats.ideal_reused_tokens == ref.n_tokens
        assert stats.reused_tokens == ref.n_tokens  # prefill's own count (cached_tokens)
        assert tier_refs(prefill)[-1] == ref.to_wire()
        # The turn superseded the entry: it is deleted in the background.
        assert s.tier is None
    assert fake.tier.ids == []
    assert fake.wrong_reuse_events == 0


async def test_an_async_persist_and_the_tier_turn_answer_as_a_never_interrupted_session(
    fake, clock
):
    reference = FakeCluster(pairs=1, clock=clock, tier=True)
    answers = {}
    for name, cluster_fake in (("tier", fake), ("pinned", reference)):
        async with AsyncCluster.from_dict(
            cluster_fake.cluster_spec, transport=cluster_fake.transport, clock=clock
        ) as cluster, cluster.session(**LONG) as s:
            s.append(SYSTEM)
            await s.send(QUESTIONS[0])
            if name == "tier":
                assert await s.offload() is not None
                cluster_fake.prefill(0).restart()
            answers[name] = [(await s.send(q)).token_ids for q in QUESTIONS[1:]]
    assert answers["tier"] == answers["pinned"]
    assert fake.wrong_reuse_events == 0


def test_turn_persist_disk_persists_right_after_the_turn(cluster, fake):
    decode = fake.decode(0)
    with cluster.session(**LONG) as s:
        s.append(SYSTEM)
        with capture_logs() as logs:
            s.send(QUESTIONS[0], offload="always")
        assert s.tier is not None
        assert s.handle is None
        assert decode.leased_handles == 0
        [event] = events(logs, "agentkv.offload")
        assert (event["reason"], event["outcome"]) == ("turn", "ok")
        assert s.send(QUESTIONS[1]).stats.handle_state is HandleState.TIER


def test_a_stream_with_persist_disk_persists_after_its_result(cluster, fake):
    with cluster.session(**LONG) as s:
        s.append(SYSTEM, Message.user(QUESTIONS[0]))
        list(s.stream(offload="always"))
        assert s.tier is not None
        assert fake.decode(0).leased_handles == 0


def test_an_offload_mode_that_does_not_exist_is_refused_before_anything_is_sent(cluster, fake):
    with cluster.session() as s:
        with pytest.raises(ValueError, match="offload must be one of"):
            s.send(QUESTIONS[0], offload="ssd")  # type: ignore[arg-type]
        assert fake.prefill(0).requests == []


def test_persist_without_a_tier_keeps_the_pin_and_returns_none(clock):
    fake = FakeCluster(pairs=1, clock=clock)  # no agentkv_tier_dir
    with open_cluster(fake, clock) as cluster, cluster.session(**LONG) as s:
        s.append(SYSTEM)
        s.send(QUESTIONS[0])
        handle = s.handle
        with capture_logs() as logs:
            assert s.offload() is None
        assert s.handle is handle
        assert s.tier is None
        assert fake.decode(0).leased_handles == 1
        [event] = events(logs, "agentkv.offload")
        assert (event["status"], event["detail"]) == (501, "tier_unavailable")
        assert s.send(QUESTIONS[1]).stats.handle_state is HandleState.ATTACHED


def test_a_failed_write_keeps_the_pin(clock):
    fake = FakeCluster(pairs=1, clock=clock, tier=True, tier_budget_bytes=1)
    with open_cluster(fake, clock) as cluster, cluster.session(**LONG) as s:
        s.append(SYSTEM)
        s.send(QUESTIONS[0])
        with capture_logs() as logs:
            assert s.offload() is None
        assert fake.decode(0).leased_handles == 1
        assert s.handle is not None
        [event] = events(logs, "agentkv.offload")
        assert (event["status"], event["detail"]) == (500, "tier_write_failed")
        assert s.send(QUESTIONS[1]).stats.handle_state is HandleState.ATTACHED


def test_the_routes_answer_as_the_connector_does(fake):
    client = httpx2.Client(transport=fake.transport)
    url = fake.decode(0).url
    unknown = {"remote_request_id": "x", "remote_block_ids": [[1]], "lease": "0" * 32}
    assert client.post(url + LEGACY_OFFLOAD_PATH, json=unknown).status_code == 404
    assert client.post(url + LEGACY_OFFLOAD_PATH, json={}).status_code == 400
    answer = client.post(url + TIER_DELETE_PATH, json={"id": "f" * 32, "secret": "a" * 22})
    assert (answer.status_code, answer.json()["error"]["code"]) == (404, "unknown_lease")
    assert client.post(url + TIER_DELETE_PATH, json={"id": "f" * 32}).status_code == 400
    assert client.post(url + TIER_DELETE_PATH, json={"id": "../etc"}).status_code == 400
    info = client.get(url + "/v1/agentkv/info").json()
    assert info["tier"]["entries"] == 0
    assert info["tier"]["budget_bytes"] == 4 << 30
    no_tier = FakeCluster(pairs=1)
    answer = httpx2.Client(transport=no_tier.transport).post(
        no_tier.decode(0).url + TIER_DELETE_PATH, json={"id": "f" * 32, "secret": "a" * 22}
    )
    assert (answer.status_code, answer.json()["error"]["code"]) == (501, "tier_unavailable")


# --- the entry's secret and TTL -----------------------------------------------------------------


def test_only_the_persisting_session_holds_the_secret_and_prefill_never_sees_it(cluster, fake):
    with cluster.session(**LONG) as s:
        s.append(SYSTEM)
        s.send(QUESTIONS[0])
        ref = s.offload()
        assert ref is not None
        assert ref.secret is not None
        assert ref.secret not in repr(ref)
        s.send(QUESTIONS[1])
        [sent] = [t for t in tier_refs(fake.prefill(0)) if t is not None]
        assert sent == {"id": ref.id, "n_tokens": ref.n_tokens}


def test_a_delete_with_a_wrong_secret_is_refused_as_unknown_and_keeps_the_entry(cluster, fake):
    client = httpx2.Client(transport=fake.transport)
    url = fake.decode(0).url + TIER_DELETE_PATH
    with capture_logs() as logs, cluster.session(**LONG) as s:
        s.append(SYSTEM)
        s.send(QUESTIONS[0])
        ref = s.offload()
        assert ref is not None
        answer = client.post(url, json={"id": ref.id, "secret": "an-attacker-s-guess"})
        assert (answer.status_code, answer.json()["error"]["code"]) == (404, "unknown_lease")
        assert fake.tier.ids == [ref.id]
    assert fake.tier.ids == []  # the owner's close showed the secret
    [event] = events(logs, "agentkv.tier_delete")
    assert (event["reason"], event["outcome"]) == ("close", "ok")


def test_an_expired_entry_is_recomputed_and_removed(cluster, fake, clock):
    """Past its TTL (24 h by default) an entry is not served, whatever the session thinks."""
    with cluster.session(**LONG) as s:
        s.append(SYSTEM)
        s.send(QUESTIONS[0])
        ref = s.offload()
        assert ref is not None
        clock.advance(24 * 3600)
        prefill_cache_cold(fake)
        stats = s.send(QUESTIONS[1]).stats
        assert stats.handle_state is HandleState.TIER  # sent: the SDK cannot know
        assert stats.reused_tokens == 0
        assert fake.tier.ids == []
    assert fake.wrong_reuse_events == 0


def test_a_bad_ttl_is_a_400_and_the_pin_is_kept(cluster, fake):
    client = httpx2.Client(transport=fake.transport)
    with cluster.session(**LONG) as s:
        s.append(SYSTEM)
        s.send(QUESTIONS[0])
        body = lease_ref(s.handle).to_wire()
        for bad in (-1, 0, "600", True):
            url = fake.decode(0).url + LEGACY_OFFLOAD_PATH
            answer = client.post(url, json={**body, "ttl_s": bad})
            assert (answer.status_code, answer.json()["error"]["code"]) == (400, "invalid_request")
        assert fake.decode(0).leased_handles == 1
        assert fake.tier.ids == []
        assert s.offload() is not None


def test_the_policy_s_tier_ttl_is_asked_for_and_capped_by_decode(fake, clock):
    for asked, granted in ((600.0, 600.0), (1e9, 7 * 24 * 3600.0)):
        policy = CachePolicy(tier_ttl_s=asked)
        with (
            open_cluster(fake, clock, policy=policy) as cluster,
            capture_logs() as logs,
            cluster.session(**LONG) as s,
        ):
            s.append(SYSTEM)
            s.send(QUESTIONS[0])
            ref = s.offload()
            assert ref is not None
            assert fake.tier.entries[ref.id].expires == clock() + granted
            [event] = events(logs, "agentkv.offload")
            assert event["ttl_s"] == granted
    with pytest.raises(ConfigError, match="tier_ttl_s"):
        CachePolicy(tier_ttl_s=0)


# --- tool_wait ---------------------------------------------------------------------------------


def test_a_long_tool_wait_persists_instead_of_holding_the_pin(cluster, fake, clock):
    decode = fake.decode(0)
    with cluster.session(**LONG) as s:
        s.append(SYSTEM)
        s.send(QUESTIONS[0])
        with s.tool_wait(expected_s=3600) as wait:
            assert decode.leased_handles == 0
            clock.advance(3600)
        assert wait.persisted
        assert wait.survived
        assert not wait.extended
        assert wait.tier_decision is not None
        assert wait.tier_decision.action == "persist"
        prefill_cache_cold(fake)
        stats = s.send(QUESTIONS[1]).stats
        assert stats.handle_state is HandleState.TIER
        assert stats.reused_tokens == stats.ideal_reused_tokens
        assert "persisted to the file tier" in stats.handle_reason
    assert fake.wrong_reuse_events == 0


def test_a_short_tool_wait_keeps_the_pin(cluster, fake):
    with cluster.session(**LONG) as s:
        s.append(SYSTEM)
        s.send(QUESTIONS[0])
        with s.tool_wait(expected_s=5) as wait:
            pass
        assert not wait.persisted
        assert s.tier is None
        assert fake.decode(0).leased_handles == 1
        assert s.send(QUESTIONS[1]).stats.handle_state is HandleState.ATTACHED


@pytest.mark.parametrize(("pressure", "persisted"), [(0.0001, True), (1.0, False)])
def test_a_short_tool_wait_persists_when_decode_memory_is_past_the_policy_s_pressure(
    fake, clock, pressure, persisted
):
    """The wait alone keeps the pin; decode's own kv_cache_usage_perc (its /metrics) at or past
    ``persist_kv_usage`` moves the KV to the tier anyway."""
    from agentkv import CachePolicy

    policy = CachePolicy(persist_kv_usage=pressure)
    with open_cluster(fake, clock, policy=policy) as cluster, cluster.session(**LONG) as s:
        s.append(SYSTEM)
        s.send(QUESTIONS[0])
        assert fake.decode(0).kv_cache_usage > pressure or not persisted
        with s.tool_wait(expected_s=5) as wait:
            pass
        assert wait.persisted is persisted
        assert wait.tier_decision is not None
        if persisted:
            assert "decode KV usage" in wait.tier_decision.reason
            assert fake.decode(0).leased_handles == 0
        stats = s.send(QUESTIONS[1]).stats
        assert stats.reused_tokens == stats.ideal_reused_tokens
    assert fake.wrong_reuse_events == 0


def test_tool_wait_pin_extends_as_before_and_disk_persists_a_short_wait(cluster, fake):
    with cluster.session(**LONG) as s:
        s.append(SYSTEM)
        s.send(QUESTIONS[0])
        with s.tool_wait(expected_s=3600, offload="never") as wait:
            pass
        assert wait.extended
        assert not wait.persisted
        with s.tool_wait(expected_s=1, offload="always") as wait:
            pass
        assert wait.persisted
        assert s.tier is not None


# --- divergence, damage, eviction ----------------------------------------------------------------


def test_a_diverged_history_never_sends_the_tier_ref(cluster, fake):
    prefill = fake.prefill(0)
    with cluster.session(**LONG) as s:
        s.append(SYSTEM)
        first = s.send(QUESTIONS[0])
        assert s.offload() is not None
        # An edited history: another session's state with this one's tier entry.
        state = s._state
        state.apply(kv.Step(dataclasses.replace(state.kv, digest="0" * 32)))
        result = s.send(QUESTIONS[1])
        assert result.stats.handle_state is HandleState.DIVERGED
        assert tier_refs(prefill)[-1] is None
        assert first.stats.turn == 1
    assert fake.tier.ids == []  # the obsolete entry went anyway
    assert fake.wrong_reuse_events == 0


def _turn_after_damage(s, fake, damage):
    """One turn, persisted, its tier entry damaged (``None``: left intact), prefill's cache
    cold: the next turn's stats."""
    s.append(SYSTEM)
    s.send(QUESTIONS[0])
    ref = s.offload()
    assert ref is not None
    if damage == "corrupt":
        fake.tier.corrupt(ref.id, block=1)
    elif damage == "truncate":
        fake.tier.truncate(ref.id, blocks=1)
    elif damage == "drop":
        fake.tier.drop(ref.id)
    prefill_cache_cold(fake)
    return s.send(QUESTIONS[1]).stats


@pytest.mark.parametrize("damage", ["corrupt", "truncate", "drop"])
def test_a_damaged_tier_entry_is_recomputed_never_served(cluster, fake, damage):
    with cluster.session(**LONG) as s:
        stats = _turn_after_damage(s, fake, damage)
        assert stats.handle_state is HandleState.TIER  # sent; prefill cut what it could not verify
        assert stats.reused_tokens == (0 if damage == "drop" else 16)
        assert stats.reused_tokens < stats.ideal_reused_tokens
    assert fake.wrong_reuse_events == 0


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (None, None),
        ("corrupt", "the tier's blocks from token 16 on did not load intact"),
        ("truncate", "the tier entry's data ends before token 16"),
        ("drop", "the tier entry is gone"),
    ],
)
def test_prefill_s_reason_for_a_short_tier_load_is_in_the_turn_s_handle_reason(
    cluster, fake, damage, reason
):
    """Prefill's answer says why it served less than the entry holds; the turn says it too."""
    with cluster.session(**LONG) as s:
        stats = _turn_after_damage(s, fake, damage)
        assert stats.handle_state is HandleState.TIER
        if reason is None:
            assert "tier" not in stats.handle_reason
        else:
            assert reason in stats.handle_reason
            assert "recomputed" in stats.handle_reason


def test_an_entry_evicted_by_the_budget_is_survived_by_recomputing(clock):
    fake = FakeCluster(pairs=1, clock=clock, tier=True, tier_budget_bytes=300 * 23_040)
    with open_cluster(fake, clock) as cluster:
        a, b = cluster.session(**LONG), cluster.session(**LONG)
        for s, question in ((a, QUESTIONS[0]), (b, QUESTIONS[2])):
            s.append(SYSTEM)
            s.send(question)
        ref_a = a.offload()
        ref_b = b.offload()
        assert ref_a is not None
        assert ref_b is not None
        assert fake.tier.ids == [ref_b.id]  # a's entry was least recently used
        prefill_cache_cold(fake)
        stats = a.send(QUESTIONS[1]).stats
        assert stats.handle_state is HandleState.TIER
        assert stats.reused_tokens == 0
        assert b.send(QUESTIONS[1]).stats.reused_tokens == ref_b.n_tokens
        a.close()
        b.close()
    assert fake.wrong_reuse_events == 0


# --- lifecycle: close, save/load, moves -------------------------------------------------------


def test_closing_a_session_deletes_its_tier_entry(cluster, fake):
    with capture_logs() as logs, cluster.session(**LONG) as s:
        s.append(SYSTEM)
        s.send(QUESTIONS[0])
        assert s.offload() is not None
        assert len(fake.tier.ids) == 1
    assert fake.tier.ids == []
    [event] = events(logs, "agentkv.tier_delete")
    assert (event["reason"], event["detail"]) == ("close", "deleted True")


def test_save_and_load_resume_from_the_tier(fake, clock, tmp_path):
    path = tmp_path / "run.json"
    with open_cluster(fake, clock) as cluster:
        s = cluster.session(**LONG)
        s.append(SYSTEM)
        s.send(QUESTIONS[0])
        ref = s.offload()
        s.save(path)
        s.detach()  # the process "exits": the entry is the file's
    assert fake.tier.ids == [ref.id]
    saved = json.loads(path.read_text())
    assert saved["kv"]["kind"] == "tier"
    assert saved["kv"]["id"] == ref.id
    assert saved["kv"]["secret"] == ref.secret
    prefill_cache_cold(fake)
    with open_cluster(fake, clock) as cluster, cluster.load_session(path) as s:
        assert s.tier == ref
        stats = s.send(QUESTIONS[1]).stats
        assert stats.handle_state is HandleState.TIER
        assert stats.reused_tokens == ref.n_tokens
    assert fake.tier.ids == []
    assert fake.wrong_reuse_events == 0


def test_a_snapshot_without_a_tier_key_still_loads(fake, clock, tmp_path):
    path = tmp_path / "old.json"
    with open_cluster(fake, clock) as cluster, cluster.session(**LONG) as s:
        s.append(SYSTEM)
        s.send(QUESTIONS[0])
        data = s.snapshot()
    data = as_version_3(data)
    del data["tier"]
    path.write_text(json.dumps(data))
    with open_cluster(fake, clock) as cluster, cluster.load_session(path) as s:
        assert s.tier is None
        s.send(QUESTIONS[1])


def test_a_session_saved_before_tier_secrets_resumes_but_cannot_delete_its_entry(
    fake, clock, tmp_path
):
    """An old file's reference has no secret: it resumes from the tier; its entry is left to
    its TTL on decode (no delete is sent)."""
    path = tmp_path / "old.json"
    with open_cluster(fake, clock) as cluster:
        s = cluster.session(**LONG)
        s.append(SYSTEM)
        s.send(QUESTIONS[0])
        ref = s.offload()
        data = s.snapshot()
        s.detach()
    del data["kv"]["secret"]
    path.write_text(json.dumps(data))
    with (
        capture_logs() as logs,
        open_cluster(fake, clock) as cluster,
        cluster.load_session(path) as s,
    ):
        assert s.tier == ref
        assert s.tier.secret is None
    assert fake.tier.ids == [ref.id]
    [event] = events(logs, "agentkv.tier_delete")
    assert (event["log_level"], event["status"], event["detail"]) == (
        "info", None, "no secret for this tier entry")  # nothing was sent
    clock.advance(24 * 3600)
    assert fake.tier.usage().entries == 0  # expired: swept


def test_a_session_moved_to_another_pair_drops_its_tier_ref(clock):
    fake = FakeCluster(pairs=2, clock=clock, tier=True)
    retry = RetryPolicy(max_attempts=3, initial_backoff_s=0, jitter_s=0)
    with open_cluster(fake, clock, retry=retry) as cluster, cluster.session(**LONG) as s:
        s.append(SYSTEM)
        s.send(QUESTIONS[0])
        assert s.offload() is not None
        fake.server(s.pair.prefill).kill()
        stats = s.send(QUESTIONS[1]).stats
        assert stats.handle_state is HandleState.INVALIDATED
        assert s.tier is None
        moved_prefill = fake.server(s.pair.prefill)
        assert tier_refs(moved_prefill) == [None]
    assert fake.wrong_reuse_events == 0


def test_the_old_persist_names_still_work_and_warn(cluster, fake):
    """``session.persist()``, ``persist=`` and the values ``"pin"``/``"disk"`` are the names of
    ``offload()``/``offload=`` before issue 41: they work for one release, with a warning."""
    with cluster.session(**LONG) as s:
        s.append(SYSTEM)
        with pytest.warns(DeprecationWarning, match="persist= is deprecated"):
            s.send(QUESTIONS[0], persist="disk")
        assert s.tier is not None  # "disk" still offloads right after the turn
        with pytest.warns(DeprecationWarning, match="offload='pin' is deprecated"):
            s.send(QUESTIONS[1], offload="pin")  # type: ignore[arg-type]
        assert s.tier is None
        assert s.handle is not None
        with pytest.warns(DeprecationWarning, match=r"session.persist\(\) is deprecated"):
            assert s.persist() is not None
        with pytest.raises(ValueError, match="offload must be one of"):
            s.send(QUESTIONS[2], offload="later")  # type: ignore[arg-type]
