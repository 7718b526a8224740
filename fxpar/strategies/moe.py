"""MoE routing and indexing: gather, scatter, scatter_add, index.Tensor, index_put, plus factories.

Only dims that are not indexed may be sharded, and only where every tensor taking part has the
same size there (so ``torch.chunk`` cuts them alike). ``topk``, ``sort``, ``histc``, ``argmax``
live in :mod:`.reductions`; ``transformers.grouped_mm_fallback`` has no rule (replicated).
Other indexing copies (``index_add``, ``masked_select``, ``*_scatter``) and factories have no
sharding rule (replicated); indexing is priced as a copy, factories as a write of the output.

``index.Tensor(x, [None, idx])`` with ``x[B, T, D]``, ``idx[K]``: output ``[B, K, D]``; dims
before the first and after the last indexed dim map through (indices adjacent), and a single
index tensor may itself be sharded (the output follows its dims).
"""

from __future__ import annotations

import torch

from fxpar.cost.compute import copy_cost, creation_cost
from fxpar.strategies.base import P, R, S, bound, choice, declare, register, tensor_shape
from fxpar.strategies.local import arange_bounds, shape_arg

aten = torch.ops.aten


@register(aten.scatter_, aten.scatter_add_)  # in-place: priced as their functional forms
@register(aten.scatter_reduce, cost=copy_cost)
@register(aten.gather, aten.scatter, aten.scatter_add, cost=copy_cost, saves="indices")
def gather_scatter_rule(node):
    b = bound(node)
    keys = [k for k in ("self", "index", "src") if tensor_shape(b.get(k)) is not None]
    shapes = {k: tensor_shape(b[k]) for k in keys}
    o = tensor_shape(node)
    if not o:  # 0-d (torch allows it): nothing to shard (replicated fallback)
        return
    dim = b["dim"] % len(o)
    for d in range(len(o)):
        if d == dim or any(len(s) != len(o) or s[d] != o[d] for s in shapes.values()):
            continue
        yield choice(node, {k: S(d) for k in keys}, [S(d)], f"S{d}")


def _index_layout(x, idx_shapes):
    """(positions of indexed dims, broadcast index shape, where its dims land in the output)."""
    pos = [i for i, s in enumerate(idx_shapes) if s is not None]
    bshape = list(torch.broadcast_shapes(*[idx_shapes[i] for i in pos])) if pos else []
    adjacent = pos == list(range(pos[0], pos[-1] + 1)) if pos else True
    start = pos[0] if adjacent else 0
    return pos, bshape, start, adjacent


def _index_map(x, idx_shapes):
    """``{x dim: out dim}`` for the dims of ``x`` that are not indexed."""
    pos, bshape, start, adjacent = _index_layout(x, idx_shapes)
    m = {}
    if not pos:
        return {d: d for d in range(len(x))}, pos, bshape, start, adjacent
    for d in range(len(x)):
        if d in pos:
            continue
        if adjacent and d < pos[0]:
            m[d] = d
        elif d > pos[-1] or not adjacent:
            before = sum(1 for q in range(d) if q not in pos)
            m[d] = len(bshape) + before if not adjacent else start + len(bshape) + (d - pos[-1] - 1)
    return m, pos, bshape, start, adjacent


@register(aten.index, cost=copy_cost, saves="indices")
def index_rule(node):
    b = bound(node)
    x = tensor_shape(b["self"])
    idx = list(b["indices"])
    shapes = [tensor_shape(i) if i is not None else None for i in idx]
    if any(isinstance(i, torch.fx.Node) and i.meta["val"].dtype == torch.bool for i in idx if i is not None):
        return  # boolean masks: data-dependent shapes
    o = tensor_shape(node)
    m, pos, bshape, start, _ = _index_map(x, shapes)
    for d, od in m.items():
        if o[od] == x[d]:
            yield choice(node, {"self": S(d), "indices": [R if s is not None else None for s in shapes]},
                         [S(od)], f"S{od}")
    if len(pos) == 1:  # shard the one index tensor: each device gathers its own rows
        s = shapes[pos[0]]
        for j in range(len(s)):
            if s[j] > 1:
                yield choice(node, {"self": R, "indices": [S(j) if i == pos[0] else None for i in range(len(idx))]},
                             [S(start + j)], f"S{start + j}(idx)")


@register(aten.index_put_, aten._index_put_impl_)
@register(aten.index_put, cost=copy_cost)
def index_put_rule(node):
    b = bound(node)
    x = tensor_shape(b["self"])
    idx = list(b["indices"])
    shapes = [tensor_shape(i) if i is not None else None for i in idx]
    vals = tensor_shape(b["values"])
    if any(isinstance(i, torch.fx.Node) and i.meta["val"].dtype == torch.bool for i in idx if i is not None):
        return
    m, pos, bshape, start, adjacent = _index_map(x, shapes)
    # shape of x[indices]: values broadcast into it
    res = len(x) - len(pos) + len(bshape)
    for d, od in m.items():
        vd = od - (res - len(vals))
        pv = S(vd) if vd >= 0 and vals[vd] == x[d] and x[d] > 1 else R
        yield choice(node, {"self": S(d), "values": pv,
                            "indices": [R if s is not None else None for s in shapes]}, [S(d)], f"S{d}")
    if not b.get("accumulate", False):
        return
    # accumulate: x[idx] += values is linear in (x, values)
    yield choice(node, {"self": P(), "values": P()}, [P()], "P")


@register(aten.scalar_tensor, aten.tensor, aten.randn, aten.rand, cost=creation_cost, differentiable=False)
@register(aten.new_ones, aten.new_zeros, aten.new_full, aten.new_empty, cost=creation_cost, differentiable=False,
          local=shape_arg(1, "default"))
@register(aten.empty, cost=creation_cost, differentiable=False, local=shape_arg(0, "memory_format"))
@register(aten.zeros, aten.ones, aten.full, cost=creation_cost, differentiable=False, local=shape_arg(0, "default"))
@register(aten.arange, cost=creation_cost, differentiable=False, local=arange_bounds)
def factory_rule(node):
    """Factories (and ``new_*``, whose input only lends dtype/device): replicated output.

    Sharded factories would need localized sizes (and offsets for ``arange``): not offered.
    Their local entries (size arguments, ``arange`` bounds) keep a node right whatever layout it
    is given; random factories become shard-keyed draws when localizing (:mod:`.rand`).
    """
    return ()


declare(aten.index_add, aten.index_copy, aten.masked_scatter, aten.masked_select, aten.select_scatter,
        aten.diagonal_scatter, aten.as_strided_scatter, cost=copy_cost)
declare(aten.slice_scatter, cost=copy_cost, saves="nothing")
declare(aten.empty_strided, aten.eye, aten.linspace, aten.logspace, aten.randint, aten.randint_like, aten.randperm,
        aten.new_empty_strided, aten.normal, aten.uniform, aten._local_scalar_dense, aten.zero_,
        cost=creation_cost, differentiable=False)
# in-place random fills: their cost is their functional form's (normal, uniform)
declare(aten.normal_, aten.uniform_, differentiable=False)
