"""``Planned.why(node)``: alternatives priced against the chosen plan, checked by brute force,
and the reductions' removal log (``reduce_problem(..., explain=True)``)."""

from __future__ import annotations


import numpy as np
import pytest
import torch

import fxpar
from fxpar.errors import PlanError
from fxpar.planner import PlannerOptions, plan_and_keep
from fxpar.planner.explain import why
from fxpar.solver import StrategyProblem, brute_force, reduce_problem

from test_planner import mlp_graph, toy_strategies


@pytest.fixture(scope="module")
def a100():
    return fxpar.Cluster.preset("dgx-a100")


def _objective(prob, choice):
    nc, ec, _ = prob.evaluate(choice)
    return nc + ec


@pytest.mark.parametrize("node", ["linear", "gelu", "p_fc1_weight", "x"])
def test_alternatives_match_brute_force(a100, node):
    """Δ of every candidate = objective with only that node switched − the optimum; the best
    alternative (second-best strategy of the node) is the brute-force one."""
    gm = mlp_graph(4096, 64, 128)
    plan, bp, sol = plan_and_keep(gm, fxpar.Mesh(a100, tp=4), strategies=toy_strategies)
    prob = bp.problem
    assert sol.objective == pytest.approx(brute_force(prob).objective, rel=1e-12)
    i = prob.index(node)
    base = _objective(prob, sol.choice)
    deltas = {}
    for k in range(prob.cost[i].size):
        c = list(sol.choice)
        c[i] = k
        deltas[k] = _objective(prob, c) - base
    w = why(bp, sol.choice, node, top=100)
    assert w.chosen.index == sol.choice[i] and w.chosen.status == "chosen"
    assert w.num_candidates == prob.cost[i].size == len(w.alternatives) + 1
    for a in w.alternatives:
        assert a.delta == pytest.approx(deltas[a.index], abs=1e-15)
        assert a.delta >= -1e-15  # the optimum: no single switch improves it
        assert a.node_cost == pytest.approx(float(prob.cost[i][a.index]))
    second = min((k for k in deltas if k != sol.choice[i]), key=lambda k: (deltas[k], k))
    assert w.alternatives[0].index == second
    assert [a.delta for a in w.alternatives] == sorted(a.delta for a in w.alternatives)
    # neighbour edges under the neighbours' chosen strategies
    chosen_edges = sum(float(r[sol.choice[a], sol.choice[b]]) for a, b, r in prob.edges if i in (a, b))
    assert w.chosen.edge_cost == pytest.approx(chosen_edges, abs=1e-15)
    text = str(w)
    assert node in text and "chosen" in text


def test_removed_candidates_name_their_reduction(a100):
    """Every candidate the reductions removed says which one (a pin here); the candidates
    they keep still hold an optimum of the full problem (brute force)."""
    gm = mlp_graph(4096, 64, 128)
    plan, bp, sol = plan_and_keep(gm, fxpar.Mesh(a100, tp=4), strategies=toy_strategies,
                                  pins={"fc2.weight": "S(1)"})
    prob = bp.problem
    red = reduce_problem(prob, explain=True)
    kinds = {r.reduction for d in red.removed.values() for r in d.values()}
    assert kinds <= {"pin", "ties", "prune", "merge"} and {"pin", "prune"} <= kinds
    w = why(bp, sol.choice, "p_fc2_weight", top=100)
    assert {a.removal.reduction for a in w.alternatives} == {"pin"}
    assert all("pin" in a.why for a in w.alternatives)
    kept = {i: sorted(set(range(prob.cost[i].size)) - set(red.removed.get(i, {})))
            for i in range(prob.n)}
    only_kept = StrategyProblem(cost=prob.cost, mem=prob.mem, edges=prob.edges, live=prob.live,
                                budget=prob.budget, pins=kept, names=prob.names)
    assert brute_force(only_kept).objective == pytest.approx(brute_force(prob).objective,
                                                             rel=1e-12)
    # the log is not vacuous: candidates were removed
    assert any(len(v) < prob.cost[i].size for i, v in kept.items())


def test_explain_does_not_change_the_reduction():
    rng = np.random.default_rng(0)
    for _ in range(20):
        n = 5
        cost = [rng.random(rng.integers(2, 5)) for _ in range(n)]
        edges = {(a, a + 1): rng.random((cost[a].size, cost[a + 1].size)) for a in range(n - 1)}
        edges[(0, n - 1)] = rng.random((cost[0].size, cost[-1].size))
        p = StrategyProblem(cost=cost, edges=edges, pins={2: [0, 1]},
                            mem=[rng.integers(0, 100, c.size) for c in cost], live=[range(n)],
                            budget=300)
        a, b = reduce_problem(p), reduce_problem(p, explain=True)
        assert a.dom == b.dom and a.offset == b.offset and a.removed == {}
        assert all((x == y).all() for x, y in zip(a.cost, b.cost))
        assert [(c, f.tolist()) for c, f in a.node_map] == [(c, f.tolist()) for c, f in b.node_map]
        # what survives per node + what was removed = all candidates
        for i in range(n):
            c, f = b.node_map[i]
            kept = set(f.tolist())
            assert kept | set(b.removed.get(i, {})) == set(range(cost[i].size))
            assert not kept & set(b.removed.get(i, {}))


def test_over_budget_alternative(a100):
    """With a memory budget that binds, an alternative whose switch breaks it says so."""
    gm = mlp_graph(4096, 64, 128)
    mesh = fxpar.Mesh(a100, tp=4)
    free = plan_and_keep(gm, mesh, strategies=toy_strategies)[0]
    plan, bp, sol = plan_and_keep(gm, mesh, strategies=toy_strategies,
                                  options=PlannerOptions(memory_budget=int(free.memory * 0.9)))
    # a budget between this plan's peak and the largest one-switch peak
    top = max(a.peak for nd in bp.problem.names for a in why(bp, sol.choice, nd, top=100).alternatives)
    assert top > plan.memory
    plan, bp, sol = plan_and_keep(gm, mesh, strategies=toy_strategies,
                                  options=PlannerOptions(memory_budget=(plan.memory + top) // 2))
    rows = [a for nd in bp.problem.names for a in why(bp, sol.choice, nd, top=100).alternatives]
    over = [a for a in rows if a.status == "over budget"]
    assert over and all(a.peak > bp.problem.budget and "memory budget" in a.why for a in over)
    assert all(a.peak <= bp.problem.budget for a in rows if a.status == "kept")


def test_planned_why_api(a100):
    from examples.models import MLP

    p = fxpar.plan(MLP(8, 16, 4), a100, example_inputs=(torch.randn(2, 8),), mesh={"dp": 2})
    node = next(n for n in p.graph.graph.nodes if n.name == "linear_1")
    w = p.why(node, top=2)
    assert w.node == "linear_1" and len(w.alternatives) == 2
    with pytest.raises(PlanError, match="no node 'nope'"):
        p.why("nope")
    loaded = fxpar.Planned(p.plan, p.graph)
    with pytest.raises(PlanError, match="why\\(\\) needs the planning problem"):
        loaded.why("linear")
