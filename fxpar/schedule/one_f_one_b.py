"""1F1B (PipeDream-Flush), Megatron-LM's non-interleaved schedule (§2.2.1).

Rule, rank ``r`` of ``p`` (chunk ``r``): a warm-up of ``w = min(m, p−r−1)`` forwards, then a
steady phase of ``m−w`` pairs "forward of the next microbatch, backward of the oldest", then a
cool-down of the ``w`` backwards left. So ``min(m, p−r)`` forwards run before the first
backward and rank ``r`` holds at most that many microbatches' activations (rank 0: ``p``).
Bubble with equal stages: ``(p−1)/m``, as GPipe.

>>> from fxpar.schedule.one_f_one_b import one_f_one_b
>>> [str(a) for a in one_f_one_b(3, 4)[0]]      # w = 2
['0F0', '0F1', '0F2', '0B0', '0F3', '0B1', '0B2', '0B3']
>>> [str(a) for a in one_f_one_b(3, 4)[2]]      # w = 0
['2F0', '2B0', '2F1', '2B1', '2F2', '2B2', '2F3', '2B3']
"""

from __future__ import annotations

from fxpar.schedule.actions import Action

__all__ = ["one_f_one_b", "one_f_one_b_order"]


def one_f_one_b_order(chunk: int, m: int, warmup: int, backward: str = "B") -> list[Action]:
    """``warmup`` forwards, then ``(F next, B oldest)`` pairs, then the remaining backwards."""
    w = min(m, warmup)
    acts = [Action(chunk, "F", i) for i in range(w)]
    for i in range(m - w):
        acts += [Action(chunk, "F", w + i), Action(chunk, backward, i)]
    acts += [Action(chunk, backward, i) for i in range(m - w, m)]
    return acts


def one_f_one_b(p: int, m: int, v: int = 1) -> dict[int, list[Action]]:
    """Compute-only 1F1B order for ``p`` ranks and ``m`` microbatches (``v`` must be 1)."""
    return {r: one_f_one_b_order(r, m, p - r - 1) for r in range(p)}
