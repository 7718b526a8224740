"""One planner per world: under ``torch.distributed``, global rank 0 plans and the other ranks
receive its plan (what :func:`fxpar.plan` and :func:`fxpar.compile` do by default).

The solver runs under a wall-clock limit (``time_limit``): ranks that each solved could stop
at different points and hold different plans, which the runner's plan-hash check then
refuses. With an initialized default process group of more than one rank (not the
single-process ``"fake"`` backend of planning tests), :func:`on_rank0`

1. runs ``prepare()`` on every rank (the work that needs no plan, e.g. the capture; an error
   there is held until the plan has been exchanged, so no rank is left in a collective);
2. runs ``solve(state)`` on rank 0 only and broadcasts its plan (``Plan.to_dict()``) and
   ``extra_of(result)`` (plain data), or its error;
3. runs ``rebuild(state, plan, extra)`` on every other rank (no solver);
4. exchanges every rank's outcome once more: every rank returns a result holding the same
   plan (the same ``Plan.hash``), or every rank raises. Rank 0's error is raised on every
   rank as the same :class:`~fxpar.FxparError` type with the same message (any other
   exception there: a :class:`PlanError` naming it); a rank that could not rebuild makes
   every rank raise a :class:`PlanError` naming that rank.

Without a process group, on one rank, on the fake backend, or with ``enabled=False`` it is
``solve(prepare())``: nothing changes.

Object collectives use the default group when its backend takes CPU tensors (gloo, or a
``cpu:gloo,cuda:nccl`` pair), else a gloo group made once (NCCL alone would need each rank's
CUDA device set, which a training script often does only after it compiles).

>>> from fxpar.plan_data import Plan
>>> p = Plan(kind="auto", mesh={}, nodes=(), edges=(), time=1.0, compute_fwd=0.0,
...          compute_bwd=0.0, comm=0.0, memory=0, budget=None, status="OPTIMAL")
>>> plan, graph = on_rank0(lambda graph: (p, graph), lambda graph, plan, extra: (plan, graph),
...                        plan_of=lambda r: r[0], prepare=lambda: "captured")  # no group: local
>>> plan is p, graph
(True, 'captured')
"""

from __future__ import annotations

import importlib
import pickle
from collections.abc import Callable
from typing import Any, TypeVar

from fxpar.errors import FxparError, PlanError
from fxpar.plan_data import Plan

__all__ = ["on_rank0", "shared_world", "graph_signature"]

T = TypeVar("T")

#: (default group, its gloo twin) for worlds whose default backend cannot carry CPU tensors
_GLOO: list = []


def shared_world() -> bool:
    """Whether planning is shared: an initialized default group of more than one rank whose
    ranks are processes (the ``"fake"`` backend stands one process for a whole world)."""
    import torch.distributed as dist

    return (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
            and str(dist.get_backend()) != "fake")


def _object_group():
    """The group object collectives go over (``None``: the default one)."""
    import torch.distributed as dist

    backend = str(dist.get_backend())
    if "gloo" in backend or backend in ("mpi", "ucc"):
        return None
    world = dist.group.WORLD
    if not _GLOO or _GLOO[0] is not world:   # collective: every rank gets here in step
        _GLOO[:] = [world, dist.new_group(backend="gloo")]
    return _GLOO[1]


def _error_payload(e: BaseException) -> tuple:
    """``e`` as plain data another rank can raise again (:func:`_raise_payload`)."""
    cls = type(e)
    if isinstance(e, FxparError):
        args, attrs = e.args, dict(vars(e))
        try:
            pickle.dumps((args, attrs))
        except Exception:  # an unpicklable attribute: the message is what must match
            args, attrs = (str(e),), {}
        return ("fxpar", cls.__module__, cls.__qualname__, args, attrs)
    return ("other", f"{cls.__module__}.{cls.__qualname__}", str(e))


def _rebuilt_error(payload: tuple) -> BaseException:
    if payload[0] == "fxpar":
        _, module, qualname, args, attrs = payload
        cls: Any = importlib.import_module(module)
        for part in qualname.split("."):
            cls = getattr(cls, part)
        # not cls(*args): a subclass's __init__ may take other arguments (PinError's pin)
        err = cls.__new__(cls, *args)
        BaseException.__init__(err, *args)
        err.__dict__.update(attrs)
    else:
        err = PlanError(f"planning failed on rank 0 with {payload[1]}: {payload[2]}")
    err.add_note("raised on rank 0, which plans for every rank (fxpar.plan broadcasts its "
                 "plan; broadcast=False plans on each rank alone)")
    return err


def graph_signature(gm) -> list[str]:
    """One line per node of a captured graph (name, op, inputs): what must be the same on
    every rank for rank 0's plan, which names nodes, to mean the same on all of them."""
    return [f"{n.name} {n.op} {n.target} {[a.name for a in n.all_input_nodes]}" for n in gm.graph.nodes]


def _first_difference(mine: list[str], theirs: list[str]) -> str:
    for a, b in zip(mine, theirs):
        if a != b:
            return f"this rank has `{a}` where rank 0 has `{b}`"
    return f"{len(mine)} nodes here, {len(theirs)} on rank 0"


def on_rank0(solve: Callable[[Any], T], rebuild: Callable[[Any, Plan, Any], T], *,
             plan_of: Callable[[T], Plan], extra_of: Callable[[T], Any] = lambda r: None,
             prepare: Callable[[], Any] = lambda: None, enabled: bool = True,
             signature: Callable[[Any], Any] | None = None) -> T:
    """``solve(prepare())`` on global rank 0, ``rebuild(prepare(), plan, extra)`` on the
    other ranks with rank 0's plan and ``extra_of`` of its result (module docstring).
    ``signature(state)``: what must agree across ranks (a graph's :func:`graph_signature`);
    a rank whose differs from rank 0's does not rebuild, and every rank raises."""
    if not enabled or not shared_world():
        return solve(prepare())
    import torch.distributed as dist

    group = _object_group()
    rank = dist.get_rank()
    state, mine = None, None
    try:
        state = prepare()
    except BaseException as e:
        mine = e
    if rank == 0:
        result = None
        if mine is None:
            try:
                result = solve(state)
                msg = ("plan", plan_of(result).to_dict(), extra_of(result),
                       signature(state) if signature else None)
            except BaseException as e:
                mine = e
        if mine is not None:
            msg = ("error", _error_payload(mine))
        box = [msg]
        dist.broadcast_object_list(box, src=0, group=group)
        if mine is not None:
            raise mine
    else:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=group)
        msg = box[0]
        if msg[0] == "error":  # everyone stops here, with rank 0's error
            raise _rebuilt_error(msg[1]) from mine
        if mine is None and signature is not None and signature(state) != msg[3]:
            from fxpar.errors import CaptureError

            mine = CaptureError(
                "the ranks captured different graphs (" + _first_difference(signature(state), msg[3])
                + "): the model's forward ran differently here. A common cause is Python's "
                "per-process string hashing (a model iterating a set of names); launch every "
                "rank with the same PYTHONHASHSEED, e.g. PYTHONHASHSEED=0 torchrun ...")
        if mine is None:
            try:
                result = rebuild(state, Plan.from_dict(msg[1]), msg[2])
            except BaseException as e:
                mine = e
    # rank 0 has a plan; every rank says whether it holds it too
    said = f"{type(mine).__name__}: {mine}" if mine is not None else None
    outcomes: list = [None] * dist.get_world_size()
    dist.all_gather_object(outcomes, said, group=group)
    bad = {r: s for r, s in enumerate(outcomes) if s is not None}
    if bad:
        raise PlanError("rank 0 planned, but ranks " + "; ".join(
            f"{r} could not build the program from its plan ({s})" for r, s in bad.items())) \
            from mine
    return result
