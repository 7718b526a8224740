"""localize: turn the global distributed graph into this rank's local program.

Contract (per rank, ``ctx.coord`` set; runs after insert_collectives):

* every node's ``meta[VAL]`` becomes a ``meta``-device tensor of this rank's local shape
  (``Spec.local_shape`` of its output spec); the global value stays under
  ``meta[GLOBAL_VAL]``; parameters and buffers are placeholders fed with local shards by the
  runner;
* the ``shape`` argument of communication ops (``torch.ops.fxpar.wait``/``reshard``) is the
  destination's local shape;
* size arguments become local: ``view``/``reshape``/``_unsafe_view``/``expand`` and the
  ``new_*``/``zeros``/``ones``/``empty``/``full`` factories get the output's local
  shape, ``unflatten`` its local sizes, a sharded ``arange`` its local bounds;
* device arguments (``device=``, ``.to(device)``) name ``ctx.device``;
* a vocabulary-parallel ``embedding`` (strategy ``vocab``) becomes
  :func:`fxpar.runtime.ops.vocab_parallel_embedding` with this rank's first row;
* a training ``aten.dropout`` becomes ``x * fxpar.keep_mask(x, p, site, shard_key) / (1 - p)``
  (:func:`fxpar.runtime.ops.sharded_dropout`): the mask is keyed by the node (its index, the
  site) and this rank's coordinates on the axes that shard its input; any other random op raises
  :class:`fxpar.PlanError` naming the node (replicas would silently diverge).

Example (``view(x[4, 6], [4, 2, 3])`` with ``x`` ``S(0)`` on a 2-way axis, coordinate 1):
the node becomes ``view(x, [2, 2, 3])``.
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from fxpar import ir
from fxpar.errors import PlanError
from fxpar.passes.checks import localized
from fxpar.passes.infra import PassContext, PassResult, graph_pass
from fxpar.runtime.comm import COMM_OPS
from fxpar.runtime.ops import sharded_dropout, vocab_parallel_embedding
from fxpar.spec import Shard
from fxpar.strategies.embedding import NEEDS_MASKED_LOOKUP

aten = torch.ops.aten

_SHAPE_ARG1 = {aten.view.default, aten.reshape.default, aten._unsafe_view.default,
               aten.expand.default, aten.new_zeros.default, aten.new_ones.default,
               aten.new_empty.default, aten.new_full.default}
_SHAPE_ARG0 = {aten.zeros.default, aten.ones.default, aten.empty.memory_format,
               aten.full.default}
_DROPOUT = {aten.dropout.default}
#: Random ops with no shard-aware replacement yet: ranks holding the same data would draw
#: different numbers (silently wrong), so they are refused.
_RANDOM = {aten.rand.default, aten.randn.default, aten.rand_like.default, aten.randn_like.default,
           aten.bernoulli.default, aten.bernoulli.p, aten.randint.default, aten.randint_like.default,
           aten.randperm.default, aten.multinomial.default, aten.normal.Tensor_float,
           aten.native_dropout.default, aten.uniform_.default, aten.normal_.default,
           aten.bernoulli_.float}


def _local(spec, v: torch.Tensor, ctx: PassContext) -> torch.Tensor:
    shape = spec.local_shape(tuple(v.shape), ctx.mesh.shape, ctx.coord)
    return torch.empty(shape, dtype=v.dtype, device="meta")


def _arange_bounds(n: fx.Node, spec, ctx: PassContext, length: int):
    """``(start, end, step)`` of this rank's piece of a sharded 1-D ``arange``."""
    args = list(n.args)
    start, end = (0, args[0]) if n.target is aten.arange.default else (args[0], args[1])
    step = args[2] if n.target is aten.arange.start_step and len(args) > 2 else 1
    sl = spec.global_slices((length,), ctx.mesh.shape, ctx.coord)[0]
    return start + sl.start * step, start + sl.stop * step, step


@graph_pass(ensures=(localized,))
def localize_pass(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    if ctx.coord is None:
        raise PlanError("localize_pass needs this rank's mesh coordinate (ctx.coord)")
    graph = gm.graph
    glob_shape: dict[fx.Node, tuple[int, ...]] = {}
    for i, n in enumerate(list(graph.nodes)):
        specs = n.meta.get(ir.SPECS)
        v = n.meta.get(ir.VAL)
        glob = v
        if isinstance(v, torch.Tensor):
            glob_shape[n] = tuple(v.shape)
        if specs:
            n.meta[ir.GLOBAL_VAL] = v
        if specs and isinstance(v, torch.Tensor):
            n.meta[ir.VAL] = _local(specs[0], v, ctx)
        elif specs and isinstance(v, (tuple, list)):
            n.meta[ir.VAL] = type(v)(_local(s, t, ctx) if isinstance(t, torch.Tensor) else t
                                     for s, t in zip(specs, v))
        if n.op != "call_function":
            continue
        if n.target in COMM_OPS:
            if n.target is not torch.ops.fxpar.start.default:  # (x..., edge, shape, grad)
                n.args = n.args[:-2] + (list(n.meta[ir.VAL].shape), n.args[-1])
            continue
        dev = torch.device(ctx.device)
        n.args, n.kwargs = pytree.tree_map_only(torch.device, lambda d: dev, (n.args, n.kwargs))
        local = n.meta.get(ir.VAL)
        if n.target in _SHAPE_ARG1:
            n.args = (n.args[0], list(local.shape)) + tuple(n.args[2:])
        elif n.target in _SHAPE_ARG0:
            n.args = (list(local.shape),) + tuple(n.args[1:])
        elif n.target is aten.unflatten.int:
            d = n.args[1] % glob.ndim
            k = len(n.args[2])
            n.args = (n.args[0], n.args[1], list(local.shape[d:d + k]))
        elif n.target in (aten.arange.default, aten.arange.start, aten.arange.start_step):
            if specs and not specs[0].is_replicated:
                n.args = _arange_bounds(n, specs[0], ctx, glob.shape[0])
                n.target = aten.arange.start_step
        elif n.target is aten.embedding.default and NEEDS_MASKED_LOOKUP in n.meta.get(ir.STRATEGY, ""):
            w = n.args[0]
            wspec = n.meta[ir.IN_SPECS][n.all_input_nodes.index(w)]
            start = wspec.global_slices(glob_shape[w], ctx.mesh.shape, ctx.coord)[0].start
            n.target = vocab_parallel_embedding
            n.args = (n.args[0], n.args[1], start) + tuple(n.args[2:])
        elif n.target in _RANDOM:
            raise PlanError(f"node {n.name} ({n.target}): random ops other than dropout are not "
                            "supported under sharding yet (replicas would draw different values)")
        elif n.target in _DROPOUT:
            x, p = n.args[0], float(n.args[1])
            train = n.args[2] if len(n.args) > 2 else n.kwargs.get("train", True)
            if not train or p == 0.0:
                continue  # the identity: aten.dropout itself draws nothing
            xs = n.meta[ir.IN_SPECS][0]
            key = tuple(c for c, pl in zip(ctx.coord, xs) if isinstance(pl, Shard))
            with graph.inserting_before(n):
                new = sharded_dropout(graph, x, p, i, key, n.name)
            kept = new.args[0]
            mask = kept.args[1]
            for m in (mask, kept, new):
                m.meta.update(n.meta)
            mask.meta[ir.VAL] = torch.empty(n.meta[ir.VAL].shape, dtype=torch.bool, device="meta")
            n.replace_all_uses_with(new)
            graph.erase_node(n)
            new.name = n.name  # the plan's key for the node
    return PassResult(gm, True)
