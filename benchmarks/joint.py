"""The joint planner end to end (issue #12): ``fxpar.plan(model, cluster, batch)`` with no mesh on
the papers' setups, and user degree tuples through the same cost model.

Rows (time from the call to the finished plan, capture included; building the ``meta`` model
apart as ``model_s``):

* GPT-3 175B (96 layers, hidden 12288, vocab 50304, seq 2048), batch 1536, on 128 ``dgx-a100``
  nodes (1024 GPUs): ``auto``, and Megatron-LM's own configuration (Table 1: ``t=8, p=16,
  d=8``, interleaved, ``b=1``, with recomputation) as a tuple. Target: ``auto`` ≤ 30 s, TP
  inside nodes and PP across them; ``auto`` not predicted slower than the tuple;
* Llama-3-8B (HF ``LlamaConfig``), batch 64 x seq 2048 on 8 ``dgx-a100`` nodes (64 GPUs):
  ``auto`` (target ≤ 5 s).

Per row: planning seconds, the chosen configuration, the search's predicted step (its own
estimate, simulated) and the planned pipeline's predicted step (the chunks' intra-op plans
through the simulator), memory, and the ratio to the tuple. Prints a table, writes
``benchmarks/results/joint.json``.

    python benchmarks/joint.py [--skip-llama] [--only-llama --out joint_llama.json]
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import fxpar  # noqa: E402
from planning import gpt3_175b, llama3_8b  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "joint.json"
MEGATRON_175B = dict(pp=16, dp=8, tp=8, microbatch=1, schedule="interleaved", chunks=2,
                     recompute=True)


def row(name, make, cluster, batch, seq, plan="auto"):
    t0 = time.perf_counter()
    model = make()
    model_s = time.perf_counter() - t0
    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    t1 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = fxpar.plan(model, cluster, (ids,), plan=plan).plan
    plan_s = time.perf_counter() - t1
    search = p.schedule.get("search", {}) if p.stages else {}
    best = search.get("ranked", [{}])[0] if search else {}
    return {"model": name, "devices": cluster.num_devices, "batch": batch, "plan": str(plan),
            "model_s": round(model_s, 2), "plan_s": round(plan_s, 2),
            "config": best.get("name", p.mesh_str), "search_step_s": best.get("step"),
            "planned_step_s": p.time, "memory_gib": p.memory / 2**30,
            "tried": search.get("tried"), "over_memory": search.get("over_memory"),
            "mesh": dict(zip(p.mesh["axis_names"], p.mesh["shape"]))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--skip-llama", action="store_true")
    ap.add_argument("--only-llama", action="store_true", help="the Llama-3-8B row only")
    ap.add_argument("--out", default=None, help="results file name under benchmarks/results/")
    a = ap.parse_args(argv)
    rows = []
    if not a.only_llama:
        a100_128 = fxpar.Cluster.preset("dgx-a100", nodes=128)
        rows = [row("gpt3-175b", gpt3_175b, a100_128, 1536, 2048),
                row("gpt3-175b", gpt3_175b, a100_128, 1536, 2048, plan=MEGATRON_175B)]
    if not a.skip_llama:
        rows.append(row("llama3-8b", llama3_8b, fxpar.Cluster.preset("dgx-a100", nodes=8), 64, 2048))
    if not a.only_llama:
        ref = rows[1]["planned_step_s"]
        for r in rows[:2]:
            r["vs_megatron_tuple"] = r["planned_step_s"] / ref
    print(f"{'model':10} {'plan':>8} {'plan s':>7} {'search step':>12} {'planned step':>13} "
          f"{'GiB':>6}  config")
    for r in rows:
        ss = f"{r['search_step_s']:.2f}" if r["search_step_s"] else "-"
        print(f"{r['model']:10} {('tuple' if r['plan'] != 'auto' else 'auto'):>8} {r['plan_s']:7.1f} "
              f"{ss:>12} {r['planned_step_s']:13.2f} {r['memory_gib']:6.1f}  {r['config']}")
    out = {"benchmark": "joint", "rows": rows, "cpus": __import__("os").cpu_count(),
           "load": __import__("os").getloadavg()[0],
           "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
           "targets": {"gpt3_175b_auto_s": 30, "llama3_8b_auto_s": 5,
                       "auto_not_slower_than_megatron_tuple": True}}
    path = OUT.parent / a.out if a.out else OUT
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():  # hand-written notes (before/after) survive a re-run
        notes = json.loads(path.read_text()).get("notes")
        if notes is not None:
            out["notes"] = notes
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
