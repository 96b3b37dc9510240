"""How each mode serves a session's turns: the SDK for the P/D modes, plain requests for aggregated.

``disagg``, ``affinity`` and ``agentkv`` all run on the SDK (the same transcript, template and
request code), so they differ only in what the benchmark means to compare:

=========  ==========================  ==================  =============================
mode       handle sent to prefill      prefill cache_salt  decode keeps turn KV
=========  ==========================  ==================  =============================
disagg     never                       fresh every turn    no
affinity   never                       one per session     no
agentkv    when the policy says so     one per session     yes (pinned, extended to
                                                           cover each pause; with
                                                           ``pause="tool-wait"`` the
                                                           SDK's tool_wait decides)
agentkv-   never: no P leg after the   (no P leg)          yes, as agentkv
decode     first turn; decode's cache
           holds the pinned KV
agentkv-   the route policy's choice   one per session     yes, as agentkv
auto       (decode or pull, per turn)
tier       the tier reference after    one per session     pinned until the pause, then
           a pause, else the handle                        in its file tier, pin freed
oracle     never; the previous turn's  one per session     no
           tokens prefilled off the
           clock before each turn
limit      no P leg: the turn goes to  one per session     no (a local request; the
           decode alone, whose cache                       previous turn's tokens are
           holds the previous turn                         filled off the clock)
=========  ==========================  ==================  =============================

``aggregated`` sends ordinary streamed chat completions (the server renders the messages) to the
prefill server alone, with one salt per session. "One per session" is one per salt group where
the workload names one: a replayed conversation's parent and subagents share a salt (one user),
so siblings can hit each other's prefix (``open_runner``). ``limit`` (``_limit.py``) sends the
SDK's exact prompt ids to the decode server alone: only the new tokens (and a block's tail) are
computed.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Mapping
from typing import Any, Protocol

import httpx2

from agentkv import AsyncCluster, AsyncSession, CachePolicy, Message, TurnResult
from agentkv._core import HttpxPoster, dumps, stream_events
from agentkv.bench._config import SDK_ROUTES, Mode, Pause
from agentkv.bench._legs import LegRewriter
from agentkv.bench._limit import LimitRunner, fill_cache
from agentkv.bench._samples import Held, TurnSample
from agentkv.bench._share import SharedClusters
from agentkv.bench._target import ClusterTarget
from agentkv.bench._workload import TurnScript

__all__ = [
    "NEVER_ATTACH",
    "AggregatedRunner",
    "ClusterTarget",
    "Held",
    "NotOwned",
    "SdkRunner",
    "SessionRunner",
    "open_runner",
]

_NO_HANDLE = "decode returned no turn-end handle: is bidirectional_kv_xfer on for decode?"
_NO_STREAMED_HANDLE = (
    "decode's streamed answer carried no turn-end handle: run the pair with agentkv's vLLM "
    "plugin (as `agentkv up` does) or pass --no-stream"
)
# Never attach a handle: a policy whose reuse floor no handle reaches.
NEVER_ATTACH = CachePolicy(min_reuse_tokens=2**62)


# A pin kept through a pause outlasts it by this much (the SDK's own extend slack).
_PIN_SLACK_S = 30.0


class SessionRunner(Protocol):
    """Runs one session's turns in one mode."""

    async def turn(self, script: TurnScript) -> TurnSample: ...

    async def pause(self, expected_s: float) -> Held:
        """A pause of ``expected_s`` seconds starts (the agent runs a tool)."""
        ...

    async def aclose(self) -> None: ...


def _salt(run_id: str, mode: Mode, group: str) -> str:
    # vLLM refuses salts over 128 characters or with '/', '@', '\\'.
    return f"akvb-{run_id}-{mode.value}-{group}"


class SdkRunner:
    """A session on the SDK: ``disagg``, ``affinity``, ``agentkv`` or ``oracle``.

    ``warm``, when given, runs before each turn, off the clock (the oracle's cache fill).
    """

    def __init__(
        self,
        *,
        mode: Mode,
        index: int,
        cluster: AsyncCluster,
        session: AsyncSession,
        system: str,
        decode_salt: str,
        stream: bool,
        warm: CacheFiller | None = None,
        pause: Pause = "extend",
        owns_cluster: bool = True,
    ) -> None:
        self._mode = mode
        self._owns_cluster = owns_cluster
        self._pause = pause
        # A tool wait opened at a pause, closed when the next turn starts (or the lane ends).
        self._waits = contextlib.AsyncExitStack()
        self._warm = warm
        self._index = index
        self._cluster = cluster
        self._session = session
        self._system: str | None = system
        self._decode_salt = decode_salt
        self._stream = stream

    async def turn(self, script: TurnScript) -> TurnSample:
        session = self._session
        await self._waits.aclose()  # the tool returned: the wait ends as the next turn starts
        if self._warm is not None and session.turns:
            await self._warm(session)
        if self._system is not None:
            session.append(Message.system(self._system))
            self._system = None
        session.append(Message.user(script.user))
        extra = {"min_tokens": script.output_tokens, "cache_salt": self._decode_salt}
        result: TurnResult | None = None
        if self._stream:
            async for event in session.stream(max_tokens=script.output_tokens, extra_body=extra):
                if isinstance(event, TurnResult):
                    result = event
        else:
            result = await session.turn(max_tokens=script.output_tokens, extra_body=extra)
        assert result is not None  # a stream that ends without a result raises instead
        stats = result.stats
        error = None
        if self._mode in SDK_ROUTES and session.handle is None:
            # Without a handle the next turn cannot pull: the lane would measure affinity, not
            # agentkv. Stock vLLM puts no handle on streamed answers (vllm#40186).
            error = _NO_STREAMED_HANDLE if self._stream else _NO_HANDLE
        return TurnSample(
            mode=self._mode,
            session=self._index,
            turn=script.turn,
            # From the call, rendering the new messages' tokens included (the SDK's own TTFT).
            ttft_s=stats.ttft_s,
            total_s=stats.total_s,
            prompt_tokens=stats.prompt_tokens,
            reused_tokens=stats.reused_tokens,
            ideal_reused_tokens=stats.ideal_reused_tokens,
            generated_tokens=stats.generated_tokens,
            prefill_s=stats.prefill_s,
            handle_state=stats.handle_state.value,
            prefill=stats.prefill,
            error=error,
        )

    async def pause(self, expected_s: float) -> Held:
        session = self._session
        if self._mode is Mode.TIER:
            await session.offload()
        elif self._mode in SDK_ROUTES and self._pause == "tool-wait":
            # As an agent waits on its tool: the SDK's policy keeps the pin (extended if the
            # pause outlasts it) or offloads it to decode's tier, when the pause is long or
            # decode's memory is full. The wait spans the pause, so it stays open until the
            # next turn.
            await self._waits.enter_async_context(
                session.tool_wait(expected_s=expected_s, offload="auto")
            )
        elif self._mode in SDK_ROUTES and session.handle is not None:
            # The reference "unlimited pin": decode keeps the KV however long the pause.
            await session.extend_handle(expected_s + _PIN_SLACK_S)
        handle, tier = session.handle, session.tier
        return Held(
            decode_tokens=0 if handle is None else handle.num_tokens,
            tier_tokens=0 if tier is None else tier.n_tokens,
        )

    async def aclose(self) -> None:
        await self._waits.aclose()
        await self._session.aclose()
        if self._owns_cluster:
            await self._cluster.aclose()
        if self._warm is not None:
            await self._warm.aclose()


class AggregatedRunner:
    """A session on one server doing prefill and decode, with its prefix cache (a reference)."""

    def __init__(
        self, *, index: int, client: httpx2.AsyncClient, url: str, model: str, system: str,
        salt: str,
    ) -> None:
        self._index = index
        self._client = client
        self._poster = HttpxPoster(client)
        self._url = url.rstrip("/") + "/v1/chat/completions"
        self._model = model
        self._messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
        self._salt = salt
        self._ideal = 0

    async def turn(self, script: TurnScript) -> TurnSample:
        messages = [*self._messages, {"role": "user", "content": script.user}]
        body = dumps({
            "model": self._model,
            "messages": messages,
            "max_tokens": script.output_tokens,
            "min_tokens": script.output_tokens,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "cache_salt": self._salt,
        })
        started = time.perf_counter()
        first: float | None = None
        text: list[str] = []
        usage: Mapping[str, Any] = {}
        async for chunk in stream_events(self._poster, self._url, body, summary="aggregated"):
            choices = chunk.get("choices") or []
            delta = choices[0].get("delta") or {} if choices else {}
            piece = delta.get("content") or ""
            if first is None and piece:
                first = time.perf_counter()
            text.append(piece)
            if isinstance(chunk.get("usage"), Mapping):
                usage = chunk["usage"]
        end = time.perf_counter()
        prompt = int(usage.get("prompt_tokens", 0))
        generated = int(usage.get("completion_tokens", 0))
        details = usage.get("prompt_tokens_details") or {}
        ideal, self._ideal = self._ideal, prompt + generated - 1
        self._messages = [*messages, {"role": "assistant", "content": "".join(text)}]
        return TurnSample(
            mode=Mode.AGGREGATED,
            session=self._index,
            turn=script.turn,
            ttft_s=(first if first is not None else end) - started,
            total_s=end - started,
            prompt_tokens=prompt,
            reused_tokens=int(details.get("cached_tokens") or 0),
            ideal_reused_tokens=min(ideal, max(0, prompt - 1)),
            generated_tokens=generated,
        )

    async def pause(self, expected_s: float) -> Held:
        return Held()  # the server keeps what its prefix cache keeps

    async def aclose(self) -> None:
        await self._client.aclose()


class NotOwned(httpx2.AsyncBaseTransport):
    """Lends a shared transport to a client that will try to close it."""

    def __init__(self, inner: httpx2.AsyncBaseTransport) -> None:
        self._inner = inner

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        return await self._inner.handle_async_request(request)

    async def aclose(self) -> None:
        """The owner closes the shared transport."""


def open_runner(
    mode: Mode,
    index: int,
    *,
    target: ClusterTarget,
    system: str,
    run_id: str,
    stream: bool,
    pause: Pause = "extend",
    salt_group: str | None = None,
    clusters: SharedClusters | None = None,
) -> SessionRunner:
    """A runner for session ``index`` in ``mode``, with its own HTTP client; ``pause`` says what
    the SDK modes do at a pause (``BenchConfig.pause``).

    The modes that keep one cache salt per session keep it per ``salt_group`` when given: the
    sessions of one replayed conversation (parent and subagents) are one user, whose siblings
    may hit each other's prefix. ``disagg`` keeps a fresh salt on every P leg regardless. In the
    SDK modes but ``disagg``, a group's sessions share one cluster from ``clusters`` (``_share``).
    """
    own = f"s{index}"
    salt = _salt(run_id, mode, own if mode is Mode.DISAGG else salt_group or own)
    if mode is Mode.AGGREGATED:
        client = httpx2.AsyncClient(transport=NotOwned(target.transport), timeout=600.0)
        return AggregatedRunner(
            index=index, client=client, url=target.urls("prefill")[0], model=target.model,
            system=system, salt=salt,
        )
    if mode is Mode.LIMIT:
        client = httpx2.AsyncClient(transport=NotOwned(target.transport), timeout=600.0)
        return LimitRunner(
            index=index, client=client, url=target.urls("decode")[0], model=target.model,
            system=system, salt=salt, stream=stream,
        )
    warm = None
    if mode is Mode.ORACLE:
        warm = CacheFiller(target, salt)
    if mode is Mode.DISAGG:
        counter = itertools.count(1)

        def prefill_salt() -> str:
            return f"{salt}-p{next(counter)}"
    else:

        def prefill_salt() -> str:
            return salt

    def make() -> AsyncCluster:
        transport = LegRewriter(
            target.transport,
            prefill=target.urls("prefill"),
            decode=target.urls("decode"),
            prefill_salt=prefill_salt,
            pin_on_decode=mode in SDK_ROUTES,
        )
        policy = CachePolicy() if mode in SDK_ROUTES else NEVER_ATTACH
        return AsyncCluster.from_dict(target.spec, transport=transport, policy=policy)

    # The group's salt is the same on every P leg of its sessions: one transport serves them.
    shared = clusters is not None and salt_group is not None and mode is not Mode.DISAGG
    cluster = (clusters.get(mode, salt_group, make)
               if clusters is not None and salt_group is not None and shared else make())
    session = cluster.session(  # the id: see _run.session_id
        session_id=f"{mode.value}-s{index}", route=SDK_ROUTES.get(mode, "pull")
    )
    return SdkRunner(
        mode=mode, index=index, cluster=cluster, session=session, system=system,
        decode_salt=salt, stream=stream, warm=warm, pause=pause, owns_cluster=not shared,
    )


class CacheFiller:
    """The oracle's fill: a session's committed tokens (the previous turn's prompt and output,
    exactly) prefilled on its prefill server under its salt, so that prefill's cache holds every
    whole block of them when the timed turn comes. No KV moves between servers, nothing is
    pinned.

    The fill is a P-leg-shaped chat request (the prompt as ``kv_transfer_params.prompt_token_ids``,
    which vLLM's ``OnlineRenderer`` takes instead of the messages) without ``do_remote_decode``:
    prefill computes the tokens, keeps their blocks in its prefix cache and hands nothing on
    (``fill_cache``, which the ``limit`` mode sends to decode).
    """

    def __init__(self, target: ClusterTarget, salt: str) -> None:
        self._client = httpx2.AsyncClient(transport=NotOwned(target.transport), timeout=600.0)
        self._model = target.model
        self._salt = salt

    async def __call__(self, session: AsyncSession) -> None:
        await fill_cache(self._client, session.pair.prefill, model=self._model, salt=self._salt,
                         token_ids=session.transcript.token_ids)

    async def aclose(self) -> None:
        await self._client.aclose()
