"""Interleaved zero-bubble pipeline (ZB1P of Qi et al. 2024 with ``v`` chunks per rank;
torch.distributed.pipelining's ``ScheduleInterleavedZeroBubble``): interleaved 1F1B's chunk
placement (chunk ``k`` on rank ``k % p``) with the backward split into ``I`` (input gradient,
what the previous chunk waits for) and ``W`` (weight gradient, which nobody waits for), the
``W``'s deferred into the bubbles.

Rule, rank ``r`` of ``p`` (``m`` a multiple of ``p``, as interleaved 1F1B): ``n = m·v`` virtual
microbatches visited in rounds of ``p`` microbatches per local chunk. Forward ``j`` runs local
chunk ``(j // p) mod v``; input-gradient ``j`` (counted from the end of the warm-up) runs local
chunk ``v − 1 − (j // p) mod v``; within a chunk the microbatches go in order. A warm-up of
``w = min(n, (v−1)·p + (p−1−r))`` forwards (interleaved 1F1B's count with one slot per hop
instead of two: an ``I`` is shorter than a ``B``), then "forward, input-gradient" pairs, then
the remaining input-gradients; after the ``j``-th input-gradient, once ``j ≥ r``, the weight
gradient of the oldest ``I`` still without one (rank ``r`` defers ``r`` of them), and the
remaining ``W``'s at the end. With ``v = 1`` this is ZB-H1 (:mod:`fxpar.schedule.zb_h1`).

>>> from fxpar.schedule.interleaved_zb import interleaved_zb
>>> [str(a) for a in interleaved_zb(2, 2, 2)[0]]     # chunks 0 and 2, w = 3
['0F0', '0F1', '2F0', '2F1', '2I0', '2W0', '2I1', '2W1', '0I0', '0W0', '0I1', '0W1']
>>> [str(a) for a in interleaved_zb(2, 2, 2)[1]]     # chunks 1 and 3, w = 2
['1F0', '1F1', '3F0', '3I0', '3F1', '3I1', '3W0', '1I0', '3W1', '1I1', '1W0', '1W1']
"""

from __future__ import annotations

from fxpar.errors import ScheduleError
from fxpar.schedule.actions import Action

__all__ = ["interleaved_zb", "zb_warmup"]


def zb_warmup(r: int, p: int, m: int, v: int) -> int:
    """Forwards rank ``r`` runs before its first input-gradient: ``min(m·v, (v−1)·p + p−1−r)``.

    >>> [zb_warmup(r, 4, 8, 2) for r in range(4)]
    [7, 6, 5, 4]
    """
    return min(m * v, (v - 1) * p + (p - 1 - r))


def interleaved_zb(p: int, m: int, v: int = 2) -> dict[int, list[Action]]:
    """Compute-only interleaved zero-bubble order for ``p`` ranks, ``m`` microbatches, ``v``
    chunks per rank."""
    if m % p:
        raise ScheduleError(f"microbatches={m}: interleaved zero-bubble needs a multiple of "
                            f"stages={p} (as interleaved 1F1B)")
    n = m * v
    out: dict[int, list[Action]] = {}
    for r in range(p):
        w = zb_warmup(r, p, m, v)
        nxt = {"F": [0] * v, "I": [0] * v, "W": [0] * v}   # next microbatch per kind, local chunk
        done_i: list[int] = []                            # local chunks of the I's run, in order
        acts: list[Action] = []

        def run(kind: str, c: int) -> None:
            acts.append(Action(c * p + r, kind, nxt[kind][c]))
            nxt[kind][c] += 1

        def input_grad(j: int) -> None:
            c = v - 1 - (j // p) % v
            run("I", c)
            done_i.append(c)
            if j >= r:   # rank r defers r weight gradients into its cool-down
                run("W", done_i[sum(nxt["W"])])

        for j in range(n):
            run("F", (j // p) % v)
            if j >= w:
                input_grad(j - w)
        for j in range(n - w, n):
            input_grad(j)
        while sum(nxt["W"]) < n:
            run("W", done_i[sum(nxt["W"])])
        out[r] = acts
    return out
