"""Invariants shared by several passes, as ``check(gm, ctx) -> None | message`` functions.

Passes name them in their contract (:func:`fxpar.passes.infra.graph_pass`); each returns a
message naming the first node at fault, so a broken pass is caught where it breaks, not three
passes later. Each is one linear scan of the graph.

>>> import torch, torch.fx as fx
>>> gm = fx.symbolic_trace(lambda x: x + 1)
>>> annotated(gm, None)
"node x has no meta['fxpar_specs'] (not annotated)"
"""

from __future__ import annotations

import torch
import torch.fx as fx

from fxpar import ir

__all__ = ["annotated", "comm_ops_have_edges", "localized", "only_op_nodes"]


def _comm_ops():
    from fxpar.runtime.comm import COMM_OPS

    return COMM_OPS


def annotated(gm: fx.GraphModule, ctx) -> str | None:
    """Every node but the output has its output specs and its inputs' specs."""
    for n in gm.graph.nodes:
        if n.op != "output" and (ir.SPECS not in n.meta or ir.IN_SPECS not in n.meta):
            key = ir.SPECS if ir.SPECS not in n.meta else ir.IN_SPECS
            return f"node {n.name} has no meta[{key!r}] (not annotated)"
    return None


def comm_ops_have_edges(gm: fx.GraphModule, ctx) -> str | None:
    """Every communication op names an edge of ``gm.meta[EDGES]``."""
    edges = gm.meta.get(ir.EDGES, {})
    comm = _comm_ops()
    for n in gm.graph.nodes:
        if n.target in comm:
            names = n.args[1] if n.args and isinstance(n.args[1], list) else [n.args[-3]]
            missing = [e for e in names if e not in edges]
            if missing:
                return f"node {n.name} ({n.target}) names edges {missing} not in gm.meta[EDGES]"
    return None


def localized(gm: fx.GraphModule, ctx) -> str | None:
    """``meta[VAL]`` is a local-shape meta tensor and the global value is under ``GLOBAL_VAL``."""
    for n in gm.graph.nodes:
        v = n.meta.get(ir.VAL)
        if isinstance(v, torch.Tensor) and n.meta.get(ir.SPECS):
            if v.device.type != "meta" or ir.GLOBAL_VAL not in n.meta:
                return f"node {n.name}: meta['val'] is not a local meta tensor with the global value kept"
    return None


def only_op_nodes(gm: fx.GraphModule, ctx) -> str | None:
    """No ``call_module``/``get_attr`` of runtime objects: a rank graph is placeholders, op calls
    and the output (it holds no runtime state; DESIGN §6)."""
    for n in gm.graph.nodes:
        if n.op == "call_module":
            return f"node {n.name} calls module {n.target!r}: rank graphs hold op nodes only"
        if n.op == "get_attr" and not isinstance(getattr(gm, n.target, None), torch.Tensor):
            return f"node {n.name} reads attribute {n.target!r} that is not a tensor"
    return None
