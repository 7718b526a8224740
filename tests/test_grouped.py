"""Grouped GEMMs with data-dependent group sizes (fxpar.capture.grouped): JetMoE's experts
(``x.split(counts.tolist())``, a linear per piece, ``cat``) captured with static shapes, equal
to eager on batches whose sizes differ from the example's, gradients included; a read that
reaches anything else keeps its guard."""

import pytest
import torch

import fxpar
from fxpar.capture.specialize import guards
from fxpar.errors import GuardError


class Experts(torch.nn.Module):
    """Tokens routed top-1 to 4 experts, sorted by expert, one linear per expert's rows."""

    def __init__(self, uses_sizes_elsewhere: bool = False):
        super().__init__()
        self.router = torch.nn.Linear(8, 4)
        self.w = torch.nn.Parameter(torch.randn(4, 6, 8) / 3)
        self.b = torch.nn.Parameter(torch.randn(4, 6) / 3)
        self.out = torch.nn.Linear(6, 8)
        self.elsewhere = uses_sizes_elsewhere

    def forward(self, x):
        x = x.reshape(-1, 8)
        expert = self.router(x).argmax(-1)
        order = expert.argsort(stable=True)
        counts = torch.nn.functional.one_hot(expert, 4).sum(0)
        sizes = counts.tolist()
        pieces = x[order].split(sizes)
        y = torch.cat([torch.nn.functional.linear(p, self.w[i], self.b[i])
                       for i, p in enumerate(pieces)])
        y = torch.empty_like(y).index_copy(0, order, y)
        out = self.out(torch.relu(y))
        if self.elsewhere:   # the sizes also scale the output: the guard must stay
            out = out * sizes[0]
        return out.square().mean()


def _batch(seed):
    return torch.randn(2, 12, 8, generator=torch.Generator().manual_seed(seed))


def test_grouped_linear_is_static_and_exact_for_other_group_sizes():
    torch.manual_seed(0)
    m = Experts()
    gm = fxpar.capture(m, (_batch(0),))
    assert guards(gm) == []   # the sizes reach only the split: no guard left
    ops = {str(n.target) for n in gm.graph.nodes}
    assert "aten.split_with_sizes.default" not in ops and "aten.where.self" in ops
    sizes = set()
    for seed in range(1, 6):
        x = _batch(seed)
        sizes.add(tuple(torch.bincount(m.router(x.reshape(-1, 8)).argmax(-1), minlength=4).tolist()))
        m.zero_grad()
        ref = m(x)
        ref.backward()
        want = {n: None if p.grad is None else p.grad.clone() for n, p in m.named_parameters()}
        m.zero_grad()
        got = fxpar.run_captured(gm, m, x)
        got.backward()
        assert torch.allclose(got, ref, rtol=1e-6, atol=1e-7)
        for n, p in m.named_parameters():   # the router's argmax passes no gradient
            assert (p.grad is None) == (want[n] is None) and (
                p.grad is None or torch.allclose(p.grad, want[n], rtol=1e-5, atol=1e-7)), n
    assert len(sizes) > 1   # the batches really routed differently


def test_a_read_used_elsewhere_keeps_its_guard():
    torch.manual_seed(0)
    m = Experts(uses_sizes_elsewhere=True)
    gm = fxpar.capture(m, (_batch(0),))
    assert len(guards(gm)) == 1
    first = torch.bincount(m.router(_batch(0).reshape(-1, 8)).argmax(-1), minlength=4).tolist()
    other = next(s for s in range(1, 20) if torch.bincount(
        m.router(_batch(s).reshape(-1, 8)).argmax(-1), minlength=4).tolist() != first)
    with pytest.raises(GuardError, match="read"):
        fxpar.run_captured(gm, m, _batch(other))
