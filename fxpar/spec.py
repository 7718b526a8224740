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

* ``S(d,f)`` (:data:`Strided`, DTensor's ``_StridedShard`` on one axis) cuts dim ``d`` into
  ``f`` equal groups and splits each group over the axis: device ``i`` holds chunk ``i`` of
  every group, concatenated. It is the layout of a fused projection (GPT-2's ``c_attn``, q, k
  and v side by side) whose output is split into ``f`` parts: each part comes out ``S(d)``
  with no communication. It must split evenly and no other axis may shard its dim.

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
from torch.distributed.tensor.placement_types import _StridedShard as Strided

from fxpar.errors import SpecError

__all__ = [
    "Partial",
    "Placement",
    "Replicate",
    "Shard",
    "Spec",
    "Strided",
    "as_spec",
    "partial_reducible",
    "chunk_bounds",
    "grad_in_spec",
    "grad_out_spec",
    "placement_kind",
    "placement_str",
    "trusted_spec",
    "with_dim",
]

_REDUCE_OPS = ("sum", "avg", "max", "min")


_KIND: dict[type, str | None] = {}


def placement_kind(p) -> str | None:
    """``"S"``, ``"R"``, ``"P"`` or ``"T"`` for a Shard, Replicate, Partial or
    :data:`Strided` (subclasses included), else ``None``; by type, cached: ``isinstance``
    against DTensor's placement classes goes through a metaclass hook (~8× a type lookup),
    and the planner asks millions of times.

    >>> placement_kind(Shard(1)), placement_kind(Strided(1, split_factor=3)), placement_kind("R")
    ('S', 'T', None)
    """
    t = type(p)
    try:
        return _KIND[t]
    except KeyError:
        k = _KIND[t] = ("T" if isinstance(p, Strided) else "S" if isinstance(p, Shard)
                        else "R" if isinstance(p, Replicate)
                        else "P" if isinstance(p, Partial) else None)
        return k


def placement_str(p: Placement) -> str:
    """Short form of one placement: ``S(0)``, ``R``, ``P(sum)``."""
    k = placement_kind(p)
    if k == "S":
        return f"S({p.dim})"
    if k == "T":
        return f"S({p.dim},{p.split_factor})"
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


_TOKEN = re.compile(r"S\((-?\d+)(?:,(\d+))?\)|R|P\((\w+)\)")


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
            elif k == "T" and p.split_factor < 2:
                raise SpecError(f"strided placement {placement_str(p)}: split factor < 2")
            elif k == "P" and p.reduce_op not in _REDUCE_OPS:
                raise SpecError(f"Partial reduce op {p.reduce_op!r} not in {_REDUCE_OPS}")
        object.__setattr__(self, "placements", ps)

    def __hash__(self) -> int:  # computed once: planning looks specs up millions of times
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash(self.placements)
            object.__setattr__(self, "_hash", h)
        return h

    def __getstate__(self) -> dict:  # the cached hash is per process (string hashing is salted)
        return {"placements": self.placements}

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
            elif m.group(2) is not None:
                out.append(Strided(int(m.group(1)), split_factor=int(m.group(2))))
            elif m.group(1) is not None:
                out.append(Shard(int(m.group(1))))
            else:
                out.append(Partial(m.group(3)))
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
        return Spec(tuple(with_dim(p, p.dim % ndim) if placement_kind(p) in ("S", "T") and p.dim < 0 else p
                          for p in self.placements))

    @property
    def is_strided(self) -> bool:
        """Some axis holds a :data:`Strided` placement (its pieces are not one box)."""
        return any(placement_kind(p) == "T" for p in self.placements)

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
            k = placement_kind(p)
            if k in ("S", "T") and not -ndim <= p.dim < ndim:
                raise SpecError(
                    f"spec {self}: mesh axis {axis} shards dim {p.dim}, out of range for "
                    f"tensor shape {tuple(shape)} (rank {ndim})")
            if k == "T":
                self._check_strided(axis, p, shape, mesh_shape)

    def _check_strided(self, axis: int, p, shape, mesh_shape) -> None:
        d, f = p.dim % len(shape), p.split_factor
        others = [a for a, q in enumerate(self.placements)
                  if a != axis and placement_kind(q) in ("S", "T") and q.dim % len(shape) == d]
        n = shape[d]
        m = mesh_shape[axis] if mesh_shape is not None else 1
        if f < 2 or others or n % (f * m):
            raise SpecError(
                f"spec {self}: mesh axis {axis} holds strided {placement_str(p)} of dim {d} "
                f"(size {n}): needs a split factor >= 2 that, times the axis size {m}, divides "
                f"the dim, and no other axis sharding dim {d} (axes {others})")

    # -- layout math --------------------------------------------------------------------
    def global_slices(self, shape: Sequence[int], mesh_shape: Sequence[int],
                      coord: Sequence[int]) -> tuple[slice, ...]:
        """The global region held by the device at mesh ``coord``: one slice per tensor dim."""
        self.check(shape, mesh_shape)
        if self.is_strided:
            raise SpecError(f"spec {self} of shape {tuple(shape)}: a strided shard is not one "
                            "box of the global tensor; use global_index")
        spec = self.normalized(len(shape))
        lo = [0] * len(shape)
        hi = list(shape)
        for axis, p in enumerate(spec.placements):
            if isinstance(p, Shard):
                a, b = chunk_bounds(hi[p.dim] - lo[p.dim], mesh_shape[axis], coord[axis])
                lo[p.dim], hi[p.dim] = lo[p.dim] + a, lo[p.dim] + b
        return tuple(slice(a, b) for a, b in zip(lo, hi))

    def global_index(self, shape: Sequence[int], mesh_shape: Sequence[int],
                     coord: Sequence[int]) -> tuple[slice | list[int], ...]:
        """:meth:`global_slices`, where a :data:`Strided` dim gives the list of global
        indices the device holds, in its local order: ``Strided(d, split_factor=f)`` on an
        axis of ``m`` devices cuts dim ``d`` (size ``n``) into ``f`` groups of ``n/f`` and
        gives device ``i`` chunk ``i`` of every group (q, k and v's own columns of a fused
        projection, DTensor's ``_StridedShard`` on one axis).

        >>> Spec.parse("S(0,3)").global_index((12,), (2,), (1,))
        ([2, 3, 6, 7, 10, 11],)
        """
        if not self.is_strided:
            return self.global_slices(shape, mesh_shape, coord)
        self.check(shape, mesh_shape)
        spec = self.normalized(len(shape))
        plain = Spec(tuple(Replicate() if placement_kind(p) == "T" else p for p in spec.placements))
        out: list = list(plain.global_slices(shape, mesh_shape, coord))
        for axis, p in enumerate(spec.placements):
            if placement_kind(p) == "T":
                g = shape[p.dim] // p.split_factor
                a, b = chunk_bounds(g, mesh_shape[axis], coord[axis])
                out[p.dim] = [j * g + x for j in range(p.split_factor) for x in range(a, b)]
        return tuple(out)

    def boxes(self, shape: Sequence[int], mesh_shape: Sequence[int],
              coord: Sequence[int]) -> tuple[int | None, list[tuple[slice, ...]]]:
        """``(dim, boxes)``: the device's piece is the concatenation along ``dim`` of these
        global boxes (one box and ``dim=None`` without a strided placement; a strided dim
        gives one box per group). For readers that take boxes (safetensors slices,
        initializer replay).

        >>> Spec.parse("RS(0,2)").boxes((8, 3), (2, 2), (0, 1))
        (0, [(slice(2, 4, None), slice(0, 3, None)), (slice(6, 8, None), slice(0, 3, None))])
        """
        idx = self.global_index(shape, mesh_shape, coord)
        lists = [d for d, i in enumerate(idx) if isinstance(i, list)]
        if not lists:
            return None, [idx]
        if len(lists) > 1:
            raise SpecError(f"spec {self}: more than one strided dim")
        (d,) = lists
        f = next(p.split_factor for p in self.normalized(len(shape)).placements
                 if placement_kind(p) == "T" and p.dim == d)
        c = len(idx[d]) // f
        return d, [idx[:d] + (slice(idx[d][j * c], idx[d][j * c] + c),) + idx[d + 1:] for j in range(f)]

    def local_of(self, full, mesh_shape: Sequence[int], coord: Sequence[int]):
        """The device at ``coord``'s piece of the global tensor ``full`` (a view where it is
        one box, else a copy); ``Partial`` axes are ignored (the caller splits the value)."""
        idx = self.global_index(tuple(full.shape), mesh_shape, coord)
        out = full[tuple(i if isinstance(i, slice) else slice(None) for i in idx)]
        for d, i in enumerate(idx):
            if not isinstance(i, slice):
                out = out.index_select(d, full.new_tensor(i, dtype=_long()))
        return out

    def local_shape(self, shape: Sequence[int], mesh_shape: Sequence[int],
                    coord: Sequence[int]) -> tuple[int, ...]:
        """Shape of the local tensor on the device at mesh ``coord``."""
        return tuple(len(s) if isinstance(s, list) else s.stop - s.start
                     for s in self.global_index(shape, mesh_shape, coord))

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
            if placement_kind(p) in ("S", "T"):   # (check has made a strided split even)
                if sizes[p.dim] % mesh_shape[axis]:
                    return False
                sizes[p.dim] //= mesh_shape[axis]
        return True


def with_dim(p, dim: int):
    """``p`` (a Shard or :data:`Strided`) on tensor dim ``dim``."""
    if placement_kind(p) == "T":
        return Strided(dim, split_factor=p.split_factor)
    return Shard(dim)


def _long():
    import torch

    return torch.long


def trusted_spec(placements: tuple[Placement, ...]) -> Spec:
    """``Spec(placements)`` without re-checking them: for placements taken from specs or
    choices already checked (the planner builds millions of combinations of a few).

    >>> trusted_spec((Shard(0), Replicate())) == Spec.parse("S(0)R")
    True
    """
    s = object.__new__(Spec)
    object.__setattr__(s, "placements", placements)
    return s


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
