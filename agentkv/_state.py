"""A session's state and the bookkeeping of a finished turn; no I/O.

Shared by ``AsyncSession`` and ``Session`` (which wrap one ``SessionState``) and read by the turn
runner (``_turn.py``). It is mutated only on the event loop the session's cluster runs on.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import structlog

from agentkv._exceptions import InvalidMessageError, PrefixDivergedError, SessionLoadError
from agentkv._handoff import DecodeResult, PrefillResult, TurnRequest, no_handle_cause
from agentkv._json import fragment
from agentkv._policy import CachePolicy
from agentkv._template import tools_key
from agentkv._transcript import Transcript, TurnPrompt
from agentkv._types import HandleState, KVHandle, Message, TurnStats

if TYPE_CHECKING:
    from agentkv._cluster import AsyncCluster, Pair
    from agentkv._turn import SessionOptions

__all__ = ["SessionState", "pulled_estimate"]

logger = structlog.get_logger("agentkv")


class SessionState:
    """Everything a session knows. Mutated only on the event loop its cluster runs on."""

    __slots__ = (
        "busy",
        "closed",
        "cluster",
        "fingerprint",
        "fingerprint_ok",
        "handle",
        "ideal_base",
        "last_prefill",
        "lost",
        "options",
        "pair",
        "policy",
        "prefilled",
        "session_id",
        "stream",
        "tools_key",
        "transcript",
        "turns",
        "unconfirmed",
        "wait_note",
        "wire",
    )

    def __init__(
        self,
        cluster: AsyncCluster,
        *,
        session_id: str,
        pair: Pair,
        policy: CachePolicy,
        options: SessionOptions,
        transcript: Transcript,
    ) -> None:
        self.cluster = cluster
        self.session_id = session_id
        self.pair = pair
        self.policy = policy
        self.options = options
        self.transcript = transcript
        # OpenAI dicts of the committed messages, built once (requests carry the conversation).
        self.wire: list[dict[str, Any]] = [m.to_openai() for m in transcript.messages]
        self.handle: KVHandle | None = None
        # Why there is no handle, when one was lost (expired, consumed by a failed turn, ...).
        self.lost: tuple[HandleState, str] | None = None
        self.turns: list[TurnStats] = []
        # Tokens a perfect handle would give the next turn (previous prompt + generated - 1).
        self.ideal_base = 0
        # The last prompt this session prefilled on its pair (bounds prefill's own cache).
        self.prefilled = 0
        # The prefill (a name) that prefilled ``prefilled`` tokens: its prefix cache may hold them.
        self.last_prefill: str | None = None
        # The tools rendered into the transcript's first prompt; later turns must match.
        self.tools_key: str | None = None
        # What the last tool wait did to the handle, for the next turn's handle_reason.
        self.wait_note: str | None = None
        # A handle read from a save file: decode may have freed (and reused) its blocks since, so
        # it is attached only once decode confirms the lease (``TurnRunner._confirm_loaded``).
        self.unconfirmed: KVHandle | None = None
        # The tokenizer and chat template the transcript's token ids come from (see
        # ``ChatTemplate.fingerprint``); checked against the cluster's once per session.
        self.fingerprint: str | None = None
        self.fingerprint_ok = False
        # The stream running the current turn, if one does: left suspended by a caller that
        # stopped iterating, it is closed by the next call rather than by garbage collection.
        self.stream: AsyncGenerator[Any, None] | None = None
        self.closed = False
        self.busy = False

    def move_to(self, pair: Pair) -> None:
        self.pair = pair
        self.prefilled = 0
        self.drop_handle(HandleState.INVALIDATED, f"the session moved to pair {pair.name}")

    def drop_handle(self, state: HandleState, reason: str) -> None:
        """Forget the handle (if any), remembering why for the next turn's stats."""
        if self.handle is not None:
            self.handle = None
            self.lost = (state, reason)

    async def build_prompt(
        self,
        prefill_url: str,
        tools: Sequence[Mapping[str, Any]] | None,
        pending: Sequence[Message] | None = None,
    ) -> TurnPrompt:
        """The turn's exact prompt for ``pending`` (the messages pending when the turn started;
        all pending ones by default)."""
        key = tools_key(tools)
        if self.tools_key is not None and key != self.tools_key:
            raise PrefixDivergedError(
                "the tools differ from those rendered into the session's first prompt; the "
                "template put them in the prefix, so fork the session to change them"
            )
        template = self.cluster._template(prefill_url)
        if not self.fingerprint_ok:
            self._check_fingerprint(await template.fingerprint())
        transcript = self.transcript
        pending = transcript.pending if pending is None else tuple(pending)
        if not pending:
            raise InvalidMessageError("nothing to send: append a message before the turn")
        last = transcript.last_message
        # Rendered for the messages pending now: any appended while the template renders stay
        # queued for the next turn.
        if transcript.is_fresh or last is None:
            first = await template.first(pending, tools=tools)
            return transcript.prompt_for_turn(first, messages=pending)
        delta = await template.delta(pending, last=last, tools=tools)
        closing = await template.closing(tools)
        return transcript.prompt_for_turn(delta, closing=closing, messages=pending)

    def _check_fingerprint(self, served: str) -> None:
        if self.fingerprint is not None and self.fingerprint != served:
            raise SessionLoadError(
                f"session {self.session_id}'s token ids come from another tokenizer or chat "
                f"template (fingerprint {self.fingerprint}; the cluster serves {served}): they "
                "cannot be continued here; start a new session from its messages instead"
            )
        self.fingerprint = served
        self.fingerprint_ok = True

    def turn_request(self, prompt: TurnPrompt, options: SessionOptions) -> TurnRequest:
        messages = [*self.wire, *(m.to_openai() for m in prompt.messages)]
        return TurnRequest(
            model=self.cluster.model,
            # Serialized once for both legs.
            messages=fragment(messages),
            num_messages=len(messages),
            max_tokens=options.max_tokens,
            temperature=options.temperature,
            tools=options.tools,
            tool_choice=options.tool_choice,
            extra=options.extra_body,
        )

    def commit(
        self,
        prompt: TurnPrompt,
        result: DecodeResult,
        *,
        pair: Pair,
        prefill_name: str,
        prefill: PrefillResult,
        attached: KVHandle | None,
        handle_state: HandleState,
        handle_reason: str,
        ttft_s: float,
        server_ttft_s: float,
        prefill_s: float,
        decode_s: float,
        total_s: float,
        retries: int,
        extends: int,
        final: bool,
        tools: Sequence[Mapping[str, Any]] | None,
    ) -> TurnStats:
        """Record a successful turn (transcript, handle, stats, log event)."""
        self.transcript.commit_turn(
            prompt,
            generated_ids=result.token_ids,
            message=result.message,
            finish_reason=result.finish_reason,
        )
        self.tools_key = tools_key(tools)
        self.wire.extend(m.to_openai() for m in prompt.messages)
        self.wire.append(result.message.to_openai())
        prompt_len = len(prompt)
        reused = min(prefill.cached_tokens, prompt_len)
        if prefill_name != self.last_prefill:
            self.prefilled = 0  # another prefill: its prefix cache holds nothing of ours
        self.last_prefill = prefill_name
        stats = TurnStats(
            session_id=self.session_id,
            turn=self.transcript.version,
            pair=pair.name,
            prefill=prefill_name,
            prompt_tokens=prompt_len,
            reused_tokens=reused,
            pulled_tokens=pulled_estimate(
                reused=reused,
                attached=attached,
                prefilled_before=self.prefilled,
                block_size=self.cluster.block_size,
            ),
            computed_tokens=prompt_len - reused,
            generated_tokens=len(result.token_ids),
            ideal_reused_tokens=min(self.ideal_base, prompt_len - 1),
            ttft_s=ttft_s,
            server_ttft_s=server_ttft_s,
            prefill_s=prefill_s,
            decode_s=decode_s,
            total_s=total_s,
            handle_state=handle_state,
            handle_reason=handle_reason,
            retries=retries,
            extends=extends,
        )
        self.turns.append(stats)
        self.handle = result.handle
        self.wait_note = None
        if result.handle is not None:
            self.lost = None
        elif final:
            self.lost = (HandleState.NONE, "the previous turn was final: decode pinned nothing")
        else:
            cause = no_handle_cause(result.finish_reason, result.stop_reason)
            self.lost = (
                HandleState.NONE,
                f"the previous turn ended on a {cause.replace('_', ' ')}: vLLM kept no KV for it"
                if cause is not None
                else "decode returned no handle",
            )
        self.ideal_base = prompt_len + len(result.token_ids) - 1
        self.prefilled = prompt_len
        logger.info(
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
            retries=stats.retries,
            extends=stats.extends,
            final=final,
            leased=result.handle is not None and result.handle.leased,
        )
        return stats


def pulled_estimate(
    *, reused: int, attached: KVHandle | None, prefilled_before: int, block_size: int | None
) -> int:
    """Tokens of ``reused`` that came from decode rather than prefill's own prefix cache.

    Prefill's local cache holds at most the whole blocks of the longest prompt this session
    prefilled there before; the rest of what it reused was pulled. Without a block size the local
    part is taken as that whole prompt, which makes the estimate a lower bound.
    """
    if attached is None:
        return 0
    block = block_size or 1
    local = (prefilled_before // block) * block
    return max(0, min(reused, attached.num_tokens) - local)
