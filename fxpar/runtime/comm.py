"""Communication ops of emitted graphs (``torch.ops.fxpar.*``), with exact autograd.

Every edge of a plan where the producer's spec differs from what the consumer's strategy needs
(or where only the *gradient* layouts differ) is an :class:`Edge`: the forward resharding plan
``src -> dst`` and the backward plan of the gradient, ``grad_in(consumer) ->
grad_out(producer)``, both planned by :func:`fxpar.resharding.intra.reshard_plan`. The backward of an
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

Graph form. Edges are plain data (``gm.meta[EDGES]``); the graph holds op nodes that name
their edge, and everything stateful (process groups, gradient sink, in-flight handles) comes
from the :class:`~fxpar.runtime.bindings.Bindings` active at call time::

    all_gather_dp = torch.ops.fxpar.start.default([p_fc1_weight], ['p_fc1_weight->linear'])
    ...                                                   # prefetch moves the start up
    wait = torch.ops.fxpar.wait.default(all_gather_dp, p_fc1_weight, 'p_fc1_weight->linear',
                                        [16, 8], 'sink')
    linear = torch.ops.aten.linear.default(x, wait, ...)

* ``fxpar::start(xs, edges) -> token``: launches the first (collective) round of the edges'
  forward plans, coalesced; returns an empty token tensor (the handle stays in the bindings);
* ``fxpar::wait(token, x, edge, shape, grad) -> y``: finishes the edge's plan; ``x`` (the
  source) is the autograd input;
* ``fxpar::redistribute(x, edge, shape, grad) -> y``: a synchronous edge (local steps only, or a
  gradient-only edge: then ``y`` is a copy of ``x``);
* backward of ``wait``/``redistribute`` by the static ``grad`` mode: ``"none"``; ``"identity"``
  (the gradient passes unchanged); ``"reshard"`` → ``fxpar::edge_grad(g, edge, shape)``
  (scale, then the gradient plan); ``"sink"`` → ``fxpar::sink_grad(g, edge)`` (a parameter's
  gradient leaves autograd for the model-state manager, which reduces it asynchronously; a
  side-effecting op, so compilers keep it).

``shape`` is the destination's LOCAL shape (fake/meta kernels need it); every op runs on
``meta``/fake tensors without bindings, so a rank graph can be shape-checked and traced. The
result of ``wait``/``redistribute`` is always a contiguous tensor (its fake kernel is
``x.new_empty(shape)``; the runtime keeps that contract, see :mod:`fxpar.runtime.redistribute`),
so an op after a collective sees the layout of a fresh eager tensor, never a padded buffer.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import numpy as np
import torch
import torch.fx

from fxpar.cost.reshard import LOCAL_KINDS
from fxpar.kinds import StrKind
from fxpar.resharding.intra import ReshardPlan
from fxpar.runtime import redistribute as rt
from fxpar.runtime.bindings import current
from fxpar.runtime.library import define
from fxpar.spec import Partial

__all__ = ["Edge", "grad_scale", "Regather", "COMM_OPS", "START", "WAIT", "REDISTRIBUTE", "EDGE_GRAD",
           "SINK_GRAD", "GRAD_MODES", "GradMode"]

class GradMode(StrKind):
    """Where an edge's gradient goes (module docstring). Emitted graphs hold its string (the
    ``grad`` argument of ``wait``/``redistribute``), so they print and pickle as before."""

    NONE = "none"
    IDENTITY = "identity"
    RESHARD = "reshard"
    SINK = "sink"


#: The gradient destinations of an edge (module docstring).
GRAD_MODES = tuple(GradMode)


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


@dataclass(frozen=True)
class Edge:
    """One resharding edge of a plan: plain, frozen data (the same for every rank).

    ``fwd`` reshapes the value ``src -> dst``; ``bwd`` (``None`` without gradient) takes the
    gradient from the consumer's gradient layout to the producer's (or, for a parameter, to
    its storage layout with ``P(sum)`` on the axes the model-state manager reduces over);
    ``param`` is the parameter's FQN when the gradient goes to the bound sink instead of
    autograd; ``bucket``: the edges whose parameter gradients are reduced together (one
    layer's, see passes/prefetch.py).
    """

    name: str
    producer: str
    consumer: str
    fwd: ReshardPlan
    bwd: ReshardPlan | None
    scale: float = 1.0
    param: str | None = None
    bucket: tuple[str, ...] = ()

    @property
    def collective(self) -> bool:
        """Whether the forward's first step talks to other ranks (then it is async)."""
        return bool(self.fwd.steps) and self.fwd.steps[0].kind not in LOCAL_KINDS

    @property
    def gathers_param(self) -> bool:
        """Whether it gathers a parameter (its source one, its forward moving or copying
        bytes: sharded in storage, needed whole or laid out otherwise)."""
        return self.param is not None and bool(self.collective or self.fwd.nbytes)

    @property
    def grad_mode(self) -> GradMode:
        """One of :data:`GRAD_MODES` (module docstring)."""
        if self.bwd is None:
            return GradMode.NONE
        if self.param is not None:
            return GradMode.SINK
        return GradMode.RESHARD if self.bwd.steps or self.scale != 1.0 else GradMode.IDENTITY

    def group(self, axis: int, coord) -> tuple[int, ...]:
        """The ranks the device at ``coord`` talks to over mesh ``axis``."""
        mesh = self.fwd.mesh
        at = list(coord)
        at[axis] = slice(None)
        return tuple(int(d) for d in np.asarray(mesh.devices).reshape(mesh.shape)[tuple(at)])

    def describe(self, coord=None) -> str:
        """``S(0)R -> RR: all_gather(dp) | grad ...``; with this rank's ``coord`` each
        collective also names its group: ``all_gather(dp [0, 2])``."""
        def steps(p):
            return " + ".join(
                f"{s.kind}({s.axis_name}"
                + ("" if coord is None or s.kind in LOCAL_KINDS else f" {list(self.group(s.axis, coord))}")
                + ")" for s in p.steps) or "-"
        g = "no grad" if self.bwd is None else f"grad {self.bwd.src} -> {self.bwd.dst}: {steps(self.bwd)}"
        return f"{self.fwd.src} -> {self.fwd.dst}: {steps(self.fwd)} | {g}"

    def grad(self, g: torch.Tensor, device_mesh) -> torch.Tensor:
        """The producer-side gradient: scaled, then the gradient plan."""
        if self.scale != 1.0:
            g = g * self.scale
        return rt.execute(self.bwd, g.contiguous(), device_mesh) if self.bwd.steps else g


# ---------------------------------------------------------------------------------------------
# regather (ZeRO-3 / FSDP reshard_after_forward)
# ---------------------------------------------------------------------------------------------
class _Group:
    """The parameters one start gathered (coalesced: several; a synchronous edge: one),
    gathered again together in backward, once, when the first of them is needed."""

    def __init__(self, plans, shards, device_mesh, at: int) -> None:
        self.plans, self.shards, self.dm = list(plans), [t.detach() for t in shards], device_mesh
        self.at = at                         # its place in forward (registration) order
        self.packs = [0] * len(self.plans)   # saved tensors per member (counted in forward)
        self.results: dict[int, torch.Tensor] | None = None   # gathered again, until unpacked
        self.pending = None                  # the re-gather, started ahead (prefetch)
        self.kept: dict[int, torch.Tensor] = {}   # gathered in forward, held (Regather.keep_last)


class Regather:
    """Saved-tensor hooks that free gathered parameters after their forward use and gather
    them again when backward needs them (ZeRO-3 / FSDP ``reshard_after_forward``; the planner
    prices that second gather). While active (``Bindings.regather``), every parameter a
    communication op gathers is registered; a tensor autograd saves that is (a view of) one is
    packed as a reference to its local shard and edge, and unpacked by running the edge's
    forward plan again, then taking the same view (the gather is deterministic, so the layout
    is the same). Parameters gathered by one start are gathered again together, once, when
    the first of them is needed; each result is kept only until its last saved use is
    unpacked. Backward prefetch (FSDP's ``BACKWARD_PRE``): when a group is gathered again, the
    group registered before it in forward (the layer backward reaches next) is started, so
    its gather runs under this layer's backward. Collective in backward: every rank unpacks
    in the same (autograd) order, so every rank starts the same gathers in the same order.

    ``keep_last``: the last group the forward gathers stays held for the backward, which needs
    it first (torchtitan's ``reshard_after_forward=False`` on the last block: FSDP would gather
    it again at once): a group's tensors are held until the next group is gathered, and once
    :meth:`end_forward` is called the last one stays, served to backward without a collective.
    For one forward per backward (an SPMD step), not for a pipeline's microbatches in flight."""

    def __init__(self, keep_last: bool = False) -> None:
        self.full: dict[int, tuple] = {}
        self.groups: list[_Group] = []   # in forward (registration) order
        self.count = 0  # collective re-gathers in backward (for tests and stats)
        self.keep_last = keep_last
        self._last: _Group | None = None

    def register(self, full: torch.Tensor, edge: Edge, shard: torch.Tensor, device_mesh,
                 pending=None, index: int = 0) -> None:
        base = full if full._base is None else full._base  # views are keyed by their root
        group = getattr(pending, "regather_group", None) if pending is not None else None
        if group is None:
            at = len(self.groups)
            if pending is not None:
                group = pending.regather_group = _Group(pending.plans, pending.inputs, device_mesh, at)
            else:
                group, index = _Group([edge.fwd], [shard], device_mesh, at), 0
            self.groups.append(group)
        self.full[id(base)] = (weakref.ref(base), group, index)
        if self.keep_last:
            if self._last is not group:
                if self._last is not None:
                    self._last.kept = {}   # the group before: freed after its last use
                self._last = group
            group.kept[index] = base

    def end_forward(self) -> None:
        """The forward is done: the group held now stays for backward; gathers after this
        (a recomputed layer's) are not held."""
        self.keep_last = False

    def alive(self) -> int:
        """How many gathered parameters are still held (after forward: those of the group
        ``keep_last`` holds for backward, 0 without it)."""
        return sum(1 for entry in self.full.values() if entry[0]() is not None)

    def pack(self, t: torch.Tensor):
        base = t if t._base is None else t._base
        hit = self.full.get(id(base))
        if hit is None or hit[0]() is not base:
            return t
        hit[1].packs[hit[2]] += 1
        return (Regather, hit[1:], t.size(), t.stride(), t.storage_offset())

    def _gather(self, group: _Group) -> None:
        need = [i for i, k in enumerate(group.packs) if k > 0]
        if group.pending is None and all(i in group.kept for i in need):   # held: no collective
            group.results = {i: group.kept[i] for i in need}
        else:
            self.count += 1
            got = rt.finish(group.pending) if group.pending is not None else \
                rt.execute_many(group.plans, group.shards, group.dm)
            group.results = {i: got[i] for i in need}
        group.pending, group.kept = None, {}
        prev = self.groups[group.at - 1] if group.at > 0 else None
        if prev is not None and prev.results is None and prev.pending is None and any(prev.packs):
            prev.pending = rt.start(prev.plans, prev.shards, prev.dm)

    def unpack(self, x):
        if not (isinstance(x, tuple) and x and x[0] is Regather):
            return x
        _, (group, index), size, stride, offset = x
        if group.results is None:
            self._gather(group)
        group.packs[index] -= 1
        full = group.results[index] if group.packs[index] else group.results.pop(index)
        return full.as_strided(size, stride, offset)

    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        return self._hooks.__exit__(*exc)


def gathers_params(edges) -> bool:
    """Whether a graph with these edges registers gathered parameters with :class:`Regather`
    (as :func:`_registered` does): without any, its hooks would only cost time."""
    return any(e.gathers_param for e in edges.values())


def _registered(b, out: torch.Tensor, x: torch.Tensor, edge: Edge, pending=None,
                index: int = 0) -> torch.Tensor:
    if b.regather is not None and edge.param is not None:
        b.regather.register(out, edge, x, b.device_mesh, pending, index)
    return out


# ---------------------------------------------------------------------------------------------
# the ops
# ---------------------------------------------------------------------------------------------
def _fresh(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``out``, copied if it shares memory with the op's input (a custom op may not return an
    alias of an input; local steps such as ``to_partial`` on coordinate 0 keep the tensor)."""
    if out.numel() and x.numel() and out.untyped_storage().data_ptr() == x.untyped_storage().data_ptr():
        return out.clone()
    return out


def _start(xs: list[torch.Tensor], edges: list[str]) -> torch.Tensor:
    b = current()
    todo = [(b.edge(n), x) for n, x in zip(edges, xs) if n not in b.given]
    if todo:
        pending = rt.start([e.fwd for e, _ in todo], [x.detach() for _, x in todo], b.device_mesh)
        for i, (e, _) in enumerate(todo):
            b.pending[e.name] = (pending, i)
    return xs[0].new_empty(0)


def _wait(token: torch.Tensor, x: torch.Tensor, edge: str, shape, grad: str) -> torch.Tensor:
    b = current()
    e = b.edge(edge)
    if edge in b.given:
        return b.given[edge].clone()
    try:
        pending, index = b.pending.pop(edge)
    except KeyError:
        if b.regathering and e.param is not None:   # selective recomputation: gather again
            return _fresh(rt.execute(e.fwd, x.detach(), b.device_mesh), x)
        raise RuntimeError(f"fxpar.wait({edge!r}): no start of this edge is in flight") from None
    if b.deferred is not None and e.consumer == "output":
        out = rt.in_flight(pending)
        if out is not None:  # filled in place when the runner finishes it, after backward
            b.deferred.append(pending)
            return out.view(shape)
    return _registered(b, rt.finish(pending)[index], x, e, pending, index)


def _redistribute(x: torch.Tensor, edge: str, shape, grad: str) -> torch.Tensor:
    b = current()
    e = b.edge(edge)
    if not e.fwd.steps:  # a gradient-only edge: identity forward (an op may not return its input);
        return x.clone(memory_format=torch.contiguous_format)  # contiguous, as the fake kernel says
    if edge in b.given:
        return b.given[edge].clone()
    out = _fresh(rt.execute(e.fwd, x.detach(), b.device_mesh), x)
    return _registered(b, out, x, e) if e.fwd.nbytes else out


def _edge_grad(g: torch.Tensor, edge: str, shape) -> torch.Tensor:
    b = current()
    return _fresh(b.edge(edge).grad(g, b.device_mesh), g)


def _sink_grad(g: torch.Tensor, edge: str) -> None:
    b = current()
    e = b.edge(edge)
    if b.sink is None:
        raise RuntimeError(f"fxpar.sink_grad({edge!r}): the bindings have no gradient sink")
    if e.scale != 1.0:
        g = g * e.scale   # a new tensor already
    elif b.fresh_grads:   # compiled: its buffer may be reused (Bindings.fresh_grads)
        g = g.clone(memory_format=torch.contiguous_format)
    b.sink(e, g.contiguous())


def _sink_then_none(x: torch.Tensor, edge: str, g: torch.Tensor) -> None:
    SINK_GRAD(g, edge)


#: mode -> ``f(x, edge, g)``: the gradient of the edge's source ``x`` (None: autograd gets none)
_GRAD_OF_X = {
    GradMode.NONE: lambda x, edge, g: None,
    GradMode.IDENTITY: lambda x, edge, g: g,
    GradMode.RESHARD: lambda x, edge, g: EDGE_GRAD(g, edge, list(x.shape)),
    GradMode.SINK: _sink_then_none,
}


def _grad_of_x(x: torch.Tensor, edge: str, mode: str, g: torch.Tensor):
    """The gradient of an edge's source ``x`` by the static ``mode`` (module docstring)."""
    return _GRAD_OF_X.get(mode, _GRAD_OF_X[GradMode.NONE])(x, edge, g)


START = define("fxpar::start(Tensor[] xs, str[] edges) -> Tensor", _start,
               fake=lambda xs, edges: xs[0].new_empty(0), differentiable=False)
WAIT = define("fxpar::wait(Tensor token, Tensor x, str edge, SymInt[] shape, str grad) -> Tensor", _wait,
              fake=lambda token, x, edge, shape, grad: x.new_empty(shape),
              backward=lambda a, g: (None, _grad_of_x(a[1], a[2], a[4], g), None, None, None))
REDISTRIBUTE = define("fxpar::redistribute(Tensor x, str edge, SymInt[] shape, str grad) -> Tensor",
                      _redistribute, fake=lambda x, edge, shape, grad: x.new_empty(shape),
                      backward=lambda a, g: (_grad_of_x(a[0], a[1], a[3], g), None, None, None))
EDGE_GRAD = define("fxpar::edge_grad(Tensor g, str edge, SymInt[] shape) -> Tensor", _edge_grad,
                   fake=lambda g, edge, shape: g.new_empty(shape))
SINK_GRAD = define("fxpar::sink_grad(Tensor g, str edge) -> ()", _sink_grad, fake=lambda g, edge: None)
torch.fx.node.has_side_effect(SINK_GRAD)  # no output: compilers must keep it for its effect

#: The communication ops an emitted graph may hold (overloads, as graph nodes name them).
COMM_OPS = frozenset({START, WAIT, REDISTRIBUTE})
