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

**Ring attention** (Liu et al.; ``torch.ops.fxpar.ring_sdpa(q, k, v, axes, is_causal, scale,
enable_gqa)``): queries, keys and values all split along the sequence over the mesh ``axes``
(``C`` blocks, nested left to right as a dim split over them); no rank ever holds more than
two key/value blocks. Forward, ``C`` steps: attend the block held (block ``j = me − t``, skipped
when causal and ``j > me``; the diagonal block causal), merge with the running output by
log-sum-exp (``lse = log(e^lse + e^lse_j)``, ``o = o·e^(lse_old−lse) + o_j·e^(lse_j−lse)``)
while the block moves on to the next rank (send to ``me + 1``, receive from ``me − 1``,
overlapped). Backward, ``C`` steps again with ``D = rowsum(dO ∘ O)`` and ``P = e^(S − lse)``:
``dV_j += Pᵀ·dO``, ``dS = P ∘ (dO·V_jᵀ − D)``, ``dQ += dS·K_j·scale``, ``dK_j += dSᵀ·Q·scale``,
each block travelling with its ``dK_j, dV_j`` until it is home. Saved: the local ``q, k, v``,
the output and ``lse`` (the K/V all-gather's saved copy is what the ring avoids).

>>> [(p.row0, p.rows, p.keys) for p in balanced_pieces(16, 4, 0)]   # rank 0 of 4 on 16 rows
[(0, 2, 2), (14, 2, 16)]
>>> {sum(p.rows * p.keys for p in balanced_pieces(16, 4, r)) for r in range(4)}
{36}
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from fxpar.runtime.bindings import current
from fxpar.runtime.keyed import _composite, _offset_causal
from fxpar.runtime.library import define

__all__ = ["Piece", "balanced_pieces", "CP_SWAP", "BALANCED_CAUSAL_SDPA", "RING_SDPA", "ring_step"]


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


def _exchange(ts, dst: int, src: int, group=None):
    """Send ``ts`` to global rank ``dst`` and receive as many tensors of their shapes from
    ``src``, all at once: the started requests and the receive buffers (wait on the former
    before reading the latter)."""
    import torch.distributed as dist

    bufs = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in ts]
    ops = [dist.P2POp(dist.isend, t.contiguous(), dst, group) for t in ts] + \
          [dist.P2POp(dist.irecv, b, src, group) for b in bufs]
    return dist.batch_isend_irecv(ops), bufs


def _swap(x: torch.Tensor, axis: int, me: int, peer: int) -> torch.Tensor:
    if peer == me:
        return x.clone()
    import torch.distributed as dist

    group = current().device_mesh.get_group(axis)
    dst = dist.get_process_group_ranks(group)[peer]
    reqs, (out,) = _exchange((x,), dst, dst, group)
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


# --- ring attention -------------------------------------------------------------------------


def _ring(axes) -> tuple[list[int], int]:
    """Global ranks of this rank's ring over mesh ``axes`` in block order (the axes nest left
    to right, as a dim split over them) and this rank's place in it."""
    dm = current().device_mesh
    coord = list(dm.get_coordinate())
    sizes = [dm.size(a) for a in axes]
    ranks = []
    for b in range(math.prod(sizes)):
        c, rest = list(coord), b
        for a, k in reversed(list(zip(axes, sizes))):
            c[a], rest = rest % k, rest // k
        ranks.append(int(dm.mesh[tuple(c)]))
    return ranks, ranks.index(int(dm.mesh[tuple(coord)]))


def _shift(ts, ranks: list[int], me: int):
    """Send ``ts`` to the next rank of the ring, receive the previous rank's
    (:func:`_exchange`)."""
    n = len(ranks)
    return _exchange(ts, ranks[(me + 1) % n], ranks[(me - 1) % n])


def _heads(t: torch.Tensor, h: int) -> torch.Tensor:
    return t if t.size(-3) == h else t.repeat_interleave(h // t.size(-3), -3)


def _fold_heads(g: torch.Tensor, hk: int) -> torch.Tensor:
    """A gradient over the query heads summed back onto ``hk`` key/value heads (GQA)."""
    if g.size(-3) == hk:
        return g
    *b, h, n, e = g.shape
    return g.reshape(*b, hk, h // hk, n, e).sum(-3)


def _acc(t: torch.Tensor) -> torch.dtype:
    """The accumulation dtype for ``t``: fp32, or ``t``'s own when wider (fp64)."""
    return torch.promote_types(t.dtype, torch.float32)


def _scores(q, k, scale, diag: bool) -> torch.Tensor:
    s = (q @ k.transpose(-2, -1)).to(_acc(q)) * scale
    if diag:   # the block on the diagonal: rows and keys start at the same position
        keep = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~keep, float("-inf"))
    return s


def ring_step(q, k, v, out, lse, scale: float, diag: bool):
    """One forward step of ring attention: ``q`` against the key block ``k, v``, merged into
    the running ``out`` and ``lse`` (fp32, or fp64 for fp64 inputs) by log-sum-exp; returns
    the new ``(out, lse)``.

    >>> import torch
    >>> q, k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 8, 8), torch.randn(1, 2, 8, 8)
    >>> o = torch.zeros(1, 2, 4, 8); l = torch.full((1, 2, 4), float("-inf"))
    >>> for j in range(2):   # two blocks of 4 keys, merged
    ...     o, l = ring_step(q, k[..., 4*j:4*j+4, :], v[..., 4*j:4*j+4, :], o, l, 8 ** -0.5, False)
    >>> torch.allclose(o, torch.nn.functional.scaled_dot_product_attention(q, k, v), atol=1e-6)
    True
    """
    s = _scores(q, _heads(k, q.size(-3)), scale, diag)
    l_j = torch.logsumexp(s, -1)
    o_j = torch.exp(s - l_j[..., None]).to(v.dtype) @ _heads(v, q.size(-3))
    new = torch.logaddexp(lse, l_j)
    return out * torch.exp(lse - new)[..., None] + o_j.to(out.dtype) * torch.exp(l_j - new)[..., None], new


def _ring_fwd(q, k, v, axes, causal, scale, gqa):
    ranks, me = _ring(axes)
    n = len(ranks)
    scale = scale if scale is not None else q.size(-1) ** -0.5
    out = q.new_zeros(q.shape[:-1] + (v.size(-1),), dtype=_acc(q))
    lse = q.new_full(q.shape[:-1], float("-inf"), dtype=_acc(q))
    kb, vb = k, v
    for t in range(n):
        j = (me - t) % n
        moving = _shift((kb, vb), ranks, me) if t < n - 1 else None
        if not causal or j <= me:
            out, lse = ring_step(q, kb, vb, out, lse, scale, causal and j == me)
        if moving is not None:
            for w in moving[0]:
                w.wait()
            kb, vb = moving[1]
    out = out.to(q.dtype)
    return _heads_last(out).copy_(out), lse


def _heads_last(t: torch.Tensor) -> torch.Tensor:
    """An empty tensor shaped like ``t`` (``[..., H, L, E]``) stored as ``[..., L, H, E]``, as
    the fused attention kernels return their output: a model's ``transpose(1, 2).reshape(...)``
    after attention is then a view, so the out-projection keeps the attention's output rather
    than a copy of it beside it.

    >>> t = _heads_last(torch.randn(2, 4, 8, 16))
    >>> t.shape, t.transpose(1, 2).is_contiguous()
    (torch.Size([2, 4, 8, 16]), True)
    """
    if t.dim() < 3:
        return torch.empty_like(t)
    return torch.empty_like(t.transpose(-3, -2), memory_format=torch.contiguous_format).transpose(-3, -2)


def _ring_bwd(dout, q, k, v, out, lse, axes, causal, scale, gqa):
    ranks, me = _ring(axes)
    n = len(ranks)
    scale = scale if scale is not None else q.size(-1) ** -0.5
    h, hk = q.size(-3), k.size(-3)
    acc = _acc(q)
    D = (dout.to(acc) * out.to(acc)).sum(-1)
    dq = torch.zeros_like(q, dtype=acc)
    kb, vb = k, v
    dk, dv = torch.zeros_like(k, dtype=acc), torch.zeros_like(v, dtype=acc)
    for t in range(n):
        j = (me - t) % n
        if not causal or j <= me:
            K, V = _heads(kb, h), _heads(vb, h)
            P = torch.exp(_scores(q, K, scale, causal and j == me) - lse[..., None])
            dv = dv + _fold_heads(P.transpose(-2, -1) @ dout.to(acc), hk)
            dS = P * ((dout @ V.transpose(-2, -1)).to(acc) - D[..., None])
            dq = dq + (dS @ K.to(acc)) * scale
            dk = dk + _fold_heads((dS.transpose(-2, -1) @ q.to(acc)) * scale, hk)
        if n == 1:
            break
        # the block moves on with its gradients; after n moves each is home
        reqs, got = _shift((kb, vb, dk, dv) if t < n - 1 else (dk, dv), ranks, me)
        for w in reqs:
            w.wait()
        if t < n - 1:
            kb, vb, dk, dv = got
        else:
            dk, dv = got
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _fake_fwd(q, k, v, axes, causal, scale, gqa):
    out = _heads_last(q.new_empty(q.shape[:-1] + (v.size(-1),)))
    return out, q.new_empty(q.shape[:-1], dtype=_acc(q))


RING_FWD = define("fxpar::ring_sdpa_fwd(Tensor q, Tensor k, Tensor v, int[] axes, bool is_causal, "
                  "float? scale, bool enable_gqa) -> (Tensor, Tensor)", _ring_fwd, fake=_fake_fwd,
                  differentiable=False)
RING_BWD = define("fxpar::ring_sdpa_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, "
                  "Tensor lse, int[] axes, bool is_causal, float? scale, bool enable_gqa) "
                  "-> (Tensor, Tensor, Tensor)", _ring_bwd,
                  fake=lambda dout, q, k, v, *a: (torch.empty_like(q), torch.empty_like(k),
                                                  torch.empty_like(v)),
                  differentiable=False)


class _Ring(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, axes, causal, scale, gqa):
        out, lse = RING_FWD(q, k, v, axes, causal, scale, gqa)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cfg = (axes, causal, scale, gqa)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        return (*RING_BWD(dout.contiguous(), q, k, v, out, lse, *ctx.cfg), None, None, None, None)


#: ``ring_sdpa(q, k, v, axes, is_causal, scale, enable_gqa)`` (module docstring)
RING_SDPA = _composite(
    "ring_sdpa(Tensor query, Tensor key, Tensor value, int[] axes, bool is_causal, float? scale, "
    "bool enable_gqa) -> Tensor",
    lambda q, k, v, axes, causal, scale, gqa: _Ring.apply(q, k, v, list(axes), causal, scale, gqa))
