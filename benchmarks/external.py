"""Published training throughput of systems other than the four seeds, predicted from the
presets' physics with nothing fitted to them (issue #24: "checks outside the project will
compare predictions with published measurements of systems other than the seeds"):
``./dev bench external``.

``benchmarks/published.py`` fits the A100 efficiencies on a third of the seeds' rows and
predicts the rest; these rows test the same physics on other systems' runs, and the H100
preset, which no seed measured, on one published H100 run and on fxpar's own H200 step. Each
row is a configuration the source states, priced by the joint search restricted to it
(``only=``); tokens per second per GPU = ``global batch · sequence / (step · GPUs)``.

Rows (torchtitan, ``docs/performance.md``, eager, no Float8; Llama 3 / 3.1 built from its
config on ``meta``, bf16, sequence 8192, AdamW with fp32 master states):

* **titan 8B 64×A100**: Llama 3 8B, 64 A100-80GB (8 ``dgx-a100`` nodes), FSDP2 over all 64
  (``s_p = s_g = s_os = 64``), local batch 1: 2904 tokens/s/GPU with selective per-layer
  checkpointing, 2973 with selective per-op checkpointing.
* **titan 70B 64×A100**: Llama 3 70B, the same cluster and sharding, full checkpointing,
  local batch 1: 331 tokens/s/GPU.
* **titan 8B 8×H100**: Llama 3.1 8B, 8 H100 (one ``dgx-h100`` node; torchtitan's have 96 GB
  at a 500 W limit, the preset's 80 GB at 700 W), FSDP2 over 8, local batch 2, selective
  checkpointing: 5762 tokens/s/GPU.
* **fxpar H200 step** (``benchmarks/results/gpu.json``, ``sec_speed``): fxpar's own runtime
  on one H200, a 536M Llama (hidden 2048, 8 layers, vocabulary 32000), batch 4 × 2048, bf16
  parameters with fp32 masters: 82.6 ms per step; predicted by ``plan="dp"`` on the
  ``dgx-h100`` preset with the H200's memory and bandwidth (as ``benchmarks/gpu.py`` does).

**Selective checkpointing.** torchtitan's two selective modes are not fxpar's: "per-layer"
recomputes every other layer whole, "per-op" keeps the outputs of every other matmul and of
attention and recomputes the rest; fxpar's selective granularity keeps every GEMM's output
(``recompute="selective"``, :func:`fxpar.cost.memory.selective_keeps`). Both of torchtitan's
recompute more than fxpar's selective and less than full checkpointing, so those rows are
priced three ways: full (a lower bound), fxpar's selective (the upper bound, within the
device's memory) and none (shown; memory ignored where it would not fit). The check is that
the published figure lies between full and selective; the error printed is the nearer
bound's.

    python benchmarks/external.py [--out F]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import fxpar  # noqa: E402
from fxpar.planner.joint import search  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "external.json"
GiB = 2**30
#: Llama shapes: hidden, layers, heads, kv heads, FFN, vocabulary
LLAMA3_8B = (4096, 32, 32, 8, 14336, 128256)
LLAMA3_70B = (8192, 80, 64, 8, 28672, 128256)
#: (name, source, shape, sequence, preset, nodes, global batch, degrees, recomputation
#: ("full", "none" or "selective"), published tokens/s/GPU)
TITAN = "torchtitan docs/performance.md"
ROWS = [
    ("titan 8B 64xA100 sel-layer", TITAN, LLAMA3_8B, 8192, "dgx-a100", 8, 64, 64, "selective", 2904),
    ("titan 8B 64xA100 sel-op", TITAN, LLAMA3_8B, 8192, "dgx-a100", 8, 64, 64, "selective", 2973),
    ("titan 70B 64xA100 full", TITAN, LLAMA3_70B, 8192, "dgx-a100", 8, 64, 64, "full", 331),
    ("titan 8B 8xH100 selective", TITAN, LLAMA3_8B, 8192, "dgx-h100", 1, 16, 8, "selective", 5762),
]
#: fxpar's own step on an H200 (benchmarks/results/gpu.json, sec_speed): ms per step
H200_MS = 82.6


def _capture(shape, seq, cache={}):  # noqa: B006 — one capture per shape
    from transformers import LlamaConfig, LlamaForCausalLM

    key = (shape, seq)
    if key not in cache:
        h, l, heads, kv, ffn, vocab = shape
        cfg = LlamaConfig(hidden_size=h, num_hidden_layers=l, num_attention_heads=heads,
                          num_key_value_heads=kv, intermediate_size=ffn, vocab_size=vocab,
                          max_position_embeddings=seq)
        with torch.device("meta"):
            model = LlamaForCausalLM(cfg).to(torch.bfloat16)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cache[key] = fxpar.capture(model, (torch.zeros(1, seq, dtype=torch.long, device="meta"),))
    return cache[key]


def price(row) -> dict:
    """Tokens/s/GPU of one row; a selective row's bounds (module docstring)."""
    name, source, shape, seq, preset, nodes, batch, dp, rec, pub = row
    gm = _capture(shape, seq)
    cl = fxpar.Cluster.preset(preset, nodes=nodes)
    gpus = nodes * cl.devices_per_node
    only = dict(tp=1, pp=1, dp=dp, s_p=dp, s_g=dp, s_os=dp, microbatch=batch // dp)
    out = dict(source=source, published=pub, preset=preset, gpus=gpus, batch=batch, seq=seq,
               recompute=rec)
    for way in (("full", "selective", "none") if rec == "selective" else (rec,)):
        # no recomputation is priced whatever memory it would take
        opts = fxpar.PlannerOptions(memory_budget=math.inf) if way == "none" else None
        r = {"full": True, "none": False}.get(way, way)
        c = search(gm, cl, batch=batch, only=dict(only, recompute=r), options=opts).best
        out[way] = dict(tokens_per_s=batch * seq / (c.step * gpus), step_s=c.step, config=c.name,
                        memory_gib=c.memory / GiB)
    if rec == "selective":
        lo, hi = out["full"]["tokens_per_s"], out["selective"]["tokens_per_s"]
        out["within_bounds"] = lo <= pub <= hi
        out["error"] = 0.0 if out["within_bounds"] else min((lo / pub - 1, hi / pub - 1), key=abs)
    else:
        out["error"] = out[rec]["tokens_per_s"] / pub - 1
    return out


def price_h200() -> dict:
    """fxpar's H200 step (``benchmarks/gpu.py``'s ``sec_speed`` model and preset)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, layers, heads, vocab, seq, bsz = 2048, 8, 16, 32000, 2048, 4
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                      intermediate_size=int(2.6875 * hidden) // 64 * 64,
                      num_attention_heads=heads, max_position_embeddings=seq)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    ids = torch.zeros(bsz, seq, dtype=torch.long, device="meta")
    cl = dataclasses.replace(fxpar.Cluster.preset("dgx-h100", nodes=1), devices_per_node=1,
                             memory_bandwidth=4800e9, device_memory=140 * GiB)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prog = fxpar.compile(model, cl, (ids,), {"labels": ids}, plan="dp", mesh={"dp": 1},
                             optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-4), emit=False)
    return dict(source="benchmarks/results/gpu.json (sec_speed, fxpar runner on one H200)",
                published_ms=H200_MS, predicted_ms=prog.plan.time * 1e3,
                error=prog.plan.time * 1e3 / H200_MS - 1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    rows = {}
    print(f"{'row':28s} {'published':>9s} {'full AC':>8s} {'sel. AC':>8s} {'no AC':>8s}  error  config")
    for row in ROWS:
        r = rows[row[0]] = price(row)
        tps = [r.get(w, {}).get("tokens_per_s", float("nan")) for w in ("full", "selective", "none")]
        cfg = next(r[w]["config"] for w in ("full", "selective", "none") if w in r)
        print(f"{row[0]:28s} {r['published']:>9.0f} " + " ".join(f"{x:>8.0f}" for x in tps)
              + f" {r['error']:+6.0%}  {cfg}", flush=True)
    h = rows["fxpar H200 step"] = price_h200()
    print(f"{'fxpar H200 step (ms)':28s} {h['published_ms']:>9.1f} {h['predicted_ms']:>8.1f} "
          f"{'':>17s} {h['error']:+6.0%}  plan dp, one device")
    errs = sorted(abs(r["error"]) for r in rows.values())
    summary = dict(rows=len(rows), median_abs_error=errs[len(errs) // 2],
                   max_abs_error=errs[-1], total_s=round(time.perf_counter() - t0, 1),
                   physics={p: dataclasses.asdict(fxpar.Cluster.preset(p).physics)
                            for p in ("dgx-a100", "dgx-h100")})
    print(json.dumps({k: v for k, v in summary.items() if k != "physics"}))
    Path(args.out).write_text(json.dumps(dict(benchmark="external", rows=rows, summary=summary),
                                         indent=1) + "\n")
    print("wrote", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
