"""Pipeline schedules in closed form: bubble fractions, warm-up counts and in-flight microbatches
(pure functions).

Closed forms (Megatron-LM PTD-P §2.2, ``p`` stages, ``m`` microbatches, ``v`` chunks per
device): the bubble fraction ``t_pb / t_id`` is ``(p−1)/m`` for GPipe and 1F1B and
``(1/v)·(p−1)/m`` for interleaved 1F1B. Eager-1F1B (cross-mesh resharding paper §4) has the
1F1B bubble without communication.

Looped breadth-first (Lamy-Poirier 2022) runs every microbatch through a rank's first chunk,
then its second, ...: a step of ``(v−1)·max(m, p) + p − 1 + m`` chunk slots against interleaved
1F1B's ``v·m + p − 1`` (equal when ``m ≥ p``). Zero-bubble schedules (ZB-H1, interleaved
zero-bubble, ZB-V, DualPipeV) fill the bubble with weight gradients: their step depends on how
a backward splits, which only :func:`fxpar.sim.simulate` prices.

Warm-up (forwards a stage runs before its first backward, ``I`` for the zero-bubble ones;
stages ``s = 0 .. p−1``):

==============  ==========================================  ====================================
schedule        forwards before the first backward          activations in flight (microbatches)
==============  ==========================================  ====================================
gpipe           ``m``                                       ``m``
1f1b            ``min(m, p−s)``                             ``min(m, p−s)``
eager_1f1b      ``min(m, 2(p−s)−1)``                        ``min(m, 2(p−s)−1)``
interleaved     ``min(m·v, 2(p−s−1) + (v−1)·p + 1)`` chunks  that many chunk activations ``/ v``
zb_h1           ``min(m, p−s)``                             ``min(m, p)``: a microbatch lives
                                                            until its deferred ``W``
looped_bfs      ``m·v`` chunks                              ``m``
interleaved_zb  ``min(m·v, (v−1)·p + p−s)`` chunks           ``min(m, p)`` (``p | m``)
zbv             ``min(m, 2p−s−1) + min(m, s+1)`` chunks     ``min(2p, m+1+s, 2m) / 2``
dualpipev       ``2p`` chunks (the last stage ``2p+1``)     ``(2p+1) / 2`` (``m ≥ 2p``)
==============  ==========================================  ====================================

Exact step times of a schedule with arbitrary per-chunk times and communication are
:func:`fxpar.sim.simulate`'s (over the action lists of :mod:`fxpar.schedule`); with equal
stages and no communication it reproduces the closed forms.

>>> from fxpar.cost.pipeline import bubble_fraction
>>> bubble_fraction("1f1b", p=4, m=8), bubble_fraction("interleaved", p=4, m=8, v=2)
(0.375, 0.1875)
"""

from __future__ import annotations

__all__ = [
    "SCHEDULES",
    "bubble_fraction",
    "warmup_forwards",
    "in_flight_microbatches",
]

SCHEDULES = ("gpipe", "1f1b", "interleaved", "eager_1f1b", "zb_h1", "looped_bfs", "interleaved_zb",
             "zbv", "dualpipev")
#: the schedules with several chunks per device
MULTI_CHUNK = ("interleaved", "looped_bfs", "interleaved_zb", "zbv", "dualpipev")
#: the schedules that split (some) backwards into I and W
ZERO_BUBBLE = ("zb_h1", "interleaved_zb", "zbv", "dualpipev")


def _check(schedule: str, p: int, m: int, v: int = 1) -> None:
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; known: {SCHEDULES}")
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"stages, microbatches and chunks must be >= 1 (p={p}, m={m}, v={v})")
    if schedule not in MULTI_CHUNK and v != 1:
        raise ValueError(f"{schedule} has one chunk per device (v={v}); use one of {MULTI_CHUNK}")
    if schedule in ("zbv", "dualpipev") and v != 2:
        raise ValueError(f"{schedule} places two chunks per device in a V (v={v})")
    if schedule == "dualpipev" and m < 2 * p:
        raise ValueError(f"dualpipev needs m >= 2p microbatches (m={m}, p={p})")


def bubble_fraction(schedule: str, p: int, m: int, v: int = 1) -> float:
    """Idle fraction ``t_pb / t_id`` with equal stages (Megatron-LM §2.2.1 and §2.2.2):
    ``(p−1)/m``, or ``(1/v)·(p−1)/m`` interleaved; looped BFS
    ``((v−1)(max(m,p)−m) + p−1)/(v·m)`` (the module docstring); none for the zero-bubble
    schedules (a :class:`ValueError`).

    >>> bubble_fraction("gpipe", 8, 32), bubble_fraction("looped_bfs", 4, 2, v=2)
    (0.21875, 1.25)
    """
    _check(schedule, p, m, v)
    if schedule in ZERO_BUBBLE:
        raise ValueError(f"{schedule}: the bubble depends on how a backward splits into I and W; "
                         "fxpar.sim.simulate prices it")
    if schedule == "interleaved":
        return (p - 1) / (v * m)
    if schedule == "looped_bfs":
        return ((v - 1) * (max(m, p) - m) + p - 1) / (v * m)
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
    if schedule in ("1f1b", "zb_h1"):
        return min(m, left)
    if schedule == "eager_1f1b":
        return min(m, 2 * left - 1)
    if schedule == "looped_bfs":
        return m * v
    if schedule == "interleaved_zb":
        return min(m * v, (v - 1) * stages + left)
    if schedule == "zbv":   # the first chunk's forwards, then the second's up to its first I
        return min(m, stages + left - 1) + min(m, stage + 1)
    if schedule == "dualpipev":   # the last rank starts its steady state with F c0, B c1
        return 2 * stages + (stage == stages - 1)
    return min(m * v, 2 * (left - 1) + (v - 1) * stages + 1)


def in_flight_microbatches(schedule: str, stage: int, stages: int, m: int, v: int = 1) -> float:
    """Microbatches whose activations stage ``stage`` holds at its peak: the warm-up count
    (1F1B: ``p−s``); for interleaved, chunk activations divided by ``v`` (each chunk holds
    ``1/v`` of the stage's layers), in units of one microbatch through the whole stage.

    >>> in_flight_microbatches("1f1b", 0, 4, 8), in_flight_microbatches("gpipe", 3, 4, 8)
    (4, 8)
    >>> in_flight_microbatches("interleaved", 0, 4, 8, v=2)
    5.5
    >>> in_flight_microbatches("zb_h1", 3, 4, 8), in_flight_microbatches("looped_bfs", 3, 4, 8, v=2)
    (4, 8.0)
    """
    if schedule in ("zb_h1", "interleaved_zb"):   # each deferred W holds its microbatch
        _check(schedule, stages, m, v)
        return min(m, stages)
    if schedule == "zbv":
        _check(schedule, stages, m, v)
        return min(2 * stages, m + 1 + stage, 2 * m) / 2
    if schedule == "dualpipev":
        _check(schedule, stages, m, v)
        return (2 * stages + 1) / 2
    w = warmup_forwards(schedule, stage, stages, m, v)
    return w / v if schedule in MULTI_CHUNK else w
