"""A configuration priced by the one step model (:mod:`fxpar.cost.step`), from plans.

* :func:`unit_table`: a plan's costs attributed to the units of its graph
  (:func:`fxpar.split.units`): per device, compute and communication on the plan's own axes;
  parameter communication over the replica axes (:func:`replica_axes`: ``dp``, ``dp_shard``,
  ``cp``, whose sequence shards make a gradient a partial sum too, and any axis the plan uses
  as data parallelism whatever its name) is left out, the step
  model prices it with AMSP's terms from the configuration's state factors, and so are the
  reductions of activation gradients summed over the batch (``replica_grads``: their bytes,
  priced by the configuration's data-parallel group);
* :func:`price_config`: a :class:`~fxpar.config.ParallelConfig`'s step
  (:class:`~fxpar.cost.step.StepTime`) and peak memory per pipeline rank from its chunks' unit
  tables. The joint search calls it on the probe's table scaled to each candidate's
  microbatch; a realized plan on its own tables at their real shapes
  (:func:`price_plan`), so the two agree where the layouts agree.

>>> import torch, fxpar
>>> from examples.models import MLP
>>> gm = fxpar.capture(MLP(8, 16, 4), (torch.randn(4, 8),))
>>> p = fxpar.plan(MLP(8, 16, 4), fxpar.Cluster.preset("dgx-a100"), (torch.randn(4, 8),),
...                mesh={"dp": 2}).plan
>>> [u.layer for u in unit_table(gm, p)] == [u.layer for u in p.units]
True
>>> p.time == price_plan(p)[0].step, p.config.dp
(True, 2)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from types import SimpleNamespace

import numpy as np
import torch
import torch.fx as fx

from fxpar import ir
from fxpar.config import ParallelConfig
from fxpar.layers import layer_of
from fxpar.cost.compute import accumulate_time, node_dispatches, op_overheads
from fxpar.cost.memory import (STATE_BYTES_PER_PARAM, kept_bytes, model_state_bytes, reduce_scale,
                               selective_keeps)
from fxpar.cost.overlap import coalesced_pricer
from fxpar.cost.pipeline import SCHEDULES as PIPELINE_SCHEDULES
from fxpar.cost.pipeline import in_flight_microbatches
from fxpar.cost.step import (BUCKET, DpTerms, StepTime, UnitCost, chunk_costs, dp_terms,
                             host_rate, microbatch_overhead, optimizer_time, split_backward,
                             rank_chunks, rank_memory, step_piece, step_time, tiny_params, zero_units)
from fxpar.spec import Replicate, Spec
from fxpar.split import units

__all__ = ["REPLICA_AXES", "replica_axes", "schedule_of", "unit_table", "replica_grid",
           "price_config", "price_plan", "optimizer_seconds", "recomputed_units", "in_flight"]

#: mesh axes whose devices hold replicas of the batch split (data parallelism)
REPLICA_AXES = ("dp", "dp_shard")
#: mesh axes over which a parameter is replicated and its gradient reduced by the step's
#: data-parallel terms: the batch replicas' and context parallelism's (sequence shards)
PARAM_REPLICA_AXES = REPLICA_AXES + ("cp",)


def replica_axes(plan) -> tuple[str, ...]:
    """The axes of ``plan``'s mesh over which its parameters are data-parallel: the replica
    axes by name (:data:`PARAM_REPLICA_AXES`), plus the other axes of size > 1 (not ``pp``)
    when the plan is data-parallel on every one of them: every trainable parameter stored
    ``R`` there and some parameter's gradient all-reduced there (a position embedding's is
    reduced on its output instead). So an ``auto`` plan on ``{"tp": 4}`` that shards the batch
    and replicates the weights, or AxoNN's ``data``, is priced as the runner runs it (its
    buckets reduce those gradients behind the backward, ``gm.meta[ir.REPLICA_AXES]``), not as
    tensor-parallel collectives in the units. Storage sharded on such an axis (ZeRO-3 over
    ``dp × tp``), or an axis beside ones that shard the model (AxoNN's ``z`` beside ``y`` and
    ``x``), keeps its collectives in the units.

    >>> import torch, fxpar
    >>> from examples.models import MLP
    >>> p = fxpar.plan(MLP(8, 16, 4), fxpar.Cluster.preset("dgx-a100"), (torch.randn(4, 8),),
    ...                plan="dp", mesh={"data": 2}).plan
    >>> replica_axes(p), p.config.dp
    (('data',), 2)
    """
    names, shape = tuple(plan.mesh["axis_names"]), tuple(plan.mesh["shape"])
    named = tuple(a for a in names if a in PARAM_REPLICA_AXES)
    params = [n for n in plan.nodes if n.param]
    if not params:
        return named
    ids = {n.name for n in params}
    reduced = {st.axis for e in plan.edges if e.direction == "bwd" and e.producer in ids
               for st in e.steps if st.kind == "all_reduce"}
    stored = [Spec.parse(n.outputs[0]) for n in params]
    others = [(i, a) for i, (a, k) in enumerate(zip(names, shape))
              if a not in named and a != "pp" and k > 1]
    # all or none: beside axes that shard the model the units' per-axis reductions stay (the
    # step's data-parallel terms would price one flat all-reduce over their product instead)
    if others and all(a in reduced and all(s[i] == Replicate() for s in stored)
                      for i, a in others):
        return named + tuple(a for _, a in others)
    return named


def in_flight(schedule: str, r: int, p: int, m: int, v: int) -> float:
    """Microbatches (through the whole stage) whose activations pipeline rank ``r`` holds at
    its peak under ``schedule`` (:func:`fxpar.cost.pipeline.in_flight_microbatches`); a
    hand-written schedule is priced as GPipe (every microbatch held).

    >>> [in_flight("1f1b", r, 4, 8, 1) for r in range(4)], in_flight("zb-h1", 3, 4, 8, 1)
    ([4, 3, 2, 1], 4)
    """
    key = schedule.replace("-", "_")
    if key not in PIPELINE_SCHEDULES:
        return in_flight_microbatches("gpipe", r, p, m, 1)
    return in_flight_microbatches(key, r, p, m, v)


def unit_table(gm: fx.GraphModule, plan) -> list[UnitCost]:
    """``plan`` (of ``gm``) attributed to ``gm``'s units (module docstring): a node's compute
    and saved bytes to its unit, an edge's seconds to its consumer's unit (``fwd``/``bwd``, or
    ``*_fixed`` out of a parameter), a parameter's local elements (over the non-replica axes)
    to the unit that first uses it, and each value's local bytes to every cut it crosses. A
    program input's collective (the targets a mean loss gathers) starts at the top
    (:mod:`fxpar.passes.prefetch`): only what outlasts the forward of the units before its
    consumer's is charged to that unit."""
    us = units(gm)
    unit_of = {nd.name: i for i, (_, nodes) in enumerate(us) for nd in nodes}
    nodes = {n.name: n for n in gm.graph.nodes}
    params = {n.name for n in gm.graph.nodes if n.op == "placeholder" and ir.is_trainable_param(n)}
    inputs = {n.name for n in gm.graph.nodes if n.op == "placeholder" and layer_of(n) == "(inputs)"}
    early: list[tuple[int, list]] = []  # (consumer's unit, steps) of the inputs' collectives
    names, shape = tuple(plan.mesh["axis_names"]), tuple(plan.mesh["shape"])
    replicas = replica_axes(plan)
    own = tuple(1 if a in replicas else s for a, s in zip(names, shape))
    first_use: dict[str, int] = {}
    last_use: dict[str, int] = {}
    for i, (_, unodes) in enumerate(us):
        for nd in unodes:
            for a in nd.all_input_nodes:
                first_use.setdefault(a.name, i)
                if a.name in unit_of:
                    last_use[a.name] = max(last_use.get(a.name, -1), i)
    acc = [dict(fwd=0.0, bwd=0.0, fwd_fixed=0.0, bwd_fixed=0.0, act=0.0, params=0.0, out=0.0,
                fwd_lat=0.0, bwd_lat=0.0, tensors=0, sel_act=0.0, sel_fwd=0.0, sel_lat=0.0)
           for _ in us]
    users: dict[str, set[int]] = {}
    for i, (_, unodes) in enumerate(us):
        for nd in unodes:
            for a in nd.all_input_nodes:
                users.setdefault(a.name, set()).add(i)
    reused: list[list] = [[] for _ in us]
    cl = _cluster_of(plan)
    fixed_f, fixed_b = op_overheads(cl)   # (0, 0) without a cluster
    flags = ir.grad_flags(gm)
    # a measured host's per-op work is paid per kernel and backward node (op_time's
    # dispatches); a preset's kernel_overhead per op with work (physics_time)
    counted = getattr(cl, "compute", None) is not None and bool(fixed_f or fixed_b)
    for n in plan.nodes:
        if n.name in params and n.name in first_use:
            val = nodes[n.name].meta[ir.VAL]
            k = Spec.parse(n.outputs[0]).local_numel(tuple(val.shape), own)
            f = first_use[n.name]
            acc[f]["params"] += k
            acc[f]["tensors"] += 1
            if flags.get(nodes[n.name]):
                # the add into its bucket (a kernel on a measured device, however the host
                # runs) and, on a synchronous one, its AccumulateGrad node: per backward
                t = accumulate_time(k * val.dtype.itemsize, cl) + (fixed_b if counted else 0.0)
                acc[f]["bwd"] += t
                acc[f]["bwd_lat"] += t
            for u in sorted(users[n.name] - {f}):
                reused[u].append((n.name, f, float(k)))
        elif n.name in unit_of:
            a = acc[unit_of[n.name]]
            a["fwd"] += n.fwd_time
            a["bwd"] += n.bwd_time
            # the per-op host work of its kernels and backward nodes (op_time's dispatches)
            kf, kb = (node_dispatches(nodes[n.name], requires_grad=flags) or (1, 1)
                      if counted else (1, 1))
            lat_f = min(n.fwd_time, max(kf, 1) * fixed_f) if n.fwd_time > 0 else 0.0
            a["fwd_lat"] += lat_f
            a["bwd_lat"] += min(n.bwd_time, max(kb, 1) * fixed_b) if n.bwd_time > 0 else 0.0
            a["act"] += n.memory
            # selective recomputation: what it keeps of this node, or re-runs
            nd = nodes[n.name]
            ndims = [a_.meta[ir.VAL].dim() for a_ in nd.all_input_nodes
                     if isinstance(a_.meta.get(ir.VAL), torch.Tensor)]
            if nd.op == "call_function" and selective_keeps(nd.target, ndims):
                a["sel_act"] += kept_bytes(nd, _local_bytes(nd.meta.get(ir.VAL), n.outputs[0], shape))
            else:
                a["sel_fwd"] += n.fwd_time
                a["sel_lat"] += lat_f
    # activation gradients summed over the batch: reduced over the replicas, priced by the
    # configuration (the search's probe has no replica axis to show them)
    batch = _batch_derived(gm)
    sync: set[tuple[str, str]] = set()
    grads: list[list[float]] = [[] for _ in us]
    for n in gm.graph.nodes:
        val = n.meta.get(ir.VAL)
        if (n.op != "call_function" or n.name in batch or not flags.get(n)
                or not isinstance(val, torch.Tensor) or n.name not in unit_of):
            continue
        nb = Spec.parse(plan.node(n.name).outputs[0]).local_numel(tuple(val.shape), own) * val.dtype.itemsize
        for c in n.users:
            if c.name in batch and c.name in unit_of and flags.get(c):
                sync.add((n.name, c.name))
                grads[unit_of[c.name]].append(float(nb))
    last = len(us) - 1
    lat = _latency(plan, cl)
    # a unit's parameter collectives of one kind and axis run as one (the runtime gathers a
    # layer's parameters together and reduces its gradients in buckets): priced coalesced
    coalesced: dict[tuple, list] = {}
    kept_edges: set[tuple[str, str]] = set()
    for e in plan.edges:
        fixed = e.producer in params
        keep_replica = not fixed and (e.direction == "fwd" or (e.producer, e.consumer) not in sync)
        steps = [s for s in e.steps if keep_replica or s.axis not in replicas]
        d = "fwd" if e.direction == "fwd" else "bwd"
        u = unit_of.get(e.consumer, last)
        if fixed:
            for s in steps:
                coalesced.setdefault((u, d, s.kind, s.axis), []).append(s)
            continue
        if d == "fwd" and e.producer in inputs:
            early.append((u, steps))
            continue
        if d == "fwd" and steps and (e.producer, e.dst_spec) not in kept_edges:
            # an activation's collective: selective recomputation keeps what it delivered
            kept_edges.add((e.producer, e.dst_spec))
            acc[u]["sel_act"] += _local_bytes(nodes[e.producer].meta.get(ir.VAL), e.dst_spec, shape)
        acc[u][d] += sum(s.time for s in steps)
        acc[u][d + "_lat"] += sum(min(lat(s), s.time) for s in steps)
    for u, steps in early:   # started at the top: hidden behind the units before its use
        exposed = max(0.0, sum(s.time for s in steps) - sum(a["fwd"] for a in acc[:u]))
        acc[u]["fwd"] += exposed
        acc[u]["fwd_lat"] += min(exposed, sum(min(lat(s), s.time) for s in steps))
    price = coalesced_pricer(plan)
    for (u, d, kind, axis), steps in coalesced.items():
        acc[u][d + "_fixed"] += price(kind, axis, steps)
    for name, j in last_use.items():
        i, val = unit_of[name], nodes[name].meta.get(ir.VAL)
        if j <= i or not isinstance(val, torch.Tensor):
            continue
        nb = Spec.parse(plan.node(name).outputs[0]).local_numel(tuple(val.shape), shape) * val.dtype.itemsize
        for k in range(i, j):
            acc[k]["out"] += nb
    return [UnitCost(lay, nodes_[0].name, **a, reused=tuple(r), replica_grads=tuple(g))
            for (lay, nodes_), a, r, g in zip(us, acc, reused, grads)]


def _local_bytes(val, spec: str, mesh_shape) -> float:
    """Bytes of one device's piece of ``val`` laid out as ``spec`` (0 for a non-tensor)."""
    if not isinstance(val, torch.Tensor):
        return 0.0
    return float(Spec.parse(spec).local_numel(tuple(val.shape), mesh_shape) * val.dtype.itemsize)


def _cluster_of(plan):
    """The plan's cluster, ``None`` where the plan does not carry one (then nothing is fixed
    per microbatch and no latency is split off)."""
    try:
        return plan.cluster()
    except (KeyError, TypeError, ValueError):
        return None


def _latency(plan, cl) -> Callable:
    """``step -> seconds`` of a collective step's latency on the plan's mesh and cluster
    ``cl`` (0 for local steps and where the plan does not carry its cluster)."""
    from fxpar.cost.comm import COLLECTIVES, latency_time
    from fxpar.mesh import Mesh

    if cl is None:
        return lambda s: 0.0
    try:
        mesh = Mesh.from_devices(cl, plan.mesh["axis_names"],
                                 np.asarray(plan.mesh["devices"]).reshape(plan.mesh["shape"]))
    except (KeyError, TypeError, ValueError):
        return lambda s: 0.0
    groups = {a: mesh.groups(a)[0] for a in mesh.axis_names}
    return lambda s: (latency_time(s.kind, groups[s.axis], cl)
                      if s.kind in COLLECTIVES and s.axis in groups else 0.0)


def _batch_derived(gm: fx.GraphModule) -> set[str]:
    """Names of the nodes computed from the batch (the user's tensor inputs), transitively."""
    out = {i.name for i in ir.user_inputs(gm) if i.is_tensor}
    for n in gm.graph.nodes:
        if n.op == "call_function" and any(a.name in out for a in n.all_input_nodes):
            out.add(n.name)
    return out


def replica_grid(dp: int, pp: int, tp: int, cluster) -> tuple[int, int]:
    """``(d0, d1)``: a stage's ``dp`` replicas as ``d0`` inside a node × ``d1`` across nodes
    (tensor parallelism innermost, then data, then pipeline)."""
    R = cluster.devices_per_node
    d0 = math.gcd(dp, max(1, R // tp)) if pp * dp * tp >= R else dp
    return d0, dp // d0


def replica_allreduce(config: ParallelConfig, cluster) -> Callable[[float], float] | None:
    """``nbytes -> seconds`` of an all-reduce over one data-parallel group of ``config`` (all
    its :attr:`~fxpar.config.ParallelConfig.replicas`, ``dp·cp``, on the devices a mesh of its
    degrees gives them), ``None`` without one."""
    from fxpar.cost.comm import collective_time
    from fxpar.mesh import Mesh

    if config.replicas == 1:
        return None
    # cp lies next to dp (pp, dp, cp, tp): one axis of dp·cp has the same groups
    deg = {k: v for k, v in config.degrees.items() if k not in ("dp_shard", "cp")}
    deg["dp"] = config.replicas
    groups = Mesh(cluster, {k: deg[k] for k in config.degrees if k in deg}).groups("dp")
    return lambda nb: collective_time("all_reduce", nb, groups[0], cluster, concurrent=groups)


def recomputed_units(us: Sequence[UnitCost], layers) -> frozenset[int]:
    """Indices of the units whose layer is in ``layers``."""
    return frozenset(i for i, u in enumerate(us) if u.layer in layers)


def state_bytes(options) -> tuple[float, float, float]:
    """``(k_p, k_g, k_os)``: model-state bytes per parameter for ``options``' optimizer and
    precision, ``k_g`` that of its ``reduce_dtype`` when it names one."""
    ms = model_state_bytes(1, optimizer=options.optimizer, precision=options.precision,
                           reduce_dtype=getattr(options, "reduce_dtype", None))
    return ms.params, ms.grads, ms.optimizer


def price_config(config: ParallelConfig, us: Sequence[UnitCost], starts: Sequence[int],
                 cluster, options, *, scale: float = 1.0, recomputed=None,
                 xfer: Callable[[int], tuple[float, float]] | None = None,
                 schedule=None, memory: bool = False) -> tuple[StepTime, list[float]]:
    """``config``'s step and peak bytes per pipeline rank over the units ``us`` cut into chunks
    at ``starts`` (``pp·chunks`` of them), at ``scale`` times the units' batch;
    ``recomputed``: unit indices (default: the units of ``config.recompute``); ``xfer(k)``: a
    boundary transfer's seconds forward and back (default none); ``schedule``: the
    :class:`~fxpar.schedule.Schedule` (default built from ``config``)."""
    from fxpar.schedule import Schedule

    p, m, v = config.pp, config.microbatches, config.chunks
    rec = recomputed_units(us, config.recompute) if recomputed is None else recomputed
    chunks = chunk_costs(us, starts, scale, rec, replica_allreduce(config, cluster),
                         microbatch_overhead(cluster), config.recompute_granularity)
    sched = schedule or Schedule.build(str(config.schedule), stages=p, microbatches=m, chunks=v)
    d0, d1 = replica_grid(config.replicas, p, config.tp, cluster)
    style = getattr(options, "zero_style", "flat")
    prec = options.precision
    ranks = sched.ranks
    mine = rank_chunks(chunks, p, ranks)
    layers = zero_units(chunks, p, style, tiny_params(config.state[0], prec), ranks)
    k = reduce_scale(prec, getattr(options, "reduce_dtype", None))
    dp = [dp_terms(round(sum(c.params for c in mine[r])), layers[r], m, d0, d1, *config.state,
                   cluster, prec, style, k) if config.replicas > 1 else DpTerms() for r in range(p)]
    fl = [in_flight(str(config.schedule), r, p, m, v) for r in range(p)]
    tmp = 2 * BUCKET + max(c.max_act for c in chunks)
    kb = state_bytes(options)
    mem = rank_memory(chunks, p, fl, kb, config.state, tmp, ranks)
    kw = {}
    if memory:
        per = sum(k / s for k, s in zip(kb, config.state))
        kw = dict(act_bytes=[c.act for c in chunks],
                  static_bytes=[per * sum(c.params for c in mine[r]) for r in range(p)])
    st = step_time(sched, chunks, xfer or (lambda k: (0.0, 0.0)), dp,
                   interference=cluster.comm_interference,
                   optimizer=optimizer_seconds(chunks, p, config.state, cluster, prec,
                                               state_bytes(options), ranks),
                   overhead=microbatch_overhead(cluster), split=split_backward(cluster),
                   rate=host_rate(cluster, config.devices // p), **kw)
    return st, mem


def optimizer_seconds(chunks, p: int, state: tuple[int, int, int], cluster, precision: str,
                      state_bytes: tuple[float, float, float] = STATE_BYTES_PER_PARAM["adam", "mixed"],
                      ranks: Sequence[int] | None = None) -> list[float]:
    """Per pipeline rank (chunk ``k`` on rank ``k % p``, or ``ranks[k]``), the seconds of its
    optimizer step (:func:`fxpar.cost.step.optimizer_time` over its chunks' local parameters, states sharded
    ``s_os`` ways, ``state = (s_p, s_g, s_os)``) at the price the cluster's measured compute
    gives (:attr:`fxpar.cluster.ComputeProfile.optimizer`), else, with physics, the
    memory-bound one of its ``state_bytes`` (:func:`fxpar.cost.step.cluster_optimizer_price`),
    else zeros."""
    from fxpar.cost.memory import is_fp32
    from fxpar.cost.step import cluster_optimizer_price

    s_p, _, s_os = state
    price = cluster_optimizer_price(cluster, state_bytes, is_fp32(precision))
    # parameters sharded by their layouts (s_p) are local tensors to the runtime's optimizer:
    # stepped flat unless it shards their states further (ZeRO-1/2)
    flat = s_os == s_p and is_fp32(precision)
    piece = step_piece(getattr(cluster, "device_type", ""))
    return [optimizer_time(sum(c.params for c in mine) / s_os, sum(c.tensors for c in mine),
                           price, flat, piece=piece) for mine in rank_chunks(chunks, p, ranks)]


def schedule_of(plan):
    """The :class:`fxpar.schedule.Schedule` a pipeline plan runs (its action lists are in
    ``plan.schedule["csv"]``: the plan says exactly what every rank does)."""
    from fxpar.schedule import Schedule

    sc = plan.schedule
    return Schedule.from_csv(sc["csv"], microbatches=sc["microbatches"], chunks=sc["chunks"],
                             name=sc["name"], placement=sc.get("placement"))


def mesh_config(plan) -> ParallelConfig:
    """The configuration an SPMD ``plan`` realizes, read off its mesh (the replicas: the
    product of its data-parallel axes, :func:`replica_axes` but ``cp``; ``tp``, other axes as
    ``extra``) and its parameters' layouts (``s_p``: the
    replica axes on which some parameter is stored sharded and gathered for its use, ZeRO-3 /
    FSDP style; gradients and optimizer states sharded with them, as the runner does by
    default). A parameter its use reads sharded on the axis (a column-parallel lookup on
    ``dp``, say) is tensor parallelism there, not sharded storage: it does not count."""
    deg = dict(zip(plan.mesh["axis_names"], plan.mesh["shape"]))
    params = {n.name for n in plan.nodes if n.param}
    gathered = {st.axis for e in plan.edges if e.direction == "fwd" and e.producer in params
                for st in e.steps if st.kind in ("all_gather", "all_to_all")}
    # the batch replicas: dp, dp_shard and any axis found data-parallel (not cp: its own term)
    data = tuple(a for a in replica_axes(plan) if a != "cp")
    s_p = 1
    for a in data:
        if deg[a] > 1 and a in gathered:
            s_p *= deg[a]
    extra = tuple((a, k) for a, k in deg.items() if a not in (*data, "tp", "pp"))
    return ParallelConfig(dp=math.prod(deg[a] for a in data),
                          tp=1 if "tp" in data else deg.get("tp", 1),
                          extra=extra, s_p=s_p, s_g=s_p, s_os=s_p)


def price_plan(plan, config: ParallelConfig | None = None, *, memory: bool = False,
               cluster=None) -> tuple[StepTime, list[float]]:
    """A realized ``plan``'s step and memory per rank from its unit tables (its stages' in
    chunk order, or its own) under ``config`` (default ``plan.config``); with ``memory``,
    the simulator also traces memory (each chunk's activations per microbatch in flight
    over its rank's model states), as :meth:`fxpar.program.Program.simulate` shows.
    ``cluster``: the step's physics from that cluster instead of the plan's (its units keep
    the costs they were priced at: a what-if of the step model alone)."""
    config = config or plan.config
    opts = SimpleNamespace(optimizer=plan.options.get("optimizer", "adam"),
                           precision=plan.options.get("precision", "mixed"),
                           zero_style=plan.options.get("zero_style", "flat"),
                           reduce_dtype=plan.options.get("reduce_dtype"))
    tables = [st.plan.units for st in plan.stages] if plan.stages else [plan.units]
    us = [u for t in tables for u in t]
    starts = [0]
    for t in tables[:-1]:
        starts.append(starts[-1] + len(t))
    st_x = {s.index: (s.send_time, s.back_time) for s in plan.stages}
    sched = schedule_of(plan) if plan.stages else None
    return price_config(config, us, starts, cluster or plan.cluster(), opts, memory=memory,
                        xfer=lambda k: st_x.get(k, (0.0, 0.0)), schedule=sched)
