"""When a gloo pipeline rank posts its receives: the policies of
:attr:`fxpar.runtime.interpreter.PipelineRunner.prepost` against each other, and against
torch.distributed.pipelining. Measured, not asserted.

The model, split, batch and torch twins are ``benchmarks/pipeline.py``'s (a small
:class:`examples.models.GPT` on ``pp`` gloo processes, one intra-op thread each). Per
(schedule, m) the fxpar runner is built once per policy:

=========  =====================================================================================
policy     receives posted
=========  =====================================================================================
step       all of the step's before its first action (the default, within ``PREPOST_BYTES``)
compute    a compute action's successor's, just before that compute action runs
off        each at its own receive action
=========  =====================================================================================

and torch's schedule of the same name where it has one (left out with ``--no-torch``). All sides of one ``pp``
step **interleaved**, rotating who goes first, a barrier before each step; a sample is the
slowest rank's wall time of one step; ``--warmup`` steps are dropped; medians over ``--steps``.
``paired`` is the median per-step ratio of a side to the ``compute`` side of its (schedule, m)
(the policy before ``step`` was the default). The time each rank spends inside the posting
calls is reported per policy too (``pre_ms``: the median step's sum).

    python benchmarks/prepost.py               # pp = 2 and 4, ~5 min; results/prepost.json
    python benchmarks/prepost.py --pp 2 --steps 10

The machine's cores are shared with other work: compare the rows of one run.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "benchmarks"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

POLICIES = ("step", "compute", "off")
#: (schedule, m) per pipeline width
CASES = {2: [("gpipe", 8), ("1f1b", 4), ("1f1b", 8), ("interleaved", 4), ("interleaved", 8)],
         4: [("1f1b", 4), ("1f1b", 8), ("interleaved", 4), ("interleaved", 8)]}


def run_group(spec: dict) -> dict:
    """One rank's part: build every side, step them interleaved; per side this rank's step
    times and posting times (seconds)."""
    import torch.distributed as dist

    import fxpar
    import pipeline as P
    from examples.models import GPT

    torch.set_num_threads(1)
    rank, pp = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    init = GPT(**P.MODEL)
    g = torch.Generator().manual_seed(1234)
    idx = torch.randint(0, P.MODEL["vocab"], (P.BATCH, P.MODEL["seq_len"]), generator=g)
    tgt = torch.randint(0, P.MODEL["vocab"], (P.BATCH, P.MODEL["seq_len"]), generator=g)
    sides, pre = {}, {}
    for sched, m in spec["cases"]:
        v = P._chunks(sched)
        for policy in POLICIES:
            prog = fxpar.compile(copy.deepcopy(init), fxpar.Cluster.local(pp), (idx,),
                                 loss_fn=P._ce, example_targets=(tgt,), optimizer=P._adamw,
                                 mesh={"pp": pp}, schedule=sched, microbatches=m, chunks=v,
                                 split_points=[f"model.blocks.{x}" for x in P._starts(pp * v)])
            r = prog.runner()
            r.prepost = policy
            key = f"{sched}:m{m}:{policy}"
            calls = pre[key] = []
            post = r._prepost

            def timed(*a, post=post, calls=calls):
                t0 = time.perf_counter()
                post(*a)
                calls.append(time.perf_counter() - t0)
            r._prepost = timed
            sides[key] = r
        if spec["torch"] and sched in P.TORCH_SCHEDULES:
            sides[f"{sched}:m{m}:torch"] = P.TorchSide(sched, copy.deepcopy(init), m, rank, pp, [])
    keys = list(sides)
    times = {k: [] for k in keys}
    pre_steps = {k: [] for k in pre}
    for step in range(spec["warmup"] + spec["steps"]):
        shift = step % len(keys)
        for k in keys[shift:] + keys[:shift]:
            dist.barrier()
            n = len(pre.get(k, ()))
            t0 = time.perf_counter()
            sides[k].step(idx, tgt)
            times[k].append(time.perf_counter() - t0)
            if k in pre:
                pre_steps[k].append(sum(pre[k][n:]))
    return dict(times=times, pre=pre_steps)


def summarize(per_rank: list[dict], warmup: int) -> list[dict]:
    """Rows per side: slowest-rank step medians, paired ratio to the ``compute`` side, the
    slowest rank's median posting time."""
    keys = list(per_rank[0]["times"])
    steps = len(per_rank[0]["times"][keys[0]])
    slow = {k: [max(r["times"][k][i] for r in per_rank) for i in range(warmup, steps)] for k in keys}
    rows = []
    for k in keys:
        sched, m, policy = k.split(":")
        base = slow.get(f"{sched}:{m}:compute")
        row = dict(schedule=sched, m=int(m[1:]), policy=policy,
                   step_ms=statistics.median(slow[k]) * 1e3,
                   vs_compute=statistics.median(slow[k]) / statistics.median(base),
                   paired=statistics.median(a / b for a, b in zip(slow[k], base)))
        if k in per_rank[0]["pre"]:
            row["pre_ms"] = max(statistics.median(r["pre"][k][warmup:]) for r in per_rank) * 1e3
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pp", type=int, nargs="*", default=[2, 4])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--no-torch", dest="torch", action="store_false",
                    help="leave out torch.distributed.pipelining's twins")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "prepost.json"))
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from fxpar.testing import WorkerPool

    t_start = time.perf_counter()
    groups = {}
    for pp in args.pp:
        spec = dict(cases=CASES[pp], steps=args.steps, warmup=args.warmup, torch=args.torch)
        t0 = time.perf_counter()
        with WorkerPool(pp, timeout=900, start_timeout=300) as pool:
            res = pool.run(run_group, spec, timeout=3600)
        rows = summarize(res, args.warmup)
        groups[f"pp{pp}"] = dict(pp=pp, rows=rows, wall_s=time.perf_counter() - t0)
        print(f"\npp={pp} ({time.perf_counter() - t0:.0f} s): slowest rank per step, medians of "
              f"{args.steps} steps")
        print(f"{'schedule':<12}{'m':>3}  {'policy':<8}{'step ms':>9}{'/compute':>10}"
              f"{'paired':>8}{'pre ms':>8}")
        for r in rows:
            pre = f"{r['pre_ms']:8.1f}" if "pre_ms" in r else " " * 8
            print(f"{r['schedule']:<12}{r['m']:>3}  {r['policy']:<8}{r['step_ms']:9.1f}"
                  f"{r['vs_compute']:10.3f}{r['paired']:8.3f}{pre}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(
        benchmark="prepost", date=datetime.datetime.now().isoformat(timespec="seconds"),
        python=platform.python_version(), torch=torch.__version__, cpus=os.cpu_count(),
        backend="gloo", threads_per_rank=1, steps=args.steps, warmup=args.warmup,
        sample="max over ranks of one step's wall time (barrier before each step)",
        order="all sides of one pp interleaved, rotating which goes first",
        total_s=time.perf_counter() - t_start, groups=groups), indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
