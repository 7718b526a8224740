"""Fitting measured collective and compute times (pure functions).

**Collectives.**

For one collective on a group of ``G`` devices the model is ``t(m) = steps(G)·α + factor(G)·m/β``
(:func:`fxpar.cost.comm.ring_steps_and_factor`), a line in the message size ``m``; for a group
spanning ``nodes`` nodes ``steps`` is the total ``intra + inter`` of
:func:`fxpar.cost.comm.latency_steps` (the step count :func:`fxpar.cost.comm.latency_time`
multiplies a calibrated ``"inter"`` α by, so a measured group is reproduced exactly). The fit of
``t = a + b·m`` minimizes the **relative** error ``Σ((a + b·m − t)/t)²``: measured sizes span
decades, and an absolute least-squares fit lets the largest message decide alone (the small
messages, where α matters, get errors of several ×). ``α = a/steps`` and ``β = factor/b``, with
``a`` and ``b`` kept non-negative (noise can tilt a line through two close points).

>>> alpha, beta, err = fit_alpha_beta("all_reduce", 4, [1e3, 1e6], [6e-5 + 1.5e-6, 6e-5 + 1.5e-3])
>>> round(alpha * 1e6, 3), round(beta / 1e9, 3), err < 1e-9
(10.0, 1.0, True)

**Compute.** A kernel's measured time ``t`` at work ``w`` (FLOPs of one GEMM call, or bytes
moved by one elementwise call) holds the per-call dispatch ``d`` too; the kernel's own rate is
``r(w) = w / max(t − d, t/4)`` (:func:`rate_points`: at most ``d`` is removed, and never more
than three quarters of ``t``, so noise cannot make a rate infinite or negative). Between the
measured ``w`` the rate is interpolated linearly in ``(log w, log r)``, and held at the end
values outside them (:func:`interp_loglog`). A measured rate curve is not forced to be
monotone: a CPU GEMM can slow down past the last cache level, and that is what it measured.

>>> pts = rate_points([2e3, 2e6], [3e-6, 1.002e-3], dispatch=2e-6)
>>> [(w, round(r / 1e9, 3)) for w, r in pts]
[(2000.0, 2.0), (2000000.0, 2.0)]
>>> round(interp_loglog(((1e3, 1e9), (1e5, 1e11)), 1e4) / 1e9, 6)   # halfway in log: 10 GFLOP/s
10.0
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

import numpy as np

from fxpar.cost.comm import latency_steps, ring_steps_and_factor

__all__ = ["fit_alpha_beta", "rate_points", "interp_loglog", "median_of_max", "interference_factor"]


def fit_alpha_beta(collective: str, group_size: int, sizes: Sequence[float],
                   times: Sequence[float], *, nodes: int = 1,
                   per_node: int | None = None) -> tuple[float, float, float]:
    """``(α, β, median relative error)`` of the model fitted to measured ``(size, time)`` on a
    group of ``group_size`` devices over ``nodes`` nodes (at most ``per_node`` on one): α is
    the latency per step of :func:`fxpar.cost.comm.latency_steps` (intra and inter steps
    alike: one measured latency for the whole collective).

    >>> a, b, _ = fit_alpha_beta("all_reduce", 16, [1e3, 1e6], [4.2e-5 + 1.875e-6, 4.2e-5 + 1.875e-3],
    ...                          nodes=2)        # 2·7 + 2·1 = 16 steps, factor 2·15/16
    >>> round(a * 1e6, 3), round(b / 1e9, 3)
    (2.625, 1.0)
    """
    _, factor = ring_steps_and_factor(collective, group_size)
    steps = sum(latency_steps(collective, group_size, nodes, per_node))
    m = np.asarray(sizes, dtype=np.float64)
    t = np.asarray(times, dtype=np.float64)
    if len(m) == 1:
        a, b = 0.0, float(t[0] / m[0])
    else:
        # Rows scaled by 1/t: least squares on (a + b·m)/t ≈ 1 is the relative-error fit.
        (a, b), *_ = np.linalg.lstsq(np.stack([1 / t, m / t], axis=1), np.ones_like(t), rcond=None)
        if b <= 0:  # no measurable bandwidth term: constant time, β effectively unbounded
            a, b = float(np.median(t)), 0.0
        elif a < 0:  # no measurable latency: the relative-error line through the origin
            a, b = 0.0, float(np.mean(t / m))
    alpha = a / steps if steps else 0.0
    beta = factor / b if b > 0 else float("inf")
    pred = a + b * m
    err = statistics.median(abs(p - x) / x for p, x in zip(pred, t)) if len(t) else 0.0
    return float(alpha), float(beta), float(err)


def rate_points(work: Sequence[float], times: Sequence[float],
                dispatch: float = 0.0) -> tuple[tuple[float, float], ...]:
    """``((w, r), ...)`` sorted by ``w``: ``r = w / max(t − dispatch, t/4)`` (module docstring).

    ``work`` and ``times`` pair up (one measured time per work size, seconds); a zero work or
    a non-positive time is refused with :class:`ValueError` (nothing was measured).

    >>> rate_points([8.0, 4.0], [2.0, 1.0])                     # sorted by work
    ((4.0, 4.0), (8.0, 4.0))
    >>> rate_points([100.0], [1.0], dispatch=5.0)               # never more than 3/4 removed
    ((100.0, 400.0),)
    """
    if len(work) != len(times):
        raise ValueError(f"rate_points: {len(work)} work sizes but {len(times)} times")
    out = []
    for w, t in zip(work, times):
        if not (w > 0 and t > 0 and math.isfinite(t)):
            raise ValueError(f"rate_points: work {w} measured in {t} s is not a measurement")
        out.append((float(w), float(w) / max(t - dispatch, t / 4)))
    return tuple(sorted(out))


def interp_loglog(points: Sequence[tuple[float, float]], x: float) -> float:
    """``y(x)`` from ``points`` (``(x, y)`` pairs sorted by ``x``, all positive): linear in
    ``(log x, log y)`` between points, the end value outside them.

    >>> pts = ((10.0, 1.0), (1000.0, 100.0))
    >>> interp_loglog(pts, 1.0), round(interp_loglog(pts, 100.0), 9), interp_loglog(pts, 1e9)
    (1.0, 10.0, 100.0)
    """
    if not points:
        raise ValueError("interp_loglog: no points")
    if x <= points[0][0]:
        return float(points[0][1])
    if x >= points[-1][0]:
        return float(points[-1][1])
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x0 <= x <= x1:
            if x1 == x0:
                return float(y1)
            f = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
            return float(math.exp(math.log(y0) + f * (math.log(y1) - math.log(y0))))
    raise ValueError(f"interp_loglog: points not sorted by x: {points}")


def median_of_max(runs: Sequence[Sequence[float]]) -> float:
    """The calibration statistic: per run the slowest rank's time, then the median over runs.

    ``runs[i][r]`` is rank ``r``'s time in run ``i``.

    >>> median_of_max([[1.0, 3.0], [2.0, 2.5], [9.0, 1.0]])    # maxima 3, 2.5, 9
    3.0
    """
    if not runs:
        raise ValueError("median_of_max: no runs")
    return float(statistics.median(max(r) for r in runs))


def interference_factor(compute: float, comm: float, both: float) -> float:
    """The ``comm_interference`` of :func:`fxpar.cost.step.unit_overlap`: how many seconds one
    second of communication hidden behind compute adds to the pair, from the compute alone
    (``compute`` seconds), the collective alone (``comm``, at most ``compute``: it would be
    hidden) and both issued together until both are done (``both``)::

        f = max(0, (both − compute) / comm)

    >>> interference_factor(compute=30.0, comm=10.0, both=45.0)   # 15 s more for 10 s hidden
    1.5
    >>> interference_factor(compute=30.0, comm=10.0, both=29.0)   # free overlap (noise)
    0.0
    """
    if not comm > 0 or comm > compute:
        raise ValueError(f"interference_factor: the collective ({comm} s) must be positive and "
                         f"no longer than the compute it hides behind ({compute} s)")
    return max(0.0, (both - compute) / comm)
