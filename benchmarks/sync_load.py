"""Does compute on the other ranks slow a blocking collective beyond its own time?

The fidelity benchmark under-predicts tp2×dp2 and pipeline plans on 4 gloo ranks sharing
2 cores (``results/fidelity.json``); one hypothesis was that every blocking wait costs the
ranks scheduler time slices, which the unloaded calibration (one call after a barrier,
:func:`fxpar.cluster._time_collective`) cannot see. This measures it directly. Per group
size ``G`` (consecutive ranks, every group at once, as the plans' tp groups run) and GEMM
size ``n``, each rank loops ``reps`` times over

- ``c``: one ``n×n @ n×n`` GEMM alone,
- ``m``: one all-reduce of ``KIB`` KiB in its group alone,
- ``cm``: the GEMM then the all-reduce (what a tp layer does),

and reports per iteration the slowest rank's time, median over runs, with
``excess = cm − c − m``: the time a collective costs under load beyond its unloaded loop
time plus the compute. It also prints the calibrated prediction of the same all-reduce
(``Cluster.calibrate`` on that group size, :func:`fxpar.cost.comm.collective_time`) against
``m``: what the step model charges per collective. Sides are interleaved within each run.

Run: ``.venv/bin/python benchmarks/sync_load.py [--quick]``; writes
``benchmarks/results/sync_load.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

KIB = 4


def _worker(sizes, reps, runs):
    import torch
    import torch.distributed as dist

    from fxpar import Cluster
    from fxpar.cost.comm import collective_time

    world, rank = dist.get_world_size(), dist.get_rank()
    rows = []
    for g in (2, world) if world > 2 else (2,):
        subs = [dist.new_group(list(range(i, i + g))) for i in range(0, world, g)]
        sub = subs[rank // g]
        cal = Cluster.calibrate(sizes=(KIB * 1024, 4 * KIB * 1024), collectives=("all_reduce",),
                                iters=7, group_sizes=[g], compute=False)
        x = torch.ones(KIB * 256)
        predicted = collective_time("all_reduce", x.numel() * 4, tuple(range(g)), cal)
        for n in sizes:
            a = torch.randn(n, n)

            def loop(comp: bool, comm: bool) -> float:
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(reps):
                    if comp:
                        a @ a
                    if comm:
                        dist.all_reduce(x, group=sub)
                t = torch.tensor([(time.perf_counter() - t0) / reps], dtype=torch.float64)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                return t.item()

            loop(True, True)   # warm-up
            samples = {"c": [], "m": [], "cm": []}
            for _ in range(runs):   # interleaved
                samples["c"].append(loop(True, False))
                samples["m"].append(loop(False, True))
                samples["cm"].append(loop(True, True))
            med = {k: statistics.median(v) for k, v in samples.items()}
            rows.append(dict(group=g, n=n, reps=reps, **{f"{k}_ms": v * 1e3 for k, v in med.items()},
                             excess_ms=(med["cm"] - med["c"] - med["m"]) * 1e3,
                             predicted_ms=predicted * 1e3))
        for s in subs:
            dist.destroy_process_group(s)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "sync_load.json"))
    args = ap.parse_args(argv)
    from fxpar.testing import WorkerPool

    sizes, reps, runs = ((64,), 10, 2) if args.quick else ((64, 128, 256), 100, 5)
    t0 = time.perf_counter()
    with WorkerPool(args.world, timeout=600) as pool:
        rows = pool.run(_worker, sizes, reps, runs, timeout=600)[0]
    print(f"{'G':>3} {'n':>5} {'c ms':>8} {'m ms':>8} {'cm ms':>8} {'excess':>8} {'pred m':>8}")
    for r in rows:
        print(f"{r['group']:>3} {r['n']:>5} {r['c_ms']:8.3f} {r['m_ms']:8.3f} {r['cm_ms']:8.3f} "
              f"{r['excess_ms']:8.3f} {r['predicted_ms']:8.3f}")
    if args.quick:
        return 0
    result = dict(benchmark="sync_load", date=time.strftime("%Y-%m-%dT%H:%M:%S"), world=args.world,
                  host=dict(platform=platform.platform(), cpus=os.cpu_count(), load=os.getloadavg()),
                  kib=KIB, wall_s=time.perf_counter() - t0, rows=rows)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
