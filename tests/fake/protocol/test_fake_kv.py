"""The P/D protocol and KV reuse on the fake pair, as vLLM's NixlConnector does them:
prefill and decode handles, pins, pulls of prompt + generated - 1 tokens, the recompute
threshold, single-use handles, expiry (with its 5 s margin), leases of unread prefill
blocks, and KV usage."""

from __future__ import annotations

import httpx2
import pytest
from raw_protocol import (
    DECODE_HANDLE_KEYS,
    FIRST_LEG,
    HANDLE_KEYS,
    TOK,
    cached,
    leg,
    metric,
    next_turn,
    post,
    prompt_of_length,
    turn,
    user,
)

from agentkv.testing import FakeCluster, ManualClock


def test_prefill_leg_answers_with_a_prefill_handle(
    client: httpx2.Client, fake: FakeCluster
) -> None:
    ids = prompt_of_length(100)
    p = leg(client, fake.prefill(0).url, ids, FIRST_LEG, max_tokens=1)
    params = p["kv_transfer_params"]
    assert set(params) == HANDLE_KEYS | {"remote_prefill_cached_tokens"}
    assert params["do_remote_prefill"] is True
    assert params["do_remote_decode"] is False
    assert params["remote_engine_id"] == fake.prefill(0).engine_id
    assert params["remote_request_id"].startswith(p["id"] + "-")
    assert params["remote_num_tokens"] == 100
    assert params["remote_blocks_expiry_time"] is None
    assert params["transfer_mode"] == "pull"
    assert (params["tp_size"], params["dcp_size"], params["pp_size"]) == (1, 1, 1)
    assert len(params["remote_block_ids"]) == 1  # one list per KV cache group
    assert len(params["remote_block_ids"][0]) == 7  # ceil(100 / 16)
    assert p["usage"]["completion_tokens"] == 1
    assert p["choices"][0]["finish_reason"] == "length"
    assert fake.prefill(0).pending_prefill_handles == 1


def test_decode_leg_pins_the_turn_end_kv_and_returns_a_decode_handle(
    client: httpx2.Client, fake: FakeCluster, clock: ManualClock
) -> None:
    ids = prompt_of_length(100)
    p, d = turn(client, fake, ids)
    handle = d["kv_transfer_params"]
    generated = d["choices"][0]["token_ids"]
    assert set(handle) == DECODE_HANDLE_KEYS
    assert handle["do_remote_decode"] is True
    assert handle["do_remote_prefill"] is False
    assert handle["remote_engine_id"] == fake.decode(0).engine_id
    assert handle["remote_num_tokens"] == 100 + len(generated) - 1
    assert handle["remote_blocks_expiry_time"] == clock() + 480.0
    assert "prompt_token_ids" not in handle
    assert fake.decode(0).pinned_handles == 1
    assert fake.prefill(0).pending_prefill_handles == 0  # D read P's blocks
    assert fake.decode(0).kv_cache_usage > 0
    # P's first token is D's first token: same KV, greedy.
    assert p["choices"][0]["message"]["content"] == TOK.decode(generated[:1])


def test_decode_reports_the_cached_tokens_prefill_passed_on(
    client: httpx2.Client, fake: FakeCluster
) -> None:
    ids = prompt_of_length(300)
    leg(client, fake.prefill(0).url, ids, None, max_tokens=1)  # warm P's prefix cache
    p, d = turn(client, fake, ids)
    assert cached(p) == 288  # whole blocks, never the last token
    assert p["kv_transfer_params"]["remote_prefill_cached_tokens"] == 288
    assert cached(d) == 288
    # Without P's figure, D reports its own hit rate: all transferred tokens count.
    p = leg(client, fake.prefill(1).url, ids, FIRST_LEG, max_tokens=1)
    params = {
        k: v for k, v in p["kv_transfer_params"].items() if k != "remote_prefill_cached_tokens"
    }
    d = leg(client, fake.decode(1).url, ids, params)
    assert cached(d) == 300


def test_two_turns_reuse_prompt_plus_generated_minus_one_as_measured_on_vllm(
    clock: ManualClock,
) -> None:
    """DESIGN: 942 prompt + 160 generated tokens, 128-token blocks: turn 2's P caches 1101."""
    fake = FakeCluster(pairs=1, block_size=128, clock=clock)
    with httpx2.Client(transport=fake.transport) as client:
        ids = prompt_of_length(942)
        _, d = turn(client, fake, ids, max_tokens=160, ignore_eos=True)
        generated = d["choices"][0]["token_ids"]
        assert len(generated) == 160
        assert d["kv_transfer_params"]["remote_num_tokens"] == 1101
        assert metric(client, fake.decode(0).url, "vllm:kv_cache_usage_perc") == pytest.approx(
            9 / 364
        )
        transfers = "vllm:nixl_bytes_transferred_count"
        assert metric(client, fake.prefill(0).url, transfers) == 0
        ids2 = next_turn(ids, generated, "And Germany?")
        p2, d2 = turn(client, fake, ids2, handle=d["kv_transfer_params"])
        assert cached(p2) == 1101
        assert metric(client, fake.prefill(0).url, transfers) == 1
        assert cached(d2) == 1101
        assert fake.wrong_reuse_events == 0


def test_reused_kv_gives_the_same_output_as_a_cold_run(
    client: httpx2.Client, fake: FakeCluster, clock: ManualClock
) -> None:
    ids = prompt_of_length(200)
    _, d = turn(client, fake, ids, max_tokens=100, ignore_eos=True)
    ids2 = next_turn(ids, d["choices"][0]["token_ids"], "More.")
    p2, warm = turn(client, fake, ids2, handle=d["kv_transfer_params"])
    assert cached(p2) == 299
    cold_cluster = FakeCluster(pairs=1, clock=clock)
    with httpx2.Client(transport=cold_cluster.transport) as cold_client:
        _, cold = turn(cold_client, cold_cluster, ids2)
    assert cached(cold) == 0
    assert warm["choices"][0]["token_ids"] == cold["choices"][0]["token_ids"]
    assert fake.wrong_reuse_events == 0


def test_wrong_history_with_a_handle_changes_the_output_and_counts_wrong_reuse(
    client: httpx2.Client, fake: FakeCluster, clock: ManualClock
) -> None:
    ids = prompt_of_length(200)
    _, d = turn(client, fake, ids, max_tokens=100, ignore_eos=True)
    generated = d["choices"][0]["token_ids"]
    # A history that was edited early on (compacted, re-rendered...) sent with the old handle.
    edited = next_turn(ids, generated, "More.")
    edited[40] = TOK.token_to_id("y")
    p2, wrong = turn(client, fake, edited, handle=d["kv_transfer_params"])
    assert cached(p2) == 299  # vLLM reports the reuse all the same
    # P's pull from D, then D's pull of P's (now wrong) blocks.
    assert fake.wrong_reuse_events == 2
    cold_cluster = FakeCluster(pairs=1, clock=clock)
    with httpx2.Client(transport=cold_cluster.transport) as cold_client:
        _, cold = turn(cold_client, cold_cluster, edited)
    assert wrong["choices"][0]["token_ids"] != cold["choices"][0]["token_ids"]


def test_a_pull_below_the_recompute_threshold_recomputes_but_consumes_the_handle(
    client: httpx2.Client, fake: FakeCluster
) -> None:
    ids = prompt_of_length(100)
    _, d = turn(client, fake, ids, max_tokens=10, ignore_eos=True)
    ids2 = next_turn(ids, d["choices"][0]["token_ids"], "Ok")
    p2 = leg(client, fake.prefill(0).url, ids2, d["kv_transfer_params"], max_tokens=1)
    # P's own cache has 96 tokens; D would add 109 - 96 = 13 < 64: recompute.
    assert cached(p2) == 96
    assert fake.decode(0).pinned_handles == 0


def test_a_consumed_handle_frees_the_decode_blocks(
    client: httpx2.Client, fake: FakeCluster
) -> None:
    ids = prompt_of_length(200)
    _, d = turn(client, fake, ids, max_tokens=100, ignore_eos=True)
    assert fake.decode(0).kv_cache_usage > 0
    ids2 = next_turn(ids, d["choices"][0]["token_ids"], "Next")
    leg(client, fake.prefill(0).url, ids2, d["kv_transfer_params"], max_tokens=1)
    assert fake.decode(0).pinned_handles == 0
    assert metric(client, fake.decode(0).url, "vllm:kv_cache_usage_perc") == 0.0


def test_a_handle_read_twice_returns_whatever_the_freed_blocks_hold(clock: ManualClock) -> None:
    """vLLM does not refuse a second read: D logs it, P gets the blocks' current content."""
    fake = FakeCluster(pairs=2, clock=clock, num_kv_blocks=40)
    with httpx2.Client(transport=fake.transport) as client:
        ids = prompt_of_length(150)
        _, d = turn(client, fake, ids, max_tokens=60, ignore_eos=True)
        handle = d["kv_transfer_params"]
        ids2 = next_turn(ids, d["choices"][0]["token_ids"], "Next")
        first = leg(client, fake.prefill(0).url, ids2, handle, max_tokens=1)
        assert cached(first) == 209
        assert fake.wrong_reuse_events == 0
        # D reuses the freed blocks for another request...
        leg(client, fake.decode(0).url, prompt_of_length(600), None, max_tokens=1)
        # ...then the same handle is pulled again (by another prefill server).
        second = leg(client, fake.prefill(1).url, ids2, handle, max_tokens=1)
        assert cached(second) == 209
        assert fake.wrong_reuse_events == 1
        after_expiry = "vllm:nixl_num_notifications_after_expiry_total"
        assert metric(client, fake.decode(0).url, after_expiry) == 1


def test_an_expired_handle_fails_the_prefill_leg_with_a_500(
    client: httpx2.Client, fake: FakeCluster
) -> None:
    ids = prompt_of_length(200)
    _, d = turn(client, fake, ids, max_tokens=100, ignore_eos=True)
    fake.advance(480.0)
    assert fake.decode(0).pinned_handles == 0
    ids2 = next_turn(ids, d["choices"][0]["token_ids"], "Next")
    body = {
        "messages": user("x"),
        "max_tokens": 1,
        "kv_transfer_params": {**d["kv_transfer_params"], "prompt_token_ids": ids2},
    }
    response = post(client, fake.prefill(0).url, body)
    assert response.status_code == 500
    assert response.json() == {
        "error": {
            "message": "Internal server error",
            "type": "InternalServerError",
            "param": None,
            "code": 500,
        }
    }
    assert metric(client, fake.prefill(0).url, "vllm:nixl_num_kv_expired_reqs_total") == 1


def test_a_handle_within_five_seconds_of_expiry_is_declined(
    client: httpx2.Client, fake: FakeCluster
) -> None:
    ids = prompt_of_length(200)
    _, d = turn(client, fake, ids, max_tokens=100, ignore_eos=True)
    fake.advance(475.5)
    assert fake.decode(0).pinned_handles == 1
    ids2 = next_turn(ids, d["choices"][0]["token_ids"], "Next")
    body = {
        "messages": user("x"),
        "max_tokens": 1,
        "kv_transfer_params": {**d["kv_transfer_params"], "prompt_token_ids": ids2},
    }
    assert post(client, fake.prefill(0).url, body).status_code == 500
    assert fake.decode(0).pinned_handles == 1  # D was never told: it keeps the pin to the TTL
    fake.advance(5.0)
    assert fake.decode(0).pinned_handles == 0


def test_the_decode_server_pins_after_every_request_with_kv_transfer_params(
    client: httpx2.Client, fake: FakeCluster
) -> None:
    ids = prompt_of_length(50)
    leg(client, fake.decode(0).url, ids, None)
    assert fake.decode(0).pinned_handles == 0
    turn(client, fake, ids)
    turn(client, fake, prompt_of_length(60))
    assert fake.decode(0).pinned_handles == 2
    leg(client, fake.decode(0).url, ids, {"do_remote_decode": False})
    assert fake.decode(0).pinned_handles == 3


def test_a_handle_from_a_restarted_decode_server_fails_the_pull(
    client: httpx2.Client, fake: FakeCluster
) -> None:
    ids = prompt_of_length(200)
    _, d = turn(client, fake, ids, max_tokens=100, ignore_eos=True)
    fake.decode(0).restart()
    assert fake.decode(0).pinned_handles == 0
    ids2 = next_turn(ids, d["choices"][0]["token_ids"], "Next")
    body = {
        "messages": user("x"),
        "max_tokens": 1,
        "kv_transfer_params": {**d["kv_transfer_params"], "prompt_token_ids": ids2},
    }
    assert post(client, fake.prefill(0).url, body).status_code == 500
    assert metric(client, fake.prefill(0).url, "vllm:nixl_num_failed_transfers_total") == 1


def test_kv_cache_usage_follows_pins(client: httpx2.Client, fake: FakeCluster) -> None:
    decode = fake.decode(0).url
    assert metric(client, decode, "vllm:kv_cache_usage_perc") == 0.0
    turn(client, fake, prompt_of_length(160))
    assert metric(client, decode, "vllm:kv_cache_usage_perc") > 0.0
    fake.advance(480.0)
    assert metric(client, decode, "vllm:kv_cache_usage_perc") == 0.0


def test_a_rejected_decode_leg_still_frees_the_prefill_blocks(
    client: httpx2.Client, fake: FakeCluster
) -> None:
    ids = prompt_of_length(60)
    p = leg(client, fake.prefill(0).url, ids, FIRST_LEG, max_tokens=1)
    assert fake.prefill(0).pending_prefill_handles == 1
    body = {
        "messages": user("x"),
        "model": "other-model",
        "kv_transfer_params": {**p["kv_transfer_params"], "prompt_token_ids": ids},
    }
    assert post(client, fake.decode(0).url, body).status_code == 404
    assert fake.prefill(0).pending_prefill_handles == 0


def test_an_unread_prefill_handle_is_released_after_the_lease(
    client: httpx2.Client, fake: FakeCluster
) -> None:
    ids = prompt_of_length(60)
    p = leg(client, fake.prefill(0).url, ids, FIRST_LEG, max_tokens=1)
    fake.advance(30.0)
    assert fake.prefill(0).pending_prefill_handles == 0
    # D still reads the freed blocks (as vLLM would); P logs a late notification.
    d = leg(client, fake.decode(0).url, ids, p["kv_transfer_params"])
    assert d["choices"][0]["finish_reason"] == "stop"
    late = "vllm:nixl_num_notifications_after_expiry_total"
    assert metric(client, fake.prefill(0).url, late) == 1
    # Nothing reused the blocks, so their content is still right; the strict fake counts the
    # read of freed KV as wrong all the same (another request could have had them).
    assert fake.wrong_reuse_events == 1
