"""Planning time of every tiny causal-LM architecture of the HF sweep, in one process (#32
item 3: "plan every tiny model of the sweep in under 5 s").

Each architecture is built tiny (``tests/hf_models.py``, as ``./dev bench hf-sweep``) and
captured once; then ``fxpar.compile(..., plan, mesh, graph=gm, time_limit=20)`` is timed
(no process group: this process plans; ``total_s`` includes building the problem, solving it,
the plan and the rank graphs). The sweep's own ``plan_s`` is measured on 4 gloo ranks; this is
the planner alone, without other processes on the cores. Prints one row per architecture
(slowest first) and writes ``benchmarks/results/hf_plan_time.json``.

    ./dev bench hf-plan-time                        # every architecture, plan auto on dp2 x tp2
    ./dev bench hf-plan-time --only kimi_linear,qwen4_exp --plans auto,megatron
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

MESHES = {"auto": {"dp": 2, "tp": 2}, "megatron": {"dp": 2, "tp": 2}, "dp": {"dp": 4},
          "zero3": {"dp": 4}, "auto-tp4": {"tp": 4}}
TARGET_S = 5.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="comma-separated model types (default: all)")
    ap.add_argument("--plans", default="auto", help=f"comma-separated, of {sorted(MESHES)}")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/hf_plan_time.json"))
    a = ap.parse_args()
    warnings.filterwarnings("ignore")
    os.environ.setdefault("PYTHONHASHSEED", "0")
    import torch
    import fxpar
    import hf_models as H

    archs = [t for t in a.only.split(",") if t] or H.model_types()
    plans = [p for p in a.plans.split(",") if p]
    rows, skipped = [], {}
    t_all = time.perf_counter()
    for arch in archs:
        try:
            model, ids, kw = H.build(arch)
            gm = fxpar.capture(model, (ids,), kw)
        except Exception as e:  # noqa: BLE001 - recorded: the sweep reports these
            skipped[arch] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
            continue
        for plan in plans:
            t0 = time.perf_counter()
            row = dict(arch=arch, plan=plan, nodes=len(gm.graph.nodes))
            try:
                prog = fxpar.compile(model, H.cluster("local", 4), (ids,), kw,
                                     plan=plan.split("-")[0], mesh=MESHES[plan], time_limit=20,
                                     graph=gm)
                st = prog.plan.stats
                row.update(build_s=round(st.get("build_s", 0.0), 3),
                           solve_s=round(st.get("solve_s", 0.0), 3))
            except Exception as e:  # noqa: BLE001 - recorded per row
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
            row["total_s"] = round(time.perf_counter() - t0, 3)
            rows.append(row)
            print(f"{arch:26s} {plan:9s} {row['nodes']:6d} nodes {row['total_s']:7.2f} s"
                  f"{'  ' + row['error'] if 'error' in row else ''}", flush=True)
    rows.sort(key=lambda r: -r["total_s"])
    over = [f"{r['arch']} ({r['plan']}) {r['total_s']:.1f} s" for r in rows if r["total_s"] > TARGET_S]
    print(f"\n{len(rows)} plans, slowest: " + ", ".join(
        f"{r['arch']} {r['total_s']:.1f} s" for r in rows[:5]))
    print(f"over {TARGET_S:.0f} s: {', '.join(over) or 'none'}")
    out = dict(benchmark="hf_plan_time", plans=plans, meshes={p: MESHES[p] for p in plans},
               cluster="Cluster.local(4)", time_limit_s=20, target_s=TARGET_S,
               machine=dict(cpus=os.cpu_count(), torch=torch.__version__),
               wall_s=round(time.perf_counter() - t_all, 1), over_target=over, rows=rows,
               skipped=skipped)
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
