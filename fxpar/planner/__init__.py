"""Planning: captured graph + cluster → priced strategy problem → solver → :class:`Plan`.

Modules (dependencies point down; the solver is the only OR-Tools importer):

* :mod:`fxpar.planner.intra_op`: one mesh, one graph: :func:`build_problem` (the
  :class:`~fxpar.solver.StrategyProblem` and what is needed to read a solution back),
  :func:`solution_to_plan`, :func:`plan_graph`;
* :mod:`fxpar.planner.pricing`: node compute times, node memory, edge resharding matrices;
* :mod:`fxpar.planner.pins`: pin matching, the size-1 mesh axes;
* :mod:`fxpar.planner.baselines`: the meshes and pins of the ``dp``/``zero3``/``megatron``/
  ``axonn`` baselines and of the ``auto`` mesh search;
* to come: ``stages.py`` (pipeline stage cuts over submeshes) and ``joint.py`` (the joint
  inter-/intra-op planner over ``intra_op``'s per-stage problems).

>>> import fxpar.planner as planner
>>> planner.plan_graph is planner.intra_op.plan_graph
True
"""

from fxpar.planner.intra_op import (BuildCache, BuiltProblem, PlannerOptions, build_problem,
                                    default_strategies, plan_and_keep, plan_graph,
                                    solution_to_plan, unkeepable_pins)
from fxpar.planner.baselines import (axonn_meshes, baseline_mesh, baseline_notes, baseline_pins, cp_pins,
                                     candidate_meshes, zero3_spec)

__all__ = [
    "PlannerOptions", "BuiltProblem", "BuildCache", "build_problem", "solution_to_plan", "plan_graph",
    "plan_and_keep", "default_strategies", "unkeepable_pins",
    "baseline_pins", "baseline_notes", "zero3_spec", "baseline_mesh", "candidate_meshes", "axonn_meshes", "cp_pins",
]
