"""Looped breadth-first pipeline (Lamy-Poirier 2022, "Breadth-First Pipeline Parallelism";
torch.distributed.pipelining's ``ScheduleLoopedBFS``): ``v`` chunks per rank, chunk ``k`` on
rank ``k % p`` as interleaved 1F1B, but breadth first.

Rule, rank ``r`` of ``p``: the forwards of every microbatch through its first local chunk
(global chunk ``r``), then through its second (``p + r``), ... ; then the backwards, the last
local chunk first and, within a chunk, the last microbatch first (torch's order: the newest
activations are consumed first). GPipe over ``v`` looped chunks: every microbatch's
activations of every local chunk are alive at the backward's start (``m·v`` chunk
activations, GPipe's ``m`` microbatches), and the bubble is GPipe's ``(p−1)/m`` divided by
``v`` when ``m ≥ p`` (a rank's next chunk has work queued while the pipeline fills), for ``v``
times the point-to-point traffic. ``v = 1`` is GPipe with the backwards in reverse order.

>>> from fxpar.schedule.looped_bfs import looped_bfs
>>> [str(a) for a in looped_bfs(2, 2, 2)[0]]      # chunks 0 and 2
['0F0', '0F1', '2F0', '2F1', '2B1', '2B0', '0B1', '0B0']
>>> [str(a) for a in looped_bfs(2, 2, 2)[1]]      # chunks 1 and 3
['1F0', '1F1', '3F0', '3F1', '3B1', '3B0', '1B1', '1B0']
"""

from __future__ import annotations

from fxpar.schedule.actions import Action

__all__ = ["looped_bfs"]


def looped_bfs(p: int, m: int, v: int = 1) -> dict[int, list[Action]]:
    """Compute-only looped breadth-first order for ``p`` ranks, ``m`` microbatches, ``v``
    chunks per rank."""
    out: dict[int, list[Action]] = {}
    for r in range(p):
        mine = range(r, p * v, p)
        out[r] = ([Action(k, "F", i) for k in mine for i in range(m)]
                  + [Action(k, "B", i) for k in reversed(mine) for i in reversed(range(m))])
    return out
