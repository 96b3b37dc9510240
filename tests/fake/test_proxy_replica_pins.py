"""Replicas on a real Redis: no dirty handover is laundered, and no turn's pin outlives a commit
that did not land.

* Only a commit clears the mark a claim leaves when it ends mid-turn: an idle sweep's refused
  removal, or a release, by a holder that found it set, leaves it set.
* Every claim records its D leg's request secret. A refused commit releases its turn's pin at
  once; a commit whose answer was lost asks the store again and releases the pin only when the
  commit certainly did not land; a replica killed between its answer and its commit leaves its
  secret to the next claim, which releases that pin.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from agentkv.proxy._config import key_digest
from agentkv.proxy._redis_store import RedisSessions
from agentkv.proxy._shared import DIRTY_HANDOVER
from agentkv.proxy._store import StoreUnavailableError
from tests.fake.test_proxy_replicas import QUESTIONS, SYSTEM, HeldCommits, Replica, _ask

PRINCIPAL = f"key-{key_digest('sk-test')}"  # the proxy's principal for sk-test, without keys


def _pins(fake):
    return sum(fake.decode(i).pinned_handles for i in range(2))


def _released(replica, reason):
    return replica.app.state.metrics.value(
        "agentkv_proxy_unreferenced_pins_released_total", reason=reason
    )


async def _delete(replica, session_id):
    response = await replica.http.delete(
        f"/v1/sessions/{session_id}", headers={"Authorization": "Bearer sk-test"}
    )
    assert response.status_code == 200, response.text


async def _lapse(store):
    await asyncio.sleep(store.lease_s + 0.1)


async def test_a_refused_sweep_removal_does_not_clear_the_mark_of_a_turn_that_stopped_midway(
    fake, clock, redis_url
):
    """A sweep lists the session; it is used again; its next holder stalls past its lease after
    its P leg pulled the stored handle. The sweep's claim is dirty and its removal refused
    (used since the cutoff): the next claim must still be dirty, or it attaches a consumed
    handle (wrong KV)."""
    held = HeldCommits(RedisSessions.from_url(redis_url, lease_s=0.3))
    held.go.set()
    a = Replica(fake, clock, redis_url, store=held)
    b = Replica(fake, clock, redis_url)
    messages = [{"role": "system", "content": SYSTEM}]
    await _ask(a, "swept", messages, QUESTIONS[0])
    await a.app.state.registry.written()
    cutoff = time.time()  # the sweep lists the session as idle before now
    await _ask(a, "swept", messages, QUESTIONS[1])  # used again
    await a.app.state.registry.written()
    held.go.clear()
    await _ask(a, "swept", messages, QUESTIONS[2])  # pulled turn 2's handle; commit stalls
    await _lapse(held)
    removed = await b.app.state.registry._remove(
        PRINCIPAL, "swept", reason="idle", idle_before=cutoff
    )
    assert removed is False  # used since the cutoff
    await _ask(b, "swept", messages, QUESTIONS[3])
    turns = await b.turns("swept")
    assert turns[-1]["handle_state"] == "consumed"
    assert turns[-1]["handle_reason"] == DIRTY_HANDOVER
    assert fake.wrong_reuse_events == 0
    held.go.set()
    await a.app.state.registry.written()
    await a.aclose(release=False)
    await b.aclose()


async def test_a_replica_killed_between_answer_and_commit_leaves_no_pin_once_the_next_claims(
    fake, clock, redis_url
):
    """The dead replica's turn pinned KV that no snapshot will reference; the next claim gets
    its secret as an orphan and releases it, instead of decode holding it for its TTL."""
    held = HeldCommits(RedisSessions.from_url(redis_url, lease_s=0.3))
    held.go.set()
    a = Replica(fake, clock, redis_url, store=held)
    b = Replica(fake, clock, redis_url)
    messages = [{"role": "system", "content": SYSTEM}]
    await _ask(a, "killed", messages, QUESTIONS[0])
    await a.app.state.registry.written()
    held.go.clear()
    await _ask(a, "killed", messages, QUESTIONS[1])  # A is dead from here: nothing lands
    assert _pins(fake) == 1  # turn 2's: turn 1's was pulled by turn 2
    await _lapse(held)
    await _ask(b, "killed", messages, QUESTIONS[2])
    await b.app.state.registry.written()
    await b.app.state.registry.released()
    assert _pins(fake) == 1  # B's turn's only: A's orphan was released
    assert _released(b, "orphan") == 1
    assert fake.wrong_reuse_events == 0
    await _delete(b, "killed")
    assert _pins(fake) == 0
    await a.aclose(release=False)
    await b.aclose()


async def test_a_refused_commit_releases_the_pin_of_its_turn(fake, clock, redis_url):
    """A replica paused past its lease between answer and commit: its commit is refused, and
    the turn's pin, referenced by nothing, is released at once."""
    held = HeldCommits(RedisSessions.from_url(redis_url, lease_s=0.3))
    held.go.set()
    a = Replica(fake, clock, redis_url, store=held)
    messages = [{"role": "system", "content": SYSTEM}]
    await _ask(a, "refused", messages, QUESTIONS[0])
    await a.app.state.registry.written()
    held.go.clear()
    await _ask(a, "refused", messages, QUESTIONS[1])
    await _lapse(held)
    held.go.set()
    registry = a.app.state.registry
    await registry.written()
    await registry.released()
    assert held.refused == 1
    assert _released(a, "commit_refused") == 1
    assert _pins(fake) == 0  # turn 1's was pulled by turn 2, turn 2's released
    await a.aclose(release=False)


class LostReplies:
    """A replica's store whose next commit gets no answer: Redis unreachable before it ran
    (``land=False``) or after (``land=True``, the reply lost on the way back)."""

    def __init__(self, inner):
        self._inner = inner
        self.lease_s = inner.lease_s
        self.land: bool | None = None

    def __getattr__(self, name):
        return getattr(self._inner, name)

    async def commit(self, claim, data, **options):
        land, self.land = self.land, None
        if land is None:
            return await self._inner.commit(claim, data, **options)
        if land:
            await self._inner.commit(claim, data, **options)
        raise StoreUnavailableError("the session store is unreachable: reply lost")


@pytest.mark.parametrize("land", [False, True])
async def test_a_commit_without_an_answer_releases_its_pin_only_if_it_did_not_land(
    fake, clock, redis_url, land
):
    """Releasing blindly would free the stored handle's blocks under the next turn's pull:
    the replica asks the store until it answers (``fence_off``). Not landed: the claim is
    fenced off (no late commit), the pin released, the next turn recomputes. Landed: the pin
    is the stored handle, kept, and the next turn, on the other replica, attaches it."""
    store = LostReplies(RedisSessions.from_url(redis_url, lease_s=5.0))
    a = Replica(fake, clock, redis_url, store=store)
    b = Replica(fake, clock, redis_url)
    messages = [{"role": "system", "content": SYSTEM}]
    await _ask(a, "unanswered", messages, QUESTIONS[0])
    await a.app.state.registry.written()
    store.land = land
    await _ask(a, "unanswered", messages, QUESTIONS[1])
    registry = a.app.state.registry
    await registry.written()
    assert _pins(fake) == 1
    started = time.monotonic()
    await registry.released()  # the fence-off's first try comes after half a second
    assert time.monotonic() - started < 5.0
    assert _released(a, "commit_lost") == (0 if land else 1)
    assert _pins(fake) == (1 if land else 0)
    await _ask(b, "unanswered", messages, QUESTIONS[2])
    turns = await b.turns("unanswered")
    assert [t["handle_state"] for t in turns] == (
        ["none", "attached", "attached"] if land else ["none", "consumed"]
    )
    assert fake.wrong_reuse_events == 0
    await _delete(b, "unanswered")
    assert _pins(fake) == 0
    await a.aclose(release=False)
    await b.aclose()
