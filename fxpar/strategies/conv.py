"""Convolutions: convolution, conv1d/2d/3d, conv_transpose (``groups == 1`` for channel splits).

``input[N, Cin, *sp]``, ``weight[Cout, Cin, *k]`` (transposed: ``[Cin, Cout, *k]``):

* ``dp``: N sharded -> output N sharded;
* ``cout``: weight's out-channel dim (and bias) sharded -> output channel dim sharded;
* ``cin``: input channels and weight's in-channel dim sharded -> ``P(sum)`` (bias ``P(sum)``).

Spatial dims are never sharded (a halo exchange would be needed).
"""

from __future__ import annotations

import torch

from fxpar.strategies.base import P, S, bound, choice, register, tensor_shape

aten = torch.ops.aten

_OPS = [aten.convolution, aten.conv1d, aten.conv2d, aten.conv3d, aten.conv_transpose1d,
        aten.conv_transpose2d, aten.conv_transpose3d, aten._convolution]


@register(*_OPS)
def conv_rule(node):
    b = bound(node)
    x = tensor_shape(b["input"])
    w = tensor_shape(b["weight"])
    o = tensor_shape(node)
    if x is None or w is None or len(x) != len(w):  # unbatched input: replicate only
        return
    tr = bool(b.get("transposed", False)) or "transpose" in str(node.target)
    has_bias = b.get("bias") is not None
    yield choice(node, {"input": S(0)}, [S(0)], "dp")
    if b.get("groups", 1) != 1:
        return
    wout, win = (1, 0) if tr else (0, 1)
    yield choice(node, {"weight": S(wout), "bias": S(0) if has_bias else None}, [S(1)], "cout")
    yield choice(node, {"input": S(1), "weight": S(win), "bias": P() if has_bias else None}, [P()], "cin")
    del o
