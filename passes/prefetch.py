"""prefetch: issue parameter gathers early, a bounded window ahead of their use.

Contract (AxoNN §IV-C, AMSP §V-C). A ``CollectiveStart`` whose input is a placeholder (a
parameter, buffer or input: nothing computed) depends on no activation, so it may run as early
as we like; its ``CollectiveWait`` stays right before the first use. With the parameter gathers
numbered ``0, 1, ...`` in the order of their waits and a window of ``W = ctx.prefetch``, start
``k`` is moved to right after wait ``k - W`` (the first ``W`` to the top of the program): at
most ``W`` gathered parameters are in flight or waiting ahead of use, which bounds the extra
memory. Only start nodes move, so results never change; ``W = 0`` leaves the graph as is.

With ``W = 1`` and one weight per layer the order is (layer ``i`` computes while layer
``i + 1``'s weight arrives)::

    start ag0 -> wait ag0 -> start ag1 -> mm0 -> wait ag1 -> start ag2 -> mm1 -> wait ag2 -> mm2
"""

from __future__ import annotations

import torch.fx as fx

from fxpar.pipeline import PassContext, PassResult
from fxpar.runtime.comm import CollectiveStart, CollectiveWait


def _is(gm: fx.GraphModule, n: fx.Node, cls) -> bool:
    return n.op == "call_module" and isinstance(gm.get_submodule(n.target), cls)


def prefetch_pass(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    W = ctx.prefetch
    if W <= 0:
        return PassResult(gm, False)
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    pairs = []
    for n in nodes:
        if _is(gm, n, CollectiveStart) and n.args[0].op == "placeholder":
            waits = [u for u in n.users if _is(gm, u, CollectiveWait)]
            if waits:
                pairs.append((min(pos[w] for w in waits), n, min(waits, key=pos.get)))
    pairs.sort(key=lambda t: t[0])
    if not pairs:
        return PassResult(gm, False)
    top = [n for n in nodes if n.op == "placeholder"][-1]
    modified = False
    for k, (_, start, _) in enumerate(pairs):
        anchor = top if k < W else pairs[k - W][2]
        if start.prev is not anchor:
            anchor.append(start)
            modified = True
        if k < W:
            top = start  # keep the first W starts in wait order
    return PassResult(gm, modified)
