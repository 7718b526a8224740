"""Which frontend captures a model: :func:`capture` tries them in order and reports each failure.

Contract of :func:`capture`: the example inputs are prepared once (a meta-device model gets its
tensor inputs moved to ``meta``; a tensor passed twice is cloned), then each frontend of
``FRONTENDS`` is tried in order (``frontend="auto"``) or one alone: ``export``
(:func:`fxpar.capture.export.export_graph`, non-strict), ``export_strict`` (the same through
TorchDynamo), ``symbolic_trace`` (:func:`fxpar.capture.symbolic.symbolic_trace_graph`; not
with ``decompose=True``). When non-strict export leaves a value read with
``.item()``/``.tolist()`` that sets a size or a branch
(:func:`~fxpar.capture.specialize.reads_to_specialize`), or fails on a data-dependent guard,
it is run again with the reads specialized to an eager run's values and guarded
(:mod:`fxpar.capture.specialize`; when that run read nothing, as before). The first graph made
is checked for data-dependent shapes (:func:`fxpar.capture.diagnose.refuse_data_dependent`,
final: no other frontend can do better) and returned; when none succeeds, a :class:`~fxpar.errors.CaptureError` names every
frontend tried and why it failed (:mod:`fxpar.capture.diagnose`). torch's own logs of a
failing frontend are held back unless ``FXPAR_DEBUG=1``.

Example (the same module through the torch-level frontend, and on the meta device)::

    >>> import torch
    >>> from fxpar import ir
    >>> FRONTENDS
    ('export', 'export_strict', 'symbolic_trace')
    >>> mlp = torch.nn.Sequential(torch.nn.Linear(4, 2), torch.nn.ReLU())
    >>> gm = capture(mlp, (torch.randn(3, 4),), frontend="symbolic_trace")
    >>> gm.meta[ir.FRONTEND], [n.op for n in gm.graph.nodes]
    ('symbolic_trace', ['placeholder', 'call_module', 'call_module', 'output'])
    >>> with torch.device("meta"):
    ...     big = torch.nn.Linear(4096, 4096)  # no weights allocated, nor by the capture
    >>> capture(big, (torch.randn(8, 4096),)).meta[ir.PARAMS]["weight"].shape
    (4096, 4096)
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from fxpar import ir
from fxpar.capture.diagnose import (DATA_DEPENDENT_ERRORS, capture_error, failure_reason,
                                    quiet_torch_logs, refuse_data_dependent)
from fxpar.capture.export import export_graph
from fxpar.capture.model import on_meta, unalias_inputs
from fxpar.capture.specialize import reads_to_specialize, record_reads
from fxpar.errors import CaptureError
from fxpar.capture.symbolic import symbolic_trace_graph

__all__ = ["capture", "Frontend", "FRONTENDS"]

Frontend = Literal["auto", "export", "export_strict", "symbolic_trace"]
#: What ``frontend="auto"`` tries, in order: the ATen-level routes first, torch-level last.
FRONTENDS: tuple[str, ...] = ("export", "export_strict", "symbolic_trace")
_LABEL = {
    "export": "export(non-strict)",
    "export_strict": "export(strict)",
    "symbolic_trace": "symbolic_trace",
}


def capture(
    model: torch.nn.Module,
    example_inputs: Sequence[Any] | torch.Tensor = (),
    example_kwargs: Mapping[str, Any] | None = None,
    *,
    frontend: Frontend = "auto",
    decompose: bool = False,
    stack_traces: bool = True,
    reads: dict | None = None,
) -> fx.GraphModule:
    """Capture ``model(*example_inputs, **example_kwargs)`` as a graph with fake-tensor meta.

    See the module docstring for the graph form of each frontend. ``frontend`` is ``"auto"``
    (export, then strict export, then symbolic_trace), or one of them alone. ``decompose=True``
    lowers to core ATen (export frontends only). ``stack_traces=False``: no node carries
    ``meta["stack_trace"]`` (:data:`fxpar.ir.STACK_TRACE`), everything else is the same;
    export then skips symbolizing every node's Python stack, ~20% of a capture (for a graph
    that is only planned on, e.g. the joint search's probe). ``reads``: the values to
    specialize ``.item()``/``.tolist()`` reads to (a saved graph's ``gm.meta[ir.READS]``)
    instead of an eager run's. Raises :class:`CaptureError` when no frontend
    succeeds; its message names every frontend tried and the first line of its error, and
    ``err.failures`` maps each frontend's label to its exception. Falling back to
    ``symbolic_trace`` warns, naming why each ATen-level frontend failed.
    """
    args, kwargs = _prepared_inputs(model, example_inputs, example_kwargs, frontend, decompose)
    order = FRONTENDS if frontend == "auto" else (frontend,)
    failures: dict[str, BaseException] = {}
    reasons: list[str] = []
    debug = os.environ.get("FXPAR_DEBUG") == "1"
    for fe in order:
        label = _LABEL[fe]
        if fe == "symbolic_trace" and decompose:
            reasons.append(f"{label}: skipped (decompose=True needs an ATen-level graph)")
            continue
        try:
            with quiet_torch_logs(debug):
                gm = _run_frontend(fe, model, args, kwargs, decompose, stack_traces)
        except Exception as e:  # noqa: BLE001 - every frontend failure is reported, none hidden
            failures[label] = e
            reasons.append(failure_reason(label, e, debug=debug))
            if fe == "export" and _data_dependent(e):
                # a guard on a value read with .item()/.tolist() (a branch): specialize the reads
                try:
                    gm = _specialized(model, args, kwargs, decompose, stack_traces, debug, reads)
                except CaptureError as e2:
                    failures[f"{label}, specialized"] = e2
                    reasons.append(f"{label}, values read from tensor data specialized: {e2}")
                    continue
                if gm is not None:
                    refuse_data_dependent(gm, type(model).__name__)
                    return gm
            continue
        if fe == "export" and (wanted := reads_to_specialize(gm)):
            # a value read with .item()/.tolist() sets a size or a branch: specialize the reads
            try:
                gm = _specialized(model, args, kwargs, decompose, stack_traces, debug, reads) or gm
            except CaptureError as e:
                r = wanted[0]
                raise CaptureError(
                    f"could not capture {type(model).__name__}: node {r.name} ({r.target}"
                    f"{ir.source_of(r)}) reads a value from tensor data that sets a size or a branch: "
                    f"{e}") from e
        refuse_data_dependent(gm, type(model).__name__)  # final: no other frontend can do better
        if fe == "symbolic_trace" and failures:
            # said, not hidden: a torch-level graph (call_module nodes, parameters read by
            # their modules) plans differently, and a failed export is often the user's to fix
            warnings.warn(f"fxpar.capture: {type(model).__name__} captured at torch level by "
                          f"symbolic_trace, the ATen-level frontends failed: {'; '.join(reasons)}",
                          stacklevel=2)
        return gm
    raise capture_error(type(model).__name__, reasons, failures) from next(
        iter(failures.values()), None)


def _prepared_inputs(model: torch.nn.Module, example_inputs: Sequence[Any] | torch.Tensor,
                     example_kwargs: Mapping[str, Any] | None, frontend: str,
                     decompose: bool) -> tuple[tuple, dict]:
    """The arguments checked, and the example inputs as every frontend gets them: a tuple and a
    dict, on ``meta`` for a meta-device model, a tensor passed twice cloned."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"capture expects an nn.Module, got {type(model).__name__}")
    if frontend != "auto" and frontend not in FRONTENDS:
        raise ValueError(f"unknown frontend {frontend!r}; expected 'auto' or one of {FRONTENDS}")
    if decompose and frontend == "symbolic_trace":
        raise ValueError("decompose=True needs an ATen-level (export) frontend, not symbolic_trace")
    args = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else tuple(example_inputs)
    kwargs = dict(example_kwargs or {})
    if on_meta(model):
        # Fake propagation refuses to mix devices: meta weights need meta inputs.
        args, kwargs = pytree.tree_map_only(torch.Tensor, lambda t: t.to("meta"), (args, kwargs))
    return unalias_inputs(args, kwargs)


def _data_dependent(e: BaseException) -> bool:
    return type(e).__name__ in DATA_DEPENDENT_ERRORS


def _specialized(model: torch.nn.Module, args: tuple, kwargs: dict, decompose: bool,
                 stack_traces: bool, debug: bool, reads: dict | None) -> fx.GraphModule | None:
    """``model`` exported (non-strict) with each ``.item()``/``.tolist()`` specialized to its
    value in an eager run on the example inputs (or in ``reads``) and guarded
    (:mod:`fxpar.capture.specialize`); ``None`` when that run read no value. Failures are
    :class:`CaptureError`."""
    reads = record_reads(model, args, kwargs) if reads is None else reads
    if not reads:
        return None

    def export(reads):
        with quiet_torch_logs(debug):
            return export_graph(model, args, kwargs, strict=False, decompose=decompose,
                                stack_traces=stack_traces, reads=reads)

    try:
        gm = export(reads)
    except CaptureError:
        raise
    except Exception as e:  # noqa: BLE001 - reported as this route's reason
        raise CaptureError(failure_reason("export(non-strict)", e, debug=debug)) from e
    _densify_grouped(gm, reads, export)
    return gm


def _densify_grouped(gm: fx.GraphModule, reads: dict, export) -> None:
    """Grouped GEMMs whose sizes are guarded reads, made static (:mod:`fxpar.capture.grouped`)
    when two more exports, with other sizes of the same sum, differ only in those splits and
    the guards (the reads reach nothing else); otherwise the guards stay."""
    from fxpar.capture.grouped import altered_reads, densify, graph_key, grouped_linears
    from fxpar.capture.specialize import guards

    groups = grouped_linears(gm)
    if not groups:
        return
    lists = {tuple(m.guard.args[1]) for m in groups}
    names = {m.split.name for m in groups} | {g.name for g in guards(gm)}
    key = graph_key(gm, lambda n: n.name in names)

    def same_graph(shift: int) -> bool:
        alt = altered_reads(reads, lists, shift)
        try:
            other = export(alt) if alt is not None else None
        except Exception:  # noqa: BLE001 - the other sizes take another path: keep the guards
            return False
        return other is not None and graph_key(other, lambda n: n.name in names) == key

    if same_graph(0) and same_graph(1):
        densify(gm, groups)


def _run_frontend(fe: str, model: torch.nn.Module, args: tuple, kwargs: dict, decompose: bool,
                  stack_traces: bool) -> fx.GraphModule:
    if fe == "symbolic_trace":
        return symbolic_trace_graph(model, args, kwargs)
    return export_graph(model, args, kwargs, strict=fe == "export_strict", decompose=decompose,
                        stack_traces=stack_traces)
