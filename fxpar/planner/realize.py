"""Realizing a joint search's configuration: the search (:mod:`fxpar.planner.joint`) on a
probe capture, then its winner planned for real at its microbatch shape with the layouts the
search priced, and priced by the one step model under its configuration (what
``fxpar.plan(..., plan=dict(...))`` and ``plan="auto"`` on several nodes return).

:class:`Planned` (re-exported by :mod:`fxpar.api`) is what planning returns.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from fxpar.capture import capture
from fxpar.config import ParallelConfig
from fxpar.errors import PinError, PlanError
from fxpar.mesh import Mesh
from fxpar.plan_data import Plan
from fxpar.planner.intra_op import BuildCache, BuiltProblem, PlannerOptions, plan_and_keep, unkeepable_pins
from fxpar.solver import Solution

__all__ = ["Planned", "plan_joint", "planned_from", "microbatch"]


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
        >>> len(w.alternatives) == w.num_candidates - 1 and all(a.why for a in w.alternatives)
        True
        >>> all(a.delta >= 0 for a in w.alternatives if a.status == "kept")  # the solver's optimum
        True
        """
        from fxpar.planner.explain import why

        if self.problem is None or self.solution is None:
            raise PlanError("why() needs the planning problem: this Planned holds a given or "
                            "loaded Plan only; plan it with fxpar.plan(...)")
        return why(self.problem, self.solution.choice, node, top=top)


def planned_from(plan: Plan, model, args, kwargs, *, graph: fx.GraphModule | None = None,
                 tried=()) -> Planned:
    """The :class:`Planned` of ``plan`` made elsewhere (on rank 0, loaded from a file) for
    ``model`` called on the global batch ``args``/``kwargs``: the model captured as the
    planner captured it (one SPMD step: the whole batch; a pipeline: one microbatch, dim 0
    divided by ``plan.schedule["microbatches"]``) unless ``graph`` is given, and a pipeline's
    stage chunk graphs split again where the plan's chunks start (``StagePlan.start``): the
    same chunks, node for node. No solver runs; ``why()`` is unavailable.

    >>> import torch, fxpar
    >>> from examples.models import MLP
    >>> model, x = MLP(8, 16, 4), torch.randn(4, 8)
    >>> prog = fxpar.compile(model, fxpar.Cluster.local(2), (x,), mesh={"pp": 2}, microbatches=2,
    ...                      loss_fn=lambda out: out.sum())
    >>> got = planned_from(prog.plan, prog.model, (x,), {})
    >>> names = lambda g: [n.name for n in g.graph.nodes]
    >>> [names(g) for g in got.stage_graphs] == [names(sp.graph) for sp in prog.stage_programs]
    True
    """
    from fxpar.split import split_stages

    args = (args,) if isinstance(args, torch.Tensor) else tuple(args)
    kwargs = dict(kwargs or {})
    if plan.stages:
        m = int(plan.schedule["microbatches"])
        args = tuple(microbatch(x, m, f"#{i}") for i, x in enumerate(args))
        kwargs = {k: microbatch(v, m, repr(k)) for k, v in kwargs.items()}
    gm = graph if graph is not None else capture(model, args, kwargs or None)
    chunks = ()
    if plan.stages:
        chunks = tuple(c.graph for c in split_stages(gm, len(plan.stages),
                                                     start_nodes=[st.start for st in plan.stages]))
    return Planned(plan, gm, tuple(tuple(t) for t in tried), stage_graphs=chunks)


def _global_batch(args, kwargs) -> int:
    sizes = {int(x.shape[0]) for x in (*args, *(kwargs or {}).values())
             if isinstance(x, torch.Tensor) and x.ndim}
    if len(sizes) != 1:
        raise PlanError(f"the joint search splits every tensor input along dim 0 (the batch); "
                        f"the inputs' dim-0 sizes are {sorted(sizes) or 'none'}")
    return sizes.pop()


def plan_joint(model, cluster, args, example_kwargs, *, plan, options, memory_budget,
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
        return capture(model, tuple(microbatch(x, m, f"#{i}") for i, x in enumerate(args)),
                       {k: microbatch(v, m, repr(k)) for k, v in (example_kwargs or {}).items()} or None,
                       stack_traces=stack_traces)

    # the probe is only planned on: no stack traces (~20% of a capture); the graph returned
    # below is a full capture, also when it has the probe's one row
    probe = cap(1, stack_traces=False)
    # alpa chooses under its own (placement-agnostic) costs; the choice is priced for real below
    # alpa's degrees are the real cluster's (tensor parallelism inside a node, as auto's:
    # auto's space holds its picks), only its communication costs are placement-agnostic
    tps = [t for t in (1, 2, 4, 8, 16) if t <= cluster.devices_per_node]
    res = search(probe, cluster.placement_agnostic() if kind == "alpa" else cluster, batch=B,
                 options=opts, only=only, tps=tps)
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
    return stage_submesh(_pipeline_mesh(c, cluster), 0)


def _pipeline_mesh(c, cluster) -> Mesh:
    """The whole mesh of a pipeline configuration ``c``: ``pp``, ``dp``, ``cp`` (when
    ``c.cp > 1``), ``tp``, outermost first."""
    return Mesh(cluster, {"pp": c.pp, "dp": c.dp, **({"cp": c.cp} if c.cp > 1 else {}), "tp": c.tp})


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
    mesh = _pipeline_mesh(c, cluster)
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


def microbatch(x, m: int, name: str):
    """The first of ``m`` equal slices of ``x`` along dim 0 (a pipeline is captured at the
    microbatch shape); non-tensors pass through."""
    if not isinstance(x, torch.Tensor):
        return x
    if x.ndim == 0 or x.shape[0] % m:
        raise PlanError(f"input {name}: {m} microbatches do not divide its batch dimension "
                        f"(shape {tuple(x.shape)}); every tensor input is split along dim 0")
    return x[: x.shape[0] // m]
