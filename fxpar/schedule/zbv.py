"""ZB-V (Qi et al. 2024, "Zero Bubble Pipeline Parallelism" §6; torch.distributed.pipelining's
``ScheduleZBVZeroBubble``): two chunks per rank placed in a V, rank ``r`` holding chunk ``r``
(going down) and chunk ``2p−1−r`` (coming back), so the first and the last chunk share rank 0
and the pipeline turns around on rank ``p−1`` without a transfer; the backward is split into
``I`` and ``W`` as in ZB-H1.

Rule, rank ``r`` of ``p`` (``c₀ = r``, ``c₁ = 2p−1−r``), over ``n = max(m, 2p−1)`` microbatch
slots (the slots of microbatches ``≥ m`` are dropped at the end, as torch drops them):
``2(p−r)−1`` forwards of ``c₀``; ``r`` pairs ``F c₁, F c₀``; ``p−r`` triples ``F c₁, I c₁, W
c₁``; then, while forwards are left, ``F c₀`` (while ``c₀`` has some), ``I c₀, W c₀, F c₁,
I c₁, W c₁``; a cool-down of ``r`` pairs ``I c₀, I c₁`` and ``p−r`` pairs ``I c₀, W c₀``
(the ``W``'s taken in order), then the ``W``'s left of ``c₁``, then of ``c₀``. With ``t_F =
t_I = t_W`` every rank is busy from its first action to the step's end but for the ramp;
rank ``r`` holds at most ``min(2p, m+1+r, 2m)`` chunk activations (``p`` microbatches of a
stage's two halves on the last rank, fewer on the first: 1F1B's rank 0 holds ``p``).

>>> from fxpar.schedule.zbv import zbv
>>> [str(a) for a in zbv(2, 2)[0]]         # chunks 0 and 3
['0F0', '0F1', '3F0', '3I0', '3W0', '3F1', '3I1', '3W1', '0I0', '0W0', '0I1', '0W1']
>>> [str(a) for a in zbv(2, 2)[1]]         # chunks 1 and 2
['1F0', '2F0', '1F1', '2F1', '2I0', '2W0', '1I0', '1W0', '2I1', '2W1', '1I1', '1W1']
"""

from __future__ import annotations

from fxpar.errors import ScheduleError
from fxpar.schedule.actions import Action

__all__ = ["zbv"]


def zbv(p: int, m: int, v: int = 2) -> dict[int, list[Action]]:
    """Compute-only ZB-V order for ``p`` ranks and ``m`` microbatches (``v`` must be 2; chunks
    placed by :func:`fxpar.schedule.actions.chunk_rank`'s ``"v"``)."""
    if v != 2:
        raise ScheduleError(f"chunks={v}: zbv runs exactly two chunks per rank (a V)")
    n = max(m, 2 * p - 1)
    out: dict[int, list[Action]] = {}
    for r in range(p):
        c0, c1 = r, 2 * p - 1 - r
        nxt = {(c, kind): 0 for c in (c0, c1) for kind in "FIW"}
        acts: list[Action] = []

        def run(*steps: tuple[int, str]) -> None:   # (chunk, kind): its next microbatch
            for c, kind in steps:
                acts.append(Action(c, kind, nxt[c, kind]))
                nxt[c, kind] += 1

        run(*[(c0, "F")] * (2 * (p - r) - 1))
        run(*[(c1, "F"), (c0, "F")] * r)
        run(*[(c1, "F"), (c1, "I"), (c1, "W")] * (p - r))
        while nxt[c1, "F"] < nxt[c0, "F"] or nxt[c0, "F"] < n:
            if nxt[c0, "F"] < n:
                run((c0, "F"))
            run((c0, "I"), (c0, "W"), (c1, "F"), (c1, "I"), (c1, "W"))
        run(*[(c0, "I"), (c1, "I")] * r)
        run(*[(c0, "I"), (c0, "W")] * (p - r))
        for c in (c1, c0):   # the weight gradients left, in order
            run(*[(c, "W")] * (nxt[c, "I"] - nxt[c, "W"]))
        out[r] = [a for a in acts if a.microbatch < m]
    return out
