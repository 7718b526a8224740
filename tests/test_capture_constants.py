"""Constant folding (fxpar.capture.constants) and identity dropping (cleanup.drop_identities):
each on a toy model, against eager and against the graph's own ops."""

from __future__ import annotations

import torch
import torch.fx as fx
from torch import nn

from fxpar import ir
from fxpar.capture import capture, run_captured
from fxpar.capture.cleanup import drop_identities
from fxpar.capture.constants import MAX_FOLDED, fold_constants

aten = torch.ops.aten


def _ops(gm) -> list[str]:
    return [str(n.target).removeprefix("aten.") for n in gm.graph.nodes if n.op == "call_function"]


class _Gather(nn.Module):
    """Per query, the keys of a fixed pattern: index lists computed from constants alone."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):                                    # x: [B, 6, 8]
        L = x.shape[1]
        i = torch.arange(L)
        pattern = (i[:, None] - i[None, :]) % 3 == 0          # [L, L] constant
        outs = []
        for q in range(L):
            keys = (i[: L // 3] * 3 + q % 3).clamp(max=L - 1)  # the keys of q's residue class
            outs.append(self.lin(x[:, keys] * pattern[q, keys, None]).mean(1))
        return torch.stack(outs, 1)


def test_constant_index_lists_are_computed_once_at_capture_and_stay_exact():
    m, x = _Gather(), torch.randn(2, 6, 8)
    gm = capture(m, (x,))
    folded = {n.target: n for n in gm.graph.nodes if n.op == "get_attr"}
    # per query its key list and its pattern column are constants; nothing of the pattern,
    # the arange or the index arithmetic is left to run
    assert sorted(folded) == sorted([f"_folded_clamp{'_%d' % q if q else ''}" for q in range(6)]
                                    + [f"_folded_index{'_%d' % (2 * q + 1)}" for q in range(6)])
    assert not {"arange.start_step", "arange.default", "remainder.Scalar", "clamp.default", "eq.Scalar"} \
        & set(_ops(gm)), _ops(gm)
    for q in range(6):   # the values the eager model computes for each query
        n = folded[f"_folded_clamp{'_%d' % q if q else ''}"]
        assert getattr(gm, n.target).tolist() == [k for k in range(6) if (q - k) % 3 == 0]
        assert n.meta[ir.CONSTANT] == n.target and isinstance(n.meta[ir.VAL], torch.Tensor)
    for b in (torch.randn(2, 6, 8), torch.randn(2, 6, 8)):
        torch.testing.assert_close(run_captured(gm, m, b), m(b))


def _graph(build, shape=(4, 4)) -> fx.GraphModule:
    """A toy graph: ``build(graph, x)`` adds nodes reading placeholder ``x`` and returns the
    output; fake values from running the nodes."""
    g = fx.Graph()
    x = g.placeholder("x")
    g.output(build(g, x))
    gm = fx.GraphModule(nn.Module(), g)
    from torch.fx.passes.shape_prop import ShapeProp
    ShapeProp(gm).propagate(torch.randn(shape))
    for n in g.nodes:
        if "tensor_meta" in n.meta and n.op != "output":
            n.meta[ir.VAL] = torch.empty_strided(n.meta["tensor_meta"].shape,
                                                 n.meta["tensor_meta"].stride,
                                                 dtype=n.meta["tensor_meta"].dtype)
    return gm


def test_random_and_uninitialized_values_are_not_folded_and_big_values_stay_computed():
    n_big = MAX_FOLDED + 1

    def build(g, x):
        r = g.call_function(aten.rand.default, ([4],))                # a new draw every step
        e = g.call_function(aten.empty.memory_format, ([4],))          # uninitialized
        a = g.call_function(aten.arange.default, (n_big,))
        big = g.call_function(aten.mul.Tensor, (a, 2))                 # too big to hold
        s = g.call_function(aten.amax.default, (big,))
        y = g.call_function(aten.add.Tensor, (x, g.call_function(aten.mul.Tensor, (r, 2))))
        return g.call_function(aten.add.Tensor, (y, s)), g.call_function(aten.abs.default, (e,))

    gm = _graph(build)
    before = _ops(gm)
    fold_constants(gm)
    # rand and empty stay; the max of the big product is folded (one number), the product goes
    assert _ops(gm) == ["rand.default", "empty.memory_format", "mul.Tensor", "add.Tensor",
                        "add.Tensor", "abs.default"], \
        (before, _ops(gm))
    (s_attr,) = [n.target for n in gm.graph.nodes if n.op == "get_attr"]
    assert int(getattr(gm, s_attr)) == 2 * (n_big - 1)
    assert not torch.equal(gm(torch.zeros(4, 4))[0], gm(torch.zeros(4, 4))[0])   # drawn anew

    # a constant read as a big value stays computed from a folded (small) one
    k = n_big // 4 + 1

    def build2(g, x):
        a = g.call_function(aten.arange.default, (4,))
        b = g.call_function(aten.mul.Tensor, (a, 3))                   # folded
        big = g.call_function(aten.expand.default, (b, [k, 4]))        # stays
        return g.call_function(aten.add.Tensor, (x, big))

    gm2 = _graph(build2, (k, 4))
    fold_constants(gm2)
    assert _ops(gm2) == ["expand.default", "add.Tensor"], _ops(gm2)
    torch.testing.assert_close(gm2(torch.zeros(k, 4)), (torch.arange(4) * 3).expand(k, 4).float())


def test_identities_go_unless_something_writes_through_them():
    def build(g, x):
        same = g.call_function(aten.to.dtype, (x, torch.float32))       # x itself: goes
        wider = g.call_function(aten.to.dtype, (same, torch.float64))   # a real cast: stays
        al = g.call_function(aten.alias.default, (x,))                  # goes
        y = g.call_function(aten.mul.Tensor, (al, 2))
        w = g.call_function(aten.alias.default, (y,))                   # written in place: stays
        g.call_function(aten.add_.Tensor, (w, 1.0))
        return (g.call_function(aten.add.Tensor, (wider, w)), g.call_function(aten.alias.default, (y,)))

    gm = _graph(build)
    x = torch.randn(4, 4)
    want = gm(x)
    assert drop_identities(gm) == 2
    assert _ops(gm) == ["to.dtype", "mul.Tensor", "alias.default", "add_.Tensor", "add.Tensor",
                        "alias.default"]
    (to,) = gm.graph.find_nodes(op="call_function", target=aten.to.dtype)
    assert to.args[0].op == "placeholder" and to.args[1] == torch.float64
    for a, b in zip(gm(x), want):
        torch.testing.assert_close(a, b)
