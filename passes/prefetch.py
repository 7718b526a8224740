"""prefetch: issue parameter gathers early, a bounded window ahead of their use, per layer.

Contract (AxoNN §IV-C, AMSP §V-C). A ``torch.ops.fxpar.start`` whose input is a placeholder (a
parameter, buffer or input: nothing computed) depends on no activation, so it may run as early
as we like; its ``fxpar.wait`` stays right before the first use. The gathers are grouped
into *units* by the layer of the node that uses them (:func:`fxpar.layers.layer_of`: a
repeated block such as ``blocks.3``, else a top-level module; a node outside any module is
a unit of its own), numbered ``0, 1, ...`` in the
order of their first wait. The starts of one unit become ONE ``fxpar.start`` of all its
edges (their collectives coalesce, as FSDP gathers a block's flat parameter), placed right
after the first wait of unit ``k - W`` with ``W = ctx.prefetch`` (the first ``W`` units at the
top of the program): at most ``W`` units are gathered ahead of use, which bounds the extra
memory. Units are grouped until a group's collectives move
:data:`fxpar.defaults.TINY_GATHER_BYTES` per device (:func:`fxpar.cost.step.gather_groups`):
a norm or a position table rides with the unit after it, one collective less, whose latency
would be all its cost; a group is then one unit of this contract. A gather of a program input (a placeholder that is no parameter or buffer: the
targets a mean loss reads whole, say) is no unit: it starts at the top, hidden behind
everything before its use, rather than one unit ahead of it, where nothing hides it (an input
is used where it is used, often at the end; its gathered size is the batch's, not a layer's
weights). The unit's parameter gradients form one backward bucket (``Edge.bucket``, set on the
copies in ``gm.meta[EDGES]``): their
collectives are launched together once all have arrived. Only start nodes move or merge, so results never change; ``W = 0`` leaves the graph
as is.

With ``W = 1`` and one weight per layer the order is (layer ``i`` computes while layer
``i + 1``'s weight arrives)::

    start ag0 -> wait ag0 -> start ag1 -> mm0 -> wait ag1 -> start ag2 -> mm1 -> wait ag2 -> mm2
"""

from __future__ import annotations

import dataclasses

import torch.fx as fx

from fxpar import ir
from fxpar.cost.step import gather_groups
from fxpar.layers import layer_of
from fxpar.passes.checks import comm_ops_have_edges
from fxpar.passes.infra import PassContext, PassResult, graph_pass
from fxpar.runtime.comm import START as _START, WAIT as _WAIT

__all__ = ["prefetch_pass"]


@graph_pass(requires=(comm_ops_have_edges,), ensures=(comm_ops_have_edges,))
def prefetch_pass(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    W = ctx.prefetch
    if W <= 0:
        return PassResult(gm, False)
    graph = gm.graph
    nodes = list(graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    units: dict[str, list[tuple[fx.Node, fx.Node]]] = {}
    inputs: list[fx.Node] = []
    for n in graph.find_nodes(op="call_function", target=_START):
        xs, _ = n.args
        if len(xs) == 1 and xs[0].op == "placeholder":
            if layer_of(xs[0]) == "(inputs)":
                inputs.append(n)
                continue
            waits = [u for u in n.users if u.target is _WAIT]
            if len(waits) == 1:
                user = min(waits[0].users, key=pos.get, default=waits[0])
                layer = layer_of(user)  # "(top)" etc.: no module info, the user is its unit
                units.setdefault(user.name if layer.startswith("(") else layer, []).append((n, waits[0]))
    if not units and not inputs:   # nothing gathered (a graph may have no placeholder)
        return PassResult(gm, False)
    anchor = [n for n in nodes if n.op == "placeholder"][-1]
    for n in inputs:
        anchor.append(n)
        anchor = n
    if not units:
        return PassResult(gm, bool(inputs))
    edges = dict(gm.meta[ir.EDGES])  # a copy: other graphs may share the dict
    order = sorted(units.values(), key=lambda u: min(pos[w] for _, w in u))
    # latency-bound units (a norm's few parameters) ride with the unit after them
    moved = [sum(edges[s.args[1][0]].fwd.nbytes for s, _ in u) for u in order]
    order = [[sw for k in group for sw in order[k]] for group in gather_groups(moved)]
    first_wait = [min((w for _, w in u), key=pos.get) for u in order]
    for k, unit in enumerate(order):
        unit.sort(key=lambda sw: pos[sw[1]])
        where = anchor if k < W else first_wait[k - W]
        head, _ = unit[0]
        if len(unit) > 1:  # one start for the whole unit: its collectives coalesce
            names = [s.args[1][0] for s, _ in unit]
            # ... and so do the gradient collectives of its parameters in backward
            bucket = tuple(e for e in names if edges[e].param is not None and edges[e].bwd is not None
                           and edges[e].bwd.steps)
            for e in bucket:
                edges[e] = dataclasses.replace(edges[e], bucket=bucket)
            head.args = ([s.args[0][0] for s, _ in unit], names)
            for s, w in unit[1:]:
                w.args = (head,) + tuple(w.args[1:])
                graph.erase_node(s)
            for _, w in unit:
                w.meta[ir.EDGE] = edges[w.args[2]]
        where.append(head)
        if k < W:
            anchor = head  # keep the first W units in order at the top
    gm.meta[ir.EDGES] = edges
    return PassResult(gm, True)
