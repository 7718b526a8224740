"""Plan type: explain(), JSON round trip, hash, baselines and the api entry points."""

from __future__ import annotations

import pytest
import torch

import fxpar
from fxpar.api import compile, plan
from fxpar.errors import FxparError, PlanError
from fxpar.plan import Plan

from test_planner import mlp_graph, toy_strategies


@pytest.fixture(scope="module")
def a100():
    return fxpar.Cluster.preset("dgx-a100")


@pytest.fixture(scope="module")
def mlp_plan(a100):
    gm = mlp_graph(8, 1024, 4096)
    return plan(None, a100, graph=gm, mesh={"tp": 4}, strategies=toy_strategies,
                memory_budget=(1024 * 4096 * 2) * 8)


def test_explain_has_layers_and_totals(mlp_plan):
    text = mlp_plan.explain()
    lines = text.splitlines()
    assert lines[0].startswith("plan auto on Mesh(tp=4)")
    assert any(l.split()[:2] == ["fc1", "linear=col"] for l in lines)
    assert any(l.split()[:2] == ["fc2", "linear=row"] for l in lines)
    assert any(l.strip().startswith("total") for l in lines)
    assert "communication: all_reduce tp" in text
    assert "unsharded ops (replicate-only fallback): none" in text


def test_json_round_trip_and_hash(mlp_plan):
    p = mlp_plan.plan
    q = Plan.from_json(p.to_json())
    assert q == p and q.hash == p.hash
    assert q.explain() == p.explain()
    assert q.node("linear").to_strategy().name == "col"
    assert q.cluster() == fxpar.Cluster.preset("dgx-a100")
    assert len(p.hash) == 64
    with pytest.raises(PlanError):
        Plan.from_json('{"nodes": []}')


def test_baselines_share_the_cost_model(a100):
    gm = mlp_graph(4096, 256, 1024)
    kw = dict(graph=gm, strategies=toy_strategies, mesh={"dp": 2, "tp": 4})
    auto = plan(None, a100, **kw).plan
    got = {}
    for kind in ("dp", "zero3", "megatron"):
        got[kind] = plan(None, a100, plan=kind, **kw).plan
        assert got[kind].kind == kind
        assert auto.time <= got[kind].time * (1 + 1e-9)
    assert got["dp"].node("p_fc1_weight").outputs == ("RR",)
    assert got["zero3"].node("p_fc1_weight").outputs == ("S(0)S(0)",)
    z3 = got["zero3"]
    kinds = {s.kind for _, s in z3.steps()}
    assert {"all_gather", "reduce_scatter"} <= kinds
    # zero3 gathers each weight twice (fwd + bwd) and reduce-scatters its grad
    fc1 = [(e.direction, s.kind) for e, s in z3.steps() if e.producer == "p_fc1_weight"]
    assert fc1.count(("fwd", "all_gather")) == 2 and fc1.count(("bwd", "all_gather")) == 2
    assert z3.memory < got["dp"].memory
    mg = got["megatron"]
    assert mg.node("p_fc1_weight").outputs == ("RS(0)",) and mg.node("p_fc2_weight").outputs == ("RS(1)",)


def test_auto_mesh_choice_and_default_meshes(a100):
    gm = mlp_graph(4096, 256, 1024)
    res = plan(None, a100, graph=gm, strategies=toy_strategies)
    assert len(res.tried) >= 3
    assert res.plan.time == min(t for _, t in res.tried)
    assert plan(None, a100, graph=gm, plan="megatron", strategies=toy_strategies).plan.mesh["axis_names"] == ("dp", "tp")


def test_compile_emit_false_and_unknown_plan(a100):
    from examples.models import MLP

    res = compile(MLP(8, 16, 4), a100, (torch.randn(2, 8),), mesh={"dp": 2}, emit=False)
    assert isinstance(res.plan, Plan) and res.graph is not None
    with pytest.raises(PlanError, match="unknown plan"):
        plan(MLP(8, 16, 4), a100, (torch.randn(2, 8),), plan="pipedream")
