"""Local replacements for ops whose sharded computation is not the plain op on local tensors.

* :func:`vocab_parallel_embedding`: the weight's rows ``[start, start + n)`` live on this rank
  (``S(0)`` on the vocabulary dim); ids outside that range read row 0 and are zeroed, so the
  output is ``P(sum)`` over the vocabulary axes (Megatron's vocabulary-parallel embedding).
  Plain ATen ops: traceable, differentiable.
* ``torch.ops.fxpar.keep_mask(x, p, site, shard_key)``: dropout's boolean keep-mask of ``x``'s
  shape, drawn from a generator keyed by the step, the ``site`` (the node) and this rank's
  shard coordinates (:mod:`fxpar.runtime.rng`, the tracker of the active
  :class:`~fxpar.runtime.bindings.Bindings`): replicas of one shard draw the same mask,
  different shards independent ones.
* ``torch.ops.fxpar.sharded_dropout(x, p, train, site, shard_key)``: ``x * mask / (1 - p)``
  with that mask; its backward draws the mask again (nothing saved).
* every other random op, keyed the same way: ``torch.ops.fxpar.keyed_*``
  (:mod:`fxpar.runtime.keyed`; defined when this module is imported);
* the vocabulary-parallel cross-entropy, log-softmax and nll loss (the class dim split):
  ``torch.ops.fxpar.vocab_parallel_cross_entropy`` and friends (:mod:`fxpar.runtime.vocab`;
  defined when this module is imported);
* causal attention on a sequence shard with its work balanced across the context-parallel
  axis: ``torch.ops.fxpar.balanced_causal_sdpa`` (:mod:`fxpar.runtime.context_parallel`).

>>> import torch
>>> w = torch.arange(6.).reshape(3, 2)            # rows 3..5 of a 6-row table
>>> vocab_parallel_embedding(w, torch.tensor([0, 4]), 3)
tensor([[0., 0.],
        [2., 3.]])
"""

from __future__ import annotations

import torch

from fxpar.runtime.bindings import current
from fxpar.runtime.library import define

__all__ = ["vocab_parallel_embedding", "KEEP_MASK", "SHARDED_DROPOUT"]


def vocab_parallel_embedding(weight: torch.Tensor, indices: torch.Tensor, start: int,
                             padding_idx: int = -1, scale_grad_by_freq: bool = False,
                             sparse: bool = False) -> torch.Tensor:
    """``aten.embedding`` over the rows ``[start, start + weight.shape[0])`` of the full table:
    ``out[i] = weight[ids[i] - start]`` if the id is in range, else 0 (a ``P(sum)`` addend)."""
    n = weight.shape[0]
    local = indices - start
    inside = (local >= 0) & (local < n)
    pad = padding_idx - start if 0 <= padding_idx - start < n else -1
    out = torch.ops.aten.embedding(weight, torch.where(inside, local, 0), pad,
                                   scale_grad_by_freq, sparse)
    return out * inside.unsqueeze(-1).to(out.dtype)


def _keep_mask(x: torch.Tensor, p: float, site: int, shard_key: list[int]) -> torch.Tensor:
    from fxpar.runtime.rng import keep_mask as draw

    tracker = current().tracker
    if tracker is None:
        raise RuntimeError(f"fxpar.keep_mask site {site}: the bindings have no RNG tracker")
    return draw(x.shape, p, site=site, shard_key=shard_key, tracker=tracker, device=x.device)


def _scale(p: float) -> float:
    return 0.0 if p == 1.0 else 1.0 / (1.0 - p)


def _sharded_dropout(x: torch.Tensor, p: float, train: bool, site: int, shard_key: list[int]) -> torch.Tensor:
    if not train or p == 0.0:
        return x.clone()
    return x * KEEP_MASK(x, p, site, shard_key) * _scale(p)


def _dropout_backward(args, g):
    _, p, train, site, key = args
    if not train or p == 0.0:
        return g, None, None, None, None
    return g * KEEP_MASK(g, p, site, key) * _scale(p), None, None, None, None


KEEP_MASK = define("fxpar::keep_mask(Tensor x, float p, int site, int[] shard_key) -> Tensor", _keep_mask,
                   fake=lambda x, p, site, shard_key: torch.empty(x.shape, dtype=torch.bool, device=x.device),
                   differentiable=False)
#: ``aten.dropout(x, p, train)`` with a shard-aware mask: ``x * keep_mask(x, p, site, shard_key)
#: * (1 / (1 - p))`` (the arithmetic of :func:`fxpar.runtime.rng.dropout`, so masks and values
#: match it bit for bit). Backward draws the same mask again (a function of the tracker's step
#: and microbatch, the site and the shard key: nothing is saved) and returns
#: ``g * mask * (1 / (1 - p))``. ``train=False`` or ``p == 0``: a copy of ``x``.
SHARDED_DROPOUT = define(
    "fxpar::sharded_dropout(Tensor x, float p, bool train, int site, int[] shard_key) -> Tensor",
    _sharded_dropout, fake=lambda x, p, train, site, shard_key: torch.empty_like(x),
    backward=_dropout_backward)

# the keyed random ops build on keep_mask / sharded_dropout: defined with them
import fxpar.runtime.keyed  # noqa: E402,F401
import fxpar.runtime.vocab  # noqa: E402,F401  (the vocabulary-parallel cross-entropy)
import fxpar.runtime.context_parallel  # noqa: E402,F401  (load-balanced causal attention)
