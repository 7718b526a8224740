"""Vocabulary-parallel losses: the class dim split over mesh axes, nothing gathered.

``torch.ops.fxpar.vocab_parallel_cross_entropy`` (below), ``vocab_parallel_log_softmax`` and
:func:`vocab_parallel_nll` (at the end). The logits ``x[N, C, d1..]`` are split along the
class dim (dim 1) over the mesh axes ``axes``: this rank holds classes ``[start, start + n)``
of ``classes``. The loss of a row with target ``t`` (class-index targets, no class weights)
and label smoothing ``ε`` is::

    lse  = m + log Σ_c exp(x_c − m)            m = max_c x_c
    loss = lse − (1 − ε)·x_t − (ε / C)·Σ_c x_c    (0 where t == ignore_index)

(``torch.nn.functional.cross_entropy``'s formula). Megatron's vocabulary-parallel
cross-entropy computes it without gathering the logits, in three all-reduces (the max, the
sum of ``exp(x − m)``, the target logit). Here each rank computes, per row, its shard's own
``lse_r = logsumexp`` over its classes, the target logit if its shard holds ``t`` (0
elsewhere) and, with ``ε > 0``, its ``Σ x``, and ONE all-gather of those 2N (3N) numbers
per rank over the axes gives ``lse = logsumexp_r lse_r`` (as stable as the global max
shift) and the sums: one collective's latency instead of three, which is what a loss of a
few thousand rows costs. Reductions as ATen encodes them (0 ``none``: the loss per
row, replicated; 1 ``mean``: summed over rows whose target is not ``ignore_index``, divided by
their count; 2 ``sum``). The process group of each axis is the bound
:class:`~fxpar.runtime.bindings.Bindings`' ``device_mesh.get_group(axis)``: the graph holds
only the axis indices.

Backward is exact and local (no communication; ``lse`` is saved): for a kept row with
incoming gradient ``g`` (``g/count`` for mean)::

    ∂loss/∂x_c = g·(softmax_c − ε/C − (1 − ε)·[c == t])     on this rank's classes only

so each rank gets the gradient of its own shard (``S(1)`` in, ``S(1)`` gradient out), rows
with ``t == ignore_index`` zero. Class weights are not supported (the strategy is not offered
with a ``weight``; the op has no such argument).

``start``/``classes`` are static (this rank's first class, the global class count);
``reduction``, ``ignore_index``, ``label_smoothing`` as ``aten.cross_entropy_loss``'s.

>>> import torch
>>> x, t = torch.randn(4, 6), torch.tensor([0, 5, -100, 2])
>>> got = VOCAB_PARALLEL_CROSS_ENTROPY(x, t, 0, 6, [], 1, -100, 0.1)   # no axes: all classes here
>>> torch.allclose(got, torch.nn.functional.cross_entropy(x, t, label_smoothing=0.1))
True
"""

from __future__ import annotations

import torch

from fxpar.errors import FxparError
from fxpar.runtime.bindings import current
from fxpar.runtime.library import define

__all__ = ["VOCAB_PARALLEL_CROSS_ENTROPY", "vocab_parallel_mean_loss", "VOCAB_PARALLEL_LOG_SOFTMAX",
           "vocab_parallel_nll", "VocabParallelError"]

_NONE, _MEAN, _SUM = 0, 1, 2


class VocabParallelError(FxparError, RuntimeError):
    """A vocabulary-parallel loss cannot run as called (a reduction it does not know)."""


def _all_reduce(t: torch.Tensor, op: str, axes) -> torch.Tensor:
    """``t`` reduced with ``op`` over the groups of mesh ``axes`` (one after the other: max
    and sum are associative, so nested axes reduce to the whole class dim)."""
    if not axes:
        return t
    f = _functional()
    dm = current().device_mesh
    t = t.contiguous()
    for a in axes:
        t = f.wait_tensor(f.all_reduce(t, op, dm.get_group(a).group_name))
    return t


def _gather(t: torch.Tensor, axes) -> torch.Tensor:
    """``t`` of every rank of this rank's groups of mesh ``axes``, stacked: ``[G, *t.shape]``
    (nested axes gathered one after the other; ``G = 1`` without axes)."""
    t = t.unsqueeze(0).contiguous()
    if not axes:
        return t
    f = _functional()
    dm = current().device_mesh
    for a in axes:
        g = dm.get_group(a)
        t = f.wait_tensor(f.all_gather_into_tensor(t, g.size(), g.group_name))
    return t


def _functional():
    import torch.distributed  # noqa: F401  (registers the _c10d_functional ops)

    return torch.ops._c10d_functional


def _check_reduction(reduction: int, op: str = "vocab_parallel_cross_entropy") -> None:
    if reduction not in (_NONE, _MEAN, _SUM):
        raise VocabParallelError(f"fxpar.{op}: reduction {reduction} is not one of 0 (none), "
                                 "1 (mean), 2 (sum)")


def _acc(dtype: torch.dtype) -> torch.dtype:
    """The dtype the loss is computed in: float32, or float64 for a float64 input."""
    return torch.promote_types(dtype, torch.float32)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x[N, C, d..]`` as ``[N, d.., C]`` in :func:`_acc` (a view for a float32 ``[N, C]``)."""
    return x.movedim(1, -1).to(_acc(x.dtype))


def _target_at(xl: torch.Tensor, target: torch.Tensor, start: int, ignore_index: int):
    """``(local index, inside, keep)``: the target's column in this shard (0 where it is not
    here), whether this shard holds it, and whether the row counts (not ``ignore_index``)."""
    local = target - start
    keep = target != ignore_index
    inside = (local >= 0) & (local < xl.shape[-1]) & keep
    return torch.where(inside, local, 0), inside, keep


def _forward(x, target, start, classes, axes, reduction, ignore_index, eps):
    """``(loss, lse)``: the module docstring's forward (``lse`` per row, in :func:`_acc`)."""
    _check_reduction(reduction)
    xl = _rows(x)
    idx, inside, keep = _target_at(xl, target, start, ignore_index)
    parts = [torch.logsumexp(xl, -1),
             torch.where(inside, xl.gather(-1, idx.unsqueeze(-1)).squeeze(-1), 0.0)]
    if eps:
        parts.append(xl.sum(-1))
    g = _gather(torch.stack(parts), axes)   # one collective: [ranks, parts, rows..]
    lse = torch.logsumexp(g[:, 0], 0)
    s = g[:, 1:].sum(0)
    loss = lse - (1.0 - eps) * s[0]
    if eps:
        loss = loss - (eps / classes) * s[1]
    loss = torch.where(keep, loss, 0.0)
    if reduction == _SUM:
        loss = loss.sum()
    elif reduction == _MEAN:
        loss = loss.sum() / keep.sum()
    return loss.to(x.dtype), lse


def _backward(grad, x, target, lse, start, classes, reduction, ignore_index, eps):
    """``∂loss/∂x`` of this rank's shard (module docstring), in ``x``'s dtype and layout."""
    _check_reduction(reduction)
    xl = _rows(x)
    p = torch.exp(xl - lse.unsqueeze(-1))
    if eps:
        p = p - eps / classes
    idx, inside, keep = _target_at(xl, target, start, ignore_index)
    p = p.scatter_add(-1, idx.unsqueeze(-1), (inside.to(p.dtype) * -(1.0 - eps)).unsqueeze(-1))
    g = grad.to(p.dtype)
    if reduction == _MEAN:
        g = g / keep.sum()
    g = torch.where(keep, g, 0.0)  # a scalar g broadcasts to every row
    return (p * g.unsqueeze(-1)).to(x.dtype).movedim(-1, 1).contiguous()


def _loss_fake(x, target, start, classes, axes, reduction, ignore_index, eps):
    return x.new_empty(target.shape if reduction == _NONE else ())


_FWD = define("fxpar::vocab_parallel_cross_entropy_fwd(Tensor x, Tensor target, int start, int classes, "
              "int[] axes, int reduction, int ignore_index, float label_smoothing) -> (Tensor, Tensor)",
              _forward, differentiable=False,
              fake=lambda x, t, *a: (_loss_fake(x, t, *a),
                                     torch.empty(t.shape, dtype=_acc(x.dtype), device=x.device)))
_BWD = define("fxpar::vocab_parallel_cross_entropy_backward(Tensor grad, Tensor x, Tensor target, "
              "Tensor lse, int start, int classes, int reduction, int ignore_index, "
              "float label_smoothing) -> Tensor", _backward, differentiable=False,
              fake=lambda grad, x, *a: x.new_empty(x.shape))

_SCHEMA = ("vocab_parallel_cross_entropy(Tensor x, Tensor target, int start, int classes, int[] axes, "
           "int reduction, int ignore_index, float label_smoothing) -> Tensor")
_LIB = torch.library.Library("fxpar", "FRAGMENT")
_LIB.define(_SCHEMA)
_LIB.impl("vocab_parallel_cross_entropy", lambda *a: _FWD(*a)[0], "CompositeExplicitAutograd")
torch.library.register_fake("fxpar::vocab_parallel_cross_entropy", _loss_fake, lib=_LIB)


class _VocabParallelCE(torch.autograd.Function):
    """Saves ``x``, ``target`` and ``lse`` (through autograd's saved-tensor hooks, so
    recomputation and memory accounting see them) and runs the local backward op."""

    @staticmethod
    def forward(ctx, x, target, start, classes, axes, reduction, ignore_index, eps):
        with torch._C._AutoDispatchBelowAutograd():
            loss, lse = _FWD(x, target, start, classes, axes, reduction, ignore_index, eps)
        ctx.save_for_backward(x, target, lse)
        ctx.static = (start, classes, reduction, ignore_index, eps)
        return loss

    @staticmethod
    def backward(ctx, grad):
        x, target, lse = ctx.saved_tensors
        gx = _BWD(grad, x, target, lse, *ctx.static) if ctx.needs_input_grad[0] else None
        return gx, None, None, None, None, None, None, None


_LIB.impl("vocab_parallel_cross_entropy", _VocabParallelCE.apply, "Autograd")
#: ``fxpar::vocab_parallel_cross_entropy(x, target, start, classes, axes, reduction,
#: ignore_index, label_smoothing) -> loss`` (module docstring)
VOCAB_PARALLEL_CROSS_ENTROPY = torch.ops.fxpar.vocab_parallel_cross_entropy.default


def vocab_parallel_mean_loss(x, target, bounds, start, classes, axes, ignore_index, eps):
    """A ``reduction="mean"`` vocabulary-parallel cross-entropy whose rows are split too: ``x``
    holds the rows ``bounds`` (``[start, stop]`` per target dim) of the global input, ``target``
    is the WHOLE target; the loss summed over this rank's rows divided by the number of
    non-ignored targets of the whole batch (:mod:`fxpar.strategies.losses`: the addends of the
    ranks splitting the rows sum to the mean, exactly, for any split)."""
    local_t = target[tuple(slice(lo, hi) for lo, hi in bounds)]
    total = VOCAB_PARALLEL_CROSS_ENTROPY(x, local_t, start, classes, axes, _SUM, ignore_index, eps)
    return total / (target != ignore_index).sum()


# --- log_softmax over a split dim, and the nll losses of its output ------------------------------
def _log_softmax(x, dim, axes, dtype=None):
    """``(out, lse)``: ``x − logsumexp(x, dim)`` over the WHOLE dim split over ``axes``."""
    xa = x.to(_acc(x.dtype))
    lse = torch.logsumexp(_gather(torch.logsumexp(xa, dim, keepdim=True), axes), 0)
    return (xa - lse).to(dtype if dtype is not None else x.dtype)


def _log_softmax_backward(grad, out, dim, axes):
    """``g − softmax·Σ_dim g`` with the sum over the whole dim (one all-reduce)."""
    acc = _acc(out.dtype)
    g = grad.to(acc)
    total = _all_reduce(g.sum(dim, keepdim=True), "sum", axes)
    return (g - torch.exp(out.to(acc)) * total).to(grad.dtype)


_LSM_BWD = define("fxpar::vocab_parallel_log_softmax_backward(Tensor grad, Tensor out, int dim, int[] axes) "
                  "-> Tensor", _log_softmax_backward, differentiable=False,
                  fake=lambda grad, out, dim, axes: grad.new_empty(grad.shape))
_LIB.define("vocab_parallel_log_softmax(Tensor x, int dim, int[] axes, ScalarType? dtype=None) -> Tensor")
_LIB.impl("vocab_parallel_log_softmax", _log_softmax, "CompositeExplicitAutograd")
torch.library.register_fake(
    "fxpar::vocab_parallel_log_softmax",
    lambda x, dim, axes, dtype=None: x.new_empty(x.shape, dtype=dtype if dtype is not None else x.dtype),
    lib=_LIB)


class _VocabParallelLogSoftmax(torch.autograd.Function):
    """Saves its output (as ``aten._log_softmax`` does); backward all-reduces ``Σ_dim g``."""

    @staticmethod
    def forward(ctx, x, dim, axes, dtype=None):
        with torch._C._AutoDispatchBelowAutograd():
            out = VOCAB_PARALLEL_LOG_SOFTMAX(x, dim, axes, dtype)
        ctx.save_for_backward(out)
        ctx.static = (dim, list(axes), x.dtype)
        return out

    @staticmethod
    def backward(ctx, grad):
        (out,) = ctx.saved_tensors
        dim, axes, dtype = ctx.static
        return _LSM_BWD(grad, out, dim, axes).to(dtype), None, None, None


_LIB.impl("vocab_parallel_log_softmax", _VocabParallelLogSoftmax.apply, "Autograd")
#: ``fxpar::vocab_parallel_log_softmax(x, dim, axes, dtype=None)``: ``log_softmax(x, dim)``
#: with ``dim`` split over mesh ``axes`` (Megatron's vocabulary-parallel softmax): one
#: all-gather of each shard's ``logsumexp`` per row in forward (``lse = logsumexp_r lse_r``);
#: backward ``g − softmax·Σ_dim g``, one all-reduce (sum) of one number per row.
VOCAB_PARALLEL_LOG_SOFTMAX = torch.ops.fxpar.vocab_parallel_log_softmax.default


def vocab_parallel_nll(x, target, weight, start, reduction, ignore_index, bounds=None,
                       total_weight=False):
    """This rank's ``P(sum)`` addend of an nll loss (``aten.nll_loss*``: ``−w[t]·x[t]`` per row)
    whose input ``x[N, C, d..]`` (log-probabilities) holds the classes ``[start, start + n)``:
    the rows whose target is here contribute, the others 0. No communication: the addends of
    the ranks splitting C sum to the loss. ``weight`` (class weights) and ``target`` are WHOLE
    along C; with ``bounds`` (``[start, stop]`` per target dim: this rank's rows of a
    ``reduction="mean"`` loss whose rows are split too) ``target`` is the whole target and the
    divisor is the weight of all its non-ignored targets. ``total_weight``: also return ATen's
    second output (that weight; 0 for ``reduction="none"``). Plain ATen ops (exact autograd).

    >>> x = torch.randn(3, 4).log_softmax(1)
    >>> t, w = torch.tensor([0, 3, 2]), torch.rand(4)
    >>> got = vocab_parallel_nll(x[:, :2], t, w, 0, 1, -100) + vocab_parallel_nll(x[:, 2:], t, w, 2, 1, -100)
    >>> torch.allclose(got, torch.nn.functional.nll_loss(x, t, w))
    True
    """
    _check_reduction(reduction, "vocab_parallel_nll")
    whole = target
    if bounds is not None:
        target = target[tuple(slice(lo, hi) for lo, hi in bounds)]
    local = target - start
    keep = target != ignore_index
    inside = (local >= 0) & (local < x.shape[1]) & keep
    picked = x.gather(1, torch.where(inside, local, 0).unsqueeze(1)).squeeze(1)
    rows = torch.where(inside, -picked, 0.0)
    if weight is not None:
        rows = rows * weight[torch.where(keep, target, 0)]
    wk = whole != ignore_index
    denom = (weight[torch.where(wk, whole, 0)] * wk).sum() if weight is not None else wk.sum().to(x.dtype)
    out = rows if reduction == _NONE else rows.sum() if reduction == _SUM else rows.sum() / denom
    if not total_weight:
        return out
    return out, (denom if reduction != _NONE else denom.new_zeros(()))
