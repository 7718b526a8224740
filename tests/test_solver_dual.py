"""fxpar.solver.dual and the solver's route through it (issue #32 item 3: memory-free problems
whose bucket-elimination tables do not fit, the unrolled step loops of RWKV and xLSTM and
HunYuan v4's shared streams, took 25-66 s of CP-SAT at 2 layers and often ended FEASIBLE).

Checked against enumeration: the dual's bound and its per-value bounds (1) hold for every
assignment; on a tree it is exact; ``solve`` with a table cap small enough to make the DP
give up (so brute force can check the problems) returns the brute-force optimum whenever it
says OPTIMAL, and otherwise an assignment no better than its bound claims. The regression
test plans a 2-layer RWKV built from its config: proven optimal by the dual route, with no
CP-SAT model built and a bounded number of passes (not timed).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from fxpar.solver import ALL_REDUCTIONS, StrategyProblem, brute_force, reduce_problem, solve
from fxpar.solver.dual import dual_bound


def dense_problem(seed: int, n: int = 6) -> StrategyProblem:
    """``n`` nodes of 2-4 layouts, most pairs joined by a resharding-like edge: the L1
    distance of the ends' layouts after a per-edge relabelling (an op maps its input layout
    to another), times a weight; integer multiples of 1/8 (exact ties). No memory."""
    rng = np.random.default_rng(seed)
    sizes = [int(rng.integers(2, 5)) for _ in range(n)]
    where = rng.integers(0, 3, size=(4, 2))
    metric = np.abs(where[:, None] - where[None]).sum(-1) * 0.125
    cost = [list(rng.integers(0, 8, size=s) * 0.125) for s in sizes]
    edges = {}
    for j in range(1, n):
        for i in range(j):
            if rng.random() < 0.7:
                pa, pb = rng.permutation(4)[:sizes[i]], rng.permutation(4)[:sizes[j]]
                edges[(i, j)] = float(rng.integers(1, 4)) * metric[np.ix_(pa, pb)]
    return StrategyProblem(cost=cost, edges=edges)


def frustrated_problem(seed: int, n: int = 7) -> StrategyProblem:
    """A ring of ``n`` nodes (and a chord or two) whose edges penalise equal values: odd
    rings cannot satisfy every edge, and the LP relaxation is not tight there."""
    rng = np.random.default_rng(seed)
    k = int(rng.integers(2, 4))
    cost = [list(rng.integers(0, 4, size=k) * 0.125) for _ in range(n)]
    edges = {}
    for i in range(n):
        a, b = sorted((i, (i + 1) % n))
        edges[(a, b)] = np.eye(k) * float(rng.integers(2, 6)) + rng.integers(0, 2, size=(k, k)) * 0.125
    for _ in range(int(rng.integers(0, 3))):
        a, b = sorted(rng.choice(n, 2, replace=False).tolist())
        edges.setdefault((a, b), np.eye(k) * float(rng.integers(1, 4)))
    return StrategyProblem(cost=cost, edges=edges)


def tree_problem(seed: int, n: int = 9) -> StrategyProblem:
    """A random tree (each node's parent an earlier node) with random integer-eighth costs."""
    rng = np.random.default_rng(seed)
    sizes = [int(rng.integers(2, 5)) for _ in range(n)]
    cost = [list(rng.integers(0, 8, size=s) * 0.125) for s in sizes]
    edges = {}
    for j in range(1, n):
        i = int(rng.integers(0, j))
        edges[(i, j)] = rng.integers(0, 6, size=(sizes[i], sizes[j])) * 0.125
    return StrategyProblem(cost=cost, edges=edges)


def _values(red):
    """Every assignment of the classes of ``red`` with its value (units)."""
    for x in itertools.product(*(range(d) for d in red.dom)):
        yield x, red.value(list(x))


@pytest.mark.parametrize("make,seed", [(dense_problem, s) for s in range(12)]
                         + [(frustrated_problem, s) for s in range(6)])
def test_dual_bounds_every_assignment_and_every_value(make, seed):
    red = reduce_problem(make(seed), reductions=("edges",))  # keep every class
    b = dual_bound(red, rel_tol=0.0, max_iters=40)
    assert b is not None and len(b.reduced) == len(red.dom)
    best_through = [np.full(d, np.inf) for d in red.dom]
    opt = np.inf
    for x, v in _values(red):
        opt = min(opt, v)
        for c, xc in enumerate(x):
            best_through[c][xc] = min(best_through[c][xc], v)
    tol = 1e-9 * opt + 1e-6
    assert b.lower <= opt + tol
    for c in range(len(red.dom)):
        assert (b.reduced[c] >= -tol).all() and b.reduced[c].min() == 0.0
        # (1): lower + reduced cost bounds every assignment through the value
        assert (b.lower + b.reduced[c] <= best_through[c] + tol).all(), c
    assert red.value(b.x) >= opt


@pytest.mark.parametrize("seed", range(6))
def test_dual_is_exact_on_a_tree(seed):
    red = reduce_problem(tree_problem(seed), reductions=("edges",))
    b = dual_bound(red, rel_tol=0.0, max_iters=60)
    opt = min(v for _, v in _values(red))
    assert b.lower == pytest.approx(opt, rel=1e-9, abs=1e-6)
    assert red.value(b.x) == opt


def test_dual_declines_what_it_cannot_hold():
    p = dense_problem(0)
    red = reduce_problem(p, reductions=("edges",))
    assert dual_bound(red, max_entries=3) is None               # too many edge entries
    tied = StrategyProblem(cost=[[0.0, 1.0], [1.0, 0.0]], ties=[[0, 1]])
    assert dual_bound(reduce_problem(tied, reductions=())) is None  # ties kept as constraints


@pytest.mark.parametrize("make,seed", [(dense_problem, s) for s in range(40)]
                         + [(frustrated_problem, s) for s in range(20)])
def test_solve_past_the_dp_agrees_with_brute_force(make, seed):
    """max_table=2: every DP gives up (also the dual's own restricted ones unless the
    reductions leave a tree of at most 2-entry tables), so the dual route and its fallbacks
    decide; what they claim must hold."""
    p = make(seed)
    best = brute_force(p)
    s = solve(p, max_table=2, time_limit=30)
    method = s.stats["method"]
    assert p.violations(s.choice) == []
    assert s.objective >= best.objective - 1e-12
    assert s.bound <= best.objective + 1e-9
    if s.status == "OPTIMAL":
        assert s.objective == pytest.approx(best.objective, rel=1e-9, abs=1e-12), method
    if "dual" in method:
        d = s.stats["dual"]
        assert d["lower_s"] <= best.objective + 1e-9
        assert d["upper_s"] >= best.objective - 1e-12


def test_solve_takes_the_dual_route_and_proves_with_it():
    """Over the random problems above some are decided by the dual and a DP on what its
    filter kept (proven, no CP-SAT), and none of those is wrong. Without series elimination,
    which would leave most of these to the DP alone."""
    proven = 0
    for seed in range(40):
        p = dense_problem(seed)
        s = solve(p, max_table=2, time_limit=30, reductions=ALL_REDUCTIONS - {"series"})
        if s.stats["method"].endswith("dual+dp"):
            proven += 1
            assert s.status == "OPTIMAL"
            assert s.objective == pytest.approx(brute_force(p).objective, rel=1e-9, abs=1e-12)
    assert proven >= 3


def _scan_order(dom, adj, key, max_table):
    """The elimination order by a scan of every alive class per step (the reference)."""
    import math

    adj = [set(a) for a in adj]
    score = {c: key(c, adj) for c in range(len(dom))}
    order, big, total = [], 0, 0
    while score:
        best = min(score, key=lambda c: (score[c], c))
        nb = adj[best]
        size = dom[best] * math.prod(dom[d] for d in nb)
        if size > max_table:
            return None, size, total
        big, total = max(big, size), total + size
        for d in nb:
            adj[d] |= nb
            adj[d].discard(d)
            adj[d].discard(best)
        del score[best]
        adj[best] = set()
        order.append(best)
        for d in set(nb).union(*(adj[d] for d in nb)):
            if d in score:
                score[d] = key(d, adj)
    return order, big, total


@pytest.mark.parametrize("seed", range(20))
def test_heap_elimination_order_is_the_scan_order(seed):
    import math

    from fxpar.solver.dp import _greedy_order

    rng = np.random.default_rng(seed)
    n = int(rng.integers(5, 40))
    dom = [int(rng.integers(1, 6)) for _ in range(n)]
    adj = [set() for _ in range(n)]
    for _ in range(int(rng.integers(n, 3 * n))):
        a, b = rng.choice(n, 2, replace=False).tolist()
        adj[a].add(b)
        adj[b].add(a)

    def table(c, a):
        return math.prod(dom[d] for d in a[c])

    def fill(c, a):
        nb = sorted(a[c])
        return (sum(1 for i, x in enumerate(nb) for y in nb[:i] if y not in a[x]), table(c, a))

    for key in (fill, table):
        for cap in (10**3, 10**18):
            assert _greedy_order(dom, adj, key, cap) == _scan_order(dom, adj, key, cap)


def _tiny_rwkv():
    import torch
    import transformers

    cfg = transformers.RwkvConfig(vocab_size=128, hidden_size=64, attention_hidden_size=64,
                                  intermediate_size=128, num_hidden_layers=2, context_length=64,
                                  use_cache=False)
    torch.manual_seed(0)
    model = transformers.RwkvForCausalLM(cfg).float().train()
    ids = torch.randint(0, 120, (4, 16), generator=torch.Generator().manual_seed(1))
    return model, ids


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_unrolled_step_loop_is_proven_without_cp_sat(monkeypatch):
    """RWKV's WKV recurrence unrolled over 16 steps (the loop's inputs and state meet every
    step; the DP's tables would hold ~10^12 entries): the dual route proves the optimum and
    no CP-SAT model is built (before: ~300k Booleans, FEASIBLE after the 60 s limit)."""
    import fxpar
    import fxpar.solver.ilp as ilp

    built = []
    real = ilp._Model

    class Counting(real):
        def __init__(self, red):
            built.append(len(red.dom))
            super().__init__(red)

    monkeypatch.setattr(ilp, "_Model", Counting)
    model, ids = _tiny_rwkv()
    p = fxpar.plan(model, fxpar.Cluster.local(4), (ids,), {"labels": ids}, plan="auto",
                   mesh={"dp": 2, "tp": 2})
    st = p.plan.stats
    assert p.plan.status == "OPTIMAL" and st["gap"] == 0.0
    assert st["solve_method"].endswith("dual+dp"), st["solve_method"]
    assert built == []                                   # CP-SAT never saw the problem
    d = p.solution.stats["dual"]
    assert d["iters"] <= 200 and d["rungs"] <= 4
    assert d["kept"] < d["values"]
