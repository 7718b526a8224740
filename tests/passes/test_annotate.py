"""annotate: the plan's decisions onto node meta; a plan for another graph is refused."""

from __future__ import annotations

import pytest
import torch

import fxpar
from fxpar import ir
from fxpar.passes.annotate import annotate_pass
from fxpar.passes.infra import PassContext, run_passes


@pytest.fixture(scope="module")
def planned():
    torch.manual_seed(0)
    return fxpar.plan(torch.nn.Linear(4, 2), fxpar.Cluster.local(2), (torch.randn(4, 4),),
                      mesh={"dp": 2}, plan="dp")


def test_specs_from_the_plan(planned):
    """dp on a Linear: input and output S(0), weight and bias R; the linear's strategy needs
    (S(0), R, R); the output node asks for no special layout (no pin)."""
    gm = run_passes(planned.graph, PassContext(planned.plan), [annotate_pass])
    by = {n.name: n for n in gm.graph.nodes}
    assert [str(s) for s in by["linear"].meta[ir.SPECS]] == ["S(0)"]
    assert [str(s) for s in by["linear"].meta[ir.IN_SPECS]] == ["S(0)", "R", "R"]
    assert [str(s) for s in by["p_weight"].meta[ir.SPECS]] == ["R"]
    assert by["linear"].meta[ir.STRATEGY] == next(n.strategy for n in planned.plan.nodes
                                                  if n.name == "linear")
    assert by["output"].meta[ir.IN_SPECS] == (None,)


def test_plan_with_fewer_inputs_is_refused(planned):
    """A strategy with the wrong number of input specs for its node names the node."""
    import dataclasses

    nodes = tuple(dataclasses.replace(n, inputs=n.inputs[:1]) if n.name == "linear" else n
                  for n in planned.plan.nodes)
    bad = dataclasses.replace(planned.plan, nodes=nodes)
    with pytest.raises(fxpar.PlanError, match="plan node linear .* has 1 input specs, the node has 3"):
        run_passes(planned.graph, PassContext(bad), [annotate_pass])
