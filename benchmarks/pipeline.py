"""Pipeline benchmark: fxpar's pipeline runtime against ``torch.distributed.pipelining``, and
its simulator against what was measured. Measured, not asserted.

On ``pp`` gloo processes of this machine (one intra-op thread each; a
:class:`fxpar.testing.WorkerPool`), one small GPT (:class:`examples.models.GPT`, plain torch,
``n_layers=8``) is trained with AdamW, the global batch cut into ``m`` microbatches, the model
cut into ``pp·v`` stage chunks at the same layers on both sides (chunk 0 also holds the
embeddings, the last chunk ``ln_f``, the LM head and the loss; the blocks are divided evenly).

**(a) fxpar vs torch** at ``m=4`` and ``m=8``, per pipeline width (``pp=2``, ``pp=4``):

=============  =======================================  ==========================================
schedule       fxpar                                    torch.distributed.pipelining
=============  =======================================  ==========================================
gpipe          ``schedule="gpipe"``                     ``ScheduleGPipe``
1f1b           ``schedule="1f1b"``                      ``Schedule1F1B``
interleaved    ``schedule="interleaved", chunks=2``     ``ScheduleInterleaved1F1B``, 2 stages/rank
looped-bfs     ``schedule="looped-bfs", chunks=2``      ``ScheduleLoopedBFS``, 2 stages/rank
interleaved-zb ``schedule="interleaved-zb", chunks=2``  ``ScheduleInterleavedZeroBubble``, 2
                                                        stages/rank
eager-1f1b     ``schedule="eager-1f1b"``                (no counterpart)
zbv            ``schedule="zbv", chunks=2``             ``ScheduleZBVZeroBubble``, 2 stages/rank in
                                                        a V (rank r: stages r and 2p−1−r)
dualpipev      ``schedule="dualpipev", chunks=2``       ``ScheduleDualPipeV``, the same V (its
                                                        overlapped F+B actions run F then B, as
                                                        torch runs them; ``m ≥ 2p``)
zb-h1          ``schedule="zb-h1"``                     (torch's interleaved zero-bubble with one
                                                        stage per rank is the same order)
=============  =======================================  ==========================================

The orders of the schedules compared are the same on both sides (tests/test_schedule.py checks
fxpar's generators against torch's): every schedule torch.distributed.pipelining has.

fxpar: ``fxpar.compile(model, Cluster.local(pp), (idx,), loss_fn=ce, example_targets=(tgt,),
mesh={"pp": pp}, schedule=..., microbatches=m, split_points=[...])`` then
``prog.runner().step(idx, tgt)`` (schedule, gradient reduction, AdamW step, loss broadcast to
every rank). torch, written by hand the documented way: one ``nn.Module`` per stage holding its
layers (the first also the embeddings, the last ``ln_f`` and the head), a ``PipelineStage``
per stage, the schedule with the same ``loss_fn`` (mean cross-entropy; ``scale_grads=True``
divides by ``m`` as fxpar does), ``step(idx)`` on the first rank, ``step(target=tgt,
losses=...)`` on the last, ``return_outputs=False``, then ``AdamW.step()`` and ``zero_grad``.
Both start from the same weights and see the same batches, so the losses agree step by step
(``max|Δloss|`` printed).

How it is measured (as ``benchmarks/runtime.py``): ONE pool run per ``pp`` holds every side
of both parts — each fxpar (schedule, m) and each torch (schedule, m), ~25 on ``pp=2`` — and
they step **interleaved** (A B C ..., B C ... A, rotating who goes first), so load drift on
this shared machine hits all of them alike; a barrier before every step;
a sample is the **slowest rank's** wall time of that step; ``--warmup`` steps per side are
excluded; medians over ``--steps``. ``fxpar/torch`` is the ratio of medians (aim ≤ 1.0),
``paired`` the median of per-step ratios (an fxpar step and its torch twin run back to back,
swapping who goes first), ``mins`` the ratio of the fastest steps, ``quiet`` the ratio of the
medians of each side's fastest third of steps.

**(b) simulator vs measured.** fxpar schedules × ``m`` (``pp=2``: m ∈ {1, 2, 4, 8}; ``pp=4``:
m ∈ {4, 8}; interleaved only where ``m`` is a multiple of ``pp``). Each fxpar runner is timed
from outside: its ``_forward``/``_backward``/``_weight``/``_recv``/``optimizer_step`` methods
(and its optimizer's per-bucket ``step_bucket``) are wrapped on the instance (the interpreter
is not edited; a wrapper costs two ``perf_counter`` calls). Predicted step times:

* ``sim·own``: :func:`fxpar.sim.simulate` of the schedule with per-chunk forward, backward and
  (zb-h1) weight-gradient times = the medians of that very side's ``F``/``B``-or-``I``/``W``
  actions (the simulator's scheduling model alone), ``comm`` = one-way gloo time of a boundary
  activation (ping-pong, measured), plus the side's median optimizer step (not in the
  simulator).
* ``sim·cal``: the same, but every chunk time from ONE calibration side per ``pp`` (gpipe at the
  smallest ``m``), scaled linearly to the microbatch size (``×m₀/m``); an interleaved chunk
  (half a stage) takes half its stage's time; zb-h1's ``W`` the simulator's default half of a
  backward. A prediction a user could make from one run.
* ``plan``: ``prog.simulate().step_time`` — the plan's own cost model on a cluster calibrated
  on the same ranks first (``Cluster.local(pp).calibrate()``: GEMM and memory curves, per-op
  overheads, which are paid once per microbatch, and collectives), what a user who calibrates
  sees; ``--nominal``: ``Cluster.local``'s roofline, judged by rank order only.

* ``plan·shr``: the plan's own units (``price_plan(plan, cluster=...)``) on the same
  calibration with the speed of compute by the number of ranks busy measured too
  (``calibrate(share_cores=True)``): a rank in the others' bubble computes at the cores they
  leave it (:func:`fxpar.cost.step.host_rate`).
* ``plan·ref``: the closed loop (issue #24 item 6): after the measured steps,
  ``runner.profile()`` of 1F1B at the smallest and at the largest ``m`` and of zb-h1 at the
  largest on every rank, ``cluster.refine(*profiles)`` (compute scale and the seconds each
  action pays whatever its size, fitted over both microbatch sizes; zb-h1's
  ``physics.split_backward`` from its ``I``/``W`` actions), every fxpar side planned again on
  the refined cluster: its ``prog.simulate().step_time``. Three of the points calibrate, the
  rest are predicted.
* ``plan·r·s``: the closed loop on the calibration with shared cores: ``plan·shr``'s cluster
  refined on ``runner.profile()`` of the same three sides planned on it (their actions
  predicted at the speed its simulation gives each), every side's
  ``prog.simulate().step_time`` on it.

Every column twice: from all measured steps (medians), and ``q_`` from each side's quiet steps
only (the fastest third by step time; action medians over those steps) — on a machine shared
with other jobs about half the steps are slowed 2–4× by load bursts, which medians of 15 steps
do not always reject.

Reported per ``pp``: Spearman rank correlation of each predictor with the measured step times
over all (schedule, m) points, and averaged over the ``m`` with at least 4 schedules (ranking the
schedules at one ``m``), the median relative error ``|pred − meas| / meas`` and the median
``pred/meas``. On ``pp=4`` four processes share the 2
cores: a "rank" is half a core and the measured times include time slicing that none of the
predictors model (sim·own sees it only through slower ``F``/``B`` actions).

    python benchmarks/pipeline.py            # ~6–10 min; writes benchmarks/results/pipeline.json
    python benchmarks/pipeline.py --quick    # ~2 min: pp=2 only, m ∈ {2, 4}, 6 steps
    python benchmarks/pipeline.py --no-pp4   # pp=2 only, all m
    python benchmarks/pipeline.py --profile 1f1b   # + cProfile of rank 0's fxpar and torch steps

The machine's 2 cores are shared with other work: compare the columns of one run, not numbers
across runs.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import cProfile
import datetime
import io
import json
import os
import platform
import pstats
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MODEL = dict(vocab=512, d_model=128, n_heads=4, n_layers=8, seq_len=64)
BATCH = 16
LR = 1e-3
FX_SCHEDULES = ("gpipe", "1f1b", "interleaved", "eager-1f1b", "zb-h1", "looped-bfs",
                "interleaved-zb", "zbv", "dualpipev")
TORCH_SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B",
                   "interleaved": "ScheduleInterleaved1F1B", "looped-bfs": "ScheduleLoopedBFS",
                   "interleaved-zb": "ScheduleInterleavedZeroBubble", "zbv": "ScheduleZBVZeroBubble",
                   "dualpipev": "ScheduleDualPipeV"}


def _ce(out: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), tgt.reshape(-1))


def _adamw(params):
    return torch.optim.AdamW(params, lr=LR)


def _chunks(schedule: str) -> int:
    from fxpar.schedule import MULTI_CHUNK

    return 2 if schedule in MULTI_CHUNK else 1


def _starts(n_chunks: int) -> list[int]:
    """First block of each chunk after the first: the blocks divided evenly."""
    L = MODEL["n_layers"]
    return [i * L // n_chunks for i in range(1, n_chunks)]


def _valid(schedule: str, pp: int, m: int) -> bool:
    return not ((schedule in ("interleaved", "interleaved-zb") and m % pp)
                or (schedule == "dualpipev" and m < 2 * pp))


# ---------------------------------------------------------------------------------------------
# the hand-written torch.distributed.pipelining side
# ---------------------------------------------------------------------------------------------
class _TorchStage(torch.nn.Module):
    """Blocks ``lo:hi`` of a GPT; the first stage also embeds, the last applies ln_f + head."""

    def __init__(self, gpt, lo: int, hi: int, first: bool, last: bool) -> None:
        super().__init__()
        self.first, self.last = first, last
        if first:
            self.tok_emb, self.pos_emb = gpt.tok_emb, gpt.pos_emb
        self.blocks = torch.nn.ModuleList(gpt.blocks[lo:hi])
        if last:
            self.ln_f, self.head = gpt.ln_f, gpt.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.tok_emb(x) + self.pos_emb(torch.arange(x.shape[1], device=x.device))
        for b in self.blocks:
            x = b(x)
        if self.last:
            x = self.head(self.ln_f(x))
        return x


class TorchSide:
    """``PipelineStage`` per stage this rank holds + a torch schedule + AdamW."""

    def __init__(self, schedule: str, model, m: int, rank: int, pp: int, log: list) -> None:
        from torch.distributed import pipelining as pl

        v = _chunks(schedule)
        n = pp * v
        bounds = [0, *_starts(n), MODEL["n_layers"]]
        from fxpar.schedule import PLACEMENT_OF, chunk_rank

        mine = [k for k in range(n) if chunk_rank(k, pp, PLACEMENT_OF.get(schedule, "loop")) == rank]
        self.stages = []
        params = []
        for k in mine:
            mod = _TorchStage(model, bounds[k], bounds[k + 1], k == 0, k == n - 1)
            params += list(mod.parameters())
            st = pl.PipelineStage(mod, k, n, torch.device("cpu"))
            _wrap(st, "forward_one_chunk", log, "F")
            _wrap(st, "backward_one_chunk", log, "B")
            self.stages.append(st)
        cls = getattr(pl, TORCH_SCHEDULES[schedule])
        if v == 1:
            self.sched = cls(self.stages[0], n_microbatches=m, loss_fn=_ce)
        else:
            self.sched = cls(self.stages, n_microbatches=m, loss_fn=_ce)
        self.first = any(s.is_first for s in self.stages)
        self.last = any(s.is_last for s in self.stages)
        self.opt = _adamw(params)

    def step(self, idx, tgt):
        losses: list = []
        args = (idx,) if self.first else ()
        if self.last:
            self.sched.step(*args, target=tgt, losses=losses, return_outputs=False)
        else:
            self.sched.step(*args, return_outputs=False)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return torch.stack([x.detach() for x in losses]).mean() if losses else None


def _wrap(obj, name: str, log: list, tag: str) -> None:
    """Time every call of ``obj.name`` into ``log`` as ``(tag, chunk, seconds)`` (an instance
    attribute shadowing the method: measured from outside). A method the object does not have
    (a runtime without it) is left alone."""
    orig = getattr(obj, name, None)
    if orig is None:
        return
    chunk = getattr(obj, "stage_index", None)

    def timed(*a, **k):
        t0 = time.perf_counter()
        try:
            return orig(*a, **k)
        finally:
            log.append((tag, a[0] if chunk is None and tag in ("F", "B", "W") else chunk,
                        time.perf_counter() - t0))

    setattr(obj, name, timed)


# ---------------------------------------------------------------------------------------------
# one group of sides, on every rank of the pool
# ---------------------------------------------------------------------------------------------
def _pingpong(shape, reps: int = 20) -> float | None:
    """One-way gloo time of a float32 tensor of ``shape`` between ranks 0 and 1 (median of
    half round trips); ``None`` on other ranks."""
    import torch.distributed as dist

    rank = dist.get_rank()
    x = torch.randn(shape)
    dist.barrier()
    out = []
    if rank in (0, 1):
        for _ in range(reps + 3):
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(x, 1)
                dist.recv(x, 1)
            else:
                dist.recv(x, 0)
                dist.send(x, 0)
            out.append((time.perf_counter() - t0) / 2)
    dist.barrier()
    return statistics.median(out[3:]) if out else None


def run_group(spec: dict) -> dict:
    """Build every side of ``spec`` on this rank, step them interleaved, return the samples."""
    import torch.distributed as dist

    import fxpar
    from examples.models import GPT
    from fxpar.planner.price import price_plan

    rank, pp = dist.get_rank(), dist.get_world_size()
    warmup, steps = spec["warmup"], spec["steps"]
    torch.manual_seed(0)
    init = GPT(**MODEL)
    g = torch.Generator().manual_seed(1234)
    batches = [(torch.randint(0, MODEL["vocab"], (BATCH, MODEL["seq_len"]), generator=g),
                torch.randint(0, MODEL["vocab"], (BATCH, MODEL["seq_len"]), generator=g))
               for _ in range(warmup + steps)]
    out: dict = dict(rank=rank, sides={}, p2p_s={})
    for m in sorted({m for _, _, m in spec["sides"]}):
        out["p2p_s"][m] = _pingpong((BATCH // m, MODEL["seq_len"], MODEL["d_model"]))
    # the cluster the plans are priced on: calibrated on these ranks (collectives and compute,
    # per-op overheads included), as a user who calibrates would plan
    t0 = time.perf_counter()
    cluster = (fxpar.Cluster.local(pp).calibrate(share_cores=True) if spec.get("calibrate")
               else fxpar.Cluster.local(pp))
    # the plans are priced as calibrate() prices them (shared cores not modelled); the same
    # calibration with them, for plan·shr (a what-if of the step model: Plan.time's units)
    shared = cluster if cluster.compute is not None and cluster.compute.shared else None
    if shared is not None:
        cluster = dataclasses.replace(cluster, compute=dataclasses.replace(cluster.compute, shared=()))
    out["cluster"] = dict(name=cluster.name, calibration_s=time.perf_counter() - t0,
                          in_model=cluster.compute.in_model if cluster.compute else ())
    sides, logs = {}, {}

    def build(cl, sched, m):
        v = _chunks(sched)
        return fxpar.compile(copy.deepcopy(init), cl, (batches[0][0],), loss_fn=_ce,
                             example_targets=(batches[0][1],), optimizer=_adamw,
                             mesh={"pp": pp}, schedule=sched, microbatches=m, chunks=v,
                             split_points=[f"model.blocks.{x}" for x in _starts(pp * v)])

    def agree(err) -> bool:
        ok = torch.tensor([0 if err else 1])
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        return bool(ok.item())

    for lib, sched, m in spec["sides"]:
        key, v = f"{lib}:{sched}:m{m}", _chunks(sched)
        info: dict = dict(lib=lib, schedule=sched, chunks=v, m=m)
        log: list = []
        err, step = None, None
        try:
            if lib == "fxpar":
                t0 = time.perf_counter()
                prog = build(cluster, sched, m)
                info["compile_s"] = time.perf_counter() - t0
                t0 = time.perf_counter()
                runner = prog.runner()
                info["runner_s"] = time.perf_counter() - t0
                sim = prog.simulate()
                info["plan_step_s"] = sim.step_time
                if shared is not None:
                    info["plan_shared_s"] = price_plan(prog.plan, cluster=shared)[0].step
                info["plan_bubble"] = sim.bubble_fraction
                info["plan_chunks"] = [dict(index=st.index, rank=st.rank, layers=list(st.layers),
                                            send_time=st.send_time) for st in prog.plan.stages]
                for name, tag in (("_forward", "F"), ("_backward", "B"), ("_weight", "W"),
                                  ("_recv", "RECV"), ("optimizer_step", "OPT")):
                    _wrap(runner, name, log, tag)
                # runner.step steps the optimizer bucket by bucket inside the schedule's end
                # (ModelStates.finish_backward_and_step): those calls are the OPT time
                _wrap(runner.states._opt, "step_bucket", log, "OPT")
                step = runner.step
            else:
                info["torch_class"] = TORCH_SCHEDULES[sched]
                step = TorchSide(sched, copy.deepcopy(init), m, rank, pp, log).step
        except Exception as e:  # noqa: BLE001 — recorded, the benchmark goes on
            err = dict(type=type(e).__name__, message=str(e)[:2000],
                       traceback=traceback.format_exc())
        # every rank must agree on whether a side runs, or the interleaved steps would hang
        if not agree(err):
            info["error"] = err or dict(type="PeerError", message="failed on another rank")
        else:
            sides[key] = step
            logs[key] = log
        out["sides"][key] = info

    order = list(sides)
    # blocks: fxpar and torch of one (schedule, m) side by side, so their per-step ratio compares
    # steps taken moments apart; the blocks rotate, and a pair swaps who goes first every step
    blocks: list[list[str]] = []
    for k in order:
        lib, rest = k.split(":", 1)
        twin = f"torch:{rest}" if lib == "fxpar" else None
        if lib == "torch" and f"fxpar:{rest}" in sides:
            continue
        blocks.append([k, twin] if twin in sides else [k])
    times = {k: [] for k in order}
    losses = {k: [] for k in order}
    acts = {k: [] for k in order}
    prof_keys = set(spec.get("profile", ())) if rank == 0 else set()
    profs = {k: cProfile.Profile() for k in order if k in prof_keys}
    for i in range(warmup + steps):
        j = i % len(blocks)
        idx, tgt = batches[i]
        for k in [k for blk in blocks[j:] + blocks[:j] for k in (blk[::-1] if i % 2 else blk)]:
            logs[k].clear()
            dist.barrier()
            prof = profs.get(k) if i >= warmup else None
            if prof is not None:
                prof.enable()
            t0 = time.perf_counter()
            loss = sides[k](idx, tgt)
            dt = time.perf_counter() - t0
            if prof is not None:
                prof.disable()
            times[k].append(dt)
            losses[k].append(None if loss is None else float(loss))
            if i >= warmup:
                acts[k].append(list(logs[k]))
    for k in order:
        s = out["sides"][k]
        s["times_s"] = times[k]
        s["losses"] = losses[k]
        s["actions"] = acts[k]
    for k, prof in profs.items():
        buf = io.StringIO()
        st = pstats.Stats(prof, stream=buf)
        st.sort_stats("cumulative").print_stats(35)
        st.sort_stats("tottime").print_stats(25)
        out["sides"][k]["profile_rank0"] = buf.getvalue()
    # (c) the closed loop: runner.profile() of 1F1B at the smallest and the largest m and of
    # zb-h1 at the largest (every rank's profiles, gathered), cluster.refine(...) on them,
    # every fxpar side planned again on the refined cluster: its plan's step beside the
    # measured one
    ms = sorted({m for lib, _, m in spec["sides"] if lib == "fxpar"})
    cal = [f"fxpar:1f1b:m{m}" for m in (ms[0], ms[-1])] if ms else []
    if f"fxpar:zb-h1:m{ms[-1] if ms else 0}" in sides:
        cal.append(f"fxpar:zb-h1:m{ms[-1]}")
    if spec.get("calibrate") and len(set(cal[:2])) == 2 and all(k in sides for k in cal):
        def gathered(runners) -> list:
            """Every rank's ``runner.profile()`` of each of ``runners``."""
            every: list = [None] * pp
            dist.all_gather_object(every, [r.profile(*batches[0], steps=3).to_dict()
                                           for r in runners])
            return [fxpar.Profile.from_dict(d) for r in every for d in r]

        profiles = gathered([sides[k].__self__ for k in cal])
        refined = cluster.refine(*profiles)
        out["refined"] = dict(calibration=cal, scales=profiles[0].scales(*profiles[1:]),
                              microbatch_overhead_s=(refined.physics.microbatch_overhead
                                                     if refined.physics else 0.0),
                              split_backward=(refined.physics.split_backward
                                              if refined.physics else 1.0))
        # the calibration with shared cores is refined on profiles of the same sides planned
        # on it (refine's contract: their actions predicted at the speed its simulation gives
        # them, not at every rank busy)
        refined_shared = None if shared is None else shared.refine(*gathered(
            [build(shared, out["sides"][k]["schedule"], out["sides"][k]["m"]).runner()
             for k in cal]))
        for key, info in out["sides"].items():
            if info["lib"] == "fxpar" and "error" not in info:
                info["plan_refined_s"] = build(refined, info["schedule"], info["m"]).simulate().step_time
                if refined_shared is not None:
                    info["plan_refined_shared_s"] = build(
                        refined_shared, info["schedule"], info["m"]).simulate().step_time
    dist.barrier()
    return out


# ---------------------------------------------------------------------------------------------
# analysis (driver)
# ---------------------------------------------------------------------------------------------
def _median(xs):
    return statistics.median(xs) if xs else float("nan")


def _spearman(a, b) -> float:
    def ranks(x):
        order = sorted(range(len(x)), key=lambda i: x[i])
        r = [0.0] * len(x)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and x[order[j + 1]] == x[order[i]]:
                j += 1
            for t in range(i, j + 1):
                r[order[t]] = (i + j) / 2
            i = j + 1
        return r

    if len(a) < 3:
        return float("nan")
    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.mean(ra), statistics.mean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    va = sum((x - ma) ** 2 for x in ra) ** 0.5
    vb = sum((y - mb) ** 2 for y in rb) ** 0.5
    return cov / (va * vb) if va and vb else float("nan")


def _merge(per_rank: list[dict], warmup: int) -> dict:
    """One row per side from every rank's result: samples = max over ranks per step, action
    times per (kind, chunk) from the rank that ran them."""
    pp = len(per_rank)
    rows = {}
    for key, info0 in per_rank[0]["sides"].items():
        row = {k: v for k, v in info0.items() if k not in ("times_s", "losses", "actions")}
        row["pp"] = pp
        row["p2p_s"] = per_rank[0]["p2p_s"][info0["m"]]
        if "error" in info0:
            rows[key] = row
            continue
        per_step = list(zip(*[r["sides"][key]["times_s"] for r in per_rank]))
        ms = [1e3 * max(t) for t in per_step]
        row["samples_ms"] = ms[warmup:]
        row["warmup_ms"] = ms[:warmup]
        row["median_ms"] = _median(ms[warmup:])
        row["min_ms"] = min(ms[warmup:])
        # "quiet" steps: the fastest third (by slowest-rank time), the least disturbed by the
        # other load on the machine
        n = len(row["samples_ms"])
        quiet = sorted(range(n), key=lambda s: row["samples_ms"][s])[:max(1, n // 3)]
        row["quiet_steps"] = sorted(quiet)
        row["quiet_ms"] = _median([row["samples_ms"][s] for s in quiet])
        losses = None
        for r in per_rank:
            ls = r["sides"][key]["losses"]
            if all(x is not None for x in ls):
                losses = ls
                break
        row["losses"] = losses
        # per rank: median per step of compute (F+B), recv wait, optimizer, and the rest
        for label, which in (("", range(n)), ("quiet_", quiet)):
            acts: dict = {}
            ranks = []
            for r in per_rank:
                steps = r["sides"][key]["actions"]
                wall = r["sides"][key]["times_s"][warmup:]
                parts = dict(F=[], B=[], W=[], RECV=[], OPT=[], other=[])
                for s in which:
                    tot = dict(F=0.0, B=0.0, W=0.0, RECV=0.0, OPT=0.0)
                    for tag, k, dt in steps[s]:
                        tot[tag] += dt
                        if tag in ("F", "B", "W"):
                            acts.setdefault(f"{tag}{k}", []).append(dt)
                    for t, x in tot.items():
                        parts[t].append(x)
                    parts["other"].append(wall[s] - sum(tot.values()))
                ranks.append({t: 1e3 * _median(v) for t, v in parts.items()})
            row[label + "rank_breakdown_ms"] = ranks
            row[label + "action_median_ms"] = {a: 1e3 * _median(v) for a, v in sorted(acts.items())}
        rows[key] = row
    return rows


def _simulate_measured(row: dict, pp: int, m: int, fwd, bwd, comm: float, opt_s: float,
                       wgrad=None) -> float:
    """:func:`fxpar.simulate` of ``row``'s schedule with these per-chunk times (``bwd`` the
    whole backward, ``wgrad`` its W part; ``None``: the simulator's default half), plus the
    optimizer step the simulator does not model."""
    import fxpar

    sched = fxpar.Schedule.build(row["schedule"], stages=pp, microbatches=m, chunks=row["chunks"])
    r = fxpar.simulate(sched, fwd=fwd, bwd=bwd, wgrad=wgrad, comm=comm)
    return r.step_time + opt_s


def _predict(groups: dict) -> list[dict]:
    """Rows of part (b): every fxpar side, measured vs the predictors — once from all measured
    steps (medians) and once from the quiet steps only (``q_`` columns)."""
    out = []
    for g in groups.values():
        pp = g["pp"]
        fx = {k: r for k, r in g["rows"].items() if r["lib"] == "fxpar" and "error" not in r}
        # calibration: gpipe at the smallest m of this pp
        cands = [r for r in fx.values() if r["schedule"] == "gpipe"]
        cal = min(cands, key=lambda r: r["m"]) if cands else None
        for row in sorted(fx.values(), key=lambda r: (r["m"], FX_SCHEDULES.index(r["schedule"]))):
            m, v = row["m"], row["chunks"]
            n = pp * v
            p2p = row["p2p_s"]
            rec = dict(pp=pp, m=m, schedule=row["schedule"], plan_ms=1e3 * row["plan_step_s"],
                       plan_bubble=row["plan_bubble"], p2p_ms=1e3 * p2p)
            if cal is not None:
                rec["calibration"] = f"gpipe m={cal['m']}"
            if "plan_refined_s" in row:
                rec["plan_ref_ms"] = 1e3 * row["plan_refined_s"]
            if "plan_shared_s" in row:
                rec["plan_shr_ms"] = 1e3 * row["plan_shared_s"]
            if "plan_refined_shared_s" in row:
                rec["plan_ref_shr_ms"] = 1e3 * row["plan_refined_shared_s"]
            for pre, src in (("", ""), ("q_", "quiet_")):
                am = row[src + "action_median_ms"]
                fwd = [am.get(f"F{k}", 0.0) / 1e3 for k in range(n)]
                # B: a whole backward, or zb-h1's I; W: zb-h1's weight-gradient part
                wgt = [am.get(f"W{k}", 0.0) / 1e3 for k in range(n)]
                bwd = [am.get(f"B{k}", 0.0) / 1e3 + w for k, w in zip(range(n), wgt)]
                opt = max(b["OPT"] for b in row[src + "rank_breakdown_ms"]) / 1e3
                rec[pre + "measured_ms"] = row["quiet_ms" if pre else "median_ms"]
                rec[pre + "opt_ms"] = 1e3 * opt
                rec[pre + "sim_own_ms"] = 1e3 * _simulate_measured(row, pp, m, fwd, bwd, p2p, opt,
                                                                   wgrad=wgt)
                if cal is not None:
                    cm = cal[src + "action_median_ms"]
                    # microbatch size, and an interleaved chunk k (of p·v) is half of v=1 stage k // v
                    scale = cal["m"] / m / v
                    cf = [cm[f"F{k // v}"] / 1e3 * scale for k in range(n)]
                    cb = [cm[f"B{k // v}"] / 1e3 * scale for k in range(n)]
                    rec[pre + "sim_cal_ms"] = 1e3 * _simulate_measured(row, pp, m, cf, cb, p2p, opt)
                rec[src + "action_median_ms"] = am
            out.append(rec)
    return out


def _corr_summary(pred: list[dict]) -> dict:
    """Per pp, per (measured column, predictor): Spearman, median |rel err|, median pred/meas."""
    out = {}
    for pp in sorted({r["pp"] for r in pred}):
        rs = [r for r in pred if r["pp"] == pp]
        d: dict = dict(points=len(rs))
        for pre in ("", "q_"):
            meas = [r[pre + "measured_ms"] for r in rs]
            for col in (pre + "sim_own_ms", pre + "sim_cal_ms", "plan_ms", "plan_ref_ms",
                        "plan_shr_ms", "plan_ref_shr_ms"):
                if not all(col in r for r in rs):
                    continue
                p = [r[col] for r in rs]
                # ranking the schedules at one m (m=1: too few distinct schedules)
                within = [_spearman([r[col] for r in rs if r["m"] == m],
                                    [r[pre + "measured_ms"] for r in rs if r["m"] == m])
                          for m in sorted({r["m"] for r in rs})
                          if sum(r["m"] == m for r in rs) >= 4]
                within = [x for x in within if x == x]
                d[f"{pre}measured vs {col.removesuffix('_ms')}"] = dict(
                    spearman=_spearman(p, meas),
                    spearman_within_m=statistics.mean(within) if within else float("nan"),
                    median_rel_err=_median([abs(a - b) / b for a, b in zip(p, meas)]),
                    median_pred_over_meas=_median([a / b for a, b in zip(p, meas)]))
        out[pp] = d
    return out


# ---------------------------------------------------------------------------------------------
# driver
# ---------------------------------------------------------------------------------------------
def _plan_groups(args) -> list[dict]:
    """One group per pipeline width: every (schedule, m) of fxpar, and torch's schedules at the
    compared m, all stepped interleaved in one pool run (load drift hits them alike)."""
    if args.quick:
        plan = {2: ((2, 4), (4,))}
    else:
        plan = {2: ((1, 2, 4, 8), (4, 8)), 4: ((4, 8), (4, 8))}
        if args.no_pp4:
            del plan[4]
    groups = []
    for pp, (ms, cmp_ms) in plan.items():
        sides = [("fxpar", s, m) for m in ms for s in FX_SCHEDULES if _valid(s, pp, m)]
        sides += [("torch", s, m) for m in cmp_ms for s in TORCH_SCHEDULES if _valid(s, pp, m)]
        g = dict(pp=pp, sides=sides, warmup=args.warmup, steps=args.steps,
                 calibrate=not args.nominal)
        if args.profile:
            g["profile"] = [f"{lib}:{args.profile}:m{cmp_ms[0]}" for lib in ("fxpar", "torch")]
        groups.append(g)
    return groups


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=15, help="measured steps per side")
    ap.add_argument("--warmup", type=int, default=3, help="unmeasured steps per side first")
    ap.add_argument("--quick", action="store_true",
                    help="pp=2 only, m in {2, 4} (torch at m=4), 6 steps after 2 warm-up")
    ap.add_argument("--no-pp4", action="store_true", help="skip the pp=4 group")
    ap.add_argument("--nominal", action="store_true",
                    help="plan on Cluster.local (nominal roofline), not a calibrated cluster")
    ap.add_argument("--profile", choices=tuple(TORCH_SCHEDULES), default=None,
                    help="cProfile rank 0's fxpar and torch steps of this schedule (first compared m)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "pipeline.json"))
    args = ap.parse_args()
    if args.quick:
        args.steps, args.warmup = min(args.steps, 6), 2

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from fxpar.testing import WorkerPool

    t_start = time.perf_counter()
    groups: dict = {}
    for g in _plan_groups(args):
        pp = g["pp"]
        t0 = time.perf_counter()
        print(f"[pp={pp}] {len(g['sides'])} sides x {g['warmup'] + g['steps']} steps, "
              "interleaved ...", flush=True)
        with WorkerPool(pp, timeout=900, start_timeout=300) as pool:
            res = pool.run(run_group, g, timeout=3600)
        rows = _merge(res, g["warmup"])
        groups[f"pp{pp}"] = dict(pp=pp, rows=rows, wall_s=time.perf_counter() - t0,
                                 refined=res[0].get("refined"), cluster=res[0].get("cluster"))
        print(f"[pp={pp}] {time.perf_counter() - t0:.0f} s; calibrated in a model (kernels, "
              f"overheads): {res[0].get('cluster', {}).get('in_model')}", flush=True)

    # ---- (a) fxpar vs torch ---------------------------------------------------------------
    cmp_rows = []
    for g in groups.values():
        rows = g["rows"]
        cmp_ms = sorted({r["m"] for r in rows.values() if r["lib"] == "torch"})
        for m in cmp_ms:
            for sched in FX_SCHEDULES:
                fx, tr = rows.get(f"fxpar:{sched}:m{m}"), rows.get(f"torch:{sched}:m{m}")
                if fx is None:
                    continue
                r = dict(pp=g["pp"], m=m, schedule=sched, fxpar_ms=fx.get("median_ms"),
                         fxpar_error=fx.get("error"), torch_class=TORCH_SCHEDULES.get(sched))
                if tr is not None:
                    r["torch_ms"] = tr.get("median_ms")
                    r["torch_error"] = tr.get("error")
                    if "median_ms" in fx and "median_ms" in tr:
                        r["ratio"] = fx["median_ms"] / tr["median_ms"]
                        r["paired"] = _median([a / b for a, b in zip(fx["samples_ms"],
                                                                      tr["samples_ms"])])
                        r["mins"] = fx["min_ms"] / tr["min_ms"]
                        r["quiet"] = fx["quiet_ms"] / tr["quiet_ms"]
                        r["fxpar_quiet_ms"], r["torch_quiet_ms"] = fx["quiet_ms"], tr["quiet_ms"]
                        if fx["losses"] and tr["losses"]:
                            r["loss_max_abs_diff"] = max(
                                abs(a - b) for a, b in zip(fx["losses"], tr["losses"]))
                cmp_rows.append(r)

    print(f"\n(a) GPT {MODEL}, global batch {BATCH}, AdamW(lr={LR}); gloo ranks x 1 thread; "
          f"medians over {args.steps} steps after {args.warmup} warm-up; every side of one pp "
          "stepped interleaved")
    print(f"{'pp':>2} {'m':>2} {'schedule':<12} {'fxpar ms':>9} {'torch ms':>9} {'fxpar/torch':>12} "
          f"{'paired':>7} {'mins':>6} {'quiet':>6} {'max|dloss|':>11}  torch side")
    for r in cmp_rows:
        fx = "error" if r["fxpar_error"] else f"{r['fxpar_ms']:.1f}"
        if "torch_ms" not in r:
            print(f"{r['pp']:>2} {r['m']:>2} {r['schedule']:<12} {fx:>9} {'-':>9} {'-':>12} "
                  f"{'-':>7} {'-':>6} {'-':>6} {'-':>11}  (no counterpart)")
            continue
        tr = "error" if r.get("torch_error") else f"{r['torch_ms']:.1f}"
        if "ratio" in r:
            dl = f"{r['loss_max_abs_diff']:.2e}" if "loss_max_abs_diff" in r else "-"
            print(f"{r['pp']:>2} {r['m']:>2} {r['schedule']:<12} {fx:>9} {tr:>9} {r['ratio']:>12.3f} "
                  f"{r['paired']:>7.3f} {r['mins']:>6.3f} {r['quiet']:>6.3f} {dl:>11}  {r['torch_class']}")
        else:
            print(f"{r['pp']:>2} {r['m']:>2} {r['schedule']:<12} {fx:>9} {tr:>9} {'-':>12} "
                  f"{'-':>7} {'-':>6} {'-':>6} {'-':>11}  {r['torch_class']}")
        for side in ("fxpar", "torch"):
            e = r.get(f"{side}_error")
            if e:
                print(f"      {side}: {e['type']}: {e['message'][:300]}")
    print("fxpar/torch: ratio of medians (a sample = slowest rank's step); paired: median of "
          "per-step ratios (the two step back to back); mins: ratio of the fastest steps; "
          "quiet: ratio of the medians of each side's fastest third of steps")

    print("\nper-rank breakdown of the compared steps (medians, ms): F/B = compute of this "
          "rank's forward/backward actions (torch: forward_one_chunk/backward_one_chunk, the "
          "last stage's loss in B; zb-h1: B = its I actions, W = its W actions), RECV = "
          "blocking receives (fxpar only: waiting for the neighbour + transfer), OPT = "
          "optimizer step (fxpar only), other = the rest of the step (sends, waiting for them "
          "at the end, loss broadcast, ...; torch: also its receives)")
    for g in groups.values():
        cmp_ms = {r["m"] for r in g["rows"].values() if r["lib"] == "torch"}
        for k, row in g["rows"].items():
            if "rank_breakdown_ms" not in row or row["m"] not in cmp_ms:
                continue
            parts = "  ".join(
                f"r{i}: F {b['F']:.0f} B {b['B']:.0f}" + (f" W {b['W']:.0f}" if b["W"] else "")
                + (f" RECV {b['RECV']:.0f} OPT {b['OPT']:.0f}" if row["lib"] == "fxpar" else "")
                + f" other {b['other']:.0f}"
                for i, b in enumerate(row["rank_breakdown_ms"]))
            print(f"pp={g['pp']} {k:<22} {row['median_ms']:>6.0f}  {parts}")

    # ---- (b) simulator vs measured --------------------------------------------------------
    pred = _predict(groups)
    corr = _corr_summary(pred)
    print("\n(b) predicted vs measured step time (ms). measured: median step (slowest rank); "
          "sim·own: simulator fed with this side's own per-chunk F/B medians + measured p2p + "
          "its optimizer step; sim·cal: the same with chunk times from ONE gpipe side at the "
          "smallest m of this pp, scaled linearly to the microbatch size; plan: "
          "prog.simulate() from the plan's cost model on a cluster calibrated on these ranks "
          "(--nominal: Cluster.local's roofline, judge it by rank); plan·ref: the same plans on "
          "that cluster refined by cluster.refine() on runner.profile() of 1f1b at the smallest "
          "and the largest m and of zb-h1 at the largest (3 of the points); plan·shr: the plan's "
          "units on the calibration with shared cores (calibrate(share_cores=True)); plan·r·s: "
          "that calibration refined on profiles of the same sides planned on it. q_: the same "
          "from the quiet steps only (fastest third of each side's steps).")
    print(f"{'pp':>2} {'m':>2} {'schedule':<12} {'measured':>9} {'sim·own':>8} {'sim·cal':>8} "
          f"{'plan':>8} {'plan·ref':>8} {'plan·shr':>8} {'plan·r·s':>8} {'bubble':>6} | "
          f"{'q_meas':>7} {'q_own':>7} "
          f"{'q_cal':>7}")
    for r in pred:
        print(f"{r['pp']:>2} {r['m']:>2} {r['schedule']:<12} {r['measured_ms']:>9.1f} "
              f"{r['sim_own_ms']:>8.1f} {r.get('sim_cal_ms', float('nan')):>8.1f} "
              f"{r['plan_ms']:>8.1f} {r.get('plan_ref_ms', float('nan')):>8.1f} "
              f"{r.get('plan_shr_ms', float('nan')):>8.1f} {r.get('plan_ref_shr_ms', float('nan')):>8.1f} "
              f"{r['plan_bubble']:>6.2f} | {r['q_measured_ms']:>7.1f} "
              f"{r['q_sim_own_ms']:>7.1f} {r.get('q_sim_cal_ms', float('nan')):>7.1f}")
    for pp, d in corr.items():
        print(f"pp={pp} ({d['points']} points):")
        for c, v in d.items():
            if isinstance(v, dict):
                print(f"  {c:<28} Spearman {v['spearman']:>5.2f} (within one m: "
                      f"{v['spearman_within_m']:>5.2f})   median |rel err| "
                      f"{v['median_rel_err']:>4.0%}   median pred/meas {v['median_pred_over_meas']:.2f}")

    for key, g in groups.items():
        for k, row in g["rows"].items():
            if "profile_rank0" in row:
                print(f"\n--- pp={g['pp']} {k}: cProfile of rank 0's measured steps ---")
                print(row["profile_rank0"])

    total = time.perf_counter() - t_start
    print(f"\ntotal {total:.0f} s")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for g in groups.values():
        for row in g["rows"].values():
            row.pop("profile_rank0", None)
    out.write_text(json.dumps(dict(
        date=datetime.datetime.now().isoformat(timespec="seconds"),
        python=platform.python_version(), torch=torch.__version__, machine=platform.machine(),
        cpus=os.cpu_count(), backend="gloo", threads_per_rank=1,
        model=dict(name="examples.models.GPT", **MODEL), global_batch=BATCH,
        optimizer=f"AdamW(lr={LR})", steps=args.steps,
        warmup=args.warmup, quick=args.quick, total_s=total,
        sample="max over ranks of one step's wall time (barrier before each step), ms",
        order="all sides of one pp interleaved, rotating which goes first",
        comparison=cmp_rows, prediction=pred, correlation=corr, groups=groups), indent=1))
    try:
        shown = out.relative_to(ROOT)
    except ValueError:
        shown = out
    print(f"wrote {shown}")


if __name__ == "__main__":
    main()
