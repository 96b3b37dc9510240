"""The KV file tier on the real local pair: persist on decode, resume straight into prefill.

Raw HTTP, as ``test_connector.py`` (whose helpers this reuses). Each test uses its own topic, so
prefill's prefix cache from one test does not serve another's; the uninterrupted reference of a
topic runs *after* the tier run, so the tier run's prefill cannot find the reference's blocks.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import httpx2
import pytest

from agentkv._wire.hints import INFO_PATH, RELEASE_PATH, LeaseRef, PinHint
from agentkv._wire.tier import (
    LEGACY_OFFLOAD_PATH,
    TIER_DELETE_PATH,
    OffloadResult,
    TierDelete,
    TierLoadReport,
    TierRef,
    TierUsage,
    with_tier,
)
from agentkv.local._config import ClusterRecord
from tests.e2e.test_connector import BLOCK, NULL_HANDLE, Conversation, Pair

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def pair(local_cluster: ClusterRecord) -> Any:
    first = local_cluster.pairs[0]
    with httpx2.Client(timeout=300) as client:
        yield Pair(client=client, p_url=first.prefill.url, d_url=first.decode.url,
                   model=local_cluster.model)

HOLD = PinHint(ttl_s=300)


def _persist(pair: Pair, handle: dict[str, Any]) -> httpx2.Response:
    return pair.post(pair.d_url, LEGACY_OFFLOAD_PATH, LeaseRef.from_handle(handle).to_wire())


def _resume(conv: Conversation, ref: TierRef) -> tuple[dict[str, Any], int]:
    """A P leg that carries the tier reference and no decode handle."""
    params = with_tier({**NULL_HANDLE, "prompt_token_ids": conv.prompt}, ref)
    data = conv.pair.chat(conv.pair.p_url, {
        "model": conv.pair.model, "messages": conv.messages, "max_tokens": 1, "stream": False,
        "temperature": 0.0, "kv_transfer_params": params})
    cached: int = data["usage"]["prompt_tokens_details"]["cached_tokens"]
    return data["kv_transfer_params"], cached


def _tier_dir(pair: Pair) -> Path:
    info = pair.client.get(f"{pair.d_url}{INFO_PATH}").json()
    return Path(TierUsage.from_wire(info["tier"]).dir)


def _delete(ref: TierRef) -> dict[str, Any]:
    """The delete body: the entry's id and the secret its persist answer carried."""
    assert ref.secret is not None
    return TierDelete(id=ref.id, secret=ref.secret).to_wire()


def _files(pair: Pair, ref: TierRef) -> list[Path]:
    return sorted(_tier_dir(pair).glob(f"{ref.id}.*"))


def _persisted_turn(pair: Pair, topic: str) -> tuple[Conversation, TierRef, float]:
    """Turn 1 of a conversation, persisted; decode's idle usage level before it."""
    idle = pair.settle()
    conv = Conversation(pair, topic)
    handle = conv.turn(None, HOLD)
    response = _persist(pair, handle)
    assert response.status_code == 200, response.text
    result = OffloadResult.from_wire(response.json())
    assert result.ref.n_tokens == conv.turn_tokens - 1  # the last token's KV is never made
    assert result.bytes > 0
    # The pin is gone: the old handle is unknown to decode.
    assert pair.post(pair.d_url, RELEASE_PATH,
                     LeaseRef.from_handle(handle).to_wire()).status_code == 404
    return conv, result.ref, idle


def _reference_answer(pair: Pair, topic: str) -> list[int]:
    """Turn 2's greedy answer in a never-interrupted session (pull from decode)."""
    conv = Conversation(pair, topic)
    handle = conv.turn(None, HOLD)
    conv.add_user("And which shelf holds parcel 5?")
    conv.turn(handle, PinHint(pin=False))
    return list(conv.generated)


def test_a_persisted_turn_frees_decode_and_resumes_from_the_tier_at_the_ideal(
    pair: Pair,
) -> None:
    """Persist writes the files and frees the pin; the next P leg loads prompt + generated - 1
    tokens from the tier, and the greedy answer equals a never-interrupted session's."""
    conv, ref, idle = _persisted_turn(pair, "tier-resume")
    usage, _ = pair.wait_usage(lambda u: u <= idle + 1e-9, timeout_s=15)
    assert usage <= idle + 1e-9, (usage, idle)
    assert [p.name for p in _files(pair, ref)] == [f"{ref.id}.json", f"{ref.id}.r0.kv"]

    conv.add_user("And which shelf holds parcel 5?")
    p_params, cached = _resume(conv, ref)
    assert cached == ref.n_tokens, (cached, ref.n_tokens, len(conv.prompt))
    conv.decode(p_params, PinHint(pin=False))
    assert conv.generated == _reference_answer(pair, "tier-resume")

    files = _files(pair, ref)
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in files), files
    wrong = pair.post(pair.d_url, TIER_DELETE_PATH, {"id": ref.id, "secret": "not-the-secret!"})
    assert wrong.status_code == 400  # not even a well-formed secret
    wrong = pair.post(pair.d_url, TIER_DELETE_PATH, {"id": ref.id, "secret": "x" * 22})
    assert wrong.status_code == 404
    assert _files(pair, ref) == files
    response = pair.post(pair.d_url, TIER_DELETE_PATH, _delete(ref))
    assert response.json() == {"deleted": True}
    assert _files(pair, ref) == []
    assert pair.post(pair.d_url, TIER_DELETE_PATH, _delete(ref)).status_code == 404


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_damaged_tier_file_is_recomputed_never_served(pair: Pair, damage: str) -> None:
    """A flipped byte or a truncated file: prefill loads at most the intact prefix and the
    greedy answer is the same as a never-interrupted session's."""
    topic = f"tier-{damage}"
    conv, ref, _ = _persisted_turn(pair, topic)
    data = _tier_dir(pair) / f"{ref.id}.r0.kv"
    size = data.stat().st_size
    n_blocks = -(-ref.n_tokens // BLOCK)
    if damage == "flip":  # one byte in the last block
        at = size - size // n_blocks // 2
        with data.open("r+b") as f:
            f.seek(at)
            byte = f.read(1)
            f.seek(at)
            f.write(bytes([byte[0] ^ 0xFF]))
    else:
        os.truncate(data, size // 2)
    conv.add_user("And which shelf holds parcel 5?")
    p_params, cached = _resume(conv, ref)
    # A truncated file is refused at lookup (sizes are checked there); a flipped byte only by
    # the worker's checksum after the read, when vLLM has already counted the tokens as cached:
    # prefill's report says how far the entry really served, and the answer shows that the
    # damaged block was recomputed, not served.
    report = TierLoadReport.from_params(p_params)
    assert report is not None
    assert report.short, report
    assert report.reason == ("load_failed" if damage == "flip" else "truncated")
    assert report.tokens <= (n_blocks - 1) * BLOCK
    if damage == "truncate":
        assert cached <= (n_blocks - 1) * BLOCK
    conv.decode(p_params, PinHint(pin=False))
    assert conv.generated == _reference_answer(pair, topic)
    assert pair.post(pair.d_url, TIER_DELETE_PATH, _delete(ref)).json() == {"deleted": True}


def test_info_reports_the_tier(pair: Pair, local_cluster: ClusterRecord) -> None:
    info = pair.client.get(f"{pair.p_url}{INFO_PATH}").json()
    usage = TierUsage.from_wire(info["tier"])
    assert usage.budget_bytes > 0
    assert local_cluster.tier_dir == usage.dir


def test_a_prefill_that_never_saw_the_session_loads_all_of_it_from_the_tier(pair: Pair) -> None:
    """Turn 1 computed on decode alone (prefill's cache is cold for it): turn 2's P leg loads
    every block from the tier, and the greedy answers equal a never-interrupted session's."""
    conv = Conversation(pair, "tier-cold")
    handle = conv.decode({"do_remote_decode": False, "do_remote_prefill": False}, HOLD)
    first = list(conv.generated)
    response = _persist(pair, handle)
    assert response.status_code == 200, response.text
    ref = OffloadResult.from_wire(response.json()).ref
    assert ref.n_tokens == conv.turn_tokens - 1
    conv.add_user("And which shelf holds parcel 5?")
    p_params, cached = _resume(conv, ref)
    assert cached == ref.n_tokens
    conv.decode(p_params, PinHint(pin=False))

    reference = Conversation(pair, "tier-cold")
    old = reference.turn(None, HOLD)
    assert reference.generated == first
    reference.add_user("And which shelf holds parcel 5?")
    reference.turn(old, PinHint(pin=False))
    assert conv.generated == reference.generated
    assert pair.post(pair.d_url, TIER_DELETE_PATH, _delete(ref)).json() == {"deleted": True}
