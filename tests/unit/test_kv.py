"""The reusable KV (``agentkv._client.kv``) as a state machine, on the pure value alone.

No fake cluster: decode is a dict of pins and tier entries here, and the effects a transition
returns are performed against it the way ``leasing`` performs them against a real decode
(releases free a pin whose secret matches, a claim rotates the secret, an offload frees the pin
for a tier entry). Hypothesis runs random sequences of every transition, with two holders of
one handle (a session and a copy made from its save file or snapshot), and checks after every
step what must hold for any sequence:

* no turn attaches a handle whose pin decode freed (released, consumed by a pull, expired) or
  whose lease another holder took;
* no turn carries a tier entry whose tokens its prompt does not start with;
* a holder releases a pin at most once (once decode answered) and deletes a tier entry at most
  once;
* a closed holder released (or deleted) what it held, unless decode no longer held it;
* a holder never holds a handle it sent with a turn (single use).

The fake-cluster fuzzers (``tests/fake/fuzz_sessions.py``, ``fuzz_replicas.py``) stay as the
integration tests of the same rules through the real turn, pool and HTTP stack.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass, field

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from agentkv._client import kv
from agentkv._client.kv_json import kv_from_json, kv_to_json
from agentkv._client.offload import OffloadMode
from agentkv._policy import CachePolicy
from agentkv._route import Route
from agentkv._types import HandleState, KVHandle
from agentkv._wire.hints import ExtendResult
from agentkv._wire.tier import TierRef

POLICY = CachePolicy(recompute_threshold=4, min_reuse_tokens=0, persist_after_s=10.0)
LEASE_TTL_S = 100.0
PAIRS = ("p0", "p1")
# Examples per CI run: each example is up to ``stateful_step_count`` steps.
MACHINE_SETTINGS = settings(
    max_examples=200,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@dataclass
class Pin:
    """A pin as decode keeps it."""

    secret: str
    expiry: float
    freed: str | None = None  # why: released, consumed, expired, offloaded


@dataclass
class Holder:
    """One holder of the session's KV: the session, or a copy continued from its save file."""

    name: str
    value: kv.KV
    tokens: list[int]
    pair: str
    sent: set[str] = field(default_factory=set)  # request ids its turns took
    releases: Counter[str] = field(default_factory=Counter)  # answered by decode
    failed_releases: Counter[str] = field(default_factory=Counter)
    deletes: Counter[str] = field(default_factory=Counter)


class KVMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 1000.0
        self.pins: dict[str, Pin] = {}
        self.entries: dict[str, tuple[int, ...]] = {}  # tier id -> the tokens it holds
        self.serial = 0
        self.failing = False
        self.holders: dict[str, Holder] = {
            "a": Holder(name="a", value=kv.NO_KV, tokens=[], pair="p0")
        }

    # --- decode, as the executor meets it ---------------------------------------------------------

    def _id(self) -> int:
        self.serial += 1
        return self.serial

    def _held(self, handle: KVHandle) -> Pin | None:
        pin = self.pins.get(handle.request_id)
        if pin is None or pin.freed is not None or pin.secret != handle.lease:
            return None
        return pin

    def perform(self, holder: Holder, effects: kv.Effects) -> None:
        for effect in effects:
            if isinstance(effect, kv.Release):
                if self.failing:  # unanswered: the pin stays, and a later release may retry
                    holder.failed_releases[effect.handle.request_id] += 1
                    continue
                holder.releases[effect.handle.request_id] += 1
                pin = self._held(effect.handle)
                if pin is not None:
                    pin.freed = "released"
            elif isinstance(effect, kv.DeleteTierEntry):
                holder.deletes[effect.ref.id] += 1
                self.entries.pop(effect.ref.id, None)
            elif isinstance(effect, kv.Extend):
                self._extend(holder, effect)
            elif isinstance(effect, kv.Offload):
                self._offload(holder, effect)
            else:  # ReleaseRequest: not emitted by the value's transitions
                raise AssertionError(effect)

    def _extend(self, holder: Holder, effect: kv.Extend) -> None:
        pin = self._held(effect.handle)
        result = None
        if pin is not None and not self.failing:
            pin.expiry = max(pin.expiry, self.now + effect.ttl_s)
            lease = None
            if effect.claim:
                lease = pin.secret = f"s{self._id()}"
            result = ExtendResult(expiry=pin.expiry, ttl_s=pin.expiry - self.now, lease=lease)
        step, _ = kv.extended(
            holder.value,
            effect,
            result=result,
            gone=pin is None and not self.failing,
            detail="",
            sent_at=self.now,
            policy=POLICY,
        )
        self.apply(holder, step)

    def _offload(self, holder: Holder, effect: kv.Offload) -> None:
        pin = self._held(effect.handle)
        ref = None
        if pin is not None and not self.failing:
            pin.freed = "offloaded"
            ref = TierRef(
                id=f"{self._id():032x}", n_tokens=effect.handle.num_tokens, secret="x" * 16
            )
            self.entries[ref.id] = tuple(holder.tokens[: ref.n_tokens])
        step = kv.offloaded(
            holder.value,
            effect,
            ref=ref,
            gone=pin is None and not self.failing,
            detail="",
            tokens=holder.tokens,
        )
        self.apply(holder, step)

    def apply(self, holder: Holder, step: kv.Step) -> None:
        holder.value = step.kv
        self.perform(holder, step.effects)

    def _new_handle(self, holder: Holder, num_tokens: int) -> KVHandle:
        rid = f"r{self._id()}"
        secret = f"s{self._id()}"
        self.pins[rid] = Pin(secret=secret, expiry=self.now + LEASE_TTL_S)
        return KVHandle(
            pair=holder.pair,
            engine_id="e",
            request_id=rid,
            block_ids=((1,),),
            host="h",
            port=1,
            num_tokens=num_tokens,
            issued_at=self.now,
            deadline=POLICY.lease_deadline(sent_at=self.now, ttl_s=LEASE_TTL_S),
            server_expiry=self.now + LEASE_TTL_S,
            lease_ttl_s=LEASE_TTL_S,
            lease=secret,
        )

    # --- rules ------------------------------------------------------------------------------------

    holder_names = st.sampled_from(["a", "b"])

    def _holder(self, name: str) -> Holder | None:
        """``name``, or the other holder when it is closed (a rule is rarely wasted)."""
        return self.holders.get(name) or next(iter(self.holders.values()), None)

    @rule(
        name=holder_names,
        new=st.integers(1, 40),
        diverge=st.booleans(),
        route=st.sampled_from(["auto", "pull", "decode", "recompute"]),
        outcome=st.sampled_from(["ok", "final", "no_handle", "prefill_fails", "decode_fails"]),
        closed_meanwhile=st.booleans(),
        offload=st.booleans(),
    )
    def turn(
        self,
        name: str,
        new: int,
        diverge: bool,
        route: Route,
        outcome: str,
        closed_meanwhile: bool,
        offload: bool,
    ) -> None:
        holder = self._holder(name)
        if holder is None:
            return
        prompt = [*holder.tokens, *range(100, 100 + new)]
        if diverge and prompt:
            prompt[0] += 1  # an edited history: the KV must not be carried with it
        self.apply(
            holder,
            kv.confirm(
                holder.value, prompt_len=len(prompt), supported=True, policy=POLICY, now=self.now
            ),
        )
        facts = kv.RouteFacts(
            route=route, decode_queued=0, decode_running=0, block_size=16, local_ok=True
        )
        before = holder.value
        step, taken = kv.take(before, prompt=prompt, facts=facts, policy=POLICY, now=self.now)
        self.apply(holder, step)
        if taken.sent is not None:
            assert self._held(taken.sent) is not None, "attached a pin decode freed or gave away"
            assert taken.state is HandleState.ATTACHED
            holder.sent.add(taken.sent.request_id)
            if taken.route.route == "pull":
                self.pins[taken.sent.request_id].freed = "consumed"
        if taken.tier is not None:
            held = self.entries.get(taken.tier.id)
            assert held is None or tuple(prompt[: len(held)]) == held, "tier entry off the prompt"
            assert isinstance(before, kv.OnTier)
            assert kv.tokens_digest(prompt[: taken.tier.n_tokens]) == before.digest
        if outcome in ("prefill_fails", "decode_fails"):
            self.perform(
                holder,
                kv.release_sent(taken.sent, reason="failed", policy=POLICY, now=self.now),
            )
            return
        if taken.route.route == "decode":
            self.perform(
                holder,
                kv.release_sent(taken.sent, reason="decode_route", policy=POLICY, now=self.now),
            )
        generated = 5
        holder.tokens = [*prompt, *range(500, 500 + generated)]
        handle = None
        if outcome == "ok":
            handle = self._new_handle(holder, len(holder.tokens) - 1)
        self.apply(
            holder,
            kv.committed(
                holder.value,
                handle=handle,
                final=outcome == "final",
                finish_reason="stop",
                stop_reason=None,
                closed=closed_meanwhile,
                offload=offload,
                policy=POLICY,
                now=self.now,
            ),
        )
        if closed_meanwhile:
            self._close(holder, detach=False)

    @rule(
        name=holder_names,
        new=st.integers(1, 40),
        route=st.sampled_from(["auto", "pull", "decode", "recompute"]),
        outcome=st.sampled_from(["ok", "ok", "prefill_fails", "decode_fails"]),
    )
    def plain_turn(self, name: str, new: int, route: Route, outcome: str) -> None:
        """A turn that extends the history (the most common step of a session)."""
        self.turn(name, new, False, route, outcome, False, False)

    @rule(seconds=st.sampled_from([1.0, 10.0, 60.0, 69.0, 71.0, 100.0, 500.0]))
    def advance(self, seconds: float) -> None:
        self.now += seconds
        for pin in self.pins.values():
            if pin.freed is None and pin.expiry <= self.now:
                pin.freed = "expired"

    @rule(failing=st.booleans())
    def decode_answers(self, failing: bool) -> None:
        self.failing = failing

    @precondition(lambda self: "b" not in self.holders and "a" in self.holders)
    @rule(how=st.sampled_from(["save", "fenced", "dirty"]))
    def copy(self, how: str) -> None:
        """A copy of ``a``: a save file loaded beside it (both claim before attaching), a fenced
        handover (the proxy's: ``a`` stops, the copy attaches as is), or a dirty one.

        A fenced handover is the caller's promise that no other holder used the handle: only
        from a holder whose handle is its own (no copy of it was made, or its claim won)."""
        a = self.holders["a"]
        if how == "fenced" and isinstance(a.value, kv.Pinned) and not a.value.confirmed:
            how = "save"
        wall = 1.7e9
        saved = kv_to_json(a.value, now=self.now, wall=wall)
        loaded = kv_from_json({"kv": saved}, now=self.now, wall=wall)
        drop = "dirty handover" if how == "dirty" else None
        b = Holder(name="b", value=loaded, tokens=list(a.tokens), pair=a.pair)
        self.apply(b, kv.restored(b.value, pair=b.pair, confirmed=how == "fenced", drop=drop))
        self.holders["b"] = b
        if how == "fenced":
            self.apply(a, kv.detached(a.value))
            del self.holders["a"]
        else:
            self.apply(a, kv.handed_out(a.value))

    @rule(name=holder_names, cut=st.sampled_from([0, 0, 1, 5]), copies=st.booleans())
    def fork(self, name: str, cut: int, copies: bool) -> None:
        """A fork of a holder (the whole history, or ``cut`` tokens fewer): a copy of the pin
        written to the tier for it, the pin kept by the parent; the fork takes the place of the
        other name (closed first if open)."""
        pinned = [h for h in self.holders.values() if isinstance(h.value, kv.Pinned)]
        parent = pinned[0] if pinned else self.holders.get(name)
        parent = parent or self._holder(name)
        if parent is None:
            return
        other = "b" if parent.name == "a" else "a"
        if other in self.holders:
            self._close(self.holders[other], detach=False)
        tokens = parent.tokens[: max(0, len(parent.tokens) - cut)]
        child = Holder(name=other, value=kv.NO_KV, tokens=tokens, pair=parent.pair)
        self.holders[other] = child
        pinned_before = kv.handle_of(parent.value)
        decision = kv.fork_copy(
            parent.value,
            parent_tokens=parent.tokens,
            fork_tokens=tokens,
            fork_pair=child.pair,
            copies=copies,
            policy=POLICY,
            now=self.now,
        )
        if isinstance(decision, kv.NoKV):
            self.apply(child, kv.Step(decision))
            return
        assert copies
        assert pinned_before is decision.handle
        pin = self._held(decision.handle)
        ref = None
        if pin is not None and not self.failing:  # written; the pin stays the parent's
            ref = TierRef(id=f"{self._id():032x}", n_tokens=decision.handle.num_tokens,
                          secret="y" * 16)
            self.entries[ref.id] = tuple(parent.tokens[: ref.n_tokens])
        value = kv.inherited(decision, ref=ref, detail="", fork_tokens=tokens)
        self.apply(child, kv.inherit(child.value, value))
        assert kv.handle_of(parent.value) is pinned_before, "a fork took its parent's pin"
        assert kv.handle_of(child.value) is None, "a fork holds its parent's handle"

    @rule(name=holder_names)
    def move(self, name: str) -> None:
        holder = self._holder(name)
        if holder is None:
            return
        holder.pair = PAIRS[1 - PAIRS.index(holder.pair)]
        self.apply(holder, kv.moved(holder.value, pair=holder.pair, policy=POLICY, now=self.now))

    @rule(name=holder_names)
    def pair_failed(self, name: str) -> None:
        holder = self._holder(name)
        if holder is not None:
            step = kv.pair_failed(
                holder.value, detail="down", reason="pair_down", policy=POLICY, now=self.now
            )
            self.apply(holder, step)

    @rule(name=holder_names, ttl=st.sampled_from([5.0, 50.0, 500.0]))
    def extend(self, name: str, ttl: float) -> None:
        holder = self._holder(name)
        if holder is not None:
            self.perform(holder, kv.extend_effects(holder.value, ttl_s=ttl, reason="explicit"))

    @rule(name=holder_names)
    def offload(self, name: str) -> None:
        holder = self._holder(name)
        if holder is not None:
            effects = kv.offload_effects(
                holder.value, reason="explicit", policy=POLICY, now=self.now
            )
            self.perform(holder, effects)

    @rule(name=holder_names)
    def unpin(self, name: str) -> None:
        holder = self._holder(name)
        if holder is None:
            return
        for effect in kv.unpin_effects(holder.value):
            assert isinstance(effect, kv.Release)
            freed = not self.failing  # decode freed it, or no longer held it (gone)
            self.perform(holder, (effect,))
            self.apply(holder, kv.unpinned(holder.value, effect, freed=freed))

    @rule(
        name=holder_names,
        expected=st.sampled_from([1.0, 30.0, 120.0]),
        hint=st.sampled_from(["auto", "never", "always"]),
        tier=st.booleans(),
        usage=st.sampled_from([None, 0.5, 0.95]),
        waited=st.sampled_from([0.5, 30.0, 200.0]),
    )
    def tool_wait(
        self,
        name: str,
        expected: float,
        hint: OffloadMode,
        tier: bool,
        usage: float | None,
        waited: float,
    ) -> None:
        holder = self._holder(name)
        if holder is None:
            return
        started = self.now
        had_handle = kv.handle_of(holder.value) is not None
        decision = kv.wait_tier(
            holder.value,
            hint=hint,
            expected_wait_s=expected,
            idle_s=None,
            decode_kv_usage=usage,
            tier_available=tier,
            policy=POLICY,
            now=self.now,
        )
        offloaded = False
        if decision.persist:
            before = holder.value
            self.perform(
                holder,
                kv.offload_effects(holder.value, reason="tool_wait", policy=POLICY, now=self.now),
            )
            offloaded = isinstance(holder.value, kv.OnTier) and holder.value is not before
        extend = kv.wait_extend(
            holder.value, expected_s=expected, offloaded=offloaded, policy=POLICY, now=self.now
        )
        extended = False
        if extend.extend and extend.ttl_s is not None:
            before_handle = kv.handle_of(holder.value)
            self.perform(holder, kv.extend_effects(holder.value, ttl_s=extend.ttl_s, reason="wait"))
            extended = kv.handle_of(holder.value) is not before_handle
        self.advance(waited)
        step, survived = kv.wait_ended(
            holder.value,
            had_handle=had_handle,
            offloaded=offloaded,
            extended=extended,
            extend_reason=extend.reason,
            started_at=started,
            policy=POLICY,
            now=self.now,
        )
        self.apply(holder, step)
        assert survived == (
            isinstance(holder.value, kv.Pinned)
            and POLICY.overdue_s(holder.value.handle, now=self.now) is None
        ) or (offloaded and isinstance(holder.value, kv.OnTier))

    def _close(self, holder: Holder, *, detach: bool) -> None:
        before = holder.value
        if detach:
            self.apply(holder, kv.detached(holder.value))
        else:
            step = kv.closed(holder.value, policy=POLICY, now=self.now)
            self.apply(holder, step)
            if isinstance(before, kv.Pinned) and POLICY.decide_release(before.handle, now=self.now):
                rid = before.handle.request_id
                assert holder.releases[rid] + holder.failed_releases[rid] >= 1, "pin not released"
            if isinstance(before, kv.OnTier):
                assert holder.deletes[before.ref.id] == 1, "a closed tier entry not deleted"
        assert isinstance(holder.value, kv.NoKV)
        del self.holders[holder.name]
        if not self.holders:  # the next session
            self.holders["a"] = Holder(name="a", value=kv.NO_KV, tokens=[], pair="p0")

    @rule(name=holder_names, detach=st.booleans())
    def close(self, name: str, detach: bool) -> None:
        holder = self._holder(name)
        if holder is not None:
            self._close(holder, detach=detach)

    # --- invariants -------------------------------------------------------------------------------

    @invariant()
    def a_handle_is_single_use(self) -> None:
        for holder in self.holders.values():
            handle = kv.handle_of(holder.value)
            assert handle is None or handle.request_id not in holder.sent

    @invariant()
    def a_pin_is_released_at_most_once_and_an_entry_deleted_at_most_once(self) -> None:
        for holder in self.holders.values():
            assert all(count <= 1 for count in holder.releases.values()), holder.releases
            assert all(count <= 1 for count in holder.deletes.values()), holder.deletes

    @invariant()
    def a_tier_entry_holds_the_holders_tokens(self) -> None:
        for holder in self.holders.values():
            value = holder.value
            if isinstance(value, kv.OnTier):
                assert value.ref.n_tokens <= len(holder.tokens)
                assert value.digest == kv.tokens_digest(holder.tokens[: value.ref.n_tokens])

    @invariant()
    def the_value_survives_its_save_format(self) -> None:
        for holder in self.holders.values():
            saved = kv_to_json(holder.value, now=self.now, wall=5.0)
            loaded = kv_from_json({"kv": saved}, now=self.now, wall=5.0)
            if isinstance(holder.value, kv.Pinned):
                assert isinstance(loaded, kv.Pinned)
                assert loaded.handle == holder.value.handle
            else:
                assert loaded == holder.value


KVMachine.TestCase.settings = MACHINE_SETTINGS
TestKV = KVMachine.TestCase


def test_a_copys_claim_wins_and_the_original_recomputes() -> None:
    """Two holders of one handle: whichever claims first attaches; the other, refused, does not."""
    machine = KVMachine()
    machine.turn("a", 30, False, "pull", "ok", False, False)
    machine.copy("save")
    machine.turn("b", 10, False, "pull", "ok", False, False)
    a = machine.holders["a"]
    machine.turn("a", 10, False, "pull", "ok", False, False)
    assert a.sent == set()  # the original never attached the handle the copy claimed
    machine.teardown()


def test_a_value_is_frozen() -> None:
    value = kv.NoKV()
    try:
        value.detail = "x"  # type: ignore[misc]
    except dataclasses.FrozenInstanceError:
        return
    raise AssertionError("a KV value must be immutable")
