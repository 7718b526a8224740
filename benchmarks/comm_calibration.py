"""Measured collective times on live gloo groups against the calibrated ring model.

For each world size G in (2, 4, 8) a :class:`fxpar.testing.WorkerPool` of G processes:

1. runs :meth:`fxpar.Cluster.calibrate` on the whole group at the *calibration* sizes
   (even powers of two), which fits α and β per collective (:mod:`fxpar.cost.calibration`);
2. measures every collective afresh at the *held-out* sizes (odd powers of two, in between)
   and again at the calibration sizes (a fresh run, not the fitting data), each as the median
   over runs of the slowest rank, the same way the calibration times (runs of back-to-back
   calls lasting ``MIN_TIME``);
3. predicts each with :func:`fxpar.cost.comm.collective_time` on the calibrated cluster, and
   with the uncalibrated ``Cluster.local`` guess for comparison;
4. as a diagnostic of the fitting method, refits the same ring model to the *fresh* run at the
   calibration sizes by relative-error least squares (minimizing ``Σ((t̂ − t)/t)²`` instead of
   the absolute errors :func:`fxpar.cost.calibration.fit_alpha_beta` minimizes) and scores it
   on the held-out sizes too.

Prints the table (collective, G, bytes, measured, predicted, relative error) and writes the
median relative error per G (held-out and fresh in-sample) to
``benchmarks/results/comm_calibration.json``. Timings on a shared 2-core machine are noisy,
8 processes on 2 cores share CPUs, so compare numbers within one run only.

Run: ``.venv/bin/python benchmarks/comm_calibration.py [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

CAL_SIZES = [2**k for k in range(10, 21, 2)]     # 1 KiB .. 1 MiB
HELD_OUT = [2**k for k in range(11, 20, 2)]      # 2 KiB .. 512 KiB, between the fitted points
MIN_TIME = 0.05                                   # Cluster.calibrate's default
COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "all_to_all", "send_recv")


def _worker(cal_sizes, eval_sizes, collectives, iters):
    """Runs on every rank: calibrate, then time fresh and predict. Rank 0 returns the rows."""
    import torch.distributed as dist

    from fxpar import Cluster
    from fxpar.cluster import _group_device, _time_collective
    from fxpar.cost.comm import collective_time

    world = dist.get_world_size()
    t0 = time.perf_counter()
    cal = Cluster.calibrate(sizes=cal_sizes, collectives=collectives, iters=iters, group_sizes=[world],
                            min_time=MIN_TIME)
    t_cal = time.perf_counter() - t0
    nominal = Cluster.local(world)
    group = dist.group.WORLD
    device = _group_device(group)
    fitted = {e.collective for e in cal.profile.entries}
    rows = []
    for coll in collectives:
        if coll not in fitted:  # unsupported by this backend: nothing to compare
            continue
        for split, sizes in (("held_out", eval_sizes), ("fresh", cal_sizes)):
            for nbytes in sizes:
                measured = _time_collective(coll, nbytes, group, world, device, iters, group, MIN_TIME)
                if measured is None:
                    continue
                # the timed buffer is float32 with a length divisible by G (as calibrate sizes it)
                eff = max(world, nbytes // 4 // world * world) * 4
                pred = collective_time(coll, eff, range(world), cal)
                pred_nominal = collective_time(coll, eff, range(world), nominal)
                rows.append(dict(collective=coll, G=world, bytes=eff, split=split, measured=measured,
                                 predicted=pred, rel_err=abs(pred - measured) / measured,
                                 nominal_rel_err=abs(pred_nominal - measured) / measured))
    fits = [dict(collective=e.collective, level=e.level, G=e.group_size, alpha_us=e.latency * 1e6,
                 beta_GBps=e.bandwidth / 1e9, fit_rel_err=e.rel_error) for e in cal.profile.entries]
    return (rows, fits, t_cal) if dist.get_rank() == 0 else None


def _relative_fit(points):
    """``(a, b)`` of ``t = a + b·m`` minimizing relative squared error, both clamped >= 0."""
    import numpy as np

    m = np.array([p[0] for p in points], dtype=float)
    t = np.array([p[1] for p in points], dtype=float)
    A = np.stack([1 / t, m / t], axis=1)
    (a, b), *_ = np.linalg.lstsq(A, np.ones_like(t), rcond=None)
    if a < 0:
        a, b = 0.0, float(np.sum(m / t) / np.sum((m / t) ** 2))
    if b < 0:
        a, b = float(np.median(t)), 0.0
    return float(a), float(b)


def _add_refit(rows):
    """Relative-error refit on the fresh in-sample run, scored on the held-out sizes."""
    for coll in dict.fromkeys(r["collective"] for r in rows):
        fresh = [(r["bytes"], r["measured"]) for r in rows if r["collective"] == coll and r["split"] == "fresh"]
        if len(fresh) < 2:
            continue
        a, b = _relative_fit(fresh)
        for r in rows:
            if r["collective"] == coll:
                pred = a + b * r["bytes"]
                r["refit_predicted"] = pred
                r["refit_rel_err"] = abs(pred - r["measured"]) / r["measured"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", default="2,4,8")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="fewer sizes and iterations (smoke run)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "comm_calibration.json"))
    args = ap.parse_args(argv)

    from fxpar.testing import WorkerPool

    cal_sizes, eval_sizes, iters = CAL_SIZES, HELD_OUT, args.iters
    if args.quick:
        cal_sizes, eval_sizes, iters = CAL_SIZES[::2], HELD_OUT[::2], 3
    worlds = [int(w) for w in args.worlds.split(",")]
    all_rows, all_fits, summary = [], [], {}
    t_start = time.perf_counter()
    for world in worlds:
        t0 = time.perf_counter()
        with WorkerPool(world, timeout=600) as pool:
            rows, fits, t_cal = pool.run(_worker, cal_sizes, eval_sizes, COLLECTIVES, iters, timeout=600)[0]
        _add_refit(rows)
        all_rows += rows
        all_fits += fits
        held = [r["rel_err"] for r in rows if r["split"] == "held_out"]
        refit = [r["refit_rel_err"] for r in rows if r["split"] == "held_out" and "refit_rel_err" in r]
        fresh = [r["rel_err"] for r in rows if r["split"] == "fresh"]
        summary[str(world)] = dict(
            median_rel_err_held_out=statistics.median(held) if held else None,
            median_rel_err_fresh=statistics.median(fresh) if fresh else None,
            median_rel_err_uncalibrated=statistics.median(r["nominal_rel_err"] for r in rows) if rows else None,
            median_rel_err_held_out_relative_refit=statistics.median(refit) if refit else None,
            per_collective={c: statistics.median(r["rel_err"] for r in rows if r["collective"] == c)
                            for c in dict.fromkeys(r["collective"] for r in rows)},
            collectives_fitted=sorted({f["collective"] for f in fits}),
            calibration_s=round(t_cal, 2), total_s=round(time.perf_counter() - t0, 2))

    hdr = f"{'collective':<15}{'G':>3}{'bytes':>10}  {'split':<9}{'measured':>12}{'predicted':>12}{'rel err':>9}"
    print(hdr)
    print("-" * len(hdr))
    for r in all_rows:
        print(f"{r['collective']:<15}{r['G']:>3}{r['bytes']:>10}  {r['split']:<9}"
              f"{r['measured'] * 1e6:>10.1f}us{r['predicted'] * 1e6:>10.1f}us{r['rel_err']:>9.1%}")
    print()
    print("fitted ring model t = steps·α + factor·m/β:")
    for f in all_fits:
        print(f"  {f['collective']:<15} G={f['G']}  α={f['alpha_us']:8.1f} us  β={f['beta_GBps']:7.3f} GB/s"
              f"  (fit error {f['fit_rel_err']:.1%})")
    print()
    print(f"{'G':>3}  {'median rel err (held-out)':>26}  {'(fresh, same sizes)':>20}  {'(uncalibrated)':>15}"
          f"  {'(relative refit, held-out)':>27}")
    for w, s in summary.items():
        fmt = lambda x: "n/a" if x is None else f"{x:.1%}"  # noqa: E731
        print(f"{w:>3}  {fmt(s['median_rel_err_held_out']):>26}  {fmt(s['median_rel_err_fresh']):>20}"
              f"  {fmt(s['median_rel_err_uncalibrated']):>15}  {fmt(s['median_rel_err_held_out_relative_refit']):>27}")
    result = dict(
        benchmark="comm_calibration", when=time.strftime("%Y-%m-%d %H:%M:%S"),
        machine=dict(platform=platform.platform(), cpus=os.cpu_count(), python=sys.version.split()[0]),
        backend="gloo", iters=iters, calibration_sizes=cal_sizes, held_out_sizes=eval_sizes,
        note="median relative error |predicted - measured| / measured of fxpar.cost.comm.collective_time "
             "on the calibrated cluster; one run on a shared machine, noisy",
        median_rel_err_by_G={w: s["median_rel_err_held_out"] for w, s in summary.items()},
        summary=summary, fits=all_fits, rows=all_rows,
        total_s=round(time.perf_counter() - t_start, 1))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"\nwrote {args.out} ({result['total_s']} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
