r"""Intra-op planner: captured graph + mesh → :class:`StrategyProblem` → solve → :class:`Plan`.

Problem (Alpa's intra-op pass; the solver's math is in :mod:`fxpar.solver`):

* **nodes**: every graph node except ``output``; candidates ``S_i`` from
  ``strategies(node, mesh)`` (default :func:`fxpar.strategies.strategies_for`; a node without
  candidates gets the replicate-only fallback).
* **node cost** ``c_ik = t_fwd + t_bwd`` (+ the finalisation of a graph output), **edge cost**
  ``R^ij_kl`` (forward reshard + gradient reshard + a parameter's re-gather) and **memory**
  ``m_ik``: :mod:`fxpar.planner.pricing` (formulas there), with the gradient layout rules of
  :func:`fxpar.spec.grad_in_spec` / :func:`fxpar.spec.grad_out_spec`.
* **one liveness point** (whole forward: all model states + all saved activations), so the
  budget binds the sum; budget = ``memory_budget`` or ``cluster.device_memory``.
* **repeated layers**: :func:`fxpar.layers.repeated_copies` groups nodes by their repeated
  block (``blocks.0``, ``model.layers.17``); copies of one template (``blocks.*``) with the
  same node sequence signature (op + shapes, parameter FQN suffixes, candidate strategies)
  are tied position-wise, so the solver solves one block for all.
* **pins** restrict a node to the strategies producing the pinned spec
  (:mod:`fxpar.planner.pins`); a mesh with size-1 axes is planned without them.

Everything is iterated in graph order and sorted, CP-SAT runs one worker with a fixed seed:
the same inputs give the same plan in any process.

>>> import torch, fxpar
>>> from examples.models import MLP
>>> from fxpar.planner import plan_graph
>>> gm = fxpar.capture(MLP(8, 16, 4), (torch.randn(2, 8),))
>>> mesh = fxpar.Mesh(fxpar.Cluster.preset("dgx-a100"), dp=2)
>>> p = plan_graph(gm, mesh)            # replicate-only until strategies_for has rules
>>> p.kind, p.status, len(p.nodes)
('auto', 'OPTIMAL', 8)
"""

from __future__ import annotations

import dataclasses
import operator
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.fx as fx

from fxpar import ir
from fxpar.cost.compute import cost_rule, op_name
from fxpar.cost.step import ZERO_STYLES
from fxpar.errors import MemoryBudgetError, PlanError
from fxpar.ir import grad_flags
from fxpar.layers import layer_of, repeated_copies
from fxpar.plan_data import EdgePlan, NodePlan, Plan, StepCost
from fxpar.planner.explain import megatron_reference
from fxpar.planner.pins import match_pins, squeeze, unsqueeze
from fxpar.planner.pricing import (EdgePricer, backward_transient, bucket_share, bucketed_time,
                                   compute_times, fan_out_grad, finalize_spec, grad_dtype, latency_free,
                                   node_key, node_memory, output_meta, time_inputs)
from fxpar.resharding.intra import LOCAL_KINDS, reshard_costs, reshard_plan
from fxpar.solver import Solution, StrategyProblem, solve
from fxpar.spec import Partial, Replicate, Spec, grad_in_spec, grad_out_spec, placement_kind
from fxpar.strategies import strategies_for, unsharded_strategy
from fxpar.strategies.base import Strategy

__all__ = ["PlannerOptions", "BuiltProblem", "BuildCache", "build_problem", "plan_graph",
           "plan_and_keep", "solution_to_plan", "default_strategies", "unkeepable_pins"]


@dataclass(frozen=True)
class PlannerOptions:
    """Knobs of the cost model and solver.

    ``optimizer``/``precision``: model-state bytes per parameter (``adam``/``mixed`` = 16 B,
    ``adam``/``fp32`` = 16 B, ...; :data:`fxpar.cost.memory.STATE_BYTES_PER_PARAM`);
    ``efficiency``: fraction of peak FLOP/s reached by compute; ``memory_budget``: bytes per
    device (default ``cluster.device_memory``); ``time_limit``/``det_time_limit``: CP-SAT
    limits (the deterministic one is reproducible); ``tie_layers``: tie repeated blocks;
    ``relative_gap``: accept a plan proven within this fraction of the optimum (the solver's
    bound filter and CP-SAT stop there; 0: exact). AxoNN's 4-D grids with memory binding
    (GPT-20B on 64 devices) prove 1% in about a minute, optimality not within 60 s of CP-SAT.
    """

    optimizer: str = "adam"
    precision: str = "mixed"
    efficiency: float = 0.5
    memory_efficiency: float = 0.8
    memory_budget: float | None = None
    time_limit: float | None = 60.0
    det_time_limit: float | None = None
    tie_layers: bool = True
    relative_gap: float = 0.0
    #: backward passes per optimizer step (a pipeline's microbatches): the solver prices a
    #: parameter's gradient reduction once per step (the runtime buckets it after the last)
    grad_steps: int = 1
    #: offer fan-out values a reshard shared by their consumers and a gradient-accumulation
    #: layout (``Strategy.shared``/``grad_acc``): consumers' partial gradients summed, then
    #: reduced once, as Megatron does
    fan_out: bool = True
    #: ``plan="megatron"``: sequence parallelism (:func:`fxpar.planner.baselines.baseline_pins`)
    sequence_parallel: bool = False
    #: how the priced runtime issues ZeRO's collectives (:data:`fxpar.cost.step.ZERO_STYLES`):
    #: ``"flat"`` (fxpar's own: a unit's parameters in one collective, the updated parameters
    #: gathered in one after the step), ``"amsp"`` (AMSP's: those broadcast by their owners),
    #: ``"deepspeed"`` (one per parameter tensor, reduce-scatters not overlapped) or
    #: ``"deepspeed-list"`` (DeepSpeed ≤ 0.5's list-based collectives: host work per member),
    #: to price what another system measured
    zero_style: str = "flat"
    #: the dtype gradients are summed over microbatches and reduced in (``Program.runner``'s
    #: ``reduce_dtype``, e.g. ``"float32"`` for bf16 parameters, as Megatron-LM's
    #: ``accumulate_allreduce_grads_in_fp32`` and FSDP2's ``MixedPrecisionPolicy``): every
    #: gradient reduction moves its bytes and the gradients occupy them (``k_G``); ``None``:
    #: the parameters' own. A plan records it, and its runners reduce in it by default.
    reduce_dtype: str | None = None

    def __post_init__(self) -> None:
        if self.zero_style not in ZERO_STYLES:
            raise PlanError(f"PlannerOptions.zero_style={self.zero_style!r}: one of {ZERO_STYLES}")
        if self.reduce_dtype is not None:
            name = str(self.reduce_dtype).removeprefix("torch.")
            dt = getattr(torch, name, None)
            if not isinstance(dt, torch.dtype) or not dt.is_floating_point:
                raise PlanError(f"PlannerOptions.reduce_dtype={self.reduce_dtype!r}: a floating "
                                f"torch dtype (e.g. torch.float32 or 'bfloat16')")
            object.__setattr__(self, "reduce_dtype", str(dt).removeprefix("torch."))

    def to_dict(self) -> dict:
        out = {k: getattr(self, k) for k in ("optimizer", "precision", "efficiency",
                                             "memory_efficiency", "tie_layers")}
        # plans priced as fxpar runs them, in the parameters' dtype, keep their hash
        for k, default in (("zero_style", "flat"), ("reduce_dtype", None)):
            if getattr(self, k) != default:
                out[k] = getattr(self, k)
        return out


# ---------------------------------------------------------------------------------------------
# strategies
# ---------------------------------------------------------------------------------------------
def default_strategies() -> Callable:
    """The candidate generator used when none is given: :func:`fxpar.strategies.strategies_for`."""
    return strategies_for


# ---------------------------------------------------------------------------------------------
# repeated layers
# ---------------------------------------------------------------------------------------------
def _ties(gm: fx.GraphModule, nodes: list[fx.Node], strats: list[list[Strategy]],
          layers: Sequence[str] | None = None) -> list[list[int]]:
    """Position-wise tie groups over copies of a repeated block with equal signatures
    (``layers[i]``: :func:`fxpar.layers.layer_of` of node ``i``, computed when not given)."""
    strs: dict[int, tuple] = {}  # id(strategy list) -> (list, its strings): lists are shared

    def sig(i: int, lay: str):
        n = nodes[i]
        info = n.meta.get(ir.PARAM)
        tag = info.fqn[len(lay):] if info is not None else op_name(n.target) if n.op == "call_function" else n.op
        return (tag, tuple(None if t is None else (t.shape, str(t.dtype)) for t in ir.tensor_metas(n)))

    def texts(i: int) -> tuple:
        lst = strats[i]
        key = id(lst)
        if key not in strs:
            strs[key] = (lst, tuple(map(str, lst)))
        return strs[key][1]

    groups = []
    for tmpl, copies in repeated_copies(nodes, layers).items():
        by_sig: dict[tuple, list[list[int]]] = defaultdict(list)
        for lay, members in copies:
            idx = sorted(members, key=lambda i: (nodes[i].op != "placeholder",
                         nodes[i].meta[ir.PARAM].fqn[len(lay):] if ir.PARAM in nodes[i].meta else "", i))
            by_sig[tuple(sig(i, lay) for i in idx)].append(idx)
        for members in by_sig.values():
            # per position, the copies with the same strategies (the last block's output,
            # read once, has no gradient-accumulation choice: it is left free)
            for col in zip(*members) if len(members) > 1 else ():
                same: dict[tuple, list[int]] = defaultdict(list)
                for i in col:
                    same[texts(i)].append(i)
                groups.extend(g for g in same.values() if len(g) > 1)
    return sorted(groups)


# ---------------------------------------------------------------------------------------------
# building
# ---------------------------------------------------------------------------------------------
@dataclass
class BuiltProblem:
    """The problem plus what is needed to turn a solution into a :class:`Plan`."""

    problem: StrategyProblem
    gm: fx.GraphModule
    mesh: object
    nodes: list[fx.Node]
    strategies: list[list[Strategy]]
    fwd: list[np.ndarray]
    bwd: list[np.ndarray]
    edge_info: list[tuple]  # (i, j, p, out_index, needs_grad)
    outputs: list[tuple[int, int, Spec | None]]  # (i, out_index, pinned spec)
    options: PlannerOptions
    build_time: float = 0.0
    layers: list[str] = field(default_factory=list)
    #: the mesh as given when ``mesh`` (what the problem was built on) is it without its
    #: size-1 axes; ``None`` when they are the same (:func:`fxpar.planner.pins.squeeze`)
    full_mesh: object = None


class BuildCache:
    """What :func:`build_problem` prices per node and per edge, kept across calls: the
    strategy list, time and memory vectors of each distinct :func:`~fxpar.planner.pricing.node_key`
    and the :class:`~fxpar.planner.pricing.EdgePricer`'s matrices, per ``(mesh, options)``.
    Both are functions of their keys alone (the key is everything the default rules and
    cost models read), so a problem built with a cache is the one built without; the
    chunks of a pipeline, made of the same layers on the same submesh, then price each
    distinct node once (Llama-3-8B's 8 chunks on 2 submeshes: the layers of 2, not 8).
    Default strategy rules only (a user's ``strategies`` callable is called on every node).

    >>> import torch, fxpar
    >>> from examples.models import GPT
    >>> gm = fxpar.capture(GPT(vocab=32, d_model=16, n_heads=2, n_layers=2, seq_len=8),
    ...                    (torch.randint(0, 32, (2, 8)),))
    >>> mesh, cache = fxpar.Mesh(fxpar.Cluster.preset("dgx-a100"), dp=2, tp=2), BuildCache()
    >>> a = plan_and_keep(gm, mesh, cache=cache)[0]
    >>> b = plan_and_keep(gm, mesh, cache=cache)[0]   # every node and edge priced from the cache
    >>> a.hash == b.hash == plan_graph(gm, mesh).hash
    True
    """

    def __init__(self) -> None:
        self._per: dict[tuple, tuple[dict, EdgePricer]] = {}
        self._lists: dict[tuple, dict] = {}

    def _for(self, mesh, opts: PlannerOptions) -> tuple[dict, EdgePricer]:
        """``({node_key: priced entry}, edge pricer)`` of ``(mesh, opts)``."""
        key = (mesh, opts)
        got = self._per.get(key)
        if got is None:
            got = self._per[key] = ({}, EdgePricer(mesh, opts.grad_steps, opts.reduce_dtype))
        return got

    def _strategies(self, mesh) -> dict:
        """``{node_key: strategy list}`` on ``mesh`` (the rules read no options)."""
        return self._lists.setdefault(mesh, {})


def _strategies_of(n: fx.Node, mesh, strategies: Callable) -> list[Strategy]:
    cand = list(strategies(n, mesh) or [])
    return cand if cand else [unsharded_strategy(n, mesh.ndim)]


def _price_node(n: fx.Node, flags, mesh, opts: PlannerOptions, lst: list[Strategy],
                kept: bool = True, extra: int = 0) -> tuple:
    """``(lst, fwd, bwd, memory, cost)`` of node ``n`` with strategies ``lst`` on ``mesh``
    (read-only vectors); ``kept``/``extra``: what autograd keeps of it (:func:`_kept`)."""
    f = np.zeros(len(lst))
    b = np.zeros(len(lst))
    m = np.zeros(len(lst), dtype=np.int64)
    prep = time_inputs(n, flags) if n.op == "call_function" else None
    for k, s in enumerate(lst):
        f[k], b[k] = compute_times(n, s, mesh, flags, opts, prep)
        m[k] = node_memory(n, s, mesh, flags, opts, kept=kept, extra=extra)
    c = f + b
    for v in (f, b, m, c):
        v.setflags(write=False)
    return lst, f, b, m, c


_SUM = Partial("sum")


def _gemm_rules() -> tuple:
    from fxpar.cost import compute as cc

    return (cc.mm_cost, cc.addmm_cost, cc.bmm_cost, cc.baddbmm_cost, cc.matmul_cost, cc.linear_cost,
            cc.einsum_cost, cc.sdpa_cost, cc.convolution_cost, cc.convnd_cost, cc.conv_transpose_cost)


def fans_out(n: fx.Node, flags) -> bool:
    """``n``'s output gradient is the sum of several consumers' contributions where sharing
    pays: a differentiable floating-point value of one output read by ops none of which is
    the graph output or a ``getitem``, two or more of them GEMMs or attention (the q, k, v or
    gate, up projections of one normed input: their partial input gradients are what an
    all-reduce sums; element-wise consumers take the layout they are given, and offering
    every fan-out the variants made recurrences like RWKV's too large to prove)."""
    v = n.meta.get(ir.VAL)
    if n.op != "call_function" or not flags.get(n) or not isinstance(v, torch.Tensor) \
            or not v.dtype.is_floating_point or len(n.users) < 2:
        return False
    if not all(u.op == "call_function" and u.target is not operator.getitem for u in n.users):
        return False
    gemms = _gemm_rules()
    return sum(cost_rule(u.target) in gemms for u in n.users) >= 2


def grad_acc_spec(spec: Spec) -> Spec | None:
    """The gradient-accumulation layout offered for an output of layout ``spec``: its
    gradient layout with every ``R`` axis ``P(sum)`` (consumers' partial sums are added
    locally and reduced once), ``None`` when there is no such axis.

    >>> grad_acc_spec(Spec.parse("S(0)R")), grad_acc_spec(Spec.parse("S(0)S(1)"))
    (S(0)P(sum), None)
    """
    g = grad_out_spec(spec)
    if not any(placement_kind(p) == "R" for p in g):
        return None
    return Spec(tuple(_SUM if placement_kind(p) == "R" else p for p in g))


def fan_out_variants(s: Strategy) -> list[Strategy]:
    """The ways a fan-out node's output ``s.outputs[0]`` reaches its consumers (``s`` first):
    read as it is or resharded once (``shared``) to the layout with one sharded axis
    replicated (sequence parallelism's all-gather on ``tp``); gradients resharded per
    consumer edge or summed first (``grad_acc``, :func:`grad_acc_spec` of the layout read).

    >>> [str(v) for v in fan_out_variants(Strategy((), ("S(1)",)))]
    [' -> S(1)', ' -> S(1) | shared R', ' -> S(1) | shared R | grad P(sum)']
    """
    out = [s]
    if len(s.outputs) != 1:
        return out
    spec = s.outputs[0]
    for shared in [None] + [spec.with_axis(a, Replicate()) for a, p in enumerate(spec)
                            if placement_kind(p) == "S"]:
        if shared is not None:
            out.append(dataclasses.replace(s, shared=shared))
        g = grad_acc_spec(shared or spec)
        if g is not None:
            out.append(dataclasses.replace(s, shared=shared, grad_acc=g))
    return out


def fan_out_time(s: Strategy, mesh, tm) -> float:
    """Seconds of what a fan-out strategy does once for all consumers: the forward reshard to
    ``shared`` and the backward reshard of the summed gradients to the output's gradient
    layout (:func:`~fxpar.planner.pricing.fan_out_grad`); 0 for a plain strategy."""
    if s.shared is None and s.grad_acc is None:
        return 0.0
    out = s.outputs[0]
    t = reshard_costs(out, [s.shared], mesh, tm.shape, tm.dtype)[0] if s.shared is not None else 0.0
    return t + reshard_costs(fan_out_grad(s), [grad_out_spec(out)], mesh, tm.shape, tm.dtype)[0]


def _with_fan_out(n: fx.Node, got: tuple, mesh) -> tuple:
    """``got`` (a fan-out node's priced strategies) with each strategy's
    :func:`fan_out_variants` after it, their cost adding :func:`fan_out_time` (an
    all-reduce of the summed gradients for Megatron's one ``f`` per block input against one
    per consumer edge; an all-gather and a reduce-scatter for sequence parallelism)."""
    lst, f, b, m, c = got
    tm = ir.tensor_meta(n)
    idx, out, extra = [], [], []
    for k, s in enumerate(lst):
        for v in fan_out_variants(s):
            idx.append(k)
            out.append(v)
            extra.append(fan_out_time(v, mesh, tm))
    ix = np.array(idx)
    vecs = [f[ix], b[ix], m[ix], c[ix] + np.array(extra)]
    for v in vecs:
        v.setflags(write=False)
    return (out, *vecs)


def _kept(gm: fx.GraphModule, flags, device: str = "") -> tuple[set, dict]:
    """``(kept nodes, extra bytes)``: the nodes whose outputs autograd keeps for the backward
    (a multi-output node when one of its elements is kept) and what each saving node keeps
    besides (:func:`fxpar.cost.memory.saved_storage`). Activation memory is these alone, not
    every output (which priced HF Llama's activations about 2x what it saves); ``device``:
    the cluster's device type (attention's math path on a CPU, :func:`saved_storage`)."""
    from fxpar.cost.memory import saved_storage

    saved, extra = saved_storage(gm, flags, device=device)
    kept = set(saved)
    kept.update(a for n in saved if n.target is operator.getitem for a in n.all_input_nodes[:1])
    return kept, extra


def build_problem(gm: fx.GraphModule, mesh, *, pins: Mapping[str, object] | None = None,
                  options: PlannerOptions | None = None,
                  strategies: Callable | None = None,
                  cache: BuildCache | None = None) -> BuiltProblem:
    """Build the :class:`StrategyProblem` of ``gm`` on ``mesh`` (module docstring; a mesh
    with size-1 axes is built without them, :func:`fxpar.planner.pins.squeeze`).
    ``cache``: a :class:`BuildCache` shared with earlier calls (same problem, less work)."""
    t0 = time.perf_counter()
    opts = options or PlannerOptions()
    given = mesh
    mesh, pins = squeeze(mesh, pins)
    strategies = strategies or default_strategies()
    nodes = [n for n in gm.graph.nodes if n.op != "output"]
    flags = grad_flags(gm)
    # Nodes with equal keys (node_key: op, arguments, input/output metas, gradient flags,
    # parameter kind) get the same strategy list object and cost/memory vectors: the copies
    # of a repeated block are computed once. Only for the default rules, which read nothing
    # else of a node; a user's ``strategies`` callable is called on every node.
    share = strategies is strategies_for
    by_key: dict[tuple, tuple] = {}
    lists: dict[tuple, list] = {}
    pricer = EdgePricer(mesh, opts.grad_steps, opts.reduce_dtype)
    if cache is not None and share:
        by_key, pricer = cache._for(mesh, opts)
        lists = cache._strategies(mesh)
    strats: list[list[Strategy]] = []
    cost, mem, fwd, bwd = [], [], [], []
    kept, extra = _kept(gm, flags, mesh.cluster.device_type)
    for n in nodes:
        skey = node_key(n, flags) if share else None      # the strategies' key
        nkey = None if skey is None else skey + (n in kept, extra.get(n, 0))  # the prices'
        got = by_key.get(nkey) if nkey is not None else None
        if got is None:
            lst = lists.get(skey) if skey is not None else None
            got = _price_node(n, flags, mesh, opts, lst if lst is not None else
                              _strategies_of(n, mesh, strategies), n in kept, extra.get(n, 0))
            if nkey is not None:
                by_key[nkey] = got
        if opts.fan_out and fans_out(n, flags):
            akey = ("fan_out", nkey) if nkey is not None else None
            acc = by_key.get(akey) if akey is not None else None
            if acc is None:
                acc = _with_fan_out(n, got, mesh)
                if akey is not None:
                    by_key[akey] = acc
            got = acc
        lst, f, b, m, c = got
        strats.append(lst)
        fwd.append(f)
        bwd.append(b)
        cost.append(c)  # shared read-only: StrategyProblem converts each object once
        mem.append(m)
    index = {n: i for i, n in enumerate(nodes)}

    allowed, out_pin = match_pins(gm, nodes, strats, pins, mesh)

    # graph outputs: a returned value must not stay Partial
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    outputs: list[tuple[int, int, Spec | None]] = []
    for a in out_node.all_input_nodes:
        if a in index and isinstance(a.meta.get(ir.VAL), torch.Tensor):
            i = index[a]
            outputs.append((i, 0, out_pin))
            tm = ir.tensor_meta(a)
            fin: dict[Spec, float] = {}
            c = cost[i].copy()  # cost[i] may be shared with other nodes
            for k, s in enumerate(strats[i]):
                if s.outputs:
                    src = s.outputs[0]
                    if src not in fin:
                        fin[src] = reshard_costs(src, [finalize_spec(src, out_pin)], mesh, tm.shape,
                                                 tm.dtype)[0]
                    c[k] += fin[src]
            cost[i] = c

    # edges
    edges: dict[tuple[int, int], np.ndarray] = {}
    edge_info, priced = [], []
    for j, n in enumerate(nodes):
        for p, a in enumerate(n.all_input_nodes):
            if a not in index:
                continue
            i = index[a]
            o = n.args[1] if n.target is operator.getitem and isinstance(n.args[1], int) else 0
            tm = output_meta(a, o)
            if tm is None:
                continue
            needs_grad = bool(flags.get(a, False)) and tm.dtype.is_floating_point
            is_param = ir.PARAM in a.meta
            edge_info.append((i, j, p, o, needs_grad))
            priced.append((strats[i], o, strats[j], p, tuple(tm.shape), tm.dtype, needs_grad,
                           is_param))
    for (i, j, _, _, _), R in zip(edge_info, pricer.matrices(priced)):
        if R is not None:
            edges[i, j] = edges[i, j] + R if (i, j) in edges else R

    layers = [layer_of(n) for n in nodes]
    ties = _ties(gm, nodes, strats, layers) if opts.tie_layers else []
    budget = opts.memory_budget if opts.memory_budget is not None else mesh.cluster.device_memory
    problem = StrategyProblem(
        cost=cost, mem=mem, edges=edges, live=[list(range(len(nodes)))], live_names=["step"],
        budget=budget, pins=allowed, ties=ties, names=[n.name for n in nodes])
    return BuiltProblem(problem, gm, mesh, nodes, strats, fwd, bwd, edge_info, outputs, opts,
                        time.perf_counter() - t0, layers, None if mesh is given else given)


def unkeepable_pins(gm: fx.GraphModule, mesh, pins: Mapping[str, object], *,
                    cache: BuildCache | None = None) -> list[str]:
    """The keys of ``pins`` that name a node of ``gm`` whose strategies on ``mesh`` (the
    default rules) never produce the pinned spec: every pin :func:`build_problem` would reject
    with "no strategy produces spec", found at once, in sorted key order. Only the pinned
    nodes' strategy lists are made, through ``cache`` (a later build on ``mesh`` reuses
    them). Keys that are not node names (``"input"``, parameter FQNs) are not checked.

    >>> import torch, fxpar
    >>> from examples.models import MLP
    >>> gm = fxpar.capture(MLP(8, 16, 4), (torch.randn(2, 8),))
    >>> mesh = fxpar.Mesh(fxpar.Cluster.preset("dgx-a100"), dp=2)
    >>> unkeepable_pins(gm, mesh, {"linear": "S(0)", "gelu": "S(5)", "input": "S(0)"})
    ['gelu']
    """
    by_name = {n.name: n for n in gm.graph.nodes if n.op != "output"}
    mesh, sq = squeeze(mesh, {k: v for k, v in pins.items() if k in by_name})
    lists = cache._strategies(mesh) if cache is not None else {}
    flags = grad_flags(gm)
    nodes = [by_name[k] for k in sorted(sq)]
    strats = []
    for n in nodes:  # as build_problem makes them (and shares them with its later builds)
        nkey = node_key(n, flags)
        lst = lists.get(nkey) if nkey is not None else None
        if lst is None:
            lst = _strategies_of(n, mesh, strategies_for)
            if nkey is not None:
                lists[nkey] = lst
        strats.append(lst)
    bad: list[str] = []
    match_pins(gm, nodes, strats, sq, mesh, bad=bad)
    return bad


# ---------------------------------------------------------------------------------------------
# solution -> plan
# ---------------------------------------------------------------------------------------------
def _steps(plan) -> tuple[StepCost, ...]:
    return tuple(StepCost(s.kind, s.axis_name, int(s.nbytes), float(s.time)) for s in plan.steps
                 if s.time > 0 or s.kind not in LOCAL_KINDS)


def solution_to_plan(bp: BuiltProblem, choice: Sequence[int], *, kind: str = "auto",
                     status: str = "OPTIMAL", stats: Mapping | None = None) -> Plan:
    """Turn a strategy choice into a :class:`Plan` with the per-edge steps re-derived."""
    mesh, nodes, strats = bp.mesh, bp.nodes, bp.strategies
    # The copies of a repeated block share strategy objects and edge layouts: strings and
    # resharding plans are made once per distinct strategy / (src, dst, shape, dtype).
    texts: dict[int, tuple] = {}
    plans: dict[tuple, object] = {}

    full = bp.full_mesh

    def sstr(spec) -> str:
        return str(unsqueeze(full, spec))

    def text(s: Strategy) -> tuple:
        t = texts.get(id(s))
        if t is None:
            shown = s if full is None else Strategy(
                tuple(unsqueeze(full, x) for x in s.inputs),
                tuple(unsqueeze(full, x) for x in s.outputs), s.name, s.unsharded)
            t = texts[id(s)] = (s, str(shown), tuple(None if x is None else str(x) for x in shown.inputs),
                                tuple(str(x) for x in shown.outputs))
        return t

    def rplan(src, dst, tm, on=mesh, dtype=None):
        dtype = dtype or tm.dtype
        key = (src, dst, tuple(tm.shape), dtype, on is mesh)
        got = plans.get(key)
        if got is None:
            got = plans[key] = reshard_plan(src, dst, on, tm.shape, dtype)
        return got

    free = None

    def bucketed(g, go, tm) -> tuple[StepCost, ...]:
        # a parameter gradient's reduction, priced as the solver priced it (bucketed_time, in
        # the reduce dtype): its steps scaled to the bandwidth plus its share of the latency
        nonlocal free
        gd = grad_dtype(tm.dtype, bp.options.reduce_dtype)
        bpn = rplan(g, go, tm, dtype=gd)
        if not bpn.time:
            return _steps(bpn)
        free = free or latency_free(mesh)
        t = bucketed_time(bpn.time, rplan(g, go, tm, free, gd).time, bucket_share(tm.shape, gd))
        return tuple(dataclasses.replace(s, time=s.time * t / bpn.time) for s in _steps(bpn))

    nps, acc_edges = [], []
    for i, n in enumerate(nodes):
        s = strats[i][choice[i]]
        op = op_name(n.target) if n.op == "call_function" else n.op
        _, s_str, s_in, s_out = text(s)
        nps.append(NodePlan(
            name=n.name, op=op, layer=bp.layers[i], strategy=s_str, strategy_name=s.name,
            inputs=s_in, outputs=s_out, unsharded=bool(s.unsharded),
            index=int(choice[i]), num_strategies=len(strats[i]),
            fwd_time=float(bp.fwd[i][choice[i]]), bwd_time=float(bp.bwd[i][choice[i]]),
            memory=int(bp.problem.mem[i][choice[i]]),
            param=n.op == "placeholder" and ir.is_trainable_param(n),
            grad_acc=None if s.grad_acc is None else sstr(s.grad_acc),
            shared=None if s.shared is None else sstr(s.shared)))
        if s.shared is not None or s.grad_acc is not None:   # once for all consumers, at n
            tm = output_meta(n, 0)
            out, g, go = s.outputs[0], fan_out_grad(s), grad_out_spec(s.outputs[0])
            for d, (a, b) in (("fwd", (out, s.shared or out)), ("bwd", (g, go))):
                steps = _steps(rplan(a, b, tm))
                if steps:
                    acc_edges.append(EdgePlan(n.name, n.name, d, sstr(a), sstr(b), steps, bp.layers[i]))
    eps = []
    for i, j, p, o, needs_grad in bp.edge_info:
        sk, sl = strats[i][choice[i]], strats[j][choice[j]]
        if p >= len(sl.inputs) or sl.inputs[p] is None or o >= len(sk.outputs):
            continue
        tm = output_meta(nodes[i], o)
        fan = o == 0 and (sk.shared is not None or sk.grad_acc is not None)
        src, dst = (sk.shared or sk.outputs[o]) if fan else sk.outputs[o], sl.inputs[p]
        lay = bp.layers[j]
        fp = rplan(src, dst, tm)
        if fp.steps:
            eps.append(EdgePlan(nodes[i].name, nodes[j].name, "fwd", sstr(src), sstr(dst), _steps(fp), lay))
        if needs_grad:
            g, go = grad_in_spec(sl, p), fan_out_grad(sk) if fan else grad_out_spec(src)
            if ir.PARAM in nodes[i].meta:
                steps = bucketed(g, go, tm)
                if fp.steps:
                    steps = _steps(fp) + steps  # re-gather of the parameter for backward
            else:
                steps = _steps(rplan(g, go, tm))
            if steps:
                eps.append(EdgePlan(nodes[i].name, nodes[j].name, "bwd", sstr(g), sstr(go), steps, lay))
    eps += acc_edges
    for i, o, pin in bp.outputs:
        s = strats[i][choice[i]].outputs[o]
        tm = output_meta(nodes[i], o)
        fp = rplan(s, finalize_spec(s, pin), tm)
        if fp.steps:
            eps.append(EdgePlan(nodes[i].name, "output", "fwd", sstr(s), sstr(fp.dst), _steps(fp),
                                bp.layers[i]))
    cf = float(sum(n.fwd_time for n in nps))
    cb = float(sum(n.bwd_time for n in nps))
    comm = float(sum(e.time for e in eps))
    # what is kept (model states, saved activations) plus one op's backward at its peak
    memory = int(bp.problem.evaluate(choice)[2][0]) if bp.problem.live else 0
    transient = backward_transient(nodes, [strats[i][choice[i]] for i in range(len(nodes))], mesh,
                                   grad_flags(bp.gm))
    memory += transient
    stats = dict(stats or {}, backward_transient=transient)
    ref = megatron_reference(nodes, bp.layers, mesh)
    if ref:
        stats["megatron_tp"] = ref
    c = mesh.cluster
    shown = full if full is not None else mesh
    mesh_d = dict(axis_names=tuple(shown.axis_names), shape=tuple(shown.shape),
                  devices=tuple(shown.devices), cluster=c.to_dict())
    return Plan(kind=kind, mesh=mesh_d, nodes=tuple(nps), edges=tuple(eps), time=cf + cb + comm,
                compute_fwd=cf, compute_bwd=cb, comm=comm, memory=memory,
                budget=bp.problem.budget, status=status, options=bp.options.to_dict(),
                stats=stats)


def plan_graph(gm: fx.GraphModule, mesh, *, pins: Mapping[str, object] | None = None,
               options: PlannerOptions | None = None, strategies: Callable | None = None,
               kind: str = "auto") -> Plan:
    """Build, solve (CP-SAT, one worker) and return the :class:`Plan` of ``gm`` on ``mesh``.

    Raises :class:`PlanError` naming the budget when nothing fits in memory.
    """
    return plan_and_keep(gm, mesh, pins=pins, options=options, strategies=strategies,
                         kind=kind)[0]


def plan_and_keep(gm: fx.GraphModule, mesh, *, pins: Mapping[str, object] | None = None,
                  options: PlannerOptions | None = None, strategies: Callable | None = None,
                  kind: str = "auto", cache: BuildCache | None = None
                  ) -> tuple[Plan, BuiltProblem, Solution]:
    """:func:`plan_graph` that also returns the :class:`BuiltProblem` and the solver's
    :class:`~fxpar.solver.Solution` (what :meth:`fxpar.api.Planned.why` explains).
    ``cache``: see :class:`BuildCache`."""
    opts = options or PlannerOptions()
    bp = build_problem(gm, mesh, pins=pins, options=opts, strategies=strategies, cache=cache)
    t0 = time.perf_counter()
    try:
        kw: dict = {"det_time_limit": opts.det_time_limit} if opts.det_time_limit is not None else {}
        if opts.relative_gap > 0:
            kw.update(filter_gap=opts.relative_gap,
                      params={"relative_gap_limit": opts.relative_gap})
        sol = solve(bp.problem, time_limit=opts.time_limit, **kw)
    except MemoryBudgetError as e:
        raise MemoryBudgetError(f"no {kind} plan on {mesh!r} within the memory budget "
                                f"{bp.problem.budget} B ({bp.problem.budget / 2**30:.3g} GiB) per device: {e}") from e
    except PlanError as e:  # e.g. a tie group that the pins leave empty
        raise PlanError(f"no {kind} plan on {mesh!r}: {e}") from e
    solve_t = time.perf_counter() - t0
    stats = dict(build_s=bp.build_time, solve_s=solve_t, objective=sol.objective, gap=sol.gap,
                 nodes=bp.problem.n, strategies=int(sum(c.size for c in bp.problem.cost)),
                 edges=len(bp.problem.edges), ties=len(bp.problem.ties),
                 solve_method=sol.stats.get("method"))
    plan = solution_to_plan(bp, sol.choice, kind=kind, status=sol.status, stats=stats)
    return priced(plan, gm), bp, sol


def priced(plan: Plan, gm: fx.GraphModule, config=None) -> Plan:
    """``plan`` (of ``gm``, one SPMD step) with its unit table, ``config`` (default: read off
    its mesh and parameter layouts, :func:`fxpar.planner.price.mesh_config`) and ``time``
    the one step model's (:mod:`fxpar.cost.step`)."""
    from fxpar.planner.price import mesh_config, price_plan, unit_table

    plan = dataclasses.replace(plan, units=tuple(unit_table(gm, plan)))
    plan = dataclasses.replace(plan, config=config or mesh_config(plan))
    return dataclasses.replace(plan, time=price_plan(plan)[0].step)
