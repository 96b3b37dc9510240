"""A session's state, and the bookkeeping of a finished turn: a value, no I/O, no services.

``AsyncSession`` and ``Session`` wrap one ``SessionState``; the turn (``_turn.py``) reads it, and
replaces what a turn changes (the handle, the transcript's committed turn, the stats) through the
methods here. Everything it needs from the servers (the pool, the template, the clock) reaches it
as arguments. It is mutated only on the event loop its pool runs on.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import AsyncGenerator, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from agentkv._client import kv
from agentkv._client.copy_job import CopyJob
from agentkv._client.kv import tokens_digest
from agentkv._client.turn_log import TurnLog
from agentkv._exceptions import PrefixDivergedError, SessionBusyError, SessionLoadError
from agentkv._log import turn_logger
from agentkv._policy import CachePolicy
from agentkv._prompt.template import tools_key
from agentkv._prompt.transcript import Transcript, TurnPrompt
from agentkv._route import TakenRoute
from agentkv._types import HandleState, KVHandle, Pair, SessionOptions, TurnStats
from agentkv._wire.handoff import DecodeResult, PrefillResult, TurnRequest
from agentkv._wire.json import dumps, json_fragment
from agentkv._wire.tier import TierRef

__all__ = ["SessionState", "TurnOutcome", "pulled_estimate", "tokens_digest"]


@dataclass(frozen=True, kw_only=True, slots=True)
class TurnOutcome:
    """A turn that succeeded, as the turn hands it to ``SessionState.commit``.

    ``attached`` is the handle the P leg carried (if any), ``handle_state`` and ``handle_reason``
    say why it was or was not; on the ``decode`` route there is no P leg (``prefill`` is
    ``None``) and ``attached`` is the handle whose blocks decode's cache held; times are
    seconds (``ttft_s`` from the call, ``server_ttft_s`` from the first leg's start);
    ``final`` says the turn asked decode to pin nothing.
    """

    prompt: TurnPrompt
    result: DecodeResult
    pair: Pair
    prefill_name: str
    prefill: PrefillResult | None
    attached: KVHandle | None
    handle_state: HandleState
    handle_reason: str
    ttft_s: float
    server_ttft_s: float
    prefill_s: float
    decode_s: float
    total_s: float
    retries: int
    extends: int
    final: bool
    tools: Sequence[Mapping[str, Any]] | None
    # The tier reference the P leg carried instead of a handle (``HandleState.TIER``).
    tier: TierRef | None = None
    route: TakenRoute = "pull"
    route_reason: str = ""
    # The output limit the D leg carried, and the caller's ask when it was clamped to it.
    max_tokens: int | None = None
    max_tokens_clamped_from: int | None = None


class Lifecycle(enum.Enum):
    """Where a session is in its life: one value instead of two flags that could disagree.

    ``IDLE`` ⇄ ``RUNNING`` for each turn; ``close()`` makes an idle session ``CLOSED`` and a
    running one ``CLOSING``, which becomes ``CLOSED`` when its turn ends.
    """

    IDLE = "idle"
    RUNNING = "running"
    CLOSING = "closing"
    CLOSED = "closed"


class SessionState:
    """Everything a session knows. Mutated only on the event loop its pool runs on."""

    __slots__ = (
        "fingerprint",
        "fingerprint_ok",
        "forks",
        "ideal_base",
        "inherit",
        "kv",
        "last_prefill",
        "options",
        "pair",
        "phase",
        "policy",
        "prefilled",
        "session_id",
        "stream",
        "tools_key",
        "transcript",
        "turns",
        "wire",
        "wire_count",
    )

    def __init__(
        self,
        *,
        session_id: str,
        pair: Pair,
        policy: CachePolicy,
        options: SessionOptions,
        transcript: Transcript,
    ) -> None:
        self.session_id = session_id
        self.pair = pair
        self.policy = policy
        self.options = options
        self.transcript = transcript
        # The committed messages as a JSON array's items (OpenAI dicts, comma-separated), each
        # serialized once: every D leg carries the whole conversation.
        self.wire = _json_items(m.to_openai() for m in transcript.messages)
        self.wire_count = len(transcript.messages)
        # What the next turn may reuse: nothing, a pin or a tier entry. Written only with what a
        # transition of ``kv`` returns (``apply``).
        self.kv: kv.KV = kv.NO_KV
        # Copies of this session's pin being written for its forks: they finish before anything
        # consumes the pin (``leasing.settle``). And a fork's own copy of its parent's pin, still
        # being written: its value once it is (``kv.inherited``).
        self.forks: list[CopyJob] = []
        self.inherit: CopyJob | None = None
        self.turns = TurnLog()
        # Tokens a perfect handle would give the next turn (previous prompt + generated - 1).
        self.ideal_base = 0
        # The last prompt this session prefilled on its pair (bounds prefill's own cache).
        self.prefilled = 0
        # The prefill (a name) that prefilled ``prefilled`` tokens: its prefix cache may hold them.
        self.last_prefill: str | None = None
        # The tools rendered into the transcript's first prompt; later turns must match.
        self.tools_key: str | None = None
        # The tokenizer and chat template the transcript's token ids come from (see
        # ``ChatTemplate.fingerprint``); checked against the servers' once per session.
        self.fingerprint: str | None = None
        self.fingerprint_ok = False
        # The stream running the current turn, if one does: left suspended by a caller that
        # stopped iterating, it is closed by the next call rather than by garbage collection.
        self.stream: AsyncGenerator[Any, None] | None = None
        self.phase = Lifecycle.IDLE

    # --- the reusable KV ---------------------------------------------------------------------

    def apply(self, step: kv.Step) -> kv.Effects:
        """Take a transition's new value; its effects, for the executor (``leasing.run``)."""
        self.kv = step.kv
        return step.effects

    @property
    def handle(self) -> KVHandle | None:
        """The pin's handle, if the session holds one."""
        return kv.handle_of(self.kv)

    @property
    def tier(self) -> TierRef | None:
        """The tier entry's reference, if the session holds one."""
        return kv.tier_of(self.kv)

    # --- the lifecycle -----------------------------------------------------------------------

    @property
    def busy(self) -> bool:
        """A turn is running (the session may have been closed meanwhile)."""
        return self.phase in (Lifecycle.RUNNING, Lifecycle.CLOSING)

    @property
    def closed(self) -> bool:
        """The session was closed (a turn may still be finishing)."""
        return self.phase in (Lifecycle.CLOSING, Lifecycle.CLOSED)

    def begin_turn(self) -> None:
        if self.phase is not Lifecycle.IDLE:
            raise AssertionError(f"a turn cannot begin while {self.phase.value}")
        self.phase = Lifecycle.RUNNING

    def end_turn(self) -> None:
        self.phase = Lifecycle.CLOSED if self.phase is Lifecycle.CLOSING else Lifecycle.IDLE

    @contextlib.contextmanager
    def holding(self, what: str) -> Iterator[None]:
        """Hold the session as a turn does while ``what`` (a persist, a tool wait's lease calls)
        acts on its handle: a turn started meanwhile would take the handle decode is freeing
        (a persist frees the pin once written), so it is refused with ``SessionBusyError``."""
        if self.busy:
            raise SessionBusyError(f"session {self.session_id} is running a turn: no {what} now")
        self.begin_turn()
        try:
            yield
        finally:
            self.end_turn()

    def close(self) -> None:
        """Mark the session closed; a running turn finishes, and then it is ``CLOSED``."""
        if self.phase is Lifecycle.IDLE:
            self.phase = Lifecycle.CLOSED
        elif self.phase is Lifecycle.RUNNING:
            self.phase = Lifecycle.CLOSING

    def move_to(self, pair: Pair, *, now: float) -> kv.Effects:
        """Move to ``pair`` (its prefill's cache holds nothing of ours); the KV's effects."""
        self.pair = pair
        self.prefilled = 0
        return self.apply(kv.moved(self.kv, pair=pair.name, policy=self.policy, now=now))

    def check_tools(self, tools: Sequence[Mapping[str, Any]] | None) -> None:
        """``PrefixDivergedError`` unless ``tools`` are those rendered into the first prompt."""
        if self.tools_key is not None and tools_key(tools) != self.tools_key:
            raise PrefixDivergedError(
                "the tools differ from those rendered into the session's first prompt; the "
                "template put them in the prefix, so fork the session to change them"
            )

    def check_fingerprint(self, served: str) -> None:
        """``SessionLoadError`` unless ``served`` (the servers' tokenizer and template) is the
        one the transcript's token ids come from; the first check records it."""
        if self.fingerprint is not None and self.fingerprint != served:
            raise SessionLoadError(
                f"session {self.session_id}'s token ids come from another tokenizer or chat "
                f"template (fingerprint {self.fingerprint}; the cluster serves {served}): they "
                "cannot be continued here; start a new session from its messages instead"
            )
        self.fingerprint = served
        self.fingerprint_ok = True

    def turn_request(
        self, prompt: TurnPrompt, options: SessionOptions, *, model: str
    ) -> TurnRequest:
        """What the turn asks ``model`` for: the conversation with ``prompt``'s messages."""
        added = _json_items(m.to_openai() for m in prompt.messages)
        return TurnRequest(
            model=model,
            messages=json_fragment(b"[" + b",".join(filter(None, (self.wire, added))) + b"]"),
            num_messages=self.wire_count + len(prompt.messages),
            max_tokens=options.max_tokens,
            temperature=options.temperature,
            tools=options.tools,
            tool_choice=options.tool_choice,
            extra=options.extra_body,
        )

    def commit(self, outcome: TurnOutcome, *, block_size: int | None) -> TurnStats:
        """Record a successful turn (transcript, stats, log event); the KV is ``kv.committed``'s.

        ``block_size`` is the servers' KV block size, when known (it sharpens ``pulled_tokens``).
        """
        prompt, result, prefill_name = outcome.prompt, outcome.result, outcome.prefill_name
        final = outcome.final
        self.transcript.commit_turn(
            prompt,
            generated_ids=result.token_ids,
            message=result.message,
            finish_reason=result.finish_reason,
        )
        self.tools_key = tools_key(outcome.tools)
        added = _json_items([*(m.to_openai() for m in prompt.messages), result.message.to_openai()])
        self.wire = b",".join((self.wire, added)) if self.wire else added
        self.wire_count += len(prompt.messages) + 1
        prompt_len = len(prompt)
        if outcome.prefill is None:  # the decode route: decode's own prefix-cache hits
            reused = min(result.cached_tokens or 0, prompt_len)
            pulled = 0
        else:
            reused = min(outcome.prefill.cached_tokens, prompt_len)
            if prefill_name != self.last_prefill:
                self.prefilled = 0  # another prefill: its prefix cache holds nothing of ours
            self.last_prefill = prefill_name
            pulled = pulled_estimate(
                reused=reused,
                attached=outcome.attached,
                prefilled_before=self.prefilled,
                block_size=block_size,
                tier=outcome.tier,
            )
            self.prefilled = prompt_len
        stats = TurnStats(
            session_id=self.session_id,
            turn=self.transcript.version,
            pair=outcome.pair.name,
            prefill=prefill_name,
            prompt_tokens=prompt_len,
            reused_tokens=reused,
            pulled_tokens=pulled,
            computed_tokens=prompt_len - reused,
            generated_tokens=len(result.token_ids),
            ideal_reused_tokens=min(
                self.ideal_base if outcome.tier is None else outcome.tier.n_tokens,
                prompt_len - 1,
            ),
            ttft_s=outcome.ttft_s,
            server_ttft_s=outcome.server_ttft_s,
            prefill_s=outcome.prefill_s,
            decode_s=outcome.decode_s,
            total_s=outcome.total_s,
            handle_state=outcome.handle_state,
            handle_reason=outcome.handle_reason,
            retries=outcome.retries,
            extends=outcome.extends,
            route=outcome.route,
            route_reason=outcome.route_reason,
            max_tokens=outcome.max_tokens,
            max_tokens_clamped_from=outcome.max_tokens_clamped_from,
        )
        self.turns.append(stats)
        self.ideal_base = prompt_len + len(result.token_ids) - 1
        log = turn_logger()
        if log is None:
            return stats
        log.info(
            "agentkv.turn",
            session_id=self.session_id,
            turn=stats.turn,
            pair=stats.pair,
            prefill=stats.prefill,
            prompt_tokens=stats.prompt_tokens,
            reused_tokens=stats.reused_tokens,
            pulled_tokens=stats.pulled_tokens,
            ideal_reused_tokens=stats.ideal_reused_tokens,
            generated_tokens=stats.generated_tokens,
            ttft_ms=round(stats.ttft_ms, 3),
            server_ttft_ms=round(stats.server_ttft_s * 1000.0, 3),
            handle_state=stats.handle_state.value,
            handle_reason=stats.handle_reason,
            route=stats.route,
            route_reason=stats.route_reason,
            retries=stats.retries,
            extends=stats.extends,
            final=final,
            leased=result.handle is not None and result.handle.leased,
        )
        return stats


def _json_items(values: Iterable[Any]) -> bytes:
    """``values`` as the items of a JSON array, without its brackets (``b""`` for none)."""
    return dumps(list(values))[1:-1]


def pulled_estimate(
    *,
    reused: int,
    attached: KVHandle | None,
    prefilled_before: int,
    block_size: int | None,
    tier: TierRef | None = None,
) -> int:
    """Tokens of ``reused`` that came from decode (or the file tier, for a ``tier`` turn) rather
    than prefill's own prefix cache.

    Prefill's local cache holds at most the whole blocks of the longest prompt this session
    prefilled there before; the rest of what it reused was pulled. Without a block size the local
    part is taken as that whole prompt, which makes the estimate a lower bound.
    """
    if attached is None and tier is None:
        return 0
    covered = attached.num_tokens if attached is not None else tier.n_tokens if tier else 0
    block = block_size or 1
    local = (prefilled_before // block) * block
    return max(0, min(reused, covered) - local)
