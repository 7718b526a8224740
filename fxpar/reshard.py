"""Resharding planner: the cheapest sequence of one-axis steps from one spec to another.

:func:`reshard_plan` runs Dijkstra over specs (states) of a tensor on a mesh. A step changes the
placement of **one** mesh axis ``i``; with ``G`` the size of axis ``i``:

==========================  ==================  ==============================================
placement on axis ``i``     kind                what every device does
==========================  ==================  ==============================================
``S(d) → R``                ``all_gather``      gathers the ``G`` pieces of dim ``d``
``S(d) → S(e)``             ``all_to_all``      gives away dim ``e``'s chunks, gets dim ``d``'s
``P(op) → R``               ``all_reduce``      reduces the ``G`` addends (sum, avg, max, min)
``P(sum|avg) → S(d)``       ``reduce_scatter``  reduces and keeps its chunk of dim ``d``
``R → S(d)``                ``chunk``           keeps its chunk of dim ``d`` (local copy)
``R → P(sum)``              ``to_partial``      coordinate 0 keeps the value, the others zeros
``R → P(avg|max|min)``      ``to_partial``      keeps the value (avg/max/min of copies is it)
``P(sum) ↔ P(avg)``         ``rescale``         multiplies (sum → avg) or divides by ``G``
==========================  ==================  ==============================================

**Which steps are legal, and why.** A dim sharded over several axes is split left to right
(outer axis first, :mod:`fxpar.spec`, as in DTensor): the piece a device holds for dim ``d`` is
chunk ``c_j`` of chunk ``c_i`` of ... along the axes ``i < j`` that shard ``d``. Gathering,
chunking, reduce-scattering or all-to-all-ing dim ``d`` on axis ``i`` is a contiguous operation
on the local tensor only if **no later axis ``j > i`` shards ``d``**: otherwise the data a
device would need is held by other devices in an interleaved order (``S(0)S(0) → RS(0)`` is not
an all-gather on axis 0). Those steps are forbidden; the search goes through the innermost axis
first instead (``S(0)S(0) → S(0)R → RR``), and every pair of specs stays reachable (gather every
axis from the last to the first, then chunk from the first to the last). Partial(max/min) is
only all-reduced, then chunked (no reduce-scatter); ``S → P`` has no direct step (go through
``R``). States mixing reduce ops are allowed only when they commute: one op everywhere, or only
``sum`` and ``avg`` (both linear); ``P(sum)P(max)`` is ambiguous and raises :class:`ReshardError`.

**Cost** of a step: :func:`fxpar.cost.reshard.step_cost` (ring formulas on the local bytes of
the fullest device). Ties are broken by the number of steps, then by the sequence of
intermediate specs as strings, so every rank computes the identical plan. Plans are cached by
``(src, dst, mesh, shape, dtype)``.

**Many pairs at once.** :func:`reshard_cost_table` (and :func:`reshard_costs`, one row of it)
answers ``reshard_plan(s, d).time`` for every source ``s`` and destination ``d`` of two lists:
the planner prices a whole edge matrix with it, per distinct pair of specs. It expands the
state graph of the tensor once (every spec reachable from the sources), then relaxes all
sources at once with numpy (Bellman-Ford, ``D[v] = min(D[v], D[u] + t_uv)`` to the fixed
point); the rows are kept per ``(mesh, shape, dtype, reduce ops)``, so later tables from the
same sources are lookups. The costs are bit-identical to :func:`reshard_plan`'s: both are the
minimum over paths of the left-to-right float sum of step times (times are ``>= 0`` and float
addition is monotone, so any label-correcting fixed point and Dijkstra's settled labels agree,
and the tie-breaking, which only chooses among equal-cost paths, never changes the cost).

>>> from fxpar import Cluster, Mesh
>>> mesh = Mesh(Cluster.preset("perlmutter", nodes=2), dp=2, tp=4)   # dp crosses nodes
>>> plan = reshard_plan("S(0)S(1)", "RR", mesh, (1024, 1024), "float32")
>>> print(plan)
S(0)S(1) -> RS(1) -> RR
>>> print(plan.describe())  # doctest: +NORMALIZE_WHITESPACE
reshard S(0)S(1) -> RR of float32[1024, 1024] on Mesh(dp=2, tp=4 on devices 0..7): 2 steps, 48.5 us
  #  step               collective  axis    bytes  time
  1  S(0)S(1) -> RS(1)  all_gather  dp     524288  29 us
  2  RS(1) -> RR        all_gather  tp    1048576  19.5 us
>>> # chunk over tp (local), reduce-scatter a quarter over the slow dp, gather over tp
>>> print(reshard_plan("P(sum)R", "S(0)R", mesh, (1024, 1024)))
P(sum)R -> P(sum)S(1) -> S(0)S(1) -> S(0)R
"""

from __future__ import annotations

import functools
import heapq
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from fxpar.cost.reshard import LOCAL_KINDS, step_cost
from fxpar.errors import ReshardError, SpecError
from fxpar.spec import Partial, Placement, Replicate, Shard, Spec, as_spec
from fxpar.units import dtype_name, fmt_time

__all__ = ["ReshardPlan", "ReshardStep", "LOCAL_KINDS", "reshard_plan", "reshard_costs", "reshard_cost_table", "step_kind", "as_dtype"]

_LINEAR_OPS = frozenset({"sum", "avg"})


@dataclass(frozen=True)
class ReshardStep:
    """One step of a plan: ``kind`` on mesh axis ``axis`` (named ``axis_name``) turns spec
    ``src`` into ``dst``, moving ``nbytes`` per device (fullest device) in ``time`` seconds.
    Kinds in :data:`LOCAL_KINDS` (``chunk``, ``to_partial``, ``rescale``) move no data."""

    kind: str
    axis: int
    axis_name: str
    src: Spec
    dst: Spec
    nbytes: int
    time: float

    def __str__(self) -> str:
        return f"{self.src} -> {self.dst}: {self.kind} on {self.axis_name} ({fmt_time(self.time)})"


@dataclass(frozen=True, repr=False)
class ReshardPlan:
    """The cheapest ordered steps from ``src`` to ``dst`` for a tensor of ``shape``/``dtype``
    on ``mesh``; ``time`` is the sum of the steps' times. ``str(plan)`` is the chain of specs
    (``S(0)S(1) -> S(0)R -> RR``); :meth:`describe` a table of the steps."""

    src: Spec
    dst: Spec
    mesh: object  # fxpar.Mesh
    shape: tuple[int, ...]
    dtype: torch.dtype
    steps: tuple[ReshardStep, ...]
    time: float

    @property
    def specs(self) -> tuple[Spec, ...]:
        """Every spec along the way, ``src`` first and ``dst`` last."""
        return (self.src,) + tuple(s.dst for s in self.steps)

    @property
    def nbytes(self) -> int:
        """Bytes moved over the network per device (collective steps only)."""
        return sum(s.nbytes for s in self.steps if s.kind not in LOCAL_KINDS)

    def __len__(self) -> int:
        return len(self.steps)

    def __str__(self) -> str:
        return " -> ".join(str(s) for s in self.specs)

    def __repr__(self) -> str:
        return (f"ReshardPlan({self}, shape={self.shape}, {dtype_name(self.dtype)}, "
                f"time={fmt_time(self.time)})")

    def describe(self) -> str:
        """A table: one row per step with its collective, mesh axis name, bytes and time."""
        head = (f"reshard {self.src} -> {self.dst} of {dtype_name(self.dtype)}"
                f"{list(self.shape)} on {self.mesh!r}: {len(self.steps)} step"
                f"{'' if len(self.steps) == 1 else 's'}, {fmt_time(self.time)}")
        if not self.steps:
            return head + " (nothing to do)"
        rows = [("#", "step", "collective", "axis", "bytes", "time")]
        for k, s in enumerate(self.steps, 1):
            rows.append((str(k), f"{s.src} -> {s.dst}", s.kind, s.axis_name, str(s.nbytes),
                         fmt_time(s.time)))
        widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
        lines = ["  " + "  ".join(v.rjust(w) if c in (0, 4) else v.ljust(w)
                                  for c, (v, w) in enumerate(zip(r, widths))).rstrip()
                 for r in rows]
        return "\n".join([head] + lines)


def as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """``torch.float32``, ``"float32"`` or ``"torch.float32"`` → ``torch.float32``."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str):
        d = getattr(torch, dtype.removeprefix("torch."), None)
        if isinstance(d, torch.dtype):
            return d
    raise ReshardError(f"unknown dtype {dtype!r}: give a torch.dtype or its name, e.g. 'float32'")


# -- transitions --------------------------------------------------------------------------
def _later_shards(spec: Spec, axis: int, dim: int) -> bool:
    return any(isinstance(p, Shard) and p.dim == dim for p in spec.placements[axis + 1:])


def _ambiguous_partials(spec: Spec) -> bool:
    ops = {p.reduce_op for p in spec.placements if isinstance(p, Partial)}
    return len(ops) > 1 and not ops <= _LINEAR_OPS


def step_kind(spec: Spec, axis: int, new: Placement) -> str | None:
    """The kind of the step that sets ``spec``'s placement on ``axis`` to ``new``, or ``None``
    if that is not a legal single step (see the module docstring). ``spec`` must be
    normalized (non-negative shard dims)."""
    cur = spec[axis]
    if cur == new:
        return None
    if isinstance(cur, Shard):
        if _later_shards(spec, axis, cur.dim):
            return None  # dim cur.dim is split further by a later axis: not contiguous here
        if isinstance(new, Replicate):
            return "all_gather"
        if isinstance(new, Shard):
            return None if _later_shards(spec, axis, new.dim) else "all_to_all"
        return None  # S -> P: go through R
    if isinstance(cur, Replicate):
        if isinstance(new, Shard):
            return None if _later_shards(spec, axis, new.dim) else "chunk"
        return "to_partial"
    # cur is Partial
    if isinstance(new, Replicate):
        return "all_reduce"
    if isinstance(new, Shard):
        if cur.reduce_op not in _LINEAR_OPS or _later_shards(spec, axis, new.dim):
            return None
        return "reduce_scatter"
    if {cur.reduce_op, new.reduce_op} == _LINEAR_OPS:
        return "rescale"
    return None


def _candidates(ndim: int, ops: Sequence[str]) -> tuple[Placement, ...]:
    return tuple(Shard(d) for d in range(ndim)) + (Replicate(),) + tuple(Partial(o) for o in ops)


def _moves_slow(spec: Spec, ndim: int, ops: Sequence[str]) -> Iterable[tuple[str, int, Spec]]:
    """Reference for :func:`_moves` (same steps, same order), written with :func:`step_kind`."""
    cands = _candidates(ndim, ops)
    for axis in range(len(spec)):
        for p in cands:
            kind = step_kind(spec, axis, p)
            if kind is None:
                continue
            nxt = spec.with_axis(axis, p)
            if not _ambiguous_partials(nxt):
                yield kind, axis, nxt


_CODES: dict[type, str] = {}


def _code(p) -> tuple:
    """``("S", dim)``, ``("R",)`` or ``("P", op)``; the class test is cached per type
    (``isinstance`` on torch placements is slow)."""
    t = type(p)
    c = _CODES.get(t)
    if c is None:
        c = _CODES[t] = ("S" if isinstance(p, Shard) else "R" if isinstance(p, Replicate)
                         else "P" if isinstance(p, Partial) else "?")
    if c == "S":
        return ("S", p.dim)
    if c == "P":
        return ("P", p.reduce_op)
    return (c,)


def _fast_spec(placements: tuple) -> Spec:
    # placements taken from valid specs and candidates: skip re-validation
    s = object.__new__(Spec)
    object.__setattr__(s, "placements", placements)
    return s


def _moves(spec: Spec, ndim: int, ops: Sequence[str]) -> list[tuple[str, int, Spec]]:
    """Every legal one-axis step out of ``spec``: ``(kind, axis, next_spec)``; the legality of
    :func:`step_kind` (module docstring), in the order of :func:`_moves_slow`."""
    cands = _candidates(ndim, ops)
    ccodes = [_code(p) for p in cands]
    pls = spec.placements
    codes = [_code(p) for p in pls]
    if "?" in {c[0] for c in codes}:
        return list(_moves_slow(spec, ndim, ops))
    n = len(pls)

    def later(axis: int, dim: int) -> bool:
        return any(c[0] == "S" and c[1] == dim for c in codes[axis + 1:])

    out = []
    for axis in range(n):
        cur = codes[axis]
        for p, new in zip(cands, ccodes):
            if cur == new:
                continue
            kind = None
            if cur[0] == "S":
                if later(axis, cur[1]):
                    continue
                if new[0] == "R":
                    kind = "all_gather"
                elif new[0] == "S":
                    kind = None if later(axis, new[1]) else "all_to_all"
            elif cur[0] == "R":
                if new[0] == "S":
                    kind = None if later(axis, new[1]) else "chunk"
                else:
                    kind = "to_partial"
            else:
                if new[0] == "R":
                    kind = "all_reduce"
                elif new[0] == "S":
                    kind = None if cur[1] not in _LINEAR_OPS or later(axis, new[1]) else "reduce_scatter"
                elif {cur[1], new[1]} == _LINEAR_OPS:
                    kind = "rescale"
            if kind is None:
                continue
            nops = {c[1] for a, c in enumerate(codes) if a != axis and c[0] == "P"}
            if new[0] == "P":
                nops.add(new[1])
            if len(nops) > 1 and not nops <= _LINEAR_OPS:
                continue
            out.append((kind, axis, _fast_spec(pls[:axis] + (p,) + pls[axis + 1:])))
    return out


# -- validation ---------------------------------------------------------------------------
def _validate(spec, role: str, shape: tuple[int, ...], mesh) -> Spec:
    try:
        s = as_spec(spec)
        s.check(shape, mesh.shape)
    except SpecError as e:
        raise SpecError(f"reshard {role} spec: {e} (mesh {mesh!r})") from None
    s = s.normalized(len(shape))
    if _ambiguous_partials(s):
        axes = {mesh.axis_names[i]: p.reduce_op for i, p in enumerate(s) if isinstance(p, Partial)}
        raise ReshardError(
            f"reshard {role} spec {s} mixes reduce ops that do not commute on mesh axes {axes} "
            f"(tensor shape {shape}): only one op, or only sum and avg, can be partial at once")
    return s


def reshard_plan(src: Spec | str, dst: Spec | str, mesh, shape: Sequence[int],
                 dtype: torch.dtype | str = torch.float32) -> ReshardPlan:
    """The cheapest plan turning a tensor of ``shape``/``dtype`` laid out as ``src`` on
    ``mesh`` (an :class:`fxpar.Mesh`) into layout ``dst``.

    Specs may be :class:`Spec` or strings (``"S(0)R"``); both are checked against ``shape``
    and ``mesh`` (:class:`SpecError` naming the spec, shape and mesh). Same ``src`` and
    ``dst`` give an empty plan of time 0. Raises :class:`ReshardError` for specs that mix
    non-commuting reduce ops.
    """
    shape = tuple(int(s) for s in shape)
    dt = as_dtype(dtype)
    s = _validate(src, "source", shape, mesh)
    d = _validate(dst, "destination", shape, mesh)
    return _plan(s, d, mesh, shape, dt)


def _ops_of(*specs: Spec) -> tuple[str, ...]:
    return tuple(sorted({p.reduce_op for s in specs for p in s.placements if isinstance(p, Partial)}))


class _Tensor:
    """Per ``(shape, dtype, mesh)``: validated normalized specs, their reduce ops, and the
    state graphs by reduce ops (shared with :func:`reshard_plan` through :func:`_graph`)."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, mesh):
        self.shape, self.dtype, self.mesh = shape, dtype, mesh
        self.checked: dict[tuple, tuple[Spec, frozenset]] = {}
        self.graphs: dict[tuple[str, ...], _Graph] = {}

    def spec(self, spec, role: str) -> tuple[Spec, frozenset]:
        key = (spec, role)
        got = self.checked.get(key)
        if got is None:
            s = _validate(spec, role, self.shape, self.mesh)
            got = self.checked[key] = (s, frozenset(_ops_of(s)))
        return got

    def graph(self, ops: tuple[str, ...]) -> _Graph:
        g = self.graphs.get(ops)
        if g is None:
            g = self.graphs[ops] = _graph(self.mesh, self.shape, self.dtype, ops)
        return g


@functools.lru_cache(maxsize=256)
def _tensor(shape: tuple[int, ...], dtype: torch.dtype, mesh) -> _Tensor:
    return _Tensor(shape, dtype, mesh)


def reshard_cost_table(srcs: Sequence[Spec | str], dsts: Sequence[Spec | str], mesh,
                       shape: Sequence[int], dtype: torch.dtype | str = torch.float32) -> np.ndarray:
    """``T[a, b] = reshard_plan(srcs[a], dsts[b], mesh, shape, dtype).time`` (float64 array),
    all sources relaxed at once per reduce-op group (module docstring).
    Specs are validated once each (same errors as :func:`reshard_plan`)."""
    shape = tuple(int(x) for x in shape)
    tens = _tensor(shape, as_dtype(dtype), mesh)
    S = [tens.spec(x, "source") for x in srcs]
    D = [tens.spec(x, "destination") for x in dsts]
    by_ops: dict[frozenset, list[int]] = {}
    for b, (_, ops) in enumerate(D):
        by_ops.setdefault(ops, []).append(b)
    T = np.zeros((len(S), len(D)))
    goal_ids: dict[tuple, np.ndarray] = {}
    work: dict[tuple[str, ...], list[tuple[int, list[int]]]] = {}
    for a, (s, s_ops) in enumerate(S):
        groups: dict[tuple[str, ...], list[int]] = {}
        for d_ops, bs in by_ops.items():
            groups.setdefault(tuple(sorted(s_ops | d_ops)), []).extend(bs)
        for ops, bs in groups.items():
            work.setdefault(ops, []).append((a, bs))
    for ops, items in work.items():
        g = tens.graph(ops)
        starts = [g.id(S[a][0]) for a, _ in items]
        rows = g.table(starts)
        for (a, bs), st in zip(items, starts):
            ids = goal_ids.get((ops, tuple(bs)))
            if ids is None:
                ids = goal_ids[ops, tuple(bs)] = np.array([g.id(D[b][0]) for b in bs], np.int64)
            row = rows[st]
            if ids.size and (ids.max() >= row.size or not np.all(np.isfinite(row[ids]))):
                raise ReshardError(f"no resharding path from {S[a][0]} for shape {shape} on {mesh!r}")
            T[a, bs] = row[ids]
    return T


def reshard_costs(src: Spec | str, dsts: Sequence[Spec | str], mesh, shape: Sequence[int],
                  dtype: torch.dtype | str = torch.float32) -> list[float]:
    """``[reshard_plan(src, d, mesh, shape, dtype).time for d in dsts]``: one row of
    :func:`reshard_cost_table` (module docstring).

    >>> from fxpar import Cluster, Mesh
    >>> mesh = Mesh(Cluster.preset("perlmutter", nodes=2), dp=2, tp=4)
    >>> ts = reshard_costs("S(0)S(1)", ["RR", "S(0)S(1)", "S(0)R"], mesh, (1024, 1024))
    >>> ts == [reshard_plan("S(0)S(1)", d, mesh, (1024, 1024)).time for d in ("RR", "S(0)S(1)", "S(0)R")]
    True
    """
    return reshard_cost_table([src], dsts, mesh, shape, dtype)[0].tolist()


class _Graph:
    """The state graph of one ``(mesh, shape, dtype, reduce ops)``: specs interned as ints
    (hashing a Spec hashes its placements in Python: slow), each state's outgoing steps with
    their costs computed on first visit and kept, so plans for many pairs of specs of the same
    tensor share them."""

    def __init__(self, mesh, shape: tuple[int, ...], dtype: torch.dtype, ops: tuple[str, ...]):
        self.mesh, self.shape, self.dtype, self.ops = mesh, shape, dtype, ops
        self.ids: dict[Spec, int] = {}
        self.names: list[str] = []
        self.specs: list[Spec] = []
        self._out: list[tuple | None] = []
        self._closed = 0                        # states 0.._closed-1 are in the edge arrays
        self._arrays: tuple | None = None       # (U, W, targets, first) for table()
        self._rows: dict[int, np.ndarray] = {}  # source -> min time to every closed state

    def id(self, spec: Spec) -> int:
        i = self.ids.get(spec)
        if i is None:
            i = self.ids[spec] = len(self.specs)
            self.specs.append(spec)
            self.names.append(str(spec))
            self._out.append(None)
        return i

    def out(self, i: int) -> tuple[tuple[float, int, ReshardStep], ...]:
        """``(time, next state id, step)`` for every legal step out of state ``i``."""
        got = self._out[i]
        if got is None:
            spec, edges = self.specs[i], []
            for kind, axis, nxt in _moves(spec, len(self.shape), self.ops):
                nbytes, t = step_cost(kind, spec, nxt, self.mesh, axis, self.shape, self.dtype)
                step = ReshardStep(kind, axis, self.mesh.axis_names[axis], spec, nxt, nbytes, t)
                edges.append((t, self.id(nxt), step))
            got = self._out[i] = tuple(edges)
        return got

    def closure(self, starts: Sequence[int]) -> None:
        """Expand every state reachable from the known states (``starts`` among them) and
        build the edge arrays ``(U, W, targets, first)`` (edges sorted by target) over them,
        unless ``starts`` are already in the arrays."""
        if self._arrays is not None and all(i < self._closed for i in starts):
            return
        stack = list(range(len(self.specs)))
        seen = set(stack)
        while stack:
            for _, j, _ in self.out(stack.pop()):
                if j not in seen:
                    seen.add(j)
                    stack.append(j)
        U, V, W = [], [], []
        for i in range(len(self.specs)):
            for t, j, _ in self._out[i]:
                U.append(i)
                V.append(j)
                W.append(t)
        U, V, W = np.array(U, np.int64), np.array(V, np.int64), np.array(W, np.float64)
        order = np.argsort(V, kind="stable")
        tgt, first = np.unique(V[order], return_index=True)
        self._arrays = (U[order], W[order], tgt, first)
        self._closed = len(self.specs)

    def table(self, starts: Sequence[int]) -> dict[int, np.ndarray]:
        """Minimum time from each of ``starts`` to every state (rows over state ids): a
        Bellman-Ford relaxation of all sources at once, ``D[v] = min(D[v], D[u] + w)`` to the
        fixed point. That fixed point is the minimum over paths of the left-to-right float sum
        of step times (times are >= 0 and float addition is monotone), i.e. exactly the cost
        Dijkstra settles, bit for bit (:func:`reshard_plan`)."""
        need = sorted({i for i in starts if i not in self._rows})
        if need:
            self.closure(need)
            U, W, tgt, first = self._arrays
            n = self._closed
            for b in range(0, len(need), 64):
                blk = need[b:b + 64]
                D = np.full((len(blk), n), np.inf)
                D[np.arange(len(blk)), blk] = 0.0
                while True:
                    cand = D[:, U] + W
                    red = np.minimum.reduceat(cand, first, axis=1)
                    new = np.minimum(D[:, tgt], red)
                    if np.array_equal(new, D[:, tgt]):
                        break
                    D[:, tgt] = new
                for r, i in enumerate(blk):
                    self._rows[i] = D[r]
        return {i: self._rows[i] for i in starts}


@functools.lru_cache(maxsize=256)
def _graph(mesh, shape: tuple[int, ...], dtype: torch.dtype, ops: tuple[str, ...]) -> _Graph:
    return _Graph(mesh, shape, dtype, ops)


@functools.lru_cache(maxsize=4096)
def _plan(src: Spec, dst: Spec, mesh, shape: tuple[int, ...], dtype: torch.dtype) -> ReshardPlan:
    # Partial states use only the reduce ops of src and dst: another op is never cheaper
    # (R -> P -> S costs a reduce-scatter where R -> S is a local chunk).
    ops = _ops_of(src, dst)
    g = _graph(mesh, shape, dtype, ops)
    start, goal = g.id(src), g.id(dst)
    names = g.names
    # Heap entries: (cost, n_steps, path as spec strings, state, steps). The key
    # (cost, n_steps, path) is unique per path and only grows along a path, so Dijkstra settles
    # each state with its smallest key: the same plan on every rank.
    heap = [(0.0, 0, (names[start],), start, ())]
    done: set[int] = set()
    while heap:
        cost, n, path, i, steps = heapq.heappop(heap)
        if i in done:
            continue
        done.add(i)
        if i == goal:
            return ReshardPlan(src, dst, mesh, shape, dtype, steps, cost)
        for t, j, step in g.out(i):
            if j not in done:
                heapq.heappush(heap, (cost + t, n + 1, path + (names[j],), j, steps + (step,)))
    # Unreachable by construction (gather all, then chunk all); kept as a guard.
    raise ReshardError(f"no resharding path from {src} to {dst} for shape {shape} on {mesh!r}")
