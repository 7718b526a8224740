r"""Split a captured training graph into pipeline stage chunks at layer boundaries.

:func:`split_stages` cuts the graph (captured at the *microbatch* shape) into ``n`` contiguous
pieces. Each piece is a graph of the same form as a captured one (parameter placeholders with
``meta[PARAM]``, input placeholders with ``meta[INPUT]``, the same node names), so the intra-op
planner and the passes take it as they take a whole model.

* **Where to cut.** The graph's op nodes form *units*: maximal runs of nodes of one layer
  (:func:`fxpar.layers.layer_of`) in graph order. Given ``split_points`` (module FQNs such as
  ``"model.layers.8"``), a chunk starts at the first node traced under that module. Otherwise
  the units are split into ``n`` runs minimizing the largest run's compute time (the cost
  model's roofline time of each node on one device of ``cluster``: an exact linear-partition
  DP, ``f[k][j] = min_i max(f[k−1][i], T(i..j))``).
* **Which chunk a node runs in**: ``chunk(n) = max(chunk of its unit, chunk of every input)``,
  so the order is always valid; a ``getitem`` stays with its producer.
* **Boundary values.** A value made in chunk ``a`` and used in chunk ``b > a + 1`` (a skip
  connection, an encoder output) is relayed: every chunk between takes it as an input and
  returns it unchanged, so chunks only talk to their neighbours (the schedule's
  ``SEND_F(k)``/``RECV_F(k+1)`` pairs carry everything). Chunk ``k``'s inputs are its user
  inputs (the batch, sliced per microbatch by the runtime) then its boundary values in
  producer order, marked ``InputInfo.requires_grad`` when they carry a gradient; its outputs
  are the boundary values later chunks need, the last chunk's outputs the model's own.
* **Parameters** live in every chunk that uses them (a tied embedding and LM head: the first
  and the last chunk); the runtime sums their gradients across chunks.

>>> import torch, fxpar
>>> from examples.models import GPT
>>> gm = fxpar.capture(GPT(vocab=32, d_model=16, n_heads=2, n_layers=4, seq_len=8),
...                    (torch.randint(0, 32, (2, 8)),))
>>> chunks = split_stages(gm, 2, split_points=["blocks.2"])
>>> [c.layers for c in chunks]
[('(top)', 'tok_emb', 'pos_emb', 'blocks.0', 'blocks.1'), ('blocks.2', 'blocks.3', 'ln_f', 'head')]
>>> chunks[1].inputs, chunks[0].outputs            # blocks.1's output crosses
(('add_4',), ('add_4',))
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from fxpar import ir
from fxpar.errors import PlanError
from fxpar.layers import _stack_fqns, layer_of

__all__ = ["StageGraph", "is_boundary", "split_stages", "units"]


@dataclass(frozen=True, eq=False)
class StageGraph:
    """One stage chunk: its graph (captured form), the layers it runs, the boundary values it
    receives (``inputs``, names of the producing nodes of the whole graph) and sends
    (``outputs``), and the indices of the whole graph's user inputs it reads."""

    index: int
    graph: fx.GraphModule
    layers: tuple[str, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    user_inputs: tuple[int, ...]
    #: the first node of the unit it starts at (``split_stages(start_nodes=...)`` redoes a split)
    start: str = ""

    @property
    def is_last(self) -> bool:
        return bool(self.graph.meta.get(_LAST))


_LAST = "fxpar_last_chunk"
#: the ``InputInfo.path`` of a boundary input starts so (a user input's is a pytree key path)
_BOUNDARY = "[boundary "


def is_boundary(info: ir.InputInfo) -> bool:
    """Whether a chunk graph's input is a boundary value (an earlier chunk's activation)
    rather than one of the model's own inputs."""
    return info.path.startswith(_BOUNDARY)


def _ops(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")]


def units(gm: fx.GraphModule) -> list[tuple[str, list[fx.Node]]]:
    """Maximal runs of op nodes of one layer, in graph order: ``[(layer, nodes), ...]``."""
    out: list[tuple[str, list[fx.Node]]] = []
    for n in _ops(gm):
        lay = layer_of(n)
        if out and (out[-1][0] == lay or n.target is operator.getitem):
            out[-1][1].append(n)
        else:
            out.append((lay, [n]))
    return out


def _unit_times(gm: fx.GraphModule, us, cluster) -> list[float]:
    from fxpar.cost.compute import node_cost, node_dispatches, op_time

    flags = ir.grad_flags(gm)
    out = []
    for _, nodes in us:
        t = 0.0
        for n in nodes:
            f, b = op_time(node_cost(n, requires_grad=flags), cluster,
                           dispatches=node_dispatches(n, requires_grad=flags))
            t += f + (b if flags.get(n) else 0.0)
        out.append(t)
    return out


def _balanced(times: Sequence[float], n: int) -> list[int]:
    """Start index of each of ``n`` contiguous runs of ``times`` minimizing the largest sum
    (exact DP; ties: the earliest cut)."""
    u = len(times)
    pre = [0.0]
    for t in times:
        pre.append(pre[-1] + t)
    inf = float("inf")
    f = [[inf] * (u + 1) for _ in range(n + 1)]
    arg = [[0] * (u + 1) for _ in range(n + 1)]
    f[0][0] = 0.0
    for k in range(1, n + 1):
        for j in range(k, u + 1):
            for i in range(k - 1, j):
                v = max(f[k - 1][i], pre[j] - pre[i])
                if v < f[k][j] - 1e-15:
                    f[k][j], arg[k][j] = v, i
    starts, j = [], u
    for k in range(n, 0, -1):
        j = arg[k][j]
        starts.append(j)
    return starts[::-1]


def _cut_starts(gm, us, n, split_points, cluster) -> list[int]:
    """Index into ``us`` of the unit each chunk starts at."""
    if split_points is None:
        if len(us) < n:
            raise PlanError(f"{n} pipeline stage chunks but the graph has only {len(us)} "
                            f"layers to split ({[lay for lay, _ in us]}): use fewer stages")
        if cluster is None:
            from fxpar.cluster import Cluster

            cluster = Cluster.preset("dgx-a100")
        return _balanced(_unit_times(gm, us, cluster), n)
    points = list(split_points)
    if len(points) != n - 1:
        raise PlanError(f"{len(points)} split points {points} for {n} stage chunks: give "
                        f"{n - 1} (each the module FQN a chunk starts at)")
    starts = [0]
    for p in points:
        hit = next((i for i, (_, nodes) in enumerate(us)
                    if any(f == p or f.startswith(p + ".") for nd in nodes for f in _stack_fqns(nd))),
                   None)
        if hit is None:
            layers = list(dict.fromkeys(lay for lay, _ in us))
            raise PlanError(f"split point {p!r} names no module of the graph (its layers: "
                            f"{layers[:12]}{'...' if len(layers) > 12 else ''})")
        if hit <= starts[-1]:
            raise PlanError(f"split point {p!r} does not come after the previous chunk's start "
                            f"(layer {us[starts[-1]][0]!r}): split points go in forward order")
        starts.append(hit)
    return starts


def split_stages(gm: fx.GraphModule, n: int, *, split_points: Sequence[str] | None = None,
                 cluster=None, start_nodes: Sequence[str] | None = None) -> list[StageGraph]:
    """Split ``gm`` into ``n`` stage chunks (module docstring); ``start_nodes`` (the
    ``StageGraph.start`` of an earlier split) repeats that split exactly. Raises
    :class:`PlanError` for more chunks than layers, a split point that names no module, or one
    out of order."""
    if n < 1:
        raise PlanError(f"need at least one stage chunk, got {n}")
    us = units(gm)
    if not us:
        raise PlanError("the graph has no op to split into stages")
    if start_nodes is not None:
        first = {nodes[0].name: i for i, (_, nodes) in enumerate(us)}
        missing = [x for x in start_nodes if x not in first]
        if missing or len(start_nodes) != n:
            raise PlanError(f"stage chunks start at nodes {list(start_nodes)}, but this graph "
                            f"has no layer starting at {missing} (a plan for another model?)")
        starts = [first[x] for x in start_nodes]
    else:
        starts = _cut_starts(gm, us, n, split_points, cluster)
    of_unit = {}
    for k in range(n):
        end = starts[k + 1] if k + 1 < n else len(us)
        for lay, nodes in us[starts[k]:end]:
            for nd in nodes:
                of_unit[nd] = k
    chunk: dict[fx.Node, int] = {}
    for nd in _ops(gm):
        k = of_unit[nd]
        for a in nd.all_input_nodes:
            if a in chunk:
                k = max(k, chunk[a])
        if nd.target is operator.getitem and nd.args[0] in chunk:
            k = chunk[nd.args[0]]
        chunk[nd] = k
    out_node = next(iter(gm.graph.find_nodes(op="output")))
    # last chunk that reads each value (the output counts as the last chunk)
    last_use: dict[fx.Node, int] = {}
    for nd in list(chunk) + [out_node]:
        k = chunk.get(nd, n - 1)
        for a in nd.all_input_nodes:
            if a in chunk and k > chunk[a]:
                last_use[a] = max(last_use.get(a, -1), k)
    flags = ir.grad_flags(gm)
    for a in last_use:
        if not isinstance(a.meta.get(ir.VAL), torch.Tensor):
            raise PlanError(f"node {a.name} ({a.target}) crosses a stage boundary but is not "
                            "a tensor; move the split point")
    empty = [k for k in range(n) if k not in chunk.values()]
    if empty:
        raise PlanError(f"stage chunks {empty} have no op: fewer stages or other split points")
    return [dataclasses.replace(
                _build(gm, k, n, chunk, last_use, flags,
                       tuple(dict.fromkeys(layer_of(nd) for nd in chunk if chunk[nd] == k))),
                start=us[starts[k]][1][0].name)
            for k in range(n)]


def _build(gm, k, n, chunk, last_use, flags, layers) -> StageGraph:
    """The graph of chunk ``k`` (module docstring)."""
    ops = [nd for nd in chunk if chunk[nd] == k]
    # boundary values: made before k, still needed at k or later
    inputs = [a for a in chunk if chunk[a] < k and last_use.get(a, -1) >= k]
    outputs = [a for a in chunk if chunk[a] <= k and last_use.get(a, -1) > k]
    used = {a for nd in ops for a in nd.all_input_nodes}
    if k == n - 1:
        out_node = next(iter(gm.graph.find_nodes(op="output")))
        used |= set(out_node.all_input_nodes)
    holders = [nd for nd in gm.graph.nodes
               if nd.op in ("placeholder", "get_attr") and nd in used and nd not in chunk]
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    user_idx = []
    in_infos = []
    user_inputs = {info.node_name: (i, info) for i, info in enumerate(ir.user_inputs(gm))}
    for nd in holders:
        if nd.op == "placeholder" and ir.INPUT in nd.meta:
            continue
        env[nd] = g.node_copy(nd, lambda x: env[x])
    for nd in holders:
        if nd.op == "placeholder" and ir.INPUT in nd.meta:
            i, info = user_inputs[nd.name]
            user_idx.append(i)
            env[nd] = g.node_copy(nd, lambda x: env[x])
            in_infos.append(info)
    for a in inputs:
        ph = g.placeholder(a.name)
        ph.meta.update({key: a.meta[key] for key in (ir.VAL, ir.STACK_TRACE) if key in a.meta})
        v = a.meta[ir.VAL]
        info = ir.InputInfo(name=a.name, path=f"{_BOUNDARY}{a.name}]", node_name=a.name,
                            shape=tuple(int(s) for s in v.shape), dtype=v.dtype,
                            requires_grad=bool(flags.get(a)))
        ph.meta[ir.INPUT] = info
        in_infos.append(info)
        env[a] = ph
    for nd in ops:
        env[nd] = g.node_copy(nd, lambda x: env[x])
    if k == n - 1:
        out_node = next(iter(gm.graph.find_nodes(op="output")))
        g.node_copy(out_node, lambda x: env[x])
    else:
        new_out = g.output(tuple(env[a] for a in outputs))
        new_out.meta[ir.VAL] = tuple(a.meta[ir.VAL] for a in outputs)
    for old, new in env.items():
        new.name = old.name  # plans are keyed by node names
    sub = fx.GraphModule(gm, g)
    sub.meta.update(gm.meta)
    params = ir.params(gm)
    mine = {nd.meta[ir.PARAM].fqn for nd in holders if ir.PARAM in nd.meta}
    sub.meta[ir.PARAMS] = {f: info for f, info in params.items() if f in mine}
    sub.meta[ir.INPUTS] = tuple(in_infos)
    sub.meta[ir.INPUT_TREE] = pytree.tree_flatten((tuple(range(len(in_infos))), {}))[1]
    if k < n - 1:
        sub.meta[ir.OUTPUTS] = tuple(ir.OutputInfo(j, "user") for j in range(len(outputs)))
        sub.meta[ir.OUTPUT_TREE] = pytree.tree_flatten(tuple(range(len(outputs))))[1]
    sub.meta[_LAST] = k == n - 1
    return StageGraph(k, sub, layers, tuple(a.name for a in inputs),
                      tuple(a.name for a in outputs), tuple(user_idx))
