"""Test oracle for pipeline schedules: each schedule's per-device order written from the papers'
formulas, and a compute-only event loop over it, both independent of :mod:`fxpar.schedule` and
:mod:`fxpar.sim` (which tests/test_schedule.py and tests/test_sim.py check against them).

It used to live in ``fxpar.cost.pipeline``; nothing in fxpar uses it (the planner's step is
:mod:`fxpar.cost.step` over :mod:`fxpar.sim`), so it lives beside the tests. The closed forms
it starts from stay in ``fxpar.cost.pipeline`` (:func:`~fxpar.cost.pipeline.warmup_forwards`).

>>> r = simulate("1f1b", [1.0] * 4, [2.0] * 4, m=8)
>>> r.step_time, r.bubble_fraction            # (m + p − 1)·(t_f + t_b)
(33.0, 0.375)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from fxpar.cost.pipeline import _check, warmup_forwards

__all__ = ["schedule_actions", "PipelineResult", "simulate", "step_time"]


def schedule_actions(schedule: str, stage: int, stages: int, m: int, v: int = 1) -> list[tuple[str, int, int]]:
    """Ordered ``(kind, microbatch, chunk)`` actions of one device, ``kind`` ``"F"`` or ``"B"``.

    Interleaved follows Megatron-LM's schedule (requires ``m % p == 0``): virtual microbatch
    ``k`` runs chunk ``(k mod p·v) // p`` of microbatch ``(k // p·v)·p + k mod p``, backwards in
    reverse chunk order.

    >>> schedule_actions("1f1b", 2, 4, 4)
    [('F', 0, 0), ('F', 1, 0), ('B', 0, 0), ('F', 2, 0), ('B', 1, 0), ('F', 3, 0), ('B', 2, 0), ('B', 3, 0)]
    """
    _check(schedule, stages, m, v)
    if schedule == "gpipe":
        return [("F", i, 0) for i in range(m)] + [("B", i, 0) for i in range(m)]
    if schedule in ("1f1b", "eager_1f1b"):
        w = warmup_forwards(schedule, stage, stages, m) - 1  # the last one pairs with B(0)
        acts = [("F", i, 0) for i in range(w)]
        for i in range(m - w):
            acts += [("F", w + i, 0), ("B", i, 0)]
        acts += [("B", i, 0) for i in range(m - w, m)]
        return acts
    p = stages
    if m % p:
        raise ValueError(f"interleaved 1F1B needs m divisible by p (m={m}, p={p})")
    total = m * v

    def chunk_mb(k: int, forward: bool) -> tuple[int, int]:
        c = (k % (p * v)) // p
        if not forward:
            c = v - 1 - c
        return (k // (p * v)) * p + k % p, c

    w = min(total, 2 * (p - stage - 1) + (v - 1) * p)
    acts = [("F",) + chunk_mb(k, True) for k in range(w)]
    for i in range(total - w):
        acts.append(("F",) + chunk_mb(w + i, True))
        acts.append(("B",) + chunk_mb(i, False))
    acts += [("B",) + chunk_mb(k, False) for k in range(total - w, total)]
    return acts


@dataclass(frozen=True)
class PipelineResult:
    """Outcome of :func:`simulate`: ``step_time`` (seconds from the first forward to the last
    backward), ``bubble_fraction = step_time / ideal − 1`` with ``ideal = m·max_s(f_s+b_s)``
    (Megatron's ``t_pb / t_id`` generalized to unequal stages), per-device ``busy`` and
    ``idle`` time, and each device's ``(kind, microbatch, chunk, start, end)`` timeline."""

    step_time: float
    bubble_fraction: float
    busy: tuple[float, ...]
    idle: tuple[float, ...]
    timeline: tuple[tuple[tuple[str, int, int, float, float], ...], ...]


def simulate(schedule: str, fwd_times: Sequence[float], bwd_times: Sequence[float], m: int, *,
             v: int = 1, p2p_time: float = 0.0, per_chunk: bool = False) -> PipelineResult:
    """Exact step time of ``schedule`` with per-stage forward/backward times per microbatch.

    ``fwd_times``/``bwd_times`` have one entry per device (each chunk of an interleaved device
    takes ``1/v`` of it) or, with ``per_chunk=True``, one per virtual stage (``p·v`` entries;
    virtual stage ``c·p + d`` is chunk ``c`` of device ``d``, as in Megatron-LM). ``p2p_time`` delays
    every activation/gradient that crosses devices (it overlaps compute; the schedule decides
    whether anything is there to overlap with, which is the point of eager-1F1B).

    >>> simulate("gpipe", [1, 1], [2, 2], m=2).step_time        # (m + p − 1)·(f + b)
    9.0
    >>> simulate("interleaved", [1.0] * 4, [2.0] * 4, m=8, v=2).bubble_fraction
    0.1875
    """
    if len(bwd_times) != len(fwd_times):
        raise ValueError("fwd_times and bwd_times need the same length")
    if per_chunk:
        if len(fwd_times) % v:
            raise ValueError(f"per_chunk times need p·v entries, got {len(fwd_times)} for v={v}")
        p = len(fwd_times) // v
        f_v = [float(t) for t in fwd_times]
        b_v = [float(t) for t in bwd_times]
    else:
        p = len(fwd_times)
        f_v = [float(fwd_times[d]) / v for _ in range(v) for d in range(p)]
        b_v = [float(bwd_times[d]) / v for _ in range(v) for d in range(p)]
    _check(schedule, p, m, v)
    nv = p * v
    done: dict[tuple[str, int, int], float] = {}  # (kind, virtual stage, microbatch) -> end time
    orders = [schedule_actions(schedule, d, p, m, v) for d in range(p)]
    pos = [0] * p
    free = [0.0] * p
    timeline: list[list] = [[] for _ in range(p)]
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for d in range(p):
            while pos[d] < len(orders[d]):
                kind, mb, c = orders[d][pos[d]]
                vs = c * p + d
                if kind == "F":
                    deps = [("F", vs - 1, mb)] if vs > 0 else []
                    dur = f_v[vs]
                else:
                    deps = [("F", vs, mb)] + ([("B", vs + 1, mb)] if vs < nv - 1 else [])
                    dur = b_v[vs]
                if any(dep not in done for dep in deps):
                    break
                ready = 0.0
                for dep in deps:
                    t = done[dep]
                    if dep[1] % p != d:  # crosses devices
                        t += p2p_time
                    ready = max(ready, t)
                start = max(free[d], ready)
                end = start + dur
                done[(kind, vs, mb)] = end
                free[d] = end
                timeline[d].append((kind, mb, c, start, end))
                pos[d] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"schedule {schedule} deadlocked (p={p}, m={m}, v={v})")
    step = max(free)
    busy = tuple(sum(e - s for _, _, _, s, e in tl) for tl in timeline)
    ideal = m * max(sum(f_v[c * p + d] + b_v[c * p + d] for c in range(v)) for d in range(p))
    return PipelineResult(step, step / ideal - 1.0 if ideal > 0 else 0.0, busy,
                          tuple(step - b for b in busy), tuple(tuple(tl) for tl in timeline))


def step_time(schedule: str, fwd_times: Sequence[float], bwd_times: Sequence[float], m: int, *,
              v: int = 1, p2p_time: float = 0.0) -> float:
    """Step time of :func:`simulate`.

    >>> step_time("1f1b", [1, 1, 1, 1], [2, 2, 2, 2], m=4)
    21.0
    """
    return simulate(schedule, fwd_times, bwd_times, m, v=v, p2p_time=p2p_time).step_time
