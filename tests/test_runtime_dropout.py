"""Dropout under sharding, on the emitted programs of real gloo ranks.

The model is ``fc2(dropout(gelu(fc1(x))))`` then ``dropout`` again on the output: under the
Megatron plan on ``tp=2`` the first dropout sees a column-sharded activation (each rank a
different half: masks must be independent) and the second a replicated one (both ranks hold
the same data: masks must be identical, else the replicas diverge). Each rank runs its
program's own ``fxpar.sharded_dropout`` ops on a tensor of ones of the local shape and the ranks
compare what they drew.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.dist


class DropMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 64)
        self.fc2 = nn.Linear(64, 16)
        self.d1 = nn.Dropout(0.5)
        self.d2 = nn.Dropout(0.5)

    def forward(self, x):
        return self.d2(self.fc2(self.d1(nn.functional.gelu(self.fc1(x)))))


def masks_on_rank():
    import fxpar
    from fxpar import ir
    from fxpar.runtime.bindings import bind

    torch.manual_seed(0)
    model = DropMLP()
    x, y = torch.randn(32, 16), torch.randn(32, 16)
    prog = fxpar.compile(model, fxpar.Cluster.local(2), (x,), loss_fn=nn.functional.mse_loss,
                         example_targets=(y,), plan="megatron", mesh={"tp": 2},
                         optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    runner = prog.runner()
    losses = [runner.step(x, y).item() for _ in range(2)]  # training runs with dropout on
    out = {}
    for node in runner.gm.graph.find_nodes(op="call_function", target=torch.ops.fxpar.sharded_dropout.default):
        spec = str(node.meta[ir.IN_SPECS][0])
        with bind(runner.bindings):  # the program's own op, drawing from the runner's tracker
            keep = node.target(torch.ones(node.meta[ir.VAL].shape), *node.args[1:]) != 0
        out[spec] = keep
    return out, losses, runner.rank


@pytest.mark.timeout(300)
def test_masks_agree_on_replicas_and_differ_on_shards(pools):
    res = pools(2).run(masks_on_rank)
    (m0, l0, _), (m1, l1, _) = res
    assert l0 == l1, "the replicated loss must be the same on both ranks"
    assert set(m0) == set(m1) and len(m0) == 2, f"expected a sharded and a replicated dropout: {m0}"
    sharded = [s for s in m0 if "S(" in s]
    replicated = [s for s in m0 if "S(" not in s]
    assert sharded and replicated
    for s in sharded:  # different halves of the activation: independent masks
        assert not torch.equal(m0[s], m1[s])
    for s in replicated:  # the same data on both ranks: the same mask
        assert torch.equal(m0[s], m1[s])
    for m in (m0, m1):  # Bernoulli(0.5) keep rate on 512+ elements
        for keep in m.values():
            assert 0.35 < keep.float().mean().item() < 0.65
