"""Convolutions: convolution, conv1d/2d/3d, conv_transpose (``groups == 1`` for channel splits).

``input[N, Cin, *sp]``, ``weight[Cout, Cin, *k]`` (transposed: ``[Cin, Cout, *k]``):

* ``dp``: N sharded -> output N sharded;
* ``cout``: weight's out-channel dim (and bias) sharded -> output channel dim sharded;
* ``cin``: input channels and weight's in-channel dim sharded -> ``P(sum)`` (bias ``P(sum)``).

Spatial dims are never sharded (a halo exchange would be needed). Backend convolutions have no
sharding rule (replicated).

Pooling and resampling (``max_pool*``, ``avg_pool*``, ``adaptive_avg_pool*``, ``upsample_*``)
work on each ``(sample, channel)`` plane alone: every dim before the ``k`` spatial ones may be
sharded, output (and ``max_pool2d_with_indices``' plane-local indices) alike
(:func:`pool_rule`); ``pixel_shuffle`` mixes channels (batch dims only), ``im2col``/``col2im``
the channels and the kernel window (the batch only). All are priced as copies.
``max_pool2d(x[8, 4, 6, 6], [2, 2])`` on one axis::

    R: R -> R      dp: S(0) -> S(0)      S1: S(1) -> S(1)
"""

from __future__ import annotations

import torch

import torch.nn.functional as F

from fxpar.cost.compute import conv_transpose_cost, convnd_cost, convolution_cost, copy_cost
from fxpar.strategies.base import P, S, bound, choice, declare, out_shapes, register, tensor_shape

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

# spatial data movement: pooling windows, resampling, patch extraction (bytes only); the number
# of trailing dims each op mixes (the dims before them index independent planes): im2col and
# pixel_shuffle mix the channels too, col2im its [C·k, L] columns
_SPATIAL = {aten.max_pool1d: 1, aten.avg_pool1d: 1, aten.adaptive_avg_pool1d: 1,
            aten.max_pool2d: 2, aten.max_pool2d_with_indices: 2, aten.avg_pool2d: 2,
            aten.adaptive_avg_pool2d: 2, aten._adaptive_avg_pool2d: 2, aten.upsample_nearest2d: 2,
            aten.upsample_bilinear2d: 2, aten.max_pool3d: 3, aten.avg_pool3d: 3,
            aten.adaptive_avg_pool3d: 3, aten._adaptive_avg_pool3d: 3,
            aten.pixel_shuffle: 3, aten.im2col: 3, aten.col2im: 2}

def pool_rule(node):
    """Every dim before the ones the op mixes (:data:`_SPATIAL`) sharded, every output alike
    (for ``im2col``/``col2im``/``pixel_shuffle`` the batch only)."""
    x = tensor_shape(node.args[0])  # named input or self, by overload
    if x is None:
        return
    outs = out_shapes(node)
    for d in range(len(x) - _SPATIAL[node.target.overloadpacket]):
        yield choice(node, {"input": S(d), "self": S(d)}, [S(d)] * len(outs), "dp" if d == 0 else f"S{d}")


register(aten.max_pool2d, aten.max_pool2d_with_indices, cost=copy_cost, saves="input0")(pool_rule)
register(*[op for op in _SPATIAL if op not in (aten.max_pool2d, aten.max_pool2d_with_indices)],
         cost=copy_cost)(pool_rule)
declare(F.interpolate, cost=copy_cost)
