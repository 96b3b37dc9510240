"""A hypothesis state machine: two proxy replicas share one conversation through a session store.

Each replica is its own app with its own cluster client (as separate processes are), in front
of the fake pair; only the store and the servers are shared. The store is ``MemoryStore`` below:
the Redis scripts of ``agentkv/proxy/_redis_store.py`` ported to one dict, with claim leases on
a manual clock of their own, so that a claim lapses exactly when a rule says so. One client
holds one conversation (``X-Session-ID``) and sends its next request to either replica.

Steps: a turn through either replica; the same request through both at once (``asyncio.gather``:
a client retrying on the other replica), the client going on with either answer; a replica
paused between its answer and its commit (the commit is written behind the answer and waits);
a paused replica resumed (its late commit lands, or is refused when its claim lapsed and the
session moved on); a replica killed with its commit in flight (the write-behind task is
cancelled, its claim stays in the store until it lapses, a fresh replica takes its place);
claims lapsing (the store's clock); the session clock jumping; faults on either leg.

After every step:

* no pull read wrong KV (``FakeCluster.wrong_reuse_events == 0``);
* a handle is single use: no two P legs carry one decode handle, whichever replicas sent them
  (so a replica that lost its claim never attaches a handle the other one also attaches);
* the stored conversation is a consistent prefix of what the client was answered: every
  message is the client's, except that the last one may be another answer a replica gave to
  the client's request at that position (a race's other answer, or one the client never saw);
* after a turn whose commit is not held back, the stored conversation is exactly the client's.

At the end the session is deleted through a live replica: decode keeps no pin beyond those a
replica could not release because it died, or lost its claim, between an answer and its commit.

Shared by ``test_fuzz_replicas.py`` (bounded, in the normal run, derandomized) and the longer
run, with fresh randomness::

    AGENTKV_FUZZ_EXAMPLES=300 nice -n 10 .venv/bin/python -m pytest \\
        tests/fake/test_fuzz_replicas.py -q -s -p no:cacheprovider

(``AGENTKV_FUZZ_STEPS`` sets the steps per sequence; the run prints its figures at the end).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import Awaitable
from typing import Any

import httpx2
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from agentkv import AsyncCluster, Message, RetryPolicy
from agentkv.proxy import ProxyConfig, create_app
from agentkv.proxy._config import key_digest
from agentkv.proxy._entry import SessionEntry, store_key
from agentkv.proxy._redis_store import ORPHANS_KEPT
from agentkv.proxy._store import (
    Claim,
    ClaimLostError,
    CommitFate,
    Stored,
    StoreUnavailableError,
    response_group,
)
from agentkv.testing import FakeCluster, ManualClock
from tests.fake.fuzz_sessions import FAULTS, carried_handle

SYSTEM = "You answer briefly. " + " ".join(f"Rule {i}: be kind to robot {i}." for i in range(12))
WORDS = ("robot 4", "robot 9", "Paris", "tea", "trains", "rivers", "KV")
PRINCIPAL_KEY = "sk-fuzz"
SESSION = "conversation"
LEASE_S = 300.0  # claims: on the store's own clock, renewed by the proxy every LEASE_S / 3 real s
UNBLOCK = ("resume", "lapse", "kill", "sweep")
STUCK_S = 60.0  # real seconds without progress in one step: a hang, reported as a failure

questions = st.lists(st.sampled_from(WORDS), min_size=1, max_size=3).map(
    lambda ws: "Tell me about " + " and ".join(ws) + "."
)
replicas_ = st.sampled_from([0, 1])


class MemoryStore:
    """``SessionStore`` in memory: ``RedisSessions``' scripts, one dict, leases on ``clock``.

    As in Redis, a session is a hash (``_snaps``: ``ver``, ``snap`` the snapshot without its
    tail, ``tver``) and its tail apart (``_tails``), appended to by a commit that extends it.
    An appending commit is also checked against what Redis cannot see: that the tail it extends
    is the one its snapshot starts with (``AssertionError`` otherwise: the caller's ``kept`` was
    wrong, and Redis would have stored a mixed snapshot). ``appended`` and ``rewritten`` count
    the commits of each kind.

    A claimant that finds the session claimed waits for a change (a commit, a release, a
    removal, the clock moving) instead of polling. ``waiting`` counts them; ``attention`` is set
    whenever one starts waiting (and by a replica whose commit starts waiting at its gate), so
    that a driver can tell when a request waits on a claim that will not end by itself.
    """

    def __init__(self, *, clock: ManualClock, lease_s: float = LEASE_S) -> None:
        self.clock = clock
        self.lease_s = lease_s
        self._fence = 0
        self._snaps: dict[str, tuple[int, bytes, int]] = {}  # key -> (ver, snap, tver)
        self._tails: dict[str, bytes] = {}
        self.appended = 0
        self.rewritten = 0
        self._held: dict[str, tuple[int, str]] = {}  # the hash's ``held`` and ``secret``
        self._dirty: set[str] = set()  # the hash's ``dirty``: set until a commit
        self._orphans: dict[str, tuple[str, ...]] = {}  # the hash's ``orphans``
        self._locks: dict[str, tuple[int, float]] = {}  # key -> (fence, lease deadline)
        self._idle: dict[str, float] = {}
        self._pinned: dict[str, float] = {}
        self._sweeping: dict[str, float] = {}  # key -> until when an idle sweep holds it
        self._secret: str | None = None
        # As Redis' ``r:{group}`` hashes: group -> (id -> (count, record)), and when each
        # group's ``PX`` runs out.
        self._responses: dict[str, dict[str, tuple[int, bytes]]] = {}
        self._responses_until: dict[str, float] = {}
        self._changed = asyncio.Event()
        self.attention = asyncio.Event()
        self.waiting = 0

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def advance(self, seconds: float) -> None:
        """Move the leases' clock (claims not renewed meanwhile lapse)."""
        self.clock.advance(seconds)
        self._wake()

    def lock(self, key: str) -> int | None:
        """The fence holding ``key`` now, if any (a lapsed lease holds nothing)."""
        held = self._locks.get(key)
        if held is not None and held[1] <= self.clock():
            del self._locks[key]  # Redis's PX expiry
            held = None
        return None if held is None else held[0]

    async def claim(
        self, key: str, *, known_version: int, wait_s: float, secret: str = ""
    ) -> Claim:
        deadline = self.clock() + wait_s
        while True:
            if self.lock(key) is None:
                self._fence += 1
                fence = self._fence
                self._locks[key] = (fence, self.clock() + self.lease_s)
                version, snap, tver = self._snaps.get(key, (0, b"", 0))
                previous = self._held.get(key)
                orphans = self._orphans.get(key, ())
                if previous is not None and previous[1]:
                    orphans = (*orphans, previous[1])[-ORPHANS_KEPT:]
                    self._orphans[key] = orphans
                if version > 0 and (previous is not None or key in self._dirty):
                    self._dirty.add(key)
                dirty = key in self._dirty
                self._held[key] = (fence, secret)
                data = None
                if version > 0 and (version != known_version or dirty):
                    data = snap + self._tails.get(key, b"") if tver == version else snap
                return Claim(
                    key=key,
                    fence=fence,
                    version=version,
                    data=data,
                    dirty=dirty,
                    secret=secret,
                    orphans=orphans,
                )
            if self.clock() >= deadline:
                raise TimeoutError(f"session {key} stayed claimed for {wait_s:.1f} s")
            changed = self._changed
            self.waiting += 1
            self.attention.set()
            try:
                await changed.wait()
            finally:
                self.waiting -= 1

    async def renew(self, claim: Claim) -> bool:
        if self.lock(claim.key) != claim.fence:
            return False
        self._locks[claim.key] = (claim.fence, self.clock() + self.lease_s)
        return True

    async def commit(
        self,
        claim: Claim,
        data: bytes,
        *,
        used_at: float,
        pinned: bool = False,
        tail: int = 0,
        kept: int = 0,
    ) -> int:
        key = claim.key
        if not 0 <= kept <= tail <= len(data):
            raise ValueError(f"commit: kept {kept}, tail {tail} of a {len(data)}-byte snapshot")
        if self.lock(key) != claim.fence:
            raise ClaimLostError(f"the claim on session {key} was lost; nothing written")
        split = len(data) - tail
        version, _, tver = self._snaps.get(key, (0, b"", 0))
        stored_tail = self._tails.get(key, b"")
        if kept and version == tver == claim.version and len(stored_tail) == kept:
            assert stored_tail == data[split : split + kept], "an append to another tail"
            self._tails[key] = stored_tail + data[split + kept :]
            self.appended += 1
        else:  # kept 0, or the script's -1 and the whole commit sent after it
            self._tails[key] = data[split:]
            self.rewritten += 1
        self._snaps[key] = (claim.fence, data[:split], claim.fence)
        self._held.pop(key, None)
        self._dirty.discard(key)
        self._orphans.pop(key, None)
        del self._locks[key]
        self._idle[key] = used_at
        if pinned:
            self._pinned[key] = used_at
        else:
            self._pinned.pop(key, None)
        self._wake()
        return claim.fence

    def _unhold(self, claim: Claim) -> None:
        held = self._held.get(claim.key)
        if held is not None and held[0] == claim.fence:
            del self._held[claim.key]

    async def release(self, claim: Claim) -> None:
        key = claim.key
        if self.lock(key) == claim.fence:
            del self._locks[key]
            self._unhold(claim)
            self._wake()

    async def fence_off(self, claim: Claim) -> CommitFate:
        key = claim.key
        held = self._held.get(key)
        if held is not None and held[0] == claim.fence:
            if self.lock(key) == claim.fence:
                del self._locks[key]
            del self._held[key]
            if key in self._snaps:
                self._dirty.add(key)
            self._wake()
            return CommitFate.LOST
        if key in self._snaps and self._snaps[key][0] == claim.fence:
            return CommitFate.LANDED
        return CommitFate.SUPERSEDED

    async def remove(self, claim: Claim, *, idle_before: float | None = None) -> bool:
        key = claim.key
        if self.lock(key) != claim.fence:
            return False
        used = self._idle.get(key)
        if idle_before is not None and used is not None and used >= idle_before:
            del self._locks[key]
            self._unhold(claim)
            self._wake()
            return False
        existed = self._snaps.pop(key, None) is not None
        self._responses.pop(response_group(key), None)
        self._tails.pop(key, None)
        self._held.pop(key, None)
        self._dirty.discard(key)
        self._orphans.pop(key, None)
        del self._locks[key]
        self._idle.pop(key, None)
        self._pinned.pop(key, None)
        self._wake()
        return existed

    async def peek(self, key: str) -> Stored:
        claimed = self.lock(key) is not None
        if key not in self._snaps:
            return Stored(version=0, data=None, claimed=claimed)
        version, snap, tver = self._snaps[key]
        data = snap + self._tails.get(key, b"") if tver == version else snap
        return Stored(version=version, data=data, claimed=claimed)

    async def idle(self, *, before: float, limit: int) -> list[str]:
        keys = sorted((used, key) for key, used in self._idle.items() if used < before)
        return [key for _, key in keys[:limit]]

    async def take_idle(self, *, before: float, limit: int, hold_s: float) -> list[str]:
        now = self.clock()
        self._sweeping = {k: until for k, until in self._sweeping.items() if until > now}
        idle = await self.idle(before=before, limit=len(self._idle))
        taken = [key for key in idle if key not in self._sweeping][:limit]
        self._sweeping.update(dict.fromkeys(taken, now + hold_s))
        return taken

    async def count(self) -> int:
        return len(self._idle)

    async def pinned_idle(self, *, before: float, limit: int) -> list[tuple[str, float]]:
        keys = sorted((used, key) for key, used in self._pinned.items() if used < before)
        return [(key, used) for used, key in keys[:limit]]

    def _group(self, group: str) -> dict[str, tuple[int, bytes]]:
        if self._responses_until.get(group, 0.0) <= self.clock():
            self._responses.pop(group, None)
        return self._responses.setdefault(group, {})

    async def put_response(
        self, key: str, response_id: str, record: bytes, *, count: int, ttl_s: float
    ) -> None:
        group = response_group(key)
        self._group(group)[response_id] = (count, record)
        self._responses_until[group] = self.clock() + ttl_s

    async def get_response(self, group: str, response_id: str) -> bytes | None:
        stored = self._group(group).get(response_id)
        return None if stored is None else stored[1]

    async def drop_responses(self, key: str, *, after: int) -> None:
        responses = self._group(response_group(key))
        for response_id in [r for r, (count, _) in responses.items() if count > after]:
            del responses[response_id]

    async def shared_secret(self) -> str:
        if self._secret is None:
            self._secret = secrets.token_hex(32)
        return self._secret

    async def ping(self) -> bool:
        return True

    async def aclose(self) -> None:
        return None


class ReplicaStore:
    """One replica's view of the shared store: commits can be held back (a replica paused
    between its answer and its commit), and a killed replica's store answers nothing more."""

    def __init__(
        self, inner: MemoryStore, *, name: str, owners: dict[int, str], lost: dict[str, int]
    ) -> None:
        self._inner = inner
        self.lost = lost
        self.lease_s = inner.lease_s
        self.name = name
        self._owners = owners
        self.gate = asyncio.Event()
        self.gate.set()
        self.dead = False
        self.held = 0  # commits waiting at the gate now
        self.landed = 0
        self.refused = 0
        self.cancelled = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def _alive(self) -> None:
        if self.dead:
            raise StoreUnavailableError(f"replica {self.name} is dead")

    async def claim(
        self, key: str, *, known_version: int, wait_s: float, secret: str = ""
    ) -> Claim:
        self._alive()
        claim = await self._inner.claim(
            key, known_version=known_version, wait_s=wait_s, secret=secret
        )
        self._owners[claim.fence] = self.name
        return claim

    async def renew(self, claim: Claim) -> bool:
        self._alive()
        return await self._inner.renew(claim)

    async def commit(
        self,
        claim: Claim,
        data: bytes,
        *,
        used_at: float,
        pinned: bool = False,
        tail: int = 0,
        kept: int = 0,
    ) -> int:
        self._alive()
        self.held += 1
        if not self.gate.is_set():
            self._inner.attention.set()
        try:
            await self.gate.wait()
        except asyncio.CancelledError:
            self.cancelled += 1  # killed: counted in ``lost`` by ``Replica.kill``
            raise
        finally:
            self.held -= 1
        self._alive()
        try:
            version = await self._inner.commit(
                claim, data, used_at=used_at, pinned=pinned, tail=tail, kept=kept
            )
        except ClaimLostError:
            self.refused += 1
            self.lost["refused"] += 1
            raise
        self.landed += 1
        return version


class Recorder(httpx2.AsyncBaseTransport):
    """A replica's transport to the fake: notes which P legs carry which decode handle, and
    can stall its P legs (the process stops mid-turn, its handle taken, its claim held)."""

    def __init__(self, machine: ReplicaMachine, name: str) -> None:
        self._fake = machine.fake
        self._carried = machine.carried
        self._attention = machine.store.attention
        self.name = name
        self.gate = asyncio.Event()
        self.gate.set()
        self.stalled = 0  # P legs waiting at the gate now

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        if self._fake.server(str(request.url)).role == "prefill":
            if not self.gate.is_set() and request.url.path.endswith("completions"):
                self.stalled += 1
                self._attention.set()
                try:
                    await self.gate.wait()
                finally:
                    self.stalled -= 1
            handle = carried_handle(request)
            if handle is not None:
                self._carried.setdefault(handle, []).append(self.name)
        return await self._fake.transport.handle_async_request(request)


class Replica:
    """One proxy replica: an app, its own cluster client, its view of the shared store."""

    def __init__(self, machine: ReplicaMachine, index: int) -> None:
        machine.spawned += 1
        self.name = f"r{index}.{machine.spawned}"
        self.store = ReplicaStore(
            machine.store, name=self.name, owners=machine.owners, lost=machine.lost
        )
        self.transport = Recorder(machine, self.name)
        self.cluster = AsyncCluster.from_dict(
            machine.fake.cluster_spec,
            transport=self.transport,
            clock=machine.clock,
            block_size=16,
            retry=RetryPolicy(max_attempts=2, initial_backoff_s=0, max_backoff_s=0, jitter_s=0),
        )
        self.app = create_app(self.cluster, ProxyConfig(), clock=machine.clock, store=self.store)
        self.registry = self.app.state.registry
        self.http = httpx2.AsyncClient(
            transport=httpx2.ASGITransport(app=self.app), base_url="http://proxy"
        )

    @property
    def paused(self) -> bool:
        return not self.store.gate.is_set()

    @property
    def holding(self) -> bool:
        """A commit waits at the closed gate, or is on its way there: until it lands the
        session stays checked out here, and claimed in the store."""
        return self.store.held > 0 or (self.paused and bool(self.registry._writes))

    async def ask(self, messages: list[dict[str, str]], max_tokens: int) -> httpx2.Response:
        return await self.http.post(
            "/v1/chat/completions",
            json={"model": "fake-smollm2", "messages": messages, "max_tokens": max_tokens},
            headers={"X-Session-ID": SESSION, "Authorization": f"Bearer {PRINCIPAL_KEY}"},
        )

    async def kill(self) -> None:
        """As a killed process: what it was writing never lands, it releases nothing, its
        claims stay in the store until their lease runs out."""
        self.store.dead = True
        writes = list(self.registry._writes)
        self.store.lost["killed"] += len(writes)  # never to land
        tasks = writes + [e.renewer for e in self.registry._entries.values() if e.renewer]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)
        await self.http.aclose()
        await self.cluster.aclose()

    async def aclose(self) -> None:
        self.store.gate.set()
        await self.registry.written()
        await self.registry.close_all()
        await self.http.aclose()
        await self.cluster.aclose()


class Counters:
    """Figures of a whole hypothesis run."""

    sequences = 0
    steps = 0
    answered = 0
    failed = 0
    races = 0
    races_overlapped = 0
    kills_in_flight = 0
    lapses = 0
    refused = 0
    sweeps = 0
    swept = 0  # sessions the sweeps removed
    stranded = 0  # pins left at the end: all explained by deaths and refused commits
    stranded_fenced = 0  # of which in sequences where no replica died, only commits were refused
    appended = 0  # commits that appended to the stored token ids
    rewritten = 0  # commits that wrote them whole
    unblocked: dict[str, int] = {}  # noqa: RUF012 - a tally, read by the test module
    handles: dict[str, int] = {}  # noqa: RUF012 - a tally, read by the test module

    @classmethod
    def unblock(cls, action: str) -> None:
        cls.unblocked[action] = cls.unblocked.get(action, 0) + 1

    @classmethod
    def summary(cls) -> str:
        return (
            f"sequences={cls.sequences} steps={cls.steps} answered={cls.answered} "
            f"failed={cls.failed} races={cls.races} races_overlapped={cls.races_overlapped} "
            f"kills_with_commit_in_flight={cls.kills_in_flight} lapses={cls.lapses} "
            f"refused_commits={cls.refused} sweeps={cls.sweeps} swept={cls.swept} "
            f"appended={cls.appended} rewritten={cls.rewritten} "
            f"stranded_pins={cls.stranded} "
            f"(no death: {cls.stranded_fenced}) "
            f"unblocked={dict(sorted(cls.unblocked.items()))} "
            f"handle_states={dict(sorted(cls.handles.items()))}"
        )


def _said(message: Message) -> tuple[str, str]:
    return message.role, (message.content or "").strip()


class ReplicaMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        Counters.sequences += 1
        self.loop = asyncio.new_event_loop()
        self.clock = ManualClock()
        self.fake = FakeCluster(
            pairs=2, clock=self.clock, num_kv_blocks=256, kv_recompute_threshold=1
        )
        self.store = MemoryStore(clock=ManualClock())
        self.owners: dict[int, str] = {}
        self.carried: dict[tuple[str, str], list[str]] = {}
        self.spawned = 0
        # Commits that never landed: their replica was killed waiting, or its claim was lost.
        # Each may leave one pin until its TTL: the stored handle when that turn did not consume
        # it (the next holder drops it); its turn's new one is released (see ``teardown``).
        self.lost = {"killed": 0, "refused": 0}
        self.replicas = [Replica(self, 0), Replica(self, 1)]
        # A third replica serving no requests, only its idle sweep (``sweep``).
        self.sweeper = Replica(self, 2)
        self.dead: list[Replica] = []
        self.inspector = AsyncCluster.from_dict(
            self.fake.cluster_spec, transport=self.fake.transport, clock=self.clock
        )
        # The client's conversation, and every answer a replica gave at each position.
        self.history: list[tuple[str, str]] = [("system", SYSTEM)]
        self.answers: dict[int, set[str]] = {}

    def run(self, coro: Awaitable[Any]) -> Any:
        Counters.steps += 1
        return self.loop.run_until_complete(coro)

    # --- the client -------------------------------------------------------------------------

    def _messages(self, question: str) -> list[dict[str, str]]:
        said = [*self.history, ("user", question)]
        return [{"role": role, "content": content} for role, content in said]

    def _answered(self, response: httpx2.Response) -> str | None:
        if response.status_code != 200:
            Counters.failed += 1
            return None
        Counters.answered += 1
        state = response.headers.get("x-agentkv-handle", "?")
        Counters.handles[state] = Counters.handles.get(state, 0) + 1
        content = response.json()["choices"][0]["message"]["content"] or ""
        self.answers.setdefault(len(self.history) + 1, set()).add(content.strip())
        return str(content)

    def _go_on(self, question: str, answer: str) -> None:
        self.history += [("user", question), ("assistant", answer.strip())]

    def _owner(self) -> Replica | None:
        """The replica whose claim holds the session in the store now, if any."""
        fence = self.store.lock(store_key(self._principal(), SESSION))
        name = None if fence is None else self.owners.get(fence)
        return next((r for r in [*self.replicas, *self.dead] if r.name == name), None)

    @staticmethod
    def _principal() -> str:
        return f"key-{key_digest(PRINCIPAL_KEY)}"  # the proxy's principal without --api-keys

    async def _drive(self, requests: list[Awaitable[Any]], unblock: str) -> list[Any]:
        """Run ``requests`` at once; whenever one waits on a claim that will not end by itself
        (held by a paused or dead replica), end it as ``unblock`` says: resume the holder,
        let its claim lapse, or kill it (its commit in flight) and let the claim lapse. A claim
        held by a turn stalled mid-way (``stall``) lapses; stalled turns go on once every
        other request has ended."""
        tasks = [asyncio.ensure_future(r) for r in requests]
        for _ in range(50):
            attention = asyncio.ensure_future(self.store.attention.wait())
            pending = [t for t in tasks if not t.done()]
            done, _ = await asyncio.wait(
                [*pending, attention], timeout=STUCK_S, return_when=asyncio.FIRST_COMPLETED
            )
            attention.cancel()
            if all(t.done() for t in tasks):
                break
            if not done:  # a wait the rules did not foresee: fail, do not hang the suite
                raise AssertionError(f"requests stuck: {self._where()}")
            self.store.attention.clear()
            owner = self._owner()
            stalled = sum(r.transport.stalled for r in self.replicas)
            if self.store.waiting and owner in self.replicas and owner.transport.stalled:
                Counters.unblock("lapse_mid_turn")
                self._lapse()
                continue
            if stalled and stalled >= sum(not t.done() for t in tasks):
                for replica in self.replicas:
                    replica.transport.gate.set()
                continue
            if (
                not self.store.waiting
                or owner is None
                or (owner in self.replicas and not owner.holding)
            ):
                continue  # nobody waits, or on a live holder: its turn and commit end the wait
            action = unblock if owner in self.replicas else "lapse"
            Counters.unblock(action)
            if action == "resume":
                owner.store.gate.set()
            elif action == "kill":
                await self._kill(self.replicas.index(owner))
                self._lapse()
            elif action == "sweep":  # the lapsed claim's next claimant is an idle sweep
                self._lapse()
                await self._sweep(used_since=True)
            else:
                self._lapse()
        else:
            raise AssertionError(f"requests stuck behind a claim: {self._where()}")
        return [t.result() for t in tasks]

    def _where(self) -> str:
        owner = self._owner()
        replicas = [
            f"{r.name}: paused={r.paused} held={r.store.held} writes={len(r.registry._writes)} "
            f"stalled={r.transport.stalled}"
            for r in self.replicas
        ]
        return f"owner={owner and owner.name} waiting={self.store.waiting} {replicas}"

    def _lapse(self) -> None:
        Counters.lapses += 1
        self.store.advance(LEASE_S + 1.0)

    async def _kill(self, index: int) -> None:
        victim = self.replicas[index]
        if victim.holding:
            Counters.kills_in_flight += 1
        await victim.kill()
        self.dead.append(victim)
        self.replicas[index] = Replica(self, index)

    # --- rules ------------------------------------------------------------------------------

    @precondition(lambda self: not all(r.holding for r in self.replicas))
    @rule(
        index=replicas_,
        question=questions,
        max_tokens=st.sampled_from([8, 40]),
        unblock=st.sampled_from(UNBLOCK),
    )
    def ask(self, index: int, question: str, max_tokens: int, unblock: str) -> None:
        """The client's next request, through one replica."""
        replica = self.replicas[index]
        if replica.holding:  # its copy stays checked out until the held commit lands
            replica = self.replicas[1 - index]
        (response,) = self.run(
            self._drive([replica.ask(self._messages(question), max_tokens)], unblock)
        )
        answer = self._answered(response)
        if answer is None:
            return
        self._go_on(question, answer)
        if replica in self.replicas and not replica.paused:
            self.run(replica.registry.written())
            assert self._stored() == self.history, "the stored conversation is not the client's"

    @precondition(lambda self: not any(r.holding for r in self.replicas))
    @rule(
        question=questions,
        pick=st.sampled_from([0, 1]),
        unblock=st.sampled_from(UNBLOCK),
    )
    def race(self, question: str, pick: int, unblock: str) -> None:
        """One request through both replicas at once; the client goes on with either answer."""
        Counters.races += 1
        messages = self._messages(question)
        spans: list[str] = []

        async def ask(replica: Replica) -> httpx2.Response:
            spans.append(replica.name)
            try:
                return await replica.ask(messages, 24)
            finally:
                spans.append(replica.name)

        responses = self.run(self._drive([ask(r) for r in self.replicas], unblock))
        # Both requests were in the replicas at once: each started before the other ended.
        if spans[:2] != spans[2:3] * 2:
            Counters.races_overlapped += 1
        answers = [self._answered(r) for r in responses]
        chosen = answers[pick] if answers[pick] is not None else answers[1 - pick]
        if chosen is not None:
            self._go_on(question, chosen)

    @rule(index=replicas_)
    def pause(self, index: int) -> None:
        """The replica stalls between its answers and their commits."""
        self.replicas[index].store.gate.clear()

    @rule(index=replicas_)
    def resume(self, index: int) -> None:
        replica = self.replicas[index]
        replica.store.gate.set()
        self.run(replica.registry.written())

    @rule(index=replicas_)
    def stall(self, index: int) -> None:
        """The replica's next turn stops before its P leg (its handle taken, its claim held)
        until every other request of the step has ended; meanwhile its claim may lapse."""
        self.replicas[index].transport.gate.clear()

    @rule(index=replicas_)
    def kill(self, index: int) -> None:
        """The replica dies; a commit it held back never lands."""
        self.run(self._kill(index))

    async def _sweep(self, *, used_since: bool) -> None:
        """An idle sweep (on the third replica, which serves no requests) reaches the session:
        it listed it as idle before a cutoff and removes it under a claim, refused when the
        session was used since (``used_since``: the cutoff is before its last commit). After a
        claim that lapsed mid-turn, the sweep's claim is dirty, and its refused removal must not
        clear that (only a commit does). A removed session's client goes on: its next request
        re-sends the whole history."""
        Counters.sweeps += 1
        now = time.time()
        cutoff = now - 3600.0 if used_since else now + 1.0
        removed = await self.sweeper.registry._remove(
            self._principal(), SESSION, reason="idle", idle_before=cutoff
        )
        Counters.swept += removed

    @rule(used_since=st.booleans())
    def sweep(self, used_since: bool) -> None:
        self.run(self._sweep(used_since=used_since))

    @rule()
    def lapse(self) -> None:
        """Claims not renewed for a lease lapse (a replica paused past its lease)."""
        self._lapse()

    @rule(seconds=st.sampled_from([1.0, 100.0, 481.0]))
    def time_passes(self, seconds: float) -> None:
        self.clock.advance(seconds)

    @rule(
        role=st.sampled_from(["prefill", "decode"]),
        pair=st.integers(0, 1),
        kind=st.sampled_from(FAULTS),
    )
    def fault(self, role: str, pair: int, kind: str) -> None:
        server = self.fake.prefill(pair) if role == "prefill" else self.fake.decode(pair)
        server.fail_next(kind, status=503)

    # --- what must hold ---------------------------------------------------------------------

    def _stored(self) -> list[tuple[str, str]] | None:
        stored = self.run(self.store.peek(store_key(self._principal(), SESSION)))
        if stored.data is None:
            return None
        entry = SessionEntry(("fuzz", "inspect"), self.inspector.session(), now=0.0)
        entry.load_bytes(stored.data, self.inspector)
        try:
            return [_said(m) for m in entry.session.transcript.messages]
        finally:
            entry.session.detach()

    @invariant()
    def no_wrong_kv(self) -> None:
        assert self.fake.wrong_reuse_events == 0

    @invariant()
    def a_handle_is_single_use(self) -> None:
        reused = {h[1][-12:]: who for h, who in self.carried.items() if len(who) > 1}
        assert not reused, f"P legs carried one decode handle more than once: {reused}"

    @invariant()
    def the_store_holds_a_prefix_of_what_the_client_was_answered(self) -> None:
        stored = self._stored()
        if stored is None:
            return
        assert len(stored) <= len(self.history), (stored, self.history)
        for i, said in enumerate(stored):
            if said == self.history[i]:
                continue
            assert i == len(stored) - 1, f"message {i} of the stored session is not the client's"
            assert said[0] == "assistant", f"message {i} of the stored session is not the client's"
            assert said[1] in self.answers.get(i, ()), f"stored, never answered: {said}"

    def teardown(self) -> None:
        try:
            live = self.replicas[0]
            for replica in self.replicas:
                replica.store.gate.set()
            for replica in self.replicas:
                self.run(replica.registry.written())
            Counters.refused += self.lost["refused"]
            Counters.appended += self.store.appended
            Counters.rewritten += self.store.rewritten
            self.store.advance(LEASE_S + 1.0)  # dead replicas' claims
            response = self.run(
                live.http.delete(
                    f"/v1/sessions/{SESSION}", headers={"Authorization": f"Bearer {PRINCIPAL_KEY}"}
                )
            )
            assert response.status_code in (200, 404), response.text
            pins = sum(self.fake.decode(i).pinned_handles for i in range(2))
            Counters.stranded += pins
            if pins and not self.lost["killed"]:
                Counters.stranded_fenced += pins
            # A lost commit's own turn pinned KV nobody else knows of: released (by the replica
            # whose commit was refused, or by the next claim, its secret an orphan). What may
            # stay is the stored handle such a turn did not consume: the next holder can neither
            # attach it nor release it (the holder that stopped may only be slow, its pull to
            # come), and it lives out its TTL. One per lost commit at most.
            explained = self.lost["killed"] + self.lost["refused"]
            assert pins <= explained, f"{pins} pins left after the delete, {explained} explained"
            self.no_wrong_kv()
        finally:
            for replica in [*self.replicas, self.sweeper]:
                with contextlib.suppress(Exception):
                    self.run(replica.aclose())
            self.run(self.inspector.aclose())
            self.loop.close()
