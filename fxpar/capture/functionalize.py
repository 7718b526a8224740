"""In-place writes made functional: the captured graph's dataflow is its whole meaning.

fxpar plans a graph by its edges: a node's users read its value, and a consumer that needs
another layout reads a *resharded copy*. An in-place op breaks that: ``copy_(slice(q, ...), k)``
writes into ``q``'s memory, and every later reader of ``q`` (or of another view of it) sees the
write without an edge saying so. Once the slice is a resharded copy, the write lands in the copy
and ``q`` stays as it was (uninitialized, for the ``new_empty`` MLA attention builds its queries
in): a silently wrong program.

:func:`functionalize_mutations` rewrites every in-place ATen op ``op_(a, ...)`` on an
intermediate value (not a parameter, buffer or input: those are state updates, kept) into its
functional form and writes the result back up ``a``'s chain of views to the base ``b`` it
aliases (found from the fake values' storages) with the inverse of each view::

    e = new_empty(...)          e = new_empty(...)
    s = slice(e, 3, 0, 8)       s = slice(e, 3, 0, 8)
    copy_(s, k)          ->     c = alias(k)       # copy_'s functional form: k as s's dtype/shape
    sdpa(q, e, v)               e2 = slice_scatter(e, c, 3, 0, 8)     # b's new value
                                sdpa(q, e2, v)                        # later readers of e

Every later use (graph order) of ``b``, of a view of ``b`` made before the write, or of the
in-place node itself reads the new value (views re-derived from it). Inverses: ``slice``/
``narrow`` → ``slice_scatter``, ``select`` → ``select_scatter``, ``diagonal`` →
``diagonal_scatter``, ``as_strided`` → ``as_strided_scatter``, a ``getitem`` of ``split``/
``split_with_sizes``/``chunk``/``unbind`` → the slice or select it is, shape views (``view``,
``reshape``, ``transpose``, ``permute``, ``unsqueeze``, ``squeeze``, ``t``, ``flatten``...)
→ the inverse reshape or permutation, ``alias``/``detach``/an aliasing ``contiguous`` or
``to`` → identity. A chain with another view (``expand``, ``view.dtype``...) raises
:class:`~fxpar.CaptureError` naming the write and the view: fxpar never runs a write it cannot
place. Random in-place fills (``uniform_``...) are left to :mod:`fxpar.runtime.rng`, in-place
metadata changes (``resize_``, ``unsqueeze_``...) to their own strategies.

>>> import torch
>>> class M(torch.nn.Module):
...     def forward(self, x):
...         e = x.new_empty(2, 4)
...         e[:, :2].copy_(x)
...         e[:, 2:].copy_(x * 2)
...         return e.sum()
>>> from fxpar.capture import capture   # (capture then drops the slices nothing reads
>>> gm = capture(M(), (torch.ones(2, 2),))  # and the aliases: cleanup.drop_identities)
>>> [str(n.target).removeprefix("aten.") for n in gm.graph.nodes if n.op == "call_function"]
['new_empty.default', 'slice_scatter.default', 'mul.Tensor', 'slice_scatter.default', 'sum.default']
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef

from fxpar import ir
from fxpar.errors import CaptureError

__all__ = ["functionalize_mutations"]

aten = torch.ops.aten

#: in-place random fills: keyed per shard by the runtime (fxpar.runtime.rng), not rewritten here
_RANDOM = {"uniform_", "normal_", "bernoulli_", "exponential_", "random_", "geometric_",
           "cauchy_", "log_normal_"}
#: in-place changes of a tensor's metadata, not its data (planned by their own rules)
_METADATA = {"resize_", "resize_as_", "set_", "as_strided_", "squeeze_", "unsqueeze_",
             "transpose_", "t_", "swapdims_", "swapaxes_", "detach_", "requires_grad_"}
#: views whose inverse is the identity when they alias their input
_SAME = {"alias", "detach", "contiguous", "to", "_to_copy", "lift_fresh"}
#: views whose inverse is a reshape to the input's shape
_RESHAPE = {"view", "reshape", "_unsafe_view", "flatten", "unflatten", "view_as", "squeeze",
            "unsqueeze", "_reshape_alias"}
#: multi-output ops whose pieces are views of their input along ``dim``
_SPLITS = {"split", "split_with_sizes", "chunk", "unbind", "tensor_split", "unsafe_split",
           "unsafe_split_with_sizes"}


def _name(target) -> str:
    return getattr(getattr(target, "overloadpacket", None), "__name__", "")


def _storage(v):
    """A key of ``v``'s storage (``None`` for a non-tensor); hashable, compares by identity."""
    return StorageWeakRef(v.untyped_storage()).cdata if isinstance(v, torch.Tensor) else None


def _functional(n: fx.Node):
    """The functional overload of in-place ATen op ``n`` (``None``: not an in-place write of
    its first argument we rewrite)."""
    t = n.target
    if not isinstance(t, torch._ops.OpOverload) or t.namespace != "aten":
        return None
    args = t._schema.arguments
    if not args or args[0].alias_info is None or not args[0].alias_info.is_write:
        return None
    base = _name(t)
    if not base.endswith("_") or base in _RANDOM or base in _METADATA or any(a.kwarg_only and a.name == "out" for a in args):
        return None
    packet = getattr(aten, base[:-1], None)
    if packet is None:
        return None
    return getattr(packet, t._overloadname, None)


def _call_functional(graph: fx.Graph, m: fx.Node, fn) -> fx.Node:
    """``fn(*m.args)``; ``copy_(a, src)`` (``aten.copy`` has no derivative) becomes ``src``
    converted to ``a``'s dtype and broadcast to its shape, what ``copy_`` writes."""
    if fn is not aten.copy.default:
        return graph.call_function(fn, m.args, m.kwargs)
    a, src = m.args[0].meta[ir.VAL], m.args[1]
    x = src
    if src.meta[ir.VAL].dtype != a.dtype:
        x = graph.call_function(aten._to_copy.default, (x,), {"dtype": a.dtype})
    if tuple(src.meta[ir.VAL].shape) != tuple(a.shape):
        x = graph.call_function(aten.expand.default, (x, list(a.shape)))
    return graph.call_function(aten.alias.default, (x,)) if x is src else x


def _parent(v: fx.Node) -> fx.Node | None:
    """The node ``v`` is a view of (its first tensor input, or for a ``getitem`` the split's
    input), when their fake values share storage; else ``None``."""
    src = v.args[0] if v.args else None
    if v.target is operator.getitem:
        if not isinstance(src, fx.Node) or not src.args or not isinstance(src.args[0], fx.Node):
            return None
        src = src.args[0]
    key = _storage(src.meta.get(ir.VAL)) if isinstance(src, fx.Node) else None
    return src if key is not None and key == _storage(v.meta.get(ir.VAL)) else None


def _inverse(graph: fx.Graph, view: fx.Node, parent: fx.Node, child_new: fx.Node) -> fx.Node:
    """A node for ``parent``'s value after its view ``view`` took the value ``child_new``."""
    t, name = view.target, _name(view.target)
    pv = parent.meta[ir.VAL]
    a = view.args

    def call(op, *args):   # ``None`` first: the parent's old value, scattered into
        return graph.call_function(op, (parent if args[0] is None else args[0], *args[1:]))

    if t is operator.getitem:
        split, k = view.args[0], view.args[1]
        op = _name(split.target)
        if op not in _SPLITS:
            raise _unplaceable(view, op)
        dim = _dim(split, op)
        outs = split.meta[ir.VAL]
        if op == "unbind":
            return call(aten.select_scatter.default, None, child_new, dim, k)
        start = sum(o.shape[dim] for o in outs[:k])
        return call(aten.slice_scatter.default, None, child_new, dim, start,
                    start + outs[k].shape[dim])
    if name == "slice":
        dim, start, end, step = (list(a[1:]) + [0, None, None, 1][len(a) - 1:])[:4]
        return call(aten.slice_scatter.default, None, child_new, dim, start, end, step)
    if name == "narrow":
        return call(aten.slice_scatter.default, None, child_new, a[1], a[2], a[2] + a[3])
    if name == "select":
        return call(aten.select_scatter.default, None, child_new, a[1], a[2])
    if name == "diagonal":
        rest = list(a[1:]) + [0, 0, 1][len(a) - 1:]
        return call(aten.diagonal_scatter.default, None, child_new, *rest[:3])
    if name == "as_strided":
        return call(aten.as_strided_scatter.default, None, child_new, *a[1:])
    if name in _SAME:
        return child_new
    if name in _RESHAPE and t is not aten.view.dtype:
        return call(aten.reshape.default, child_new, list(pv.shape))
    if name in ("transpose", "swapaxes", "swapdims"):
        return call(aten.transpose.int, child_new, a[1], a[2])
    if name == "t":
        return call(aten.t.default, child_new)
    if name == "permute":
        dims = [d % pv.ndim for d in a[1]]
        return call(aten.permute.default, child_new, [dims.index(i) for i in range(pv.ndim)])
    raise _unplaceable(view, name)


def _dim(split: fx.Node, op: str) -> int:
    if op == "unbind":
        d = split.args[1] if len(split.args) > 1 else split.kwargs.get("dim", 0)
    else:
        d = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
    return d % split.args[0].meta[ir.VAL].ndim


def _unplaceable(view: fx.Node, op: str) -> CaptureError:
    return CaptureError(f"node {view.name} ({op}): an in-place write reaches its base through this "
                        "view, which fxpar cannot invert; write to a fresh tensor (e.g. torch.cat "
                        "the pieces) instead of through the view")


def functionalize_mutations(gm: fx.GraphModule) -> int:
    """Rewrite in-place writes to intermediates as the module docstring says; returns how
    many were rewritten. New nodes take the write's layer and stack meta and get fake values
    (so later writes in the same graph see their storages)."""
    from fxpar.capture.cleanup import _fake_mode_of

    graph = gm.graph
    mode = _fake_mode_of(gm)
    done = 0
    for m in list(graph.nodes):
        fn = _functional(m) if m.op == "call_function" else None
        if fn is None or not isinstance(m.args[0], fx.Node):
            continue
        chain = [m.args[0]]   # a, then its parents up to the base
        while (p := _parent(chain[-1])) is not None:
            chain.append(p)
        base = chain[-1]
        if base.op != "call_function":   # a parameter, buffer or input: a state update, kept
            continue
        done += 1
        order = {n: i for i, n in enumerate(graph.nodes)}
        later = [u for u in graph.nodes if order[u] > order[m]]
        sid = _storage(base.meta[ir.VAL])
        aliases = {v for v in graph.nodes if order[v] < order[m] and v is not base
                   and any(_storage(x) == sid for x in _vals(v))}
        meta = {k: m.meta[k] for k in (ir.NN_MODULE_STACK, ir.STACK_TRACE) if k in m.meta}

        def made(x: fx.Node, own: bool = False) -> fx.Node:
            if not own:
                x.meta.update(meta)
            if mode is not None:
                args, kwargs = fx.node.map_arg((x.args, x.kwargs), lambda a: a.meta[ir.VAL])
                with mode:
                    x.meta[ir.VAL] = x.target(*args, **kwargs)
            return x

        with graph.inserting_after(m):
            new = made(_call_functional(graph, m, fn))
        cur = new
        for view, parent in zip(chain, chain[1:]):
            with graph.inserting_after(cur):
                cur = made(_inverse(graph, view, parent, cur))
        remap: dict[fx.Node, fx.Node] = {base: cur, m: new}
        last = cur

        def rederive(v: fx.Node) -> fx.Node:   # an older view of the base, taken again
            nonlocal last
            if v not in remap:
                # its inputs first (each after ``last``), then the copy after them: copied
                # inside one insertion point, a parent taken again in the copy's argument
                # map landed after it (a view of a view of the base read after the write)
                for a in v.all_input_nodes:
                    if a in remap or a in aliases:
                        rederive(a)
                with graph.inserting_after(last):
                    c = graph.node_copy(v, lambda a: remap.get(a, a))
                remap[v] = last = made(c)
            return remap[v]

        for u in later:
            if any(a in remap or a in aliases for a in u.all_input_nodes):
                u.args, u.kwargs = fx.node.map_arg(
                    (u.args, u.kwargs), lambda a: rederive(a) if a in remap or a in aliases else a)
            if any(_storage(x) == sid for x in _vals(u)):
                made(u, own=True)   # a later view of the old base: now one of the new (its storage)
        name = m.name
        graph.erase_node(m)
        new._rename(name)   # the write keeps its name (graphs and plans read by it)
    if done:
        graph.lint()
        gm.recompile()
    return done


def _vals(v: fx.Node) -> list:
    val = v.meta.get(ir.VAL)
    return list(val) if isinstance(val, (list, tuple)) else [val]
