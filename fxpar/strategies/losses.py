"""Losses: cross_entropy_loss, nll_loss, nll_loss_forward (class-index targets).

``input[N, C, d1..]`` (or ``[C]``), ``target[N, d1..]``. Sharding N (or a spatial dim d_i) in
input and target:

* ``reduction="none"`` -> output sharded on that dim;
* ``"sum"`` -> ``P(sum)``;
* ``"mean"`` -> ``P(sum)`` with the target (and class weights) replicated: the mean divides
  by the weight of the non-ignored targets (their count without class weights), which a shard
  of the target cannot know (an average of local means is wrong when shards hold different
  numbers of ``ignore_index`` targets, and NaN for a shard that holds only those), so the
  local program (:func:`sharded_mean_local`) computes the loss summed over its own slice of
  input and target divided by that weight over the WHOLE target: the addends sum to the mean,
  exactly, for any split. ``nll_loss_forward``'s ``total_weight`` is then that global weight
  (replicated).

**Vocabulary-parallel cross-entropy** (``vocab``, Megatron's): ``cross_entropy_loss`` without
class weights may take its input split along the class dim C (``S(1)``) with the target whole
on that axis; the loss comes out replicated there (``R``, for every reduction). Not the ATen op
on local shapes: the local rewrite (:func:`vocab_local`) calls
``torch.ops.fxpar.vocab_parallel_cross_entropy`` (:mod:`fxpar.runtime.vocab`: each shard's
``logsumexp`` and the target logit from the shard holding it, one all-gather over the axes
splitting C; exact local backward) with this rank's first class; with the rows also split
(``dp``) and ``reduction="mean"`` it sums its rows and divides by the non-ignored count of the
whole target, as above. The planner adds that all-gather to the node's time
(:func:`vocab_comm`, :func:`fxpar.cost.losses.vocab_ce_time`): ``2·rows`` numbers per device
(``3·rows`` with label smoothing) per axis, against an all-gather of the logits before a
replicated loss. ``cross_entropy_loss(x[64, 96], t[64])`` on one axis::

    R: R, R -> R    dp: S(0), R -> P(sum)    vocab: S(1), R -> R

and ``nll_loss_nd(x[64, 96], t[64])``: ``vocab: S(1), R -> P(sum)``.

The **nll losses** (``nll_loss``, ``nll_loss_forward``, ``nll_loss_nd``, 2d) may take their
input (log-probabilities) split along C too, target and class weights whole there: each rank
adds ``−w[t]·x[t]`` of the targets it holds, so the loss is ``P(sum)`` (``total_weight`` ``R``)
with no communication inside (:func:`fxpar.runtime.vocab.vocab_parallel_nll`). With
``log_softmax`` over a split dim (:mod:`.reductions`'s ``vocab``: Megatron's vocabulary-parallel
softmax, :data:`fxpar.runtime.vocab.VOCAB_PARALLEL_LOG_SOFTMAX`, one all-gather of one
number per row forward, one all-reduce backward) ``nll_loss(log_softmax(x))`` runs without gathering
``x`` either. Other losses have no sharding rule (replicated); all are priced like a softmax.
"""

from __future__ import annotations

import math

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.distributed.tensor import Shard

from fxpar import ir
from fxpar.cost.compute import softmax_cost
from fxpar.cost.losses import vocab_ce_time, vocab_log_softmax_time
from fxpar.cost.reshard import max_local_shape
from fxpar.errors import PlanError
from fxpar.strategies.base import P, R, S, bound, choice, declare, out_shapes, register, tensor_shape
from fxpar.strategies.local import LocalContext

aten = torch.ops.aten
_RED = {0: "none", 1: "mean", 2: "sum"}
#: the class-index losses of :func:`loss_rule` (same leading arguments: self, target, weight,
#: reduction, ignore_index)
_LOSSES = (aten.cross_entropy_loss, aten.nll_loss, aten.nll_loss_forward, aten.nll_loss2d_forward,
           aten.nll_loss_nd, aten.nll_loss2d)


def sharded_mean_loss(x: torch.Tensor, target: torch.Tensor, bounds: list, weight, ignore_index: int,
                      op: str, overload: str, *extra):
    """This rank's addend of a ``reduction="mean"`` class-index loss whose input ``x`` is this
    rank's slice ``bounds`` (``[start, stop]`` per target dim) of the global input and whose
    ``target`` is the WHOLE target: the loss summed over the slice, divided by the weight of
    every non-ignored target (``aten.<op>.<overload>`` with ``reduction="sum"``; ``extra``: its
    arguments after ``ignore_index``, e.g. ``label_smoothing``). Two-output ops
    (``nll_loss_forward``) also return that weight (``total_weight``)."""
    fn = getattr(getattr(torch.ops.aten, op), overload)
    local_t = target[tuple(slice(lo, hi) for lo, hi in bounds)]
    out = fn(x, local_t, weight, 2, ignore_index, *extra)
    keep = target != ignore_index
    if weight is None:
        denom = keep.sum().to(x.dtype)
    else:
        denom = (weight[torch.where(keep, target, 0)] * keep).sum()
    if isinstance(out, (tuple, list)):
        return out[0] / denom, denom
    return out / denom


def sharded_mean_call(node: fx.Node, in_specs, global_shape, mesh_shape, coord):
    """``(target, args)`` of this rank's call of a mean loss ``node`` whose input is sharded and
    target replicated (:func:`sharded_mean_loss`), or ``None`` when the plain op is right
    (another reduction, or the input whole). ``global_shape(n)``: a node's global shape."""
    if getattr(node.target, "overloadpacket", None) not in _LOSSES:
        return None
    b = bound(node)
    if _RED.get(b.get("reduction", 1), "mean") != "mean":
        return None
    x = b["self"]
    xspec = in_specs[node.all_input_nodes.index(x)]
    if xspec is None or not any(isinstance(p, Shard) for p in xspec):
        return None
    sl = xspec.global_slices(global_shape(x), mesh_shape, coord)
    bounds = [[s.start, s.stop] for s in (sl[0], *sl[2:])]  # target dims: N, d1, ...
    extra = (b["label_smoothing"],) if "label_smoothing" in b else ()
    op = node.target
    args = (x, b["target"], bounds, b.get("weight"), b.get("ignore_index", -100),
            op._schema.name.split("::")[-1], op._overloadname, *extra)
    return sharded_mean_loss, args


def sharded_mean_local(node: fx.Node, lctx: LocalContext) -> None:
    """Localize a mean loss planned with its input sharded (see the module docstring)."""
    got = sharded_mean_call(node, node.meta[ir.IN_SPECS], lctx.global_shape, lctx.mesh_shape,
                            lctx.coord)
    if got is not None:
        node.target, node.args = got
        node.kwargs = {}


def class_axes(xspec) -> list[int]:
    """The mesh axes splitting the class dim (dim 1) of a loss input of spec ``xspec``.

    >>> from fxpar.spec import Spec
    >>> class_axes(Spec.parse("S(0)S(1)")), class_axes(Spec.parse("S(0)R"))
    ([1], [])
    """
    return _split_axes(xspec, 1)


def _packet(node: fx.Node):
    return getattr(node.target, "overloadpacket", None)


def _is_ce(node: fx.Node) -> bool:
    return _packet(node) is aten.cross_entropy_loss


#: log_softmax ops whose split dim has a vocabulary-parallel form (:mod:`.reductions`)
LOG_SOFTMAX = (aten.log_softmax, aten._log_softmax)


def _split_axes(spec, dim: int) -> list[int]:
    return [a for a, p in enumerate(spec or ()) if isinstance(p, Shard) and p.dim == dim]


def vocab_call(node: fx.Node, in_specs, global_shape, mesh_shape, coord):
    """``(target, args)`` of this rank's call of a ``cross_entropy_loss``, an nll loss or a
    ``log_softmax`` planned with its class (softmax) dim split (module docstring), or ``None``
    when it is not (``global_shape(n)``: a node's global shape). Raises :class:`PlanError`
    for a cross-entropy with class weights (the strategy never offers it: a hand-made plan)."""
    packet = _packet(node)
    if packet not in _LOSSES and packet not in LOG_SOFTMAX:
        return None
    b = bound(node)
    x = b["self"]
    xspec = in_specs[node.all_input_nodes.index(x)]
    shape = tuple(global_shape(x))
    if not shape:  # a 0-d input: nothing is split
        return None
    if packet in LOG_SOFTMAX:
        dim = b["dim"] % len(shape)
        axes = _split_axes(xspec, dim)
        if not axes:
            return None
        from fxpar.runtime.vocab import VOCAB_PARALLEL_LOG_SOFTMAX

        dtype = b.get("dtype") if packet is aten.log_softmax else (
            torch.float32 if b.get("half_to_float") else None)
        return VOCAB_PARALLEL_LOG_SOFTMAX, (x, dim, axes, dtype)
    axes = class_axes(xspec)
    if not axes or len(shape) < 2:
        return None
    from fxpar.runtime import vocab as V

    sl = xspec.global_slices(shape, mesh_shape, coord)
    red = b.get("reduction", 1)
    ii = b.get("ignore_index", -100)
    rows_split = any(isinstance(p, Shard) and p.dim != 1 for p in xspec)
    bounds = ([[s.start, s.stop] for s in (sl[0], *sl[2:])]  # target dims: N, d1, ...
              if _RED.get(red) == "mean" and rows_split else None)
    if not _is_ce(node):
        two = len(out_shapes(node)) > 1
        return V.vocab_parallel_nll, (x, b["target"], b.get("weight"), sl[1].start, red, ii, bounds, two)
    if b.get("weight") is not None:
        raise PlanError(f"node {node.name} ({node.target}): a vocabulary-parallel cross-entropy "
                        f"(class dim split over mesh axes {axes}) with class weights is not "
                        "supported; keep the class dim whole (pin the loss input's class dim R)")
    rest = (sl[1].start, shape[1], axes)
    eps = float(b.get("label_smoothing", 0.0))
    if bounds is not None:
        return V.vocab_parallel_mean_loss, (x, b["target"], bounds, *rest, ii, eps)
    return V.VOCAB_PARALLEL_CROSS_ENTROPY, (x, b["target"], *rest, red, ii, eps)


def vocab_local(node: fx.Node, lctx: LocalContext) -> None:
    """Localize a class-index loss or a ``log_softmax``: vocabulary-parallel
    (:func:`vocab_call`), else a mean over a split input (:func:`sharded_mean_local`), else
    the plain op."""
    got = vocab_call(node, node.meta[ir.IN_SPECS], lctx.global_shape, lctx.mesh_shape, lctx.coord)
    if got is None:
        sharded_mean_local(node, lctx)
        return
    node.target, node.args = got
    node.kwargs = {}


def vocab_comm(node: fx.Node, strat, mesh) -> tuple[float, float]:
    """``(t_fwd, t_bwd)`` of the collectives inside a vocabulary-parallel cross-entropy (the
    backward is local) or ``log_softmax`` under ``strat`` on ``mesh``
    (:mod:`fxpar.cost.losses`, on this rank's rows); ``(0, 0)`` for any other strategy and
    for the nll losses (no communication inside)."""
    packet = _packet(node)
    if not _is_ce(node) and packet not in LOG_SOFTMAX:
        return 0.0, 0.0
    b = bound(node)
    x = b["self"]
    val = x.meta["val"]
    if val.ndim < (2 if _is_ce(node) else 1):
        return 0.0, 0.0
    dim = 1 if _is_ce(node) else b["dim"] % val.ndim
    xspec = strat.inputs[node.all_input_nodes.index(x)]
    axes = _split_axes(xspec, dim)
    if not axes:
        return 0.0, 0.0
    local = max_local_shape(xspec, tuple(val.shape), mesh.shape)
    rows = math.prod(local) // max(local[dim], 1)
    itemsize = torch.promote_types(val.dtype, torch.float32).itemsize
    if packet in LOG_SOFTMAX:
        return vocab_log_softmax_time(rows, itemsize, mesh, axes)
    return vocab_ce_time(rows, itemsize, mesh, axes, bool(b.get("label_smoothing", 0.0))), 0.0


@register(*_LOSSES[3:], cost=softmax_cost, local=vocab_local)
@register(*_LOSSES[1:3], cost=softmax_cost, saves="input0", local=vocab_local)
@register(aten.cross_entropy_loss, cost=softmax_cost, saves="input0", local=vocab_local, comm=vocab_comm)
def loss_rule(node):
    b = bound(node)
    x, t = tensor_shape(b["self"]), tensor_shape(b["target"])
    if len(x) < 2 or t is None or len(t) != len(x) - 1:
        return
    red = _RED.get(b.get("reduction", 1), "mean")
    n_out = len(out_shapes(node))
    for td in range(len(t)):
        xd = 0 if td == 0 else td + 1
        name = "dp" if td == 0 else f"m{td}"
        if red == "none":
            yield choice(node, {"self": S(xd), "target": S(td)}, [S(td)] + [P()] * (n_out - 1), name)
        elif red == "sum":
            yield choice(node, {"self": S(xd), "target": S(td)}, [P()] * n_out, name)
        else:  # the local program divides by the weight of the WHOLE target: exact for any split
            yield choice(node, {"self": S(xd), "target": R, "weight": R},
                         [P()] + [R] * (n_out - 1), name)
    # vocabulary-parallel (module docstring): the class dim split, the target whole
    if _is_ce(node) and b.get("weight") is None:
        yield choice(node, {"self": S(1), "target": R}, [R], "vocab")
    elif not _is_ce(node):
        yield choice(node, {"self": S(1), "target": R, "weight": R}, [P()] + [R] * (n_out - 1), "vocab")


declare(aten.mse_loss, aten.l1_loss, aten.smooth_l1_loss, F.cross_entropy, cost=softmax_cost, saves="input0")
declare(aten.binary_cross_entropy, aten.binary_cross_entropy_with_logits, aten.huber_loss, aten.kl_div,
        cost=softmax_cost)
