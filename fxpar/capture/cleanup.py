"""Graph clean-ups: what normalizes an exported graph before fxpar's passes see it.

Contract: each function does one job on the graph module export produced (in place, except
:func:`decompose`, which returns a new ``ExportedProgram``), keeps every other node, name and
meta as they are, and is run by :mod:`fxpar.capture.export` in this order:

1. :func:`inline_set_grad_regions`: ``wrap_with_set_grad_enabled`` regions (Llama's
   ``@torch.no_grad`` rotary embedding) become plain ATen nodes of the parent graph; an output
   that could carry a gradient gets an ``aten.detach``, so autograd is unchanged;
2. :func:`decompose` (``decompose=True`` only): core ATen through ``run_decompositions``,
   ``aten.view`` turned into ``aten.reshape`` first (:func:`views_to_reshapes`) and
   ``aten.detach`` kept (core ATen would lower it to ``aten.alias`` and lose the stop-gradient);
3. :func:`merge_tied_placeholders`: a tensor with several names (tied weights) is ONE
   placeholder, the first one the signature lists;
4. :func:`constants_to_attrs`: lifted tensor constants become ``get_attr`` buffers of the graph
   module (``meta[CONSTANT]``), so the placeholders are exactly parameters, buffers and inputs;
5. :func:`drop_metadata_asserts`: ``aten._assert_tensor_metadata`` checks are removed (the fake
   values carry dtype and device already);
6. :func:`fill_missing_vals`: every node gets ``meta["val"]`` (recomputed under the graph's
   fake mode where export left none);
7. :func:`fold_empty_cats` (after :mod:`fxpar.capture.functionalize`): a ``cat`` drops the
   inputs that add nothing (a legacy 1-d empty tensor, or size 0 along its dim) and one left
   alone stands for the ``cat``; what only fed a dropped input goes. transformers' key/value
   cache under ``use_cache=True`` is such a ``cat`` onto an empty cache per layer, so a
   training graph plans as it does with ``use_cache=False``;
8. :func:`read_through_scatters`: a ``select`` of a functionalized write into a buffer reads
   the written value or the buffer's earlier version (writes nothing reads go);
9. :func:`drop_identities` (last): ``alias`` and casts to the dtype a tensor has are erased,
   their users read the input (nothing to run, nothing for the planner to place).

Example (a ``view`` becomes a ``reshape``, a grad-disabled region is inlined)::

    >>> import torch
    >>> class M(torch.nn.Module):
    ...     def forward(self, x):
    ...         with torch.no_grad():
    ...             s = x.sin()
    ...         return (x * s).view(4)
    >>> gm = torch.export.export(M(), (torch.randn(2, 2),)).graph_module
    >>> ops = lambda: [getattr(n.target, "__name__", n.target) for n in gm.graph.nodes
    ...                if n.op == "call_function"]
    >>> ops()
    ['wrap_with_set_grad_enabled', 'getitem', 'mul.Tensor', 'view.default']
    >>> inline_set_grad_regions(gm); views_to_reshapes(gm)
    >>> ops()
    ['sin.default', 'mul.Tensor', 'reshape.default']
"""

from __future__ import annotations

import operator
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.fx as fx
from torch.export.graph_signature import InputKind, InputSpec
from torch.fx.node import map_arg

from fxpar import ir
from fxpar.errors import CaptureError

__all__ = ["inline_set_grad_regions", "views_to_reshapes", "decompose", "merge_tied_placeholders",
           "constants_to_attrs", "drop_metadata_asserts", "fill_missing_vals", "fold_empty_cats",
           "read_through_scatters", "drop_identities"]


def inline_set_grad_regions(gm: fx.GraphModule) -> None:
    """Inline ``wrap_with_set_grad_enabled`` higher-order ops into the parent graph.

    Later passes see plain ATen ops instead of a nested graph. Inside a grad-disabled region no
    gradient flows out, so an output that depends on a tensor requiring grad is wrapped in
    ``aten.detach``; other outputs (e.g. rotary tables from buffers) need nothing. Run it before
    :func:`decompose`: ``run_decompositions`` would inline the regions WITHOUT the detach.
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
        results = _copy_region(graph, node, sub, operands)
        # Recomputed per region: earlier inlining created new nodes.
        grad = {n for n, f in ir.grad_flags(gm, prune=False).items() if f}
        needs_detach = any(isinstance(o, fx.Node) and o in grad for o in operands)
        for u in users:
            r = results[u.args[1]]
            src = _returned_input(r, operands)
            if src is not None:   # the region handed back its input itself: grad flows as eager
                r = src
            elif needs_detach and isinstance(r, fx.Node) and isinstance(r.meta.get(ir.VAL), torch.Tensor):
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


#: ops that return their input tensor itself when they have nothing to do
_MAY_RETURN_SELF = {torch.ops.aten.to.dtype, torch.ops.aten.to.dtype_layout, torch.ops.aten.to.device,
                    torch.ops.aten.to.other, torch.ops.aten.contiguous.default, torch.ops.aten.type_as.default}


def _same_layout(a: fx.Node, b: fx.Node) -> bool:
    va, vb = a.meta.get(ir.VAL), b.meta.get(ir.VAL)
    return (isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor) and va.dtype == vb.dtype
            and va.device == vb.device and tuple(va.shape) == tuple(vb.shape)
            and va.stride() == vb.stride())


def _returned_input(r, operands: list) -> fx.Node | None:
    """The region operand that ``r`` *is* (not a copy): eager ``x.to(x.dtype)`` under
    ``no_grad`` returns ``x`` itself, so a use outside the region keeps ``x``'s gradient
    (dots3's indexer hands back ``hidden_states.to(weight.dtype)``, the same tensor the
    attention's gate reads); ``None`` when ``r`` is a new tensor."""
    while (isinstance(r, fx.Node) and r not in operands and r.op == "call_function"
           and r.target in _MAY_RETURN_SELF and isinstance(r.args[0], fx.Node)
           and _same_layout(r, r.args[0])):
        r = r.args[0]
    return r if isinstance(r, fx.Node) and r in operands else None


#: ops that are their input when dtype, device, shape and strides stay (``contiguous`` is
#: not: a rank's shard of a contiguous tensor may not be, and a ``view`` may need it)
_IDENTITIES = (_MAY_RETURN_SELF - {torch.ops.aten.contiguous.default}) | {torch.ops.aten.alias.default}


def drop_identities(gm: fx.GraphModule) -> int:
    """Erase ``alias`` and the casts and moves that change nothing (``x.to(x.dtype)``,
    ``x.type_as(y)`` of one dtype; same shape and strides): a functional graph reads their
    input instead. Kept: one the output reads, and one that an in-place op may write through
    (its input or output, or a view of them, is written in place). Returns how many went."""
    from fxpar.capture.functionalize import _parent

    graph = gm.graph
    written: set[fx.Node] = set()
    for n in graph.nodes:   # what an in-place op writes, and what that is a view of
        if n.op == "call_function" and _writes_in_place(n, n.args[0] if n.args else None):
            t = n.args[0]
            while isinstance(t, fx.Node) and t not in written:
                written.add(t)
                t = _parent(t)
    gone = 0
    for n in list(graph.nodes):
        if (n.op == "call_function" and n.target in _IDENTITIES and n.args
                and isinstance(n.args[0], fx.Node) and _same_layout(n, n.args[0])
                and not {n, n.args[0]} & written
                and not any(u.op == "output" for u in n.users)):
            n.replace_all_uses_with(n.args[0])
            graph.erase_node(n)
            gone += 1
    if gone:
        gm.recompile()
    return gone


def _copy_region(graph: fx.Graph, node: fx.Node, sub: fx.GraphModule, operands: list) -> Any:
    """Copy ``sub``'s nodes into ``graph`` before ``node`` (its placeholders bound to
    ``operands``) and return its outputs, as nodes of ``graph``."""
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
    return results


def views_to_reshapes(gm: fx.GraphModule) -> None:
    """Turn ``aten.view`` into ``aten.reshape`` before decomposing.

    Decomposed ops may produce other strides than the training-IR ops they replace (the math
    decomposition of ``aten.scaled_dot_product_attention`` does), so a ``.contiguous()`` that was
    a no-op at trace time is missing and a later ``view`` fails (HF GPT-2 with dropout off).
    ``reshape`` is a view whenever ``view`` would succeed, so this changes nothing else.
    """
    for n in gm.graph.find_nodes(op="call_function", target=torch.ops.aten.view.default):
        n.target = torch.ops.aten.reshape.default


def decompose(ep: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """``ep`` lowered to core ATen, functionalized (in-place buffer/input updates become extra
    leading outputs), with ``aten.detach`` kept: core ATen lowers it to ``aten.alias``, which
    would let gradients through the no_grad regions :func:`inline_set_grad_regions` inlined."""
    table = torch.export.default_decompositions()
    table.pop(torch.ops.aten.detach.default, None)
    views_to_reshapes(ep.graph_module)
    ep.graph_module.recompile()  # decompositions re-trace the module's code
    with warnings.catch_warnings():  # torch-internal deprecation noise from copying specs
        warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
        return ep.run_decompositions(table)


def merge_tied_placeholders(gm: fx.GraphModule, input_specs: Iterable[InputSpec],
                            canon: Mapping[str, str]) -> None:
    """A tensor export lifted once per name (tied weights) is ONE placeholder: the first the
    signature's ``input_specs`` lists for its canonical FQN (``canon``: every FQN to it) keeps
    the uses of the others, which are erased."""
    graph = gm.graph
    placeholders = {n.name: n for n in graph.find_nodes(op="placeholder")}
    holder: dict[str, fx.Node] = {}
    for spec in input_specs:
        if spec.kind not in (InputKind.PARAMETER, InputKind.BUFFER):
            continue
        fqn = canon.get(spec.target, spec.target)
        node = placeholders[spec.arg.name]
        if fqn in holder:
            node.replace_all_uses_with(holder[fqn])
            graph.erase_node(node)
        else:
            holder[fqn] = node


def constants_to_attrs(gm: fx.GraphModule, constants: list[tuple[fx.Node, str, Any]]) -> None:
    """Lifted constants ``(placeholder, name in the program, value)`` become buffers of the
    graph module itself, read by ``get_attr`` nodes right after the placeholders, so the graph's
    inputs are exactly parameters, buffers and user inputs."""
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


def drop_metadata_asserts(gm: fx.GraphModule) -> None:
    """Erase ``aten._assert_tensor_metadata`` nodes: checks of the example inputs' dtype and
    device, which the fake values already carry."""
    graph = gm.graph
    for n in graph.find_nodes(op="call_function",
                              target=torch.ops.aten._assert_tensor_metadata.default):
        graph.erase_node(n)


def fill_missing_vals(gm: fx.GraphModule) -> None:
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


def fold_empty_cats(gm: fx.GraphModule) -> int:
    """Fold ``cat`` inputs that add nothing (module docstring, step 7); returns how many were
    dropped. A ``cat`` whose dtype the dropped input promoted, or that is written in place
    later, is left alone."""
    graph = gm.graph
    dropped = 0
    for n in list(graph.find_nodes(op="call_function", target=torch.ops.aten.cat.default)):
        parts = list(n.args[0])
        dim = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim", 0)
        out = n.meta[ir.VAL]
        keep = [p for p in parts if not _adds_nothing(p, dim, out.ndim)]
        if len(keep) == len(parts) or not keep or any(_writes_in_place(u, n) for u in n.users):
            continue
        gone = [p for p in parts if p not in keep]
        if len(keep) == 1:
            k = keep[0]
            if tuple(k.meta[ir.VAL].shape) != tuple(out.shape) or k.meta[ir.VAL].dtype != out.dtype:
                continue
            n.replace_all_uses_with(k)
            graph.erase_node(n)
        else:
            n.args = (keep, *n.args[1:])
        dropped += len(gone)
        for p in gone:
            _erase_if_dead(p)
    if dropped:
        gm.recompile()
    return dropped


def read_through_scatters(gm: fx.GraphModule) -> int:
    """A ``select`` of a ``select_scatter`` on the same dim reads what was written (same
    index: the scattered ``src``) or what was there before (another index: a ``select`` of
    the base), as functionalized writes into a buffer leave them
    (``buf[b, q] = v; ... buf[b, j]``); the read then skips the write, and writes nothing
    reads any more go. Returns how many reads were rewritten.

    >>> import torch
    >>> g = fx.Graph(); base, src = g.placeholder("base"), g.placeholder("src")
    >>> w = g.call_function(torch.ops.aten.select_scatter.default, (base, src, 0, 1))
    >>> r1 = g.call_function(torch.ops.aten.select.int, (w, 0, -3))   # row 1 again: src
    >>> r2 = g.call_function(torch.ops.aten.select.int, (w, 0, 2))    # row 2: the base's
    >>> _ = g.output((r1, r2))
    >>> for n, v in zip(g.nodes, (torch.zeros(4, 2), torch.ones(2))):
    ...     n.meta[ir.VAL] = v
    >>> gm = fx.GraphModule(torch.nn.Module(), g); read_through_scatters(gm)
    2
    >>> [line.strip() for line in gm.code.strip().splitlines()[-2:]]
    ['select_int_1 = torch.ops.aten.select.int(base, 0, 2);  base = None', 'return (src, select_int_1)']
    """
    aten = torch.ops.aten
    done = 0
    for n in list(gm.graph.nodes):
        if n.target is not aten.select.int or not isinstance(n.args[0], fx.Node):
            continue
        first, (x, dim, i) = n.args[0], n.args
        read = x   # the version of the buffer the read goes to, or the written src
        while (isinstance(x, fx.Node) and x.target is aten.select_scatter.default
               and isinstance(i, int) and isinstance(x.args[3], int)
               and not any(_writes_in_place(u, x) for u in x.users)):
            base, src, wdim, wi = x.args
            size = base.meta[ir.VAL].shape
            if wdim % len(size) != dim % len(size):
                break
            if wi % size[dim % len(size)] == i % size[dim % len(size)]:
                read = src                     # the value written
                break
            x = read = base                    # another row: what was there before
        if read is first:
            continue
        if read is x:
            n.args = (x, dim, i)
        else:
            n.replace_all_uses_with(read)
            gm.graph.erase_node(n)
        done += 1
        _erase_if_dead(first)
    if done:
        gm.recompile()
    return done


def _adds_nothing(p, dim: int, ndim: int) -> bool:
    v = p.meta.get(ir.VAL) if isinstance(p, fx.Node) else None
    if not isinstance(v, torch.Tensor):
        return False
    if v.ndim == 1 and v.shape[0] == 0:   # torch.cat skips legacy empty tensors
        return True
    return v.ndim == ndim and v.shape[dim % ndim] == 0


def _writes_in_place(user: fx.Node, arg: fx.Node) -> bool:
    schema = getattr(user.target, "_schema", None)
    return bool(schema and schema.arguments and user.args and user.args[0] is arg
                and schema.arguments[0].alias_info is not None and schema.arguments[0].alias_info.is_write)


def _erase_if_dead(n) -> None:
    """Erase ``n`` and then its inputs while nothing reads them: pure calls and constants, and
    an in-place op (``detach_``) whose target nothing else reads."""
    if not isinstance(n, fx.Node) or n.users or n.op not in ("call_function", "get_attr"):
        return
    if n.op == "call_function" and n.is_impure():
        target = n.args[0] if n.args else None
        if not (_writes_in_place(n, target) and set(target.users) == {n}):
            return
    inputs = n.all_input_nodes
    n.graph.erase_node(n)
    for i in inputs:
        _erase_if_dead(i)


def _fake_mode_of(gm: fx.GraphModule) -> Any:
    from torch._guards import detect_fake_mode

    return detect_fake_mode([n.meta.get(ir.VAL) for n in gm.graph.find_nodes(op="placeholder")])


def _fetch_attr(gm: fx.GraphModule, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj
