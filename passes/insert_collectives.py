"""insert_collectives: a communication node on every edge whose layouts differ.

Contract (runs on the annotated *global* graph; the edges are the same on every rank). For
each edge ``producer -> consumer`` (input ``p`` of the consumer):

* value plan ``src -> dst``: ``src`` the producer's output spec, ``dst`` the spec the consumer's
  strategy needs (:func:`fxpar.resharding.intra.reshard_plan`);
* gradient plan (when the value carries a gradient): ``grad_in_spec(consumer, p) ->
  grad_out_spec(src)`` (:mod:`fxpar.spec`); for a trainable parameter the target is its
  storage spec with ``P(sum)`` on its *replica axes* (axes where it is stored ``R`` and some use
  produces a ``P(sum)`` gradient): the model-state manager reduces those, asynchronously;
* if the value plan's first step is a collective, a ``torch.ops.fxpar.start`` node right after
  the producer and a ``torch.ops.fxpar.wait`` node right before the consumer (the consumer
  reads the wait); otherwise, if anything is left to do (local steps, a gradient plan, a
  ``P(avg)`` gradient scale), one synchronous ``torch.ops.fxpar.redistribute`` node before the
  consumer (:mod:`fxpar.runtime.comm`). A parameter use with nothing to do gets
  no node: autograd accumulates its gradient on the parameter (already in the target layout)
  and the runner's post-accumulate hook hands it to the model-state manager.

**Partial gradients sunk into parameter reductions.** A backward is linear in the gradient
it receives, so a value stored ``R`` on axis ``a`` whose every use returns a ``P(sum)``
gradient on ``a`` need not be all-reduced when its producer's only differentiable inputs are
parameters used nowhere else and consumed ``R`` on ``a``: the producer's backward turns the
partial sum into partial parameter gradients. A parameter stored ``R`` on ``a`` gets ``a`` as
a replica axis; one stored sharded (ZeRO-3, gathered for the use) reduce-scatters its
gradient on the use's edge. Either way the reduction happens in the model-state manager's
asynchronous path instead of synchronously in backward. A GPT's learned position
embedding under data parallelism is the case: ``wpe[arange(T)]`` is the same on every rank
and is added to batch-sharded activations; its gradient is reduced with the other weights'
(as DDP does), not as an activation in the middle of backward.

An output whose spec is ``Partial`` gets the edge to its finalized spec (``P -> R``) before the
``output`` node (to the spec ``annotate`` put on the output node: a pin, else ``P -> R``).
A ``getitem`` of a multi-output node keeps the producer's element spec and
the edge goes after it; the getitem's consumers then read that edge's output (in the spec the
plan gave the getitem), and their own edges start from it. Every inserted node carries ``meta[EDGE]`` and ``meta[SPECS]``;
``gm.meta[EDGES]`` holds every edge by name; ``gm.meta[REPLICA_AXES]`` maps each trainable parameter to its replica axes. A Megatron MLP
(``col`` then ``row``) gets exactly one forward collective (the row output's all-reduce) and
one gradient all-reduce (the ``f`` edge at the column input)::

    x -> [reshard f: R -> R | grad P(sum) -> R] -> linear(col) -> gelu -> linear(row)
      -> [start all_reduce(tp)] ... [wait] -> output

Reads node meta only (``SPECS``, ``IN_SPECS``, ``VAL``, ``PARAM``), never the plan.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from fxpar import ir
from fxpar.ir import grad_flags
from fxpar.resharding.intra import reshard_plan
from fxpar.runtime.comm import REDISTRIBUTE, START, WAIT, Edge, grad_scale
from fxpar.spec import Partial, Replicate, Spec, grad_in_spec, grad_out_spec
from fxpar.strategies.base import Strategy
from fxpar.passes.infra import PassContext, PassResult, graph_pass
from fxpar.passes.checks import annotated, comm_ops_have_edges

__all__ = ["insert_collectives_pass"]
_SUM = Partial("sum")


def _strategy(n: fx.Node) -> Strategy:
    return Strategy(n.meta[ir.IN_SPECS], n.meta[ir.SPECS])


def _val(a: fx.Node, o: int):
    v = a.meta.get(ir.VAL)
    if isinstance(v, (tuple, list)):
        v = v[o] if o < len(v) else None
    return v if isinstance(v, torch.Tensor) else None


def _uses(gm: fx.GraphModule):
    """``(producer, output index, consumer, input position, dst spec)`` for every tensor edge."""
    for n in gm.graph.nodes:
        if n.op == "output" or ir.IN_SPECS not in n.meta:
            continue
        for p, a in enumerate(n.all_input_nodes):
            dst = n.meta[ir.IN_SPECS][p]
            if dst is None or ir.SPECS not in a.meta:
                continue
            o = n.args[1] if n.target is operator.getitem and isinstance(n.args[1], int) else 0
            if o < len(a.meta[ir.SPECS]) and _val(a, o) is not None:
                yield a, o, n, p, dst


def _replica_axes(uses, flags) -> dict[fx.Node, tuple[int, ...]]:
    out: dict[fx.Node, set[int]] = {}
    for a, o, n, p, dst in uses:
        if ir.PARAM in a.meta and flags.get(a):
            store = a.meta[ir.SPECS][0]
            g = grad_in_spec(_strategy(n), p)
            axes = out.setdefault(a, set())
            axes.update(i for i, pl in enumerate(g) if pl == _SUM and isinstance(store[i], Replicate))
    return {a: tuple(sorted(s)) for a, s in out.items()}


def _sunk(uses, flags, replica) -> dict[fx.Node, set[int]]:
    """Producers whose output gradient stays ``P(sum)`` on some axes (module docstring), and
    those axes; adds them to the producers' parameters' ``replica`` axes."""
    uses_of: dict[fx.Node, list] = {}
    for a, o, n, p, dst in uses:
        uses_of.setdefault(a, []).append(grad_in_spec(_strategy(n), p))
    out: dict[fx.Node, set[int]] = {}
    for a, grads in uses_of.items():
        if (a.op != "call_function" or not flags.get(a) or len(a.meta[ir.SPECS]) != 1
                or len(grads) != len(a.users)):   # another user (the output, a getitem) wants R
            continue
        src = a.meta[ir.SPECS][0]
        axes = {i for i, pl in enumerate(src) if isinstance(pl, Replicate)}
        for g in grads:
            axes &= {i for i, pl in enumerate(g) if pl == _SUM}
        diff = [(k, x) for k, x in enumerate(a.all_input_nodes) if flags.get(x)]
        if not axes or not diff or not all(
                ir.PARAM in x.meta and len(x.users) == 1
                and all(isinstance(a.meta[ir.IN_SPECS][k][i], Replicate) for i in axes)
                for k, x in diff):
            continue
        out[a] = axes
        for _, x in diff:  # stored R there: a replica axis; stored S: its edge reduce-scatters
            rep = {i for i in axes if isinstance(x.meta[ir.SPECS][0][i], Replicate)}
            replica[x] = tuple(sorted(set(replica.get(x, ())) | rep))
    return out


@graph_pass(requires=(annotated,), ensures=(comm_ops_have_edges,))
def insert_collectives_pass(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    mesh, graph = ctx.mesh, gm.graph
    flags = grad_flags(gm)
    uses = list(_uses(gm))
    replica = _replica_axes(uses, flags)
    sunk = _sunk(uses, flags, replica)
    for a, axes in sunk.items():   # its gradient stays partial there (what verify compares)
        g = grad_out_spec(a.meta[ir.SPECS][0])
        a.meta[ir.GRAD_SPEC] = Spec(tuple(_SUM if i in axes else pl for i, pl in enumerate(g)))
    gm.meta[ir.REPLICA_AXES] = {a.meta[ir.PARAM].fqn: tuple(mesh.axis_names[i] for i in ax)
                                for a, ax in replica.items()}
    edges: dict[str, Edge] = gm.meta.setdefault(ir.EDGES, {})
    names: dict[str, int] = {}
    modified = False

    def add(kind: str, edge: Edge, target, args, where: fx.Node, after: bool) -> fx.Node:
        base = f"{kind}__{edge.producer}"
        k = names.get(base, 0)
        names[base] = k + 1
        ctx_mgr = graph.inserting_after(where) if after else graph.inserting_before(where)
        with ctx_mgr:
            node = graph.create_node("call_function", target, args, name=base if k == 0 else f"{base}_{k}")
        node.meta[ir.EDGE] = edge
        # the source line it serves, so print_readable shows where the collective comes from
        node.meta[ir.STACK_TRACE] = where.meta.get(ir.STACK_TRACE)
        return node

    def grad_in(n: fx.Node, p: int) -> Spec:
        """The gradient ``n``'s backward gives input ``p``: partial on ``n``'s sunk axes."""
        g = grad_in_spec(_strategy(n), p)
        return Spec(tuple(_SUM if i in sunk.get(n, ()) else pl for i, pl in enumerate(g)))

    def edge_for(a, o, consumer_name, src, dst, gsrc, gtarget=None) -> Edge | None:
        v = _val(a, o)
        shape, dtype = tuple(v.shape), v.dtype
        fwd = reshard_plan(src, dst, mesh, shape, dtype)
        needs_grad = bool(flags.get(a)) and dtype.is_floating_point
        param = a.meta[ir.PARAM].fqn if (ir.PARAM in a.meta and needs_grad) else None
        bwd, scale = None, 1.0
        if needs_grad:
            target = gtarget or grad_out_spec(src)
            if a in sunk:
                target = Spec(tuple(_SUM if i in sunk[a] else pl for i, pl in enumerate(target)))
            if param is not None:
                target = Spec(tuple(_SUM if i in replica.get(a, ()) else pl
                                    for i, pl in enumerate(target.placements)))
            bwd = reshard_plan(gsrc, target, mesh, shape, dtype)
            scale = grad_scale(src, dst, mesh.shape)
        if not fwd.steps and (bwd is None or not bwd.steps) and scale == 1.0:
            return None  # (a parameter's gradient then reaches the runner via its leaf)
        name = f"{a.name}->{consumer_name}"
        edge = Edge(name, a.name, consumer_name, fwd, bwd, scale, param)
        edges[name] = edge
        return edge

    def insert(edge: Edge, consumer: fx.Node, value: fx.Node, v: torch.Tensor,
               tag: str | None = None) -> fx.Node:
        """Nodes for ``edge`` reading ``value`` (global value ``v``); returns the node the
        consumer reads. An activation's collective starts right after its producer; a
        placeholder's right before the consumer (prefetch_pass moves parameter gathers).
        ``shape`` arguments are global here; localize makes them local."""
        shape = list(v.shape)
        if edge.collective:
            kind = "_".join(dict.fromkeys(f"{s.kind}_{s.axis_name}" for s in edge.fwd.steps))
            kind = kind if tag is None else f"{tag}_{kind}"
            early = value.op != "placeholder"
            start = add(kind, edge, START, ([value], [edge.name]),
                        value if early else consumer, after=early)
            out = add("wait", edge, WAIT, (start, value, edge.name, shape, str(edge.grad_mode)),
                      consumer, after=False)
        else:
            kinds = [f"{s.kind}_{s.axis_name}" for s in edge.fwd.steps]
            if not kinds and edge.bwd is not None and edge.bwd.steps:
                kinds = ["grad_" + "_".join(f"{s.kind}_{s.axis_name}" for s in edge.bwd.steps)]
            name = "_".join(dict.fromkeys(kinds)) or ("param" if edge.param else "grad_scale")
            out = add(name if tag is None else f"{tag}_{name}",
                      edge, REDISTRIBUTE, (value, edge.name, shape, str(edge.grad_mode)),  # a plain str in graphs
                      consumer, after=False)
        out.meta[ir.SPECS] = (edge.fwd.dst,)
        out.meta[ir.VAL] = v
        return out

    # Fan-out (meta[SHARED], meta[GRAD_ACC]): one edge from the producer to all its consumers,
    # before the first: its forward reshards to the shared layout (or is the identity), its
    # backward reshards the SUM of the consumers' gradients (autograd adds them at its output,
    # each already in the accumulation layout) to the producer's gradient layout. The
    # consumers read it; their own edges start from the shared layout and end at the sum's.
    acc_of: dict[fx.Node, tuple[fx.Node, Spec, Spec]] = {}
    first: dict[fx.Node, fx.Node] = {}
    for a, o, n, p, dst in uses:
        first.setdefault(a, n)
    for a, n in first.items():
        L, G = a.meta.get(ir.SHARED), a.meta.get(ir.GRAD_ACC)
        if (L is None and G is None) or a in sunk:   # sunk: reduced with the parameters' instead
            continue
        src, v = a.meta[ir.SPECS][0], _val(a, 0)
        L = L or src
        G = G or grad_out_spec(L)
        shape = tuple(v.shape)
        edge = Edge(f"{a.name}->consumers", a.name, n.name, reshard_plan(src, L, mesh, shape, v.dtype),
                    reshard_plan(G, grad_out_spec(src), mesh, shape, v.dtype))
        edges[edge.name] = edge
        acc_of[a] = (insert(edge, n, a, v, "fan_out"), L, G)
        modified = True

    # A getitem's edge goes after it, so its consumers read the edge's output (in the layout
    # the plan gave the getitem); their own edges (processed later: uses are in node order)
    # start from that node and that spec, not from the getitem itself.
    moved: dict[fx.Node, fx.Node] = {}
    for a, o, n, p, dst in uses:
        if a in acc_of:
            acc, L, G = acc_of[a]
            edge = edge_for(a, o, n.name, L, dst, grad_in(n, p), gtarget=G)
            n.replace_input_with(a, acc if edge is None else insert(edge, n, acc, _val(a, o)))
            continue
        if a in moved:
            value = moved[a]
            src = value.meta[ir.SPECS][0]
            edge = edge_for(a, o, n.name, src, dst, grad_in(n, p))
            if edge is not None:
                out = insert(edge, n, value, _val(a, o))
                n.replace_input_with(value, out)
                modified = True
            continue
        src = a.meta[ir.SPECS][o]
        if n.target is operator.getitem:
            # The getitem keeps the element's layout; the edge goes after it.
            edge = edge_for(a, o, n.name, src, dst, grad_out_spec(dst))
            n.meta[ir.SPECS] = (src,)
            n.meta[ir.IN_SPECS] = (src,)
            if edge is None:
                continue
            users = [u for u in n.users]
            nxt = n.next
            out = insert(edge, nxt, n, _val(a, o))
            for u in users:
                u.replace_input_with(n, out)
            moved[n] = out
            modified = True
            continue
        edge = edge_for(a, o, n.name, src, dst, grad_in(n, p))
        if edge is None:
            continue
        out = insert(edge, n, a, _val(a, o))
        n.replace_input_with(a, out)
        modified = True

    # graph outputs: a Partial value is finalized before it leaves the graph, to the spec
    # annotate recorded on the output node (an output pin may ask for another layout)
    out_node = next(n for n in graph.nodes if n.op == "output")
    finals = dict(zip(out_node.all_input_nodes, out_node.meta.get(ir.IN_SPECS, ())))
    for a in list(out_node.all_input_nodes):
        if ir.SPECS not in a.meta or _val(a, 0) is None:
            continue
        src = a.meta[ir.SPECS][0]
        fin = finals.get(a) or grad_out_spec(src)
        edge = edge_for(a, 0, "output", src, fin, grad_out_spec(fin))
        if edge is None:
            continue
        out = insert(edge, out_node, a, _val(a, 0))
        out_node.replace_input_with(a, out)
        modified = True
    return PassResult(gm, modified)
