"""CP-SAT model of the reduced strategy problem, the solve driver and the min-peak program.

The only module of fxpar that imports OR-Tools.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence

import numpy as np
from ortools.sat.python import cp_model

from fxpar.errors import MemoryBudgetError, PlanError
from fxpar.solver.bounds import bound_and_filter, lagrangian_bound
from fxpar.solver.dp import DEFAULT_MAX_TABLE, eliminate, elimination_order
from fxpar.solver.dual import dual_bound
from fxpar.solver.heuristic import feasible, greedy
from fxpar.solver.problem import Solution, StrategyProblem
from fxpar.solver.reduce import ALL_REDUCTIONS, Reduced, choose_scale, reduce_problem
from fxpar.units import fmt_bytes

__all__ = ["solve", "min_peak_memory", "EDGE_ENCODINGS"]

#: ``marginal``: Alpa's e_kl with both marginal sums (tight LP, |D_a|·|D_b| booleans per edge);
#: ``clause``: y_kl ≥ x_ak + x_bl - 1 only where the reparametrised cost is non-zero;
#: ``table``: index variables and one AddAllowedAssignments((i_a, i_b, z)) per edge.
EDGE_ENCODINGS = ("marginal", "clause", "table")
DEFAULT_EDGE_ENCODING = "marginal"

_STATUS = {cp_model.OPTIMAL: "OPTIMAL", cp_model.FEASIBLE: "FEASIBLE",
           cp_model.INFEASIBLE: "INFEASIBLE", cp_model.MODEL_INVALID: "MODEL_INVALID",
           cp_model.UNKNOWN: "UNKNOWN"}


class _Model:
    """x[c][v] booleans with exactly-one per class, plus whatever the objective needs."""

    def __init__(self, red: Reduced) -> None:
        self.red = red
        self.m = cp_model.CpModel()
        self.x = []
        for c, n in enumerate(red.dom):
            xs = [self.m.new_bool_var(f"x{c}_{v}") for v in range(n)]
            self.m.add_exactly_one(xs)
            self.x.append(xs)
        for a, b in red.equal:  # ties kept as constraints (ties reduction off)
            for v in range(red.dom[a]):
                self.m.add(self.x[a][v] == self.x[b][v])

    def lin(self, c: int, vec: np.ndarray):
        return sum(int(w) * self.x[c][v] for v, w in enumerate(vec) if w)

    def add_cost_objective(self, encoding: str) -> None:
        red, m, x = self.red, self.m, self.x
        terms = [self.lin(c, vec) for c, vec in enumerate(red.cost)]
        for e, (a, b, r) in enumerate(red.edges):
            na, nb = r.shape
            if encoding == "marginal":
                ev = [[m.new_bool_var(f"e{e}_{k}_{l}") for l in range(nb)] for k in range(na)]
                for k in range(na):
                    m.add(sum(ev[k]) == x[a][k])
                for l in range(nb):
                    m.add(sum(ev[k][l] for k in range(na)) == x[b][l])
                terms.append(sum(int(r[k, l]) * ev[k][l]
                                 for k in range(na) for l in range(nb) if r[k, l]))
            elif encoding == "clause":
                for k, l in zip(*np.nonzero(r)):
                    y = m.new_bool_var(f"y{e}_{k}_{l}")
                    m.add_bool_or([x[a][k].Not(), x[b][l].Not(), y])
                    terms.append(int(r[k, l]) * y)
            elif encoding == "table":
                ia, ib = self.index_var(a), self.index_var(b)
                z = m.new_int_var(0, int(r.max()), f"z{e}")
                m.add_allowed_assignments(
                    [ia, ib, z], [(k, l, int(r[k, l])) for k in range(na) for l in range(nb)])
                terms.append(z)
            else:
                raise PlanError(f"unknown edge encoding {encoding!r}; one of {EDGE_ENCODINGS}")
        m.minimize(sum(terms))

    def index_var(self, c: int):
        if not hasattr(self, "_idx"):
            self._idx = {}
        if c not in self._idx:
            v = self.m.new_int_var(0, self.red.dom[c] - 1, f"i{c}")
            self.m.add_map_domain(v, self.x[c])
            self._idx[c] = v
        return self._idx[c]

    def add_memory(self, budget: int) -> None:
        for const, terms, _ in self.red.points:
            self.m.add(sum(self.lin(c, v) for c, v in terms) <= budget - const)

    def solver(self, time_limit, workers, seed, det_time_limit, log, params=None):
        s = cp_model.CpSolver()
        # Measured (benchmarks/solver.py): with the default level 1 the single worker's LP
        # stays empty and the search branches blindly; the full local-polytope LP up front
        # proves the tied 8B model optimal 5-10x faster.
        s.parameters.linearization_level = 2
        s.parameters.add_lp_constraints_lazily = False
        # Probing (fixing each Boolean in turn in presolve and at the root) found nothing on
        # the planner's programs and took over half of the time (Llama-3-8B on (8, 8) with
        # memory: 8.0 s -> 3.1 s without it; GPT-3-175B on (128, 8): 1.7 s -> 0.8 s; same
        # optimum and the same choice).
        s.parameters.cp_model_probing_level = 0
        s.parameters.num_workers = workers
        s.parameters.random_seed = seed
        if workers > 1:  # deterministic whatever the worker count (sat_parameters.proto)
            s.parameters.interleave_search = True
        if time_limit is not None:
            s.parameters.max_time_in_seconds = float(time_limit)
        if det_time_limit is not None:
            s.parameters.max_deterministic_time = float(det_time_limit)
        s.parameters.log_search_progress = bool(log)
        for k, v in (params or {}).items():
            setattr(s.parameters, k, v)
        return s

    def values(self, s: cp_model.CpSolver) -> list[int]:
        return [int(np.argmax([s.boolean_value(v) for v in xs])) for xs in self.x]


def solve(problem: StrategyProblem, *, time_limit: float | None = 60.0,
          det_time_limit: float | None = None, workers: int = 1, seed: int = 0,
          reductions: Collection[str] = ALL_REDUCTIONS, edge_encoding: str | None = None,
          scale: float | None = None, log: bool = False, hint: bool = True,
          params: dict | None = None, dp: bool = True, bound_filter: bool = True,
          filter_gap: float = 0.0, start: Sequence[int] | None = None,
          dual: bool = True, max_table: int = DEFAULT_MAX_TABLE) -> Solution:
    """Optimal (or, under a time limit, best found) strategy per node of ``problem``.

    Deterministic: the model is built in a canonical order and CP-SAT runs with a fixed
    ``seed`` on one worker (``workers > 1`` switches on ``interleave_search``, documented as
    deterministic for any worker count). A wall-clock ``time_limit`` that cuts the search
    short returns ``status="FEASIBLE"`` with its ``gap`` and is the one source of run-to-run
    variation; ``det_time_limit`` (CP-SAT deterministic seconds) is the reproducible limit.

    Raises :class:`PlanError` if the memory budget cannot be met (naming the budget, the
    smallest achievable peak and the liveness point that binds there) or if no feasible
    assignment was found before the time limit.

    ``dp``: first solve the reduced problem without its memory points by bucket elimination
    (:mod:`fxpar.solver.dp`, exact); if that optimum fits the budget it is the answer
    (``stats["method"] == "dp"``); if memory binds, the Lagrangian DP
    (:func:`fxpar.solver.bounds.lagrangian_bound`) answers when its bounds prove optimality
    or the accepted gap ``max(filter_gap, params["relative_gap_limit"])`` of the objective
    (``"lagrange-dp"``, ``stats["lagrange"]``); else (or when the tables would be too large)
    CP-SAT solves the full program (``"cp-sat"``).

    ``start``: a strategy per node (a known assignment) used as CP-SAT's hint when it is
    feasible and better than the greedy one.

    ``max_table``: the largest table bucket elimination may build (entries; tests make it
    small to reach the paths after the DP on problems brute force can check).

    ``dual``: when the reduced problem has no memory points and neither the DP nor the bound
    filter decides it, the LP relaxation's dual bound (:mod:`fxpar.solver.dual`) comes next:
    its reduced costs filter the values exactly, the problem left is solved by the DP when its
    tables fit (``"dual+dp"``, proven optimal); else the best assignment found is returned
    with its proven gap (``"dual"``, ``FEASIBLE``) when that gap is accepted or CP-SAT's model
    would hold more than :data:`DUAL_CPSAT_MAX_BOOLEANS` edge Booleans, and CP-SAT solves the
    filtered problem otherwise (``"dual+cp-sat"``).

    ``bound_filter``: when the DP does not decide it, first drop every value whose
    spanning-forest lower bound exceeds a feasible assignment's cost
    (:mod:`fxpar.solver.bounds`, exact) and solve the problem restricted to what is left
    (reduced again, DP again, CP-SAT last); ``stats["filter"]`` records the values before and
    after, the bounds and the time. ``filter_gap > 0`` also drops values within that
    relative gap of the upper bound: the answer is then within ``filter_gap`` of the optimum
    (``status`` ``"FEASIBLE"`` unless the bound proves it).

    >>> p = StrategyProblem(cost=[[1.0, 2.0], [3.0, 0.5]], edges={(0, 1): [[0, 4], [4, 0]]},
    ...                     names=["mm", "relu"])
    >>> s = solve(p)
    >>> s.choice, s.objective, s.status, s["relu"]
    ((1, 1), 2.5, 'OPTIMAL', 1)
    """
    t0 = time.perf_counter()
    encoding = edge_encoding or DEFAULT_EDGE_ENCODING
    scale = choose_scale(problem) if scale is None else scale
    red = reduce_problem(problem, scale=scale, reductions=reductions)
    t_reduce = time.perf_counter() - t0
    stats = dict(red.stats, encoding=encoding, reduce_s=t_reduce)

    if red.budget is not None and any(const > red.budget for const, _, _ in red.points):
        _raise_memory(problem, time_limit, workers, seed, reductions)

    exact = None
    if red.dom and dp:
        t1 = time.perf_counter()
        exact = eliminate(red, max_table=max_table)
        stats["dp_s"] = time.perf_counter() - t1
        if exact is not None and not feasible(red, exact[0]):
            exact = None  # memory binds: the relaxation's optimum is not a plan
    if red.dom and exact is None and bound_filter:
        got = _filtered_solve(problem, red, t0, stats, time_limit=time_limit,
                              det_time_limit=det_time_limit, workers=workers, seed=seed,
                              reductions=reductions, edge_encoding=edge_encoding, scale=scale,
                              log=log, hint=hint, params=params, dp=dp, filter_gap=filter_gap,
                              max_table=max_table)
        if got is not None:
            return got
    if red.dom and exact is None and dual and dp and not red.points and not red.equal:
        got = _dual_solve(problem, red, t0, stats, time_limit=time_limit,
                          det_time_limit=det_time_limit, workers=workers, seed=seed,
                          reductions=reductions, edge_encoding=edge_encoding, scale=scale,
                          log=log, hint=hint, params=params, filter_gap=filter_gap,
                          max_table=max_table)
        if got is not None:
            return got
    lag = None
    if red.dom and exact is None and dp and red.budget is not None and red.points:
        # memory binds: Lagrangian DP bounds; decides when they prove the requested gap
        t1 = time.perf_counter()
        accept = max(filter_gap, float((params or {}).get("relative_gap_limit", 0.0)))
        lag = lagrangian_bound(red, gap=accept,
                               start=None if start is None else _encode(red, start))
        if lag is not None and lag.lower == np.inf:   # proved: nothing fits the budget
            _raise_memory(problem, time_limit, workers, seed, reductions)
        if lag is not None:
            stats["lagrange"] = {"s": time.perf_counter() - t1, "rounds": lag.rounds,
                                 "nodes": lag.nodes,
                                 "lower_s": red.offset + lag.lower / red.scale,
                                 "upper_s": None if lag.upper is None
                                 else red.offset + lag.upper / red.scale}
    if not red.dom or exact is not None:  # decided by the reductions or by the DP
        x: list[int] = exact[0] if exact is not None else []
        status, bound_units = "OPTIMAL", 0
        stats["solve_s"] = stats.get("dp_s", 0.0)
        stats["method"] = "dp" if exact is not None else "reductions"
    elif lag is not None and lag.proven:
        x, bound_units = lag.x, lag.lower
        status = "OPTIMAL" if lag.upper <= lag.lower else "FEASIBLE"
        stats["solve_s"] = stats.get("dp_s", 0.0) + stats["lagrange"]["s"]
        stats["method"] = "lagrange-dp"
    else:
        stats["method"] = "cp-sat"
        model = _Model(red)
        model.add_cost_objective(encoding)
        if red.budget is not None:
            model.add_memory(red.budget)
        x0 = greedy(red) if hint else None
        # a given assignment or the Lagrangian DP's, when it is better
        for xs in ([] if not hint else [None if start is None else _encode(red, start),
                                        None if lag is None else lag.x]):
            if xs is not None and feasible(red, xs) and (
                    not feasible(red, x0) or red.value(xs) <= red.value(x0)):
                x0 = xs
        if x0 is not None:
            for c, xs in enumerate(model.x):
                for v, var in enumerate(xs):
                    model.m.add_hint(var, v == x0[c])
        s = model.solver(time_limit, workers, seed, det_time_limit, log, params)
        t1 = time.perf_counter()
        code = s.solve(model.m)
        stats["solve_s"] = time.perf_counter() - t1
        stats["build_s"] = t1 - t0 - t_reduce
        stats["branches"] = s.num_branches
        status = _STATUS.get(code, str(code))
        bound_units = int(np.floor(s.best_objective_bound + 1e-9))
        if (status == "OPTIMAL" and {"relative_gap_limit", "absolute_gap_limit"} & set(params or {})
                and int(np.ceil(s.best_objective_bound - 1e-6)) < int(round(s.objective_value))):
            status = "FEASIBLE"  # stopped by a gap limit (params): not proven optimal
        if status == "INFEASIBLE":
            _raise_memory(problem, time_limit, workers, seed, reductions)
        if status in ("OPTIMAL", "FEASIBLE"):
            x = model.values(s)
            if status == "FEASIBLE" and x0 is not None and feasible(red, x0) \
                    and red.value(x0) < red.value(x):
                x = x0  # CP-SAT was stopped before it got back to its hint
        elif x0 is not None and feasible(red, x0):  # stopped before CP-SAT's first solution
            x, status = x0, "FEASIBLE"
            bound_units = min(bound_units, red.value(x0))
        else:
            raise PlanError(f"no feasible strategy assignment found ({status}) within "
                            f"time_limit={time_limit} s, det_time_limit={det_time_limit}")
    choice = red.decode(x)
    units = red.value(x)
    nc, ec, peaks = problem.evaluate(choice)
    obj = nc + ec
    if status == "OPTIMAL":
        gap, bound = 0.0, obj
    else:
        bound = min(obj, red.offset + bound_units / scale)
        gap = (obj - bound) / obj if obj > 0 else 0.0
    stats["objective_units"] = units
    return Solution(problem.names, choice, obj, nc, ec, peaks, status, bound, gap,
                    time.perf_counter() - t0, stats)


def _encode(red: Reduced, choice: Sequence[int]) -> list[int] | None:
    """Class values that decode to ``choice`` (``None`` if the reduced problem lost it)."""
    members: dict[int, list[tuple[int, np.ndarray]]] = {}
    for i, (c, f) in enumerate(red.node_map):
        if c == -1:
            if int(f[0]) != int(choice[i]):
                return None
        elif c >= 0:
            members.setdefault(c, []).append((i, f))
    x = [0] * len(red.dom)
    for c, ms in members.items():
        ok = np.ones(red.dom[c], dtype=bool)
        for i, f in ms:
            ok &= f == int(choice[i])
        if not ok.any():
            return None
        x[c] = int(np.argmax(ok))
    # a series-eliminated node takes its best value given its neighbours: another is lost
    if red.series and red.decode(x) != tuple(int(k) for k in choice):
        return None
    return x


def class_problem(red: Reduced, keep: Sequence[np.ndarray]) -> StrategyProblem:
    """The reduced problem ``red`` (no memory points, no equalities) as a
    :class:`StrategyProblem` whose node ``c`` is class ``c`` restricted to its values
    ``keep[c]`` (sorted), in seconds: integer units over ``red.scale``, a power of two, so
    exact, and the same units again at that scale. Its optimum plus ``red.offset`` is the
    optimum of the problem ``red`` was reduced from, restricted to those values.

    >>> p = StrategyProblem(cost=[[1.0, 2.0, 0.0], [3.0, 0.5, 1.0], [0.0, 0.2, 0.1]],
    ...                     edges={(0, 1): [[0, 4, 1], [4, 0, 2], [3, 3, 0]],
    ...                            (1, 2): [[0, 1, 2], [1, 0, 1], [2, 2, 0]]})
    >>> red = reduce_problem(p)
    >>> sub = class_problem(red, [np.arange(d) for d in red.dom])
    >>> round(solve(sub).objective + red.offset, 12) == round(solve(p).objective, 12) == 1.1
    True
    """
    cost = [red.cost[c][k] / red.scale for c, k in enumerate(keep)]
    edges = [(c, d, a[np.ix_(keep[c], keep[d])] / red.scale) for c, d, a in red.edges]
    return StrategyProblem(cost=cost, edges=edges, names=[f"class{c}" for c in range(len(keep))])


def _filtered_solve(problem: StrategyProblem, red: Reduced, t0: float, stats: dict, *,
                    time_limit, filter_gap, **kw) -> Solution | None:
    """Bound filtering (:func:`fxpar.solver.bounds.bound_and_filter`) then :func:`solve` on
    the problem restricted to the surviving values; ``None`` when nothing was filtered."""
    t1 = time.perf_counter()
    f = bound_and_filter(red, gap=filter_gap)
    kept = int(sum(k.size for k in f.keep))
    info = {"values": int(sum(red.dom)), "kept": kept, "rounds": f.rounds,
            "lower_s": red.offset + f.lower / red.scale,
            "upper_s": None if f.upper is None else red.offset + f.upper / red.scale}
    if f.upper is None or kept == sum(red.dom):
        info["s"] = time.perf_counter() - t1
        stats["filter"] = info
        return None
    ub_choice = red.decode(f.x)
    left = None if time_limit is None else max(1.0, time_limit - (time.perf_counter() - t0))
    shift = 0.0   # what the inner problem's objective leaves out of the original's
    if not red.points and not red.equal:
        # the reduced problem itself, restricted: its classes are the nodes (what the
        # reductions already did is not redone on the original nodes)
        sub = class_problem(red, f.keep)
        start = [int(np.searchsorted(k, v)) for k, v in zip(f.keep, f.x)]
        info["s"] = time.perf_counter() - t1
        inner = solve(sub, time_limit=left, bound_filter=False, start=start, **kw)
        choice = red.decode([int(k[v]) for k, v in zip(f.keep, inner.choice)])
        shift = red.offset
    else:
        allowed: dict[int, set[int]] = {}
        for i, (c, fmap) in enumerate(red.node_map):
            if c >= 0:
                allowed.setdefault(i, set()).update(fmap[f.keep[c]].tolist())
        sub = problem.restricted(allowed)
        info["s"] = time.perf_counter() - t1
        inner = solve(sub, time_limit=left, bound_filter=False, start=ub_choice, **kw)
        choice = inner.choice
    nc, ec, peaks = problem.evaluate(choice)
    obj = nc + ec
    unc, uec, upeaks = problem.evaluate(ub_choice)
    if unc + uec < obj:  # a time limit stopped the inner search above the upper bound
        choice, nc, ec, peaks, obj = ub_choice, unc, uec, upeaks, unc + uec
    status, bound = inner.status, max(inner.bound + shift, info["lower_s"])
    if filter_gap > 0:  # the filtered problem's bound holds for the original only within gap
        bound = min(bound, info["upper_s"] / (1.0 + filter_gap), obj)
        bound = max(bound, info["lower_s"])
        if bound < obj * (1 - 1e-12):
            status = "FEASIBLE"
    gap = 0.0 if status == "OPTIMAL" else (obj - bound) / obj if obj > 0 else 0.0
    st = dict(stats)
    st.update({k: v for k, v in inner.stats.items() if k in ("method", "dp_s", "branches",
                                                            "build_s", "objective_units",
                                                            "dual")})
    if shift and "dual" in st:
        st["dual"] = dict(st["dual"], **{k: st["dual"][k] + shift for k in ("lower_s", "upper_s")
                                          if st["dual"].get(k) is not None})
    st["filter"] = info
    st["filtered"] = {k: inner.stats.get(k) for k in ("classes", "values", "class_edges",
                                                      "class_points", "reduce_s", "solve_s",
                                                      "lagrange")}
    st["method"] = f"filter+{inner.stats.get('method')}"
    st["solve_s"] = time.perf_counter() - t1
    return Solution(problem.names, choice, obj, nc, ec, peaks, status,
                    obj if status == "OPTIMAL" else bound, gap, time.perf_counter() - t0, st)


#: CP-SAT after the dual filter only on a model of at most this many edge Booleans (the
#: marginal encoding's ``Σ |D_a|·|D_b|``): above it, measured on the unrolled step loops of
#: RWKV and xLSTM and HunYuan v4's shared streams (~300k), presolve alone took 10-35 s and the
#: search found nothing past its hint in two minutes; the dual's own assignment and gap are
#: the answer there
DUAL_CPSAT_MAX_BOOLEANS = 50_000


def _restricted_optimum(red: Reduced, keep: list[np.ndarray], *,
                        scale: float, reductions, max_table: int) -> tuple[int, ...] | None:
    """The exact optimum of the problem ``red`` was reduced from (no memory points, no
    equalities), restricted to class values ``keep[c]`` and its fixed nodes' values: the
    restricted classes (:func:`class_problem`) reduced again and solved by bucket
    elimination; ``None`` when the tables do not fit."""
    rs = reduce_problem(class_problem(red, keep), scale=scale, reductions=reductions)
    if rs.points or rs.equal:
        return None
    if rs.dom:
        order = elimination_order(rs.dom, rs.edges, max_table)
        if order is None:
            return None
        got = eliminate(rs, max_table=max_table, order=order)
        if got is None:
            return None
    x = rs.decode(got[0] if rs.dom else [])
    return red.decode([int(k[v]) for k, v in zip(keep, x)])


def _dual_solve(problem: StrategyProblem, red: Reduced, t0: float, stats: dict, *,
                time_limit, filter_gap, reductions, scale, max_table, **kw) -> Solution | None:
    """The dual bound's route (:mod:`fxpar.solver.dual`; ``dual`` in :func:`solve`), on a
    reduced problem without memory points; ``None`` when the bound does not apply."""
    t1 = time.perf_counter()
    b = dual_bound(red)
    if b is None:
        return None
    best = red.decode(greedy(red, start=b.x))  # read off the dual, then conditional modes
    obj = sum(problem.evaluate(best)[:2])

    def slack(b) -> float:
        """The exact filter's threshold (units): no assignment through a value whose reduced
        cost exceeds it beats `best`; the margin absorbs the float round-off of the passes
        and of the reductions."""
        upper = (obj - red.offset) * red.scale
        return upper - b.lower + 1e-7 * abs(upper) + 2.0

    # The problem restricted to the values of reduced cost <= tau, solved exactly by the DP
    # where its tables fit: with tau = slack() its optimum is the optimum (every optimal
    # assignment survives the filter); a smaller tau that fits still gives an assignment
    # (an LP-tight problem keeps its optima among the values of ~zero reduced cost), which
    # lowers slack() and may prove it after all. A dual stopped early (rel_tol 1e-4: most
    # problems are proven there) goes on to 1e-7 once before giving up.
    status, rungs = "FEASIBLE", 0
    for attempt in range(2):
        if attempt:
            b = b.more(1e-7, 200)
        tau, too_wide = slack(b), np.inf
        while rungs < 12 * (attempt + 1) and tau >= 0.5:
            rungs += 1
            got = _restricted_optimum(red, [np.flatnonzero(r <= tau) for r in b.reduced],
                                      scale=scale, reductions=reductions,
                                      max_table=max_table)
            if got is None:
                too_wide, tau = tau, tau / 16
                continue
            g = sum(problem.evaluate(got)[:2])
            if g < obj:
                best, obj = got, g
            if tau >= slack(b):
                status = "OPTIMAL"
                break
            if slack(b) >= too_wide:
                break
            tau = slack(b)
        if status == "OPTIMAL":
            break
        upper = (obj - red.offset) * red.scale
        if upper - b.lower <= 1e-9 * abs(upper) + 1.0:  # the bound meets it (round-off aside)
            status = "OPTIMAL"
            break
    lower_s = red.offset + b.lower / red.scale
    method = "dual+dp" if status == "OPTIMAL" else "dual"
    keep = [np.flatnonzero(r <= slack(b)) for r in b.reduced]
    info = {"s": 0.0, "iters": b.iters, "values": int(sum(red.dom)),
            "kept": int(sum(k.size for k in keep)), "rungs": rungs, "lower_s": lower_s,
            "upper_s": obj}
    info["s"] = time.perf_counter() - t1
    gap = 0.0 if status == "OPTIMAL" else max(0.0, (obj - lower_s) / obj) if obj > 0 else 0.0
    accept = max(filter_gap, float((kw.get("params") or {}).get("relative_gap_limit", 0.0)))
    if status != "OPTIMAL" and gap > accept:
        booleans = sum(int(keep[c].size) * int(keep[d].size) for c, d, _ in red.edges)
        info["cp_sat_booleans"] = booleans
        if booleans <= DUAL_CPSAT_MAX_BOOLEANS:
            allowed = {i: set(f[keep[c]].tolist()) for i, (c, f) in enumerate(red.node_map)
                       if c >= 0}
            left = None if time_limit is None else max(1.0, time_limit - (time.perf_counter() - t0))
            inner = solve(problem.restricted(allowed), time_limit=left, bound_filter=False,
                          dual=False, start=best, reductions=reductions, scale=scale,
                          max_table=max_table, **kw)
            if inner.objective <= obj:
                best, obj = inner.choice, inner.objective
            method, status = "dual+cp-sat", inner.status
            lower_s = max(lower_s, inner.bound)
            gap = 0.0 if status == "OPTIMAL" else max(0.0, (obj - lower_s) / obj) if obj > 0 else 0.0
    nc, ec, peaks = problem.evaluate(best)
    st = dict(stats)
    st["dual"] = info
    st["method"] = method
    st["solve_s"] = time.perf_counter() - t1
    return Solution(problem.names, tuple(best), nc + ec, nc, ec, peaks, status,
                    nc + ec if status == "OPTIMAL" else min(lower_s, nc + ec), gap,
                    time.perf_counter() - t0, st)


def min_peak_memory(problem: StrategyProblem, *, time_limit: float | None = 30.0,
                    workers: int = 1, seed: int = 0,
                    reductions: Collection[str] = ALL_REDUCTIONS) -> tuple[int, int, bool, tuple]:
    """Smallest achievable ``max_t`` footprint, ignoring cost: ``(peak, point, optimal,
    choice)`` where ``point`` is the liveness point attaining it (-1 without points); if the
    time limit stops the search, ``peak`` is the proven lower bound and ``optimal`` False."""
    scale = choose_scale(problem)
    red = reduce_problem(problem, scale=scale, reductions=reductions, budget_aware=False)
    if not red.points:
        x = [0] * len(red.dom)
        return 0, -1, True, red.decode(x)
    lo = max(const for const, _, _ in red.points)
    hi = max(const + sum(int(v.max()) for _, v in terms) for const, terms, _ in red.points)
    model = _Model(red)
    peak = model.m.new_int_var(lo, hi, "peak")
    for const, terms, _ in red.points:
        model.m.add(sum(model.lin(c, v) for c, v in terms) + const <= peak)
    model.m.minimize(peak)
    s = model.solver(time_limit, workers, seed, None, False)
    code = s.solve(model.m)
    if code not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return int(s.best_objective_bound), -1, False, ()
    choice = red.decode(model.values(s))
    peaks = problem.evaluate(choice)[2]
    t = int(np.argmax(peaks))
    if code == cp_model.OPTIMAL:
        return int(peaks[t]), t, True, choice
    return int(np.ceil(s.best_objective_bound)), t, False, choice


def _raise_memory(problem, time_limit, workers, seed, reductions):
    """Raise the PlanError of a memory constraint that cannot hold: the budget, the smallest
    achievable peak, the liveness point (a named constraint ``b_t + Σ m ≤ M``) where it is
    reached, and the largest terms of that constraint at the min-peak assignment."""
    peak, t, optimal, choice = min_peak_memory(problem, time_limit=time_limit, workers=workers,
                                               seed=seed, reductions=reductions)
    where = ""
    if t >= 0:
        live = [problem.names[i] for i in problem.live[t]]
        shown = ", ".join(live[:5]) + (f", ... ({len(live)} nodes)" if len(live) > 5 else "")
        where = f" at liveness point {problem.live_names[t]!r} (live: {shown})"
        if choice:
            terms = sorted(((int(problem.mem[i][choice[i]]), problem.names[i])
                            for i in problem.live[t]), key=lambda x: (-x[0], x[1]))
            big = ", ".join(f"{n} {fmt_bytes(m)}" for m, n in terms[:5] if m > 0)
            const = problem.live_const[t]
            if big or const:
                where += ("; largest terms there: " + (big or "none")
                          + (f", constant {fmt_bytes(const)}" if const else ""))
    what = "the smallest achievable peak is" if optimal else "the peak is at least"
    raise MemoryBudgetError(f"memory budget {fmt_bytes(problem.budget)} ({problem.budget} B) cannot be "
                    f"met: {what} {fmt_bytes(peak)} ({peak} B){where}")
