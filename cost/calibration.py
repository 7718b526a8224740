"""Fitting measured collective times to the ring model (pure functions).

For one collective on a group of ``G`` devices the model is ``t(m) = steps(G)·α + factor(G)·m/β``
(:func:`fxpar.cost.comm.ring_steps_and_factor`), a line in the message size ``m``. The fit of
``t = a + b·m`` minimizes the **relative** error ``Σ((a + b·m − t)/t)²``: measured sizes span
decades, and an absolute least-squares fit lets the largest message decide alone (the small
messages, where α matters, get errors of several ×). ``α = a/steps`` and ``β = factor/b``, with
``a`` and ``b`` kept non-negative (noise can tilt a line through two close points).

>>> alpha, beta, err = fit_alpha_beta("all_reduce", 4, [1e3, 1e6], [6e-5 + 1.5e-6, 6e-5 + 1.5e-3])
>>> round(alpha * 1e6, 3), round(beta / 1e9, 3), err < 1e-9
(10.0, 1.0, True)
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

import numpy as np

from fxpar.cost.comm import ring_steps_and_factor

__all__ = ["fit_alpha_beta"]


def fit_alpha_beta(collective: str, group_size: int, sizes: Sequence[float],
                   times: Sequence[float]) -> tuple[float, float, float]:
    """``(α, β, median relative error)`` of the ring model fitted to measured ``(size, time)``."""
    steps, factor = ring_steps_and_factor(collective, group_size)
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
