"""The pass runner: return-type check, lint, timings, FXPAR_DEBUG dumps; annotate's plan check."""

from __future__ import annotations

import pytest
import torch

import fxpar
from fxpar.passes.infra import PassContext, PassResult, run_passes
from fxpar.passes.lowering import GLOBAL_PASSES


def _planned():
    from examples.models import MLP

    return fxpar.compile(MLP(4, 8), fxpar.Cluster.local(2), (torch.randn(4, 4),),
                         mesh={"tp": 2}, plan="megatron", emit=False)


def test_debug_dumps_and_timings(tmp_path, monkeypatch):
    monkeypatch.setenv("FXPAR_DEBUG", "1")
    monkeypatch.setenv("FXPAR_DEBUG_DIR", str(tmp_path))
    p = _planned()
    ctx = PassContext(p.plan, fxpar.Mesh(fxpar.Cluster.local(2), tp=2))
    gm = run_passes(p.graph, ctx, GLOBAL_PASSES)
    names = sorted(f.name for f in tmp_path.iterdir())
    assert names == ["00_annotate_pass.after.txt", "00_annotate_pass.before.txt",
                     "01_insert_collectives_pass.after.txt", "01_insert_collectives_pass.before.txt"]
    before = (tmp_path / "01_insert_collectives_pass.before.txt").read_text()
    after = (tmp_path / "01_insert_collectives_pass.after.txt").read_text()
    # the row-parallel output's all-reduce (Megatron's g) appears with the pass
    assert "all_reduce_tp" not in before and "all_reduce_tp" in after
    assert set(ctx.timings) == {"annotate_pass", "insert_collectives_pass"}
    assert gm.graph is not None


def test_pass_must_return_pass_result():
    p = _planned()

    def bad_pass(gm, ctx):
        return gm

    with pytest.raises(fxpar.FxparError, match="bad_pass returned GraphModule, not a PassResult"):
        run_passes(p.graph, PassContext(p.plan, None), [bad_pass])
    assert PassResult(p.graph, False).modified is False


def test_plan_from_another_graph_is_an_error():
    p = _planned()
    other = fxpar.compile(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()),
                          fxpar.Cluster.local(2), (torch.randn(4, 4),), mesh={"dp": 2}, plan="dp",
                          emit=False)
    with pytest.raises(fxpar.PlanError, match="does not match this graph"):
        run_passes(other.graph, PassContext(p.plan, None), GLOBAL_PASSES[:1])


def test_random_op_without_a_keyed_form_is_refused():
    """A random op localize cannot key (replicas would draw different values) is refused,
    naming the node, by planning: before any pass runs."""

    class Noisy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.fc(x) * torch._standard_gamma(x.abs() + 1)

    with pytest.raises(fxpar.PlanError, match="_standard_gamma.*no shard-keyed form"):
        fxpar.compile(Noisy(), fxpar.Cluster.local(2), (torch.randn(4, 4),), mesh={"dp": 2},
                      plan="dp", training=False)
