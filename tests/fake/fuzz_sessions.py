"""A hypothesis state machine that drives sessions on the fake pair and checks agentkv's promises.

Each step is one of: open, send (long or short answers), stream (completed, left early),
cancel a turn after decode finished, fork, save + load, close, tool wait, clock jumps past
TTLs, faults on either leg, a server killed or restarted, concurrent turns of two sessions (and
a second turn on a busy session), and another tenant's one-shot traffic that takes freed blocks.

After every step:

* no pull read wrong KV (``FakeCluster.wrong_reuse_events == 0``; the fake is strict: a pull
  of blocks the producer no longer pins for that request counts, even if their content is
  still intact);
* every open session's transcript is complete (exactly the messages of its committed turns, in
  order, nothing pending after a failed send) and token-exact (append-only, and each turn's
  generated ids sit right after its prompt);
* once every session is closed, no decode holds a turn-end pin.

Shared by ``test_fuzz_sessions.py`` (bounded, in the normal run) and the longer run
(``AGENTKV_FUZZ_EXAMPLES``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import tempfile
from pathlib import Path
from typing import Any

import httpx
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    precondition,
    rule,
)

from agentkv import (
    AgentKVError,
    AsyncCluster,
    AsyncSession,
    Message,
    RetryPolicy,
    SessionBusyError,
    TurnResult,
)
from agentkv.testing import FakeCluster, ManualClock

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

questions = st.lists(st.sampled_from(WORDS), min_size=1, max_size=4).map(
    lambda ws: "Tell me about " + " and ".join(ws) + "."
)
sizes = st.sampled_from(["long", "long", "short"])


@dataclasses.dataclass
class Tracked:
    """A session and what its transcript must hold."""

    session: AsyncSession
    messages: list[Message]
    name: str
    pending: list[Message] = dataclasses.field(default_factory=list)


class AnswerHeld(httpx.AsyncBaseTransport):
    """The fake's transport; while held, decode's answers wait (decode has finished)."""

    def __init__(self, fake: FakeCluster) -> None:
        self.fake = fake
        self.inner = fake.transport
        self.held = asyncio.Event()
        self._gate: asyncio.Event | None = None

    def hold(self) -> None:
        self.held = asyncio.Event()
        self._gate = asyncio.Event()

    def release(self) -> None:
        if self._gate is not None:
            self._gate.set()
        self._gate = None

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        gate = self._gate
        decode = self.fake.server(str(request.url)).role == "decode"
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

    @classmethod
    def failed(cls, why: str) -> None:
        cls.turns_failed += 1
        cls.errors[why] = cls.errors.get(why, 0) + 1


class SessionMachine(RuleBasedStateMachine):
    sessions = Bundle("sessions")

    def __init__(self) -> None:
        super().__init__()
        Counters.sequences += 1
        self.loop = asyncio.new_event_loop()
        self.clock = ManualClock()
        # A small KV cache, so freed blocks are handed to other requests soon.
        self.fake = FakeCluster(pairs=2, clock=self.clock, num_kv_blocks=256)
        self.transport = AnswerHeld(self.fake)
        self.cluster = self._cluster()
        self.tenant = self._cluster()
        self.open: dict[str, Tracked] = {}
        self.count = 0
        self.tmp = tempfile.TemporaryDirectory()

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

    def _track(self, session: AsyncSession, messages: list[Message]) -> Tracked:
        self.count += 1
        tracked = Tracked(session=session, messages=messages, name=f"s{self.count}")
        self.open[tracked.name] = tracked
        return tracked

    async def _turn(self, t: Tracked, text: str, size: str, *, final: bool = False) -> None:
        s = t.session
        before = s.transcript.token_ids
        try:
            result = await s.send(text, final=final, **(LONG if size == "long" else SHORT))
        except AgentKVError as exc:
            Counters.failed(type(exc).__name__)
            return
        Counters.turns_ok += 1
        t.messages += [*t.pending, Message.user(text), result.message]
        t.pending.clear()
        self._check_turn(s, before, result)

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

    @rule(t=sessions, text=questions, size=sizes)
    def send(self, t: Tracked, text: str, size: str) -> None:
        if t.session.closed:
            return
        self.run(self._turn(t, text, size))

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

    @rule(target=sessions, t=sessions)
    def save_and_load(self, t: Tracked) -> Tracked:
        if t.session.closed:
            return self.open_session()  # the bundle grows alike on every replay
        path = Path(self.tmp.name) / f"{t.name}-{self.count}.json"
        t.session.save(path)
        loaded = self._track(AsyncSession.load(path, self.cluster), list(t.messages))
        loaded.pending = list(t.pending)
        return loaded

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
        server = self.fake.prefill(pair) if role == "prefill" else self.fake.decode(pair)
        server.fail_next(kind, status=503)

    @rule(role=st.sampled_from(["prefill", "decode"]), pair=st.integers(0, 1))
    def kill_or_restart(self, role: str, pair: int) -> None:
        server = self.fake.prefill(pair) if role == "prefill" else self.fake.decode(pair)
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
        ha, hb = a.session.handle, b.session.handle
        if ha is not None and hb is not None and ha.request_id == hb.request_id:
            # Two copies of one save file, loaded at once: a documented limit (reliability.md).
            return

        async def go() -> None:
            await asyncio.gather(self._turn(a, texts[0], "long"), self._turn(b, texts[1], "long"))

        self.run(go())

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

    # --- what must hold -----------------------------------------------------------------------

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
        for i in range(2):
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
