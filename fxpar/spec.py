"""Sharding specs and layout math.

A :class:`Spec` is mesh-centric, as in ``torch.distributed.tensor``: one placement per mesh
axis. ``Shard(d)`` splits tensor dim ``d`` across the devices of that axis, ``Replicate()``
copies the tensor, ``Partial("sum")`` means every device of the axis holds an addend of the
value. Placements are the ``torch.distributed.tensor`` classes themselves.

Layout rules (identical to DTensor's, so ``DTensor.redistribute`` is a valid oracle):

* Splits follow ``torch.chunk``: a dim of size ``n`` over ``k`` devices gives chunks of
  ``c = ceil(n / k)``; device ``i`` holds ``[i*c, min((i+1)*c, n))``, so the last shards are
  smaller and may be empty (``n=5, k=4`` gives sizes 2, 2, 1, 0).
* One dim sharded over several axes is split **left to right in mesh-axis order**: the
  outermost (first) axis splits the global dim, each later axis splits the piece the earlier
  axes left. On a 2×2 mesh ``S(0)S(0)`` puts global block ``2*i + j`` of a dim on device
  ``(i, j)``.

>>> from fxpar.spec import Spec, Shard, Replicate
>>> s = Spec.parse("S(0)R")
>>> s, s.placements
(S(0)R, (Shard(dim=0), Replicate()))
>>> s.local_shape((5, 4), mesh_shape=(2, 2), coord=(1, 0))
(2, 4)
>>> s.global_slices((5, 4), mesh_shape=(2, 2), coord=(1, 0))
(slice(3, 5, None), slice(0, 4, None))
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from fxpar.errors import SpecError

__all__ = [
    "Partial",
    "Placement",
    "Replicate",
    "Shard",
    "Spec",
    "as_spec",
    "partial_reducible",
    "chunk_bounds",
    "grad_in_spec",
    "grad_out_spec",
    "placement_kind",
    "placement_str",
]

_REDUCE_OPS = ("sum", "avg", "max", "min")


_KIND: dict[type, str | None] = {}


def placement_kind(p) -> str | None:
    """``"S"``, ``"R"`` or ``"P"`` for a Shard, Replicate or Partial (subclasses included),
    else ``None``; by type, cached: ``isinstance`` against DTensor's placement classes goes
    through a metaclass hook (~8× a type lookup), and the planner asks millions of times.

    >>> placement_kind(Shard(1)), placement_kind(Replicate()), placement_kind("R")
    ('S', 'R', None)
    """
    t = type(p)
    try:
        return _KIND[t]
    except KeyError:
        k = _KIND[t] = ("S" if isinstance(p, Shard) else "R" if isinstance(p, Replicate)
                        else "P" if isinstance(p, Partial) else None)
        return k


def placement_str(p: Placement) -> str:
    """Short form of one placement: ``S(0)``, ``R``, ``P(sum)``."""
    k = placement_kind(p)
    if k == "S":
        return f"S({p.dim})"
    if k == "R":
        return "R"
    if k == "P":
        return f"P({p.reduce_op})"
    raise SpecError(f"unsupported placement {p!r}: fxpar specs use Shard, Replicate, Partial")


def chunk_bounds(size: int, parts: int, index: int) -> tuple[int, int]:
    """``[start, stop)`` of chunk ``index`` when ``size`` is split into ``parts`` like torch.chunk.

    >>> [chunk_bounds(5, 4, i) for i in range(4)]
    [(0, 2), (2, 4), (4, 5), (5, 5)]
    """
    c = -(-size // parts)
    start = min(size, c * index)
    return start, min(size, start + c)


_TOKEN = re.compile(r"S\((-?\d+)\)|R|P\((\w+)\)")


@dataclass(frozen=True)
class Spec:
    """One placement per mesh axis; frozen and hashable; prints as ``S(0)R``.

    A spec knows nothing of tensor rank until it is checked against a shape
    (:meth:`check`); all layout functions check first and raise :class:`fxpar.SpecError`
    (a ``ValueError``) naming the spec and shape when they do not fit.
    """

    placements: tuple[Placement, ...]

    def __post_init__(self) -> None:
        ps = tuple(self.placements)
        for p in ps:
            k = placement_kind(p)
            if k is None:
                placement_str(p)  # raises: a foreign placement type
            elif k == "P" and p.reduce_op not in _REDUCE_OPS:
                raise SpecError(f"Partial reduce op {p.reduce_op!r} not in {_REDUCE_OPS}")
        object.__setattr__(self, "placements", ps)

    # -- construction -------------------------------------------------------------------
    @classmethod
    def of(cls, *placements: Placement | str) -> Spec:
        """``Spec.of(Shard(0), "R")``: placements or their short strings."""
        out: list[Placement] = []
        for p in placements:
            out.extend(cls.parse(p).placements if isinstance(p, str) else (p,))
        return cls(tuple(out))

    @classmethod
    def parse(cls, text: str) -> Spec:
        """Parse the short form: ``Spec.parse("P(sum)S(1)")``."""
        pos, out = 0, []
        s = text.replace(" ", "")
        while pos < len(s):
            m = _TOKEN.match(s, pos)
            if m is None:
                raise SpecError(f"cannot parse spec {text!r} at position {pos}")
            if m.group(0) == "R":
                out.append(Replicate())
            elif m.group(1) is not None:
                out.append(Shard(int(m.group(1))))
            else:
                out.append(Partial(m.group(2)))
            pos = m.end()
        return cls(tuple(out))

    @classmethod
    def replicate(cls, ndim_mesh: int) -> Spec:
        return cls((Replicate(),) * ndim_mesh)

    # -- printing -----------------------------------------------------------------------
    def __str__(self) -> str:
        return "".join(placement_str(p) for p in self.placements)

    __repr__ = __str__

    # -- queries ------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.placements)

    def __getitem__(self, axis: int) -> Placement:
        return self.placements[axis]

    def __iter__(self):
        return iter(self.placements)

    def with_axis(self, axis: int, placement: Placement) -> Spec:
        """The spec with the placement of one mesh axis replaced."""
        ps = list(self.placements)
        ps[axis] = placement
        return Spec(tuple(ps))

    def normalized(self, ndim: int) -> Spec:
        """Negative shard dims made positive for a tensor of rank ``ndim``."""
        return Spec(tuple(Shard(p.dim % ndim) if isinstance(p, Shard) and p.dim < 0 else p
                          for p in self.placements))

    @property
    def is_replicated(self) -> bool:
        return all(isinstance(p, Replicate) for p in self.placements)

    @property
    def has_partial(self) -> bool:
        return any(isinstance(p, Partial) for p in self.placements)

    def shard_axes(self, dim: int) -> tuple[int, ...]:
        """Mesh axes that shard tensor dim ``dim``, outermost first (the split order)."""
        return tuple(i for i, p in enumerate(self.placements) if isinstance(p, Shard) and p.dim == dim)

    def check(self, shape: Sequence[int], mesh_shape: Sequence[int] | None = None) -> None:
        """Raise :class:`SpecError` if the spec does not fit a tensor of ``shape`` on the mesh."""
        ndim = len(shape)
        if mesh_shape is not None and len(mesh_shape) != len(self.placements):
            raise SpecError(
                f"spec {self} has {len(self.placements)} placements but the mesh has "
                f"{len(mesh_shape)} axes {tuple(mesh_shape)} (tensor shape {tuple(shape)})")
        for axis, p in enumerate(self.placements):
            if isinstance(p, Shard) and not -ndim <= p.dim < ndim:
                raise SpecError(
                    f"spec {self}: mesh axis {axis} shards dim {p.dim}, out of range for "
                    f"tensor shape {tuple(shape)} (rank {ndim})")

    # -- layout math --------------------------------------------------------------------
    def global_slices(self, shape: Sequence[int], mesh_shape: Sequence[int],
                      coord: Sequence[int]) -> tuple[slice, ...]:
        """The global region held by the device at mesh ``coord``: one slice per tensor dim."""
        self.check(shape, mesh_shape)
        spec = self.normalized(len(shape))
        lo = [0] * len(shape)
        hi = list(shape)
        for axis, p in enumerate(spec.placements):
            if isinstance(p, Shard):
                a, b = chunk_bounds(hi[p.dim] - lo[p.dim], mesh_shape[axis], coord[axis])
                lo[p.dim], hi[p.dim] = lo[p.dim] + a, lo[p.dim] + b
        return tuple(slice(a, b) for a, b in zip(lo, hi))

    def local_shape(self, shape: Sequence[int], mesh_shape: Sequence[int],
                    coord: Sequence[int]) -> tuple[int, ...]:
        """Shape of the local tensor on the device at mesh ``coord``."""
        return tuple(s.stop - s.start for s in self.global_slices(shape, mesh_shape, coord))

    def max_local_shape(self, shape: Sequence[int], mesh_shape: Sequence[int]) -> tuple[int, ...]:
        """The largest local shape over all devices (the first device's, by chunk rules)."""
        return self.local_shape(shape, mesh_shape, (0,) * len(mesh_shape))

    def local_numel(self, shape: Sequence[int], mesh_shape: Sequence[int]) -> int:
        """Elements held by the fullest device: what memory and comm costs are sized by."""
        n = 1
        for s in self.max_local_shape(shape, mesh_shape):
            n *= s
        return n

    def is_even(self, shape: Sequence[int], mesh_shape: Sequence[int]) -> bool:
        """True when every device holds the same local shape (no padding needed)."""
        self.check(shape, mesh_shape)
        spec = self.normalized(len(shape))
        sizes = list(shape)
        for axis, p in enumerate(spec.placements):
            if isinstance(p, Shard):
                if sizes[p.dim] % mesh_shape[axis]:
                    return False
                sizes[p.dim] //= mesh_shape[axis]
        return True


def as_spec(x: Spec | str | Iterable[Placement]) -> Spec:
    """Accept a Spec, its short string, or a sequence of placements."""
    if isinstance(x, Spec):
        return x
    if isinstance(x, str):
        return Spec.parse(x)
    return Spec(tuple(x))


# ---------------------------------------------------------------------------------------------
# gradient layouts
# ---------------------------------------------------------------------------------------------
# The gradient of a value flows consumer -> producer. Per mesh axis ``a``:
#   grad_out (the layout the producer needs the gradient of its output in):
#       S(d) -> S(d), R -> R, P -> R (each addend's gradient is the full gradient);
#   grad_in (the layout the consumer's backward produces for its input p):
#       S(d) -> S(d), P -> R, and R -> P(sum) when the consumer splits its computation along
#       ``a`` (another input or an output is not R there: each device computes a partial
#       gradient), else R.
# So a weight stored R on dp whose consumer shards the batch on dp gets a P(sum) -> R
# all-reduce of its gradient (data-parallel gradient sync).

def grad_out_spec(spec: Spec) -> Spec:
    """Layout a producer needs the gradient of a value of layout ``spec`` in: per axis
    ``S(d)→S(d)``, ``R→R``, ``P→R``.

    >>> grad_out_spec(Spec.parse("P(sum)S(0)"))
    RS(0)
    """
    return Spec(tuple(Replicate() if placement_kind(p) == "P" else p for p in spec.placements))


def grad_in_spec(strategy, p: int) -> Spec:
    """Layout of the gradient a consumer's backward produces for its input ``p``.

    ``strategy`` is anything with ``.inputs`` (a spec or ``None`` per input) and ``.outputs``
    (a spec per output), e.g. a :class:`fxpar.strategies.base.Strategy`. Per axis ``a``:
    ``S(d)→S(d)``, ``P→R``, ``R→P(sum)`` when the strategy splits the computation on ``a``
    (some other input or some output is not ``R`` there), else ``R``.

    >>> from types import SimpleNamespace
    >>> dp = SimpleNamespace(inputs=(Spec.parse("S(0)"), Spec.parse("R"), Spec.parse("R")),
    ...                      outputs=(Spec.parse("S(0)"),))          # x, weight, bias on dp
    >>> grad_in_spec(dp, 1)                  # the weight's gradient: a partial sum on dp
    P(sum)
    >>> grad_in_spec(dp, 0)
    S(0)
    """
    ins, outs = strategy.inputs, strategy.outputs
    spec = ins[p]
    out = []
    for a, pl in enumerate(spec.placements):
        k = placement_kind(pl)
        if k == "P":
            out.append(Replicate())
        elif k == "R":
            split = any(s is not None and q != p and placement_kind(s[a]) != "R"
                        for q, s in enumerate(ins)) or \
                any(placement_kind(o[a]) != "R" for o in outs)
            out.append(_SUM if split else Replicate())
        else:
            out.append(pl)
    return Spec(tuple(out))


_SUM = Partial("sum")


def partial_reducible(dtype, reduce_op: str) -> bool:
    """Whether a ``Partial(reduce_op)`` tensor of ``dtype`` can be reduced exactly by fxpar's
    collectives on every backend. The runtime reduces dtypes a backend lacks in a wider one
    (:func:`fxpar.runtime.redistribute._to_wire`); ``max``/``min`` of ``uint64`` has none (no
    wider integer holds it, its int64 bits do not order the same), so the planner offers no
    strategy with such an output (:func:`fxpar.strategies.strategies_for`).

    >>> import torch
    >>> partial_reducible(torch.int16, "sum"), partial_reducible(torch.uint64, "max")
    (True, False)
    """
    import torch

    return not (dtype == torch.uint64 and reduce_op in ("max", "min"))
