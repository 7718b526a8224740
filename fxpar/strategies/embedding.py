"""Embedding: ``embedding(weight[V, D], ids[...]) -> [..., D]``.

* ``dp``: ids sharded on any dim -> output sharded on it, weight replicated;
* ``col``: weight ``S(1)`` -> output sharded on its last dim;
* ``vocab`` (Megatron vocab-parallel): weight ``S(0)`` -> ``P(sum)``. NOT the plain local op:
  a device holding rows ``[lo, hi)`` must look up ``ids - lo`` where ``lo <= ids < hi`` and
  output zeros elsewhere (the runtime must emit this masked lookup; the strategy name says
  ``vocab``).

``embedding(w[64,32], ids[2,8])``::

    R: R, R -> R    dp: R, S(0) -> S(0)    m1: R, S(1) -> S(1)    col: S(1), R -> S(2)
    vocab: S(0), R -> P(sum)
"""

from __future__ import annotations

import torch

from fxpar.strategies.base import P, R, S, bound, choice, register, tensor_shape

aten = torch.ops.aten

#: strategy names whose local computation is NOT the plain op (the runtime must special-case)
NEEDS_MASKED_LOOKUP = "vocab"


@register(aten.embedding)
def embedding_rule(node):
    b = bound(node)
    ids = tensor_shape(b["indices"])
    o = tensor_shape(node)
    for d in range(len(ids)):
        yield choice(node, {"weight": R, "indices": S(d)}, [S(d)], "dp" if d == 0 else f"m{d}")
    yield choice(node, {"weight": S(1), "indices": R}, [S(len(o) - 1)], "col")
    yield choice(node, {"weight": S(0), "indices": R}, [P()], NEEDS_MASKED_LOOKUP)
