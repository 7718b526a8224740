"""Load-balanced causal attention over a context-parallel axis (issue #27).

With the queries split along the sequence into ``c`` contiguous shards and the keys/values
gathered, rank ``r`` (rows ``[r·L/c, (r+1)·L/c)``) attends to ``(r+1)/c`` of the keys: the
last rank does ``2c−1`` times the first's work, and everyone waits for it. Megatron and
Llama 3 reorder the sequence so rank ``r`` holds chunks ``r`` and ``2c−1−r`` of ``2c``; here
the sequence stays where it is and only the work moves: each rank splits its rows into halves
``A`` and ``B`` and computes its own ``A`` and its partner's ``B`` (partner ``c−1−r``), each
against the key prefix it can see (a causal row never reads a later key), then the partner's
output goes back. Rank ``r``'s work is ``h·(2rh + h) + h·2(c−r)h = (2c+1)·h²`` (``h = L/2c``):
the same on every rank (:func:`balanced_pieces`). What moves: half the local queries and half
the local output, each way once forward and once backward (their gradients), between pairs.

* ``torch.ops.fxpar.cp_swap(x, axis, me, peer)``: ``x`` sent to position ``peer`` of this
  rank's group on mesh ``axis`` and the peer's ``x`` returned (identity when ``peer == me``);
  its backward is the same swap of the gradient (a swap is its own adjoint).
* ``torch.ops.fxpar.balanced_causal_sdpa(q, k, v, offset, axis, me, peer, scale, enable_gqa)``:
  causal attention of the query rows ``[offset, offset + L)`` against all keys, the work
  shared with the peer as above (both must call it: it communicates); composite, so autograd
  differentiates through the swaps and the two attentions.

>>> [(p.row0, p.rows, p.keys) for p in balanced_pieces(16, 4, 0)]   # rank 0 of 4 on 16 rows
[(0, 2, 2), (14, 2, 16)]
>>> {sum(p.rows * p.keys for p in balanced_pieces(16, 4, r)) for r in range(4)}
{36}
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from fxpar.runtime.bindings import current
from fxpar.runtime.keyed import _composite, _offset_causal
from fxpar.runtime.library import define

__all__ = ["Piece", "balanced_pieces", "CP_SWAP", "BALANCED_CAUSAL_SDPA"]


class Piece(NamedTuple):
    """One attention a rank computes: query rows ``[row0, row0 + rows)`` of the global
    sequence against keys ``[0, keys)`` (``keys = row0 + rows``: the causal prefix)."""

    row0: int
    rows: int
    keys: int


def balanced_pieces(length: int, c: int, r: int) -> list[Piece]:
    """The two pieces rank ``r`` of ``c`` computes for a causal sequence of ``length`` rows
    (``length`` divisible by ``2c``): its own first half-shard and its partner ``c−1−r``'s
    second (module docstring). Over all ranks the pieces cover every row once."""
    s, h = length // c, length // (2 * c)
    p = c - 1 - r
    return [Piece(r * s, h, r * s + h), Piece(p * s + h, h, (p + 1) * s)]


def _swap(x: torch.Tensor, axis: int, me: int, peer: int) -> torch.Tensor:
    if peer == me:
        return x.clone()
    import torch.distributed as dist

    group = current().device_mesh.get_group(axis)
    dst = dist.get_process_group_ranks(group)[peer]
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, x.contiguous(), dst, group),
                                   dist.P2POp(dist.irecv, out, dst, group)])
    for q in reqs:
        q.wait()
    return out


CP_SWAP = define("fxpar::cp_swap(Tensor x, int axis, int me, int peer) -> Tensor", _swap,
                 fake=lambda x, axis, me, peer: torch.empty_like(x),
                 backward=lambda args, g: (CP_SWAP(g, *args[1:]), None, None, None))


def _balanced(query, key, value, offset, axis, me, peer, scale, enable_gqa):
    L = query.size(-2)
    h = L // 2

    def prefix(q, row0):   # causal rows [row0, row0 + rows) read keys [0, row0 + rows) only
        end = row0 + q.size(-2)
        return _offset_causal(q, key[..., :end, :], value[..., :end, :], None, row0, 0.0, scale,
                              enable_gqa, 0, [])

    own = prefix(query[..., :h, :], offset)
    theirs = CP_SWAP(query[..., h:, :], axis, me, peer)   # the peer's second half-shard
    # the peer's rows start at its offset: c·... = offset + (peer − me)·L, then half a shard
    got = CP_SWAP(prefix(theirs, offset + (peer - me) * L + h), axis, me, peer)
    return torch.cat([own, got], dim=-2)


#: ``balanced_causal_sdpa(q, k, v, offset, axis, me, peer, scale, enable_gqa)`` (module docstring)
BALANCED_CAUSAL_SDPA = _composite(
    "balanced_causal_sdpa(Tensor query, Tensor key, Tensor value, int offset, int axis, int me, "
    "int peer, float? scale, bool enable_gqa) -> Tensor", _balanced)
