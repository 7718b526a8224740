"""``fxpar.runtime.deferred``: a zero-bubble ``I`` that keeps each linear's input and output
gradient and a ``W`` that computes the weight gradients from them, checked against one plain
backward on toy graphs."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx

from fxpar.errors import FxparError
from fxpar.runtime.deferred import (collecting, defer_weight_grads, deferred_addmm, deferred_linear,
                                    weight_grads)

LINEAR = torch.ops.aten.linear.default
ADDMM = torch.ops.aten.addmm.default


class Net(torch.nn.Module):
    """Two linears share ``w`` (both deferrable); ``v`` also feeds a multiply (not)."""

    def forward(self, x, w, b, v):
        h = torch.tanh(LINEAR(x, w, b))
        h = LINEAR(h, w)
        return (LINEAR(h, v) * v.sum()).pow(2).sum()


def _leaves():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(*s, generator=g, requires_grad=True)
            for s in ((2, 5, 4), (4, 4), (4,), (3, 4))]


def test_i_then_w_equals_one_backward():
    gm = fx.symbolic_trace(Net())
    new, fqns = defer_weight_grads(gm, {"w": "w", "b": "b", "v": "v"})
    assert fqns == ["w"]   # b is no linear's weight; v has another use
    assert sum(n.target is deferred_linear for n in new.graph.nodes) == 2
    assert not any(n.target is deferred_linear for n in gm.graph.nodes)   # the original kept
    ref = _leaves()
    gm(*ref).backward()
    got = _leaves()
    with collecting() as kept:
        new(*got).backward()
    x, w, b, v = got
    assert w.grad is None and len(kept) == 2   # I: w waits for W
    for a, r in ((x, ref[0]), (b, ref[2]), (v, ref[3])):
        torch.testing.assert_close(a.grad, r.grad)
    w.grad = torch.ones_like(w)   # W accumulates in place, as autograd does
    weight_grads(kept)
    torch.testing.assert_close(w.grad, ref[1].grad + 1)
    assert kept == []


def test_a_deferred_linear_outside_i_is_refused():
    new, _ = defer_weight_grads(fx.symbolic_trace(Net()), {"w": "w"})
    with pytest.raises(FxparError, match="outside an I action"):
        new(*_leaves()).backward()
    with torch.no_grad():   # no autograd: the plain op
        assert torch.equal(new(*_leaves()), fx.symbolic_trace(Net())(*_leaves()))


class Conv1D(torch.nn.Module):
    """Hugging Face GPT-2's ``Conv1D``: ``addmm(b, x, w)`` with ``w`` stored ``[in, out]``."""

    def forward(self, x, w, b):
        return torch.tanh(ADDMM(b, x.view(-1, 4), w)).pow(2).sum()


def test_conv1d_addmm_is_deferred_too():
    gm = fx.symbolic_trace(Conv1D())
    new, fqns = defer_weight_grads(gm, {"w": "w", "b": "b"})
    assert fqns == ["w"] and any(n.target is deferred_addmm for n in new.graph.nodes)
    g = torch.Generator().manual_seed(1)
    mk = lambda: [torch.randn(*s, generator=g, requires_grad=True) for s in ((2, 3, 4), (4, 6), (6,))]  # noqa: E731
    ref, got = mk(), mk()
    for a, r in zip(got, ref):
        a.data.copy_(r.data)
    gm(*ref).backward()
    with collecting() as kept:
        new(*got).backward()
    assert got[1].grad is None
    weight_grads(kept)
    for a, r in zip(got, ref):
        torch.testing.assert_close(a.grad, r.grad)
