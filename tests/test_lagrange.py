"""Lagrangian DP bounds with branch and bound (fxpar.solver.bounds.lagrangian_bound) and the
float-unary bucket elimination under it, against enumeration on small problems."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from fxpar.solver import StrategyProblem, brute_force, reduce_problem, solve
from fxpar.solver.bounds import lagrangian_bound
from fxpar.solver.dp import eliminate
from fxpar.solver.heuristic import feasible

MiB = 2**20


def knapsack_problem(seed: int, points: int = 1) -> StrategyProblem:
    """4-7 nodes with 2-4 strategies, random edges (cycles included), memory that trades
    against cost (faster strategies are larger, as sharding less is), ``points`` liveness
    points, and a budget between the smallest and the largest footprint, so memory binds."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(4, 8))
    sizes = [int(rng.integers(2, 5)) for _ in range(n)]
    cost, mem = [], []
    for s in sizes:
        m = rng.integers(0, 9, size=s)
        cost.append(list((12 - m + rng.integers(0, 4, size=s)) * 0.125))
        mem.append(list(m * MiB))
    edges = {(i, j): rng.integers(0, 5, size=(sizes[i], sizes[j])) * 0.125
             for j in range(1, n) for i in range(j) if rng.random() < 0.45}
    live = [sorted(set(rng.choice(n, size=int(rng.integers(2, n + 1)), replace=False).tolist()))
            for _ in range(points)]
    lo = max(sum(min(mem[i]) for i in lv) for lv in live)
    hi = max(sum(max(mem[i]) for i in lv) for lv in live)
    budget = int(lo + rng.uniform(0.2, 0.8) * (hi - lo))
    return StrategyProblem(cost=cost, mem=mem, edges=edges, live=live, budget=budget)


def class_optimum(red):
    vals = [red.value(list(x)) for x in itertools.product(*[range(d) for d in red.dom])
            if feasible(red, list(x))]
    return min(vals) if vals else None


@pytest.mark.slow
@pytest.mark.parametrize("points", [1, 2])
def test_lagrangian_bound_brackets_the_enumerated_optimum(points):
    """lower <= OPT <= upper, x is feasible with value upper; exact (gap 0) and proven means
    upper == OPT. Both the plain dual and its branching are exercised."""
    proven = branched = 0
    for seed in range(60):
        red = reduce_problem(knapsack_problem(seed, points), reductions=())
        opt = class_optimum(red)
        b = lagrangian_bound(red)
        assert b is not None
        if opt is None:
            assert b.upper is None
            continue
        assert b.lower <= opt
        if b.upper is not None:
            assert feasible(red, b.x) and red.value(b.x) == b.upper >= opt
        if b.proven:
            assert b.upper == opt
            proven += 1
        branched += b.nodes > 1
    assert proven >= 40 and branched >= 10, (proven, branched)


@pytest.mark.slow
def test_a_gap_stops_early_and_stays_within_it():
    """With gap g, a proven answer is within g of the optimum of the whole objective
    (offset included), and a looser gap never takes more nodes."""
    for seed in range(100, 140):
        red = reduce_problem(knapsack_problem(seed), reductions=())
        opt = class_optimum(red)
        if opt is None:
            continue
        exact, loose = lagrangian_bound(red), lagrangian_bound(red, gap=0.05)
        assert loose.nodes <= exact.nodes
        if loose.proven:
            whole = red.offset * red.scale
            assert loose.upper - opt <= 0.05 * (whole + loose.upper) + 1
            assert loose.lower <= opt


@pytest.mark.slow
def test_solve_with_a_gap_is_within_it_of_brute_force():
    """solve() with a requested gap: the Lagrangian DP answers (method lagrange-dp) when it
    proves the gap; either way the objective is within the gap of brute force and the
    reported bound is below the optimum."""
    methods = []
    for seed in range(200, 240):
        p = knapsack_problem(seed)
        try:
            best = brute_force(p)
        except Exception:
            continue
        s = solve(p, filter_gap=0.05, params={"relative_gap_limit": 0.05})
        assert p.violations(s.choice) == []
        assert s.objective <= best.objective * 1.05 + 1e-12
        assert s.bound <= best.objective + 1e-12
        methods.append(s.stats["method"])
        e = solve(p)                                   # exact: optimal whatever the path
        assert e.status == "OPTIMAL"
        assert e.objective == pytest.approx(best.objective, rel=1e-9, abs=1e-12)
    assert sum("lagrange-dp" in m for m in methods) >= 5, methods


def test_eliminate_with_float_unaries_is_the_enumerated_minimum():
    rng = np.random.default_rng(5)
    for _ in range(30):
        p = knapsack_problem(int(rng.integers(0, 10**6)))
        red = reduce_problem(p, reductions=())
        u = [rng.uniform(0, 1e9, size=d) for d in red.dom]
        u[0][0] = np.inf                              # a value not allowed
        x, val = eliminate(red, unary=u)
        brute = min(sum(u[c][x_[c]] for c in range(len(red.dom)))
                    + sum(float(a[x_[c], x_[d]]) for c, d, a in red.edges)
                    for x_ in itertools.product(*[range(d) for d in red.dom]))
        assert val == pytest.approx(brute, rel=1e-12)
        assert x[0] != 0 or red.dom[0] == 1
