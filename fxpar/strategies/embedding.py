"""Embedding: ``embedding(weight[V, D], ids[...]) -> [..., D]``.

* ``dp``: ids sharded on any dim -> output sharded on it, weight replicated;
* ``col``: weight ``S(1)`` -> output sharded on its last dim;
* ``vocab`` (Megatron vocab-parallel): weight ``S(0)`` -> ``P(sum)``. NOT the plain local op:
  a device holding rows ``[lo, hi)`` must look up ``ids - lo`` where ``lo <= ids < hi`` and
  output zeros elsewhere. Which lookup runs is carried by the layouts, not by the strategy's
  name: :func:`is_vocab_parallel` reads the input specs (weight ``Shard(0)`` on an axis where
  the ids are not sharded), and the local rewrite :func:`vocab_parallel_local` turns such a node
  into :func:`fxpar.runtime.ops.vocab_parallel_embedding` with this rank's first row.

``embedding(w[64,32], ids[2,8])``::

    R: R, R -> R    dp: R, S(0) -> S(0)    m1: R, S(1) -> S(1)    col: S(1), R -> S(2)
    vocab: S(0), R -> P(sum)
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.distributed.tensor import Shard

from fxpar import ir
from fxpar.cost.compute import copy_cost, embedding_cost
from fxpar.strategies.base import P, R, S, bound, choice, declare, register, tensor_shape
from fxpar.strategies.local import LocalContext

aten = torch.ops.aten


def is_vocab_parallel(weight_spec, indices_spec) -> bool:
    """True when the weight is split along the vocabulary (``Shard(0)``) on a mesh axis where the
    indices are not sharded: each rank holds some rows and must mask the ids it does not own.

    >>> from fxpar.spec import Spec
    >>> is_vocab_parallel(Spec.parse("RS(0)"), Spec.parse("S(0)R")), is_vocab_parallel(Spec.parse("S(1)"), Spec.parse("R"))
    (True, False)
    """
    if weight_spec is None:
        return False
    ids = tuple(indices_spec) if indices_spec is not None else (None,) * len(tuple(weight_spec))
    return any(isinstance(w, Shard) and w.dim == 0 and not isinstance(i, Shard)
               for w, i in zip(weight_spec, ids))


def vocab_parallel_local(node: fx.Node, lctx: LocalContext) -> None:
    """``embedding(w, ids, ...)`` under a vocabulary-parallel layout becomes
    ``vocab_parallel_embedding(w, ids, start, ...)`` with ``start`` this rank's first row."""
    if node.target is not aten.embedding.default:
        return
    w, ids = node.args[0], node.args[1]
    in_specs = node.meta[ir.IN_SPECS]
    ins = node.all_input_nodes
    wspec = in_specs[ins.index(w)]
    ispec = in_specs[ins.index(ids)] if isinstance(ids, fx.Node) else None
    if not is_vocab_parallel(wspec, ispec):
        return
    from fxpar.runtime.ops import vocab_parallel_embedding  # runtime ops: only when localizing

    start = wspec.global_slices(lctx.global_shape(w), lctx.mesh_shape, lctx.coord)[0].start
    node.target = vocab_parallel_embedding
    node.args = (w, ids, start) + tuple(node.args[2:])


@register(aten.embedding, cost=embedding_cost, saves="indices", local=vocab_parallel_local)
def embedding_rule(node):
    b = bound(node)
    ids = tensor_shape(b["indices"])
    o = tensor_shape(node)
    for d in range(len(ids)):
        yield choice(node, {"weight": R, "indices": S(d)}, [S(d)], "dp" if d == 0 else f"m{d}")
    yield choice(node, {"weight": S(1), "indices": R}, [S(len(o) - 1)], "col")
    yield choice(node, {"weight": S(0), "indices": R}, [P()], "vocab")


declare(aten.embedding_bag, aten._embedding_bag, cost=embedding_cost)
declare(aten.embedding_dense_backward, cost=copy_cost)
