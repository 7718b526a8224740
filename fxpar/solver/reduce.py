"""Exact reductions of a :class:`StrategyProblem` to a smaller integer problem over *classes*.

A class is a set of nodes that share one decision variable: a tie group, grown by every
follower merged into it. Each member node ``i`` of class ``c`` has a map ``f_i`` from the
class's value positions ``0..|D_c|-1`` to its own strategy index. Costs stay float64 seconds
through the reductions (dominance tests allow ``tol`` of float round-off) and are rounded to
integer units once, at the end; memory is whole bytes throughout, so memory tests are exact.

See the package docstring for the math and why each step keeps the optimum.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from fxpar.errors import PlanError
from fxpar.solver.problem import StrategyProblem

__all__ = ["Reduced", "Removal", "reduce_problem", "ALL_REDUCTIONS", "choose_scale"]

#: names accepted by ``reductions=``: tie variables, dominance pruning (dead-end elimination),
#: follower merging, edge reparametrisation (drops separable edges), liveness-point pruning,
#: series elimination of memory-free classes with two neighbours
ALL_REDUCTIONS = frozenset({"ties", "prune", "merge", "edges", "points", "series"})

#: series elimination of class ``j`` between ``a`` and ``b`` builds a ``|D_a|·|D_j|·|D_b|``
#: array: a class above this is left to the other reductions and the solver
SERIES_WORK_LIMIT = 1 << 22

#: slack of the dominance tests, relative to the objective upper bound U: float round-off
#: (a shortest-path resharding metric has AR = RS + AG only in exact arithmetic); each applied
#: reduction may lose at most this much
DEFAULT_TOLERANCE = 1e-12

# How many of the largest liveness points each point is checked against for dominance:
# O(T·K) instead of O(T²); nested (chain-like) liveness is caught by the first one.
_POINT_DOMINANCE_CANDIDATES = 16


def _upper_bound(problem: StrategyProblem) -> float:
    return (sum(float(c.max()) for c in problem.cost)
            + sum(float(r.max()) for _, _, r in problem.edges))


def choose_scale(problem: StrategyProblem, bits: int = 40) -> float:
    """Integer units per second: the largest power of two with ``U·scale ≤ 2**bits``.

    ``U`` (sum of the largest node and edge cost) bounds every objective value, so no sum in
    the model exceeds ``2**bits`` (far from int64 overflow), and each rounded term is off by at
    most ``0.5/scale`` s, i.e. ``2**-(bits+1)`` of ``U``.
    """
    u = _upper_bound(problem)
    if u <= 0.0:
        return 1.0
    return float(2.0 ** np.floor(np.log2(2.0**bits / u)))


@dataclass(frozen=True)
class Removal:
    """Why strategy ``k`` of a node is not in the reduced problem (``reduce_problem(...,
    explain=True)``; each reduction keeps the optimum, see the package docstring):

    * ``"pin"``: the node's pin does not allow it;
    * ``"ties"``: allowed by the node's own pin, but the pin of ``node``, a tied copy, is not
      (tied nodes pick one index);
    * ``"prune"``: dead-end elimination: strategy ``by`` of the same node (its class) is
      never worse whatever the neighbours pick among the candidates still left then, and
      uses no more memory anywhere;
    * ``"merge"``: the node follows ``node`` (follower merging): for every choice of ``node``
      another strategy of this node is at least as good whatever else is picked, so this
      one is never needed.
    """

    reduction: str
    by: int | None = None
    node: str | None = None

    def __str__(self) -> str:
        if self.reduction == "pin":
            return "pin: not allowed by the node's pin"
        if self.reduction == "ties":
            return f"ties: the pin of tied copy {self.node} excludes it"
        if self.reduction == "prune":
            return f"prune: never better than #{self.by}, whatever the neighbours pick"
        if self.reduction == "merge":
            return f"merge: follows {self.node}; another strategy is optimal for each of its choices"
        return self.reduction


@dataclass
class Reduced:
    """The reduced integer problem handed to the model builder.

    Minimise ``offset + (Σ_c cost[c][x_c] + Σ_(c,d,A) A[x_c, x_d]) / scale`` (seconds; costs
    in integer units) over ``x_c ∈ 0..dom[c]-1``
    subject to, for every ``(const, terms, origin)`` in ``points``,
    ``const + Σ_(c,vec) vec[x_c] ≤ budget``, and ``x_c == x_d`` for ``(c, d)`` in ``equal``.
    ``A`` has a zero in every row and column (reparametrised), ``vec`` has min 0.
    ``node_map[i] = (c, f)`` decodes node ``i``'s strategy as ``f[x_c]`` (``c = -1``: fixed,
    ``f`` has one entry; ``c = -2``: set by a series elimination, ``f`` its map).
    ``series``: the series eliminations in order, each ``(a, b, V, members)``: the class
    eliminated took value ``V[y_a, y_b]`` where ``y_a``, ``y_b`` are the values of slots
    ``a`` and ``b``, and gives slot ``i`` of ``members`` the value ``f[V[y_a, y_b]]``. Slots
    below the node count are nodes; the others are *probes* (``probe_map``, read as
    ``node_map``): a probe records a neighbour's value position at the time of the
    elimination and follows that neighbour through the later reductions like a member.
    ``removed[i][k]``: the :class:`Removal` of strategy ``k`` of node ``i`` (recorded with
    ``explain=True``; empty otherwise).
    """

    scale: float
    budget: int | None
    offset: float
    dom: list[int]
    cost: list[np.ndarray]
    edges: list[tuple[int, int, np.ndarray]]
    points: list[tuple[int, list[tuple[int, np.ndarray]], int]]
    equal: list[tuple[int, int]]
    node_map: list[tuple[int, np.ndarray]]
    stats: dict = field(default_factory=dict)
    removed: dict[int, dict[int, Removal]] = field(default_factory=dict)
    series: list[tuple[int, int, np.ndarray, list[tuple[int, np.ndarray]]]] = field(default_factory=list)
    probe_map: list[tuple[int, np.ndarray]] = field(default_factory=list)

    def decode(self, x: list[int]) -> tuple[int, ...]:
        """Node strategy indices from class values ``x`` (series eliminations undone last
        first: each reads slots set by the classes left or by later eliminations)."""
        vals = [None if c == -2 else int(f[0] if c < 0 else f[x[c]])
                for c, f in self.node_map + self.probe_map]
        for a, b, V, members in reversed(self.series):
            v = V[vals[a], vals[b]]
            for i, f in members:
                vals[i] = int(f[v])
        return tuple(vals[:len(self.node_map)])

    def value(self, x: list[int]) -> int:
        """Objective in integer units of class values ``x``, without the offset."""
        v = sum(int(self.cost[c][x[c]]) for c in range(len(self.dom)))
        return v + sum(int(a[x[c], x[d]]) for c, d, a in self.edges)


_DIRECT_MIN_DELTA = 4096  # entries of an edge matrix below which _min_delta goes direct

#: dead-end elimination and follower merging of a class cost about ``n²·Σ_e m_e`` operations
#: (``n`` values, ``m_e`` columns of each incident edge): a class above this is skipped
#: (skipping a reduction is always exact). On 4-D meshes a class has 600-1700 values and the
#: tests cost seconds each while removing few of them; the bound filter
#: (:mod:`fxpar.solver.bounds`) shrinks such domains first and the pinned problem is reduced
#: again, this time with small classes.
DEE_WORK_LIMIT = 50_000_000


def _unique_rows(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(u, inv)`` with ``a == u[inv]``: the distinct rows of ``a`` (sorted)."""
    u, inv = np.unique(a, axis=0, return_inverse=True)
    return u, inv.reshape(-1)


def _min_delta(a: np.ndarray) -> np.ndarray:
    """``D[u, v] = min_w (a[u, w] - a[v, w])``: the least change on this edge from u to v.

    Computed on the distinct rows and distinct columns of ``a`` and expanded by index (a
    4-D-mesh strategy list has hundreds of values but an edge sees only the few distinct
    specs at its ports): the same minima over the same numbers, so bit-identical to the
    direct ``O(n²m)`` formula at a fraction of its cost."""
    if a.size <= _DIRECT_MIN_DELTA:  # small: np.unique costs more than it saves
        return (a[:, None, :] - a[None, :, :]).min(axis=2)
    rows, inv = _unique_rows(a)
    cols = np.unique(rows, axis=1)
    d = (cols[:, None, :] - cols[None, :, :]).min(axis=2)
    return d[np.ix_(inv, inv)]


class _Reducer:
    def __init__(self, p: StrategyProblem, scale: float, use: frozenset[str],
                 budget_aware: bool, tol: float, explain: bool = False) -> None:
        self.p, self.use, self.tol = p, use, tol
        #: node -> strategy -> Removal (only with explain: the solve path does not pay for it)
        self.removed: dict[int, dict[int, Removal]] | None = {} if explain else None
        self.budget = p.budget if budget_aware else None

        # --- classes: union of tie groups (or singletons + equality constraints) -----------
        parent = list(range(p.n))

        def find(i: int) -> int:
            while parent[i] != i:
                parent[i] = parent[parent[i]]
                i = parent[i]
            return i

        for g in p.ties:
            for i in g[1:]:
                ra, rb = find(g[0]), find(i)
                if ra != rb:
                    parent[max(ra, rb)] = min(ra, rb)
        groups: dict[int, list[int]] = {}
        for i in range(p.n):
            groups.setdefault(find(i), []).append(i)

        self.members: dict[int, dict[int, np.ndarray]] = {}
        self.cost: dict[int, np.ndarray] = {}  # float64 seconds
        self.adj: dict[int, dict[int, np.ndarray]] = {}
        self.cmem: dict[int, dict[int, np.ndarray]] = {}
        self.locked: set[int] = set()
        self.equal: list[tuple[int, int]] = []
        cls_of = [0] * p.n
        for root in sorted(groups):
            g = groups[root]
            dom = sorted(set.intersection(*(set(p.allowed(i)) for i in g)))
            if not dom:
                pinned = {p.names[i]: list(p.pins[i]) for i in g if i in p.pins}
                raise PlanError(f"pins leave no common strategy for tied nodes "
                                f"{[p.names[i] for i in g]} (tie constraint; pinned: "
                                f"{pinned or 'none'})")
            if self.removed is not None:
                self._log_pins(g, set(dom))
            f = np.array(dom, dtype=np.int64)
            cs = [root] if "ties" in use else g
            for c in cs:
                self.members[c], self.cost[c], self.adj[c], self.cmem[c] = {}, 0, {}, {}
            for i in g:
                c = root if "ties" in use else i
                cls_of[i] = c
                self.members[c][i] = f.copy()
                self.cost[c] = self.cost[c] + p.cost[i][f]
            if "ties" not in use and len(g) > 1:
                # ties kept as x_c == x_d constraints: no reduction may touch these classes
                self.locked.update(g)
                self.equal += [(g[0], i) for i in g[1:]]

        # --- liveness points: drop never-binding, duplicate and subset-dominated ones ------
        self.pconst = {t: int(c) for t, c in enumerate(p.live_const)}
        pts = list(range(len(p.live)))
        if "points" in use:
            pts = self._prune_node_points(pts)
        for t in pts:
            for i in p.live[t]:
                c = cls_of[i]
                v = p.mem[i][self.members[c][i]]
                if v.any():
                    old = self.cmem[c].get(t)
                    self.cmem[c][t] = v if old is None else old + v
        self.points = pts

        # --- edges ---------------------------------------------------------------------------
        for a, b, r in p.edges:
            ca, cb = cls_of[a], cls_of[b]
            fa, fb = self.members[ca][a], self.members[cb][b]
            if ca == cb:  # same variable on both ends: a node cost of the class
                self.cost[ca] = self.cost[ca] + r[fa, fb]
            else:
                self._add_edge(ca, cb, r[np.ix_(fa, fb)])
        self._md: dict[int, np.ndarray] = {}
        #: (c, d) -> (adj[c][d], its _min_delta): dead-end elimination and follower merging
        #: of a class read the same edges' deltas until an edge changes
        self._dl: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}
        #: (c, d) -> adj[c][d] when it was last reparametrised (zero row and column minima)
        self._flat: dict[tuple[int, int], np.ndarray] = {}
        self.offset = 0.0
        self.fixed: dict[int, int] = {}
        self.series: list[tuple[int, int, np.ndarray, list[tuple[int, np.ndarray]]]] = []
        self._probes = p.n   # the next probe's slot
        self.stats = {"nodes": p.n, "strategies": int(sum(c.size for c in p.cost)),
                      "edges": len(p.edges), "points": len(p.live), "merged": 0, "pruned": 0,
                      "fixed": 0, "separable_edges": 0, "series": 0,
                      "tied": p.n - len(self.members) if "ties" in use else 0,
                      "points_kept": len(self.points)}

    # -- bookkeeping -------------------------------------------------------------------------

    def _log_pins(self, g: list[int], dom: set[int]) -> None:
        p = self.p
        for i in g:
            own = set(p.allowed(i))
            for k in range(p.cost[i].size):
                if k in dom:
                    continue
                if k not in own:
                    self.removed.setdefault(i, {})[k] = Removal("pin")
                else:
                    by = next(p.names[t] for t in g if k not in p.allowed(t))
                    self.removed.setdefault(i, {})[k] = Removal("ties", node=by)

    def _log(self, c: int, image, removal) -> None:
        """Record, for each member ``i`` of class ``c``, the strategies that leave its image
        when its map ``f`` becomes ``image(f)``: ``removal(f, k)`` says why."""
        for i, f in self.members[c].items():
            if i >= self.p.n:   # a probe, not a node
                continue
            gone = set(f.tolist()) - set(image(f).tolist())
            for k in sorted(gone):
                self.removed.setdefault(i, {})[k] = removal(f, k)

    def _prune_node_points(self, pts: list[int]) -> list[int]:
        p = self.p
        if self.budget is not None:
            # a point whose worst case fits the budget can never bind
            most = np.array([int(p.mem[i][list(p.allowed(i))].max()) for i in range(p.n)]
                            + [0], dtype=np.int64)
            pts = [t for t in pts if p.live_const[t] + int(most[list(p.live[t]) or [-1]].sum())
                   > self.budget]
        order = sorted(pts, key=lambda t: (-len(p.live[t]), -p.live_const[t], t))
        kept: list[int] = []
        sets: list[frozenset[int]] = []
        for t in order:
            s = frozenset(p.live[t])
            # memory is >= 0, so a subset with no larger constant never binds first
            if any(s <= sets[k] and p.live_const[t] <= p.live_const[kept[k]]
                   for k in range(min(len(kept), _POINT_DOMINANCE_CANDIDATES))):
                continue
            kept.append(t)
            sets.append(s)
        return sorted(kept)

    def _add_edge(self, c: int, d: int, a: np.ndarray) -> None:
        old = self.adj[c].get(d)
        a = a if old is None else old + a
        self.adj[c][d], self.adj[d][c] = a, a.T

    def _del_edge(self, c: int, d: int) -> None:
        del self.adj[c][d], self.adj[d][c]

    def _restrict(self, c: int, keep: np.ndarray) -> None:
        """Keep only value positions ``keep`` of class ``c``."""
        self._md.pop(c, None)
        self.members[c] = {i: f[keep] for i, f in self.members[c].items()}
        self.cost[c] = self.cost[c][keep]
        self.cmem[c] = {t: v[keep] for t, v in self.cmem[c].items()}
        for d, a in list(self.adj[c].items()):
            na = a[keep]
            self.adj[c][d], self.adj[d][c] = na, na.T
            got = self._dl.get((c, d))
            if got is not None and got[0] is a:  # fewer rows, the same minima over w
                self._dl[c, d] = (na, got[1][np.ix_(keep, keep)])

    def _memdom(self, c: int) -> np.ndarray:
        """``M[u, v]``: u uses at least as much memory as v at every point (cached)."""
        m = self._md.get(c)
        if m is None:
            n = self.cost[c].size
            if not self.cmem[c]:
                m = np.ones((n, n), dtype=bool)
            else:
                vecs = list(self.cmem[c].values())
                a = np.unique(np.stack(vecs), axis=0) if len(vecs) > 1 else vecs[0][None]
                m = (a[:, :, None] >= a[:, None, :]).all(axis=0)
            self._md[c] = m
        return m

    # -- the reductions ----------------------------------------------------------------------

    def _delta(self, c: int, d: int) -> np.ndarray:
        """:func:`_min_delta` of ``adj[c][d]`` (cached while that matrix is the same object)."""
        a = self.adj[c][d]
        got = self._dl.get((c, d))
        if got is None or got[0] is not a:
            got = self._dl[c, d] = (a, _min_delta(a))
        return got[1]

    def _reparam(self, c: int) -> None:
        """Move row and column minima of each incident edge into node costs (exact: a
        constant per value of one endpoint); a separable edge becomes all-zero and goes."""
        for d in sorted(self.adj[c]):
            a = old = self.adj[c][d]
            if self._flat.get((c, d)) is a:  # reparametrised already, unchanged since
                continue
            rmin = a.min(axis=1)
            if rmin.any():
                a = a - rmin[:, None]
                self.cost[c] = self.cost[c] + rmin
            cmin = a.min(axis=0)
            if cmin.any():
                a = a - cmin[None, :]
                self.cost[d] = self.cost[d] + cmin
            if a.max() <= self.tol:  # separable (up to round-off): all in node costs now
                self._del_edge(c, d)
                self.stats["separable_edges"] += 1
            else:
                if a is not old:
                    self.adj[c][d], self.adj[d][c] = a, a.T
                self._flat[c, d], self._flat[d, c] = a, self.adj[d][c]

    def _fix(self, c: int) -> None:
        """Fold a single-valued class into the constant, its neighbours and point constants."""
        self.offset += float(self.cost[c][0])
        for d in list(self.adj[c]):
            self.cost[d] = self.cost[d] + self.adj[d][c][:, 0]
            self._del_edge(c, d)
        for t, v in self.cmem[c].items():
            self.pconst[t] += int(v[0])
        for i, f in self.members[c].items():
            self.fixed[i] = int(f[0])
        self.stats["fixed"] += 1
        for dct in (self.members, self.cost, self.adj, self.cmem):
            del dct[c]

    def _too_big(self, c: int) -> bool:
        n = self.cost[c].size
        return n * n * sum(a.shape[1] for a in self.adj[c].values()) > DEE_WORK_LIMIT

    def _prune(self, c: int) -> bool:
        """Goldstein dead-end elimination: drop u if some other v is never worse, whatever
        the neighbours pick, and never uses more memory. Equal values: the lower index stays."""
        cost = self.cost[c]
        n = cost.size
        if self._too_big(c):
            self.stats["skipped_dee"] = self.stats.get("skipped_dee", 0) + 1
            return False
        slack = cost[:, None] - cost[None, :]
        for d in self.adj[c]:
            slack = slack + self._delta(c, d)
        ok = (slack >= -self.tol) & self._memdom(c)
        np.fill_diagonal(ok, False)
        alive = np.ones(n, dtype=bool)
        by: dict[int, int] = {}
        # highest index first: of equal values the lowest stays (a row with no dominator,
        # most of them, is never removed and not visited)
        for u in np.flatnonzero(ok.any(axis=1))[::-1].tolist():
            if (ok[u] & alive).any():
                alive[u] = False
                if self.removed is not None:
                    by[u] = int(np.flatnonzero(ok[u] & alive)[0])
        if alive.all():
            return False
        self.stats["pruned"] += int(n - alive.sum())
        if self.removed is not None:
            keep = np.flatnonzero(alive)

            def removal(f, k):
                u = next(u for u in by if f[u] == k)
                return Removal("prune", by=int(f[by[u]]))

            self._log(c, lambda f: f[keep], removal)
        self._restrict(c, np.flatnonzero(alive))
        return True

    def _merge(self, j: int) -> int | None:
        """Merge class j into a neighbour p when, for every value u of p, one value v*(u) of j
        is at least as good as every other value of j whatever j's other neighbours pick and
        uses no more memory (conditional dead-end elimination). Then x_j = v*(x_p) loses
        nothing. Returns p, or None."""
        if self._too_big(j):
            return None
        cj = self.cost[j]
        memdom = self._memdom(j)
        deltas = {n: self._delta(j, n) for n in self.adj[j]}
        total = sum(deltas.values(), np.zeros((cj.size, cj.size), dtype=np.int64))
        for p in sorted(self.adj[j]):
            base = cj[:, None] - cj[None, :] + total - deltas[p]          # [v, v*]
            e = self.adj[p][j]                                            # [u, v]
            if e.size <= _DIRECT_MIN_DELTA:
                tot = base[None] + e[:, :, None] - e[:, None, :]          # [u, v, v*]
                good = ((tot >= -self.tol) & memdom[None]).all(axis=1)    # [u, v*]
            else:  # equal rows u give equal answers: one [v, v*] slice per distinct row
                eu, inv = _unique_rows(e)
                good = np.empty((eu.shape[0], cj.size), dtype=bool)
                for k in range(eu.shape[0]):
                    tot = base + eu[k][:, None] - eu[k][None, :]
                    good[k] = ((tot >= -self.tol) & memdom).all(axis=0)
                good = good[inv]
            if not good.any(axis=1).all():
                continue
            vstar = good.argmax(axis=1)                                   # smallest v*
            rows = np.arange(vstar.size)
            if self.removed is not None:
                self._log(j, lambda f: f[vstar],
                          lambda f, k: Removal("merge", node=self.p.names[p]))
            for i, f in self.members[j].items():
                self.members[p][i] = f[vstar]
            self.cost[p] = self.cost[p] + cj[vstar] + e[rows, vstar]
            self._del_edge(j, p)
            for n in sorted(self.adj[j]):
                a = self.adj[j][n][vstar]
                self._del_edge(j, n)
                self._add_edge(p, n, a)
            self._md.pop(p, None)
            for t, v in self.cmem[j].items():
                old = self.cmem[p].get(t)
                self.cmem[p][t] = v[vstar] if old is None else old + v[vstar]
            for dct in (self.members, self.cost, self.adj, self.cmem):
                del dct[j]
            self.stats["merged"] += 1
            return p
        return None

    def _series(self, j: int) -> bool:
        """Eliminate class ``j`` with exactly two neighbours ``a``, ``b`` and no memory: the
        edge ``(a, b)`` gains ``M[u, w] = min_v (A[u, v] + c_v + B[v, w])`` and ``j`` takes
        the minimizing ``v``, read back through a probe of ``a`` and of ``b`` (exact: for any
        values of ``a`` and ``b`` the best ``v`` is that one, and ``j`` touches nothing else)."""
        if len(self.adj[j]) != 2 or self.cmem[j]:
            return False
        a, b = sorted(self.adj[j])
        A, B = self.adj[a][j], self.adj[j][b]                         # [u, v], [v, w]
        if A.size * B.shape[1] > SERIES_WORK_LIMIT:
            return False
        T = A[:, :, None] + (self.cost[j][:, None] + B)[None, :, :]  # [u, v, w]
        V = T.argmin(axis=1)
        M = np.take_along_axis(T, V[:, None, :], axis=1)[:, 0, :]
        probes = []
        for c in (a, b):
            self.members[c][self._probes] = np.arange(self.cost[c].size)
            probes.append(self._probes)
            self._probes += 1
        self.series.append((probes[0], probes[1], V, list(self.members[j].items())))
        self._del_edge(j, a)
        self._del_edge(j, b)
        self._add_edge(a, b, M)
        for dct in (self.members, self.cost, self.adj, self.cmem):
            del dct[j]
        self.stats["series"] += 1
        return True

    def run(self) -> None:
        queue = deque(sorted(self.members))
        queued = set(queue)

        def push(cs):
            for c in sorted(cs):
                if c not in queued and c in self.members:
                    queue.append(c)
                    queued.add(c)

        while queue:
            c = queue.popleft()
            queued.discard(c)
            if c not in self.members:
                continue
            if "edges" in self.use:
                self._reparam(c)
            if self.cost[c].size == 1:
                nb = list(self.adj[c])
                self._fix(c)
                push(nb)
                continue
            if c in self.locked:
                continue
            if "prune" in self.use and self._prune(c):
                push([c, *self.adj[c]])
                continue
            if "merge" in self.use:
                nb = list(self.adj[c])
                p = self._merge(c)
                if p is not None:
                    push([p, *nb])
                    continue
            if "series" in self.use:
                nb = list(self.adj[c])
                if self._series(c):
                    push(nb)

    def finish(self, scale: float) -> Reduced:
        p = self.p
        if "edges" in self.use:  # reparametrise every edge once more before modelling
            for c in sorted(self.members):
                if c in self.members:
                    self._reparam(c)
        active = sorted(self.members)
        new = {c: k for k, c in enumerate(active)}
        # shift each class cost to min 0 (the constant goes to the offset), then round to units
        cost = []
        offset = self.offset
        for c in active:
            m = float(self.cost[c].min())
            offset += m
            cost.append(np.rint((self.cost[c] - m) * scale).astype(np.int64))
        edges = [(new[c], new[d], np.rint(a * scale).astype(np.int64)) for c in active
                 for d, a in sorted(self.adj[c].items()) if new[c] < new[d]]
        slots: list[tuple[int, np.ndarray]] = [(-1, np.zeros(1, np.int64))] * self._probes
        for _, _, _, members in self.series:
            for i, f in members:
                slots[i] = (-2, f)
        for c in active:
            for i, f in self.members[c].items():
                slots[i] = (new[c], f)
        for i, k in self.fixed.items():
            slots[i] = (-1, np.array([k], dtype=np.int64))
        node_map, probe_map = slots[:p.n], slots[p.n:]
        points = self._final_points(active, new)
        equal = [(new[a], new[b]) for a, b in self.equal if a in new and b in new]
        stats = dict(self.stats, classes=len(active), values=int(sum(x.size for x in cost)),
                     class_edges=len(edges), class_points=len(points), scale=scale)
        return Reduced(scale, self.budget, offset, [x.size for x in cost], cost, edges, points,
                       equal, node_map, stats, self.removed or {}, self.series, probe_map)

    def _final_points(self, active, new):
        by_point: dict[int, list[tuple[int, np.ndarray]]] = {t: [] for t in self.points}
        for c in active:
            for t, v in sorted(self.cmem[c].items()):
                by_point[t].append((new[c], v))
        out: dict[tuple, tuple[int, list, int]] = {}
        for t in self.points:
            const = self.pconst[t]
            terms = []
            for c, v in sorted(by_point[t], key=lambda x: x[0]):
                m = int(v.min())
                const += m
                if v.max() > m:
                    terms.append((c, v - m))
            if self.budget is not None and "points" in self.use:
                if const + sum(int(v.max()) for _, v in terms) <= self.budget:
                    continue  # cannot bind
            key = (const, tuple((c, v.tobytes()) for c, v in terms))
            if "points" not in self.use:
                key = (t,)
            if key not in out:  # ties make many points identical over class variables
                out[key] = (const, terms, t)
        pts = list(out.values())
        if "points" in self.use and len(pts) > 1:
            pts = _prune_dominated(pts)
        return sorted(pts, key=lambda x: x[2])


def _prune_dominated(pts):
    """Drop a point if one of the largest points is ≥ it in the constant and in every term."""
    def upper(pt):
        return pt[0] + sum(int(v.max()) for _, v in pt[1])

    order = sorted(pts, key=lambda pt: (-upper(pt), pt[2]))
    kept: list = []
    for pt in order:
        dominated = False
        for q in kept[:_POINT_DOMINANCE_CANDIDATES]:
            if pt[0] > q[0]:
                continue
            qt = dict(q[1])
            if all(c in qt and np.all(qt[c] >= v) for c, v in pt[1]):
                dominated = True
                break
        if not dominated:
            kept.append(pt)
    return kept


def reduce_problem(problem: StrategyProblem, *, scale: float | None = None,
                   reductions=ALL_REDUCTIONS, budget_aware: bool = True,
                   tolerance: float = DEFAULT_TOLERANCE, explain: bool = False) -> Reduced:
    """Apply the exact reductions named in ``reductions`` (a subset of
    :data:`ALL_REDUCTIONS`) and return the integer class problem.

    ``tolerance`` (a fraction of the objective bound ``U``, see :func:`choose_scale`) is how
    much worse a dominating value may look in the dominance tests, to absorb float round-off;
    each applied reduction may cost at most that much. ``budget_aware=False`` keeps points
    that cannot bind under the budget (used for the min-peak program). ``explain=True``
    records in ``Reduced.removed`` which reduction removed each strategy (same reductions,
    same result; a little slower).

    >>> from fxpar.solver import StrategyProblem
    >>> p = StrategyProblem(cost=[[1.0, 1.0], [2.0, 2.0, 0.0]], names=["a", "b"],
    ...                     edges={("a", "b"): [[0, 1, 5], [1, 0, 5]]}, pins={"b": [0, 1]})
    >>> r = reduce_problem(p, explain=True)
    >>> for i, d in sorted(r.removed.items()):
    ...     for k, why in sorted(d.items()):
    ...         print(p.names[i], k, why)
    a 1 prune: never better than #0, whatever the neighbours pick
    b 1 prune: never better than #0, whatever the neighbours pick
    b 2 pin: not allowed by the node's pin
    """
    use = frozenset(reductions)
    if not use <= ALL_REDUCTIONS:
        raise PlanError(f"unknown reductions {sorted(use - ALL_REDUCTIONS)}")
    scale = choose_scale(problem) if scale is None else scale
    tol = tolerance * _upper_bound(problem)
    r = _Reducer(problem, scale, use, budget_aware, tol, explain)
    r.run()
    return r.finish(scale)
