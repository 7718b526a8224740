r"""The joint search (DESIGN §10): pipeline stages × stage submesh × tensor-parallel layout ×
context parallelism × microbatches × schedule × recomputation × model-state sharding, under
device memory, minimizing the predicted step time.

**Cost table.** The model is captured once at a *probe* shape (one sample per replica,
``probe_batch``) and planned by the intra-op planner on a ``tp=t`` mesh for every candidate
``t`` (repeated layers tied, so each distinct layer is solved once per ``t``). Per *unit* (a run
of nodes of one layer, :func:`fxpar.split.units`) the plan gives per-device forward and
backward seconds, split into the part that scales with the microbatch (compute and activation
communication) and the part that does not (communication of parameters), the saved activation
bytes, the local parameter count and the bytes crossing the cut after it. A configuration with
``b`` samples per replica and microbatch scales the first kind by ``b / probe_batch``.
With context parallelism (:func:`cp_degrees`: long sequences; ``plan=dict(cp=c)``) the probe is
planned on ``{"cp": c, "tp": t}`` with its sequence inputs split over ``cp``
(:func:`fxpar.planner.baselines.cp_pins`): attention's K/V gathered, passed round in a ring or
its heads split, as the intra-op planner prices cheaper; parameters are replicated over
``cp`` and their gradients reduced with the replicas' (``dp·cp`` devices,
:attr:`fxpar.config.ParallelConfig.replicas`); devices order ``pp, dp, cp, tp``.

**Configurations.** ``N = p·d·t`` devices: ``p`` pipeline ranks (outermost, across nodes
first), ``d`` data-parallel replicas, ``t`` tensor-parallel devices (innermost, inside a node);
``b`` per replica per microbatch with ``m = B/(d·b)`` microbatches; a schedule with ``v``
chunks per rank (chunk ``k`` on rank ``k mod p``, or in a V for zbv and dualpipev: rank ``r``
holds chunks ``r`` and ``2p−1−r``, :func:`fxpar.schedule.chunk_rank`); recomputation of
every layer, of none, or (over the budget without it) of each rank's cheapest set of units
that fits (:func:`_partial_tables`), or of every layer at the selective granularity (over
the budget without recomputation: each layer keeps its GEMMs', attention kernels' and
collectives' outputs and re-runs the rest, ``UnitCost.sel_act``/``sel_fwd``); AMSP's
factors ``(s_p, s_g, s_os)`` over ``d``: DDP ``(1, 1, 1)``, ZeRO-1 ``(1, 1, d)``, ZeRO-2 ``(1, d, d)``, their partial forms
inside a node ``(1, 1, d₀)``, ``(1, d₀, d₀)``, ZeRO-3 ``(d, d, d)`` (with microbatches its
gathers are paid per microbatch) and, for one SPMD step (``p = 1``, ``m = 1``), parameters
sharded inside groups of ``s_p`` replicas (HSDP / MiCS, AMSP's intra-node ``s_p``;
:func:`_zero_options`).

* stage cuts: the exact linear-partition DP over units (:func:`fxpar.split._balanced`) on the
  units' time at this ``(t, b)``, for ``p·v`` chunks;
* per rank ``r``: work ``W_r = Σ_{its chunks} (F + B)``, with recomputation ``B += F``
  (selective: ``B +=`` the forward of what it does not keep);
* memory of rank ``r`` (Megatron-LM §2.2 and §3.5; AMSP §IV-D):
  ``states(Φ_r; s_g, s_os) + f_r·A_r`` without recomputation,
  ``states + f_r·I_r + max_unit A`` with it (per-layer recomputation, as the runtime does:
  each unit's inputs kept, one unit's activations rebuilt at a time; selective:
  ``I_r`` plus what the units keep), where ``states =
  Φ_r·(k_p/s_p + k_g/s_g + k_os/s_os)`` plus, with ``s_p > 1``, the gathered parameters of
  the largest unit twice (prefetch), ``f_r`` = :func:`fxpar.planner.price.in_flight`,
  ``A_r`` the rank's saved activations of one microbatch and ``I_r`` the inputs of its units;
* data parallelism once per step: AMSP's ``T_p + T_g + T_os0 + T_os1`` for the rank's parameters
  (:func:`fxpar.cost.amsp.evaluate`, not overlapped: an upper bound);
* step, estimate: ``m·W_max + (Σ_r W_r − W_max)/v + 2(p·v−1)·x`` (``x`` a boundary
  transfer; uniform stages give Megatron's ``(m + (p−1)/v)·W``); the ``keep`` best by this
  estimate are simulated exactly (:func:`fxpar.sim.simulate` on the schedule's action lists)
  and ranked by simulated step.

>>> import torch, fxpar
>>> from examples.models import GPT
>>> model = GPT(vocab=64, d_model=32, n_heads=2, n_layers=4, seq_len=16)
>>> gm = fxpar.capture(model, (torch.randint(0, 64, (1, 16)),))
>>> res = search(gm, fxpar.Cluster.preset("dgx-a100"), batch=32, tps=(1, 2), pps=(1, 2))
>>> best = res.best
>>> best.pp * best.dp * best.tp, best.dp * best.microbatch * best.microbatches
(8, 32)
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from fxpar import ir
from fxpar.config import ParallelConfig, is_layer
from fxpar.cost.memory import reduce_scale
from fxpar.cost.step import (BUCKET, UnitCost, chunk_costs, dp_terms, microbatch_overhead,
                             overlapped_chunks, rank_chunks, rank_memory, tiny_params,
                             zero_units)
from fxpar.errors import PlanError
from fxpar.mesh import Mesh
from fxpar.planner.intra_op import PlannerOptions, plan_and_keep
from fxpar.planner.price import in_flight, optimizer_seconds, price_config, replica_allreduce, state_bytes
from fxpar.schedule import MULTI_CHUNK, PLACEMENT_OF, chunk_rank
from fxpar.schedule.schedule import DIVIDES_M
from fxpar.spec import Spec
from fxpar.split import units

__all__ = ["UnitCost", "Candidate", "SearchResult", "unit_costs", "search", "SCHEDULES"]

#: the schedules that split the backward into ``I`` and ``W``
SPLIT_BACKWARD = frozenset({"zb-h1", "interleaved-zb", "zbv", "dualpipev"})
#: schedules the search tries (``chunks > 1`` for the two interleaved ones, two in a V for
#: zbv and dualpipev; looped BFS, whose bubble is interleaved 1F1B's for more memory, is left
#: out); a user's ``plan=dict(schedule=...)`` may name any of
#: :data:`fxpar.schedule.GENERATORS`
SCHEDULES = ("1f1b", "interleaved", "eager-1f1b", "zb-h1", "interleaved-zb", "zbv", "dualpipev")
#: the intra-op budget of the cost-table plans: memory is the search's business (1 EiB)
_NO_LIMIT = float(2**60)
#: the largest microbatch per replica tried (Megatron-LM §3.2: small ones win with pipelines)
MAX_MICROBATCH = 32
#: candidates of each schedule simulated whatever their estimate (see :func:`search`)
PER_SCHEDULE = 2


def unit_costs(gm: fx.GraphModule, mesh: Mesh, options: PlannerOptions | None = None
               ) -> tuple[list[UnitCost], object]:
    """Plan ``gm`` on ``mesh`` with no memory limit (memory is the search's business) and
    return its unit table (:func:`fxpar.planner.price.unit_table`) and the
    :class:`~fxpar.plan_data.Plan`. A ``cp`` axis splits the sequence of the inputs
    (:func:`fxpar.planner.baselines.cp_pins`)."""
    from fxpar.planner.baselines import cp_pins

    opts = dataclasses.replace(options or PlannerOptions(), memory_budget=_NO_LIMIT)
    plan = plan_and_keep(gm, mesh, pins=cp_pins(gm, mesh), options=opts)[0]
    return list(plan.units), plan


@dataclass(frozen=True)
class Candidate:
    """One configuration and its predicted step (seconds) and peak memory (bytes per device,
    the fullest pipeline rank). ``starts``: the unit index each chunk starts at;
    ``simulated``: ``step`` is the simulator's (else the closed-form estimate)."""

    pp: int
    dp: int
    tp: int
    microbatch: int
    microbatches: int
    schedule: str
    chunks: int
    recompute: bool
    s_g: int
    s_os: int
    step: float
    memory: float
    pipeline: float
    dp_comm: float
    starts: tuple[int, ...] = ()
    simulated: bool = False
    #: parameters sharded over ``s_p`` of the ``dp`` replicas (ZeRO-3 when ``s_p = dp``)
    s_p: int = 1
    #: with ``recompute``, the units recomputed (indices into the unit table); empty: all
    recomputed: tuple[int, ...] = ()
    #: context-parallel devices per replica: the sequence split over ``cp`` (between ``dp``
    #: and ``tp``; parameters replicated over it, gradients reduced over ``dp·cp``)
    cp: int = 1
    #: with ``recompute``: ``"full"`` or ``"selective"`` (:data:`fxpar.cost.memory.GRANULARITIES`)
    granularity: str = "full"

    @property
    def key(self) -> tuple[int, int]:
        """``(tp, cp)``: which cost table (:attr:`SearchResult.tables`) prices this."""
        return (self.tp, self.cp)

    @property
    def spmd_axes(self) -> dict[str, int]:
        """The mesh of one SPMD step: ``{"dp": d, "tp": t}``; with parameters sharded over
        ``1 < s_p < d`` consecutive replicas (HSDP / MiCS: sharded inside each group of
        ``s_p``, replicated across groups), the replicas split ``{"dp": d/s_p, "dp_shard":
        s_p, "tp": t}`` (devices ordered ``tp`` innermost, so a group lies inside a node
        when ``s_p·t`` fits one).

        >>> c = Candidate(1, 8, 2, 1, 1, "1f1b", 1, False, 4, 8, 0.0, 0.0, 0.0, 0.0, s_p=4)
        >>> c.spmd_axes
        {'dp': 2, 'dp_shard': 4, 'tp': 2}
        """
        if 1 < self.s_p < self.dp:
            return {"dp": self.dp // self.s_p, "dp_shard": self.s_p, "tp": self.tp}
        if self.cp > 1:
            return {"dp": self.dp, "cp": self.cp, "tp": self.tp}
        return {"dp": self.dp, "tp": self.tp}

    def config(self, layers=()) -> ParallelConfig:
        """This configuration as a :class:`~fxpar.config.ParallelConfig`; ``layers``: the
        names of the layers it recomputes (the unit table knows them:
        :meth:`SearchResult.config`)."""
        return ParallelConfig(pp=self.pp, dp=self.dp, tp=self.tp, microbatch=self.microbatch,
                              microbatches=self.microbatches, schedule=self.schedule,
                              chunks=self.chunks, recompute=frozenset(layers), s_p=self.s_p,
                              s_g=self.s_g, s_os=self.s_os,
                              extra=(("cp", self.cp),) if self.cp > 1 else (),
                              recompute_granularity=self.granularity)

    @property
    def name(self) -> str:
        g = "selective" if self.granularity == "selective" else ""
        r = ((f" recompute({g + ', ' if g else ''}{len(self.recomputed)} units)" if self.recomputed
              else f" recompute({g})" if g else " recompute") if self.recompute else "")
        v = f" v={self.chunks}" if self.chunks > 1 else ""
        cp = f" cp={self.cp}" if self.cp > 1 else ""
        return (f"pp={self.pp} dp={self.dp} tp={self.tp}{cp} b={self.microbatch} m={self.microbatches} "
                f"{self.schedule}{v}{r} zero({'p=%d,' % self.s_p if self.s_p > 1 else ''}"
                f"g={self.s_g},os={self.s_os})")


@dataclass(frozen=True)
class SearchResult:
    """``ranked``: the simulated candidates, best first; ``best`` = ``ranked[0]``;
    ``tried``/``over_memory``: configurations evaluated / rejected for memory;
    ``smallest``: the smallest peak memory seen (what the error names when nothing fits)."""

    ranked: tuple[Candidate, ...]
    tried: int
    over_memory: int
    smallest: Candidate | None
    budget: float
    stats: Mapping = field(default_factory=dict, compare=False)
    #: the cost table's plan per ``(tp, cp)`` (the layouts the search priced)
    layouts: Mapping = field(default_factory=dict, compare=False, repr=False)
    #: the unit table per ``(tp, cp)``
    tables: Mapping = field(default_factory=dict, compare=False, repr=False)
    #: why the winner has its context-parallel degree (:func:`_cp_reason`; what explain says)
    cp: str = field(default="", compare=False)

    @property
    def best(self) -> Candidate:
        return self.ranked[0]

    def config(self, c: Candidate) -> ParallelConfig:
        """``c`` as a :class:`~fxpar.config.ParallelConfig`, its recomputed layers named."""
        us = self.tables[c.key]
        idx = c.recomputed if c.recomputed else (range(len(us)) if c.recompute else ())
        return c.config(us[i].layer for i in idx)

    def summary(self, top: int = 6) -> dict:
        """JSON-able: what ``explain()`` prints (the ``top`` ranked, the runner-up's gap)."""
        return {"tried": self.tried, "over_memory": self.over_memory, "budget": self.budget,
                "smallest": self.smallest.name if self.smallest else "",
                "smallest_memory": self.smallest.memory if self.smallest else 0.0,
                "cp": self.cp,
                "ranked": [{"name": c.name, "step": c.step, "memory": c.memory,
                            "pipeline": c.pipeline, "dp_comm": c.dp_comm}
                           for c in self.ranked[:top]]}

    def pins(self, c: Candidate, probe: fx.GraphModule, gm: fx.GraphModule | None = None
             ) -> dict[str, str]:
        """Pins on a ``(dp, tp)`` (sub)mesh that make the planner take the layouts this search
        priced for ``c``: every parameter as in the ``tp`` plan and, over ``dp``, replicated
        (``s_p = 1``), sharded (``s_p = dp``, :func:`_zero3_dp`) or, on the mesh of
        :attr:`Candidate.spmd_axes`, replicated over ``dp`` and sharded over ``dp_shard``
        (``1 < s_p < dp``), the batch split over every replica axis; with ``gm`` (the graph
        captured at the configuration's microbatch), also every value that carries the batch
        (dim 0 is one sample in ``probe``, ``dp·b`` rows in ``gm``, or that batch flattened with
        the dims after it, ``(b·s, h)``): ``S(0)`` on the replica
        axes and its ``tp`` layout, so no replica computes another's rows (data parallelism
        is the search's choice, not one the intra-op planner may undo to save a gradient
        reduction)."""
        plan = self.layouts[c.key]
        by_name = {n.name: n for n in plan.nodes}  # (plan.node scans: one lookup per node)

        def tp(name: str) -> str:
            """The layout on the table's own axes (``tp``, or ``cp`` and ``tp``)."""
            return "R" if c.key == (1, 1) else by_name[name].outputs[0]

        hsdp = "dp_shard" in c.spmd_axes
        batch_s = "S(0)S(0)" if hsdp else "S(0)"   # the batch over every replica axis
        first = next((i.name for i in ir.user_inputs(probe) if i.is_tensor), None)
        out = {"input": batch_s + (tp(first) if first else "R")}
        if c.cp > 1:   # the sequence inputs split over cp, the others as the planner likes
            from fxpar.planner.baselines import sequence_inputs

            out = {name: batch_s + "S(1)R" for name in sequence_inputs(probe)}
        for n in probe.graph.nodes:
            if n.op == "placeholder" and ir.is_trainable_param(n):
                t_s = tp(n.name)
                if c.cp > 1:   # replicated over the sequence shards (PARAM_REPLICA_AXES)
                    t_s = "R" + str(Spec.parse(t_s).placements[1])
                shape = tuple(n.meta[ir.VAL].shape)
                if hsdp:  # replicated across the groups, sharded inside each
                    dp_s = "R" + _zero3_dp(shape, t_s, c.s_p, c.tp)
                else:
                    dp_s = _zero3_dp(shape, t_s, c.dp, c.tp) if c.s_p > 1 else "R"
                out[n.name] = dp_s + t_s
        rows = c.dp * c.microbatch
        if gm is None or rows == 1:
            return out
        small = {n.name: n.meta.get(ir.VAL) for n in probe.graph.nodes if n.op == "call_function"}
        batch = {i.name for i in ir.user_inputs(gm) if i.is_tensor}  # values derived from the batch
        for n in gm.graph.nodes:
            v, w = n.meta.get(ir.VAL), small.get(n.name)
            if not any(a.name in batch for a in n.all_input_nodes):
                continue
            if (isinstance(v, torch.Tensor) and isinstance(w, torch.Tensor) and v.ndim and w.ndim
                    and int(v.shape[0]) == rows * int(w.shape[0])
                    and tuple(v.shape[1:]) == tuple(w.shape[1:])):
                # dim 0 is the batch, or the batch flattened with what follows it (b·s, ...)
                batch.add(n.name)
                if c.cp > 1 and str(Spec.parse(tp(n.name)).placements[0]) == "S(0)":
                    continue   # (b·s, ...) split over cp: b sequences' shards, not one's
                out[n.name] = batch_s + tp(n.name)
            elif isinstance(v, (tuple, list)):  # a split's pieces: its getitems carry the batch
                batch.add(n.name)
        return out


def _zero3_dp(shape: tuple[int, ...], tp: str, d: int, t: int) -> str:
    """The ``dp`` placement of a ZeRO-3 parameter whose ``tp`` placement is ``tp``: ``S(k)``
    for the first dim ``k`` that ``tp`` leaves whole and that splits over ``d`` with no empty
    shard (then the dim ``tp`` splits, over ``d`` then ``t``: the gather back to the ``tp``
    layout is then more than an all-gather), else ``R`` (kept whole, as ``zero3`` does).

    >>> _zero3_dp((8, 8), "S(0)", 2, 2), _zero3_dp((1, 8), "S(1)", 2, 2), _zero3_dp((1,), "R", 2, 1)
    ('S(1)', 'S(1)', 'R')
    """
    from fxpar.strategies.base import no_empty_shard

    dims = sorted(range(len(shape)), key=lambda k: tp == f"S({k})")  # stable: tp's dim last
    for k in dims:
        if no_empty_shard(int(shape[k]), (d, t) if tp == f"S({k})" else (d,)):
            return f"S({k})"
    return "R"


def unit_start_names(gm: fx.GraphModule, starts: Sequence[int]) -> list[str]:
    """The first node of each chunk's first unit (what :func:`fxpar.split.split_stages`
    takes as ``start_nodes``; node names are the same at every captured batch size)."""
    us = units(gm)
    return [us[i][1][0].name for i in starts]


@functools.lru_cache(maxsize=65536)
def partition(times: tuple[float, ...], n: int) -> tuple[int, ...]:
    """Start index of each of ``n`` contiguous, non-empty runs of ``times`` minimizing the
    largest run's sum: bisection on the cap with a greedy packing check (exact to a relative
    ``1e-12``; ``O(u·log)`` where the DP of :mod:`fxpar.split` is ``O(n·u²)``).

    >>> partition((1.0, 1.0, 1.0, 3.0), 2), partition((1.0,) * 5, 5)
    ((0, 3), (0, 1, 2, 3, 4))
    """
    u = len(times)
    if not 1 <= n <= u:
        raise PlanError(f"{n} stage chunks for {u} units")

    def pack(cap: float) -> list[int]:
        starts, s = [0], times[0]
        for i in range(1, u):
            left = n - len(starts)
            if left and (s + times[i] > cap or u - i == left):
                starts.append(i)
                s = times[i]
            else:
                s += times[i]
        return starts

    def fits(cap: float) -> bool:
        k, s = 1, 0.0
        for t in times:
            if s + t > cap:
                k, s = k + 1, t
            else:
                s += t
        return k <= n

    lo, hi = max(times), sum(times)
    for _ in range(200):
        if hi - lo <= 1e-12 * hi:
            break
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    return tuple(pack(hi))


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


#: the user-tuple keys that fix the model-state factors
_STATE_KEYS = ("s_p", "s_g", "s_os")


def _zero_options(d: int, only: Mapping, spmd: bool, d0: int = 1,
                  split_backward: bool = False) -> list[tuple[int, int, int]]:
    """``(s_p, s_g, s_os)``: DDP, ZeRO-1, ZeRO-2, AMSP's partial sharding of gradients and
    optimizer states over the ``d0`` replicas of a node (``(1, 1, d0)``, ``(1, d0, d0)``, when
    ``1 < d0 < d``: the runner's state groups are runs of consecutive replicas, a node's),
    and sharded parameters:

    * one SPMD step (``spmd``: no pipeline or microbatches): every ``s_p | s_g | s_os``
      (AMSP eq. 3) with ``s_p > 1``, each factor a divisor or a multiple of ``d0`` (groups
      that tile the nodes: inside one, or of whole ones): ZeRO-3 ``(d, d, d)``, MiCS/HSDP
      ``(d0, d0, d0)`` (planned on :attr:`Candidate.spmd_axes`), AMSP's LLaMA-13B
      ``(4, 4, 8)`` and LLaMA-30B ``(8, 8, 32)``;
    * a pipeline or microbatches: ZeRO-3 ``(d, d, d)`` over a stage's replicas, whose
      parameters the runtime gathers again for every microbatch (AMSP's ``M·T_p``), except
      under a split backward (``split_backward``, :data:`SPLIT_BACKWARD`: the weight pass
      re-reads what its input pass already released).

    The user's factors when they fit these rules.

    >>> _zero_options(16, {}, False, 8)
    [(1, 1, 1), (1, 1, 16), (1, 16, 16), (1, 1, 8), (1, 8, 8), (16, 16, 16)]
    >>> [o for o in _zero_options(8, {}, True, 4) if o[0] > 1]
    [(2, 2, 2), (2, 2, 4), (2, 2, 8), (2, 4, 4), (2, 4, 8), (2, 8, 8), (4, 4, 4), (4, 4, 8), (4, 8, 8), (8, 8, 8)]
    """
    # groups that tile the nodes: inside one (dividing d0) or of whole nodes (multiples)
    fs = [f for f in _divisors(d) if d0 % f == 0 or f % d0 == 0]
    if spmd:
        sharded = [(p, g, o) for p in fs[1:] for g in fs for o in fs if g % p == 0 and o % g == 0]
    else:
        sharded = [(d, d, d)] if d > 1 and not split_backward else []
    if any(k in only for k in _STATE_KEYS):
        f = tuple(only.get(k, 1) for k in _STATE_KEYS)
        ok = not (any(d % x for x in f) or f[1] % f[0] or f[2] % f[1])
        return [f] if ok and (f[0] == 1 or f in sharded) else []
    if d == 1:
        return [(1, 1, 1)]
    partial = [(1, 1, d0), (1, d0, d0)] if 1 < d0 < d else []
    return [(1, 1, 1), (1, 1, d), (1, d, d)] + partial + sharded


def search(gm: fx.GraphModule, cluster, *, batch: int, probe_batch: int = 1,
           options: PlannerOptions | None = None, schedules: Sequence[str] = SCHEDULES,
           pps: Sequence[int] | None = None, tps: Sequence[int] | None = None,
           microbatches: Sequence[int] | None = None,
           recompute: Sequence[bool | str] = (False, True, "selective"),
           only: Mapping | None = None, keep: int = 8, devices: int | None = None,
           cps: Sequence[int] | None = None) -> SearchResult:
    """Search the configurations of the module docstring for ``gm`` captured with
    ``probe_batch`` samples per replica, a global batch of ``batch``, on ``cluster``
    (``devices``: how many of its devices, default all). ``pps``/``tps``/``cps``/``microbatches``
    restrict the degrees tried (``microbatches``: per-replica microbatch sizes ``b``; ``cps``:
    context-parallel degrees, by default :func:`cp_degrees`); ``recompute``: the
    recomputation tried (``False``; ``True``, every layer in full; ``"selective"``, every layer
    at that granularity, priced where the same configuration is over the budget without
    recomputation and within it with full recomputation: elsewhere it only adds work, or
    cannot fit either);
    ``only``: a user tuple (``{"tp": 8, "pp": 16, "dp": 8, "microbatch": 1, "schedule":
    "interleaved", "chunks": 2, "recompute": True, "s_g": 1, "s_os": 8}``; missing keys are
    searched). Every configuration is enumerated (:func:`_configurations`) and priced by the
    estimate (:func:`_price`); those within the budget are ranked (:func:`_rank_key`), the
    ``keep`` best and each schedule's :data:`PER_SCHEDULE` best simulated and ranked again.
    Raises :class:`PlanError` naming the budget and the smallest footprint when nothing fits,
    or the rule that leaves no configuration at all."""
    t0 = time.perf_counter()
    opts = options or PlannerOptions()
    budget = opts.memory_budget if opts.memory_budget is not None else cluster.device_memory
    space = _space(gm, cluster, batch=batch, probe_batch=probe_batch, devices=devices,
                   only=only, tps=tps, pps=pps, schedules=schedules, recompute=recompute,
                   microbatches=microbatches, cps=cps)
    table, layouts, plan_s = _cost_tables(gm, cluster, space.keys, opts)
    pricing = _Pricing(table, state_bytes(opts), budget, cluster,
                       "recompute" not in space.only and True in space.recompute, opts.precision,
                       opts.zero_style, reduce_scale(opts.precision, opts.reduce_dtype))
    cands, tried, over, smallest = _price_all(_configurations(space, table, cluster), pricing)
    _raise_if_nothing(space, cands, tried, smallest[None], budget)
    t2 = time.perf_counter()
    ranked = sorted((_simulate(c, table[c.key], c.microbatch / probe_batch, cluster, opts)
                     for c in _finalists(cands, keep)), key=_rank_key)
    return SearchResult(tuple(ranked), tried, over, smallest[None], float(budget),
                        stats={"table_s": plan_s, "sim_s": time.perf_counter() - t2,
                               "search_s": time.perf_counter() - t0},
                        layouts=layouts, tables=table,
                        cp=_cp_reason(ranked, space, smallest, float(budget)))


# --- the space -------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Space:
    """What :func:`search` enumerates: ``n_dev`` devices (``per_node`` a node), a global
    ``batch``, the probe's ``probe_batch`` samples, the model's ``n_units``, the user tuple
    ``only`` and the degrees, schedules, recomputation and microbatch sizes left to try
    (``microbatches``: ``None`` for every divisor up to :data:`MAX_MICROBATCH`)."""

    n_dev: int
    per_node: int
    batch: int
    probe_batch: int
    n_units: int
    only: Mapping
    tps: list[int]
    pps: list[int]
    schedules: list[str]
    recompute: list[bool | str]
    microbatches: Sequence[int] | None
    #: context-parallel degrees tried (1 always unless the user fixed one) and why not more
    cps: list[int] = field(default_factory=lambda: [1])
    cp_why: str = ""

    @property
    def keys(self) -> list[tuple[int, int]]:
        """The ``(tp, cp)`` cost tables needed: ``tp·cp`` dividing the devices."""
        return [(t, c) for t in self.tps for c in self.cps if self.n_dev % (t * c) == 0]


#: the shortest sequence context parallelism is tried at by default (Megatron-LM's guidance:
#: below ~8k tokens the K/V gathers cost more than the activation memory they save)
CP_MIN_SEQ = 8192
#: the context-parallel degrees tried by default (those dividing the sequence)
CP_DEGREES = (2, 4, 8, 16, 32)


def cp_degrees(gm: fx.GraphModule, n_dev: int, min_seq: int = CP_MIN_SEQ
               ) -> tuple[list[int], str]:
    """The context-parallel degrees the search tries by default and why no others: ``1``,
    and with a sequence input of at least ``min_seq`` tokens (a 2-d token input, dim 1:
    :func:`fxpar.planner.baselines.cp_pins`) each of :data:`CP_DEGREES` that divides it and
    the devices.

    >>> import torch, fxpar
    >>> from examples.models import GPT
    >>> gm = fxpar.capture(GPT(vocab=16, d_model=8, n_heads=2, n_layers=1, seq_len=16),
    ...                    (torch.zeros(1, 16, dtype=torch.long),))
    >>> cp_degrees(gm, 8)
    ([1], 'cp not tried: a sequence of 16 tokens, below 8192 (plan=dict(cp=...) forces it)')
    >>> cp_degrees(gm, 8, min_seq=16)
    ([1, 2, 4, 8], '')
    """
    seq = _sequence_length(gm)
    if seq is None:
        return [1], "cp not tried: no 2-d (batch, sequence) input to split along the sequence"
    if seq < min_seq:
        return [1], (f"cp not tried: a sequence of {seq} tokens, below {min_seq} "
                     "(plan=dict(cp=...) forces it)")
    return [1] + [c for c in CP_DEGREES if seq % c == 0 and n_dev % c == 0], ""


def _sequence_length(gm: fx.GraphModule) -> int | None:
    """Tokens per sequence of the model's sequence inputs (``None`` without one)."""
    from fxpar.planner.baselines import sequence_inputs

    seqs = sequence_inputs(gm)
    return next(iter(seqs.values()))[1] if seqs else None


def _check_cp(gm: fx.GraphModule, only: Mapping, n_dev: int) -> int:
    """A user's ``cp`` when the model has a sequence to split that it and the devices divide
    (parameters stay replicated over it: ``s_p = 1``); else :class:`PlanError` naming the rule
    and the degrees that would work."""
    c, seq = only["cp"], _sequence_length(gm)
    if seq is None:
        raise PlanError(f"plan={dict(only)}: cp={c} splits the sequence of a 2-d (batch, "
                        "sequence) input, and the model has none")
    ok = [k for k in range(1, n_dev + 1) if n_dev % k == 0 and seq % k == 0]
    if n_dev % c or seq % c:
        raise PlanError(f"plan={dict(only)}: cp={c} must divide the {n_dev} devices and the "
                        f"sequence of {seq} tokens; e.g. cp ∈ {ok}")
    if c > 1 and only.get("s_p", 1) > 1:
        raise PlanError(f"plan={dict(only)}: s_p={only['s_p']} with cp={c}: parameters are "
                        "replicated over the context-parallel devices (s_p = 1); shard gradients "
                        "and optimizer states with s_g, s_os (over dp·cp) instead")
    return c


def _space(gm: fx.GraphModule, cluster, *, batch, probe_batch, devices, only, tps, pps,
           schedules, recompute, microbatches, cps=None) -> _Space:
    """:func:`search`'s arguments as a :class:`_Space`: a user tuple's degrees, schedule and
    recomputation replace the lists; ``tp`` divides the devices, ``pp`` is at most the
    model's units; ``cp`` (:func:`cp_degrees`) divides the devices."""
    n_dev = devices or cluster.num_devices
    only = dict(only or {})
    R = cluster.devices_per_node
    tps = [t for t in (tps or [t for t in (1, 2, 4, 8, 16) if t <= R]) if n_dev % t == 0]
    if "tp" in only:
        tps = [only["tp"]]
    n_units = len(units(gm))
    pps = [p for p in (pps or _divisors(n_dev)) if p <= n_units]
    if "pp" in only:
        pps = [only["pp"]]
    scheds = [only["schedule"]] if "schedule" in only else list(schedules)
    if any(str(x) in PLACEMENT_OF for x in scheds) and only.get("chunks", 2) != 2:
        raise PlanError(f"plan={only}: {only.get('schedule')} places two chunks per pipeline "
                        f"rank in a V, not {only['chunks']}")
    recs = [only["recompute"]] if "recompute" in only else list(recompute)
    why = ""
    if "cp" in only:
        cps = [_check_cp(gm, only, n_dev)]
    elif cps is None:
        cps, why = cp_degrees(gm, n_dev)
    else:
        cps = [c for c in cps if n_dev % c == 0]
    return _Space(n_dev, R, batch, probe_batch, n_units, only, tps, pps, scheds, recs,
                  microbatches, list(cps), why)


def _cost_tables(gm: fx.GraphModule, cluster, keys: Sequence[tuple[int, int]],
                 opts: PlannerOptions) -> tuple[dict, dict, float]:
    """Per ``(tp, cp)`` the unit table and its plan (:func:`unit_costs` on a ``tp=t`` mesh,
    ``{"cp": c, "tp": t}`` with context parallelism), and the seconds the planning took."""
    table, layouts, plan_s = {}, {}, 0.0
    for t, c in keys:
        t1 = time.perf_counter()
        mesh = (Mesh(cluster, {"cp": c, "tp": t}) if c > 1 else
                Mesh(cluster, tp=t) if t > 1 else Mesh(cluster, dp=1))
        table[t, c], layouts[t, c] = unit_costs(gm, mesh, opts)
        plan_s += time.perf_counter() - t1
    return table, layouts, plan_s


@dataclass(frozen=True)
class _Shape:
    """One ``(t, c, p, b, schedule, v)`` of the space and the choices taken on it: ``p·d·c·t``
    devices (``d0`` of a parameter's ``d·c`` replicas inside a node), ``m`` microbatches of ``b`` samples
    per replica (``scale = b / probe_batch``), ``schedule`` with ``v`` chunks per rank, chunk
    ``k`` starting at unit ``starts[k]``; ``sync``: seconds of an all-reduce over the replicas
    (:func:`fxpar.planner.price.replica_allreduce`); each of ``recompute`` × ``states``
    (``(s_p, s_g, s_os)``, :func:`_zero_options`) is one configuration."""

    t: int
    c: int
    p: int
    d: int
    d0: int
    b: int
    m: int
    schedule: str
    v: int
    starts: tuple[int, ...]
    scale: float
    sync: Callable[[float], float] | None
    recompute: tuple[bool | str, ...]
    states: tuple[tuple[int, int, int], ...]

    @property
    def key(self) -> tuple[int, int]:
        return (self.t, self.c)

    @property
    def replicas(self) -> int:
        """A parameter's replicas (its gradient's reduction group): ``d·c``."""
        return self.d * self.c


def _configurations(space: _Space, table: Mapping[int, Sequence[UnitCost]], cluster
                    ) -> Iterator[_Shape]:
    """Every ``(t, c, p, b, schedule, v)`` of ``space`` that can run, in the order the search
    prices them (the order breaks ranking ties): ``p·c·t`` dividing the devices, the replicas
    ``d`` the batch (and equal to a user's ``dp``); then :func:`_shapes_at`."""
    R, only = space.per_node, space.only
    for t, c in space.keys:
        for p in space.pps:
            if space.n_dev % (p * t * c):
                continue
            d = space.n_dev // (p * t * c)
            if "dp" in only and only["dp"] != d or space.batch % d:
                continue
            # a parameter's d·c replicas inside a node (a divisor of d·c and of the node's R/t
            # tp groups: cp lies between dp and tp), then across
            n = d * c
            d0 = math.gcd(n, R // t) if p * n * t >= R else n
            # activation gradients summed over the batch, all-reduced over the replicas
            sync = replica_allreduce(ParallelConfig(pp=p, dp=d, tp=t,
                                                    extra=(("cp", c),) if c > 1 else ()), cluster)
            yield from _shapes_at(space, table[t, c], t, c, p, d, d0, sync)


def _shapes_at(space: _Space, us: Sequence[UnitCost], t: int, c: int, p: int, d: int, d0: int,
               sync) -> Iterator[_Shape]:
    """:func:`_configurations` at one ``(t, p)``: each microbatch size ``b`` dividing a
    replica's share (at most :data:`MAX_MICROBATCH`, or the user's), each schedule (one
    without a pipeline: they are all the same there), each chunk count (2 or 4, or the
    user's, for ``interleaved`` and ``interleaved-zb``, which need ``p | m``:
    :func:`_chunk_counts`; two in a V for zbv and dualpipev, the latter with ``m ≥ 2p``), at
    most one
    chunk per unit; stage
    cuts by :func:`partition` on the units' time at ``b``."""
    only, share = space.only, space.batch // d
    bs = [b for b in _divisors(share) if b <= MAX_MICROBATCH]
    if "microbatch" in only:  # when it divides a replica's share of the batch
        bs = [only["microbatch"]] if share % only["microbatch"] == 0 else []
    elif space.microbatches is not None:
        bs = [b for b in bs if b in space.microbatches]
    for b in bs:
        m = space.batch // (d * b)
        scale = b / space.probe_batch
        times = tuple((u.fwd + u.bwd) * scale + u.fwd_fixed for u in us)
        for sname in (space.schedules if p > 1 else space.schedules[:1]):
            interleaved = sname in MULTI_CHUNK
            vs = ([1] if not interleaved else [2] if sname in PLACEMENT_OF
                  else [only["chunks"]] if "chunks" in only else _chunk_counts(len(us), p))
            for v in vs:
                if (p * v > len(us) or (interleaved and p == 1) or (sname in DIVIDES_M and m % p)
                        or (sname == "dualpipev" and m < 2 * p)):
                    continue
                states = _zero_options(d * c, only, p == 1 and m == 1, d0, sname in SPLIT_BACKWARD)
                if c > 1:   # parameters replicated over the sequence shards
                    states = [f for f in states if f[0] == 1]
                yield _Shape(t, c, p, d, d0, b, m, sname, v, partition(times, p * v), scale,
                             sync, tuple(space.recompute), tuple(states))


def _chunk_counts(n_units: int, p: int) -> list[int]:
    """Chunk counts ``v`` tried for the interleaved schedule on ``p`` ranks: 2 and 4, and each
    ``v ≤ 8`` that splits a rank's ``⌊n_units / p⌋`` units evenly (Megatron-LM runs 105
    layers on 35 stages as 3 chunks of one layer: with only 2 or 4, every other chunk holds
    two layers and sets the pace).

    >>> _chunk_counts(107, 35), _chunk_counts(34, 4)
    ([2, 3, 4], [2, 4, 8])
    """
    per = n_units // p
    return sorted({2, 4} | {v for v in range(3, 9) if per >= v and per % v == 0})


# --- pricing ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Pricing:
    """What pricing needs besides a :class:`_Shape`: the unit table per ``tp`` degree, the
    bytes per parameter of each model state ``(k_p, k_g, k_os)``, the ``budget`` (bytes per
    device), the cluster, whether over-budget configurations try recomputing some units
    (``partial``: recomputation is searched, not fixed by the user), the training
    ``precision`` (the bytes a value moves, the optimizer's flat step), how the runtime
    issues ZeRO-3's collectives (``zero_style``, :data:`fxpar.cost.step.ZERO_STYLES`) and the
    bytes its gradients are reduced in over a value's (``reduce_scale``,
    :func:`fxpar.cost.memory.reduce_scale`)."""

    table: Mapping[int, Sequence[UnitCost]]
    state_bytes: tuple[float, float, float]
    budget: float
    cluster: object
    partial: bool
    precision: str = "mixed"
    zero_style: str = "flat"
    reduce_scale: float = 1.0

    @functools.cached_property
    def recomputable(self) -> dict[tuple[int, int], frozenset[int]]:
        """Per cost table the units full recomputation rebuilds (those of named layers)."""
        return {t: frozenset(i for i, u in enumerate(us) if is_layer(u.layer))
                for t, us in self.table.items()}


def _price_all(shapes: Iterable[_Shape], pricing: _Pricing
               ) -> tuple[list[Candidate], int, int, dict]:
    """Price every configuration of ``shapes`` (:func:`_price`): the candidates within the
    budget in enumeration order, each over-budget one's partial recomputation after it; how
    many were tried (those included), how many were over the budget, and the configuration
    of smallest peak memory seen (of a whole configuration, partial recomputations aside),
    overall (key ``None``) and per context-parallel degree."""
    cands: list[Candidate] = []
    tried = over = 0
    smallest: dict = {None: None}
    for s in shapes:
        for c, some in _price(s, pricing):
            tried += 1
            for k in (None, c.cp):
                if smallest.get(k) is None or c.memory < smallest[k].memory:
                    smallest[k] = c
            if c.memory <= pricing.budget:
                cands.append(c)
                continue
            over += 1
            if some is not None:
                tried += 1
                cands.append(some)
    return cands, tried, over, smallest


def _price(s: _Shape, pricing: _Pricing) -> Iterator[tuple[Candidate, Candidate | None]]:
    """Each configuration of ``s`` (recomputation × state factors, in that order) priced as
    the module docstring says: the :class:`Candidate` (estimated step, the fullest rank's
    memory by :func:`fxpar.cost.step.rank_memory`) and, when it is over the budget without
    recomputation and ``pricing.partial``, the same recomputing just enough units
    (:func:`_recompute_some`, ``None`` if none fits), else ``None``. The chunk costs,
    transfers and in-flight counts are computed once for ``s``, the per-rank sums once per
    recomputation choice."""
    us, p, n = pricing.table[s.key], s.p, s.p * s.v
    ranks = tuple(chunk_rank(k, p, PLACEMENT_OF.get(s.schedule, "loop")) for k in range(n))
    mine = rank_chunks(range(n), p, ranks)
    tmp = 2 * BUCKET + max(u.act for u in us) * s.scale  # buckets, one unit's backward
    # the one memory function's chunks, without and with recomputation (at each granularity)
    ccs = {rc: chunk_costs(us, s.starts, s.scale, pricing.recomputable[s.key] if rc else (), s.sync,
                           microbatch_overhead(pricing.cluster),
                           "selective" if rc == "selective" else "full")
           for rc in {False, *s.recompute}}
    xfer = 2 * sum(_xfer(ccs[False][k].out, k, p, s.replicas, s.t, pricing.cluster)
                   for k in range(n - 1) if ranks[k] != ranks[k + 1])   # a V turns in place
    fl = [in_flight(s.schedule, r, p, s.m, s.v) for r in range(p)]
    layers_by = {}   # AMSP's L per s_p: the gather groups (a norm rides with the next unit)
    part = None  # partial recomputation tables, built when first needed
    # per (recomputation, state factors): whether it fits; selective keeps more than full and
    # less than none, so it is priced only where none is over the budget and full is not
    fits: dict[tuple, bool] = {}
    for rc in sorted(s.recompute, key=lambda r: (r != False, str(r))):  # noqa: E712 (False first)
        ch = ccs[rc]
        phi = [sum(ch[k].params for k in mine[r]) for r in range(p)]
        red = [sum(ch[k].reduce for k in mine[r]) for r in range(p)]
        for s_p, s_g, s_os in s.states:
            if rc == "selective" and (fits.get((False, s_p, s_g, s_os))
                                      or fits.get((True, s_p, s_g, s_os)) is False):
                continue
            if s_p not in layers_by:
                layers_by[s_p] = zero_units(ccs[False], p, pricing.zero_style,
                                            tiny_params(s_p, pricing.precision), ranks)
            layers = layers_by[s_p]
            mems = rank_memory(ch, p, fl, pricing.state_bytes, (s_p, s_g, s_os), tmp, ranks)
            dpr = [dp_terms(round(phi[r]), layers[r], s.m, s.d0, s.replicas // s.d0, s_p, s_g, s_os,
                            pricing.cluster, pricing.precision, pricing.zero_style,
                            pricing.reduce_scale) for r in range(p)]
            dpt = max(red[r] + dpr[r].total for r in range(p))
            # the estimate overlaps as the step model does (cost.step.overlapped_chunks): the
            # gathers per pass and microbatch, what the reductions leave exposed once
            F, B, R = overlapped_chunks(ch, p, s.m, dpr, pricing.cluster.comm_interference,
                                        ranks=ranks)
            Wo = [sum(F[k] + B[k] for k in mine[r]) for r in range(p)]
            est_o = s.m * max(Wo) + (sum(Wo) - max(Wo)) / s.v + xfer
            opt = optimizer_seconds(ch, p, (s_p, s_g, s_os), pricing.cluster, pricing.precision,
                                    pricing.state_bytes, ranks)
            tail = (max(sum(R[k] for k in mine[r]) for r in range(p)) + max(opt)
                    + max(d.t_os1 for d in dpr))
            c = Candidate(p, s.d, s.t, s.b, s.m, s.schedule, s.v, bool(rc), s_g, s_os, est_o + tail,
                          max(mems), est_o, dpt, s.starts, s_p=s_p, cp=s.c,
                          granularity="selective" if rc == "selective" else "full")
            fits[rc, s_p, s_g, s_os] = c.memory <= pricing.budget
            some = None
            if pricing.partial and not rc and not c.memory <= pricing.budget:
                part = part or _partial_tables(us, s.starts, p, s.scale, fl, ranks)
                some = _recompute_some(c, part, mems, pricing.budget, Wo, s.v, xfer)
            yield c, some


# --- ranking ---------------------------------------------------------------------------------


def _raise_if_nothing(space: _Space, cands: Sequence[Candidate], tried: int,
                    smallest: Candidate | None, budget: float) -> None:
    """Raise :class:`PlanError` when nothing is left to rank: no configuration takes the
    user's state factors, none exists at all (:func:`_empty_space`), or none fits the
    budget (naming the smallest footprint)."""
    only = space.only
    if not tried and any(k in only for k in _STATE_KEYS):
        raise PlanError(f"plan={only}: no configuration takes these state factors: s_p | s_g | "
                        "s_os, each dividing dp (AMSP eq. 3) and dividing or a multiple of a "
                        "node's replicas; with a pipeline or microbatches "
                        "s_p is 1 or dp = s_g = s_os (ZeRO-3 over a stage's replicas; parameters "
                        "sharded inside groups of replicas need pp=1 and one microbatch), and "
                        f"not under a split backward ({', '.join(sorted(SPLIT_BACKWARD))})")
    if not tried:
        raise PlanError(_empty_space(only, space.n_dev, space.batch, space.tps, space.pps,
                                     space.n_units))
    if not cands:
        detail = f"; the smallest found: {smallest.name} at {smallest.memory / 2**30:.1f} GiB" if smallest else ""
        raise PlanError(f"joint search: no configuration of {tried} tried fits the memory budget "
                        f"of {budget / 2**30:.1f} GiB per device{detail}")


def _finalists(cands: Sequence[Candidate], keep: int) -> list[Candidate]:
    """The candidates to simulate: the ``keep`` best by estimate (:func:`_rank_key`), each
    schedule's :data:`PER_SCHEDULE` best and each context-parallel degree's best (what
    ``explain()`` compares the winner with). The estimate is 1F1B's bubble; other schedules'
    (zb-h1's, eager's) differ, so each schedule's best estimates are simulated too."""
    ordered = sorted(cands, key=_rank_key)  # stable: ties keep the enumeration order
    chosen = ordered[:keep]
    per = Counter(c.schedule for c in chosen)
    cps = {c.cp for c in chosen}
    for c in ordered[keep:]:   # in rank order: a schedule's first are its best estimates
        if per[c.schedule] < PER_SCHEDULE or c.cp not in cps:
            per[c.schedule] += 1
            cps.add(c.cp)
            chosen.append(c)
    return chosen


def _cp_reason(ranked: Sequence[Candidate], space: _Space, smallest: Mapping,
               budget: float) -> str:
    """Why the winner has its context-parallel degree: the best simulated configuration of
    each other degree tried and how much slower it is, or the smallest footprint of a degree
    none of whose configurations fits ``budget``; or why no degree beyond 1 was tried."""
    if space.cps == [1]:
        return space.cp_why
    best = ranked[0]
    if len(space.cps) == 1:
        return f"context parallelism: cp={best.cp}, as the user tuple says"
    per: dict[int, Candidate] = {}
    for c in ranked:
        per.setdefault(c.cp, c)
    out = []
    for k in space.cps:
        if k == best.cp:
            continue
        if k in per:
            out.append(f"cp={k}: {per[k].name} {per[k].step / best.step - 1:+.1%}")
        elif smallest.get(k) is not None:
            out.append(f"cp={k}: nothing fits (smallest {smallest[k].memory / 2**30:.1f} GiB > "
                       f"{budget / 2**30:.1f} GiB: {smallest[k].name})")
    return (f"context parallelism: cp={best.cp} chosen; the best of each other degree: "
            + "; ".join(out))


def _empty_space(only: Mapping, n_dev: int, batch: int, tps, pps, n_units: int) -> str:
    """Why no configuration exists at all (not a memory problem): which rule empties it."""
    head = f"joint search: no configuration exists for {n_dev} devices and a batch of {batch}"
    if only:
        head += f" with plan={dict(only)}"
    if batch < n_dev // max(max(tps), 1) // max(max(pps), 1):
        return (f"{head}: every device must hold at least one sample of a replica "
                f"(pp·tp ≤ {max(pps)}·{max(tps)} leaves ≥ {n_dev // (max(tps) * max(pps))} replicas "
                f"for {batch} samples); use a batch of at least "
                f"{n_dev // (max(tps) * max(pps))}, or fewer devices: at most "
                f"{max(pps) * max(tps) * batch} (plan=dict(pp={max(pps)}, tp={max(tps)}, dp={batch}))")
    return (f"{head}: pp ∈ {list(pps)} (at most the model's {n_units} units), tp ∈ {list(tps)}; "
            "the replicas dp = devices/(pp·tp) must divide the batch and the microbatch a "
            f"replica's share{_nearest(only, n_dev, batch, tps, pps)}")


def _nearest(only: Mapping, n_dev: int, batch: int, tps, pps) -> str:
    """The configurations nearest to the asked one that do exist (``dp`` dividing the batch),
    and the smallest batch the asked ``dp`` would take; ``""`` when there is nothing to say."""
    want = only.get("dp")
    shapes = [(pp, tp, n_dev // (pp * tp)) for pp in pps for tp in tps
              if n_dev % (pp * tp) == 0 and batch % (n_dev // (pp * tp)) == 0]
    if not shapes:
        return ""
    key = (lambda c: (abs(c[2] - want), c[0] * c[1])) if want else (lambda c: (c[0] * c[1], c[0]))
    near = ", ".join(f"plan=dict(pp={pp}, tp={tp}, dp={dp})" for pp, tp, dp in sorted(shapes, key=key)[:3])
    more = f"; or a batch that dp={want} divides (e.g. {-(-batch // want) * want})" if want else ""
    return f". Nearest that exist: {near}{more}"


def _rank_key(c: Candidate) -> tuple:
    """Faster first; on a tie (to the nanosecond) fewer microbatches, chunks and
    recomputation (less runtime overhead than the model sees), then less memory."""
    return (round(c.step, 9), c.microbatches, c.chunks, c.recompute, c.memory)


@functools.lru_cache(maxsize=65536)
def _xfer(nbytes: float, k: int, p: int, d: int, t: int, cluster) -> float:
    """Seconds of one boundary transfer from chunk ``k``'s rank to the next one's (``d·t``
    devices a stage, ``d`` counting ``cp``): every
    device of the stage sends its shard to the same position of the next stage, all at once
    (:func:`fxpar.cost.comm.pairs_time`, as a planned boundary is priced)."""
    from fxpar.cost.comm import pairs_time

    g = d * t
    src, dst = k % p, (k + 1) % p
    return pairs_time(nbytes, [(src * g + i, dst * g + i) for i in range(g)], cluster)


#: the most unit-count combinations a rank's partial recomputation enumerates exactly
PARTIAL_COMBOS = 4096


@dataclass(frozen=True)
class _Partial:
    """One pipeline rank's partial recomputation as a lookup: for a memory need, the first
    ``k`` with ``gain[k] ≥ need`` gives the cheapest choice freeing at least that much:
    ``cost[k]`` seconds of extra forward per microbatch, ``freed[k]`` bytes freed, ``units[k]``
    the units recomputed."""

    gain: tuple[float, ...]
    cost: tuple[float, ...]
    freed: tuple[float, ...]
    units: tuple[tuple[int, ...], ...]


def _partial_tables(us: Sequence[UnitCost], starts, p: int, scale: float,
                    in_flight: Sequence[int], ranks: Sequence[int] | None = None) -> list[_Partial]:
    """Per rank, its :class:`_Partial`. Recomputing a set ``S`` of the rank's units frees
    ``f·Σ_S (A_u − I_u) − max_S A_u`` bytes (``f`` microbatches in flight: each keeps only the
    unit's input ``I_u``, the previous unit's output, instead of its saved ``A_u``; one unit
    is rebuilt at a time) for ``Σ_S F_u`` seconds per microbatch (:func:`_chunk_costs`'
    terms). Units with equal ``(A_u, I_u, F_u)`` (repeated layers) are interchangeable, so
    the choices are counts per class, enumerated exactly when there are at most
    :data:`PARTIAL_COMBOS` of them (else prefixes of the units by bytes freed per second, a
    heuristic); a unit outside any named layer (``(top)``) is not one the runtime can
    recompute."""
    import itertools

    bounds = list(starts) + [len(us)]
    out = []
    for r, ks in enumerate(rank_chunks(range(len(starts)), p, ranks)):
        mine = [u for k in ks for u in range(bounds[k], bounds[k + 1])]
        key = {u: (us[u].act * scale, us[u - 1].out * scale if u else 0.0,
                   us[u].forward(scale)) for u in mine}
        classes: dict[tuple, list[int]] = {}
        for u in mine:
            a, i_, _ = key[u]
            if a > i_ and not us[u].layer.startswith("("):
                classes.setdefault(key[u], []).append(u)
        cls = list(classes.items())
        if math.prod(len(v) + 1 for _, v in cls) <= PARTIAL_COMBOS:
            picks = [tuple(u for (_, v), k in zip(cls, ks) for u in v[:k])
                     for ks in itertools.product(*(range(len(v) + 1) for _, v in cls))]
        else:
            order = sorted((u for _, v in cls for u in v),
                           key=lambda u: (-(key[u][0] - key[u][1]) / max(key[u][2], 1e-30), u))
            picks = [tuple(order[:j]) for j in range(len(order) + 1)]
        rows = []
        for pick in picks:
            freed = in_flight[r] * sum(key[u][0] - key[u][1] for u in pick) \
                - max((key[u][0] for u in pick), default=0.0)
            rows.append((freed, sum(key[u][2] for u in pick), tuple(sorted(pick))))
        rows.sort()
        # from the end: the cheapest choice freeing at least rows[k]'s bytes
        best, table = None, []
        for row in reversed(rows):
            if best is None or row[1] < best[1]:
                best = row
            table.append((row[0], best[1], best[0], best[2]))  # gain, cost, freed, units
        table.reverse()
        out.append(_Partial(*(tuple(x) for x in zip(*table))))
    return out


def _recompute_some(c: Candidate, part: Sequence[_Partial], mems: Sequence[float], budget: float,
                    W: Sequence[float], v: int, xfer: float) -> Candidate | None:
    """``c`` (no recomputation, over ``budget``) with each rank recomputing the cheapest set
    of its units that brings it under the budget (:class:`_Partial`); ``None`` if none does.
    Per rank ``r``: memory ``mems[r]`` less the bytes freed, work ``W[r]`` plus the extra
    forwards per microbatch; the step estimate as the search's."""
    import bisect

    got = []
    for r, t in enumerate(part):
        need = mems[r] - budget
        k = bisect.bisect_left(t.gain, need) if need > 0 else None
        if k is not None and k >= len(t.gain):
            return None
        got.append((0.0, 0.0, ()) if k is None else (t.cost[k], t.freed[k], t.units[k]))
    w = [W[r] + g[0] for r, g in enumerate(got)]
    est = c.microbatches * max(w) + (sum(w) - max(w)) / v + xfer
    units = tuple(sorted(u for g in got for u in g[2]))
    mem = max(mems[r] - g[1] for r, g in enumerate(got))
    return dataclasses.replace(c, recompute=True, recomputed=units, step=est + c.step - c.pipeline,
                               memory=mem, pipeline=est)


def _simulate(c: Candidate, us: list[UnitCost], scale: float, cluster, opts) -> Candidate:
    """``c`` priced by the one step model (:func:`fxpar.planner.price.price_config`): its
    schedule simulated, memory by the one memory function."""
    n = c.pp * c.chunks
    rec = (frozenset(c.recomputed) if c.recomputed else
           frozenset(i for i, u in enumerate(us) if is_layer(u.layer)) if c.recompute else frozenset())
    ch = chunk_costs(us, c.starts, scale)
    xs = [_xfer(ch[k].out, k, c.pp, c.dp * c.cp, c.tp, cluster) for k in range(n - 1)]
    st, mem = price_config(c.config(), us, c.starts, cluster, opts, scale=scale, recomputed=rec,
                           xfer=lambda k: (xs[k], xs[k]))
    return dataclasses.replace(c, step=st.step, pipeline=st.pipeline, dp_comm=st.dp_comm,
                               memory=max(mem), simulated=True)
