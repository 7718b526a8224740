"""Pointwise ops with broadcasting (and dropout, casts, identities).

Output dim ``d`` sharded: every tensor operand holding that dim (right-aligned, size equal to the
output's) is sharded on it; a size-1 broadcast dim or a missing dim is replicated. Partial inputs
only where the op is linear in them (DESIGN: a nonlinear op such as gelu needs R/S inputs):

* ``add``/``sub`` of tensors: all operands ``P(sum)`` -> ``P(sum)`` (not with a Python scalar:
  it would be added once per device);
* ``mul``: one operand ``P(sum)``, the others replicated; ``div``: the numerator only;
* ``neg``, casts, ``clone``/``contiguous``/``alias``/``detach``: ``P(sum)`` passes.

``add(x[2,8], b[8])`` on one axis::

    R: R, R -> R      S0: S(0), R -> S(0)      S1: S(1), S(0) -> S(1)      P: P(sum), P(sum) -> P(sum)

Dropout shards are exact only in distribution: the runtime must draw independent masks on
devices holding different shards and identical masks on replicas of one shard.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from fxpar.strategies.base import P, R, S, bound, choice, out_shapes, register, tensor_shape

aten = torch.ops.aten

_ALL_PARTIAL = {aten.add, aten.sub, aten.add_, aten.sub_}
_ONE_PARTIAL = {aten.mul, aten.mul_}
_SELF_PARTIAL = {aten.div, aten.div_}
_UNARY_LINEAR = {aten.neg, aten.clone, aten.contiguous, aten.alias, aten.detach, aten.to, aten._to_copy,
                 aten.lift_fresh_copy, aten.positive, aten.type_as}

# Not tagged pointwise in ATen, but elementwise all the same.
_EXTRA = [aten.__and__, aten.__or__, aten.__xor__, aten.floor_divide, aten.to, aten._to_copy, aten.empty_like,
          aten.zeros_like, aten.ones_like, aten.full_like, aten.rand_like, aten.randn_like, aten.dropout,
          aten.native_dropout, aten.clone, aten.contiguous, aten.alias, aten.detach, aten.lift_fresh_copy,
          aten.type_as, aten.where, aten.masked_fill, aten.masked_fill_, aten.clamp, aten.gelu, aten.silu,
          aten.relu, aten.tanh, aten.sigmoid, aten.add, aten.sub, aten.mul, aten.div, aten.neg, aten.rsqrt,
          aten.pow, aten.exp, aten.log, aten.sqrt, aten.abs, aten.eq, aten.ne, aten.le, aten.lt, aten.ge,
          aten.gt, aten.sin, aten.cos, aten.bitwise_not, aten.logical_not, aten.logical_and, aten.erf,
          aten.fill, aten.copy, aten.copy_, aten.div_, aten.mul_, aten.add_, aten.sub_, aten.positive,
          aten.minimum, aten.maximum, aten.reciprocal, aten.square, aten.remainder, aten.bitwise_and,
          aten.bitwise_or, aten.log1p, aten.expm1, aten.sign, aten.round, aten.trunc, aten.floor, aten.ceil]


def _packet(node):
    return getattr(node.target, "overloadpacket", node.target)


def _tensor_args(node: fx.Node) -> dict:
    """``{arg name: shape}`` of the tensor arguments (not list arguments)."""
    return {k: tensor_shape(v) for k, v in bound(node).items()
            if isinstance(v, fx.Node) and tensor_shape(v) is not None}


def pointwise_rule(node: fx.Node):
    outs = out_shapes(node)
    if not outs:
        return
    out = outs[0]
    r = len(out)
    args = _tensor_args(node)
    for d in range(r):
        if out[d] <= 1:
            continue
        pls = {}
        for k, s in args.items():
            td = d - (r - len(s))
            pls[k] = S(td) if td >= 0 and s[td] == out[d] else R
        yield choice(node, pls, [S(d) if o == out else R for o in outs], f"S{d}")
    op = _packet(node)
    b = bound(node)
    has_scalar = any(not isinstance(b.get(k), fx.Node) and isinstance(b.get(k), (int, float, bool))
                     for k in ("other",))
    keys = list(args)
    if op in _ALL_PARTIAL and not has_scalar and len(outs) == 1:
        yield choice(node, {k: P() for k in keys}, [P()], "P")
    elif op in _ONE_PARTIAL and len(outs) == 1:
        for k in keys:
            yield choice(node, {j: (P() if j == k else R) for j in keys}, [P()], f"P({k})")
    elif op in _SELF_PARTIAL and "self" in keys:
        yield choice(node, {j: (P() if j == "self" else R) for j in keys}, [P()], "P")
    elif op in _UNARY_LINEAR and len(keys) == 1 and len(outs) == 1:
        yield choice(node, {keys[0]: P()}, [P()], "P")


register(*_EXTRA)(pointwise_rule)
