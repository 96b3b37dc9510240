"""Fit a ``RouteCostModel`` to measured times, the fixed cost and the cost per token apart.

Pure: ``agentkv calibrate`` (``_calibrate.py``) measures, this turns its samples into a model, and
the unit tests feed it published GPU figures instead (``tests/unit/test_route_published.py``).

What each measurement is, in the model's terms (``agentkv._route.RouteCostModel``):

- a cold P leg of ``n`` tokens (nothing cached): ``leg_s + prefill_s(0, n)``, a quadratic
  ``a + b n + c n**2``: ``a`` is the leg, ``1 / b`` the prefill rate, ``c`` attention's growth;
- that turn's D leg (decode pulls all ``n`` tokens and answers one): ``leg_s + transfer_s(n)``,
  a line whose intercept less the leg is the handover's fixed cost and whose slope is the bytes
  (vLLM's NIXL metrics, where they exist, give the bytes per token and the rate instead);
- a cold turn on the ``decode`` route (D leg only, decode computes all ``n`` tokens):
  ``leg_s + decode_local_s(0, n)``, a quadratic whose intercept less the leg is decode's fixed
  cost of a local prefill; appends on that route, after ``held`` cached tokens, fit its quadratic
  term (attention over the context) too.

>>> fit = fit_quadratic([(1000, 0.041), (2000, 0.074), (4000, 0.146)])
>>> round(fit.fixed, 3), round(fit.per_token * 1e6, 1), round(fit.per_token2 * 1e9, 3)
(0.01, 30.0, 1.0)
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace

from agentkv import ConfigError, RouteCostModel

__all__ = [
    "Measurements",
    "Quadratic",
    "fit_compute",
    "fit_line",
    "fit_model",
    "fit_quadratic",
]

# A rate the fit never goes past: a slope fitted at or below zero (noise over too few lengths)
# means "too fast to see", not "free".
_MIN_SLOPE_S = 1e-9


@dataclass(frozen=True, slots=True)
class Quadratic:
    """``fixed + per_token * n + per_token2 * n**2`` seconds for ``n`` tokens."""

    fixed: float
    per_token: float
    per_token2: float

    def __call__(self, n: float) -> float:
        return self.fixed + self.per_token * n + self.per_token2 * n * n


def fit_line(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares ``(intercept, slope)`` of ``(x, y)`` points, each weighed by its relative
    error (lengths span orders of magnitude: the short ones must fit too); one length (or one
    point) is read as a line through the origin, the fixed part then unknown and taken as 0."""
    if not points:
        raise ConfigError("no samples to fit")
    if len({float(x) for x, _ in points}) < 2:
        slopes = [y / x for x, y in points if x]
        return 0.0, max(statistics.fmean(slopes) if slopes else 0.0, _MIN_SLOPE_S)
    solved = _least_squares([(1.0, float(x), float(y)) for x, y in points], columns=2)
    if solved is None:  # pragma: no cover - two distinct lengths always solve
        raise ConfigError("the calibration's samples do not determine a line")
    return solved[0], solved[1]


def _least_squares(rows: Sequence[tuple[float, ...]], *, columns: int) -> list[float] | None:
    """``x`` minimizing ``sum(((row[:columns] . x) - y) / y)**2`` over rows ``(*features, y)``:
    least squares on relative errors, by the normal equations (Gaussian elimination)."""
    weighted = [[f / row[-1] for f in row[:columns]] for row in rows if row[-1] > 0]
    scale = [max(abs(r[j]) for r in weighted) or 1.0 for j in range(columns)]
    a = [[r[j] / scale[j] for j in range(columns)] for r in weighted]
    m = [[sum(r[i] * r[j] for r in a) for j in range(columns)] + [sum(r[i] for r in a)]
         for i in range(columns)]
    for col in range(columns):
        pivot = max(range(col, columns), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-12:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, columns):
            f = m[r][col] / m[col][col]
            m[r] = [x - f * y for x, y in zip(m[r], m[col], strict=True)]
    x = [0.0] * columns
    for r in reversed(range(columns)):
        x[r] = (m[r][columns] - sum(m[r][c] * x[c] for c in range(r + 1, columns))) / m[r][r]
    return [value / scale[j] for j, value in enumerate(x)]


def fit_compute(samples: Sequence[tuple[int, int, float]]) -> Quadratic:
    """``fixed + per_token * new + per_token2 * ((held + new)**2 - held**2)`` seconds fitted to
    ``(held, new, seconds)`` samples: the model's form of a prefill of ``new`` tokens after
    ``held`` cached ones. ``per_token2 >= 0`` and ``fixed >= 0`` (attention only adds, a request
    never costs less than nothing): without three sizes, or where the curve would bend down, a
    line; where the line would start below zero, a curve through the origin."""
    rows = [(1.0, float(n), float((h + n) ** 2 - h * h), float(y)) for h, n, y in samples]
    if not rows:
        raise ConfigError("no samples to fit")
    if len({(h, n) for h, n, _ in samples}) >= 3:
        full = _least_squares(rows, columns=3)
        if full is not None and full[0] >= 0 and full[1] > 0 and full[2] >= 0:
            return Quadratic(fixed=full[0], per_token=full[1], per_token2=full[2])
    if len({n for _, n, _ in samples}) >= 2:
        line = _least_squares([(r[0], r[1], r[3]) for r in rows], columns=2)
        if line is not None and line[0] >= 0 and line[1] > 0:
            return Quadratic(fixed=line[0], per_token=line[1], per_token2=0.0)
        bent = _least_squares([r[1:] for r in rows], columns=2)
        if bent is not None and bent[0] > 0 and bent[1] >= 0:
            return Quadratic(fixed=0.0, per_token=bent[0], per_token2=bent[1])
    ratios = [y / n for _, n, y in samples if n]
    return Quadratic(fixed=0.0, per_token=max(statistics.fmean(ratios) if ratios else 0.0,
                                               _MIN_SLOPE_S), per_token2=0.0)


def fit_quadratic(points: Sequence[tuple[float, float]]) -> Quadratic:
    """``a + b n + c n**2`` fitted to cold ``(n, seconds)`` points (``fit_compute`` with
    nothing cached)."""
    return fit_compute([(0, int(n), y) for n, y in points])


@dataclass(frozen=True, kw_only=True, slots=True)
class Measurements:
    """What ``agentkv calibrate`` measured.

    Attributes:
        prefill: P legs that pulled nothing, as ``(held, new, seconds)``: prefill's cached
            tokens, the tokens it computed (``TurnStats.reused_tokens``, ``computed_tokens``),
            and ``TurnStats.prefill_s``.
        handover: D legs of those turns, as ``(tokens, seconds)``: decode pulls all of the
            prompt and answers one token (``TurnStats.decode_s``).
        decode_local: ``decode``-route turns, as ``(held, new, seconds)``: decode's own cached
            and computed tokens (the partial last block among the computed) and the D leg.
        transfer_bytes: bytes vLLM's NIXL metrics counted over the handovers (0: none exposed).
        transfer_seconds: their transfer time by the same metrics.
        transfer_tokens: tokens moved over those transfers (to turn bytes into bytes a token).
    """

    prefill: tuple[tuple[int, int, float], ...]
    handover: tuple[tuple[int, float], ...] = ()
    decode_local: tuple[tuple[int, int, float], ...] = ()
    transfer_bytes: float = 0.0
    transfer_seconds: float = 0.0
    transfer_tokens: int = 0

    @classmethod
    def cold(cls, prefill: Sequence[tuple[int, float]],
             handover: Sequence[tuple[int, float]] = (),
             decode_local: Sequence[tuple[int, float]] = ()) -> Measurements:
        """From ``(tokens, seconds)`` of turns on fresh prompts (nothing cached)."""
        return cls(prefill=tuple((0, n, y) for n, y in prefill), handover=tuple(handover),
                   decode_local=tuple((0, n, y) for n, y in decode_local))


def fit_model(
    measured: Measurements, *, base: RouteCostModel | None = None, block_size: int | None = None
) -> RouteCostModel:
    """The cost model the measurements imply; what they do not measure stays ``base``'s.

    Each kind of request has its own intercept; the smallest is the fixed cost every request
    pays (``leg_s``), and each kind's excess over it its own fixed cost (``prefill_fixed_s``,
    ``transfer_fixed_s``, ``decode_fixed_s``)."""
    model = base or RouteCostModel()
    prefill = fit_compute(measured.prefill)
    handover = fit_line(measured.handover) if measured.handover else None
    local = fit_compute(measured.decode_local) if measured.decode_local else None
    intercepts = [prefill.fixed]
    intercepts += [max(0.0, handover[0])] if handover else []
    intercepts += [local.fixed] if local else []
    leg = min(intercepts)
    model = replace(
        model,
        leg_s=leg,
        prefill_fixed_s=prefill.fixed - leg,
        prefill_tokens_per_s=1.0 / prefill.per_token,
        prefill_s_per_token2=prefill.per_token2,
        block_size=block_size or model.block_size,
    )
    bytes_per_token = model.bytes_per_token
    rate = None
    if measured.transfer_bytes > 0 and measured.transfer_tokens > 0:
        bytes_per_token = max(1, round(measured.transfer_bytes / measured.transfer_tokens))
        if measured.transfer_seconds > 0:
            rate = measured.transfer_bytes / measured.transfer_seconds
    if handover is not None:
        intercept, slope = handover
        if rate is None:
            rate = bytes_per_token / max(slope, _MIN_SLOPE_S)
        model = replace(
            model,
            bytes_per_token=bytes_per_token,
            transfer_bytes_per_s=rate,
            transfer_fixed_s=max(0.0, intercept - leg),
        )
    if local is not None:
        model = replace(
            model,
            decode_tokens_per_s=1.0 / local.per_token,
            decode_s_per_token2=local.per_token2,
            decode_fixed_s=local.fixed - leg,
        )
    if not all(math.isfinite(v) for v in model.to_wire().values()):
        raise ConfigError(f"the calibration fit is not finite: {model}")
    return model
