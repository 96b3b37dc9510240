"""A turn's legs over HTTP: the P leg on a prefill chosen by load, the D leg on decode.

``TurnRunner`` (``turn``) directs the turn (its attempts, retries, the KV's transitions and the
commit) and inherits these: each posts one leg, frees on decode what a failed leg leaves
pinned (``kv.release_sent``, ``kv.ReleaseRequest``), and records the times the stats report.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from typing import TypeVar

from agentkv._client import kv, leasing
from agentkv._client.pool import PairPool
from agentkv._client.state import SessionState
from agentkv._exceptions import ConnectError, MalformedResponseError, UpstreamStatusError
from agentkv._log import get_logger
from agentkv._types import HandleState, KVHandle, Pair, TextDelta
from agentkv._wire.decode_answer import StreamAccumulator, parse_decode, unexplained
from agentkv._wire.handoff import (
    DECODE_ECHO,
    DecodeResult,
    PrefillResult,
    TurnRequest,
    parse_prefill,
    prefill_body,
)
from agentkv._wire.hints import new_request_secret, request_tag
from agentkv._wire.http import post_json, stream_events
from agentkv._wire.tier import TierRef

__all__ = ["TurnLegs"]

T = TypeVar("T")

logger = get_logger("agentkv")

_CHAT_PATH = "/v1/chat/completions"


class TurnLegs:
    """The legs of ``TurnRunner``, which sets these attributes."""

    _pool: PairPool
    _state: SessionState
    _stream: bool
    _request_secret: str | None
    _request: TurnRequest | None
    _clamped_from: int | None
    _prefill_name: str | None
    _t_prefill: float
    _ttft: float | None
    _yielded: bool
    _handle_state: HandleState | None

    async def _release_sent(self, sent: KVHandle | None, reason: str) -> None:
        """Release a handle the turn took that no prefill read, while decode may hold it."""
        state, pool = self._state, self._pool
        effects = kv.release_sent(sent, reason=reason, policy=state.policy, now=pool.clock())
        await leasing.run(pool, state, effects)

    def _release_sent_later(self, sent: KVHandle | None, reason: str) -> None:
        """``_release_sent`` in the background: the turn does not wait for decode's answer."""
        state, pool = self._state, self._pool
        effects = kv.release_sent(
            sent, reason=reason, policy=state.policy, now=pool.clock(), background=True
        )
        leasing.start(pool, state, effects)

    async def _p_leg(
        self,
        pair: Pair,
        request: TurnRequest,
        ids: object,
        sent: KVHandle | None,
        tokens: Sequence[int],
        *,
        tier: TierRef | None = None,
    ) -> tuple[PrefillResult, str]:
        """The P leg on a prefill chosen by load, and that prefill's name; a handle the leg
        carried and no prefill will read is released on decode."""
        # Outstanding tokens: what the prefill computes (the handle's tokens are pulled).
        covered = sent.num_tokens if sent is not None else tier.n_tokens if tier else 0
        cost = max(1, len(tokens) - covered)
        salt = request.extra.get("cache_salt")
        try:
            prefill = await self._on_prefill(
                pair,
                lambda url: self._prefill(url, request, ids, sent, tier=tier),
                cost=cost,
                prompt=tokens,
                salt=salt if isinstance(salt, str) else None,
            )
        except ConnectError:
            # No prefill got the P leg, so none read the handle: free it on decode.
            await self._release_sent(sent, "prefill_unreachable")
            raise
        except (UpstreamStatusError, MalformedResponseError):
            # Prefill answered, so it is done with the handle: it pulled the blocks (decode then
            # freed them, and the release finds nothing) or never will. A lost P leg (timeout,
            # reset) may still be reading: its handle is left to decode's TTL.
            await self._release_sent(sent, "prefill_failed")
            raise
        assert self._prefill_name is not None
        return prefill, self._prefill_name

    async def _on_prefill(
        self,
        pair: Pair,
        call: Callable[[str], Awaitable[T]],
        *,
        cost: int = 0,
        prompt: Sequence[int] = (),
        salt: str | None = None,
    ) -> T:
        """Run ``call`` on a prefill chosen now; in a pool, another prefill if it refuses.

        ``cost`` (tokens) counts as the prefill's load while ``call`` runs. It is added in the
        same step as the choice, with no await between: turns that start together see each
        other's load instead of all choosing the same idle prefill. ``prompt``: the tokens the
        call prefills under ``salt``; in a pool, a first turn looks for the prefill that holds
        (or is computing) their prefix, and they are recorded as that prefill's once sent
        (``PrefixHomes``).
        """
        state, pool = self._state, self._pool
        tried: set[str] = set()
        key = f"{state.session_id}/{state.transcript.version + 1}"
        while True:
            name = pool.choose_prefill(
                key, pair, warm=state.last_prefill, exclude=tried, prompt=prompt, salt=salt
            )
            self._prefill_name = name
            pool.prefill_begin(name, cost)
            if pool.pooled and prompt:
                # Recorded as sent, not as answered: a sibling starting meanwhile (Claude Code
                # starts its Explore agents together) finds the prefill computing their prefix.
                pool.prefix_homes.record(name, salt, prompt)
            try:
                return await call(pool.prefill_url(name))
            except ConnectError as exc:
                if not pool.pooled:
                    raise
                pool.mark_prefill_down(name, reason=str(exc))
                tried.add(name)
                logger.warning("agentkv.prefill_refused", session_id=state.session_id, prefill=name)
            finally:
                pool.prefill_end(name, cost)

    async def _decode(
        self,
        pair: Pair,
        request: TurnRequest,
        body: bytes,
        *,
        issued_at: float,
        releasable: bool,
    ) -> AsyncGenerator[TextDelta | DecodeResult, None]:
        """The D leg: text deltas (streaming), then the parsed answer."""
        state = self._state
        decode_url = pair.decode + _CHAT_PATH
        dates = {"issued_at": issued_at, "deadline": kv.handle_deadline(state.policy, issued_at)}

        def lease_deadline(ttl_s: float) -> float:  # from the TTL decode granted
            return kv.lease_deadline(state.policy, sent_at=issued_at, ttl_s=ttl_s)

        summary = request.summary("decode")
        client = self._pool.poster
        # A request id of our choosing (vLLM honours X-Request-Id): if the answer, and with it
        # the handle, never reaches us, its secret still releases what decode pinned for it.
        secret = self._request_secret or new_request_secret()
        headers = {"X-Request-Id": request_tag(secret)}
        self._ttft = None
        result: DecodeResult | None = None
        refused = False
        try:
            if self._stream:
                acc = StreamAccumulator(url=decode_url)
                chunks = stream_events(
                    client, decode_url, body, summary=summary, headers=headers, unread=DECODE_ECHO
                )
                async with contextlib.aclosing(chunks):
                    async for chunk in chunks:
                        text = acc.feed(chunk)
                        if self._ttft is None and (text or acc.has_tokens):
                            self._ttft = time.perf_counter() - self._t_prefill
                        if text:
                            first = not self._yielded
                            self._yielded = True
                            yield self._delta(text, first=first)
                result = acc.result(pair=pair.name, **dates, lease_deadline=lease_deadline)
            else:
                data = await post_json(
                    client, decode_url, body, summary=summary, headers=headers, unread=DECODE_ECHO
                )
                result = parse_decode(
                    data, url=decode_url, pair=pair.name, **dates, lease_deadline=lease_deadline
                )
        except ConnectError:
            refused = True  # decode never got the leg
            raise
        finally:
            # Lost (timeout, reset), unreadable, cancelled, or a stream left early: decode may
            # have finished and pinned the turn's KV for a handle nobody will ever send.
            if releasable and not refused and (result is None or unexplained(result)):
                lost = kv.ReleaseRequest(
                    decode=pair.decode,
                    secret=secret,
                    reason="no_handle" if result is not None else "answer_lost",
                )
                leasing.start(self._pool, state, (lost,))
        yield result

    def _delta(self, text: str, *, first: bool) -> TextDelta:
        """A stream's text; the first piece also says the handle decision and any clamp."""
        if not first:
            return TextDelta(text=text)
        clamped = self._clamped_from
        return TextDelta(
            text=text,
            handle_state=self._handle_state,
            max_tokens=self._request.max_tokens if clamped is not None and self._request else None,
            max_tokens_clamped_from=clamped,
        )

    async def _prefill(
        self,
        base: str,
        request: TurnRequest,
        ids: object,
        sent: KVHandle | None,
        *,
        tier: TierRef | None = None,
    ) -> PrefillResult:
        url = base + _CHAT_PATH
        data = await post_json(
            self._pool.poster,
            url,
            prefill_body(request, prompt_ids=ids, handle=sent, tier=tier),
            summary=request.summary("prefill"),
        )
        return parse_prefill(data, url=url)
