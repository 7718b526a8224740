"""Discrete-event simulator over pipeline action lists (DESIGN §9, issue #10 item 5).

:func:`simulate` times the per-rank action lists of a :class:`fxpar.schedule.Schedule` — the
same lists the runtime interpreter runs — and returns a :class:`SimResult`.

Model. Each rank has a *compute lane* and a *comm lane*. A rank walks its list in order; the
*issue time* of an action is when the compute action before it in the list ended (0 for the
first).

- ``F``/``B``/``I``/``W`` run on the compute lane, in list order, each starting at
  ``max(lane free, inputs ready)``: a forward's input is ready when its ``RECV_F`` completes (or
  the same-rank previous chunk's forward ends); a backward's output gradient when its
  ``RECV_B`` completes (or the same-rank next chunk's backward ends).
- ``SEND_F``/``SEND_B`` occupy the sender's comm lane for ``comm`` seconds, starting at
  ``max(issue, value produced, comm lane free)``; the data arrives when it ends (sends are
  asynchronous: the compute lane goes on).
- ``RECV_F``/``RECV_B`` complete at ``max(issue, arrival)``; they occupy no lane (a posted
  ``irecv``) and block nothing but the compute action that needs the data.
- ``REDUCE_GRAD`` occupies the comm lane for ``reduce`` seconds (default 0) after the chunk's
  last backward.

**Shared compute** (``rate``): ranks whose compute lanes share one resource (processes on a
host with fewer cores than their threads) run each compute action at ``rate(k)`` seconds of
its duration per second while ``k`` ranks compute at once (a fluid, processor-sharing model;
the durations are those measured at the load ``rate`` is relative to); events are taken in
time order, and an action's end moves whenever ``k`` changes under it. Without ``rate``
every action takes its duration, as with ``rate ≡ 1``. GPipe over 2 ranks that share one
core, the actions timed one at a time (``rate(k) = 1/k``): the core is never idle, so the
step is all the work, ``2·m·(t_f + t_b)``, where a core each gives ``(m+p−1)(t_f + t_b)``:

>>> import fxpar
>>> s = fxpar.Schedule.build("gpipe", stages=2, microbatches=2)
>>> fxpar.simulate(s, fwd=1.0, bwd=2.0, rate=lambda k: 1 / k).step_time, fxpar.simulate(s).step_time
(12.0, 9.0)

Each kind's lane is one entry of a table keyed by :class:`fxpar.schedule.ActionKind`, and what
an action waits for is :func:`fxpar.schedule.dependencies`, the validator's own rule.

Results: ``step_time`` (the last event's end), ``busy`` (per-rank compute seconds),
``bubble_fraction = (step − ideal)/ideal`` with ``ideal`` = the largest per-rank compute time
(= ``m·Σ(t_f+t_b)`` over the rank's chunks: Megatron-LM's ``t_pb/t_id``), and ``peak_memory``:
per rank, ``static_bytes`` plus ``act_bytes`` of chunk ``k`` for every microbatch whose
``F(k)`` has started and whose ``B(k)`` (``W(k)`` when split) has not ended.

With equal chunks and no communication, GPipe and 1F1B give ``(p−1)/m`` and interleaved 1F1B
``(p−1)/(v·m)``:

>>> r = fxpar.simulate(fxpar.Schedule.build("1f1b", stages=4, microbatches=8), fwd=1.0, bwd=2.0)
>>> r.step_time, r.bubble_fraction        # (m+p−1)(t_f+t_b) = 11·3
(33.0, 0.375)
>>> s = fxpar.Schedule.build("interleaved", stages=4, microbatches=8, chunks=2)
>>> fxpar.simulate(s, fwd=1.0, bwd=2.0).bubble_fraction       # (p−1)/(v·m)
0.1875
>>> fxpar.simulate(fxpar.Schedule.build("gpipe", stages=2, microbatches=4), act_bytes=1.0).peak_memory
(4.0, 4.0)
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from fxpar.errors import ScheduleError
from fxpar.schedule.actions import (COMPUTE_KINDS, RECV_KINDS, SEND_KINDS, WEIGHT_GRAD_KINDS, Action,
                                    dependencies)
from fxpar.schedule.actions import ActionKind as K
from fxpar.schedule.schedule import Schedule

__all__ = ["SimEvent", "SimResult", "simulate"]


@dataclass(frozen=True)
class SimEvent:
    """One timed action: ``rank``, ``lane`` (``"compute"`` or ``"comm"``), ``name`` (the action
    as printed, ``"0F1"``), ``start``/``end`` in seconds. A receive is an instant on the comm
    lane at the moment its data is there. ``work``: a compute action's own duration (at rate
    1); ``end − start`` is that over the speed ``rate`` gave it while it ran."""

    rank: int
    lane: str
    name: str
    start: float
    end: float
    work: float = 0.0


@dataclass(frozen=True)
class SimResult:
    """Outcome of :func:`simulate` (times in seconds, memory in the unit of ``act_bytes``)."""

    step_time: float
    bubble_fraction: float
    busy: tuple[float, ...]
    peak_memory: tuple[float, ...]
    events: tuple[SimEvent, ...]
    ideal: float = 0.0

    @property
    def idle(self) -> tuple[float, ...]:
        """Per-rank ``step_time − busy``."""
        return tuple(self.step_time - b for b in self.busy)

    def to_chrome_trace(self, path=None) -> dict:
        """Chrome / Perfetto trace (JSON object format): one process per rank (``pid`` = rank,
        named ``"rank r"``), threads ``"compute"`` and ``"comm"``, one complete (``"X"``) event
        per action named as in the schedule, times in microseconds. Writes ``path`` if given.

        >>> import fxpar
        >>> t = fxpar.simulate(fxpar.Schedule.build("gpipe", stages=2, microbatches=1)).to_chrome_trace()
        >>> sorted({e["pid"] for e in t["traceEvents"]}), t["traceEvents"][-1]["name"]
        ([0, 1], '0REDUCE_GRAD')
        """
        ranks = sorted({e.rank for e in self.events} | set(range(len(self.busy))))
        out: list[dict] = []
        for r in ranks:
            out.append({"name": "process_name", "ph": "M", "pid": r, "tid": "compute",
                        "args": {"name": f"rank {r}"}})
            out.append({"name": "process_sort_index", "ph": "M", "pid": r, "tid": "compute",
                        "args": {"sort_index": r}})
            for lane in ("compute", "comm"):
                out.append({"name": "thread_name", "ph": "M", "pid": r, "tid": lane,
                            "args": {"name": lane}})
        for e in self.events:
            out.append({"name": e.name, "cat": e.lane, "ph": "X", "pid": e.rank, "tid": e.lane,
                        "ts": e.start * 1e6, "dur": (e.end - e.start) * 1e6})
        trace = {"traceEvents": out, "displayTimeUnit": "ms"}
        if path is not None:
            with open(path, "w") as f:
                json.dump(trace, f)
        return trace


def _per_chunk(val, name: str, n: int, with_mb: bool = True):
    """float | sequence indexed by chunk | callable(chunk, microbatch) -> callable(k, i)."""
    if callable(val):
        return val if with_mb else (lambda k, i=None: val(k))
    if isinstance(val, (int, float)):
        x = float(val)
        return lambda k, i=None: x
    if isinstance(val, Sequence) and not isinstance(val, str):
        if len(val) != n:
            raise ScheduleError(f"{name}: {len(val)} entries, need one per chunk ({n})")
        xs = [float(t) for t in val]
        return lambda k, i=None: xs[k]
    raise ScheduleError(f"{name}: expected a number, a sequence per chunk or a callable, got {val!r}")


def simulate(sched: Schedule, fwd=1.0, bwd=2.0, *, wgrad=None, comm=0.0, reduce=0.0,
             act_bytes=0.0, static_bytes=0.0, rate=None) -> SimResult:
    """Time ``sched`` (see the module docstring for the model).

    ``fwd``/``bwd``: seconds of one chunk's forward / full backward of one microbatch: a float
    (every chunk), a sequence indexed by chunk (``p·v`` entries) or ``callable(chunk,
    microbatch)``. Split backwards: ``W`` takes ``wgrad`` (same forms; default ``bwd/2``) and
    ``I`` takes ``bwd − wgrad``. ``comm``: seconds per boundary transfer, a float or
    ``callable(send_action)``; ``reduce``: seconds of a ``REDUCE_GRAD``, a float or
    ``callable(action)``. ``act_bytes``: activation bytes one microbatch keeps alive on chunk
    ``k`` (float or per-chunk sequence); ``static_bytes``: model-state bytes per rank (float or
    per-rank sequence). ``rate(k)``: the speed of every compute action while ``k`` ranks
    compute at once (module docstring, *shared compute*); ``None``: 1.

    >>> import fxpar
    >>> s = fxpar.Schedule.build("1f1b", stages=2, microbatches=2)
    >>> [(e.name, e.start, e.end) for e in fxpar.simulate(s, comm=0.5).events if e.rank == 1][:3]
    [('1RECV_F0', 1.5, 1.5), ('1F0', 1.5, 2.5), ('1B0', 2.5, 4.5)]
    """
    if not isinstance(sched, Schedule):
        raise ScheduleError(f"simulate needs a fxpar.Schedule, got {type(sched).__name__}")
    p, n, last = sched.stages, sched.num_chunks, sched.num_chunks - 1
    t_f = _per_chunk(fwd, "fwd", n)
    t_b = _per_chunk(bwd, "bwd", n)
    t_w = _per_chunk(wgrad, "wgrad", n) if wgrad is not None else (lambda k, i=None: t_b(k, i) / 2)
    t_c = comm if callable(comm) else (lambda a, c=float(comm): c)
    t_r = reduce if callable(reduce) else (lambda a, c=float(reduce): c)
    act = _per_chunk(act_bytes, "act_bytes", n, with_mb=False)
    if isinstance(static_bytes, Sequence) and not isinstance(static_bytes, str):
        if len(static_bytes) != p:
            raise ScheduleError(f"static_bytes: {len(static_bytes)} entries, need one per rank ({p})")
        static = [float(x) for x in static_bytes]
    else:
        static = [float(static_bytes)] * p

    acts = sched.actions
    split = {(a.stage, a.microbatch) for row in acts.values() for a in row if a.kind is K.I}

    def t_input_grad(a: Action) -> float:
        k, i = a.stage, a.microbatch
        d = float(t_b(k, i)) - float(t_w(k, i))
        if d < 0:
            raise ScheduleError(f"{a}: wgrad ({t_w(k, i)}) exceeds bwd ({t_b(k, i)})")
        return d

    #: seconds of a compute action, by kind
    duration = {
        K.F: lambda a: float(t_f(a.stage, a.microbatch)),
        K.B: lambda a: float(t_b(a.stage, a.microbatch)),
        K.W: lambda a: float(t_w(a.stage, a.microbatch)),
        K.I: t_input_grad,
    }
    compute_free = [0.0] * p
    comm_free = [0.0] * p
    busy = [0.0] * p
    last_bw: dict[int, float] = {}

    def computed(r: int, a: Action, start: float, stop: float) -> None:
        """Compute action ``a`` of rank ``r`` ran ``start..stop``: its lane is free again."""
        end[a] = compute_free[r] = stop
        busy[r] += stop - start
        if a.kind in WEIGHT_GRAD_KINDS:
            last_bw[a.stage] = max(last_bw.get(a.stage, 0.0), stop)
        events.append(SimEvent(r, "compute", str(a), start, stop, duration[a.kind](a)))

    # one function per other lane: (rank, action, issue time, inputs ready) -> (lane, start, end)
    def run_send(r: int, a: Action, issue: float, ready: float):
        start = max(issue, ready, comm_free[r])
        stop = start + float(t_c(a))
        comm_free[r] = stop
        return "comm", start, stop

    def run_recv(r: int, a: Action, issue: float, ready: float):
        start = max(issue, ready)
        return "comm", start, start

    def run_reduce(r: int, a: Action, issue: float, ready: float):
        start = max(issue, comm_free[r], last_bw.get(a.stage, 0.0))
        stop = start + float(t_r(a))
        comm_free[r] = stop
        return "comm", start, stop

    run = {**dict.fromkeys(SEND_KINDS, run_send), **dict.fromkeys(RECV_KINDS, run_recv),
           K.REDUCE_GRAD: run_reduce}

    def waits_for(a: Action) -> list[Action]:
        """What gates ``a`` besides its rank's lanes (a receive: its matching send's arrival)."""
        if a.is_recv:
            return [a.matching()]
        return [d for _, d in dependencies(a, p, last, split, sched.placement)]

    end: dict[Action, float] = {}          # completion (arrival for a send)
    pos = [0] * p
    events: list[SimEvent] = []
    remaining = sum(len(acts[r]) for r in range(p))
    #: with ``rate``, per rank its compute action in progress (or about to start):
    #: [action, start, work left at t0 in seconds at rate 1, t0, rate since t0]
    running: dict[int, list] = {}
    now = 0.0
    rank_of = {a.stage: r for r in range(p) for a in acts[r] if a.kind is K.F}   # chunk -> rank
    todo = set(range(p))    # ranks that may go on
    while remaining or running:
        # walk each rank without a compute action in progress as far as its inputs allow; its
        # next compute action starts once the lane and its inputs are free (possibly later)
        while todo:
            r = todo.pop()
            row = acts[r]
            while r not in running and pos[r] < len(row):
                a = row[pos[r]]
                deps = waits_for(a)
                if any(d not in end for d in deps):
                    break
                ready = max((end[d] for d in deps), default=0.0)
                pos[r] += 1
                remaining -= 1
                if a.kind in COMPUTE_KINDS:
                    start = max(compute_free[r], ready)
                    if rate is None:   # its own duration whatever runs beside it: ends now
                        computed(r, a, start, start + duration[a.kind](a))
                    else:
                        running[r] = [a, start, duration[a.kind](a), start, 1.0]
                    continue
                lane, start, stop = run[a.kind](r, a, compute_free[r], ready)
                end[a] = stop
                events.append(SimEvent(r, lane, str(a), start, stop))
                if a.is_send:   # its receiver may go on
                    todo.add(rank_of[a.peer_stage])
        if not running:
            if remaining:  # only a schedule that skipped validation gets here
                stuck = [f"rank {r} step {pos[r]}: {acts[r][pos[r]]}" for r in range(p)
                         if pos[r] < len(acts[r])]
                raise ScheduleError(f"schedule {sched.name!r} deadlocks in simulation: "
                                    f"{'; '.join(stuck)}")
            break
        # (only with ``rate``) the actions computing now share the rate of their number; one
        # whose rate changes is re-based at ``now`` (unchanged ones keep their exact end)
        active = [x for x in running.values() if x[1] <= now]
        speed = float(rate(len(active)))
        if not 0 < speed < float("inf"):
            raise ScheduleError(f"rate({len(active)}) must be a positive number, got {speed!r}")
        for x in active:
            if x[4] != speed:
                x[2] -= (now - x[3]) * x[4]
                x[3], x[4] = now, speed
        finish = {r: x[3] + x[2] / x[4] for r, x in running.items() if x[1] <= now}
        now = min([*finish.values(), *(x[1] for x in running.values() if x[1] > now)])
        for r, stop in finish.items():
            if stop <= now:
                computed(r, *running.pop(r)[:2], stop)
                todo.add(r)

    # memory: walk each rank's compute actions in order (one compute lane: order = time order)
    peak = []
    for r in range(p):
        cur = top = 0.0
        for a in acts[r]:
            if a.kind is K.F:
                cur += float(act(a.stage))
                top = max(top, cur)
            elif a.kind is (K.W if (a.stage, a.microbatch) in split else K.B):  # frees it
                cur -= float(act(a.stage))
        peak.append(static[r] + top)

    step = max((e.end for e in events), default=0.0)
    ideal = max(busy, default=0.0)
    bubble = (step - ideal) / ideal if ideal > 0 else 0.0
    events.sort(key=lambda e: (e.start, e.rank))  # stable: list order among ties
    return SimResult(step, bubble, tuple(busy), tuple(peak), tuple(events), ideal)
