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


def greedy(red: Reduced, sweeps: int = 20, start: list[int] | None = None) -> list[int]:
    """A good, usually feasible, assignment of class values (see the module docstring);
    ``start``: where the descent begins (default: each class at its cheapest value; with
    equality constraints a start that breaks one is replaced by the default)."""
    nb = _neighbours(red)
    groups = _groups(red)
    x = [0] * len(red.dom)
    for g in groups:
        v = int(np.argmin(sum(red.cost[c] for c in g)))
        if start is not None and all(start[c] == start[g[0]] for c in g):
            v = int(start[g[0]])
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
    heavy = [g for g in groups if any(terms[c] for c in g)]
    for _ in range(64):  # rounds; each applies a batch of the best moves
        over = _loads(red, x) - red.budget
        if (over <= 0).all():
            break
        cap = np.maximum(over, 0)
        moves = []
        for g in heavy:
            delta = np.zeros((len(red.points), red.dom[g[0]]), dtype=np.int64)  # bytes freed
            for c in g:
                for t, v in terms[c]:
                    delta[t] += v[x[c]] - v
            freed = np.minimum(np.maximum(delta, 0), cap[:, None]).sum(axis=0)
            if not np.any(freed > 0):
                continue
            loc = local(g)
            score = freed / (np.maximum(loc - loc[x[g[0]]], 0.0) + 1.0)
            score[freed <= 0] = -1.0
            v = int(np.argmax(score))
            moves.append((-float(score[v]), g[0], g, v, delta[:, v]))
        if not moves:
            break
        # best ratio first, until the estimated overage at every point is gone
        need = over.copy()
        for _, _, g, v, d in sorted(moves, key=lambda m: m[:2]):
            for c in g:
                x[c] = v
            need -= d
            if (need <= 0).all():
                break
    return x
