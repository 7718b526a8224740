r"""Pipeline planning: stage chunks on the submeshes of a ``pp`` mesh axis, each with its own
intra-op plan, and the step predicted by the simulator over the schedule's action lists.

:func:`plan_pipeline` takes a graph captured at the *microbatch* shape and a mesh with a
``pp`` axis of size ``p``:

1. :func:`fxpar.stages.split_stages` cuts it into ``p·v`` chunks (user split points, or
   balanced by the cost model); chunk ``k`` runs on pipeline rank ``r = k % p`` (a V-shaped
   schedule's: :meth:`fxpar.schedule.Schedule.rank_of`), whose submesh is the mesh at
   ``pp = r`` without the ``pp`` axis (all submeshes have one shape);
2. chunks are planned in order with :func:`fxpar.planner.plan_and_keep` on their submesh.
   A boundary value is pinned, on the receiving chunk, to the layout the sending chunk
   returns it in (its finalized spec), so a transfer is a plain send/recv of the local
   shard between ranks at the same submesh coordinate (Megatron's pipeline, equal layouts). A
   parameter used by several chunks (a tied embedding and LM head) is pinned to the layout of
   its first chunk, so the copies hold the same shards and their gradients can be summed.
   (Choosing the layouts jointly, and resharding between different ones, is the joint
   planner's and the cross-mesh planner's work.)
3. each boundary transfer is priced as a point-to-point copy of the local shards between the
   two submeshes (``α + bytes/β`` of the link the pairs cross, all pairs at once), or, for a
   value replicated on a submesh axis, Megatron's scatter/gather (§4.1: each of the ``t``
   ranks sends ``1/t``, the receivers all-gather on that axis) when that is cheaper;
4. the step: :func:`fxpar.sim.simulate` over ``Schedule.build(schedule, p, m, chunks=v)``
   with each chunk's forward/backward time from its plan (compute + its communication) and
   the transfers on the communication lanes.

>>> import torch, fxpar
>>> from examples.models import GPT
>>> gm = fxpar.capture(GPT(vocab=32, d_model=16, n_heads=2, n_layers=4, seq_len=8),
...                    (torch.randint(0, 32, (2, 8)),))
>>> mesh = fxpar.Mesh(fxpar.Cluster.preset("dgx-a100"), pp=2, tp=2)
>>> plan, chunks = plan_pipeline(gm, mesh, schedule="1f1b", microbatches=4,
...                              split_points=["blocks.2"])
>>> [(s.index, s.rank, s.plan.mesh["devices"]) for s in plan.stages]
[(0, 0, (0, 1)), (1, 1, (2, 3))]
>>> plan.schedule["name"], plan.schedule["microbatches"]
('1f1b', 4)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np
import torch.fx as fx

from fxpar.config import ParallelConfig, ScheduleKind
from fxpar.errors import PlanError
from fxpar.mesh import Mesh
from fxpar.plan_data import Plan, StagePlan
from fxpar.planner.baselines import baseline_pins, cp_pins
from fxpar.planner.intra_op import BuildCache, PlannerOptions, plan_and_keep
from fxpar.planner.price import price_plan, schedule_of
from fxpar.planner.pricing import finalize_spec
from fxpar.spec import Spec, as_spec
from fxpar.split import StageGraph, is_boundary, split_stages

#: how boundary values cross (:func:`_transfer`; ``"crossmesh"`` forces each receiving chunk's
#: own input layouts, the others keep the sender's where that is cheaper, ``auto`` by cost)
BOUNDARY_MODES = ("auto", "send_recv", "scatter_gather", "crossmesh")

__all__ = ["PP_AXIS", "BOUNDARY_MODES", "plan_pipeline", "schedule_of", "simulate_plan", "stage_submesh", "boundary_time"]

_KINDS = {k.value for k in ScheduleKind}
#: the mesh axis whose coordinate is the pipeline rank
PP_AXIS = "pp"


def stage_submesh(mesh: Mesh, rank: int) -> Mesh:
    """The submesh of pipeline rank ``rank``: ``mesh`` at ``pp = rank`` without the ``pp``
    axis (a mesh of only ``pp`` gives each stage a one-device ``dp=1`` mesh)."""
    a = mesh.axis_names.index(PP_AXIS)
    arr = np.take(np.asarray(mesh.devices).reshape(mesh.shape), rank, axis=a)
    names = [n for n in mesh.axis_names if n != PP_AXIS]
    if not names:
        return Mesh.from_devices(mesh.cluster, ["dp"], np.asarray([int(arr)]))
    return Mesh.from_devices(mesh.cluster, names, arr)


def boundary_time(nbytes: float, src: Sequence[int], dst: Sequence[int], cluster) -> float:
    """Seconds to move a boundary value from submesh ``src`` to ``dst`` (device ids, same
    order: device ``src[i]`` sends its ``nbytes`` shard to ``dst[i]``, all pairs at once):
    :func:`fxpar.cost.comm.pairs_time`."""
    from fxpar.cost.comm import pairs_time

    return pairs_time(nbytes, list(zip(src, dst)), cluster)


def _boundary_spec(plan: Plan, name: str) -> Spec:
    node = plan.node(name)
    return finalize_spec(Spec.parse(node.outputs[0]), None)


def plan_pipeline(gm: fx.GraphModule, mesh: Mesh, *, schedule="1f1b",
                  microbatches: int = 1, chunks: int | None = None,
                  split_points: Sequence[str] | None = None,
                  pins: Mapping[str, object] | None = None,
                  options: PlannerOptions | None = None,
                  kind: str = "auto", boundary: str = "auto",
                  start_nodes: Sequence[str] | None = None,
                  cache: BuildCache | None = None,
                  strategies=None) -> tuple[Plan, list[StageGraph]]:
    """Plan ``gm`` (captured at the microbatch shape) as a pipeline (module docstring);
    returns the pipeline :class:`Plan` (``plan.stages``) and the chunk graphs. ``schedule``:
    a name for :meth:`Schedule.build` (with ``microbatches`` and ``chunks``, ``None``: the
    schedule's own, two for a V) or a
    :class:`~fxpar.schedule.Schedule` (e.g. hand-written with ``Schedule.from_csv``).
    ``boundary``: how boundary values cross (:func:`_transfer`): ``"auto"`` plans each
    receiving chunk twice, pinned to the sender's layouts and free, and keeps the cheaper with
    its transfers (send/recv or scatter/gather for equal layouts, a cross-mesh reshard for
    different ones); ``"send_recv"``/``"scatter_gather"`` keep equal layouts and say how they
    cross; ``"crossmesh"`` always takes the receiver's own layouts. The chunks share one
    :class:`~fxpar.planner.intra_op.BuildCache` (``cache``, or a new one): the chunks of a
    submesh repeat the same layers, whose nodes and edges are priced once. ``strategies``:
    ``(node, submesh) -> [Strategy]`` in place of the registered rules (as
    :func:`fxpar.plan` takes it; each chunk's on its stage's submesh)."""
    from fxpar import ir
    from fxpar.schedule import Schedule

    if boundary not in BOUNDARY_MODES:
        raise PlanError(f"boundary={boundary!r}: one of {BOUNDARY_MODES}")
    if PP_AXIS not in mesh.axis_names:
        raise PlanError(f"a pipeline plan needs a {PP_AXIS!r} mesh axis, got {mesh!r}")
    p = mesh.shape[mesh.axis_names.index(PP_AXIS)]
    if isinstance(schedule, Schedule):  # hand-written (validated when made)
        if schedule.stages != p:
            raise PlanError(f"schedule {schedule.name!r} is for {schedule.stages} pipeline ranks, "
                            f"the mesh's {PP_AXIS!r} axis has {p}")
        sched = schedule
    else:
        sched = Schedule.build(schedule, stages=p, microbatches=microbatches, chunks=chunks)
    n = p * sched.chunks
    # a parameter's gradient is reduced once per step, after the last microbatch
    options = dataclasses.replace(options or PlannerOptions(), grad_steps=sched.microbatches)
    graphs = split_stages(gm, n, split_points=split_points, cluster=mesh.cluster,
                          start_nodes=start_nodes)
    subs = [stage_submesh(mesh, r) for r in range(p)]
    user_pins = dict(pins or {})
    out_pin = user_pins.pop("output", None)
    sent: list[dict[str, Spec]] = []   # per chunk: the layout each output leaves in
    recv: list[dict[str, Spec]] = []   # per chunk: the layout each boundary input arrives in
    param_spec: dict[str, Spec] = {}   # parameter fqn -> spec of its first chunk
    plans: list[Plan] = []
    cache = cache if cache is not None else BuildCache()
    for sg in graphs:
        sub = subs[sched.rank_of(sg.index)]
        own = ir.params(sg.graph)
        names = {nd.name for nd in sg.graph.graph.nodes}
        pk: dict[str, object] = dict(baseline_pins(
            kind, sg.graph, sub, sequence_parallel=options.sequence_parallel)) if kind != "auto" else {}
        pk.update(cp_pins(sg.graph, sub))   # a "cp" axis splits the sequence of the user inputs
        # a pin on a boundary value is the layout it is computed in: the receivers take it
        # as the sender's layout (or their own, under "crossmesh"/"auto")
        pk.update({k: v for k, v in user_pins.items()
                   if (k in names and k not in sg.inputs) or k in own or k == "input"})
        if "input" in pk:  # the batch's layout: user inputs only, boundary values come pinned
            spec = pk.pop("input")
            pk.update({i.name: spec for i in ir.user_inputs(sg.graph) if i.is_tensor
                       and not is_boundary(i)})
        pk.update({f: param_spec[f] for f in own if f in param_spec})
        if sg.is_last and out_pin is not None:
            pk["output"] = as_spec(out_pin)
        prev = sent[-1] if sent else {}

        def solve(pins, sg=sg, sub=sub):
            try:
                return plan_and_keep(sg.graph, sub, pins=pins, options=options, kind=kind,
                                     cache=cache, strategies=strategies)[0]
            except PlanError as e:
                raise PlanError(f"stage chunk {sg.index} (layers {', '.join(sg.layers)}) on "
                                f"{sub!r}: {e}") from e

        plan = solve({**pk, **{name: prev[name] for name in sg.inputs}})
        if sg.inputs and boundary in ("auto", "crossmesh"):
            # the receiver's own layouts, paying a cross-mesh reshard where they differ
            free = solve(pk)
            mine = {name: _placeholder_spec(free, name) for name in sg.inputs}
            if mine != {name: prev[name] for name in sg.inputs}:
                src, dst = subs[sched.rank_of(sg.index - 1)], sub
                cost = [pl.time + sum(sum(_transfer(_meta(graphs[sg.index - 1], name), prev[name],
                                                    _placeholder_spec(pl, name), src, dst,
                                                    boundary)[2:4])
                                      for name in sg.inputs) for pl in (plan, free)]
                if boundary == "crossmesh" or cost[1] < cost[0]:
                    plan = free
        plans.append(plan)
        recv.append({name: _placeholder_spec(plan, name) for name in sg.inputs})
        # a relayed value leaves in the layout it arrived in
        sent.append({name: recv[-1][name] if name in sg.inputs else _boundary_spec(plan, name)
                     for name in sg.outputs})
        for nd in plan.nodes:
            info = next((i for i in own.values() if i.node_name == nd.name), None)
            if info is not None and info.fqn not in param_spec:
                param_spec[info.fqn] = Spec.parse(nd.outputs[0])
    stages = []

    def sub_of(k: int):
        return subs[sched.rank_of(k)]

    for sg, plan in zip(graphs, plans):
        k = sg.index
        r = sched.rank_of(k)
        if k + 1 == n:
            xs = []
        elif sched.rank_of(k + 1) == r:   # the next chunk runs here too (a V's turn): no transfer
            xs = [(0, "", 0.0, 0.0) for _ in sg.outputs]
        else:
            xs = [_transfer(_meta(sg, name), sent[k][name], recv[k + 1][name], sub_of(k),
                            sub_of(k + 1), boundary) for name in sg.outputs]
        stages.append(StagePlan(
            k, r, sg.layers, sg.inputs, sg.outputs, plan,
            # typed as StagePlan.from_dict reads them: the last chunk's empty sums are int 0,
            # which would print "0" where a plan from JSON (another rank's) prints "0.0"
            send_bytes=int(sum(x[0] for x in xs)), scatter=tuple(x[1] for x in xs),
            send_time=float(sum(x[2] for x in xs)), back_time=float(sum(x[3] for x in xs)),
            in_specs=tuple(str(recv[k][name]) for name in sg.inputs),
            out_specs=tuple(str(sent[k][name]) for name in sg.outputs), start=sg.start))
    return _pipeline_plan(kind, mesh, stages, sched), graphs


def _placeholder_spec(plan: Plan, name: str) -> Spec:
    return Spec.parse(plan.node(name).outputs[0])


def _meta(sg: StageGraph, name: str):
    from fxpar import ir

    return ir.tensor_meta(next(nd for nd in sg.graph.graph.nodes if nd.name == name))


def _transfer(tm, src: Spec, dst: Spec, sub: Mesh, nxt: Mesh,
              mode: str) -> tuple[int, str, float, float]:
    """``(bytes sent per device, scatter axis or "", seconds forward, seconds backward)`` of one
    boundary value of global meta ``tm`` leaving ``sub`` as ``src`` and arriving on ``nxt``
    as ``dst``. Equal layouts: the local shards (``α + b/β`` of the link between the
    submeshes), or, for a value replicated on a submesh axis of size ``t``, scatter/gather over
    the largest such axis (``α + (b/t)/β`` then an all-gather of ``b/t`` per rank on that
    axis) when faster (``mode="auto"``), always (``"scatter_gather"``) or never
    (``"send_recv"``); the gradient comes back the same way. Different layouts: the
    cross-mesh plan's time each way (:func:`fxpar.crossmesh.cross_mesh_time`, send/recv
    tasks: what the interpreter runs without blocking a sender; bytes: what the first device
    of ``sub`` sends)."""
    from fxpar.cost.comm import axis_collective_time
    from fxpar.resharding.cross import cross_mesh_plan

    if src != dst:
        fwd = cross_mesh_plan(sub, src, nxt, dst, shape=tm.shape, dtype=tm.dtype, strategy="send_recv")
        bwd = cross_mesh_plan(nxt, dst, sub, src, shape=tm.shape, dtype=tm.dtype, strategy="send_recv")
        return sum(t.nbytes * len(t.receivers) for t in fwd.tasks if t.sender == sub.devices[0]), \
            "", fwd.time, bwd.time
    b = int(np.prod(src.local_shape(tm.shape, sub.shape, (0,) * sub.ndim))) * tm.dtype.itemsize
    plain = boundary_time(b, sub.devices, nxt.devices, sub.cluster)
    reps = [a for a, pl in enumerate(src.placements) if pl.is_replicate() and sub.shape[a] > 1]
    if reps and mode in ("auto", "scatter_gather", "crossmesh"):
        a = max(reps, key=lambda i: (sub.shape[i], i))
        piece = -(-b // sub.shape[a])
        t = (boundary_time(piece, sub.devices, nxt.devices, sub.cluster)
             + axis_collective_time("all_gather", piece, nxt, a))
        if mode == "scatter_gather" or t < plain:
            return piece, sub.axis_names[a], t, t
    return b, "", plain, plain


def _grad_reduce(e, params: set[str]) -> bool:
    """A parameter's gradient reshard (``bwd`` edge out of a parameter): the runtime reduces
    it once per step over every microbatch (bucketed), not once per microbatch."""
    return e.direction != "fwd" and e.producer in params


def _params(p: Plan) -> set[str]:
    return {n.name for n in p.nodes if n.param}


def _chunk_times(st: StagePlan) -> tuple[float, float, float]:
    """Forward and backward seconds of one microbatch through the chunk (compute and its
    communication), and the parameter-gradient reductions paid once per step."""
    p = st.plan
    params = _params(p)
    fwd = sum(e.time for e in p.edges if e.direction == "fwd")
    bwd = sum(e.time for e in p.edges if e.direction != "fwd" and not _grad_reduce(e, params))
    red = sum(e.time for e in p.edges if _grad_reduce(e, params))
    return p.compute_fwd + fwd, p.compute_bwd + bwd, red


def simulate_plan(plan: Plan):
    """The :class:`fxpar.sim.SimResult` behind a pipeline plan's ``time`` (the one step model,
    :func:`fxpar.planner.price.price_plan`): its schedule over each chunk's unit costs, the
    recomputed layers' forwards again in backward, gradient reductions once per step on the
    communication lanes, the boundary transfers, and memory traced per rank (each chunk's
    activations per microbatch in flight over its rank's model states)."""
    return price_plan(plan, memory=True)[0].sim


def _pipeline_plan(kind, mesh, stages, sched) -> Plan:
    m, p = sched.microbatches, sched.stages
    per_rank = [[st for st in stages if st.rank == r] for r in range(p)]
    busiest = max(per_rank, key=lambda sts: sum(sum(_chunk_times(s)[:2]) for s in sts))
    plans = [st.plan for st in stages]
    budget = [pl.budget for pl in plans if pl.budget is not None]
    status = next((pl.status for pl in plans if pl.status != "OPTIMAL"), "OPTIMAL")
    mesh_d = dict(axis_names=tuple(mesh.axis_names), shape=tuple(mesh.shape),
                  devices=tuple(mesh.devices), cluster=mesh.cluster.to_dict())
    c0 = stages[0].plan.config
    config = ParallelConfig(pp=p, dp=c0.dp, tp=c0.tp, extra=c0.extra, microbatches=m,
                            schedule=sched.name if sched.name in _KINDS else "custom",
                            chunks=sched.chunks, s_p=c0.s_p, s_g=c0.s_g, s_os=c0.s_os)
    plan = Plan(kind=kind, mesh=mesh_d, nodes=(), edges=(), time=0.0, config=config,
                compute_fwd=m * sum(s.plan.compute_fwd for s in busiest),
                compute_bwd=m * sum(s.plan.compute_bwd for s in busiest),
                comm=m * sum(s.plan.comm for s in busiest),
                # a rank holds every chunk it runs (interleaved, a V: several)
                memory=max(sum(s.plan.memory for s in sts) for sts in per_rank),
                budget=min(budget) if budget else None,
                status=status, stages=tuple(stages), options=plans[0].options,
                schedule=dict(name=sched.name, microbatches=m, chunks=sched.chunks,
                              csv=sched.to_csv(), placement=sched.placement))
    return with_step(plan)


def with_step(plan: Plan, config: ParallelConfig | None = None) -> Plan:
    """``plan`` (a pipeline) with ``config`` (default its own) and ``time`` and ``bubble`` the
    one step model's (:func:`fxpar.planner.price.price_plan`)."""
    config = config or plan.config
    st = price_plan(plan, config)[0]
    return dataclasses.replace(plan, config=config, time=st.step,
                               schedule={**plan.schedule, "bubble": st.bubble})
