"""Data-dependent values: a Python value read from tensor data that sets a size or a branch is
specialized to the example inputs' value and guarded at run time.

fxpar plans static shapes and static control flow, so ``k = n.sum().item()`` followed by
``x[:k]`` (a size), ``if t.max().item() > 0`` (a branch) or ``x.split(counts.tolist())`` (a
data-dependent split, as MoE routers do) cannot stay symbolic. When a plain export leaves such
a read (:func:`reads_to_specialize`, or export failing on a guard over one), capture runs the
model once eagerly on the real example inputs (:func:`record_reads`) and exports it again with
every ``.item()`` / ``.tolist()`` returning the value that run read (:func:`replaying`). Each
read becomes ``torch.ops.fxpar.guard_value(t, expected, where)`` in the graph
(:mod:`fxpar.runtime.guards`): a step whose value differs raises
:class:`~fxpar.errors.GuardError` naming the guard node, the read's source line and both
values, instead of computing with a wrong size or branch.

Contract:

* Reads are matched between the eager run and the trace by their call site (the file and line
  of the caller of ``.item()``/``.tolist()``) and their order at that site, so reads only the
  eager run makes (code that skips checks while tracing) are ignored; a read the trace makes
  that the eager run did not is a :class:`~fxpar.errors.CaptureError` naming the line.
* The graph keeps the reads it replayed (``gm.meta[ir.READS]``): ``Program.save`` writes them
  (:func:`reads_to_json`) and :func:`fxpar.load` captures with them again
  (``capture(..., reads=...)``), since the file's inputs are only shapes.
* The eager run changes nothing: no gradient, buffers (BatchNorm statistics) updated on
  copies, the RNG state restored. It needs real tensors: example inputs or weights on the
  ``meta`` device or fake raise :class:`CaptureError` saying to pass real example inputs.
* Only explicit reads are specialized (``.item()``, ``.tolist()``), and the size of
  ``nonzero``/``argwhere``/``where(cond)`` (its count guarded, the op replaced by
  ``nonzero_static`` of that size) when export failed on a guard: a loop over the hit experts
  of an MoE router (``for e in mask.nonzero():``), LongCat-Flash's. Implicit reads
  (``if t:``, ``int(t)``) stay capture errors, and so does a data-dependent output shape
  (``nonzero``, boolean masks) that only flows through the graph. A read whose value is used
  only as a number in the computation (``x * t.item()``) is refused, not specialized (every
  new batch would fail its guard): :func:`reads_to_specialize` returns nothing for it. Once a
  model needs specializing, every read is specialized.

Example (a read that sets a size)::

    >>> import torch
    >>> class Head(torch.nn.Module):
    ...     def forward(self, x, n):
    ...         return x[: n.max().item()].sum(0)
    >>> from fxpar.capture import capture, run_captured
    >>> x, n = torch.randn(6, 3), torch.tensor([2, 4])
    >>> gm = capture(Head(), (x, n))
    >>> [(g.name, g.args[1], g.args[2]) for g in guards(gm)]  # doctest: +ELLIPSIS
    [('guard_value', [4], 'node guard_value: `return x[: n.max().item()].sum(0)` ...')]
    >>> torch.equal(run_captured(gm, Head(), x, n), x[:4].sum(0))
    True
    >>> run_captured(gm, Head(), x, torch.tensor([5, 1]))
    Traceback (most recent call last):
    ...
    fxpar.errors.GuardError: node guard_value: ... read 4 when the model was captured and reads 5 in this step; ...
"""

from __future__ import annotations

import contextlib
import linecache
import os
import sys
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode

from fxpar import ir
from fxpar.errors import CaptureError
from fxpar.runtime.guards import GUARD_VALUE

__all__ = ["Read", "record_reads", "replaying", "reads_to_specialize", "name_guards", "guards",
           "reads_to_json", "reads_from_json", "READ_OPS"]

#: the ATen ops a plain export records for ``.item()`` (``tolist`` reads element by element)
READ_OPS = (torch.ops.aten.item.default, torch.ops.aten._local_scalar_dense.default)
_VALUE_READS = (torch.Tensor.item, torch.Tensor.tolist)
#: ops whose output size is a count read from the data (``torch.where(cond)`` is one too)
_NONZERO = (torch.nonzero, torch.Tensor.nonzero, torch.argwhere, torch.Tensor.argwhere)

Site = tuple[str, int]
#: export's node meta naming the unbacked symbols a node allocates (torch's key)
_UNBACKED_BINDINGS = "unbacked_bindings"


@dataclass(frozen=True)
class Read:
    """One ``.item()``/``.tolist()`` of the eager run: where (``site``: file, line; ``index``:
    its order at that site), what (``kind``, the tensor's ``shape`` and ``dtype``) and the
    Python value it returned."""

    site: Site
    index: int
    kind: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    value: Any

    def flat(self) -> list:
        """The value's elements, row-major (what the guard compares)."""
        return list(pytree.tree_leaves(self.value))


def reads_to_json(reads: dict[Site, list[Read]]) -> list[dict]:
    """``reads`` as plain JSON data (:func:`reads_from_json` inverts it; floats round-trip).

    >>> r = {("m.py", 3): [Read(("m.py", 3), 0, "tolist", (2,), torch.int64, [4, 1])]}
    >>> reads_from_json(reads_to_json(r)) == r
    True
    """
    return [dict(site=list(r.site), index=r.index, kind=r.kind, shape=list(r.shape),
                 dtype=str(r.dtype).removeprefix("torch."), value=r.value)
            for rs in reads.values() for r in rs]


def reads_from_json(data: list[dict]) -> dict[Site, list[Read]]:
    out: dict[Site, list[Read]] = defaultdict(list)
    for d in sorted(data, key=lambda d: (tuple(d["site"]), d["index"])):
        site = (d["site"][0], int(d["site"][1]))
        out[site].append(Read(site, d["index"], d["kind"], tuple(d["shape"]),
                              getattr(torch, d["dtype"]), d["value"]))
    return dict(out)


def _site() -> Site:
    """The caller of ``.item()``/``.tolist()``: the first frame outside this module."""
    f = sys._getframe(1)
    while f is not None and f.f_code.co_filename == __file__:
        f = f.f_back
    return (f.f_code.co_filename, f.f_lineno) if f is not None else ("<unknown>", 0)


def _describe(kind: str, site: Site) -> str:
    """``"`SOURCE LINE` at FILE:LINE"`` (``.item() at FILE:LINE`` without the source); for a
    ``nonzero`` read, ``"the number of nonzero elements in ..."``."""
    path, line = site
    src = linecache.getline(path, line).strip()
    rel = os.path.relpath(path) if not os.path.relpath(path).startswith("..") else path
    at = f"`{src[:100]}` at {rel}:{line}" if src else f".{kind}() at {rel}:{line}"
    return f"the number of nonzero elements in {at}" if kind == "nonzero" else at


def _kind(func, args: tuple, kwargs: dict | None) -> str | None:
    """What a call reads from tensor data: ``"item"``, ``"tolist"``, ``"nonzero"`` (the size
    of ``nonzero``/``argwhere``/``where(cond)``), or ``None``."""
    if not args or not isinstance(args[0], torch.Tensor):
        return None
    if func in _VALUE_READS:
        return func.__name__
    if func in _NONZERO or (func is torch.where and len(args) == 1 and not kwargs):
        return "nonzero"
    return None


def _count(out: Any) -> int:
    """The number of nonzero elements from ``nonzero``'s output (a tuple with as_tuple)."""
    return int((out[0] if isinstance(out, (tuple, list)) else out).shape[0])


class _Recorder(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.reads: dict[Site, list[Read]] = defaultdict(list)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        kind = _kind(func, args, kwargs)
        if kind is not None:
            site, t = _site(), args[0]
            self.reads[site].append(Read(site, len(self.reads[site]), kind, tuple(t.shape),
                                         t.dtype, _count(out) if kind == "nonzero" else out))
        return out


def _fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor) or t.is_meta


def record_reads(model: torch.nn.Module, args: tuple, kwargs: dict) -> dict[Site, list[Read]]:
    """Run ``model(*args, **kwargs)`` once eagerly and return its ``.item()``/``.tolist()``
    reads by call site (see the module docstring: nothing of the model changes). Raises
    :class:`CaptureError` when an input or weight is fake or on ``meta`` (no value to read),
    or when the run fails."""
    state = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers(remove_duplicate=False))
    fake = [f"input {pytree.keystr(p)}" for p, t in pytree.tree_flatten_with_path((args, kwargs))[0]
            if isinstance(t, torch.Tensor) and _fake(t)]
    fake += [f"weight {n}" for n, t in {**state, **buffers}.items() if _fake(t)]
    if fake:
        raise CaptureError(
            f"{type(model).__name__} reads a value from tensor data (.item()/.tolist()) that "
            "sets a size or a branch; fxpar specializes such a value to the example inputs' and "
            "guards it at run time, which needs real example inputs and weights, but "
            f"{', '.join(fake[:3])}{' ...' if len(fake) > 3 else ''} "
            f"{'is' if len(fake) == 1 else 'are'} on the meta device or fake: pass real ones")
    devices = [torch.cuda.current_device()] if torch.cuda.is_initialized() else []
    copies = {n: b.clone() for n, b in buffers.items()}  # BatchNorm updates its statistics
    rec = _Recorder()
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=devices), rec:
            torch.func.functional_call(model, copies, args, kwargs, strict=False)
    except Exception as e:
        raise CaptureError(
            f"running {type(model).__name__} eagerly on the example inputs, to read the values "
            f"it takes from tensor data (.item()/.tolist()), failed: {type(e).__name__}: "
            f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}") from e
    return dict(rec.reads)


class _Replayer(TorchFunctionMode):
    def __init__(self, reads: dict[Site, list[Read]]) -> None:
        super().__init__()
        self.reads, self.seen = reads, defaultdict(int)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kind = _kind(func, args, kwargs)
        if kind is None:
            return func(*args, **(kwargs or {}))
        t, site = args[0], _site()
        k = self.seen[site]
        self.seen[site] += 1
        if not _fake(t):  # a real tensor under tracing is a constant: its value is static
            return func(*args, **(kwargs or {}))
        done = self.reads.get(site, [])
        if k >= len(done):
            raise CaptureError(
                f"{_describe(kind, site)} read a value from tensor data while tracing "
                f"that the eager run on the example inputs did not read ({len(done)} reads "
                "there): the model takes another path when traced")
        r = done[k]
        if tuple(t.shape) != r.shape or t.dtype != r.dtype or kind != r.kind:
            raise CaptureError(
                f"{_describe(kind, site)}: read {k} there is a {kind} of a {t.dtype} tensor of "
                f"shape {tuple(t.shape)} while tracing, but a {r.kind} of {r.dtype} {r.shape} "
                "in the eager run on the example inputs: the model takes another path when "
                "traced")
        where = _describe(r.kind, site)
        if kind != "nonzero":
            GUARD_VALUE(t, r.flat(), where)  # recorded by export as a graph node
            return r.value
        # the count guarded, the indices a static-size nonzero (exact under the guard)
        GUARD_VALUE((t != 0).sum(), [r.value], where)
        out = torch.nonzero_static(t, size=r.value)
        as_tuple = func is torch.where or bool((kwargs or {}).get("as_tuple"))
        return out.unbind(1) if as_tuple else out


def _tolist_via_torch_function(self):
    # FakeTensor.tolist reads element by element in Python, out of a TorchFunctionMode's sight:
    # the base method dispatches ``Tensor.tolist`` to the mode as the eager run saw it.
    return torch.Tensor.tolist(self)


@contextlib.contextmanager
def replaying(model: torch.nn.Module, reads: dict[Site, list[Read]]) -> Iterator[None]:
    """While exporting ``model``: each ``.item()``/``.tolist()`` of a traced tensor in its
    forward returns the value ``reads`` holds for it and leaves a ``guard_value`` node.
    ``model.forward`` is wrapped as an instance attribute, removed again after."""
    import functools

    from torch._subclasses.fake_tensor import FakeTensor

    had = "forward" in model.__dict__
    orig = model.forward
    tolist = FakeTensor.__dict__.get("tolist")

    @functools.wraps(orig)
    def forward(*a: Any, **k: Any) -> Any:
        with _Replayer(reads):
            return orig(*a, **k)

    model.forward = forward  # type: ignore[method-assign]
    FakeTensor.tolist = _tolist_via_torch_function  # type: ignore[method-assign]
    try:
        yield
    finally:
        if tolist is not None:
            FakeTensor.tolist = tolist  # type: ignore[method-assign]
        if had:
            model.forward = orig  # type: ignore[method-assign]
        else:
            del model.forward


def guards(gm: fx.GraphModule) -> list[fx.Node]:
    """The ``guard_value`` nodes of a graph, in order."""
    return list(gm.graph.find_nodes(op="call_function", target=GUARD_VALUE))


def name_guards(gm: fx.GraphModule, reads: dict[Site, list[Read]]) -> None:
    """Prefix each guard's ``where`` with its node name (known only once export named it);
    keep the ``reads`` replayed in ``gm.meta[ir.READS]``."""
    gm.meta[ir.READS] = reads
    for n in guards(gm):
        x, expected, where = n.args
        if not where.startswith("node "):
            n.args = (x, expected, f"node {n.name}: {where}")
    gm.recompile()


def _syms(v: Any) -> set:
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    try:
        return set(free_unbacked_symbols(v))
    except Exception:  # noqa: BLE001 - a value it cannot walk holds no symbol
        return set()


def reads_to_specialize(gm: fx.GraphModule) -> list[fx.Node]:
    """The read nodes (``aten.item``) of a plainly exported graph whose value sets a size (its
    symbol is in a tensor's shape) or a branch (in a run-time assertion export left: a Python
    ``assert``, a size check); empty when there is none, or when a value known only at run time
    comes from elsewhere too (``nonzero``: specializing the reads cannot make it static).

    >>> import torch
    >>> from fxpar.capture.export import export_graph
    >>> class Scale(torch.nn.Module):
    ...     def forward(self, x, n):
    ...         return x * n.sum().item(), torch.zeros(n.max().item())
    >>> gm = export_graph(Scale(), (torch.randn(3), torch.tensor([1, 2])), {}, strict=False,
    ...                  decompose=False)
    >>> [n.name for n in reads_to_specialize(gm)]  # the second read sets a size, the first is data
    ['item_1']
    """
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    # symbol -> the reads it comes from: a read's own, and the sizes of ops given one (a slice
    # ``x[:k]`` gets a fresh symbol for its clamped length)
    source: dict[Any, set[fx.Node]] = {}
    used: set = set()
    for n in gm.graph.nodes:
        if n.op == "output":
            continue
        new = n.meta.get(_UNBACKED_BINDINGS) or {}
        if new:
            if n.target in READ_OPS:
                reads = {n}
            else:
                args = [a.meta.get(ir.VAL) for a in n.all_input_nodes]
                reads = set().union(*(source.get(s, set()) for a in args
                                      if not isinstance(a, torch.Tensor) for s in _syms(a)))
                if not reads:
                    return []  # a data-dependent output shape (nonzero): specializing cannot help
            for s in new:
                source[s] = reads
        for t in pytree.tree_leaves(n.meta.get(ir.VAL)):
            if isinstance(t, torch.Tensor):
                used |= _syms(t)
        if n.target is torch.ops.aten._assert_scalar.default and isinstance(n.args[0], fx.Node):
            used |= _syms(n.args[0].meta.get(ir.VAL))
    return sorted(set().union(*(source.get(s, set()) for s in used)), key=order.__getitem__)
