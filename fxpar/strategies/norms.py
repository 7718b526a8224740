"""Normalizations: layer_norm, native_layer_norm, rms_norm, _fused_rms_norm.

The normalized (trailing) dims must be replicated; any leading dim may be sharded; weight and
bias (shaped like the normalized dims) stay replicated. ``native_layer_norm``'s mean/rstd
(``[*lead, 1, ...]``) are sharded like the output. ``layer_norm(x[2,8,16], [16])``::

    R: R, R, R -> R      S0: S(0), R, R -> S(0)      S1: S(1), R, R -> S(1)

Group, batch and instance norms have no sharding rule (replicated); all are priced by
``norm_cost`` and save their input plus two fp32 statistics per row (``saves="stats"``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fxpar.cost.compute import norm_cost
from fxpar.strategies.base import S, bound, choice, declare, out_shapes, register, tensor_shape

aten = torch.ops.aten


@register(aten.layer_norm, aten.native_layer_norm, aten.rms_norm, aten._fused_rms_norm, cost=norm_cost,
          saves="stats")
def norm_rule(node):
    b = bound(node)
    a = tensor_shape(b["input"])
    lead = len(a) - len(b["normalized_shape"])
    outs = out_shapes(node)
    for d in range(lead):
        yield choice(node, {"input": S(d)}, [S(d) if len(o) > d and o[d] == a[d] else S(d) for o in outs], f"S{d}")


declare(aten.group_norm, aten.native_group_norm, aten.batch_norm, aten.native_batch_norm,
        aten._native_batch_norm_legit, aten._native_batch_norm_legit_functional, aten.instance_norm,
        cost=norm_cost, saves="stats")
declare(aten._native_batch_norm_legit_no_training, aten.cudnn_batch_norm, aten.miopen_batch_norm,
        F.local_response_norm, F.normalize, cost=norm_cost)
