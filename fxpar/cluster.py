"""The physical cluster model: nodes, devices, links, memory and compute.

Units are SI throughout: bytes, seconds, bytes/s, FLOP/s. Bandwidths are **unidirectional**:

* ``intra_node_bandwidth``: what one device can push to its peers inside a node (NVLink /
  NVSwitch / Infinity Fabric), per device;
* ``inter_node_bandwidth``: what one node can push off-node through all its NICs together
  (AxoNN's β_inter: the node's links, shared by every ring that crosses the node boundary);
* ``inter_switch_bandwidth``: what one leaf switch can push to the spine (AMSP §V-D), shared by
  the rings that leave the leaf; ``None`` means a non-blocking fabric.

Device ``d`` lives on node ``d // devices_per_node``; node ``n`` under leaf switch
``n // nodes_per_switch``.

A cluster may carry a measured communication :class:`Profile` (from :meth:`Cluster.calibrate`):
latency α and bandwidth β fitted per collective, per level (``intra`` / ``inter``) and per
group size. The cost functions in :mod:`fxpar.cost.comm` prefer those numbers over the
nominal link figures. It may also carry a measured :class:`ComputeProfile` (GEMM rate as a
function of a GEMM's FLOPs, elementwise bandwidth as a function of the bytes moved, per-op
overheads forward and backward), measured on every rank at once, which
:func:`fxpar.cost.compute.op_time` prefers over ``peak_flops``·efficiency and
``memory_bandwidth``. ``Cluster.local(n).calibrate()`` (on a live group of ``n`` ranks) is the
one call that gives both.

>>> from fxpar.cluster import Cluster
>>> c = Cluster.preset("dgx-a100", nodes=2)
>>> c.num_devices, c.node_of(9), c.device_memory // 2**30
(16, 1, 80)
>>> Cluster.from_json(c.to_json()) == c
True
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import math
import socket
import statistics
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from fxpar import defaults
from fxpar.errors import ClusterError
from fxpar.kinds import Collective

__all__ = ["Cluster", "Profile", "ProfileEntry", "ComputeProfile", "Physics", "PHYSICS_SOURCES",
           "COLLECTIVES"]

GB = 1e9
GiB = 2**30

#: Collectives the cost model and the profiler know, by the names used everywhere in fxpar.
COLLECTIVES = tuple(c.value for c in Collective)


@dataclass(frozen=True)
class ProfileEntry:
    """Fitted ``t(m) = α·steps(G) + factor(G)·m / β`` for one collective, level and group size.

    ``level`` is ``"intra"`` (group inside one node) or ``"inter"`` (group spanning nodes);
    ``bandwidth`` is the bus bandwidth β in bytes/s, ``latency`` the per-step α in seconds.
    ``rel_error`` is the median relative error of the fit over the measured sizes.
    """

    collective: str
    level: str
    group_size: int
    latency: float
    bandwidth: float
    rel_error: float = 0.0


@dataclass(frozen=True)
class Profile:
    """Measured α/β table of a cluster (AMSP's communication profiler, §V-C)."""

    entries: tuple[ProfileEntry, ...] = ()

    def lookup(self, collective: str, level: str, group_size: int) -> ProfileEntry | None:
        """The entry for this collective and level whose group size is nearest (log scale)."""
        import math

        cands = [e for e in self.entries if e.collective == collective and e.level == level]
        if not cands:
            return None
        return min(cands, key=lambda e: (abs(math.log2(e.group_size) - math.log2(max(group_size, 1))),
                                         -e.group_size))


@dataclass(frozen=True)
class ComputeProfile:
    """Measured compute of one device (rank) while every rank runs the same kernels at once.

    * ``gemm``: ``((flops, rate), ...)`` ascending in ``flops``: the FLOP/s a square float32
      GEMM of ``flops = 2·n³`` FLOPs reached, kernel only (the dispatch removed,
      :func:`fxpar.cost.calibration.rate_points`), its second operand streamed from memory
      (a pool of distinct matrices twice a core's cache, :func:`_cache_bytes`, as a training
      step meets its weights: each is read once per pass, long after the last use);
    * ``memory``: ``((bytes, rate), ...)``: bytes/s of an elementwise add moving ``bytes``
      (two reads and one write), kernel only;
    * ``vector``: ``((flops, rate), ...)``: FLOP/s of non-GEMM arithmetic as the cost rules
      count it, from a row log-softmax forward and backward (``(5 + 4)·numel`` FLOPs,
      :func:`fxpar.cost.compute.softmax_cost`):
      exponentials, logs and reductions run far below the GEMM rate on a CPU (a log-softmax
      reaches ~1/10 of it), so pricing them at the GEMM peak undercounts norms, softmax and
      losses. Empty (a profile saved before it existed): non-GEMM FLOPs at the GEMM peak;
    * ``activation``: ``((elements, rate), ...)``: FLOP/s of a transcendental elementwise op
      (kind ``"activation"``: GELU, SiLU, tanh, exp, ...; one FLOP per element and
      direction, :func:`fxpar.cost.compute.activation_cost`), from a GELU forward and
      backward of each of ``memory_sizes`` bytes. On a CPU those run 4–15x an add's time per
      element, so neither bytes nor the log-softmax rate price them. Empty: ``vector``;
    * ``attention``: ``((forward flops, rate), ...)``: FLOP/s of fused attention (SDPA,
      causal) forward + backward as :func:`fxpar.cost.compute.sdpa_cost` counts them, by the
      forward's FLOPs; on a CPU it runs well below a GEMM of the same FLOPs. Empty: the GEMM
      curve;
    * ``optimizer``: ``(per_tensor, per_element)`` seconds of a ``torch.optim.AdamW`` step
      as the runtime steps it (fused, :data:`fxpar.defaults.FUSED_STEP`; else torch's
      default: on a CPU one tensor at a time) over a parameter of ``n`` elements,
      ``per_tensor + per_element·n``; empty: the step is not priced;
    * ``op_overhead``: seconds per forward op beyond its kernel (dispatch + autograd record,
      a 1-element op on a tensor that requires grad); ``bwd_op_overhead``: seconds per
      backward node (autograd engine + the gradient kernel's dispatch);
    * ``dispatch``: seconds of a 1-element op without autograd (removed from the curves);
    * ``ranks``: how many ranks measured concurrently;
    * ``shared``: on a host whose cores the ranks share (``Cluster.calibrate(share_cores=True)``),
      entry ``k−1`` the speed of compute while ``k`` of its ranks compute at once over its
      speed with all ``ranks`` busy (the curves' load; the last entry is 1): a pipeline rank
      in the others' bubble gets the cores they leave (:func:`fxpar.cost.step.host_rate`).
      Measured, not ``cores/k``: 4 one-thread ranks on 2 vCPUs ran a GPT block's forward and
      backward 2.1×, 1.5× and 1.1× faster with 1, 2 and 3 of them busy. ``()``: not
      modelled (every rank at the curves' speed);
    * ``dtype``: the element type the GEMM, memory, vector and attention curves were measured
      in (``"float32"``; ``"bfloat16"`` for a model trained in bf16 on a GPU, where bf16 GEMMs
      run ~15× faster than float32 ones);
    * ``asynchronous``: the device runs kernels behind the host (CUDA): the host's per-op work
      (``op_overhead``, ``bwd_op_overhead``) overlaps the kernels queued before it, so an op
      costs its kernel time alone; on a CPU (``False``) host and kernel are one thread and
      the overheads add;
    * ``in_model``: ``(s, r)`` the curves and overheads were corrected by to what a transformer
      block runs at inside a model (:mod:`fxpar.block_probe`): kernels take ``s`` times what
      the curves measured alone give, each op ``r`` times the overheads the 1-element chain
      gave (the figures above are the corrected ones); ``()``: not corrected.

    :func:`fxpar.cost.compute.calibrated_time` reads it:
    ``t = max(flops / gemm_rate(flops), bytes / memory_rate(bytes)) (+ overhead unless
    asynchronous)``.

    >>> p = ComputeProfile(gemm=((2e3, 1e9), (2e6, 8e9)), memory=((1e4, 2e10), (1e8, 5e9)),
    ...                    op_overhead=5e-6, bwd_op_overhead=1e-5)
    >>> p.peak_flops / 1e9, p.memory_bandwidth / 1e9
    (8.0, 5.0)
    """

    gemm: tuple[tuple[float, float], ...]
    memory: tuple[tuple[float, float], ...]
    op_overhead: float
    bwd_op_overhead: float
    dispatch: float = 0.0
    ranks: int = 1
    vector: tuple[tuple[float, float], ...] = ()
    optimizer: tuple[float, ...] = ()
    attention: tuple[tuple[float, float], ...] = ()
    dtype: str = "float32"
    asynchronous: bool = False
    activation: tuple[tuple[float, float], ...] = ()
    shared: tuple[float, ...] = ()
    in_model: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "in_model", tuple(float(x) for x in self.in_model))
        sh = tuple(float(x) for x in self.shared)
        if sh and not (len(sh) == self.ranks and all(0 < x < math.inf for x in sh)):
            raise ClusterError(f"ComputeProfile.shared needs one positive speed per number of "
                               f"busy ranks (1..{self.ranks}), got {self.shared!r}")
        object.__setattr__(self, "shared", sh)
        object.__setattr__(self, "dtype", str(self.dtype).removeprefix("torch."))
        object.__setattr__(self, "asynchronous", bool(self.asynchronous))
        opt = tuple(float(x) for x in self.optimizer)
        if opt and (len(opt) != 2 or not all(x >= 0 and math.isfinite(x) for x in opt)):
            raise ClusterError(f"ComputeProfile.optimizer needs (per_tensor, per_element) seconds "
                               f">= 0, got {self.optimizer!r}")
        object.__setattr__(self, "optimizer", opt)
        for name in ("gemm", "memory", "vector", "attention", "activation"):
            pts = tuple(sorted((float(w), float(r)) for w, r in getattr(self, name)))
            required = name in ("gemm", "memory")  # the others are empty in older profiles
            if (required and not pts) or not all(w > 0 and r > 0 and math.isfinite(w)
                                                 and math.isfinite(r) for w, r in pts):
                raise ClusterError(f"ComputeProfile.{name} needs positive finite (size, rate) "
                                   f"points, got {getattr(self, name)!r}")
            object.__setattr__(self, name, pts)
        for name in ("op_overhead", "bwd_op_overhead", "dispatch"):
            v = float(getattr(self, name))
            if not (v >= 0 and math.isfinite(v)):
                raise ClusterError(f"ComputeProfile.{name} must be a finite number >= 0, got {v!r}")
            object.__setattr__(self, name, v)

    @property
    def peak_flops(self) -> float:
        """The fastest GEMM rate measured (FLOP/s)."""
        return max(r for _, r in self.gemm)

    @property
    def memory_bandwidth(self) -> float:
        """The elementwise rate at the largest size measured (bytes/s): DRAM, not cache."""
        return self.memory[-1][1]

    def scaled(self, time: float, overhead: float) -> ComputeProfile:
        """This profile with every kernel taking ``time`` times as long (its GEMM, memory,
        vector, attention and activation rates divided by it) and the per-op overheads
        ``overhead`` times as large.

        >>> p = ComputeProfile(gemm=((1e3, 1e9),), memory=((1e3, 1e10),), op_overhead=2e-6,
        ...                    bwd_op_overhead=4e-6)
        >>> q = p.scaled(2.0, 3.0)
        >>> q.gemm, q.memory, q.op_overhead, q.bwd_op_overhead
        (((1000.0, 500000000.0),), ((1000.0, 5000000000.0),), 6e-06, 1.2e-05)
        """
        def curve(pts):
            return tuple((x, r / time) for x, r in pts)
        return dataclasses.replace(self, gemm=curve(self.gemm), memory=curve(self.memory),
                                   vector=curve(self.vector), attention=curve(self.attention),
                                   activation=curve(self.activation),
                                   op_overhead=self.op_overhead * overhead,
                                   bwd_op_overhead=self.bwd_op_overhead * overhead)

    def to_dict(self) -> dict:
        return dict(gemm=[list(p) for p in self.gemm], memory=[list(p) for p in self.memory],
                    op_overhead=self.op_overhead, bwd_op_overhead=self.bwd_op_overhead,
                    dispatch=self.dispatch, ranks=self.ranks, vector=[list(p) for p in self.vector],
                    optimizer=list(self.optimizer), attention=[list(p) for p in self.attention],
                    dtype=self.dtype, asynchronous=self.asynchronous,
                    activation=[list(p) for p in self.activation], shared=list(self.shared),
                    in_model=list(self.in_model))

    @classmethod
    def from_dict(cls, d: dict) -> ComputeProfile:
        try:
            return cls(gemm=tuple(tuple(p) for p in d["gemm"]),
                       memory=tuple(tuple(p) for p in d["memory"]),
                       op_overhead=d["op_overhead"], bwd_op_overhead=d["bwd_op_overhead"],
                       dispatch=d.get("dispatch", 0.0), ranks=int(d.get("ranks", 1)),
                       vector=tuple(tuple(p) for p in d.get("vector", ())),
                       optimizer=tuple(d.get("optimizer", ())),
                       attention=tuple(tuple(p) for p in d.get("attention", ())),
                       activation=tuple(tuple(p) for p in d.get("activation", ())),
                       dtype=d.get("dtype", "float32"), asynchronous=d.get("asynchronous", False),
                       shared=tuple(d.get("shared", ())), in_model=tuple(d.get("in_model", ())))
        except (KeyError, TypeError, ValueError) as e:
            raise ClusterError(f"bad compute profile in cluster JSON: {type(e).__name__}: {e}") from e


@dataclass(frozen=True)
class Physics:
    """How far below its data sheet a device and its links run: the few physical parameters
    the nominal cost model reads (issue #24 item 3). Each preset's values and their sources
    are in :data:`PHYSICS_SOURCES`; a calibrated cluster's measured curves
    (:class:`ComputeProfile`, :class:`Profile`) replace the compute and link parts.

    * **GEMMs** run their output columns in tiles of ``gemm_tile``'s ``tn`` (or a narrower
      one, at less operand reuse), padded to whole tiles, and whole tiles reach
      ``gemm_efficiency`` of ``peak_flops`` (:func:`fxpar.cost.compute.gemm_efficiency`:
      rows and waves are taken as continuous, so a GEMM's time stays linear in the
      microbatch); the op's time is the roofline
      ``max(flops / (peak·eff), bytes / (bw·memory_efficiency))``.
    * **attention** (fused SDPA, forward and backward) at ``attention_efficiency`` of peak;
      other ops by the roofline at ``memory_efficiency`` of ``memory_bandwidth``.
    * **collectives**: the links' bus bandwidth is ``intra_comm_efficiency`` /
      ``inter_comm_efficiency`` of the nominal figure, so a collective of ``m`` bytes reaches
      the bus bandwidth ``factor·m / (α·steps + factor·m / (eff·β))``: message size enters
      through the latency term, network level through ``α`` and ``eff`` of its level.
      ``net_overhead``: the floor of every step of a ring all-gather or reduce-scatter whose
      group spans nodes (NCCL's ``tuning.cc``: "inter-node rings still have to launch nsteps
      * net overhead", the network post cost ``getNetOverhead``, 1 µs on Intel hosts and 2 µs
      on AMD ones, times 3 under the Simple protocol large messages use): such a ring prices
      its intra-node steps at ``max(α_i, net_overhead)`` (:func:`fxpar.cost.comm.latency_time`).
    * **fixed costs**: ``kernel_overhead`` seconds per kernel that does work (forward, and
      backward where there is one: launch gaps a kernel's size does not change), paid once
      per microbatch; ``microbatch_overhead`` seconds per forward or backward pass of one
      microbatch (a pipeline action, or an SPMD step's forward and its backward: scheduling,
      the autograd engine's start, the point-to-point handshake, the loss).
    * **split backward**: ``split_backward`` is ``(I + W) / B`` of a chunk whose backward a
      zero-bubble schedule splits into input (``I``) and weight (``W``) gradients. 1 (the
      default) prices the split as free, as zero-bubble schedules assume and as fxpar's
      runtime runs a chunk whose matrices are all linear weights (each linear keeps its
      input and output gradient for ``W``: :mod:`fxpar.runtime.deferred`); torch's split
      (``stage_backward_input``/``stage_backward_weight``, which the runtime runs for other
      chunks) walks the graph twice, and on 1 CPU thread measured 1.84, 1.62 and 1.13 for 4
      GPT blocks at d=128 with 64 and 512 tokens and at d=512 with 128 tokens.
      :meth:`Cluster.refine` fits it from a profile with ``I``/``W`` actions.

    >>> ph = Physics(gemm_efficiency=0.7)
    >>> ph.gemm_tile, ph == Physics.from_dict(ph.to_dict())
    ((256, 128), True)
    """

    gemm_tile: tuple[int, int] = (256, 128)
    gemm_efficiency: float = 0.8
    attention_efficiency: float = 0.5
    memory_efficiency: float = 0.8
    intra_comm_efficiency: float = 0.8
    inter_comm_efficiency: float = 0.9
    kernel_overhead: float = 0.0
    microbatch_overhead: float = 0.0
    split_backward: float = 1.0
    net_overhead: float = 0.0

    def __post_init__(self) -> None:
        tile = tuple(int(x) for x in self.gemm_tile)
        if len(tile) != 2 or min(tile) < 1:
            raise ClusterError(f"Physics.gemm_tile must be two positive ints, got {self.gemm_tile!r}")
        object.__setattr__(self, "gemm_tile", tile)
        for f in ("gemm_efficiency", "attention_efficiency", "memory_efficiency",
                  "intra_comm_efficiency", "inter_comm_efficiency"):
            v = getattr(self, f)
            if not 0 < v <= 1:
                raise ClusterError(f"Physics.{f} must be in (0, 1], got {v!r}")
        for f in ("kernel_overhead", "microbatch_overhead", "net_overhead"):
            if not getattr(self, f) >= 0:
                raise ClusterError(f"Physics.{f} must be >= 0 seconds, got {getattr(self, f)!r}")
        if not self.split_backward >= 1:
            raise ClusterError("Physics.split_backward ((I + W) / B of a split backward) must "
                               f"be >= 1, got {self.split_backward!r}")

    @classmethod
    def nominal(cls) -> Physics:
        """The physics that prices compute and communication as a cluster without one does
        (the roofline at 50% of peak FLOPs and 80% of memory bandwidth,
        :func:`fxpar.cost.compute.roofline_time`; links at their nominal figures): one-column
        GEMM tiles waste nothing, no fixed costs. Unlike the flat roofline it also prices the
        optimizer step (:func:`fxpar.cost.step.optimizer_price`, at the same 80%).

        >>> from fxpar.cost.compute import OpCost, op_time
        >>> c = Cluster.preset("dgx-a100", physics=None)
        >>> op = OpCost(2e12, 4e12, 1e9, 2e9, "matmul", gemm=(1, 4096, 4096, 4096))
        >>> op_time(op, c) == op_time(op, dataclasses.replace(c, physics=Physics.nominal()))
        True
        """
        return cls(gemm_tile=(1, 1), gemm_efficiency=0.5, attention_efficiency=0.5,
                   memory_efficiency=0.8, intra_comm_efficiency=1.0, inter_comm_efficiency=1.0)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["gemm_tile"] = list(self.gemm_tile)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Physics:
        try:
            return cls(**d)
        except TypeError as e:
            raise ClusterError(f"bad physics in cluster JSON: {e}") from e


class _ClassOrInstanceMethod:
    """A method callable on the class (``self`` is ``None``) or on an instance."""

    def __init__(self, fn) -> None:
        self.fn = fn
        functools.update_wrapper(self, fn)

    def __get__(self, obj, cls):
        return functools.wraps(self.fn)(functools.partial(self.fn, cls, obj))


# Nominal figures for the presets of DESIGN §4 (unidirectional; see module docstring).
# Latencies are typical small-message figures: ~3 µs per NVLink step, ~8 µs per network step.
# Each preset's Physics: PHYSICS_SOURCES says where every number comes from.
# gemm/attention efficiency: fitted by benchmarks/published.py (8 of 37 published rows;
# results/published.json); below cuBLAS's ~0.8 on large GEMMs: the fit also absorbs what the
# model does not price (unfused elementwise kernels' launch gaps, the optimizer step)
_A100 = dict(gemm_tile=(256, 128), gemm_efficiency=0.626, attention_efficiency=0.626,
             memory_efficiency=0.85, intra_comm_efficiency=0.77, inter_comm_efficiency=0.92,
             kernel_overhead=3e-6, microbatch_overhead=0.0, net_overhead=6e-6)
_PRESETS: dict[str, dict] = {
    "perlmutter": dict(
        devices_per_node=4, device_type="A100-40GB", device_memory=40 * GiB,
        peak_flops=312e12, memory_bandwidth=1555 * GB,
        intra_node_bandwidth=300 * GB, inter_node_bandwidth=4 * 25 * GB,
        intra_node_latency=3e-6, inter_node_latency=8e-6,
        physics=Physics(**{**_A100, "inter_comm_efficiency": 0.8})),
    "frontier": dict(
        devices_per_node=8, device_type="MI250X-GCD", device_memory=64 * GiB,
        peak_flops=192e12, memory_bandwidth=1600 * GB,
        intra_node_bandwidth=100 * GB, inter_node_bandwidth=4 * 25 * GB,
        intra_node_latency=4e-6, inter_node_latency=8e-6,
        physics=Physics(gemm_tile=(256, 128), gemm_efficiency=0.7,
                        attention_efficiency=0.35, memory_efficiency=0.8,
                        intra_comm_efficiency=0.7, inter_comm_efficiency=0.8,
                        kernel_overhead=5e-6, net_overhead=6e-6)),
    "dgx-a100": dict(
        devices_per_node=8, device_type="A100-80GB", device_memory=80 * GiB,
        peak_flops=312e12, memory_bandwidth=2039 * GB,
        intra_node_bandwidth=300 * GB, inter_node_bandwidth=8 * 25 * GB,
        intra_node_latency=3e-6, inter_node_latency=8e-6, physics=Physics(**_A100)),
    "a800": dict(
        devices_per_node=8, device_type="A800-80GB", device_memory=80 * GiB,
        peak_flops=312e12, memory_bandwidth=2039 * GB,
        intra_node_bandwidth=200 * GB, inter_node_bandwidth=4 * 25 * GB,
        intra_node_latency=3e-6, inter_node_latency=8e-6,
        physics=Physics(**{**_A100, "net_overhead": 3e-6})),
    "aws-p3.8xlarge": dict(
        devices_per_node=4, device_type="V100-16GB", device_memory=16 * GiB,
        peak_flops=125e12, memory_bandwidth=900 * GB,
        intra_node_bandwidth=150 * GB, inter_node_bandwidth=10e9 / 8,
        intra_node_latency=5e-6, inter_node_latency=30e-6,
        physics=Physics(gemm_tile=(128, 128), gemm_efficiency=0.75,
                        attention_efficiency=0.35, memory_efficiency=0.85,
                        intra_comm_efficiency=0.7, inter_comm_efficiency=0.9,
                        kernel_overhead=4e-6, net_overhead=3e-6)),
    "dgx-h100": dict(
        devices_per_node=8, device_type="H100-80GB", device_memory=80 * GiB,
        peak_flops=989e12, memory_bandwidth=3350 * GB,
        intra_node_bandwidth=450 * GB, inter_node_bandwidth=8 * 50 * GB,
        intra_node_latency=2.5e-6, inter_node_latency=6e-6,
        physics=Physics(gemm_tile=(256, 128), gemm_efficiency=0.6,
                        attention_efficiency=0.27, memory_efficiency=0.85,
                        intra_comm_efficiency=0.8, inter_comm_efficiency=0.9,
                        kernel_overhead=2.5e-6, net_overhead=3e-6)),
}

#: Where each preset's :class:`Physics` comes from (shown by ``Cluster.describe``'s callers
#: and the published-figures benchmark). "fitted" values are fitted by
#: ``benchmarks/published.py`` on the rows it names and predict the rest.
PHYSICS_SOURCES: dict[str, str] = {
    "dgx-a100": (
        "gemm_tile 256x128 and tile quantization: NVIDIA, Matrix Multiplication Background "
        "User's Guide (its A100 examples). gemm_efficiency 0.626, attention_efficiency 0.626: "
        "fitted to 8 of 37 published A100 training rows of the four seeds "
        "(benchmarks/published.py; held-out median error 6.4%); microbatch_overhead 0: not "
        "fitted (no published figure isolates it). memory_efficiency 0.85: STREAM-type kernels reach "
        "85-90% of A100 HBM bandwidth. intra_comm_efficiency 0.77: nccl-tests all-reduce bus "
        "bandwidth ~230 GB/s of NVLink3's 300 GB/s per direction on DGX A100; "
        "inter_comm_efficiency 0.92: nccl-tests across HDR-200 InfiniBand reach ~23 of "
        "25 GB/s per NIC. kernel_overhead 3 us: the gap between dependent CUDA kernels "
        "launched back to back. net_overhead 6 us: NCCL's network post cost on AMD hosts "
        "(getNetOverhead, 2 us; DGX A100's EPYC 7742) times 3 under the Simple protocol "
        "(tuning.cc)."),
    "perlmutter": "as dgx-a100 (the same A100 and NVLink3), except inter_comm_efficiency 0.8: "
                  "Slingshot-11 NICs reach ~20 of 25 GB/s in all-reduce (net_overhead 6 us: "
                  "AMD EPYC 7763 hosts, NERSC's Perlmutter architecture page).",
    "a800": ("as dgx-a100 (an A100 with NVLink capped at 400 GB/s bidirectional, AMSP §II), "
             "except net_overhead 3 us: AMSP §VI gives its servers' CPU cores (128), not their "
             "vendor, so NCCL's default post cost (1 us, times 3 under Simple)."),
    "aws-p3.8xlarge": (
        "128x128 tiles (NVIDIA Tesla V100 whitepaper, 2017, and cuBLAS); gemm_efficiency "
        "0.75: fp16 tensor-core GEMMs of cuBLAS reach ~90-95 of 125 TFLOP/s; "
        "attention_efficiency 0.35: no flash kernels on V100 (the unfused path); "
        "intra_comm_efficiency 0.7: NVLink2 hybrid cube mesh; inter 0.9: 10 Gb/s TCP; "
        "net_overhead 3 us: NCCL's Intel-host post cost (Xeon E5-2686 v4) under Simple."),
    "dgx-h100": (
        "gemm_efficiency 0.6: cuBLAS bf16 GEMMs measured at 0.77 of the 989 TFLOP/s peak on "
        "an H200 (benchmarks/results/gpu.json: 764-773 TFLOP/s), times 0.78, the share the "
        "A100 fit keeps of its cuBLAS rate (0.626 of ~0.8: what the step model does not price, "
        "as on dgx-a100). attention_efficiency 0.27: PyTorch's SDPA (FlashAttention-2 kernels) "
        "forward+backward measured by Cluster.calibrate on an H200 (271 TFLOP/s, "
        "benchmarks/results/gpu_calibrated.json). Checked, not fitted, on torchtitan's Llama "
        "3.1 8B on 8 H100 and fxpar's own H200 step (benchmarks/external.py); "
        "intra_comm_efficiency 0.8: nccl-tests all-reduce ~360 of 450 GB/s (NVLink4); "
        "inter 0.9: NDR-400 InfiniBand; net_overhead 3 us: NCCL's Intel-host post cost "
        "(DGX H100's Xeon 8480C) times 3 under Simple."),
    "frontier": (
        "gemm_efficiency 0.7, attention_efficiency 0.35, comm 0.7/0.8: rocBLAS and RCCL "
        "figures of that generation, not fitted (no published throughput to fit them to here); "
        "net_overhead 6 us: AMD EPYC hosts, as NCCL prices them (RCCL's tuning model is NCCL's)."),
}


@dataclass(frozen=True)
class Cluster:
    """A homogeneous cluster: ``nodes`` × ``devices_per_node`` identical devices."""

    nodes: int
    devices_per_node: int
    intra_node_bandwidth: float
    inter_node_bandwidth: float
    intra_node_latency: float
    inter_node_latency: float
    device_memory: int
    peak_flops: float
    memory_bandwidth: float
    nodes_per_switch: int | None = None
    inter_switch_bandwidth: float | None = None
    device_type: str = "generic"
    name: str = "custom"
    profile: Profile = field(default_factory=Profile)
    #: measured compute (from :meth:`calibrate`); ``None``: the nominal roofline
    compute: ComputeProfile | None = None
    #: the fraction by which communication hidden behind compute slows that compute
    #: (collective kernels take SMs and memory bandwidth); 0: overlap is free. No preset sets
    #: it (no published figure for these machines to source it from); :meth:`calibrate`
    #: measures it, and a user may set it
    comm_interference: float = 0.0
    #: how far below the data sheet the device and links run (:class:`Physics`); ``None``:
    #: the flat roofline (``PlannerOptions.efficiency``) and the links' nominal bandwidth
    physics: Physics | None = None

    def __post_init__(self) -> None:
        if isinstance(self.physics, dict):
            object.__setattr__(self, "physics", Physics.from_dict(self.physics))
        for f in ("nodes", "devices_per_node"):
            v = getattr(self, f)
            if not isinstance(v, int) or v < 1:
                raise ClusterError(f"Cluster.{f} must be a positive int, got {v!r}")
        for f in ("intra_node_bandwidth", "inter_node_bandwidth", "peak_flops",
                  "memory_bandwidth", "device_memory"):
            if not getattr(self, f) > 0:
                raise ClusterError(f"Cluster.{f} must be positive, got {getattr(self, f)!r}")
        for f in ("intra_node_latency", "inter_node_latency", "comm_interference"):
            if not getattr(self, f) >= 0:
                raise ClusterError(f"Cluster.{f} must be >= 0, got {getattr(self, f)!r}")
        if self.nodes_per_switch is not None and self.nodes_per_switch < 1:
            raise ClusterError(f"Cluster.nodes_per_switch must be >= 1, got {self.nodes_per_switch}")

    # -- construction -------------------------------------------------------------------
    @classmethod
    def preset_names(cls) -> tuple[str, ...]:
        return tuple(_PRESETS)

    @classmethod
    def preset(cls, name: str, nodes: int = 1, **overrides) -> Cluster:
        """A cluster of ``nodes`` nodes of a known machine (DESIGN §4); fields can be overridden.

        >>> Cluster.preset("perlmutter", nodes=2).num_devices
        8
        """
        if name not in _PRESETS:
            raise ClusterError(f"unknown cluster preset {name!r}; known: {', '.join(_PRESETS)}")
        return cls(nodes=nodes, name=name, **{**_PRESETS[name], **overrides})

    @classmethod
    def local(cls, world_size: int, **overrides) -> Cluster:
        """This machine's ``world_size`` CPU processes as one node (gloo over shared memory).

        The link and compute figures are conservative guesses for a CPU process; run
        :meth:`calibrate` on a live group for measured ones.
        """
        import os

        fields = dict(
            nodes=1, devices_per_node=world_size, device_type="cpu-process", name="local",
            intra_node_bandwidth=2 * GB, inter_node_bandwidth=2 * GB,
            intra_node_latency=50e-6, inter_node_latency=50e-6,
            device_memory=max(1, _total_memory() // max(world_size, 1)),
            peak_flops=20e9 * max(1, (os.cpu_count() or 1) // max(world_size, 1)),
            memory_bandwidth=10 * GB)
        fields.update(overrides)
        return cls(**fields)

    @classmethod
    def from_env(cls, preset: str | None = None, calibrate: bool = False, **overrides) -> Cluster:
        """The cluster this process was launched on: nodes and devices per node from the
        launch environment (torchrun's ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_WORLD_SIZE``,
        ``RANK``, ``LOCAL_RANK``, ``GROUP_RANK``; else SLURM's ``SLURM_NTASKS``,
        ``SLURM_NNODES``, ``SLURM_PROCID``, ``SLURM_LOCALID``, ``SLURM_NODEID``); device ``i``
        of the cluster is global rank ``i`` (node-major, as both launchers place ranks).
        Links and compute from the named ``preset`` (its node size must be the launch's), or
        :meth:`local`'s figures; ``calibrate=True`` then measures them on the live process
        group, intra-node and inter-node collectives apart (groups inside one node, groups of
        one rank per node: :meth:`calibrate` with the launch's node of each rank). A clear
        :class:`ClusterError` when the environment is inconsistent (ranks per node that
        differ, a rank placed off its node, a preset of another node size).

        >>> import os
        >>> env = dict(WORLD_SIZE="8", LOCAL_WORLD_SIZE="4", GROUP_WORLD_SIZE="2", RANK="5",
        ...            LOCAL_RANK="1", GROUP_RANK="1")
        >>> old = {k: os.environ.get(k) for k in env}
        >>> os.environ.update(env)
        >>> c = Cluster.from_env("perlmutter")
        >>> c.nodes, c.devices_per_node, c.device_type
        (2, 4, 'A100-40GB')
        >>> for k, v in old.items():
        ...     _ = os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
        """
        nodes, per_node = launch_shape()
        if preset is not None:
            base = cls.preset(preset, nodes=nodes, **overrides)
            if base.devices_per_node != per_node:
                raise ClusterError(
                    f"Cluster.from_env: preset {preset!r} has {base.devices_per_node} devices per node "
                    f"but the launch runs {per_node} processes per node ({nodes} nodes): use a preset "
                    f"of that node size, or override devices_per_node={per_node}")
        else:
            base = cls.local(nodes * per_node, **{"nodes": nodes, "devices_per_node": per_node,
                                                  "name": f"env ({nodes}x{per_node})", **overrides})
        if not calibrate:
            return base
        import torch.distributed as dist

        if not dist.is_initialized():
            raise ClusterError("Cluster.from_env(calibrate=True) measures on the live process group: "
                               "call torch.distributed.init_process_group first")
        return base.calibrate(hosts=[f"node{r // per_node}" for r in range(nodes * per_node)])

    # -- topology -----------------------------------------------------------------------
    @property
    def num_devices(self) -> int:
        return self.nodes * self.devices_per_node

    def node_of(self, device: int) -> int:
        self._check_device(device)
        return device // self.devices_per_node

    def switch_of(self, device: int) -> int:
        """Leaf switch of a device's node (0 for every device when there are no leaf switches)."""
        if self.nodes_per_switch is None:
            return 0
        return self.node_of(device) // self.nodes_per_switch

    def _check_device(self, device: int) -> None:
        if not 0 <= device < self.num_devices:
            raise ClusterError(f"device {device} not in cluster {self.name} "
                               f"(devices 0..{self.num_devices - 1})")

    def refine(self, profile, *more) -> Cluster:
        """This cluster with its rates re-fit to a measured :class:`fxpar.Profile` (from
        ``runner.profile()``; ``more``: profiles of other plans priced on this cluster): with
        ``s = measured / predicted`` over the profiled nodes and actions
        (:meth:`fxpar.Profile.scales`), compute runs at ``1/s_compute`` of the rates it
        was priced at (the measured GEMM, memory, vector and attention curves, or the
        nominal ``peak_flops``/``memory_bandwidth``; per-op overheads times ``s_compute``)
        and collectives at ``1/s_comm`` of the bandwidths with ``s_comm`` times the
        latencies (links and measured α/β entries alike). Pipeline profiles of two or more
        microbatch counts also fit the seconds each forward or backward pass pays whatever its
        size (``physics.microbatch_overhead``; a cluster without physics gets
        :meth:`Physics.nominal`'s, which prices compute and communication as it did and adds the
        optimizer step), and profiles of a zero-bubble schedule the cost of its split backward
        (``physics.split_backward``, from its ``I`` and ``W`` actions against the rate its
        ``F`` and ``B`` actions give). SPMD profiles of plans that hide different shares of
        their communication also fit ``comm_interference`` (what one second of hidden
        communication adds to compute: ``"interference"`` of :meth:`fxpar.Profile.scales`,
        over ``s_comm`` so that it multiplies the refined collectives' seconds). A kind the
        profiles did not measure is left as it is. The profiles must come from plans priced
        on this cluster.

        >>> from fxpar.runtime.profile import NodeTime, Profile
        >>> p = Profile((NodeTime("mm", "fc", "compute", None, 2e-3, 4e-3, 1e-3, 2e-3),), 0.01, 3)
        >>> c = Cluster.local(2)
        >>> c.refine(p).peak_flops == c.peak_flops / 2
        True
        """
        s = profile.scales(*more)
        out = self
        sc, sm = s.get("compute"), s.get("comm")
        fit = {}
        if "overhead" in s:
            fit["microbatch_overhead"] = s["overhead"]
        if "split" in s:   # a correction of the split backward the profile's plan priced
            ph = self.physics or Physics.nominal()
            fit["split_backward"] = max(1.0, ph.split_backward * s["split"])
        if fit:
            out = dataclasses.replace(out, physics=dataclasses.replace(
                self.physics or Physics.nominal(), **fit))
        if sc:
            if self.compute is not None:
                out = dataclasses.replace(out, compute=self.compute.scaled(sc, sc))
            else:
                out = dataclasses.replace(out, peak_flops=self.peak_flops / sc,
                                          memory_bandwidth=self.memory_bandwidth / sc)
        if sm:
            out = dataclasses.replace(
                out, intra_node_bandwidth=self.intra_node_bandwidth / sm,
                inter_node_bandwidth=self.inter_node_bandwidth / sm,
                intra_node_latency=self.intra_node_latency * sm,
                inter_node_latency=self.inter_node_latency * sm,
                inter_switch_bandwidth=(self.inter_switch_bandwidth / sm
                                        if self.inter_switch_bandwidth else self.inter_switch_bandwidth),
                profile=Profile(tuple(dataclasses.replace(e, bandwidth=e.bandwidth / sm,
                                                          latency=e.latency * sm)
                                      for e in self.profile.entries)))
        if "interference" in s:
            out = dataclasses.replace(out, comm_interference=s["interference"] / (sm or 1.0))
        return dataclasses.replace(out, name=f"{self.name} (refined)") if out is not self else out

    def placement_agnostic(self) -> Cluster:
        """The cluster as a placement-agnostic cost model sees it (AxoNN §V-C; Alpa prices its
        stages and intra-op plans this way): one node of every device whose every link has the
        inter-node figures (:func:`fxpar.cost.comm.group_bandwidth` with
        ``placement_aware=False``), no leaf switches, no per-level calibrated profile.

        >>> c = Cluster.preset("dgx-a100", nodes=2).placement_agnostic()
        >>> c.nodes, c.devices_per_node, c.intra_node_bandwidth / 1e9, c.intra_node_latency
        (1, 16, 200.0, 8e-06)
        """
        if self.nodes == 1:
            return self
        return dataclasses.replace(
            self, nodes=1, devices_per_node=self.num_devices,
            intra_node_bandwidth=min(self.intra_node_bandwidth, self.inter_node_bandwidth),
            intra_node_latency=self.inter_node_latency, nodes_per_switch=None,
            inter_switch_bandwidth=None, profile=Profile(), name=f"{self.name} (placement-agnostic)")

    def without_latency(self) -> Cluster:
        """The cluster with every latency (nominal and calibrated α) at 0: what a collective
        costs when its start-up is shared with others, as in a gradient bucket
        (:class:`fxpar.planner.pricing.EdgePricer` prices a bucketed gradient reduction between
        the two).

        >>> c = Cluster.preset("dgx-a100", nodes=2).without_latency()
        >>> c.intra_node_latency, c.inter_node_latency, c.physics.net_overhead
        (0.0, 0.0, 0.0)
        """
        physics = self.physics and dataclasses.replace(self.physics, net_overhead=0.0)
        return dataclasses.replace(
            self, intra_node_latency=0.0, inter_node_latency=0.0, physics=physics,
            profile=Profile(tuple(dataclasses.replace(e, latency=0.0) for e in self.profile.entries)))

    def describe(self) -> str:
        sw = f", {self.nodes_per_switch} nodes/leaf switch" if self.nodes_per_switch else ""
        return (f"{self.name}: {self.nodes} node(s) × {self.devices_per_node} {self.device_type}"
                f" ({self.device_memory / GiB:.0f} GiB, {self.peak_flops / 1e12:.0f} TFLOP/s each); "
                f"intra {self.intra_node_bandwidth / GB:.0f} GB/s, "
                f"inter {self.inter_node_bandwidth / GB:.1f} GB/s per node{sw}"
                + (f"; calibrated ({len(self.profile.entries)} fits)" if self.profile.entries else "")
                + (f"; compute measured (GEMM up to {self.compute.peak_flops / 1e9:.3g} GFLOP/s, "
                   f"{self.compute.memory_bandwidth / GB:.3g} GB/s, "
                   f"{self.compute.op_overhead * 1e6:.3g} µs/op"
                   + ("; in a model: kernels {:.3g}x, overheads {:.3g}x".format(*self.compute.in_model)
                      if self.compute.in_model else "")
                   + ("; speed with 1.." + str(self.compute.ranks) + " ranks busy: "
                      + ", ".join(f"{x:.2g}" for x in self.compute.shared)
                      if self.compute.shared else "")
                   + ")" if self.compute else "")
                + (f"; physics: GEMMs at {self.physics.gemm_efficiency:.0%} of peak, attention "
                   f"{self.physics.attention_efficiency:.0%}, links at "
                   f"{self.physics.intra_comm_efficiency:.0%} / {self.physics.inter_comm_efficiency:.0%}"
                   f" of nominal" if self.physics else "")
                + (f"; split backward {self.physics.split_backward:.3g}× a whole one"
                   if self.physics and self.physics.split_backward != 1 else ""))

    # -- JSON ---------------------------------------------------------------------------
    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["profile"] = [dataclasses.asdict(e) for e in self.profile.entries]
        if self.compute is None:  # JSON of an uncalibrated cluster stays as it was
            d.pop("compute")
        else:
            d["compute"] = self.compute.to_dict()
        if self.physics is None:
            d.pop("physics")
        else:
            d["physics"] = self.physics.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Cluster:
        d = dict(d)
        d["profile"] = Profile(tuple(ProfileEntry(**e) for e in d.get("profile", ())))
        if d.get("compute") is not None:
            d["compute"] = ComputeProfile.from_dict(d["compute"])
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ClusterError(f"unknown Cluster fields in JSON: {sorted(unknown)}")
        return cls(**d)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Cluster:
        return cls.from_dict(json.loads(text))

    # -- calibration --------------------------------------------------------------------
    @_ClassOrInstanceMethod
    def calibrate(cls, self, group=None, *, sizes: Sequence[int] = (2**12, 2**16, 2**20, 2**22),
                  collectives: Sequence[str] = COLLECTIVES, iters: int = 5,
                  group_sizes: Sequence[int] | None = None, base: Cluster | None = None,
                  compute: bool = True, gemm_sizes: Sequence[int] = (16, 32, 64, 128, 256, 512),
                  memory_sizes: Sequence[int] = (2**12, 2**16, 2**20, 2**24),
                  min_time: float = 0.05, dtype=None,
                  attention_shapes: Sequence[tuple[int, int, int]] | None = None,
                  hosts: Sequence[str] | None = None, share_cores: bool = False,
                  in_model: bool | None = None) -> Cluster:
        """Measure collectives and compute on a live process group; return a cluster built from them.

        ``Cluster.calibrate()`` starts from ``Cluster.local(world)``; ``cluster.calibrate()``
        (e.g. ``Cluster.local(4, device_memory=...).calibrate()``) from that cluster; ``base=``
        overrides both. Every rank must call it, and every rank gets the same cluster.

        **Collectives** over all ranks of ``group`` (default: the world). For each collective,
        group size (powers of two up to the world, groups of consecutive ranks, as
        :func:`torch.distributed.new_subgroups` makes them) and message size it times
        ``iters`` runs after a warm-up (a run: about ``min_time`` of calls, each after a GEMM
        of at least :data:`HANDOFF_COMPUTE` on every rank, as a step reaches a collective from
        compute, the GEMMs' seconds taken out; a call's mean cost, scheduler time slices
        included: :func:`_time_collective`), takes the slowest rank per run and the median
        over runs, and fits α and β with :func:`fxpar.cost.calibration.fit_alpha_beta`;
        ``send_recv`` is timed as a pipeline pays it, the receiver blocked while its peer
        computed (every pair at once, the GEMMs taken out: :func:`_time_send_recv`). Ranks are
        grouped into nodes by host name (``hosts``: one node name per rank of ``group``
        instead, e.g. from the launch, :meth:`from_env`). With several nodes, the groups of
        one rank per node are measured too: the inter-node level alone. The returned cluster
        carries the fits in ``profile``; its nominal intra-node latency and bandwidth are the
        all-reduce fit of the largest group inside a node, the inter-node ones that of the
        one-rank-per-node groups (else of the largest group spanning nodes). Sizes are bytes of the per-device buffer in the
        convention of :func:`fxpar.cost.comm.collective_time` (for all-gather: the input shard).

        **Compute** (``compute=True``), on every rank at the same time (ranks of one host
        share its cores and memory bandwidth, so this is what each gets during training):
        a GEMM ``n×n @ n×n`` in ``dtype`` (default float32; pass the dtype the model trains
        in, e.g. ``torch.bfloat16`` on a GPU) per ``n`` in ``gemm_sizes`` (``2n³`` FLOPs; its
        second operand from a pool twice a core's cache, cold as weights are), an
        elementwise add of two tensors of each of ``memory_sizes`` bytes (three times that
        moved), a 1-element op without autograd (the dispatch) and a chain of 1-element ops
        that require grad, forward then backward (per-op overheads), a row log-softmax forward
        and backward of each of ``memory_sizes`` bytes (non-GEMM arithmetic, ``vector``), a
        GELU forward and backward of each of them (``activation``), causal SDPA forward
        and backward at each ``(batch·heads, length, head dim)`` of ``attention_shapes``
        (default: two small ones on a CPU, up to 32×2048×128 on a GPU, where small
        attention is latency-bound: the curve's last rate prices every larger call)
        (``attention``) and a float32 AdamW step
        over one tensor of 2¹⁸ elements and over 32 of 64 (``optimizer``). Each is repeated until
        one run lasts ``min_time`` (the same count on every rank; longer than a scheduler
        time slice, so ranks that share a core are measured sharing it rather than taking
        turns); per run the slowest rank's
        time per call, then the median over ``iters`` runs
        (:func:`fxpar.cost.calibration.median_of_max`). The result is ``compute``
        (:class:`ComputeProfile`); ``peak_flops`` and ``memory_bandwidth`` become its
        fastest GEMM rate and its largest-size bandwidth.

        **In the model** (``in_model``; a CPU): the curves and overheads corrected by what a
        stack of transformer blocks measures, forward and backward at three batch sizes,
        against what they price it at (:mod:`fxpar.block_probe`: :attr:`ComputeProfile.in_model`):
        the fixed seconds each pipeline action pays. ``None`` (the default): where this host's
        ranks and their threads fit its cores (:func:`_oversubscribed`); ranks that share a
        core time-slice the probe, and the fit then measures the slicing (4 one-thread ranks on
        2 cores: overheads 4.2× the chain's, 2.4× with 2 ranks, in fits that still counted the
        gradients' accumulation), which the curves, measured with every rank busy, hold
        already.

        **Shared cores** (``share_cores=True``, CPU ranks of one host): the speed of a small
        block's forward and backward while ``k`` of the ranks run it at once, ``k = world..1``,
        over its speed with all of them (:attr:`ComputeProfile.shared`); the step model then
        prices a pipeline rank computing in the others' bubble at the speed the cores they
        leave give it (:func:`fxpar.cost.step.host_rate`). Off by default (the
        ``plan·shr`` column of ``benchmarks/pipeline.py`` compares).

        **Interference** (``compute=True``, more than one rank): ``comm_interference``, what
        one second of communication hidden behind compute adds to the step, measured with an
        all-reduce of the largest of ``sizes`` hidden behind GEMMs on every rank
        (:func:`_measure_interference`). On a host whose ranks outnumber its cores a
        collective's progress takes the cores its ranks compute on; on a GPU its kernels take
        SMs and memory bandwidth.
        """
        import torch.distributed as dist

        from fxpar.cost.calibration import fit_alpha_beta

        if not dist.is_initialized():
            raise ClusterError("Cluster.calibrate needs an initialized torch.distributed process group")
        group = group or dist.group.WORLD
        world = dist.get_world_size(group)
        rank = dist.get_rank(group)
        device = _group_device(group)

        if hosts is None:
            hosts = [None] * world
            dist.all_gather_object(hosts, socket.gethostname(), group=group)
        elif len(hosts) != world:
            raise ClusterError(f"Cluster.calibrate: hosts names {len(hosts)} ranks, the group has {world}")
        hosts = list(hosts)
        node_names = list(dict.fromkeys(hosts))
        per_node = [hosts.count(h) for h in node_names]
        if len(set(per_node)) != 1:
            raise ClusterError(f"Cluster.calibrate: uneven ranks per host {dict(zip(node_names, per_node))}")
        dpn = per_node[0]

        if group_sizes is None:
            group_sizes = [g for g in (2**i for i in range(1, 16)) if g <= world]
            if world not in group_sizes and world > 1:
                group_sizes.append(world)
        measured: dict[tuple[str, str, int], list[tuple[int, float]]] = {}
        global_ranks = dist.get_process_group_ranks(group)
        # ranks reach each timed collective from compute, as in a step (_time_collective)
        before = (_handoff_compute(device, group)
                  if any(c != Collective.SEND_RECV for c in collectives) else None)
        for gsize in group_sizes:
            if world % gsize:
                continue
            # Every rank creates every subgroup (new_group is collective), then uses its own.
            subgroups = [dist.new_group(global_ranks[i:i + gsize]) for i in range(0, world, gsize)]
            sub = subgroups[rank // gsize]
            level = "intra" if len({hosts[i] for i in range(rank // gsize * gsize,
                                                             rank // gsize * gsize + gsize)}) == 1 else "inter"
            for coll in collectives:
                for nbytes in sizes:
                    t = _time_collective(coll, nbytes, sub, gsize, device, iters, group, min_time,
                                         before)
                    if t is not None:
                        measured.setdefault((coll, level, gsize), []).append((nbytes, t))
            for sg in subgroups:
                dist.destroy_process_group(sg)
        across = None   # one rank per node: the inter-node links alone
        if len(node_names) > 1:
            members = [[global_ranks[i] for i in range(world) if hosts[i] == h] for h in node_names]
            strided = [[m[j] for m in members] for j in range(dpn)]
            subgroups = [dist.new_group(g) for g in strided]
            j = members[node_names.index(hosts[rank])].index(global_ranks[rank])
            across = len(node_names)
            for coll in collectives:
                for nbytes in sizes:
                    t = _time_collective(coll, nbytes, subgroups[j], across, device, iters, group,
                                         min_time, before)
                    if t is not None:
                        measured.setdefault((coll, "inter-only", across), []).append((nbytes, t))
            for sg in subgroups:
                dist.destroy_process_group(sg)

        entries = []
        for (coll, level, gsize), pts in sorted(measured.items()):
            # the group of consecutive ranks measured: its nodes and most ranks on one node
            # (the α per step of the hierarchical step count, fxpar.cost.comm.latency_steps)
            span = Counter(hosts[:gsize]) if level != "inter-only" else Counter(range(gsize))
            alpha, beta, err = fit_alpha_beta(coll, gsize, [p[0] for p in pts], [p[1] for p in pts],
                                              nodes=len(span), per_node=max(span.values()))
            entries.append(ProfileEntry(coll, level, gsize, alpha, beta, err))
        # the one-rank-per-node fits are inter-node entries of their group size (where a group
        # of consecutive ranks of that size was measured too, the pure one is kept)
        pure = {(e.collective, e.group_size) for e in entries if e.level == "inter-only"}
        entries = [dataclasses.replace(e, level="inter") if e.level == "inter-only" else e
                   for e in entries if not (e.level == "inter" and (e.collective, e.group_size) in pure)]
        profile = Profile(tuple(entries))

        def best(level: str, size: int | None = None) -> ProfileEntry | None:
            es = [e for e in entries if e.collective == "all_reduce" and e.level == level
                  and (size is None or e.group_size == size)]
            return max(es, key=lambda e: e.group_size) if es else None

        if base is None:
            base = self if self is not None else cls.local(world)
        intra, inter = best("intra"), (best("inter", across) if across else None) or best("inter")
        updates: dict = dict(nodes=len(node_names), devices_per_node=dpn, profile=profile,
                             name=f"calibrated-{base.name}")
        if intra:
            updates.update(intra_node_bandwidth=intra.bandwidth, intra_node_latency=intra.latency)
        if inter:
            updates.update(inter_node_bandwidth=inter.bandwidth, inter_node_latency=inter.latency)
        elif intra:  # a single node: nothing crosses nodes, keep inter equal to intra
            updates.update(inter_node_bandwidth=intra.bandwidth, inter_node_latency=intra.latency)
        if compute:
            prof = _measure_compute(group, device, gemm_sizes, memory_sizes, iters, min_time,
                                    dtype, attention_shapes)
            if in_model or (in_model is None and not _oversubscribed(dpn, group)):
                from fxpar.block_probe import measure_in_model
                prof = measure_in_model(group, device, prof, iters, min_time)
            if share_cores and device.type == "cpu" and len(node_names) == 1:
                prof = dataclasses.replace(prof, shared=_measure_sharing(group, iters, min_time))
            updates.update(compute=prof, peak_flops=prof.peak_flops,
                           memory_bandwidth=prof.memory_bandwidth)
            if world > 1:
                updates.update(comm_interference=_measure_interference(
                    group, device, max(sizes), iters))
        return dataclasses.replace(base, **updates)


def launch_shape(env=None) -> tuple[int, int]:
    """``(nodes, processes per node)`` of this launch from torchrun's or SLURM's variables
    (:meth:`Cluster.from_env`), checked for consistency; ``(1, world)`` without a launcher's
    node variables, ``(1, 1)`` without any. Under an initialized process group every rank's
    view is compared (all ranks must agree on the node size)."""
    import os

    env = os.environ if env is None else env

    def get(*names):
        for n in names:
            if env.get(n) not in (None, ""):
                return n, env[n]
        return None, None

    def num(name, value) -> int:
        try:
            return int(str(value).split("(")[0])   # SLURM_NTASKS_PER_NODE "4(x2)"
        except ValueError:
            raise ClusterError(f"Cluster.from_env: {name}={value!r} is not a number") from None

    wn, world = get("WORLD_SIZE", "SLURM_NTASKS")
    world = num(wn, world) if world is not None else 1
    ln, local = get("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE")
    nn, nnodes = get("GROUP_WORLD_SIZE", "SLURM_NNODES", "SLURM_JOB_NUM_NODES")
    if local is not None:
        local = num(ln, local)
    elif nnodes is not None:
        local = world // max(num(nn, nnodes), 1)
    else:
        local = world
    if local < 1 or world % local:
        raise ClusterError(f"Cluster.from_env: {world} processes ({wn}) do not split into nodes of "
                           f"{local} ({ln or nn}): ranks per node differ")
    nodes = world // local
    if nnodes is not None and num(nn, nnodes) != nodes:
        raise ClusterError(f"Cluster.from_env: {nn}={nnodes} nodes, but {world} processes in nodes of "
                           f"{local} make {nodes}: ranks per node differ")
    rn, rank = get("RANK", "SLURM_PROCID")
    lrn, lrank = get("LOCAL_RANK", "SLURM_LOCALID")
    gn, grank = get("GROUP_RANK", "SLURM_NODEID")
    if rank is not None and lrank is not None and grank is not None:
        r, lr, g = num(rn, rank), num(lrn, lrank), num(gn, grank)
        if r != g * local + lr:
            raise ClusterError(f"Cluster.from_env: rank {r} is local rank {lr} of node {g}, not "
                               f"device {g * local + lr} of nodes of {local}: ranks are not placed "
                               "node-major (fxpar's device i is global rank i)")
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            seen = [None] * dist.get_world_size()
            dist.all_gather_object(seen, (nodes, local))
            if len(set(seen)) != 1:
                raise ClusterError(f"Cluster.from_env: the ranks see different launch shapes "
                                   f"(nodes, per node): {sorted(set(seen))}")
    except ImportError:
        pass
    return nodes, local


def _total_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 16 * GiB


def _measure_sharing(group, iters: int, min_time: float) -> tuple[float, ...]:
    """:attr:`ComputeProfile.shared`: a small block's forward and backward in autograd
    (``softmax(layer_norm(gelu(x·W1)·W2))``, 256 rows of 128, hidden 512: GEMMs and the
    memory-bound ops beside them) run by ranks ``0..k−1`` at once while the others
    wait in a barrier, for ``k = world..1``; per ``k`` the median over ``iters`` runs of the
    slowest busy rank's time, each run the same number of calls (about ``4·min_time`` with all
    busy); entry ``k−1`` is the all-busy time over that one, at least entry ``k``'s."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 128, generator=g, requires_grad=True)
    w1 = torch.randn(128, 512, generator=g, requires_grad=True)
    w2 = torch.randn(512, 128, generator=g, requires_grad=True)

    def run(busy: int, reps: int) -> float:
        dist.barrier(group=group)
        t = 0.0
        if rank < busy:
            t0 = time.perf_counter()
            for _ in range(reps):
                F.softmax(F.layer_norm(F.gelu(x @ w1) @ w2, (128,)), -1).sum().backward()
            t = time.perf_counter() - t0
        out = torch.tensor([t], dtype=torch.float64)
        dist.all_reduce(out, op=dist.ReduceOp.MAX, group=group)
        return out.item()

    # runs of 4·min_time: a shared host's speed drifts more than one op's cost does (reps
    # from a second call: the first also starts autograd's engine)
    run(world, 1)
    reps = int(min(10_000, max(1, math.ceil(4 * min_time / max(run(world, 1), 1e-9)))))
    times = {k: statistics.median(run(k, reps) for _ in range(iters)) for k in range(world, 0, -1)}
    # fewer ranks busy are never slower than more (a lower figure is noise): running maximum
    # from the all-busy end
    speed, out = 1.0, []
    for k in range(world, 0, -1):
        speed = max(speed, times[world] / max(times[k], 1e-12))
        out.append(speed)
    return tuple(reversed(out))


def _group_device(group):
    import torch
    import torch.distributed as dist

    backend = dist.get_backend(group)
    if "nccl" in str(backend) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _peer(sub, gsize, dist):
    """The global rank this rank exchanges with in send/recv pairs (0,1), (2,3), ... of
    ``sub``, or ``None`` (an odd group's last rank)."""
    me = dist.get_rank(sub)
    return dist.get_global_rank(sub, me ^ 1) if me ^ 1 < gsize else None


def _bench_send_recv(x, sub, gsize, dist):
    """Pairs (0,1), (2,3), ... exchange one buffer; time of one one-way transfer (the warm-up
    and support check; the calibration times it as a pipeline pays it, :func:`_time_send_recv`)."""
    me, peer = dist.get_rank(sub), _peer(sub, gsize, dist)

    def fn():
        if peer is None:
            return
        if me % 2 == 0:
            dist.send(x, peer, group=sub)
        else:
            dist.recv(x, peer, group=sub)
    return fn


#: round trips per timed run of :func:`_time_send_recv`
HANDOFF_ROUND_TRIPS = 8
#: seconds the GEMM before each send of :func:`_time_send_recv` lasts at least
HANDOFF_COMPUTE = 1e-3


def _handoff_gemm(device):
    """``n`` of a square float32 GEMM that lasts at least :data:`HANDOFF_COMPUTE` seconds
    here: the smallest of ``n = 64 … 8192`` (doubling) that does, timed on this rank (the
    caller agrees on one ``n`` for every rank)."""
    import torch

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()
    n = 64
    while True:
        a = torch.randn(n, n, device=device)
        a @ a
        sync()
        t0 = time.perf_counter()
        for _ in range(3):
            a @ a
        sync()
        if (time.perf_counter() - t0) / 3 >= HANDOFF_COMPUTE or n >= 8192:
            return n
        n *= 2


def _handoff_compute(device, group):
    """The compute before each timed communication (:func:`_time_send_recv`,
    :func:`_time_collective`): a call running a square float32 GEMM of at least
    :data:`HANDOFF_COMPUTE` seconds (:func:`_handoff_gemm`, one ``n`` agreed on every rank of
    ``group``) and returning the seconds it took, the device synchronized."""
    import torch
    import torch.distributed as dist

    n = torch.tensor([_handoff_gemm(device)], device=device)
    dist.all_reduce(n, op=dist.ReduceOp.MAX, group=group)
    a = torch.randn(int(n.item()), int(n.item()), device=device)

    def gemm() -> float:
        t0 = time.perf_counter()
        a @ a
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0
    return gemm


def _time_send_recv(nbytes: int, sub, gsize: int, device, iters: int, world_group) -> float:
    """One-way seconds of a ``send``/``recv`` of ``nbytes`` as a pipeline pays it: the receiver
    blocked on it while the sender computed. Every pair of ``sub`` (all pairs at once, every
    rank busy as in training) plays ping-pong with a GEMM of at least
    :data:`HANDOFF_COMPUTE` before each send (:func:`_handoff_gemm`); a pair's one-way time is
    ``(T − C_even − C_odd) / 2k`` over ``k`` round trips (``T`` the even rank's loop, ``C``
    each rank's GEMM seconds in it): the transfer, and what waking the blocked receiver costs
    (on a host whose ranks outnumber its cores, a scheduler time slice; unseen by a transfer
    timed between two idle ranks after a barrier). Median over runs of the slowest pair."""
    import torch
    import torch.distributed as dist

    peer = _peer(sub, gsize, dist)
    even = dist.get_rank(sub) % 2 == 0
    x = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=device)
    gemm = _handoff_compute(device, world_group)

    def done() -> None:   # CUDA: a recv is over when its stream is
        if device.type == "cuda":
            torch.cuda.synchronize()

    k, runs = HANDOFF_ROUND_TRIPS, []
    for _ in range(iters):
        dist.barrier(group=world_group)
        one_way = torch.zeros(1, dtype=torch.float64, device=device)
        if peer is not None:
            c = 0.0
            t0 = time.perf_counter()
            for _ in range(k):
                if even:
                    c += gemm()
                    dist.send(x, peer, group=sub)
                    dist.recv(x, peer, group=sub)
                else:
                    dist.recv(x, peer, group=sub)
                    done()
                    c += gemm()
                    dist.send(x, peer, group=sub)
                done()
            total = time.perf_counter() - t0
            theirs = torch.tensor([c], dtype=torch.float64, device=device)
            if even:   # the odd member's GEMM seconds, to take out of the even one's loop
                dist.recv(theirs, peer, group=sub)
                one_way.fill_(max(0.0, total - c - theirs.item()) / (2 * k))
            else:
                dist.send(theirs, peer, group=sub)
        dist.all_reduce(one_way, op=dist.ReduceOp.MAX, group=world_group)
        runs.append(one_way.item())
    return statistics.median(runs)


#: how many times the collective alone the compute lasts that hides it while
#: :func:`_measure_interference` measures ``comm_interference``
INTERFERENCE_COMPUTE = 2.0


def _interference_gemm(device, group):
    """One unit of the compute that hides the collective in :func:`_measure_interference`: a
    square float32 GEMM of at least :data:`HANDOFF_COMPUTE` seconds (:func:`_handoff_gemm`;
    the caller agrees on one ``n``), returned as a call."""
    import torch
    import torch.distributed as dist

    n = torch.tensor([_handoff_gemm(device)], device=device)
    dist.all_reduce(n, op=dist.ReduceOp.MAX, group=group)
    a = torch.randn(int(n.item()), int(n.item()), device=device)
    return lambda: a @ a


def _measure_interference(group, device, nbytes: int, iters: int) -> float:
    """``Cluster.comm_interference`` as this group pays it: every rank issues an asynchronous
    all-reduce of ``nbytes`` and computes (GEMMs lasting :data:`INTERFERENCE_COMPUTE` times
    the all-reduce alone) until both are done, as a backward hides its gradient buckets;
    against the compute alone and the all-reduce alone, that is
    :func:`fxpar.cost.calibration.interference_factor` (a collective's progress and the
    kernels beside it share the cores, or the SMs and memory bandwidth). Each time is the
    slowest rank's; the compute alone and both together are interleaved; median over
    ``iters`` runs."""
    import torch
    import torch.distributed as dist

    from fxpar.cost.calibration import interference_factor

    world = dist.get_world_size(group)
    x = torch.ones(max(world, nbytes // 4 // world * world), dtype=torch.float32, device=device)
    unit = _interference_gemm(device, group)

    def timed(reps: int, collective: bool) -> float:
        dist.barrier(group=group)
        t0 = time.perf_counter()
        work = dist.all_reduce(x, group=group, async_op=True) if collective else None
        for _ in range(reps):
            unit()
        if work is not None:
            work.wait()
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return t.item()

    timed(1, True)   # warm-up
    comm = statistics.median(timed(0, True) for _ in range(iters))
    # the same count on every rank: each time is already the slowest rank's
    reps = max(1, math.ceil(INTERFERENCE_COMPUTE * comm / timed(1, False)))
    factors = []
    for _ in range(iters):
        alone, both = timed(reps, False), timed(reps, True)
        factors.append(interference_factor(alone, min(comm, alone), both))
    return statistics.median(factors)


def _bench_all_gather(x, sub, gsize, dist):
    out = x.new_empty(x.numel() * gsize)
    return lambda: dist.all_gather_into_tensor(out, x, group=sub)


def _bench_reduce_scatter(x, sub, gsize, dist):
    out = x.new_empty(x.numel() // gsize)
    return lambda: dist.reduce_scatter_tensor(out, x, group=sub)


def _bench_broadcast(x, sub, gsize, dist):
    src = dist.get_global_rank(sub, 0)
    return lambda: dist.broadcast(x, src=src, group=sub)


def _bench_all_to_all(x, sub, gsize, dist):
    out = x.new_empty(x.shape)
    return lambda: dist.all_to_all_single(out, x, group=sub)


#: collective -> ``f(x, group, group size, torch.distributed)`` returning the call to time on
#: the float32 buffer ``x`` (:func:`_time_collective`)
_BENCH = {
    Collective.ALL_GATHER: _bench_all_gather,
    Collective.REDUCE_SCATTER: _bench_reduce_scatter,
    Collective.ALL_REDUCE: lambda x, sub, gsize, dist: lambda: dist.all_reduce(x, group=sub),
    Collective.BROADCAST: _bench_broadcast,
    Collective.ALL_TO_ALL: _bench_all_to_all,
    Collective.SEND_RECV: _bench_send_recv,
}


def _time_collective(coll: str, nbytes: int, sub, gsize: int, device, iters: int, world_group,
                     min_time: float = 0.0, compute=None):
    """Seconds per call of one collective as a step pays it, or None if this backend does not
    support it. A run is ``reps`` calls (``reps`` from a warm-up, the same on every rank, so
    that a run lasts about ``min_time``; at least one), each after ``compute()`` (a callable
    returning the seconds it computed, e.g. :func:`_handoff_compute`: ranks arrive as they
    finish computing, the first ones blocked until the last; ``None``: back to back); per
    run ``(T − C) / reps`` with ``T`` the slowest rank's run and ``C`` the most any rank
    computed in it; the median over ``iters`` runs. A run's mean is what a step that issues
    the collective again and again pays: one call is a sample of a scheduler's time slices
    where ranks outnumber cores (a 4 KiB all-reduce on 4 gloo ranks of 2 cores: 2–11 ms from
    one call to the next, 5.2–5.9 ms as the mean of runs after GEMMs)."""
    import torch
    import torch.distributed as dist

    n = max(gsize, nbytes // 4 // gsize * gsize)  # float32 elements, divisible by the group
    if coll not in _BENCH:
        raise ClusterError(f"unknown collective {coll!r}; known: {COLLECTIVES}")
    x = torch.ones(n, dtype=torch.float32, device=device)
    fn = _BENCH[coll](x, sub, gsize, dist)

    try:
        fn()  # warm-up (also detects an unsupported collective on this backend)
    except (RuntimeError, NotImplementedError):
        ok = torch.zeros(1, device=device)
    else:
        ok = torch.ones(1, device=device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=world_group)
    if ok.item() == 0:
        return None
    if coll == Collective.SEND_RECV:
        return _time_send_recv(nbytes, sub, gsize, device, iters, world_group)

    def run(reps: int) -> tuple[float, float]:   # (slowest rank's run, most computed)
        dist.barrier(group=world_group)
        c, t0 = 0.0, time.perf_counter()
        for _ in range(reps):
            if compute is not None:
                c += compute()
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = torch.tensor([time.perf_counter() - t0, c], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=world_group)
        return t[0].item(), t[1].item()

    # reps from a warm-up run of one call and its compute (the same on every rank)
    reps = 1 if min_time <= 0 else int(min(10_000, max(1, math.ceil(
        min_time / max(run(1)[0], 1e-9)))))
    return statistics.median(max(0.0, (t - c) / reps) for t, c in (run(reps) for _ in range(iters)))


def _steady_per_call(fn, min_time: float, cap: int = 100_000) -> float:
    """Seconds per call of probe ``fn(reps) -> [seconds per call, ...]`` (its largest
    component) once warm: one call first for what only the first pays (allocations, kernel
    selection, the autograd engine's start: a chain probe's first call took 16 ms against 5 µs
    per op after, so ``reps`` sized from it ran 4 ops and measured mostly noise), then runs of
    ``reps`` growing 8× until one lasts ``min_time / 8``; the last run's figure.

    >>> calls = []
    >>> def fn(reps):
    ...     calls.append(reps)
    ...     return [1.0 if len(calls) == 1 else 1e-4]
    >>> _steady_per_call(fn, 0.01), calls
    (0.0001, [1, 1, 8, 64])
    """
    fn(1)
    reps = 1
    while True:
        t = max(fn(reps))
        if t * reps >= min_time / 8 or reps >= cap:
            return t
        reps = min(cap, reps * 8)


def _interleaved_times(fns, iters: int, group, min_time: float, sync,
                       per_round: bool = False) -> list[list]:
    """Run probes ``fn(reps) -> [seconds per call, ...]`` on every rank at once, in ``iters``
    interleaved rounds: each round runs every probe once (``reps`` calls, the same on every
    rank, about ``min_time`` from its steady per-call time, :func:`_steady_per_call`; every
    rank at once after a barrier), odd rounds in reverse order; per probe and component the median over rounds
    of the slowest rank. A shared host's speed drifts over seconds; measured back to back,
    the points of one curve saw different hosts (on 2 ranks of 2 vCPUs, one GEMM size's rate
    moved 83 → 41 GFLOP/s between two calibrations while its neighbours did not), so the
    curve's shape, which prices one plan against another, was noise. Interleaved, every
    point sees the same mix of the host's states. ``per_round``: per probe and component the
    slowest rank's time of every round, in round order, instead of their median."""
    import torch
    import torch.distributed as dist

    from fxpar.cost.calibration import median_of_max

    dev = _group_device(group)  # NCCL reduces only device tensors
    warm = torch.tensor([_steady_per_call(fn, min_time) for fn in fns], dtype=torch.float64,
                        device=dev)
    sync()
    dist.all_reduce(warm, op=dist.ReduceOp.MAX, group=group)
    reps = [int(min(100_000, max(1, math.ceil(min_time / max(w, 1e-9))))) for w in warm.tolist()]
    world = dist.get_world_size(group)
    runs: list[list] = [[] for _ in fns]
    for i in range(max(1, iters)):
        order = range(len(fns)) if i % 2 == 0 else range(len(fns) - 1, -1, -1)
        mine = [None] * len(fns)
        for k in order:
            dist.barrier(group=group)
            mine[k] = fns[k](reps[k])
        flat = torch.tensor([x for m in mine for x in m], dtype=torch.float64, device=dev)
        every = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(every, flat, group=group)
        per_rank = torch.stack(every).tolist()  # [rank][flat component]
        at = 0
        for k, m in enumerate(mine):
            runs[k].append([row[at:at + len(m)] for row in per_rank])   # [rank][component]
            at += len(m)
    if per_round:
        return [[[max(r[c] for r in run) for run in rs] for c in range(len(rs[0][0]))]
                for rs in runs]
    return [[median_of_max([[r[c] for r in run] for run in rs]) for c in range(len(rs[0][0]))]
            for rs in runs]


def _oversubscribed(ranks_per_host: int, group=None) -> bool:
    """Whether this host's ranks, each with torch's intra-op threads, outnumber the cores
    this process may run on (every rank of a host taken to be launched alike); with a
    process ``group``, whether that holds on any of its ranks (every rank decides alike).

    >>> _oversubscribed(1)
    False
    """
    import os

    import torch

    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    mine = ranks_per_host * torch.get_num_threads() > cores
    if group is None:
        return mine
    import torch.distributed as dist

    flag = torch.tensor([int(mine)], device=_group_device(group))
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item())


def _cache_bytes(device) -> int:
    """Bytes of the cache an operand leaves between two uses in a training step: a GPU's L2; a
    CPU core's level-2 cache (the level-3 one is shared by every rank of the host and holds a
    small model's weights whole: a step finds them there, not in DRAM); 1 MiB when neither
    says."""
    import torch

    if device.type == "cuda":
        return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 1 << 20)
    for d in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            level, text = (d / "level").read_text().strip(), (d / "size").read_text().strip().upper()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        if level == "2" and text.rstrip("KMG").isdigit():
            return int(text.rstrip("KMG")) * scale
    return 1 << 20


def _measure_compute(group, device, gemm_sizes, memory_sizes, iters: int,
                     min_time: float, dtype=None, attention_shapes=None) -> ComputeProfile:
    """The :class:`ComputeProfile` of this group's ranks (see :meth:`Cluster.calibrate`)."""
    import torch
    import torch.distributed as dist

    dtype = dtype or torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.removeprefix("torch."))
    esize = torch.empty((), dtype=dtype).element_size()
    if attention_shapes is None:
        attention_shapes = ((8, 64, 32), (8, 256, 64)) + (
            ((16, 1024, 128), (32, 2048, 128)) if device.type == "cuda" else ())

    from fxpar.cost.calibration import rate_points

    sync = (torch.cuda.synchronize if device.type == "cuda" else (lambda: None))

    def loop(op):
        def fn(reps: int) -> list[float]:
            sync()
            t0 = time.perf_counter()
            for _ in range(reps):
                op()
            sync()
            return [(time.perf_counter() - t0) / reps]
        return fn

    # every probe is made first, then all are timed in interleaved rounds (_interleaved_times)
    probes: list = []
    one = torch.ones(1, device=device)
    probes.append(loop(lambda: torch.add(one, one)))   # the dispatch

    leaf = torch.ones(1, device=device, requires_grad=True)

    def chain(reps: int) -> list[float]:
        sync()
        t0 = time.perf_counter()
        y = leaf
        for _ in range(reps):
            y = y * 1.0
        sync()
        t1 = time.perf_counter()
        y.backward()
        sync()
        return [(t1 - t0) / reps, (time.perf_counter() - t1) / reps]

    probes.append(chain)
    cache = _cache_bytes(device)
    for n in gemm_sizes:
        a = torch.randn(n, n, device=device, dtype=dtype)
        # the second operand cycles through distinct matrices twice the core's cache together:
        # a weight is read once per pass, long after its last use (on one CPU core an L2-cold
        # 128x384 operand made a 64-row GEMM 1.3x slower than a cached one; streaming from
        # DRAM instead priced a small model's GEMMs 1.5x too slow, its weights stay in L3)
        cold = itertools.cycle([torch.randn(n, n, device=device, dtype=dtype)
                                for _ in range(min(1024, max(2, -(-2 * cache // (n * n * esize)))))])

        def mm(a=a, cold=cold):
            torch.mm(a, next(cold))
        probes.append(loop(mm))
    elems = [max(1, nbytes // esize) for nbytes in memory_sizes]
    for n in elems:
        a = torch.randn(n, device=device, dtype=dtype)
        b = torch.randn_like(a)
        probes.append(loop(lambda a=a, b=b: torch.add(a, b)))
    # non-GEMM arithmetic: a log-softmax over rows of 512 (a loss over a vocabulary shard, an
    # attention row), forward and backward, counted as its cost rule counts them (5 + 4 FLOPs
    # per element: the backward is as slow as the forward, though it counts fewer)
    vec_n = [max(512, nbytes // esize // 512 * 512) for nbytes in memory_sizes]
    for n in vec_n:
        a = torch.randn(n // 512, 512, device=device, dtype=dtype)
        y = torch.log_softmax(a, -1)

        def fwd_bwd(a=a, y=y):  # the two kernels autograd runs, without the engine
            torch.log_softmax(a, -1)
            torch.ops.aten._log_softmax_backward_data(y, y, -1, a.dtype)
        probes.append(loop(fwd_bwd))
    # transcendental elementwise work: a GELU forward and backward (erf in software on a CPU)
    for n in elems:
        x, g = torch.randn(n, device=device, dtype=dtype), torch.randn(n, device=device, dtype=dtype)

        def gelu(x=x, g=g):
            torch.ops.aten.gelu(x)
            torch.ops.aten.gelu_backward(g, x)
        probes.append(loop(gelu))
    # fused causal attention, forward and backward (heads x length x head dim)
    att_shapes = tuple(attention_shapes)
    for bh, L, E in att_shapes:
        # (1, heads, length, dim) as models call it: 3-d inputs miss the flash kernels (on an
        # H200 a 32×2048×128 causal bf16 SDPA ran at 28 TFLOP/s 3-d)
        q, k, v = (torch.randn(1, bh, L, E, device=device, dtype=dtype, requires_grad=True)
                   for _ in range(3))
        go = torch.ones(1, bh, L, E, device=device, dtype=dtype)

        def att(q=q, k=k, v=v, go=go):
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).backward(go)
        probes.append(loop(att))
    # the optimizer step: AdamW over one large tensor, then over many small ones, solved for
    # t = per_tensor + per_element·n
    big, small, k = 2**18, 64, 32

    def adamw(shapes):
        ps = [torch.zeros(sh, device=device, requires_grad=True) for sh in shapes]
        for p in ps:
            p.grad = torch.ones_like(p)
        opt = torch.optim.AdamW(ps, fused=True if defaults.FUSED_STEP else None)
        opt.step()  # the states exist
        return loop(opt.step)

    probes += [adamw([(big,)]), adamw([(small,)] * k)]
    times = iter(_interleaved_times(probes, iters, group, min_time, sync))
    dispatch = next(times)[0]
    fwd_over, bwd_over = next(times)

    def take(count: int) -> list[float]:
        return [next(times)[0] for _ in range(count)]
    gemm_t, mem_t, vec_t, act_t = (take(len(x)) for x in (gemm_sizes, elems, vec_n, elems))
    att_t = take(len(att_shapes))
    t_big, t_small = next(times)[0], next(times)[0] / k
    per_element = max(t_big - t_small, 0.0) / (big - small)
    per_tensor = max(t_small - per_element * small, 0.0)
    fwd = [4.0 * bh * L * L * E for bh, L, E in att_shapes]   # sdpa_cost: QKᵀ and PV
    # a loop of one op takes dispatch + kernel on a CPU, but max(dispatch, kernel) where the
    # kernels queue behind the host (CUDA): there the dispatch is not part of the kernel
    host = 0.0 if device.type == "cuda" else dispatch
    return ComputeProfile(
        gemm=rate_points([2.0 * n ** 3 for n in gemm_sizes], gemm_t, host),
        memory=rate_points([3.0 * n * esize for n in elems], mem_t, host),
        op_overhead=max(fwd_over, 0.0), bwd_op_overhead=max(bwd_over, 0.0), dispatch=dispatch,
        ranks=dist.get_world_size(group),
        vector=rate_points([9.0 * n for n in vec_n], vec_t, 2 * host),
        # keyed by the forward's FLOPs (elements), the rate over both directions' (2 per element)
        activation=tuple((w / 2, r) for w, r in rate_points([2.0 * n for n in elems], act_t, 2 * host)),
        attention=tuple((f, 3.0 * f / t) for f, t in zip(fwd, att_t)),  # backward 2x forward
        optimizer=(per_tensor, per_element), dtype=str(dtype), asynchronous=device.type == "cuda")
