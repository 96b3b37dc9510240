"""Faults the fake injects for the SDK's tests: error statuses, timeouts, resets, broken
bodies and handles, killed and restarted servers; malformed handles sent to it get an HTTP
answer, never an exception."""

from __future__ import annotations

import json
from typing import Any

import httpx2
import pytest
from raw_protocol import (
    FIRST_LEG,
    leg,
    metric,
    post,
    prompt_of_length,
    turn,
    user,
)

from agentkv.testing import FakeCluster


def test_fail_next_status_answers_with_vllm_error_body_once(
    client: httpx2.Client, fake: FakeCluster
) -> None:
    fake.prefill(0).fail_next("status", status=503, times=2)
    body = {"messages": user("x")}
    for _ in range(2):
        response = post(client, fake.prefill(0).url, body)
        assert response.status_code == 503
        assert response.json()["error"]["type"] == "ServiceUnavailableError"
        assert response.json()["error"]["code"] == 503
    assert post(client, fake.prefill(0).url, body).status_code == 200
    assert len(fake.prefill(0).requests) == 3


def test_timeout_fault_raises_read_timeout_after_the_server_did_the_work(
    client: httpx2.Client, fake: FakeCluster
) -> None:
    fake.decode(0).fail_next("timeout")
    ids = prompt_of_length(60)
    p = leg(client, fake.prefill(0).url, ids, FIRST_LEG, max_tokens=1)
    body = {
        "messages": user("x"),
        "kv_transfer_params": {**p["kv_transfer_params"], "prompt_token_ids": ids},
    }
    with pytest.raises(httpx2.ReadTimeout):
        post(client, fake.decode(0).url, body)
    assert fake.decode(0).pinned_handles == 1  # a pin the client never heard of


def test_reset_fault_drops_the_connection(client: httpx2.Client, fake: FakeCluster) -> None:
    fake.prefill(0).fail_next("reset")
    with pytest.raises(httpx2.RemoteProtocolError):
        post(client, fake.prefill(0).url, {"messages": user("x")})


@pytest.mark.parametrize("kind", ["malformed_json", "truncated_json"])
def test_broken_body_faults_give_undecodable_json(
    client: httpx2.Client, fake: FakeCluster, kind: str
) -> None:
    fake.prefill(0).fail_next(kind)
    response = post(client, fake.prefill(0).url, {"messages": user("x")})
    assert response.status_code == 200
    with pytest.raises(json.JSONDecodeError):
        response.json()


def test_kv_transfer_params_faults_drop_or_corrupt_the_handle(
    client: httpx2.Client, fake: FakeCluster
) -> None:
    ids = prompt_of_length(60)
    fake.prefill(0).fail_next("no_kv_transfer_params")
    missing = leg(client, fake.prefill(0).url, ids, FIRST_LEG, max_tokens=1)
    assert missing["kv_transfer_params"] is None
    fake.prefill(0).fail_next("bad_kv_transfer_params")
    bad = leg(client, fake.prefill(0).url, ids, FIRST_LEG, max_tokens=1)
    assert bad["kv_transfer_params"]["remote_block_ids"] == "corrupted"
    assert bad["kv_transfer_params"]["remote_engine_id"] is None


def test_fault_kinds_are_checked(fake: FakeCluster) -> None:
    with pytest.raises(ValueError, match="unknown fault kind"):
        fake.prefill(0).fail_next("explode")


def test_a_killed_server_refuses_connections_and_a_restart_loses_pins(
    client: httpx2.Client, fake: FakeCluster
) -> None:
    turn(client, fake, prompt_of_length(80))
    old_engine = fake.decode(0).engine_id
    fake.decode(0).kill()
    with pytest.raises(httpx2.ConnectError):
        client.get(fake.decode(0).url + "/health")
    assert fake.decode(0).pinned_handles == 0
    fake.decode(0).restart()
    assert client.get(fake.decode(0).url + "/health").status_code == 200
    assert fake.decode(0).engine_id != old_engine
    assert metric(client, fake.decode(0).url, "vllm:prompt_tokens_total") == 0


@pytest.mark.parametrize(
    "params",
    [
        {
            "do_remote_decode": True,
            "remote_block_ids": [[99999]],
            "remote_engine_id": "x",
            "remote_request_id": "r",
            "remote_host": "fake-d0.test",
            "remote_port": 5601,
            "remote_num_tokens": 500,
        },
        {
            "do_remote_prefill": True,
            "remote_block_ids": "abc",
            "remote_engine_id": None,
            "remote_request_id": None,
            "remote_host": None,
            "remote_port": None,
        },
        {"do_remote_prefill": True},
        {
            "do_remote_decode": True,
            "remote_block_ids": [[1, 2]],
            "remote_engine_id": [],
            "remote_request_id": {},
            "remote_host": ["h"],
            "remote_port": "p",
            "remote_num_tokens": "many",
        },
    ],
)
def test_malformed_handles_get_an_http_answer_never_an_exception(
    client: httpx2.Client, fake: FakeCluster, params: dict[str, Any]
) -> None:
    ids = prompt_of_length(200)
    response = post(
        client,
        fake.prefill(0).url,
        {
            "messages": user("x"),
            "max_tokens": 1,
            "kv_transfer_params": {**params, "prompt_token_ids": ids},
        },
    )
    assert response.status_code in (200, 500)
    assert "choices" in response.json() or "error" in response.json()
