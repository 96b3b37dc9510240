"""Decode's lease book: who may release or extend a pin, and what the persist policy decides."""

from __future__ import annotations

import itertools

import pytest

from agentkv._hints import LeaseRef
from agentkv.connector._leases import LeaseBook, Outcome, PinDecision, decide_pin

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
