"""DualPipeV (DeepSeek-V3's DualPipe cut to a V, DeepSeek-AI 2024; torch.distributed.pipelining's
``ScheduleDualPipeV``): ZB-V's placement (rank ``r`` holds chunks ``c₀ = r`` and ``c₁ =
2p−1−r``, :func:`fxpar.schedule.actions.chunk_rank`'s ``"v"``) with a steady state of
forward/backward pairs of different microbatches (a forward of one chunk next to a whole
backward of the other, which DeepSeek overlaps with the other's communication); the
ramp-up and the tail split some backwards into ``I`` and ``W``. Needs ``m ≥ 2p``.

Rule, rank ``r`` of ``p`` (``B``: a whole backward, ``I``/``W``: a split one, a ``W`` taken from
the queue of ``I``'s without one, oldest first; each kind's microbatches in order per chunk,
``B`` and ``I`` sharing one count):

1. ``2(p−r−1)`` forwards of ``c₀``; ``r+1`` pairs ``F c₀, F c₁``;
2. ``p−r−1`` times ``I c₁``, a ``W``, ``F c₁``;
3. ``m − 2p + r + 1`` times ``F c₀, B c₁`` then ``F c₁, B c₀`` (torch's overlapped
   forward+backward actions, run forward first as torch runs them);
4. ``p−r−1`` times ``B c₁``, ``F c₁, B c₀``;
5. ``r+1`` pairs of backwards ``c₁, c₀``, split from the middle pair on (rank parity says
   which of the two first); ``p−r−1`` times a ``W`` then a backward of ``c₀`` (split as the
   last of 5.); then the ``W``'s left (``r+1`` of them).

>>> from fxpar.schedule.dualpipev import dualpipev
>>> [str(a) for a in dualpipev(2, 4)[1]]       # chunks 1 and 2
['1F0', '2F0', '1F1', '2F1', '1F2', '2B0', '2F2', '1B0', '1F3', '2B1', '2F3', '1B1', '2B2', '1B2', '2I3', '1I3', '2W3', '1W3']
"""

from __future__ import annotations

from collections import deque

from fxpar.errors import ScheduleError
from fxpar.schedule.actions import Action

__all__ = ["dualpipev"]


def dualpipev(p: int, m: int, v: int = 2) -> dict[int, list[Action]]:
    """Compute-only DualPipeV order for ``p`` ranks and ``m ≥ 2p`` microbatches (``v`` must be
    2; chunks placed in a V)."""
    if v != 2:
        raise ScheduleError(f"chunks={v}: dualpipev runs exactly two chunks per rank (a V)")
    if m < 2 * p:
        raise ScheduleError(f"microbatches={m}: dualpipev needs at least 2·stages = {2 * p} "
                            "(as torch's ScheduleDualPipeV)")
    out: dict[int, list[Action]] = {}
    for r in range(p):
        c0, c1 = r, 2 * p - 1 - r
        nxt: dict[tuple[int, str], int] = {}   # (chunk, "F" | "I"): next microbatch (B counts as I)
        pending_w: deque[tuple[int, int]] = deque()
        acts: list[Action] = []

        def add(c: int, kind: str) -> None:
            key = (c, "F" if kind == "F" else "I")
            i = nxt.get(key, 0)
            nxt[key] = i + 1
            acts.append(Action(c, kind, i))
            if kind == "I":
                pending_w.append((c, i))

        def weight() -> None:
            if pending_w:
                c, i = pending_w.popleft()
                acts.append(Action(c, "W", i))

        for _ in range(2 * (p - r - 1)):
            add(c0, "F")
        for _ in range(r + 1):
            add(c0, "F")
            add(c1, "F")
        for _ in range(p - r - 1):
            add(c1, "I")
            weight()
            add(c1, "F")
        for _ in range(m - 2 * p + r + 1):
            add(c0, "F")
            add(c1, "B")
            add(c1, "F")
            add(c0, "B")
        for _ in range(p - r - 1):
            add(c1, "B")
            add(c1, "F")
            add(c0, "B")
        split = False
        for j in range(r + 1):
            if j == (r + 1) // 2 and r % 2 == 1:
                split = True
            add(c1, "I" if split else "B")
            if j == (r + 1) // 2 and r % 2 == 0:
                split = True
            add(c0, "I" if split else "B")
        for _ in range(p - r - 1):
            weight()
            add(c0, "I" if split else "B")
        while pending_w:
            weight()
        out[r] = acts
    return out
