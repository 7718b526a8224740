"""localize: turn the global distributed graph into this rank's local program.

Contract (per rank, ``ctx.coord`` set; runs after insert_collectives):

* every node's ``meta[VAL]`` becomes a ``meta``-device tensor of this rank's local shape
  (``Spec.local_shape`` of its output spec); the global value stays under
  ``meta[GLOBAL_VAL]``; parameters and buffers are placeholders fed with local shards by the
  runner;
* the ``shape`` argument of communication ops (``torch.ops.fxpar.wait``/``redistribute``) is the
  destination's local shape;
* device arguments (``device=``, ``.to(device)``) name ``ctx.device``;
* every other op whose sharded computation is not the plain op on local tensors is rewritten
  by its record's ``local=`` entry (:func:`fxpar.strategies.local.local_rule`, a table, not a
  chain here): size arguments of ``view``/``reshape``/``expand``/factories/``unflatten`` become
  local, a sharded ``arange`` gets its local bounds, a vocabulary-parallel ``embedding`` calls
  :func:`fxpar.runtime.ops.vocab_parallel_embedding` with this rank's first row, a
  ``cross_entropy_loss`` / nll loss / ``log_softmax`` with its class dim split calls its
  vocabulary-parallel form (:mod:`fxpar.runtime.vocab`, all-reduces over the axes splitting
  it, bound at run time), a training
  ``aten.dropout`` is ``torch.ops.fxpar.sharded_dropout`` keyed by the node's name (the site:
  its crc32, unique across a pipeline's chunk graphs, which keep the model graph's names) and
  this rank's shard coordinates; every other random op that draws (training attention with
  dropout, ``uniform_``, ``rand_like``, ``normal``, ``bernoulli``...) becomes a
  ``torch.ops.fxpar.keyed_*`` op keyed the same way (:mod:`fxpar.strategies.rand`); the few
  without a keyed form raise :class:`fxpar.PlanError` naming the node (planning refused them
  already: replicas would silently diverge).

Example (``view(x[4, 6], [4, 2, 3])`` with ``x`` ``S(0)`` on a 2-way axis, coordinate 1):
the node becomes ``view(x, [2, 2, 3])``.
"""

from __future__ import annotations

import zlib

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from fxpar import ir
from fxpar.errors import PlanError
from fxpar.passes.checks import localized
from fxpar.passes.infra import PassContext, PassResult, graph_pass
from fxpar.runtime.comm import COMM_OPS, START
from fxpar.strategies.local import LocalContext, local_rule

__all__ = ["localize_pass"]


def _local(spec, v: torch.Tensor, ctx: PassContext) -> torch.Tensor:
    """The local value of ``v`` under ``spec`` on this rank: its local shape, laid out as ``v``
    is (:func:`_layout`), so what reads strides (the memory model's views, a reshape's copy)
    sees the rank program as eager will run it."""
    shape = spec.local_shape(tuple(v.shape), ctx.mesh.shape, ctx.coord)
    return torch.empty_strided(shape, _layout(v, shape), dtype=v.dtype, device="meta")


def _layout(v: torch.Tensor, shape) -> tuple[int, ...]:
    """Strides for ``shape`` in ``v``'s layout: its dims in the order of ``v``'s strides
    (innermost first, ties row-major), dense, and a broadcast dim (stride 0: ``expand``) still
    0. ``v`` contiguous gives contiguous strides; attention's output in the fused kernels'
    heads-after-sequence layout keeps that layout on a shard.

    >>> x = torch.empty(4, 8, 2, 16, device="meta").transpose(1, 2)       # [4, 2, 8, 16]
    >>> _layout(x, (4, 1, 8, 16)), _layout(x.expand(4, 2, 8, 16), (2, 2, 8, 16))
    ((128, 16, 16, 1), (256, 16, 32, 1))
    >>> _layout(torch.empty(3, 1, device="meta").expand(3, 5), (3, 5))
    (1, 0)
    """
    try:
        st = tuple(int(s) for s in v.stride())
    except Exception:  # noqa: BLE001 - symbolic strides: row-major
        st = ()
    if len(st) != len(shape):
        return tuple(torch.empty(shape, device="meta").stride())
    out, acc = [0] * len(shape), 1
    for d in sorted((d for d in range(len(shape)) if st[d] != 0), key=lambda d: (st[d], -d)):
        out[d] = acc
        acc *= max(int(shape[d]), 1)
    return tuple(out)


@graph_pass(ensures=(localized,))
def localize_pass(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    if ctx.coord is None:
        raise PlanError("localize_pass needs this rank's mesh coordinate (ctx.coord)")
    dev = torch.device(ctx.device)
    glob_shape: dict[fx.Node, tuple[int, ...]] = {}
    for n in list(gm.graph.nodes):
        specs = n.meta.get(ir.SPECS)
        v = n.meta.get(ir.VAL)
        if isinstance(v, torch.Tensor):
            glob_shape[n] = tuple(v.shape)
        if specs:
            n.meta[ir.GLOBAL_VAL] = v
            if isinstance(v, torch.Tensor):
                n.meta[ir.VAL] = _local(specs[0], v, ctx)
            elif isinstance(v, (tuple, list)):
                n.meta[ir.VAL] = type(v)(_local(s, t, ctx) if isinstance(t, torch.Tensor) else t
                                         for s, t in zip(specs, v))
        if n.op != "call_function":
            continue
        if n.target in COMM_OPS:
            if n.target is not START:  # (x..., edge, shape, grad)
                n.args = n.args[:-2] + (list(n.meta[ir.VAL].shape), n.args[-1])
            continue
        n.args, n.kwargs = pytree.tree_map_only(torch.device, lambda d: dev, (n.args, n.kwargs))
        rule = local_rule(n.target)
        if rule is not None:
            rule(n, LocalContext(tuple(ctx.mesh.shape), tuple(ctx.coord), dev, glob_shape,
                                 site=zlib.crc32(n.name.encode())))
    return PassResult(gm, True)
