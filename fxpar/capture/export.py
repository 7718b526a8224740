"""The ``torch.export`` frontends: an ``nn.Module`` → an ATen-level graph with fxpar's meta.

Contract of :func:`export_graph` (``strict=False``: non-strict, fake tensors; ``strict=True``:
TorchDynamo): the training IR of ``torch.export.export``, cleaned up by
:mod:`fxpar.capture.cleanup` (set-grad regions inlined, optionally decomposed to core ATen,
tied placeholders merged, constants as ``get_attr`` buffers, metadata asserts dropped, every
node with ``meta["val"]``), then described by the program's signature: each parameter/buffer
placeholder carries ``meta[PARAM]`` (its :class:`~fxpar.ir.ParamInfo`, by canonical FQN),
each user input ``meta[INPUT]``, and the graph module's meta holds ``PARAMS``, ``INPUTS``,
``OUTPUTS`` (user outputs and, when decomposed, buffer/input mutations), ``INPUT_TREE``,
``OUTPUT_TREE`` and ``FRONTEND``. Placeholders are, in order, parameters ``p_*``, buffers
``b_*``, then the flat user inputs.

Around the call to export (non-strict only): the model's forward is wrapped for the call so
output leaves no frontend can hold (transformers' ``DynamicCache``) become ``None`` with a
warning (the model is unchanged afterwards), and export's intermediate graph modules recompile
lazily. Both frontends let transformers take eager's causal-mask decision
(:func:`_eager_causal_skip`): with no padding mask a causal attention runs ``is_causal=True``
instead of a ``[B, 1, L, S]`` mask built in the graph (16 GiB at 128k tokens). ``stack_traces=False`` leaves ``meta["stack_trace"]`` out of every node; when they are
kept, a frame's source line is read when the frame is printed, not when it is listed.

Example (``nn.Linear`` decomposed to core ATen)::

    >>> import torch
    >>> gm = export_graph(torch.nn.Linear(4, 2), (torch.randn(3, 4),), {}, strict=False,
    ...                   decompose=True)
    >>> [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    ['aten.permute.default', 'aten.addmm.default']
    >>> gm.meta[ir.PARAMS]["weight"].node_name, gm.meta[ir.FRONTEND]
    ('p_weight', 'export(non-strict)')
    >>> [o.kind for o in gm.meta[ir.OUTPUTS]]
    ['user']
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import traceback
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.export.graph_signature import InputKind, OutputKind
from torch.fx.node import map_arg

from fxpar import ir
from fxpar.capture.causal_mask import fold_causal_masks
from fxpar.capture.constants import fold_constants
from fxpar.capture.functionalize import functionalize_mutations
from fxpar.capture.cleanup import (constants_to_attrs, decompose as decompose_graph,
                                   drop_identities, drop_metadata_asserts, fill_missing_vals,
                                   fold_empty_cats, inline_set_grad_regions, merge_tied_placeholders,
                                   read_through_scatters)
from fxpar.capture.model import canonical_names, param_info_from_tensor, unique_state
from fxpar.capture.specialize import name_guards, replaying
from fxpar.errors import CaptureError
from fxpar.ir import InputInfo, OutputInfo, ParamInfo

__all__ = ["export_graph"]


def export_graph(model: torch.nn.Module, args: tuple, kwargs: dict, *, strict: bool,
                 decompose: bool, stack_traces: bool = True,
                 reads: dict | None = None) -> fx.GraphModule:
    """``model(*args, **kwargs)`` exported (``strict``: TorchDynamo), cleaned up and described
    as the module docstring says; ``decompose``: lowered to core ATen. ``reads`` (non-strict
    only): the values of :func:`fxpar.capture.specialize.record_reads`, which each
    ``.item()``/``.tolist()`` returns, guarded by a ``guard_value`` node."""
    if reads is not None and strict:
        raise ValueError("export_graph: reads are replayed by non-strict export only")
    with _stack_traces(stack_traces):
        # Dynamo traces the forward itself; the output-sanitizing wrapper is for non-strict only.
        guard = contextlib.nullcontext() if strict else _pytree_outputs(model)
        replay = contextlib.nullcontext() if reads is None else replaying(model, reads)
        # (strict export reads attributes a lazily recompiled module lacks: eager there)
        with guard, replay, (contextlib.nullcontext() if strict else _lazy_recompile()), \
                _eager_causal_skip(model, args, kwargs):
            ep = torch.export.export(model, args, kwargs, strict=strict)
        _recompile_lazy(ep.graph_module)
        # Inline grad-mode regions first: run_decompositions would inline them WITHOUT the
        # detach that keeps their outputs out of autograd.
        inline_set_grad_regions(ep.graph_module)
        if decompose:
            ep = decompose_graph(ep)
        gm = _from_exported(ep, model, "export(strict)" if strict else "export(non-strict)")
        if reads is not None:
            name_guards(gm, reads)
        return gm


# --- around the call to export -------------------------------------------------------------------
@contextlib.contextmanager
def _stack_traces(on: bool) -> Iterator[None]:
    """Export's tracer records each node's user stack unless ``torch.fx.config``'s
    ``do_not_emit_stack_traces`` is set (restored after). When it records, the source line
    of a frame is read when the frame is printed, not when it is listed: the tracer lists
    all ~80 frames of every node's stack and prints only the model's few (same text, ~4% of
    a Llama capture; tests/test_capture.py compares)."""
    import torch.utils._traceback as tb

    if not (hasattr(fx.config, "do_not_emit_stack_traces") and hasattr(tb, "_extract_symbolized_tb")):
        yield  # an older torch (2.11 on the GPU images): it records stacks its own way
        return
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
def _eager_causal_skip(model: torch.nn.Module, args: tuple, kwargs: dict) -> Iterator[None]:
    """transformers builds a causal mask under export that eager skips. Eager, with no
    padding mask and ``q_length == kv_length``, hands SDPA ``is_causal=True`` and no mask;
    under export ``masking_utils`` refuses both steps of that decision, because an exported
    graph could be called with other shapes or values: ``_ignore_causal_mask_sdpa`` returns
    False while exporting, and ``find_packed_sequence_indices`` cannot read the position ids
    to see that they are one sequence, so the ``[B, 1, L, S]`` mask is built in the graph
    (16 GiB at 128k tokens, read by every attention; :func:`fold_causal_masks` folds it only
    when it is small enough to evaluate). fxpar's graphs are specialized to the captured
    shapes (the runtime checks them), so eager's decision is exact here: without a padding
    mask the skip check runs as in eager (sliding windows keep their mask by the check's own
    rule), and when the caller passes no ``position_ids`` the model makes them from
    ``arange`` (one sequence per row, never packed: eager finds no packing). A no-op when
    transformers is not imported or lacks these functions.
    """
    import inspect
    import sys

    mu = sys.modules.get("transformers.masking_utils")
    names = ("_ignore_causal_mask_sdpa", "find_packed_sequence_indices", "is_torchdynamo_exporting")
    if mu is None or not all(hasattr(mu, n) for n in names):
        yield
        return
    skip, packed = mu._ignore_causal_mask_sdpa, mu.find_packed_sequence_indices
    try:
        bound = inspect.signature(model.forward).bind_partial(*args, **kwargs).arguments
    except (TypeError, ValueError):
        bound = {"position_ids": True}   # cannot tell: keep transformers' own rule
    own_positions = bound.get("position_ids") is None

    def eager_skip(padding_mask, *a, **k):
        if padding_mask is not None:
            return skip(padding_mask, *a, **k)
        exporting = mu.is_torchdynamo_exporting
        mu.is_torchdynamo_exporting = lambda: False
        try:
            return skip(padding_mask, *a, **k)
        finally:
            mu.is_torchdynamo_exporting = exporting

    mu._ignore_causal_mask_sdpa = eager_skip
    if own_positions:
        mu.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        mu._ignore_causal_mask_sdpa, mu.find_packed_sequence_indices = skip, packed


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


# --- the exported program → fxpar's graph --------------------------------------------------------
def _from_exported(ep: torch.export.ExportedProgram, model: torch.nn.Module,
                   frontend: str) -> fx.GraphModule:
    gm = ep.graph_module
    graph = gm.graph
    canon, aliases = canonical_names(model)
    merge_tied_placeholders(gm, ep.graph_signature.input_specs, canon)
    infos, inputs, constants = _signature_inputs(ep, model, canon, aliases, frontend)
    # Parameters the graph never lifted (none under export today) still belong to the model.
    for fqn, t in unique_state(model):
        if fqn not in infos:
            infos[fqn] = param_info_from_tensor(fqn, t, model, None, aliases)
    constants_to_attrs(gm, constants)
    outs = _signature_outputs(ep, canon, frontend)
    drop_metadata_asserts(gm)
    functionalize_mutations(gm)
    fill_missing_vals(gm)
    fold_empty_cats(gm)
    read_through_scatters(gm)
    fold_causal_masks(gm)
    fold_constants(gm)   # after the masks: a causal one becomes is_causal, not a buffer
    drop_identities(gm)
    graph.eliminate_dead_code()   # pure values nothing reads (index aranges of an unused mask path)
    out_node = graph.find_nodes(op="output")[0]
    out_node.meta[ir.VAL] = map_arg(out_node.args[0], lambda n: n.meta[ir.VAL])

    gm.meta[ir.PARAMS] = infos
    gm.meta[ir.INPUTS] = tuple(inputs)
    gm.meta[ir.OUTPUTS] = tuple(outs)
    gm.meta[ir.INPUT_TREE] = ep.call_spec.in_spec
    gm.meta[ir.OUTPUT_TREE] = ep.call_spec.out_spec
    gm.meta[ir.FRONTEND] = frontend
    graph.lint()
    gm.recompile()
    return gm


def _signature_inputs(ep: torch.export.ExportedProgram, model: torch.nn.Module,
                      canon: Mapping[str, str], aliases: Mapping[str, list[str]], frontend: str
                      ) -> tuple[dict[str, ParamInfo], list[InputInfo], list[tuple[fx.Node, str, Any]]]:
    """The graph's inputs as the signature lists them: ``{canonical FQN: ParamInfo}`` of the
    parameters and buffers (their placeholders get ``meta[PARAM]``; tied aliases, already
    merged, are skipped), the user inputs' :class:`InputInfo` (``meta[INPUT]``) and the lifted
    constants ``(placeholder, name, value)``."""
    placeholders = {n.name: n for n in ep.graph_module.graph.find_nodes(op="placeholder")}
    tensors = dict(itertools.chain(model.named_parameters(remove_duplicate=False),
                                   model.named_buffers(remove_duplicate=False)))
    in_spec = ep.call_spec.in_spec
    paths = _flat_paths(in_spec) if in_spec is not None else []
    infos: dict[str, ParamInfo] = {}
    inputs: list[InputInfo] = []
    constants: list[tuple[fx.Node, str, Any]] = []
    for spec in ep.graph_signature.input_specs:
        if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER):
            fqn = canon.get(spec.target, spec.target)
            if fqn in infos:  # a tied alias: merge_tied_placeholders erased its placeholder
                continue
            node = placeholders[spec.arg.name]
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
        elif spec.kind in (InputKind.CONSTANT_TENSOR, InputKind.CUSTOM_OBJ):
            constants.append((placeholders[spec.arg.name], spec.target, ep.constants[spec.target]))
        elif spec.kind == InputKind.USER_INPUT:
            node = placeholders[spec.arg.name]
            path = paths[len(inputs)] if len(inputs) < len(paths) else node.name
            node.meta[ir.INPUT] = info = _input_info(node, path)
            inputs.append(info)
        else:
            raise CaptureError(f"{frontend}: unsupported graph input kind {spec.kind.name}")
    return infos, inputs, constants


def _input_info(node: fx.Node, path: str) -> InputInfo:
    v = node.meta.get(ir.VAL)
    is_t = isinstance(v, torch.Tensor)
    return InputInfo(
        name=node.name,
        path=path,
        node_name=node.name,
        shape=tuple(int(s) for s in v.shape) if is_t else None,
        dtype=v.dtype if is_t else None,
        value=None if is_t else v,
    )


def _signature_outputs(ep: torch.export.ExportedProgram, canon: Mapping[str, str],
                       frontend: str) -> list[OutputInfo]:
    """One :class:`OutputInfo` per graph output: a user output, or the write-back of a mutated
    buffer (by canonical FQN) or user input."""
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
    return outs


def _flat_paths(in_spec: pytree.TreeSpec) -> list[str]:
    """Key paths (``"[1]['input_ids']"``) of the flat user inputs, in graph order."""
    skeleton = pytree.tree_unflatten(list(range(in_spec.num_leaves)), in_spec)
    return [pytree.keystr(p) for p, _ in pytree.tree_flatten_with_path(skeleton)[0]]
