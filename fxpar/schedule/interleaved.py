"""Interleaved 1F1B (Megatron-LM §2.2.2): ``v`` chunks per rank, chunk ``k`` on rank ``k % p``.

Rule, rank ``r`` of ``p`` (requires ``m`` a multiple of ``p``, as Megatron-LM): the rank runs
``m·v`` forwards and ``m·v`` backwards, each indexed by a *virtual microbatch* ``n``. Forward
``n`` is local chunk ``c = (n mod p·v) // p`` (global chunk ``c·p + r``) of microbatch
``(n // p·v)·p + n mod p``: chunks are visited in groups of ``p`` microbatches, chunk 0 first.
Backward ``n`` uses the same microbatch and local chunk ``v−1−c`` (the last chunk first). A
warm-up of ``w = min(m·v, 2(p−r−1) + (v−1)·p)`` forwards, then steady "forward ``w+n``,
backward ``n``" pairs, then the remaining backwards. Bubble with equal chunks:
``(p−1)/(v·m)``, ``v`` times smaller than 1F1B's, for ``v`` times the point-to-point traffic.

>>> from fxpar.schedule.interleaved import interleaved
>>> [str(a) for a in interleaved(2, 2, 2)[0]]   # chunks 0 and 2, w = 4
['0F0', '0F1', '2F0', '2F1', '2B0', '2B1', '0B0', '0B1']
>>> [str(a) for a in interleaved(2, 2, 2)[1]]   # chunks 1 and 3, w = 2
['1F0', '1F1', '3F0', '3B0', '3F1', '3B1', '1B0', '1B1']
"""

from __future__ import annotations

from fxpar.errors import ScheduleError
from fxpar.schedule.actions import Action
from fxpar.schedule.actions import ActionKind as K

__all__ = ["interleaved", "warmup"]


def warmup(r: int, p: int, m: int, v: int) -> int:
    """Megatron-LM's ``num_warmup_microbatches`` of rank ``r``: ``min(m·v, 2(p−r−1) + (v−1)·p)``.

    >>> [warmup(r, 4, 8, 2) for r in range(4)]
    [10, 8, 6, 4]
    """
    return min(m * v, 2 * (p - r - 1) + (v - 1) * p)


def interleaved(p: int, m: int, v: int = 2) -> dict[int, list[Action]]:
    """Compute-only interleaved-1F1B order for ``p`` ranks, ``m`` microbatches, ``v`` chunks."""
    if m % p:
        raise ScheduleError(f"microbatches={m}: interleaved 1F1B needs a multiple of stages={p} "
                            "(Megatron-LM's rule)")
    total, group = m * v, p * v

    def act(r: int, n: int, kind: K) -> Action:
        c = (n % group) // p
        if kind is K.B:  # backwards run the chunks in reverse
            c = v - 1 - c
        return Action(c * p + r, kind, (n // group) * p + n % p)

    out: dict[int, list[Action]] = {}
    for r in range(p):
        w = warmup(r, p, m, v)
        acts = [act(r, n, K.F) for n in range(w)]
        for n in range(total - w):
            acts += [act(r, w + n, K.F), act(r, n, K.B)]
        acts += [act(r, n, K.B) for n in range(total - w, total)]
        out[r] = acts
    return out
