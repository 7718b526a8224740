"""Cross-mesh resharding planner (the cross-mesh paper, §2.2 and §3): move a tensor laid out as
``src_spec`` on ``src_mesh`` to layout ``dst_spec`` on ``dst_mesh``.

:func:`cross_mesh_plan` plans in five steps; the plan is frozen, hashable data (no process
groups) that every rank computes identically, and :func:`fxpar.runtime.cross_mesh_reshard`
executes it.

1. **Partial sources** are reduced first, on the source mesh, by the intra-mesh planner
   (:func:`fxpar.resharding.intra.reshard_plan`): every ``P(op)`` axis becomes ``R`` or ``S(d)`` (the same
   ``d`` on every partial axis), whichever gives the smallest reduction + transfer time.
2. **Unit tasks.** Every distinct slice of the destination layout is cut by the distinct slices
   of the source layout; each non-empty piece is a task with the source devices that hold it
   (``holders``) and the destination devices that need it. A destination device that holds
   the piece already (the meshes overlap) copies it locally (``local``, no transfer); the
   others are its ``receivers``.
3. **Strategies** per task and sender (:mod:`fxpar.cost.reshard_cross`, placement-aware):
   ``send_recv`` (``≈ r·T`` for ``r`` receivers), ``allgather`` (Alpa's: one copy per
   receiving host, then a local all-gather, ``≈ hosts·T``), ``broadcast`` (a chain pipelined in
   ``k`` chunks, ``≈ T·(1 + (h−1)/k)``). ``strategy="auto"`` takes the fastest per task.
4. **Senders and order** (paper §3.2). A task occupies its sender and receiver devices and, if
   it crosses nodes, the NIC of every node it touches (tasks sharing a NIC do not overlap, the
   paper's Eq. 3); given an order, each task starts when all of them are free (list
   scheduling). Four schedules are built and the fastest is kept (ties: the first):
   ``naive`` (lowest-id holder, tasks in index order), ``balanced`` (longest task first, each
   on the holder that finishes it earliest, so sending hosts finish together), ``greedy``
   (randomized greedy: rounds of non-overlapping tasks touching the most devices, best of
   several seeded random orders per round) and ``dfs`` (depth-first search over the next task
   and its sender, pruned by ``max over resources of (free at + remaining work)`` against the
   best so far, under a budget of ``search_budget`` nodes, deterministic so every rank gets
   the same plan; an optional wall-clock ``time_budget_s`` makes it rank-dependent).
5. **Times.** ``plan.time`` = Partial reduction + local copies + the schedule's makespan;
   ``plan.lower_bound`` = the reduction + :func:`fxpar.cost.reshard_cross.lower_bound` (every
   receiving host takes in each needed byte once, sending hosts share their NICs).

>>> import fxpar
>>> c = fxpar.Cluster.preset("aws-p3.8xlarge", physics=None, nodes=2)
>>> src = fxpar.Mesh.from_devices(c, ["dp", "tp"], [[0, 1], [2, 3]])
>>> dst = fxpar.Mesh.from_devices(c, ["tp"], [4, 5, 6, 7])
>>> plan = cross_mesh_plan(src, "S(0)R", dst, "S(1)", shape=(8, 12), dtype="float32")
>>> len(plan.tasks), sorted({t.strategy for t in plan.tasks}), plan.time >= plan.lower_bound
(8, ['send_recv'], True)
>>> t = plan.tasks[0]
>>> t.region, t.holders, t.receivers, t.nbytes
(((0, 4), (0, 3)), (0, 1), (4,), 48)
"""

from __future__ import annotations

import functools
import math
import random
import time as _time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from fxpar.cost import reshard_cross as cost
from fxpar.errors import ReshardError, SpecError
from fxpar.mesh import Mesh
from fxpar.resharding.intra import ReshardPlan, as_dtype, reshard_plan
from fxpar.spec import Partial, Replicate, Shard, Spec, as_spec
from fxpar.units import dtype_name, fmt_time

__all__ = ["CrossMeshPlan", "UnitTask", "cross_mesh_plan", "cross_mesh_time", "STRATEGIES",
           "SCHEDULERS", "region_slices"]

#: ``strategy=`` values: ``auto`` or one of the per-task strategies.
STRATEGIES = ("auto",) + cost.STRATEGIES
#: Schedules built for every plan, in tie-breaking order.
SCHEDULERS = ("naive", "balanced", "greedy", "dfs")

Region = tuple[tuple[int, int], ...]


def region_slices(region: Region, origin: Region | None = None) -> tuple[slice, ...]:
    """Slices of ``region`` (global ``[start, stop)`` per dim), relative to ``origin``'s starts.

    >>> region_slices(((2, 4), (0, 3)), origin=((2, 6), (0, 3)))
    (slice(0, 2, None), slice(0, 3, None))
    """
    if origin is None:
        return tuple(slice(a, b) for a, b in region)
    return tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(region, origin))


@dataclass(frozen=True)
class UnitTask:
    """One piece of the tensor to move: ``region`` (global ``[start, stop)`` per dim,
    ``nbytes``) held by ``holders`` on the source mesh, needed by ``receivers`` (and copied
    locally by ``local``, destination devices that hold it already). ``sender`` sends it with
    ``strategy`` (``"local"`` when nobody receives) from ``start`` for ``time`` seconds of the
    plan's schedule; ``chunks`` is the broadcast's pipeline depth. ``options`` lists what was
    weighed: ``(sender host, strategy, seconds)`` for every holder host and strategy."""

    index: int
    region: Region
    nbytes: int
    holders: tuple[int, ...]
    receivers: tuple[int, ...]
    local: tuple[int, ...]
    sender: int | None
    strategy: str
    start: float
    time: float
    chunks: int
    options: tuple[tuple[int, str, float], ...]
    why: str = ""

    @property
    def end(self) -> float:
        return self.start + self.time

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in self.region)


@dataclass(frozen=True, repr=False)
class CrossMeshPlan:
    """A planned cross-mesh resharding (module docstring). ``tasks`` in index order (regions
    row-major by destination slice, then source slice), ``order`` the indices of the tasks that
    transfer, in execution order; ``schedules`` every schedule built with its makespan
    (``scheduler`` the one kept). ``time`` and ``lower_bound`` in seconds."""

    src_mesh: Mesh
    src_spec: Spec
    dst_mesh: Mesh
    dst_spec: Spec
    shape: tuple[int, ...]
    dtype: torch.dtype
    strategy: str
    pre: ReshardPlan | None
    tasks: tuple[UnitTask, ...]
    order: tuple[int, ...]
    time: float
    lower_bound: float
    transfer_time: float
    local_time: float
    scheduler: str
    schedules: tuple[tuple[str, float], ...]
    search_nodes: int = 0

    def __hash__(self) -> int:  # computed once: the runtime looks plans up on every call
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash((self.src_mesh, self.src_spec, self.dst_mesh, self.dst_spec, self.shape, self.dtype,
                      self.strategy, self.pre, self.tasks, self.order))
            object.__setattr__(self, "_hash", h)
        return h

    def __getstate__(self) -> dict:  # the cached hash is per process (string hashing is salted)
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

    @property
    def reduced_spec(self) -> Spec:
        """The source layout the transfer starts from (after the Partial reduction, if any)."""
        return self.pre.dst if self.pre is not None else self.src_spec

    @property
    def nbytes(self) -> int:
        """Bytes sent by senders (a broadcast or all-gather task counts its slice once)."""
        return sum(t.nbytes for t in self.tasks if t.receivers)

    def src_region(self, device: int) -> Region | None:
        """Global region device ``device`` holds after the Partial reduction (None: not on the
        source mesh)."""
        return _device_region(self.reduced_spec, self.shape, self.src_mesh, device)

    def dst_region(self, device: int) -> Region | None:
        """Global region device ``device`` holds in the destination layout (None: not on it)."""
        return _device_region(self.dst_spec, self.shape, self.dst_mesh, device)

    def __repr__(self) -> str:
        return (f"CrossMeshPlan({self.src_spec} on {self.src_mesh!r} -> {self.dst_spec} on "
                f"{self.dst_mesh!r}, {dtype_name(self.dtype)}{list(self.shape)}, "
                f"{len(self.tasks)} tasks, time={fmt_time(self.time)}, lower_bound={fmt_time(self.lower_bound)})")

    def describe(self) -> str:
        """Tasks (region, bytes, holders, sender, receivers, strategy, start, time), the order,
        every schedule's makespan and the bounds, with why each task went the way it did."""
        c = self.src_mesh.cluster
        node = c.node_of
        ratio = f"{self.time / self.lower_bound:.2f}x the bound" if self.lower_bound > 0 else "no bound"
        nloc = sum(1 for t in self.tasks if not t.receivers)
        lines = [
            f"cross-mesh reshard {dtype_name(self.dtype)}{list(self.shape)}: {self.src_spec} on "
            f"{self.src_mesh!r} -> {self.dst_spec} on {self.dst_mesh!r}",
            f"  cluster {c.name}: {c.devices_per_node} devices per node (host h = device // "
            f"{c.devices_per_node}); strategy {self.strategy}",
            f"  predicted {fmt_time(self.time)} (transfer {fmt_time(self.transfer_time)}"
            + (f", local copies {fmt_time(self.local_time)}" if self.local_time else "")
            + (f", Partial reduction {fmt_time(self.pre.time)}" if self.pre is not None else "")
            + f"); lower bound {fmt_time(self.lower_bound)} ({ratio})",
        ]
        if self.pre is not None:
            lines.append(f"  Partial source reduced first on the source mesh: {self.pre} ({fmt_time(self.pre.time)})")
        lines.append(f"  {len(self.tasks)} unit tasks ({nloc} local only); schedules: "
                     + ", ".join(f"{n} {fmt_time(t)}" for n, t in self.schedules)
                     + ("" if any(n == "dfs" for n, _ in self.schedules)
                        else f", dfs none better in {self.search_nodes} nodes")
                     + f" -> kept {self.scheduler}")
        lines.append("  order: " + (" ".join(str(i) for i in self.order) if self.order else "(nothing to send)"))
        rows = [("#", "region", "bytes", "holders", "sender", "receivers", "local", "strategy", "start",
                 "time", "why")]

        def devs(ds):
            if not ds:
                return "-"
            hosts: dict[int, list[int]] = {}
            for d in ds:
                hosts.setdefault(node(d), []).append(d)
            return " ".join(f"h{h}:{','.join(map(str, v))}" for h, v in hosts.items())

        for t in self.tasks:
            reg = "[" + ", ".join(f"{a}:{b}" for a, b in t.region) + "]"
            rows.append((str(t.index), reg, str(t.nbytes), devs(t.holders),
                         "-" if t.sender is None else f"{t.sender} (h{node(t.sender)})",
                         devs(t.receivers), devs(t.local), t.strategy,
                         fmt_time(t.start) if t.receivers else "-", fmt_time(t.time), t.why))
        widths = [max(len(r[k]) for r in rows) for k in range(len(rows[0]))]
        for r in rows:
            lines.append("  " + "  ".join(v.rjust(w) if k in (0, 2) else v.ljust(w)
                                          for k, (v, w) in enumerate(zip(r, widths))).rstrip())
        return "\n".join(lines)


# -- helpers ----------------------------------------------------------------------------------
def _region(spec: Spec, shape, mesh: Mesh, coord) -> Region:
    return tuple((s.start, s.stop) for s in spec.global_slices(shape, mesh.shape, coord))


def _device_region(spec: Spec, shape, mesh: Mesh, device: int) -> Region | None:
    if device not in mesh.devices:
        return None
    return _region(spec, shape, mesh, mesh.coord(device))


def _regions(spec: Spec, shape, mesh: Mesh) -> list[tuple[Region, tuple[int, ...]]]:
    """Distinct regions of a layout with the devices holding each (order of first device)."""
    out: dict[Region, list[int]] = {}
    for coord in mesh.coords():
        out.setdefault(_region(spec, shape, mesh, coord), []).append(mesh.device_at(coord))
    return [(r, tuple(sorted(ds))) for r, ds in out.items()]


def _numel(region: Region) -> int:
    return math.prod(b - a for a, b in region)


def _check_spec(spec, role: str, shape, mesh: Mesh) -> Spec:
    try:
        s = as_spec(spec)
        s.check(shape, mesh.shape)
    except SpecError as e:
        raise SpecError(f"cross-mesh {role} spec: {e} (mesh {mesh!r})") from None
    return s.normalized(len(shape))


# -- options and schedules ---------------------------------------------------------------------
class _Opt(NamedTuple):
    sender: int
    host: int
    strategy: str
    dur: float
    chunks: int
    res: frozenset
    alts: tuple[tuple[str, float], ...]   # every strategy considered on this sender's host


def _options(task_receivers, holders, nbytes, cluster, strategies, cache) -> list[_Opt]:
    """One option per holder device: the best allowed strategy from its host."""
    recv_hosts = {cluster.node_of(r) for r in task_receivers}
    out = []
    for s in holders:
        h = cluster.node_of(s)
        key = (h, nbytes, task_receivers)
        if key not in cache:
            alts = tuple((st, cost.task_time(st, nbytes, s, task_receivers, cluster)) for st in strategies)
            best = min(alts, key=lambda a: a[1])  # ties: the first (send_recv, allgather, broadcast)
            k = cost.broadcast_chunks(nbytes, s, task_receivers, cluster) if best[0] == "broadcast" else 1
            cache[key] = (best, k, alts)
        (st, dur), k, alts = cache[key]
        res = {("dev", s)} | {("dev", r) for r in task_receivers}
        hosts = recv_hosts | {h}
        if len(hosts) > 1:
            res |= {("nic", x) for x in hosts}
        out.append(_Opt(s, h, st, dur, k, frozenset(res), alts))
    return out


def _list_schedule(order: Sequence[int], choice: dict[int, int], opts: list[list[_Opt]]):
    """Start times of tasks placed in ``order`` (each at the moment all its resources are
    free) and the makespan."""
    avail: dict = {}
    starts: dict[int, float] = {}
    end = 0.0
    for t in order:
        o = opts[t][choice[t]]
        s = max((avail.get(r, 0.0) for r in o.res), default=0.0)
        e = s + o.dur
        for r in o.res:
            avail[r] = e
        starts[t] = s
        end = max(end, e)
    return starts, end


def _nics(o: _Opt) -> int:
    """How many NICs an option holds (ties between equally fast senders go to the one that
    keeps the network free)."""
    return sum(1 for r in o.res if r[0] == "nic")


def _place_best(t: int, opts, avail) -> tuple[int, float, float]:
    """The option of task ``t`` that finishes earliest given ``avail``: (index, start, end)."""
    best = None
    for i, o in enumerate(opts[t]):
        s = max((avail.get(r, 0.0) for r in o.res), default=0.0)
        key = (s + o.dur, _nics(o), s, i)
        if best is None or key < best[0]:
            best = (key, i, s)
    return best[1], best[2], best[0][0]


def _naive(ids, opts):
    choice = {t: 0 for t in ids}   # options are in holder order: the lowest id first
    return list(ids), choice


def _balanced(ids, opts):
    """Longest first; each task on the holder that finishes it earliest (greedy LPT)."""
    order = sorted(ids, key=lambda t: (-min(o.dur for o in opts[t]), t))
    avail: dict = {}
    choice = {}
    for t in order:
        i, s, e = _place_best(t, opts, avail)
        choice[t] = i
        for r in opts[t][i].res:
            avail[r] = e
    return order, choice


def _greedy(ids, opts, seed: int = 0, trials: int | None = None):
    """Randomized greedy (paper §3.2): rounds of resource-disjoint tasks touching the most
    devices, the best of ``trials`` seeded orders per round (the first: longest first)."""
    rng = random.Random(seed)
    remaining = sorted(ids, key=lambda t: (-min(o.dur for o in opts[t]), t))
    if trials is None:
        trials = max(1, min(8, 4000 // max(1, len(remaining))))
    order, choice = [], {}
    load: dict = {}
    while remaining:
        best = None
        for trial in range(trials):
            perm = remaining if trial == 0 else rng.sample(remaining, len(remaining))
            used: set = set()
            picked = []
            for t in perm:
                cands = sorted(range(len(opts[t])),
                               key=lambda i: (opts[t][i].dur, _nics(opts[t][i]),
                                              max((load.get(r, 0.0) for r in opts[t][i].res), default=0.0), i))
                for i in cands:
                    if not (opts[t][i].res & used):
                        picked.append((t, i))
                        used |= opts[t][i].res
                        break
            score = (sum(1 for r in used if r[0] == "dev"), sum(opts[t][i].dur for t, i in picked))
            if best is None or score > best[0]:
                best = (score, picked)
        picked = sorted(best[1], key=lambda p: (-opts[p[0]][p[1]].dur, p[0]))
        for t, i in picked:
            order.append(t)
            choice[t] = i
            for r in opts[t][i].res:
                load[r] = load.get(r, 0.0) + opts[t][i].dur
        took = {t for t, _ in picked}
        remaining = [t for t in remaining if t not in took]
    return order, choice


def _dfs(ids, opts, best_end: float, budget: int, deadline: float | None):
    """Depth-first search over (next task, its sender) with pruning; returns
    ``(order, choice, makespan, nodes)`` of the best complete schedule it found below
    ``best_end`` (or None), expanding at most ``budget`` nodes."""
    ids = list(ids)
    if not ids or budget <= 0:
        return None, 0
    mandatory = {t: frozenset.intersection(*[o.res for o in opts[t]]) for t in ids}
    mindur = {t: min(o.dur for o in opts[t]) for t in ids}
    rem: dict = {}
    for t in ids:
        for r in mandatory[t]:
            rem[r] = rem.get(r, 0.0) + mindur[t]
    sig = {t: tuple((o.res, o.dur) for o in opts[t]) for t in ids}
    state = dict(nodes=0, best=None, best_end=best_end)
    avail: dict = {}
    order: list[int] = []
    choice: dict[int, int] = {}
    left = set(ids)
    eps = 1e-12

    def visit(cur_end: float) -> None:
        if state["nodes"] >= budget or (deadline is not None and _time.monotonic() > deadline):
            return
        state["nodes"] += 1
        if not left:
            if cur_end < state["best_end"] - eps:
                state["best_end"] = cur_end
                state["best"] = (list(order), dict(choice))
            return
        lb = max([cur_end] + [avail.get(r, 0.0) + w for r, w in rem.items() if w > 0])
        if lb >= state["best_end"] - eps:
            return
        seen = set()
        cands = []
        for t in sorted(left):
            if sig[t] in seen:
                continue
            seen.add(sig[t])
            for i, o in enumerate(opts[t]):
                s = max((avail.get(r, 0.0) for r in o.res), default=0.0)
                cands.append((s + o.dur, _nics(o), s, t, i))
        cands.sort()
        for e, _, s, t, i in cands:
            o = opts[t][i]
            saved = [(r, avail.get(r)) for r in o.res]
            for r in o.res:
                avail[r] = e
            for r in mandatory[t]:
                rem[r] -= mindur[t]
            left.discard(t)
            order.append(t)
            choice[t] = i
            visit(max(cur_end, e))
            order.pop()
            del choice[t]
            left.add(t)
            for r in mandatory[t]:
                rem[r] += mindur[t]
            for r, v in saved:
                if v is None:
                    del avail[r]
                else:
                    avail[r] = v
            if state["nodes"] >= budget:
                return

    import sys

    limit = sys.getrecursionlimit()
    if len(ids) + 100 > limit:
        sys.setrecursionlimit(len(ids) + 200)
    try:
        visit(0.0)
    finally:
        sys.setrecursionlimit(limit)
    return state["best"], state["nodes"]


# -- planning ----------------------------------------------------------------------------------
def _transfer(src_mesh: Mesh, rspec: Spec, dst_mesh: Mesh, dspec: Spec, shape, dtype,
              strategy: str, search_budget: int, time_budget_s: float | None):
    """Tasks, order and times of the transfer from a non-Partial source layout."""
    cluster = src_mesh.cluster
    item = torch.empty((), dtype=dtype).element_size()
    srcs = [(r, ds) for r, ds in _regions(rspec, shape, src_mesh) if _numel(r) > 0]
    dsts = [(r, ds) for r, ds in _regions(dspec, shape, dst_mesh) if _numel(r) > 0]
    strategies = cost.STRATEGIES if strategy == "auto" else (strategy,)
    raw = []
    for dreg, needers in dsts:
        for sreg, holders in srcs:
            reg = tuple((max(a, c), min(b, d)) for (a, b), (c, d) in zip(dreg, sreg))
            if any(a >= b for a, b in reg) and reg:
                continue
            hs = set(holders)
            local = tuple(d for d in needers if d in hs)
            receivers = tuple(d for d in needers if d not in hs)
            raw.append((reg, _numel(reg) * item, holders, receivers, local))
    cache: dict = {}
    opts: list[list[_Opt]] = [
        _options(rc, hd, n, cluster, strategies, cache) if rc else [] for _, n, hd, rc, _ in raw]
    ids = [i for i, (_, _, _, rc, _) in enumerate(raw) if rc]

    results: dict[str, tuple] = {}
    order, choice = _naive(ids, opts)
    results["naive"] = (order, choice, _list_schedule(order, choice, opts)[1])
    order, choice = _balanced(ids, opts)
    results["balanced"] = (order, choice, _list_schedule(order, choice, opts)[1])
    order, choice = _greedy(ids, opts)
    results["greedy"] = (order, choice, _list_schedule(order, choice, opts)[1])
    best_so_far = min(r[2] for r in results.values())
    deadline = None if time_budget_s is None else _time.monotonic() + time_budget_s
    found, nodes = _dfs(ids, opts, best_so_far, search_budget, deadline)
    if found is not None:
        order, choice = found
        results["dfs"] = (order, choice, _list_schedule(order, choice, opts)[1])
    else:
        results["dfs"] = None
    kept = None
    for name in SCHEDULERS:
        r = results[name]
        if r is not None and (kept is None or r[2] < results[kept][2] - 1e-15):
            kept = name
    order, choice, makespan = results[kept]
    starts, _ = _list_schedule(order, choice, opts)
    schedules = tuple((n, results[n][2]) for n in SCHEDULERS if results[n] is not None)

    # explanations: at each task's placement, what each other holder would have given
    avail: dict = {}
    why: dict[int, str] = {}
    for t in order:
        o = opts[t][choice[t]]
        parts = []
        if len(o.alts) > 1:
            parts.append(" | ".join(f"{'*' if st == o.strategy else ''}{st} {fmt_time(d)}" for st, d in o.alts))
        else:
            parts.append(f"{o.strategy} (forced)")
        if o.strategy == "broadcast" and o.chunks > 1:
            parts.append(f"{o.chunks} chunks")
        others = []
        for i, p in enumerate(opts[t]):
            if i != choice[t]:
                s = max((avail.get(r, 0.0) for r in p.res), default=0.0)
                others.append((s + p.dur, p.sender))
        if others:
            alt = min(others)
            e0 = starts[t] + o.dur
            tie = " (a tie)" if abs(alt[0] - e0) <= 1e-12 * max(1.0, e0) else ""
            parts.append(f"ends {fmt_time(e0)}; from {alt[1]} it would end {fmt_time(alt[0])}{tie}")
        else:
            parts.append("only holder")
        for r in o.res:
            avail[r] = starts[t] + o.dur
        why[t] = "; ".join(parts)

    tasks = []
    for i, (reg, n, holders, receivers, local) in enumerate(raw):
        if receivers:
            o = opts[i][choice[i]]
            options = tuple(sorted({(p.host, st, d) for p in opts[i] for st, d in p.alts}))
            tasks.append(UnitTask(i, reg, n, holders, receivers, local, o.sender, o.strategy,
                                  starts[i], o.dur, o.chunks, options, why[i]))
        else:
            tasks.append(UnitTask(i, reg, n, holders, receivers, local, None, "local", 0.0,
                                  cost.local_copy_time(n, cluster) if local else 0.0, 1, (),
                                  "every device that needs it holds it"))
    # local copies: every destination device copies what it holds, before the transfer
    per_dev: dict[int, float] = {}
    for reg, n, _, _, local in raw:
        for d in local:
            per_dev[d] = per_dev.get(d, 0.0) + cost.local_copy_time(n, cluster)
    local_time = max(per_dev.values(), default=0.0)
    lb = cost.lower_bound([(n, hd, rc) for _, n, hd, rc, _ in raw if rc], cluster)
    exec_order = tuple(sorted(ids, key=lambda t: (starts[t], t)))
    return dict(tasks=tuple(tasks), order=exec_order, transfer_time=makespan, local_time=local_time,
                lower_bound=lb, scheduler=kept, schedules=schedules, search_nodes=nodes)


def _reduced_candidates(spec: Spec, ndim: int) -> list[Spec]:
    """Non-Partial layouts a Partial source can be reduced to on its own mesh: every partial
    axis to R, or every partial axis to S(d) for one tensor dim d."""
    out = [Spec(tuple(Replicate() if isinstance(p, Partial) else p for p in spec))]
    for d in range(ndim):
        out.append(Spec(tuple(Shard(d) if isinstance(p, Partial) else p for p in spec)))
    return out


def cross_mesh_plan(src_mesh: Mesh, src_spec: Spec | str, dst_mesh: Mesh, dst_spec: Spec | str, *,
                    shape: Sequence[int], dtype: torch.dtype | str = torch.float32,
                    strategy: str = "auto", search_budget: int = 5000,
                    time_budget_s: float | None = None) -> CrossMeshPlan:
    """Plan moving a tensor of ``shape``/``dtype`` from ``src_spec`` on ``src_mesh`` to
    ``dst_spec`` on ``dst_mesh`` (module docstring). The meshes may have any shapes and
    overlap; both must be over the same cluster (device id = global rank at run time).

    ``strategy``: ``"auto"`` (fastest per task) or ``"send_recv"``, ``"allgather"``,
    ``"broadcast"`` for every task. ``search_budget``: DFS nodes (deterministic);
    ``time_budget_s``: also stop the DFS after that many seconds (then ranks may disagree:
    plan on one rank and share the plan, or leave it ``None``). Plans are cached.

    Raises :class:`fxpar.SpecError` for a spec that does not fit its mesh or the shape and
    :class:`fxpar.ReshardError` for meshes of different clusters, a bad shape, an unknown
    strategy or dtype, or a Partial destination.

    >>> import fxpar
    >>> c = fxpar.Cluster.preset("aws-p3.8xlarge", physics=None, nodes=2)
    >>> a = fxpar.Mesh.from_devices(c, ["x"], [0])
    >>> b = fxpar.Mesh.from_devices(c, ["x"], [4, 5, 6, 7])
    >>> [round(cross_mesh_plan(a, "R", b, "R", shape=(2**28,), strategy=s).time, 2)
    ...  for s in ("send_recv", "allgather", "broadcast")]       # 1 GiB over 10 Gb/s: 0.86 s
    [3.44, 0.86, 0.86]
    """
    if not isinstance(src_mesh, Mesh) or not isinstance(dst_mesh, Mesh):
        raise ReshardError(f"cross_mesh_plan needs two fxpar Mesh objects, got "
                           f"{type(src_mesh).__name__} and {type(dst_mesh).__name__}")
    if src_mesh.cluster != dst_mesh.cluster:
        raise ReshardError(
            f"cross-mesh reshard: source mesh {src_mesh!r} is on cluster {src_mesh.cluster.name!r} "
            f"({src_mesh.cluster.describe()}) and destination mesh {dst_mesh!r} on cluster "
            f"{dst_mesh.cluster.name!r} ({dst_mesh.cluster.describe()}); both must be over one cluster")
    try:
        shape_t = tuple(int(s) for s in shape)
    except (TypeError, ValueError):
        raise ReshardError(f"cross-mesh reshard: shape {shape!r} is not a sequence of ints") from None
    if any(s < 0 for s in shape_t):
        raise ReshardError(f"cross-mesh reshard: shape {shape_t} has a negative size")
    if strategy not in STRATEGIES:
        raise ReshardError(f"cross-mesh reshard: unknown strategy {strategy!r}; one of {STRATEGIES}")
    dt = as_dtype(dtype)
    s = _check_spec(src_spec, "source", shape_t, src_mesh)
    d = _check_spec(dst_spec, "destination", shape_t, dst_mesh)
    if d.has_partial:
        raise ReshardError(
            f"cross-mesh reshard: destination spec {d} on {dst_mesh!r} (shape {shape_t}) is Partial; "
            f"a cross-mesh transfer delivers values: give R or S(d) there")
    return _plan(src_mesh, s, dst_mesh, d, shape_t, dt, strategy, int(search_budget), time_budget_s)


@functools.lru_cache(maxsize=1024)
def _plan(src_mesh, s, dst_mesh, d, shape, dt, strategy, search_budget, time_budget_s) -> CrossMeshPlan:
    best = None
    cands = _reduced_candidates(s, len(shape)) if s.has_partial else [s]
    for r in cands:
        pre = reshard_plan(s, r, src_mesh, shape, dt) if s.has_partial else None
        tr = _transfer(src_mesh, r, dst_mesh, d, shape, dt, strategy, search_budget, time_budget_s)
        pre_t = pre.time if pre is not None else 0.0
        total = pre_t + tr["local_time"] + tr["transfer_time"]
        if best is None or total < best[0] - 1e-15:
            best = (total, pre, tr, pre_t)
    total, pre, tr, pre_t = best
    return CrossMeshPlan(src_mesh, s, dst_mesh, d, shape, dt, strategy, pre, tr["tasks"], tr["order"],
                         total, pre_t + tr["lower_bound"], tr["transfer_time"], tr["local_time"],
                         tr["scheduler"], tr["schedules"], tr["search_nodes"])


def cross_mesh_time(src_mesh: Mesh, src_spec: Spec | str, dst_mesh: Mesh, dst_spec: Spec | str,
                    shape: Sequence[int], dtype: torch.dtype | str = torch.float32) -> float:
    """Seconds of the planned transfer (``cross_mesh_plan(...).time``, ``strategy="auto"``):
    what a stage boundary between different layouts costs the planner (issue #11 item 3).

    >>> import fxpar
    >>> c = fxpar.Cluster.preset("aws-p3.8xlarge", physics=None, nodes=2)
    >>> m0, m1 = fxpar.Mesh(c, tp=4), fxpar.Mesh(c, tp=4, offset=4)
    >>> cross_mesh_time(m0, "S(0)", m1, "S(0)", (1024, 1024)) < cross_mesh_time(m0, "S(0)", m1, "R", (1024, 1024))
    True
    """
    return cross_mesh_plan(src_mesh, src_spec, dst_mesh, dst_spec, shape=shape, dtype=dtype).time
