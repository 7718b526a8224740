"""Communication inside vocabulary-parallel losses (pure functions; the runtime op is
:mod:`fxpar.runtime.vocab`).

A cross-entropy over ``rows`` rows whose class dim is split over a mesh axis runs, per axis
(nested axes one after the other), ONE all-gather of ``2·rows`` numbers per device (each
shard's ``logsumexp`` and target logit; ``3·rows`` with label smoothing, which also needs
``Σ_c x``), in the dtype the loss is computed in (float32, float64 for a float64 input):
``lse = logsumexp_r lse_r``. Megatron runs three all-reduces (max, sum of exponentials,
target logit); a loss's few thousand rows are latency-bound, so one collective is what
counts. Its backward is local (the saved ``lse`` gives the softmax): nothing. A
``log_softmax`` over a split dim all-gathers each shard's ``logsumexp`` (``rows`` numbers)
in forward and all-reduces (``sum``) ``Σ_dim g`` in backward; the nll loss of its output then
needs none (each rank adds the log-probabilities of the targets it holds: ``P(sum)``).
Against gathering the logits before a replicated loss (an all-gather of ``rows·C/t`` numbers
per device, ``C`` classes, ``t`` devices on the axis) this is ``2·rows`` numbers instead of
``rows·C/t``.

>>> vocab_ce_messages(4096, 4)
(('all_gather', None, 32768),)
>>> from fxpar import Cluster, Mesh
>>> mesh = Mesh(Cluster.preset("dgx-h100"), tp=8)
>>> t = vocab_ce_time(4096, 4, mesh, [0])     # one small all-gather: latency-bound
>>> 1e-5 < t < 3e-5
True
"""

from __future__ import annotations

from collections.abc import Sequence

from fxpar.cost.comm import axis_collective_time

__all__ = ["vocab_ce_messages", "vocab_ce_time", "vocab_log_softmax_messages", "vocab_log_softmax_time"]


def vocab_ce_messages(rows: int, itemsize: int, smoothing: bool = False) -> tuple[tuple[str, str, int], ...]:
    """``(collective, reduce op, bytes per device)`` of each collective on one axis (an
    all-gather's bytes: the device's own part, :mod:`fxpar.cost.comm`'s convention)."""
    return (("all_gather", None, (3 if smoothing else 2) * rows * itemsize),)


def vocab_ce_time(rows: int, itemsize: int, mesh, axes: Sequence[int | str],
                  smoothing: bool = False) -> float:
    """Seconds of the forward collectives (:func:`vocab_ce_messages` on each of ``axes`` of
    ``mesh``, an :class:`fxpar.Mesh`), one after the other; 0 without axes."""
    msgs = vocab_ce_messages(rows, itemsize, smoothing)
    return sum(axis_collective_time(kind, nbytes, mesh, a) for a in axes for kind, _, nbytes in msgs)


def vocab_log_softmax_messages(rows: int, itemsize: int) -> tuple[tuple, tuple]:
    """``(forward, backward)`` collectives of a ``log_softmax`` over a split dim on one axis,
    each ``(collective, reduce op, bytes per device)``.

    >>> vocab_log_softmax_messages(8, 4)
    ((('all_gather', None, 32),), (('all_reduce', 'sum', 32),))
    """
    n = rows * itemsize
    return (("all_gather", None, n),), (("all_reduce", "sum", n),)


def vocab_log_softmax_time(rows: int, itemsize: int, mesh, axes: Sequence[int | str]) -> tuple[float, float]:
    """``(t_fwd, t_bwd)`` seconds of :func:`vocab_log_softmax_messages` on each of ``axes``."""
    fwd, bwd = vocab_log_softmax_messages(rows, itemsize)
    return tuple(sum(axis_collective_time(kind, nb, mesh, a) for a in axes for kind, _, nb in msgs)
                 for msgs in (fwd, bwd))
