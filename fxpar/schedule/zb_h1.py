"""ZB-H1 (zero-bubble pipeline parallelism, Qi et al. 2024; torch.distributed.pipelining's
``ScheduleInterleavedZeroBubble`` with one chunk per rank).

The backward is split into ``I`` (gradient of the input: what the previous stage waits for,
followed by the ``SEND_B``) and ``W`` (gradient of the weights: nobody waits for it). Rule,
rank ``r`` of ``p`` (chunk ``r``): a warm-up of ``w = min(m, p−r−1)`` forwards as 1F1B; then for
each remaining forward the pair ``F(next), I(oldest)``, followed by ``W`` of the oldest pending
weight gradient once ``r`` input-gradients have run (rank ``r`` defers its ``W``'s by ``r``
slots); the cool-down runs the remaining ``I``'s, each followed by a ``W`` on the same rule,
then the remaining ``W``'s. The deferred ``W``'s fill the cool-down bubble: with equal stages
the step shrinks from 1F1B's ``(m+p−1)(t_f+t_b)`` towards ``m(t_f+t_b) + (p−1)(t_f+t_b−t_w)``.
Memory: a microbatch's activations live until its ``W``; every rank holds at most ``min(m, p)``
microbatches, the peak of 1F1B's rank 0 (the maximum over ranks is unchanged).

>>> from fxpar.schedule.zb_h1 import zb_h1
>>> [str(a) for a in zb_h1(2, 3)[0]]
['0F0', '0F1', '0I0', '0W0', '0F2', '0I1', '0W1', '0I2', '0W2']
>>> [str(a) for a in zb_h1(2, 3)[1]]
['1F0', '1I0', '1F1', '1I1', '1W0', '1F2', '1I2', '1W1', '1W2']
"""

from __future__ import annotations

from fxpar.schedule.actions import Action

__all__ = ["zb_h1"]


def zb_h1(p: int, m: int, v: int = 1) -> dict[int, list[Action]]:
    """Compute-only ZB-H1 order for ``p`` ranks and ``m`` microbatches (``v`` must be 1)."""
    out: dict[int, list[Action]] = {}
    for r in range(p):
        w = min(m, p - r - 1)
        acts = [Action(r, "F", i) for i in range(w)]
        n_w = 0
        for j in range(m):               # j-th input gradient
            if j < m - w:
                acts.append(Action(r, "F", w + j))
            acts.append(Action(r, "I", j))
            if j >= r:
                acts.append(Action(r, "W", n_w))
                n_w += 1
        acts += [Action(r, "W", i) for i in range(n_w, m)]
        out[r] = acts
    return out
