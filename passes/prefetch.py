"""prefetch: issue parameter gathers early, a bounded window ahead of their use, per layer.

Contract (AxoNN §IV-C, AMSP §V-C). A ``CollectiveStart`` whose input is a placeholder (a
parameter, buffer or input: nothing computed) depends on no activation, so it may run as early
as we like; its ``CollectiveWait`` stays right before the first use. The gathers are grouped
into *units* by the layer of the node that uses them (:func:`fxpar.planner.layer_of`: a
repeated block such as ``blocks.3``, else a top-level module; a node outside any module is
a unit of its own), numbered ``0, 1, ...`` in the
order of their first wait. The starts of one unit become ONE ``CollectiveStart`` of all its
edges (their collectives coalesce, as FSDP gathers a block's flat parameter), placed right
after the first wait of unit ``k - W`` with ``W = ctx.prefetch`` (the first ``W`` units at the
top of the program): at most ``W`` units are gathered ahead of use, which bounds the extra
memory. The unit's parameter gradients form one backward bucket (``Edge.bucket``): their
collectives are launched together once all have arrived. Only start nodes move or merge, so results never change; ``W = 0`` leaves the graph
as is.

With ``W = 1`` and one weight per layer the order is (layer ``i`` computes while layer
``i + 1``'s weight arrives)::

    start ag0 -> wait ag0 -> start ag1 -> mm0 -> wait ag1 -> start ag2 -> mm1 -> wait ag2 -> mm2
"""

from __future__ import annotations

import torch.fx as fx

from fxpar.pipeline import PassContext, PassResult
from fxpar.layers import layer_of
from fxpar.runtime.comm import CollectiveStart, CollectiveWait


def _is(gm: fx.GraphModule, n: fx.Node, cls) -> bool:
    return n.op == "call_module" and isinstance(gm.get_submodule(n.target), cls)


def prefetch_pass(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    W = ctx.prefetch
    if W <= 0:
        return PassResult(gm, False)
    graph = gm.graph
    nodes = list(graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    units: dict[str, list[tuple[fx.Node, fx.Node]]] = {}
    for n in nodes:
        if _is(gm, n, CollectiveStart) and len(n.args) == 1 and n.args[0].op == "placeholder":
            waits = [u for u in n.users if _is(gm, u, CollectiveWait)]
            if len(waits) == 1 and len(gm.get_submodule(n.target).edges) == 1:
                user = min(waits[0].users, key=pos.get, default=waits[0])
                layer = layer_of(user)  # "(top)" etc.: no module info, the user is its unit
                units.setdefault(user.name if layer.startswith("(") else layer, []).append((n, waits[0]))
    if not units:
        return PassResult(gm, False)
    order = sorted(units.values(), key=lambda u: min(pos[w] for _, w in u))
    first_wait = [min((w for _, w in u), key=pos.get) for u in order]
    anchor = [n for n in nodes if n.op == "placeholder"][-1]
    for k, unit in enumerate(order):
        unit.sort(key=lambda sw: pos[sw[1]])
        where = anchor if k < W else first_wait[k - W]
        head, _ = unit[0]
        if len(unit) > 1:  # one start for the whole unit: its collectives coalesce
            mods = [gm.get_submodule(s.target) for s, _ in unit]
            # ... and so do the gradient collectives of its parameters in backward
            waits = [gm.get_submodule(w.target).edge for _, w in unit]
            bucket = tuple(e.name for e in waits if e.param is not None and e.bwd is not None
                           and e.bwd.steps)
            for e in waits:
                if e.name in bucket:
                    e.bucket = bucket
            gm.add_submodule(head.target, CollectiveStart(mods[0].edge, tuple(m.edge for m in mods[1:])))
            head.args = tuple(s.args[0] for s, _ in unit)
            for i, (s, w) in enumerate(unit[1:], 1):
                w.args = (head,) + tuple(w.args[1:])
                gm.get_submodule(w.target).index = i
                graph.erase_node(s)
                gm.delete_submodule(s.target)
        where.append(head)
        if k < W:
            anchor = head  # keep the first W units in order at the top
    return PassResult(gm, True)
