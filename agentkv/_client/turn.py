"""One turn: prompt tokens, the attach decision, the P leg, the D leg, the commit; with retries.

Retry rules (each attempt is a whole P leg + D leg, so a decode failure re-runs the prefill):

* Transport errors and 5xx answers are retried with backoff (``RetryPolicy``); 4xx, malformed
  answers and template errors are not.
* A handle is single use: it is taken off the session as soon as a P leg carries it, and never put
  back. After a failure the server may have read, and so freed, its blocks; re-sending it could
  pull blocks that now hold another request's KV.
* A connection refused marks the pair unhealthy and drops the handle (the server may come back
  restarted, its block ids reused); the next attempt moves the session to a healthy pair
  (transcript kept, KV recomputed there). A connection lost or timed out, or a 5xx, probes the
  pair's ``/health`` at once: a dead server is treated the same way, a live one is retried.
* In a pool (xPyD) a pair is the decode server: a prefill that refuses a connection is marked down
  and the same P leg goes to another prefill with the same handle (a refused connection read
  nothing, and the KV is on decode); a prefill lost mid-request is probed and the turn retried.
* A streamed turn is not retried once text was yielded: the caller has seen it.
* Nothing is committed until the D leg's answer is parsed, so a failed turn changes nothing.
* The context window is decided here, once the prompt's exact length is known and before any
  leg is sent (``agentkv._window``): a ``max_tokens`` above what the prompt leaves is clamped
  (or refused), a prompt that leaves no room is a ``ContextLengthError``, and so is a server's
  own 400 about the context.

What the turn does with the session's KV is ``kv``'s to decide (take, commit, ...), and the
legs' HTTP calls are ``turn_legs``'; this module directs the attempt and its retries.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import AsyncGenerator
from typing import TypeVar

from tenacity import AsyncRetrying, RetryCallState, retry_if_exception, stop_after_attempt
from tenacity.wait import wait_exponential, wait_random

from agentkv._client import kv, leasing
from agentkv._client.offload import OffloadMode
from agentkv._client.pool import PairPool
from agentkv._client.state import SessionState, TurnOutcome
from agentkv._client.turn_legs import TurnLegs
from agentkv._exceptions import (
    BadRequestError,
    ConnectError,
    InvalidMessageError,
    ServerError,
    TransportError,
)
from agentkv._log import get_logger
from agentkv._prompt.transcript import TurnPrompt
from agentkv._types import HandleState, Pair, SessionOptions, TextDelta, TurnResult
from agentkv._window import context_error, fit_max_tokens
from agentkv._wire.handoff import (
    DecodeResult,
    PrefillResult,
    TurnRequest,
    decode_body,
)
from agentkv._wire.json import json_fragment

__all__ = ["TurnRunner"]

T = TypeVar("T")

logger = get_logger("agentkv")

_CHAT_PATH = "/v1/chat/completions"


class TurnRunner(TurnLegs):
    """Runs one turn of a session; ``events()`` yields text deltas (streaming) then the result.

    The one place that directs a turn: it reads the session's state, calls the pool for every
    server it needs (placement, health, templates, HTTP, lease calls) and hands the state what
    changed (``SessionState.commit``).
    """

    def __init__(
        self,
        pool: PairPool,
        state: SessionState,
        options: SessionOptions,
        *,
        stream: bool,
        final: bool = False,
        offload: OffloadMode = "auto",
        request_secret: str | None = None,
    ) -> None:
        self._pool = pool
        self._request_secret = request_secret
        self._state = state
        self._options = options
        self._stream = stream
        self._final = final
        self._offload = offload
        self._started = time.perf_counter()
        self._attempts = 0
        self._yielded = False
        self._prompt: TurnPrompt | None = None
        self._request: TurnRequest | None = None
        # The caller's max_tokens when the context made the turn clamp it.
        self._clamped_from: int | None = None
        self._prefill_name: str | None = None
        self._t_prefill = self._started
        self._ttft: float | None = None
        # The attach decision of the attempt running now, told with the first text delta.
        self._handle_state: HandleState | None = None
        # The turn sends the messages pending when it starts; later appends wait for the next.
        self._pending = state.transcript.pending

    async def events(self) -> AsyncGenerator[TextDelta | TurnResult, None]:
        # The first attempt runs outside tenacity: setting up its machinery costs more than the
        # rest of a turn's client-side work, and most turns succeed the first time.
        try:
            async with contextlib.aclosing(self._attempt()) as events:
                async for event in events:
                    yield event
        except Exception as exc:
            if self._pool.retry.max_attempts == 1 or not self._retryable(exc):
                raise
            first_failure: Exception | None = exc
        else:
            return
        retry = self._pool.retry
        retrying = AsyncRetrying(
            stop=stop_after_attempt(retry.max_attempts),
            wait=wait_exponential(multiplier=retry.initial_backoff_s, max=retry.max_backoff_s)
            + wait_random(0, retry.jitter_s),
            retry=retry_if_exception(self._retryable),
            before_sleep=self._log_retry,
            reraise=True,
        )
        async for attempt in retrying:
            with attempt:
                if first_failure is not None:
                    # Replay the first attempt's failure so tenacity counts it and waits.
                    failure, first_failure = first_failure, None
                    raise failure
                async with contextlib.aclosing(self._attempt()) as events:
                    async for event in events:
                        yield event

    def _retryable(self, exc: BaseException) -> bool:
        return not self._yielded and isinstance(exc, TransportError | ServerError)

    def _log_retry(self, retry_state: RetryCallState) -> None:
        outcome = retry_state.outcome
        exc = outcome.exception() if outcome is not None else None
        logger.warning(
            "agentkv.retry",
            session_id=self._state.session_id,
            turn=self._state.transcript.version + 1,
            pair=self._state.pair.name,
            attempt=retry_state.attempt_number,
            error=type(exc).__name__,
            detail=str(exc),
        )

    async def _attempt(self) -> AsyncGenerator[TextDelta | TurnResult, None]:
        state, pool = self._state, self._pool
        self._attempts += 1
        pair = await pool.pair_for(state.session_id, state.pair)
        if pair is not state.pair:
            # The old pair's decode may be alive (its prefill was the one that failed).
            await leasing.run(pool, state, state.move_to(pair, now=pool.clock()))
        try:
            async with contextlib.aclosing(self._legs(pair)) as events:
                async for event in events:
                    yield event
        except BadRequestError as exc:
            # A server's own refusal about the context (our count and its differed).
            mapped = self._context_error(exc)
            if mapped is not None:
                raise mapped from exc
            raise
        except ConnectError as exc:
            pool.mark_down(pair, reason=str(exc))
            # A server that refused a connection may come back restarted, its block ids reused
            # by other requests: a handle into it is never safe again.
            await self._pair_failed(f"pair {pair.name} was unreachable", "pair_unreachable")
            raise
        except (TransportError, ServerError):
            # Lost, timed out or 5xx mid-turn (a vLLM API server whose engine died answers 500
            # before it exits): a server that died under the turn is found now (the probe marks
            # the pair down), so the retry moves instead of running into it again.
            if not await pool.probe(pair):
                # Unsent; the one that stopped answering may be the pair's prefill.
                await self._pair_failed(f"pair {pair.name} stopped answering", "pair_down")
            if pool.pooled and self._prefill_name is not None:
                await pool.probe_prefill(self._prefill_name)
            raise
        finally:
            self._prefill_name = None  # a retry chooses again, by the load it then sees

    async def _pair_failed(self, detail: str, reason: str) -> None:
        state, pool = self._state, self._pool
        step = kv.pair_failed(
            state.kv, detail=detail, reason=reason, policy=state.policy, now=pool.clock()
        )
        await leasing.run(pool, state, state.apply(step))

    def _context_error(self, exc: BadRequestError) -> Exception | None:
        if self._prompt is None:
            return None
        return context_error(
            exc.response_body, prompt_tokens=len(self._prompt), limit=self._pool.max_model_len
        )

    def _fitted(self, prompt: TurnPrompt) -> TurnRequest:
        """The turn's request, its ``max_tokens`` fitted to what the prompt leaves of the
        context (``ContextLengthError`` before any leg is sent when it does not fit)."""
        options = self._options
        request = self._state.turn_request(prompt, options, model=self._pool.model)
        given = fit_max_tokens(
            options.max_tokens,
            prompt_tokens=len(prompt),
            limit=self._pool.max_model_len,
            refuse=options.oversized_max_tokens == "refuse",
        )
        if given == options.max_tokens:
            return request
        self._clamped_from = options.max_tokens
        logger.info(
            "agentkv.max_tokens_clamped",
            session_id=self._state.session_id,
            turn=self._state.transcript.version + 1,
            asked=options.max_tokens,
            given=given,
            prompt_tokens=len(prompt),
            limit=self._pool.max_model_len,
        )
        return dataclasses.replace(request, max_tokens=given)

    async def _prompt_for(self, pair: Pair) -> TurnPrompt:
        # Built once per turn: every server serves the same model, so the tokens hold on any.
        if self._prompt is None:
            self._prompt = await self._on_prefill(pair, self._build_prompt)
        return self._prompt

    async def _build_prompt(self, prefill_url: str) -> TurnPrompt:
        """The turn's exact prompt for the messages pending when it started, rendered by the
        template of ``prefill_url`` (``/tokenize``); any appended meanwhile wait for the next."""
        state, tools = self._state, self._options.tools
        state.check_tools(tools)
        template = self._pool.template(prefill_url)
        if not state.fingerprint_ok:
            state.check_fingerprint(await template.fingerprint())
        if not self._pending:
            raise InvalidMessageError("nothing to send: append a message before the turn")
        return await template.prompt(state.transcript, self._pending, tools=tools)

    async def _legs(self, pair: Pair) -> AsyncGenerator[TextDelta | TurnResult, None]:
        state, pool = self._state, self._pool
        prompt = await self._prompt_for(pair)
        request = self._request or self._fitted(prompt)
        self._request = request
        # Asked once per decode server, then cached: whether to send hints at all.
        supported = await pool.leases.supported(pair.decode)
        facts = kv.RouteFacts(
            route=self._options.route,
            decode_queued=pool.decode_queued(pair),
            decode_running=pool.decode_running(pair),
            block_size=pool.block_size,
            local_ok=supported is True,  # no turn is computed on a decode without agentkv
        )
        taken = await leasing.take(pool, state, prompt.token_ids, facts, supported=supported)
        sent, handle_state, reason, tier = taken.sent, taken.state, taken.reason, taken.tier
        route = taken.route
        self._handle_state = handle_state
        ids = json_fragment(prompt.json_ids())

        t_prefill = self._t_prefill = time.perf_counter()
        prefill: PrefillResult | None = None
        prefill_name = ""
        if route.route != "decode":
            prefill, prefill_name = await self._p_leg(
                pair, request, ids, sent, prompt.token_ids, tier=tier
            )
            served = prefill.tier_load if tier is not None else None
            if served is not None and served.short:  # the server's reason: never served
                reason = f"{reason}; {served.describe()}" if reason else served.describe()
        t_decode = time.perf_counter()

        issued_at = pool.clock()
        # A stock decode ignores the hint; one known to be stock gets the request it expects.
        hint = None if supported is False else kv.pin_hint(state.policy, final=self._final)
        body = decode_body(request, prompt_ids=ids, prefill=prefill, stream=self._stream, hint=hint)
        releasable = supported is True and hint is not None and hint.pin
        # Tokens decode computes itself (the decode route), counted as its load meanwhile.
        local = len(prompt) - (sent.num_tokens if sent else 0) if prefill is None else 0
        result: DecodeResult | None = None
        pool.decode_begin(pair, local)
        try:
            async with contextlib.aclosing(
                self._decode(pair, request, body, issued_at=issued_at, releasable=releasable)
            ) as events:
                async for event in events:
                    if isinstance(event, TextDelta):
                        yield event
                    else:
                        result = event
        except BaseException:
            # Prefill answered (above), so the handle it carried is done with: free it if the
            # pull did not (cancelled or a stream left early too, hence in the background). On
            # the decode route nobody reads it: it is freed the same way.
            self._release_sent_later(sent, "decode_failed")
            raise
        finally:
            pool.decode_end(pair, local)
        if result is None:  # pragma: no cover - _decode ends with the result or raises
            raise RuntimeError("decode leg ended without a result")
        t_end = time.perf_counter()
        if prefill is None:
            # The decode route read the old handle's blocks from decode's cache; the new turn's
            # pin holds them now, so the old pin is only in the way.
            self._release_sent_later(sent, "decode_route")
        # The first token's time, from the first leg's start: all of it on the servers
        # (non-streamed, the whole answer arrives at once).
        server_ttft = self._ttft if self._ttft is not None else t_end - t_prefill
        outcome = TurnOutcome(
            prompt=prompt,
            result=result,
            pair=pair,
            prefill_name=prefill_name,
            prefill=prefill,
            attached=sent,
            handle_state=handle_state,
            handle_reason=reason,
            # What a user waits for: from the call, prompt rendering and retries included.
            ttft_s=server_ttft + (t_prefill - self._started),
            server_ttft_s=server_ttft,
            prefill_s=t_decode - t_prefill,
            decode_s=t_end - t_decode,
            total_s=t_end - self._started,
            retries=self._attempts - 1,
            extends=taken.extends,
            final=self._final,
            tools=self._options.tools,
            tier=tier,
            route=route.route,
            route_reason=route.reason,
            max_tokens=request.max_tokens,
            max_tokens_clamped_from=self._clamped_from,
        )
        yield await self._commit(outcome)

    async def _commit(self, outcome: TurnOutcome) -> TurnResult:
        """Hand the state what the turn changed; then what the result asks of the new handle."""
        state, pool, result = self._state, self._pool, outcome.result
        stats = state.commit(outcome, block_size=pool.block_size)
        step = kv.committed(
            state.kv,
            handle=result.handle,
            final=self._final,
            finish_reason=result.finish_reason,
            stop_reason=result.stop_reason,
            closed=state.closed,
            # Asked for: the next turn is far off. The pin stays if the write fails.
            offload=self._offload == "always",
            policy=state.policy,
            now=pool.clock(),
        )
        if effects := state.apply(step):
            await leasing.run(pool, state, effects)
        return TurnResult(
            message=result.message,
            token_ids=result.token_ids,
            finish_reason=result.finish_reason,
            stats=stats,
            logprobs=result.logprobs,
            stop_sequence=result.stop_reason if isinstance(result.stop_reason, str) else None,
        )
