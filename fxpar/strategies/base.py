"""The strategy interface: what a rule returns, and the op records that register rules.

**Op records.** Each op family file registers, per op, ONE :class:`OpRecord`: its one-axis
sharding rule, its cost formula (from :mod:`fxpar.cost.compute`), its local rewrite (from
:mod:`fxpar.strategies.local`) and flags (``view``, ``differentiable``, ``saves``). Adding an op
is one ``register(...)`` line in its family's file (plus its test)::

    @register(aten.mm, cost=mm_cost, saves="partners")
    def mm_rule(node): ...
    declare(aten.dot, aten.mv, cost=matmul_cost, saves="partners")   # no sharding rule

A **strategy** of a node is the spec it requires of each tensor input and the spec it produces
for each tensor output, on one mesh (DESIGN §3). Rules say only *layouts*; the planner prices
them (compute on local shapes from :mod:`fxpar.cost.compute`, resharding on edges from
:func:`fxpar.reshard_plan`, memory from :mod:`fxpar.cost.memory`).

Rules are written for **one mesh axis** (:class:`AxisStrategy`: one placement per tensor input
and per output) and expanded over every axis of an N-d mesh by :func:`expand`: a strategy on a
``(z, y, x)`` mesh picks one axis strategy per axis. AxoNN's 3D matmul is then simply
``z: (S(0), R) -> S(0)``, ``y: (S(1), S(0)) -> P(sum)``, ``x: (R, S(1)) -> S(1)``.

Input order: ``Strategy.inputs[i]`` is the spec required of ``node.all_input_nodes[i]`` (each
distinct producer once). For a ``getitem`` of a multi-output producer, its one input spec is
the spec of the selected element. Outputs: one spec per tensor in ``meta["val"]`` (a 1-tuple
for a single tensor).

>>> from fxpar.strategies.base import AxisStrategy
>>> AxisStrategy(("S(0)", "R"), ("S(0)",))
AxisStrategy(S(0), R -> S(0))
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch.distributed.tensor.placement_types import Placement

from fxpar import ir
from fxpar.cost.compute import set_op_cost
from fxpar.spec import Spec, as_spec, placement_kind, placement_str, trusted_spec, with_dim

__all__ = ["AxisStrategy", "Strategy", "OpRecord", "RECORDS", "register", "declare", "record_for", "rule_for",
           "RULES", "expand", "bound",
           "choice", "tensor_shape", "out_shapes", "R", "P", "S"]


def _placement(p: Placement | str | None) -> Placement | None:
    if p is None or not isinstance(p, str):
        return p
    (q,) = Spec.parse(p).placements
    return q


@dataclass(frozen=True)
class AxisStrategy:
    """Placements on one mesh axis: one per tensor input (``None`` for a non-tensor input) and one
    per tensor output. Strings (``"S(0)"``, ``"R"``, ``"P(sum)"``) are accepted."""

    inputs: tuple[Placement | None, ...]
    outputs: tuple[Placement, ...]
    #: short label shown by explain() (``"col"``, ``"row"``, ``"dp"``, ``"vocab"``)
    name: str = ""
    #: the local computation is exact only when every sharded tensor is split evenly
    #: (merging views, mean over a sharded dim -> P(avg), grouped-query heads)
    even: bool = False
    #: the dims this choice shards hold ``blocks`` indivisible units (GroupNorm's channel
    #: groups): kept only where the devices splitting them divide ``blocks`` (0: any split)
    blocks: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "inputs", tuple(_placement(p) for p in self.inputs))
        object.__setattr__(self, "outputs", tuple(_placement(p) for p in self.outputs))

    def __repr__(self) -> str:
        ins = ", ".join("-" if p is None else placement_str(p) for p in self.inputs)
        return f"AxisStrategy({ins} -> {', '.join(placement_str(p) for p in self.outputs)})"


@dataclass(frozen=True)
class Strategy:
    """One choice for a node on an N-d mesh: a spec per tensor input (``None`` for non-tensor
    inputs) and a spec per tensor output. ``name`` is a short human label used by explain()
    (e.g. ``"col(tp)"``, ``"3d"``); ``unsharded`` marks the replicate-only fallback of an op
    without a rule."""

    inputs: tuple[Spec | None, ...]
    outputs: tuple[Spec, ...]
    name: str = ""
    unsharded: bool = False
    #: the layout the gradients of the output from its several consumers are summed in
    #: before one reshard to the output's gradient layout (Megatron's ``f``: the ``P(sum)``
    #: gradients of q, k and v projections of one normed input added, then all-reduced once);
    #: ``None``: each consumer's gradient is resharded on its own edge
    grad_acc: Spec | None = None
    #: the layout the output is resharded to ONCE for all its consumers (Megatron's sequence
    #: parallelism: the norm's sequence-sharded output all-gathered once for q, k and v, the
    #: backward's summed gradient reduce-scattered once); ``None``: each consumer's edge
    #: reshards from the output's own layout
    shared: Spec | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "inputs", tuple(None if s is None else as_spec(s) for s in self.inputs))
        object.__setattr__(self, "outputs", tuple(as_spec(s) for s in self.outputs))
        for f in ("grad_acc", "shared"):
            if getattr(self, f) is not None:
                object.__setattr__(self, f, as_spec(getattr(self, f)))

    def __str__(self) -> str:
        ins = ", ".join("-" if s is None else str(s) for s in self.inputs)
        fan = (f" | shared {self.shared}" if self.shared is not None else "") + \
            (f" | grad {self.grad_acc}" if self.grad_acc is not None else "")
        return f"{self.name + ': ' if self.name else ''}{ins} -> {', '.join(map(str, self.outputs))}{fan}"


@dataclass(frozen=True)
class OpRecord:
    """Everything fxpar knows about one op, written in one place (its family's file).

    * ``rule(node) -> Iterable[AxisStrategy]``: the one-axis sharding choices (``None``: only the
      replicated fallback, or the pointwise rule for an ATen op tagged ``pointwise``);
    * ``cost``: a pure formula of :mod:`fxpar.cost.compute` (``mm_cost``, ...); ``None``: priced
      by bytes (an in-place ``x_`` op falls back to the rule of ``x``);
    * ``local(node, lctx) -> None``: the rewrite that makes the node compute this rank's piece
      (:mod:`fxpar.strategies.local`); ``None``: the plain op on local tensors is right;
    * ``view``: ``True`` for an alias of an input (free, shares storage), ``"if_contiguous"`` when
      it aliases only a contiguous input; ``differentiable=False``: its outputs carry no
      gradient; ``saves``: what its backward keeps (:data:`fxpar.cost.compute.SAVES_KINDS`);
    * ``comm(node, strategy, mesh) -> (t_fwd, t_bwd)``: seconds of the collectives the op runs
      INSIDE its local program under ``strategy`` (a vocabulary-parallel cross-entropy's
      all-reduces, a synced batch norm's statistics; pure formulas of :mod:`fxpar.cost`), added
      to its compute time by the planner (:func:`fxpar.planner.pricing.compute_times`);
      ``None``: none (every other collective is an edge's).
    """

    op: object
    rule: Callable | None = None
    cost: Callable | None = None
    local: Callable | None = None
    view: bool | str = False
    differentiable: bool = True
    saves: str | None = None
    comm: Callable | None = None


#: op object (ATen overload packet or overload, or another callable) -> its record.
RECORDS: dict[object, OpRecord] = {}
#: op -> one-axis rule, derived from :data:`RECORDS` (the ops with a sharding rule).
RULES: dict[object, Callable] = {}


def register(*ops, cost: Callable | None = None, local: Callable | None = None, view: bool | str = False,
             differentiable: bool = True, saves: str | None = None,
             comm: Callable | None = None) -> Callable:
    """Decorator recording ops with their sharding rule, cost rule, local rewrite and flags.

    ``@register(aten.mm, cost=mm_cost, saves="partners")`` then
    ``def rule(node): return [AxisStrategy(...), ...]``; call ``register(op, ...)(None)`` (or
    :func:`declare`) for an op without a sharding rule. Keys are op objects: an overload packet
    covers every overload, an overload overrides its packet. One record per op: registering an
    op twice raises. The cost facts go to :func:`fxpar.cost.compute.set_op_cost` and
    ``differentiable=False`` to :data:`fxpar.ir.NON_DIFFERENTIABLE`, the indexes those layers read.

    >>> import torch
    >>> rec = RECORDS[torch.ops.aten.mm]
    >>> rec.rule.__name__, rec.cost.__name__, rec.saves, rec.view
    ('mm_rule', 'mm_cost', 'partners', False)
    """
    def deco(fn: Callable | None) -> Callable | None:
        for op in ops:
            if op in RECORDS:
                raise ValueError(f"register: {op} already has a record ({RECORDS[op]})")
            set_op_cost(op, cost, view=view, saves=saves)  # validates the flags first
            RECORDS[op] = OpRecord(op, fn, cost, local, view, differentiable, saves, comm)
            if fn is not None:
                RULES[op] = fn
            if not differentiable:
                ir.NON_DIFFERENTIABLE.add(op)
        return fn

    return deco


def declare(*ops, **facts) -> None:
    """Record ops that have no sharding rule (replicated only): ``declare(aten.dot, cost=matmul_cost)``."""
    register(*ops, **facts)(None)


def record_for(target) -> OpRecord | None:
    """The record of an op overload (exact overload first, then its packet), or ``None``."""
    rec = RECORDS.get(target)
    if rec is None:
        packet = getattr(target, "overloadpacket", None)
        rec = RECORDS.get(packet) if packet is not None else None
    return rec


def rule_for(target) -> Callable | None:
    """The sharding rule for an op overload (exact overload first, then its packet), or ``None``."""
    if target in RULES:
        return RULES[target]
    packet = getattr(target, "overloadpacket", None)
    return RULES.get(packet) if packet is not None else None


# --- helpers for rules -------------------------------------------------------------------------
import itertools  # noqa: E402
import math  # noqa: E402
from collections.abc import Iterable, Sequence  # noqa: E402

import torch  # noqa: E402
import torch.fx as fx  # noqa: E402
from torch.distributed.tensor import Partial, Replicate, Shard  # noqa: E402

R = Replicate()


def S(d: int) -> Shard:
    return Shard(d)


def P(op: str = "sum") -> Partial:
    return Partial(op)


def _is_tensor(v) -> bool:
    return isinstance(v, torch.Tensor)


def tensor_shape(x) -> tuple[int, ...] | None:
    """Global shape of a node's (single) tensor value, ``None`` when it is not a tensor."""
    if isinstance(x, fx.Node):
        x = x.meta.get("val")
    return tuple(int(s) for s in x.shape) if _is_tensor(x) else None


def out_shapes(node: fx.Node) -> list[tuple[int, ...]]:
    """Shapes of the tensor outputs of ``node`` in order (one per ``Strategy.outputs`` entry)."""
    v = node.meta.get("val")
    if isinstance(v, (tuple, list)):
        return [tensor_shape(x) for x in v if _is_tensor(x)]
    return [tensor_shape(v)] if _is_tensor(v) else []


def input_shapes(node: fx.Node) -> list[tuple[int, ...] | None]:
    """Global shape per ``node.all_input_nodes`` entry (``None`` for non-tensors). A ``getitem`` of
    a multi-output producer sees the selected element (its input spec is that element's)."""
    import operator

    if node.target is operator.getitem and node.all_input_nodes:
        v = node.args[0].meta.get("val")
        if isinstance(v, (tuple, list)) and isinstance(node.args[1], int) and node.args[1] < len(v):
            return [tensor_shape(v[node.args[1]])]
    return [tensor_shape(n) for n in node.all_input_nodes]


def out_index(node: fx.Node, element: int) -> int | None:
    """Position in ``Strategy.outputs`` of element ``element`` of a multi-output value."""
    v = node.meta.get("val")
    if not isinstance(v, (tuple, list)):
        return None
    if element < 0 or element >= len(v) or not _is_tensor(v[element]):
        return None
    return sum(1 for x in v[:element] if _is_tensor(x))


def bound(node: fx.Node) -> dict:
    """Arguments of a call by schema name (positional and keyword), defaults filled in.

    Without a schema (``operator.getitem``) the keys are the positional indices.
    """
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return dict(enumerate(node.args)) | dict(node.kwargs)
    out = {}
    for i, a in enumerate(schema.arguments):
        if i < len(node.args) and not a.kwarg_only:
            out[a.name] = node.args[i]
        elif a.name in node.kwargs:
            out[a.name] = node.kwargs[a.name]
        elif a.has_default_value():
            out[a.name] = a.default_value
        else:
            out[a.name] = None
    return out


def _occurrences(node: fx.Node) -> list[tuple[object, int | None, fx.Node]]:
    """Every Node occurrence in the call: (argument name, list index or None, node)."""
    schema = getattr(node.target, "_schema", None)
    names = [a.name for a in schema.arguments if not a.kwarg_only] if schema is not None else None
    occ = []

    def walk(key, v):
        if isinstance(v, fx.Node):
            occ.append((key, None, v))
        elif isinstance(v, (list, tuple)):
            for j, x in enumerate(v):
                if isinstance(x, fx.Node):
                    occ.append((key, j, x))

    for i, a in enumerate(node.args):
        walk(names[i] if names is not None and i < len(names) else i, a)
    for k, a in node.kwargs.items():
        walk(k, a)
    return occ


def choice(node: fx.Node, placements: dict, outputs: Sequence[Placement], name: str = "",
           even: bool = False, blocks: int = 0) -> AxisStrategy | None:
    """Build the AxisStrategy of ``node`` from placements keyed by argument name.

    ``placements[arg]`` is a placement, or a list of them for a list argument (``cat``'s
    ``tensors``, ``index``'s ``indices``). Tensor arguments not named are Replicate. When the same
    node feeds two arguments with different placements the choice is impossible: ``None``.
    """
    per: dict[fx.Node, Placement] = {}
    for key, j, n in _occurrences(node):
        if tensor_shape(n) is None:
            continue
        p = placements.get(key, R)
        if j is not None and isinstance(p, (list, tuple)):
            p = p[j] if p[j] is not None else R
        p = R if p is None else p
        if n in per and per[n] != p:
            return None
        per[n] = p
    ins = tuple(per.get(n) if tensor_shape(n) is not None else None for n in node.all_input_nodes)
    return AxisStrategy(ins, tuple(outputs), name=name, even=even, blocks=blocks)


# --- expansion over an N-d mesh --------------------------------------------------------------------
def _norm(p, shp):
    if placement_kind(p) in ("S", "T") and p.dim < 0 and shp is not None:
        return with_dim(p, p.dim % len(shp))
    return p


def no_empty_shard(n: int, ks: Sequence[int]) -> bool:
    """No empty shard when a dim of size ``n`` is split over axes of sizes ``ks`` in order."""
    pieces = [n]
    for k in ks:
        nxt = []
        for m in pieces:
            c = -(-m // k)
            if c * (k - 1) >= m:  # the last chunk would be empty
                return False
            nxt += [min(c, m - c * i) for i in range(k)]
        pieces = nxt
    return True


def _even(n: int, ks: Sequence[int]) -> bool:
    for k in ks:
        if n % k:
            return False
        n //= k
    return True


def expand(node: fx.Node, choices: Iterable[AxisStrategy | None], mesh_shape: Sequence[int],
           axis_names: Sequence[str] | None = None) -> list[Strategy]:
    """N-d strategies from one-axis choices: the product over mesh axes, kept when valid.

    Kept when (1) shard dims exist, (2) no device would hold an empty shard (dim size too small
    for the axes sharding it), (3) a dim of a tensor sharded by several axes is sharded by the
    SAME one-axis choice on each, so every tensor nests those axes left to right alike (choices
    that differ would split matching dims in different orders), (4) ``even`` choices see even
    splits of every sharded tensor, (5) one tensor is not partial under reduce ops that do not
commute (``P(sum)P(max)``), (6) a choice with ``blocks`` is taken by axes whose sizes
multiply to a divisor of ``blocks``. Axes of size 1 only replicate. The all-replicate strategy
    always comes first; duplicates are dropped; the order is deterministic.
    """
    in_shapes = input_shapes(node)
    o_shapes = out_shapes(node)
    shapes = in_shapes + o_shapes
    names = tuple(axis_names) if axis_names is not None else tuple(f"a{i}" for i in range(len(mesh_shape)))
    rep = AxisStrategy(tuple(None if s is None else R for s in in_shapes), tuple(R for _ in o_shapes), name="R")

    seen, clean = set(), [rep]
    for c in choices:
        if c is None:
            continue
        if len(c.inputs) != len(in_shapes) or len(c.outputs) != len(o_shapes):
            raise ValueError(f"rule for {node.target} returned {c!r} for {len(in_shapes)} inputs, "
                             f"{len(o_shapes)} outputs")
        pls = tuple(_norm(p, s) for p, s in zip(c.inputs + c.outputs, shapes))
        if any(placement_kind(p) in ("S", "T") and not 0 <= p.dim < len(s)
               for p, s in zip(pls, shapes) if p is not None):
            continue
        c = AxisStrategy(pls[:len(in_shapes)], pls[len(in_shapes):], name=c.name, even=c.even, blocks=c.blocks)
        key = (c.inputs, c.outputs)
        if key in seen or key == (rep.inputs, rep.outputs):
            continue
        seen.add(key)
        clean.append(c)

    def ok1(c: AxisStrategy, k: int) -> bool:
        for p, s in zip(c.inputs + c.outputs, shapes):
            kind = placement_kind(p)
            if kind == "S" and not no_empty_shard(s[p.dim], (k,)):
                return False
            if kind == "T" and s[p.dim] % (p.split_factor * k):   # strided: even (fxpar.spec)
                return False
        return True

    # per choice and tensor: (kind, dim, reduce op) of its placement, read per combination
    summ = []
    for c in clean:
        pls = c.inputs + c.outputs
        for p in pls:
            if p is not None:
                Spec((p,))   # validates the placement once (combinations are built trusted)
        summ.append(tuple(None if p is None else (placement_kind(p), getattr(p, "dim", None),
                                                   getattr(p, "reduce_op", None)) for p in pls))
    per_axis = [[0] if k == 1 else [i for i, c in enumerate(clean) if ok1(c, k)] for k in mesh_shape]
    tensors = [t for t, s in enumerate(shapes) if s is not None]
    out, keys = [], set()
    for combo in itertools.product(*per_axis):
        chosen = [clean[i] for i in combo]
        # (6) a choice of indivisible blocks: the axes taking it split them evenly
        good = all(clean[i].blocks % math.prod(k for k, j in zip(mesh_shape, combo) if j == i) == 0
                   for i in set(combo) if clean[i].blocks)
        needs_even = any(c.even for c in chosen)
        for t in tensors:
            s = shapes[t]
            by_dim: dict[int, list[int]] = {}
            ops = set()
            for a, i in enumerate(combo):
                kind, dim, op = summ[i][t]
                if kind == "S":
                    by_dim.setdefault(dim, []).append(a)
                elif kind == "T":   # a strided dim is split by its one axis only
                    by_dim.setdefault(dim, []).extend((a, -1))
                elif kind == "P":
                    ops.add(op)
            if len(ops) > 1 and not ops <= {"sum", "avg"}:
                good = False  # partial sums and maxima on one tensor do not commute (see reshard)
                break
            for d, axes in by_dim.items():
                if -1 in axes and len(axes) > 2:
                    good = False
                    break
                axes = [a for a in axes if a >= 0]
                ks = [mesh_shape[a] for a in axes]
                if len(axes) > 1 and (any(combo[a] != combo[axes[0]] for a in axes) or not no_empty_shard(s[d], ks)):
                    good = False
                if needs_even and not _even(s[d], ks):
                    good = False
            if not good:
                break
        if not good:
            continue
        ins = tuple(None if s is None else trusted_spec(tuple(c.inputs[i] for c in chosen))
                    for i, s in enumerate(in_shapes))
        outs = tuple(trusted_spec(tuple(c.outputs[i] for c in chosen)) for i in range(len(o_shapes)))
        if (ins, outs) in keys:
            continue
        keys.add((ins, outs))
        out.append(Strategy(ins, outs, name=_name(chosen, names)))
    return out


def _name(combo: Sequence[AxisStrategy], names: Sequence[str]) -> str:
    if len(combo) == 1:
        return combo[0].name or "R"
    parts = [f"{n}:{c.name or '?'}" for n, c in zip(names, combo) if c.name != "R"]
    return " ".join(parts) or "R"
