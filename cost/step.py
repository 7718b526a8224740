r"""The one step model: a configuration's step time and peak memory from its units' costs.

The joint search prices every candidate with these functions (from a probe plan's unit
costs scaled to the candidate's microbatch) and a realized :class:`fxpar.Plan` prices itself
with them (from its own plans' unit costs at their real shapes), so the search's number for
its pick and the realized ``Plan.time`` differ only where the realized layouts or shapes do.

**Units.** A :class:`UnitCost` is one run of one layer's nodes (:func:`fxpar.split.units`) per
device: ``fwd``/``bwd`` seconds that scale with the batch (compute and activation
communication), ``fwd_fixed``/``bwd_fixed`` that do not (parameter communication on the
chunk's own axes: gathers in forward, gradient reductions in backward), saved activation
bytes ``act``, local parameter count ``params`` (a parameter counted at its first use, again in
each later chunk that uses it: ``reused``) and bytes crossing a cut after it ``out``.

**Chunks** (:func:`chunk_costs`): chunk ``k`` holds units ``starts[k] ≤ u < starts[k+1]``; at
``scale`` times the units' batch, with the units in ``recomputed`` running their forward again
and each replica gradient ``g`` all-reduced over the data-parallel group (``ar``); the latency
``λ_u``/``μ_u`` of a unit's activation communication does not scale with the batch::

    F_k = Σ_u (fwd_u − λ_u)·s + λ_u + fwd_fixed_u     B_k = Σ_u (bwd_u − μ_u)·s + μ_u + Σ_{u ∈ rec} F_u + Σ ar(g)
    A_k = Σ_{u ∉ rec} act_u·s + Σ_{u ∈ rec} out_{u−1}·s     (a recomputed unit keeps its input)
    Amax_k = max_{u ∈ rec} act_u·s                           (rebuilt one unit at a time)

**Step** (:func:`step_time`): the schedule's action lists through :func:`fxpar.sim.simulate`
with ``F_k``, ``B_k``, the boundary transfers ``x_k`` on the communication lanes and, per
chunk, a ``REDUCE_GRAD`` on its rank's communication lane after its last backward; ``T_os1``
(gathering updated parameters) after the last rank finishes. Inside a chunk the units overlap
communication as the runtime does (:func:`overlapped_chunk`, :func:`unit_overlap`: one FIFO
communication lane beside the compute): ZeRO-3's gathers (``T_p/2m`` per pass, split over
the units by parameters) prefetched one unit ahead, each unit's gradient reductions (its own
axes' ``bwd_fixed`` plus its share of AMSP's ``T_g + T_os0``, :func:`dp_terms`) issued as its
backward ends, so only what outlasts the last microbatch's backward is ``REDUCE_GRAD``; the
cluster's ``comm_interference`` slows compute by that fraction of the communication it hides::

    F_k, B_k, R_k = overlapped_chunk(chunk k, T_p/2m, T_g + T_os0)
    step = max_r(end_r + O_r) + T_os1

with ``end_r`` rank ``r``'s last event in ``sim(F, B, x, REDUCE_GRAD = R)`` and ``O_r`` its
optimizer step (:func:`optimizer_time`; 0 where the cluster does not price it). Where the
cluster's compute was measured on cores its ranks share (``Cluster.calibrate(share_cores=True)``)
the simulator runs compute at :func:`host_rate`: a rank in the others' bubble gets the cores
they leave.

For one SPMD step (one chunk, one microbatch) with nothing to hide behind (one unit) this is
``F + B + reductions + T_p + O + T_os1``; ``summed`` adds every cost with no overlap.

**Memory** (:func:`rank_memory`, Megatron-LM §2.2/§3.5, AMSP §IV-D), pipeline rank ``r``
with ``f_r`` microbatches in flight::

    states_r = Φ_r·(k_p/s_p + k_g/s_g + k_os/s_os) [+ 2·k_p·max_u params_u  if s_p > 1]
    mem_r    = states_r + tmp + f_r·Σ_{k ∈ r} A_k + max_{k ∈ r} Amax_k

with ``tmp`` two gradient buckets and one unit's backward (``2·U + max_u act_u·s``).

>>> u = UnitCost("l0", "mm", fwd=1.0, bwd=2.0, fwd_fixed=0.0, bwd_fixed=0.5, act=10.0,
...              params=4.0, out=3.0)
>>> [c.fwd for c in chunk_costs([u, u], (0,), 2.0)], chunk_costs([u, u], (0,), 2.0)[0].bwd
([4.0], 8.0)
>>> chunk_costs([u, u], (0,), 1.0, recomputed={1})[0].act    # unit 1 keeps unit 0's output
13.0
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from fxpar.defaults import (BUCKET_BYTES, CPU_STEP_PIECE, FIRST_BUCKET_BYTES, OS_GATHER_BYTES,
                            TINY_GATHER_BYTES)

__all__ = ["UnitCost", "ChunkCost", "DpTerms", "StepTime", "chunk_costs", "dp_terms",
           "microbatch_overhead", "host_rate", "split_backward", "optimizer_time", "optimizer_price",
           "cluster_optimizer_price",
           "param_units", "rank_chunks", "rank_memory", "step_time",
           "ZERO_STYLES", "LIST_MEMBER_OPS", "DEEPSPEED_ALLGATHER_ELEMENTS", "os_gather_time",
           "zero_units",
           "unit_overlap", "overlapped_chunk", "overlapped_chunks", "BUCKET"]

#: gradient bucket of the data-parallel reduction (AMSP's ``U``), bytes
BUCKET = BUCKET_BYTES


@dataclass(frozen=True)
class UnitCost:
    """One unit (module docstring), per device, at the batch it was priced at."""

    layer: str
    start: str
    fwd: float
    bwd: float
    fwd_fixed: float
    bwd_fixed: float
    act: float
    params: float
    out: float
    #: parameters it uses again after an earlier unit first did (a tied embedding and LM
    #: head): ``(name, first unit, local elements)``, counted in its chunk when that first
    #: use lies in another chunk (each chunk holds, reduces and steps its own copy)
    reused: tuple[tuple[str, int, float], ...] = ()
    #: bytes of each activation gradient reduced over the replicas in its backward (a value
    #: not derived from the batch, e.g. a position embedding's lookup, read by one that is:
    #: its gradient sums over the batch), one entry per such edge; priced per microbatch
    #: by the configuration's data-parallel group (:func:`chunk_costs`' ``replica_reduce``)
    replica_grads: tuple[float, ...] = ()
    #: the part of ``fwd``/``bwd`` paid once per microbatch whatever its size: the latency
    #: of its activation communication and its ops' fixed costs (kernel launches, dispatch:
    #: :func:`fxpar.cost.compute.op_overheads`)
    fwd_lat: float = 0.0
    bwd_lat: float = 0.0
    #: parameter tensors counted in ``params`` (what an optimizer steps one by one)
    tensors: int = 0
    #: selective recomputation (:data:`fxpar.cost.memory.GRANULARITIES`): the bytes it keeps
    #: besides the unit's input (outputs of GEMMs, attention kernels and activation
    #: collectives: :func:`fxpar.cost.memory.selective_keeps`), and the seconds of the
    #: forward it runs again (the other ops; ``sel_lat`` their fixed part, as ``fwd_lat``)
    sel_act: float = 0.0
    sel_fwd: float = 0.0
    sel_lat: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "reused", tuple(tuple(x) for x in self.reused))
        object.__setattr__(self, "replica_grads", tuple(float(x) for x in self.replica_grads))

    def forward(self, scale: float) -> float:
        """Seconds of its forward at ``scale`` times the priced batch."""
        return (self.fwd - self.fwd_lat) * scale + self.fwd_lat + self.fwd_fixed

    def backward(self, scale: float) -> float:
        """Seconds of its backward at ``scale`` times the priced batch (no reductions)."""
        return (self.bwd - self.bwd_lat) * scale + self.bwd_lat

    def recompute(self, scale: float, granularity: str = "full") -> float:
        """Seconds its recomputation adds to its backward at ``scale``: its whole forward
        (``"full"``), or under ``"selective"`` the ops it does not keep plus its parameters'
        gathers again (``fwd_fixed``: a gathered parameter is never kept)."""
        if granularity == "full":
            return self.forward(scale)
        return (self.sel_fwd - self.sel_lat) * scale + self.sel_lat + self.fwd_fixed


@dataclass(frozen=True)
class ChunkCost:
    """One stage chunk of one microbatch (module docstring): ``fwd``, ``bwd`` (with its
    recomputed forwards), ``reduce`` (gradient reductions on its own axes, once per step),
    ``params`` (local parameters), ``act``/``rebuilt`` (``A_k``/``Amax_k``), ``out`` (bytes
    sent to the next chunk), ``max_params``/``max_act`` (its largest unit's)."""

    fwd: float
    bwd: float
    reduce: float
    params: float
    act: float
    rebuilt: float
    out: float
    max_params: float = 0.0
    max_act: float = 0.0
    #: per unit, in order: forward, backward (with its recomputed forward and synchronous
    #: replica reductions), own-axis gradient reductions, local parameters (sum to the above)
    unit_fwd: tuple[float, ...] = ()
    unit_bwd: tuple[float, ...] = ()
    unit_reduce: tuple[float, ...] = ()
    unit_params: tuple[float, ...] = ()
    #: parameter tensors (its units' ``tensors``, with reused copies)
    tensors: int = 0


def chunk_costs(units: Sequence[UnitCost], starts: Sequence[int], scale: float = 1.0,
                recomputed: Collection[int] = (),
                replica_reduce: Callable[[float], float] | None = None,
                overhead: float = 0.0, granularity: str = "full") -> list[ChunkCost]:
    """Per chunk its :class:`ChunkCost` (module docstring; ``recomputed``: unit indices, at
    ``granularity``: a recomputed unit keeps its input, and under ``"selective"`` its
    ``sel_act`` too, and its backward pays :meth:`UnitCost.recompute`;
    ``replica_reduce(nbytes)``: seconds of an all-reduce over the data-parallel replicas, paid
    in backward for each of the units' ``replica_grads``; ``overhead``: seconds each pipeline
    action pays whatever its size, ``Physics.microbatch_overhead``, on the chunk's first unit
    forward and its last unit backward, the first each pass runs)."""
    bounds = list(starts) + [len(units)]
    rec = set(recomputed)
    out = []
    for k in range(len(starts)):
        idx = range(bounds[k], bounds[k + 1])
        us = [units[u] for u in idx]
        ufwd = tuple(u.forward(scale) + (overhead if j == 0 else 0.0) for j, u in enumerate(us))
        ubwd = tuple(units[u].backward(scale)
                     + (units[u].recompute(scale, granularity) if u in rec else 0.0)
                     + (sum(replica_reduce(b) for b in units[u].replica_grads) if replica_reduce else 0.0)
                     + (overhead if u == bounds[k + 1] - 1 else 0.0)
                     for u in idx)
        kept = (lambda u: units[u].sel_act) if granularity == "selective" else (lambda u: 0.0)
        act = sum((units[u - 1].out if u else 0.0) + kept(u) if u in rec else units[u].act for u in idx)
        copies = {name: n for u in us for name, first, n in u.reused if first < bounds[k]}
        out.append(ChunkCost(
            fwd=sum(ufwd), bwd=sum(ubwd),
            reduce=sum(u.bwd_fixed for u in us), params=sum(u.params for u in us) + sum(copies.values()),
            act=act * scale, rebuilt=max((units[u].act for u in idx if u in rec), default=0.0) * scale,
            out=us[-1].out * scale, max_params=max(u.params for u in us),
            max_act=max(u.act for u in us) * scale, unit_fwd=ufwd, unit_bwd=ubwd,
            unit_reduce=tuple(u.bwd_fixed for u in us),
            unit_params=tuple(float(u.params) for u in us),
            tensors=sum(u.tensors for u in us) + len(copies)))
    return out


def gather_groups(moved: Sequence[float], tiny: float = TINY_GATHER_BYTES) -> list[list[int]]:
    """The runtime's parameter-gather groups (:mod:`fxpar.passes.prefetch`,
    :func:`fxpar.cost.overlap.plan_overlap`) over units in order of first use, ``moved[u]``:
    the bytes per device unit ``u``'s parameter collectives move. A group takes units until it
    moves ``tiny`` (:data:`fxpar.defaults.TINY_GATHER_BYTES`) or more: a norm or a position
    table rides with the unit after it, its own collective would be all latency; a unit of
    ``tiny`` or more closes its group. A group moves less than ``tiny`` plus its last unit.

    >>> gather_groups([4e6, 1e3, 4e6, 2e3, 1e5])
    [[0], [1, 2], [3, 4]]
    >>> gather_groups([1e4] * 10)     # ~64 KiB groups, never one of everything
    [[0, 1, 2, 3, 4, 5, 6], [7, 8, 9]]
    """
    out: list[list[int]] = []
    total = 0.0
    for u, b in enumerate(moved):
        if out and total < tiny:
            out[-1].append(u)
            total += b
        else:
            out.append([u])
            total = b
    return out


def rank_chunks(chunks: Sequence, p: int, ranks: Sequence[int] | None = None) -> list[list]:
    """``chunks`` per pipeline rank: chunk ``k`` on rank ``ranks[k]`` (a schedule's
    :attr:`~fxpar.schedule.Schedule.ranks`), by default ``k % p`` (the looping placement).

    >>> rank_chunks("abcd", 2), rank_chunks("abcd", 2, ranks=(0, 1, 1, 0))
    ([['a', 'c'], ['b', 'd']], [['a', 'd'], ['b', 'c']])
    """
    if ranks is None:
        return [list(chunks[r::p]) for r in range(p)]
    out: list[list] = [[] for _ in range(p)]
    for c, r in zip(chunks, ranks, strict=True):
        out[r].append(c)
    return out


def param_units(chunks: Sequence[ChunkCost], p: int, tiny: float = 0.0,
                ranks: Sequence[int] | None = None) -> list[int]:
    """Per pipeline rank (chunk ``k`` on rank ``k % p``, or ``ranks[k]``), how many gather
    groups its units holding parameters make, at least 1: AMSP's module count ``L``
    (:func:`dp_terms`), for the runtime gathers and reduces each group's parameters together;
    a group takes units until it holds ``tiny`` parameters (:func:`gather_groups`,
    :func:`tiny_params`).

    >>> c = ChunkCost(0, 0, 0, 3, 0, 0, 0, unit_params=(0.0, 2.0, 1.0))
    >>> param_units([c, c, c], 2), param_units([c, c, c], 2, tiny=2.5)
    ([4, 2], [2, 1])
    """
    return [max(1, sum(len(gather_groups([x for x in c.unit_params if x > 0], tiny))
                       for c in mine)) for mine in rank_chunks(chunks, p, ranks)]


def tiny_params(s_p: int, precision: str = "mixed") -> float:
    """Parameters under which a unit's ZeRO-3 gather over ``s_p`` ranks moves fewer than
    :data:`~fxpar.defaults.TINY_GATHER_BYTES` per device (``(s_p − 1)/s_p`` of its bytes):
    the runtime gathers such a unit with the one after it (0 without ZeRO-3 gathers).

    >>> tiny_params(2), tiny_params(1)
    (65536.0, 0.0)
    """
    from fxpar.cost.memory import is_fp32

    if s_p <= 1:
        return 0.0
    return TINY_GATHER_BYTES / ((4 if is_fp32(precision) else 2) * (s_p - 1) / s_p)


def microbatch_overhead(cluster) -> float:
    """Seconds each forward or backward pass of a microbatch pays whatever its size (a pipeline
    action, an SPMD step's two passes: ``cluster.physics.microbatch_overhead``;
    0 without physics): :func:`chunk_costs`' ``overhead``."""
    ph = getattr(cluster, "physics", None)
    return ph.microbatch_overhead if ph is not None else 0.0


def host_rate(cluster, width: int) -> Callable[[int], float] | None:
    """The speed of compute while ``k`` pipeline ranks compute at once, each ``width``
    processes (its data- and tensor-parallel members), on one host whose cores they share
    (:func:`fxpar.sim.simulate`'s ``rate``), from the measured curve
    :attr:`fxpar.cluster.ComputeProfile.shared` (``s[b−1]``: the speed with ``b`` of its
    ranks busy over the speed the compute was measured at, all of them busy)::

        rate(k) = s[min(k·w, len(s)) − 1]

    so a step with every rank busy runs at the measured speed, and ranks computing in the
    others' bubble at what the cores they leave give them. ``None`` (1 whatever ``k``) where
    no curve was measured or the cluster has more than one node.

    4 ranks on 2 cores, a pipeline rank per rank:

    >>> from fxpar.cluster import Cluster, ComputeProfile
    >>> cp = ComputeProfile(gemm=((1e6, 1e9),), memory=((1e6, 1e9),), op_overhead=0.0,
    ...                     bwd_op_overhead=0.0, ranks=4, shared=(2.1, 1.5, 1.1, 1.0))
    >>> r = host_rate(Cluster.local(4, compute=cp), 1)
    >>> [r(k) for k in (1, 2, 3, 4)], host_rate(Cluster.local(4, compute=cp), 2)(1)
    ([2.1, 1.5, 1.1, 1.0], 1.5)
    """
    shared = getattr(getattr(cluster, "compute", None), "shared", ())
    if not shared or getattr(cluster, "nodes", 1) != 1:
        return None
    return lambda k: shared[min(k * width, len(shared)) - 1]


def split_backward(cluster) -> float:
    """``(I + W) / B`` of a backward split for a zero-bubble schedule
    (``cluster.physics.split_backward``; 1 without physics): :func:`step_time`'s ``split``."""
    ph = getattr(cluster, "physics", None)
    return ph.split_backward if ph is not None else 1.0


def optimizer_time(elements: float, tensors: int, price: Sequence[float], flat: bool = False, *,
                   bucket: float = BUCKET, first: float = FIRST_BUCKET_BYTES,
                   piece: float | None = None) -> float:
    """Seconds of an element-wise optimizer's step over ``elements`` local elements in
    ``tensors`` parameter tensors at ``price = (per_tensor, per_element)``
    (:attr:`fxpar.cluster.ComputeProfile.optimizer`)::

        O = per_tensor·T + per_element·elements

    ``T = tensors``, or with ``flat`` (fp32 parameters, unsharded states: the runtime steps one
    flat segment per gradient bucket, :mod:`fxpar.runtime.model_state.optimizer`) the buckets'
    count ``1 + ⌈(4·elements − first)/bucket⌉``, each bucket in pieces of ``piece`` elements
    where the runtime cuts them (a CPU: :func:`step_piece`).

    >>> optimizer_time(1000, 4, (1e-5, 1e-8)) * 1e6      # 4 tensors, 1000 elements
    50.0
    >>> optimizer_time(1000, 4, (1e-5, 1e-8), flat=True) * 1e6   # one bucket
    20.0
    >>> optimizer_time(1000, 4, (1e-5, 1e-8), flat=True, piece=400) * 1e6   # 3 pieces
    40.0
    """
    if not price or elements <= 0:
        return 0.0
    per_tensor, per_element = price
    if flat:
        head = min(elements, first / 4)   # elements per bucket, the first one small
        full, tail = divmod(elements - head, bucket / 4)
        sizes = [head] + [bucket / 4] * int(full) + ([tail] if tail > 0 else [])
        tensors = sum(math.ceil(x / piece) if piece else 1 for x in sizes)
    return tensors * per_tensor + per_element * elements


def optimizer_price(memory_bandwidth: float, memory_efficiency: float, kernel_overhead: float,
                    state_bytes: Sequence[float], fp32: bool) -> tuple[float, float]:
    """``(per_tensor, per_element)`` of an element-wise optimizer step where nothing measured
    it (:func:`optimizer_time`'s ``price``): memory-bound, every optimizer state read and
    written, the gradient read and the parameter written (read too where it is its own fp32
    master), at ``memory_efficiency`` of ``memory_bandwidth``; one kernel per tensor::

        per_element = (2·k_os + k_g + (2 if fp32 else 1)·k_p) / (β·e)

    with ``state_bytes = (k_p, k_g, k_os)`` (:data:`fxpar.cost.memory.STATE_BYTES_PER_PARAM`).
    Mixed-precision AdamW (2, 2, 12) and fp32 AdamW (4, 4, 8) both move 28 bytes an element.

    >>> per_tensor, per_element = optimizer_price(1e12, 0.5, 3e-6, (2, 2, 12), fp32=False)
    >>> per_tensor, round(per_element * 1e12, 6)       # 28 bytes at 0.5 TB/s
    (3e-06, 56.0)
    """
    kp, kg, kos = state_bytes
    moved = 2 * kos + kg + (2 if fp32 else 1) * kp
    return kernel_overhead, moved / (memory_bandwidth * memory_efficiency)


def cluster_optimizer_price(cluster, state_bytes, fp32: bool) -> tuple:
    """The optimizer step's ``(per_tensor, per_element)`` on ``cluster`` (a :class:`Cluster`
    or its dict): measured (``compute.optimizer``), else from its physics
    (:func:`fxpar.cost.step.optimizer_price`), else ``()`` (not priced: the flat roofline)."""
    get = cluster.get if isinstance(cluster, dict) else (lambda k: getattr(cluster, k, None))
    compute = get("compute")
    measured = (compute.get("optimizer") if isinstance(compute, dict)
                else getattr(compute, "optimizer", None))
    if measured:
        return tuple(measured)
    ph = get("physics")
    if not ph or not get("memory_bandwidth"):
        return ()
    ph = ph if isinstance(ph, dict) else dataclasses.asdict(ph)
    return optimizer_price(get("memory_bandwidth"), ph["memory_efficiency"],
                           ph["kernel_overhead"], state_bytes, fp32)


def step_piece(device_type: str) -> int | None:
    """The elements of the pieces the runtime steps a flat segment in on ``device_type``
    (:data:`fxpar.defaults.CPU_STEP_PIECE` on a CPU), ``None`` for whole segments.

    >>> step_piece("cpu-process"), step_piece("A100-80GB")
    (131072, None)
    """
    return CPU_STEP_PIECE if device_type.lower().startswith("cpu") else None


def unit_overlap(compute: Sequence[float], gather: Sequence[float],
                 reduce: Sequence[float] | None = None, interference: float = 0.0
                 ) -> tuple[float, float]:
    """One pass over a chunk's units (its forward, or its backward in reverse order) on a
    compute lane and one communication lane, first in first out (one NCCL stream):
    ``gather[u]`` (unit ``u``'s parameters, ZeRO-3) is issued when the unit before it starts
    (prefetched one unit ahead; the first is exposed), ``reduce[u]`` (its gradients) when
    unit ``u`` ends. Returns ``(duration, tail)``: when the last unit's compute ends, plus
    ``interference`` × the communication seconds hidden behind compute (communication
    slows concurrent kernels: memory bandwidth, SMs), and how long the lane runs on after.

    >>> unit_overlap([1, 1, 1], [0.5, 0.5, 0.5])          # gathers hidden but the first
    (3.5, 0.0)
    >>> unit_overlap([1, 1, 1], [2, 2, 2])                # communication-bound
    (7.0, 0.0)
    >>> unit_overlap([1, 1, 1], [0, 0, 0], [2, 2, 2])     # reductions: 1..3, 3..5, 5..7
    (3.0, 4.0)
    >>> unit_overlap([1, 1], [0.5, 0.5], interference=0.2)  # 0.5 s hidden, 20% slower
    (2.6, 0.0)
    """
    n = len(compute)
    reduce = list(reduce) if reduce is not None else [0.0] * n
    lane = ready = gather[0] if n else 0.0
    t = 0.0
    for u in range(n):
        start = max(t, ready)
        ready = 0.0
        if u + 1 < n and gather[u + 1]:
            lane = ready = max(lane, start) + gather[u + 1]
        t = start + compute[u]
        if reduce[u]:
            lane = max(lane, t) + reduce[u]
    tail = max(0.0, lane - t)
    hidden = max(0.0, sum(gather) + sum(reduce) - (t - sum(compute)) - tail)
    return t + interference * hidden, tail


def overlapped_chunks(chunks: Sequence[ChunkCost], p: int, m: int, dp: Sequence[DpTerms],
                      interference: float = 0.0, overlap: bool = True,
                      ranks: Sequence[int] | None = None
                      ) -> tuple[list[float], list[float], list[float]]:
    """Per chunk (chunk ``k`` on pipeline rank ``k % p``, or ``ranks[k]``) ``(F, B, R)`` of
    :func:`overlapped_chunk` with its share by parameters of its rank's data-parallel terms
    ``dp``: ZeRO-3's gathers ``T_p/2m`` per pass and microbatch, reductions ``T_g + T_os0``
    once; ``overlap=False``: every cost added (``c.fwd + gather``, ...). One SPMD step (``p =
    m = 1``: the SPMD runner) holds the last unit's forward gather for the backward
    (``held_last``), as fxpar's ZeRO-3 does (not DeepSpeed's style, ``rs_exposed``). Host
    work (``DpTerms.host``) is added to the passes, ``host/3m`` to a microbatch's forward and
    ``2·host/3m`` to its backward: it delays the compute issued after it."""
    phi = [sum(x.params for x in mine) for mine in rank_chunks(chunks, p, ranks)]
    out: tuple[list[float], list[float], list[float]] = ([], [], [])
    for k, c in enumerate(chunks):
        r = k % p if ranks is None else ranks[k]
        d, share = dp[r], c.params / max(phi[r], 1e-30)
        # per microbatch: T_p/m, of which rs_share is the reduce-scatter (a third: ring RS and
        # AG of the same bytes cost the same), exposed in the backward when the runtime does
        # not overlap it; overlapped, the three are spread over the two passes alike
        rs = d.t_p * d.rs_share / m * share if d.rs_exposed else 0.0
        g, r = (d.t_p / m * share - rs) / 2, (d.t_g + d.t_os0) * share
        h = d.host / (3 * m) * share
        f, b, red = (overlapped_chunk(c, g, r, interference,
                                      held_last=p == m == 1 and not d.rs_exposed) if overlap
                     else (c.fwd + g, c.bwd + g, c.reduce + r))
        for acc, v in zip(out, (f + h, b + rs + 2 * h, red)):
            acc.append(v)
    return out


def overlapped_chunk(c: ChunkCost, gather: float, reduce: float, interference: float = 0.0,
                     held_last: bool = False) -> tuple[float, float, float]:
    """``(F, B, R)`` of chunk ``c`` with ``gather`` seconds of ZeRO-3 gathers per pass (forward
    and again backward) and ``reduce`` seconds of data-parallel reductions, both split over
    its units by parameters, as the runtime overlaps them (:func:`unit_overlap`): ``F`` and
    ``B`` one microbatch's passes with the gathers prefetched, ``R`` what the last
    microbatch's backward adds when its units' reductions (and ``c.reduce``, its own axes')
    go out as each unit's backward ends: the exposed reduction time. ``held_last``: the last
    unit holding parameters is not gathered again in backward (its forward gather is held:
    :class:`fxpar.runtime.comm.Regather` ``keep_last``).

    >>> c = chunk_costs([UnitCost("l", "x", 1.0, 2.0, 0.0, 0.5, 0.0, 1.0, 0.0)] * 2, (0,))[0]
    >>> overlapped_chunk(c, gather=0.0, reduce=1.0)     # unit 1's 1 s behind unit 0's backward
    (2.0, 4.0, 1.0)
    >>> overlapped_chunk(c, gather=1.0, reduce=0.0)     # the first gather of each pass exposed
    (2.5, 4.5, 0.5)
    >>> overlapped_chunk(c, gather=1.0, reduce=0.0, held_last=True)   # backward starts held
    (2.5, 4.0, 0.5)
    """
    if not c.unit_fwd:   # no per-unit split: nothing overlaps
        return c.fwd + gather, c.bwd + gather, c.reduce + reduce
    total = sum(c.unit_params)
    share = [p / total for p in c.unit_params] if total > 0 else [1.0 / len(c.unit_params)] * len(c.unit_params)
    g = [gather * x for x in share]
    r = [own + reduce * x for own, x in zip(c.unit_reduce, share)]
    f, _ = unit_overlap(c.unit_fwd, g, None, interference)
    gb = g[::-1]
    if held_last:
        held = next((i for i, x in enumerate(c.unit_params[::-1]) if x > 0), None)
        if held is not None:
            gb[held] = 0.0
    b, _ = unit_overlap(c.unit_bwd[::-1], gb, None, interference)
    b_last, tail = unit_overlap(c.unit_bwd[::-1], gb, r[::-1], interference)
    return f, b, b_last - b + tail


@dataclass(frozen=True)
class DpTerms:
    """AMSP's per-step data-parallel seconds for one pipeline rank's parameters;
    ``rs_exposed``: the reduce-scatters in ``t_p`` are not overlapped with the backward
    (:data:`ZERO_STYLES` ``"deepspeed"``, ``"deepspeed-list"``)."""

    t_p: float = 0.0
    t_g: float = 0.0
    t_os0: float = 0.0
    t_os1: float = 0.0
    rs_exposed: bool = False
    #: seconds of host work per step that hold up the compute issued after it (list-based
    #: collectives' per-member operations, ``"deepspeed-list"``): a third in the forward
    #: (the gathers), two thirds in the backward (gathers again, reduce-scatters)
    host: float = 0.0
    #: the reduce-scatters' share of ``t_p``: a third when gradients move the parameters'
    #: bytes (a ring all-gather and reduce-scatter of equal bytes cost the same), more when
    #: they are reduced in a wider dtype (``reduce_dtype``)
    rs_share: float = 1 / 3

    @property
    def total(self) -> float:
        return self.t_p + self.t_g + self.t_os0 + self.t_os1


#: How a runtime issues ZeRO's collectives (``PlannerOptions.zero_style``):
#:
#: * ``"flat"``: one all-gather (forward, again in backward) and one reduce-scatter per unit's
#:   parameters together, gathers prefetched a unit ahead, reduce-scatters behind the
#:   backward, as FSDP; after the optimizer step, the updated chunks of the buckets in
#:   all-gathers of up to ``OS_GATHER_BYTES`` (1 GiB) over the ``s_os/s_p`` group (``T_os1``,
#:   :func:`os_gather_time`): fxpar's runtime;
#: * ``"amsp"``: ``"flat"``'s ZeRO-3 with AMSP's ``T_os1``: each optimizer-state owner
#:   broadcasts its updated parameters (AMSP §IV-C2, ``s_os/s_p`` broadcasts);
#: * ``"deepspeed"``: DeepSpeed's ZeRO-3 as the seeds measured it: one ``all_gather`` per
#:   parameter tensor (``partition_parameters._allgather_param``), so a unit pays its ring
#:   latency once per tensor, and reduce-scatters that do not overlap the backward (AMSP §VI,
#:   Fig. 14: "fails to effectively overlap ReduceScatter with computation");
#: * ``"deepspeed-list"``: ``"deepspeed"`` as DeepSpeed ≤ 0.5 ran it (2021: Megatron-LM's
#:   Table 2), with list-based collectives: ``_allgather_param`` builds a list of the ``G``
#:   members' ``narrow`` views in Python and ``torch.distributed.all_gather`` into a list copies
#:   each member out of its flat buffer (``ProcessGroupNCCL``'s flatten/unflatten), the
#:   reduce-scatter likewise; host work per collective grows with ``G``
#:   (:data:`LIST_MEMBER_OPS`, ``DpTerms.host``). Later DeepSpeed gathers into one flat tensor
#:   (``allgather_into_tensor``): ``"deepspeed"``.
#:
#: Both DeepSpeed styles gather the updated parameters after the step as ZeRO-1/2's
#: ``all_gather_dp_groups`` does: in :data:`DEEPSPEED_ALLGATHER_ELEMENTS` pieces.
ZERO_STYLES = ("flat", "deepspeed", "deepspeed-list", "amsp")
#: the styles whose ZeRO-3 gathers a unit's parameters together and overlaps its reductions
_UNIT_GATHERS = ("flat", "amsp")

#: DeepSpeed's default ``allgather_bucket_size`` (elements): ZeRO-1/2 gather the updated
#: parameters in ``max(1, ⌊Φ/5e8⌋)`` all-gathers
DEEPSPEED_ALLGATHER_ELEMENTS = 5e8

#: host operations per member of a list-based collective (``"deepspeed-list"``): the member's
#: ``narrow`` view that builds the list and the ``copy_`` between it and the flat buffer, each
#: priced at the cluster's per-kernel fixed cost (``Physics.kernel_overhead``)
LIST_MEMBER_OPS = 2


def zero_units(chunks: Sequence[ChunkCost], p: int, style: str = "flat", tiny: float = 0.0,
               ranks: Sequence[int] | None = None
               ) -> list[int]:
    """AMSP's ``L`` per pipeline rank under ``style`` (:data:`ZERO_STYLES`): gather groups of
    the units holding parameters (:func:`param_units`, ``tiny`` its threshold) or,
    ``"deepspeed"``, parameter tensors.

    >>> c = ChunkCost(0, 0, 0, 3, 0, 0, 0, unit_params=(0.0, 2.0, 1.0), tensors=5)
    >>> zero_units([c, c, c], 2), zero_units([c, c, c], 2, "deepspeed")
    ([4, 2], [10, 5])
    """
    if style not in ZERO_STYLES:
        raise ValueError(f"zero_style {style!r}: one of {ZERO_STYLES}")
    if style in _UNIT_GATHERS:
        return param_units(chunks, p, tiny, ranks)
    return [max(1, sum(c.tensors for c in mine)) for mine in rank_chunks(chunks, p, ranks)]


@functools.lru_cache(maxsize=8192)
def dp_terms(phi: float, layers: int, m: int, d0: int, d1: int, s_p: int, s_g: int, s_os: int,
             cluster, precision: str = "mixed", style: str = "flat",
             reduce_scale: float = 1.0) -> DpTerms:
    """AMSP's ``T_p, T_g, T_os0, T_os1`` (:func:`fxpar.cost.amsp.evaluate`) for ``phi`` local
    parameters in ``layers`` equal modules over ``d0 × d1`` replicas (inside × across nodes),
    ``m`` microbatches; each factor split inside the node first (AMSP eq. 7). Three
    departures, all the runtime's: AMSP counts 2 bytes a value (bf16), ``fp32`` training moves
    4; the gradients of a P shard (``B = 2Φ/s_p`` bytes) go out in whole buckets, a first
    small one then ``BUCKET`` each (``n = 1 + ⌈(B − FIRST)/BUCKET⌉`` of ``U = B/n``), where
    AMSP's ``B/U`` may count a fraction of one bucket's latency; and ``T_os1`` is the
    all-gather the runtime issues after the step (:func:`os_gather_time`; AMSP's broadcasts
    under ``style="amsp"``, :data:`ZERO_STYLES`). ``reduce_scale``: gradients reduced in
    that many times a value's bytes (:func:`fxpar.cost.memory.reduce_scale`): ``T_g``,
    ``T_os0`` and the reduce-scatters of ``T_p`` move ``k·2Φ`` bytes in as many buckets,
    the gathers ``2Φ``.

    >>> from fxpar import Cluster
    >>> c = Cluster.preset("a800", physics=None, nodes=2).without_latency()
    >>> bf, fp = (dp_terms(1e9, 10, 2, 8, 2, 16, 16, 16, c, reduce_scale=k) for k in (1.0, 2.0))
    >>> round(fp.t_p / bf.t_p, 6), round(fp.rs_share, 6)     # AG, AG, then RS at twice the bytes
    (1.333333, 0.5)
    """
    from fxpar.cost.amsp import Sharding, evaluate
    from fxpar.cost.amsp import t_g as amsp_t_g
    from fxpar.cost.amsp import t_os0 as amsp_t_os0
    from fxpar.cost.amsp import t_p as amsp_t_p
    from fxpar.cost.memory import is_fp32

    if d0 * d1 == 1 or phi <= 0:
        return DpTerms()
    elements = phi
    if is_fp32(precision):
        phi *= 2.0
    grads = 2 * phi / s_p
    bucket = grads / (1 + math.ceil(max(0.0, grads - FIRST_BUCKET_BYTES) / BUCKET))
    # priced on the d1 nodes one stage's replicas span (AMSP tiles its grid over the cluster)
    if cluster.nodes != d1:
        cluster = dataclasses.replace(cluster, nodes=d1)

    def split(s: int) -> tuple[int, int]:
        return (s, 1) if s <= d0 else (d0, s // d0)

    sh = Sharding(split(s_p), split(s_g), split(s_os))
    L = max(1, layers)
    r = evaluate(sh, phi=phi, module_params=[phi / L], L=L, M=m, U=bucket,
                 cluster=cluster, dp=(d0, d1), precision=precision)
    t_p, t_g, t_os0, rs_share = r.t_p, r.t_g, r.t_os0, 1 / 3
    if reduce_scale != 1.0:   # the gradients' collectives at k times the bytes, same count
        k, kw = reduce_scale, dict(dp=(d0, d1))
        t_g = amsp_t_g(sh, k * phi, m, k * bucket, cluster, **kw)
        t_os0 = amsp_t_os0(sh, k * phi, k * bucket, cluster, **kw)
        rs = amsp_t_p(sh, [k * phi / L], L, m, cluster, **kw) / 3
        t_p = 2 * r.t_p / 3 + rs
        rs_share = rs / t_p if t_p else rs_share
    # each of the L tensors' three list collectives per microbatch (two gathers, one
    # reduce-scatter) walks its s_p members on the host
    host = (m * max(1, layers) * 3 * s_p * LIST_MEMBER_OPS * cluster.physics.kernel_overhead
            if style == "deepspeed-list" and s_p > 1 and cluster.physics is not None else 0.0)
    t_os1 = r.t_os1
    if style != "amsp" and s_os > s_p:   # the updated parameters: as many bytes as `grads`
        pieces = (math.ceil(grads / OS_GATHER_BYTES) if style == "flat"
                  else max(1, math.floor(elements / DEEPSPEED_ALLGATHER_ELEMENTS)))
        t_os1 = os_gather_time(grads, pieces, split(s_p), split(s_os), cluster, (d0, d1))
    return DpTerms(t_p, t_g, t_os0, t_os1, rs_exposed=style not in _UNIT_GATHERS, host=host,
                   rs_share=rs_share)


def os_gather_time(nbytes: float, pieces: int, p: tuple[int, int], os: tuple[int, int], cluster,
                   dp: tuple[int, int]) -> float:
    """``T_os1`` as an all-gather runtime pays it: the ``nbytes`` of updated parameters of a P
    shard (``2Φ/s_p``), gathered over the ``s_os/s_p`` group in ``pieces`` equal all-gathers
    (``pieces·t(AG, nbytes/pieces, s_os/s_p)``, AMSP's ``t`` on the same ratio groups as its
    broadcast term): the latency once per piece where AMSP's ``s_os/s_p`` broadcasts pay it
    once per owner.

    >>> from fxpar import Cluster
    >>> from fxpar.cost.amsp import amsp_time
    >>> c = Cluster.preset("a800", physics=None, nodes=2)
    >>> two = os_gather_time(8e9, 2, (1, 1), (8, 1), c, (8, 2))       # 8 GB in two pieces
    >>> two == 2 * amsp_time("AG", 4e9, (8, 1), c, dp=(8, 2))
    True
    """
    from fxpar.cost.amsp import amsp_time

    return pieces * amsp_time("AG", nbytes / pieces, os, cluster, b=p, dp=dp)


def rank_memory(chunks: Sequence[ChunkCost], p: int, in_flight: Sequence[float],
                state_bytes: tuple[float, float, float], state: tuple[int, int, int],
                tmp: float, ranks: Sequence[int] | None = None) -> list[float]:
    """Peak bytes per pipeline rank (module docstring); chunk ``k`` runs on rank ``k % p``
    (or ``ranks[k]``); ``state_bytes`` = ``(k_p, k_g, k_os)`` per parameter, ``state`` =
    ``(s_p, s_g, s_os)``."""
    kp, kg, kos = state_bytes
    s_p, s_g, s_os = state
    out = []
    for r, mine in enumerate(rank_chunks(chunks, p, ranks)):
        phi = sum(c.params for c in mine)
        gathered = 2 * kp * max(c.max_params for c in chunks) if s_p > 1 else 0.0
        out.append(phi * (kp / s_p + kg / s_g + kos / s_os) + gathered + tmp
                   + in_flight[r] * sum(c.act for c in mine) + max(c.rebuilt for c in mine))
    return out


@dataclass(frozen=True)
class StepTime:
    """``step`` seconds; ``pipeline`` the simulated part, ``dp_comm`` the data-parallel
    terms of the slowest rank, ``bubble`` the simulator's idle fraction, ``summed`` every
    cost added with no overlap, ``sim`` the :class:`fxpar.sim.SimResult` (its ``step_time``
    is ``step``: the timeline plus ``T_os1``)."""

    step: float
    pipeline: float
    dp_comm: float
    bubble: float
    summed: float
    sim: object = None


def step_time(schedule, chunks: Sequence[ChunkCost], xfer: Callable[[int], tuple[float, float]],
              dp: Sequence[DpTerms], *, act_bytes: Sequence[float] | None = None,
              static_bytes: Sequence[float] | None = None, interference: float = 0.0,
              optimizer: Sequence[float] | None = None, overhead: float = 0.0,
              split: float = 1.0, rate: Callable[[int], float] | None = None) -> StepTime:
    """The step of ``schedule`` (a :class:`fxpar.schedule.Schedule`) over ``chunks`` (module
    docstring). ``xfer(k)``: seconds of chunk ``k``'s boundary transfer to ``k+1`` and of its
    gradient back; ``dp[r]``: pipeline rank ``r``'s :class:`DpTerms`; ``optimizer[r]``: its
    optimizer step's seconds (an ``OPTIMIZER`` event on its compute lane after its last one).

    A backward split into ``I`` and ``W`` (zero-bubble schedules) runs as the runtime runs it:
    chunk 0 has no input gradient to hurry, so its ``I`` is the whole backward and its ``W``
    empty; another chunk's ``I`` and ``W`` are half of ``split`` times its backward each
    (:func:`split_backward`: the two passes' cost over the whole one's), and ``W``, a second
    action, pays the per-action ``overhead`` (:func:`microbatch_overhead`) again. ``rate``:
    the compute speed by the number of pipeline ranks computing at once (:func:`host_rate`).

    >>> from fxpar.schedule import Schedule
    >>> c = chunk_costs([UnitCost("l", "x", 1.0, 2.0, 0.0, 0.0, 0.0, 1.0, 0.0)], (0,))
    >>> step_time(Schedule.build("1f1b", stages=1, microbatches=1), c, lambda k: (0, 0),
    ...           [DpTerms()], optimizer=[0.5]).step
    3.5
    """
    from fxpar.sim import SimEvent, simulate

    p, m, n = schedule.stages, schedule.microbatches, len(chunks)
    ranks = getattr(schedule, "ranks", None)
    fwd, bwd, red = overlapped_chunks(chunks, p, m, dp, interference, ranks=ranks)
    xs = [xfer(k) for k in range(n - 1)]

    def comm(action) -> float:
        if action.kind == "SEND_F":
            return xs[action.stage][0] if action.stage < n - 1 else 0.0
        if action.kind == "SEND_B":
            return xs[action.stage - 1][1] if action.stage >= 1 else 0.0
        return 0.0

    kw = {}
    if act_bytes is not None:
        kw.update(act_bytes=list(act_bytes), static_bytes=list(static_bytes or [0.0] * p))
    halves = {(a.stage, a.microbatch) for row in schedule.actions.values() for a in row
              if a.kind.name == "I"}

    def b_time(k: int, i: int) -> float:
        return bwd[k] * split + overhead if k and (k, i) in halves else bwd[k]

    def w_time(k: int, i: int) -> float:
        return b_time(k, i) / 2 if k else 0.0

    res = simulate(schedule, fwd=fwd, bwd=b_time, wgrad=w_time if halves else None, comm=comm,
                   reduce=lambda a: red[a.stage], rate=rate, **kw)
    opt = [float(x) for x in optimizer] if optimizer is not None else [0.0] * p
    ends = [max((e.end for e in res.events if e.rank == r), default=0.0) for r in range(p)]
    steps = [SimEvent(r, "compute", "OPTIMIZER", ends[r], ends[r] + opt[r])
             for r in range(p) if opt[r] > 0]
    done = max([float(res.step_time)] + [e.end for e in steps])
    tail = max(d.t_os1 for d in dp)
    f0, b0, r0 = overlapped_chunks(chunks, p, m, dp, overlap=False, ranks=ranks)
    summed = (m * sum(f0) + m * sum(b0) + sum(r0) + m * sum(a + b for a, b in xs) + tail
              + sum(opt))
    # the simulator's result with the step the model predicts (T_os1 after the last rank)
    return StepTime(done + tail, done, max(d.total for d in dp),
                    float(res.bubble_fraction), float(summed),
                    dataclasses.replace(res, step_time=done + tail, events=res.events + tuple(steps)))
