"""Reductions (sum, mean, amax, amin, argmax, argmin, histc, logsumexp), softmax/log_softmax, cumsum, sort,
topk and other ops along one dim.

Sharding a kept dim shards the output; sharding a reduced dim leaves each device a partial
result: ``sum`` -> ``P(sum)``, ``mean`` -> ``P(avg)`` (exact only for even shards, so flagged
``even``), ``amax`` -> ``P(max)``, ``amin`` -> ``P(min)``; ``histc`` counts add up -> ``P(sum)`` (only
with a fixed range: ``min == max`` bins the data's own range, so it stays whole).
``sum`` and ``mean`` are linear: a ``P(sum)`` input gives ``P(sum)``. ``argmax``, ``softmax``,
``sort``, ``topk``, ``cumsum`` need their dim whole; ``log_softmax`` may split it (``vocab``:
``S(d) -> S(d)``, all-reduces inside its local program, :mod:`.losses`). Other reductions
(``max``, ``var``, ``norm``, ``median``, ...) have no sharding rule (replicated). ``sum(x[4,6], [1])``::

    R: R -> R      S0: S(0) -> S(0)      red1: S(1) -> P(sum)      P: P(sum) -> P(sum)
"""

from __future__ import annotations

import torch

from fxpar.cost.compute import reduction_cost, softmax_cost
from fxpar.strategies.base import P, S, bound, choice, declare, out_shapes, register, tensor_shape
from fxpar.strategies.losses import LOG_SOFTMAX, vocab_comm, vocab_local

aten = torch.ops.aten

_REDUCE = {aten.sum: "sum", aten.mean: "avg", aten.amax: "max", aten.amin: "min", aten.nansum: "sum"}


@register(aten.nansum, cost=reduction_cost)
@register(aten.amax, aten.amin, cost=reduction_cost, saves="input0")
@register(aten.sum, aten.mean, cost=reduction_cost, saves="nothing")
def reduce_rule(node):
    b = bound(node)
    a = tensor_shape(b["self"])
    op = _REDUCE[node.target.overloadpacket]
    dims = b.get("dim")
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        dims = list(range(len(a)))
    dims = {d % max(len(a), 1) for d in ([dims] if isinstance(dims, int) else dims)}
    keep = bool(b.get("keepdim", False))
    for d in range(len(a)):
        if d in dims:
            yield choice(node, {"self": S(d)}, [P(op)], f"red{d}", even=op == "avg")
        else:
            od = d if keep else d - sum(1 for r in dims if r < d)
            yield choice(node, {"self": S(d)}, [S(od)], f"S{od}")
    if op in ("sum", "avg"):
        yield choice(node, {"self": P()}, [P()], "P")


@register(aten.logsumexp, cost=reduction_cost, saves="input0")
def logsumexp_rule(node):
    """``logsumexp(x, dim: int[], keepdim)``: a kept dim may be sharded (``S(d) -> S(d')``); the
    reduced dims must be whole (there is no ``Partial`` that combines log-sum-exps).

    ``logsumexp(x[4, 6, 8], [0, 2])``: ``S1: S(1) -> S(0)`` only.
    """
    b = bound(node)
    a = tensor_shape(b["self"])
    dims = b.get("dim")
    dims = list(range(len(a))) if dims is None or (isinstance(dims, (list, tuple)) and not dims) else dims
    dims = {d % max(len(a), 1) for d in ([dims] if isinstance(dims, int) else dims)}
    keep = bool(b.get("keepdim", False))
    for d in range(len(a)):
        if d not in dims:
            od = d if keep else d - sum(1 for r in dims if r < d)
            yield choice(node, {"self": S(d)}, [S(od)], f"S{od}")


def along_dim_rule(node, key="self", dim_key="dim"):
    """Ops needing one dim whole; other dims map 1:1 to every output (same rank)."""
    b = bound(node)
    a = tensor_shape(b[key])
    dim = b.get(dim_key)
    if dim is None:
        return
    dim %= max(len(a), 1)
    outs = out_shapes(node)
    for d in range(len(a)):
        if d == dim:
            continue
        if any(len(o) != len(a) or o[d] != a[d] for o in outs):
            continue
        yield choice(node, {key: S(d)}, [S(d)] * len(outs), f"S{d}")


@register(aten.diff)
def diff_rule(node):
    """``diff(x, n, dim, prepend, append)``: any dim but ``dim``, with ``prepend``/``append``
    (the same shape as ``x`` off ``dim``) sharded like ``x``."""
    b = bound(node)
    a, o = tensor_shape(b["self"]), tensor_shape(node)
    if not a or len(o) != len(a):
        return
    dim = b.get("dim", -1) % len(a)
    extra = [k for k in ("prepend", "append") if b.get(k) is not None]
    for d in range(len(a)):
        if d != dim and o[d] == a[d]:
            yield choice(node, {"self": S(d), **{k: S(d) for k in extra}}, [S(d)], f"S{d}")


@register(aten.special_log_softmax)
@register(aten.sort, aten.topk, cost=reduction_cost, saves="lowered")
@register(aten.cumprod, cost=reduction_cost, saves="input0")
@register(aten.cumsum, cost=reduction_cost, saves="nothing")
@register(aten.softmax, aten._softmax, cost=softmax_cost, saves="output")
@register(*LOG_SOFTMAX, cost=softmax_cost, saves="output", local=vocab_local, comm=vocab_comm)
def softmax_rule(node):
    yield from along_dim_rule(node, "self" if "self" in bound(node) else "input")
    if node.target.overloadpacket is aten.cumsum:
        yield choice(node, {"self": P()}, [P()], "P")
    a = tensor_shape(bound(node).get("self"))
    if node.target.overloadpacket in LOG_SOFTMAX and a:  # its dim split: all-reduces inside (.losses)
        d = bound(node)["dim"] % len(a)
        yield choice(node, {"self": S(d)}, [S(d)], "vocab")


@register(aten.argmax, aten.argmin, cost=reduction_cost, differentiable=False)
def argmax_rule(node):
    b = bound(node)
    if b.get("dim") is None:
        return
    a = tensor_shape(b["self"])
    if not a:  # a 0-d input: nothing to shard (replicated fallback)
        return
    dim = b["dim"] % len(a)
    keep = bool(b.get("keepdim"))
    for d in range(len(a)):
        if d != dim:
            od = d if keep or d < dim else d - 1
            yield choice(node, {"self": S(d)}, [S(od)], f"S{od}")


@register(aten.histc)
def histc_rule(node):
    b = bound(node)
    if b.get("min", 0) == b.get("max", 0):
        return  # min == max: the bins span the data's own range, which a shard does not know
    a = tensor_shape(b["self"])
    for d in range(len(a)):  # counts over disjoint shards (same bins) add up
        yield choice(node, {"self": S(d)}, [P()], f"red{d}")


declare(aten._safe_softmax, cost=softmax_cost, saves="output")
declare(aten.max, aten.min, aten.var, aten.std, aten.var_mean, aten.std_mean, aten.prod, cost=reduction_cost,
        saves="input0")
declare(aten.norm, aten.linalg_vector_norm, cost=reduction_cost, saves="stats")
declare(aten.any, aten.all, aten.count_nonzero, cost=reduction_cost, differentiable=False)
declare(aten.aminmax, aten.argsort, aten.nanmean, aten.median, aten.mode, aten.kthvalue, aten.frobenius_norm,
        cost=reduction_cost)
