r"""Overlap of asynchronous communication with compute: how much of a step's communication is
exposed (the compute stream waits for it) and how much is hidden behind compute.

The model is the runtime's (DESIGN §7; AxoNN §IV-C, AMSP §V-C): one compute stream runs the
ops in order; one communication channel runs the collectives one at a time, in the order they
are issued. A collective is *issued* when the compute stream reaches op ``issue`` (before that
op starts) and must have *finished* before op ``need`` starts (``need = len(ops)``: by the end
of the step, e.g. a gradient reduction waited before the optimizer). With ``s_j`` the start of
op ``j`` and ``c_j`` its seconds::

    s_0 = 0,  s_j = max(s_{j-1} + c_{j-1}, max{f_k : need_k = j})
    b_k = max(s_{issue_k}, f_{k-1}),  f_k = b_k + t_k      (channel in issue order)
    step = max(s_n, max_k f_k),  exposed = step - Σ_j c_j,  hidden = Σ_k t_k - exposed

A collective issued and needed at the same op (``issue == need``) is synchronous and fully
exposed unless the channel was already busy: it then waits for that, too.

>>> r = overlap([1.0, 1.0], [Comm(0.5, issue=0, need=1)])   # gathered while op 0 runs
>>> r.step, r.exposed, r.hidden
(2.0, 0.0, 0.5)
>>> overlap([1.0, 1.0], [Comm(0.5, issue=1, need=1)]).exposed  # no window: waited in full
0.5
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Comm", "Overlap", "overlap"]


@dataclass(frozen=True)
class Comm:
    """One collective: ``time`` seconds, issued before op ``issue``, needed before op ``need``."""

    time: float
    issue: int
    need: int


@dataclass(frozen=True)
class Overlap:
    """``step`` seconds; of the communication, ``exposed`` seconds the compute waited for and
    ``hidden`` seconds that ran under compute."""

    step: float
    compute: float
    exposed: float
    hidden: float


def overlap(compute: Sequence[float], comms: Sequence[Comm]) -> Overlap:
    """The step of ``compute`` (seconds per op, in order) with ``comms`` (module docstring)."""
    n = len(compute)
    for c in comms:
        if not 0 <= c.issue <= c.need <= n or c.time < 0:
            raise ValueError(f"collective {c}: needs 0 <= issue <= need <= {n} and time >= 0")
    order = sorted(range(len(comms)), key=lambda k: (comms[k].issue, comms[k].need, k))
    by_issue: dict[int, list[int]] = {}
    for k in order:
        by_issue.setdefault(comms[k].issue, []).append(k)
    finish = [0.0] * len(comms)
    waits: dict[int, float] = {}
    free = t = 0.0  # channel free at, compute clock
    for j in range(n + 1):
        for k in by_issue.get(j, ()):  # issued when op j is reached: after waits issued earlier
            free = max(free, t) + comms[k].time
            finish[k] = free
            waits[comms[k].need] = max(waits.get(comms[k].need, 0.0), free)
        t = max(t, waits.get(j, 0.0))
        if j < n:
            t += compute[j]
    step = max([t] + finish)
    total = float(sum(compute))
    exposed = step - total
    return Overlap(step, total, exposed, float(sum(c.time for c in comms)) - exposed)
