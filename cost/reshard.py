"""Cost of one resharding step on one mesh axis (pure functions, no process group).

A step changes the placement of one mesh axis (see :mod:`fxpar.resharding.intra` for which changes are
legal). Its bytes come from the **current** local shape, taken on the fullest device
(:meth:`fxpar.spec.Spec.local_numel`, device 0 by chunk rules) times the dtype's item size; its
time from the ring formulas of :func:`fxpar.cost.comm.axis_collective_time` (every group of the
axis runs at once, the slowest sets the time), or from the device memory bandwidth ``B_mem``
for the local steps:

==================  =================  =================================  ===========================
kind                placement change   ``nbytes`` (per device, fullest)   time
==================  =================  =================================  ===========================
``all_gather``      S(d) → R           input shard (source local)         ``(G−1)·(α + m/β)``
``reduce_scatter``  P → S(d)           full buffer (source local)         ``(G−1)·(α + m/(G·β))``
``all_reduce``      P → R              full buffer (source local)         ``2(G−1)·(α + m/(G·β))``
``all_to_all``      S(d) → S(d')       full buffer (source local)         ``(G−1)·(α + m/(G·β))``
``chunk``           R → S(d)           kept shard (destination local)     ``2·m / B_mem`` (read+write)
``to_partial``      R → P(op)          zero-filled buffer (``sum`` only)  ``m / B_mem``; 0 for avg/max/min
``rescale``         P(sum) ↔ P(avg)    full buffer                        ``2·m / B_mem``
==================  =================  =================================  ===========================

On a mesh axis of size 1 every step is free (the layouts coincide).

>>> import torch
>>> from fxpar import Cluster, Mesh, Spec
>>> mesh = Mesh(Cluster.preset("dgx-a100", physics=None), dp=2, tp=4)
>>> nbytes, t = step_cost("all_gather", Spec.parse("S(0)S(1)"), Spec.parse("S(0)R"), mesh, 1,
...                       (1024, 1024), torch.float32)
>>> nbytes                     # (1024/2)·(1024/4) float32 elements on each device
524288
>>> round(t * 1e6, 2)          # 3·(3 µs + 512 KiB / 300 GB/s)
14.24
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from fxpar.cost.comm import axis_collective_time
from fxpar.kinds import StrKind
from fxpar.spec import placement_kind

__all__ = ["StepKind", "STEP_KINDS", "COLLECTIVE_KINDS", "LOCAL_KINDS", "step_bytes", "step_time",
           "step_cost", "max_local_shape", "local_numel"]


class StepKind(StrKind):
    """What one resharding step does on one mesh axis (the table in the module docstring): four
    collectives (their :class:`fxpar.kinds.Collective` names) and three local steps."""

    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_REDUCE = "all_reduce"
    ALL_TO_ALL = "all_to_all"
    CHUNK = "chunk"
    TO_PARTIAL = "to_partial"
    RESCALE = "rescale"


#: Steps that talk over the mesh axis (priced by the ring formulas).
COLLECTIVE_KINDS = (StepKind.ALL_GATHER, StepKind.REDUCE_SCATTER, StepKind.ALL_REDUCE, StepKind.ALL_TO_ALL)
#: Steps that only touch local memory (priced by the memory bandwidth).
LOCAL_KINDS = (StepKind.CHUNK, StepKind.TO_PARTIAL, StepKind.RESCALE)
STEP_KINDS = COLLECTIVE_KINDS + LOCAL_KINDS
#: local steps: passes over ``nbytes`` of device memory (read + write = 2)
_MEMORY_PASSES = {StepKind.CHUNK: 2.0, StepKind.RESCALE: 2.0, StepKind.TO_PARTIAL: 1.0}


def _itemsize(dtype) -> int:
    return dtype.itemsize if isinstance(dtype, torch.dtype) else int(dtype)


def max_local_shape(spec, shape: Sequence[int], mesh_shape: Sequence[int]) -> tuple[int, ...]:
    """``spec.max_local_shape(shape, mesh_shape)`` (the first device's local shape), without
    building slices: each shard of a dim of size ``n`` over ``G`` devices keeps
    ``min(n, ceil(n / G))`` on device 0 (:func:`fxpar.spec.chunk_bounds`). Falls back to the
    spec's own method (and its errors) for a spec that does not fit ``shape``/``mesh_shape``."""
    ndim = len(shape)
    pls = spec.placements
    if len(pls) != len(mesh_shape):
        return spec.max_local_shape(shape, mesh_shape)
    out = list(shape)
    for axis, p in enumerate(pls):
        if placement_kind(p) in ("S", "T"):   # a strided shard holds n / G too (even)
            d = p.dim
            if not -ndim <= d < ndim:
                return spec.max_local_shape(shape, mesh_shape)
            d %= ndim
            n = out[d]
            out[d] = min(n, -(-n // mesh_shape[axis]))
    return tuple(out)


def local_numel(spec, shape: Sequence[int], mesh_shape: Sequence[int]) -> int:
    """``spec.local_numel(shape, mesh_shape)``: elements on the fullest device."""
    n = 1
    for s in max_local_shape(spec, shape, mesh_shape):
        n *= s
    return n


def step_bytes(kind: str, src, dst, mesh_shape: Sequence[int], axis: int, shape: Sequence[int],
               dtype: torch.dtype | int) -> int:
    """Bytes one step moves or writes per device (fullest device), per the table above.

    ``dtype`` is a ``torch.dtype`` or an item size in bytes.
    """
    if kind not in STEP_KINDS:
        raise ValueError(f"unknown reshard step kind {kind!r}; known: {STEP_KINDS}")
    return _BYTES.get(kind, _source_bytes)(src, dst, mesh_shape, axis, shape, _itemsize(dtype))


def _source_bytes(src, dst, mesh_shape, axis, shape, size) -> int:
    return local_numel(src, shape, mesh_shape) * size


def _to_partial_bytes(src, dst, mesh_shape, axis, shape, size) -> int:
    # Only Partial(sum) writes anything: the devices off axis-coordinate 0 zero their copy.
    op = dst[axis].reduce_op
    return local_numel(src, shape, mesh_shape) * size if op == "sum" and mesh_shape[axis] > 1 else 0


#: bytes per kind where they are not the source's local buffer
_BYTES = {
    StepKind.CHUNK: lambda src, dst, mesh_shape, axis, shape, size: local_numel(dst, shape, mesh_shape) * size,
    StepKind.TO_PARTIAL: _to_partial_bytes,
}


@functools.lru_cache(maxsize=65536)
def _axis_time(kind: str, nbytes: float, mesh, axis: int) -> float:
    # A search prices the same (collective, size, axis) many times; each call walks every
    # group of the axis (linear in the mesh size).
    return axis_collective_time(kind, nbytes, mesh, axis)


def step_time(kind: str, nbytes: float, mesh, axis: int) -> float:
    """Seconds for a step of ``kind`` moving ``nbytes`` (see :func:`step_bytes`) on mesh axis
    ``axis`` of ``mesh`` (an :class:`fxpar.Mesh`)."""
    if mesh.shape[axis] == 1:
        return 0.0
    if kind in COLLECTIVE_KINDS:
        return _axis_time(kind, nbytes, mesh, axis)
    if kind in _MEMORY_PASSES:
        return _MEMORY_PASSES[kind] * nbytes / mesh.cluster.memory_bandwidth
    raise ValueError(f"unknown reshard step kind {kind!r}; known: {STEP_KINDS}")


def step_cost(kind: str, src, dst, mesh, axis: int, shape: Sequence[int],
              dtype: torch.dtype | int) -> tuple[int, float]:
    """``(nbytes, seconds)`` of one step from spec ``src`` to spec ``dst`` on ``axis``.

    ``src`` and ``dst`` are :class:`fxpar.spec.Spec` that differ only on ``axis``; legality is
    the planner's business (:func:`fxpar.resharding.intra.step_kind`), this function only prices.
    """
    nbytes = step_bytes(kind, src, dst, mesh.shape, axis, shape, dtype)
    return nbytes, step_time(kind, nbytes, mesh, axis)
