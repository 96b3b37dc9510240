"""agentkv's cache hints and lease calls: the wire form both sides agree on, and what is refused."""

from __future__ import annotations

import hashlib
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agentkv._wire.hints import (
    HINTS_KEY,
    WIRE_VERSION,
    ExtendRequest,
    ExtendResult,
    HintError,
    LeaseAck,
    LeaseRef,
    PinHint,
    ServerInfo,
    for_prefill,
    new_request_secret,
    request_tag,
    with_expiry,
    with_hint,
)

HANDLE = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": "d-engine",
    "remote_request_id": "chatcmpl-7-1a2b3c4d",
    "remote_block_ids": [[3, 4, 9]],
    "remote_host": "127.0.0.1",
    "remote_port": 16001,
    "remote_num_tokens": 300,
    "remote_blocks_expiry_time": 1234.5,
    HINTS_KEY: {"v": 1, "pinned": True, "lease": "s3cret-lease", "ttl_s": 60.0},
}


def test_a_pin_hint_travels_under_the_namespaced_key_with_a_version() -> None:
    params = with_hint({"do_remote_prefill": True}, PinHint(ttl_s=30))
    assert params == {
        "do_remote_prefill": True,
        "agentkv": {"v": WIRE_VERSION, "persist": True, "ttl_s": 30.0},
    }


def test_a_final_turn_hint_says_do_not_pin_and_carries_no_ttl() -> None:
    assert PinHint(pin=False).to_wire() == {"v": 1, "persist": False}


def test_a_hint_without_ttl_leaves_the_server_default() -> None:
    assert PinHint().to_wire() == {"v": 1, "persist": True}
    assert PinHint.from_wire({"v": 1}) == PinHint()


@pytest.mark.parametrize("ttl", [0, -1, math.inf, math.nan, True, "60"])
def test_a_ttl_must_be_a_positive_finite_number(ttl: object) -> None:
    with pytest.raises(HintError):
        PinHint(ttl_s=ttl)  # type: ignore[arg-type]
    with pytest.raises(HintError):
        PinHint.from_wire({"v": 1, "persist": True, "ttl_s": ttl})


def test_a_ttl_with_pin_false_is_a_contradiction() -> None:
    with pytest.raises(HintError, match="no meaning"):
        PinHint(pin=False, ttl_s=10)


@pytest.mark.parametrize(
    "wire", [None, [], "persist", {"persist": True}, {"v": 2}, {"v": 1, "persist": "no"}]
)
def test_malformed_or_future_hints_are_refused(wire: object) -> None:
    with pytest.raises(HintError):
        PinHint.from_wire(wire)


@given(st.booleans(), st.one_of(st.none(), st.floats(min_value=0.001, max_value=1e6)))
def test_a_hint_round_trips_through_its_wire_form(pin: bool, ttl: float | None) -> None:
    if not pin:
        ttl = None
    hint = PinHint(pin=pin, ttl_s=ttl)
    assert PinHint.from_wire(hint.to_wire()) == hint


def test_the_ack_in_decodes_answer_tells_whether_the_extension_ran() -> None:
    assert LeaseAck.from_params({"remote_block_ids": [[1]]}) is None  # stock vLLM: no ack
    assert LeaseAck.from_params(HANDLE) == LeaseAck(pinned=True, lease="s3cret-lease", ttl_s=60.0)
    assert LeaseAck.from_params({HINTS_KEY: {"v": 1, "pinned": False}}) == LeaseAck(pinned=False)
    ack = LeaseAck(pinned=True, lease="x", ttl_s=5.0, error="bad hint")
    assert LeaseAck.from_params({HINTS_KEY: ack.to_wire()}) == ack


def test_a_pinned_ack_without_a_lease_secret_is_malformed() -> None:
    with pytest.raises(HintError, match="secret"):
        LeaseAck.from_params({HINTS_KEY: {"v": 1, "pinned": True}})


def test_the_lease_capability_is_request_id_blocks_and_secret_from_the_handle() -> None:
    ref = LeaseRef.from_handle(HANDLE)
    assert ref == LeaseRef(
        request_id="chatcmpl-7-1a2b3c4d", block_ids=((3, 4, 9),), lease="s3cret-lease"
    )
    assert LeaseRef.from_wire(ref.to_wire()) == ref
    assert ref.to_wire() == {
        "remote_request_id": "chatcmpl-7-1a2b3c4d",
        "remote_block_ids": [[3, 4, 9]],
        "lease": "s3cret-lease",
    }


def test_a_handle_from_stock_decode_has_no_lease_to_release() -> None:
    stock = {k: v for k, v in HANDLE.items() if k != HINTS_KEY}
    with pytest.raises(HintError, match="no agentkv lease"):
        LeaseRef.from_handle(stock)


@pytest.mark.parametrize(
    "change",
    [
        {"remote_request_id": ""},
        {"remote_request_id": 7},
        {"remote_block_ids": []},
        {"remote_block_ids": [[]]},
        {"remote_block_ids": [[1, -2]]},
        {"remote_block_ids": [[1, True]]},
        {"remote_block_ids": "1,2"},
        {"lease": None},
        {"lease": "x" * 513},
    ],
)
def test_malformed_lease_references_are_refused(change: dict[str, object]) -> None:
    body = {**LeaseRef.from_handle(HANDLE).to_wire(), **change}
    with pytest.raises(HintError):
        LeaseRef.from_wire(body)


def test_a_flat_block_list_is_one_kv_cache_group() -> None:
    ref = LeaseRef.from_wire({"remote_request_id": "r", "remote_block_ids": [1, 2], "lease": "s"})
    assert ref.block_ids == ((1, 2),)


def test_extend_carries_the_reference_and_a_ttl_and_answers_the_new_expiry() -> None:
    request = ExtendRequest(ref=LeaseRef.from_handle(HANDLE), ttl_s=120)
    assert ExtendRequest.from_wire(request.to_wire()) == request
    assert request.to_wire()["ttl_s"] == 120.0
    with pytest.raises(HintError):
        ExtendRequest.from_wire({**request.to_wire(), "ttl_s": 0})
    result = ExtendResult.from_wire({"remote_blocks_expiry_time": 9000.25, "ttl_s": 119.5})
    assert result == ExtendResult(expiry=9000.25, ttl_s=119.5)
    assert ExtendResult.from_wire(result.to_wire()) == result


def test_after_extend_the_handle_for_prefill_carries_the_new_expiry() -> None:
    extended = with_expiry(HANDLE, ExtendResult(expiry=9999.0, ttl_s=100.0))
    assert extended["remote_blocks_expiry_time"] == 9999.0
    assert HANDLE["remote_blocks_expiry_time"] == 1234.5  # the original is not changed


def test_the_prefill_leg_does_not_see_the_lease_secret() -> None:
    sent = for_prefill(HANDLE)
    assert HINTS_KEY not in sent
    assert sent["remote_block_ids"] == HANDLE["remote_block_ids"]


def test_server_info_round_trips_and_rejects_other_versions() -> None:
    info = ServerInfo(leases=True, stream_handles=True, default_ttl_s=480.0, max_ttl_s=3600.0)
    assert ServerInfo.from_wire(info.to_wire()) == info
    with pytest.raises(HintError):
        ServerInfo.from_wire({**info.to_wire(), "v": 0})


@given(st.text(min_size=1, max_size=64))
def test_a_request_tag_is_the_hex_sha256_of_its_secret(secret: str) -> None:
    """Decode's connector checks tags with hashlib: the client's digest must be the same."""
    digest = hashlib.sha256(secret.encode()).hexdigest()
    assert request_tag(secret) == "agentkv-" + digest
    fresh = new_request_secret()
    assert request_tag(fresh) == "agentkv-" + hashlib.sha256(fresh.encode()).hexdigest()
