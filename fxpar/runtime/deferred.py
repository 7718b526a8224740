"""Weight gradients deferred from ``I`` to ``W`` (zero-bubble schedules), as the zero-bubble
papers and Megatron-LM split a linear layer's backward: ``I`` computes ``dX = dY·W`` (and the
bias gradient) and keeps ``(W, X, dY)``; ``W`` computes ``dW = dYᵀ·X`` from what ``I`` kept.

torch.distributed.pipelining's split (``stage_backward_input``/``stage_backward_weight``) walks
the autograd graph twice instead, and on one CPU thread that costs 1.1–1.8× a whole backward
(``Physics.split_backward``); here each GEMM runs once, and ``I + W`` measured 1.06–1.18× a
whole backward of 4 GPT blocks on one CPU thread (torch's split 1.26–1.75× in the same runs):
what remains is this Python-level backward's dispatch.

:func:`defer_weight_grads` rewrites a pipeline chunk's rank graph: an ``aten.linear`` (or a
Hugging Face ``Conv1D``'s ``aten.addmm``) whose weight is one of the given parameters, each of
whose uses in the graph is such an op, calls :func:`deferred_linear` (:func:`deferred_addmm`)
instead (a function of its inputs only: the graph holds no state).
Its backward appends to the list that :func:`collecting` opens around an ``I`` action;
:func:`weight_grads` is the ``W`` action. The weight reaches the autograd graph only through
that list, so its leaf gets no gradient (and fires no hook) in ``I``: ``W`` accumulates it.

>>> import torch, torch.fx as fx
>>> class M(torch.nn.Module):
...     def forward(self, x, w):
...         return torch.ops.aten.linear.default(x, w).sum()
>>> gm = fx.symbolic_trace(M())
>>> w = torch.randn(3, 4, requires_grad=True); x = torch.randn(2, 4, requires_grad=True)
>>> gm, fqns = defer_weight_grads(gm, {"w": "w"}); fqns
['w']
>>> with collecting() as kept:
...     gm(x, w).backward()
>>> x.grad is not None, w.grad is None, len(kept)
(True, True, 1)
>>> weight_grads(kept); torch.allclose(w.grad, torch.ones(2, 3).t() @ x)
True
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

import torch
import torch.fx as fx

from fxpar.errors import FxparError

__all__ = ["defer_weight_grads", "deferred_linear", "deferred_addmm", "linear_weight", "collecting",
           "weight_grads"]

_LINEAR = torch.ops.aten.linear.default
_ADDMM = torch.ops.aten.addmm.default
#: the list the running ``I`` action collects ``(weight, input, output gradient, conv1d)`` in
_KEPT: list | None = None


class _Linear(torch.autograd.Function):
    """``linear(x, w, b)`` (``conv1d``: ``addmm(b, x, w)``, the weight stored ``[in, out]`` as
    in Hugging Face's ``Conv1D``) whose weight gradient waits for ``W``; ``w`` comes in a
    list, so autograd has no edge to it."""

    @staticmethod
    def forward(ctx, x, b, holder, conv1d):
        (w,) = holder
        ctx.save_for_backward(x)
        ctx.w, ctx.b_shape, ctx.conv1d = w, None if b is None else b.shape, conv1d
        return _ADDMM(b, x, w.detach()) if conv1d else _LINEAR(x, w.detach(), b)

    @staticmethod
    def backward(ctx, gy):
        (x,) = ctx.saved_tensors
        if _KEPT is None:
            raise FxparError("a deferred weight gradient (fxpar.runtime.deferred) outside an I "
                             "action: its chunk's backward must run as I and W")
        _KEPT.append((ctx.w, x, gy, ctx.conv1d))
        w = ctx.w.detach()
        gx = (gy @ (w.t() if ctx.conv1d else w)) if ctx.needs_input_grad[0] else None
        gb = gy.sum_to_size(ctx.b_shape) if ctx.b_shape is not None and ctx.needs_input_grad[1] else None
        return gx, gb, None, None


def deferred_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``aten.linear(x, w, b)``; under autograd, its weight gradient is left to ``W``."""
    if not (torch.is_grad_enabled() and w.requires_grad):
        return _LINEAR(x, w, b)
    return _Linear.apply(x, b, [w], False)


def deferred_addmm(b: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``aten.addmm(b, x, w)`` (a ``Conv1D``); under autograd, its weight gradient is left
    to ``W``."""
    if not (torch.is_grad_enabled() and w.requires_grad):
        return _ADDMM(b, x, w)
    return _Linear.apply(x, b, [w], True)


#: op → (its deferring replacement, the position of its weight)
_DEFERRED = {_LINEAR: (deferred_linear, 1), _ADDMM: (deferred_addmm, 2)}


def linear_weight(n: fx.Node) -> bool:
    """Whether ``n`` is used, and only as the weight of ``aten.linear`` or ``aten.addmm``
    calls (no ``beta``/``alpha``)."""
    def weight_of(u):
        at = _DEFERRED.get(u.target, (None, -1))[1]
        return (0 <= at < len(u.args) and u.args[at] is n and not u.kwargs
                and sum(a is n for a in u.args) == 1)
    return bool(n.users) and all(weight_of(u) for u in n.users)


def defer_weight_grads(gm: fx.GraphModule, params: Mapping[str, str]) -> tuple[fx.GraphModule, list[str]]:
    """``(graph, fqns)``: a copy of ``gm`` whose linears (``Conv1D`` addmms) over the
    parameters ``params`` (placeholder name → fqn) call :func:`deferred_linear`
    (:func:`deferred_addmm`), where every use of the parameter is such an op's weight
    (:func:`linear_weight`), and the fqns so rewritten (their gradients then come from
    :func:`weight_grads` only); ``gm`` itself (it may be shared) is left as it is, and
    returned when nothing is rewritten. Node names and meta are kept."""
    names = [n.name for n in gm.graph.find_nodes(op="placeholder") if n.name in params and linear_weight(n)]
    if not names:
        return gm, []
    g = fx.Graph()
    val_map: dict[fx.Node, fx.Node] = {}
    g.output(g.graph_copy(gm.graph, val_map))
    for old, new in val_map.items():
        new.name = old.name
        if old.op == "placeholder" and old.name in names:
            for u in old.users:
                val_map[u].target = _DEFERRED[u.target][0]
    out = fx.GraphModule(gm, g)
    out.meta.update(gm.meta)
    return out, [params[nm] for nm in names]


@contextlib.contextmanager
def collecting() -> Iterator[list]:
    """What every deferred linear whose backward runs inside (an ``I`` action's) keeps for
    :func:`weight_grads`: ``(weight, input, output gradient, conv1d)``."""
    global _KEPT
    prev, _KEPT = _KEPT, []
    try:
        yield _KEPT
    finally:
        _KEPT = prev


def weight_grads(kept: list) -> None:
    """``W``: ``dW = dYᵀ·X`` (``Conv1D``: ``Xᵀ·dY``) of each kept linear, accumulated on its
    weight's ``.grad`` (in place where one exists, as autograd's accumulation does)."""
    with torch.no_grad():
        for w, x, gy, conv1d in kept:
            x2, g2 = x.reshape(-1, x.shape[-1]), gy.reshape(-1, gy.shape[-1])
            gw = (x2.t() @ g2 if conv1d else g2.t() @ x2).to(w.dtype)
            if w.grad is None:
                w.grad = gw
            else:
                w.grad.add_(gw)
    kept.clear()
