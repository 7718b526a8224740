"""Plan: every decision of the intra-op planner and its cost breakdown; explain(); JSON; hash.

A :class:`Plan` is frozen, plain data (strings and numbers) so it round-trips through JSON
exactly and hashes stably (``Plan.hash`` = sha256 of the canonical JSON of everything but
``stats``, which holds wall-clock timings):

- ``mesh``: axis names, shape, device ids and the cluster (``Cluster.to_dict()``);
- ``nodes``: per graph node (graph order) a :class:`NodePlan`: the chosen strategy printed
  with its specs (``"col: R, S(0), S(0) -> S(2)"``), its layer, forward/backward compute
  seconds (roofline on local shapes) and memory bytes per device;
- ``edges``: per (producer, consumer, direction) the resharding steps (kind, mesh axis,
  bytes, seconds) actually paid under the chosen strategies (``direction`` is ``fwd`` for
  the value, ``bwd`` for its gradient; ``consumer == "output"`` is the finalisation of a
  graph output);
- ``time``: the predicted step of :mod:`fxpar.cost.step` (the one step model the joint search
  ranks by: pipeline schedule, gradient reductions on the communication lane, AMSP's
  data-parallel terms for ``config``'s state factors); ``summed_time``: Σ compute + Σ
  communication with no overlap, for display;
- ``memory``: bytes per device at the one liveness point (model states + saved
  activations), and the budget it was planned under.

Cost breakdowns are derived properties: :meth:`Plan.comm_by` (seconds by collective kind and
mesh axis), :meth:`Plan.layers` (per-layer compute, comm by axis, memory, main ops).

Example (what :meth:`Plan.explain` prints for a 2-layer MLP on 4 devices, tight memory)::

    plan auto on Mesh(tp=4) [dgx-a100 x1]: step 1.23 ms (compute 1.1 ms, comm 0.13 ms),
    memory 1.5 GiB / 2 GiB per device, solver OPTIMAL
      layer  main ops                     compute ms  comm ms (by axis)  memory
      fc1    linear=col                   0.55        -                  0.75 GiB
      fc2    linear=row                   0.55        tp 0.13            0.75 GiB
      total                               1.1         tp 0.13            1.5 GiB
    communication: all_reduce tp 0.13 ms (1x)
    unsharded ops (replicate-only fallback): none
"""

from __future__ import annotations

import hashlib
import json
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field

from fxpar.config import ParallelConfig
from fxpar.cost.reshard import COLLECTIVE_KINDS
from fxpar.cost.step import UnitCost
from fxpar.defaults import BUCKET_BYTES, FIRST_BUCKET_BYTES
from fxpar.errors import PlanError
from fxpar.units import fmt_bytes

__all__ = ["Plan", "StagePlan", "NodePlan", "EdgePlan", "StepCost", "BASELINES", "SEARCHED",
           "PLAN_KINDS"]

#: Baseline plans priced by the same cost model (see :func:`fxpar.planner.baseline_pins`).
BASELINES = ("dp", "zero3", "megatron", "axonn")
#: Baselines that are programs of the joint search, not pins: ``amsp`` (AMSP §IV: TP = PP = 1
#: over every device; its state sharding, microbatches and recomputation searched); ``alpa``
#: (stages, submeshes and intra-op layouts searched with placement-agnostic communication
#: costs, :meth:`fxpar.Cluster.placement_agnostic`, and replicated model states; the winner
#: is then priced on the real cluster).
SEARCHED = {"amsp": {"tp": 1, "pp": 1}, "alpa": {"s_p": 1, "s_g": 1, "s_os": 1}}
PLAN_KINDS = ("auto",) + BASELINES + tuple(SEARCHED)


@dataclass(frozen=True)
class StepCost:
    """One resharding collective: ``kind`` (``all_reduce``, ``all_gather``...) on mesh axis
    ``axis`` moving ``nbytes`` per device in ``time`` seconds."""

    kind: str
    axis: str
    nbytes: int
    time: float


@dataclass(frozen=True)
class EdgePlan:
    """Resharding paid on one graph edge in one direction: ``src_spec -> dst_spec``."""

    producer: str
    consumer: str
    direction: str  # "fwd" | "bwd"
    src_spec: str
    dst_spec: str
    steps: tuple[StepCost, ...]
    layer: str

    @property
    def time(self) -> float:
        return float(sum(s.time for s in self.steps))


@dataclass(frozen=True)
class NodePlan:
    """The decision for one node: chosen strategy (index ``index`` of ``num_strategies``)."""

    name: str
    op: str
    layer: str
    strategy: str
    strategy_name: str
    inputs: tuple[str | None, ...]
    outputs: tuple[str, ...]
    unsharded: bool
    index: int
    num_strategies: int
    fwd_time: float
    bwd_time: float
    memory: int
    #: a trainable parameter (its memory is its model states)
    param: bool = False
    #: the layout its consumers' gradients are summed in (``Strategy.grad_acc``), or ``None``
    grad_acc: str | None = None
    #: the layout its output is resharded to once for all its consumers (``Strategy.shared``)
    shared: str | None = None

    def to_strategy(self):
        """The chosen :class:`fxpar.strategies.base.Strategy` rebuilt from its specs."""
        from fxpar.strategies.base import Strategy

        return Strategy(self.inputs, self.outputs, self.strategy_name, self.unsharded, self.grad_acc,
                        self.shared)


def _search_lines(search: Mapping | None) -> list[str]:
    """The joint search's ranked configurations (:mod:`fxpar.planner.joint`) as a table."""
    if not search:
        return []
    out = [f"joint search: {search['tried']} configurations priced, {search['over_memory']} over "
           f"the {fmt_bytes(search['budget'])} budget; simulated best:"]
    best = search["ranked"][0]["step"] if search["ranked"] else 0.0
    for i, r in enumerate(search["ranked"]):
        out.append(f"  {i + 1}. {r['name']}: step {_fmt_ms(r['step'])} ms "
                   f"(x{r['step'] / best:.3f}), pipeline {_fmt_ms(r['pipeline'])} ms + dp "
                   f"{_fmt_ms(r['dp_comm'])} ms, {fmt_bytes(r['memory'])}")
    if search.get("cp"):
        out.append("  " + search["cp"])
    return out


def _fmt_ms(t: float) -> str:
    return "-" if t == 0 else f"{t * 1e3:.4g}"


@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage chunk: ``index`` (0..p·v−1), the pipeline rank ``rank`` it runs on
    (``index % p``, or the schedule's V), the ``layers`` it runs, the boundary values it
    receives (``inputs``) and sends (``outputs``) by node name, and its intra-op ``plan`` on
    the stage's submesh."""

    index: int
    rank: int
    layers: tuple[str, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    plan: Plan
    #: bytes each device sends to the next chunk per microbatch (its outputs' local shards,
    #: ``1/t`` of one under scatter/gather)
    send_bytes: int = 0
    #: per output: the submesh axis it crosses by scatter/gather (Megatron §4.1: each of the
    #: ``t`` ranks of that axis sends ``1/t``, the receivers all-gather), ``""``: whole shards
    scatter: tuple[str, ...] = ()
    #: seconds of one boundary transfer to the next chunk, and of its gradient back
    send_time: float = 0.0
    back_time: float = 0.0
    #: the layouts its boundary inputs arrive in and its outputs leave in (printed specs);
    #: where an output's differs from the next chunk's input, a cross-mesh reshard moves it
    in_specs: tuple[str, ...] = ()
    out_specs: tuple[str, ...] = ()
    #: the graph node its first layer starts at (what re-splitting a re-captured model needs)
    start: str = ""

    @property
    def submesh(self) -> Mapping:
        """The stage's submesh (axis names, shape, global device ids)."""
        return self.plan.mesh

    @classmethod
    def from_dict(cls, d: Mapping) -> StagePlan:
        return cls(d["index"], d["rank"], tuple(d["layers"]), tuple(d["inputs"]),
                   tuple(d["outputs"]), Plan.from_dict(d["plan"]), int(d.get("send_bytes", 0)),
                   tuple(d.get("scatter", ())), float(d.get("send_time", 0.0)),
                   float(d.get("back_time", 0.0)), tuple(d.get("in_specs", ())),
                   tuple(d.get("out_specs", ())), d.get("start", ""))


@dataclass(frozen=True)
class Plan:
    """A complete intra-op plan (see the module docstring). Build with :func:`fxpar.plan` or
    :func:`fxpar.planner.plan_graph`; compare, hash, ``to_json``/``from_json``."""

    kind: str
    mesh: Mapping
    nodes: tuple[NodePlan, ...]
    edges: tuple[EdgePlan, ...]
    time: float
    compute_fwd: float
    compute_bwd: float
    comm: float
    memory: int
    budget: int | None
    status: str
    options: Mapping = field(default_factory=dict)
    stats: Mapping = field(default_factory=dict, compare=False)
    #: what a named baseline could not do as its recipe says (e.g. a parameter zero3 keeps whole)
    notes: tuple[str, ...] = ()
    #: pipeline plans: one :class:`StagePlan` per stage chunk (empty for one SPMD step)
    stages: tuple[StagePlan, ...] = ()
    #: pipeline plans: ``{"name", "microbatches", "chunks", "csv", "bubble"}``; a joint
    #: search's winner also ``"search"`` (its ranked configurations)
    schedule: Mapping = field(default_factory=dict)
    #: the :class:`fxpar.ParallelConfig` the plan realizes (degrees, microbatching, schedule,
    #: recomputed layers, state factors): what ``time`` and ``memory`` price and the runners run
    config: ParallelConfig | None = None
    #: its costs per unit of its graph (:func:`fxpar.planner.price.unit_table`), what ``time``
    #: is priced from (a pipeline plan: its stages' plans hold theirs)
    units: tuple[UnitCost, ...] = ()

    # -- lookups -----------------------------------------------------------------------
    def node(self, name: str) -> NodePlan:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(f"plan has no node {name!r}")

    def __getitem__(self, name: str) -> str:
        """The chosen strategy (printed) of node ``name``."""
        return self.node(name).strategy

    @property
    def mesh_str(self) -> str:
        axes = ", ".join(f"{a}={s}" for a, s in zip(self.mesh["axis_names"], self.mesh["shape"]))
        c = self.mesh.get("cluster", {})
        return f"Mesh({axes}) [{c.get('name', '?')} x{c.get('nodes', '?')}]"

    @property
    def compute(self) -> float:
        return self.compute_fwd + self.compute_bwd

    @property
    def summed_time(self) -> float:
        """Every compute and communication second added, nothing overlapped (a pipeline's:
        its busiest rank's chunks times the microbatches; no bubble)."""
        return self.compute + self.comm

    def steps(self, kind: str | None = None, axis: str | None = None, direction: str | None = None):
        """Every paid resharding step ``(edge, step)``, filtered by kind/axis/direction."""
        return [(e, s) for e in self.edges for s in e.steps
                if (kind is None or s.kind == kind) and (axis is None or s.axis == axis)
                and (direction is None or e.direction == direction)]

    def comm_by(self) -> dict[tuple[str, str], float]:
        """Seconds of communication by ``(collective kind, mesh axis)``, sorted."""
        acc: dict[tuple[str, str], float] = defaultdict(float)
        for _, s in self.steps():
            acc[s.kind, s.axis] += s.time
        return dict(sorted(acc.items()))

    def layers(self) -> list[dict]:
        """Per-layer rows in first-appearance order: ``layer``, ``ops`` (main op=strategy
        names), ``fwd``/``bwd`` compute s, ``comm`` {axis: s}, ``memory`` bytes."""
        rows: dict[str, dict] = {}
        for n in self.nodes:
            r = rows.setdefault(n.layer, dict(layer=n.layer, ops=[], fwd=0.0, bwd=0.0,
                                              comm=defaultdict(float), memory=0))
            r["fwd"] += n.fwd_time
            r["bwd"] += n.bwd_time
            r["memory"] += n.memory
            if n.fwd_time + n.bwd_time > 0 and n.op not in ("placeholder", "getitem"):
                r["ops"].append((n.op, n.strategy_name or ("R" if n.unsharded else "?"),
                                 n.fwd_time + n.bwd_time))
        for e in self.edges:
            r = rows.setdefault(e.layer, dict(layer=e.layer, ops=[], fwd=0.0, bwd=0.0,
                                              comm=defaultdict(float), memory=0))
            for s in e.steps:
                r["comm"][s.axis] += s.time
        for r in rows.values():
            r["comm"] = dict(sorted(r["comm"].items()))
        return list(rows.values())

    @property
    def unsharded(self) -> list[str]:
        """Nodes that only had the replicate-only fallback (op without a sharding rule)."""
        return [f"{n.name} ({n.op})" for n in self.nodes if n.unsharded]

    # -- overlap -----------------------------------------------------------------------
    def overlap(self, prefetch: int = 1, bucket_bytes: int = BUCKET_BYTES,
                first_bucket_bytes: int = FIRST_BUCKET_BYTES):
        """The step replayed node by node as the runtime orders it: which of :attr:`comm` is
        exposed and which hidden behind compute (:func:`fxpar.cost.overlap.plan_overlap`)."""
        from fxpar.cost.overlap import plan_overlap

        return plan_overlap(self, prefetch, bucket_bytes, first_bucket_bytes)

    # -- explain -----------------------------------------------------------------------
    def explain(self, max_ops: int = 4) -> str:
        """A readable per-layer table, then totals, communication and the unsharded ops (a
        pipeline plan: the schedule and a per-stage table, then each stage's own plan)."""
        if self.stages:
            return self._explain_pipeline(max_ops)
        head = (f"plan {self.kind} on {self.mesh_str}: step {_fmt_ms(self.time)} ms (summed "
                f"{_fmt_ms(self.summed_time)} ms: compute {_fmt_ms(self.compute)} ms = fwd "
                f"{_fmt_ms(self.compute_fwd)} + bwd {_fmt_ms(self.compute_bwd)}, comm "
                f"{_fmt_ms(self.comm)} ms), memory "
                f"{fmt_bytes(self.memory)}"
                + (f" / {fmt_bytes(self.budget)}" if self.budget is not None else "")
                + f" per device, solver {self.status}")
        table = [("layer", "main ops", "compute ms", "comm ms (by axis)", "memory")]
        for r in self.layers():
            ops = sorted(r["ops"], key=lambda o: -o[2])[:max_ops]
            main = ", ".join(f"{o}={s}" for o, s, _ in ops) or "-"
            comm = " ".join(f"{a} {_fmt_ms(t)}" for a, t in r["comm"].items() if t > 0) or "-"
            table.append((r["layer"], main, _fmt_ms(r["fwd"] + r["bwd"]), comm,
                          fmt_bytes(r["memory"])))
        axes: dict[str, float] = defaultdict(float)
        for (k, a), t in self.comm_by().items():
            axes[a] += t
        table.append(("total", "", _fmt_ms(self.compute),
                      " ".join(f"{a} {_fmt_ms(t)}" for a, t in sorted(axes.items()) if t > 0) or "-",
                      fmt_bytes(self.memory)))
        widths = [max(len(row[c]) for row in table) for c in range(5)]
        lines = [head] + ["  " + "  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip()
                          for row in table]
        counts: dict[tuple[str, str], int] = defaultdict(int)
        for _, s in self.steps():
            counts[s.kind, s.axis] += 1
        comm = ", ".join(f"{k} {a} {_fmt_ms(t)} ms ({counts[k, a]}x)"
                         for (k, a), t in self.comm_by().items() if t > 0)
        lines.append(f"communication: {comm or 'none'}")
        if self.comm > 0:
            ov = self.overlap()
            lines.append(f"overlap as the runtime orders it (prefetch 1): step {_fmt_ms(ov.step)} ms, "
                         f"communication exposed {_fmt_ms(ov.exposed)} ms, hidden {_fmt_ms(ov.hidden)} ms")
        lines += self._megatron_lines()
        lines += self._cp_lines()
        lines += self._config_lines()
        if self.config is not None and self.config.dp_shard > 1 and "dp_shard" in self.mesh["axis_names"]:
            lines.append(f"  (s_p: parameters sharded inside groups of dp_shard="
                         f"{self.mesh['shape'][self.mesh['axis_names'].index('dp_shard')]} "
                         "replicas, replicated across the groups on dp: HSDP / MiCS)")
        lines += _search_lines(self.schedule.get("search"))  # a joint search's winner, SPMD
        lines += [f"note: {n}" for n in self.notes]
        un = self.unsharded
        lines.append(f"unsharded ops (replicate-only fallback): {', '.join(un) if un else 'none'}")
        return "\n".join(lines)

    def _cp_lines(self) -> list[str]:
        """On a mesh with a ``cp`` axis: how each attention uses it (the sequence split with
        K/V gathered, or another split the solver priced cheaper on this cluster)."""
        from fxpar.spec import Spec, placement_kind

        names = list(self.mesh["axis_names"])
        if "cp" not in names or self.mesh["shape"][names.index("cp")] == 1:
            return []
        a = names.index("cp")
        head = f"context parallelism (cp={self.mesh['shape'][a]}): "
        att = [n for n in self.nodes if "attention" in n.op and n.inputs and n.inputs[0]]
        if not att:
            return [head + "no attention in the graph"]
        ways: dict[str, int] = defaultdict(int)
        for n in att:
            q = Spec.parse(n.inputs[0]).placements[a]
            split = q.dim if placement_kind(q) == "S" else None
            k = Spec.parse(n.inputs[1]).placements[a] if len(n.inputs) > 1 and n.inputs[1] else None
            if split == 2 and k is not None and placement_kind(k) == "S" and k.dim == 2:
                ways["ring attention (K/V blocks passed round cp, overlapped with compute)"] += 1
                continue
            ways["the sequence split, K/V gathered over cp" if split == 2 else
                 "the heads split over cp (DeepSpeed-Ulysses: all-to-all from the sequence "
                 "split and back, priced cheaper than gathering K/V)" if split == 1 else
                 f"{n.strategy_name or 'R'} instead (priced cheaper than gathering K/V)"] += 1
        return [head + "; ".join(f"{k}: {v} of {len(att)} attentions" for k, v in ways.items())]

    def _megatron_lines(self) -> list[str]:
        """Each transformer layer's tensor-parallel communication (collectives on ``tp``)
        beside Megatron-LM's two all-reduces of ``b·s·h`` forward and two backward
        (``stats["megatron_tp"]``, :func:`fxpar.planner.explain.megatron_reference`); bytes
        are message sizes, as an all-reduce's ``b·s·h`` in the formula."""
        ref = self.stats.get("megatron_tp")
        if not ref:
            return []
        mine: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
        for e, st in self.steps(axis="tp"):
            if st.kind not in COLLECTIVE_KINDS:
                continue   # local steps move nothing
            mine[e.layer][0] += st.nbytes
            mine[e.layer][1] += st.time
        rows = [("layer", "fxpar bytes", "Megatron bytes", "fxpar ms", "Megatron ms")]
        for lay, r in ref.items():
            rows.append((lay, fmt_bytes(int(mine[lay][0])), fmt_bytes(int(r["bytes"])),
                         _fmt_ms(mine[lay][1]) if mine[lay][1] else "0", _fmt_ms(r["time"])))
        widths = [max(len(r[c]) for r in rows) for c in range(5)]
        return ["tensor-parallel communication per layer on tp, beside Megatron-LM's 2 + 2 "
                "all-reduces of b·s·h:"] + ["  " + "  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip()
                                            for r in rows]

    def _config_lines(self) -> list[str]:
        c = self.config
        # what the plan priced that the runtime must do alike (its runners' default)
        out = [f"gradients reduced in {self.options['reduce_dtype']} (PlannerOptions.reduce_dtype)"
               ] if self.options.get("reduce_dtype") else []
        if self.options.get("zero_style", "flat") != "flat":
            out.append(f"ZeRO collectives priced as {self.options['zero_style']!r} issues them "
                       "(PlannerOptions.zero_style)")
        if c is None:
            return out
        out.append(f"configuration: {c.name}")
        if c.recompute:
            out.append(f"recomputation: {len(c.recompute)} layers re-run their forward in backward")
        if c.dp > 1:
            out.append(f"model states over dp: s_p={c.s_p}, s_g={c.s_g}, s_os={c.s_os}")
        return out

    def _explain_pipeline(self, max_ops: int) -> str:
        sc = self.schedule
        lines = [f"plan {self.kind} on {self.mesh_str}: pipeline of {len(self.stages)} stage "
                 f"chunks, schedule {sc.get('name')} (chunks {sc.get('chunks', 1)}), "
                 f"{sc.get('microbatches')} microbatches; predicted step {_fmt_ms(self.time)} ms, "
                 f"bubble {100 * sc.get('bubble', 0.0):.1f}%, memory {fmt_bytes(self.memory)} "
                 "per device (the busiest rank's chunks, one microbatch live in each)"]
        table = [("stage", "rank", "layers", "fwd ms", "bwd ms", "comm ms", "receives", "sends")]
        for st in self.stages:
            p = st.plan
            lay = st.layers if len(st.layers) <= 4 else (*st.layers[:2], "...", st.layers[-1])
            table.append((str(st.index), str(st.rank), " ".join(lay), _fmt_ms(p.compute_fwd),
                          _fmt_ms(p.compute_bwd), _fmt_ms(p.comm), ", ".join(st.inputs) or "-",
                          ", ".join(st.outputs) or "-"))
        widths = [max(len(row[c]) for row in table) for c in range(len(table[0]))]
        lines += ["  " + "  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip()
                  for row in table]
        lines += _search_lines(sc.get("search"))
        lines += self._config_lines()
        for st in self.stages:
            lines.append(f"-- stage {st.index} (pipeline rank {st.rank}) --")
            # a chunk's own configuration (one stage, one microbatch) would contradict the
            # pipeline's above, which holds its dp and tp
            lines += [x for x in st.plan.explain(max_ops).splitlines()
                      if not x.startswith("configuration: ")]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def __str__(self) -> str:
        nodes = sum(len(s.plan.nodes) for s in self.stages) if self.stages else len(self.nodes)
        what = (f"{len(self.stages)} stage chunks, " if self.stages else "") + f"{nodes} nodes"
        return (f"Plan({self.kind} on {self.mesh_str}: {self.time * 1e3:.4g} ms, "
                f"{fmt_bytes(self.memory)}/device, {what})")

    # -- serialisation -----------------------------------------------------------------
    def to_dict(self, with_stats: bool = True) -> dict:
        d = asdict(self)
        d["mesh"] = dict(self.mesh)
        d["config"] = self.config.to_dict() if self.config is not None else None
        d["stages"] = [dict(asdict(st), plan=st.plan.to_dict(with_stats)) for st in self.stages]
        if not with_stats:
            d.pop("stats")
        return d

    def to_json(self, indent: int | None = None) -> str:
        """JSON text; ``Plan.from_json(p.to_json()) == p``."""
        return json.dumps(self.to_dict(), sort_keys=True, indent=indent)

    @classmethod
    def from_dict(cls, d: Mapping) -> Plan:
        try:
            nodes = tuple(NodePlan(**{**n, "inputs": tuple(n["inputs"]), "outputs": tuple(n["outputs"])})
                          for n in d["nodes"])
            edges = tuple(EdgePlan(**{**e, "steps": tuple(StepCost(**s) for s in e["steps"])})
                          for e in d["edges"])
            mesh = dict(d["mesh"])
            mesh["axis_names"] = tuple(mesh["axis_names"])
            mesh["shape"] = tuple(mesh["shape"])
            mesh["devices"] = tuple(mesh["devices"])
            rest = {k: v for k, v in d.items() if k not in ("nodes", "edges", "mesh")}
            rest["notes"] = tuple(rest.get("notes", ()))
            rest["stages"] = tuple(StagePlan.from_dict(x) for x in rest.get("stages", ()))
            rest["units"] = tuple(UnitCost(**u) for u in rest.get("units", ()))
            if rest.get("config") is not None:
                rest["config"] = ParallelConfig.from_dict(rest["config"])
            return cls(nodes=nodes, edges=edges, mesh=mesh, **rest)
        except (KeyError, TypeError) as e:
            raise PlanError(f"not a valid fxpar plan: {e}") from e

    @classmethod
    def from_json(cls, text: str) -> Plan:
        return cls.from_dict(json.loads(text))

    @property
    def hash(self) -> str:
        """sha256 of the canonical JSON (sorted keys, no wall-clock stats): stable across runs."""
        text = json.dumps(self.to_dict(with_stats=False), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()

    def cluster(self):
        """The :class:`fxpar.Cluster` the plan was made for."""
        from fxpar.cluster import Cluster

        return Cluster.from_dict(dict(self.mesh["cluster"]))
