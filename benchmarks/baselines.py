"""Predicted step time of ``auto`` next to the ``dp``, ``zero3``, ``megatron`` and ``axonn``
baselines, for a GPT and a Llama shape on three cluster presets (64 devices each).

Every number comes from the one cost model of :mod:`fxpar.planner` (roofline compute on local
shapes, resharding/collective times on the mesh, model-state + activation memory per
device); the real strategy rules (``fxpar.strategies.strategies_for``) throughout. Models are
built on ``meta`` and captured once; each (model, cluster) pair is then planned:

* ``auto``: ``fxpar.plan(...)`` with its own mesh search (:func:`fxpar.planner.candidate_meshes`:
  ``(dp=64)``, ``(dp, tp)`` for ``tp`` = 2 .. devices per node, and AxoNN's grid);
* each baseline on its own default mesh (:func:`fxpar.planner.baseline_mesh`) with its pins;
  ``axonn`` tries AxoNN's ranked grids in order and keeps the first that fits.

A baseline that does not fit device memory (or whose pins cannot be met) is recorded as
``null`` with the planner's reason. ``auto`` is never worse than a baseline: every baseline's
mesh is among ``auto``'s candidates and ``auto`` is the same program on that mesh without the
pins, so a larger feasible set; the script checks it and lists any violation. The one way it
can happen: ``axonn`` fell back to a lower-ranked grid (its first ran out of memory) that
``auto`` did not try; the JSON records each mesh ``auto`` tried.

Shapes: ``gpt-20b`` is ``examples.models.GPT`` with AxoNN's GPT-20B sizes (hidden 7168, 56
heads, 32 layers, vocab 50304); ``llama3-8b`` is HF ``LlamaForCausalLM`` with Llama-3-8B sizes
(hidden 4096, 32 layers, 32/8 heads, intermediate 14336, vocab 128256), both in bf16
(activations 2 B/element; model states are 16 B/parameter, Adam in mixed precision). Batch
64 sequences of 2048 tokens (one step), so data parallelism over 64 devices is possible.
Memory is the planner's: model states plus every saved activation of the whole step (no
microbatching, recomputation or pipeline stages yet), so large batches exceed 40 GB devices. Presets:
``dgx-a100`` x8 nodes (8 x A100-80GB), ``perlmutter`` x16 (4 x A100-40GB), ``frontier`` x8
(8 GCDs, 64 GB).

    python benchmarks/baselines.py [--layers 32] [--time-limit 30] [--models gpt-20b,llama3-8b]

Prints a table (ms per step; ``-`` = does not fit) and writes
``benchmarks/results/baselines.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import fxpar  # noqa: E402
from fxpar.api import plan  # noqa: E402

BASELINES = ("dp", "zero3", "megatron", "axonn")
PRESETS = (("dgx-a100", 8), ("perlmutter", 16), ("frontier", 8))


def gpt_20b(layers: int):
    from examples.models import GPT

    with torch.device("meta"):
        return GPT(vocab=50304, d_model=7168, n_heads=56, n_layers=layers,
                   seq_len=2048).to(torch.bfloat16)


def llama3_8b(layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=4096, num_hidden_layers=layers, num_attention_heads=32,
                      num_key_value_heads=8, intermediate_size=14336, vocab_size=128256,
                      max_position_embeddings=8192)
    with torch.device("meta"):
        return LlamaForCausalLM(cfg).to(torch.bfloat16)


MODELS = {"gpt-20b": gpt_20b, "llama3-8b": llama3_8b}


def _mesh(p) -> dict:
    return dict(zip(p.mesh["axis_names"], p.mesh["shape"]))


def run_pair(model, gm, cluster, time_limit: float) -> dict:
    row: dict = {}
    t0 = time.perf_counter()
    try:
        res = plan(model, cluster, graph=gm, time_limit=time_limit)
        row["auto"] = {"ms": res.plan.time * 1e3, "mesh": _mesh(res.plan),
                       "memory_gib": res.plan.memory / 2**30, "status": res.plan.status,
                       "tried": [[m, t * 1e3] for m, t in res.tried]}
    except fxpar.FxparError as e:
        row["auto"] = {"ms": None, "reason": str(e)[:400]}
    row["auto"]["plan_s"] = time.perf_counter() - t0
    for kind in BASELINES:
        t1 = time.perf_counter()
        try:
            p = plan(model, cluster, graph=gm, plan=kind, time_limit=time_limit).plan
            row[kind] = {"ms": p.time * 1e3, "mesh": _mesh(p), "memory_gib": p.memory / 2**30,
                         "status": p.status}
        except fxpar.FxparError as e:
            row[kind] = {"ms": None, "reason": str(e)[:400]}
        row[kind]["plan_s"] = time.perf_counter() - t1
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--time-limit", type=float, default=30.0)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--presets", default=",".join(f"{p}:{n}" for p, n in PRESETS))
    ap.add_argument("--out", default="baselines.json")
    a = ap.parse_args()
    t_start = time.perf_counter()
    results, violations = [], []
    for name in a.models.split(","):
        t0 = time.perf_counter()
        model = MODELS[name](a.layers)
        ids = torch.zeros(a.batch, 2048, dtype=torch.long, device="meta")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            gm = fxpar.capture(model, (ids,))
        cap = time.perf_counter() - t0
        for spec in a.presets.split(","):
            preset, nodes = spec.split(":")
            cluster = fxpar.Cluster.preset(preset, nodes=int(nodes))
            row = run_pair(model, gm, cluster, a.time_limit)
            row.update(model=name, preset=preset, nodes=int(nodes), devices=cluster.num_devices,
                       layers=a.layers, batch=a.batch, seq=2048, capture_s=cap)
            auto = row["auto"]["ms"]
            for kind in BASELINES:
                b = row[kind]["ms"]
                if auto is not None and b is not None and auto > b * (1 + 1e-9):
                    violations.append(f"{name} on {preset}: auto {auto:.4g} ms > {kind} {b:.4g} ms")
                if auto is None and b is not None:
                    violations.append(f"{name} on {preset}: auto failed but {kind} planned")
            results.append(row)
            print(_line(row), flush=True)
    print()
    print(_table(results))
    if violations:
        print("\nauto worse than a baseline:\n  " + "\n  ".join(violations))
    out = {"results": results, "violations": violations, "time_limit": a.time_limit,
           "total_s": time.perf_counter() - t_start, "load": os.getloadavg()[0],
           "cpus": os.cpu_count()}
    path = ROOT / "benchmarks" / "results" / a.out
    path.write_text(json.dumps(out, indent=1, sort_keys=True))
    print(f"wrote {path} ({out['total_s']:.0f} s)")


def _cell(r: dict) -> str:
    return "-" if r["ms"] is None else f"{r['ms']:.1f}"


def _line(row: dict) -> str:
    return (f"{row['model']} on {row['preset']} x{row['nodes']}: auto {_cell(row['auto'])} ms "
            f"({row['auto'].get('mesh')}, {row['auto']['plan_s']:.1f} s); "
            + ", ".join(f"{k} {_cell(row[k])}" for k in BASELINES))


def _table(rows: list[dict]) -> str:
    head = f"{'model':10} {'cluster':14} {'auto ms':>9} {'auto mesh':24}" + "".join(
        f" {k + ' ms':>12}" for k in BASELINES)
    lines = [head, "-" * len(head)]
    for r in rows:
        mesh = ",".join(f"{k}={v}" for k, v in (r["auto"].get("mesh") or {}).items())
        lines.append(f"{r['model']:10} {r['preset'] + ' x' + str(r['nodes']):14} "
                     f"{_cell(r['auto']):>9} {mesh:24}"
                     + "".join(f" {_cell(r[k]):>12}" for k in BASELINES))
    lines.append("(- : does not fit device memory or its pins cannot be met; reasons in the JSON)")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
