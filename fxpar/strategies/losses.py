"""Losses: cross_entropy_loss, nll_loss, nll_loss_forward (class-index targets).

``input[N, C, d1..]`` (or ``[C]``), ``target[N, d1..]``. Sharding N (or a spatial dim d_i) in
input and target:

* ``reduction="none"`` -> output sharded on that dim;
* ``"sum"`` -> ``P(sum)``;
* ``"mean"`` -> ``P(avg)``, flagged ``even``, and only without class weights. CAVEAT: the mean
  divides by the number of non-ignored targets; ``P(avg)`` is exact only when every shard holds
  the same number of targets equal to ``ignore_index`` (e.g. HF's shifted labels: one -100 per
  sequence and whole sequences per shard). Otherwise use ``"sum"`` and divide by the global count.

The class dim C is never sharded: vocabulary-parallel cross-entropy needs the global max and
sum-exp (two all-reduces) plus a masked target-logit gather inside the op, which is not the
same ATen op on local shards; it needs a dedicated kernel (not provided). Other losses have no
sharding rule (replicated); all are priced like a softmax.
"""

from __future__ import annotations

import torch

import torch.nn.functional as F

from fxpar.cost.compute import softmax_cost
from fxpar.strategies.base import P, S, bound, choice, declare, out_shapes, register, tensor_shape

aten = torch.ops.aten
_RED = {0: "none", 1: "mean", 2: "sum"}


@register(aten.nll_loss2d_forward, aten.nll_loss_nd, aten.nll_loss2d, cost=softmax_cost)
@register(aten.cross_entropy_loss, aten.nll_loss, aten.nll_loss_forward, cost=softmax_cost, saves="input0")
def loss_rule(node):
    b = bound(node)
    x, t = tensor_shape(b["self"]), tensor_shape(b["target"])
    if len(x) < 2 or t is None or len(t) != len(x) - 1 or b.get("weight") is not None and _RED.get(b.get("reduction", 1)) == "mean":
        return
    red = _RED.get(b.get("reduction", 1), "mean")
    n_out = len(out_shapes(node))
    for td in range(len(t)):
        xd = 0 if td == 0 else td + 1
        if red == "none":
            outs = [S(td)] + [P()] * (n_out - 1)
        elif red == "sum":
            outs = [P()] * n_out
        else:
            outs = [P("avg")] + [P()] * (n_out - 1)  # total_weight of nll_loss_forward adds up
        yield choice(node, {"self": S(xd), "target": S(td)}, outs, "dp" if td == 0 else f"m{td}",
                     even=red == "mean")


declare(aten.mse_loss, aten.l1_loss, aten.smooth_l1_loss, F.cross_entropy, cost=softmax_cost, saves="input0")
declare(aten.binary_cross_entropy, aten.binary_cross_entropy_with_logits, aten.huber_loss, aten.kl_div,
        cost=softmax_cost)
