"""Cross-mesh resharding benchmark (issue #11; the cross-mesh paper's §5.1 microbenchmarks).

**Predicted** (no hardware: :func:`fxpar.cross_mesh_plan` on the ``aws-p3.8xlarge`` preset,
4 V100 per node, NVLink inside, 10 Gb/s between nodes; tensor (1024, 1024, 512) float32 = 2 GiB):

1. one sender to 1–4 receivers in one node, and to 1–4 nodes of 2 receivers (paper §5.1.1);
2. the paper's Table 2 cases (mesh shapes and specs from Alpa's benchmark suite,
   ``benchmark/alpa/resharding/suite.py``; case 8, which that suite copies from case 7, is the
   paper's (2,3)→(3,2) with one replicated slice, "only one broadcast"); case 6 keeps the
   (1024, 1024, 512) tensor, uneven over 3 rows, where Alpa padded.

Per case: predicted time of ``send_recv``, ``allgather`` (Alpa's) and ``broadcast`` (each with
the best schedule), of ``broadcast`` under the paper's ablation orders (``naive``: lowest
holder, index order; ``balanced``: load balance only), the lower bound, and the ratios
broadcast / lower bound and send_recv / broadcast.

**Measured** (``--no-measure`` skips it): 8 gloo processes on this machine, modelled as 2
hosts of 4 (``Cluster.local(8, nodes=2, devices_per_node=4)`` with the α/β of one send between
two ranks measured alone, for both levels: intra- and inter-"host" links are the same shared
memory here). Small tensors; per strategy the median over runs of the slowest rank's time of
:func:`fxpar.runtime.cross_mesh_reshard` (groups made before timing) next to the plan's
prediction. On a few CPU cores shared by 8 processes, gloo's broadcast is not the pipelined
chain the model prices and nothing here has a NIC: the measured column says how the runtime
behaves, not whether the paper's network model is right.

    python benchmarks/crossmesh.py [--no-measure]   # writes benchmarks/results/crossmesh.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fxpar import Cluster, Mesh, cross_mesh_plan  # noqa: E402

SHAPE = (1024, 1024, 512)
STRATS = ("send_recv", "allgather", "broadcast")


def grid(cluster, shape, first_node, names=("x", "y")) -> Mesh:
    """Row i on node ``first_node + i``, the first ``cols`` devices of that node."""
    rows, cols = shape
    dpn = cluster.devices_per_node
    return Mesh.from_devices(cluster, names, [[(first_node + i) * dpn + j for j in range(cols)]
                                              for i in range(rows)])


def row(name, src, sspec, dst, dspec, shape=SHAPE, dtype="float32") -> dict:
    plans = {s: cross_mesh_plan(src, sspec, dst, dspec, shape=shape, dtype=dtype, strategy=s)
             for s in STRATS + ("auto",)}
    b = plans["broadcast"]
    sched = dict(b.schedules)
    lb = b.lower_bound
    return dict(
        case=name, src_mesh=list(src.shape), src_spec=str(sspec), dst_mesh=list(dst.shape),
        dst_spec=str(dspec), shape=list(shape), tasks=len(b.tasks),
        predicted_s={s: plans[s].time for s in STRATS + ("auto",)},
        broadcast_naive_order_s=sched["naive"], broadcast_balanced_only_s=sched["balanced"],
        broadcast_scheduler=b.scheduler, lower_bound_s=lb,
        broadcast_over_bound=b.time / lb if lb else None,
        send_recv_over_broadcast=plans["send_recv"].time / b.time if b.time else None,
        allgather_over_broadcast=plans["allgather"].time / b.time if b.time else None)


def predicted() -> dict:
    c = Cluster.preset("aws-p3.8xlarge", nodes=8)
    one = Mesh.from_devices(c, ["x"], [0])
    single = []
    for r in range(1, 5):
        dst = Mesh.from_devices(c, ["x"], list(range(4, 4 + r)))
        single.append(row(f"1 -> {r} GPU(s) in 1 node", one, "R", dst, "R"))
    for h in range(1, 5):
        dst = grid(c, (h, 2), 1)
        single.append(row(f"1 -> {h} node(s) x 2 GPUs", one, "R", dst, "RR"))
    table2 = [
        ("case1", (2, 4), "S(0)R", (2, 4), "S(0)R"),
        ("case2", (2, 4), "RR", (2, 4), "S(0)R"),
        ("case3", (2, 4), "S(1)R", (2, 4), "S(0)R"),
        ("case4", (2, 4), "S(1)S(1)", (2, 4), "S(0)S(0)"),
        ("case5", (2, 4), "RS(0)", (2, 4), "S(0)R"),
        ("case6", (2, 4), "S(0)R", (3, 4), "S(0)R"),
        ("case7", (1, 4), "RS(0)", (2, 4), "RR"),
        ("case8", (2, 3), "RR", (3, 2), "RR"),
        ("case9", (2, 4), "S(1)R", (2, 4), "S(2)R"),
    ]
    multi = []
    for name, ss, sp, ds, dp in table2:
        src = grid(c, ss, 0)
        dst = grid(c, ds, ss[0])
        multi.append(row(name, src, sp, dst, dp))
    return dict(cluster=c.describe(), one_to_many=single, table2=multi)


def print_table(title: str, rows: list[dict]) -> None:
    print(f"\n{title}")
    head = (f"{'case':<26} {'src':>6} {'spec':>9} {'dst':>6} {'spec':>9} {'tasks':>5} "
            f"{'send_recv':>9} {'allgather':>9} {'bcast':>8} {'b naive':>8} {'b bal.':>8} {'bound':>8} "
            f"{'b/bound':>7} {'sr/b':>6}")
    print(head)
    for r in rows:
        p = r["predicted_s"]
        print(f"{r['case']:<26} {'x'.join(map(str, r['src_mesh'])):>6} {r['src_spec']:>9} "
              f"{'x'.join(map(str, r['dst_mesh'])):>6} {r['dst_spec']:>9} {r['tasks']:>5} "
              f"{p['send_recv']:>9.3f} {p['allgather']:>9.3f} {p['broadcast']:>8.3f} "
              f"{r['broadcast_naive_order_s']:>8.3f} {r['broadcast_balanced_only_s']:>8.3f} "
              f"{r['lower_bound_s']:>8.3f} {r['broadcast_over_bound']:>7.3f} "
              f"{r['send_recv_over_broadcast']:>6.2f}")
    print("(seconds; b naive / b bal.: broadcast under the naive order and load balance only)")


# -- measured -----------------------------------------------------------------------------------
MEASURED = [
    # name, src devices, src spec, dst devices, dst spec, shape
    ("1 -> 3 in one host", [0], "R", [1, 2, 3], "R", (256, 1024)),
    ("1 -> 4 in the other host", [0], "R", [4, 5, 6, 7], "R", (256, 1024)),
    ("1 -> 2 hosts of 2", [0], "R", [[2, 3], [6, 7]], "RR", (256, 1024)),
    ("2x2 S(1)R -> S(0)R (case 3)", [[0, 1], [4, 5]], "S(1)R", [[2, 3], [6, 7]], "S(0)R", (512, 512)),
    ("4 S(0) -> 2x2 RR", [0, 1, 2, 3], "S(0)", [[4, 5], [6, 7]], "RR", (512, 512)),
]


def _measure_worker(iters: int):
    import torch.distributed as dist

    from fxpar.runtime import cross_mesh_reshard
    from fxpar.runtime.redistribute_cross import prepare_cross_mesh
    from fxpar.runtime.redistribute import distribute

    # One machine: every link is the same shared memory, and 8 processes share a few cores, so
    # a pair measured alone (the other ranks wait) is what one transfer of a plan sees. Fit α/β
    # of one send from rank 0 to rank 1 and use them for both modelled levels.
    from fxpar.cost.calibration import fit_alpha_beta

    rank = dist.get_rank()
    sizes, pts = (2**16, 2**18, 2**20, 2**22), []
    for nb in sizes:
        buf = torch.zeros(nb, dtype=torch.uint8)
        ts = []
        for _ in range(8):
            dist.barrier()
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(buf, 1)
            elif rank == 1:
                dist.recv(buf, 0)
            dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            ts.append(dt.item())
        pts.append(statistics.median(ts[1:]))
    alpha, beta, err = fit_alpha_beta("send_recv", 2, sizes, pts)
    c = Cluster.local(8, nodes=2, devices_per_node=4, name="gloo-8-as-2x4",
                      intra_node_latency=alpha, inter_node_latency=alpha,
                      intra_node_bandwidth=beta, inter_node_bandwidth=beta)
    rows = []
    for name, sd, ss, dd, ds, shape in MEASURED:
        src = Mesh.from_devices(c, [f"s{i}" for i in range(torch.tensor(sd).dim())], sd)
        dst = Mesh.from_devices(c, [f"d{i}" for i in range(torch.tensor(dd).dim())], dd)
        full = torch.randn(shape, generator=torch.Generator().manual_seed(0))
        local = distribute(full, ss, src, src.coord(rank)) if rank in src.devices else None
        out_row = dict(case=name, shape=list(shape), bytes=full.numel() * 4, strategies={})
        for st in STRATS + ("auto",):
            plan = cross_mesh_plan(src, ss, dst, ds, shape=shape, strategy=st)
            prepare_cross_mesh(plan)
            ok = True
            times = []
            for it in range(iters + 1):
                dist.barrier()
                t0 = time.perf_counter()
                out = cross_mesh_reshard(plan, local)
                dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                dist.all_reduce(dt, op=dist.ReduceOp.MAX)
                if it:
                    times.append(dt.item())
                if out is not None:
                    ok &= torch.equal(out, distribute(full, ds, dst, dst.coord(rank)))
            flag = torch.tensor([int(ok)])
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            out_row["strategies"][st] = dict(
                measured_s=statistics.median(times), predicted_s=plan.time,
                lower_bound_s=plan.lower_bound, correct=bool(flag.item()),
                task_strategies=sorted({t.strategy for t in plan.tasks}))
        rows.append(out_row)
    return dict(rows=rows, calibration=dict(sizes=sizes, median_s=pts, fit_rel_error=err),
                send_recv_latency_s=alpha, send_recv_bandwidth_Bps=beta) if rank == 0 else None


def measured(iters: int) -> dict:
    from fxpar.testing import WorkerPool

    with WorkerPool(8, timeout=900, start_timeout=600) as pool:
        return pool.run(_measure_worker, iters, timeout=900)[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-measure", action="store_true", help="predicted tables only")
    ap.add_argument("--iters", type=int, default=5)
    args = ap.parse_args()
    t0 = time.perf_counter()
    pred = predicted()
    plan_s = time.perf_counter() - t0
    print(f"predicted on {pred['cluster']}; tensor {SHAPE} float32 (2 GiB); planning all rows took {plan_s:.1f} s")
    print_table("one sender to many receivers (paper §5.1.1)", pred["one_to_many"])
    print_table("Table 2 mesh-to-mesh cases (paper §5.1.2)", pred["table2"])
    result = {"python": platform.python_version(), "torch": torch.__version__, "shape": SHAPE,
              "dtype": "float32", "predicted": pred, "planning_s": plan_s,
              "notes": ("predicted_s: fxpar's cost model on the aws-p3.8xlarge preset, not a measurement; "
                        "measured: 8 gloo CPU processes on one machine treated as 2 hosts of 4, "
                        "median over runs of the slowest rank, next to the prediction on the calibrated "
                        "cluster")}
    if not args.no_measure:
        t0 = time.perf_counter()
        load = os.getloadavg()[0]
        meas = measured(args.iters)
        meas["load_average_1min_before"] = load
        meas["cpus"] = os.cpu_count()
        result["measured"] = meas
        print(f"\nmeasured on 8 gloo ranks as 2 hosts of 4 on {os.cpu_count()} CPUs (load {load:.1f}; "
              f"{time.perf_counter() - t0:.0f} s; calibrated "
              f"send/recv α = {1e6 * (meas['send_recv_latency_s'] or 0):.0f} us, "
              f"β = {(meas['send_recv_bandwidth_Bps'] or 0) / 1e9:.2f} GB/s)")
        print(f"{'case':<30} {'bytes':>9} " + " ".join(f"{s + ' meas/pred ms':>26}" for s in STRATS + ("auto",)))
        for r in meas["rows"]:
            cells = []
            for s in STRATS + ("auto",):
                e = r["strategies"][s]
                cells.append(f"{1e3 * e['measured_s']:>10.2f} / {1e3 * e['predicted_s']:>7.2f}"
                             f"{'' if e['correct'] else ' WRONG':>6}")
            print(f"{r['case']:<30} {r['bytes']:>9} " + " ".join(f"{c:>26}" for c in cells))
    out = ROOT / "benchmarks" / "results" / "crossmesh.json"
    out.write_text(json.dumps(result, indent=1))
    print(f"\nwrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
