"""``AgentKVConnector``'s pin policy: ``apply_pin_policy`` on vLLM's NIXL scheduler fields.

``AgentKVConnector._apply_policy`` is this function on a ``SchedulerPins`` (importing the
connector class needs vLLM and torch, ~40 s; the module below does not); the fake engine calls
the same function on its own pins. A stand-in holds the two scheduler fields it writes
(``_reqs_need_send``, ``_reqs_not_processed``), with vLLM's types.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import pytest

from agentkv._wire.hints import HINTS_KEY, RequestRelease, request_tag
from agentkv.connector._leases import LeaseBook, LeaseService, SchedulerPins, apply_pin_policy


class Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Scheduler:
    _reqs_need_send: dict[str, float] = field(default_factory=dict)
    _reqs_not_processed: set[str] = field(default_factory=set)


@dataclass
class Request:
    request_id: str
    kv_transfer_params: dict[str, Any] | None


class Connector:
    """What ``AgentKVConnector`` holds on the scheduler side, and its two policy entry points."""

    def __init__(self, clock: Clock) -> None:
        self.scheduler = Scheduler()
        counter = itertools.count()
        self.book = LeaseBook(clock=clock, max_ttl_s=600, secret=lambda: f"s{next(counter)}")
        self.control = SchedulerPins(self.scheduler)
        self.service = LeaseService(self.book, set_deadline=self.control.set_deadline,
                                    clock=clock, default_ttl_s=480.0)

    def _apply_policy(
        self, request: Request, result: tuple[bool, dict[str, Any] | None]
    ) -> tuple[bool, dict[str, Any] | None]:
        return apply_pin_policy(self.book, self.control, request_id=request.request_id,
                                params=request.kv_transfer_params, result=result,
                                default_ttl_s=480.0)

    def agentkv_lease_op(self, op: str, payload: object) -> dict[str, object]:
        return self.service.handle(op, payload)


def _connector(clock: Clock) -> tuple[Connector, Scheduler]:
    connector = Connector(clock)
    return connector, connector.scheduler


def _finished(request_id: str) -> tuple[bool, dict[str, Any]]:
    # What NixlPullConnector.request_finished answers for a finished decode request.
    return True, {
        "do_remote_decode": True,
        "remote_request_id": request_id,
        "remote_block_ids": [[3, 4, 5]],
        "remote_num_tokens": 40,
        "remote_blocks_expiry_time": 999.0,
    }


def test_a_hinted_request_is_leased_for_its_ttl_and_the_worker_gets_that_deadline() -> None:
    clock = Clock()
    connector, scheduler = _connector(clock)
    hint = {HINTS_KEY: {"v": 1, "persist": True, "ttl_s": 30}}
    delay, out = connector._apply_policy(Request("r1", hint), _finished("r1"))
    assert delay is True
    assert out is not None
    assert out["remote_blocks_expiry_time"] == 130.0
    assert out[HINTS_KEY] == {"v": 1, "pinned": True, "lease": "s0", "ttl_s": 30.0}
    assert scheduler._reqs_need_send == {"r1": 130.0}


def test_a_final_turn_is_unpinned_the_way_vllm_unpins_an_aborted_request() -> None:
    connector, scheduler = _connector(Clock())
    scheduler._reqs_need_send["r1"] = 999.0
    hint = {HINTS_KEY: {"v": 1, "persist": False}}
    delay, out = connector._apply_policy(Request("r1", hint), _finished("r1"))
    assert delay is False
    assert out is not None
    assert out["remote_block_ids"] == [[]]
    assert out["remote_num_tokens"] == 0
    assert "r1" not in scheduler._reqs_need_send
    assert "r1" in scheduler._reqs_not_processed
    assert len(connector.book) == 0


def test_prefills_blocks_are_left_to_vllm() -> None:
    connector, scheduler = _connector(Clock())
    result = (True, {"do_remote_prefill": True, "remote_block_ids": [[1]]})
    assert connector._apply_policy(Request("p1", None), result) == result
    assert scheduler._reqs_need_send == {}


def test_a_request_its_client_released_before_it_finished_is_never_pinned() -> None:
    clock = Clock()
    connector, scheduler = _connector(clock)
    request_id = f"chatcmpl-{request_tag('lost')}-1a2b3c4d"
    answer = connector.agentkv_lease_op("release_request", RequestRelease(secret="lost").to_wire())
    assert answer == {"status": "ok", "released": 0}
    delay, out = connector._apply_policy(Request(request_id, None), _finished(request_id))
    assert delay is False
    assert out is not None
    assert out[HINTS_KEY] == {"v": 1, "pinned": False}
    assert request_id in scheduler._reqs_not_processed


def test_a_finished_request_is_released_by_its_secret_at_the_next_step() -> None:
    clock = Clock()
    connector, scheduler = _connector(clock)
    request_id = f"chatcmpl-{request_tag('lost')}-1a2b3c4d"
    connector._apply_policy(Request(request_id, None), _finished(request_id))
    assert scheduler._reqs_need_send[request_id] == 580.0
    answer = connector.agentkv_lease_op("release_request", RequestRelease(secret="lost").to_wire())
    assert answer == {"status": "ok", "released": 1}
    assert scheduler._reqs_need_send[request_id] < clock.now  # freed at the next step
    wrong = connector.agentkv_lease_op(
        "release_request", RequestRelease(secret=request_tag("lost")).to_wire()
    )
    assert wrong == {"status": "ok", "released": 0}


def test_a_vllm_without_the_scheduler_fields_refuses_to_start() -> None:
    with pytest.raises(RuntimeError, match="_reqs_need_send"):
        SchedulerPins(object())
