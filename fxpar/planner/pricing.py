r"""Pricing of the intra-op problem: node compute times, node memory, edge resharding matrices.

Pure functions of a node, one strategy and the mesh (no solver, no graph walking beyond a node's
inputs); :mod:`fxpar.planner.intra_op` calls them for every node and edge.

* **node cost** ``c_ik = t_fwd + t_bwd`` (:func:`compute_times`):
  :func:`fxpar.cost.compute.op_cost` on the LOCAL shapes (``max_local_shape(spec, global,
  mesh.shape)`` of each tensor input under strategy ``k`` and of each output), priced by
  :func:`fxpar.cost.compute.op_time` (roofline on ``mesh.cluster``); ``t_bwd = 0`` when the
  node's output needs no gradient (:func:`fxpar.cost.compute.grad_flags`). An op that
  communicates inside its local program under ``k`` (its record's ``comm``: a
  vocabulary-parallel cross-entropy's all-reduces) adds those seconds to ``t_fwd``/``t_bwd``
  (synchronous collectives, priced as the node's own time; the backward's only when the node
  needs a gradient).
* **edge cost** (:class:`EdgePricer`) for producer ``i`` (output ``o``: the ``getitem`` index,
  else 0) feeding input ``p`` of consumer ``j``::

      R^ij_kl = reshard(out_ik[o] → in_jl[p]).time                                  (forward)
              + [needs grad] reshard(grad_in(j, l, p) → grad_out(out_ik[o])).time   (backward)
              + [i is a parameter and the forward reshard is not empty] forward time again

  with the gradient layout rules :func:`fxpar.spec.grad_in_spec` / :func:`fxpar.spec.grad_out_spec`.
  So a parameter stored ``R`` on a ``dp`` axis whose consumer shards the batch on ``dp`` gets
  a ``P(sum) → R`` all-reduce of its gradient (data-parallel gradient sync). The runtime
  reduces parameter gradients in buckets of :data:`GRAD_BUCKET_BYTES`, so a gradient pays the
  bandwidth of its reduction and only its share of a bucket's latency
  (:func:`bucketed_time`): ``t₀ + (t − t₀)·min(1, bytes / GRAD_BUCKET_BYTES)`` with ``t₀`` the
  same reduction on :meth:`fxpar.Cluster.without_latency` (a LayerNorm weight does not cost
  a whole all-reduce's latency, which would make replicating its compute look cheaper than
  data parallelism). A parameter
  stored ``S(0)`` everywhere but consumed ``R`` (ZeRO-3) pays an all-gather forward, the
  all-gather again in backward (the gathered copy is not kept: memory counts the storage
  only) and a reduce-scatter of the gradient. Several consumers of one value each pay their
  own edge (gradient accumulation across consumers is not modelled).
* **graph outputs**: a value returned by the graph must not stay ``Partial``: it is resharded
  to :func:`finalize_spec` (the pinned output spec, else ``P→R`` on every partial axis).
* **memory** ``m_ik`` (bytes per device, :func:`node_memory`): a parameter placeholder holds
  its model states (``model_state_bytes(local numel, optimizer, precision)``: Adam mixed
  precision = 16 B per local element by default); a buffer or user input its local bytes;
  any other node whose output needs a gradient and is not a view holds its local output bytes
  (an upper bound of the activations saved for backward).

>>> from types import SimpleNamespace
>>> import fxpar
>>> from fxpar.strategies.base import Strategy
>>> mesh = fxpar.Mesh(fxpar.Cluster.preset("dgx-a100"), dp=8)
>>> w = SimpleNamespace(op="placeholder", meta={"fxpar_param": SimpleNamespace(
...     kind="param", requires_grad=True), "val": torch.empty(1024, 1024, device="meta")})
>>> opts = SimpleNamespace(optimizer="adam", precision="mixed")
>>> node_memory(w, Strategy((), ("S(0)",)), mesh, {}, opts) == 16 * 1024 * 1024 // 8
True
>>> finalize_spec(Spec.parse("P(sum)"), None)
R
"""

from __future__ import annotations

import dataclasses

import math
import operator
from collections.abc import Sequence

import numpy as np
import torch
import torch.fx as fx

from fxpar import ir
from fxpar.cost.compute import TensorArg, is_view, node_dispatches, op_cost, op_time
from fxpar.cost.memory import model_state_bytes
from fxpar.cost.reshard import max_local_shape
from fxpar.defaults import BUCKET_BYTES
from fxpar.mesh import Mesh
from fxpar.resharding.intra import reshard_cost_tables
from fxpar.spec import Shard, Spec, grad_in_spec, grad_out_spec
from fxpar.strategies.base import Strategy, record_for

__all__ = ["compute_times", "time_inputs", "node_memory", "node_key", "output_meta",
           "finalize_spec", "EdgePricer", "grad_dtype"]


def _local(spec: Spec | None, shape, mesh) -> tuple[int, ...]:
    if spec is None:
        return tuple(shape)
    return max_local_shape(spec, shape, mesh.shape)


def backward_transient(nodes, strategies, mesh, flags) -> int:
    """Bytes per device live on top of the saved activations while one op's backward runs,
    the largest over the ops: its output gradient plus its activation inputs' gradients
    (``dY + ΣdX``, :func:`fxpar.cost.memory.activation_memory`'s ``peak_bytes``), each in
    the layout the op's strategy holds it.

    >>> import torch, fxpar
    >>> from fxpar.ir import grad_flags
    >>> gm = fxpar.capture(torch.nn.Linear(8, 4), (torch.randn(2, 8).requires_grad_(),))
    >>> nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    >>> mesh = fxpar.Mesh(fxpar.Cluster.local(1), dp=1)
    >>> backward_transient(nodes, [Strategy(("R", "R", "R"), ("R",))], mesh, grad_flags(gm))
    96
    """
    peak = 0
    for n, s in zip(nodes, strategies):
        if n.op != "call_function" or not flags.get(n) or is_view(n.target) or not s.outputs:
            continue
        mets = ir.tensor_metas(n)
        if not mets or mets[0] is None:
            continue
        t = mets[0]
        dy = math.prod(_local(s.outputs[0], t.shape, mesh)) * t.dtype.itemsize
        dx = 0
        for a, spec in zip(n.all_input_nodes, s.inputs):
            v = a.meta.get(ir.VAL)
            if spec is not None and flags.get(a) and ir.PARAM not in a.meta and isinstance(v, torch.Tensor):
                dx += math.prod(_local(spec, v.shape, mesh)) * v.dtype.itemsize
        peak = max(peak, dy + dx)
    return peak


def output_meta(node: fx.Node, out_idx: int):
    """Tensor meta of output ``out_idx`` of ``node`` (``None`` past its last output)."""
    mets = ir.tensor_metas(node)
    return mets[out_idx] if out_idx < len(mets) else None


def time_inputs(node, flags) -> tuple:
    """What :func:`compute_times` reads of ``node`` whatever the strategy (made once per node
    by the planner): its input nodes, each one's tensor meta (or its value when it is not
    a tensor) and gradient flag, the node's tensor output metas and their count with
    ``None`` entries, its op record, whether it has a gradient and its
    :func:`fxpar.cost.compute.node_dispatches` (kernels and backward nodes: the same whatever
    the strategy)."""
    ins = node.all_input_nodes
    metas = {}
    for x in ins:
        v = x.meta.get(ir.VAL)
        tm = ir.tensor_meta(x) if isinstance(v, torch.Tensor) else None
        metas[x] = (tm, v, bool(flags.get(x)))
    mets = ir.tensor_metas(node)
    return (ins, metas, [m for m in mets if m is not None], len(mets), record_for(node.target),
            bool(flags.get(node, False)), node_dispatches(node, requires_grad=flags))


def compute_times(node, strat: Strategy, mesh, flags, opts,
                  prep: tuple | None = None) -> tuple[float, float]:
    """``(t_fwd, t_bwd)`` seconds of ``node`` under ``strat`` (module docstring); 0 for a
    non-``call_function`` node. ``prep``: :func:`time_inputs` of the node, when the caller
    prices many strategies of it."""
    if node.op != "call_function":
        return 0.0, 0.0
    ins, metas, outs_m, n_out, rec, grad, disp = prep if prep is not None else time_inputs(node, flags)
    spec_of = {a: strat.inputs[q] if q < len(strat.inputs) else None for q, a in enumerate(ins)}

    def conv(x):
        if isinstance(x, fx.Node):
            tm, v, g = metas[x]
            if tm is None:
                return v
            return TensorArg(_local(spec_of.get(x), tm.shape, mesh), tm.dtype, g)
        if isinstance(x, (list, tuple)):
            return type(x)(conv(y) for y in x)
        return x

    args = tuple(conv(a) for a in node.args)
    kwargs = {k: conv(v) for k, v in node.kwargs.items()}
    outs = [TensorArg(_local(strat.outputs[o] if o < len(strat.outputs) else None, t.shape, mesh), t.dtype)
            for o, t in enumerate(outs_m)]
    out = outs[0] if n_out == 1 and outs else tuple(outs)
    c = op_cost(node.target, args, kwargs, out)
    if not grad:
        c = dataclasses.replace(c, bwd_flops=0.0, bwd_bytes=0.0)
        disp = (disp[0], 0) if disp is not None else None
    f, b = op_time(c, mesh.cluster, opts.efficiency, opts.memory_efficiency, dispatches=disp)
    if rec is not None and rec.comm is not None:
        cf, cb = rec.comm(node, strat, mesh)
        f, b = f + cf, b + (cb if grad else 0.0)
    return f, b


def node_memory(node, strat: Strategy, mesh, flags, opts, *, kept: bool = True,
                extra: int = 0) -> int:
    """``m_ik``: bytes per device ``node`` keeps under ``strat`` (module docstring): a
    parameter's model states, an input's bytes, and an activation's output only where
    autograd keeps it for the backward (``kept``: :func:`fxpar.cost.memory.saved_storage`),
    plus the ``extra`` bytes its own backward keeps (norm statistics, a mask), sharded as
    its first output."""
    info = node.meta.get(ir.PARAM)
    mets = ir.tensor_metas(node)
    if not strat.outputs or not mets or mets[0] is None:
        return 0
    if node.op == "placeholder" or node.op == "get_attr":
        t = mets[0]
        local = math.prod(_local(strat.outputs[0], t.shape, mesh))
        if info is not None and info.kind == "param" and info.requires_grad:
            return int(model_state_bytes(local, optimizer=opts.optimizer, precision=opts.precision,
                                         reduce_dtype=getattr(opts, "reduce_dtype", None)).total)
        return local * t.dtype.itemsize
    if not flags.get(node, False) or (node.op == "call_function" and is_view(node.target)):
        return 0
    if node.target is operator.getitem:
        return 0
    total = 0
    if extra:
        t = mets[0]
        n = math.prod(t.shape)
        total += extra * math.prod(_local(strat.outputs[0], t.shape, mesh)) // n if n else extra
    if not kept:
        return total
    total += gathered_kv_bytes(node, strat, mesh)
    for o, t in enumerate(m for m in mets if m is not None):
        if o < len(strat.outputs) and t.dtype.is_floating_point:
            total += math.prod(_local(strat.outputs[o], t.shape, mesh)) * t.dtype.itemsize
    return total

def gathered_kv_bytes(node, strat: Strategy, mesh) -> int:
    """Bytes per device of the keys and values an attention on the sequence split (queries
    ``S(2)`` over axes of ``c`` devices, K/V replicated there: gathered over them) keeps for
    its backward beyond the shards their producers hold: ``(1 − 1/c)·(|K| + |V|)`` at K/V's
    local shape (context parallelism's memory: at 128k tokens a layer's gathered K/V is 1 GiB).

    >>> import torch, fxpar
    >>> from types import SimpleNamespace
    >>> mesh = fxpar.Mesh(fxpar.Cluster.local(4), cp=4)
    >>> kv = SimpleNamespace(meta={"val": torch.empty(1, 8, 1024, 64, device="meta")})
    >>> att = SimpleNamespace(target=torch.ops.aten.scaled_dot_product_attention.default,
    ...                       args=(kv, kv, kv))
    >>> gathered_kv_bytes(att, Strategy(("S(2)", "R", "R"), ("S(2)",), "seq"), mesh) == 2 * 3 * 8 * 1024 * 64
    True
    """
    if "attention" not in str(getattr(node, "target", "")) or len(strat.inputs) < 3:
        return 0
    q = strat.inputs[0]
    axes = [a for a, pl in enumerate(q.placements) if pl == Shard(2)] if q is not None else []
    # gathered: K/V not split along the sequence where the queries are
    axes = [a for a in axes if all(s is None or s.placements[a] != Shard(2) for s in strat.inputs[1:3])]
    c = math.prod(mesh.shape[a] for a in axes)
    if c == 1:
        return 0
    total = 0
    for a, spec in zip(node.args[1:3], strat.inputs[1:3]):
        t = getattr(a, "meta", {}).get(ir.VAL)
        if isinstance(t, torch.Tensor):
            total += math.prod(_local(spec, t.shape, mesh)) * t.dtype.itemsize
    return total * (c - 1) // c


def node_key(node: fx.Node, flags) -> tuple | None:
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


#: Bytes of one gradient-reduction bucket: :class:`fxpar.runtime.model_state.ModelStates`'
#: default (DDP's 25 MiB); a test keeps the two equal.
GRAD_BUCKET_BYTES = BUCKET_BYTES


def bucket_share(shape, dtype) -> float:
    """The fraction of a bucket's latency a parameter gradient of ``shape``/``dtype`` pays:
    ``min(1, bytes / GRAD_BUCKET_BYTES)`` (its global bytes: an upper bound of its shard's).

    >>> bucket_share((1024,), torch.float32), bucket_share((8192, 8192), torch.float32)
    (0.00015625, 1.0)
    """
    nbytes = math.prod(int(x) for x in shape) * dtype.itemsize
    return min(1.0, nbytes / GRAD_BUCKET_BYTES)


def grad_dtype(dtype: torch.dtype, reduce_dtype: str | None) -> torch.dtype:
    """The dtype a parameter of ``dtype`` has its gradient reduced in: a floating one's
    ``reduce_dtype`` (``PlannerOptions.reduce_dtype``, as the runtime's buckets hold it), else
    its own.

    >>> grad_dtype(torch.bfloat16, "float32"), grad_dtype(torch.int64, "float32")
    (torch.float32, torch.int64)
    """
    if reduce_dtype is not None and dtype.is_floating_point:
        return getattr(torch, reduce_dtype)
    return dtype


def bucketed_time(t: float, t0: float, share: float) -> float:
    """A bucketed gradient reduction: bandwidth ``t0`` (the latency-free time) plus ``share``
    of the latency ``t − t0``.

    >>> bucketed_time(5e-3, 1e-3, 0.25)        # 1 ms of bandwidth + a quarter of 4 ms latency
    0.002
    """
    return t0 + (t - t0) * share


def latency_free(mesh):
    """``mesh`` on :meth:`fxpar.Cluster.without_latency` (same axes and devices)."""
    return Mesh.from_devices(mesh.cluster.without_latency(), mesh.axis_names, mesh.array)


def finalize_spec(spec: Spec, pinned: Spec | None) -> Spec:
    """Layout a graph output of layout ``spec`` is returned in: the output pin, else
    ``spec`` without partial axes (``P→R``)."""
    return pinned if pinned is not None else grad_out_spec(spec)


def fan_out_grad(s: Strategy) -> Spec:
    """The layout a fan-out strategy's consumers' gradients are summed in: ``grad_acc``, else
    the gradient layout of the layout they read (``shared``, else the output's).

    >>> fan_out_grad(Strategy((), ("S(1)",), shared="R"))
    R
    """
    if s.grad_acc is not None:
        return s.grad_acc
    return grad_out_spec(s.shared if s.shared is not None else s.outputs[0])


class EdgePricer:
    """Edge matrices ``R[k, l]`` (module docstring) priced per DISTINCT pair of specs.

    A strategy list has many strategies but few distinct specs per tensor (a 4-D mesh linear
    has 624 strategies and ~60 output specs), so each edge prices the distinct producer
    output specs against the distinct consumer input specs (and the distinct gradient pairs)
    with :func:`fxpar.reshard.reshard_costs` (one single-source search per source spec) and
    expands the small matrices by index. Specs are interned to ints once per strategy list;
    a whole matrix is memoized by content (interned ids, shape, dtype, flags), so the tied
    copies of a repeated block reuse the first copy's matrices. Every entry is the same float
    sum as the pairwise formula ``ft + bt + ft`` (same order of additions).

    ``grad_steps``: backward passes per optimizer step (a pipeline chunk's microbatches); a
    parameter's gradient reshard is paid once per step, so its ``bt`` counts ``1/grad_steps``;
    it is bucketed (:func:`bucketed_time`). ``reduce_dtype``: the dtype a parameter's gradient
    is reduced in (``PlannerOptions.reduce_dtype``; ``None``: the parameter's own).
    """

    def __init__(self, mesh, grad_steps: int = 1, reduce_dtype: str | None = None):
        self.mesh = mesh
        self.grad_steps = grad_steps
        self.reduce_dtype = reduce_dtype
        self._ids: dict[Spec, int] = {}
        self._specs: list[Spec] = []
        self._gout: list[int] = []            # id -> id of grad_out_spec(spec)
        self._src: dict[tuple[int, int], np.ndarray] = {}       # (id(list), o) -> ids, -1 none
        self._dst: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}
        self._keep: list = []                 # keeps the strategy lists alive (ids above)
        self._mats: dict[tuple, np.ndarray | None] = {}
        self._table: dict[tuple, np.ndarray] = {}
        self._free = None                     # the latency-free mesh, made when first needed

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

    def _src_ids(self, strats: list[Strategy], o: int) -> tuple[np.ndarray, np.ndarray]:
        """Per strategy: the id of the layout the edge reshards output ``o`` from (``shared``
        where the strategy reshards it once for all consumers, else the output's spec) and of
        the layout its gradient is resharded to on the edge (where the consumers' gradients
        are summed: :func:`fan_out_grad`, else ``grad_out_spec``); -1 without output ``o``."""
        key = (id(strats), o)
        got = self._src.get(key)
        if got is None:
            self._keep.append(strats)
            src, gt = [], []
            for s in strats:
                if o >= len(s.outputs):
                    src.append(-1)
                    gt.append(-1)
                    continue
                fan = o == 0 and (s.shared is not None or s.grad_acc is not None)
                src.append(self._id(s.shared if fan and s.shared is not None else s.outputs[o]))
                gt.append(self._id(fan_out_grad(s)) if fan else self._gout_id(src[-1]))
            got = self._src[key] = (np.array(src, np.int64), np.array(gt, np.int64))
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

    def _tables(self, requests: list[tuple]) -> None:
        """Memoize ``T[a, b]`` = reshard time from spec id ``srcs[a]`` to spec id ``dsts[b]``
        for every ``(srcs, dsts, shape, dtype, free)`` not yet known, in one batch
        (:func:`reshard_cost_tables`); ``free``: on the latency-free mesh. Matrices of
        different strategy lists often read the same specs of one shape."""
        todo = {}
        for srcs, dsts, shape, dtype, free in requests:
            key = (srcs.tobytes(), dsts.tobytes(), shape, dtype, free)
            if key not in self._table and key not in todo:
                if free and self._free is None:
                    self._free = latency_free(self.mesh)
                todo[key] = ([self._specs[i] for i in srcs], [self._specs[i] for i in dsts],
                             self._free if free else self.mesh, shape, dtype)
        self._table.update(zip(todo, reshard_cost_tables(list(todo.values()))))

    def _get(self, srcs: np.ndarray, dsts: np.ndarray, shape, dtype, free: bool = False):
        return self._table[srcs.tobytes(), dsts.tobytes(), shape, dtype, free]

    def _grad_dtype(self, dtype, is_param: bool):
        """The dtype an edge's gradient is resharded in: a parameter's :func:`grad_dtype`,
        every other gradient its value's."""
        return grad_dtype(dtype, self.reduce_dtype) if is_param else dtype

    def matrix(self, si: list[Strategy], o: int, sj: list[Strategy], p: int, shape, dtype,
               needs_grad: bool, is_param: bool) -> np.ndarray | None:
        """``R`` of the edge (output ``o`` of a node with strategies ``si`` → input ``p`` of a
        node with strategies ``sj``), or ``None`` when it is all zeros."""
        return self.matrices([(si, o, sj, p, shape, dtype, needs_grad, is_param)])[0]

    def matrices(self, edges: Sequence[tuple]) -> list[np.ndarray | None]:
        """``[self.matrix(*e) for e in edges]``, with every reshard table they read computed
        in one batch (:func:`reshard_cost_tables`: the many shapes of a model share rounds)."""
        keys, todo, reqs = [], {}, []
        for si, o, sj, p, shape, dtype, needs_grad, is_param in edges:
            src, gt = self._src_ids(si, o)
            dst, gin = self._dst_ids(sj, p, needs_grad)
            key = (src.tobytes(), gt.tobytes(), dst.tobytes(), gin.tobytes(), shape, dtype,
                   needs_grad, is_param)
            keys.append(key)
            if key in self._mats or key in todo:
                continue
            rows, cols = src >= 0, dst >= 0
            us, si_ = np.unique(src[rows], return_inverse=True)
            ud, dj = np.unique(dst[cols], return_inverse=True)
            grad = None
            if len(us) and len(ud):
                reqs.append((us, ud, shape, dtype, False))
            if needs_grad:
                ug, gj = np.unique(gin[cols], return_inverse=True)
                ugo, gk = np.unique(gt[rows], return_inverse=True)   # per row: its target
                grad = (ug, gj, ugo, gk)
                if len(us) and len(ud):
                    gd = self._grad_dtype(dtype, is_param)
                    reqs += [(ug, ugo, shape, gd, free) for free in (False, True)[:1 + is_param]]
            todo[key] = (len(si), len(sj), rows, cols, us, si_, ud, dj, grad, shape, dtype,
                         is_param)
        self._tables(reqs)
        for key, (ni, nj, rows, cols, us, si_, ud, dj, grad, shape, dtype, is_param) in todo.items():
            R = np.zeros((ni, nj))
            if len(us) and len(ud):
                F = self._get(us, ud, shape, dtype)[np.ix_(si_, dj)]
                Rs = F
                if grad is not None:
                    ug, gj, ugo, gk = grad
                    gd = self._grad_dtype(dtype, is_param)
                    B = self._get(ug, ugo, shape, gd)             # [gin, grad target]
                    if is_param:  # reduced in buckets, once per step
                        B0 = self._get(ug, ugo, shape, gd, True)
                        B = bucketed_time(B, B0, bucket_share(shape, gd))
                        if self.grad_steps > 1:
                            B = B / self.grad_steps
                    Rs = F + B[np.ix_(gj, gk)].T
                    if is_param:
                        Rs = Rs + F
                R[np.ix_(rows, cols)] = Rs
            self._mats[key] = R if R.any() else None
        return [self._mats[k] for k in keys]
