"""Public entry points of planning: :func:`plan` and :func:`compile`; :class:`Planned`.

``fxpar.plan(model, cluster, example_inputs=...)`` captures the model (fake tensors, no real
weights), builds the strategy problem on one or several candidate meshes, solves it and
returns a :class:`Planned` (``.plan``, ``.graph``, ``.explain()``, ``.why(node)``).

``plan=``: ``"auto"`` (free choice per node, on the given mesh or the best of
:func:`fxpar.planner.candidate_meshes`) or a baseline, ``"dp"``, ``"zero3"``, ``"megatron"``,
``"axonn"`` (:mod:`fxpar.planner.baselines`: their meshes and pins), all scored by the one
cost model of :mod:`fxpar.planner`. ``axonn`` without a mesh tries AxoNN's ranked grids in
order and keeps the first that plans; ``auto`` keeps the fastest of all meshes tried.

>>> import torch, fxpar
>>> from examples.models import MLP
>>> p = fxpar.api.plan(MLP(8, 16, 4), fxpar.Cluster.preset("dgx-a100"),
...                    example_inputs=(torch.randn(2, 8),), mesh={"dp": 8})
>>> p.plan.kind, p.plan.mesh["shape"]
('auto', (8,))
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from fxpar.capture import WithLoss, capture, frozen_params
from fxpar.errors import PlanError
from fxpar.mesh import Mesh
from fxpar.plan_data import PLAN_KINDS, Plan
from fxpar.planner import (BuiltProblem, PlannerOptions, axonn_meshes, baseline_mesh,
                           baseline_notes, baseline_pins, candidate_meshes, plan_and_keep)
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


def plan(model: torch.nn.Module, cluster, example_inputs: Sequence[Any] | torch.Tensor = (),
         example_kwargs: Mapping[str, Any] | None = None, *, mesh=None, plan: str = "auto",
         pins: Mapping[str, object] | None = None, memory_budget: float | None = None,
         time_limit: float | None = 60.0, options: PlannerOptions | None = None,
         strategies: Callable | None = None, graph: fx.GraphModule | None = None,
         progress: Callable[[str], None] | None = None) -> Planned:
    """Capture ``model`` and plan it on ``cluster`` (module docstring for ``plan=`` kinds).

    ``mesh``: a :class:`Mesh` or ``{"dp": 2, "tp": 4}``; ``None`` picks one. ``pins`` add to
    a baseline's own pins. ``graph``: an already captured graph (skips capture).
    ``progress(line)`` is called once per candidate mesh as it is planned (its build and
    solve times and predicted step, or why it failed).
    Raises :class:`PlanError` when no plan fits ``memory_budget`` (default device memory).
    """
    if plan not in PLAN_KINDS:
        raise PlanError(f"unknown plan {plan!r}; one of {PLAN_KINDS}")
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
    best, kept, tried, errors = None, None, [], []
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
        if progress is not None:
            progress(f"{msh!r}: build {p.stats.get('build_s', 0):.2f} s, solve "
                     f"{p.stats.get('solve_s', 0):.2f} s ({p.stats.get('strategies', '?')} "
                     f"strategies), predicted step {p.time * 1e3:.4g} ms")
        tried.append((repr(msh), p.time))
        if best is None or p.time < best.time:
            best, best_mesh, kept = p, msh, (bp, sol)
    if best is None:
        raise PlanError(f"no {plan} plan on any candidate mesh: " + "; ".join(errors))
    notes = baseline_notes(plan, gm, best_mesh)
    if notes:
        best = dataclasses.replace(best, notes=notes)
    return Planned(best, gm, tuple(tried), *kept)


def compile(model: torch.nn.Module, cluster, example_inputs: Sequence[Any] | torch.Tensor = (),
            example_kwargs: Mapping[str, Any] | None = None, *, loss_fn: Callable | None = None,
            example_targets: Sequence[Any] = (), optimizer: Callable | None = None,
            plan: str | Plan = "auto", training: bool = True, prefetch: int = 1,
            emit: bool = True, **kwargs):
    """Compile ``model`` for ``cluster``: plan it and return a :class:`fxpar.program.Program`
    (``.plan``, ``.explain()``, ``.rank_graph(r)``, ``.save(path)``, ``.runner()``).

    ``example_inputs``/``example_kwargs``: one global batch of the model's inputs (fake or
    meta tensors are fine). ``loss_fn(output, *targets)`` with ``example_targets`` when the
    model does not return its loss. ``optimizer(params)`` builds any ``torch.optim`` optimizer.
    ``plan``: ``"auto"``, a baseline name, or a :class:`Plan` (e.g. from :func:`fxpar.load`).
    ``training=False`` captures the model in eval mode and plans the forward only.
    ``emit=False`` stops after planning and returns a :class:`Planned`. Other keyword
    arguments go to :func:`plan` (``mesh``, ``pins``, ``memory_budget``...).
    """
    from fxpar.program import Program

    args = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else tuple(example_inputs)
    targets = tuple(example_targets)
    wrapped = WithLoss(model, loss_fn, len(args), len(targets)) if loss_fn is not None else model
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
                   prefetch=prefetch)
