"""View-like and data-movement ops: reshape family, transpose/permute, expand, split/cat/stack,
slice/select/index_select, getitem.

Each rule states a **dimension map**: which input dim becomes which output dim. The runtime runs
the same op on local tensors, so size arguments (``view``, ``reshape``, ``expand``,
``new_*``) are **localized**: the records' ``local=`` entries
(:func:`fxpar.strategies.local.shape_arg`, :func:`~fxpar.strategies.local.unflatten_sizes`)
replace them by the output's local shape (``Spec.local_shape`` of the node's output spec); slice
bounds and indices are only used along unsharded dims and stay as they are, and so are split
sizes, except where a fused projection's strided output ``S(d,f)`` is split into its ``f``
parts (:func:`split_factor`, :func:`split_sizes`).
Views are recorded ``view=True`` (free, aliasing their input); ``reshape``/``flatten``/
``contiguous`` alias only a contiguous input (``view="if_contiguous"``).

Reshape (``view``, ``reshape``, ``_unsafe_view``, ``flatten``, ``unflatten``, ``squeeze``,
``unsqueeze``): input and output dims are grouped into runs of equal element count; in each
group only the outermost non-1 input dim and the outermost non-1 output dim may be sharded,
together. A 1:1 group allows uneven shards; a merge/split group needs even splits (then a
device's contiguous block of the group is the same block in both layouts). ``view(x[4,6], [24])``::

    R: R -> R      S0: S(0) -> S(0) (even)      P: P(sum) -> P(sum)
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from fxpar.cost.compute import copy_cost, creation_cost, maybe_copy_cost, view_cost
from fxpar.spec import Strided
from fxpar.strategies.base import (P, R, S, AxisStrategy, bound, choice, declare, out_shapes, register,
                                   tensor_shape)
from fxpar.strategies.local import reads_storage, shape_arg, unflatten_sizes

aten = torch.ops.aten


def reshape_groups(a, b):
    """Groups ``(in dims, out dims)`` of equal element count, in order; ``None`` if sizes are 0.

    >>> reshape_groups((2, 3, 4), (6, 4))
    [([0, 1], [0]), ([2], [1])]
    """
    if 0 in a or 0 in b:
        return None
    i = j = 0
    out = []
    while i < len(a) and j < len(b):
        pa, pb, gi, gj = a[i], b[j], [i], [j]
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb:
                if i >= len(a):
                    return None
                pa *= a[i]
                gi.append(i)
                i += 1
            else:
                if j >= len(b):
                    return None
                pb *= b[j]
                gj.append(j)
                j += 1
        out.append((gi, gj))
    return out


_RESHAPES = (aten.view, aten.reshape, aten._unsafe_view)
_EQUAL_SPLITS = (aten.split, aten.split_with_sizes, aten.chunk, aten.unsafe_split)


def split_factor(node: fx.Node, dim: int) -> int:
    """``f`` when dim ``dim`` of ``node``'s output reaches, through reshapes that keep it
    whole, a split into ``f >= 2`` equal parts (a fused q/k/v or gate/up projection's
    ``split``/``chunk``); else 0. Such a value may be :data:`fxpar.spec.Strided` ``S(dim,f)``:
    each part then comes out of the split ``S(dim)``, with no communication.

    >>> import torch
    >>> from fxpar.capture import capture
    >>> class QKV(torch.nn.Module):
    ...     def __init__(self): super().__init__(); self.w = torch.nn.Linear(4, 12)
    ...     def forward(self, x): return [t.sum() for t in self.w(x).view(2, 3, 12).split(4, -1)]
    >>> gm = capture(QKV(), (torch.randn(6, 4),))
    >>> lin = next(n for n in gm.graph.nodes if n.target == aten.linear.default)
    >>> split_factor(lin, 1), split_factor(lin, 0)
    (3, 0)
    """
    shape = tensor_shape(node)
    if shape is None:
        return 0
    for u in node.users:
        pk = getattr(u.target, "overloadpacket", None)
        if not u.args or u.args[0] is not node:
            continue
        if pk in _RESHAPES:
            o = tensor_shape(u)
            for gi, gj in reshape_groups(shape, o) or []:
                if gi == [dim] and len(gj) == 1 and o[gj[0]] == shape[dim]:
                    f = split_factor(u, gj[0])
                    if f:
                        return f
        elif pk in _EQUAL_SPLITS and bound(u).get("dim", 0) % len(shape) == dim:
            sizes = [o[dim] for o in out_shapes(u)]
            if len(sizes) >= 2 and len(set(sizes)) == 1 and sum(sizes) == shape[dim]:
                return len(sizes)
    return 0


def _first_non1(dims, shape):
    nz = [d for d in dims if shape[d] > 1]
    return nz


@register(aten.squeeze_, aten.unsqueeze_)  # in-place: priced as squeeze/unsqueeze
@register(aten.view_copy, cost=copy_cost, local=shape_arg(1, "default"))
@register(aten.flatten, cost=maybe_copy_cost, view="if_contiguous", saves="nothing")
@register(aten.reshape, cost=maybe_copy_cost, view="if_contiguous", saves="nothing", local=shape_arg(1, "default"))
@register(aten.unflatten, cost=view_cost, view=True, local=unflatten_sizes)
@register(aten.view, aten._unsafe_view, cost=view_cost, view=True, local=shape_arg(1, "default"))
@register(aten.squeeze, aten.unsqueeze, aten._reshape_alias, cost=view_cost, view=True)
def reshape_rule(node: fx.Node):
    b = bound(node)
    x = b.get("self", b.get("input"))
    key = "self" if "self" in b else "input"
    a, o = tensor_shape(x), tensor_shape(node)
    for gi, gj in reshape_groups(a, o) or []:
        ni, nj = _first_non1(gi, a), _first_non1(gj, o)
        if not ni or not nj:
            continue
        yield choice(node, {key: S(ni[0])}, [S(nj[0])], f"S{nj[0]}", even=not (len(ni) == len(nj) == 1))
        f = split_factor(node, nj[0]) if len(ni) == len(nj) == 1 else 0
        if f:   # a fused projection's output on its way to the split
            yield choice(node, {key: Strided(ni[0], split_factor=f)}, [Strided(nj[0], split_factor=f)],
                         f"S{nj[0]}/{f}")
    yield choice(node, {key: P()}, [P()], "P")


@register(aten.transpose_)  # in-place: priced as transpose
@register(aten.transpose, aten.t, aten.permute, aten.swapaxes, cost=view_cost, view=True)
def permute_rule(node: fx.Node):
    b = bound(node)
    a = tensor_shape(b["self"])
    n = len(a)
    perm = list(range(n))
    if "dims" in b:
        perm = [d % n for d in b["dims"]]
    elif n and (n == 2 or ("dim0" in b and b.get("dim0") is not None) or ("axis0" in b)):
        # (a 0-d tensor: transpose(x, 0, -1) is legal and swaps nothing)
        d0 = b.get("dim0", b.get("axis0", 0)) % max(n, 1)
        d1 = b.get("dim1", b.get("axis1", 1)) % max(n, 1)
        perm[d0], perm[d1] = perm[d1], perm[d0]
    for d, src in enumerate(perm):
        yield choice(node, {"self": S(src)}, [S(d)], f"S{d}")
    yield choice(node, {"self": P()}, [P()], "P")


@register(aten.expand_copy, cost=copy_cost, local=shape_arg(1, "default"))
@register(aten.expand, cost=view_cost, view=True, saves="nothing", local=shape_arg(1, "default"))
def expand_rule(node: fx.Node):
    a, o = tensor_shape(bound(node)["self"]), tensor_shape(node)
    off = len(o) - len(a)
    for d in range(len(o)):
        i = d - off
        if i >= 0 and a[i] == o[d]:
            yield choice(node, {"self": S(i)}, [S(d)], f"S{d}")
        else:  # a broadcast dim: each device expands its replica to its local size
            yield choice(node, {"self": R}, [S(d)], f"S{d}")
    yield choice(node, {"self": P()}, [P()], "P")


def split_sizes(node: fx.Node, lctx) -> None:
    """``split``/``split_with_sizes`` of a strided dim: the sizes become the outputs' local
    sizes along it (each part is ``S(dim)``: ``h/G`` of ``h``). Along an unsharded dim the
    local sizes are the global ones, so the call is left as it is."""
    vals = node.meta["val"]
    if len(node.args) < 2 or not vals:
        return
    b = bound(node)
    dim = b.get("dim", 0) % vals[0].dim()
    sizes = [int(v.shape[dim]) for v in vals]
    args = list(node.args)
    if isinstance(args[1], int):
        if sizes[0] != args[1]:
            args[1] = sizes[0]
    elif list(args[1]) != sizes:
        args[1] = sizes
    node.args = tuple(args)


@register(aten.split, aten.split_with_sizes, aten.unsafe_split, cost=view_cost, view=True, local=split_sizes)
@register(aten.chunk, aten.unbind, aten.tensor_split, cost=view_cost, view=True)
def split_rule(node: fx.Node):
    b = bound(node)
    a = tensor_shape(b["self"])
    dim = b.get("dim", 0) % len(a)
    outs = out_shapes(node)
    drop = node.target.overloadpacket is aten.unbind
    for d in range(len(a)):
        if d == dim:
            continue
        od = d - 1 if drop and d > dim else d
        yield choice(node, {"self": S(d)}, [S(od)] * len(outs), f"S{od}")
    sizes = [o[dim] for o in outs] if node.target.overloadpacket in _EQUAL_SPLITS else []
    if len(sizes) >= 2 and len(set(sizes)) == 1 and sum(sizes) == a[dim]:
        # the parts of a fused projection: chunk i of each part, side by side (module doc)
        yield choice(node, {"self": Strided(dim, split_factor=len(sizes))}, [S(dim)] * len(outs), "fused")
    yield choice(node, {"self": P()}, [P()] * len(outs), "P")


@register(aten.concat, cost=copy_cost)
@register(aten.cat, aten.stack, cost=copy_cost, saves="nothing")
def cat_rule(node: fx.Node):
    b = bound(node)
    ts = b["tensors"]
    shapes = [tensor_shape(t) for t in ts]
    o = tensor_shape(node)
    stack = node.target.overloadpacket is aten.stack
    # torch.cat skips legacy empty operands (shape (0,)): they stay replicated (nothing to
    # move), the others are sharded (e.g. a KV cache started from torch.empty(0))
    empty = [not stack and s is not None and tuple(s) == (0,) and len(o) != 1 for s in shapes]
    real = [s for s, e in zip(shapes, empty) if not e]
    r = len(real[0]) if real else 0
    if not real or any(s is None or len(s) != r for s in real):
        return  # shapes it cannot follow: replicate only
    dim = b.get("dim", 0) % (r + 1 if stack else r)

    def specs(p):
        return [R if e else p for e in empty]
    for d in range(r):
        if d == dim and not stack:
            continue
        od = d + 1 if stack and d >= dim else d
        if any(s[d] != o[od] for s in real):
            continue
        yield choice(node, {"tensors": specs(S(d))}, [S(od)], f"S{od}")
    yield choice(node, {"tensors": specs(P())}, [P()], "P")


@register(aten.slice_copy)
@register(aten.slice, aten.narrow, cost=view_cost, view=True)
def slice_rule(node: fx.Node):
    b = bound(node)
    a, o = tensor_shape(b["self"]), tensor_shape(node)
    dim = b.get("dim", 0) % len(a)
    for d in range(len(a)):
        if d == dim and a[d] != o[d]:  # a real slice along a sharded dim needs global offsets
            continue
        yield choice(node, {"self": S(d)}, [S(d)], f"S{d}")
    yield choice(node, {"self": P()}, [P()], "P")


@register(aten.select, cost=view_cost, view=True)
def select_rule(node: fx.Node):
    b = bound(node)
    a = tensor_shape(b["self"])
    dim = b["dim"] % len(a)
    for d in range(len(a)):
        if d != dim:
            od = d - (d > dim)
            yield choice(node, {"self": S(d)}, [S(od)], f"S{od}")
    yield choice(node, {"self": P()}, [P()], "P")


@register(aten.index_select, cost=copy_cost, saves="indices")
def index_select_rule(node: fx.Node):
    b = bound(node)
    a = tensor_shape(b["self"])
    if not a:  # a 0-d input: nothing to shard (replicated fallback)
        return
    dim = b["dim"] % len(a)
    for d in range(len(a)):
        if d != dim:
            yield choice(node, {"self": S(d), "index": R}, [S(d)], f"S{d}")
    yield choice(node, {"self": R, "index": S(0)}, [S(dim)], f"S{dim}(idx)")
    yield choice(node, {"self": P(), "index": R}, [P()], "P")


@register(operator.getitem, cost=view_cost, view=True)
def getitem_rule(node: fx.Node):
    """Pass-through: the element of the producer's output is what flows."""
    if tensor_shape(node) is None:
        return
    o = tensor_shape(node)
    for d in range(len(o)):
        yield AxisStrategy((S(d),), (S(d),), name=f"S{d}")
    for op in ("sum", "avg", "max"):
        yield AxisStrategy((P(op),), (P(op),), name=f"P{op}" if op != "sum" else "P")


@register(aten.lift_fresh_copy, cost=creation_cost, differentiable=False)
@register(aten.clone, cost=copy_cost, saves="nothing")
@register(aten.contiguous, cost=maybe_copy_cost, view="if_contiguous", saves="nothing")
@register(aten.detach, cost=view_cost, view=True, differentiable=False)
@register(aten.alias, cost=view_cost, view=True)
def identity_rule(node: fx.Node):
    o = tensor_shape(node)
    if o is None:
        return
    for d in range(len(o)):
        yield choice(node, {"self": S(d)}, [S(d)], f"S{d}")
    yield choice(node, {"self": P()}, [P()], "P")


@register(aten.pad, aten.constant_pad_nd, cost=copy_cost, saves="nothing")
def pad_rule(node: fx.Node):
    """Only dims without padding may be sharded (padding is at the global edges)."""
    b = bound(node)
    a = tensor_shape(b["self"])
    pad = list(b["pad"])
    padded = {len(a) - 1 - i // 2 for i, p in enumerate(pad) if p}
    for d in range(len(a)):
        if d not in padded:
            yield choice(node, {"self": S(d)}, [S(d)], f"S{d}")


# Views without a sharding rule (replicated): aliases, and shape/metadata queries and runtime
# assertions that move no data (free, ``view=True``).
declare(aten.diagonal, aten.unfold, aten.real, aten.imag, aten.view_as_real, aten.view_as_complex,
        aten.lift_fresh, aten.movedim, aten.moveaxis, aten.swapdims, aten.view_as, aten.expand_as, aten.numpy_T,
        aten.mT, aten.dim, aten.numel, aten.stride, aten.sym_stride, aten.sym_numel, aten.storage_offset,
        aten.sym_storage_offset, aten.item, aten._assert_async, aten._assert_scalar, aten._assert_tensor_metadata,
        aten.sym_constrain_range, aten.sym_constrain_range_for_size, aten._functional_assert_async,
        aten._functional_sym_constrain_range, aten.record_stream, aten.requires_grad_, aten.set_grad_enabled,
        aten.device, torch.ops._c10d_functional.wait_tensor, torch._C._set_grad_enabled,
        torch.amp.autocast_mode._enter_autocast, torch.amp.autocast_mode._exit_autocast, torch.Tensor.type,
        torch.sym_sum, torch.sym_max, torch.sym_min, torch.sym_not, torch.sym_float, torch.sym_int, torch.sym_ite,
        torch.sym_sqrt, cost=view_cost, view=True)
declare(aten.size, aten.sym_size, aten.detach_, cost=view_cost, view=True, differentiable=False)
# Ops that read or rewrite raw storage (sizes/strides/offsets of the WHOLE buffer): replicate-only
# by design, not a missing rule. A shard's storage is not a slice of the global storage
# (``x.resize_((25, 5))`` on a ``[5, 5, 5]`` tensor keeps its first 125 elements in memory
# order; ``as_strided`` addresses elements by global strides), so no sharded layout computes
# the right piece locally. They run on the whole tensor, which the runtime hands over
# contiguous (fxpar.runtime.redistribute: layout contract), as eager would.
# ``reads_storage`` refuses an input that arrives through a collective when eager's input is a
# view into a larger storage (the gathered tensor is not that storage).
declare(aten.as_strided, cost=view_cost, view=True, local=reads_storage)
declare(aten.resize_, aten.resize_as_, aten.set_, aten.as_strided_, aten.as_strided_copy,
        cost=copy_cost, local=reads_storage)
# Data movement without a sharding rule (replicated), priced as copies.
declare(aten.repeat, aten.flip, aten.roll, cost=copy_cost, saves="nothing")
declare(aten.repeat_interleave, aten.tile, aten.hstack, aten.vstack, aten.concatenate, aten.split_copy,
        aten.permute_copy, aten.transpose_copy, cost=copy_cost)
declare(aten.reflection_pad1d, aten.reflection_pad2d, aten.replication_pad2d, cost=copy_cost)
declare(aten._reshape_alias_copy, cost=maybe_copy_cost)
# ``list[i]`` / ``dict[k]`` in graphs of Python containers: free, but no tensor alias
declare(aten.__getitem__, cost=view_cost)
