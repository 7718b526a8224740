"""Pass infrastructure (DESIGN §5): :class:`PassResult`, :class:`PassContext`, contracts, runner.

A pass is ``name_pass(gm, ctx) -> PassResult`` in its own file under ``passes/``. It may declare
its contract with :func:`graph_pass`: ``requires`` checks run before it, ``ensures`` checks
after it (torch.fx's ``PassBase.requires``/``ensures``); a check is ``check(gm, ctx)`` returning
``None`` when it holds, else a message naming the node at fault. :func:`run_passes` applies a
list in order and, around each pass: runs its checks, checks the return type, runs
``graph.lint()``, recompiles, records the pass's wall time in ``ctx.timings``, and under
``FXPAR_DEBUG=1`` dumps the graph before and after to ``$FXPAR_DEBUG_DIR`` (default
``./fxpar_debug``). A failing check raises :class:`fxpar.PassError` naming the pass, the check
and the passes already run; any other error raised inside a pass gets the same names as an
exception note.

>>> import torch.fx as fx
>>> def no_relu(gm, ctx):
...     bad = [n.name for n in gm.graph.nodes if n.target is torch.relu]
...     return f"relu nodes {bad}" if bad else None
>>> @graph_pass(ensures=(no_relu,))
... def drop_relu_pass(gm, ctx):
...     for n in gm.graph.find_nodes(op="call_function", target=torch.relu):
...         n.replace_all_uses_with(n.args[0]); gm.graph.erase_node(n)
...     return PassResult(gm, True)
>>> import torch
>>> gm = fx.symbolic_trace(lambda x: torch.relu(x) + 1)
>>> print(run_passes(gm, PassContext(), [drop_relu_pass]).code.strip().splitlines()[-2].strip())
add = x + 1;  x = None
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch.fx as fx

from fxpar.errors import FxparError, PassError

if TYPE_CHECKING:  # for the types only: passes read node meta, not the planner
    from fxpar.mesh import Mesh
    from fxpar.plan_data import Plan

__all__ = ["PassContext", "PassResult", "Check", "graph_pass", "run_passes"]


@dataclass(frozen=True)
class PassResult:
    """What a pass returns: the (possibly same) graph module and whether it changed it."""

    graph_module: fx.GraphModule
    modified: bool


@dataclass
class PassContext:
    """What passes may read besides node meta.

    ``plan``: read by ``annotate`` only (it copies the plan onto node meta; every later pass
    reads meta). ``mesh``: the mesh the plan is on. ``coord``: this rank's mesh coordinate
    (per-rank passes; ``None`` for the global ones). ``prefetch``: parameter-gather units in
    flight ahead of their use (0 disables the reordering). ``device``: the device the rank
    computes on. ``timings``: seconds per pass name, filled by :func:`run_passes`.
    """

    plan: Plan | None = None
    mesh: Mesh | None = None
    coord: tuple[int, ...] | None = None
    prefetch: int = 1
    device: str = "cpu"
    timings: dict[str, float] = field(default_factory=dict)


#: ``check(gm, ctx) -> None`` when the property holds, else a message naming what is at fault.
Check = Callable[[fx.GraphModule, PassContext], "str | None"]


def graph_pass(*, requires: Sequence[Check] = (), ensures: Sequence[Check] = ()):
    """Decorator: attach a pass's contract (checked by :func:`run_passes`)."""

    def deco(fn):
        fn.requires, fn.ensures = tuple(requires), tuple(ensures)
        return fn

    return deco


def _dump(gm: fx.GraphModule, name: str, when: str) -> None:
    d = os.environ.get("FXPAR_DEBUG_DIR", "fxpar_debug")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, f"{name}.{when}.txt"), "w") as f:
        f.write(gm.print_readable(print_output=False))


def _check(p, which: str, gm: fx.GraphModule, ctx: PassContext, done: list[str]) -> None:
    for check in getattr(p, which, ()):
        msg = check(gm, ctx)
        if msg:
            raise PassError(f"pass {p.__name__}: {which} check {check.__name__} failed: {msg} "
                            f"(passes already run: {done or 'none'})")


def run_passes(gm: fx.GraphModule, ctx: PassContext,
               passes: Sequence[Callable[[fx.GraphModule, PassContext], PassResult]],
               *, already_run: Sequence[str] = ()) -> fx.GraphModule:
    """Apply ``passes`` in order (module docstring); returns the final graph module.
    ``already_run`` names the passes applied to ``gm`` before (for error messages)."""
    debug = os.environ.get("FXPAR_DEBUG") == "1"
    done = list(already_run)
    for i, p in enumerate(passes):
        tag = f"{i:02d}_{p.__name__}" + ("" if ctx.coord is None else f"_rank{'_'.join(map(str, ctx.coord))}")
        if debug:
            _dump(gm, tag, "before")
        t0 = time.perf_counter()
        _check(p, "requires", gm, ctx, done)
        try:
            res = p(gm, ctx)
        except FxparError as e:
            e.add_note(f"in pass {p.__name__} (passes already run: {done or 'none'})")
            raise
        if not isinstance(res, PassResult):
            raise FxparError(f"pass {p.__name__} returned {type(res).__name__}, not a PassResult")
        gm = res.graph_module
        gm.graph.lint()
        gm.recompile()
        done.append(p.__name__)
        _check(p, "ensures", gm, ctx, done[:-1])
        ctx.timings[p.__name__] = ctx.timings.get(p.__name__, 0.0) + time.perf_counter() - t0
        if debug:
            _dump(gm, tag, "after")
    return gm
