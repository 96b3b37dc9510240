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
  cost of a local prefill.

>>> fit_quadratic([(1, 3.0), (2, 5.0), (3, 7.0)])
Quadratic(fixed=1.0, per_token=2.0, per_token2=0.0)
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace

from agentkv import ConfigError, RouteCostModel

__all__ = ["Measurements", "Quadratic", "fit_line", "fit_model", "fit_quadratic"]

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
    """Least-squares ``(intercept, slope)`` of ``(x, y)`` points; one length (or one point) is
    read as a line through the origin, the fixed part then unknown and taken as 0."""
    xs = [float(x) for x, _ in points]
    ys = [float(y) for _, y in points]
    if not points:
        raise ConfigError("no samples to fit")
    if len(set(xs)) < 2:
        slope = statistics.fmean(y / x for x, y in zip(xs, ys, strict=True) if x) if any(xs) else 0
        return 0.0, max(slope, _MIN_SLOPE_S)
    slope, intercept = statistics.linear_regression(xs, ys)
    return intercept, slope


def _solve3(m: list[list[float]], v: list[float]) -> list[float] | None:
    """``m x = v`` for 3x3 ``m`` by Gaussian elimination with partial pivoting."""
    a = [[*row, rhs] for row, rhs in zip(m, v, strict=True)]
    for col in range(3):
        pivot = max(range(col, 3), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) < 1e-300:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(col + 1, 3):
            f = a[r][col] / a[col][col]
            a[r] = [x - f * y for x, y in zip(a[r], a[col], strict=True)]
    x = [0.0, 0.0, 0.0]
    for r in (2, 1, 0):
        x[r] = (a[r][3] - sum(a[r][c] * x[c] for c in range(r + 1, 3))) / a[r][r]
    return x


def fit_quadratic(points: Sequence[tuple[float, float]]) -> Quadratic:
    """Least-squares ``a + b n + c n**2`` with ``c >= 0`` and ``a >= 0`` (attention only adds,
    a request never costs less than nothing): a line where three lengths are not at hand or the
    curve would bend down."""
    lengths = {float(n) for n, _ in points}
    if len(lengths) >= 3:
        # Scaled to thousands of tokens: the normal equations' n**4 terms stay well conditioned.
        k = 1000.0
        rows = [(1.0, n / k, (n / k) ** 2, float(y)) for n, y in points]
        m = [[sum(r[i] * r[j] for r in rows) for j in range(3)] for i in range(3)]
        v = [sum(r[i] * r[3] for r in rows) for i in range(3)]
        solved = _solve3(m, v)
        if solved is not None and solved[2] >= 0 and solved[0] >= 0 and solved[1] > 0:
            return Quadratic(fixed=solved[0], per_token=solved[1] / k, per_token2=solved[2] / k**2)
    intercept, slope = fit_line(points)
    if intercept < 0:  # through the origin instead: the fixed part is too small to see
        slope = sum(n * y for n, y in points) / sum(n * n for n, _ in points)
        intercept = 0.0
    return Quadratic(fixed=intercept, per_token=max(slope, _MIN_SLOPE_S), per_token2=0.0)


@dataclass(frozen=True, kw_only=True, slots=True)
class Measurements:
    """What ``agentkv calibrate`` measured, each as ``(tokens, seconds)``.

    Attributes:
        prefill: cold P legs (``TurnStats.prefill_s`` of a ``recompute`` turn on fresh tokens).
        handover: their D legs (``TurnStats.decode_s``: decode pulls all of it, answers one).
        decode_local: cold ``decode``-route turns (``TurnStats.decode_s``: D leg only).
        transfer_bytes: bytes vLLM's NIXL metrics counted over the handovers (0: none exposed).
        transfer_seconds: their transfer time by the same metrics.
        transfer_tokens: tokens moved over those transfers (to turn bytes into bytes a token).
    """

    prefill: tuple[tuple[int, float], ...]
    handover: tuple[tuple[int, float], ...] = ()
    decode_local: tuple[tuple[int, float], ...] = ()
    transfer_bytes: float = 0.0
    transfer_seconds: float = 0.0
    transfer_tokens: int = 0


def fit_model(
    measured: Measurements, *, base: RouteCostModel | None = None, block_size: int | None = None
) -> RouteCostModel:
    """The cost model the measurements imply; what they do not measure stays ``base``'s."""
    model = base or RouteCostModel()
    prefill = fit_quadratic(measured.prefill)
    leg = prefill.fixed
    model = replace(
        model,
        leg_s=leg,
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
    if measured.handover:
        intercept, slope = fit_line(measured.handover)
        if rate is None:
            rate = bytes_per_token / max(slope, _MIN_SLOPE_S)
        model = replace(
            model,
            bytes_per_token=bytes_per_token,
            transfer_bytes_per_s=rate,
            transfer_fixed_s=max(0.0, intercept - leg),
        )
    if measured.decode_local:
        local = fit_quadratic(measured.decode_local)
        model = replace(
            model,
            decode_tokens_per_s=1.0 / local.per_token,
            decode_s_per_token2=local.per_token2,
            decode_fixed_s=max(0.0, local.fixed - leg),
        )
    if not all(math.isfinite(v) for v in model.to_wire().values()):
        raise ConfigError(f"the calibration fit is not finite: {model}")
    return model
