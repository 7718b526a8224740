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
           "bound_and_filter", "LagrangeBound", "lagrangian_bound"]


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


@dataclass
class LagrangeBound:
    """What :func:`lagrangian_bound` found (integer units, offset excluded): ``lower`` (a
    proven lower bound of every feasible assignment's value; ``inf``: the search proved that
    none fits the budget), the best feasible assignment
    ``x`` and its value ``upper`` (``None``, ``None`` when none was found), the DP passes and
    search nodes run, and whether ``upper`` is proven within the requested gap."""

    lower: int | float
    upper: int | None
    x: list[int] | None
    rounds: int
    nodes: int = 1
    proven: bool = False


class _Dual:
    """The Lagrangian dual of a reduced problem restricted to allowed values (``mask``):
    ``L(λ) = min_(x allowed) F(x) + Σ_t λ_t (const_t + load_t(x) - budget)`` by bucket
    elimination with ``cost + λ·mem`` unaries (``+inf`` on the values not allowed)."""

    def __init__(self, red: Reduced, order: list[int]):
        from fxpar.solver.heuristic import feasible, greedy

        self.red, self.order = red, order
        self.caps = np.array([red.budget - const for const, _, _ in red.points], np.float64)
        self.passes = 0
        self.best_x: list[int] | None = None
        self.best_ub: int | None = None
        self._feasible, self._greedy = feasible, greedy

    def offer(self, x: list[int]) -> None:
        """Keep ``x`` (and its polish by iterated conditional modes) if feasible and best."""
        for y in (x, self._greedy(self.red, start=x)):
            if self._feasible(self.red, y):
                v = self.red.value(y)
                if self.best_ub is None or v < self.best_ub:
                    self.best_x, self.best_ub = list(y), v

    def at(self, lam: np.ndarray, block: list[np.ndarray]) -> tuple[float, np.ndarray]:
        """``(L(λ) minus a round-off margin, load - budget of the minimiser per point)``."""
        from fxpar.solver.dp import eliminate
        from fxpar.solver.heuristic import _loads

        u = [a + b for a, b in zip(_unaries(self.red, lam), block)]
        x, val = eliminate(self.red, unary=u, order=self.order)
        self.passes += 1
        over = _loads(self.red, x) - self.red.budget
        if (over <= 0).all():
            self.offer(x)
        if not lam.any():   # integer sums below 2^53: exact in float64
            return val, over
        # float round-off of λ·mem: the margin keeps it a bound; values are integers (ceil)
        pen = float(lam @ self.caps)
        return float(np.ceil(val - pen - 1e-9 * (abs(val) + pen) - 1.0)), over

    def bound(self, mask: list[np.ndarray], rounds: int, stop_above: float = np.inf) -> float:
        """The best ``L(λ)`` found in at most ``rounds`` passes (``-inf``: nothing allowed,
        ``+inf``: no allowed assignment fits the budget), stopping once it exceeds
        ``stop_above``. One point: bisection on ``λ`` for where the minimiser's load crosses
        the budget (the concave 1-D dual's maximum); several: projected subgradient steps."""
        red = self.red
        mem_min = [const + sum(float(v[m].min()) for c, v in terms for m in [mask[c]])
                   for const, terms, _ in red.points]
        if any(mm > red.budget for mm in mem_min):
            return np.inf     # even the smallest allowed footprint is over: infeasible
        block = [np.where(m, 0.0, np.inf) for m in mask]
        lam = np.zeros(len(red.points))
        best, over = self.at(lam, block)
        n = 1
        if len(red.points) == 1 and over[0] > 0:
            lo, hi = 0.0, None
            ref = self.best_ub if self.best_ub is not None else abs(best)
            lam1 = max(float(ref) * 0.01, 1.0) / float(over[0])
            while n < rounds and best <= stop_above:
                v, o = self.at(np.array([lam1]), block)
                best, n = max(best, v), n + 1
                if o[0] > 0:
                    lo, lam1 = lam1, lam1 * 8.0
                else:
                    hi = lam1
                    break
            while hi is not None and n < rounds and hi - lo > 1e-9 * hi and best <= stop_above:
                mid = 0.5 * (lo + hi)
                v, o = self.at(np.array([mid]), block)
                best, n = max(best, v), n + 1
                if o[0] > 0:
                    lo = mid
                else:
                    hi = mid
        elif len(red.points) > 1:
            while n < rounds and best <= stop_above:
                g = np.where((lam <= 0) & (over < 0), 0.0, over.astype(np.float64))
                if not g.any():
                    break
                target = self.best_ub if self.best_ub is not None else abs(best) * 1.1 + 1.0
                lam = np.maximum(0.0, lam + max(target - best, 1.0) / float(g @ g) * g)
                v, over = self.at(lam, block)
                best, n = max(best, v), n + 1
        return best


def lagrangian_bound(red: Reduced, gap: float = 0.0, rounds: int = 40,
                     start: list[int] | None = None, max_nodes: int = 200) -> LagrangeBound | None:
    r"""Memory by Lagrange multipliers, the rest exactly, inside a branch and bound.

    **Bound.** Bucket elimination (:func:`fxpar.solver.dp.eliminate`) of
    ``F(x) + Σ_t λ_t (load_t(x) - budget)`` over the whole class graph (no edge dropped,
    unlike :func:`forest_bound`), for ``λ ≥ 0``::

        L(λ) = min_x  F(x) + Σ_t λ_t (const_t + Σ_(c,v)∈terms_t v[x_c] - budget)  ≤  OPT

    (the added term is ``≤ 0`` at every feasible ``x``), maximised over ``λ`` in at most
    ``rounds`` DP passes (:class:`_Dual`). Every minimiser that fits the budget, polished by
    :func:`fxpar.solver.heuristic.greedy`, is an upper bound, as is ``start`` if feasible.

    **Branching.** A knapsack's dual leaves a gap when a few classes hold most of the memory
    (a tied class of 32 blocks): a node whose bound is below the incumbent splits the class
    with the widest memory range among its allowed values into one child per memory level
    (the values with that footprint); a child whose smallest footprint is over the budget is
    infeasible, one whose bound reaches the incumbent is pruned. Nodes are taken lowest bound
    first, so ``lower`` (the least bound of the open and pruned nodes) only rises. Stops when
    ``upper - lower ≤ gap · (offset·scale + upper)`` (the gap *of the whole objective*,
    offset included, as :class:`~fxpar.solver.Solution` reports it), or no node is left
    (``lower = upper``: optimal), or after ``max_nodes`` nodes; ``proven`` says whether the
    gap was met. ``None`` when the DP does not apply (tables over the cap, ties kept as
    constraints) or there is no memory point.

    Values are integer units, so a bound is rounded up: ``⌈L(λ) - margin⌉`` with a margin of
    ``1e-9·(|L| + λ·cap) + 1`` unit for the float round-off of ``λ·mem`` (none at ``λ = 0``:
    integer sums below ``2^53`` are exact in float64). A node where every class has one
    footprint has no knapsack left: its ``L(0)`` is its optimum.

    >>> from fxpar.solver import StrategyProblem, reduce_problem
    >>> # two nodes, value 1 is faster and larger; the budget fits one large value only
    >>> p = StrategyProblem(cost=[[3.0, 1.0], [3.0, 2.0]], mem=[[1, 4], [1, 4]],
    ...                     live=[{0, 1}], budget=5)
    >>> red = reduce_problem(p, reductions=())
    >>> b = lagrangian_bound(red)
    >>> red.decode(b.x)            # the optimum, 1 + 3 s at 5 B (both fast ones need 8 B)
    (1, 0)
    >>> # L(λ) = min(6 - 3λ, 4, 5, 3 + 3λ) in seconds peaks at 4 (λ = 1/3): the optimum
    >>> 0 <= red.value(b.x) - b.lower <= 1e-8 * red.value(b.x)
    True
    """
    import heapq

    from fxpar.solver.dp import DEFAULT_MAX_TABLE, elimination_order

    if red.budget is None or not red.points or red.equal:
        return None
    order = elimination_order(red.dom, red.edges, DEFAULT_MAX_TABLE)
    if order is None:
        return None
    offset_units = max(red.offset, 0.0) * red.scale
    # level[c][v]: which footprint (one per point) value v of class c has
    foot = [np.zeros((d, len(red.points))) for d in red.dom]
    for t, (_, terms, _) in enumerate(red.points):
        for c, v in terms:
            foot[c][:, t] += v
    level = [np.unique(f, axis=0, return_inverse=True)[1].reshape(-1) for f in foot]
    dual = _Dual(red, order)
    if start is not None:
        dual.offer(start)

    def slack(ub: float) -> float:
        return gap * (offset_units + ub)

    root = [np.ones(d, dtype=bool) for d in red.dom]
    lb = dual.bound(root, rounds)
    heap = [(lb, 0, root)]
    pruned, nodes, tick = np.inf, 1, 1
    while heap:
        ub = np.inf if dual.best_ub is None else float(dual.best_ub)
        lb = min(heap[0][0], pruned)
        if ub - lb <= slack(ub) or nodes >= max_nodes:
            break
        node_lb, _, mask = heapq.heappop(heap)
        if node_lb >= ub:
            pruned = min(pruned, node_lb)
            continue
        width = [float(np.ptp(foot[c][m], axis=0).max(initial=0.0)) for c, m in enumerate(mask)]
        c = int(np.argmax(width))
        if width[c] <= 0:   # every class at one footprint: the dual has no knapsack gap left
            pruned = min(pruned, node_lb)
            continue
        for lv in np.unique(level[c][mask[c]]):
            child = list(mask)
            child[c] = mask[c] & (level[c] == lv)
            ub = np.inf if dual.best_ub is None else float(dual.best_ub)
            b = dual.bound(child, rounds, stop_above=ub)
            nodes += 1
            if b >= ub:
                pruned = min(pruned, b)
            elif b < np.inf:
                heapq.heappush(heap, (max(b, node_lb), tick, child))
                tick += 1
    ub = None if dual.best_ub is None else dual.best_ub
    lower = min(heap[0][0] if heap else np.inf, pruned, np.inf if ub is None else ub)
    proven = ub is not None and ub - lower <= slack(ub)
    return LagrangeBound(lower if np.isinf(lower) else int(lower), ub, dual.best_x,
                         dual.passes, nodes, proven)
