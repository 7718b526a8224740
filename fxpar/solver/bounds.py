r"""Lower bounds and bound-based domain filtering of a reduced problem (large domains).

On a 4-D mesh a class has 600-1700 values (``S(d)``/``R``/``P`` per axis), dead-end
elimination removes few of them, bucket elimination's tables (``|D|³`` for a residual
connection) do not fit, and CP-SAT's marginal edge encoding has ``|D_a|·|D_b|`` Booleans per
edge. Most values are far from optimal, though, and a cheap *lower bound conditioned on one
value* proves it.

Spanning-tree bound
-------------------
After reparametrisation every edge matrix is ``≥ 0`` (:mod:`fxpar.solver.reduce`), so dropping
edges can only lower the objective. Keep a maximum-weight spanning forest ``T`` of the class
graph (weight: the edge's largest entry) and drop the other edges; the forest is solved exactly
by min-sum message passing (two passes, ``Σ_(c,d)∈T |D_c|·|D_d|`` operations), which also gives
every *min-marginal*::

    μ_c(v) = min { F_T(x) : x_c = v }  ≤  min { F(x) : x_c = v }

With memory points the objective gets ``Σ_t λ_t (load_t(x) - (budget - const_t))`` for
``λ ≥ 0`` (a Lagrangian relaxation: the added term is ``≤ 0`` on every feasible ``x``), so
``μ_c(v)`` still bounds every *feasible* assignment with ``x_c = v``.

Filtering (reduced-cost fixing)
-------------------------------
Given an upper bound ``UB`` (the value of a feasible assignment), value ``v`` of class ``c``
is dropped when ``μ_c(v) > UB``: no assignment through it is as good as the one in hand. Every
optimal assignment survives (its values have ``μ ≤ OPT ≤ UB``), so the optimum of the
filtered problem is the optimum of the original: exact. ``gap > 0`` drops ``μ_c(v) >
UB/(1+gap)`` instead (the upper bound's own values are kept): either an optimum survives,
or ``UB ≤ (1+gap)·OPT``; the filtered optimum (``≤ UB``) is then within ``gap`` of the
optimum (the offset of the reduced problem is ``≥ 0``).

The upper bound: the forest's own minimiser, improved by iterated conditional modes
(:func:`fxpar.solver.heuristic.greedy` started there), made feasible by its memory repair.

>>> import numpy as np
>>> from fxpar.solver import StrategyProblem, reduce_problem
>>> # a 3-cycle: the forest keeps two of its edges
>>> p = StrategyProblem(cost=[[0.0, 1.0, 5.0], [0.0, 2.0, 5.0], [1.0, 0.0, 5.0]],
...                     edges={(0, 1): [[0, 3, 3], [3, 0, 3], [3, 3, 0]],
...                            (1, 2): [[0, 3, 3], [3, 0, 3], [3, 3, 0]],
...                            (0, 2): [[0, 1, 1], [1, 0, 1], [1, 1, 0]]})
>>> red = reduce_problem(p, reductions=("edges",))
>>> b = forest_bound(red)
>>> b.lower <= red.value(b.x)
True
>>> keep = filter_domains(red, b, red.value(b.x))
>>> [k.tolist() for k in keep]    # only (0, 0, 0) is within the bound: solved
[[0], [0], [0]]
>>> b.lower == red.value(b.x)     # the dropped (0, 2) edge costs 0 at the optimum
True
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fxpar.solver.reduce import Reduced

__all__ = ["ForestBound", "Filtered", "forest_bound", "filter_domains", "spanning_forest",
           "bound_and_filter"]


@dataclass
class ForestBound:
    """Result of :func:`forest_bound` (all in the reduced problem's integer units, float64).

    ``lower``: ``min F_T`` (a lower bound of the problem's optimum, offset excluded);
    ``marginals[c][v] = μ_c(v)``; ``x``: a minimiser of ``F_T``; ``tree``: indices into
    ``red.edges`` of the kept edges; ``lam``: the multipliers used per point.
    """

    lower: float
    marginals: list[np.ndarray]
    x: list[int]
    tree: list[int]
    lam: np.ndarray


def spanning_forest(red: Reduced) -> list[int]:
    """Indices into ``red.edges`` of a maximum spanning forest by largest entry (Kruskal;
    ties by index, so deterministic)."""
    parent = list(range(len(red.dom)))

    def find(c: int) -> int:
        while parent[c] != c:
            parent[c] = parent[parent[c]]
            c = parent[c]
        return c

    order = sorted(range(len(red.edges)), key=lambda e: (-int(red.edges[e][2].max()), e))
    keep = []
    for e in order:
        a, b = find(red.edges[e][0]), find(red.edges[e][1])
        if a != b:
            parent[max(a, b)] = min(a, b)
            keep.append(e)
    return sorted(keep)


def _unaries(red: Reduced, lam: np.ndarray | None) -> list[np.ndarray]:
    u = [np.asarray(c, dtype=np.float64) for c in red.cost]
    if lam is not None:
        for (_, terms, _), w in zip(red.points, lam):
            if w > 0:
                for c, v in terms:
                    u[c] = u[c] + w * v
    return u


def forest_bound(red: Reduced, lam: np.ndarray | None = None,
                 tree: list[int] | None = None) -> ForestBound:
    """Min-marginals of the forest relaxation (module docstring) with multipliers ``lam``
    (one per ``red.points`` entry, ``≥ 0``; ``None``: memory ignored)."""
    n = len(red.dom)
    tree = spanning_forest(red) if tree is None else tree
    unary = _unaries(red, lam)
    const = 0.0
    if lam is not None:
        for (c0, _, _), w in zip(red.points, lam):
            const -= float(w) * float(red.budget - c0)
    nb: list[list[tuple[int, np.ndarray]]] = [[] for _ in range(n)]
    for e in tree:
        c, d, a = red.edges[e]
        a = a.astype(np.float64)
        nb[c].append((d, a))        # a[x_c, x_d]
        nb[d].append((c, a.T))
    # roots: lowest class of each component; BFS order
    seen = [False] * n
    parent = [-1] * n
    pmat: list[np.ndarray | None] = [None] * n   # matrix [x_c, x_parent]
    order: list[int] = []
    roots = []
    for r in range(n):
        if seen[r]:
            continue
        roots.append(r)
        seen[r] = True
        queue = [r]
        k = 0
        while k < len(queue):
            c = queue[k]
            k += 1
            order.append(c)
            for d, a in nb[c]:
                if not seen[d]:
                    seen[d] = True
                    parent[d] = c
                    pmat[d] = a.T
                    queue.append(d)
    up = [np.zeros(0)] * n           # message c -> parent(c), over x_parent
    belief = [u.copy() for u in unary]
    for c in reversed(order):        # leaves first
        if parent[c] >= 0:
            up[c] = (belief[c][:, None] + pmat[c]).min(axis=0)
            belief[parent[c]] = belief[parent[c]] + up[c]
    full = [np.zeros(0)] * n
    for c in order:                  # root first
        if parent[c] < 0:
            full[c] = belief[c]
        else:
            p = parent[c]
            down = (full[p] - up[c])[None, :] + pmat[c]     # [x_c, x_p]
            full[c] = belief[c] + down.min(axis=1)
    comp_min = {}
    for r in roots:
        comp_min[r] = float(full[r].min())
    total = const + sum(comp_min.values())
    root_of = [0] * n
    for c in order:
        root_of[c] = c if parent[c] < 0 else root_of[parent[c]]
    marg = [full[c] + (total - comp_min[root_of[c]]) for c in range(n)]
    x = [0] * n
    for c in order:
        if parent[c] < 0:
            x[c] = int(np.argmin(full[c]))
        else:
            x[c] = int(np.argmin(belief[c] + pmat[c][:, x[parent[c]]]))
    return ForestBound(total, marg, x, tree,
                       np.zeros(len(red.points)) if lam is None else np.asarray(lam, float))


def filter_domains(red: Reduced, bound: ForestBound, upper: float,
                   gap: float = 0.0) -> list[np.ndarray]:
    """Per class, the values ``v`` with ``μ_c(v) ≤ upper/(1+gap)`` (module docstring), as
    sorted index arrays. A margin of ``1e-9·upper`` (plus one unit) absorbs float round-off
    of the multipliers, so an optimal value is never dropped."""
    limit = upper / (1.0 + gap) + 1e-9 * abs(upper) + 1.0
    keep = []
    for m in bound.marginals:
        k = np.flatnonzero(m <= limit)
        if k.size == 0:  # cannot happen with a feasible upper bound; keep the best value
            k = np.array([int(np.argmin(m))])
        keep.append(k)
    return keep


@dataclass
class Filtered:
    """What :func:`bound_and_filter` found: ``keep[c]`` (value indices of class ``c`` that may
    still be optimal), the best lower bound ``lower`` and the feasible assignment ``x`` of
    value ``upper`` (units, offset excluded; ``x`` is ``None`` when none was found, and then
    nothing is filtered), the multiplier rounds run."""

    keep: list[np.ndarray]
    lower: float
    upper: float | None
    x: list[int] | None
    rounds: int


def bound_and_filter(red: Reduced, gap: float = 0.0, rounds: int = 30) -> Filtered:
    """Forest bound, an upper bound, and the values that survive (module docstring).

    Without memory points: one forest pass and one descent. With one point: bisection on its
    multiplier for the value where the forest minimiser's load meets the budget (the 1-D
    dual's optimum); with several: subgradient ascent (Polyak steps towards the best upper
    bound); at most ``rounds`` passes;
    every pass's marginals are valid bounds, so a value goes when *any* pass proves it bad
    (the running maximum of the marginals is used). The upper bound is the best feasible
    descent (:func:`fxpar.solver.heuristic.greedy`) started from each pass's minimiser.
    """
    from fxpar.solver.heuristic import _loads, feasible, greedy

    tree = spanning_forest(red)
    best_x, best_ub = None, None

    def try_x(x0):
        nonlocal best_x, best_ub
        x = greedy(red, start=x0)
        if feasible(red, x):
            v = red.value(x)
            if best_ub is None or v < best_ub:
                best_x, best_ub = x, v

    has_mem = red.budget is not None and bool(red.points)
    lam = np.zeros(len(red.points)) if has_mem else None
    b = forest_bound(red, lam, tree)
    marg = [m.copy() for m in b.marginals]
    lower = b.lower
    try_x(b.x)
    done = 1
    def take(lam_):
        nonlocal b, lower, done
        b = forest_bound(red, lam_, tree)
        done += 1
        lower = max(lower, b.lower)
        for c in range(len(marg)):
            np.maximum(marg[c], b.marginals[c], out=marg[c])
        over = _loads(red, b.x) - red.budget
        if (over <= 0).all() or done % 5 == 0:
            try_x(b.x)
        return over

    if has_mem and len(red.points) == 1:
        # one point: the forest minimiser's load falls as lambda grows; bisect for the
        # lambda where it crosses the budget (the optimum of the 1-D concave dual)
        over = _loads(red, b.x) - red.budget
        if over[0] > 0:
            lo, hi = 0.0, None
            lam1 = max(float(best_ub or b.lower) * 0.01, 1.0) / float(over[0])
            while done < rounds // 2:
                if take(np.array([lam1]))[0] > 0:
                    lo, lam1 = lam1, lam1 * 8.0
                else:
                    hi = lam1
                    break
            if hi is not None:
                while done < rounds and hi - lo > 1e-6 * hi:
                    mid = 0.5 * (lo + hi)
                    if take(np.array([mid]))[0] > 0:
                        lo = mid
                    else:
                        hi = mid
    elif has_mem:
        for _ in range(rounds - 1):
            g = _loads(red, b.x).astype(np.float64) - red.budget   # bytes over budget
            g = np.where((lam <= 0) & (g < 0), 0.0, g)
            if not g.any() or best_ub is not None and lower >= best_ub:
                break
            target = best_ub if best_ub is not None else b.lower * 1.1 + 1.0
            step = max(target - b.lower, 1.0) / float(g @ g)
            lam = np.maximum(0.0, lam + step * g)
            take(lam)
    if best_ub is None:
        return Filtered([np.arange(d) for d in red.dom], lower, None, None, done)
    bound = ForestBound(lower, marg, best_x, tree, lam if lam is not None else np.zeros(0))
    keep = filter_domains(red, bound, float(best_ub), gap)
    if gap > 0:  # the upper bound's own values stay: the filtered problem contains it
        keep = [np.union1d(k, [best_x[c]]) for c, k in enumerate(keep)]
    return Filtered(keep, lower, float(best_ub), best_x, done)
