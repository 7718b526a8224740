"""Local replacements for ops whose sharded computation is not the plain op on local tensors.

* :func:`vocab_parallel_embedding`: the weight's rows ``[start, start + n)`` live on this rank
  (``S(0)`` on the vocabulary dim); ids outside that range read row 0 and are zeroed, so the
  output is ``P(sum)`` over the vocabulary axes (Megatron's vocabulary-parallel embedding).
* :class:`ShardedDropout`: dropout whose mask is drawn from a generator keyed by the step, the
  node and this rank's shard coordinates (:mod:`fxpar.runtime.rng`): replicas of one shard
  draw the same mask, different shards independent ones.

>>> import torch
>>> w = torch.arange(6.).reshape(3, 2)            # rows 3..5 of a 6-row table
>>> vocab_parallel_embedding(w, torch.tensor([0, 4]), 3)
tensor([[0., 0.],
        [2., 3.]])
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["vocab_parallel_embedding", "ShardedDropout"]


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


class ShardedDropout(nn.Module):
    """``aten.dropout(x, p, train)`` with a mask keyed by ``(step, site, shard_key)``; the
    runner sets ``tracker`` (:class:`fxpar.runtime.rng.RNGTracker`)."""

    def __init__(self, site: int, shard_key: tuple[int, ...]) -> None:
        super().__init__()
        self.site, self.shard_key, self.tracker = site, tuple(shard_key), None

    def extra_repr(self) -> str:
        return f"site={self.site}, shard_key={self.shard_key}"

    def forward(self, x: torch.Tensor, p: float, train: bool) -> torch.Tensor:
        if x.device.type == "meta" or not train or p == 0:
            return x.clone() if x.device.type == "meta" else x
        from fxpar.runtime.rng import dropout

        if self.tracker is None:
            raise RuntimeError(f"ShardedDropout site {self.site}: no RNG tracker attached "
                               "(run the graph through fxpar's runner)")
        return dropout(x, p, train, site=self.site, shard_key=self.shard_key, tracker=self.tracker)
