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
``S(d,f) → R``              ``all_gather``      gathers, then puts each group's pieces together
``R → S(d,f)``              ``chunk``           keeps its chunk of each of the ``f`` groups
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
the planner prices a whole edge matrix with it, per distinct pair of specs. The state graph
(which steps are legal) depends only on the tensor's rank, the number of mesh axes and the
reduce ops, so it is expanded once per such triple and shared by every shape; a tensor's
step costs are computed for all edges at once (per-state local sizes, one
:func:`~fxpar.cost.reshard.step_time` per distinct ``(kind, bytes, axis)``); then all
sources are relaxed at once with numpy (Bellman-Ford, ``D[v] = min(D[v], D[u] + t_uv)`` to
the fixed point, each round only from the states that improved); the rows are kept per
``(mesh, shape, dtype, reduce ops)``, so later tables from the same sources are lookups.
:func:`reshard_cost_tables` answers many tables at once: the sources of every shape of one
state topology are relaxed together, as columns with their own step costs (a model has
hundreds of small shapes). :func:`reshard_plan`'s search reads the same topology and step
costs and makes :class:`ReshardStep` objects for its path only. The costs are bit-identical
to :func:`reshard_plan`'s: both are the minimum over paths of the left-to-right float sum of step times (times are ``>= 0`` and float
addition is monotone, so any label-correcting fixed point and Dijkstra's settled labels agree,
and the tie-breaking, which only chooses among equal-cost paths, never changes the cost).

>>> from fxpar import Cluster, Mesh
>>> mesh = Mesh(Cluster.preset("perlmutter", physics=None, nodes=2), dp=2, tp=4)   # dp crosses nodes
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

from fxpar.cost.reshard import LOCAL_KINDS, StepKind, step_cost, step_time
from fxpar.errors import ReshardError, SpecError
from fxpar.spec import (Partial, Placement, Replicate, Shard, Spec, as_spec, placement_kind,
                        placement_str, trusted_spec)
from fxpar.units import dtype_name, fmt_time

__all__ = ["ReshardPlan", "ReshardStep", "LOCAL_KINDS", "reshard_plan", "reshard_costs", "reshard_cost_table", "reshard_cost_tables", "step_kind", "as_dtype"]

_LINEAR_OPS = frozenset({"sum", "avg"})


@dataclass(frozen=True)
class ReshardStep:
    """One step of a plan: ``kind`` on mesh axis ``axis`` (named ``axis_name``) turns spec
    ``src`` into ``dst``, moving ``nbytes`` per device (fullest device) in ``time`` seconds.
    Kinds in :data:`LOCAL_KINDS` (``chunk``, ``to_partial``, ``rescale``) move no data."""

    kind: StepKind
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
    return any(placement_kind(p) == "S" and p.dim == dim for p in spec.placements[axis + 1:]) \
        or _strided_elsewhere(spec, axis, dim)


def _strided_elsewhere(spec: Spec, axis: int, dim: int) -> bool:
    # a strided dim is sharded by its one axis only (fxpar.spec): nothing else may split it
    return any(placement_kind(p) == "T" and p.dim == dim for a, p in enumerate(spec.placements) if a != axis)


def _ambiguous_partials(spec: Spec) -> bool:
    ops = {p.reduce_op for p in spec.placements if isinstance(p, Partial)}
    return len(ops) > 1 and not ops <= _LINEAR_OPS


def step_kind(spec: Spec, axis: int, new: Placement) -> StepKind | None:
    """The kind of the step that sets ``spec``'s placement on ``axis`` to ``new``, or ``None``
    if that is not a legal single step (see the module docstring). ``spec`` must be
    normalized (non-negative shard dims)."""
    cur = spec[axis]
    if cur == new:
        return None
    kc, kn = placement_kind(cur), placement_kind(new)
    if kc == "T":   # a strided shard only gathers (its groups interleave: no other collective)
        return StepKind.ALL_GATHER if kn == "R" else None
    if kn == "T":   # ... and is only cut out of a replica
        return StepKind.CHUNK if kc == "R" and not _strided_elsewhere(spec, axis, new.dim) \
            and not any(placement_kind(p) == "S" and p.dim == new.dim for p in spec.placements) else None
    if isinstance(cur, Shard):
        if _later_shards(spec, axis, cur.dim):
            return None  # dim cur.dim is split further by a later axis: not contiguous here
        if isinstance(new, Replicate):
            return StepKind.ALL_GATHER
        if isinstance(new, Shard):
            return None if _later_shards(spec, axis, new.dim) else StepKind.ALL_TO_ALL
        return None  # S -> P: go through R
    if isinstance(cur, Replicate):
        if isinstance(new, Shard):
            return None if _later_shards(spec, axis, new.dim) else StepKind.CHUNK
        return StepKind.TO_PARTIAL
    # cur is Partial
    if isinstance(new, Replicate):
        return StepKind.ALL_REDUCE
    if isinstance(new, Shard):
        if cur.reduce_op not in _LINEAR_OPS or _later_shards(spec, axis, new.dim):
            return None
        return StepKind.REDUCE_SCATTER
    if {cur.reduce_op, new.reduce_op} == _LINEAR_OPS:
        return StepKind.RESCALE
    return None


def _candidates(ndim: int, ops: Sequence[str]) -> tuple[Placement, ...]:
    # ``ops``: the reduce ops of the partial states, and the strided placements (``S(d,f)``)
    # of the endpoints, the only ones a path ever needs
    return tuple(Shard(d) for d in range(ndim)) + (Replicate(),) + tuple(
        Spec.parse(o).placements[0] if o.startswith("S(") else Partial(o) for o in ops)


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
        c = _CODES[t] = placement_kind(p) or "?"
    if c == "T":
        return ("T", p.dim, p.split_factor)
    if c == "S":
        return ("S", p.dim)
    if c == "P":
        return ("P", p.reduce_op)
    return (c,)


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
        return any(c[0] == "S" and c[1] == dim for c in codes[axis + 1:]) or \
            any(c[0] == "T" and c[1] == dim for a, c in enumerate(codes) if a != axis)

    out = []
    for axis in range(n):
        cur = codes[axis]
        for p, new in zip(cands, ccodes):
            if cur == new:
                continue
            kind = None
            if cur[0] == "T" or new[0] == "T":   # strided: gathered, or cut out of a replica
                if new[0] == "R":
                    kind = StepKind.ALL_GATHER
                elif cur[0] == "R" and not any(c[0] in "ST" and c[1] == new[1] for c in codes):
                    kind = StepKind.CHUNK
            elif cur[0] == "S":
                if later(axis, cur[1]):
                    continue
                if new[0] == "R":
                    kind = StepKind.ALL_GATHER
                elif new[0] == "S":
                    kind = None if later(axis, new[1]) else StepKind.ALL_TO_ALL
            elif cur[0] == "R":
                if new[0] == "S":
                    kind = None if later(axis, new[1]) else StepKind.CHUNK
                else:
                    kind = StepKind.TO_PARTIAL
            else:
                if new[0] == "R":
                    kind = StepKind.ALL_REDUCE
                elif new[0] == "S":
                    kind = None if cur[1] not in _LINEAR_OPS or later(axis, new[1]) else StepKind.REDUCE_SCATTER
                elif {cur[1], new[1]} == _LINEAR_OPS:
                    kind = StepKind.RESCALE
            if kind is None:
                continue
            nops = {c[1] for a, c in enumerate(codes) if a != axis and c[0] == "P"}
            if new[0] == "P":
                nops.add(new[1])
            if len(nops) > 1 and not nops <= _LINEAR_OPS:
                continue
            out.append((kind, axis, trusted_spec(pls[:axis] + (p,) + pls[axis + 1:])))
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
    """The reduce ops of the specs' partials and their strided placements (as ``S(d,f)``):
    what a state graph between them is made of besides ``S(d)`` and ``R`` (:func:`_candidates`)."""
    return tuple(sorted({p.reduce_op if placement_kind(p) == "P" else placement_str(p)
                         for s in specs for p in s.placements if placement_kind(p) in ("P", "T")}))


class _Tensor:
    """Per ``(shape, dtype, mesh)``: validated normalized specs, their reduce ops, and the
    state graphs by reduce ops (shared with :func:`reshard_plan` through :func:`_graph`)."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, mesh):
        self.shape, self.dtype, self.mesh = shape, dtype, mesh
        # a spec without strided placements checks the same against every tensor of this
        # rank (its dims in range, normalized by the rank alone): shared across shapes
        self.by_rank = _checked_by_rank(len(shape), mesh)
        self.checked: dict[tuple, tuple[Spec, frozenset]] = {}
        self.graphs: dict[tuple[str, ...], _Graph] = {}

    def spec(self, spec, role: str) -> tuple[Spec, frozenset]:
        key = (spec, role)
        got = self.by_rank.get(key) or self.checked.get(key)
        if got is None:
            s = _validate(spec, role, self.shape, self.mesh)
            got = (s, frozenset(_ops_of(s)))
            (self.checked if s.is_strided else self.by_rank)[key] = got
        return got

    def graph(self, ops: tuple[str, ...]) -> _Graph:
        g = self.graphs.get(ops)
        if g is None:
            g = self.graphs[ops] = _graph(self.mesh, self.shape, self.dtype, ops)
        return g


@functools.lru_cache(maxsize=64)
def _checked_by_rank(ndim: int, mesh) -> dict:
    return {}


@functools.lru_cache(maxsize=256)
def _tensor(shape: tuple[int, ...], dtype: torch.dtype, mesh) -> _Tensor:
    return _Tensor(shape, dtype, mesh)


def reshard_cost_table(srcs: Sequence[Spec | str], dsts: Sequence[Spec | str], mesh,
                       shape: Sequence[int], dtype: torch.dtype | str = torch.float32) -> np.ndarray:
    """``T[a, b] = reshard_plan(srcs[a], dsts[b], mesh, shape, dtype).time`` (float64 array),
    all sources relaxed at once per reduce-op group (module docstring).
    Specs are validated once each (same errors as :func:`reshard_plan`)."""
    return reshard_cost_tables([(srcs, dsts, mesh, shape, dtype)])[0]


def reshard_cost_tables(requests: Sequence[tuple]) -> list[np.ndarray]:
    """``[reshard_cost_table(*r) for r in requests]`` (each ``r`` is ``(srcs, dsts, mesh,
    shape, dtype)``), with the sources of every table whose tensors share a state topology
    (rank, mesh axes, reduce ops) relaxed together as the columns of one Bellman-Ford, each
    column with its own tensor's step costs: a model's hundreds of small shapes cost a few
    numpy rounds per topology instead of per shape. Same costs, bit for bit.

    >>> from fxpar import Cluster, Mesh
    >>> mesh = Mesh(Cluster.preset("dgx-a100"), dp=2, tp=4)
    >>> reqs = [(["S(0)S(1)", "RR"], ["RS(1)", "S(0)R"], mesh, (64, n), "float32") for n in (8, 12)]
    >>> all((t == reshard_cost_table(*r)).all() for t, r in zip(reshard_cost_tables(reqs), reqs))
    True
    """
    jobs = [_table_job(*r) for r in requests]
    graphs = {id(g): g for _, work in jobs for g, _ in work}
    cols: dict[_Topology, dict[tuple[int, int], tuple[_Graph, int]]] = {}
    for g in graphs.values():
        g.weights()  # every state is interned by now: rows of a grown graph are dropped here
    for _, work in jobs:
        for g, items in work:
            for starts, _, _, _ in items:
                for i in starts.tolist():
                    if i not in g._rows:
                        cols.setdefault(g.topo, {})[id(g), i] = (g, i)
    for topo, c in cols.items():
        _relax(topo, list(c.values()))
    out = []
    for (T, shape, mesh), work in jobs:
        for g, items in work:
            for starts, srcs, goals, bs in items:
                T[np.ix_(srcs, bs)] = np.stack([g._rows[i] for i in starts.tolist()])[:, goals]
        if not np.isfinite(T).all():   # unreachable by construction (gather all, chunk all)
            a = int(np.flatnonzero(~np.isfinite(T).all(axis=1))[0])
            raise ReshardError(f"no resharding path from {requests[len(out)][0][a]} for shape "
                               f"{shape} on {mesh!r}")
        out.append(T)
    return out


def _table_job(srcs, dsts, mesh, shape, dtype):
    """``((T, shape, mesh), work)``: the zero table to fill, and per state graph the start
    states, the rows of ``T`` they fill, the goal states and the columns they fill."""
    shape = tuple(int(x) for x in shape)
    tens = _tensor(shape, as_dtype(dtype), mesh)
    S = [tens.spec(x, "source") for x in srcs]
    D = [tens.spec(x, "destination") for x in dsts]
    by_ops: dict[frozenset, list[int]] = {}
    for b, (_, ops) in enumerate(D):
        by_ops.setdefault(ops, []).append(b)
    work: dict[tuple[str, ...], dict[tuple[int, ...], list[int]]] = {}
    for a, (s, s_ops) in enumerate(S):
        groups: dict[tuple[str, ...], list[int]] = {}
        for d_ops, bs in by_ops.items():
            groups.setdefault(tuple(sorted(s_ops | d_ops)), []).extend(bs)
        for ops, bs in groups.items():
            work.setdefault(ops, {}).setdefault(tuple(bs), []).append(a)
    graphs = []
    for ops, by_goals in work.items():
        g = tens.graph(ops)
        graphs.append((g, [(np.array([g.id(S[a][0]) for a in srcs], np.int64), srcs,
                            np.array([g.id(D[b][0]) for b in bs], np.int64), bs)
                           for bs, srcs in by_goals.items()]))
    return (np.zeros((len(S), len(D))), shape, mesh), graphs


def reshard_costs(src: Spec | str, dsts: Sequence[Spec | str], mesh, shape: Sequence[int],
                  dtype: torch.dtype | str = torch.float32) -> list[float]:
    """``[reshard_plan(src, d, mesh, shape, dtype).time for d in dsts]``: one row of
    :func:`reshard_cost_table` (module docstring).

    >>> from fxpar import Cluster, Mesh
    >>> mesh = Mesh(Cluster.preset("perlmutter", physics=None, nodes=2), dp=2, tp=4)
    >>> ts = reshard_costs("S(0)S(1)", ["RR", "S(0)S(1)", "S(0)R"], mesh, (1024, 1024))
    >>> ts == [reshard_plan("S(0)S(1)", d, mesh, (1024, 1024)).time for d in ("RR", "S(0)S(1)", "S(0)R")]
    True
    """
    return reshard_cost_table([src], dsts, mesh, shape, dtype)[0].tolist()


_KINDS = tuple(StepKind)  # a step kind's index in the edge arrays


class _Topology:
    """The steps between specs of a tensor with ``ndim`` dims on ``naxes`` mesh axes whose
    partials use only ``ops``: which step is legal (:func:`_moves`) does not depend on the
    shape, the dtype or the axis sizes, so every tensor of that rank shares one state graph
    and only its step costs differ. States are interned as ints (hashing a Spec hashes its
    placements in Python: slow); the graph is expanded from the all-``R`` spec, from which
    every spec is reachable (module docstring), and grows if a spec outside it is asked for.
    Per edge: ``U``, ``V`` (states), ``K`` (index into ``_KINDS``), ``A`` (mesh axis)."""

    def __init__(self, ndim: int, naxes: int, ops: tuple[str, ...]):
        self.ndim, self.naxes, self.ops = ndim, naxes, ops
        self.ids: dict[Spec, int] = {}
        self.specs: list[Spec] = []
        self.names: list[str] = []
        self._edges: list[tuple[int, int, int, int]] = []
        self._arrays: tuple | None = None
        self._derived: dict = {}   # per-edge/per-state arrays made from the arrays
        # id(spec) -> (spec, state): callers ask with the same few Spec objects again and
        # again, and an equal-but-distinct key costs a dataclass __eq__ per lookup in ``ids``
        self._seen: dict[int, tuple[Spec, int]] = {}
        self.id(trusted_spec((Replicate(),) * naxes))

    def id(self, spec: Spec) -> int:
        got = self._seen.get(id(spec))
        if got is not None and got[0] is spec:
            return got[1]
        i = self.ids.get(spec)
        if i is None:
            self._expand(spec)
            i = self.ids[spec]
        self._seen[id(spec)] = (spec, i)   # keeps spec alive: its id is not reused
        return i

    def _expand(self, spec: Spec) -> None:
        kind_ix = {k: n for n, k in enumerate(_KINDS)}
        stack = [self._add(spec)]
        while stack:
            i = stack.pop()
            for kind, axis, nxt in _moves(self.specs[i], self.ndim, self.ops):
                j = self.ids.get(nxt)
                if j is None:
                    j = self._add(nxt)
                    stack.append(j)
                self._edges.append((i, j, kind_ix[kind], axis))
        self._arrays = None

    def _add(self, spec: Spec) -> int:
        i = self.ids[spec] = len(self.specs)
        self.specs.append(spec)
        self.names.append(str(spec))
        return i

    def arrays(self) -> tuple[np.ndarray, ...]:
        """``(U, V, K, A)`` over every edge, sorted by target ``V`` (stable)."""
        if self._arrays is None:
            e = np.array(self._edges, np.int64).reshape(-1, 4)
            e = e[np.argsort(e[:, 1], kind="stable")]
            self._arrays = (e[:, 0].copy(), e[:, 1].copy(), e[:, 2].copy(), e[:, 3].copy())
            self._derived = {}
        return self._arrays

    def splits(self, mesh_shape: tuple[int, ...]) -> np.ndarray:
        """``G[state, dim]``: how many pieces the state splits each dim into (the product of
        the sizes of the axes sharding it): the fullest device keeps ``ceil(n / G)`` of a dim
        of size ``n``, as :func:`fxpar.cost.reshard.max_local_shape` nests one ceiling per
        axis (``ceil(ceil(n/a)/b) = ceil(n/(a·b))``)."""
        self.arrays()
        key = ("splits", mesh_shape)
        got = self._derived.get(key)
        if got is None:
            got = np.ones((len(self.specs), self.ndim), np.int64)
            for i, sp in enumerate(self.specs):
                for a, pl in enumerate(sp.placements):
                    if placement_kind(pl) in ("S", "T"):
                        got[i, pl.dim] *= mesh_shape[a]
            self._derived[key] = got
        return got

    def out_edges(self) -> list[list[int]]:
        """Per state, the indices (order of :meth:`arrays`) of the edges out of it."""
        U = self.arrays()[0]
        got = self._derived.get("out")
        if got is None:
            got = self._derived["out"] = [[] for _ in self.specs]
            for e, u in enumerate(U.tolist()):
                got[u].append(e)
        return got

    def targets(self) -> list[int]:
        """Per edge (order of :meth:`arrays`), its target state, as Python ints."""
        V = self.arrays()[1]
        got = self._derived.get("targets")
        if got is None:
            got = self._derived["targets"] = V.tolist()
        return got

    def to_sum(self) -> np.ndarray:
        """Per edge (order of :meth:`arrays`): a ``TO_PARTIAL`` step whose new placement is
        ``Partial(sum)`` (the only one that writes: the other ranks zero their copy)."""
        U, V, K, A = self.arrays()
        got = self._derived.get("to_sum")
        if got is None:
            tp = _KINDS.index(StepKind.TO_PARTIAL)
            got = np.array([k == tp and self.specs[v][a].reduce_op == "sum"
                            for v, k, a in zip(V.tolist(), K.tolist(), A.tolist())], bool)
            self._derived["to_sum"] = got
        return got


@functools.lru_cache(maxsize=64)
def _topology(ndim: int, naxes: int, ops: tuple[str, ...]) -> _Topology:
    return _Topology(ndim, naxes, ops)


class _Graph:
    """The state graph of one ``(mesh, shape, dtype, reduce ops)``: the shared
    :class:`_Topology` with this tensor's step costs, all at once (:meth:`weights`), for
    :func:`_relax` and for :func:`reshard_plan`'s search (steps are made for a plan's path
    only), and the minimum-time rows found from each source so far (``_rows``)."""

    def __init__(self, mesh, shape: tuple[int, ...], dtype: torch.dtype, ops: tuple[str, ...]):
        self.mesh, self.shape, self.dtype, self.ops = mesh, shape, dtype, ops
        self.topo = _topology(len(shape), len(mesh.shape), ops)
        self.ids, self.names, self.specs = self.topo.ids, self.topo.names, self.topo.specs
        self._weights: tuple[int, np.ndarray] | None = None   # (edges, W)
        self._wlist: list[float] = []                          # W as Python floats
        self._rows: dict[int, np.ndarray] = {}  # source -> min time to every state (_relax)

    def id(self, spec: Spec) -> int:
        return self.topo.id(spec)

    def step(self, e: int) -> ReshardStep:
        """The :class:`ReshardStep` of edge ``e`` (order of :meth:`_Topology.arrays`): its
        time is ``weights()[e]``, which equals ``step_cost(...)[1]`` bit for bit."""
        U, V, K, A = self.topo.arrays()
        kind, axis, u, v = _KINDS[int(K[e])], int(A[e]), self.specs[int(U[e])], self.specs[int(V[e])]
        nbytes, _ = step_cost(kind, u, v, self.mesh, axis, self.shape, self.dtype)
        return ReshardStep(kind, axis, self.mesh.axis_names[axis], u, v, nbytes,
                           float(self.weights()[e]))

    def weights(self) -> np.ndarray:
        """Every edge's time (order of :meth:`_Topology.arrays`), exactly
        ``step_cost(kind, u, v, mesh, axis, shape, dtype)[1]``: the same ``step_bytes``
        rules on per-state local sizes, and :func:`step_time` once per distinct
        ``(kind, bytes, axis)``."""
        U, V, K, A = self.topo.arrays()
        if self._weights is not None and self._weights[0] == U.size:
            return self._weights[1]
        ms = tuple(self.mesh.shape)
        shape = np.array(self.shape, np.int64)
        numel = (-(-shape // self.topo.splits(ms))).prod(axis=1)
        chunk, to_partial = _KINDS.index(StepKind.CHUNK), _KINDS.index(StepKind.TO_PARTIAL)
        nbytes = np.where(K == chunk, numel[V], numel[U]) * self.dtype.itemsize
        # only Partial(sum) writes anything, and not on an axis of size 1
        writes = self.topo.to_sum() & (np.array(ms, np.int64)[A] > 1)
        nbytes = np.where((K == to_partial) & ~writes, 0, nbytes)
        # one key per distinct (kind, bytes, axis): bytes < 2**52 leaves room for both
        nk, na = len(_KINDS), len(ms)
        uniq, inv = np.unique((nbytes * nk + K) * na + A, return_inverse=True)
        times = np.array([step_time(_KINDS[u // na % nk], u // (na * nk), self.mesh, u % na)
                          for u in uniq.tolist()])
        W = times[inv.reshape(-1)]
        self._weights = (U.size, W)
        self._wlist = W.tolist()
        self._rows.clear()   # the graph grew (never in practice): rows are recomputed
        return W


#: entries of the gathered ``D[u] + w`` block of one relaxation round: 32 sources of the
#: largest (4-D mesh) topologies, ~16k edges, stay in cache (measured: 2.5x faster than all)
_RELAX_BLOCK = 1 << 19


def _relax(topo: _Topology, cols: list[tuple[_Graph, int]]) -> None:
    """Fill ``g._rows[i]`` for every column ``(g, i)``: the minimum time from state ``i`` to
    every state of ``g`` (graphs of one topology, each with its own step costs), by a
    Bellman-Ford relaxation of all columns at once, ``D[v] = min(D[v], D[u] + w)`` to the
    fixed point, each round relaxing only the edges out of states whose distance fell in the
    previous round in some column (the others cannot improve anything). That fixed point is
    the minimum over paths of the left-to-right float sum of step times (times are >= 0 and
    float addition is monotone), i.e. exactly the cost Dijkstra settles, bit for bit
    (:func:`reshard_plan`), whatever columns share the rounds."""
    U, V, _, _ = topo.arrays()
    n = len(topo.specs)
    graphs = list({id(g): g for g, _ in cols}.values())
    ws = {id(g): k for k, g in enumerate(graphs)}
    W_all = np.stack([g.weights() for g in graphs], axis=1)   # edge x graph
    # D is states x columns (row gathers are contiguous: 2.5x faster than columns)
    step = max(1, _RELAX_BLOCK // max(U.size, 1))
    for b in range(0, len(cols), step):
        blk = cols[b:b + step]
        src = np.array([i for _, i in blk], np.int64)
        Wb = W_all[:, [ws[id(g)] for g, _ in blk]]          # edge x column
        D = np.full((n, len(blk)), np.inf)
        D[src, np.arange(len(blk))] = 0.0
        changed = np.zeros(n, bool)
        changed[src] = True
        while True:
            sel = np.flatnonzero(changed[U])     # still sorted by target
            if not sel.size:
                break
            u, v = U[sel], V[sel]
            first = np.flatnonzero(np.r_[True, v[1:] != v[:-1]])
            tgt = v[first]
            red = np.minimum.reduceat(D[u] + Wb[sel], first, axis=0)
            old = D[tgt]
            better = red < old
            changed[:] = False
            changed[tgt] = better.any(axis=1)
            D[tgt] = np.where(better, red, old)
        for r, (g, i) in enumerate(blk):
            g._rows[i] = D[:, r].copy()


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
    # Heap entries: (cost, n_steps, path as spec strings, state, edge indices). The key
    # (cost, n_steps, path) is unique per path and only grows along a path, so Dijkstra settles
    # each state with its smallest key: the same plan on every rank.
    g.weights()
    out, nxt, w = g.topo.out_edges(), g.topo.targets(), g._wlist
    heap = [(0.0, 0, (names[start],), start, ())]
    done: set[int] = set()
    while heap:
        cost, n, path, i, edges = heapq.heappop(heap)
        if i in done:
            continue
        done.add(i)
        if i == goal:
            return ReshardPlan(src, dst, mesh, shape, dtype, tuple(map(g.step, edges)), cost)
        for e in out[i]:
            j = nxt[e]
            if j not in done:
                heapq.heappush(heap, (cost + w[e], n + 1, path + (names[j],), j, edges + (e,)))
    # Unreachable by construction (gather all, then chunk all); kept as a guard.
    raise ReshardError(f"no resharding path from {src} to {dst} for shape {shape} on {mesh!r}")
