r"""Strategy selection: one strategy per node, minimum time, within memory (Alpa's ILP, reduced).

The only package of fxpar that imports OR-Tools (in :mod:`fxpar.solver.ilp`). The planner
builds a :class:`StrategyProblem` and calls :func:`solve`; nothing here knows about graphs,
ops or specs.

The program
-----------
Nodes ``i``, strategies ``k ∈ S_i`` with cost ``c_ik`` (s) and memory ``m_ik`` (B); edges
``(i, j) ∈ E`` with resharding costs ``R^ij_kl`` (s); liveness points ``t`` with live sets
``L_t`` and constants ``b_t`` (B); budget ``M``; pins ``P_i ⊆ S_i``; tie groups ``g``::

    min   Σ_i Σ_k c_ik x_ik  +  Σ_(i,j)∈E Σ_k,l R^ij_kl e^ij_kl
    s.t.  Σ_k x_ik = 1                                  every node i
          x_ik = 0                                      k ∉ P_i
          x_ik = x_jk                                   i, j in one tie group
          Σ_l e^ij_kl = x_ik,   Σ_k e^ij_kl = x_jl      every edge, k, l
          b_t + Σ_(i∈L_t) Σ_k m_ik x_ik ≤ M             every liveness point t
          x, e ∈ {0, 1}

What CP-SAT sees is the same program over the *classes* left by the reductions below, with
costs in integer units: ``scale = 2^⌊log2(2^40 / U)⌋`` units per second where
``U = Σ_i max_k c_ik + Σ_E max R`` bounds every objective value, so no sum exceeds ``2^40``
(int64 is far away) and a rounded term is off by at most ``2^-41 U``. Memory stays in whole
bytes. The objective a :class:`Solution` reports is recomputed in float from the original
problem.

Reductions (each keeps the optimum; tested against brute force)
----------------------------------------------------------------
A *class* is a set of nodes sharing one variable ``x_c ∈ D_c``; member ``i`` reads its
strategy as ``f_i(x_c)``. Class costs, edges and memory are sums over members.

``ties``
    A tie group is one class: the 32 copies of a Llama block's ``q_proj`` share one variable,
    their costs add, an edge inside a class becomes a node cost ``R_{f_i(v) f_j(v)}``, and the
    32 parallel edges between two classes become one edge with the summed matrix (the edges
    between consecutive blocks keep their own cost: they are edges between two classes).
``edges``
    Reparametrisation ``R_kl = a_k + b_l + r_kl`` (``a`` row minima, ``b`` column minima of
    ``R - a``), ``a`` and ``b`` moved into node costs. ``r ≥ 0`` has a zero in every row and
    column; a separable edge (row- or column-constant, ``a_k + b_l``) leaves ``r = 0`` and is
    dropped. Exact: it adds the same constant to every assignment's cost per value.
``prune``
    Dead-end elimination (Goldstein): value ``u`` of class ``c`` goes if some other ``v``
    has ``c_u - c_v + Σ_(d∈N(c)) min_w (R^cd_uw - R^cd_vw) ≥ 0`` and ``m_tu ≥ m_tv`` at
    every point: switching ``u → v`` never costs more, whatever the neighbours pick, and
    frees memory. It covers plain dominance (≥ cost, ≥ memory, ≥ every edge row) and
    duplicates (the higher index goes). A class left with one value is folded into the
    constant, its neighbours' costs and the points' constants.
``merge``
    Follower merging (conditional dead-end elimination): class ``j`` joins neighbour ``p`` if
    for every value ``u`` of ``p`` some ``v*(u)`` of ``j`` satisfies, for every ``v``,
    ``c_v - c_v* + R^pj_uv - R^pj_uv* + Σ_(n∈N(j)∖p) min_w (R^jn_vw - R^jn_v*w) ≥ 0`` and
    ``m_tv ≥ m_tv*``: given ``x_p = u`` the choice ``v*(u)`` is optimal whatever else is
    picked, so ``x_j = v*(x_p)`` loses nothing. ``p`` gains ``c_v*(u) + R^pj_u,v*(u)``,
    ``j``'s other edges become ``p``'s with rows ``v*(u)``, ``j``'s memory joins ``p``'s.
    A view or layout-preserving op under a resharding cost that obeys the triangle
    inequality (a shortest-path planner's) passes with ``v*(u) = u``; an op whose sharded
    variants are cheaper does not (switching layout there can pay). A leaf (one neighbour,
    no memory trade-off) always passes: on a tree without memory the reductions alone are
    dynamic programming.
``series``
    A class ``j`` with two neighbours ``a``, ``b`` and no memory, that neither pruning nor
    merging removed, is eliminated: the edge ``(a, b)`` gains
    ``M_uw = min_v (R^aj_uv + c_v + R^jb_vw)`` and ``x_j = argmin_v`` of that, read back from
    the values ``a`` and ``b`` end with (``Reduced.series``; a *probe* member of each
    follows it through the later reductions). Exact, as one step of bucket elimination: the
    unrolled loops of recurrent layers are long chains of such classes.
``points``
    A point whose worst case fits the budget cannot bind; a point whose live set is a
    subset of another's with no larger constant, or (over classes) is termwise ≤ another,
    is implied; points equal over class variables (repeated blocks) are one.

Costs stay float64 through the reductions; the dominance tests allow a slack of
``1e-12·U`` for float round-off (a shortest-path metric has ``AR = RS + AG`` only in exact
arithmetic), so an applied reduction can lose at most that much.

Dynamic programming before CP-SAT
---------------------------------
The reduced problem *without its memory points* is solved exactly by bucket elimination
(:mod:`fxpar.solver.dp`: eliminate class ``c`` with neighbours ``N`` into
``g(x_N) = min_v Σ_(factors ∋ c) f(v, x_N)``, greedy min-fill order, tables capped at
``DEFAULT_MAX_TABLE`` entries). Its optimum is a lower bound of the program above; if it also
meets every point's budget it is optimal, and CP-SAT is not run (``stats["method"] == "dp"``).
A tied transformer block reduces to a near-tree (Llama-3-8B on ``(dp=8, tp=8)``: 82 classes,
95 edges, largest table 0.6M entries): 0.05 s instead of 7 s of CP-SAT presolve and probing.
When memory binds and the tables fit, the Lagrangian DP comes next
(:func:`fxpar.solver.bounds.lagrangian_bound`): the same elimination over
``cost + λ·mem``, ``λ`` maximised by bisection, inside a branch and bound over the memory
levels of the classes that hold the most memory; its bounds decide when they prove the
requested gap (``max(filter_gap, params["relative_gap_limit"])``, on the whole objective,
offset included) or optimality (``stats["method"] == "lagrange-dp"``). GPT-20B on
``(data, z, y, x) = (4, 4, 2, 2)`` after the bound filter (36 classes, 1.9k values): within
0.5% in 0.3 s, where CP-SAT took 45-57 s to reach 1%. Otherwise (tables too large, ties kept
as constraints, gap not proven) CP-SAT solves it, hinted with the best assignment found.

Bound filtering before CP-SAT (large domains)
---------------------------------------------
When the DP does not decide it (tables over the cap: a 4-D mesh gives classes of 600-1700
values and a residual connection a ``|D|³`` table; or memory binds), :mod:`fxpar.solver.bounds`
drops every value whose *spanning-forest min-marginal* (edges are ``≥ 0`` after
reparametrisation, so dropping the non-forest edges bounds from below; memory enters by
Lagrange multipliers) exceeds the cost ``UB`` of a feasible assignment (the forest's minimiser
improved by conditional modes): no optimal value is ever dropped, so the problem restricted to
what is left (pins), reduced and solved again, has the same optimum. The 2-layer GPT on
``(data, z, y, x) = (2, 2, 2, 2)``: 18,380 class values → 33, solved by the reductions
(was: CP-SAT 379 s, stopped at a 29% gap).

The LP relaxation's dual before CP-SAT (wide graphs, no memory points)
----------------------------------------------------------------------
When neither decides a problem without memory points (the graph is wide *and* its domains
large: a step loop unrolled over the sequence, whose inputs and state meet every step, as
RWKV's and xLSTM's; RoPE tables and hyper-connection streams shared by every layer, as
HunYuan v4's: tables of ``10¹¹-10¹⁴`` entries, and a forest bound 30-97% below the optimum),
:mod:`fxpar.solver.dual` climbs the local-polytope LP's dual by sequential message passing
(SRMP), which gives a lower bound and, per value, a bound on every assignment through it.
Values whose bound exceeds the best assignment found are dropped (exact); the DP solves what
is left when its tables fit, and its optimum is then the optimum (``"dual+dp"``). The best
assignment comes from the same DP on the values of (near-)zero reduced cost. Tiny 2-layer
models on ``(dp, tp) = (2, 2)``: RWKV 12.5k class values, proven optimal in ~2.5 s (was:
CP-SAT, ~300k Booleans, stopped by the 60 s limit at an 80% gap with a plan 5x slower);
xLSTM, HunYuan v4 likewise (1-3 s). When the dual cannot prove it (the LP is not tight)
CP-SAT gets the filtered problem if its model is small (:data:`DUAL_CPSAT_MAX_BOOLEANS`),
else the best assignment is the answer, ``FEASIBLE`` with its proven gap.

Edge encoding and CP-SAT settings (``benchmarks/solver.py``; 2-core machine)
----------------------------------------------------------------------------
After reparametrisation only edges with ``r ≠ 0`` remain. Encodings: ``marginal`` (Alpa's
``e`` with both marginal sums: the local-polytope LP), ``clause`` (``y_kl ≥ x_ak + x_bl - 1``
only where ``r_kl > 0``: fewer variables, weak LP) and ``table``
(``AddAllowedAssignments((i_a, i_b, z))`` on index variables). ``marginal`` is the default: it
proves the reduced models fastest; ``clause`` is the slowest by far. CP-SAT runs with
``linearization_level=2`` and ``add_lp_constraints_lazily=False``: with the defaults the
single worker's LP stays empty and the search branches blindly (10x slower on the tied
Llama-3-8B model); and ``cp_model_probing_level=0``: probing found nothing on these programs
and took half of the time. A greedy assignment (iterated conditional modes, then memory repair)
is the hint, and the answer of last resort if a time limit stops CP-SAT before its first
solution.

Determinism
-----------
The problem is canonicalised on construction (sorted edges, points, pins, ties) and the
reductions and model are built in that order; CP-SAT runs one worker with a fixed seed
(``workers > 1`` turns on ``interleave_search``, documented as deterministic for any worker
count). So equal inputs give equal solutions in any process, including among equal-cost
optima. A wall-clock ``time_limit`` that cuts the search short is the one source of
variation; ``det_time_limit`` is the reproducible limit.

Example
-------
>>> from fxpar.solver import StrategyProblem, solve
>>> # a matmul (replicated / column-sharded / row-sharded) feeding a relu (R or S)
>>> p = StrategyProblem(
...     names=["mm", "relu"],
...     cost=[[4.0, 1.0, 1.0], [0.5, 0.25]],
...     mem=[[4 << 30, 1 << 30, 1 << 30], [1 << 30, 256 << 20]],
...     edges={("mm", "relu"): [[0.0, 0.0], [0.5, 0.0], [1.0, 1.0]]},
...     live=[{"mm", "relu"}], live_names=["peak"], budget=3 << 30)
>>> s = solve(p)
>>> print(s)
OPTIMAL 1.25 s (nodes 1.25 + edges 0), gap 0.00%, peak 1.25 GiB, ... ms: mm=1, relu=1
>>> s["mm"], s.peak_mem
(1, (1342177280,))
"""

from fxpar.solver.problem import Solution, StrategyProblem, brute_force, fmt_bytes
from fxpar.solver.reduce import ALL_REDUCTIONS, Reduced, Removal, choose_scale, reduce_problem
from fxpar.solver.ilp import DUAL_CPSAT_MAX_BOOLEANS, EDGE_ENCODINGS, min_peak_memory, solve
from fxpar.solver.dp import eliminate

__all__ = [
    "StrategyProblem", "Solution", "solve", "min_peak_memory", "brute_force",
    "reduce_problem", "Reduced", "Removal", "choose_scale", "ALL_REDUCTIONS", "EDGE_ENCODINGS",
    "fmt_bytes", "eliminate", "DUAL_CPSAT_MAX_BOOLEANS",
]
