"""Measured steps of a rank program, beside the plan's prediction (issue #24 item 6).

:meth:`Runner.profile <fxpar.runtime.runner.Runner.profile>` runs a copy of the rank graph in
which every ``call_function`` node is followed by a **stamp**: a node with no users that
records the time its value was ready (forward: ``t_k - t_(k-1)`` is node ``k``'s time, its
collectives included) and hooks the value's autograd node (backward: the time between the
hook before and the hook after that node ran). A node whose backward autograd made of several
autograd nodes gets only its last one's time (the captured graph is core ATen: one op, one
autograd node, as a rule). The measured steps are real training steps (forward, backward,
optimizer) on the given batch; one warm-up step runs first.

:class:`Profile` keeps, per node, the median over the steps of the measured forward and
backward seconds beside the plan's predicted ones (``NodePlan.fwd_time``/``bwd_time``, and
an edge's ``EdgePlan.time`` for the collective node that runs it). From it:

* :meth:`Profile.compare` prints predicted against measured per layer and per collective and
  writes a Chrome trace (``chrome://tracing``, Perfetto) with a measured and a predicted lane;
* :meth:`Profile.scales` gives ``measured / predicted`` of compute and of communication (ratios
  of sums), from pipeline profiles the fixed seconds of an action, and from plans hiding
  different shares of their communication what hidden communication adds to compute, which
  :meth:`fxpar.Cluster.refine` applies to the cluster's rates, its
  ``physics.microbatch_overhead`` and its ``comm_interference``.

>>> from fxpar.runtime.profile import NodeTime, Profile
>>> p = Profile((NodeTime("mm", "fc", "compute", None, 2e-3, 4e-3, 1e-3, 2e-3),
...              NodeTime("ar", "fc", "comm", "mm->add", 3e-3, 0.0, 1e-3, 0.0)), step=0.01, steps=3)
>>> p.scales()
{'compute': 2.0, 'comm': 3.0}
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, replace

import torch
import torch.fx as fx

from fxpar import ir
from fxpar.cost.step import split_backward
from fxpar.layers import layer_of
from fxpar.units import fmt_time

__all__ = ["ActionTime", "NodeTime", "Profile", "profile_runner", "profile_pipeline"]


@dataclass(frozen=True)
class NodeTime:
    """One node of the rank graph: its layer, ``kind`` (``"compute"``, or ``"comm"`` for a
    node that runs a planned edge's collectives, ``edge`` naming it), measured forward and
    backward seconds (medians over the steps) and the plan's predicted ones. ``blocking``
    (communication): no computation the plan prices runs between the edge's launch and its
    wait, so its nodes' times are the collective's duration; an overlapped edge (prefetched,
    or the loss's all-reduce waited after the backward) measures its launch and the wait it
    left exposed."""

    name: str
    layer: str
    kind: str
    edge: str | None
    fwd: float
    bwd: float
    pred_fwd: float
    pred_bwd: float
    blocking: bool = True


@dataclass(frozen=True)
class ActionTime:
    """One action of a pipeline rank's list (``kind`` of chunk ``stage``, a microbatch's median
    over the steps): measured seconds and the chunk plan's prediction for it (at the speed the
    plan's simulation ran it where ranks share a host's cores, else as priced; ``F``: the
    chunk's forward compute and forward collectives; ``B``: backward; ``I``/``W``: half the
    backward compute times ``physics.split_backward`` each, ``I`` with the backward
    collectives (chunk 0: ``I`` the whole backward, ``W`` 0); ``SEND_F``/``SEND_B``: the
    boundary transfer, measured: its launch; a receive is waiting for a peer, predicted 0;
    only ``F``/``B``/``I``/``W`` count in :meth:`Profile.scales`)."""

    kind: str
    stage: int
    microbatch: int
    measured: float
    predicted: float


@dataclass(frozen=True)
class Profile:
    """Measured per-node times of a rank program (module docstring); ``step`` is the median
    wall time of a training step (forward, backward, optimizer), ``optimizer`` of its optimizer
    part, ``predicted_step`` the plan's step (``Plan.time``)."""

    nodes: tuple[NodeTime, ...]
    step: float
    steps: int
    optimizer: float = 0.0
    predicted_step: float = 0.0
    #: a pipeline rank's actions (``()`` for an SPMD runner)
    actions: tuple[ActionTime, ...] = ()
    #: a pipeline profile's microbatches per step (0 for an SPMD runner)
    microbatches: int = 0

    def layers(self) -> dict[str, dict[str, float]]:
        """``{layer: {fwd, bwd, comm, pred_fwd, pred_bwd, pred_comm}}`` seconds, compute and
        communication apart, in first-appearance order."""
        out: dict[str, dict[str, float]] = {}
        for n in self.nodes:
            r = out.setdefault(n.layer, dict.fromkeys(("fwd", "bwd", "comm", "pred_fwd", "pred_bwd",
                                                       "pred_comm"), 0.0))
            if n.kind == "comm":
                r["comm"] += n.fwd + n.bwd
                r["pred_comm"] += n.pred_fwd + n.pred_bwd
            else:
                for k in ("fwd", "bwd", "pred_fwd", "pred_bwd"):
                    r[k] += getattr(n, k)
        return out

    def collectives(self) -> dict[str, dict[str, float]]:
        """``{edge: {measured, predicted}}`` seconds (forward and backward together)."""
        out: dict[str, dict[str, float]] = defaultdict(lambda: dict(measured=0.0, predicted=0.0))
        for n in self.nodes:
            if n.kind == "comm":
                out[n.edge]["measured"] += n.fwd + n.bwd
                out[n.edge]["predicted"] += n.pred_fwd + n.pred_bwd
        return dict(out)

    def scales(self, *others: Profile) -> dict[str, float]:
        """``{"compute": Σ measured / Σ predicted, "comm": ...}`` over the nodes and pipeline
        actions the plan priced in this profile and ``others`` (a kind with nothing predicted
        is left out): what :meth:`fxpar.Cluster.refine` divides the rates by. Communication
        counts only where the measurement is a collective's duration, which is what the plan
        predicts: blocking edges (:class:`NodeTime`); not an overlapped edge, not the
        gradient sync (the wait the bucketed reductions left exposed after the backward), not
        a pipeline's sends (their launch: the wait for them comes at the end of the step).

        Pipeline profiles of two or more microbatch counts also give ``"overhead"``, the
        seconds every action pays whatever its size (``Physics.microbatch_overhead``): a
        least-squares fit of ``measured = s·predicted + overhead`` over their ``F`` and ``B``
        actions (and ``measured = s·predicted`` over the SPMD profiles' nodes), ``s`` then
        the compute scale; at one microbatch count the fixed part cannot be told from the
        rate, and a fit with a negative overhead keeps the ratio.

        SPMD profiles whose plans overlap different shares of their communication also give
        ``"interference"`` (``Cluster.comm_interference``): the seconds of compute one second
        of hidden communication adds, the ``κ`` of ``measured = s·predicted + κ·H`` over their
        compute (``H``: the predicted seconds of the communication the plan runs under
        compute, its overlapped edges and the bucketed gradient reductions), fitted with
        ``s`` (and the overhead) where the profiles tell them apart; a negative ``κ`` is 0
        (overlap does not speed compute up).

        Zero-bubble profiles also give ``"split"``: what the halves of their split backwards
        (``I`` and ``W`` of a chunk after the first) measured, less their overheads, over
        ``s`` times what they were predicted at; the factor the plan's
        ``physics.split_backward`` was off by.

        >>> def pipe(m, f):   # forward predicted f seconds, measured 2·f + 3 ms
        ...     return Profile((), 0.1, 3, actions=(ActionTime("F", 0, 0, 2 * f + 3e-3, f),
        ...                                         ActionTime("B", 0, 0, 4 * f + 3e-3, 2 * f)),
        ...                    microbatches=m)
        >>> {k: round(v, 6) for k, v in pipe(2, 0.01).scales(pipe(4, 0.005)).items()}
        {'compute': 2.0, 'overhead': 0.003}
        >>> mm = NodeTime("mm", "fc", "compute", None, 12e-3, 0.0, 10e-3, 0.0)
        >>> spmd = Profile((mm,), 0.1, 3)   # compute predicted 10 ms, measured 12 ms
        >>> sync = NodeTime(_SYNC, "(params)", "comm", _SYNC, 0.0, 1e-3, 0.0, 4e-3)
        >>> slowed = Profile((replace(mm, fwd=14e-3), sync), 0.1, 3)   # + 2 ms under 4 ms hidden
        >>> {k: round(v, 6) for k, v in spmd.scales(slowed).items()}
        {'compute': 1.2, 'interference': 0.5}
        >>> zb = Profile((), 0.1, 3, actions=(ActionTime("F", 1, 0, 0.02, 0.01),
        ...     ActionTime("I", 1, 0, 0.03, 0.01), ActionTime("W", 1, 0, 0.03, 0.01)))
        >>> {k: round(v, 6) for k, v in zb.scales().items()}   # I + W at 1.5x the rate F gives
        {'compute': 2.0, 'split': 1.5}
        """
        profiles = (self, *others)
        out = {}
        for kind in ("compute", "comm"):
            pred = meas = 0.0
            for pr in profiles:
                nodes = [n for n in pr.nodes if n.kind == kind and n.edge != _SYNC and n.blocking]
                pred += sum(n.pred_fwd + n.pred_bwd for n in nodes)
                meas += sum(n.fwd + n.bwd for n in nodes if n.pred_fwd + n.pred_bwd > 0)
                acts = [a for a in pr.actions if a.predicted > 0 and kind == "compute"
                        and a.kind in ("F", "B", "I", "W") and not _split(a)]
                pred += sum(a.predicted for a in acts)
                meas += sum(a.measured for a in acts)
            if pred > 0 and meas > 0:
                out[kind] = meas / pred
        out.update(_fit(profiles))
        halves = [a for pr in profiles for a in pr.actions if _split(a) and a.predicted > 0]
        if halves and out.get("compute"):
            net = sum(a.measured for a in halves) - len(halves) * out.get("overhead", 0.0)
            out["split"] = net / (out["compute"] * sum(a.predicted for a in halves))
        return out

    def compare(self, plan=None, trace: str | os.PathLike | None = "fxpar_profile_trace.json") -> str:
        """Predicted against measured, per layer and per collective, as a table (printed and
        returned); writes a Chrome trace to ``trace`` (``name.rankR.json`` under a process
        group of several ranks, each its own; ``None``: no file) with the measured
        step on one lane and the predicted on another, node by node. ``plan`` is the plan
        whose predictions to show (default: the one profiled, already in the profile); a
        different plan of the same program is matched by node and edge names."""
        nodes = self.nodes if plan is None else _predicted(self.nodes, plan)
        prof = Profile(nodes, self.step, self.steps, self.optimizer,
                       plan.time if plan is not None else self.predicted_step, self.actions)
        rows = [("layer", "fwd pred", "fwd meas", "bwd pred", "bwd meas", "comm pred", "comm meas")]
        for lay, r in prof.layers().items():
            rows.append((lay,) + tuple(fmt_time(r[k]) for k in ("pred_fwd", "fwd", "pred_bwd", "bwd",
                                                                  "pred_comm", "comm")))
        lines = [f"profile of {self.steps} steps: step measured {fmt_time(self.step)} (optimizer "
                 f"{fmt_time(self.optimizer)}), predicted {fmt_time(prof.predicted_step)}; "
                 f"measured / predicted: " + ", ".join(f"{k} {v:.3g}" for k, v in prof.scales().items())]
        if prof.nodes:
            lines += _table(rows)
        if self.actions:
            by: dict[tuple[str, int], list[ActionTime]] = defaultdict(list)
            for a in self.actions:
                by[a.kind, a.stage].append(a)
            lines.append("pipeline actions (per microbatch, median over microbatches):")
            lines += _table([("action", "chunk", "predicted", "measured")] + [
                (k, str(c), fmt_time(statistics.median(a.predicted for a in v)),
                 fmt_time(statistics.median(a.measured for a in v))) for (k, c), v in sorted(by.items())])
        coll = prof.collectives()
        if coll:
            lines.append("collectives (forward + backward):")
            lines += _table([("edge", "predicted", "measured")] + [
                (e, fmt_time(v["predicted"]), fmt_time(v["measured"])) for e, v in coll.items()])
        if trace is not None:
            trace = _per_rank(os.fspath(trace))
            with open(trace, "w") as f:
                json.dump(prof.chrome_trace(), f)
            lines.append(f"chrome trace: {trace}")
        text = "\n".join(lines)
        print(text)
        return text

    def chrome_trace(self) -> dict:
        """The step as Chrome trace events: process 0 the measured, process 1 the predicted
        times; each lays the nodes' forwards in graph order, then their backwards in reverse."""
        events = []
        for pid, (f, b) in enumerate((("fwd", "bwd"), ("pred_fwd", "pred_bwd"))):
            events.append(dict(name="process_name", ph="M", pid=pid,
                               args=dict(name="measured" if pid == 0 else "predicted")))
            t = 0.0
            order = [(n, f, "fwd") for n in self.nodes] + [(n, b, "bwd") for n in reversed(self.nodes)]
            for n, key, phase in order:
                d = getattr(n, key)
                if d > 0:
                    events.append(dict(name=f"{n.name} {phase}", cat=n.kind, ph="X", pid=pid,
                                       tid=0 if n.kind == "compute" else 1, ts=t * 1e6, dur=d * 1e6,
                                       args=dict(layer=n.layer, edge=n.edge)))
                    t += d
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    def to_dict(self) -> dict:
        return dict(nodes=[asdict(n) for n in self.nodes], step=self.step, steps=self.steps,
                    optimizer=self.optimizer, predicted_step=self.predicted_step,
                    actions=[asdict(a) for a in self.actions], microbatches=self.microbatches)

    @classmethod
    def from_dict(cls, d: dict) -> Profile:
        return cls(tuple(NodeTime(**n) for n in d["nodes"]), d["step"], d["steps"],
                   d.get("optimizer", 0.0), d.get("predicted_step", 0.0),
                   tuple(ActionTime(**a) for a in d.get("actions", ())), d.get("microbatches", 0))


def _split(a: ActionTime) -> bool:
    """Whether ``a`` is half of a split backward (``I`` or ``W`` of a chunk after the first;
    the first chunk's ``I`` is its whole backward)."""
    return a.kind in ("I", "W") and a.stage > 0


def _hidden(p: Profile) -> float:
    """Predicted seconds of the communication an SPMD profile's plan runs under compute: its
    overlapped edges and the bucketed gradient reductions (the gradient sync's prediction)."""
    return sum(n.pred_fwd + n.pred_bwd for n in p.nodes
               if n.kind == "comm" and (not n.blocking or n.edge == _SYNC))


def _fit(profiles) -> dict[str, float]:
    """``compute`` (``s``), ``overhead`` and ``interference`` of :meth:`Profile.scales`: a
    least-squares fit of ``measured = s·predicted + o·[a pipeline F/B action] + κ·H`` over
    the pipeline profiles' ``F``/``B`` actions (``H = 0``) and the SPMD profiles' compute
    (``o`` not paid: nodes are timed one by one); ``o`` only from two microbatch counts,
    ``κ`` only where some plan hides communication, each only where the rows tell it from
    the others. A fit with ``o ≤ 0`` drops it; ``κ < 0`` is 0. ``{}``: nothing fitted (the
    ratio of sums stands)."""
    import numpy as np

    rows = [(a.predicted, 1.0, 0.0, a.measured) for p in profiles for a in p.actions
            if a.kind in ("F", "B") and a.predicted > 0]
    for p in profiles:
        priced = [n for n in p.nodes if n.kind == "compute" and n.pred_fwd + n.pred_bwd > 0]
        if priced:
            rows.append((sum(n.pred_fwd + n.pred_bwd for n in priced), 0.0, _hidden(p),
                         sum(n.fwd + n.bwd for n in priced)))
    if not rows:
        return {}
    a = np.asarray(rows)
    cols = ([0] + ([1] if len({p.microbatches for p in profiles if p.actions}) >= 2 else [])
            + ([2] if (a[:, 2] > 0).any() else []))
    no_interference = False
    while len(cols) > 1:
        x = a[:, cols]
        if np.linalg.matrix_rank(x) < len(cols):   # not told apart: the last added goes
            cols.pop()
            continue
        fit = dict(zip(cols, (float(v) for v in np.linalg.lstsq(x, a[:, 3], rcond=None)[0])))
        if fit.get(2, 0.0) < 0:
            cols.remove(2)
            no_interference = True
        elif fit.get(1, 1.0) <= 0:
            cols.remove(1)
        elif fit[0] <= 0:
            break
        else:
            out = {"compute": fit[0]}
            if 1 in fit:
                out["overhead"] = fit[1]
            if 2 in fit or no_interference:
                out["interference"] = fit.get(2, 0.0)
            return out
    return {"interference": 0.0} if no_interference else {}


def _per_rank(path: str) -> str:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        root, ext = os.path.splitext(path)
        return f"{root}.rank{dist.get_rank()}{ext}"
    return path


def _table(rows) -> list[str]:
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    return ["  " + "  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]


# -- measurement -------------------------------------------------------------------------------
class _Recorder:
    """Times of one step: forward stamps in order, backward (start, end) per node index."""

    def __init__(self) -> None:
        self.fwd: list[tuple[int, float]] = []
        self.bwd: dict[int, list[list[float]]] = {}
        self.hooked: set[int] = set()
        self.keep: list = []
        self.forward = True
        self.sync = 0.0   # the backward's gradient reduction left after the graph's backward


_ACTIVE: _Recorder | None = None


def _stamp(value, index: int) -> None:
    """The profiling node after node ``index``: its forward end, and hooks on its autograd node."""
    rec = _ACTIVE
    if rec is None:
        return
    now = time.perf_counter()
    if rec.forward:
        rec.fwd.append((index, now))
    vals = value if isinstance(value, (tuple, list)) else (value,)
    # every autograd node this op created: reachable from its outputs' and not an earlier
    # op's (stamps run in graph order, so those are hooked already): a composite op (linear
    # = view, addmm, view) is timed whole
    todo = [v.grad_fn for v in vals if isinstance(v, torch.Tensor) and v.grad_fn is not None]
    while todo:
        fn = todo.pop()
        if fn is None or id(fn) in rec.hooked:
            continue
        rec.hooked.add(id(fn))
        rec.keep.append(fn)   # ids stay unique while the step runs
        spans = rec.bwd.setdefault(index, [])
        span = [0.0, 0.0]
        spans.append(span)

        def pre(grad_outputs, span=span):
            span[0] = time.perf_counter()

        def post(grad_inputs, grad_outputs, span=span):
            span[1] = time.perf_counter()
        fn.register_prehook(pre)
        fn.register_hook(post)
        todo += [f for f, _ in fn.next_functions]


def _instrumented(gm: fx.GraphModule) -> tuple[fx.GraphModule, list[fx.Node]]:
    """A copy of ``gm`` with a stamp after every ``call_function`` node; the stamped nodes."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    stamped = []
    for n in gm.graph.nodes:
        new = g.node_copy(n, lambda a: env[a])
        env[n] = new
        if n.op == "call_function":
            g.call_function(_stamp, (new, len(stamped)))
            stamped.append(n)
    out = fx.GraphModule(gm, g)
    out.meta = gm.meta
    return out, stamped


def _comm_edges(n: fx.Node, edges) -> list[str]:
    """The planned edges a collective node of the rank graph runs (its edge-name arguments: a
    wait names one, a launch lists the edges it starts together)."""
    if getattr(n.target, "namespace", None) != "fxpar":
        return []
    names = [x for a in n.args for x in (a if isinstance(a, (list, tuple)) else (a,))]
    return [x for x in names if isinstance(x, str) and x in edges]


def _comm_edge(n: fx.Node, edges) -> str | None:
    return next(iter(_comm_edges(n, edges)), None)


def _synthetic_batch(runner):
    """A batch of the compiled shapes when none is given: zeros for integer inputs (valid
    token ids and indices), standard normals for floating ones (seeded: the same on every
    rank), the traced value for non-tensor inputs."""
    from torch.utils._pytree import tree_unflatten

    gen = torch.Generator().manual_seed(0)
    flat = []
    for n in runner.inputs:
        info = n.meta[ir.INPUT]
        if not info.is_tensor:
            flat.append(info.value)
        elif info.dtype.is_floating_point:
            flat.append(torch.randn(info.shape, generator=gen).to(info.dtype))
        else:
            flat.append(torch.zeros(info.shape, dtype=info.dtype))
    args, kwargs = tree_unflatten(flat, runner._input_tree)
    return tuple(args), dict(kwargs)


def _sync_for(runner, steps: int):
    """The steps checked; what waits for the device's queued kernels (nothing on a CPU)."""
    from fxpar.errors import FxparError

    if steps < 1:
        raise FxparError(f"profile: steps must be >= 1, got {steps}")
    return torch.cuda.synchronize if torch.device(runner.device).type == "cuda" else (lambda: None)


def profile_runner(runner, args, kwargs, steps: int = 3) -> Profile:
    """Measure ``steps`` training steps of an SPMD ``runner`` (module docstring)."""
    global _ACTIVE
    sync = _sync_for(runner, steps)
    if not args and not kwargs:
        args, kwargs = _synthetic_batch(runner)
    gm = runner.gm
    # a split compiled runner (fxpar.runtime.runner.compiled) is profiled on its rank graph
    prof_gm, stamped = _instrumented(gm.meta.get(ir.SOURCE, gm))
    runs, walls, opts = [], [], []
    runner.gm = prof_gm
    try:
        for k in range(steps + 1):   # one warm-up step first
            rec = _Recorder()
            _ACTIVE = rec
            sync()
            t0 = time.perf_counter()
            rec.fwd.append((-1, t0))
            states = runner.states
            begin, finish = states.begin_backward, states.finish_backward

            def begin_backward(rec=rec, begin=begin):
                sync()
                rec.forward = False
                begin()

            def finish_backward(rec=rec, finish=finish):
                t = time.perf_counter()
                finish()
                sync()
                rec.sync = time.perf_counter() - t
            states.begin_backward, states.finish_backward = begin_backward, finish_backward
            try:
                runner.forward_backward(*args, **kwargs)
            finally:
                del states.begin_backward, states.finish_backward
            sync()
            t1 = time.perf_counter()
            runner.optimizer_step()
            sync()
            t2 = time.perf_counter()
            _ACTIVE = None
            if k:
                runs.append(rec)
                walls.append(t2 - t0)
                opts.append(t2 - t1)
    finally:
        _ACTIVE = None
        runner.gm = gm
    fwd: dict[int, list[float]] = defaultdict(list)
    bwd: dict[int, list[float]] = defaultdict(list)
    for rec in runs:
        for (_, a), (i, b) in zip(rec.fwd, rec.fwd[1:]):
            fwd[i].append(b - a)
        for i, spans in rec.bwd.items():
            bwd[i].append(sum(b - a for a, b in spans if b >= a > 0))
    edges = gm.meta.get(ir.EDGES, {})
    out = []
    at: dict[str, list[int]] = defaultdict(list)   # edge -> positions of its nodes
    for i, n in enumerate(stamped):
        for e in _comm_edges(n, edges):
            at[e].append(i)
        edge = _comm_edge(n, edges)
        out.append(NodeTime(n.name, layer_of(n), "comm" if edge else "compute", edge,
                            _median(fwd.get(i, [])), _median(bwd.get(i, [])), 0.0, 0.0))
    # the parameters' gradient reductions (data parallel, ZeRO) run in the runtime's buckets,
    # not as graph nodes: their exposed wait after the backward
    out.append(NodeTime(_SYNC, "(params)", "comm", _SYNC, 0.0, _median([r.sync for r in runs]), 0.0, 0.0))
    plan = runner.program.plan
    out = list(_predicted(out, plan))
    for e, ix in at.items():
        # overlapped: computation the plan prices between launch and wait, or the output's
        # edge (the runner waits for the loss's all-reduce after the backward)
        hidden = edges[e].consumer == "output" or any(
            out[i].kind == "compute" and out[i].pred_fwd > 0 for i in range(ix[0], ix[-1]))
        for i in ix:
            if hidden and out[i].edge == e:
                out[i] = replace(out[i], blocking=False)
    nodes = tuple(n for n in out if n.edge != _SYNC or n.pred_bwd > 0)  # none planned
    return Profile(nodes, statistics.median(walls), steps, statistics.median(opts), plan.time)


_SYNC = "(gradient sync)"


def _predicted(nodes, plan) -> tuple[NodeTime, ...]:
    """``nodes`` with the plan's predictions: a compute node's ``NodePlan`` times, a
    collective node's edge times, and for the gradient sync the planned backward edges out of
    parameters that no graph node runs (the runtime's buckets do)."""
    by_node = {n.name: n for n in plan.nodes}
    by_edge: dict[tuple[str, str], float] = defaultdict(float)
    for e in plan.edges:
        by_edge[f"{e.producer}->{e.consumer}", e.direction] += e.time
    ran = {n.edge for n in nodes if n.kind == "comm"}
    params = {n.name for n in plan.nodes if n.param}
    # an edge runs as a launch and a wait node: its time is predicted once, on the last one
    last = {n.edge: i for i, n in enumerate(nodes) if n.kind == "comm"}
    out = []
    for i, n in enumerate(nodes):
        if n.edge == _SYNC:
            pf, pb = 0.0, sum(t for (e, d), t in by_edge.items()
                              if d == "bwd" and e not in ran and e.split("->")[0] in params)
        elif n.kind == "comm":
            pf, pb = ((by_edge.get((n.edge, "fwd"), 0.0), by_edge.get((n.edge, "bwd"), 0.0))
                      if last[n.edge] == i else (0.0, 0.0))
        else:
            p = by_node.get(n.name)
            pf, pb = (p.fwd_time, p.bwd_time) if p is not None else (0.0, 0.0)
        out.append(replace(n, pred_fwd=pf, pred_bwd=pb))
    return tuple(out)


def _median(xs) -> float:
    return statistics.median(xs) if xs else 0.0


def profile_pipeline(runner, args, kwargs, steps: int = 3) -> Profile:
    """Measure ``steps`` training steps of a pipeline ``runner``, action by action
    (:class:`ActionTime`; one warm-up step first)."""
    sync = _sync_for(runner, steps)
    times: dict[tuple[str, int, int], list[float]] = defaultdict(list)
    names: dict[tuple[str, int, int], str] = {}
    run = runner._run
    walls, opts = [], []

    def timed(action, batch, rec):
        sync()
        t = time.perf_counter()
        run(action, batch)
        sync()
        rec.append((str(action.kind), action.stage, action.microbatch or 0, time.perf_counter() - t,
                    str(action)))
    try:
        for k in range(steps + 1):
            rec: list = []
            runner._run = lambda action, batch, rec=rec: timed(action, batch, rec)
            t0 = time.perf_counter()
            loss, work = runner._schedule(args, kwargs)
            t1 = time.perf_counter()
            runner.optimizer_step()
            work.wait()
            sync()
            t2 = time.perf_counter()
            if k:
                for kind, st, mb, d, name in rec:
                    times[kind, st, mb].append(d)
                    names[kind, st, mb] = name
                walls.append(t2 - t0)
                opts.append(t2 - t1)
    finally:
        del runner._run
    plan = runner.program.plan
    split = split_backward(plan.cluster())
    pred = {}
    for st in plan.stages:
        p = st.plan
        fwd = p.compute_fwd + sum(e.time for e in p.edges if e.direction == "fwd")
        bwd_comm = sum(e.time for e in p.edges if e.direction == "bwd")
        # as the step model splits a backward (cost.step.step_time): chunk 0 has no input
        # gradient, so its I is the whole backward and its W empty
        half = p.compute_bwd * split / 2 if st.index else 0.0
        pred[st.index] = dict(F=fwd, B=p.compute_bwd + bwd_comm,
                              I=(half if st.index else p.compute_bwd) + bwd_comm, W=half,
                              SEND_F=st.send_time, SEND_B=0.0)
        if st.index:
            pred[st.index]["SEND_B"] = plan.stages[st.index - 1].back_time
    # where the plan runs compute at the speed the ranks busy at once leave it (ranks sharing
    # a host's cores: cost.step.host_rate), an action is predicted at the speed its simulated
    # run had, as the step's prediction takes it (the rate the refit finds is then the rate
    # at all ranks busy, which the simulation scales again)
    speed = {e.name: e.work / (e.end - e.start) for e in runner.program.simulate().events
             if e.rank == runner.pp_rank and e.lane == "compute" and e.work > 0 and e.end > e.start}
    acts = tuple(ActionTime(kind, st, mb, _median(ts), pred.get(st, {}).get(kind, 0.0)
                            / speed.get(names[kind, st, mb], 1.0))
                 for (kind, st, mb), ts in sorted(times.items()))
    return Profile((), statistics.median(walls), steps, statistics.median(opts), plan.time, acts,
                   plan.schedule["microbatches"])
