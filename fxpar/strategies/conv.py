"""Convolutions: convolution, conv1d/2d/3d, conv_transpose (``groups == 1`` for channel splits).

``input[N, Cin, *sp]``, ``weight[Cout, Cin, *k]`` (transposed: ``[Cin, Cout, *k]``):

* ``dp``: N sharded -> output N sharded;
* ``cout``: weight's out-channel dim (and bias) sharded -> output channel dim sharded;
* ``cin``: input channels and weight's in-channel dim sharded -> ``P(sum)`` (bias ``P(sum)``).

Spatial dims are never sharded (a halo exchange would be needed). Backend convolutions, pooling,
upsampling and ``im2col``/``col2im`` have no sharding rule (replicated) and are priced as copies.
"""

from __future__ import annotations

import torch

import torch.nn.functional as F

from fxpar.cost.compute import conv_transpose_cost, convnd_cost, convolution_cost, copy_cost
from fxpar.strategies.base import P, S, bound, choice, declare, register, tensor_shape

aten = torch.ops.aten
_TRANSPOSED = (aten.conv_transpose1d, aten.conv_transpose2d, aten.conv_transpose3d)


@register(*_TRANSPOSED, cost=conv_transpose_cost, saves="partners")
@register(aten.conv1d, aten.conv2d, aten.conv3d, cost=convnd_cost, saves="partners")
@register(aten.convolution, aten._convolution, cost=convolution_cost, saves="partners")
def conv_rule(node):
    b = bound(node)
    x = tensor_shape(b["input"])
    w = tensor_shape(b["weight"])
    o = tensor_shape(node)
    if x is None or w is None or len(x) != len(w):  # unbatched input: replicate only
        return
    tr = bool(b.get("transposed", False)) or getattr(node.target, "overloadpacket", None) in _TRANSPOSED
    has_bias = b.get("bias") is not None
    yield choice(node, {"input": S(0)}, [S(0)], "dp")
    if b.get("groups", 1) != 1:
        return
    wout, win = (1, 0) if tr else (0, 1)
    yield choice(node, {"weight": S(wout), "bias": S(0) if has_bias else None}, [S(1)], "cout")
    yield choice(node, {"input": S(1), "weight": S(win), "bias": P() if has_bias else None}, [P()], "cin")
    del o


declare(aten.convolution_overrideable, aten.cudnn_convolution, aten.mkldnn_convolution, cost=convolution_cost)
# spatial data movement: pooling windows, resampling, patch extraction (bytes only)
declare(aten.max_pool2d, aten.max_pool2d_with_indices, cost=copy_cost, saves="input0")
declare(aten._adaptive_avg_pool2d, aten.adaptive_avg_pool2d, aten.avg_pool1d, aten.avg_pool2d, aten.avg_pool3d,
        aten.max_pool1d, aten.max_pool3d, aten.upsample_nearest2d, aten.upsample_bilinear2d, aten.pixel_shuffle,
        aten.im2col, aten.col2im, F.interpolate, cost=copy_cost)
