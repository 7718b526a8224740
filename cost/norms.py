"""Normalization costs beyond FLOPs: the statistics they keep and the collectives of a synced batch norm.

**Statistics kept for backward** (:func:`norm_stat_rows`): one fp32 ``(mean, rstd)`` pair per
normalized group, besides the input itself:

==================  ================================  ==========================
norm                a group is                        pairs for ``x[N, C, *sp]``
==================  ================================  ==========================
batch norm          a channel                         ``C``
group norm (``G``)  a sample's group of channels      ``N·G``
instance norm       a sample's channel                ``N·C``
layer / RMS norm    a row (all but the normalized)    ``Π shape[:-k]``
==================  ================================  ==========================

**Synchronized batch norm** (:mod:`fxpar.runtime.norms`) on a batch sharded over mesh axes
``axes``: per axis ``a`` of size ``G_a``, the forward all-gathers each device's ``3·C``
statistics (count, mean, M2; ``m = 3·C·b`` bytes per device, ``t_AG = α + (G_a−1)·m/β``) and
the backward all-reduces ``3·C`` sums (``Σdy``, ``Σdy·(x−mean)``, count;
``t_AR = α + 2(G_a−1)/G_a·m/β``), one axis after the other (:func:`sync_batch_norm_comm`).
Both are latency-bound for any real ``C``: a ResNet's widest norm (2048 channels) moves 24 KiB.
The weight's and bias's gradients are partial sums reduced with the other data-parallel
gradients (priced on their edges), not here.

>>> norm_stat_rows("batch", (8, 64, 14, 14)), norm_stat_rows("group", (8, 64, 14, 14), groups=32)
(64, 256)
>>> from fxpar import Cluster, Mesh
>>> fwd, bwd = sync_batch_norm_comm(64, Mesh(Cluster.preset("dgx-a100"), dp=8), ["dp"])
>>> fwd > 0 and bwd > 0
True
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from fxpar.cost.comm import axis_collective_time

__all__ = ["norm_stat_rows", "norm_saved_bytes", "sync_batch_norm_bytes", "sync_batch_norm_comm",
           "STAT_BYTES"]

#: bytes of one statistic (fp32, as torch keeps them for every input dtype but fp64)
STAT_BYTES = 4


def norm_stat_rows(kind: str, shape: Sequence[int], *, groups: int | None = None,
                   normalized_dims: int = 1) -> int:
    """How many ``(mean, rstd)`` pairs a norm of ``kind`` (``"batch"``, ``"group"``,
    ``"instance"``, ``"layer"``) keeps for an input of ``shape`` (module docstring table).

    >>> norm_stat_rows("instance", (4, 3, 5)), norm_stat_rows("layer", (4, 3, 5))
    (12, 12)
    """
    shape = tuple(int(s) for s in shape)
    if kind == "batch":
        return shape[1] if len(shape) > 1 else 1
    if kind == "group":
        if groups is None:
            raise ValueError("norm_stat_rows('group', ...) needs groups")
        return shape[0] * int(groups)
    if kind == "instance":
        return math.prod(shape[:2])
    if kind == "layer":
        return math.prod(shape[:len(shape) - normalized_dims])
    raise ValueError(f"norm_stat_rows: unknown norm kind {kind!r}")


def norm_saved_bytes(kind: str, shape: Sequence[int], itemsize: int, **kw) -> int:
    """Bytes a training norm keeps for backward: its input plus two fp32 statistics per group.

    >>> norm_saved_bytes("batch", (8, 64, 14, 14), 2) == 8 * 64 * 14 * 14 * 2 + 64 * 2 * 4
    True
    """
    return math.prod(int(s) for s in shape) * itemsize + 2 * STAT_BYTES * norm_stat_rows(kind, shape, **kw)


def sync_batch_norm_bytes(channels: int, stat_bytes: int = STAT_BYTES) -> int:
    """Bytes per device of a synced batch norm's collective, forward or backward (``3·C``
    statistics).

    >>> sync_batch_norm_bytes(2048)
    24576
    """
    return 3 * int(channels) * stat_bytes


def sync_batch_norm_comm(channels: int, mesh, axes: Sequence[int | str], *,
                         stat_bytes: int = STAT_BYTES, input_grad: bool = True) -> tuple[float, float]:
    """``(t_fwd, t_bwd)`` seconds of the collectives of a batch norm whose batch is sharded over
    mesh ``axes``: an all-gather of ``3·C`` statistics per axis forward, an all-reduce of ``3·C``
    sums per axis backward (none when the input needs no gradient: the weight's and bias's are
    local partial sums). ``(0, 0)`` for no axes or axes of size 1.

    >>> from fxpar import Cluster, Mesh
    >>> m = Mesh(Cluster.preset("dgx-a100", nodes=2), dp=2, tp=8)
    >>> sync_batch_norm_comm(64, m, []), sync_batch_norm_comm(64, m, ["dp"], input_grad=False)[1]
    ((0.0, 0.0), 0.0)
    """
    nbytes = sync_batch_norm_bytes(channels, stat_bytes)
    fwd = sum(axis_collective_time("all_gather", nbytes, mesh, a) for a in axes)
    bwd = sum(axis_collective_time("all_reduce", nbytes, mesh, a) for a in axes) if input_grad else 0.0
    return float(fwd), float(bwd)
