"""Pipeline schedules: bubble fractions, warm-up counts, in-flight microbatches and step time
from per-stage forward/backward times (pure functions).

Closed forms (Megatron-LM PTD-P §2.2, ``p`` stages, ``m`` microbatches, ``v`` chunks per
device): the bubble fraction ``t_pb / t_id`` is ``(p−1)/m`` for GPipe and 1F1B and
``(1/v)·(p−1)/m`` for interleaved 1F1B. Eager-1F1B (cross-mesh resharding paper §4) has the
1F1B bubble without communication.

Warm-up (forwards a stage runs before its first backward; stages ``s = 0 .. p−1``):

==============  ==========================================  ====================================
schedule        forwards before the first backward          activations in flight (microbatches)
==============  ==========================================  ====================================
gpipe           ``m``                                       ``m``
1f1b            ``min(m, p−s)``                             ``min(m, p−s)``
eager_1f1b      ``min(m, 2(p−s)−1)``                        ``min(m, 2(p−s)−1)``
interleaved     ``min(m·v, 2(p−s−1) + (v−1)·p + 1)`` chunks  that many chunk activations ``/ v``
==============  ==========================================  ====================================

:func:`simulate` runs a schedule's per-device action order with arbitrary per-stage times and
a point-to-point delay between stages, and gives the exact step time; with equal stages and no
delay it reproduces the closed forms.

>>> from fxpar.cost.pipeline import bubble_fraction, simulate
>>> bubble_fraction("1f1b", p=4, m=8), bubble_fraction("interleaved", p=4, m=8, v=2)
(0.375, 0.1875)
>>> r = simulate("1f1b", [1.0] * 4, [2.0] * 4, m=8)
>>> r.step_time, r.bubble_fraction            # (m + p − 1)·(t_f + t_b)
(33.0, 0.375)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "SCHEDULES",
    "bubble_fraction",
    "warmup_forwards",
    "in_flight_microbatches",
    "schedule_actions",
    "PipelineResult",
    "simulate",
    "step_time",
]

SCHEDULES = ("gpipe", "1f1b", "interleaved", "eager_1f1b")


def _check(schedule: str, p: int, m: int, v: int = 1) -> None:
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; known: {SCHEDULES}")
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"stages, microbatches and chunks must be >= 1 (p={p}, m={m}, v={v})")
    if schedule != "interleaved" and v != 1:
        raise ValueError(f"{schedule} has one chunk per device (v={v}); use 'interleaved'")


def bubble_fraction(schedule: str, p: int, m: int, v: int = 1) -> float:
    """Idle fraction ``t_pb / t_id`` with equal stages (Megatron-LM §2.2.1 and §2.2.2):
    ``(p−1)/m``, or ``(1/v)·(p−1)/m`` interleaved.

    >>> bubble_fraction("gpipe", 8, 32)
    0.21875
    """
    _check(schedule, p, m, v)
    if schedule == "interleaved":
        return (p - 1) / (v * m)
    return (p - 1) / m


def warmup_forwards(schedule: str, stage: int, stages: int, m: int, v: int = 1) -> int:
    """Forwards stage ``stage`` (0-based) runs before its first backward; for interleaved the
    count is in (chunk, microbatch) units (Megatron-LM's ``num_warmup_microbatches + 1``).
    Eager-1F1B runs ``min(m, 2(S−s)−1)`` instead of 1F1B's ``min(m, S−s)`` so that boundary
    communication overlaps computation (cross-mesh paper §4).

    >>> [warmup_forwards("1f1b", s, 4, 8) for s in range(4)]
    [4, 3, 2, 1]
    >>> [warmup_forwards("eager_1f1b", s, 4, 8) for s in range(4)]
    [7, 5, 3, 1]
    >>> warmup_forwards("interleaved", 0, 4, 8, v=2)
    11
    """
    _check(schedule, stages, m, v)
    if not 0 <= stage < stages:
        raise ValueError(f"stage {stage} not in 0..{stages - 1}")
    left = stages - stage
    if schedule == "gpipe":
        return m
    if schedule == "1f1b":
        return min(m, left)
    if schedule == "eager_1f1b":
        return min(m, 2 * left - 1)
    return min(m * v, 2 * (left - 1) + (v - 1) * stages + 1)


def in_flight_microbatches(schedule: str, stage: int, stages: int, m: int, v: int = 1) -> float:
    """Microbatches whose activations stage ``stage`` holds at its peak: the warm-up count
    (1F1B: ``p−s``); for interleaved, chunk activations divided by ``v`` (each chunk holds
    ``1/v`` of the stage's layers), in units of one microbatch through the whole stage.

    >>> in_flight_microbatches("1f1b", 0, 4, 8), in_flight_microbatches("gpipe", 3, 4, 8)
    (4, 8)
    >>> in_flight_microbatches("interleaved", 0, 4, 8, v=2)
    5.5
    """
    w = warmup_forwards(schedule, stage, stages, m, v)
    return w / v if schedule == "interleaved" else w


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
