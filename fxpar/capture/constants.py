"""Constant folding: what a graph computes from its constants alone is computed once, at capture.

Models compute values that depend on no input, parameter or buffer: index lists of a fixed
sparsity pattern, position tables from ``arange``, a window mask, the counts a specialized
``.item()`` read from them. Under export each becomes a chain of small nodes (Qwen's
experimental per-query attention: 873 of its 5157 nodes) that every step recomputes and the
planner gives a sharding variable each, although their values never change.

:func:`fold_constants` evaluates them once on the CPU and keeps only the *frontier*: each
constant value a non-constant node (or the output) reads becomes a buffer of the graph module
read by a ``get_attr`` node (``meta[CONSTANT]``, as :func:`~fxpar.capture.cleanup.
constants_to_attrs` makes them; a Python number read where a number is expected becomes the
literal); the nodes only the frontier read go. A ``guard_value`` on a constant checks a value
that cannot change: it is evaluated (raising :class:`~fxpar.errors.GuardError` as it would at
run time) and goes. Folding is exact: the same ops run on the same values, once.

Not folded: random ops (``nondeterministic_seeded``) and uninitialized ``empty`` tensors (each
step draws anew), in-place ops, constants on ``meta``, values of more than
:data:`MAX_EVALUATED` elements on the way, and a frontier value of more than
:data:`MAX_FOLDED` elements (a mask ``[B, 1, L, S]`` expanded from a small table is cheaper to
recompute than to hold): there the region stays computed from the folded values before it.

>>> import torch
>>> class M(torch.nn.Module):
...     def forward(self, x):
...         i = torch.arange(4)
...         return x[:, (i * 3) % 4]
>>> from fxpar.capture import capture
>>> gm = capture(M(), (torch.randn(2, 4),))
>>> [n.op for n in gm.graph.nodes]
['placeholder', 'get_attr', 'call_function', 'output']
>>> getattr(gm, gm.graph.find_nodes(op="get_attr")[0].target).tolist()
[0, 3, 2, 1]
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.fx.node import map_arg

from fxpar import ir
from fxpar.capture.cleanup import _fetch_attr
from fxpar.runtime.guards import GUARD_VALUE

aten = torch.ops.aten

__all__ = ["fold_constants", "evaluate", "MAX_FOLDED", "MAX_EVALUATED"]

#: elements of the largest value kept as a folded constant (256 KiB of float32)
MAX_FOLDED = 1 << 16
#: elements of the largest value evaluated on the way to one
MAX_EVALUATED = 1 << 24


def fold_constants(gm: fx.GraphModule) -> int:
    """Fold as the module docstring says; returns how many nodes went."""
    graph = gm.graph
    const = _constant_nodes(gm)
    # a constant read by what stays (or the output) is kept: folded when it may be, else it
    # stays computed and what it reads is kept in turn (users before their inputs)
    stays: set[fx.Node] = set()
    kept: list[fx.Node] = []
    for n in reversed(graph.nodes):
        if n not in const:
            continue
        if n.target is GUARD_VALUE:
            kept.append(n)
        elif any(u not in const or u in stays for u in n.users):
            if n.op == "get_attr":
                continue
            if _foldable_value(n.meta.get(ir.VAL)) and not _renames_constant(n) \
                    and any(a.op == "call_function" for a in n.all_input_nodes):
                kept.append(n)
            else:
                stays.add(n)
    if not kept:
        return 0
    needed = _ancestors(kept, const)
    try:
        env = evaluate(gm, [n for n in graph.nodes if n in needed])
    except Exception:  # noqa: BLE001 - an op we cannot run on constants: leave the graph as is
        return 0
    before = len(graph.nodes)
    body = next(n for n in graph.nodes if n.op != "placeholder")  # placeholders stay first
    for n in kept:
        if n.target is GUARD_VALUE:
            graph.erase_node(n)
            continue
        v = env[n]
        if isinstance(v, torch.Tensor):
            attr = _free_name(gm, f"_folded_{n.name}")
            gm.register_buffer(attr, v.detach().clone(), persistent=False)
            with graph.inserting_before(body):
                new = graph.get_attr(attr)
            new.meta.update(n.meta)
            new.meta[ir.CONSTANT] = attr
            n.replace_all_uses_with(new)
        else:   # a number: the literal where it is read
            for u in list(n.users):
                u.args, u.kwargs = map_arg((u.args, u.kwargs), lambda a: v if a is n else a)
    for n in reversed(graph.nodes):   # what only the folded values read
        if n in const and not n.users and n.target is not GUARD_VALUE:
            graph.erase_node(n)
            if n.op == "get_attr" and not graph.find_nodes(op="get_attr", target=n.target) \
                    and "." not in n.target:
                delattr(gm, n.target)   # a constant nothing reads any more
    gm.recompile()
    return before - len(graph.nodes)


def evaluate(gm: fx.GraphModule, nodes: list[fx.Node]) -> dict[fx.Node, object]:
    """The values of ``nodes`` (in graph order, closed under inputs) computed on the CPU from
    the graph module's constants."""
    env: dict[fx.Node, object] = {}
    cpu = torch.device("cpu")
    for n in nodes:
        if n.op == "get_attr":
            v = _fetch_attr(gm, n.target)
            if isinstance(v, torch.Tensor) and v.device.type == "meta":
                raise ValueError("a constant on meta")
            env[n] = v.to(cpu) if isinstance(v, torch.Tensor) else v
            continue
        args, kwargs = map_arg((n.args, n.kwargs), env.__getitem__)
        if "device" in kwargs:
            kwargs = {**kwargs, "device": cpu}
        env[n] = n.target(*args, **kwargs)
    return env


def _constant_nodes(gm: fx.GraphModule) -> set[fx.Node]:
    """Nodes computed from constants alone by ops that give the same values every step."""
    const: set[fx.Node] = set()
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            v = n.meta.get(ir.VAL)
            if isinstance(v, torch.Tensor) and v.numel() <= MAX_EVALUATED and v.device.type != "meta":
                const.add(n)
        elif n.op == "call_function" and _deterministic(n) \
                and all(a in const for a in n.all_input_nodes) and _evaluable(n.meta.get(ir.VAL)):
            const.add(n)
    return const


def _deterministic(n: fx.Node) -> bool:
    if n.target is GUARD_VALUE:
        return True
    if n.is_impure():
        return False
    tags = getattr(n.target, "tags", ())
    name = getattr(n.target, "__name__", "")
    return torch.Tag.nondeterministic_seeded not in tags and "empty" not in name


def _evaluable(v) -> bool:
    if isinstance(v, torch.Tensor):
        return v.numel() <= MAX_EVALUATED
    if isinstance(v, (tuple, list)):
        return all(_evaluable(x) for x in v)
    return v is None or isinstance(v, (bool, int, float))


def _foldable_value(v) -> bool:
    """A static-shape tensor of at most :data:`MAX_FOLDED` elements, or a number."""
    if isinstance(v, torch.Tensor):
        return all(isinstance(d, int) for d in v.shape) and v.numel() <= MAX_FOLDED
    return isinstance(v, (bool, int, float))


#: single-input ops that hand a constant on as it is (export lifts ``torch.tensor(...)`` as
#: ``lift_fresh_copy`` of a constant): folding them would only rename the constant
_AS_IS = {aten.lift_fresh_copy.default, aten.alias.default, aten.clone.default,
          aten.detach.default, aten.to.dtype, aten.contiguous.default}


def _renames_constant(n: fx.Node) -> bool:
    while n.op == "call_function" and n.target in _AS_IS and len(n.all_input_nodes) == 1:
        n = n.all_input_nodes[0]
    return n.op == "get_attr"


def _ancestors(nodes: list[fx.Node], within: set[fx.Node]) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    stack = list(nodes)
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(a for a in n.all_input_nodes if a in within)
    return seen


def _free_name(gm: fx.GraphModule, base: str) -> str:
    name, k = base, 0
    while hasattr(gm, name):
        k += 1
        name = f"{base}_{k}"
    return name
