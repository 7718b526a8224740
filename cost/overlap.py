r"""Overlap of asynchronous communication with compute: how much of a step's communication is
exposed (the compute stream waits for it) and how much is hidden behind compute.

The model is the runtime's (DESIGN §7; AxoNN §IV-C, AMSP §V-C): one compute stream runs the
ops in order; one communication channel runs the collectives one at a time, in the order they
are issued. A collective is *issued* when the compute stream reaches op ``issue`` (before that
op starts) and must have *finished* before op ``need`` starts (``need = len(ops)``: by the end
of the step, e.g. a gradient reduction waited before the optimizer). With ``s_j`` the start of
op ``j`` and ``c_j`` its seconds::

    s_0 = 0,  s_j = max(s_{j-1} + c_{j-1}, max{f_k : need_k = j})
    b_k = max(s_{issue_k}, f_{k-1}),  f_k = b_k + t_k      (channel in issue order)
    step = max(s_n, max_k f_k),  exposed = step - Σ_j c_j,  hidden = Σ_k t_k - exposed

A collective issued and needed at the same op (``issue == need``) is synchronous and fully
exposed unless the channel was already busy: it then waits for that, too.

>>> r = overlap([1.0, 1.0], [Comm(0.5, issue=0, need=1)])   # gathered while op 0 runs
>>> r.step, r.exposed, r.hidden
(2.0, 0.0, 0.5)
>>> overlap([1.0, 1.0], [Comm(0.5, issue=1, need=1)]).exposed  # no window: waited in full
0.5
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from fxpar.cost.reshard import LOCAL_KINDS
from fxpar.cost.step import gather_groups, optimizer_time, step_piece
from fxpar.defaults import BUCKET_BYTES, FIRST_BUCKET_BYTES
from fxpar.errors import PlanError

__all__ = ["Comm", "Overlap", "overlap", "plan_overlap", "coalesced_pricer"]


@dataclass(frozen=True)
class Comm:
    """One collective: ``time`` seconds, issued before op ``issue``, needed before op ``need``."""

    time: float
    issue: int
    need: int


@dataclass(frozen=True)
class Overlap:
    """``step`` seconds; of the communication, ``exposed`` seconds the compute waited for and
    ``hidden`` seconds that ran under compute."""

    step: float
    compute: float
    exposed: float
    hidden: float


def overlap(compute: Sequence[float], comms: Sequence[Comm]) -> Overlap:
    """The step of ``compute`` (seconds per op, in order) with ``comms`` (module docstring)."""
    n = len(compute)
    for c in comms:
        if not 0 <= c.issue <= c.need <= n or c.time < 0:
            raise ValueError(f"collective {c}: needs 0 <= issue <= need <= {n} and time >= 0")
    order = sorted(range(len(comms)), key=lambda k: (comms[k].issue, comms[k].need, k))
    by_issue: dict[int, list[int]] = {}
    for k in order:
        by_issue.setdefault(comms[k].issue, []).append(k)
    finish = [0.0] * len(comms)
    waits: dict[int, float] = {}
    free = t = 0.0  # channel free at, compute clock
    for j in range(n + 1):
        for k in by_issue.get(j, ()):  # issued when op j is reached: after waits issued earlier
            free = max(free, t) + comms[k].time
            finish[k] = free
            waits[comms[k].need] = max(waits.get(comms[k].need, 0.0), free)
        t = max(t, waits.get(j, 0.0))
        if j < n:
            t += compute[j]
    step = max([t] + finish)
    total = float(sum(compute))
    exposed = step - total
    return Overlap(step, total, exposed, float(sum(c.time for c in comms)) - exposed)


def plan_overlap(plan, prefetch: int = 1, bucket_bytes: int = BUCKET_BYTES,
             first_bucket_bytes: int = FIRST_BUCKET_BYTES) -> Overlap:
    """The step as the runtime orders it (:func:`fxpar.cost.overlap.overlap`): which of
    ``plan.comm`` is exposed and which hidden behind compute. The solver minimizes every
    edge's collectives summed; this replays one forward then one backward:

    * an activation's collective starts after its producer, is waited before its consumer;
      a program input's (layer ``(inputs)``) starts at the top;
    * parameter gathers of one layer coalesce into one collective per kind and axis (layers
      grouped until a group moves :data:`~fxpar.defaults.TINY_GATHER_BYTES`:
      :func:`~fxpar.cost.step.gather_groups`), started ``prefetch`` groups ahead of use
      (:mod:`fxpar.passes.prefetch`; 0: right before it, ungrouped);
    * in backward, an activation's gradient reshard is synchronous; a freed parameter's
      re-gather (ZeRO-3; one per group) starts when the layer after it is gathered again
      (backward prefetch; ``prefetch=0``: when needed), but for the last group's, whose
      forward gather is held for the backward (:class:`fxpar.runtime.comm.Regather`);
      parameter gradients are reduced in buckets of ``bucket_bytes`` (the first of each kind
      and axis ``first_bucket_bytes``, as :class:`fxpar.runtime.model_state.ModelStates`
      makes them) in the order they arrive, each launched when its last gradient is in,
      all waited at the end of the step;
    * then the optimizer step, on a cluster whose compute profile prices it
      (:attr:`fxpar.cluster.ComputeProfile.optimizer`): ``per_tensor + per_element·n`` per
      tensor of ``n`` local elements (a parameter's state bytes over the optimizer's
      per-element bytes, divided by ``s_os`` where the plan shards optimizer states); fp32
      parameters with unsharded states are stepped as one flat tensor per bucket, as the
      runtime does for element-wise optimizers.

    Coalesced collectives are priced again as one (``steps·α`` once) on the plan's cluster.
    Returns an :class:`Overlap` (``step``, ``exposed``, ``hidden``)."""
    if plan.stages:
        raise PlanError("overlap() replays one SPMD step: a pipeline plan's step is its "
                        "schedule's (Program.simulate()); call it on a stage's plan "
                        "(plan.stages[k].plan)")
    price = coalesced_pricer(plan)
    ops = [n for n in plan.nodes if n.op != "placeholder"]
    inputs = {n.name for n in plan.nodes if n.op == "placeholder" and n.layer == "(inputs)"}
    held = {n.name for n in plan.nodes if n.op == "placeholder"} - inputs
    F = len(ops)
    fi = {n.name: i for i, n in enumerate(ops)}
    bi = {n.name: 2 * F - 1 - i for i, n in enumerate(ops)}  # backward runs them in reverse
    compute = [n.fwd_time for n in ops] + [n.bwd_time for n in reversed(ops)] \
        + [_optimizer_time(plan, bucket_bytes, first_bucket_bytes)]
    edges = [e for e in plan.edges if e.consumer in fi]
    first: dict[str, int] = {}  # gather unit (consumer's layer) -> its first use
    for e in edges:
        if e.producer in held:
            first[e.layer] = min(first.get(e.layer, F), fi[e.consumer])
    units = sorted(first, key=first.get)
    moved = dict.fromkeys(units, 0)
    for e in edges:
        if e.direction == "fwd" and e.producer in held:
            moved[e.layer] += sum(st.nbytes for st in e.steps if st.kind not in LOCAL_KINDS)
    # one coalesced collective per gather group, needed by the group's first use
    groups = (gather_groups([moved[u] for u in units]) if prefetch > 0
              else [[k] for k in range(len(units))])
    unit_no = {units[i]: k for k, g in enumerate(groups) for i in g}
    need_at = [first[units[g[0]]] for g in groups]
    gathers: dict[tuple, list] = {}  # (issue, need, kind, axis) -> steps, coalesced
    grads: list[tuple] = []  # (ready at, reduction step)
    regathers: dict[tuple, list] = {}  # (layer, axis) -> [needed at, steps] in backward
    comms = []
    for e in edges:
        use, back = fi[e.consumer], bi[e.consumer]
        if e.direction == "fwd" and e.producer in held:
            k = unit_no[e.layer]
            issue = use if prefetch <= 0 else (need_at[k - prefetch] if k >= prefetch else 0)
            for st in e.steps:
                gathers.setdefault((min(issue, need_at[k]), need_at[k], st.kind, st.axis),
                                   []).append(st)
        elif e.direction == "fwd" and e.producer in inputs:   # gathered from the top
            comms.append(Comm(e.time, 0, use))
        elif e.direction == "fwd":
            # a shared reshard (Strategy.shared: its consumer is the producer itself) runs
            # once after the producer, needed by the first consumer, the next op at the latest
            issue = fi.get(e.producer, -1) + 1
            comms.append(Comm(e.time, issue, max(use, issue)))
        elif e.producer in held:
            last = 2 * F - 1 - first[e.layer]  # the layer's first use runs last in backward
            for st in e.steps:
                if st.kind == "all_gather":  # re-gathered with its group when first needed
                    r = regathers.setdefault((unit_no[e.layer], st.axis), [back, []])
                    r[0] = min(r[0], back)
                    r[1].append(st)
                else:
                    grads.append((last, st))
        else:
            comms.append(Comm(e.time, back + 1, back + 1))
    for key, steps in gathers.items():
        comms.append(Comm(price(key[2], key[3], steps), key[0], key[1]))
    # backward prefetch: a layer's re-gather starts when the layer after it is gathered
    order = sorted(regathers, key=lambda k: regathers[k][0])   # backward order
    for j, key in enumerate(order):
        need, steps = regathers[key]
        issue = regathers[order[j - 1]][0] if prefetch > 0 and j > 0 else need
        if key[0] != len(groups) - 1:   # the last group's forward gather is held for backward
            comms.append(Comm(price("all_gather", key[1], steps), issue, need))
    open_: dict[tuple[str, str], list] = {}  # (kind, axis) -> [ready, steps, bytes]
    closed: set[tuple[str, str]] = set()      # (kind, axis) whose first bucket is full
    first_cap = min(first_bucket_bytes, bucket_bytes)
    for ready, st in sorted(grads, key=lambda g: g[0]):
        key = (st.kind, st.axis)
        b = open_.setdefault(key, [0, [], 0])
        b[0], b[2] = max(b[0], ready), b[2] + st.nbytes
        b[1].append(st)
        if b[2] >= (bucket_bytes if key in closed else first_cap):
            comms.append(Comm(price(st.kind, st.axis, b[1]), b[0] + 1, 2 * F))
            del open_[key]
            closed.add(key)
    for (kind, axis), (ready, steps, _) in open_.items():
        comms.append(Comm(price(kind, axis, steps), ready + 1, 2 * F))
    return overlap(compute, comms)


def _optimizer_time(plan, bucket_bytes: int, first_bucket_bytes: int) -> float:
    """Seconds of the optimizer step (:meth:`overlap`) at the cluster's measured price, else
    its physics' (:func:`fxpar.cost.step.cluster_optimizer_price`), else 0."""
    from fxpar.cost.memory import is_fp32, model_state_bytes
    from fxpar.cost.step import cluster_optimizer_price

    precision = plan.options.get("precision", "mixed")
    states = model_state_bytes(1, optimizer=plan.options.get("optimizer", "adam"),
                               precision=precision)
    price = cluster_optimizer_price(plan.mesh.get("cluster") or {},
                                    (states.params, states.grads, states.optimizer),
                                    is_fp32(precision))
    if not price:
        return 0.0
    per_param = states.total
    # a parameter node's memory is already sharded by s_p (its spec); states by s_os/s_p more
    s_os = plan.config.s_os // plan.config.s_p if plan.config is not None else 1
    # a parameter's memory is its model states (fxpar.planner.pricing.node_memory)
    n = [x.memory / per_param / s_os for x in plan.nodes if x.param]
    flat = s_os == 1 and is_fp32(precision)
    return optimizer_time(sum(n), len(n), price, flat,
                          bucket=bucket_bytes, first=first_bucket_bytes,
                          piece=step_piece((plan.mesh.get("cluster") or {}).get("device_type", "")))

def coalesced_pricer(plan):
    """``price(kind, axis, steps)``: seconds of ``steps`` coalesced into one collective on
    the plan's own mesh and cluster (the planner's :func:`fxpar.cost.comm.collective_time`),
    or their sum where the plan does not carry them."""
    from fxpar.cluster import Cluster
    from fxpar.cost.comm import COLLECTIVES, collective_time
    from fxpar.mesh import Mesh

    try:
        cl = Cluster.from_dict(plan.mesh["cluster"])
        mesh = Mesh.from_devices(cl, plan.mesh["axis_names"],
                                 np.asarray(plan.mesh["devices"]).reshape(plan.mesh["shape"]))
    except (KeyError, TypeError, ValueError):
        mesh = None

    def price(kind: str, axis: str, steps) -> float:
        if mesh is None or kind not in COLLECTIVES or len(steps) == 1:
            return float(sum(st.time for st in steps))
        groups = mesh.groups(axis)
        return collective_time(kind, sum(st.nbytes for st in steps), groups[0], cl,
                               concurrent=groups)
    return price
