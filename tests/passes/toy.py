"""Toy graphs for pass tests: a few ATen nodes built by hand, annotated by hand.

``toy(ops)`` builds ``x -> op0 -> op1 -> ...`` from ``(name, target, extra args, out shape)``
rows; :func:`annotate` sets the meta every pass after ``annotate`` reads (``val``, specs),
without a plan, so a pass can be tested on exactly the layouts a test wants.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

import fxpar
from fxpar import ir
from fxpar.spec import Spec

_FAKE = FakeTensorMode()


def fake(shape, dtype=torch.float32, requires_grad=False) -> torch.Tensor:
    with _FAKE:
        return torch.empty(shape, dtype=dtype).requires_grad_(requires_grad)


def mesh(**axes) -> fxpar.Mesh:
    n = 1
    for s in axes.values():
        n *= s
    return fxpar.Mesh(fxpar.Cluster.local(n), **axes)


def placeholder(g: fx.Graph, name: str, shape, *, param: str | None = None, dtype=torch.float32) -> fx.Node:
    n = g.placeholder(name)
    n.meta[ir.VAL] = fake(shape, dtype, requires_grad=param is not None)
    if param is not None:
        n.meta[ir.PARAM] = ir.ParamInfo(param, "param", tuple(shape), dtype, name, True, True, ())
    return n


def annotate(n: fx.Node, out: str | tuple[str, ...], ins: tuple[str | None, ...] = ()) -> fx.Node:
    """Set the node's output spec(s) and its inputs' specs (as ``annotate_pass`` would)."""
    outs = (out,) if isinstance(out, str) else out
    n.meta[ir.SPECS] = tuple(Spec.parse(s) for s in outs)
    n.meta[ir.IN_SPECS] = tuple(None if s is None else Spec.parse(s) for s in ins)
    return n


def call(g: fx.Graph, target, args, shape, name: str | None = None, dtype=torch.float32,
         requires_grad=True) -> fx.Node:
    n = g.call_function(target, tuple(args))
    if name:
        n.name = name
    n.meta[ir.VAL] = fake(shape, dtype, requires_grad)
    return n


def module(g: fx.Graph) -> fx.GraphModule:
    gm = fx.GraphModule(torch.nn.Module(), g)
    return gm
