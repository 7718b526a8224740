"""Matmul-like ops through one einsum helper: linear, mm, addmm, bmm, baddbmm, matmul, einsum.

:func:`einsum_choices` turns subscripts into one-axis choices. For ``linear`` on a 3-d input,
``"bmk,nk->bmn"`` gives::

    R                    R, R -> R
    dp   (letter b)      S(0), R -> S(0)        data parallel
    m1   (letter m)      S(1), R -> S(1)        sequence / rows
    row  (letter k)      S(2), S(1) -> P(sum)   Megatron row split, contraction -> partial
    col  (letter n)      R, S(0) -> S(2)        Megatron column split
    col/3                R, S(0,3) -> S(2,3)    ... of a fused q/k/v weight whose output is split
                                                into 3 (strided: each rank holds its q, k and v)

mm/bmm/matmul/einsum (activation x activation, e.g. attention) also offer ``pin<i>``: operand i
``P(sum)``, the others R -> ``P(sum)``; linear/addmm do not (reduce before a layer).

On a ``(z, y, x)`` mesh AxoNN's 3D matmul is ``z:m1 y:row x:col`` (``dp`` for a 2-d input).
A bias (linear, addmm, baddbmm) follows the output: sharded with it, ``P(sum)`` when the output is
partial (the planner turns a replicated bias into ``P(sum)`` by zeroing it off coordinate 0).
"""

from __future__ import annotations

import torch

from fxpar.cost.compute import (addmm_cost, baddbmm_cost, bmm_cost, einsum_cost, linear_cost, matmul_cost,
                                mm_cost)
from fxpar.spec import Strided, placement_kind, with_dim
from fxpar.strategies.base import P, R, S, bound, choice, declare, register, tensor_shape
from fxpar.strategies.views import split_factor

aten = torch.ops.aten


def einsum_choices(subscripts: str, shapes, names: dict | None = None, partial_inputs=True):
    """One-axis choices of an einsum ``"ab,bc->ac"`` on operands of ``shapes``.

    Returns ``(name, [placement per operand], output placement)`` triples (no replicate; the
    expansion adds it). A free letter (in the output) shards every operand holding it with size
    > 1 (size-1 operands broadcast: R) and the output; a contraction letter shards every operand
    and makes the output ``P(sum)``; with ``partial_inputs`` one ``P(sum)`` operand among
    replicated ones gives ``P(sum)``.

    >>> [(n, [str(p) for p in ps], str(o)) for n, ps, o in einsum_choices("mk,nk->mn", [(4, 6), (8, 6)])][:3]
    [('m', ['S(0)', 'R'], 'S(0)'), ('k', ['S(1)', 'S(1)'], 'P(sum)'), ('n', ['R', 'S(0)'], 'S(1)')]
    """
    lhs, out = subscripts.replace(" ", "").split("->")
    ops = lhs.split(",")
    names = names or {}
    size = {}
    for sub, shp in zip(ops, shapes):
        for c, n in zip(sub, shp):
            size[c] = max(size.get(c, 1), n)
    res = []
    letters = []
    for sub in ops:
        letters += [c for c in sub if c not in letters]
    for c in letters:
        if size[c] <= 1:
            continue
        pls = [S(sub.index(c)) if c in sub and shp[sub.index(c)] == size[c] else R
               for sub, shp in zip(ops, shapes)]
        if c in out:
            res.append((names.get(c, c), pls, S(out.index(c))))
        elif all(isinstance(p, type(S(0))) for p, sub in zip(pls, ops) if c in sub):
            res.append((names.get(c, c), pls, P("sum")))
    if partial_inputs:
        for i in (range(len(ops)) if partial_inputs is True else partial_inputs):
            res.append((f"pin{i}", [P("sum") if j == i else R for j in range(len(ops))], P("sum")))
    return res


def _bias_pl(bias_shape, out_pl, out_shape):
    """Placement of a bias broadcast (right-aligned) into the output."""
    if bias_shape is None:
        return None
    if isinstance(out_pl, type(P())):
        return out_pl
    if placement_kind(out_pl) in ("S", "T"):
        d = out_pl.dim - (len(out_shape) - len(bias_shape))
        if d >= 0 and bias_shape[d] == out_shape[out_pl.dim] and bias_shape[d] > 1:
            return with_dim(out_pl, d)
    return R


def _with_fused(node, choices):
    """The einsum ``choices`` of a projection, plus a strided ``col`` when its output is split
    into ``f`` equal parts (:func:`fxpar.strategies.views.split_factor`: q, k and v of one
    fused weight): every operand and the output sharded along the output's last dim hold
    chunk ``i`` of each part (``S(d,f)``), so the split hands each part out ``S(d)``."""
    out = tensor_shape(node)
    f = split_factor(node, len(out) - 1) if out else 0
    for name, pls, po in choices:
        yield name, pls, po
        if f and placement_kind(po) == "S" and po.dim == len(out) - 1:
            yield (f"{name}/{f}", [Strided(p.dim, split_factor=f) if placement_kind(p) == "S" else p
                                   for p in pls], Strided(po.dim, split_factor=f))


@register(aten.linear, cost=linear_cost, saves="partners")
def linear_rule(node):
    b = bound(node)
    x, w, bias = (tensor_shape(b[k]) for k in ("input", "weight", "bias"))
    lead = "abcdefghij"[: len(x) - 1]
    if len(w) == 1:  # linear with a 1-d weight: a dot product over k
        sub, names = f"{lead}k,k->{lead}", {}
    else:
        sub = f"{lead}k,nk->{lead}n"
        names = {"k": "row", "n": "col"}
    names |= {c: ("dp" if i == 0 else f"m{i}") for i, c in enumerate(lead)}
    out = tensor_shape(node)
    # No partial-input choices: a partial weight is never useful, and a partial activation
    # into a layer multiplies the count by ~2 per mesh axis for little gain (reduce first).
    for name, (pi, pw), po in _with_fused(node, einsum_choices(sub, [x, w], names, partial_inputs=False)):
        yield choice(node, {"input": pi, "weight": pw, "bias": _bias_pl(bias, po, out)}, [po], name)


def _self_mat2(node, subscripts: str, names: dict[str, str]):
    """Choices of a two-operand ``self @ mat2`` op given its einsum subscripts."""
    b = bound(node)
    shapes = [tensor_shape(b["self"]), tensor_shape(b["mat2"])]
    for name, (pa, pb), po in _with_fused(node, einsum_choices(subscripts, shapes, names)):
        yield choice(node, {"self": pa, "mat2": pb}, [po], name)


@register(aten.mm, cost=mm_cost, saves="partners")
def mm_rule(node):
    return _self_mat2(node, "mk,kn->mn", {"m": "dp", "k": "row", "n": "col"})


@register(aten.bmm, cost=bmm_cost, saves="partners")
def bmm_rule(node):
    return _self_mat2(node, "bmk,bkn->bmn", {"b": "dp", "k": "row", "n": "col"})


@register(aten.baddbmm, cost=baddbmm_cost, saves="partners")
@register(aten.addmm, cost=addmm_cost, saves="partners")
def addmm_rule(node):
    b = bound(node)
    a, m = tensor_shape(b["mat1" if "mat1" in b else "batch1"]), tensor_shape(b["mat2" if "mat2" in b else "batch2"])
    k1, k2 = ("mat1", "mat2") if "mat1" in b else ("batch1", "batch2")
    sub = "mk,kn->mn" if len(a) == 2 else "bmk,bkn->bmn"
    out = tensor_shape(node)
    names = {"b": "dp", "m": "dp" if len(a) == 2 else "m", "k": "row", "n": "col"}
    for name, (pa, pb), po in _with_fused(node, einsum_choices(sub, [a, m], names, partial_inputs=False)):
        yield choice(node, {"self": _bias_pl(tensor_shape(b["self"]), po, out), k1: pa, k2: pb}, [po], name)


def matmul_subscripts(a, b):
    """Subscripts of ``torch.matmul`` for operand ranks (1-d operands and broadcast batch dims)."""
    ra, rb = len(a), len(b)
    nb = max(ra, rb) - 2 if ra >= 2 and rb >= 2 else max(ra, rb) - 2 if min(ra, rb) >= 1 else 0
    batch = "abcdefgh"[: max(nb, 0)]
    if ra == 1 and rb == 1:
        return "k,k->"
    if ra == 1:
        return f"k,{batch[len(batch) - (rb - 2):]}kn->{batch[len(batch) - (rb - 2):]}n"
    if rb == 1:
        return f"{batch[len(batch) - (ra - 2):]}mk,k->{batch[len(batch) - (ra - 2):]}m"
    ba, bb = batch[len(batch) - (ra - 2):], batch[len(batch) - (rb - 2):]
    return f"{ba}mk,{bb}kn->{batch}mn"


@register(aten.matmul, cost=matmul_cost, saves="partners")
def matmul_rule(node):
    b = bound(node)
    a, m = tensor_shape(b["self"]), tensor_shape(b["other"])
    sub = matmul_subscripts(a, m)
    names = {"k": "row", "n": "col", "a": "dp"}
    for name, (pa, pb), po in _with_fused(node, einsum_choices(sub, [a, m], names)):
        yield choice(node, {"self": pa, "other": pb}, [po], name)


@register(aten.einsum, cost=einsum_cost, saves="lowered")
def einsum_rule(node):
    b = bound(node)
    eq = b["equation"].replace(" ", "")
    if "..." in eq or "->" not in eq:
        return  # implicit output / ellipsis: replicate only
    shapes = [tensor_shape(t) for t in b["tensors"]]
    for name, pls, po in einsum_choices(eq, shapes):
        yield choice(node, {"tensors": pls}, [po], name)


# Matmul-like ops without a sharding rule (replicated), priced as GEMMs.
declare(aten.addbmm, cost=baddbmm_cost)
declare(aten.dot, aten.mv, cost=matmul_cost, saves="partners")
declare(aten.vdot, aten.inner, cost=matmul_cost)
