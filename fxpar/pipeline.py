"""The pass list and its runner (DESIGN §5).

A pass is ``name_pass(gm, ctx) -> PassResult`` in its own file under ``passes/``. The runner
applies a list in order and, after each pass: checks the return type, runs ``graph.lint()``,
recompiles, records the pass's wall time in ``ctx.timings``, and under ``FXPAR_DEBUG=1`` dumps
the graph before and after to ``$FXPAR_DEBUG_DIR`` (default ``./fxpar_debug``).

Two lists, because the first half is the same for every rank and the second is per rank:

>>> [p.__name__ for p in GLOBAL_PASSES]
['annotate_pass', 'insert_collectives_pass']
>>> [p.__name__ for p in RANK_PASSES]
['localize_pass', 'prefetch_pass', 'emit_pass']
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch.fx as fx

from fxpar.errors import FxparError

__all__ = ["PassContext", "PassResult", "run_passes", "GLOBAL_PASSES", "RANK_PASSES"]


@dataclass(frozen=True)
class PassResult:
    """What a pass returns: the (possibly same) graph module and whether it changed it."""

    graph_module: fx.GraphModule
    modified: bool


@dataclass
class PassContext:
    """What passes may read: the plan, its mesh, and for per-rank passes this rank's mesh
    coordinate. ``prefetch`` is the number of parameter gathers in flight ahead of their use
    (0 disables prefetch reordering); ``device`` the device the rank computes on."""

    plan: object  # fxpar.Plan
    mesh: object  # fxpar.Mesh
    coord: tuple[int, ...] | None = None
    prefetch: int = 1
    device: str = "cpu"
    timings: dict[str, float] = field(default_factory=dict)


def _dump(gm: fx.GraphModule, name: str, when: str) -> None:
    d = os.environ.get("FXPAR_DEBUG_DIR", "fxpar_debug")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, f"{name}.{when}.txt"), "w") as f:
        f.write(gm.print_readable(print_output=False))


def run_passes(gm: fx.GraphModule, ctx: PassContext,
               passes: Sequence[Callable[[fx.GraphModule, PassContext], PassResult]]) -> fx.GraphModule:
    """Apply ``passes`` in order (module docstring); returns the final graph module."""
    debug = os.environ.get("FXPAR_DEBUG") == "1"
    for i, p in enumerate(passes):
        tag = f"{i:02d}_{p.__name__}" + ("" if ctx.coord is None else f"_rank{'_'.join(map(str, ctx.coord))}")
        if debug:
            _dump(gm, tag, "before")
        t0 = time.perf_counter()
        res = p(gm, ctx)
        if not isinstance(res, PassResult):
            raise FxparError(f"pass {p.__name__} returned {type(res).__name__}, not a PassResult")
        gm = res.graph_module
        gm.graph.lint()
        gm.recompile()
        ctx.timings[p.__name__] = ctx.timings.get(p.__name__, 0.0) + time.perf_counter() - t0
        if debug:
            _dump(gm, tag, "after")
    return gm


# The lists (imports at the end: the passes import PassResult from here).
from fxpar.passes.annotate import annotate_pass  # noqa: E402
from fxpar.passes.emit import emit_pass  # noqa: E402
from fxpar.passes.insert_collectives import insert_collectives_pass  # noqa: E402
from fxpar.passes.localize import localize_pass  # noqa: E402
from fxpar.passes.prefetch import prefetch_pass  # noqa: E402

GLOBAL_PASSES = [
    annotate_pass,            # plan specs onto nodes: everything after reads node meta only
    insert_collectives_pass,  # on the global graph: edges are the same on every rank
]
RANK_PASSES = [
    localize_pass,   # local shapes, parameter shards, vocab-parallel/dropout rewrites
    prefetch_pass,   # after localize: moves only comm starts, shapes are final
    emit_pass,       # last: readable names/annotations, shape check on meta tensors
]
