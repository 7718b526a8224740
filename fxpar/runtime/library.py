"""``torch.ops.fxpar``: the namespace of fxpar's graph ops, and one way to define an op in it.

:func:`define` registers an op with ``torch.library`` at the three places a graph op needs:
the real kernel (``CompositeExplicitAutograd``: any device), a fake kernel (shapes only: used
on ``meta`` tensors, under ``FakeTensorMode`` and by ``torch.compile``) and, when the op is
differentiable, an ``Autograd`` kernel: a ``torch.autograd.Function`` that runs the op below
autograd and whose backward is given as ``backward(args, grad) -> input grads`` (written with
other ``torch.ops`` calls, so AOT autograd can trace it). This is what
``torch.library.custom_op`` + ``register_autograd`` do, with less Python per call (half the
dispatch overhead, measured), which matters for ops that run on every edge of every step.

>>> import torch
>>> twice = define("fxpar_doc::twice(Tensor x) -> Tensor", lambda x: x * 2,
...                fake=lambda x: torch.empty_like(x), backward=lambda args, g: (g * 2,))
>>> x = torch.ones(2, requires_grad=True)
>>> twice(x).sum().backward(); x.grad
tensor([2., 2.])
>>> twice(torch.empty(3, device="meta")).shape
torch.Size([3])
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["TensorMeta", "define"]

_LIBS: dict[str, torch.library.Library] = {}


class TensorMeta:
    """What a custom op's backward sees of a tensor argument: ``shape``, ``dtype``, ``device``.

    >>> TensorMeta(torch.zeros(2, 3)).shape
    torch.Size([2, 3])
    """

    __slots__ = ("shape", "dtype", "device")

    def __init__(self, t: torch.Tensor) -> None:
        self.shape, self.dtype, self.device = t.shape, t.dtype, t.device

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self.shape[dim]


def _meta(a):
    if isinstance(a, torch.Tensor):
        return TensorMeta(a)
    if isinstance(a, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in a):
        return type(a)(_meta(x) for x in a)
    return a


def define(schema: str, impl: Callable, *, fake: Callable, backward: Callable | None = None,
           differentiable: bool = True) -> torch._ops.OpOverload:
    """Define ``ns::name(...)`` from its schema; returns the op's default overload.

    ``backward(args, *grads)`` returns one gradient (or ``None``) per argument; in ``args``
    a tensor argument is its :class:`TensorMeta` (shape, dtype, device; no storage), so an op
    keeps no activation alive for its backward (what autograd saves goes through
    ``saved_tensors_hooks``: recomputation and memory accounting see all of it).
    ``differentiable=False`` marks the outputs as carrying no gradient (a token, a mask). An
    op returning nothing (``-> ()``, a check) gets no ``Autograd`` kernel: there is nothing to
    differentiate, and autograd's fallback runs the kernel as it is."""
    qualname, _, sig = schema.partition("(")
    ns, name = qualname.split("::")
    lib = _LIBS.get(ns) or _LIBS.setdefault(ns, torch.library.Library(ns, "FRAGMENT"))
    lib.define(f"{name}({sig}")
    lib.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(qualname, fake, lib=lib)
    op = getattr(getattr(torch.ops, ns), name).default
    if sig.replace(" ", "").endswith("->()"):
        # it exists for its effect (a gradient handed to the sink, a guard's check): under
        # torch.compile, AOTAutograd and inductor would drop a call whose result nobody reads
        torch.fx.node.has_side_effect(op)
        return op

    class Fn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *args):
            ctx.args = tuple(_meta(a) for a in args)
            with torch._C._AutoDispatchBelowAutograd():
                out = op(*args)
            if not differentiable:   # every output of a multi-output op
                ctx.mark_non_differentiable(*(out if isinstance(out, tuple) else (out,)))
            return out

        @staticmethod
        def backward(ctx, *grads):
            if backward is None:
                return (None,) * len(ctx.args)
            return backward(ctx.args, *grads)

    Fn.__name__ = f"{name}_autograd"
    lib.impl(name, Fn.apply, "Autograd")
    return op
