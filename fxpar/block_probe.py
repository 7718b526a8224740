"""The in-model correction of a calibrated compute profile (issue #24 item 5).

:meth:`fxpar.Cluster.calibrate` measures each kind of kernel alone: square GEMMs, an add, a
log-softmax, a chain of 1-element ops for the per-op overheads. Inside a model the same ops
run slower. What the torch profiler showed on one CPU thread (a 4-block GPT, d=128, at 128
and 1024 tokens): the forward GEMMs at their calibrated rate, the backward ones 1.2x slower
(their saved operands come from memory, not from the cache: 10% of it alone), a GELU 1.8x
its isolated time at 128 tokens (its outputs are kept, so each is fresh memory: page faults),
and every view and autograd node dearer than in a chain of 1-element ops. On 2 one-thread
ranks the model's forward and backward took ``1.17x`` the calibrated prediction plus
``1.5 ms`` whatever the batch, about the calibrated per-op overheads once more. That fixed
part is what every pipeline action pays once per microbatch: without it more microbatches
always looked faster (``benchmarks/pipeline.py``'s plan against measured at ``pp=2``,
Spearman 0.67; with it 0.86-0.89).

This module measures it with a probe shaped like what fxpar trains, a stack of pre-norm
transformer blocks (:class:`ProbeBlock`), at three batch sizes, run forward and backward on
every rank at once like the other calibrations, and prices the same captured graph with the
profile's curves (kernels ``K(b)`` and per-op overheads ``O``, which do not depend on the
batch). The least-squares fit (:func:`fit_in_model`)::

    measured(b) = s · K(b) + r · O

gives ``s``, the speed of in-model kernels against the calibrated curves, and ``r``, the real
per-op cost against the 1-element chain's; :meth:`ComputeProfile.scaled` applies them. It is
fitted per round (the three sizes run back to back, so the host's drift between rounds
cancels) and the median over rounds taken.

Its limits, measured: ``s`` came out 0.94-1.45 over a dozen fits on 2 ranks of this 2-core
host, most within 1.0-1.2; ``r`` 2.2-2.9 over five once the probe stopped accumulating its
gradients (a parameter-sized pass per backward, priced apart:
:func:`fxpar.cost.compute.accumulate_time`), 1.0-3.7 (6.2 once) while it did. The fixed part
is 5-15% of the probe's time at its smallest size, so a loaded host's noise moves ``r``
most. A smaller size would weigh it more, but the fixed part is not constant in the size (at
32 tokens the fit gave ``r`` 6.6, which priced the model 1.45x too slow at 128 tokens): the
sizes are those pipelines run microbatches at.

The probe's width (192) differs from the models the benchmarks train; it stands for "a
transformer layer", not for one model. Only on a synchronous device (a CPU): on a GPU the
host's per-op work overlaps the kernels (:func:`fxpar.cost.compute.op_time`).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

#: the probe's width, heads and blocks, and the (batch, sequence) it is run at
WIDTH, HEADS, BLOCKS, SHAPES = 192, 6, 3, ((1, 128), (2, 128), (8, 128))
#: rounds of the probe per round of the other calibrations (its fit of a small fixed part
#: beside large kernels needs the quieter medians)
ROUNDS = 3
#: the range the fit is kept in: a fit outside it is noise of a loaded host, not physics
SCALE_RANGE, OVERHEAD_RANGE = (0.5, 2.0), (1.0, 10.0)


class ProbeBlock(nn.Module):
    """A pre-norm transformer block: fused qkv, causal SDPA, output projection, GELU MLP."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for z in self.qkv(self.ln1(x)).split(d, dim=2))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


def fit_in_model(measured: Sequence[float], kernels: Sequence[float],
                 overheads: float) -> tuple[float, float]:
    """``(s, r)``: the least-squares fit of ``measured[i] = s·kernels[i] + r·overheads`` over
    the probe's sizes (module docstring), each clipped to its range (:data:`SCALE_RANGE`,
    :data:`OVERHEAD_RANGE`); with ``r`` clipped, ``s`` is fitted again with that ``r``.

    >>> [round(x, 6) for x in fit_in_model((12e-3, 52e-3), (8e-3, 40e-3), 2e-3)]  # kernels 1.25x
    [1.25, 1.0]
    >>> s, r = fit_in_model((13e-3, 23e-3, 53e-3), (8e-3, 16e-3, 40e-3), 1e-3)   # and 3x the overheads
    >>> round(s, 6), round(r, 6)
    (1.25, 3.0)
    >>> s, r = fit_in_model((8.5e-3, 40.5e-3), (8e-3, 40e-3), 1e-3)   # r = 0.5: clipped, s refitted
    >>> round(s, 4), r
    (0.9856, 1.0)
    """
    ms, ks = [float(x) for x in measured], [float(x) for x in kernels]
    if len(ms) < 2 or overheads <= 0 or min(ks) <= 0 or min(ms) <= 0 or max(ks) == min(ks):
        return 1.0, 1.0
    # a straight line through (kernels, measured): slope s, intercept r·overheads
    n, o = len(ms), float(overheads)
    skk, sk, sm, skm = sum(k * k for k in ks), sum(ks), sum(ms), sum(k * m for k, m in zip(ks, ms))
    s = (n * skm - sk * sm) / (n * skk - sk * sk)
    r = (sm - s * sk) / n / o
    if not OVERHEAD_RANGE[0] <= r <= OVERHEAD_RANGE[1]:
        r = min(max(r, OVERHEAD_RANGE[0]), OVERHEAD_RANGE[1])
        s = sum(k * (m - r * o) for k, m in zip(ks, ms)) / skk
    return min(max(s, SCALE_RANGE[0]), SCALE_RANGE[1]), r


def price(gm: torch.fx.GraphModule, profile) -> tuple[float, float]:
    """``(kernels, overheads)``: seconds of one forward and backward of a captured graph on
    ``profile`` (:func:`fxpar.cost.compute.op_time` per node with its dispatches), the part
    that is per-op overhead (:func:`fxpar.cost.compute.op_overheads` times the dispatches)
    apart."""
    from fxpar import ir
    from fxpar.cluster import Cluster
    from fxpar.cost.compute import node_cost, node_dispatches, op_overheads, op_time

    cluster = Cluster.local(max(profile.ranks, 1), compute=profile)
    fo, bo = op_overheads(cluster)
    flags = ir.grad_flags(gm)
    total = over = 0.0
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "get_attr", "output"):
            continue
        d = node_dispatches(n, requires_grad=flags) or (1, 1)
        f, b = op_time(node_cost(n, requires_grad=flags, gm=gm), cluster, dispatches=d)
        total += f + b
        over += d[0] * fo + (d[1] * bo if b > 0 else 0.0)
    return total - over, over


def measure_in_model(group, device, profile, iters: int, min_time: float):
    """:attr:`ComputeProfile.in_model` ``(s, r)`` of ``profile`` measured on ``group`` (every
    rank at once, :func:`fxpar.cluster._interleaved_times`) and ``profile`` scaled by them;
    unchanged on an asynchronous device."""
    from fxpar.capture import capture
    from fxpar.cluster import _interleaved_times

    if profile.asynchronous:
        return profile
    dtype = getattr(torch, profile.dtype)
    g = torch.Generator().manual_seed(0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = nn.Sequential(*(ProbeBlock(WIDTH, HEADS) for _ in range(BLOCKS))).to(device, dtype)
    xs = [torch.randn(b, t, WIDTH, generator=g).to(device, dtype) for b, t in SHAPES]

    def run(x):
        def fn(reps: int) -> list[float]:
            t0 = time.perf_counter()
            for _ in range(reps):
                # no gradient accumulated into an earlier one's: a step's first backward (what
                # is priced here; adding into .grad is a parameter-sized pass of its own)
                model.zero_grad(set_to_none=True)
                model(x).sum().backward()
            return [(time.perf_counter() - t0) / reps]
        return fn

    rounds = [t[0] for t in _interleaved_times([run(x) for x in xs], ROUNDS * iters, group,
                                               min_time, lambda: None, per_round=True)]
    priced = [price(capture(model, (x,)), profile) for x in xs]
    kernels = [k for k, _ in priced]
    fits = [fit_in_model(ms, kernels, priced[0][1]) for ms in zip(*rounds)]
    s, r = (statistics.median(f[i] for f in fits) for i in range(2))
    return dataclasses.replace(profile.scaled(s, r), in_model=(s, r))

