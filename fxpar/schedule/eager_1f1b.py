"""Eager-1F1B (cross-mesh resharding paper §4): 1F1B with forwards shifted earlier.

Rule, rank ``s`` of ``S`` (chunk ``s``): ``min(m, 2(S−s)−1)`` forwards run before the first
backward (1F1B runs ``min(m, S−s)``), i.e. a warm-up of ``min(m, 2(S−s)−1) − 1 = 2(S−s−1)``
forwards, then steady "forward next, backward oldest" pairs, then the remaining backwards.
The extra forwards in flight give each stage work to do while a boundary transfer is under
way, so communication overlaps computation; with free transfers the step time equals 1F1B's.
The cost: rank ``s`` holds up to ``min(m, 2(S−s)−1)`` microbatches' activations.

>>> from fxpar.schedule.eager_1f1b import eager_1f1b
>>> [str(a) for a in eager_1f1b(2, 4)[0]]       # 3 forwards before the first backward
['0F0', '0F1', '0F2', '0B0', '0F3', '0B1', '0B2', '0B3']
>>> [str(a) for a in eager_1f1b(2, 4)[1]]       # the last stage is plain 1F1B
['1F0', '1B0', '1F1', '1B1', '1F2', '1B2', '1F3', '1B3']
"""

from __future__ import annotations

from fxpar.schedule.actions import Action
from fxpar.schedule.one_f_one_b import one_f_one_b_order

__all__ = ["eager_1f1b"]


def eager_1f1b(p: int, m: int, v: int = 1) -> dict[int, list[Action]]:
    """Compute-only eager-1F1B order for ``p`` ranks and ``m`` microbatches (``v`` must be 1)."""
    return {s: one_f_one_b_order(s, m, 2 * (p - s) - 2) for s in range(p)}
