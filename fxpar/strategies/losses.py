"""Losses: cross_entropy_loss, nll_loss, nll_loss_forward (class-index targets).

``input[N, C, d1..]`` (or ``[C]``), ``target[N, d1..]``. Sharding N (or a spatial dim d_i) in
input and target:

* ``reduction="none"`` -> output sharded on that dim;
* ``"sum"`` -> ``P(sum)``;
* ``"mean"`` -> ``P(sum)`` with the target (and class weights) replicated: the mean divides
  by the weight of the non-ignored targets (their count without class weights), which a shard
  of the target cannot know (an average of local means is wrong when shards hold different
  numbers of ``ignore_index`` targets, and NaN for a shard that holds only those), so the
  local program (:func:`sharded_mean_local`) computes the loss summed over its own slice of
  input and target divided by that weight over the WHOLE target: the addends sum to the mean,
  exactly, for any split. ``nll_loss_forward``'s ``total_weight`` is then that global weight
  (replicated).

The class dim C is never sharded: vocabulary-parallel cross-entropy needs the global max and
sum-exp (two all-reduces) plus a masked target-logit gather inside the op, which is not the
same ATen op on local shards; it needs a dedicated kernel (not provided). Other losses have no
sharding rule (replicated); all are priced like a softmax.
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.distributed.tensor import Shard

from fxpar import ir
from fxpar.cost.compute import softmax_cost
from fxpar.strategies.base import P, R, S, bound, choice, declare, out_shapes, register, tensor_shape
from fxpar.strategies.local import LocalContext

aten = torch.ops.aten
_RED = {0: "none", 1: "mean", 2: "sum"}
#: the class-index losses of :func:`loss_rule` (same leading arguments: self, target, weight,
#: reduction, ignore_index)
_LOSSES = (aten.cross_entropy_loss, aten.nll_loss, aten.nll_loss_forward, aten.nll_loss2d_forward,
           aten.nll_loss_nd, aten.nll_loss2d)


def sharded_mean_loss(x: torch.Tensor, target: torch.Tensor, bounds: list, weight, ignore_index: int,
                      op: str, overload: str, *extra):
    """This rank's addend of a ``reduction="mean"`` class-index loss whose input ``x`` is this
    rank's slice ``bounds`` (``[start, stop]`` per target dim) of the global input and whose
    ``target`` is the WHOLE target: the loss summed over the slice, divided by the weight of
    every non-ignored target (``aten.<op>.<overload>`` with ``reduction="sum"``; ``extra``: its
    arguments after ``ignore_index``, e.g. ``label_smoothing``). Two-output ops
    (``nll_loss_forward``) also return that weight (``total_weight``)."""
    fn = getattr(getattr(torch.ops.aten, op), overload)
    local_t = target[tuple(slice(lo, hi) for lo, hi in bounds)]
    out = fn(x, local_t, weight, 2, ignore_index, *extra)
    keep = target != ignore_index
    if weight is None:
        denom = keep.sum().to(x.dtype)
    else:
        denom = (weight[torch.where(keep, target, 0)] * keep).sum()
    if isinstance(out, (tuple, list)):
        return out[0] / denom, denom
    return out / denom


def sharded_mean_call(node: fx.Node, in_specs, global_shape, mesh_shape, coord):
    """``(target, args)`` of this rank's call of a mean loss ``node`` whose input is sharded and
    target replicated (:func:`sharded_mean_loss`), or ``None`` when the plain op is right
    (another reduction, or the input whole). ``global_shape(n)``: a node's global shape."""
    if getattr(node.target, "overloadpacket", None) not in _LOSSES:
        return None
    b = bound(node)
    if _RED.get(b.get("reduction", 1), "mean") != "mean":
        return None
    x = b["self"]
    xspec = in_specs[node.all_input_nodes.index(x)]
    if xspec is None or not any(isinstance(p, Shard) for p in xspec):
        return None
    sl = xspec.global_slices(global_shape(x), mesh_shape, coord)
    bounds = [[s.start, s.stop] for s in (sl[0], *sl[2:])]  # target dims: N, d1, ...
    extra = (b["label_smoothing"],) if "label_smoothing" in b else ()
    op = node.target
    args = (x, b["target"], bounds, b.get("weight"), b.get("ignore_index", -100),
            op._schema.name.split("::")[-1], op._overloadname, *extra)
    return sharded_mean_loss, args


def sharded_mean_local(node: fx.Node, lctx: LocalContext) -> None:
    """Localize a mean loss planned with its input sharded (see the module docstring)."""
    got = sharded_mean_call(node, node.meta[ir.IN_SPECS], lctx.global_shape, lctx.mesh_shape,
                            lctx.coord)
    if got is not None:
        node.target, node.args = got
        node.kwargs = {}


@register(*_LOSSES[3:], cost=softmax_cost, local=sharded_mean_local)
@register(*_LOSSES[:3], cost=softmax_cost, saves="input0", local=sharded_mean_local)
def loss_rule(node):
    b = bound(node)
    x, t = tensor_shape(b["self"]), tensor_shape(b["target"])
    if len(x) < 2 or t is None or len(t) != len(x) - 1:
        return
    red = _RED.get(b.get("reduction", 1), "mean")
    n_out = len(out_shapes(node))
    for td in range(len(t)):
        xd = 0 if td == 0 else td + 1
        name = "dp" if td == 0 else f"m{td}"
        if red == "none":
            yield choice(node, {"self": S(xd), "target": S(td)}, [S(td)] + [P()] * (n_out - 1), name)
        elif red == "sum":
            yield choice(node, {"self": S(xd), "target": S(td)}, [P()] * n_out, name)
        else:  # the local program divides by the weight of the WHOLE target: exact for any split
            yield choice(node, {"self": S(xd), "target": R, "weight": R},
                         [P()] + [R] * (n_out - 1), name)


declare(aten.mse_loss, aten.l1_loss, aten.smooth_l1_loss, F.cross_entropy, cost=softmax_cost, saves="input0")
declare(aten.binary_cross_entropy, aten.binary_cross_entropy_with_logits, aten.huber_loss, aten.kl_div,
        cost=softmax_cost)
