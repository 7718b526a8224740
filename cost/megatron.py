"""Megatron-LM (PTD-P, Narayanan et al. 2021) formulas as functions: GPT parameters and FLOPs,
tensor/pipeline traffic, the microbatch-time model and training-time estimates.

These are baselines and cross-checks for the general cost model (:mod:`fxpar.cost.compute`
must agree with :func:`gpt_flops` on a GPT graph; :mod:`fxpar.cost.pipeline` with the bubble
fractions). Symbols: ``B`` global batch, ``b`` microbatch, ``s`` sequence length, ``h`` hidden
size, ``l`` layers, ``V`` vocabulary, ``t`` tensor-parallel size, ``p`` pipeline stages, ``d``
data-parallel size, ``n = p·t·d`` devices, ``X`` achieved FLOP/s per device.

>>> from fxpar.cost.megatron import gpt_params, gpt_flops
>>> round(gpt_params(l=96, h=12288) / 1e9, 1)          # GPT-3 175B (Table 2: 174.6)
174.6
>>> round(gpt_flops(B=1536, s=2048, l=96, h=12288) / 1e18, 1)   # per iteration, recompute
4.5
"""

from __future__ import annotations

from fxpar.cost.comm import collective_time, pairs_time
from fxpar.cost.pipeline import bubble_fraction

__all__ = [
    "gpt_params",
    "gpt_flops",
    "gpt_layer_forward_flops",
    "tp_traffic_per_layer",
    "pp_boundary_traffic",
    "tp_comm_time_per_layer",
    "pp_boundary_time",
    "microbatch_compute_time",
    "training_time",
    "training_time_approx",
    "bubble_fraction",
]

V_DEFAULT = 51200
S_DEFAULT = 2048


def gpt_params(l: int, h: int, V: int = V_DEFAULT, s: int = S_DEFAULT) -> float:
    """Parameters of a GPT (PTD-P §5.1 eq. 2): ``P = 12·l·h²·(1 + 13/(12h) + (V+s)/(12·l·h))``.

    >>> round(gpt_params(l=24, h=2304) / 1e9, 2)           # Table 1, first row: 1.7B
    1.65
    """
    return 12.0 * l * h * h * (1 + 13 / (12 * h) + (V + s) / (12 * l * h))


def gpt_layer_forward_flops(b: int, s: int, h: int) -> float:
    """Forward GEMM FLOPs of one transformer layer (PTD-P Appendix): QKV ``6bsh²``, scores
    ``2bs²h``, attention over values ``2bs²h``, projection ``2bsh²``, MLP ``16bsh²``; total
    ``24bsh² + 4bs²h``.

    >>> gpt_layer_forward_flops(1, 1024, 1024) == 24 * 1024**3 + 4 * 1024**3
    True
    """
    return 24.0 * b * s * h * h + 4.0 * b * s * s * h


def gpt_flops(B: int, s: int, l: int, h: int, V: int = V_DEFAULT, *, recompute: bool = True) -> float:
    """GEMM FLOPs of one training iteration (PTD-P §5.1 eq. 3 and Appendix).

    With activation recomputation (the paper's setting) every layer runs forward twice:
    ``F = 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h))``; without:
    ``F = 72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h))`` (backward = 2× forward; the logit layer
    ``2BshV`` forward, ``4BshV`` backward, is never recomputed).

    >>> f = gpt_flops(8, 512, 4, 1024, 50304, recompute=False)
    >>> round(f / (3 * (4 * gpt_layer_forward_flops(8, 512, 1024) + 2 * 8 * 512 * 1024 * 50304)), 12)
    1.0
    """
    if recompute:
        return 96.0 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))
    return 72.0 * B * s * l * h * h * (1 + s / (6 * h) + V / (12 * l * h))


def tp_traffic_per_layer(b: int, s: int, h: int, t: int, bytes_per_elem: int = 2) -> float:
    """Tensor-parallel bytes per layer per microbatch per device (PTD-P §3.2): two all-reduces
    of ``b·s·h`` forward and two backward, ``8·b·s·h·(t−1)/t`` elements.

    >>> tp_traffic_per_layer(1, 2048, 12288, 8, bytes_per_elem=1) == 8 * 2048 * 12288 * 7 / 8
    True
    """
    return 8.0 * b * s * h * (t - 1) / t * bytes_per_elem


def pp_boundary_traffic(b: int, s: int, h: int, t: int = 1, *, scatter_gather: bool = False,
                        bytes_per_elem: int = 2) -> float:
    """Bytes between consecutive stages per microbatch in one direction (PTD-P §3.2, §4.1):
    ``b·s·h``, or ``b·s·h/t`` per tensor-parallel rank with the scatter/gather optimization.

    >>> pp_boundary_traffic(1, 2048, 12288, 8, scatter_gather=True) * 8 == pp_boundary_traffic(1, 2048, 12288)
    True
    """
    n = float(b * s * h) * bytes_per_elem
    return n / t if scatter_gather else n


def tp_comm_time_per_layer(b: int, s: int, h: int, mesh, tp_axis, bytes_per_elem: int = 2, *,
                           placement_aware: bool = True) -> float:
    """Seconds of tensor-parallel communication per layer per microbatch: four ring all-reduces
    of ``b·s·h`` elements over the ``tp_axis`` groups of ``mesh`` (f and g, forward and
    backward), priced by :func:`fxpar.cost.comm.axis_collective_time`.

    >>> from fxpar import Cluster, Mesh
    >>> m = Mesh(Cluster.preset("dgx-a100", physics=None, nodes=2), pp=2, tp=8)
    >>> round(tp_comm_time_per_layer(1, 2048, 12288, m, "tp") * 1e3, 3)   # 4·(2·7/8·50.3 MB/300 GB/s + 14·3 µs)
    1.342
    """
    from fxpar.cost.comm import axis_collective_time

    return 4.0 * axis_collective_time("all_reduce", float(b * s * h) * bytes_per_elem, mesh, tp_axis,
                                      placement_aware=placement_aware)


def pp_boundary_time(b: int, s: int, h: int, cluster, src_group, dst_group, *, scatter_gather: bool = False,
                     bytes_per_elem: int = 2) -> float:
    """Seconds to move one stage-boundary activation from the ``t`` ranks of ``src_group`` to
    the ranks of ``dst_group`` (index-aligned pairs run at once and share the NICs).

    Without scatter/gather every pair sends ``b·s·h``; with it every pair sends ``b·s·h/t`` and
    the receivers all-gather over their (intra-node) group (PTD-P §4.1, Figure 9).

    >>> from fxpar import Cluster
    >>> c = Cluster.preset("dgx-a100", physics=None, nodes=2)
    >>> src, dst = range(8), range(8, 16)
    >>> plain = pp_boundary_time(1, 2048, 12288, c, src, dst)
    >>> sg = pp_boundary_time(1, 2048, 12288, c, src, dst, scatter_gather=True)
    >>> round(plain / sg, 1)          # 8 pairs share 200 GB/s; s/g sends 1/8, then an NVLink all-gather
    4.7
    """
    src, dst = tuple(src_group), tuple(dst_group)
    t = len(src)
    nbytes = pp_boundary_traffic(b, s, h, t, scatter_gather=scatter_gather, bytes_per_elem=bytes_per_elem)
    send = pairs_time(nbytes, list(zip(src, dst)), cluster)
    if not scatter_gather or t == 1:
        return send
    return send + collective_time("all_gather", nbytes, dst, cluster)


def microbatch_compute_time(B: int, b: int, d: int, p: int, t_f: float, t_b: float) -> float:
    """Batch compute time ignoring communication (PTD-P §3.4 eq. 1):
    ``(b'/b + p − 1)·(t_f(b) + t_b(b))`` with ``b' = B/d``.

    >>> microbatch_compute_time(B=512, b=4, d=8, p=8, t_f=1.0, t_b=2.0)   # (16 + 7)·3
    69.0
    """
    return (B / d / b + p - 1) * (t_f + t_b)


def training_time(tokens: float, B: int, s: int, l: int, h: int, n: int, X: float, V: int = V_DEFAULT,
                  *, recompute: bool = True) -> float:
    """End-to-end training seconds from eq. 3 (PTD-P §5.1): ``T/(B·s)`` iterations of ``F``
    FLOPs at ``n·X`` FLOP/s.

    >>> round(training_time(300e9, 1536, 2048, 96, 12288, n=384, X=144e12) / 86400)  # Table 2
    90
    """
    return tokens / (B * s) * gpt_flops(B, s, l, h, V, recompute=recompute) / (n * X)


def training_time_approx(tokens: float, P: float, n: int, X: float) -> float:
    """PTD-P §5.1 eq. 4: ``8·T·P/(n·X)`` seconds (assumes ``6h ≫ s``, ``16lh ≫ V+s``).

    >>> round(training_time_approx(300e9, 175e9, 1024, 140e12) / 86400)   # "34 days"
    34
    """
    return 8.0 * tokens * P / (n * X)
