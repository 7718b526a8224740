r"""Intra-op planner: captured graph + mesh → :class:`StrategyProblem` → solve → :class:`Plan`.

Problem (Alpa's intra-op pass; the solver's math is in :mod:`fxpar.solver`):

* **nodes**: every graph node except ``output``; candidates ``S_i`` from
  ``strategies(node, mesh)`` (default :func:`fxpar.strategies.strategies_for`; a node without
  candidates gets the replicate-only fallback).
* **node cost** ``c_ik = t_fwd + t_bwd``: :func:`fxpar.cost.compute.op_cost` on the LOCAL shapes
  (``spec.max_local_shape(global, mesh.shape)`` of each tensor input under strategy ``k`` and of
  each output), priced by :func:`fxpar.cost.compute.op_time` (roofline on ``mesh.cluster``).
  Which inputs need a gradient comes from :func:`fxpar.cost.compute.grad_flags`.
* **edge cost** for producer ``i`` (output ``o``: the ``getitem`` index, else 0) feeding input
  ``p`` of consumer ``j``::

      R^ij_kl = reshard(out_ik[o] → in_jl[p]).time                                  (forward)
              + [needs grad] reshard(grad_in(j, l, p) → grad_out(out_ik[o])).time   (backward)
              + [i is a parameter and the forward reshard is not empty] forward time again

  **Gradient rule** (per mesh axis ``a``; the gradient of a tensor flows consumer → producer):
  ``grad_out`` (the layout the producer needs its gradient in) maps ``S(d)→S(d)``, ``R→R``,
  ``P→R`` (each addend's gradient is the full gradient). ``grad_in`` (the layout the
  consumer's backward produces) maps ``S(d)→S(d)``, ``P→R``, and ``R→P(sum)`` when the
  consumer's strategy splits its computation along ``a`` (some other input or an output of
  the strategy is not ``R`` on ``a``: each device then computes a partial gradient), else
  ``R``. So a parameter stored ``R`` on a ``dp`` axis whose consumer shards the batch on
  ``dp`` gets a ``P(sum) → R`` all-reduce of its gradient (data-parallel gradient sync), and
  a parameter stored ``S(0)`` everywhere but consumed ``R`` (ZeRO-3) pays an all-gather
  forward, the all-gather again in backward (the gathered copy is not kept: memory counts
  the storage only) and a reduce-scatter of the gradient. Several consumers of one value each
  pay their own edge (gradient accumulation across consumers is not modelled).
* **graph outputs**: a value returned by the graph must not stay ``Partial``: producer ``i``
  pays ``reshard(out_ik → pinned output spec)`` or, unpinned, ``P→R`` on every partial axis.
* **memory** ``m_ik`` (bytes per device): a parameter placeholder holds its model states
  (``model_state_bytes(local numel, optimizer, precision)``: Adam mixed precision = 16 B per
  local element by default); a buffer or user input its local bytes; any other node whose
  output needs a gradient and is not a view holds its local output bytes (an upper bound of
  the activations saved for backward). **One liveness point** (whole forward: all model
  states + all saved activations), so the budget binds the sum; budget =
  ``memory_budget`` or ``cluster.device_memory``.
* **repeated layers**: nodes are grouped by the innermost ``nn_module_stack`` entry whose FQN
  ends in an integer (``blocks.0``, ``model.layers.17``); copies of one template
  (``blocks.*``) with the same node sequence signature (op + shapes, parameter FQN suffixes)
  are tied position-wise, so the solver solves one block for all.
* **pins**: ``{"input": spec, "output": spec, "<param fqn>": spec, "<node name>": spec}``;
  a pin allows the strategies whose output spec equals it, reading any placement on a size-1
  mesh axis as ``R`` (one device holds the whole tensor); none → PlanError.

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

import math
import re
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.fx as fx

from fxpar import ir
from fxpar.cost.compute import VIEW_OPS, TensorArg, grad_flags, op_cost, op_name, op_time
from fxpar.cost.memory import model_state_bytes
from fxpar.cost.reshard import max_local_shape
from fxpar.errors import PlanError
from fxpar.plan import EdgePlan, NodePlan, Plan, StepCost
from fxpar.reshard import reshard_cost_table, reshard_costs, reshard_plan
from fxpar.solver import StrategyProblem, solve
from fxpar.spec import Partial, Replicate, Shard, Spec, as_spec
from fxpar.strategies.base import Strategy

__all__ = ["PlannerOptions", "BuiltProblem", "build_problem", "plan_graph", "solution_to_plan",
           "default_strategies", "grad_out_spec", "grad_in_spec", "layer_of"]

_SUM = Partial("sum")
_R = Replicate()


@dataclass(frozen=True)
class PlannerOptions:
    """Knobs of the cost model and solver.

    ``optimizer``/``precision``: model-state bytes per parameter (``adam``/``mixed`` = 16 B,
    ``adam``/``fp32`` = 16 B, ...; :data:`fxpar.cost.memory.STATE_BYTES_PER_PARAM`);
    ``efficiency``: fraction of peak FLOP/s reached by compute; ``memory_budget``: bytes per
    device (default ``cluster.device_memory``); ``time_limit``/``det_time_limit``: CP-SAT
    limits (the deterministic one is reproducible); ``tie_layers``: tie repeated blocks.
    """

    optimizer: str = "adam"
    precision: str = "mixed"
    efficiency: float = 0.5
    memory_efficiency: float = 0.8
    memory_budget: float | None = None
    time_limit: float | None = 60.0
    det_time_limit: float | None = None
    tie_layers: bool = True

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("optimizer", "precision", "efficiency",
                                                "memory_efficiency", "tie_layers")}


# ---------------------------------------------------------------------------------------------
# strategies
# ---------------------------------------------------------------------------------------------
def _n_outputs(node: fx.Node) -> int:
    v = node.meta.get(ir.VAL)
    if isinstance(v, (tuple, list)):
        return sum(isinstance(x, torch.Tensor) for x in v)
    return 1 if isinstance(v, torch.Tensor) else 0


def _replicate(node: fx.Node, mesh) -> Strategy:
    r = Spec.replicate(mesh.ndim)
    ins = tuple(r if isinstance(a.meta.get(ir.VAL), (torch.Tensor, tuple, list)) else None
                for a in node.all_input_nodes)
    return Strategy(ins, (r,) * max(1, _n_outputs(node)), "R", unsharded=True)


def default_strategies() -> Callable:
    """``fxpar.strategies.strategies_for`` if it exists, else the replicate-only fallback."""
    try:
        from fxpar.strategies import strategies_for  # type: ignore[attr-defined]

        return strategies_for
    except ImportError:
        return lambda node, mesh: [_replicate(node, mesh)]


# ---------------------------------------------------------------------------------------------
# gradient layouts
# ---------------------------------------------------------------------------------------------
def grad_out_spec(spec: Spec) -> Spec:
    """Layout a producer needs the gradient of a value of layout ``spec`` in: S→S, R→R, P→R.

    >>> grad_out_spec(Spec.parse("P(sum)S(0)"))
    RS(0)
    """
    return Spec(tuple(_R if isinstance(p, Partial) else p for p in spec.placements))


def grad_in_spec(strategy: Strategy, p: int) -> Spec:
    """Layout of the gradient the consumer's backward produces for its input ``p``:
    S→S, P→R, R→P(sum) on axes where the strategy splits the computation (any other input
    or output non-R there), else R.

    >>> s = Strategy(("S(0)", "R", "R"), ("S(0)",), "dp")      # x, weight, bias
    >>> grad_in_spec(s, 1)                                      # weight grad: partial on dp
    P(sum)
    """
    spec = strategy.inputs[p]
    out = []
    for a, pl in enumerate(spec.placements):
        if isinstance(pl, Partial):
            out.append(_R)
        elif isinstance(pl, Replicate):
            split = any(s is not None and q != p and not isinstance(s[a], Replicate)
                        for q, s in enumerate(strategy.inputs)) or \
                any(not isinstance(o[a], Replicate) for o in strategy.outputs)
            out.append(_SUM if split else _R)
        else:
            out.append(pl)
    return Spec(tuple(out))


# ---------------------------------------------------------------------------------------------
# layers
# ---------------------------------------------------------------------------------------------
_REPEAT = re.compile(r"^(.*?)\.(\d+)$")


def _stack_fqns(node: fx.Node) -> list[str]:
    st = node.meta.get(ir.NN_MODULE_STACK) or {}
    out = []
    for v in st.values():
        fqn = v[0] if isinstance(v, tuple) else str(v)
        fqn = re.sub(r"^L\['self'\]\.?", "", fqn)
        out.append(fqn.replace("._modules['", ".").replace("']", ""))
    return [f for f in out if f]


def _repeat_of(fqns: Sequence[str]) -> str | None:
    """Innermost module FQN that is ``<prefix>.<int>`` (a repeated layer), else None."""
    for f in reversed(fqns):
        parts = f.split(".")
        for k in range(len(parts) - 1, 0, -1):
            if parts[k].isdigit():
                return ".".join(parts[:k + 1])
    return None


def layer_of(node: fx.Node) -> str:
    """The layer a node belongs to: its repeated block (``blocks.0``), else its top-level
    module (``fc1``), else ``(params)``/``(inputs)``/``(top)``."""
    info = node.meta.get(ir.PARAM)
    if info is not None:
        fqns = [info.fqn.rsplit(".", 1)[0]] if "." in info.fqn else []
    else:
        fqns = _stack_fqns(node)
    rep = _repeat_of(fqns)
    if rep is not None:
        return rep
    if fqns:
        return fqns[0].split(".")[0] if info is None else fqns[0].split(".")[0]
    if node.op == "placeholder":
        return "(params)" if info is not None else "(inputs)"
    return "(top)"


def _ties(gm: fx.GraphModule, nodes: list[fx.Node], strats: list[list[Strategy]],
          layers: Sequence[str] | None = None) -> list[list[int]]:
    """Position-wise tie groups over copies of a repeated block with equal signatures
    (``layers[i]``: :func:`layer_of` of node ``i``, computed here when not given)."""
    copies: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(list))
    for i, n in enumerate(nodes):
        lay = layers[i] if layers is not None else layer_of(n)
        m = _REPEAT.match(lay)
        if m:
            copies[m.group(1)][lay].append(i)

    strs: dict[int, tuple] = {}  # id(strategy list) -> (list, its strings): lists are shared

    def sig(i: int, lay: str):
        n = nodes[i]
        info = n.meta.get(ir.PARAM)
        tag = info.fqn[len(lay):] if info is not None else op_name(n.target) if n.op == "call_function" else n.op
        shapes = tuple(None if t is None else (t.shape, str(t.dtype)) for t in ir.tensor_metas(n))
        lst = strats[i]
        key = id(lst)
        if key not in strs:
            strs[key] = (lst, tuple(map(str, lst)))
        return (tag, shapes, strs[key][1])

    groups = []
    for tmpl in sorted(copies):
        by_sig: dict[tuple, list[list[int]]] = defaultdict(list)
        for lay in sorted(copies[tmpl], key=lambda s: int(_REPEAT.match(s).group(2))):
            idx = sorted(copies[tmpl][lay], key=lambda i: (nodes[i].op != "placeholder",
                         nodes[i].meta[ir.PARAM].fqn[len(lay):] if ir.PARAM in nodes[i].meta else "", i))
            by_sig[tuple(sig(i, lay) for i in idx)].append(idx)
        for members in by_sig.values():
            if len(members) > 1:
                groups.extend([list(col) for col in zip(*members)])
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
    #: size-1 axes; ``None`` when they are the same (:func:`_squeeze`)
    full_mesh: object = None


def _meta_list(node: fx.Node):
    return [t for t in ir.tensor_metas(node) if t is not None]


def _local(spec: Spec | None, shape, mesh) -> tuple[int, ...]:
    if spec is None:
        return tuple(shape)
    return max_local_shape(spec, shape, mesh.shape)


def _tensor_val_of(node: fx.Node, out_idx: int):
    mets = ir.tensor_metas(node)
    return mets[out_idx] if out_idx < len(mets) else None


def _compute_times(node, strat: Strategy, mesh, flags, opts) -> tuple[float, float]:
    if node.op != "call_function":
        return 0.0, 0.0
    ins = node.all_input_nodes
    spec_of = {a: strat.inputs[q] if q < len(strat.inputs) else None for q, a in enumerate(ins)}

    def conv(x):
        if isinstance(x, fx.Node):
            tm = ir.tensor_meta(x) if isinstance(x.meta.get(ir.VAL), torch.Tensor) else None
            if tm is None:
                return x.meta.get(ir.VAL)
            return TensorArg(_local(spec_of.get(x), tm.shape, mesh), tm.dtype, bool(flags.get(x)))
        if isinstance(x, (list, tuple)):
            return type(x)(conv(y) for y in x)
        return x

    args = tuple(conv(a) for a in node.args)
    kwargs = {k: conv(v) for k, v in node.kwargs.items()}
    mets = ir.tensor_metas(node)
    outs = [TensorArg(_local(strat.outputs[o] if o < len(strat.outputs) else None, t.shape, mesh), t.dtype)
            for o, t in enumerate(m for m in mets if m is not None)]
    out = outs[0] if len(mets) == 1 and outs else tuple(outs)
    c = op_cost(node.target, args, kwargs, out)
    if not flags.get(node, False):
        c = type(c)(c.fwd_flops, 0.0, c.fwd_bytes, 0.0, c.kind, c.known)
    return op_time(c, mesh.cluster, opts.efficiency, opts.memory_efficiency)


def _memory(node, strat: Strategy, mesh, flags, opts) -> int:
    info = node.meta.get(ir.PARAM)
    mets = ir.tensor_metas(node)
    if not strat.outputs or not mets or mets[0] is None:
        return 0
    if node.op == "placeholder" or node.op == "get_attr":
        t = mets[0]
        local = math.prod(_local(strat.outputs[0], t.shape, mesh))
        if info is not None and info.kind == "param" and info.requires_grad:
            return int(model_state_bytes(local, optimizer=opts.optimizer, precision=opts.precision).total)
        return local * t.dtype.itemsize
    if not flags.get(node, False) or (node.op == "call_function" and op_name(node.target) in VIEW_OPS):
        return 0
    if node.target is __import__("operator").getitem:
        return 0
    total = 0
    for o, t in enumerate(m for m in mets if m is not None):
        if o < len(strat.outputs) and t.dtype.is_floating_point:
            total += math.prod(_local(strat.outputs[o], t.shape, mesh)) * t.dtype.itemsize
    return total


def _default_rules():
    try:
        from fxpar.strategies import strategies_for  # type: ignore[attr-defined]

        return strategies_for
    except ImportError:
        return None


def _node_key(node: fx.Node, flags) -> tuple | None:
    """Everything the default rules, the compute-cost and the memory model read of a node:
    op and target, the arguments (input nodes by position, other values by ``repr``), the
    metas of the node and of every input, gradient flags, parameter kind. ``None`` when an
    argument is not hashable as such (then the node is not shared)."""
    ins = node.all_input_nodes
    pos = {a: q for q, a in enumerate(ins)}

    def conv(x):
        if isinstance(x, fx.Node):
            return ("@", pos[x])
        if isinstance(x, (list, tuple)):
            return (type(x).__name__,) + tuple(conv(y) for y in x)
        if isinstance(x, dict):
            return ("dict",) + tuple((k, conv(v)) for k, v in sorted(x.items()))
        if x is None or isinstance(x, (bool, int, float, str, torch.dtype, torch.device,
                                       torch.memory_format, torch.layout)):
            return (type(x).__name__, repr(x))
        raise TypeError

    try:
        args = conv(node.args)
        kwargs = conv(dict(node.kwargs))
    except TypeError:
        return None
    info = node.meta.get(ir.PARAM)
    # a placeholder's target is its name; nothing reads it (its value and kind decide)
    target = None if node.op == "placeholder" else node.target
    return (node.op, target, args, kwargs, tuple(ir.tensor_metas(node)),
            tuple(tuple(ir.tensor_metas(a)) for a in ins),
            tuple(None if isinstance(a.meta.get(ir.VAL), (torch.Tensor, tuple, list))
                  else repr(a.meta.get(ir.VAL)) for a in ins),
            bool(flags.get(node)), tuple(bool(flags.get(a)) for a in ins),
            None if info is None else (info.kind, bool(info.requires_grad)),
            ir.INPUT in node.meta, ir.PARAM in node.meta)


def _finalize(spec: Spec, pinned: Spec | None) -> Spec:
    return pinned if pinned is not None else grad_out_spec(spec)


def _pin_form(spec: Spec, nd: int, mesh) -> Spec:
    """``spec`` as pins compare it: negative shard dims made positive, and ``R`` on every
    axis of size 1 (sharding or a partial over one device is the whole tensor: the strategy
    rules offer only ``R`` there, and a baseline's ``S(0)`` on a size-1 ``z`` means that)."""
    spec = spec.normalized(nd) if nd else spec
    if 1 not in tuple(mesh.shape):
        return spec
    return Spec(tuple(_R if k == 1 else p for p, k in zip(spec.placements, mesh.shape)))


def _match_pins(gm, nodes, strats, pins, mesh) -> tuple[dict[int, list[int]], Spec | None]:
    """``{node index: allowed strategy indices}`` and the output pin."""
    out_pin = None
    allowed: dict[int, list[int]] = {}
    index = {n.name: i for i, n in enumerate(nodes)}
    params = {n.meta[ir.PARAM].fqn: n.name for n in nodes if ir.PARAM in n.meta}
    for n in nodes:
        if ir.PARAM in n.meta:
            for a in n.meta[ir.PARAM].aliases:
                params[a] = n.name
    inputs = [n.name for n in nodes if ir.INPUT in n.meta and isinstance(n.meta.get(ir.VAL), torch.Tensor)]
    by_input_name = {n.meta[ir.INPUT].name: n.name for n in nodes if ir.INPUT in n.meta}
    for key in sorted(pins or {}):
        spec = as_spec(pins[key])
        if len(spec) != mesh.ndim:
            raise PlanError(f"pin {key!r}: spec {spec} has {len(spec)} placements, mesh {mesh!r} "
                            f"has {mesh.ndim} axes")
        if key == "output":
            out_pin = spec
            continue
        if key == "input":
            targets = inputs
        elif key in params:
            targets = [params[key]]
        elif key in by_input_name:
            targets = [by_input_name[key]]
        elif key in index:
            targets = [key]
        else:
            raise PlanError(f"pin {key!r}: no parameter, input or node of that name")
        for name in targets:
            i = index[name]
            tm = ir.tensor_metas(nodes[i])
            nd = len(tm[0].shape) if tm and tm[0] is not None else 0
            want = _pin_form(spec, nd, mesh)
            ok = [k for k, s in enumerate(strats[i])
                  if s.outputs and _pin_form(s.outputs[0], nd, mesh) == want]
            if not ok:
                have = sorted({str(s.outputs[0]) for s in strats[i] if s.outputs})
                raise PlanError(f"pin {key!r} -> node {name!r}: no strategy produces spec {spec} "
                                f"(candidates: {', '.join(have[:12])}{' ...' if len(have) > 12 else ''})")
            allowed[i] = sorted(set(ok) & set(allowed.get(i, ok)))
    return allowed, out_pin


class _EdgePricer:
    """Edge matrices ``R[k, l]`` (module docstring) priced per DISTINCT pair of specs.

    A strategy list has many strategies but few distinct specs per tensor (a 4-D mesh linear
    has 624 strategies and ~60 output specs), so each edge prices the distinct producer
    output specs against the distinct consumer input specs (and the distinct gradient pairs)
    with :func:`fxpar.reshard.reshard_costs` (one single-source search per source spec) and
    expands the small matrices by index. Specs are interned to ints once per strategy list;
    a whole matrix is memoized by content (interned ids, shape, dtype, flags), so the tied
    copies of a repeated block reuse the first copy's matrices. Every entry is the same float
    sum as the pairwise formula ``ft + bt + ft`` (same order of additions).
    """

    def __init__(self, mesh):
        self.mesh = mesh
        self._ids: dict[Spec, int] = {}
        self._specs: list[Spec] = []
        self._gout: list[int] = []            # id -> id of grad_out_spec(spec)
        self._src: dict[tuple[int, int], np.ndarray] = {}       # (id(list), o) -> ids, -1 none
        self._dst: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}
        self._keep: list = []                 # keeps the strategy lists alive (ids above)
        self._mats: dict[tuple, np.ndarray | None] = {}

    def _id(self, spec: Spec) -> int:
        i = self._ids.get(spec)
        if i is None:
            i = self._ids[spec] = len(self._specs)
            self._specs.append(spec)
            self._gout.append(-1)
        return i

    def _gout_id(self, i: int) -> int:
        g = self._gout[i]
        if g < 0:
            g = self._gout[i] = self._id(grad_out_spec(self._specs[i]))
        return g

    def _src_ids(self, strats: list[Strategy], o: int) -> np.ndarray:
        key = (id(strats), o)
        got = self._src.get(key)
        if got is None:
            self._keep.append(strats)
            got = self._src[key] = np.array(
                [self._id(s.outputs[o]) if o < len(s.outputs) else -1 for s in strats], np.int64)
        return got

    def _dst_ids(self, strats: list[Strategy], p: int, needs_grad: bool) -> tuple[np.ndarray, np.ndarray]:
        key = (id(strats), p, needs_grad)
        got = self._dst.get(key)
        if got is None:
            self._keep.append(strats)
            dst, gin = [], []
            for s in strats:
                d = s.inputs[p] if p < len(s.inputs) else None
                dst.append(-1 if d is None else self._id(d))
                gin.append(self._id(grad_in_spec(s, p)) if needs_grad and d is not None else -1)
            got = self._dst[key] = (np.array(dst, np.int64), np.array(gin, np.int64))
        return got

    def _table(self, srcs: np.ndarray, dsts: np.ndarray, shape, dtype) -> np.ndarray:
        """``T[a, b]`` = reshard time from spec id ``srcs[a]`` to spec id ``dsts[b]``."""
        return reshard_cost_table([self._specs[s] for s in srcs], [self._specs[d] for d in dsts],
                                  self.mesh, shape, dtype)

    def matrix(self, si: list[Strategy], o: int, sj: list[Strategy], p: int, shape, dtype,
               needs_grad: bool, is_param: bool) -> np.ndarray | None:
        """``R`` of the edge (output ``o`` of a node with strategies ``si`` → input ``p`` of a
        node with strategies ``sj``), or ``None`` when it is all zeros."""
        src = self._src_ids(si, o)
        dst, gin = self._dst_ids(sj, p, needs_grad)
        key = (src.tobytes(), dst.tobytes(), gin.tobytes(), shape, dtype, needs_grad, is_param)
        if key in self._mats:
            return self._mats[key]
        rows, cols = src >= 0, dst >= 0
        us, si_ = np.unique(src[rows], return_inverse=True)
        ud, dj = np.unique(dst[cols], return_inverse=True)
        R = np.zeros((len(si), len(sj)))
        if len(us) and len(ud):
            F = self._table(us, ud, shape, dtype)[np.ix_(si_, dj)]
            Rs = F
            if needs_grad:
                ug, gj = np.unique(gin[cols], return_inverse=True)
                go = np.array([self._gout_id(int(x)) for x in us], np.int64)
                ugo, gk = np.unique(go, return_inverse=True)
                B = self._table(ug, ugo, shape, dtype)          # [gin, grad_out]
                Rs = F + B[np.ix_(gj, gk[si_])].T
                if is_param:
                    Rs = Rs + F
            R[np.ix_(rows, cols)] = Rs
        out = R if R.any() else None
        self._mats[key] = out
        return out


_SQUEEZE = True  # tests switch it off to check the squeezed problem against the full one


def _squeeze(mesh, pins):
    """``(mesh without its size-1 axes, pins without their placements there)``, or
    ``(mesh, pins)`` when it has none (or only size-1 axes).

    A size-1 axis holds every tensor whole and never communicates: compute, resharding and
    memory are those of the mesh without it (same devices, same order), while the resharding
    search over specs grows with every axis (Llama-3-8B on ``(data=32, z=1, y=1, x=2)``:
    17.6 s to build instead of 0.75 s). The plan re-inserts ``R`` there (:func:`_unsqueeze`)."""
    from fxpar.mesh import Mesh

    keep = [a for a, k in enumerate(mesh.shape) if k > 1]
    if not _SQUEEZE or len(keep) == mesh.ndim or not keep:
        return mesh, pins
    sq = Mesh.__new__(Mesh)
    sq._init(mesh.cluster, tuple(mesh.axis_names[a] for a in keep),
             tuple(mesh.shape[a] for a in keep), tuple(mesh.devices))
    out = None
    if pins is not None:
        out = {}
        for k, v in pins.items():
            spec = as_spec(v)
            out[k] = Spec(tuple(spec.placements[a] for a in keep)) if len(spec) == mesh.ndim else spec
    return sq, out


def _unsqueeze(full, spec: Spec | None) -> Spec | None:
    """``spec`` of the squeezed mesh on ``full``: ``R`` on each size-1 axis."""
    if spec is None or full is None:
        return spec
    it = iter(spec.placements)
    return Spec(tuple(next(it) if k > 1 else _R for k in full.shape))


def build_problem(gm: fx.GraphModule, mesh, *, pins: Mapping[str, object] | None = None,
                  options: PlannerOptions | None = None,
                  strategies: Callable | None = None) -> BuiltProblem:
    """Build the :class:`StrategyProblem` of ``gm`` on ``mesh`` (module docstring; a mesh
    with size-1 axes is built without them, :func:`_squeeze`)."""
    t0 = time.perf_counter()
    opts = options or PlannerOptions()
    given = mesh
    mesh, pins = _squeeze(mesh, pins)
    strategies = strategies or default_strategies()
    nodes = [n for n in gm.graph.nodes if n.op != "output"]
    flags = grad_flags(gm)
    # Nodes with equal keys (_node_key: op, arguments, input/output metas, gradient flags,
    # parameter kind) get the same strategy list object and cost/memory vectors: the copies
    # of a repeated block are computed once. Only for the default rules, which read nothing
    # else of a node; a user's ``strategies`` callable is called on every node.
    share = strategies is _default_rules()
    by_key: dict[tuple, tuple] = {}
    strats: list[list[Strategy]] = []
    cost, mem, fwd, bwd = [], [], [], []
    cache: dict[tuple, tuple] = {}
    for i, n in enumerate(nodes):
        nkey = _node_key(n, flags) if share else None
        if nkey is not None and nkey in by_key:
            lst, f, b, m, c = by_key[nkey]
            strats.append(lst)
            fwd.append(f)
            bwd.append(b)
            cost.append(c)  # shared read-only: StrategyProblem converts each object once
            mem.append(m)
            continue
        cand = list(strategies(n, mesh) or [])
        strats.append(cand if cand else [_replicate(n, mesh)])
        f = np.zeros(len(strats[i]))
        b = np.zeros(len(strats[i]))
        m = np.zeros(len(strats[i]), dtype=np.int64)
        base = (n.target, str(n.args), str(n.kwargs), tuple(ir.tensor_metas(n)),
                bool(flags.get(n))) if n.op == "call_function" else None
        for k, s in enumerate(strats[i]):
            key = base + (str(s),) if base is not None else None
            if key is not None and key in cache:
                f[k], b[k] = cache[key]
            else:
                f[k], b[k] = _compute_times(n, s, mesh, flags, opts)
                if key is not None:
                    cache[key] = (f[k], b[k])
            m[k] = _memory(n, s, mesh, flags, opts)
        c = f + b
        for v in (f, b, m, c):
            v.setflags(write=False)
        if nkey is not None:
            by_key[nkey] = (strats[i], f, b, m, c)
        fwd.append(f)
        bwd.append(b)
        cost.append(c)
        mem.append(m)
    index = {n: i for i, n in enumerate(nodes)}

    allowed, out_pin = _match_pins(gm, nodes, strats, pins, mesh)

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
                        fin[src] = reshard_costs(src, [_finalize(src, out_pin)], mesh, tm.shape,
                                                 tm.dtype)[0]
                    c[k] += fin[src]
            cost[i] = c

    # edges
    edges: dict[tuple[int, int], np.ndarray] = {}
    edge_info = []
    pricer = _EdgePricer(mesh)
    import operator

    for j, n in enumerate(nodes):
        for p, a in enumerate(n.all_input_nodes):
            if a not in index:
                continue
            i = index[a]
            o = n.args[1] if n.target is operator.getitem and isinstance(n.args[1], int) else 0
            tm = _tensor_val_of(a, o)
            if tm is None:
                continue
            needs_grad = bool(flags.get(a, False)) and tm.dtype.is_floating_point
            is_param = ir.PARAM in a.meta
            edge_info.append((i, j, p, o, needs_grad))
            R = pricer.matrix(strats[i], o, strats[j], p, tuple(tm.shape), tm.dtype, needs_grad,
                              is_param)
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


# ---------------------------------------------------------------------------------------------
# solution -> plan
# ---------------------------------------------------------------------------------------------
def _steps(plan) -> tuple[StepCost, ...]:
    return tuple(StepCost(s.kind, s.axis_name, int(s.nbytes), float(s.time)) for s in plan.steps
                 if s.time > 0 or s.kind not in ("chunk", "to_partial", "rescale"))


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
        return str(_unsqueeze(full, spec))

    def text(s: Strategy) -> tuple:
        t = texts.get(id(s))
        if t is None:
            shown = s if full is None else Strategy(
                tuple(_unsqueeze(full, x) for x in s.inputs),
                tuple(_unsqueeze(full, x) for x in s.outputs), s.name, s.unsharded)
            t = texts[id(s)] = (s, str(shown), tuple(None if x is None else str(x) for x in shown.inputs),
                                tuple(str(x) for x in shown.outputs))
        return t

    def rplan(src, dst, tm):
        key = (src, dst, tuple(tm.shape), tm.dtype)
        got = plans.get(key)
        if got is None:
            got = plans[key] = reshard_plan(src, dst, mesh, tm.shape, tm.dtype)
        return got

    nps = []
    for i, n in enumerate(nodes):
        s = strats[i][choice[i]]
        op = op_name(n.target) if n.op == "call_function" else n.op
        _, s_str, s_in, s_out = text(s)
        nps.append(NodePlan(
            name=n.name, op=op, layer=bp.layers[i], strategy=s_str, strategy_name=s.name,
            inputs=s_in, outputs=s_out, unsharded=bool(s.unsharded),
            index=int(choice[i]), num_strategies=len(strats[i]),
            fwd_time=float(bp.fwd[i][choice[i]]), bwd_time=float(bp.bwd[i][choice[i]]),
            memory=int(bp.problem.mem[i][choice[i]])))
    eps = []
    for i, j, p, o, needs_grad in bp.edge_info:
        sk, sl = strats[i][choice[i]], strats[j][choice[j]]
        if p >= len(sl.inputs) or sl.inputs[p] is None or o >= len(sk.outputs):
            continue
        tm = _tensor_val_of(nodes[i], o)
        src, dst = sk.outputs[o], sl.inputs[p]
        lay = bp.layers[j]
        fp = rplan(src, dst, tm)
        if fp.steps:
            eps.append(EdgePlan(nodes[i].name, nodes[j].name, "fwd", sstr(src), sstr(dst), _steps(fp), lay))
        if needs_grad:
            g, go = grad_in_spec(sl, p), grad_out_spec(src)
            bpn = rplan(g, go, tm)
            steps = _steps(bpn)
            if ir.PARAM in nodes[i].meta and fp.steps:
                steps = _steps(fp) + steps  # re-gather of the parameter for backward
            if steps:
                eps.append(EdgePlan(nodes[i].name, nodes[j].name, "bwd", sstr(g), sstr(go), steps, lay))
    for i, o, pin in bp.outputs:
        s = strats[i][choice[i]].outputs[o]
        tm = _tensor_val_of(nodes[i], o)
        fp = rplan(s, _finalize(s, pin), tm)
        if fp.steps:
            eps.append(EdgePlan(nodes[i].name, "output", "fwd", sstr(s), sstr(fp.dst), _steps(fp),
                                bp.layers[i]))
    cf = float(sum(n.fwd_time for n in nps))
    cb = float(sum(n.bwd_time for n in nps))
    comm = float(sum(e.time for e in eps))
    memory = int(bp.problem.evaluate(choice)[2][0]) if bp.problem.live else 0
    c = mesh.cluster
    shown = full if full is not None else mesh
    mesh_d = dict(axis_names=tuple(shown.axis_names), shape=tuple(shown.shape),
                  devices=tuple(shown.devices), cluster=c.to_dict())
    return Plan(kind=kind, mesh=mesh_d, nodes=tuple(nps), edges=tuple(eps), time=cf + cb + comm,
                compute_fwd=cf, compute_bwd=cb, comm=comm, memory=memory,
                budget=bp.problem.budget, status=status, options=bp.options.to_dict(),
                stats=dict(stats or {}))


def plan_graph(gm: fx.GraphModule, mesh, *, pins: Mapping[str, object] | None = None,
               options: PlannerOptions | None = None, strategies: Callable | None = None,
               kind: str = "auto") -> Plan:
    """Build, solve (CP-SAT, one worker) and return the :class:`Plan` of ``gm`` on ``mesh``.

    Raises :class:`PlanError` naming the budget when nothing fits in memory.
    """
    opts = options or PlannerOptions()
    bp = build_problem(gm, mesh, pins=pins, options=opts, strategies=strategies)
    t0 = time.perf_counter()
    try:
        sol = solve(bp.problem, time_limit=opts.time_limit, **(
            {"det_time_limit": opts.det_time_limit} if opts.det_time_limit is not None else {}))
    except PlanError as e:
        raise PlanError(f"no {kind} plan on {mesh!r} within the memory budget "
                        f"{bp.problem.budget} B ({bp.problem.budget / 2**30:.3g} GiB) per device: {e}") from e
    solve_t = time.perf_counter() - t0
    stats = dict(build_s=bp.build_time, solve_s=solve_t, objective=sol.objective, gap=sol.gap,
                 nodes=bp.problem.n, strategies=int(sum(c.size for c in bp.problem.cost)),
                 edges=len(bp.problem.edges), ties=len(bp.problem.ties),
                 solve_method=sol.stats.get("method"))
    plan = solution_to_plan(bp, sol.choice, kind=kind, status=sol.status, stats=stats)
    return plan
