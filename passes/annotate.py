"""annotate: copy the plan's decisions onto the graph.

Contract: for every node the plan names, ``node.meta[SPECS]`` is the tuple of its output specs,
``node.meta[IN_SPECS]`` the specs its strategy needs per ``node.all_input_nodes`` (``None`` for
a non-tensor input) and ``node.meta[STRATEGY]`` the strategy text. Raises
:class:`fxpar.PlanError` if the plan and the graph disagree (a node missing from either side,
or a different number of inputs): a plan from another model is an error, not a silent
misplacement. The ``output`` node gets ``meta[IN_SPECS]``: per output value, the layout the
plan delivers it in (an output pin), or ``None`` (``insert_collectives`` finalizes a
``Partial`` to ``R``). After this pass no pass reads the plan: node meta is the contract.

>>> import torch, fxpar
>>> from fxpar.passes.infra import PassContext
>>> p = fxpar.plan(torch.nn.Linear(4, 2), fxpar.Cluster.local(2), (torch.randn(4, 4),),
...                mesh={"dp": 2}, plan="dp")
>>> gm = annotate_pass(p.graph, PassContext(p.plan, None)).graph_module
>>> [str(s) for s in next(n for n in gm.graph.nodes if n.name == "linear").meta["fxpar_specs"]]
['S(0)']
"""

from __future__ import annotations

import torch.fx as fx

from fxpar import ir
from fxpar.errors import PlanError
from fxpar.passes.checks import annotated
from fxpar.passes.infra import PassContext, PassResult, graph_pass
from fxpar.spec import Spec


@graph_pass(ensures=(annotated,))
def annotate_pass(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    by_name = {n.name: n for n in ctx.plan.nodes}
    nodes = [n for n in gm.graph.nodes if n.op != "output"]
    missing = [n.name for n in nodes if n.name not in by_name]
    extra = sorted(set(by_name) - {n.name for n in nodes})
    if missing or extra:
        raise PlanError(f"the plan does not match this graph: graph nodes without a decision "
                        f"{missing[:5]}, plan nodes not in the graph {extra[:5]} (a plan made for "
                        f"another model or other input shapes?)")
    for n in nodes:
        np_ = by_name[n.name]
        ins = tuple(None if s is None else Spec.parse(s) for s in np_.inputs)
        if len(ins) != len(n.all_input_nodes):
            raise PlanError(f"plan node {n.name} ({np_.op}): strategy {np_.strategy!r} has "
                            f"{len(ins)} input specs, the node has {len(n.all_input_nodes)} inputs")
        n.meta[ir.SPECS] = tuple(Spec.parse(s) for s in np_.outputs)
        n.meta[ir.IN_SPECS] = ins
        n.meta[ir.STRATEGY] = np_.strategy
        for key, text in ((ir.GRAD_ACC, np_.grad_acc), (ir.SHARED, np_.shared)):
            if text is not None:
                n.meta[key] = Spec.parse(text)
            else:
                n.meta.pop(key, None)
    pinned = {e.producer: Spec.parse(e.dst_spec) for e in ctx.plan.edges
              if e.consumer == "output" and e.direction == "fwd"}
    out = next(iter(gm.graph.find_nodes(op="output")))
    out.meta[ir.IN_SPECS] = tuple(pinned.get(a.name) for a in out.all_input_nodes)
    return PassResult(gm, True)
