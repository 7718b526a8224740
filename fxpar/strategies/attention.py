"""Scaled dot-product attention and its ``_scaled_dot_product_*_attention`` variants.

``q[B, H, L, E], k[B, Hk, S, E], v[B, Hk, S, Ev] -> out[B, H, L, Ev]``; an ``attn_mask``
broadcast to ``[B, H, L, S]`` follows (sharded where its dim is not a broadcast 1).

* ``dp``: B sharded in all;  ``heads``: H and Hk sharded (even splits when Hk != H, so each
  device's query heads keep their own key/value group);
* ``seq``: L of q (and mask) sharded, k/v replicated (all-gathered over the axis: context
  parallelism as Llama 3 runs it); with ``is_causal`` the local op becomes
  ``fxpar::balanced_causal_sdpa`` (even shards over one axis, no mask or dropout: each rank
  computes half its rows and half its partner's, every rank the same work,
  :mod:`fxpar.runtime.context_parallel`, the swaps priced by :func:`attention_comm`), else
  ``fxpar::offset_causal_sdpa`` at the shard's first global row (``is_causal`` alone would
  align the mask to the local rows); the fused variants with ``is_causal`` have no ``seq``;
* ``ring`` (:func:`fxpar.strategies.attention.sdpa_rule`: plain SDPA, self-attention, no mask or
  dropout): q, k and v all split along the sequence, even blocks; the local op
  ``fxpar::ring_sdpa`` passes the K/V blocks round the axes, merged by log-sum-exp (ring
  attention, :mod:`fxpar.runtime.context_parallel`; :func:`_ring_time` prices the other blocks,
  each overlapped with the next shift); no gathered K/V is held;
* never E (the head dim is contracted) or S (the softmax runs over it), except in ``ring``,
  whose local op sees every key block in turn.

Extra outputs of the variants (logsumexp ``[B, H, L]``) shard like the output on B, H, L; scalar
RNG seeds/offsets stay replicated. Training attention with dropout (``dropout_p > 0``) becomes
math attention with a shard-keyed dropout on its probabilities (:func:`attention_local`); the
fused variants with dropout are refused at plan time (:func:`fxpar.strategies.rand.check_random`). ``sdpa(q, k, v, is_causal=True)`` on one axis::

    R: R, R, R -> R      dp: S(0), S(0), S(0) -> S(0)      heads: S(1), S(1), S(1) -> S(1)
"""

from __future__ import annotations

import math

import numpy as np
import torch

import torch.fx as fx

from fxpar import ir
from fxpar.cost.compute import sdpa_cost
from fxpar.strategies.base import R, S, bound, choice, declare, out_shapes, register, tensor_shape
from fxpar.strategies.local import LocalContext, refuse_random

aten = torch.ops.aten

_VARIANTS = [aten.scaled_dot_product_attention]
for _n in ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
           "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
           "_scaled_dot_product_attention_math"):
    if hasattr(aten, _n):
        _VARIANTS.append(getattr(aten, _n))


def _mask_pl(mask, dim):
    """Placement of a [B,H,L,S]-broadcast mask when dim ``dim`` of the 4-d product is sharded."""
    if mask is None:
        return None
    i = dim - (4 - len(mask))
    return S(i) if i >= 0 and mask[i] > 1 else R


def _causal_rows(node: fx.Node, lctx: LocalContext) -> int | None:
    """The global index of this rank's first query row when a causal attention's queries
    are split along the sequence (``None`` when they are not)."""
    b = bound(node)
    if not b.get("is_causal"):
        return None
    q = b["query"]
    spec = node.meta[ir.IN_SPECS][node.all_input_nodes.index(q)]
    if not spec.shard_axes(2):
        return None
    return spec.global_slices(lctx.global_shape(q), lctx.mesh_shape, lctx.coord)[2].start


def _balanceable(node: fx.Node, qspec, length: int, mesh_shape) -> tuple[int, int] | None:
    """``(axis, c)`` when a causal attention whose queries are laid out ``qspec`` can share
    its work evenly (:mod:`fxpar.runtime.context_parallel`): the sequence (``length`` rows)
    split over one mesh axis of ``c`` devices into equal shards of an even length, no mask,
    no dropout; else ``None`` (each rank's rows against all keys, the mask at their global
    rows: ``fxpar::offset_causal_sdpa``)."""
    b = bound(node)
    if not b.get("is_causal") or b.get("attn_mask") is not None or (b.get("dropout_p") or 0.0):
        return None
    axes = qspec.shard_axes(2) if qspec is not None else ()
    if len(axes) != 1:
        return None
    c = mesh_shape[axes[0]]
    return (axes[0], c) if c > 1 and length % (2 * c) == 0 else None


def _balanced(node: fx.Node, lctx: LocalContext) -> tuple[int, int] | None:
    q = bound(node)["query"]
    return _balanceable(node, node.meta[ir.IN_SPECS][node.all_input_nodes.index(q)],
                        lctx.global_shape(q)[2], lctx.mesh_shape)


def attention_comm(node: fx.Node, strat, mesh) -> tuple[float, float]:
    """``(t_fwd, t_bwd)`` of the swaps a load-balanced causal attention adds
    (:func:`_balanceable`; :mod:`fxpar.runtime.context_parallel`): half the local queries to
    the partner and its outputs back, forward; their gradients, backward; all pairs ``(r,
    c−1−r)`` of the axis at once (:func:`fxpar.cost.comm.pairs_time`). ``(0, 0)`` otherwise.
    The attention itself is priced on its local shapes against all keys, as every causal
    attention is (the causal mask does not halve the price: :mod:`fxpar.cost.compute`), so
    the balanced op's half-sized work and the unbalanced op's masked full work price alike."""
    if node.target is not aten.scaled_dot_product_attention.default:
        return 0.0, 0.0
    from fxpar.cost.comm import pairs_time
    from fxpar.cost.reshard import max_local_shape

    b = bound(node)
    q, v = b["query"], b["value"]
    qspec = strat.inputs[node.all_input_nodes.index(q)]
    kspec = strat.inputs[node.all_input_nodes.index(b["key"])]
    qv, vv = q.meta[ir.VAL], v.meta[ir.VAL]
    ring = _ring_of(qspec, kspec)
    if ring:
        return _ring_time(node, strat, mesh, ring)
    got = _balanceable(node, qspec, int(qv.shape[2]), mesh.shape)
    if got is None or (kspec is not None and kspec.placements[got[0]] == S(2)):
        return 0.0, 0.0   # not balanced, or K/V not gathered
    axis, c = got
    local = max_local_shape(qspec, tuple(qv.shape), mesh.shape)
    half_q = math.prod(local) // 2 * qv.dtype.itemsize
    half_o = half_q // int(qv.shape[-1]) * int(vv.shape[-1])
    g = mesh.groups(axis)[0]
    pairs = [(g[r], g[c - 1 - r]) for r in range(c) if r != c - 1 - r]
    if not pairs:
        return 0.0, 0.0
    t = pairs_time(half_q, pairs, mesh.cluster) + pairs_time(half_o, pairs, mesh.cluster)
    return t, t


def _ring_axes(node: fx.Node) -> tuple[int, ...]:
    """The mesh axes of the ``ring`` strategy (queries, keys and values all split along the
    sequence over them), ``()`` for any other."""
    b = bound(node)
    specs = node.meta.get(ir.IN_SPECS)
    if specs is None or not isinstance(b.get("query"), fx.Node) or not isinstance(b.get("key"), fx.Node):
        return ()
    return _ring_of(*(specs[node.all_input_nodes.index(b[x])] for x in ("query", "key")))


def _ring_of(q, k) -> tuple[int, ...]:
    axes = q.shard_axes(2) if q is not None else ()
    return axes if axes and k is not None and k.shard_axes(2) == axes else ()


def attention_local(node: fx.Node, lctx: LocalContext) -> None:
    """Attention is tagged ``nondeterministic_seeded`` for its dropout: without dropout
    (``dropout_p == 0``) the plain op is right. With it, ``aten.scaled_dot_product_attention``
    becomes ``torch.ops.fxpar.keyed_sdpa`` (:mod:`fxpar.runtime.keyed`): math attention whose
    probabilities ``[B, H, L, S]`` go through ``fxpar.sharded_dropout`` keyed by the node's site and
    this rank's coordinates on the axes sharding B, H or L (the scores' own sharded dims: S is
    never split), so replicas draw one mask, shards independent ones, and backward the same mask
    again. The fused variants (``_scaled_dot_product_flash_attention``...) with dropout are
    refused (planning refused them already)."""
    b = bound(node)
    ring = _ring_axes(node)
    if ring:   # keys and values split along the sequence too: they go round the axes
        import fxpar.runtime.ops  # noqa: F401  (registers torch.ops.fxpar)

        node.target = torch.ops.fxpar.ring_sdpa.default
        node.args = (b["query"], b["key"], b["value"], list(ring), bool(b.get("is_causal", False)),
                     b.get("scale"), bool(b.get("enable_gqa", False)))
        node.kwargs = {}
        return
    offset = _causal_rows(node, lctx) if node.target is aten.scaled_dot_product_attention.default else None
    if not (b.get("dropout_p") or 0.0) and offset is None:
        return
    if node.target is not aten.scaled_dot_product_attention.default:
        refuse_random(node, lctx)
        return
    from fxpar.strategies.rand import random_key

    import fxpar.runtime.ops  # noqa: F401  (registers torch.ops.fxpar: only when localizing)

    bal = _balanced(node, lctx) if offset is not None else None
    if bal is not None:   # causal rows of a sequence shard, their work shared with a partner
        axis, c = bal
        me = lctx.coord[axis]
        node.target = torch.ops.fxpar.balanced_causal_sdpa.default
        node.args = (b["query"], b["key"], b["value"], offset, axis, me, c - 1 - me, b.get("scale"),
                     bool(b.get("enable_gqa", False)))
        node.kwargs = {}
        return
    if offset is not None:   # causal rows of a sequence shard: the mask at their global rows
        node.target = torch.ops.fxpar.offset_causal_sdpa.default
        node.args = (b["query"], b["key"], b["value"], b.get("attn_mask"), offset, float(b.get("dropout_p") or 0.0),
                     b.get("scale"), bool(b.get("enable_gqa", False)), int(lctx.site),
                     random_key(node, lctx, dims=(0, 1, 2)))
        node.kwargs = {}
        return

    node.target = torch.ops.fxpar.keyed_sdpa.default
    node.args = (b["query"], b["key"], b["value"], b.get("attn_mask"), float(b["dropout_p"]),
                 bool(b.get("is_causal", False)), b.get("scale"), bool(b.get("enable_gqa", False)),
                 int(lctx.site), random_key(node, lctx, dims=(0, 1, 2)))
    node.kwargs = {}


def _ring_time(node: fx.Node, strat, mesh, axes) -> tuple[float, float]:
    """Ring attention beyond its local op's price (one block: the local queries against the
    local keys): the other ``C − 1`` blocks, each overlapped with the shift of the next
    (``max(block, shift)``: the K/V block forward; K, V and their fp32 gradients backward, then
    the gradients' last move home). Every rank is priced for all ``C`` blocks, as causal
    attention is priced in full (:mod:`fxpar.cost.compute`)."""
    from fxpar.cost.comm import pairs_time
    from fxpar.cost.compute import TensorArg, op_cost, op_time
    from fxpar.cost.reshard import max_local_shape

    b = bound(node)
    args = []
    for x in ("query", "key", "value"):
        v = b[x].meta[ir.VAL]
        spec = strat.inputs[node.all_input_nodes.index(b[x])]
        args.append(TensorArg(max_local_shape(spec, tuple(v.shape), mesh.shape), v.dtype, True))
    out = TensorArg(args[0].shape[:-1] + args[2].shape[-1:], args[0].dtype)
    tf, tb = op_time(op_cost(node.target, tuple(args), {}, out), mesh.cluster)
    kv = sum(math.prod(a.shape) for a in args[1:]) * args[1].dtype.itemsize
    grads = sum(math.prod(a.shape) for a in args[1:]) * 4
    C = math.prod(mesh.shape[a] for a in axes)
    devs = np.asarray(mesh.devices).reshape(mesh.shape)
    idx = [slice(None) if a in axes else 0 for a in range(len(mesh.shape))]
    ring = [int(d) for d in devs[tuple(idx)].reshape(-1)]   # block order: axes nested in order
    pairs = [(ring[i], ring[(i + 1) % C]) for i in range(C)]
    fwd = (C - 1) * max(tf, pairs_time(kv, pairs, mesh.cluster))
    bwd = (C - 1) * max(tb, pairs_time(kv + grads, pairs, mesh.cluster)) + pairs_time(grads, pairs, mesh.cluster)
    return fwd, bwd


@register(*_VARIANTS, cost=sdpa_cost, saves="qkvo", local=attention_local, comm=attention_comm)
def sdpa_rule(node):
    b = bound(node)
    q, k = tensor_shape(b["query"]), tensor_shape(b["key"])
    if len(q) != 4 or len(k) != 4:
        return  # unbatched / extra batch dims: replicate only
    mkey = "attn_mask" if "attn_mask" in b else "attn_bias" if "attn_bias" in b else None
    mask = tensor_shape(b[mkey]) if mkey and b.get(mkey) is not None else None
    outs = out_shapes(node)

    def outs_for(d):
        return [S(d) if len(o) >= 3 and o[d] == q[d] else R for o in outs]

    def pls(pq, pkv, d):
        p = {"query": pq, "key": pkv, "value": pkv}
        if mask is not None:
            p[mkey] = _mask_pl(mask, d)
        return p

    yield choice(node, pls(S(0), S(0), 0), outs_for(0), "dp")
    yield choice(node, pls(S(1), S(1), 1), outs_for(1), "heads", even=q[1] != k[1])
    if node.target.overloadpacket is aten.scaled_dot_product_attention or not b.get("is_causal", False):
        # causal: the local rewrite masks at the shard's global rows (fused variants have none)
        yield choice(node, pls(S(2), R, 2), outs_for(2), "seq")
    if (node.target is aten.scaled_dot_product_attention.default and mask is None
            and not (b.get("dropout_p") or 0.0) and q[2] == k[2]):
        # ring attention: K/V stay split and go round (even blocks: the diagonal is square)
        yield choice(node, pls(S(2), S(2), 2), outs_for(2), "ring", even=True)


# Fused-attention kernels without a sharding rule, priced like SDPA.
declare(*[getattr(aten, n) for n in ("_scaled_dot_product_fused_attention_overrideable",) if hasattr(aten, n)],
        cost=sdpa_cost, saves="qkvo", local=attention_local)
declare(*[getattr(aten, n) for n in ("_flash_attention_forward", "_efficient_attention_forward")
          if hasattr(aten, n)], cost=sdpa_cost, local=attention_local)
