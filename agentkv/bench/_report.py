"""The benchmark's JSON report: per mode, per turn, one value per session; and a summary.

Shape (``null`` marks a turn that failed or never ran)::

    {"config": {...},
     "modes": {"<mode>": {
         "turns": [{"turn": 1, "ttft_ms": [...], "prompt_tokens": [...], "reused_tokens": [...],
                    "ideal_reused_tokens": [...]}, ...],   # on a pool, also "prefill": [...]
         "summary": {"ttft_p50_ms_after_first_turn": x, "ttft_p90_ms_after_first_turn": x,
                     "reuse_vs_ideal": x, "throughput_tokens_per_s": x}}},
     "errors": [...],   # only when some turn failed
     "sessions": [...], "roles": {...}, "role_ratios": {...}}  # a replay with subagents

Summary definitions: TTFT percentiles over every session's turns 2 and later (linear
interpolation); ``reuse_vs_ideal`` is the sum of prefill's reused tokens over the sum of the ideal
on those turns; ``throughput_tokens_per_s`` is the mode's generated tokens over the summed
wall-clock time of its turns (request to last token), i.e. what one agent sees. With think time,
``paused_decode_tokens_mean`` and ``paused_tier_tokens_mean`` are the tokens of a session's KV
held pinned in decode's memory, and in decode's file tier, through a pause (mean over pauses).
The ``limit`` mode's summary adds ``computed_tokens_mean_after_first_turn`` (prompt less the
server's cached tokens, mean over turns >= 2) and ``old_tokens_recomputed_max_after_first_turn``
(the most tokens of the previous turn's prompt and output that a turn recomputed: below the
block size when only prefix caching's whole-block rule costs anything).

The SDK modes' summaries (those that hold a decode handle between turns) count what became of
it on turns >= 2: ``handle_states_after_first_turn`` (turns by ``TurnStats.handle_state``),
``evictions`` (turns whose handle could not be used: ``EVICTED_STATES``), ``tier_resumes``
(turns that loaded the KV from decode's file tier) and ``tier_shortfalls`` (those that reused
less than the tier held: the entry was gone or cut short). ``decode`` holds decode's KV usage
and preemptions sampled through the run (``_decode_watch``), by phase and server; when modes
run one at a time each mode's summary also gets its phase's ``decode_kv_usage_peak``,
``decode_kv_usage_mean`` and ``decode_preemptions``. A replay of conversations with subagents
adds the parent's and the subagents' turns apart (``_roles.role_report``).
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from agentkv import HandleState
from agentkv.bench._config import SDK_ROUTES, BenchConfig, Mode
from agentkv.bench._decode_watch import DecodeWatch
from agentkv.bench._samples import TurnSample

__all__ = [
    "EVICTED_STATES",
    "build_report",
    "handle_counts",
    "median_by_turn",
    "percentile",
    "ratios",
    "speedups",
    "summarize",
]

_TURN_FIELDS = ("ttft_ms", "prompt_tokens", "reused_tokens", "ideal_reused_tokens")

# A turn's handle could not be used: decode freed it (its deadline passed, or decode said it no
# longer held it at an extend or offload), a failed attempt may have read it, the session moved
# pair, or the prompt no longer starts with its tokens. Not counted: ``none`` (there was none
# to use), ``below_threshold`` and ``unused`` (the policy chose to recompute), ``tier``.
EVICTED_STATES = frozenset({
    HandleState.EXPIRED, HandleState.CONSUMED, HandleState.INVALIDATED, HandleState.DIVERGED,
})


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) with linear interpolation, as numpy's default.

    >>> percentile([1.0, 2.0, 3.0, 4.0], 0.5), percentile([1.0, 2.0, 3.0, 4.0], 0.9)
    (2.5, 3.7)
    """
    if not values:
        raise ValueError("no values")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def _value(sample: TurnSample | None, name: str) -> float | int | None:
    if sample is None or not sample.ok:
        return None
    if name == "ttft_ms":
        return round(sample.ttft_s * 1000.0, 3)
    value: int = getattr(sample, name)
    return value


def handle_counts(samples: Iterable[TurnSample]) -> dict[str, Any]:
    """What became of the decode handle on the (successful) turns >= 2 of an SDK mode.

    >>> from agentkv.bench._config import Mode
    >>> def turn(state, reused=9):
    ...     return TurnSample(mode=Mode.AGENTKV, session=0, turn=2, ttft_s=0.1, total_s=0.2,
    ...                       prompt_tokens=20, reused_tokens=reused, ideal_reused_tokens=9,
    ...                       generated_tokens=4, handle_state=state)
    >>> counts = handle_counts([turn("attached"), turn("expired"), turn("tier"),
    ...                         turn("tier", reused=0)])
    >>> counts["handle_states_after_first_turn"]
    {'attached': 1, 'expired': 1, 'tier': 2}
    >>> counts["evictions"], counts["tier_resumes"], counts["tier_shortfalls"]
    (1, 2, 1)
    """
    later = [s for s in samples if s.ok and s.turn >= 2]
    states = Counter(s.handle_state for s in later)
    tier = [s for s in later if s.handle_state == HandleState.TIER]
    return {
        "handle_states_after_first_turn": dict(sorted(states.items())),
        "evictions": sum(states[state] for state in EVICTED_STATES),
        "tier_resumes": len(tier),
        "tier_shortfalls": sum(1 for s in tier if s.reused_tokens < s.ideal_reused_tokens),
    }


def summarize(
    samples: Iterable[TurnSample], *, computed: bool = False, handles: bool = False
) -> dict[str, Any]:
    """The summary block of one mode (``None`` where nothing was measured); ``computed`` adds
    what the turns >= 2 computed (the ``limit`` mode's check on itself), ``handles`` what
    became of the decode handle (``handle_counts``, for the SDK modes)."""
    samples = list(samples)
    ok = [s for s in samples if s.ok]
    later = [s for s in ok if s.turn >= 2]
    ttfts = [s.ttft_s * 1000.0 for s in later]
    ideal = sum(s.ideal_reused_tokens for s in later)
    reused = sum(s.reused_tokens for s in later if s.ideal_reused_tokens)
    seconds = sum(s.total_s for s in ok)
    generated = sum(s.generated_tokens for s in ok)

    def rounded(value: float | None, digits: int) -> float | None:
        return None if value is None else round(value, digits)

    summary = {
        "ttft_p50_ms_after_first_turn": rounded(percentile(ttfts, 0.5) if ttfts else None, 3),
        "ttft_p90_ms_after_first_turn": rounded(percentile(ttfts, 0.9) if ttfts else None, 3),
        "reuse_vs_ideal": rounded(reused / ideal if ideal else None, 5),
        "throughput_tokens_per_s": rounded(generated / seconds if seconds > 0 else None, 3),
    }
    if computed:
        # ideal + 1 is the previous turn's prompt and output: what the cache could have held.
        old = [s.ideal_reused_tokens + 1 - s.reused_tokens for s in later if s.ideal_reused_tokens]
        summary["computed_tokens_mean_after_first_turn"] = rounded(
            statistics.fmean(s.prompt_tokens - s.reused_tokens for s in later) if later else None,
            1,
        )
        summary["old_tokens_recomputed_max_after_first_turn"] = max(old) if old else None
    paused = [s for s in ok if s.paused_decode_tokens is not None]
    if paused:
        summary["paused_decode_tokens_mean"] = rounded(
            statistics.fmean(s.paused_decode_tokens or 0 for s in paused), 1
        )
        summary["paused_tier_tokens_mean"] = rounded(
            statistics.fmean(s.paused_tier_tokens or 0 for s in paused), 1
        )
    if handles:
        summary.update(handle_counts(samples))
    return summary


def _mode_block(
    config: BenchConfig,
    samples: Sequence[TurnSample],
    *,
    mode: Mode,
    decode: DecodeWatch | None = None,
    pooled: bool = False,
) -> dict[str, Any]:
    by_key = {(s.session, s.turn): s for s in samples}
    # Which prefill ran each turn (a pool's placement, per session), where the mode has P legs.
    placed = pooled and any(s.prefill for s in samples)
    turns = []
    for turn in range(1, config.turns + 1):
        row: dict[str, Any] = {"turn": turn}
        for name in _TURN_FIELDS:
            row[name] = [_value(by_key.get((i, turn)), name) for i in range(config.sessions)]
        if placed:
            row["prefill"] = [
                s.prefill if (s := by_key.get((i, turn))) is not None and s.ok else None
                for i in range(config.sessions)
            ]
        turns.append(row)
    summary = summarize(samples, computed=mode is Mode.LIMIT, handles=mode in SDK_ROUTES)
    phase = decode.peak(mode.value) if decode is not None and config.serial_modes else None
    if phase is not None:
        summary["decode_kv_usage_peak"] = phase["kv_usage_peak"]
        summary["decode_kv_usage_mean"] = phase["kv_usage_mean"]
        summary["decode_preemptions"] = phase["preemptions"]
    return {"turns": turns, "summary": summary}


def build_report(
    config: BenchConfig,
    samples: Iterable[TurnSample],
    *,
    environment: Mapping[str, Any],
    decode: DecodeWatch | None = None,
    pooled: bool = False,
) -> dict[str, Any]:
    """The JSON report of a run: ``config`` (with ``environment`` merged in) and ``modes``,
    ``decode`` (the metrics ``decode`` sampled, when given), and ``ratios`` (see
    :func:`ratios`) when the oracle, the limit or another route ran, or agentkv beside
    affinity. On a pool (``pooled``), the SDK modes' turn rows also name each turn's prefill."""
    by_mode: dict[Mode, list[TurnSample]] = {mode: [] for mode in config.modes}
    for sample in samples:
        by_mode[sample.mode].append(sample)
    report: dict[str, Any] = {
        "config": {**config.to_json(), **environment},
        "modes": {
            mode.value: _mode_block(config, by_mode[mode], mode=mode, decode=decode,
                                    pooled=pooled)
            for mode in config.modes
        },
    }
    if decode is not None:
        report["decode"] = decode.summary()
    errors = [
        {"mode": s.mode.value, "session": s.session, "turn": s.turn, "error": s.error}
        for mode in config.modes
        for s in by_mode[mode]
        if not s.ok
    ]
    if errors:
        report["errors"] = errors
    routes = [m for m in (Mode.AGENTKV_DECODE, Mode.AGENTKV_AUTO) if m in config.modes]
    pair = {Mode.AFFINITY, Mode.AGENTKV} <= set(config.modes)  # the decode-pressure target
    if Mode.ORACLE in config.modes or Mode.LIMIT in config.modes or routes or pair:
        # The shape otherwise; speedups() reads it.
        report["ratios"] = ratios(report)
        for mode in routes:
            report["ratios"].update(ratios(report, mode=mode.value))
    return report


def ratios(report: Mapping[str, Any], *, mode: str = Mode.AGENTKV.value) -> dict[str, Any]:
    """``mode``'s TTFT as a ratio to ``limit``, ``oracle``, ``disagg``, ``affinity`` and, for
    another route's mode, ``agentkv`` (the pull route): overall (p50 of turns >= 2) and per turn
    (median across sessions), for the references that ran.

    A ratio to the limit near 1 means reuse costs next to nothing over serving the turn where its
    KV already is (only the new tokens computed, nothing transferred); the oracle is the P/D path
    with prefill's cache filled, and no limit. A ratio to disagg below 1 is the speedup's inverse.
    """
    modes = report["modes"]
    if mode not in modes:
        return {}
    out: dict[str, Any] = {}
    ours = modes[mode]
    for other in (Mode.LIMIT.value, Mode.ORACLE.value, Mode.DISAGG.value, Mode.AFFINITY.value,
                  Mode.AGENTKV.value):
        if other not in modes or other == mode:
            continue
        base = modes[other]
        p50 = ours["summary"]["ttft_p50_ms_after_first_turn"]
        ref = base["summary"]["ttft_p50_ms_after_first_turn"]
        by_turn = [
            None if a is None or b is None or b == 0 else round(a / b, 3)
            for a, b in zip(median_by_turn(ours), median_by_turn(base), strict=True)
        ]
        out[f"{mode}_vs_{other}"] = {
            "ttft_p50_after_first_turn": None if not p50 or not ref else round(p50 / ref, 3),
            "by_turn": by_turn,
        }
    return out


def speedups(report: Mapping[str, Any], *, baseline: str = Mode.DISAGG.value) -> dict[str, float]:
    """Median TTFT (turns >= 2) of ``baseline`` over each mode's, for the modes that have both."""
    modes = report["modes"]
    if baseline not in modes:
        return {}
    base = modes[baseline]["summary"]["ttft_p50_ms_after_first_turn"]
    out = {}
    for name, block in modes.items():
        value = block["summary"]["ttft_p50_ms_after_first_turn"]
        if base and value:
            out[name] = round(base / value, 3)
    return out


def median_by_turn(block: Mapping[str, Any]) -> list[float | None]:
    """Median TTFT (ms) of each turn across sessions (``None`` for a turn with no value)."""
    out: list[float | None] = []
    for row in block["turns"]:
        values = [v for v in row["ttft_ms"] if v is not None]
        out.append(statistics.median(values) if values else None)
    return out
