"""Op records, one file per op family; :func:`strategies_for` is the entry for the planner.

Each family file (``matmul``, ``attention``, ``conv``, ``embedding``, ``guards``, ``losses``,
``moe``, ``norms``, ``pointwise``, ``reductions``, ``views``) registers ONE
:class:`~fxpar.strategies.base.OpRecord` per op: its sharding rule, its cost formula (which fills
:mod:`fxpar.cost.compute`'s table), its local rewrite (:func:`local_rule`, used by
``passes/localize.py``) and its flags (``view``, ``differentiable``, ``saves``). Adding an op
touches its family's file and its test only.

``strategies_for(node, mesh)`` returns every candidate :class:`Strategy` of a graph node on an
N-d mesh: the input specs it requires (``Strategy.inputs[i]`` for ``node.all_input_nodes[i]``,
``None`` for a non-tensor input) and the output specs it produces (one per tensor output). The
all-replicate strategy is always first; the order is deterministic; no duplicates.

* placeholders: every spec of ``{R, S(d)}`` per axis that fits the shape (the runner feeds
  each rank its shard);
* ``get_attr`` (lifted tensor constants, buffers of the graph module itself): replicated only.
  Every rank's graph holds the whole constant (nothing slices it), so a sharded spec would
  claim a piece the rank does not have; a sharded consumer gets it through a local ``chunk``;
* ops with a rule (:func:`strategy_rule`: the record's, or the pointwise rule for any ATen op
  tagged pointwise): the rule's one-axis choices expanded over the mesh
  (:func:`fxpar.strategies.base.expand`);
* strategies with a ``Partial`` output the collectives cannot reduce exactly on its dtype
  (:func:`fxpar.spec.partial_reducible`) are dropped;
* ops without a rule: ONE all-replicate strategy with ``unsharded=True``
  (:func:`unsharded_strategy`, THE replicate-only fallback);
* a random op the runtime cannot key by shard raises :class:`PlanError` naming the node
  (:func:`fxpar.strategies.rand.check_random`), so planning refuses it, not the runner.

>>> import torch
>>> from fxpar import Cluster, Mesh
>>> from fxpar.capture import capture
>>> from examples.models import MLP
>>> gm = capture(MLP(8, 16, 4), (torch.randn(2, 8),))
>>> lin = next(n for n in gm.graph.nodes if n.target == torch.ops.aten.linear.default)
>>> for s in strategies_for(lin, Mesh(Cluster.local(2), tp=2)):
...     print(s)
R: R, R, R -> R
dp: S(0), R, R -> S(0)
row: S(1), S(1), P(sum) -> P(sum)
col: R, S(0), S(0) -> S(1)
"""

from __future__ import annotations

import torch
import torch.fx as fx

from fxpar import ir
from fxpar.errors import FxparError, PlanError
from fxpar.spec import Strided

from fxpar.strategies import (attention, conv, embedding, guards, losses, matmul, moe,  # noqa: F401
                              norms, pointwise, reductions, views)
from fxpar.strategies.base import (RECORDS, AxisStrategy, OpRecord, Strategy, declare, expand, input_shapes,
                                   out_shapes, record_for, register, rule_for, tensor_shape)
from fxpar.strategies.local import LocalContext, local_rule
from fxpar.strategies.rand import check_random

__all__ = ["strategies_for", "is_unsharded", "AxisStrategy", "Strategy", "OpRecord", "RECORDS", "register",
           "declare", "record_for", "rule_for", "strategy_rule", "local_rule", "LocalContext", "expand",
           "placeholder_strategies", "unsharded_strategy", "input_shapes"]


def strategy_rule(target):
    """The one-axis sharding rule of ``target``: its record's, else the pointwise rule for an
    ATen op tagged ``pointwise``, else ``None`` (replicated only).

    >>> import torch
    >>> strategy_rule(torch.ops.aten.mm.default).__name__, strategy_rule(torch.ops.aten.atan.default).__name__
    ('mm_rule', 'pointwise_rule')
    """
    rule = rule_for(target)
    if rule is None and isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags:
        rule = pointwise.pointwise_rule
    return rule


def _rule(node: fx.Node):
    return strategy_rule(node.target)


def unsharded_strategy(node: fx.Node, mesh_ndim: int) -> Strategy:
    """THE replicate-only fallback: every tensor input and output replicated, flagged
    ``unsharded`` (an op without a rule, or whose rule offers nothing on this mesh)."""
    from fxpar.spec import Spec

    rep = Spec.replicate(mesh_ndim)
    ins = tuple(None if s is None else rep for s in input_shapes(node))
    return Strategy(ins, tuple(rep for _ in out_shapes(node)), name="unsharded", unsharded=True)


def placeholder_strategies(node: fx.Node, mesh) -> list[Strategy]:
    """Every ``{R, S(d)}``-per-axis spec that fits the value's shape (the planner pins), and
    the strided ``S(d,f)`` of a fused projection's weight or bias (:func:`_fused_dims`)."""
    shp = tensor_shape(node)
    if shp is None:
        return [Strategy((), (), name="const")]
    choices = [AxisStrategy((), (torch.distributed.tensor.Shard(d),), name=f"S{d}") for d in range(len(shp))]
    choices += [AxisStrategy((), (Strided(d, split_factor=f),), name=f"S{d}/{f}") for d, f in _fused_dims(node)]
    return expand(node, choices, mesh.shape, mesh.axis_names)


_PROJECTIONS = (torch.ops.aten.linear, torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.matmul)


def _fused_dims(node: fx.Node) -> list[tuple[int, int]]:
    """``(dim, f)`` for a parameter read by a projection whose output is split into ``f``
    equal parts (:func:`fxpar.strategies.views.split_factor`), ``dim`` of the parameter's
    dims that has the output's last size (the strided col split of the projection needs it)."""
    if ir.PARAM not in node.meta:
        return []
    shp = tensor_shape(node)
    out = set()
    for u in node.users:
        o = tensor_shape(u)
        if o and getattr(u.target, "overloadpacket", None) in _PROJECTIONS:
            f = views.split_factor(u, len(o) - 1)
            if f:
                out |= {(d, f) for d, n in enumerate(shp) if n == o[-1]}
    return sorted(out)


def strategies_for(node: fx.Node, mesh) -> list[Strategy]:
    """Every candidate strategy of ``node`` on ``mesh`` (at least one); see the module doc."""
    if node.op == "output":
        raise ValueError("strategies_for: the output node has no strategies")
    if node.op == "get_attr":  # a constant: every rank holds it whole (module docstring)
        from fxpar.spec import Spec

        shp = tensor_shape(node)
        rep = Spec.replicate(mesh.ndim)
        return [Strategy((), () if shp is None else (rep,), name="const")]
    if node.op == "placeholder":
        return placeholder_strategies(node, mesh)
    check_random(node)  # a random op localize could not key is refused here, by the planner
    rule = _rule(node) if node.op == "call_function" else None
    if rule is None:
        return [unsharded_strategy(node, mesh.ndim)]
    try:
        out = expand(node, rule(node) or (), mesh.shape, mesh.axis_names)
    except FxparError:
        raise
    except Exception as e:  # a rule that cannot handle this call: name the op, not a raw trace
        shapes = [None if s is None else tuple(s) for s in input_shapes(node)]
        raise PlanError(
            f"node {node.name} ({node.target}): its sharding rule {rule.__name__} failed on "
            f"input shapes {shapes}: {type(e).__name__}: {e} (a bug in fxpar's rule; "
            "please report it)") from e
    out = [s for s in out if _reducible(node, s)]
    return out or [unsharded_strategy(node, mesh.ndim)]


def _reducible(node: fx.Node, strat: Strategy) -> bool:
    """False when an output of ``strat`` is ``Partial`` with a reduce op the collectives cannot
    run exactly on that output's dtype (:func:`fxpar.spec.partial_reducible`: ``max``/``min``
    of ``uint64``): such a strategy is never offered, so the plan keeps the reduction whole."""
    from torch.distributed.tensor import Partial

    from fxpar.spec import partial_reducible

    v = node.meta.get("val")
    vals = [t for t in (v if isinstance(v, (tuple, list)) else [v]) if isinstance(t, torch.Tensor)]
    for t, spec in zip(vals, strat.outputs):
        for p in spec:
            if isinstance(p, Partial) and not partial_reducible(t.dtype, p.reduce_op):
                return False
    return True


def is_unsharded(node: fx.Node) -> bool:
    """True when no rule covers ``node`` (its only strategy is the replicated fallback)."""
    if node.op in ("placeholder", "get_attr", "output"):
        return False
    return node.op != "call_function" or _rule(node) is None
