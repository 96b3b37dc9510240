"""The fuzzers' six regressions (``tests/fake/test_fuzz_corpus.py``) as transition tables on the
pure value: ``(start value, input) -> (value, effects)``.

Each table row is one step of the shrunk sequence that once loaded wrong KV or leaked a pin,
stated on ``agentkv._client.kv`` alone; the fake-cluster replays stay in ``test_fuzz_corpus.py``
as integration tests (they also cover what is not the value's: a session held during an
offload, the shared store's claims).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import pytest

from agentkv._client import kv
from agentkv._policy import CachePolicy
from agentkv._types import HandleState, KVHandle
from agentkv._wire.hints import ExtendResult
from agentkv._wire.tier import TierRef
from agentkv.proxy._shared import DIRTY_HANDOVER

POLICY = CachePolicy(recompute_threshold=1)
NOW = 1000.0
HANDLE = KVHandle(
    pair="p0",
    engine_id="e",
    request_id="r1",
    block_ids=((1, 2),),
    host="h",
    port=1,
    num_tokens=40,
    issued_at=NOW - 10.0,
    deadline=NOW + 100.0,
    server_expiry=NOW + 130.0,
    lease_ttl_s=140.0,
    lease="secret-1",
)
PROMPT = list(range(60))
REF = TierRef(id="a" * 32, n_tokens=40, secret="s" * 16)
ON_TIER = kv.OnTier(ref=REF, pair="p0", digest=kv.tokens_digest(PROMPT[:40]))
FACTS = kv.RouteFacts(route="pull", decode_queued=0, decode_running=0, block_size=16, local_ok=True)
CLAIM = kv.Extend(
    handle=HANDLE, ttl_s=kv.CONFIRM_TTL_S, reason="confirm_loaded", claim=True, confirming=True
)
CLAIMED = ExtendResult(expiry=NOW + 30.0, ttl_s=30.0, lease="secret-2")
CLOSED = kv.NoKV(reason=HandleState.NONE, detail="the session was closed")


Outcome = tuple[kv.KV, tuple[object, ...]]


def _take(value: kv.KV) -> Outcome:
    """A turn takes ``value``: the new value, its effects and (as ``("sent", id)``) the handle
    its P leg carries."""
    step, taken = kv.take(value, prompt=PROMPT, facts=FACTS, policy=POLICY, now=NOW)
    sent = () if taken.sent is None else (("sent", taken.sent.request_id),)
    return step.kv, (*step.effects, *sent)


def _claim_answer(result: ExtendResult | None, *, gone: bool) -> Callable[[kv.KV], kv.Step]:
    def answer(value: kv.KV) -> kv.Step:
        step, _ = kv.extended(
            value, CLAIM, result=result, gone=gone, detail="gone", sent_at=NOW, policy=POLICY
        )
        return step

    return answer


class Row(NamedTuple):
    start: kv.KV
    event: Callable[[kv.KV], kv.Step | Outcome]
    value: kv.KV
    effects: tuple[object, ...]


UNCONFIRMED = kv.Pinned(handle=HANDLE, confirmed=False)
CLAIMED_HANDLE = kv.Pinned(
    handle=dataclasses.replace(
        HANDLE, server_expiry=NOW + 30.0, lease_ttl_s=30.0, extends=1, lease="secret-2"
    )
)

TABLES: dict[str, list[Row]] = {
    # save -> load -> close the copy -> the original's turn: the copy's close released the pin
    # the original still named; the original attached freed blocks. Fixed: a handed-out handle
    # is claimed before it is attached, and a refused claim drops it.
    "a_saved_copy_closed_early": [
        Row(kv.Pinned(handle=HANDLE), kv.handed_out, UNCONFIRMED, ()),
        Row(
            UNCONFIRMED,
            lambda v: kv.closed(v, policy=POLICY, now=NOW),
            CLOSED,
            (kv.Release(handle=HANDLE, reason="close"),),
        ),
        Row(
            UNCONFIRMED,
            lambda v: kv.confirm(v, prompt_len=60, supported=True, policy=POLICY, now=NOW),
            UNCONFIRMED,
            (CLAIM,),
        ),
        Row(
            UNCONFIRMED,
            _claim_answer(None, gone=True),
            kv.NoKV(
                reason=HandleState.EXPIRED,
                detail="decode no longer holds the handle (or another copy of this session "
                "claimed it first) (gone)",
            ),
            (),
        ),
    ],
    # The pair's prefill died; the session moved and dropped its handle, leaving the pin on the
    # live decode. Fixed: a handle dropped unsent (moved, pair down) is released.
    "a_session_moved_off_a_dead_prefill": [
        Row(
            kv.Pinned(handle=HANDLE),
            lambda v: kv.moved(v, pair="p1", policy=POLICY, now=NOW),
            kv.NoKV(reason=HandleState.INVALIDATED, detail="the session moved to pair p1"),
            (kv.Release(handle=HANDLE, reason="moved"),),
        ),
        Row(
            kv.Pinned(handle=HANDLE),
            lambda v: kv.pair_failed(
                v, detail="pair p0 stopped answering", reason="pair_down", policy=POLICY, now=NOW
            ),
            kv.NoKV(reason=HandleState.INVALIDATED, detail="pair p0 stopped answering"),
            (kv.Release(handle=HANDLE, reason="pair_down"),),
        ),
    ],
    # A close inside our deadline's safety margin did not release. Fixed: released until the
    # margin past our deadline (decode may still hold it); not after.
    "a_session_closed_inside_its_handles_safety_margin": [
        Row(
            kv.Pinned(handle=HANDLE),
            lambda v: kv.closed(v, policy=POLICY, now=HANDLE.deadline + 0.5),
            CLOSED,
            (kv.Release(handle=HANDLE, reason="close"),),
        ),
        Row(
            kv.Pinned(handle=HANDLE),
            lambda v: kv.closed(v, policy=POLICY, now=HANDLE.deadline + POLICY.ttl_margin_s),
            CLOSED,
            (),
        ),
    ],
    # Two holders of one save file sent at once; an extend "confirmed" both, and both attached.
    # Fixed: the confirmation is a claim; the winner holds the new secret, the other drops it.
    "holders_of_one_save_file_sending_at_once": [
        Row(UNCONFIRMED, _claim_answer(CLAIMED, gone=False), CLAIMED_HANDLE, ()),
        Row(
            CLAIMED_HANDLE,
            _take,
            kv.NoKV(reason=HandleState.CONSUMED, detail="a failed turn may have read the handle"),
            (("sent", "r1"),),
        ),
        Row(
            UNCONFIRMED,
            _claim_answer(None, gone=False),
            kv.NoKV(
                reason=HandleState.INVALIDATED,
                detail="decode could not confirm the handle (it is also in a save file)",
            ),
            (),
        ),
    ],
    # A turn started while an offload's answer was on its way took the handle decode had freed.
    # Fixed on the session (an offload holds it as a turn does); on the value, once offloaded
    # only the tier entry is left to send.
    "a_turn_started_while_an_offload_is_answered": [
        Row(
            kv.Pinned(handle=HANDLE),
            lambda v: kv.offloaded(
                v,
                kv.Offload(handle=HANDLE, ttl_s=None, reason="explicit"),
                ref=REF,
                gone=False,
                detail="",
                tokens=PROMPT,
            ),
            ON_TIER,
            (),
        ),
        Row(ON_TIER, _take, ON_TIER, ()),
    ],
    # A replica stalled mid-turn past its claim; the next replica attached the stored handle the
    # stalled one was about to pull. Fixed: after a dirty handover nothing is attached (nor
    # released: the other may only be slow).
    "a_replica_stalled_mid_turn_past_its_claim": [
        Row(
            kv.Pinned(handle=HANDLE),
            lambda v: kv.restored(v, pair="p0", confirmed=False, drop=DIRTY_HANDOVER),
            kv.NoKV(reason=HandleState.CONSUMED, detail=DIRTY_HANDOVER),
            (),
        ),
        Row(
            kv.NoKV(reason=HandleState.CONSUMED, detail=DIRTY_HANDOVER),
            _take,
            kv.NoKV(reason=HandleState.CONSUMED, detail=DIRTY_HANDOVER),
            (),
        ),
    ],
}


@pytest.mark.parametrize(
    "row",
    [
        pytest.param(row, id=f"{name}-{index}")
        for name, rows in TABLES.items()
        for index, row in enumerate(rows)
    ],
)
def test_the_regressions_transitions(row: Row) -> None:
    value, effects = row.event(row.start)
    assert value == row.value
    assert effects == row.effects
