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
devices holding different shards and identical masks on replicas of one shard. The local rewrite
:func:`dropout_local` makes a training ``aten.dropout`` the op
``torch.ops.fxpar.sharded_dropout(x, p, train, site, shard_key)`` keyed by the node (``site``) and this
rank's coordinates on the axes that shard ``x``.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from fxpar import ir
from fxpar.cost.compute import activation_cost, copy_cost, creation_cost, dropout_cost, pointwise_cost
from fxpar.strategies.base import P, R, S, bound, choice, declare, out_shapes, register, tensor_shape
from fxpar.strategies.local import LocalContext, shard_key

aten = torch.ops.aten

_ALL_PARTIAL = {aten.add, aten.sub, aten.add_, aten.sub_}
_ONE_PARTIAL = {aten.mul, aten.mul_}
_SELF_PARTIAL = {aten.div, aten.div_}
_UNARY_LINEAR = {aten.neg, aten.clone, aten.contiguous, aten.alias, aten.detach, aten.to, aten._to_copy,
                 aten.lift_fresh_copy, aten.positive, aten.type_as}

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


def dropout_local(node: fx.Node, lctx: LocalContext) -> None:
    """``aten.dropout.default(x, p, train)`` in training becomes
    ``torch.ops.fxpar.sharded_dropout(x, p, train, site, shard_key)``: ``site`` is
    ``lctx.site``, ``shard_key`` this rank's coordinates where ``x``'s spec is ``Shard``
    (:func:`~fxpar.strategies.local.shard_key`). Inference (``train=False``) or ``p == 0`` is the
    identity and is left as it is (``aten.dropout`` draws nothing then)."""
    if node.target is not aten.dropout.default:
        return
    b = bound(node)
    x, p, train = b["input"], float(b["p"]), bool(b["train"])
    if not train or p == 0.0:
        return
    xspec = node.meta[ir.IN_SPECS][node.all_input_nodes.index(x)]
    import fxpar.runtime.ops  # noqa: F401  (registers torch.ops.fxpar: only when localizing)

    node.target = torch.ops.fxpar.sharded_dropout.default
    node.args = (x, p, train, int(lctx.site), shard_key(xspec, lctx.coord))
    node.kwargs = {}


# --- records -------------------------------------------------------------------------------------
# Ops listed here with ``pointwise_rule`` are elementwise but not all tagged pointwise in ATen;
# any other ATen op tagged pointwise gets the rule too (``fxpar.strategies.strategy_rule``).
# The record of an in-place op (``add_``) names no cost: it is priced as its functional form.
register(aten.__and__, aten.__or__, aten.__xor__, aten.positive)(pointwise_rule)
register(aten.floor_divide, aten.remainder, cost=pointwise_cost)(pointwise_rule)
register(aten.expm1, cost=activation_cost)(pointwise_rule)
register(aten.masked_fill_, aten.div_, aten.mul_, aten.add_, aten.sub_)(pointwise_rule)
register(aten.where, aten.mul, aten.div, cost=pointwise_cost, saves="partners")(pointwise_rule)
register(aten.masked_fill, cost=pointwise_cost, saves="indices")(pointwise_rule)
register(aten.clamp, aten.pow, aten.abs, aten.minimum, aten.maximum, aten.square, cost=pointwise_cost,
         saves="input0")(pointwise_rule)
register(aten.relu, aten.rsqrt, aten.sqrt, aten.reciprocal, cost=pointwise_cost, saves="output")(pointwise_rule)
# transcendental: priced at the measured activation rate (erf, exp, log, sin in software on a CPU)
register(aten.gelu, aten.silu, aten.log, aten.sin, aten.cos, aten.erf, aten.log1p, cost=activation_cost,
         saves="input0")(pointwise_rule)
register(aten.tanh, aten.sigmoid, aten.exp, cost=activation_cost, saves="output")(pointwise_rule)
register(aten.add, aten.sub, aten.neg, cost=pointwise_cost, saves="nothing")(pointwise_rule)
register(aten.eq, aten.ne, aten.le, aten.lt, aten.ge, aten.gt, aten.bitwise_not, aten.logical_not, aten.logical_and,
         aten.bitwise_and, aten.bitwise_or, aten.sign, aten.round, aten.trunc, aten.floor, aten.ceil,
         cost=pointwise_cost, differentiable=False)(pointwise_rule)
# casts and copies
register(aten.to, aten._to_copy, aten.type_as, aten.copy, aten.copy_, cost=copy_cost, saves="nothing")(pointwise_rule)
# factories shaped like their input: the input lends only shape, dtype and device
register(aten.empty_like, aten.rand_like, aten.randn_like, aten.fill, cost=creation_cost,
         differentiable=False)(pointwise_rule)
register(aten.zeros_like, aten.ones_like, aten.full_like, cost=creation_cost, saves="nothing",
         differentiable=False)(pointwise_rule)
# dropout: exact in distribution only; localized into a shard-keyed mask (dropout_local) that
# its backward draws again (fxpar.sharded_dropout): it keeps nothing for the backward
register(aten.dropout, cost=dropout_cost, saves="nothing", local=dropout_local)(pointwise_rule)
register(aten.native_dropout, cost=dropout_cost, saves="nothing")(pointwise_rule)

# Elementwise ops without a record of their own above (those ATen tags pointwise still get the
# pointwise rule), and the torch-level callables a graph can hold (Python scalar arithmetic).
declare(aten.clip, aten.copysign, aten.floordiv, aten.fmax, aten.fmin, aten.fmod, aten.frac,
        aten.hardtanh_backward, aten.hypot, aten.lerp, aten.nan_to_num, aten.sgn,
        aten.sigmoid_backward, aten.tanh_backward, aten.threshold,
        aten.threshold_backward, operator.truediv, operator.floordiv, operator.mod, operator.imul,
        operator.isub, operator.itruediv, cost=pointwise_cost)
declare(aten.acos, aten.asin, aten.atan, aten.celu, aten.cosh, aten.erfc, aten.erfinv, aten.exp2,
        aten.gelu_backward, aten.log10, aten.logit, aten.selu, aten.silu_backward, aten.sinh, aten.tan,
        aten.xlogy, cost=activation_cost)
declare(aten.addcdiv, aten.addcmul, aten.true_divide, operator.mul, cost=pointwise_cost, saves="partners")
declare(aten.clamp_max, aten.clamp_min, aten.hardsigmoid, aten.hardswish, aten.leaky_relu,
        operator.pow, operator.abs, cost=pointwise_cost, saves="input0")
declare(aten.atan2, aten.glu, aten.log2, aten.mish, aten.softplus, cost=activation_cost, saves="input0")
declare(aten.hardtanh, aten.relu6, cost=pointwise_cost, saves="output")
declare(aten.elu, cost=activation_cost, saves="output")
declare(aten.rsub, aten.tril, aten.triu, operator.add, operator.sub, operator.iadd, operator.neg,
        cost=pointwise_cost, saves="nothing")
declare(aten.bitwise_xor, aten.isfinite, aten.isinf, aten.isnan, aten.logical_or, aten.logical_xor, operator.eq,
        operator.ne, operator.lt, operator.le, operator.gt, operator.ge, cost=pointwise_cost,
        differentiable=False)
declare(aten.alpha_dropout, aten.feature_dropout, cost=dropout_cost, saves="mask")
declare(aten.bernoulli, cost=dropout_cost)
declare(aten.fill_, differentiable=False)
# Tensor-method casts of symbolic_trace graphs (``x.float()``)
declare(torch.Tensor.float, torch.Tensor.half, torch.Tensor.bfloat16, cost=copy_cost, saves="nothing")
declare(torch.Tensor.double, cost=copy_cost)
