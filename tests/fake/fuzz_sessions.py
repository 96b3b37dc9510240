"""A hypothesis state machine that drives sessions on the fake pair and checks agentkv's promises.

Each step is one of: open, send (long or short answers), stream (completed, left early),
cancel a turn after decode finished, fork, save + load, close, tool wait, clock jumps past
TTLs, faults on either leg, a server killed or restarted, concurrent turns of two sessions (and
a second turn on a busy session), and another tenant's one-shot traffic that takes freed blocks.

Concurrent rules (issue 26): their operations run at once on the machine's one event loop
(``asyncio.gather``; the fake transport yields at every request, so they interleave):

* two or three holders of one save file (two loads; a load beside the original, which also
  sends; both loads and the original) send their first turns together;
* ``session.offload()`` races a turn of the same session (either order of start);
* a tool wait that persists the handle to the file tier races a copy loaded from the session's
  save file and that copy's first turn.

Each sequence first draws the fake's options: two pairs, or a pool of two prefills before one
decode (a turn's prefill chosen by load: a second holder's P leg then pulls everything, where on
one pair it finds most of it in its own prefix cache); ``kv_recompute_threshold`` 64 (vLLM's
default) or 1 (every token short of the local prefix cache is pulled); a file tier on decode or
none.

After every step:

* no pull read wrong KV (``FakeCluster.wrong_reuse_events == 0``; the fake is strict: a pull
  of blocks the producer no longer pins for that request counts, even if their content is
  still intact);
* a handle is single use: no two P legs ever carry the same decode handle (whoever sent them);
* every open session's transcript is complete (exactly the messages of its committed turns, in
  order, nothing pending after a failed send) and token-exact (append-only, and each turn's
  generated ids sit right after its prompt);
* once every session is closed, no decode holds a turn-end pin.

And after each concurrent step: of the holders of one handle at most one turn reports it
``attached``; every other holder's turn says why it did not (``handle_reason``); a persist that
moved a handle to the tier and a turn that attached that same handle never both happen.

Shared by ``test_fuzz_sessions.py`` (bounded, in the normal run, derandomized) and the longer
run, with fresh randomness::

    AGENTKV_FUZZ_EXAMPLES=300 nice -n 10 .venv/bin/python -m pytest \
        tests/fake/test_fuzz_sessions.py -q -s -p no:cacheprovider

(``AGENTKV_FUZZ_STEPS`` sets the steps per sequence; the run prints its figures, concurrent
firings included, at the end).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import httpx2
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
)

from agentkv import (
    AgentKVError,
    AsyncCluster,
    AsyncSession,
    HandleState,
    Message,
    RetryPolicy,
    Route,
    SessionBusyError,
    TurnResult,
)
from agentkv.testing import FakeCluster, FakeServer, ManualClock

SYSTEM = Message.system("You are a helpful assistant. Answer in one or two sentences. " * 3)
WORDS = ("Paris", "Spain", "rivers", "weather", "history", "numbers", "tea", "trains", "KV")
LONG = {"max_tokens": 90, "extra_body": {"min_tokens": 70}}  # pulls over the threshold
SHORT = {"max_tokens": 6}
FAULTS = (
    "status",
    "timeout",
    "reset",
    "malformed_json",
    "truncated_json",
    "no_kv_transfer_params",
    "bad_kv_transfer_params",
)

# Questions that part from each other at once ("Hi.") or only after a few tokens: two prompts
# behind one handle then share little or much of a prefill's prefix cache.
questions = st.builds(
    lambda lead, ws: lead + " and ".join(ws) + ".",
    st.sampled_from(["Tell me about ", "Tell me about ", "Hi. ", "Why "]),
    st.lists(st.sampled_from(WORDS), min_size=1, max_size=4),
)
sizes = st.sampled_from(["long", "long", "short"])
# How a turn reaches decode: the pull (the default), decode's own compute, or the policy's choice.
routes = st.sampled_from(["pull", "pull", "decode", "auto"])
# Scheduling points an answer to a lease call is late by, in a concurrent step.
lags = st.sampled_from([0, 1, 4])
# Lease answers late, too: found with them, a turn started while ``session.offload()`` waited
# for decode's answer attached the handle decode was moving to the tier (fixed: a persist holds
# the session as a turn does; replayed in test_fuzz_corpus.py).
persist_race_lags = lags


@dataclasses.dataclass
class Tracked:
    """A session and what its transcript must hold."""

    session: AsyncSession
    messages: list[Message]
    name: str
    pending: list[Message] = dataclasses.field(default_factory=list)


# Which of a concurrent step's operations sent a request (set in each gathered task).
ACTOR: contextvars.ContextVar[str | None] = contextvars.ContextVar("fuzz_actor", default=None)


def carried_handle(request: httpx2.Request) -> tuple[str, str] | None:
    """The decode handle a P leg carries: ``(remote_engine_id, remote_request_id)``, else None."""
    if request.method != "POST" or not request.url.path.endswith("completions"):
        return None
    try:
        body = json.loads(request.content)
    except ValueError:
        return None
    params = body.get("kv_transfer_params") if isinstance(body, dict) else None
    if not (isinstance(params, dict) and params.get("do_remote_decode")):
        return None
    if not params.get("remote_block_ids") or not params.get("remote_request_id"):
        return None  # a first turn's P leg, or one carrying a tier reference
    return str(params.get("remote_engine_id")), str(params["remote_request_id"])


class AnswerHeld(httpx2.AsyncBaseTransport):
    """The fake's transport; while held, decode's answers wait (decode has finished).

    It also keeps what the checks need: the actor (``ACTOR``) of every request's start and end,
    in order, and how many P legs carried each decode handle.
    """

    def __init__(self, fake: FakeCluster) -> None:
        self.fake = fake
        self.inner = fake.transport
        self.held = asyncio.Event()
        self._gate: asyncio.Event | None = None
        self.actors: list[str | None] = []
        self.carried: dict[tuple[str, str], int] = {}
        # Extra scheduling points before an answer to a lease call (release, extend, claim,
        # persist) comes back: decode has acted, its client does not know yet (a slow write).
        self.lease_lag = 0

    def hold(self) -> None:
        self.held = asyncio.Event()
        self._gate = asyncio.Event()

    def release(self) -> None:
        if self._gate is not None:
            self._gate.set()
        self._gate = None

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        self.actors.append(ACTOR.get())
        server = self.fake.server(str(request.url))
        handle = carried_handle(request) if server.role == "prefill" else None
        if handle is not None:
            self.carried[handle] = self.carried.get(handle, 0) + 1
        try:
            response = await self.inner.handle_async_request(request)
        finally:
            self.actors.append(ACTOR.get())  # its end: a span from each request's start to end
        if self.lease_lag and request.url.path.startswith("/v1/agentkv/"):
            for _ in range(self.lease_lag):
                await asyncio.sleep(0)
        gate = self._gate
        decode = server.role == "decode"
        if gate is not None and decode and "/chat/" in request.url.path:
            self.held.set()
            await gate.wait()
        return response


class Counters:
    """Figures for docs/reliability.md (summed over a whole hypothesis run)."""

    steps = 0
    sequences = 0
    turns_ok = 0
    turns_failed = 0
    errors: dict[str, int] = {}  # noqa: RUF012 - a tally, read by the test module
    # Concurrent steps: how often each ran, and how often its operations' requests interleaved.
    concurrent: dict[str, int] = {}  # noqa: RUF012 - a tally, read by the test module
    overlapped: dict[str, int] = {}  # noqa: RUF012 - a tally, read by the test module

    @classmethod
    def failed(cls, why: str) -> None:
        cls.turns_failed += 1
        cls.errors[why] = cls.errors.get(why, 0) + 1

    @classmethod
    def fired(cls, rule: str, *, overlapped: bool) -> None:
        cls.concurrent[rule] = cls.concurrent.get(rule, 0) + 1
        if overlapped:
            cls.overlapped[rule] = cls.overlapped.get(rule, 0) + 1

    @classmethod
    def summary(cls) -> str:
        return (
            f"sequences={cls.sequences} steps={cls.steps} turns_ok={cls.turns_ok} "
            f"turns_failed={cls.turns_failed} errors={dict(sorted(cls.errors.items()))} "
            f"concurrent={dict(sorted(cls.concurrent.items()))} "
            f"overlapped={dict(sorted(cls.overlapped.items()))}"
        )


def interleaved(actors: list[str | None], labels: list[str]) -> bool:
    """Whether every two of ``labels`` had requests in flight at once: the spans from each one's
    first request's start to its last request's end overlap."""
    spans = []
    for label in labels:
        sent = [i for i, actor in enumerate(actors) if actor == label]
        if not sent:
            return False
        spans.append((sent[0], sent[-1]))
    return all(a[0] < b[1] and b[0] < a[1] for i, a in enumerate(spans) for b in spans[i + 1 :])


HOLDERS = ("two_loads", "load_beside_original", "both_loads_and_original")
BUSY = "busy"  # what a concurrent operation refused with SessionBusyError returns


class SessionMachine(RuleBasedStateMachine):
    sessions = Bundle("sessions")

    def __init__(self) -> None:
        super().__init__()
        Counters.sequences += 1
        self.loop = asyncio.new_event_loop()
        self.clock = ManualClock()
        self.open: dict[str, Tracked] = {}
        self.count = 0
        self.tmp = tempfile.TemporaryDirectory()
        self._build(threshold=64, tier=False, pool=False)

    def _build(self, *, threshold: int, tier: bool, pool: bool) -> None:
        # A small KV cache, so freed blocks are handed to other requests soon. A pool: two
        # prefills before one decode (each turn's prefill is chosen by load).
        shape: dict[str, int] = {"prefills": 2, "decodes": 1} if pool else {"pairs": 2}
        self.fake = FakeCluster(
            clock=self.clock,
            num_kv_blocks=256,
            kv_recompute_threshold=threshold,
            tier=tier,
            **shape,
        )
        self.decodes = 1 if pool else 2
        self.transport = AnswerHeld(self.fake)
        self.cluster = self._cluster()
        self.tenant = self._cluster()

    @initialize(threshold=st.sampled_from([64, 1]), tier=st.booleans(), pool=st.booleans())
    def configure(self, threshold: int, tier: bool, pool: bool = False) -> None:
        """The fake's options for this sequence (built with the defaults until now)."""
        if (threshold, tier, pool) == (64, False, False):
            return
        self.run(self.cluster.aclose())
        self.run(self.tenant.aclose())
        self._build(threshold=threshold, tier=tier, pool=pool)

    def _server(self, role: str, index: int) -> FakeServer:
        if role == "prefill":
            return self.fake.prefill(index)
        return self.fake.decode(index % self.decodes)

    def _cluster(self) -> AsyncCluster:
        return AsyncCluster.from_dict(
            self.fake.cluster_spec,
            transport=self.transport,
            clock=self.clock,
            block_size=16,
            retry=RetryPolicy(max_attempts=2, initial_backoff_s=0, max_backoff_s=0, jitter_s=0),
        )

    def run(self, coro: Any) -> Any:
        Counters.steps += 1
        return self.loop.run_until_complete(coro)

    async def _together(self, rule: str, *operations: Any, lag: int = 0) -> list[Any]:
        """Run ``operations`` at once (``asyncio.gather`` on this loop), each as its own actor,
        with answers to lease calls ``lag`` scheduling points late; count the step, and whether
        their requests interleaved."""
        labels = [f"{rule}:{i}" for i in range(len(operations))]
        start = len(self.transport.actors)
        self.transport.lease_lag = lag

        async def act(label: str, operation: Any) -> Any:
            ACTOR.set(label)  # this task's own context: its requests carry the label
            return await operation

        acts = (act(label, op) for label, op in zip(labels, operations, strict=True))
        try:
            results = await asyncio.gather(*acts)
        finally:
            self.transport.lease_lag = 0
        Counters.fired(rule, overlapped=interleaved(self.transport.actors[start:], labels))
        return list(results)

    def _track(self, session: AsyncSession, messages: list[Message]) -> Tracked:
        self.count += 1
        tracked = Tracked(session=session, messages=messages, name=f"s{self.count}")
        self.open[tracked.name] = tracked
        return tracked

    async def _turn(
        self,
        t: Tracked,
        text: str,
        size: str,
        *,
        final: bool = False,
        refusable: bool = False,
        route: Route = "pull",
    ) -> TurnResult | None:
        """One turn, tracked; ``None`` when it failed. ``refusable``: a ``SessionBusyError`` is
        raised (a race's expected refusal), not counted as a failed turn."""
        s = t.session
        before = s.transcript.token_ids
        try:
            result = await s.send(
                text, final=final, route=route, **(LONG if size == "long" else SHORT)
            )
        except SessionBusyError:
            if refusable:
                raise
            Counters.failed(SessionBusyError.__name__)
            return None
        except AgentKVError as exc:
            Counters.failed(type(exc).__name__)
            return None
        Counters.turns_ok += 1
        t.messages += [*t.pending, Message.user(text), result.message]
        t.pending.clear()
        self._check_turn(s, before, result)
        return result

    @staticmethod
    def _check_turn(s: AsyncSession, before: tuple[int, ...], result: TurnResult) -> None:
        after = s.transcript.token_ids
        assert after[: len(before)] == before, "a turn rewrote committed tokens"
        start = result.stats.prompt_tokens
        generated = tuple(result.token_ids)
        assert after[start : start + len(generated)] == generated, "generated ids misplaced"

    # --- sessions ---------------------------------------------------------------------------

    @rule(target=sessions)
    def open_session(self) -> Tracked:
        session = self.cluster.session()
        session.append(SYSTEM)
        tracked = self._track(session, [])
        tracked.pending.append(SYSTEM)
        return tracked

    @rule(t=sessions, text=questions, size=sizes, route=routes)
    def send(self, t: Tracked, text: str, size: str, route: Route = "pull") -> None:
        if t.session.closed:
            return
        self.run(self._turn(t, text, size, route=route))

    @rule(t=sessions, text=questions, leave=st.booleans())
    def stream(self, t: Tracked, text: str, leave: bool) -> None:
        s = t.session
        if s.closed:
            return

        async def go() -> None:
            before = s.transcript.token_ids
            s.append(Message.user(text))
            t.pending.append(Message.user(text))  # stays pending unless the stream commits
            result: TurnResult | None = None
            try:
                async with contextlib.aclosing(s.stream(**LONG)) as events:
                    async for event in events:
                        if leave:
                            break  # left early: nothing is committed
                        if isinstance(event, TurnResult):
                            result = event
            except AgentKVError as exc:
                Counters.failed(type(exc).__name__)
                return
            if result is None:
                Counters.failed("stream_left")
                return
            Counters.turns_ok += 1
            t.messages += [*t.pending, result.message]
            t.pending.clear()
            self._check_turn(s, before, result)

        self.run(go())

    @rule(t=sessions, text=questions)
    def cancel_after_decode(self, t: Tracked, text: str) -> None:
        """A turn cancelled while its answer is on the way (decode has finished)."""
        s = t.session
        if s.closed:
            return

        async def go() -> None:
            self.transport.hold()
            task = asyncio.ensure_future(s.send(text, **LONG))
            held = asyncio.ensure_future(self.transport.held.wait())
            # Until decode has answered (or the turn ended before it: a fault, a dead server).
            await asyncio.wait([task, held], return_when=asyncio.FIRST_COMPLETED)
            held.cancel()
            task.cancel()
            self.transport.release()
            try:
                result = await task
            except (asyncio.CancelledError, AgentKVError) as exc:
                Counters.failed(type(exc).__name__)
                return
            t.messages += [*t.pending, Message.user(text), result.message]
            t.pending.clear()

        self.run(go())

    @rule(target=sessions, t=sessions, keep_turns=st.integers(min_value=0, max_value=3))
    def fork(self, t: Tracked, keep_turns: int) -> Tracked:
        if t.session.closed:
            return self.open_session()  # the bundle grows alike on every replay
        keep = min(len(t.messages), 1 + 2 * keep_turns)
        kept = list(t.messages[:keep])
        child = self._track(t.session.fork(keep=keep), [])
        # Kept tokens when the cut ends on an assistant message, else queued for a fresh render.
        if list(child.session.transcript.messages) == kept:
            child.messages = kept
        else:
            child.pending = kept
        return child

    def _saved(self, t: Tracked) -> Path:
        path = Path(self.tmp.name) / f"{t.name}-{self.count}.json"
        t.session.save(path)
        return path

    def _load(self, t: Tracked, path: Path) -> Tracked:
        loaded = self._track(AsyncSession.load(path, self.cluster), list(t.messages))
        loaded.pending = list(t.pending)
        return loaded

    @rule(target=sessions, t=sessions)
    def save_and_load(self, t: Tracked) -> Tracked:
        if t.session.closed:
            return self.open_session()  # the bundle grows alike on every replay
        return self._load(t, self._saved(t))

    @rule(t=consumes(sessions), final_turn=st.booleans(), text=questions)
    def close(self, t: Tracked, final_turn: bool, text: str) -> None:
        if final_turn and not t.session.closed:
            self.run(self._turn(t, text, "long", final=True))
        self.run(t.session.aclose())
        self.open.pop(t.name, None)

    @rule(t=sessions, wait=st.sampled_from([0.0, 30.0, 200.0, 600.0]))
    def tool_wait(self, t: Tracked, wait: float) -> None:
        if t.session.closed:
            return

        async def go() -> None:
            async with t.session.tool_wait(expected_s=wait):
                self.clock.advance(wait)

        self.run(go())

    # --- the world --------------------------------------------------------------------------

    @rule(seconds=st.sampled_from([1.0, 20.0, 100.0, 481.0]))
    def time_passes(self, seconds: float) -> None:
        self.clock.advance(seconds)

    @rule(
        role=st.sampled_from(["prefill", "decode"]),
        pair=st.integers(0, 1),
        kind=st.sampled_from(FAULTS),
    )
    def fault(self, role: str, pair: int, kind: str) -> None:
        self._server(role, pair).fail_next(kind, status=503)

    @rule(role=st.sampled_from(["prefill", "decode"]), pair=st.integers(0, 1))
    def kill_or_restart(self, role: str, pair: int) -> None:
        server = self._server(role, pair)
        if server.alive:
            server.kill()
        else:
            server.restart()

    @rule(text=questions)
    def other_tenant(self, text: str) -> None:
        """Another client's one-shot conversation: it takes whatever blocks are free."""

        async def go() -> None:
            async with self.tenant.session() as s:
                with contextlib.suppress(AgentKVError):
                    await s.send(text * 3, max_tokens=40)

        self.run(go())

    @precondition(lambda self: len(self.open) >= 2)
    @rule(data=st.data(), texts=st.lists(questions, min_size=2, max_size=2))
    def concurrent_turns(self, data: st.DataObject, texts: list[str]) -> None:
        names = sorted(self.open)
        a = self.open[data.draw(st.sampled_from(names))]
        b = self.open[data.draw(st.sampled_from([n for n in names if n != a.name]))]
        # Two copies of one save file among them are fine too: the claim is exclusive.
        turns = (self._turn(a, texts[0], "long"), self._turn(b, texts[1], "long"))
        self.run(self._together("concurrent_turns", *turns))

    @rule(t=sessions, texts=st.lists(questions, min_size=2, max_size=2))
    def second_turn_on_a_busy_session(self, t: Tracked, texts: list[str]) -> None:
        s = t.session
        if s.closed:
            return

        async def go() -> None:
            first = asyncio.ensure_future(self._turn(t, texts[0], "short"))
            await asyncio.sleep(0)
            if first.done():  # it ran to the end in one go: nothing overlapped
                return
            try:
                await s.send(texts[1], **SHORT)
            except SessionBusyError:
                pass
            else:
                raise AssertionError("a second turn ran while the first was running")
            finally:
                await first

        self.run(go())

    # --- concurrent rules (issue 26) ------------------------------------------------------------

    @rule(
        target=sessions,
        t=sessions,
        variant=st.sampled_from(HOLDERS),
        texts=st.lists(questions, min_size=3, max_size=3),
        lag=lags,
    )
    def holders_of_one_save_file_send_at_once(
        self, t: Tracked, variant: str, texts: list[str], lag: int
    ) -> Any:
        """Save, load the file twice (or once beside the original, which lives on and sends too,
        or twice beside it), then every holder's first turn at once. The handle is single use:
        at most one of them attaches it, every other recomputes and says why."""
        copies = 1 if variant == "load_beside_original" else 2
        if t.session.closed:
            return multiple(*(self.open_session() for _ in range(copies)))
        path = self._saved(t)
        loaded = [self._load(t, path) for _ in range(copies)]
        holders = loaded if variant == "two_loads" else [t, *loaded]
        shared = t.session.handle
        results = self.run(
            self._together(
                "holders_of_one_save_file",
                *(self._turn(h, text, "short") for h, text in zip(holders, texts, strict=False)),
                lag=lag,
            )
        )
        if shared is not None:
            turns = [r for r in results if r is not None]
            attached = [r for r in turns if r.stats.handle_state == HandleState.ATTACHED]
            assert len(attached) <= 1, (
                f"{len(attached)} holders of one saved handle attached it "
                f"({[r.stats.handle_state.value for r in turns]})"
            )
            for r in turns:
                if r.stats.handle_state != HandleState.ATTACHED:
                    assert r.stats.handle_reason, f"{r.stats.handle_state} without a reason"
        return multiple(*loaded)

    @precondition(lambda self: self.fake.tier is not None)
    @rule(t=sessions, text=questions, persist_first=st.booleans(), lag=persist_race_lags)
    def persist_races_a_turn(self, t: Tracked, text: str, persist_first: bool, lag: int) -> None:
        """``persist()`` and ``send()`` on one session at once, either started first: one is
        refused (``SessionBusyError``) or they serialize; never does the turn attach the handle
        the persist moved to the tier (decode freed its blocks)."""
        s = t.session
        if s.closed:
            return
        handle = s.handle

        async def persist() -> Any:
            try:
                return await s.offload()
            except SessionBusyError:
                return BUSY

        async def send() -> Any:
            try:
                return await self._turn(t, text, "short", refusable=True)
            except SessionBusyError:
                return BUSY

        ops = (persist(), send()) if persist_first else (send(), persist())
        results = self.run(self._together("persist_races_a_turn", *ops, lag=lag))
        ref, result = results if persist_first else results[::-1]
        assert not (ref is BUSY and result is BUSY), "both refused: neither was running"
        if ref not in (None, BUSY) and isinstance(result, TurnResult) and handle is not None:
            # The persist read the session's handle when it started: the one the turn found.
            assert result.stats.handle_state != HandleState.ATTACHED, (
                "the turn attached the handle that the racing persist moved to the tier"
            )

    @precondition(lambda self: self.fake.tier is not None)
    @rule(target=sessions, t=sessions, text=questions, wait_first=st.booleans(), lag=lags)
    def tool_wait_persist_races_a_load(
        self, t: Tracked, text: str, wait_first: bool, lag: int
    ) -> Tracked:
        """A tool wait that persists the handle to the tier, while a copy loaded from the
        session's save file sends its first turn: the persist frees decode's pin, so the copy
        may attach the handle only if the persist did not happen (decode refused it)."""
        if t.session.closed:
            return self.open_session()  # the bundle grows alike on every replay
        path = self._saved(t)
        copy = self._load(t, path)
        handle = t.session.handle

        async def wait() -> Any:
            async with t.session.tool_wait(expected_s=600.0, offload="always") as waited:
                await asyncio.sleep(0)
            return waited

        rule = "tool_wait_persist_races_a_load"
        turn = self._turn(copy, text, "short")
        if wait_first:
            waited, result = self.run(self._together(rule, wait(), turn, lag=lag))
        else:
            result, waited = self.run(self._together(rule, turn, wait(), lag=lag))
        if handle is not None and result is not None:
            attached = result.stats.handle_state == HandleState.ATTACHED
            assert not (attached and waited.persisted), (
                "the copy attached the handle that the tool wait moved to the tier"
            )
        return copy

    @precondition(lambda self: self.fake.tier is not None)
    @rule(
        target=sessions,
        t=sessions,
        texts=st.lists(questions, min_size=2, max_size=2),
        parent_first=st.booleans(),
        lag=lags,
    )
    def a_fork_races_its_parent(
        self, t: Tracked, texts: list[str], parent_first: bool, lag: int
    ) -> Tracked:
        """Fork the whole history (decode writes a copy of the parent's pin to the tier and
        keeps the pin), then the parent's next turn and the fork's first at once, either
        started first. The fork never carries the parent's handle: it loads its own copy or
        recomputes; the parent, whose pin the copy kept, may still attach it."""
        if t.session.closed:
            return self.open_session()  # the bundle grows alike on every replay
        parent_handle = t.session.handle
        child = t.session.fork()
        fork = self._track(child, list(child.transcript.messages))
        fork.pending = list(child.transcript.pending)
        turns = (self._turn(t, texts[0], "short"), self._turn(fork, texts[1], "short"))
        ordered = turns if parent_first else turns[::-1]
        results = self.run(self._together("a_fork_races_its_parent", *ordered, lag=lag))
        parent, child = results if parent_first else results[::-1]
        if child is not None:
            assert child.stats.handle_state != HandleState.ATTACHED, (
                "a fork's first turn attached a handle: it holds none of its own"
            )
        if parent is not None and child is not None and parent_handle is not None:
            both = (parent.stats.handle_state, child.stats.handle_state)
            Counters.fired(f"fork_race:{both[0].value}/{both[1].value}", overlapped=False)
        return fork

    # --- what must hold -----------------------------------------------------------------------

    @invariant()
    def a_handle_is_single_use(self) -> None:
        reused = {h: n for h, n in self.transport.carried.items() if n > 1}
        assert not reused, f"P legs carried one decode handle more than once: {reused}"

    @invariant()
    def no_wrong_kv(self) -> None:
        assert self.fake.wrong_reuse_events == 0

    @invariant()
    def transcripts_are_complete(self) -> None:
        for t in self.open.values():
            if t.session.closed:
                continue
            assert list(t.session.transcript.messages) == t.messages, t.name
            assert list(t.session.transcript.pending) == t.pending, t.name

    @invariant()
    def no_pin_once_all_sessions_are_closed(self) -> None:
        if any(not t.session.closed for t in self.open.values()):
            return
        for i in range(self.decodes):
            assert self.fake.decode(i).pinned_handles == 0, f"decode {i} still pins"

    def teardown(self) -> None:
        try:
            for t in list(self.open.values()):
                self.run(t.session.aclose())
            self.open.clear()
            self.no_pin_once_all_sessions_are_closed()
            self.no_wrong_kv()
        finally:
            self.run(self.cluster.aclose())
            self.run(self.tenant.aclose())
            self.loop.close()
            self.tmp.cleanup()


def examples() -> int:
    """``AGENTKV_FUZZ_EXAMPLES`` raises the number of sequences for a long run."""
    return int(os.environ.get("AGENTKV_FUZZ_EXAMPLES", "0")) or 120
