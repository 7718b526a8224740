"""Capture: ``nn.Module`` + example inputs → a ``torch.fx.GraphModule`` with fake-tensor meta.

Contract of :func:`capture`

* The result is a ``GraphModule`` whose every node carries ``node.meta["val"]`` (:data:`fxpar.ir.VAL`):
  fake tensors (tuple/list of them for multi-output nodes), the Python value for nodes producing
  ``None``/ints, and on the ``output`` node the structure of the output values. Shapes are static,
  fixed by the example inputs.
* No real weights are allocated and no real compute runs: export traces with fake tensors, so a
  model built under ``with torch.device("meta")`` is captured as cheaply as a real one (meta
  models get their tensor inputs moved to ``meta``; real models keep their own tensors untouched).
* Python control flow is resolved by the example inputs (``if targets is None``, ``if n > 2``);
  data-dependent control flow (``if x.sum() > 0``) cannot be captured and raises
  :class:`~fxpar.errors.CaptureError` naming each frontend tried and why it failed. A
  data-dependent output SHAPE (``nonzero``, ``unique``...) raises :class:`CaptureError` naming
  the node and op (no fallback to another frontend: static shapes are fxpar's premise).
* Parameters and buffers are identified by fully qualified name: ``gm.meta[PARAMS]`` is an
  ordered ``{fqn: ParamInfo}`` and the node holding each carries ``node.meta[PARAM]``; user inputs
  carry ``node.meta[INPUT]`` (keys and helpers in :mod:`fxpar.ir`). Tied weights (GPT-2's
  ``lm_head.weight`` is ``transformer.wte.weight``) are ONE placeholder named as
  ``named_parameters()`` names it, with the other names in ``ParamInfo.aliases``.
* The model's mode is respected: capture a training graph from a model in ``train()`` mode
  (dropout appears as ``aten.dropout``), an inference graph from ``eval()``.
* :func:`run_captured` runs a capture on real tensors with a model's parameters and buffers bound
  by FQN and returns the model's own output structure: the single-device reference.
* A tensor passed twice (``labels=input_ids``) is cloned first, so the two placeholders stay
  distinct; the model is never modified (apart from a temporary wrapper, see below).

Frontends

``export`` (the default, via ``frontend="auto"``): ``torch.export.export(strict=False)``, the
training IR. The graph is ATen-level and keeps the composite training ops (``aten.linear``,
``aten.scaled_dot_product_attention``, ``aten.layer_norm``, ``aten.cross_entropy_loss``...). It
is non-functional: in-place buffer updates (BatchNorm running stats) stay in place. Placeholders
are, in order, parameters ``p_*``, buffers ``b_*``, then the flat user inputs; the graph returns
the flat user outputs as a tuple (``OUTPUT_TREE`` rebuilds e.g. a transformers ``ModelOutput``).
fxpar normalizes what export leaves behind: tied-weight placeholders are merged, lifted tensor
constants become ``get_attr`` buffers of the graph module (``meta[CONSTANT]``),
``wrap_with_set_grad_enabled`` regions (e.g. Llama's ``@torch.no_grad`` rotary embedding) are
inlined (outputs that could carry a gradient get an ``aten.detach`` so autograd is unchanged),
and ``aten._assert_tensor_metadata`` checks are dropped. Output leaves no frontend can hold
(transformers' ``DynamicCache`` from ``use_cache=True``) are replaced by ``None`` with a warning.

``decompose=True`` additionally runs ``ep.run_decompositions()``: core ATen (``aten.linear``
becomes ``aten.permute`` + ``aten.addmm``, ``aten.layer_norm`` its native form), functionalized,
so in-place buffer/input updates become extra leading outputs (``OutputInfo.kind`` is
``"buffer_mutation"``/``"input_mutation"``). ``aten.detach`` is kept (core ATen would lower it
to ``aten.alias`` and lose the stop-gradient). Decomposing a Llama-7B-shaped model takes about
3-4x as long as capturing it (benchmarks/capture.py).

``export_strict``: ``torch.export.export(strict=True)`` (TorchDynamo); same graph form, slower,
tried by ``auto`` when non-strict tracing fails.

``symbolic_trace``: ``torch.fx.symbolic_trace`` for plain modules, then fake-tensor propagation
fills ``meta["val"]``. This graph is TORCH-level: ``call_module`` nodes for leaf modules
(``nn.Linear``), ``call_function`` on ``torch``/``operator`` functions, parameters used directly as
``get_attr`` (``meta[PARAM]``) or inside a ``call_module`` (``meta[MODULE_PARAMS]``). Its forward
mirrors the module's signature (non-tensor arguments are specialized and asserted) and returns
the module's own output structure. ``auto`` uses it last.

Example (a 2-layer MLP, default frontend)::

    >>> import torch
    >>> from examples.models import MLP
    >>> gm = capture(MLP(8, 16, 4), (torch.randn(2, 8),))
    >>> print(gm.graph)  # doctest: +NORMALIZE_WHITESPACE
    graph():
        %p_fc1_weight : [num_users=1] = placeholder[target=p_fc1_weight]
        %p_fc1_bias : [num_users=1] = placeholder[target=p_fc1_bias]
        %p_fc2_weight : [num_users=1] = placeholder[target=p_fc2_weight]
        %p_fc2_bias : [num_users=1] = placeholder[target=p_fc2_bias]
        %x : [num_users=1] = placeholder[target=x]
        %linear : [num_users=1] = call_function[target=torch.ops.aten.linear.default](args = (%x, %p_fc1_weight, %p_fc1_bias), kwargs = {})
        %gelu : [num_users=1] = call_function[target=torch.ops.aten.gelu.default](args = (%linear,), kwargs = {})
        %linear_1 : [num_users=1] = call_function[target=torch.ops.aten.linear.default](args = (%gelu, %p_fc2_weight, %p_fc2_bias), kwargs = {})
        return (linear_1,)
    >>> gm.graph.find_nodes(op="output")[0].meta["val"]
    (FakeTensor(..., size=(2, 4)),)
    >>> run_captured(gm, MLP(8, 16, 4), torch.randn(2, 8)).shape
    torch.Size([2, 4])
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import io
import itertools
import logging
import operator
import os
import traceback
import warnings
from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Literal

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.export.graph_signature import InputKind, OutputKind
from torch.fx.node import map_arg

from fxpar import ir
from fxpar.errors import CaptureError
from fxpar.ir import InputInfo, OutputInfo, ParamInfo

__all__ = ["capture", "run_captured", "flatten_inputs", "WithLoss", "frozen_params", "Frontend",
           "FRONTENDS"]

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
) -> fx.GraphModule:
    """Capture ``model(*example_inputs, **example_kwargs)`` as a graph with fake-tensor meta.

    See the module docstring for the graph form of each frontend. ``frontend`` is ``"auto"``
    (export, then strict export, then symbolic_trace), or one of them alone. ``decompose=True``
    lowers to core ATen (export frontends only). ``stack_traces=False``: no node carries
    ``meta["stack_trace"]`` (:data:`fxpar.ir.STACK_TRACE`), everything else is the same;
    export then skips symbolizing every node's Python stack, ~20% of a capture (for a graph
    that is only planned on, e.g. the joint search's probe). Raises :class:`CaptureError` when no frontend
    succeeds; its message names every frontend tried and the first line of its error, and
    ``err.failures`` maps each frontend's label to its exception.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"capture expects an nn.Module, got {type(model).__name__}")
    if frontend != "auto" and frontend not in FRONTENDS:
        raise ValueError(f"unknown frontend {frontend!r}; expected 'auto' or one of {FRONTENDS}")
    if decompose and frontend == "symbolic_trace":
        raise ValueError("decompose=True needs an ATen-level (export) frontend, not symbolic_trace")
    args = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else tuple(example_inputs)
    kwargs = dict(example_kwargs or {})
    if _on_meta(model):
        # Fake propagation refuses to mix devices: meta weights need meta inputs.
        args, kwargs = pytree.tree_map_only(torch.Tensor, lambda t: t.to("meta"), (args, kwargs))
    args, kwargs = _unalias_inputs(args, kwargs)

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
            with _quiet_torch_logs(debug):
                if fe == "symbolic_trace":
                    gm = _symbolic_trace(model, args, kwargs)
                else:
                    with _stack_traces(stack_traces):
                        gm = _export(model, args, kwargs, strict=fe == "export_strict",
                                     decompose=decompose)
        except Exception as e:  # noqa: BLE001 - every frontend failure is reported, none hidden
            failures[label] = e
            name = type(e).__name__
            dd = ("data-dependent value" if name == "GuardOnDataDependentSymNode"  # a branch
                  # an op returning a Python value read from tensor data (torch.equal)
                  else "data-dependent output value" if name == "DataDependentOutputException"
                  else "data-dependent output shape" if name in _DATA_DEPENDENT_ERRORS else "")
            if dd:  # name the op and the line that made it (not just the model's class)
                dd = f"{dd}{_failure_site(e)}: "
            reasons.append(f"{label}: {dd}{_sorted_symbol_sets(_first_line(e))}" +
                           ("\n" + "".join(traceback.format_exception(e)) if debug else ""))
            continue
        _refuse_data_dependent(gm, type(model).__name__)  # final: no other frontend can do better
        return gm
    why = ""
    if any(type(f).__name__ in _DATA_DEPENDENT_ERRORS for f in failures.values()):
        why = (" (fxpar plans static shapes and static control flow: an op whose output shape "
               "depends on tensor values, a Python value read from a tensor (torch.equal, "
               ".item()), or a branch or size taken from one, cannot be captured)")
    err = CaptureError(f"could not capture {type(model).__name__}: " + "; ".join(reasons) + why)
    err.failures = failures  # type: ignore[attr-defined]
    raise err from next(iter(failures.values()), None)


@contextlib.contextmanager
def _quiet_torch_logs(debug: bool):
    """Hold back torch's own log output while a frontend is tried: export logs ERROR-level
    tracebacks and graph dumps for a model it then fails on, and fxpar's :class:`CaptureError`
    already names each frontend's reason (``FXPAR_DEBUG=1``: logs shown, full tracebacks in
    the error)."""
    if debug:
        yield
        return
    prev = logging.root.manager.disable
    logging.disable(logging.CRITICAL)
    try:
        with contextlib.redirect_stderr(io.StringIO()):  # graph dumps written to stderr
            yield
    finally:
        logging.disable(prev)


#: export's errors for a size known only at run time (an op such as ``combinations`` whose fake
#: kernel leaves an unbacked size export cannot bind): reported as a data-dependent shape.
_DATA_DEPENDENT_ERRORS = frozenset({"GuardOnDataDependentSymNode", "PendingUnbackedSymbolNotFound",
                                    "DataDependentOutputException", "DynamicOutputShapeException"})


def _sorted_symbol_sets(msg: str) -> str:
    """torch prints sets of unbacked symbols (``{u2, u1, u3}``) in hash order, which differs
    between processes: sorted, every rank raises the same message.

    >>> _sorted_symbol_sets("Pending unbacked symbols {u10, u2, u1} not in returned outputs")
    'Pending unbacked symbols {u1, u2, u10} not in returned outputs'
    """
    import re

    def sort(m: re.Match) -> str:
        syms = sorted(m.group(1).split(", "), key=lambda t: (t[0], int(t[1:])))
        return "{" + ", ".join(syms) + "}"

    return re.sub(r"\{([a-z]\d+(?:, [a-z]\d+)*)\}", sort, msg)


def _failure_site(e: BaseException) -> str:
    """Where a tracing error happened, as `` at OP in API, called from USER (FILE:LINE: `SRC`)``:
    the ATen op being traced (the innermost frame of torch's dispatch that holds it), the public
    torch function it happened in (``torch.nn.functional.gaussian_nll_loss``: a check on a
    tensor value in Python), and the innermost frame of the caller's own code (outside torch
    and ``fxpar.capture``). Parts that cannot be found are left out; ``""`` when none is."""
    import linecache
    import sysconfig

    frames = []
    seen: set[int] = set()
    while e is not None and id(e) not in seen and len(seen) < 8:
        seen.add(id(e))
        tb = e.__traceback__
        while tb is not None:
            frames.append((tb.tb_frame, tb.tb_lineno))
            tb = tb.tb_next
        e = e.__cause__ or e.__context__
    stdlib = sysconfig.get_paths().get("stdlib") or "\0"
    op = user = api = None
    for i, (fr, line) in enumerate(frames):
        fn = fr.f_locals.get("func")
        if isinstance(fn, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
            op = fn
        mod = str(fr.f_globals.get("__name__") or "")
        path = fr.f_code.co_filename
        if (mod and mod.split(".")[0] != "torch" and mod != __name__
                and not path.startswith(stdlib) and not path.startswith("<")):
            user, api = (fr, line), None
        elif user is not None and mod.startswith("torch.") and not any(
                part.startswith("_") for part in mod.split(".")) and not mod.startswith(
                ("torch.fx", "torch.export", "torch.utils", "torch.overrides",
                 "torch.nn.modules.module")):
            api = (fr, line)
    parts = []
    if op is not None:
        parts.append(f"at {op}")
    if api is not None:
        fr, line = api
        parts.append(f"in {fr.f_globals['__name__']}.{fr.f_code.co_qualname} "
                     f"({os.path.basename(fr.f_code.co_filename)}:{line})")
    if user is not None:
        fr, line = user
        path = fr.f_code.co_filename
        rel = os.path.relpath(path) if not os.path.relpath(path).startswith("..") else path
        src = linecache.getline(path, line).strip()
        src = f": `{src[:80]}`" if src else ""
        parts.append(f"called from {fr.f_code.co_qualname} ({rel}:{line}{src})")
    return (" " + ", ".join(parts)) if parts else ""


def _refuse_data_dependent(gm: fx.GraphModule, owner: str) -> None:
    """Raise :class:`CaptureError` naming the first node whose output shape depends on the
    data (``nonzero``, ``argwhere``, ``unique``, ``masked_select``...: export gives it an
    unbacked size ``u0``). fxpar plans static shapes (every spec's local shape is computed up
    front), so such a graph cannot be planned; without this check the planner would fail on
    ``int(u0)`` with a raw ``GuardOnDataDependentSymNode``. Deterministic, so every rank raises
    the same error."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    for n in gm.graph.nodes:
        if n.op == "output":
            continue
        v = n.meta.get(ir.VAL)
        if v is None:
            continue
        try:
            syms = free_unbacked_symbols(v)
        except Exception:  # noqa: BLE001 - a value free_unbacked_symbols cannot walk has none
            syms = set()
        if syms:
            what = ("output shape (sizes" if isinstance(v, (torch.Tensor, tuple, list))
                    else "output value (a Python number read from a tensor, as .item() does:")
            raise CaptureError(
                f"could not capture {owner}: node {n.name} ({n.target}) has a data-dependent "
                f"{what} {sorted(map(str, syms))} known only at run time); fxpar plans static "
                "shapes, so ops such as nonzero, argwhere, unique, masked_select, boolean-mask "
                "indexing and .item() are not supported")


def run_captured(gm: fx.GraphModule, model: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """Run a captured graph on real tensors with ``model``'s parameters and buffers bound by FQN.

    Returns the output in the model's own structure (e.g. a ``ModelOutput``), so it can be
    compared with ``model(*args, **kwargs)``; buffer mutations of a functionalized
    (``decompose=True``) graph are written back into ``model``'s buffers. The reference
    single-device execution of a capture, used by numerics tests.
    """
    state = dict(itertools.chain(model.named_parameters(remove_duplicate=False),
                                 model.named_buffers(remove_duplicate=False)))
    if gm.meta.get(ir.FRONTEND) == "symbolic_trace":
        # The graph module shares the traced model's submodules; swap in ``model``'s tensors
        # (same FQNs) so both frontends run on the weights passed here.
        own = itertools.chain(gm.named_parameters(remove_duplicate=False),
                              gm.named_buffers(remove_duplicate=False))
        bound = {name: state[name] for name, _ in own if name in state}
        return torch.func.functional_call(gm, bound, args, kwargs)
    flat_params = [state[n.meta[ir.PARAM].fqn] for n in gm.graph.find_nodes(op="placeholder")
                   if ir.PARAM in n.meta]
    in_spec = gm.meta[ir.INPUT_TREE]
    flat_inputs = flatten_inputs(args, kwargs, in_spec)
    flat_out = gm(*flat_params, *flat_inputs)
    by_input = {i.name: x for i, x in zip(ir.user_inputs(gm), flat_inputs, strict=True)}
    user: list[Any] = []
    for info, value in zip(ir.outputs(gm), flat_out, strict=True):
        if info.kind == "user":
            user.append(value)
        else:
            # Write-backs of a functionalized graph, through .data: they must not bump the
            # version counter autograd checks (the functional batch-norm saved the old buffer),
            # just as eager batch-norm's in-place update does not.
            dst = state[info.target] if info.kind == "buffer_mutation" else by_input[info.target]
            dst.data.copy_(value)
    return pytree.tree_unflatten(user, gm.meta[ir.OUTPUT_TREE])


# --- export frontends ----------------------------------------------------------------------------
def _export(model: torch.nn.Module, args: tuple, kwargs: dict, *, strict: bool,
            decompose: bool) -> fx.GraphModule:
    # Dynamo traces the forward itself; the output-sanitizing wrapper is for non-strict only.
    guard = contextlib.nullcontext() if strict else _pytree_outputs(model)
    # (strict export reads attributes a lazily recompiled module lacks: eager there)
    with guard, (contextlib.nullcontext() if strict else _lazy_recompile()):
        ep = torch.export.export(model, args, kwargs, strict=strict)
    _recompile_lazy(ep.graph_module)
    # Inline grad-mode regions first: run_decompositions would inline them WITHOUT the detach
    # that keeps their outputs out of autograd.
    _inline_set_grad_regions(ep.graph_module)
    if decompose:
        # Keep aten.detach: core ATen lowers it to aten.alias, which would let gradients through
        # the no_grad regions inlined above.
        table = torch.export.default_decompositions()
        table.pop(torch.ops.aten.detach.default, None)
        _views_to_reshapes(ep.graph_module)
        ep.graph_module.recompile()  # decompositions re-trace the module's code
        with warnings.catch_warnings():  # torch-internal deprecation noise from copying specs
            warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
            ep = ep.run_decompositions(table)
    return _from_exported(ep, model, "export(strict)" if strict else "export(non-strict)")


@contextlib.contextmanager
def _stack_traces(on: bool) -> Iterator[None]:
    """Export's tracer records each node's user stack unless ``torch.fx.config``'s
    ``do_not_emit_stack_traces`` is set (restored after). When it records, the source line
    of a frame is read when the frame is printed, not when it is listed: the tracer lists
    all ~80 frames of every node's stack and prints only the model's few (same text, ~4% of
    a Llama capture; tests/test_capture.py compares)."""
    import torch.utils._traceback as tb

    prev, listed = fx.config.do_not_emit_stack_traces, tb._extract_symbolized_tb
    fx.config.do_not_emit_stack_traces = prev or not on
    tb._extract_symbolized_tb = _frames_unread
    try:
        yield
    finally:
        fx.config.do_not_emit_stack_traces = prev
        tb._extract_symbolized_tb = listed


def _frames_unread(tb, skip):
    """``torch.utils._traceback._extract_symbolized_tb`` with the lines left to
    ``FrameSummary.line`` (linecache, on first use)."""
    stack = traceback.StackSummary()
    for f in reversed(tb[skip:]):
        stack.append(traceback.FrameSummary(f["filename"], f["line"], f["name"], lookup_line=False))
    return stack


@contextlib.contextmanager
def _lazy_recompile() -> Iterator[None]:
    """Graph modules that export makes on its way (make_fx's, ``sequential_split``'s pieces)
    regenerate their Python code only when it is needed, not on every graph edit: export's
    passes (set-grad regions to higher-order ops, runtime assertions, placeholder names)
    recompile the whole 2,400-node Llama graph about 30 times, ~0.8 s of a ~3 s capture.
    Non-strict export only (strict export's Dynamo graph needs eager recompiles). The graph,
    its names and its meta are the same (tests/test_capture.py compares them);
    :func:`_recompile_lazy` makes whatever lazy module is left a regular one."""
    from torch.fx._lazy_graph_module import _use_lazy_graph_module

    with _use_lazy_graph_module(True):
        yield


def _recompile_lazy(gm: fx.GraphModule) -> None:
    """Generate the code now of every lazily recompiled module in ``gm``'s tree."""
    from torch.fx._lazy_graph_module import _LazyGraphModule

    for m in gm.modules():
        if isinstance(m, _LazyGraphModule):
            m.real_recompile()


def _from_exported(ep: torch.export.ExportedProgram, model: torch.nn.Module,
                   frontend: str) -> fx.GraphModule:
    gm = ep.graph_module
    graph = gm.graph
    canon, aliases = _canonical_names(model)
    tensors = dict(itertools.chain(model.named_parameters(remove_duplicate=False),
                                   model.named_buffers(remove_duplicate=False)))
    placeholders = {n.name: n for n in graph.find_nodes(op="placeholder")}
    infos: dict[str, ParamInfo] = {}
    holder: dict[str, fx.Node] = {}
    inputs: list[InputInfo] = []
    constants: list[tuple[fx.Node, str, Any]] = []
    in_spec = ep.call_spec.in_spec
    paths = _flat_paths(in_spec) if in_spec is not None else []
    user_index = 0

    for spec in ep.graph_signature.input_specs:
        node = placeholders[spec.arg.name]
        if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER):
            fqn = canon.get(spec.target, spec.target)
            if fqn in holder:  # a tied alias lifted as its own placeholder: use the first one
                node.replace_all_uses_with(holder[fqn])
                graph.erase_node(node)
                continue
            v = node.meta[ir.VAL]
            is_param = spec.kind == InputKind.PARAMETER
            t = tensors.get(spec.target)
            infos[fqn] = ParamInfo(
                fqn=fqn,
                kind="param" if is_param else "buffer",
                shape=tuple(int(s) for s in v.shape),
                dtype=v.dtype,
                node_name=node.name,
                requires_grad=bool(is_param and (t.requires_grad if t is not None else True)),
                persistent=True if is_param else bool(spec.persistent),
                aliases=tuple(aliases.get(fqn, ())),
            )
            node.meta[ir.PARAM] = infos[fqn]
            holder[fqn] = node
        elif spec.kind in (InputKind.CONSTANT_TENSOR, InputKind.CUSTOM_OBJ):
            constants.append((node, spec.target, ep.constants[spec.target]))
        elif spec.kind == InputKind.USER_INPUT:
            v = node.meta.get(ir.VAL)
            is_t = isinstance(v, torch.Tensor)
            info = InputInfo(
                name=node.name,
                path=paths[user_index] if user_index < len(paths) else node.name,
                node_name=node.name,
                shape=tuple(int(s) for s in v.shape) if is_t else None,
                dtype=v.dtype if is_t else None,
                value=None if is_t else v,
            )
            node.meta[ir.INPUT] = info
            inputs.append(info)
            user_index += 1
        else:
            raise CaptureError(f"{frontend}: unsupported graph input kind {spec.kind.name}")

    # Parameters the graph never lifted (none under export today) still belong to the model.
    for fqn, t in _unique_state(model):
        if fqn not in infos:
            infos[fqn] = _param_info_from_tensor(fqn, t, model, None, aliases)

    _constants_to_attrs(gm, constants)

    out_node = graph.find_nodes(op="output")[0]
    outs: list[OutputInfo] = []
    for i, spec in enumerate(ep.graph_signature.output_specs):
        if spec.kind == OutputKind.USER_OUTPUT:
            outs.append(OutputInfo(i, "user"))
        elif spec.kind == OutputKind.BUFFER_MUTATION:
            outs.append(OutputInfo(i, "buffer_mutation", canon.get(spec.target, spec.target)))
        elif spec.kind == OutputKind.USER_INPUT_MUTATION:
            outs.append(OutputInfo(i, "input_mutation", spec.target))
        else:
            raise CaptureError(f"{frontend}: unsupported graph output kind {spec.kind.name}")

    for n in graph.find_nodes(op="call_function",
                              target=torch.ops.aten._assert_tensor_metadata.default):
        # Checks of the example inputs' dtype/device; the fake values already carry that.
        graph.erase_node(n)
    _fill_missing_vals(gm)
    out_node.meta[ir.VAL] = map_arg(out_node.args[0], lambda n: n.meta[ir.VAL])

    gm.meta[ir.PARAMS] = infos
    gm.meta[ir.INPUTS] = tuple(inputs)
    gm.meta[ir.OUTPUTS] = tuple(outs)
    gm.meta[ir.INPUT_TREE] = in_spec
    gm.meta[ir.OUTPUT_TREE] = ep.call_spec.out_spec
    gm.meta[ir.FRONTEND] = frontend
    graph.lint()
    gm.recompile()
    return gm


def _constants_to_attrs(gm: fx.GraphModule, constants: list[tuple[fx.Node, str, Any]]) -> None:
    """Lifted constants become buffers of the graph module itself, so the graph's inputs are
    exactly parameters, buffers and user inputs."""
    if not constants:
        return
    graph = gm.graph
    body = next(n for n in graph.nodes if n.op != "placeholder")  # placeholders stay first
    for node, target, value in constants:
        attr = node.name
        if isinstance(value, torch.Tensor):
            gm.register_buffer(attr, value, persistent=False)
        else:
            setattr(gm, attr, value)
        with graph.inserting_before(body):
            new = graph.get_attr(attr)
        new.meta.update(node.meta)
        new.meta[ir.CONSTANT] = target
        node.replace_all_uses_with(new)
        graph.erase_node(node)


def _inline_set_grad_regions(gm: fx.GraphModule) -> None:
    """Inline ``wrap_with_set_grad_enabled`` higher-order ops into the parent graph.

    Later passes see plain ATen ops instead of a nested graph. Inside a grad-disabled region no
    gradient flows out, so an output that depends on a tensor requiring grad is wrapped in
    ``aten.detach``; other outputs (e.g. rotary tables from buffers) need nothing.
    """
    graph = gm.graph
    hop = torch.ops.higher_order.wrap_with_set_grad_enabled
    nodes = graph.find_nodes(op="call_function", target=hop)
    if not nodes:
        return
    for node in nodes:
        enabled, sub_node, *operands = node.args
        if enabled:
            continue  # grad re-enabled inside a no_grad region: keep the scope, rare
        sub = getattr(gm, sub_node.target)
        users = list(node.users)
        if (not isinstance(sub, fx.GraphModule)
                or sub.graph.find_nodes(op="get_attr")
                or any(u.op != "call_function" or u.target is not operator.getitem for u in users)):
            continue  # unusual shape: keep the region as is (it still has meta)
        env: dict[fx.Node, Any] = dict(zip(sub.graph.find_nodes(op="placeholder"), operands))
        results: Any = None
        with graph.inserting_before(node):
            for sn in sub.graph.nodes:
                if sn.op == "placeholder":
                    continue
                if sn.op == "output":
                    results = map_arg(sn.args[0], lambda n: env[n])
                    continue
                env[sn] = graph.node_copy(sn, lambda n: env[n])
        # Recomputed per region: earlier inlining created new nodes.
        grad = {n for n, f in ir.grad_flags(gm, prune=False).items() if f}
        needs_detach = any(isinstance(o, fx.Node) and o in grad for o in operands)
        for u in users:
            r = results[u.args[1]]
            if needs_detach and isinstance(r, fx.Node) and isinstance(r.meta.get(ir.VAL), torch.Tensor):
                with graph.inserting_before(u):
                    d = graph.call_function(torch.ops.aten.detach.default, (r,))
                d.meta.update(u.meta)
                r = d
            u.replace_all_uses_with(r)
            graph.erase_node(u)
        graph.erase_node(node)
        if not sub_node.users:
            graph.erase_node(sub_node)
    gm.delete_all_unused_submodules()


def _views_to_reshapes(gm: fx.GraphModule) -> None:
    """Turn ``aten.view`` into ``aten.reshape`` before decomposing.

    Decomposed ops may produce other strides than the training-IR ops they replace (the math
    decomposition of ``aten.scaled_dot_product_attention`` does), so a ``.contiguous()`` that was
    a no-op at trace time is missing and a later ``view`` fails (HF GPT-2 with dropout off).
    ``reshape`` is a view whenever ``view`` would succeed, so this changes nothing else.
    """
    for n in gm.graph.find_nodes(op="call_function", target=torch.ops.aten.view.default):
        n.target = torch.ops.aten.reshape.default


def _fill_missing_vals(gm: fx.GraphModule) -> None:
    """Every node gets ``meta["val"]``: recompute a missing one under the graph's fake mode."""
    fake_mode = _fake_mode_of(gm)
    for n in gm.graph.nodes:
        if ir.VAL in n.meta or n.op == "output":
            continue
        if n.op == "get_attr":
            attr = _fetch_attr(gm, n.target)
            n.meta[ir.VAL] = (fake_mode.from_tensor(attr) if isinstance(attr, torch.Tensor)
                              and fake_mode is not None else None)
            continue
        if n.op == "call_function" and fake_mode is not None:
            args, kwargs = map_arg((n.args, n.kwargs), lambda a: a.meta[ir.VAL])
            with fake_mode:
                n.meta[ir.VAL] = n.target(*args, **kwargs)
            continue
        raise CaptureError(f"node {n.name} ({n.op} {n.target}) has no fake value")


def _fake_mode_of(gm: fx.GraphModule) -> Any:
    from torch._guards import detect_fake_mode

    return detect_fake_mode([n.meta.get(ir.VAL) for n in gm.graph.find_nodes(op="placeholder")])


@contextlib.contextmanager
def _pytree_outputs(model: torch.nn.Module) -> Iterator[None]:
    """Temporarily wrap ``model.forward`` so output leaves no frontend can hold become ``None``.

    transformers returns a ``DynamicCache`` when ``use_cache=True``; its tensors are computed by
    the graph anyway, only the container is dropped. Applied as an instance attribute that is
    removed again, so the model is unchanged afterwards and FQNs are not prefixed.
    """
    had = "forward" in model.__dict__
    orig = model.forward

    @functools.wraps(orig)
    def forward(*a: Any, **k: Any) -> Any:
        return _drop_opaque_leaves(orig(*a, **k), type(model).__name__)

    model.forward = forward  # type: ignore[method-assign]
    try:
        yield
    finally:
        if had:
            model.forward = orig  # type: ignore[method-assign]
        else:
            del model.forward


_LEAF_TYPES = (torch.Tensor, int, float, bool, str, type(None), torch.SymInt, torch.SymFloat,
               torch.SymBool, torch.dtype, torch.device)


def _drop_opaque_leaves(out: Any, owner: str) -> Any:
    flat, spec = pytree.tree_flatten_with_path(out)
    bad = [(path, leaf) for path, leaf in flat if not isinstance(leaf, _LEAF_TYPES)]
    if not bad:
        return out
    names = ", ".join(f"output{pytree.keystr(p)} ({type(v).__name__})" for p, v in bad)
    warnings.warn(f"fxpar.capture: {owner} returned objects that are not tensors or pytrees; "
                  f"captured them as None: {names}", stacklevel=3)
    keep = [leaf if isinstance(leaf, _LEAF_TYPES) else None for _, leaf in flat]
    return pytree.tree_unflatten(keep, spec)


# --- symbolic_trace frontend ---------------------------------------------------------------------
def _symbolic_trace(model: torch.nn.Module, args: tuple, kwargs: dict) -> fx.GraphModule:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    sig = inspect.signature(model.forward)
    for p in sig.parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise CaptureError(f"forward takes {p} (symbolic_trace needs named arguments)")
    bound = sig.bind(*args, **kwargs)
    bound.apply_defaults()
    values = dict(bound.arguments)
    for name, v in values.items():
        if not isinstance(v, torch.Tensor) and any(
                isinstance(x, torch.Tensor) for x in pytree.tree_leaves(v)):
            raise CaptureError(f"argument {name!r} nests tensors in a container "
                               "(symbolic_trace takes tensors or constants)")
    # Non-tensor arguments are specialized to their example values, so Python control flow on
    # them (``if targets is None``) is resolved like export resolves it.
    concrete = {k: v for k, v in values.items() if not isinstance(v, torch.Tensor)}
    gm = fx.symbolic_trace(model, concrete_args=concrete or None)

    class _Prop(FakeTensorProp):
        def run_node(self, n: fx.Node) -> Any:
            result = super().run_node(n)
            if ir.VAL not in n.meta:  # FakeTensorProp keeps only tensors/numbers; keep None,
                n.meta[ir.VAL] = result  # torch.device, ... as the Python value
            return result

    mode = FakeTensorMode(allow_non_fake_inputs=True)  # real weights are fakified, never run
    _Prop(gm, mode).propagate(*values.values())

    canon, aliases = _canonical_names(model)
    tensors = dict(_unique_state(model))
    first_user: dict[str, str] = {}
    for n in gm.graph.nodes:
        if n.op == "get_attr" and isinstance(n.target, str) and n.target in canon:
            first_user.setdefault(canon[n.target], n.name)
        elif n.op == "call_module":
            sub = model.get_submodule(n.target)
            fqns = dict.fromkeys(
                canon[f"{n.target}.{name}"] for name, _ in itertools.chain(
                    sub.named_parameters(remove_duplicate=False),
                    sub.named_buffers(remove_duplicate=False)))
            n.meta[ir.MODULE_PARAMS] = tuple(fqns)
            for f in fqns:
                first_user.setdefault(f, n.name)
    infos = {fqn: _param_info_from_tensor(fqn, t, model, first_user.get(fqn), aliases)
             for fqn, t in tensors.items()}

    inputs: list[InputInfo] = []
    placeholders = gm.graph.find_nodes(op="placeholder")
    for n, (name, v) in zip(placeholders, values.items(), strict=True):
        if ir.VAL not in n.meta:  # FakeTensorProp skips None-valued nodes
            n.meta[ir.VAL] = v
        tv = n.meta[ir.VAL]
        is_t = isinstance(tv, torch.Tensor)
        info = InputInfo(name=name, path=name, node_name=n.name,
                         shape=tuple(int(s) for s in tv.shape) if is_t else None,
                         dtype=tv.dtype if is_t else None, value=None if is_t else v)
        n.meta[ir.INPUT] = info
        inputs.append(info)
    for n in gm.graph.nodes:
        if n.op == "get_attr" and isinstance(n.target, str):
            if n.target in canon:
                n.meta[ir.PARAM] = infos[canon[n.target]]
            else:
                n.meta[ir.CONSTANT] = n.target
        if n.op == "output":
            n.meta[ir.VAL] = map_arg(n.args[0], lambda a: a.meta[ir.VAL])

    gm.meta[ir.PARAMS] = infos
    gm.meta[ir.INPUTS] = tuple(inputs)
    gm.meta[ir.OUTPUTS] = ()
    gm.meta[ir.INPUT_TREE] = None
    gm.meta[ir.OUTPUT_TREE] = None
    gm.meta[ir.FRONTEND] = "symbolic_trace"
    return gm


# --- shared helpers ------------------------------------------------------------------------------
def _unalias_inputs(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Clone a tensor passed twice (``labels=input_ids``): export would bind both placeholders to
    one fake tensor and the graph would read the wrong one when they differ at run time."""
    seen: set[int] = set()

    def fresh(t: torch.Tensor) -> torch.Tensor:
        if id(t) in seen:
            return t.clone()
        seen.add(id(t))
        return t

    return pytree.tree_map_only(torch.Tensor, fresh, (args, kwargs))


def _on_meta(model: torch.nn.Module) -> bool:
    t = next(itertools.chain(model.parameters(), model.buffers()), None)
    return t is not None and t.is_meta


def _unique_state(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Parameters then buffers, deduplicated by identity like ``named_parameters()``."""
    seen: set[int] = set()
    for name, t in itertools.chain(model.named_parameters(), model.named_buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            yield name, t


def _canonical_names(model: torch.nn.Module) -> tuple[dict[str, str], dict[str, list[str]]]:
    """``{every FQN: canonical FQN}`` (first name of each tensor) and ``{canonical: aliases}``."""
    first: dict[int, str] = {}
    canon: dict[str, str] = {}
    aliases: dict[str, list[str]] = defaultdict(list)
    for name, t in itertools.chain(model.named_parameters(remove_duplicate=False),
                                   model.named_buffers(remove_duplicate=False)):
        c = first.setdefault(id(t), name)
        canon[name] = c
        if c != name:
            aliases[c].append(name)
    return canon, dict(aliases)


def _param_info_from_tensor(fqn: str, t: torch.Tensor, model: torch.nn.Module,
                            node_name: str | None, aliases: Mapping[str, list[str]]) -> ParamInfo:
    is_param = isinstance(t, torch.nn.Parameter)
    persistent = True
    if not is_param:
        owner, _, leaf = fqn.rpartition(".")
        mod = model.get_submodule(owner) if owner else model
        persistent = leaf not in mod._non_persistent_buffers_set
    return ParamInfo(fqn=fqn, kind="param" if is_param else "buffer", shape=tuple(t.shape),
                     dtype=t.dtype, node_name=node_name,
                     requires_grad=bool(is_param and t.requires_grad), persistent=persistent,
                     aliases=tuple(aliases.get(fqn, ())))


def _fetch_attr(gm: fx.GraphModule, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _flat_paths(in_spec: pytree.TreeSpec) -> list[str]:
    """Key paths (``"[1]['input_ids']"``) of the flat user inputs, in graph order."""
    skeleton = pytree.tree_unflatten(list(range(in_spec.num_leaves)), in_spec)
    return [pytree.keystr(p) for p, _ in pytree.tree_flatten_with_path(skeleton)[0]]


def flatten_inputs(args: tuple, kwargs: dict, in_spec: pytree.TreeSpec) -> list[Any]:
    """The flat user inputs of a captured graph from a call's ``(args, kwargs)``, in the order
    of ``in_spec`` (``gm.meta[ir.INPUT_TREE]``): keyword arguments follow the spec (export
    orders them by the forward signature), not the caller. Raises ``TypeError`` when the
    keywords or the structure differ from the captured ones.

    >>> spec = pytree.tree_flatten(((1, 2), {"mask": 3, "ids": 4}))[1]
    >>> flatten_inputs((10, 20), {"ids": 40, "mask": 30}, spec)
    [10, 20, 30, 40]
    """
    # Export orders kwargs by the forward signature; follow the spec, not the caller's order.
    kw_keys = in_spec.child(1).context
    missing = set(kw_keys) ^ set(kwargs)
    if missing:
        raise TypeError(f"captured graph expects keyword arguments {list(kw_keys)}, "
                        f"got {list(kwargs)}")
    flat, spec = pytree.tree_flatten((tuple(args), {k: kwargs[k] for k in kw_keys}))
    if spec != in_spec:
        raise TypeError(f"inputs do not match the captured structure:\n{spec}\nvs\n{in_spec}")
    return flat


def _first_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[0] if lines else '(no message)'}"


class WithLoss(torch.nn.Module):
    """``loss_fn(model(*args[:n_inputs], **kwargs), *args[n_inputs:])`` as one module, so the
    loss is part of the captured graph (its parameters are ``model.<fqn>``); ``n_targets``
    of the trailing arguments are targets.

    >>> m = WithLoss(torch.nn.Linear(2, 1), torch.nn.functional.mse_loss, 1, 1)
    >>> m(torch.zeros(3, 2), m.model(torch.zeros(3, 2))).item()
    0.0
    """

    fxpar_wraps_loss = True

    def __init__(self, model: torch.nn.Module, loss_fn, n_inputs: int,
                 n_targets: int = 0) -> None:
        super().__init__()
        self.model, self.loss_fn = model, loss_fn
        self.n_inputs, self.n_targets = n_inputs, n_targets

    def forward(self, *args, **kwargs):
        return self.loss_fn(self.model(*args[:self.n_inputs], **kwargs), *args[self.n_inputs:])


@contextlib.contextmanager
def frozen_params(model: torch.nn.Module) -> Iterator[None]:
    """Parameters temporarily not requiring grad (restored on exit, also on error): an
    inference capture plans the forward only.

    >>> lin = torch.nn.Linear(2, 2)
    >>> with frozen_params(lin):
    ...     lin.weight.requires_grad
    False
    >>> lin.weight.requires_grad
    True
    """
    flags = {}
    try:
        for p in model.parameters():
            flags[p] = p.requires_grad
            p.requires_grad_(False)
        yield
    finally:
        for p, f in flags.items():
            p.requires_grad_(f)
