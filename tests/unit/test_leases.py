"""Decode's lease book: who may release or extend a pin, and what the persist policy decides."""

from __future__ import annotations

import itertools

import pytest

from agentkv._wire.hints import LeaseRef, RequestRelease, request_tag, tag_of_request_id
from agentkv.connector._leases import (
    MAX_TOMBSTONES,
    TOMBSTONE_S,
    LeaseBook,
    Outcome,
    PinDecision,
    decide_pin,
)

BLOCKS = ((10, 11, 12),)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _book(clock: Clock, max_ttl_s: float = 600.0) -> LeaseBook:
    counter = itertools.count()
    return LeaseBook(clock=clock, max_ttl_s=max_ttl_s, secret=lambda: f"secret-{next(counter)}")


def _ref(
    request_id: str = "req-1", blocks: tuple[tuple[int, ...], ...] = BLOCKS, lease: str = "secret-0"
) -> LeaseRef:
    return LeaseRef(request_id=request_id, block_ids=blocks, lease=lease)


def test_no_hint_pins_for_the_servers_default_ttl() -> None:
    assert decide_pin({"do_remote_prefill": True}, default_ttl_s=480, max_ttl_s=3600) == (
        PinDecision(pin=True, ttl_s=480)
    )


def test_the_hinted_ttl_is_used_and_capped() -> None:
    hinted = {"agentkv": {"v": 1, "persist": True, "ttl_s": 20}}
    assert decide_pin(hinted, default_ttl_s=480, max_ttl_s=3600).ttl_s == 20
    huge = {"agentkv": {"v": 1, "persist": True, "ttl_s": 1e9}}
    assert decide_pin(huge, default_ttl_s=480, max_ttl_s=3600).ttl_s == 3600


def test_persist_false_pins_nothing() -> None:
    final = {"agentkv": {"v": 1, "persist": False}}
    assert decide_pin(final, default_ttl_s=480, max_ttl_s=3600).pin is False


def test_a_malformed_hint_falls_back_to_stock_pinning_and_says_why() -> None:
    decision = decide_pin({"agentkv": {"v": 9}}, default_ttl_s=480, max_ttl_s=3600)
    assert decision.pin is True
    assert decision.ttl_s == 480
    assert decision.error is not None


def test_a_grant_mints_a_secret_and_a_deadline_on_decodes_clock() -> None:
    clock = Clock()
    book = _book(clock)
    lease, ack = book.grant("req-1", BLOCKS, ttl_s=30)
    assert lease.deadline == 1030.0
    assert ack.pinned
    assert ack.lease == "secret-0"
    assert ack.ttl_s == 30
    assert "req-1" in book


def test_release_needs_the_request_id_the_exact_blocks_and_the_secret() -> None:
    book = _book(Clock())
    book.grant("req-1", BLOCKS, ttl_s=30)
    assert book.release(_ref(request_id="req-2")) is Outcome.UNKNOWN
    assert book.release(_ref(blocks=((10, 11),))) is Outcome.UNKNOWN
    assert book.release(_ref(blocks=((10, 11, 13),))) is Outcome.UNKNOWN
    assert book.release(_ref(lease="secret-1")) is Outcome.UNKNOWN
    assert "req-1" in book  # refused calls change nothing
    assert book.release(_ref()) is Outcome.OK
    assert "req-1" not in book
    assert book.release(_ref()) is Outcome.UNKNOWN  # a second release finds nothing


def test_one_sessions_secret_does_not_open_another_sessions_pin() -> None:
    book = _book(Clock())
    book.grant("req-a", BLOCKS, ttl_s=30)  # secret-0
    book.grant("req-b", ((20, 21),), ttl_s=30)  # secret-1
    assert book.release(_ref(request_id="req-b", blocks=((20, 21),), lease="secret-0")) is (
        Outcome.UNKNOWN
    )
    assert book.extend(_ref(request_id="req-a", lease="secret-1"), ttl_s=60)[0] is Outcome.UNKNOWN


def test_extend_pushes_the_deadline_out_but_never_pulls_it_in() -> None:
    clock = Clock()
    book = _book(clock)
    book.grant("req-1", BLOCKS, ttl_s=30)
    clock.now += 20
    outcome, lease = book.extend(_ref(), ttl_s=100)
    assert outcome is Outcome.OK
    assert lease is not None
    assert lease.deadline == 1120.0
    assert book.remaining_s(lease) == 100.0
    outcome, lease = book.extend(_ref(), ttl_s=5)
    assert lease is not None
    assert lease.deadline == 1120.0


def test_a_claim_hands_the_lease_to_its_first_caller_only() -> None:
    """Two holders of one secret (a save file loaded twice): extend confirms both, a claim
    rotates the secret, so the second claim, and every call with the old secret, is refused."""
    clock = Clock()
    book = _book(clock)
    book.grant("req-1", BLOCKS, ttl_s=30)
    assert book.extend(_ref(), ttl_s=30)[0] is Outcome.OK  # not exclusive: both would hear ok
    outcome, lease = book.claim(_ref(), ttl_s=60)
    assert outcome is Outcome.OK
    assert lease is not None
    assert lease.secret == "secret-1"
    assert lease.deadline == 1060.0
    assert book.claim(_ref(), ttl_s=60)[0] is Outcome.UNKNOWN  # the other holder
    assert book.extend(_ref(), ttl_s=60)[0] is Outcome.UNKNOWN
    assert book.release(_ref()) is Outcome.UNKNOWN
    assert book.release(_ref(lease="secret-1")) is Outcome.OK  # the winner's own secret


def test_an_expired_lease_cannot_be_claimed() -> None:
    clock = Clock()
    book = _book(clock)
    book.grant("req-1", BLOCKS, ttl_s=30)
    clock.now += 30
    assert book.claim(_ref(), ttl_s=100)[0] is Outcome.EXPIRED
    assert book.release(_ref()) is Outcome.EXPIRED  # the secret did not change


def test_extend_is_capped_by_the_servers_max_ttl() -> None:
    clock = Clock()
    book = _book(clock, max_ttl_s=60)
    book.grant("req-1", BLOCKS, ttl_s=1e9)
    _, lease = book.extend(_ref(), ttl_s=1e9)
    assert lease is not None
    assert lease.deadline == 1060.0


def test_an_expired_lease_cannot_be_extended_back_to_life() -> None:
    clock = Clock()
    book = _book(clock)
    book.grant("req-1", BLOCKS, ttl_s=30)
    clock.now += 30
    assert book.extend(_ref(), ttl_s=100)[0] is Outcome.EXPIRED
    assert book.release(_ref()) is Outcome.EXPIRED
    # ...but a stranger still learns nothing about it.
    assert book.release(_ref(lease="guess")) is Outcome.UNKNOWN


def test_pins_freed_by_vllm_leave_the_book() -> None:
    book = _book(Clock())
    book.grant("req-1", BLOCKS, ttl_s=30)
    book.grant("req-2", BLOCKS, ttl_s=30)
    book.forget(["req-1", "not-ours"])
    assert len(book) == 1
    assert book.release(_ref(request_id="req-1")) is Outcome.UNKNOWN


def test_the_book_needs_a_positive_cap() -> None:
    with pytest.raises(ValueError, match="max_ttl_s"):
        LeaseBook(clock=Clock(), max_ttl_s=0)


# --- release by the client's request id (a D leg whose answer was lost) -----------------------


def _engine_id(secret: str, suffix: str = "1a2b3c4d") -> str:
    # vLLM: "chatcmpl-{X-Request-Id}-{8 random characters}".
    return f"chatcmpl-{request_tag(secret)}-{suffix}"


def test_the_secret_behind_a_request_id_releases_its_pin() -> None:
    book = _book(Clock())
    book.grant(_engine_id("mine"), BLOCKS, ttl_s=30)
    book.grant(_engine_id("theirs"), ((20,),), ttl_s=30)
    assert book.release_request(RequestRelease(secret="mine")) == [_engine_id("mine")]
    assert _engine_id("mine") not in book
    assert _engine_id("theirs") in book


def test_the_request_id_itself_releases_nothing() -> None:
    """The tag travels in the clear (logs, response ids, prefill); only its preimage acts."""
    book = _book(Clock())
    book.grant(_engine_id("mine"), BLOCKS, ttl_s=30)
    assert book.release_request(RequestRelease(secret=request_tag("mine"))) == []
    assert book.release_request(RequestRelease(secret=_engine_id("mine"))) == []
    assert _engine_id("mine") in book


def test_a_release_before_the_request_finished_keeps_it_from_being_pinned() -> None:
    clock = Clock()
    book = _book(clock)
    assert book.release_request(RequestRelease(secret="early")) == []
    decision = book.decide(_engine_id("early"), None, default_ttl_s=480)
    assert decision == PinDecision(pin=False, ttl_s=0.0, withheld=True)
    # Another request, or the same one long after, is pinned as usual.
    assert book.decide(_engine_id("other"), None, default_ttl_s=480).pin
    clock.now += TOMBSTONE_S
    assert book.decide(_engine_id("early"), None, default_ttl_s=480).pin


def test_a_flood_of_early_releases_keeps_only_the_newest_tombstones() -> None:
    clock = Clock()
    book = _book(clock)
    for i in range(MAX_TOMBSTONES + 10):
        book.release_request(RequestRelease(secret=f"s{i}"))
    assert not book.decide(_engine_id(f"s{MAX_TOMBSTONES + 9}"), None, default_ttl_s=1).pin
    assert book.decide(_engine_id("s0"), None, default_ttl_s=1).pin  # evicted: stock pinning


def test_request_ids_not_chosen_by_agentkv_are_never_matched() -> None:
    book = _book(Clock())
    book.grant("chatcmpl-0123abcd-1a2b3c4d", BLOCKS, ttl_s=30)
    assert tag_of_request_id("chatcmpl-0123abcd-1a2b3c4d") is None
    assert tag_of_request_id(_engine_id("x")) == request_tag("x")
    assert tag_of_request_id(f"chatcmpl-{request_tag('x')}") == request_tag("x")  # no suffix
    assert book.decide("chatcmpl-0123abcd-1a2b3c4d", None, default_ttl_s=480).pin


def test_a_lease_freed_by_vllm_leaves_the_tag_index_too() -> None:
    book = _book(Clock())
    book.grant(_engine_id("mine"), BLOCKS, ttl_s=30)
    book.forget([_engine_id("mine")])
    # Nothing to release, so this only tombstones (the request is gone anyway).
    assert book.release_request(RequestRelease(secret="mine")) == []
    assert len(book) == 0
