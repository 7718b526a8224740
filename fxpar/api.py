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
``Plan.time``, the one step model of :mod:`fxpar.cost.step`), and of the ``dp``, ``zero3``
and ``megatron`` layouts (:func:`_seeds`: the solver minimizes a summed time, not the step).

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
from typing import Any

import numpy as np
import torch
import torch.fx as fx

from fxpar.capture import WithLoss, capture, frozen_params
from fxpar.errors import PlanError
from fxpar.ir import untrained_outputs
from fxpar.mesh import Mesh
from fxpar.plan_data import BASELINES, PLAN_KINDS, SEARCHED, Plan
from fxpar.planner import (PlannerOptions, axonn_meshes, baseline_mesh,
                           baseline_notes, baseline_pins, candidate_meshes, cp_pins, plan_and_keep)
from fxpar.plan_broadcast import graph_signature, on_rank0
from fxpar.planner.realize import Planned, microbatch as _microbatch, plan_joint, planned_from

__all__ = ["plan", "compile", "Planned"]


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
         microbatches: int = 1, chunks: int | None = None,
         split_points: Sequence[str] | None = None,
         boundary: str = "auto", broadcast: bool = True,
         sequence_parallel: bool = False) -> Planned:
    """Capture ``model`` and plan it on ``cluster`` (module docstring for ``plan=`` kinds).

    ``mesh``: a :class:`Mesh` or ``{"dp": 2, "tp": 4}``; ``None`` picks one; with a ``"pp"``
    axis, a pipeline plan (``schedule``, ``microbatches``, ``chunks``, ``split_points``,
    ``boundary``: see :func:`compile`). ``pins`` add to
    a baseline's own pins. ``graph``: an already captured graph (skips capture).
    ``progress(line)`` is called once per candidate mesh as it is planned (its build and
    solve times and predicted step, or why it failed).
    Raises :class:`PlanError` when no plan fits ``memory_budget`` (default device memory).

    **Under torch.distributed** (an initialized process group, e.g. under ``torchrun``), call
    it on every rank: global rank 0 plans and broadcasts its plan, the other ranks capture the
    model (they need the graph) but never solve, so every rank holds the same plan whatever
    ``time_limit`` cuts (:mod:`fxpar.plan_broadcast`). A planning error on rank 0 is raised on
    every rank, as the same error type with the same message. On the other ranks ``why()`` is
    unavailable (they hold no solver problem) and ``progress`` is not called.
    ``broadcast=False`` plans on this rank alone, as without a process group.

    ``sequence_parallel=True`` (``plan="megatron"`` only): Megatron's sequence parallelism,
    the norms between tensor-parallel regions split along the sequence on ``tp``, each
    all-reduce of a layer a reduce-scatter plus an all-gather (``auto`` picks it where it pays).
    """
    if sequence_parallel:
        if plan != "megatron":
            raise PlanError(f"sequence_parallel=True applies to plan='megatron', not {plan!r} "
                            "(plan='auto' chooses sequence-sharded norms where they pay)")
        options = dataclasses.replace(options or PlannerOptions(), sequence_parallel=True)
    if isinstance(plan, str) and plan in SEARCHED:
        if mesh is not None or graph is not None or model is None:
            raise PlanError(f"plan={plan!r} searches its own configurations ({SEARCHED[plan]}, "
                            "over every device of the cluster): give a model, no mesh or graph")
        return _joint_on_rank0(model, cluster, example_inputs, example_kwargs, broadcast,
                               plan=SEARCHED[plan], options=options, memory_budget=memory_budget,
                               time_limit=time_limit, progress=progress, kind=plan)
    if isinstance(plan, Mapping) or (plan == "auto" and mesh is None and graph is None
                                     and model is not None and _multi_node(cluster)):
        return _joint_on_rank0(model, cluster, example_inputs, example_kwargs, broadcast,
                               plan=plan, options=options, memory_budget=memory_budget,
                               time_limit=time_limit, progress=progress)
    if plan not in PLAN_KINDS:
        raise PlanError(f"unknown plan {plan!r}; one of {PLAN_KINDS}")
    if mesh is not None and "pp" in (mesh.axis_names if isinstance(mesh, Mesh) else dict(mesh)):
        args = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else tuple(example_inputs)
        kw = {k: v for k, v in (("memory_budget", memory_budget), ("time_limit", time_limit),
                                ("options", options), ("pins", pins)) if v is not None}
        return _compile_pipeline(model, model, cluster, args, example_kwargs, optimizer=None,
                                 plan=plan, training=model.training, prefetch=1, emit=False,
                                 schedule=schedule, microbatches=microbatches, chunks=chunks,
                                 split_points=split_points, mesh=mesh, boundary=boundary,
                                 broadcast=broadcast, **kw)
    opts = options or PlannerOptions()
    kw = {k: v for k, v in (("memory_budget", memory_budget), ("time_limit", time_limit))}
    opts = PlannerOptions(**{**{f: getattr(opts, f) for f in opts.__dataclass_fields__},
                             **{k: v for k, v in kw.items() if v is not None or k == "time_limit"}})

    def solve(gm: fx.GraphModule) -> Planned:
        m = _as_mesh(mesh, cluster)
        # axonn without a mesh: AxoNN's ranked grids in order, the first that plans (AxoNN tries
        # its top configurations); the others: their one default mesh; auto: the best of all.
        first_fit = m is None and plan == "axonn"
        meshes = [m] if m is not None else (
            candidate_meshes(gm, cluster) if plan == "auto" else
            axonn_meshes(gm, cluster) if first_fit else [baseline_mesh(plan, gm, cluster)])
        trials = [(msh, plan) for msh in meshes]
        if plan == "auto" and not pins:
            trials += _seeds(gm, cluster, m)
        best, kept, tried, errors, best_key, best_seed, failed = None, None, [], [], None, None, None
        for msh, kind in trials:
            if first_fit and best is not None:
                break
            seed = kind != plan
            label = f"{msh!r} [{kind} layout]" if seed else repr(msh)
            try:
                all_pins = dict(baseline_pins(kind, gm, msh, sequence_parallel=opts.sequence_parallel)
                                ) if kind != "auto" else {}
                all_pins.update(cp_pins(gm, msh))   # a "cp" axis splits the sequence
                all_pins.update(pins or {})
                p, bp, sol = plan_and_keep(gm, msh, pins=all_pins, options=opts,
                                           strategies=strategies, kind=plan)
            except PlanError as e:
                if progress is not None:
                    progress(f"{label}: no plan ({str(e).splitlines()[0][:120]})")
                if not seed:   # a baseline's layout that cannot plan is no error of auto's
                    errors.append(f"{msh!r}: {e}")
                    failed = failed or e
                continue
            # meshes are compared by the one step model (Plan.time), as the joint search ranks
            # its configurations; on one mesh the solver minimizes the summed time
            step = p.time
            if progress is not None:
                progress(f"{label}: build {p.stats.get('build_s', 0):.2f} s, solve "
                         f"{p.stats.get('solve_s', 0):.2f} s ({p.stats.get('strategies', '?')} "
                         f"strategies), predicted step {step * 1e3:.4g} ms")
            tried.append((label, step))
            if best is None or (step, p.summed_time) < best_key:
                best, best_mesh, kept, best_key = p, msh, (bp, sol), (step, p.summed_time)
                best_seed = kind if seed else None
        if best is None:
            if len(meshes) == 1 and failed is not None:
                raise failed
            raise PlanError(f"no {plan} plan on any candidate mesh: " + "; ".join(errors))
        notes = baseline_notes(plan, gm, best_mesh)
        if best_seed is not None:
            notes = notes + (f"auto: the {best_seed} baseline's layout on {best_mesh!r} is priced "
                             "faster by the step model than the solver's own choice (the solver "
                             "minimizes the summed time, the step model overlaps), so it is kept",)
        if notes:
            best = dataclasses.replace(best, notes=notes)
        return Planned(best, gm, tuple(tried), *kept)

    return on_rank0(solve, lambda gm, p, tried: Planned(p, gm, tuple(map(tuple, tried))),
                    plan_of=_plan_of, extra_of=_tried_of, enabled=broadcast,
                    prepare=lambda: graph if graph is not None else
                    capture(model, example_inputs, example_kwargs), signature=graph_signature)


#: baselines whose layouts ``plan="auto"`` also prices (:func:`_seeds`)
SEED_BASELINES = ("dp", "zero3", "megatron")


def _seeds(gm: fx.GraphModule, cluster, mesh: Mesh | None) -> list[tuple[Mesh, str]]:
    """``(mesh, baseline)`` pairs ``plan="auto"`` prices besides its own solves: each of
    :data:`SEED_BASELINES` on the given ``mesh`` (else on its default mesh). The solver
    minimizes the summed time of a mesh's ops and collectives, while plans are ranked by the
    step model (overlap, buckets, the optimizer), so on one mesh the solver's optimum can price
    a few percent slower than a baseline's layout; with these seeds ``auto`` is never slower
    than a baseline by its own step model."""
    out = []
    for kind in SEED_BASELINES:
        try:
            out.append((mesh if mesh is not None else baseline_mesh(kind, gm, cluster), kind))
        except PlanError:
            continue
    return out


@_gc_paused
def compile(model: torch.nn.Module, cluster, example_inputs: Sequence[Any] | torch.Tensor = (),
            example_kwargs: Mapping[str, Any] | None = None, *, loss_fn: Callable | None = None,
            example_targets: Sequence[Any] = (), optimizer: Callable | None = None,
            plan: str | Plan = "auto", training: bool = True, prefetch: int = 1,
            emit: bool = True, schedule: str = "1f1b", microbatches: int = 1,
            chunks: int | None = None,
            split_points: Sequence[str] | None = None, **kwargs):
    """Compile ``model`` for ``cluster``: plan it and return a :class:`fxpar.program.Program`
    (``.plan``, ``.explain()``, ``.rank_graph(r)``, ``.save(path)``, ``.runner()``).

    ``example_inputs``/``example_kwargs``: one global batch of the model's inputs (fake or
    meta tensors are fine). ``loss_fn(output, *targets)`` with ``example_targets`` when the
    model does not return its loss. ``optimizer(params)`` builds any ``torch.optim`` optimizer.
    ``plan``: ``"auto"``, a baseline name, or a :class:`Plan` (e.g. from :func:`fxpar.load`,
    or made on another rank: a pipeline plan's stage chunks are split again where it says).
    Under ``torch.distributed``, rank 0 plans and broadcasts (see :func:`plan`; ``broadcast=``).
    ``training=False`` captures the model in eval mode and plans the forward only.
    ``emit=False`` stops after planning and returns a :class:`Planned`. Other keyword
    arguments go to :func:`plan` (``mesh``, ``pins``, ``memory_budget``...).

    **Pipelines**: a mesh with a ``"pp"`` axis (``mesh={"pp": 2, "dp": 1, "tp": 2}``) splits
    the model into ``pp·chunks`` stage chunks (at ``split_points``, module FQNs each chunk
    starts at, or balanced by the cost model), plans each on its stage's submesh and runs
    ``schedule`` (``"gpipe"``, ``"1f1b"``, ``"interleaved"``, ``"eager-1f1b"``, ``"zb-h1"``,
    ``"looped-bfs"``, ``"interleaved-zb"``, ``"zbv"``, ``"dualpipev"`` (the last four and
    ``"interleaved"`` with ``chunks > 1``; ``"zbv"`` and ``"dualpipev"`` place their two chunks
    per rank in a V, and ``chunks=None`` gives them two, the rest one), or a
    :class:`fxpar.Schedule`, e.g. written by hand)
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
            if isinstance(plan, Plan):  # a pipeline plan's chunks split again where it says
                planned = planned_from(plan, wrapped, args + targets, example_kwargs,
                                       graph=kwargs.pop("graph", None))
            else:
                planned = globals()["plan"](wrapped, cluster, args + targets, example_kwargs,
                                            plan=plan, **kwargs)
    finally:
        model.train(was_training)
    why = untrained_outputs(planned.graph) if training else ""
    if why:   # its backward would fail at the first step: say why before anything runs
        raise PlanError(f"cannot train the captured {type(model).__name__}: {why}. Compile it "
                        "with training=False for inference, or write the layer without a custom "
                        "autograd.Function")
    if not emit:
        return planned
    return Program(planned.plan, planned.graph, wrapped, optimizer=optimizer, training=training,
                   prefetch=prefetch, stage_graphs=list(planned.stage_graphs) or None)


def _multi_node(cluster) -> bool:
    return getattr(cluster, "nodes", 1) > 1


def _plan_of(planned: Planned) -> Plan:
    return planned.plan


def _tried_of(planned: Planned) -> tuple:
    return planned.tried


def _joint_on_rank0(model, cluster, args, kwargs, broadcast: bool, **kw) -> Planned:
    """:func:`plan_joint` on rank 0; the other ranks capture the model at the shape of rank
    0's winner (:func:`planned_from`): which one is known only from the plan."""
    return on_rank0(lambda _: plan_joint(model, cluster, args, kwargs, **kw),
                    lambda _, p, tried: planned_from(p, model, args, kwargs, tried=tried),
                    plan_of=_plan_of, extra_of=_tried_of, enabled=broadcast)


def _compile_pipeline(model, wrapped, cluster, args, example_kwargs, *, optimizer, plan,
                      training, prefetch, emit, schedule, microbatches, chunks, split_points,
                      mesh, broadcast: bool = True, **kwargs):
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
    unknown = set(kwargs) - {"pins", "options", "memory_budget", "time_limit", "boundary", "strategies"}
    if unknown:
        raise PlanError(f"pipeline compile does not take {sorted(unknown)}")
    opts = kwargs.get("options") or PlannerOptions()
    over = {k: kwargs[k] for k in ("memory_budget", "time_limit") if k in kwargs}
    if over:
        opts = dataclasses.replace(opts, **over)
    def captured() -> fx.GraphModule:
        was_training = model.training
        model.train(training)
        try:
            with (frozen_params(model) if not training else contextlib.nullcontext()):
                return capture(wrapped, mb_args, mb_kwargs or None)
        finally:
            model.train(was_training)

    def solve(gm):
        pplan, chunks_ = plan_pipeline(gm, m, schedule=schedule, microbatches=microbatches,
                                       chunks=chunks, split_points=split_points,
                                       pins=kwargs.get("pins"), options=opts, kind=plan,
                                       boundary=kwargs.get("boundary", "auto"),
                                       strategies=kwargs.get("strategies"))
        return Planned(pplan, gm, stage_graphs=tuple(c.graph for c in chunks_))

    # rank 0 plans; the others split their capture where rank 0's chunks start
    planned = on_rank0(solve, lambda gm, p, _: planned_from(p, wrapped, (), None, graph=gm),
                       plan_of=_plan_of, prepare=captured, enabled=broadcast,
                       signature=graph_signature)
    if not emit:
        return planned
    return Program(planned.plan, planned.graph, wrapped, optimizer=optimizer, training=training,
                   prefetch=prefetch, stage_graphs=list(planned.stage_graphs))
