"""GPipe: every rank runs all forwards, then all backwards (Huang et al.; Megatron-LM §2.2.1).

Rule, rank ``r`` of ``p`` (one chunk per rank, chunk ``r``): ``F(r,0) … F(r,m−1)`` then
``B(r,0) … B(r,m−1)``. Bubble with equal stages: ``(p−1)/m``; every rank holds the
activations of all ``m`` microbatches at its peak.

>>> from fxpar.schedule.gpipe import gpipe
>>> [str(a) for a in gpipe(2, 3)[1]]
['1F0', '1F1', '1F2', '1B0', '1B1', '1B2']
"""

from __future__ import annotations

from fxpar.schedule.actions import Action

__all__ = ["gpipe"]


def gpipe(p: int, m: int, v: int = 1) -> dict[int, list[Action]]:
    """Compute-only GPipe order for ``p`` ranks and ``m`` microbatches (``v`` must be 1)."""
    return {r: [Action(r, "F", i) for i in range(m)] + [Action(r, "B", i) for i in range(m)]
            for r in range(p)}
