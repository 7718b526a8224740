"""Normalizations: layer_norm, native_layer_norm, rms_norm, _fused_rms_norm.

The normalized (trailing) dims must be replicated; any leading dim may be sharded; weight and
bias (shaped like the normalized dims) stay replicated. ``native_layer_norm``'s mean/rstd
(``[*lead, 1, ...]``) are sharded like the output. ``layer_norm(x[2,8,16], [16])``::

    R: R, R, R -> R      S0: S(0), R, R -> S(0)      S1: S(1), R, R -> S(1)
"""

from __future__ import annotations

import torch

from fxpar.strategies.base import S, bound, choice, out_shapes, register, tensor_shape

aten = torch.ops.aten


@register(aten.layer_norm, aten.native_layer_norm, aten.rms_norm, aten._fused_rms_norm)
def norm_rule(node):
    b = bound(node)
    a = tensor_shape(b["input"])
    lead = len(a) - len(b["normalized_shape"])
    outs = out_shapes(node)
    for d in range(lead):
        yield choice(node, {"input": S(d)}, [S(d) if len(o) > d and o[d] == a[d] else S(d) for o in outs], f"S{d}")
