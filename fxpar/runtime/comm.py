"""Communication nodes of emitted graphs, with exact autograd.

Every edge of a plan where the producer's spec differs from what the consumer's strategy needs
(or where only the *gradient* layouts differ) becomes an :class:`Edge`: the forward resharding
plan ``src -> dst`` and the backward plan of the gradient, ``grad_in(consumer) ->
grad_out(producer)``, both planned by :func:`fxpar.reshard.reshard_plan`. The backward of an
edge is that gradient plan, not the autograd of the forward collectives (DESIGN §6): the stock
functional ``all_reduce`` backward is another all-reduce, which over-counts when every rank
computes the same loss. Megatron's conjugate pair falls out: ``f`` (column-parallel input) is
an edge ``R -> R`` whose gradient plan is ``P(sum) -> R`` (identity forward, all-reduce
backward); ``g`` (row-parallel output) is ``P(sum) -> R`` whose gradient plan is ``R -> R``.

Gradient representation. A rank's local gradient is ``dL/d(its local tensor)``. For every
layout but ``P(avg)`` that is the gradient's spec-representation (``P(sum)``: each addend's
gradient is the full gradient; ``S``: the shard of it). A ``P(avg)`` addend contributes
``1/G`` of the value, so its local gradient is ``1/G`` of the full one. An edge therefore
scales the gradient by ``Π_{dst P(avg) axes} G / Π_{src P(avg) axes} G`` (:attr:`Edge.scale`),
then runs the gradient plan (linear, so the order does not matter).

Graph form (what ``print_readable`` shows), for an edge with a collective in its first step::

    all_gather_dp = self.all_gather_dp__p_fc1_weight(p_fc1_weight)     # CollectiveStart: launch
    ...                                                                  # (prefetch moves it up)
    wait_all_gather_dp = self.wait__p_fc1_weight(all_gather_dp, p_fc1_weight)   # CollectiveWait
    linear = torch.ops.aten.linear.default(x, wait_all_gather_dp, ...)

A :class:`CollectiveStart` returns a :class:`fxpar.runtime.reshard.Pending` (no tensor, no
autograd); the :class:`CollectiveWait` takes it and the source tensor (the autograd edge) and
returns the destination local tensor. Edges whose forward has no collective (local steps only,
or gradient-only edges) are one synchronous :class:`Reshard` module. On ``meta`` inputs every
module returns ``meta`` tensors of the destination's local shape, so an emitted graph can be
shape-checked without a process group.

Parameter edges send their gradient to a sink (the model-state manager of the runner, which
reduces over data-parallel replicas asynchronously) instead of returning it to autograd.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from fxpar.reshard import ReshardPlan
from fxpar.runtime import reshard as rt
from fxpar.spec import Partial

__all__ = ["Edge", "CollectiveStart", "CollectiveWait", "Reshard", "LOCAL_KINDS", "grad_scale",
           "Regather"]

#: Reshard step kinds that move no data between ranks.
LOCAL_KINDS = frozenset({"chunk", "to_partial", "rescale"})


def grad_scale(src, dst, mesh_shape) -> float:
    """``Π_{dst P(avg) axes} G / Π_{src P(avg) axes} G`` (module docstring).

    >>> from fxpar.spec import Spec
    >>> grad_scale(Spec.parse("P(avg)R"), Spec.parse("RR"), (2, 4))
    0.5
    """
    f = 1.0
    for a, g in enumerate(mesh_shape):
        if isinstance(dst[a], Partial) and dst[a].reduce_op == "avg":
            f *= g
        if isinstance(src[a], Partial) and src[a].reduce_op == "avg":
            f /= g
    return f


@dataclass(eq=False)
class Edge:
    """One resharding edge of a plan (global: the same object describes every rank).

    ``fwd`` reshapes the value ``src -> dst``; ``bwd`` (``None`` without gradient) takes the
    gradient from the consumer's gradient layout to the producer's (or, for a parameter, to
    its storage layout with ``P(sum)`` on the axes the model-state manager reduces over);
    ``param`` is the parameter's FQN when the gradient goes to ``sink(edge, grad)`` instead
    of autograd: ``grad`` in the consumer's gradient layout, scaled; the sink runs ``bwd``
    (asynchronously, coalesced with the other edges of ``bucket``: the parameters one layer
    gathered together, see passes/prefetch.py).
    """

    name: str
    producer: str
    consumer: str
    fwd: ReshardPlan
    bwd: ReshardPlan | None
    scale: float = 1.0
    param: str | None = None
    sink: Callable[[Edge, torch.Tensor], None] | None = field(default=None, repr=False)
    bucket: tuple[str, ...] = ()
    coord: tuple[int, ...] | None = field(default=None, repr=False)
    _dm: object = field(default=None, repr=False)

    @property
    def mesh(self):
        """The ``DeviceMesh`` (made on first use; hashing the fxpar Mesh per call is slow)."""
        if self._dm is None:
            self._dm = rt._as_device_mesh(self.fwd.mesh)
        return self._dm

    @property
    def collective(self) -> bool:
        """Whether the forward's first step talks to other ranks (then it is async)."""
        return bool(self.fwd.steps) and self.fwd.steps[0].kind not in LOCAL_KINDS

    def group(self, axis: int) -> tuple[int, ...]:
        """The ranks this rank talks to over mesh ``axis`` (needs ``coord``)."""
        mesh = self.fwd.mesh
        at = list(self.coord)
        at[axis] = slice(None)
        return tuple(int(d) for d in np.asarray(mesh.devices).reshape(mesh.shape)[tuple(at)])

    def describe(self) -> str:
        """``S(0)R -> RR: all_gather(dp) | grad ...``; on a rank's copy each collective also
        names its group: ``all_gather(dp [0, 2])``."""
        def steps(p):
            return " + ".join(
                f"{s.kind}({s.axis_name}"
                + ("" if self.coord is None or s.kind in LOCAL_KINDS else f" {list(self.group(s.axis))}")
                + ")" for s in p.steps) or "-"
        g = "no grad" if self.bwd is None else f"grad {self.bwd.src} -> {self.bwd.dst}: {steps(self.bwd)}"
        return f"{self.fwd.src} -> {self.fwd.dst}: {steps(self.fwd)} | {g}"

    def local_shape(self, spec) -> tuple[int, ...]:
        return spec.local_shape(self.fwd.shape, self.fwd.mesh.shape, self.coord)

    # -- backward ------------------------------------------------------------------------
    def backward(self, g: torch.Tensor) -> torch.Tensor | None:
        if self.bwd is None:
            return None
        if self.scale != 1.0:
            g = g * self.scale
        if self.param is not None and self.sink is not None:
            # A parameter's gradient feeds nothing else in backward: the sink launches its
            # collectives and finishes them after backward (overlapping the rest of it).
            self.sink(self, g.contiguous())
            return None
        return rt.execute(self.bwd, g.contiguous(), self.mesh) if self.bwd.steps else g


class _Group:
    """The parameters one coalesced start gathered: gathered again together in backward."""

    def __init__(self, plans, shards, mesh) -> None:
        self.plans, self.shards, self.mesh = list(plans), [t.detach() for t in shards], mesh
        self.packs = [0] * len(self.plans)   # saved tensors per member (counted in forward)
        self.results: dict[int, torch.Tensor] = {}


class Regather:
    """Saved-tensor hooks that free gathered parameters after their forward use and gather
    them again when backward needs them (ZeRO-3 / FSDP ``reshard_after_forward``; the planner
    prices that second gather). While active, every parameter a communication node gathers
    is registered; a tensor autograd saves that is (a view of) one is packed as a reference to
    its local shard and edge, and unpacked by running the edge's forward plan again, then
    taking the same view (the gather is deterministic, so the layout is the same). Parameters
    gathered by one coalesced start are gathered again together, once, when the first of them
    is needed; each result is kept only until its last saved use is unpacked.
    Collective in backward: every rank unpacks in the same (autograd) order."""

    active: Regather | None = None

    def __init__(self) -> None:
        self.full: dict[int, tuple] = {}
        self.count = 0  # collective re-gathers in backward (for tests and stats)

    def register(self, full: torch.Tensor, edge: Edge, shard: torch.Tensor, pending=None,
                 index: int = 0) -> None:
        base = full if full._base is None else full._base  # views are keyed by their root
        group = None
        if pending is not None and len(pending.plans) > 1:
            group = getattr(pending, "regather_group", None)
            if group is None:
                group = pending.regather_group = _Group(pending.plans, pending.inputs, edge.mesh)
        self.full[id(base)] = (weakref.ref(base), edge, shard.detach(), group, index)

    def alive(self) -> int:
        """How many gathered parameters are still held (after forward: 0 = all were freed)."""
        return sum(1 for entry in self.full.values() if entry[0]() is not None)

    def pack(self, t: torch.Tensor):
        base = t if t._base is None else t._base
        hit = self.full.get(id(base))
        if hit is None or hit[0]() is not base:
            return t
        if hit[3] is not None:
            hit[3].packs[hit[4]] += 1
        return (Regather, hit[1:], t.size(), t.stride(), t.storage_offset())

    def unpack(self, x):
        if not (isinstance(x, tuple) and x and x[0] is Regather):
            return x
        _, (edge, shard, group, index), size, stride, offset = x
        if group is None:
            self.count += 1
            full = rt.execute(edge.fwd, shard, edge.mesh)
        else:
            if index not in group.results:
                self.count += 1
                got = rt.execute_many(group.plans, group.shards, group.mesh)
                group.results = {i: t for i, t in enumerate(got) if group.packs[i] > 0}
            group.packs[index] -= 1
            full = group.results[index] if group.packs[index] else group.results.pop(index)
        return full.as_strided(size, stride, offset)

    def __enter__(self):
        Regather.active = self
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        Regather.active = None
        return self._hooks.__exit__(*exc)


def _registered(out: torch.Tensor, x: torch.Tensor, edge: Edge, pending=None,
                index: int = 0) -> torch.Tensor:
    if Regather.active is not None and edge.param is not None:
        Regather.active.register(out, edge, x, pending, index)
    return out


def _meta_like(edge: Edge, x: torch.Tensor) -> torch.Tensor:
    return torch.empty(edge.local_shape(edge.fwd.dst), dtype=x.dtype, device="meta")


class _Wait(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, pending, edge, index):
        ctx.edge = edge
        return _registered(rt.finish(pending)[index], x, edge, pending, index)

    @staticmethod
    def backward(ctx, g):
        return ctx.edge.backward(g), None, None, None


class _Sync(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, edge):
        ctx.edge = edge
        if not edge.fwd.steps:
            return x.view_as(x)
        out = rt.execute(edge.fwd, x.detach(), edge.mesh)
        return _registered(out, x, edge) if edge.fwd.nbytes else out

    @staticmethod
    def backward(ctx, g):
        return ctx.edge.backward(g), None


class _CommModule(nn.Module):
    def __init__(self, edge: Edge) -> None:
        super().__init__()
        self.edge = edge

    def extra_repr(self) -> str:
        return f"{self.edge.producer} -> {self.edge.consumer}: {self.edge.describe()}"


class CollectiveStart(_CommModule):
    """Launch the first (collective) round of ``edge.fwd`` — of several edges at once, whose
    collectives are then coalesced (``extra`` edges, see passes/prefetch.py) — and return
    the in-flight handle."""

    def __init__(self, edge: Edge, extra: tuple[Edge, ...] = ()) -> None:
        super().__init__(edge)
        self.edges = (edge,) + tuple(extra)

    def extra_repr(self) -> str:
        return "; ".join(f"{e.producer} -> {e.consumer}: {e.describe()}" for e in self.edges)

    def forward(self, *xs: torch.Tensor):
        if xs[0].device.type == "meta":
            return None
        return rt.start([e.fwd for e in self.edges], [x.detach() for x in xs], self.edge.mesh)


class CollectiveWait(_CommModule):
    """Wait for a :class:`CollectiveStart` and finish ``edge.fwd`` (result ``index`` of the
    start's edges); backward = ``edge.bwd``."""

    def __init__(self, edge: Edge, index: int = 0) -> None:
        super().__init__(edge)
        self.index = index

    def forward(self, pending, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "meta":
            return _meta_like(self.edge, x)
        return _Wait.apply(x, pending, self.edge, self.index)


class Reshard(_CommModule):
    """A synchronous edge: local forward steps (or none) and the gradient plan backward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "meta":
            return _meta_like(self.edge, x)
        return _Sync.apply(x, self.edge)
