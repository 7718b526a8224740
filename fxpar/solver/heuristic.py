"""A quick assignment of a reduced problem: the CP-SAT hint, and the answer of last resort when
a time limit stops CP-SAT before its first solution.

Iterated conditional modes (each class in turn takes its best value given its neighbours)
then, while a liveness point is over budget, the move that frees the most over-budget bytes
per second of extra cost. Deterministic; no optimality claim.
"""

from __future__ import annotations

import numpy as np

from fxpar.solver.reduce import Reduced

__all__ = ["greedy", "feasible"]


def _neighbours(red: Reduced) -> list[list[tuple[int, np.ndarray]]]:
    nb: list[list[tuple[int, np.ndarray]]] = [[] for _ in red.dom]
    for c, d, a in red.edges:
        nb[c].append((d, a))
        nb[d].append((c, a.T))
    return nb


def _local(red: Reduced, nb, x: list[int], c: int) -> np.ndarray:
    """Cost of each value of class c with every other class fixed (units)."""
    v = red.cost[c].astype(np.float64)
    for d, a in nb[c]:
        v = v + a[:, x[d]]
    return v


def _loads(red: Reduced, x: list[int]) -> np.ndarray:
    return np.array([const + sum(int(v[x[c]]) for c, v in terms)
                     for const, terms, _ in red.points], dtype=np.int64)


def feasible(red: Reduced, x: list[int]) -> bool:
    """Whether class values ``x`` meet the budget and the equality constraints."""
    if any(x[a] != x[b] for a, b in red.equal):
        return False
    return red.budget is None or not red.points or bool((_loads(red, x) <= red.budget).all())


def _groups(red: Reduced) -> list[list[int]]:
    """Classes that must take equal values (ties kept as constraints), else singletons."""
    parent = list(range(len(red.dom)))

    def find(c: int) -> int:
        while parent[c] != c:
            c = parent[c]
        return c

    for a, b in red.equal:
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)
    out: dict[int, list[int]] = {}
    for c in range(len(red.dom)):
        out.setdefault(find(c), []).append(c)
    return list(out.values())


def greedy(red: Reduced, sweeps: int = 20) -> list[int]:
    """A good, usually feasible, assignment of class values (see the module docstring)."""
    nb = _neighbours(red)
    groups = _groups(red)
    x = [0] * len(red.dom)
    for g in groups:
        v = int(np.argmin(sum(red.cost[c] for c in g)))
        for c in g:
            x[c] = v

    def local(g: list[int]) -> np.ndarray:
        return sum(_local(red, nb, x, c) for c in g)

    for _ in range(sweeps):
        changed = False
        for g in groups:
            loc = local(g)
            v = int(np.argmin(loc))
            if loc[v] < loc[x[g[0]]]:
                changed = True
                for c in g:
                    x[c] = v
        if not changed:
            break
    if red.budget is None or not red.points:
        return x
    # per class: (point index, vector) of its memory terms
    terms: list[list[tuple[int, np.ndarray]]] = [[] for _ in red.dom]
    for t, (_, ts, _) in enumerate(red.points):
        for c, v in ts:
            terms[c].append((t, v))
    for _ in range(sum(red.dom)):
        over = _loads(red, x) - red.budget
        if (over <= 0).all():
            break
        best = None
        for g in groups:
            if not any(terms[c] for c in g):
                continue
            # bytes freed at over-budget points, capped by how far over each one is
            # (approximate for a group: each member capped separately)
            freed = sum(np.minimum(np.maximum(v[x[c]] - v, 0), max(int(over[t]), 0))
                        for c in g for t, v in terms[c])
            if not np.any(freed > 0):
                continue
            loc = local(g)
            score = freed / (np.maximum(loc - loc[x[g[0]]], 0.0) + 1.0)
            score[freed <= 0] = -1.0
            v = int(np.argmax(score))
            if best is None or score[v] > best[0]:
                best = (float(score[v]), g, v)
        if best is None:
            break
        for c in best[1]:
            x[c] = best[2]
    return x
