r"""Exact dynamic programming (bucket elimination) on a reduced problem, memory ignored.

Minimise ``F(x) = Σ_c cost[c][x_c] + Σ_(c,d,A) A[x_c, x_d]`` (integer units, the objective of
:class:`~fxpar.solver.reduce.Reduced`) over the class values, without the liveness points.
Classes are eliminated one at a time (Dechter's bucket elimination): eliminating ``c`` with
current neighbours ``N`` replaces every factor that mentions ``c`` by

    g(x_N) = min_v  Σ_(factors f ∋ c) f(v, x_N),     with   v*(x_N) = argmin (lowest v)

and, once every class is gone, the values are read back in reverse order of elimination
(``x_c = v*(x_N)``). Exact in int64 arithmetic: the returned value is ``min F``. Cost is the
size of the largest table ``|D_c|·Π_(d∈N)|D_d|``; the order is greedy (smallest table next,
lowest class on ties), fixed before any arithmetic, and :func:`eliminate` returns ``None``
when a table would exceed ``max_table`` entries (CP-SAT then solves the problem).

Why it is used (:func:`fxpar.solver.solve`): the memory points make the problem a knapsack,
but without them the reduced class graph of a transformer is close to a tree (a tied
Llama-3-8B block on ``(dp, tp)``: 82 classes, 95 edges, elimination width 4). When the
memory-free optimum fits the budget it is optimal for the full problem (it is the optimum of
a relaxation and feasible), so no integer program is solved at all; otherwise it is skipped.

>>> import numpy as np
>>> from fxpar.solver import StrategyProblem, reduce_problem
>>> p = StrategyProblem(cost=[[1.0, 2.0], [3.0, 0.5], [0.0, 1.0]],
...                     edges={(0, 1): [[0, 4], [4, 0]], (1, 2): [[0, 1], [1, 0]],
...                            (0, 2): [[0, 2], [2, 0]]})
>>> red = reduce_problem(p, reductions=())     # keep all three classes
>>> x, v = eliminate(red)
>>> red.decode(x), p.evaluate(red.decode(x))[:2]
((1, 1, 1), (3.5, 0.0))
"""

from __future__ import annotations

import heapq
import math

import numpy as np

from fxpar.solver.reduce import Reduced

__all__ = ["eliminate", "elimination_order", "DEFAULT_MAX_TABLE"]

#: largest intermediate table (entries) bucket elimination may build: 4M int64 = 32 MiB
DEFAULT_MAX_TABLE = 4_000_000


def _greedy_order(dom: list[int], adj: list[set[int]], key, max_table: int):
    """Eliminate the alive class with the smallest ``key`` (lowest class on ties); scores are
    recomputed only around each elimination. ``(order, largest table, total entries)``.

    A heap of ``(score, class)`` with stale entries skipped when popped picks the same class
    as a scan of all alive ones (a scan per step is quadratic in the classes: 2.5x slower
    on RWKV's 963)."""
    adj = [set(a) for a in adj]
    score = {c: key(c, adj) for c in range(len(dom))}
    heap = [(s, c) for c, s in score.items()]
    heapq.heapify(heap)
    order, big, total = [], 0, 0
    while score:
        s, best = heapq.heappop(heap)
        if score.get(best) != s:  # eliminated, or rescored since this entry was pushed
            continue
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
                new = key(d, adj)
                if new != score[d]:
                    score[d] = new
                    heapq.heappush(heap, (new, d))
    return order, big, total


def elimination_order(dom: list[int], edges, max_table: int = DEFAULT_MAX_TABLE) -> list[int] | None:
    """An elimination order of the classes whose largest table has at most ``max_table``
    entries, else ``None``: the better (fewer table entries in all) of two greedy orders,
    min-fill (fewest new edges, then smallest table) and min-table. ``edges``: ``(c, d, ...)``."""
    adj: list[set[int]] = [set() for _ in dom]
    for e in edges:
        adj[e[0]].add(e[1])
        adj[e[1]].add(e[0])

    def table(c, adj):
        return math.prod(dom[d] for d in adj[c])

    def fill(c, adj):
        nb = sorted(adj[c])
        return (sum(1 for i, a in enumerate(nb) for b in nb[:i] if b not in adj[a]), table(c, adj))

    best = None
    for key in (fill, table):
        order, _, total = _greedy_order(dom, adj, key, max_table)
        if order is not None and (best is None or total < best[0]):
            best = (total, order)
    return None if best is None else best[1]


def _aligned(scope: tuple[int, ...], table: np.ndarray, target: tuple[int, ...]) -> np.ndarray:
    """``table`` over ``scope`` as an array broadcastable over ``target`` (a superset)."""
    perm = sorted(range(len(scope)), key=lambda k: target.index(scope[k]))
    t = np.transpose(table, perm)
    shape = [1] * len(target)
    for k in perm:
        shape[target.index(scope[k])] = table.shape[k]
    return t.reshape(shape)


def eliminate(red: Reduced, max_table: int = DEFAULT_MAX_TABLE,
              unary: list[np.ndarray] | None = None,
              order: list[int] | None = None) -> tuple[list[int], int | float] | None:
    """``(x, F(x))`` with ``x`` a minimiser of the memory-free objective (module docstring),
    or ``None`` when the elimination tables would be too large or classes are tied by
    equality constraints (``red.equal``). Deterministic: lowest values win ties.

    ``unary``: per class, costs used instead of ``red.cost`` (float64 allowed: the Lagrangian
    ``cost + λ·mem`` of :func:`fxpar.solver.bounds.lagrangian_bound`); the tables are then
    float64 and the value a float. ``order``: an elimination order computed before (by
    :func:`elimination_order` with the same ``max_table``), to skip recomputing it."""
    if red.equal:
        return None
    if order is None:
        order = elimination_order(red.dom, red.edges, max_table)
    if order is None:
        return None
    dtype = np.int64 if unary is None else np.float64
    # factors: scope (tuple of classes) -> int64 table; every class has its unary factor
    factors: dict[int, list[tuple[tuple[int, ...], np.ndarray]]] = {c: [] for c in range(len(red.dom))}
    fid = 0
    store: dict[int, tuple[tuple[int, ...], np.ndarray]] = {}

    def add(scope, table):
        nonlocal fid
        store[fid] = (scope, table)
        for c in scope:
            factors[c].append(fid)
        fid += 1

    for c, v in enumerate(red.cost if unary is None else unary):
        add((c,), np.asarray(v, dtype=dtype))
    for c, d, a in red.edges:
        add((c, d), np.asarray(a, dtype=dtype))
    total = 0 if unary is None else 0.0
    back: list[tuple[int, tuple[int, ...], np.ndarray]] = []
    for c in order:
        mine = [f for f in factors[c] if f in store]
        scope_n = sorted({d for f in mine for d in store[f][0]} - {c})
        target = (c, *scope_n)
        acc = np.zeros([red.dom[d] for d in target], dtype=dtype)
        for f in mine:
            s, t = store.pop(f)
            acc = acc + _aligned(s, t, target)
        arg = acc.argmin(axis=0)
        best = np.take_along_axis(acc, arg[None], axis=0)[0]
        back.append((c, tuple(scope_n), arg))
        if scope_n:
            add(tuple(scope_n), best)
        else:
            total += best.item()
    x = [0] * len(red.dom)
    for c, scope_n, arg in reversed(back):
        x[c] = int(arg[tuple(x[d] for d in scope_n)]) if scope_n else int(arg)
    return x, total
