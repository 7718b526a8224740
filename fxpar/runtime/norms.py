"""Synchronized batch normalization: the statistics of the global batch on a sharded batch.

A training ``batch_norm`` normalizes each channel by the mean and variance over every other
dim of the WHOLE batch (the single-process program's semantics). When the batch (or another
non-channel dim) is sharded over mesh axes ``axes``, each rank holds part of those elements:

* forward (:func:`SYNC_BATCH_NORM`): per channel, this rank's count ``n_r``, mean ``m_r`` and
  sum of squared deviations ``M2_r`` (``var_mean``, stable), all-gathered over each axis of
  ``axes`` in turn and merged with Chan's parallel formula (no ``E[x²] − E[x]²``
  cancellation)::

      N = Σ n_r,   mean = Σ n_r·m_r / N,   M2 = Σ M2_r + Σ n_r·(m_r − mean)²
      var = M2 / N,   invstd = 1/√(var + eps),   y = (x − mean)·invstd·w + b

  The running statistics move by ``momentum`` towards ``mean`` and the unbiased
  ``M2 / (N − 1)`` of the global count, identically on every rank (they all hold the merged
  statistics), as ``torch.nn.BatchNorm`` does on one process.
* backward (:func:`SYNC_BATCH_NORM_BACKWARD`), SyncBatchNorm's
  (``torch.nn.modules._functions.SyncBatchNorm``): with ``x̂ = (x − mean)·invstd``, per channel
  ``Σdy`` and ``Σdy·(x − mean)`` are all-reduced over ``axes`` together with the count, and::

      dx = (dy − Σdy/N − (x − mean)·invstd²·Σdy(x − mean)/N)·invstd·w
      dw = Σ_local dy·x̂,   db = Σ_local dy

  ``dw``/``db`` are this rank's partial sums: the weight is replicated on ``axes`` and consumed
  by a sharded computation, so its gradient is ``P(sum)`` there and the model-state manager
  reduces it with the other data-parallel gradients (DESIGN §6).

Collectives run over ``DeviceMesh.get_group(axis)`` of the active
:class:`~fxpar.runtime.bindings.Bindings` with the functional collectives the rest of the
runtime uses. With ``axes == []`` the op is plain batch normalization of the local tensor.
Statistics are fp32 (fp64 for fp64 inputs); the output has the input's dtype. Uneven shards
are exact (counts are exchanged); an empty shard contributes ``n_r = 0``.

>>> x = torch.randn(6, 3, 4, generator=torch.Generator().manual_seed(0))
>>> rm, rv = torch.zeros(3), torch.ones(3)
>>> y = sync_batch_norm(x, None, None, rm, rv, 0.1, 1e-5, [])       # no axes: one process
>>> rm2, rv2 = torch.zeros(3), torch.ones(3)
>>> torch.allclose(y, torch.batch_norm(x, None, None, rm2, rv2, True, 0.1, 1e-5, False), atol=1e-6)
True
>>> torch.allclose(rv, rv2) and torch.allclose(rm, rm2)
True
>>> merge_moments(torch.stack([moments(x[:2]), moments(x[2:])]))[1].allclose(x.mean((0, 2)), atol=1e-6)
True
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fxpar.errors import FxparError

__all__ = ["moments", "merge_moments", "sync_batch_norm", "sync_native_batch_norm",
           "sync_batch_norm_functional", "sync_batch_norm_with_update",
           "sync_batch_norm_with_update_functional", "SYNC_BATCH_NORM", "SYNC_BATCH_NORM_BACKWARD"]


def _stat_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _dims(x: torch.Tensor) -> list[int]:
    return [0] + list(range(2, x.dim()))


def _bshape(x: torch.Tensor) -> list[int]:
    """``[1, C, 1, ...]``: a per-channel vector broadcast against ``x``."""
    return [1, x.shape[1]] + [1] * (x.dim() - 2)


def moments(x: torch.Tensor) -> torch.Tensor:
    """``[3, C]``: per channel (dim 1) the element count, mean and sum of squared deviations
    ``M2`` over every other dim of ``x``, in fp32 (fp64 for fp64 ``x``).

    >>> moments(torch.tensor([[1.], [3.]]))
    tensor([[2.],
            [2.],
            [2.]])
    """
    dt = _stat_dtype(x)
    c = x.shape[1]
    n = x.numel() // c if c else 0
    if n == 0:
        return torch.zeros(3, c, dtype=dt, device=x.device)
    var, mean = torch.var_mean(x.to(dt), _dims(x), correction=0)
    return torch.stack([torch.full_like(mean, n), mean, var * n])


def merge_moments(g: torch.Tensor) -> torch.Tensor:
    """Chan's merge of ``[k, 3, C]`` moments (count, mean, M2) of ``k`` disjoint parts into the
    ``[3, C]`` moments of their union (module docstring); a channel with no element keeps
    mean 0 and M2 0.

    >>> parts = torch.tensor([[[1.], [0.], [0.]], [[1.], [2.], [0.]]])   # {0} and {2}
    >>> merge_moments(parts).flatten().tolist()                          # n, mean, M2 of {0, 2}
    [2.0, 1.0, 2.0]
    """
    n, m, m2 = g[:, 0], g[:, 1], g[:, 2]
    total = n.sum(0)
    mean = (n * m).sum(0) / total.clamp_min(1)
    return torch.stack([total, mean, m2.sum(0) + (n * (m - mean) ** 2).sum(0)])


def _group(axis: int):
    from fxpar.runtime.bindings import current

    b = current()
    return b.mesh.shape[axis], b.device_mesh.get_group(axis).group_name


def _gathered(t: torch.Tensor, axis: int) -> torch.Tensor:
    k, name = _group(axis)
    f = torch.ops._c10d_functional
    out = f.wait_tensor(f.all_gather_into_tensor(t.contiguous(), k, name))
    return out.view(k, *t.shape)


def _all_reduced(t: torch.Tensor, axis: int) -> torch.Tensor:
    _, name = _group(axis)
    f = torch.ops._c10d_functional
    return f.wait_tensor(f.all_reduce(t.contiguous(), "sum", name))


def _check_input(x: torch.Tensor, weight, where: str) -> None:
    if x.dim() < 2:
        raise FxparError(f"{where}: input of shape {tuple(x.shape)} has no channel dim (dim 1)")
    if weight is not None and weight.shape != (x.shape[1],):
        raise FxparError(f"{where}: weight of shape {tuple(weight.shape)} for {x.shape[1]} channels")


def _forward(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
             axes: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_input(x, weight, "fxpar::sync_batch_norm")
    mom = moments(x)
    for a in axes:  # merged moments are equal on the group: the next axis merges those
        mom = merge_moments(_gathered(mom, a))
    n, mean, m2 = mom[0], mom[1], mom[2]
    if bool((n == 0).any()):
        raise FxparError(f"fxpar::sync_batch_norm: no element to normalize over (input "
                         f"{tuple(x.shape)} on every rank of mesh axes {list(axes)})")
    invstd = torch.rsqrt(m2 / n + eps)
    unbiased = m2 / (n - 1)  # as torch: inf/nan for one element per channel
    scale = invstd if weight is None else invstd * weight.to(invstd.dtype)
    shift = -mean * scale if bias is None else bias.to(scale.dtype) - mean * scale
    y = (x.to(scale.dtype) * scale.view(_bshape(x)) + shift.view(_bshape(x))).to(x.dtype)
    return y, mean, invstd, unbiased


def _fake_forward(x, weight, bias, eps, axes):
    c = x.shape[1]
    dt = _stat_dtype(x)
    return (torch.empty_like(x), x.new_empty((c,), dtype=dt), x.new_empty((c,), dtype=dt),
            x.new_empty((c,), dtype=dt))


def _backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, mean: torch.Tensor,
              invstd: torch.Tensor, axes: Sequence[int], need_input: bool
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dt = mean.dtype
    dims, shp = _dims(x), _bshape(x)
    dy = grad.to(dt)
    xmu = x.to(dt) - mean.view(shp)
    sum_dy = dy.sum(dims)
    sum_dy_xmu = (dy * xmu).sum(dims)
    grad_weight = (sum_dy_xmu * invstd).to(weight.dtype) if weight is not None else x.new_empty(0)
    grad_bias = sum_dy.to(weight.dtype if weight is not None else x.dtype)
    if not need_input:
        return x.new_empty(0), grad_weight, grad_bias
    c = x.shape[1]
    red = torch.stack([sum_dy, sum_dy_xmu, torch.full_like(sum_dy, x.numel() // c if c else 0)])
    for a in axes:  # every rank of the groups runs this: the same graph, the same needs
        red = _all_reduced(red, a)
    mean_dy, mean_dy_xmu = red[0] / red[2], red[1] / red[2]
    scale = invstd if weight is None else invstd * weight.to(dt)
    gi = (dy - mean_dy.view(shp) - xmu * (invstd * invstd * mean_dy_xmu).view(shp)) * scale.view(shp)
    return gi.to(x.dtype), grad_weight, grad_bias


def _fake_backward(grad, x, weight, mean, invstd, axes, need_input):
    wdt = weight.dtype if weight is not None else x.dtype
    return (torch.empty_like(x) if need_input else x.new_empty(0),
            weight.new_empty(weight.shape) if weight is not None else x.new_empty(0),
            x.new_empty((x.shape[1],), dtype=wdt))


@torch.library.custom_op("fxpar::sync_batch_norm", mutates_args=())
def _sync_batch_norm_op(input: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                        eps: float, axes: list[int]
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _forward(input, weight, bias, eps, axes)


@torch.library.custom_op("fxpar::sync_batch_norm_backward", mutates_args=())
def _sync_batch_norm_backward_op(grad: torch.Tensor, input: torch.Tensor, weight: torch.Tensor | None,
                                 mean: torch.Tensor, invstd: torch.Tensor, axes: list[int],
                                 need_input: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward(grad, input, weight, mean, invstd, axes, need_input)


_sync_batch_norm_op.register_fake(_fake_forward)
_sync_batch_norm_backward_op.register_fake(_fake_backward)

#: ``fxpar::sync_batch_norm(input, weight?, bias?, eps, axes) -> (y, mean, invstd, unbiased_var)``
SYNC_BATCH_NORM = torch.ops.fxpar.sync_batch_norm.default
#: ``fxpar::sync_batch_norm_backward(dy, input, weight?, mean, invstd, axes, need_input) -> (dx, dw, db)``
SYNC_BATCH_NORM_BACKWARD = torch.ops.fxpar.sync_batch_norm_backward.default


def _setup(ctx, inputs, output) -> None:
    x, weight, bias, eps, axes = inputs
    _, mean, invstd, _ = output
    # the input and two per-channel vectors: what the fused kernel keeps (saves="stats")
    ctx.save_for_backward(x, weight, mean, invstd)
    ctx.axes, ctx.has_bias = list(axes), bias is not None
    ctx.mark_non_differentiable(output[1], output[2], output[3])


def _grad(ctx, grad_y, *_stats):
    x, weight, mean, invstd = ctx.saved_tensors
    need_x, need_w, need_b = ctx.needs_input_grad[:3]
    if grad_y is None or not (need_x or need_w or need_b):
        return None, None, None, None, None
    gi, gw, gb = SYNC_BATCH_NORM_BACKWARD(grad_y, x, weight, mean, invstd, ctx.axes, bool(need_x))
    return (gi if need_x else None, gw if need_w and weight is not None else None,
            gb if need_b and ctx.has_bias else None, None, None)


_sync_batch_norm_op.register_autograd(_grad, setup_context=_setup)


def _update(running: torch.Tensor | None, stat: torch.Tensor, momentum: float) -> None:
    if running is not None:
        with torch.no_grad():
            running.mul_(1 - momentum).add_(stat.to(running.dtype), alpha=momentum)


def sync_batch_norm(input: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                    running_mean: torch.Tensor | None, running_var: torch.Tensor | None,
                    momentum: float, eps: float, axes: list[int]) -> torch.Tensor:
    """Training ``aten.batch_norm`` over the batch sharded on mesh ``axes`` (module docstring):
    the running statistics (when given) are updated in place with the global ones."""
    y, mean, _, var = SYNC_BATCH_NORM(input, weight, bias, eps, axes)
    _update(running_mean, mean, momentum)
    _update(running_var, var, momentum)
    return y


def sync_native_batch_norm(input: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                           running_mean: torch.Tensor | None, running_var: torch.Tensor | None,
                           momentum: float, eps: float, axes: list[int]):
    """``aten.native_batch_norm`` / ``_native_batch_norm_legit`` in training: ``(y, mean,
    invstd)`` of the global batch, running statistics updated in place."""
    y, mean, invstd, var = SYNC_BATCH_NORM(input, weight, bias, eps, axes)
    _update(running_mean, mean, momentum)
    _update(running_var, var, momentum)
    return y, mean, invstd


def sync_batch_norm_functional(input: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                               running_mean: torch.Tensor, running_var: torch.Tensor,
                               momentum: float, eps: float, axes: list[int]):
    """``aten._native_batch_norm_legit_functional`` in training: ``(y, mean, invstd,
    new_running_mean, new_running_var)``, the running statistics returned, not written."""
    y, mean, invstd, var = SYNC_BATCH_NORM(input, weight, bias, eps, axes)
    new_mean = running_mean * (1 - momentum) + mean.to(running_mean.dtype) * momentum
    new_var = running_var * (1 - momentum) + var.to(running_var.dtype) * momentum
    return y, mean, invstd, new_mean, new_var


def sync_batch_norm_with_update(input: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                                running_mean: torch.Tensor, running_var: torch.Tensor,
                                momentum: float, eps: float, axes: list[int]):
    """``aten._batch_norm_with_update``: ``(y, mean, invstd, reserve)`` (``reserve`` an empty
    ``uint8`` tensor, as on CPU), running statistics updated in place."""
    y, mean, invstd = sync_native_batch_norm(input, weight, bias, running_mean, running_var, momentum, eps, axes)
    return y, mean, invstd, input.new_empty((0,), dtype=torch.uint8)


def sync_batch_norm_with_update_functional(input: torch.Tensor, weight: torch.Tensor | None,
                                           bias: torch.Tensor | None, running_mean: torch.Tensor,
                                           running_var: torch.Tensor, momentum: float, eps: float,
                                           axes: list[int]):
    """``aten._batch_norm_with_update_functional``: ``(y, mean, invstd, reserve,
    new_running_mean, new_running_var)``."""
    y, mean, invstd, new_mean, new_var = sync_batch_norm_functional(
        input, weight, bias, running_mean, running_var, momentum, eps, axes)
    return y, mean, invstd, input.new_empty((0,), dtype=torch.uint8), new_mean, new_var
