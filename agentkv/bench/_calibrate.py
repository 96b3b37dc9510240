"""``agentkv calibrate``: measure the route cost model on the user's own cluster.

A few requests at a time, through the SDK's own sessions (``route=``), on fresh random text so
that no prefix cache answers for the compute being timed. At each context length:

1. a ``recompute`` turn of ``n`` tokens, one answer token: its P leg is a cold prefill, its D leg
   the handover of all ``n`` tokens (decode's NIXL metrics, where exposed, count its bytes);
2. a ``decode`` turn of ``n`` other tokens: decode computes all of them itself, and pins them;
3. the same session's next turn on ``pull``: prefill pulls the pinned ``n`` tokens back and
   computes the append; against step 1, the prompt with the handle and without it;
4. its next turn on ``decode``: decode computes the append on its cached blocks.

Then, while another session streams, appends of a few sizes on the ``decode`` route: the gap they
open in the stream, less its usual inter-token time, is what a local prefill costs decode's other
sessions. ``_calibrate_fit.fit_model`` turns steps 1, 2 and 4 into a ``RouteCostModel``; step 3
and the stream are reported beside the model's prices for them.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import random
import secrets
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from agentkv import (
    AsyncCluster,
    AsyncSession,
    ConfigError,
    Message,
    Route,
    RouteCostModel,
    TextDelta,
    TurnResult,
    TurnStats,
)
from agentkv._core import Poster, TransportError, sample_values
from agentkv.bench._calibrate_fit import Measurements, fit_model
from agentkv.bench._text import generate

__all__ = ["CalibrateConfig", "Calibration", "LengthRow", "TaxRow", "calibrate", "choose_lengths"]

LENGTHS = (256, 1024, 2048, 4096, 8192, 16384, 32768)
QUICK_LENGTHS = (128, 512, 1024)
_XFER_TIME = "vllm:nixl_xfer_time_seconds_sum"
_XFER_BYTES = "vllm:nixl_bytes_transferred_sum"
_METRICS_TIMEOUT_S = 5.0
_ANSWER = {"ignore_eos": True}  # one token exactly, whatever it is


@dataclass(frozen=True, kw_only=True, slots=True)
class CalibrateConfig:
    """What ``agentkv calibrate`` measures.

    Attributes:
        lengths: context lengths in tokens (``None``: ``LENGTHS``, or ``QUICK_LENGTHS`` with
            ``quick``), capped by the served context.
        max_length: the longest context measured (also capped by the served context).
        append_tokens: the new tokens of the pull and decode appends (a tool result).
        tax_appends: append sizes whose cost to a streaming session is measured.
        stream_tokens: tokens the streaming session generates meanwhile.
        quick: the fewest lengths and appends (tests, a first look).
    """

    lengths: tuple[int, ...] | None = None
    max_length: int | None = None
    append_tokens: int = 64
    tax_appends: tuple[int, ...] = (16, 64, 256)
    stream_tokens: int = 160
    quick: bool = False


@dataclass(frozen=True, kw_only=True, slots=True)
class LengthRow:
    """One context length's turns: each leg's seconds, as ``TurnStats`` timed them, and the
    tokens each computed after how many cached (``reused_tokens``, ``computed_tokens``)."""

    tokens: int
    recompute_prefill_s: float
    recompute_handover_s: float
    recompute_cached: int
    decode_cold_s: float
    decode_cold_cached: int
    decode_cold_computed: int
    pull_prefill_s: float
    pulled_tokens: int
    pull_ttft_s: float
    decode_append_s: float
    decode_append_cached: int
    decode_append_computed: int
    decode_append_route: Route

    def decode_samples(self) -> list[tuple[int, int, float]]:
        """``(held, new, seconds)`` of this length's turns on the decode route."""
        samples = []
        if not math.isnan(self.decode_cold_s):
            samples.append((self.decode_cold_cached, self.decode_cold_computed,
                            self.decode_cold_s))
        if self.decode_append_route == "decode":
            samples.append((self.decode_append_cached, self.decode_append_computed,
                            self.decode_append_s))
        return samples


@dataclass(frozen=True, kw_only=True, slots=True)
class TaxRow:
    """A decode-route append of ``new`` tokens, and the gap it opened in another session's
    stream beyond that stream's median inter-token time (``itl_s``)."""

    new: int
    append_s: float
    gap_s: float
    itl_s: float

    @property
    def tax_s(self) -> float:
        return max(0.0, self.gap_s - self.itl_s)


@dataclass(frozen=True, kw_only=True, slots=True)
class Calibration:
    """The measurements, the fitted model, and where the transfer figures came from."""

    model: RouteCostModel
    rows: tuple[LengthRow, ...]
    tax: tuple[TaxRow, ...]
    measured: Measurements
    nixl_metrics: bool
    max_model_len: int | None
    notes: tuple[str, ...] = field(default=())


def choose_lengths(config: CalibrateConfig, *, max_model_len: int | None) -> tuple[int, ...]:
    """The lengths to measure: within the context, leaving room for the append and answer."""
    wanted = config.lengths or (QUICK_LENGTHS if config.quick else LENGTHS)
    cap = config.max_length or max(wanted)
    if max_model_len is not None:
        cap = min(cap, max_model_len - config.append_tokens - 16)
    lengths = tuple(sorted({n for n in wanted if 16 <= n <= cap}))
    if len(lengths) < 2:
        raise ConfigError(
            f"calibration needs two context lengths within {cap} tokens; got {lengths}"
        )
    return lengths


class _Text:
    """Fresh random text of about ``n`` tokens: each call starts with its own nonce, so no
    prefix cache holds any block of it; the characters a token are learned as turns report."""

    def __init__(self) -> None:
        self._rng = random.Random(secrets.randbits(64))  # noqa: S311 - text, no secret
        self.chars_per_token = 4.0

    def __call__(self, tokens: int) -> str:
        nonce = secrets.token_hex(8)
        chars = max(8, int(tokens * self.chars_per_token))
        return f"{nonce} " + generate("prose", self._rng, chars)

    def learn(self, text: str, tokens: int) -> None:
        if tokens > 32:  # the template's own tokens count too: a shade under, never over
            self.chars_per_token = len(text) / tokens


async def _metric_sum(poster: Poster, urls: Sequence[str], name: str) -> float | None:
    """The sum of series ``name`` over ``urls``' ``/metrics``; ``None`` where none exposes it."""
    total, seen = 0.0, False
    for url in urls:
        try:
            answer = await poster.get(url + "/metrics", timeout_s=_METRICS_TIMEOUT_S)
        except TransportError:
            continue
        if answer.status != 200:
            continue
        values = sample_values(answer.body.decode("utf-8", "replace"), name)
        seen = seen or bool(values)
        total += sum(values)
    return total if seen else None


class _Meter:
    """NIXL's transfer bytes and seconds on some servers, read before and after a step."""

    def __init__(self, poster: Poster, urls: Sequence[str]) -> None:
        self._poster, self._urls = poster, urls
        self.bytes = self.seconds = 0.0
        self.seen = False

    async def _read(self) -> tuple[float | None, float | None]:
        return (await _metric_sum(self._poster, self._urls, _XFER_BYTES),
                await _metric_sum(self._poster, self._urls, _XFER_TIME))

    async def around(self, step: Callable[[], Awaitable[None]]) -> None:
        before = await self._read()
        await step()
        after = await self._read()
        if None not in before and None not in after:
            self.seen = True
            self.bytes += after[0] - before[0]  # type: ignore[operator]
            self.seconds += after[1] - before[1]  # type: ignore[operator]


async def _turn(session: AsyncSession, text: str, *, route: Route) -> TurnStats:
    result = await session.send(text, route=route, max_tokens=1, extra_body=_ANSWER)
    return result.stats


async def _one_length(
    cluster: AsyncCluster, n: int, config: CalibrateConfig, text: _Text, handover: _Meter
) -> LengthRow:
    async with cluster.session(route="recompute", max_tokens=1) as cold:
        prompt = text(n)
        stats: list[TurnStats] = []

        async def recompute() -> None:
            stats.append(await _turn(cold, prompt, route="recompute"))

        await handover.around(recompute)
        recomputed = stats[0]
        text.learn(prompt, recomputed.prompt_tokens)
    async with cluster.session(route="decode", max_tokens=1) as pinned:
        local = await _turn(pinned, text(n), route="decode")
        pulled = await _turn(pinned, text(config.append_tokens), route="pull")
        appended = await _turn(pinned, text(config.append_tokens), route="decode")
    return LengthRow(
        tokens=recomputed.prompt_tokens,
        recompute_prefill_s=recomputed.prefill_s,
        recompute_handover_s=recomputed.decode_s,
        recompute_cached=recomputed.reused_tokens,
        decode_cold_s=local.decode_s if local.route == "decode" else float("nan"),
        decode_cold_cached=local.reused_tokens,
        decode_cold_computed=local.computed_tokens,
        pull_prefill_s=pulled.prefill_s,
        pulled_tokens=pulled.pulled_tokens,
        pull_ttft_s=pulled.server_ttft_s,
        decode_append_s=appended.decode_s,
        decode_append_cached=appended.reused_tokens,
        decode_append_computed=appended.computed_tokens,
        decode_append_route=appended.route,
    )


async def _stream_times(session: AsyncSession, tokens: int, started: asyncio.Event) -> list[float]:
    """The arrival time of each streamed piece; ``started`` once the stream runs steadily."""
    times: list[float] = []
    stream = session.stream(max_tokens=tokens, extra_body={"min_tokens": tokens, **_ANSWER})
    async for event in stream:
        if isinstance(event, TextDelta):
            times.append(time.perf_counter())
            if len(times) == 8:
                started.set()
        elif isinstance(event, TurnResult):
            break
    started.set()
    return times


async def _measure_tax(cluster: AsyncCluster, config: CalibrateConfig, text: _Text,
                       progress: Callable[[str], None]) -> tuple[TaxRow, ...]:
    """Appends on the ``decode`` route while another session streams on the same decode."""
    appends = config.tax_appends[1:2] if config.quick else config.tax_appends
    async with cluster.session(route="decode", max_tokens=1) as appender, \
            cluster.session(route="recompute", placement_key=appender.session_id) as streamer:
        await _turn(appender, text(256), route="decode")
        streamer.append(Message.user(text(64)))
        started = asyncio.Event()
        streaming = asyncio.create_task(
            _stream_times(streamer, config.stream_tokens, started))
        await started.wait()
        windows: list[tuple[int, float, float]] = []
        for new in appends:
            if streaming.done():
                break
            await asyncio.sleep(0.2)
            t0 = time.perf_counter()
            await _turn(appender, text(new), route="decode")
            windows.append((new, t0, time.perf_counter()))
            progress(f"calibrate: a {new}-token append on decode beside a stream")
        times = await streaming
    return tax_rows(times, windows)


def tax_rows(
    times: Sequence[float], windows: Sequence[tuple[int, float, float]]
) -> tuple[TaxRow, ...]:
    """Each append's ``(new, start, end)`` against a stream's token arrival ``times``: the
    longest gap that overlaps the append, and the median of the gaps that overlap none."""
    gaps = [(b, b - a) for a, b in itertools.pairwise(times)]

    def overlaps(end: float, gap: float, t0: float, t1: float) -> bool:
        return end > t0 and end - gap < t1

    quiet = [g for t, g in gaps if not any(overlaps(t, g, t0, t1) for _, t0, t1 in windows)]
    if not quiet:
        return ()
    itl = statistics.median(quiet)
    rows = []
    for new, t0, t1 in windows:
        during = [g for t, g in gaps if overlaps(t, g, t0, t1)]
        if during:
            rows.append(TaxRow(new=new, append_s=t1 - t0, gap_s=max(during), itl_s=itl))
    return tuple(rows)


async def calibrate(
    cluster: AsyncCluster,
    config: CalibrateConfig | None = None,
    *,
    progress: Callable[[str], None] = lambda _: None,
) -> Calibration:
    """Measure ``cluster`` and fit its ``RouteCostModel`` (``docs/benchmarks.md``,
    "Calibration"). vLLM's NIXL metrics are read through the cluster's own ``poster``."""
    config = config or CalibrateConfig()
    probe_prompt = _Text()
    async with cluster.session(route="recompute", max_tokens=1) as probe:
        text = probe_prompt(256)
        first = await _turn(probe, text, route="recompute")  # renders: the context is known
        probe_prompt.learn(text, first.prompt_tokens)
    max_len = cluster.max_model_len
    lengths = choose_lengths(config, max_model_len=max_len)
    handover = _Meter(cluster.poster, [pair.decode for pair in cluster.pairs])
    rows = []
    for index, n in enumerate(lengths, 1):
        progress(f"calibrate: context {n} tokens ({index}/{len(lengths)})")
        rows.append(await _one_length(cluster, n, config, probe_prompt, handover))
    tax = await _measure_tax(cluster, config, probe_prompt, progress)
    notes = []
    local = tuple(sample for r in rows for sample in r.decode_samples())
    if not local:
        notes.append("decode lacks agentkv's connector: the decode route was not measured")
    measured = Measurements(
        prefill=tuple((r.recompute_cached, r.tokens - r.recompute_cached, r.recompute_prefill_s)
                      for r in rows),
        handover=tuple((r.tokens, r.recompute_handover_s) for r in rows),
        decode_local=local,
        transfer_bytes=handover.bytes if handover.seen else 0.0,
        transfer_seconds=handover.seconds if handover.seen else 0.0,
        transfer_tokens=sum(r.tokens for r in rows) if handover.seen else 0,
    )
    if not handover.seen:
        notes.append("no vllm:nixl_* metrics on decode: bytes per token kept, rate from timing")
    model = fit_model(measured, block_size=cluster.block_size)
    return Calibration(model=model, rows=tuple(rows), tax=tax, measured=measured,
                      nixl_metrics=handover.seen, max_model_len=max_len, notes=tuple(notes))
