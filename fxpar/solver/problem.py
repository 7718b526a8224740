"""The strategy-selection problem, its solution, exact evaluation and a brute-force oracle.

Nothing here imports OR-Tools; :mod:`fxpar.solver.ilp` does the solving.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from fxpar.errors import PlanError
from fxpar.units import fmt_bytes  # re-exported: fxpar.solver.fmt_bytes

__all__ = ["StrategyProblem", "Solution", "brute_force", "fmt_bytes"]


def _ro(a: np.ndarray) -> np.ndarray:
    a.setflags(write=False)
    return a


@dataclass(frozen=True, eq=False, init=False)
class StrategyProblem:
    """Pick one strategy per node to minimise ``Σ node cost + Σ edge resharding cost``.

    Contract (nodes are positions ``0..N-1``; a node's name may stand for it in ``edges``,
    ``live``, ``pins`` and ``ties``):

    - ``cost[i][k]``: seconds (finite, ≥ 0) of node ``i`` under strategy ``k``;
    - ``mem[i][k]``: bytes node ``i`` keeps under strategy ``k`` (rounded to whole bytes);
      default 0;
    - ``edges``: ``{(i, j): R}`` or ``[(i, j, R), ...]`` with ``R[k][l]`` seconds (finite, ≥ 0)
      paid when ``i`` picks ``k`` and ``j`` picks ``l`` (repeated pairs are summed);
    - ``live``: liveness points, each a collection of nodes live at that point;
      ``live_const[t]`` bytes are added at point ``t``; ``live_names`` name them in messages;
    - ``budget``: bytes; every point must satisfy ``live_const[t] + Σ_{i∈live[t]} mem[i][k_i]
      ≤ budget`` (``None``: no memory constraint);
    - ``pins``: ``{node: allowed strategy indices}``;
    - ``ties``: groups of nodes that must pick the same strategy index (same strategy count).

    The constructor copies and canonicalises everything (sorted edges, sorted sets), so the
    order in which dicts were filled never matters.

    >>> p = StrategyProblem(cost=[[1.0, 2.0], [3.0, 0.5]], edges={(0, 1): [[0, 4], [4, 0]]},
    ...                     names=["mm", "relu"])
    >>> p
    StrategyProblem(2 nodes, 4 strategies, 1 edges, 0 liveness points, budget=None)
    >>> p.evaluate([0, 0])
    (4.0, 0.0, ())
    """

    names: tuple[str, ...]
    cost: tuple[np.ndarray, ...]
    mem: tuple[np.ndarray, ...]
    edges: tuple[tuple[int, int, np.ndarray], ...]
    live: tuple[tuple[int, ...], ...]
    live_const: tuple[int, ...]
    live_names: tuple[str, ...]
    budget: int | None
    pins: Mapping[int, tuple[int, ...]] = field(repr=False)
    ties: tuple[tuple[int, ...], ...]

    def __init__(
        self,
        cost: Sequence[Sequence[float]],
        mem: Sequence[Sequence[float]] | None = None,
        edges: Mapping[tuple[int, int], Sequence[Sequence[float]]]
        | Iterable[tuple[int, int, Sequence[Sequence[float]]]] = (),
        live: Sequence[Collection[int | str]] = (),
        budget: float | None = None,
        pins: Mapping[int | str, Collection[int]] | None = None,
        ties: Sequence[Collection[int | str]] = (),
        names: Sequence[str] | None = None,
        live_const: Sequence[float] | None = None,
        live_names: Sequence[str] | None = None,
    ) -> None:
        n = len(cost)
        names = tuple(f"n{i}" for i in range(n)) if names is None else tuple(map(str, names))
        if len(names) != n or len(set(names)) != n:
            raise PlanError(f"need {n} distinct node names, got {names!r}")
        index = {nm: i for i, nm in enumerate(names)}

        def node(x: int | str, what: str) -> int:
            i = index.get(x) if isinstance(x, str) else int(x)
            if i is None or not 0 <= i < n:
                raise PlanError(f"{what}: unknown node {x!r}")
            return i

        # The planner hands the copies of a repeated block the same vector objects: each
        # object is converted and checked once. The cache holds ``v`` itself, so an id is
        # never reused by another object (rows of a 2-D array are temporaries).
        seen: dict[tuple[str, int], tuple[object, np.ndarray]] = {}

        def vec(v, i: int, what: str) -> np.ndarray:
            got = seen.get((what, id(v)))
            if got is not None:
                return got[1]
            a = np.array(v, dtype=np.float64).reshape(-1)
            if not np.all(np.isfinite(a)) or np.any(a < 0):
                raise PlanError(f"{what} of node {names[i]!r} must be finite and >= 0: {a}")
            if what == "mem":
                a = np.rint(a).astype(np.int64)
            seen[what, id(v)] = (v, _ro(a))
            return a

        costs = tuple(vec(c, i, "cost") for i, c in enumerate(cost))
        for i, c in enumerate(costs):
            if c.size == 0:
                raise PlanError(f"node {names[i]!r} has no strategy")
        if mem is None:
            mems = tuple(_ro(np.zeros(c.size, np.int64)) for c in costs)
        else:
            if len(mem) != n:
                raise PlanError(f"mem has {len(mem)} rows for {n} nodes")
            mems = tuple(vec(m, i, "mem") for i, m in enumerate(mem))
        for i in range(n):
            if mems[i].size != costs[i].size:
                raise PlanError(f"node {names[i]!r}: {costs[i].size} costs, {mems[i].size} mems")

        items = (edges.items() if isinstance(edges, Mapping)
                 else [((e[0], e[1]), e[2]) for e in edges])
        acc: dict[tuple[int, int], np.ndarray] = {}
        mats: dict[int, tuple[object, np.ndarray]] = {}  # id -> (object, checked copy)
        for (a, b), r0 in _sorted_edges(items, node):
            # the copies of a repeated block hand over the same matrix objects: one read-only
            # copy each (a 4-D mesh GPT-20B has 1231 edges of up to 1665x624 entries)
            got = mats.get(id(r0))
            r = got[1] if got is not None else np.array(r0, dtype=np.float64)
            if a == b:
                raise PlanError(f"self edge on node {names[a]!r}")
            if r.shape != (costs[a].size, costs[b].size):
                raise PlanError(f"edge {names[a]!r}->{names[b]!r}: matrix {r.shape}, expected "
                                f"{(costs[a].size, costs[b].size)}")
            if got is None:
                if not np.all(np.isfinite(r)) or np.any(r < 0):
                    raise PlanError(f"edge {names[a]!r}->{names[b]!r}: costs must be finite, >= 0")
                mats[id(r0)] = (r0, _ro(r))
            acc[a, b] = acc[a, b] + r if (a, b) in acc else r
        edge_t = tuple((a, b, r if not r.flags.writeable else _ro(r))
                       for (a, b), r in sorted(acc.items(), key=lambda x: x[0]))

        live_t = tuple(tuple(sorted({node(x, "live") for x in pt})) for pt in live)
        t = len(live_t)
        lc = (0,) * t if live_const is None else tuple(int(round(float(c))) for c in live_const)
        ln = tuple(f"t{k}" for k in range(t)) if live_names is None else tuple(map(str, live_names))
        if len(lc) != t or len(ln) != t:
            raise PlanError(f"{t} liveness points but {len(lc)} constants and {len(ln)} names")

        pin_d: dict[int, tuple[int, ...]] = {}
        for x, allowed in (pins or {}).items():
            i = node(x, "pin")
            s = tuple(sorted({int(k) for k in allowed}))
            if not s or s[0] < 0 or s[-1] >= costs[i].size:
                raise PlanError(f"pin of node {names[i]!r}: {s} not within 0..{costs[i].size - 1}")
            pin_d[i] = tuple(sorted(set(s) & set(pin_d.get(i, s))))
        tie_t = []
        for g in ties:
            members = tuple(sorted({node(x, "tie") for x in g}))
            sizes = {costs[i].size for i in members}
            if len(sizes) > 1:
                raise PlanError(f"tied nodes {[names[i] for i in members]} have different "
                                f"strategy counts {sorted(sizes)}")
            if len(members) > 1:
                tie_t.append(members)

        set_ = object.__setattr__
        set_(self, "names", names)
        set_(self, "cost", costs)
        set_(self, "mem", mems)
        set_(self, "edges", edge_t)
        set_(self, "live", live_t)
        set_(self, "live_const", lc)
        set_(self, "live_names", ln)
        set_(self, "budget", None if budget is None else int(np.floor(float(budget))))
        set_(self, "pins", dict(sorted(pin_d.items())))
        set_(self, "ties", tuple(sorted(tie_t)))

    # -- helpers ---------------------------------------------------------------------------

    @property
    def n(self) -> int:
        """Number of nodes."""
        return len(self.cost)

    def index(self, name: str) -> int:
        """Position of the node called ``name``."""
        return self.names.index(name)

    def allowed(self, i: int) -> tuple[int, ...]:
        """Strategy indices node ``i`` may pick (its pin, else all)."""
        return self.pins.get(i, tuple(range(self.cost[i].size)))

    def restricted(self, allowed: Mapping[int, Collection[int]]) -> StrategyProblem:
        """The same problem with node ``i`` further restricted to ``allowed[i]`` (intersected
        with its pin); shares every array with ``self`` (no copy, no re-validation).

        >>> p = StrategyProblem(cost=[[1.0, 2.0, 3.0], [0.0, 1.0]])
        >>> p.restricted({0: [1, 2]}).allowed(0), p.allowed(0)
        ((1, 2), (0, 1, 2))
        """
        pins = dict(self.pins)
        for i, ks in allowed.items():
            i = int(i)
            s = sorted(set(int(k) for k in ks) & set(self.allowed(i)))
            if not s:
                raise PlanError(f"restricted: node {self.names[i]!r} left without a strategy")
            if len(s) < self.cost[i].size:
                pins[i] = tuple(s)
        out = object.__new__(StrategyProblem)
        for f in ("names", "cost", "mem", "edges", "live", "live_const", "live_names",
                  "budget", "ties"):
            object.__setattr__(out, f, getattr(self, f))
        object.__setattr__(out, "pins", dict(sorted(pins.items())))
        return out

    def evaluate(self, choice: Sequence[int]) -> tuple[float, float, tuple[int, ...]]:
        """``(node cost s, edge cost s, peak bytes per liveness point)`` of a full assignment.

        Exact float arithmetic in a fixed order, so the same choice always gives the same
        numbers. Pins, ties and the budget are not checked here (see :meth:`violations`).
        """
        k = [int(c) for c in choice]
        node_cost = float(sum(float(self.cost[i][k[i]]) for i in range(self.n)))
        edge_cost = float(sum(float(r[k[a], k[b]]) for a, b, r in self.edges))
        peaks = tuple(int(c + sum(int(self.mem[i][k[i]]) for i in pt))
                      for pt, c in zip(self.live, self.live_const))
        return node_cost, edge_cost, peaks

    def violations(self, choice: Sequence[int]) -> list[str]:
        """Human-readable list of violated pins, ties and memory points (empty: feasible)."""
        out = []
        for i, allowed in self.pins.items():
            if choice[i] not in allowed:
                out.append(f"pin {self.names[i]}={choice[i]} not in {allowed}")
        for g in self.ties:
            if len({choice[i] for i in g}) > 1:
                out.append(f"tie {[self.names[i] for i in g]} broken")
        if self.budget is not None:
            for t, peak in enumerate(self.evaluate(choice)[2]):
                if peak > self.budget:
                    out.append(f"point {self.live_names[t]}: {fmt_bytes(peak)} > budget")
        return out

    def __repr__(self) -> str:
        return (f"StrategyProblem({self.n} nodes, {sum(c.size for c in self.cost)} strategies, "
                f"{len(self.edges)} edges, {len(self.live)} liveness points, budget="
                f"{None if self.budget is None else fmt_bytes(self.budget)})")


def _sorted_edges(items, node):
    return sorted((((node(a, "edge"), node(b, "edge")), r) for (a, b), r in items),
                  key=lambda x: x[0])


@dataclass(frozen=True)
class Solution:
    """A chosen strategy per node with its exact cost and how the solver got there.

    ``objective = node_cost + edge_cost`` (seconds, recomputed in float from the original
    problem); ``bound`` is the solver's proven lower bound (seconds) and ``gap`` the relative
    gap ``(objective - bound) / objective`` (0 when proven optimal); ``peak_mem[t]`` is the
    footprint (bytes) at liveness point ``t``; ``status`` is ``"OPTIMAL"`` or ``"FEASIBLE"``
    (a time limit stopped the search); ``stats`` records reduction sizes and solver details.
    """

    names: tuple[str, ...]
    choice: tuple[int, ...]
    objective: float
    node_cost: float
    edge_cost: float
    peak_mem: tuple[int, ...]
    status: str
    bound: float
    gap: float
    wall_time: float
    stats: Mapping[str, object] = field(default_factory=dict, compare=False, repr=False)

    def __getitem__(self, name: str) -> int:
        """Strategy index chosen for the node called ``name``."""
        return self.choice[self.names.index(name)]

    @property
    def peak(self) -> int:
        """Largest footprint over all liveness points (0 without points)."""
        return max(self.peak_mem, default=0)

    def __str__(self) -> str:
        picks = ", ".join(f"{n}={k}" for n, k in zip(self.names, self.choice))
        if len(picks) > 200:
            picks = picks[:197] + "..."
        return (f"{self.status} {self.objective:.6g} s (nodes {self.node_cost:.6g} + edges "
                f"{self.edge_cost:.6g}), gap {self.gap:.2%}, peak {fmt_bytes(self.peak)}, "
                f"{self.wall_time * 1e3:.1f} ms: {picks}")


def brute_force(problem: StrategyProblem, max_combinations: int = 1 << 20) -> Solution:
    """Enumerate every assignment (vectorised); the oracle for tests on tiny problems.

    Ties among equal objectives go to the lexicographically smallest choice vector. Raises
    :class:`PlanError` if nothing is feasible.

    >>> p = StrategyProblem(cost=[[1.0, 2.0], [3.0, 0.5]], edges={(0, 1): [[0, 4], [4, 0]]})
    >>> brute_force(p).choice, brute_force(p).objective
    ((1, 1), 2.5)
    """
    import time

    t0 = time.perf_counter()
    n = problem.n
    sizes = [c.size for c in problem.cost]
    if int(np.prod(sizes, dtype=np.float64)) > max_combinations:
        raise PlanError(f"brute_force: {np.prod(sizes, dtype=np.float64):.3g} combinations")

    def along(i: int, v: np.ndarray) -> np.ndarray:  # v broadcast along axis i
        shape = [1] * n
        shape[i] = v.size
        return v.reshape(shape)

    total = np.zeros(sizes)
    for i in range(n):
        total = total + along(i, problem.cost[i])
    for a, b, r in problem.edges:
        shape = [1] * n
        shape[a], shape[b] = r.shape
        total = total + (r if a < b else r.T).reshape(shape)
    ok = np.ones(sizes, dtype=bool)
    for i, allowed in problem.pins.items():
        m = np.zeros(sizes[i], dtype=bool)
        m[list(allowed)] = True
        ok &= along(i, m)
    for g in problem.ties:
        for a in g[1:]:
            shape = [1] * n
            shape[g[0]] = shape[a] = sizes[a]
            ok &= np.eye(sizes[a], dtype=bool).reshape(shape)  # symmetric: axis order moot
    if problem.budget is not None:
        for pt, c in zip(problem.live, problem.live_const):
            peak = np.full(sizes, c, dtype=np.int64)
            for i in pt:
                peak = peak + along(i, problem.mem[i])
            ok &= peak <= problem.budget
    if not ok.any():
        raise PlanError("brute_force: no feasible assignment")
    masked = np.where(ok, total, np.inf)
    best = masked.min()
    # lexicographically smallest among the (float-)equal optima: first in C order
    flat = int(np.flatnonzero(masked.reshape(-1) == best)[0])
    choice = tuple(int(x) for x in np.unravel_index(flat, sizes))
    nc, ec, peaks = problem.evaluate(choice)
    return Solution(problem.names, choice, nc + ec, nc, ec, peaks, "OPTIMAL", nc + ec, 0.0,
                    time.perf_counter() - t0, {"method": "brute_force"})
