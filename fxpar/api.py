"""Public entry points of planning: :func:`plan` and :func:`compile`; :class:`Planned`.

``fxpar.plan(model, cluster, example_inputs=...)`` captures the model (fake tensors, no real
weights), builds the strategy problem on one or several candidate meshes, solves it and
returns a :class:`Planned` (``.plan``, ``.graph``, ``.explain()``, ``.why(node)``).

``plan=``: ``"auto"`` (free choice per node, on the given mesh or the best of
:func:`fxpar.planner.candidate_meshes`) or a baseline, ``"dp"``, ``"zero3"``, ``"megatron"``,
``"axonn"`` (:mod:`fxpar.planner.baselines`: their meshes and pins), or ``"amsp"`` (AMSP's
own program: data parallelism over every device with its searched ``(s_p, s_g, s_os)``,
microbatches and recomputation; the joint search with ``tp = pp = 1``) or ``"alpa"`` (the
joint search as Alpa runs it: placement-agnostic communication costs, replicated model
states; its choice priced on the real cluster), all scored by the one cost model of
:mod:`fxpar.planner`. ``axonn`` without a mesh tries AxoNN's ranked grids in
order and keeps the first that plans; ``auto`` keeps the fastest of all meshes tried (by
``Plan.time``, the one step model of :mod:`fxpar.cost.step`).

>>> import torch, fxpar
>>> from examples.models import MLP
>>> p = fxpar.api.plan(MLP(8, 16, 4), fxpar.Cluster.preset("dgx-a100"),
...                    example_inputs=(torch.randn(2, 8),), mesh={"dp": 8})
>>> p.plan.kind, p.plan.mesh["shape"]
('auto', (8,))
"""

from __future__ import annotations

import contextlib
import functools
import gc
from collections.abc import Callable, Mapping, Sequence
import dataclasses
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.fx as fx

from fxpar.capture import WithLoss, capture, frozen_params
from fxpar.config import ParallelConfig
from fxpar.errors import PinError, PlanError
from fxpar.mesh import Mesh
from fxpar.plan_data import BASELINES, PLAN_KINDS, SEARCHED, Plan
from fxpar.planner import (BuildCache, BuiltProblem, PlannerOptions, axonn_meshes, baseline_mesh,
                           baseline_notes, baseline_pins, candidate_meshes, plan_and_keep,
                           unkeepable_pins)
from fxpar.solver import Solution

__all__ = ["plan", "compile", "Planned"]


@dataclass(frozen=True)
class Planned:
    """Result of planning: the :class:`Plan`, the captured graph, every mesh tried, and (when
    planned here, not loaded) the problem built on the chosen mesh and the solver's solution,
    which :meth:`why` reads."""

    plan: Plan
    graph: fx.GraphModule
    tried: tuple[tuple[str, float], ...] = ()
    problem: BuiltProblem | None = field(default=None, repr=False, compare=False)
    solution: Solution | None = field(default=None, repr=False, compare=False)
    #: a pipeline plan's stage chunk graphs (what :class:`fxpar.program.Program` emits)
    stage_graphs: tuple = field(default=(), repr=False, compare=False)

    def explain(self) -> str:
        return self.plan.explain()

    def why(self, node, top: int = 5):
        """Why ``node`` (its name or the :class:`torch.fx.Node`) got its strategy: the chosen
        strategy and the ``top`` best alternatives, each with its node cost, the cost of its
        edges given the neighbours' chosen strategies, the change of the whole objective, and,
        for a candidate the solver never considered, the reduction (or pin) that removed it.
        See :func:`fxpar.planner.explain.why`; ``print()`` it for a table.

        >>> import torch, fxpar
        >>> from examples.models import MLP
        >>> p = fxpar.plan(MLP(8, 16, 4), fxpar.Cluster.preset("dgx-a100"),
        ...                example_inputs=(torch.randn(2, 8),), mesh={"dp": 2})
        >>> w = p.why("linear")
        >>> w.chosen.strategy == next(n for n in p.plan.nodes if n.name == "linear").strategy
        True
        >>> w.alternatives[0].delta >= 0
        True
        """
        from fxpar.planner.explain import why

        if self.problem is None or self.solution is None:
            raise PlanError("why() needs the planning problem: this Planned holds a given or "
                            "loaded Plan only; plan it with fxpar.plan(...)")
        return why(self.problem, self.solution.choice, node, top=top)


def _as_mesh(mesh, cluster) -> Mesh | None:
    if mesh is None or isinstance(mesh, Mesh):
        return mesh
    return Mesh(cluster, dict(mesh))


def _gc_paused(fn: Callable) -> Callable:
    """Run ``fn`` with Python's cyclic garbage collector off, restored after (on error too).

    Planning allocates millions of small objects next to two large, long-lived graphs (a
    capture's nodes, fake tensors and metas): every full collection walks all of them, and
    Llama-3-8B's joint plan paid 9 of them, ~1 s of 7. Reference counting still frees
    everything without a cycle; the few cycles made (export's intermediate graph modules) wait
    for the next collection after the call.

    >>> import gc
    >>> gc.isenabled(), _gc_paused(gc.isenabled)(), gc.isenabled()
    (True, False, True)
    """

    @functools.wraps(fn)
    def paused(*args, **kwargs):
        was = gc.isenabled()
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            if was:
                gc.enable()

    return paused


@_gc_paused
def plan(model: torch.nn.Module, cluster, example_inputs: Sequence[Any] | torch.Tensor = (),
         example_kwargs: Mapping[str, Any] | None = None, *, mesh=None, plan: str = "auto",
         pins: Mapping[str, object] | None = None, memory_budget: float | None = None,
         time_limit: float | None = 60.0, options: PlannerOptions | None = None,
         strategies: Callable | None = None, graph: fx.GraphModule | None = None,
         progress: Callable[[str], None] | None = None, schedule="1f1b",
         microbatches: int = 1, chunks: int = 1, split_points: Sequence[str] | None = None,
         boundary: str = "auto") -> Planned:
    """Capture ``model`` and plan it on ``cluster`` (module docstring for ``plan=`` kinds).

    ``mesh``: a :class:`Mesh` or ``{"dp": 2, "tp": 4}``; ``None`` picks one; with a ``"pp"``
    axis, a pipeline plan (``schedule``, ``microbatches``, ``chunks``, ``split_points``,
    ``boundary``: see :func:`compile`). ``pins`` add to
    a baseline's own pins. ``graph``: an already captured graph (skips capture).
    ``progress(line)`` is called once per candidate mesh as it is planned (its build and
    solve times and predicted step, or why it failed).
    Raises :class:`PlanError` when no plan fits ``memory_budget`` (default device memory).
    """
    if isinstance(plan, str) and plan in SEARCHED:
        if mesh is not None or graph is not None or model is None:
            raise PlanError(f"plan={plan!r} searches its own configurations ({SEARCHED[plan]}, "
                            "over every device of the cluster): give a model, no mesh or graph")
        return _plan_joint(model, cluster, example_inputs, example_kwargs, plan=SEARCHED[plan],
                           options=options, memory_budget=memory_budget, time_limit=time_limit,
                           progress=progress, kind=plan)
    if isinstance(plan, Mapping) or (plan == "auto" and mesh is None and graph is None
                                     and model is not None and _multi_node(cluster)):
        return _plan_joint(model, cluster, example_inputs, example_kwargs, plan=plan,
                           options=options, memory_budget=memory_budget, time_limit=time_limit,
                           progress=progress)
    if plan not in PLAN_KINDS:
        raise PlanError(f"unknown plan {plan!r}; one of {PLAN_KINDS}")
    if mesh is not None and "pp" in (mesh.axis_names if isinstance(mesh, Mesh) else dict(mesh)):
        args = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else tuple(example_inputs)
        kw = {k: v for k, v in (("memory_budget", memory_budget), ("time_limit", time_limit),
                                ("options", options), ("pins", pins)) if v is not None}
        return _compile_pipeline(model, model, cluster, args, example_kwargs, optimizer=None,
                                 plan=plan, training=model.training, prefetch=1, emit=False,
                                 schedule=schedule, microbatches=microbatches, chunks=chunks,
                                 split_points=split_points, mesh=mesh, boundary=boundary, **kw)
    gm = graph if graph is not None else capture(model, example_inputs, example_kwargs)
    opts = options or PlannerOptions()
    kw = {k: v for k, v in (("memory_budget", memory_budget), ("time_limit", time_limit))}
    opts = PlannerOptions(**{**{f: getattr(opts, f) for f in opts.__dataclass_fields__},
                             **{k: v for k, v in kw.items() if v is not None or k == "time_limit"}})
    m = _as_mesh(mesh, cluster)
    # axonn without a mesh: AxoNN's ranked grids in order, the first that plans (AxoNN tries
    # its top configurations); the others: their one default mesh; auto: the best of all.
    first_fit = m is None and plan == "axonn"
    meshes = [m] if m is not None else (
        candidate_meshes(gm, cluster) if plan == "auto" else
        axonn_meshes(gm, cluster) if first_fit else [baseline_mesh(plan, gm, cluster)])
    best, kept, tried, errors, best_key = None, None, [], [], None
    for msh in meshes:
        if first_fit and best is not None:
            break
        all_pins = dict(baseline_pins(plan, gm, msh)) if plan != "auto" else {}
        all_pins.update(pins or {})
        try:
            p, bp, sol = plan_and_keep(gm, msh, pins=all_pins, options=opts,
                                       strategies=strategies, kind=plan)
        except PlanError as e:
            if progress is not None:
                progress(f"{msh!r}: no plan ({str(e).splitlines()[0][:120]})")
            if len(meshes) == 1:
                raise
            errors.append(f"{msh!r}: {e}")
            continue
        # meshes are compared by the one step model (Plan.time), as the joint search ranks
        # its configurations; on one mesh the solver minimizes the summed time
        step = p.time
        if progress is not None:
            progress(f"{msh!r}: build {p.stats.get('build_s', 0):.2f} s, solve "
                     f"{p.stats.get('solve_s', 0):.2f} s ({p.stats.get('strategies', '?')} "
                     f"strategies), predicted step {step * 1e3:.4g} ms")
        tried.append((repr(msh), step))
        if best is None or (step, p.summed_time) < best_key:
            best, best_mesh, kept, best_key = p, msh, (bp, sol), (step, p.summed_time)
    if best is None:
        raise PlanError(f"no {plan} plan on any candidate mesh: " + "; ".join(errors))
    notes = baseline_notes(plan, gm, best_mesh)
    if notes:
        best = dataclasses.replace(best, notes=notes)
    return Planned(best, gm, tuple(tried), *kept)


@_gc_paused
def compile(model: torch.nn.Module, cluster, example_inputs: Sequence[Any] | torch.Tensor = (),
            example_kwargs: Mapping[str, Any] | None = None, *, loss_fn: Callable | None = None,
            example_targets: Sequence[Any] = (), optimizer: Callable | None = None,
            plan: str | Plan = "auto", training: bool = True, prefetch: int = 1,
            emit: bool = True, schedule: str = "1f1b", microbatches: int = 1, chunks: int = 1,
            split_points: Sequence[str] | None = None, **kwargs):
    """Compile ``model`` for ``cluster``: plan it and return a :class:`fxpar.program.Program`
    (``.plan``, ``.explain()``, ``.rank_graph(r)``, ``.save(path)``, ``.runner()``).

    ``example_inputs``/``example_kwargs``: one global batch of the model's inputs (fake or
    meta tensors are fine). ``loss_fn(output, *targets)`` with ``example_targets`` when the
    model does not return its loss. ``optimizer(params)`` builds any ``torch.optim`` optimizer.
    ``plan``: ``"auto"``, a baseline name, or a :class:`Plan` (e.g. from :func:`fxpar.load`).
    ``training=False`` captures the model in eval mode and plans the forward only.
    ``emit=False`` stops after planning and returns a :class:`Planned`. Other keyword
    arguments go to :func:`plan` (``mesh``, ``pins``, ``memory_budget``...).

    **Pipelines**: a mesh with a ``"pp"`` axis (``mesh={"pp": 2, "dp": 1, "tp": 2}``) splits
    the model into ``pp·chunks`` stage chunks (at ``split_points``, module FQNs each chunk
    starts at, or balanced by the cost model), plans each on its stage's submesh and runs
    ``schedule`` (``"gpipe"``, ``"1f1b"``, ``"interleaved"``, ``"eager-1f1b"``, ``"zb-h1"``, or
    a :class:`fxpar.Schedule`, e.g. written by hand)
    over ``microbatches`` slices of the batch (dim 0 of every tensor input); ``boundary=``
    ``"auto"``/``"send_recv"``/``"scatter_gather"`` says how values cross between stages.
    :mod:`fxpar.planner.stages` and :mod:`fxpar.runtime.interpreter` say how.
    """
    from fxpar.program import Program

    args = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else tuple(example_inputs)
    targets = tuple(example_targets)
    wrapped = WithLoss(model, loss_fn, len(args), len(targets)) if loss_fn is not None else model
    mesh = kwargs.get("mesh")
    if mesh is not None and "pp" in (mesh.axis_names if isinstance(mesh, Mesh) else dict(mesh)):
        return _compile_pipeline(model, wrapped, cluster, args + targets, example_kwargs,
                                 optimizer=optimizer, plan=plan, training=training,
                                 prefetch=prefetch, emit=emit, schedule=schedule,
                                 microbatches=microbatches, chunks=chunks,
                                 split_points=split_points, **kwargs)
    was_training = model.training
    model.train(training)
    try:
        with (frozen_params(model) if not training else contextlib.nullcontext()):
            if isinstance(plan, Plan):
                graph = kwargs.pop("graph", None) or capture(wrapped, args + targets, example_kwargs)
                planned = Planned(plan, graph)
            else:
                planned = globals()["plan"](wrapped, cluster, args + targets, example_kwargs,
                                            plan=plan, **kwargs)
    finally:
        model.train(was_training)
    if not emit:
        return planned
    return Program(planned.plan, planned.graph, wrapped, optimizer=optimizer, training=training,
                   prefetch=prefetch, stage_graphs=list(planned.stage_graphs) or None)


def _multi_node(cluster) -> bool:
    return getattr(cluster, "nodes", 1) > 1




def _global_batch(args, kwargs) -> int:
    sizes = {int(x.shape[0]) for x in (*args, *(kwargs or {}).values())
             if isinstance(x, torch.Tensor) and x.ndim}
    if len(sizes) != 1:
        raise PlanError(f"the joint search splits every tensor input along dim 0 (the batch); "
                        f"the inputs' dim-0 sizes are {sorted(sizes) or 'none'}")
    return sizes.pop()


def _plan_joint(model, cluster, args, example_kwargs, *, plan, options, memory_budget,
                time_limit, progress, kind: str = "auto") -> Planned:
    """``plan="auto"`` on a multi-node cluster without a mesh, or a user tuple ``plan={...}``:
    the joint search of :mod:`fxpar.planner.joint` on the model captured with one sample
    (without stack traces: only planned on), then the winner planned for real (captured in
    full at its microbatch shape; a pipeline when it
    has stages or microbatches, else one SPMD step). ``plan.schedule["search"]`` keeps the
    ranked configurations for ``explain()``."""
    from fxpar.planner.joint import search

    only = ParallelConfig.from_tuple(plan) if isinstance(plan, Mapping) else {}
    args = (args,) if isinstance(args, torch.Tensor) else tuple(args)
    B = _global_batch(args, example_kwargs)
    opts = options or PlannerOptions()
    over = {k: v for k, v in (("memory_budget", memory_budget), ("time_limit", time_limit))
            if v is not None}
    opts = dataclasses.replace(opts, **over) if over else opts

    def cap(rows: int, stack_traces: bool = True) -> fx.GraphModule:
        m = B // rows
        return capture(model, tuple(_microbatch(x, m, f"#{i}") for i, x in enumerate(args)),
                       {k: _microbatch(v, m, repr(k)) for k, v in (example_kwargs or {}).items()} or None,
                       stack_traces=stack_traces)

    # the probe is only planned on: no stack traces (~20% of a capture); the graph returned
    # below is a full capture, also when it has the probe's one row
    probe = cap(1, stack_traces=False)
    # alpa chooses under its own (placement-agnostic) costs; the choice is priced for real below
    res = search(probe, cluster.placement_agnostic() if kind == "alpa" else cluster, batch=B,
                 options=opts, only=only)
    c = res.best
    if progress is not None:
        progress(f"joint search: {res.tried} configurations, {res.over_memory} over memory; "
                 f"best {c.name}: {c.step * 1e3:.4g} ms")
    rows = c.dp * c.microbatch
    gm = cap(rows)
    pins = res.pins(c, probe, gm)  # the layouts the search priced
    targets = {n.name: n.target for n in gm.graph.nodes}
    cache = BuildCache()  # shared by the check below, the chunks and any retry
    # a value whose op cannot take the priced layout (no such strategy): the planner chooses
    # the layout of every value of that op, and says so; found before planning, on the
    # (sub)mesh the plan is built on (its strategy lists then come from the cache)
    dropped = unkeepable_pins(gm, _config_mesh(c, cluster), pins, cache=cache)
    for k in dropped:
        pins.pop(k)
    for _ in range(len(pins) + 1):
        try:
            got = _plan_config(gm, probe, cluster, c, res, opts, pins, dropped, cache)
            notes = (f"{kind}: {c.name} chosen under placement-agnostic communication costs "
                     "(one link for every group); priced here on the real cluster",) \
                if kind == "alpa" else ()
            return dataclasses.replace(got, plan=dataclasses.replace(
                got.plan, kind=kind, notes=got.plan.notes + notes))
        except PlanError as e:
            # the same rule for a pin only a chunk's own graph rejects (the check above saw
            # the whole graph): let the planner choose it, and say so; any other error is
            # the user's
            bad = _pin_error(e)
            if bad is None or bad.pin in ("input",):
                raise
            # and every pin on a node of the same op (one retry per op, not per node)
            same = [k for k in pins if k == bad.pin or
                    (targets.get(k) is not None and targets.get(k) is targets.get(bad.pin))]
            for k in same:
                pins.pop(k)
            dropped.extend(same)
    raise PlanError(f"joint search: no pin of {c.name} could be kept")


def _pin_error(e: BaseException):
    """The :class:`PinError` that caused ``e`` (itself or a cause in its chain), else ``None``."""
    while e is not None:
        if isinstance(e, PinError):
            return e
        e = e.__cause__
    return None


def _config_mesh(c, cluster) -> Mesh:
    """The mesh :func:`_plan_config` plans ``c``'s graph on (a pipeline: its first stage's)."""
    from fxpar.planner.stages import stage_submesh

    if c.pp == 1 and c.microbatches == 1:
        return Mesh(cluster, c.spmd_axes)
    return stage_submesh(Mesh(cluster, {"pp": c.pp, "dp": c.dp, "tp": c.tp}), 0)


def _plan_config(gm, probe, cluster, c, res, opts, pins, dropped, cache) -> Planned:
    """The search's winner ``c`` planned on ``gm`` (captured at its microbatch shape) with the
    layouts it priced (``pins``), then priced by the one step model under its configuration
    (state factors, recomputed layers): ``plan.time`` and ``plan.memory`` are what the search
    ranked it by, up to the realized layouts and shapes. Memory is the search's business, so
    the intra-op planner plans it with no limit of its own (its liveness model knows neither
    state sharding nor recomputation) and the plan shows the search's budget."""
    from fxpar.planner.intra_op import priced
    from fxpar.planner.joint import _NO_LIMIT, unit_start_names
    from fxpar.planner.price import price_plan
    from fxpar.planner.stages import plan_pipeline, with_step

    config = res.config(c)
    notes = ((f"joint search: the planner chose the layout of {', '.join(dropped)} "
              "(no strategy takes the priced one)",) if dropped else ())
    free = dataclasses.replace(opts, memory_budget=_NO_LIMIT)
    if c.pp == 1 and c.microbatches == 1:
        mesh = _config_mesh(c, cluster)
        p, bp, sol = plan_and_keep(gm, mesh, pins=pins, options=free, cache=cache)
        p = priced(p, gm, config)
        p = dataclasses.replace(p, notes=p.notes + notes, budget=int(res.budget),
                                memory=int(max(price_plan(p)[1])),
                                schedule={**p.schedule, "search": res.summary()})
        return Planned(p, gm, ((c.name, p.time),), bp, sol)
    mesh = Mesh(cluster, {"pp": c.pp, "dp": c.dp, "tp": c.tp})
    pplan, chunks = plan_pipeline(
        gm, mesh, schedule=c.schedule, microbatches=c.microbatches, chunks=c.chunks,
        options=free, boundary="scatter_gather",
        pins=pins, start_nodes=unit_start_names(probe, c.starts), cache=cache)
    # chunks were planned with no intra-op limit (memory is the search's); show the real one
    stages = tuple(dataclasses.replace(st, plan=dataclasses.replace(st.plan, budget=int(res.budget)))
                   for st in pplan.stages)
    pplan = with_step(dataclasses.replace(pplan, stages=stages, budget=int(res.budget), notes=notes,
                                          schedule={**pplan.schedule, "search": res.summary()}),
                      dataclasses.replace(config, microbatch=c.microbatch))
    pplan = dataclasses.replace(pplan, memory=int(max(price_plan(pplan)[1])))
    return Planned(pplan, gm, ((c.name, pplan.time),),
                   stage_graphs=tuple(ch.graph for ch in chunks))


def _microbatch(x, m: int, name: str):
    """The first of ``m`` equal slices of ``x`` along dim 0 (a pipeline is captured at the
    microbatch shape); non-tensors pass through."""
    if not isinstance(x, torch.Tensor):
        return x
    if x.ndim == 0 or x.shape[0] % m:
        raise PlanError(f"input {name}: {m} microbatches do not divide its batch dimension "
                        f"(shape {tuple(x.shape)}); every tensor input is split along dim 0")
    return x[: x.shape[0] // m]


def _compile_pipeline(model, wrapped, cluster, args, example_kwargs, *, optimizer, plan,
                      training, prefetch, emit, schedule, microbatches, chunks, split_points,
                      mesh, **kwargs):
    """:func:`compile` for a mesh with a ``pp`` axis (see there)."""
    from fxpar.planner.stages import plan_pipeline
    from fxpar.program import Program

    if not isinstance(plan, str) or plan not in PLAN_KINDS or plan in SEARCHED:
        raise PlanError(f"pipeline plans take plan='auto' or a baseline with pins "
                        f"{('auto',) + BASELINES}, got {plan!r}")
    from fxpar.schedule import Schedule

    if isinstance(schedule, Schedule):
        microbatches = schedule.microbatches
    if not isinstance(microbatches, int) or microbatches < 1:
        raise PlanError(f"microbatches={microbatches!r}: need a positive integer")
    m = _as_mesh(mesh, cluster)
    if m.ndim == 1:  # stages of one device: name the (size-1) data-parallel axis
        m = Mesh.from_devices(cluster, ["pp", "dp"], np.asarray(m.devices).reshape(-1, 1))
    if split_points is not None and wrapped is not model:  # FQNs of the user's model
        split_points = [p if p.startswith("model.") else "model." + p for p in split_points]
    mb_args = tuple(_microbatch(x, microbatches, f"#{i}") for i, x in enumerate(args))
    mb_kwargs = {k: _microbatch(v, microbatches, repr(k)) for k, v in (example_kwargs or {}).items()}
    unknown = set(kwargs) - {"pins", "options", "memory_budget", "time_limit", "boundary"}
    if unknown:
        raise PlanError(f"pipeline compile does not take {sorted(unknown)}")
    opts = kwargs.get("options") or PlannerOptions()
    over = {k: kwargs[k] for k in ("memory_budget", "time_limit") if k in kwargs}
    if over:
        opts = dataclasses.replace(opts, **over)
    was_training = model.training
    model.train(training)
    try:
        with (frozen_params(model) if not training else contextlib.nullcontext()):
            gm = capture(wrapped, mb_args, mb_kwargs or None)
    finally:
        model.train(was_training)
    pplan, chunks_ = plan_pipeline(gm, m, schedule=schedule, microbatches=microbatches,
                                   chunks=chunks, split_points=split_points,
                                   pins=kwargs.get("pins"), options=opts, kind=plan,
                                   boundary=kwargs.get("boundary", "auto"))
    if not emit:
        return Planned(pplan, gm)
    return Program(pplan, gm, wrapped, optimizer=optimizer, training=training,
                   prefetch=prefetch, stage_graphs=[c.graph for c in chunks_])
