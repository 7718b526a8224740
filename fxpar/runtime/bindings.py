"""Run-time bindings of an emitted rank graph: what the graph names, supplied at call time.

An emitted graph holds only op nodes. Its communication and random ops
(``torch.ops.fxpar.*``, :mod:`fxpar.runtime.comm`, :mod:`fxpar.runtime.ops`) name an *edge* by
string and carry static arguments (local shapes, sites, shard keys); everything stateful is
looked up in the :class:`Bindings` active while the graph (and its backward) runs:

* ``edges``: ``{name: Edge}`` (the graph's ``gm.meta[EDGES]``: frozen plan data);
* ``mesh``/``coord``: the mesh and this rank's coordinate, and the ``DeviceMesh`` (process
  groups, made once per Bindings on first use: making it is collective);
* ``sink(edge, grad)``: where parameter gradients go (the runner's model-state manager);
* ``tracker``: the RNG tracker of random ops (:class:`fxpar.runtime.rng.RNGTracker`);
* ``regather``: the active :class:`fxpar.runtime.comm.Regather` (or ``None``);
* ``pending``: collectives started and not yet waited on, by edge name;
* ``given``: edges out of a batch input whose destination this rank already has, sliced
  from the global batch the runner was handed (the collective is skipped; same values);
* ``deferred``: a list while a training step runs (``None`` otherwise): the all-reduces of
  graph outputs (the loss) whose wait the runner moved after backward, which needs nothing
  of their values (DDP never reduces the loss at all; fxpar reduces it off the critical path);
* ``guard_failures``: a list where a pipeline runner collects the errors of failing
  ``fxpar.guard_value`` checks, to raise them on every rank at the end of the step
  (``None``: a failing guard raises at once, :mod:`fxpar.runtime.guards`).

So one graph serves any number of runners (each with its own Bindings), prints, pickles and
goes through ``torch.compile``. The active Bindings is process-global (not thread-local):
autograd may run backward on another thread.

>>> from fxpar.errors import FxparError
>>> try:
...     current()
... except FxparError as e:
...     print(str(e)[:60])
no fxpar Bindings active: run a rank graph through its Runne
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from fxpar.errors import FxparError

__all__ = ["Bindings", "active", "bind", "current"]


@dataclass(eq=False)
class Bindings:
    """What one rank's graph needs at call time (module docstring)."""

    edges: Mapping[str, Any]
    mesh: Any
    coord: tuple[int, ...]
    sink: Callable | None = None
    tracker: Any = None
    regather: Any = None
    pending: dict[str, tuple[Any, int]] = field(default_factory=dict)
    given: dict[str, Any] = field(default_factory=dict)
    deferred: list | None = None
    guard_failures: list | None = None
    #: hand the sink a copy of each gradient: a compiled backward (inductor) reuses a
    #: buffer's memory once its graph is done with it, while the sink may hold the gradient
    #: until its bucket launches; eager autograd never writes a gradient it has handed over
    fresh_grads: bool = False
    #: a selective recomputation is running (:mod:`fxpar.runtime.recompute`): a wait for a
    #: gathered parameter, whose start it does not run again, gathers the parameter at once
    regathering: bool = False
    _device_mesh: Any = field(default=None, repr=False)

    @property
    def device_mesh(self):
        if self._device_mesh is None:
            from fxpar.runtime.redistribute import as_device_mesh

            self._device_mesh = as_device_mesh(self.mesh)
        return self._device_mesh

    def edge(self, name: str):
        try:
            return self.edges[name]
        except KeyError:
            raise FxparError(f"edge {name!r} is not in the bound program (its edges: "
                             f"{sorted(self.edges)[:5]}...): a graph run with another "
                             "program's bindings?") from None


_STACK: list[Bindings] = []


def current() -> Bindings:
    """The active :class:`Bindings`; an :class:`FxparError` if none."""
    if not _STACK:
        raise FxparError("no fxpar Bindings active: run a rank graph through its Runner, or "
                         "inside `with fxpar.runtime.bindings.bind(Bindings(...))`")
    return _STACK[-1]


def active() -> Bindings | None:
    """The active :class:`Bindings`, or ``None`` (a graph without communication runs bare)."""
    return _STACK[-1] if _STACK else None


@contextlib.contextmanager
def bind(b: Bindings):
    """Make ``b`` the active bindings for the block (nests; restores the previous one)."""
    _STACK.append(b)
    try:
        yield b
    finally:
        _STACK.pop()
