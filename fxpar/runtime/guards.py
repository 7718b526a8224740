"""``torch.ops.fxpar.guard_value``: the run-time check of a value capture specialized.

A Python value read from tensor data (``n = t.item()``, ``sizes = t.tolist()``) that sets a
size or a branch cannot stay symbolic in a static-shape plan: capture
(:mod:`fxpar.capture.specialize`) replaces it by the value the example inputs gave and puts
``guard_value(t, expected, where)`` in the graph where the read was. At run time the op reads
``t`` (every element, row-major) and raises :class:`~fxpar.errors.GuardError` when it differs
from ``expected``: the message is ``where`` (the guard node's name and the read's source line,
filled in by capture) with both values. Integers and booleans must be equal; floating-point
values equal within ``64 * eps`` of their dtype (relative, and absolute near 0), since a
distributed program sums partial results in another order than one process. The op returns
nothing (it is kept by dead-code elimination: ``torch.fx.node.has_side_effect``) and has no
gradient. Its sharding record (:mod:`fxpar.strategies.guards`) requires ``t`` replicated, so
every rank of an SPMD program reads the same value and raises at the same node. In a pipeline
the guard runs on one stage only: its ranks append the error to the bindings'
``guard_failures`` and go on (every shape is static, so the step runs through), and the
pipeline runner raises it on every rank at the end of the step, before the optimizer steps
(:mod:`fxpar.runtime.interpreter`): raising at once would leave the other stages waiting.

>>> import torch
>>> GUARD_VALUE(torch.tensor([2, 3]), [2, 3], "node guard_value: `t.tolist()` at m.py:7")
>>> GUARD_VALUE(torch.tensor(5), [4], "node guard_value: `t.item()` at m.py:7")
Traceback (most recent call last):
...
fxpar.errors.GuardError: node guard_value: `t.item()` at m.py:7 read 4 when the model was captured and reads 5 in this step; ...
"""

from __future__ import annotations

import math

import torch

from fxpar.errors import FxparError, GuardError
from fxpar.runtime.library import define

__all__ = ["GUARD_VALUE", "same_values"]

#: elements listed in full in an error; longer reads show the positions that differ
_SHOWN = 16


def same_values(got: list, expected: list, dtype: torch.dtype) -> bool:
    """Whether a read ``got`` equals the specialized ``expected`` (floats within ``64 * eps``).

    >>> same_values([1.0, 2.0], [1.0, 2.0000001], torch.float32), same_values([1], [2], torch.int64)
    (True, False)
    """
    if len(got) != len(expected):
        return False
    if not dtype.is_floating_point:
        return all(g == e for g, e in zip(got, expected))
    tol = 64 * torch.finfo(dtype).eps
    return all(g == e or math.isclose(g, e, rel_tol=tol, abs_tol=tol)
               for g, e in zip(got, expected))


def _show(values: list, other: list) -> str:
    if len(values) == 1:
        return repr(values[0])
    if len(values) <= _SHOWN:
        return repr(values)
    diff = [i for i, (a, b) in enumerate(zip(values, other)) if a != b][:_SHOWN]
    return f"{len(values)} values, at positions {diff}: {[values[i] for i in diff]}"


def _guard_value(x: torch.Tensor, expected: list, where: str) -> None:
    got = x.detach().reshape(-1).tolist()
    expected = list(expected)
    if same_values(got, expected, x.dtype):
        return
    err = GuardError(
        f"{where} read {_show(expected, got)} when the model was captured and reads "
        f"{_show(got, expected)} in this step; fxpar specialized the graph to the captured "
        "value (it sets a size or a branch), so this step cannot run: capture with inputs "
        "that give this value, or keep it a tensor (no .item()/.tolist())")
    sink = _failures()
    if sink is None:
        raise err
    sink.append(err)


def _failures() -> list | None:
    """The active bindings' ``guard_failures`` (a pipeline step), or ``None``."""
    from fxpar.runtime.bindings import current

    try:
        return current().guard_failures
    except FxparError:  # no bindings: a single-process run (run_captured)
        return None


GUARD_VALUE = define("fxpar::guard_value(Tensor x, Scalar[] expected, str where) -> ()",
                     _guard_value, fake=lambda x, expected, where: None)
torch.fx.node.has_side_effect(GUARD_VALUE)  # no outputs: dead-code elimination must keep it
