"""Grouped GEMMs whose group sizes are read from tensor data, made static and exact.

A mixture of experts that sorts its tokens by expert and multiplies each expert's rows by
that expert's weight (JetMoE's ``ParallelExperts``: ``x.split(expert_size.tolist())``, one
``linear`` per piece, ``cat``) reads the group sizes with ``.tolist()``. Capture specializes
such a read to the example's values and guards it (:mod:`fxpar.capture.specialize`), and
the sizes change every step, so training stopped at the second step with a
:class:`~fxpar.errors.GuardError`. When those sizes feed nothing but such splits, the
pattern::

    pieces = split_with_sizes(x, sizes)            # sizes == guard_value(counts)'s list
    out = cat([linear(pieces[i], w_i, b_i) for i in range(E)])   # in order, dim 0

is rewritten to the same rows computed with static shapes from the run-time ``counts``
tensor (``ends = cumsum(counts)``, ``starts = ends - counts``, ``r = arange(N)``)::

    out = where(starts[E-1] <= r < ends[E-1], linear(x, w_{E-1}, b_{E-1}), ...
            where(starts[0] <= r < ends[0], linear(x, w_0, b_0), 0))

Row ``r`` of group ``i`` is ``linear(x[r], w_i, b_i)``, as before, for any sizes; the gradient
of ``where`` routes each row's gradient to its group's weight alone. It costs ``E`` times the
GEMM work (a dense grouped GEMM; the planner prices it so), and the guard goes.

Only when it is safe: two more exports, each with those reads replaced by other sizes of the
same sum (:func:`other_sizes`: pairwise distinct, different from the read's at every
position), must show the reads reach nothing but these splits: the graphs differ in the
splits' sizes and the guards' values alone. Anything else keeps its guard.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.fx as fx

from fxpar import ir
from fxpar.runtime.guards import GUARD_VALUE

__all__ = ["GroupedLinear", "grouped_linears", "densify", "other_sizes", "altered_reads",
           "graph_key"]

_aten = torch.ops.aten


@dataclass(frozen=True)
class GroupedLinear:
    """One match: the ``guard`` whose list the ``split`` uses as sizes, the per-piece
    ``linears`` in order and the ``cat`` of their outputs."""

    guard: fx.Node
    split: fx.Node
    linears: tuple[fx.Node, ...]
    cat: fx.Node


def _where_from(src: fx.Node, dst: fx.Node) -> None:
    """``dst`` takes ``src``'s module path and source line (what explain and errors show)."""
    dst.meta.update({k: src.meta[k] for k in (ir.NN_MODULE_STACK, ir.STACK_TRACE) if k in src.meta})


def grouped_linears(gm: fx.GraphModule) -> list[GroupedLinear]:
    """Every ``split_with_sizes → linear per piece → cat`` (module docstring) whose sizes are
    the list of exactly one guarded read (of a 1-d integer tensor), in graph order."""
    by_list: dict[tuple, list[fx.Node]] = {}
    for g in gm.graph.find_nodes(op="call_function", target=GUARD_VALUE):
        by_list.setdefault(tuple(g.args[1]), []).append(g)
    # a list two reads returned alike cannot say which read's tensor sized the split
    by_list = {k: gs[0] for k, gs in by_list.items() if len(gs) == 1
               and isinstance(t := gs[0].args[0].meta.get(ir.VAL), torch.Tensor)
               and t.ndim == 1 and not t.dtype.is_floating_point}
    out = []
    for s in gm.graph.find_nodes(op="call_function", target=_aten.split_with_sizes.default):
        sizes = tuple(s.args[1])
        dim = s.args[2] if len(s.args) > 2 else s.kwargs.get("dim", 0)
        g = by_list.get(sizes)
        if g is None or dim != 0 or len(s.users) != len(sizes):
            continue
        items = {}
        for u in s.users:
            if u.target is operator.getitem and len(u.users) == 1:
                lin = next(iter(u.users))
                if lin.target is _aten.linear.default and lin.args[0] is u and u not in lin.args[1:]:
                    items[u.args[1]] = lin
        if sorted(items) != list(range(len(sizes))):
            continue
        lins = tuple(items[i] for i in range(len(sizes)))
        cats = {next(iter(lin.users)) for lin in lins if len(lin.users) == 1}
        if len(cats) != 1:
            continue
        cat = cats.pop()
        cdim = cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
        if cat.target is _aten.cat.default and list(cat.args[0]) == list(lins) and cdim == 0:
            out.append(GroupedLinear(g, s, lins, cat))
    return out


def densify(gm: fx.GraphModule, groups: list[GroupedLinear]) -> None:
    """Rewrite each match (module docstring) in place and remove the guards whose lists no
    split keeps. New nodes get fake values."""
    from fxpar.capture.cleanup import fill_missing_vals

    graph = gm.graph
    for m in groups:
        x, counts = m.split.args[0], m.guard.args[0]
        n_rows = x.meta[ir.VAL].shape[0]
        with graph.inserting_before(m.cat):
            ends = graph.call_function(_aten.cumsum.default, (counts, 0))
            starts = graph.call_function(_aten.sub.Tensor, (ends, counts))
            rows = graph.call_function(_aten.arange.default, (n_rows,),
                                       {"dtype": counts.meta[ir.VAL].dtype,
                                        "device": counts.meta[ir.VAL].device})
            acc = None
            for i, lin in enumerate(m.linears):
                y = graph.call_function(_aten.linear.default, (x, *lin.args[1:]), dict(lin.kwargs))
                _where_from(lin, y)
                lo = graph.call_function(_aten.select.int, (starts, 0, i))
                hi = graph.call_function(_aten.select.int, (ends, 0, i))
                inside = graph.call_function(_aten.logical_and.default, (
                    graph.call_function(_aten.ge.Tensor, (rows, lo)),
                    graph.call_function(_aten.lt.Tensor, (rows, hi))))
                mask = graph.call_function(_aten.unsqueeze.default, (inside, -1))
                if acc is None:
                    acc = graph.call_function(_aten.zeros_like.default, (y,))
                acc = graph.call_function(_aten.where.self, (mask, y, acc))
        _where_from(m.cat, acc)
        m.cat.replace_all_uses_with(acc)
        for n in (m.cat, *m.linears, *[u for lin in m.linears for u in lin.args[:1]], m.split):
            graph.erase_node(n)
    kept = {tuple(s.args[1]) for s in graph.find_nodes(op="call_function",
                                                       target=_aten.split_with_sizes.default)}
    for g in {m.guard for m in groups}:
        if tuple(g.args[1]) not in kept:
            graph.erase_node(g)
    fill_missing_vals(gm)
    graph.lint()
    gm.recompile()


def other_sizes(v: list[int], shift: int = 0) -> list[int] | None:
    """A list of positive ints of ``v``'s length and sum whose entries are pairwise distinct
    and differ from ``v``'s at every position (rotated by ``shift`` among such lists), so that
    no value ``v`` returned can stand in another export unchanged (positive: an empty piece
    is dropped from a ``cat`` at capture); ``None`` when ``v`` is too small to have one.

    >>> other_sizes([4, 6, 10, 4]), other_sizes([4, 6, 10, 4], shift=1)
    ([1, 2, 3, 18], [18, 1, 2, 3])
    """
    n, total = len(v), sum(v)
    base = list(range(1, n))
    last = total - sum(base)
    if n < 2 or last < n or min(v) < 0:
        return None
    alt = base + [last]
    for k in range(n):
        r = (k + shift) % n
        rot = alt[n - r:] + alt[:n - r]
        if all(a != b for a, b in zip(rot, v)):
            return rot
    return None


def altered_reads(reads: dict, lists: set[tuple], shift: int = 0) -> dict | None:
    """``reads`` with every ``.tolist()`` of a 1-d integer tensor whose value is in ``lists``
    replaced by :func:`other_sizes` of it (``shift``: another such list), for a second
    export; ``None`` when some such read cannot be altered."""
    import dataclasses

    out = {}
    for site, rs in reads.items():
        new = []
        for r in rs:
            v = r.value
            if r.kind == "tolist" and isinstance(v, list) and tuple(v) in lists:
                alt = other_sizes(v, shift) if all(isinstance(x, int) for x in v) else None
                if alt is None:
                    return None
                r = dataclasses.replace(r, value=alt)
            new.append(r)
        out[site] = new
    return out


def graph_key(gm: fx.GraphModule, ignore: Callable[[fx.Node], bool]) -> list[tuple]:
    """Each node's op, target and arguments (input nodes by name), in order; the arguments
    of nodes ``ignore`` accepts left out: what two exports must share."""
    out = []
    for n in gm.graph.nodes:
        args = None if ignore(n) else repr(fx.node.map_arg((n.args, n.kwargs), lambda a: a.name))
        out.append((n.op, str(n.target), args))
    return out
