r"""The LP relaxation's dual by sequential message passing, for memory-free reduced problems
whose bucket-elimination tables do not fit.

Why: a reduced problem without liveness points is ``min F(x) = Σ_c θ_c(x_c) + Σ_(c,d)
θ_cd(x_c, x_d)``. Bucket elimination (:mod:`fxpar.solver.dp`) solves it when the graph is
close to a tree; the graphs that defeat it are wide *and* have large domains: a step loop
unrolled over the sequence (RWKV, xLSTM: the loop's inputs and state meet every step),
RoPE tables and hyper-connection streams shared by every layer (HunYuan v4: tables of
``10¹¹`` entries at 2 layers). Their spanning-forest bound (:mod:`fxpar.solver.bounds`)
drops so many edges that it proves nothing (a 30-97% gap), so CP-SAT got the whole
marginal encoding (~300k Booleans), spent 10-35 s in presolve alone and often never left
its hint within the 60 s limit.

Dual
----
A *reparametrisation* moves cost between a node and an edge without changing ``F``:
``θ'_c(v) = θ_c(v) + δ(v)``, ``θ'_cd(v, w) = θ_cd(v, w) - δ(v)``. For any reparametrisation

    F(x) ≥ LB = Σ_c min θ'_c + Σ_e min θ'_e,      and, with x_c = v,
    F(x) ≥ LB + (θ'_c(v) - min θ'_c)                                         (1)

(every other term is at least its minimum). The best ``LB`` over reparametrisations is the
optimum of the local-polytope LP relaxation (the one CP-SAT's ``marginal`` encoding
solves). :func:`dual_bound` climbs towards it with SRMP (Kolmogorov 2015, sequential
reweighted message passing; TRW-S for pairwise models): classes in a fixed order, each in
turn collects the min-marginals of its edges (``δ(v) = min_w θ'_cd(v, w)``, moved into
``θ'_c``) and hands the fraction ``1 / max(#earlier, #later neighbours)`` of
``θ'_c - min θ'_c`` back to each edge towards the classes still to come; forward, then
backward. ``LB`` never decreases. The order is the class order (graph order: chains stay
monotone, so a pass carries information along a whole chain); classes at the same depth of
that order share no edge, so each depth is one vectorised update (a greedy colouring,
another valid order, needed 200+ passes where this needs 10-80).

What the solver does with it (:func:`fxpar.solver.solve`)
--------------------------------------------------------
* reduced-cost filtering: by (1), value ``v`` of class ``c`` with
  ``LB + θ'_c(v) - min θ'_c > UB`` is in no assignment better than the best one in hand
  (value ``UB``), so it goes: every optimal assignment survives, and the optimum of what is
  left, reduced again and solved by bucket elimination when its tables fit, is the optimum;
* the best assignment: the one read off the reparametrisation (each class, in order, its
  best value given the classes before it) improved by conditional modes, then the optima of
  the problem restricted to the values of reduced cost up to a threshold that shrinks until
  the DP fits (an LP-tight problem keeps an optimum among the values of ~zero reduced cost);
  each lowers ``UB`` and so the filter's threshold, until the filtered problem is one that
  was solved: proven. The four tiny 2-layer models above are all proven this way;
* when the LP is not tight and nothing fits, CP-SAT gets the filtered problem if its model is
  small, else the best assignment is returned with status ``FEASIBLE`` and its proven gap.

>>> import numpy as np
>>> from fxpar.solver import StrategyProblem, reduce_problem
>>> # a frustrated triangle: each edge wants its ends to differ, three classes, two values
>>> diff = [[4.0, 0.0], [0.0, 4.0]]
>>> p = StrategyProblem(cost=[[0.0, 1.0], [0.0, 1.0], [0.0, 1.0]],
...                     edges={(0, 1): diff, (1, 2): diff, (0, 2): diff})
>>> red = reduce_problem(p, reductions=("edges",))
>>> b = dual_bound(red)
>>> best = min(red.value([a, b_, c]) for a in (0, 1) for b_ in (0, 1) for c in (0, 1))
>>> b.lower <= best, b.lower > 0     # a valid bound, and better than the zero edges give
(True, True)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from fxpar.solver.reduce import Reduced

__all__ = ["DualBound", "dual_bound", "MAX_ENTRIES"]

#: edge-matrix entries :func:`dual_bound` takes on, each edge seen from both ends and padded
#: to its depth's largest domains (float64, held twice: 128 MiB; a pass reads them about
#: four times, so ~0.1 s at the cap); above it (4-D meshes: domains of 600-1700 values) it
#: returns None and the spanning-forest filter is the bound. The tiny 2-layer models that
#: need it hold 0.8-2.6M
MAX_ENTRIES = 1 << 23

#: stands for "not a value" in the padded arrays (far above any objective in units, 2^40)
_BIG = 1e30


@dataclass
class DualBound:
    """What :func:`dual_bound` found (integer units of the reduced problem, offset excluded).

    ``lower``: a lower bound of every assignment's value; ``reduced[c][v]``:
    ``θ'_c(v) - min θ'_c`` (by (1), ``lower + reduced[c][v]`` bounds every assignment with
    ``x_c = v``); ``x``: the assignment read off the reparametrisation; ``iters``: passes
    run (forward and backward)."""

    lower: float
    reduced: list[np.ndarray]
    x: list[int]
    iters: int
    #: ``more(rel_tol, max_iters)``: the same passes continued from here, a new DualBound
    more: Callable[[float, int], DualBound] = field(repr=False, default=None)


def _levels(n: int, first: np.ndarray, second: np.ndarray) -> np.ndarray:
    """Longest-path depth of each class in the class graph oriented from lower to higher
    index: an edge always joins two depths, and ordering by depth keeps every edge's
    earlier end (so the updates are those of the class order, batched)."""
    lev = np.zeros(n, dtype=np.int64)
    lo, hi = np.minimum(first, second), np.maximum(first, second)
    preds: list[list[int]] = [[] for _ in range(n)]
    for a, b in zip(lo.tolist(), hi.tolist()):
        preds[b].append(a)
    for c in range(n):
        if preds[c]:
            lev[c] = max(lev[q] for q in preds[c]) + 1
    return lev


def dual_bound(red: Reduced, max_iters: int = 200, rel_tol: float = 1e-4,
               max_entries: int = MAX_ENTRIES) -> DualBound | None:
    """SRMP on ``red``'s edges and class costs (memory points ignored; module docstring),
    until ``lower`` gains less than ``rel_tol`` of itself over 5 iterations or after
    ``max_iters`` (``.more(rel_tol, max_iters)`` goes on from there). ``None`` when ``red``
    keeps equality constraints or its padded edge copies would hold more than
    ``max_entries`` entries.
    Deterministic.

    Stored as messages: ``φ_(e,u)`` per edge end, ``θ'_u = θ_u + Σ_(e∋u) φ_(e,u)`` and
    ``θ'_e(a, b) = θ_e(a, b) - φ_(e,u)(a) - φ_(e,v)(b)``; collecting edge ``e``'s
    min-marginal at ``u`` sets ``φ_(e,u)(a) = min_b θ_e(a, b) - φ_(e,v)(b)``, handing back
    a share subtracts it from ``φ_(e,u)``. The edge matrices never change, so each depth
    keeps its own padded copy, oriented from its classes' side."""
    n = len(red.dom)
    if n == 0 or red.equal:
        return None
    E = len(red.edges)
    if 2 * sum(a.size for _, _, a in red.edges) > max_entries:   # the padded count is larger
        return None
    D = max(red.dom)
    dom = np.asarray(red.dom)
    valid = np.arange(D)[None, :] < dom[:, None]                      # (n, D)
    base = np.zeros((n, D))
    for c, v in enumerate(red.cost):
        base[c, :v.size] = v
    first = np.array([c for c, _, _ in red.edges], dtype=np.int64)
    second = np.array([d for _, d, _ in red.edges], dtype=np.int64)
    lev = _levels(n, first, second)
    deg = np.bincount(first, minlength=n) + np.bincount(second, minlength=n)
    earlier = (np.bincount(first[lev[second] < lev[first]], minlength=n)
               + np.bincount(second[lev[first] < lev[second]], minlength=n))
    later = deg - earlier
    w = 1.0 / np.maximum(np.maximum(earlier, later), 1)
    # edge ends ("incidences"): i < E is edge i seen from its first class, i + E from its
    # second; P[i] is the message φ of that end (padding 0)
    inc_u = np.concatenate([first, second])
    inc_v = np.concatenate([second, first])
    P = np.zeros((2 * E, D))
    slot = np.zeros(n, dtype=np.int64)   # position of a class inside its depth
    depth_u = lev[inc_u]
    padded = sum(int(m.sum()) * int(dom[inc_u[m]].max()) * int(dom[inc_v[m]].max())
                 for k in range(int(lev.max()) + 1) for m in [depth_u == k] if m.any())
    if padded > max_entries:
        return None
    batches = []
    for k in range(int(lev.max()) + 1):
        nodes = np.flatnonzero(lev == k)
        slot[nodes] = np.arange(nodes.size)
        b = dict(nodes=nodes, valid=valid[nodes], w=w[nodes][:, None],
                 nfwd={+1: later[nodes][:, None], -1: earlier[nodes][:, None]})
        sel = np.flatnonzero(depth_u == k)
        if sel.size:
            sel = sel[np.argsort(inc_u[sel], kind="stable")]  # grouped by class: reduceat
            u, v = inc_u[sel], inc_v[sel]
            du, dv = int(dom[u].max()), int(dom[v].max())
            theta = np.full((sel.size, du, dv), _BIG)   # θ_e from u's side, padded
            for j, i in enumerate(sel.tolist()):
                a = red.edges[i % E][2]
                a = a if i < E else a.T
                theta[j, :a.shape[0], :a.shape[1]] = a
            starts = np.flatnonzero(np.r_[True, u[1:] != u[:-1]])
            b.update(sel=sel, other=(sel + E) % (2 * E), theta=theta, dv=dv,
                     buf=np.empty_like(theta),   # reused: no allocation per pass
                     ok=valid[u][:, :du], has=u[starts], starts=starts, pos=slot[u],
                     fwd={+1: np.flatnonzero(lev[v] > k), -1: np.flatnonzero(lev[v] < k)})
        batches.append(b)
    T = base.copy()   # θ'_u (padding: never read)

    def update(b, direction):
        nodes = b["nodes"]
        if "sel" in b:
            # 1. every edge's min-marginal over this depth's classes moves into the class
            g = np.subtract(b["theta"], P[b["other"], :b["dv"]][:, None, :], out=b["buf"])
            phi = np.where(b["ok"], g.min(axis=2), 0.0)
            du = phi.shape[1]
            T[b["has"], :du] += np.add.reduceat(phi - P[b["sel"], :du], b["starts"], axis=0)
            P[b["sel"], :du] = phi
        # 2. each class hands its share back to the edges towards classes still to come
        t = np.where(b["valid"], T[nodes], np.inf)
        share = np.where(b["valid"], (t - t.min(axis=1, keepdims=True)) * b["w"], 0.0)
        T[nodes] -= share * b["nfwd"][direction]
        if "sel" in b:
            fwd = b["fwd"][direction]
            if fwd.size:
                rows = b["sel"][fwd]
                P[rows, :du] -= share[b["pos"][fwd], :du]

    # each edge once, from its first end: its θ' minimum
    views = [(b["theta"][m], b["sel"][m], b["other"][m], b["dv"], b["buf"][m])
             for b in batches if "sel" in b for m in [b["sel"] < E] if m.any()]

    def lower() -> float:
        total = float(np.where(valid, T, np.inf).min(axis=1).sum())
        for th, sel, oth, dv, buf in views:
            du = th.shape[1]
            g = np.subtract(th, P[sel, :du][:, :, None], out=buf)
            g -= P[oth, :dv][:, None, :]
            total += float(g.reshape(g.shape[0], -1).min(axis=1).sum())
        return total

    history = [lower()]

    def run(rel_tol: float, max_iters: int) -> DualBound:
        done = 0
        while done < max_iters:
            for b in batches:
                update(b, +1)
            for b in reversed(batches):
                update(b, -1)
            done += 1
            history.append(lower())
            if done >= 5 and history[-1] - history[-6] <= rel_tol * max(abs(history[-1]), 1.0):
                break
        # the last reparametrisation's bound: (1) pairs it with the reduced costs read off it
        # (SRMP never lowers it, up to round-off)
        reduced = [T[c, :red.dom[c]] - T[c, :red.dom[c]].min() for c in range(n)]
        mats = [a - P[e, :a.shape[0]][:, None] - P[e + E, :a.shape[1]][None, :]
                for e, (_, _, a) in enumerate(red.edges)]
        return DualBound(history[-1], reduced, _decode(red, T, mats, first, second, lev),
                         len(history) - 1, run)

    return run(rel_tol, max_iters)


def _decode(red: Reduced, T, mats, first, second, lev) -> list[int]:
    """Each class in depth order, its best value under ``θ'`` given the classes already set."""
    n = len(red.dom)
    x = np.full(n, -1, dtype=np.int64)
    inc: list[list[tuple[int, bool]]] = [[] for _ in range(n)]
    for e in range(len(first)):
        inc[int(first[e])].append((e, True))
        inc[int(second[e])].append((e, False))
    for c in sorted(range(n), key=lambda c: (int(lev[c]), c)):
        s = T[c, :red.dom[c]].copy()
        for e, is_first in inc[c]:
            d = int(second[e] if is_first else first[e])
            if x[d] >= 0:
                s += mats[e][:, x[d]] if is_first else mats[e][x[d], :]
        x[c] = int(np.argmin(s))
    return [int(v) for v in x]
