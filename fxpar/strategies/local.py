"""Local rewrites: what turns a node of the global graph into this rank's piece of it.

Most ops compute their piece by running the same op on local tensors. The others carry a
``local=`` entry in their :class:`~fxpar.strategies.base.OpRecord` (tinygrad-style: a table of
rewrites, not an if/elif chain): ``local(node, lctx) -> None`` edits the node in place (its
arguments, or its target). :func:`local_rule` finds the entry of a target;
``passes/localize.py`` calls it on every ``call_function`` node.

Contract of a rewrite: it runs once per node, after ``node.meta["val"]`` holds the LOCAL value
(a ``meta`` tensor of this rank's shape) and with ``meta[SPECS]``/``meta[IN_SPECS]`` (the global
layouts chosen by the plan) in place; global shapes come from the :class:`LocalContext`. It
touches nothing but the node (no new nodes, no submodules), and raises
:class:`fxpar.PlanError` naming the node when the op cannot run sharded.

The shared rewrites live here; each family file names the ones its ops use:

* :func:`shape_arg` — a size argument becomes the output's local shape (``view``, ``reshape``,
  ``expand``, ``new_*``, ``zeros``/``ones``/``empty``/``full``); :func:`unflatten_sizes`;
  :func:`arange_bounds` — a sharded ``arange`` gets this rank's bounds;
* :func:`reads_storage` — ops that address storage (``as_strided``, ``resize_``...) refuse an
  input that arrives through a collective when eager's input is a view into a larger storage;
* random ops — every op tagged ``torch.Tag.nondeterministic_seeded`` without an entry of its
  own gets :func:`fxpar.strategies.rand.keyed_local` (a shard-keyed op, or a ``PlanError`` for
  the few it has no keyed form of): no hand list; :func:`refuse_random` is the refusal;
* dropout (:mod:`.pointwise`) and the vocabulary-parallel lookup (:mod:`.embedding`) have theirs
  in their family file.

>>> import torch, torch.fx as fx
>>> from fxpar.spec import Spec
>>> g = fx.Graph(); x = g.placeholder("x")
>>> v = g.call_function(torch.ops.aten.view.default, (x, [4, 2, 3]))
>>> v.meta["val"] = torch.empty(2, 2, 3, device="meta")          # local: S(0) on 2 ranks
>>> lctx = LocalContext((2,), (1,), torch.device("cpu"), {x: (4, 6), v: (4, 2, 3)})
>>> local_rule(v.target)(v, lctx); v.args
(x, [2, 2, 3])
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from fxpar import ir
from fxpar.errors import PlanError
from fxpar.strategies.base import bound, record_for

__all__ = ["LocalContext", "LocalRule", "local_rule", "shape_arg", "unflatten_sizes", "arange_bounds",
           "refuse_random", "draws", "reads_storage", "shard_key"]


@dataclass(frozen=True)
class LocalContext:
    """What a local rewrite may know besides the node: this rank's place and the global shapes.

    ``mesh_shape``/``coord``: the mesh and this rank's coordinate on it; ``device``: where local
    tensors live; ``global_shapes``: the GLOBAL shape of every tensor node (the node's inputs
    and the node itself); ``site``: a stable integer naming the node (the crc32 of its name, the same in
    every chunk graph of a pipeline; dropout keys its random stream by it).
    """

    mesh_shape: tuple[int, ...]
    coord: tuple[int, ...]
    device: torch.device
    global_shapes: Mapping[fx.Node, tuple[int, ...]] = field(default_factory=dict)
    site: int = 0

    def global_shape(self, node: fx.Node) -> tuple[int, ...]:
        """Global shape of a tensor node; ``KeyError`` naming it when unknown."""
        try:
            return tuple(self.global_shapes[node])
        except KeyError:
            raise KeyError(f"LocalContext: no global shape for node {node.name}") from None


LocalRule = Callable[[fx.Node, LocalContext], None]


def _local_shape(node: fx.Node) -> list[int]:
    return [int(s) for s in node.meta[ir.VAL].shape]


def shape_arg(index: int, *overloads: str) -> LocalRule:
    """A rewrite setting argument ``index`` (a size list) to the output's local shape, for the
    named overloads only (``shape_arg(1, "default")`` leaves ``aten.view.dtype`` alone).

    >>> import torch, torch.fx as fx
    >>> g = fx.Graph()
    >>> z = g.call_function(torch.ops.aten.zeros.default, ([8, 4],), {"device": torch.device("cpu")})
    >>> z.meta["val"] = torch.empty(2, 4, device="meta")
    >>> shape_arg(0, "default")(z, LocalContext((4,), (0,), torch.device("cpu"))); z.args
    ([2, 4],)
    """

    def rewrite(node: fx.Node, lctx: LocalContext) -> None:
        if getattr(node.target, "_overloadname", None) not in overloads:
            return
        args = list(node.args)
        args[index] = _local_shape(node)
        node.args = tuple(args)

    rewrite.__name__ = rewrite.__qualname__ = f"shape_arg({index}, {', '.join(map(repr, overloads))})"
    return rewrite


def unflatten_sizes(node: fx.Node, lctx: LocalContext) -> None:
    """``unflatten(x, dim, sizes)``: ``sizes`` become the local sizes of the dims it creates
    (a negative ``dim`` counts from the end of the input, as ``torch.unflatten`` does).

    >>> import torch, torch.fx as fx
    >>> g = fx.Graph(); x = g.placeholder("x")
    >>> u = g.call_function(torch.ops.aten.unflatten.int, (x, -1, [4, 8]))
    >>> u.meta["val"] = torch.empty(3, 2, 8, device="meta")
    >>> unflatten_sizes(u, LocalContext((2,), (0,), torch.device("cpu"))); u.args
    (x, -1, [2, 8])
    """
    if node.target is not torch.ops.aten.unflatten.int:
        return
    local = _local_shape(node)
    k = len(node.args[2])
    d = node.args[1] % (len(local) - k + 1)  # ``dim`` counts the INPUT's dims
    node.args = (node.args[0], node.args[1], local[d:d + k])


def arange_bounds(node: fx.Node, lctx: LocalContext) -> None:
    """A sharded 1-D ``arange`` gets this rank's ``(start, end, step)`` (as ``arange.start_step``).

    >>> import torch, torch.fx as fx
    >>> from fxpar.spec import Spec
    >>> g = fx.Graph(); a = g.call_function(torch.ops.aten.arange.default, (10,))
    >>> a.meta["fxpar_specs"] = (Spec.parse("S(0)"),)
    >>> arange_bounds(a, LocalContext((2,), (1,), torch.device("cpu"), {a: (10,)})); a.target, a.args
    (<OpOverload(op='aten.arange', overload='start_step')>, (5, 10, 1))
    """
    aten = torch.ops.aten
    if node.target not in (aten.arange.default, aten.arange.start, aten.arange.start_step):
        return
    specs = node.meta.get(ir.SPECS)
    if not specs or specs[0].is_replicated:
        return
    args = list(node.args)
    start, end = (0, args[0]) if node.target is aten.arange.default else (args[0], args[1])
    step = args[2] if node.target is aten.arange.start_step and len(args) > 2 else 1
    length = lctx.global_shape(node)[0]
    sl = specs[0].global_slices((length,), lctx.mesh_shape, lctx.coord)[0]
    node.args = (start + sl.start * step, start + sl.stop * step, step)
    node.target = aten.arange.start_step


def draws(node: fx.Node) -> bool:
    """Whether a call of a random op draws numbers: not with a probability argument (``p``,
    ``dropout_p``) of 0 or ``train``/``training`` False (``alpha_dropout(x, p, False)`` is
    ``x``; ``rrelu(x, training=False)`` a fixed slope).

    >>> import torch, torch.fx as fx
    >>> g = fx.Graph(); x = g.placeholder("x")
    >>> draws(g.call_function(torch.ops.aten.alpha_dropout.default, (x, 0.5, False)))
    False
    >>> draws(g.call_function(torch.ops.aten.alpha_dropout.default, (x, 0.5, True)))
    True
    """
    if getattr(node.target, "_schema", None) is None:
        return True
    b = bound(node)
    p = b.get("dropout_p", b.get("p"))
    train = b.get("train", b.get("training"))
    return not ((isinstance(p, (int, float)) and not isinstance(p, bool) and p == 0)
                or train is False)


def refuse_random(node: fx.Node, lctx: LocalContext) -> None:
    """A random op without a shard-keyed form (:mod:`fxpar.strategies.rand`): ranks holding the
    same data would draw different numbers (silently wrong), so it is refused, unless the call
    draws nothing (:func:`draws`: then the plain op on local tensors is right)."""
    if not draws(node):
        return
    raise PlanError(refusal(node))


def refusal(node: fx.Node) -> str:
    """The :class:`PlanError` message for a random op without a keyed form, naming the node."""
    return (f"node {node.name} ({node.target}): fxpar has no shard-keyed form of this random op "
            "(replicas would draw different values); the random ops it runs under any plan are "
            "dropout, attention with dropout_p, the in-place fills (uniform_, normal_, exponential_, "
            "bernoulli_, ...), rand/randn/randint(_like), randperm, normal, bernoulli, poisson, "
            "multinomial, rrelu and the alpha/feature dropouts")


#: the local rewrite of a random op without a record of its own: set by
#: :mod:`fxpar.strategies.rand` when it loads (it builds on this module; the package imports it)
RANDOM_RULE: list[LocalRule] = []


def _storage_plain(v) -> bool:
    """Whether eager's tensor ``v`` (a fake value with eager strides) is its whole storage in
    row-major order: contiguous, offset 0, no other elements in the storage."""
    try:
        return (v.is_contiguous() and v.storage_offset() == 0
                and v.untyped_storage().nbytes() == v.numel() * v.element_size())
    except Exception:  # noqa: BLE001 - a value without a storage to inspect: assume not
        return False


def reads_storage(node: fx.Node, lctx: LocalContext) -> None:
    """Ops that address their input's STORAGE (``as_strided``, ``resize_``, ``set_``...; they
    are replicate-only). After a collective the input is a fresh contiguous tensor holding
    exactly the values (the runtime's layout contract), which is the storage eager would read
    only when eager's input is itself a plain tensor; if eager's input is a view into a
    larger or permuted storage (``x.t().as_strided(...)`` with the ``t`` sharded and gathered), the
    rank program would read other elements, so :class:`PlanError` names the node.

    >>> import torch, torch.fx as fx
    >>> g = fx.Graph(); x = g.placeholder("x")
    >>> w = g.call_function(torch.ops.aten.clone.default, (x,)); w.meta["fxpar_edge"] = "e"
    >>> w.meta["fxpar_global_val"] = torch.empty(6, 5).t()
    >>> a = g.call_function(torch.ops.aten.as_strided.default, (w, [5, 6], [6, 1]))
    >>> reads_storage(a, LocalContext((2,), (0,), torch.device("cpu")))
    Traceback (most recent call last):
    ...
    fxpar.errors.PlanError: node as_strided_default (aten.as_strided.default) reads its input's storage, ...
    """
    src = node.args[0] if node.args else None
    if not isinstance(src, fx.Node) or ir.EDGE not in src.meta:
        return  # its input is computed on this rank as eager computes it: the same storage
    eager = src.meta.get(ir.GLOBAL_VAL)
    if eager is None or _storage_plain(eager):
        return
    raise PlanError(f"node {node.name} ({node.target}) reads its input's storage, but its input "
                    f"{src.name} arrives through a collective as a fresh tensor while eager's is "
                    f"a view (shape {tuple(eager.shape)}, strides {tuple(eager.stride())}, "
                    f"offset {eager.storage_offset()}) of a storage laid out otherwise: the rank program "
                    "would read other elements. Keep the view's producer replicated (pin it to "
                    "R) or apply the op to a contiguous tensor")


def shard_key(spec, coord) -> list[int]:
    """This rank's coordinates on the axes where ``spec`` is ``Shard``: ranks with equal keys
    hold the same shard (and must draw the same random numbers).

    >>> from fxpar.spec import Spec
    >>> shard_key(Spec.parse("S(0)RS(1)"), (1, 0, 1))
    [1, 1]
    """
    from torch.distributed.tensor import Shard

    return [int(c) for c, p in zip(coord, spec) if isinstance(p, Shard)]


def local_rule(target) -> LocalRule | None:
    """The local rewrite of ``target``: its record's ``local`` entry; for an op without one that
    is tagged ``nondeterministic_seeded``, :func:`fxpar.strategies.rand.keyed_local` (its
    shard-keyed form); else ``None`` (the plain op).

    >>> import torch
    >>> local_rule(torch.ops.aten.mm.default) is None
    True
    >>> local_rule(torch.ops.aten.randn.default).__name__
    'keyed_local'
    """
    rec = record_for(target)
    if rec is not None and rec.local is not None:
        return rec.local
    if isinstance(target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in target.tags:
        return RANDOM_RULE[0]
    return None
