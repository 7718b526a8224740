"""The one step model (issue #23): does the joint search's number for its pick equal the
realized plan's ``Plan.time``, and is realized ``auto`` never slower than a realized baseline?

Rows (models built on ``meta`` in bf16, planning only):

* GPT-5B shape (HF GPT-2 layout, 24 layers, hidden 4096, vocab 51200), batch 32 x 2048 on 16
  ``perlmutter`` nodes (64 A100): ``auto``, ``alpa``, ``amsp``;
* Llama-3-8B (HF ``LlamaConfig``), batch 64 x 2048 on 8 ``dgx-a100`` nodes: ``auto``, ``amsp``;
* Llama-3-70B shape, batch 64 x 2048 on 8 ``dgx-a100`` nodes: ZeRO-3 with full recomputation
  as a user tuple (the search accepted it, the intra-op planner used to refuse it).

Per row: planning seconds, the configuration, the search's step for it, the realized
``Plan.time`` and their ratio (target: within 2%), memory. Runs under any fxpar checkout
(``--tag`` names it), so an old checkout can be timed beside the new one, interleaved::

    python benchmarks/step_model.py [--rows gpt5b,llama8b,llama70b] [--tag new]

Writes ``benchmarks/results/step_model[_TAG].json``.
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
sys.path.insert(0, str(ROOT / "benchmarks"))

import fxpar  # noqa: E402

OUT = ROOT / "benchmarks" / "results"


def gpt5b():
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_embd=4096, n_layer=24, n_head=32, n_positions=2048, vocab_size=51200,
                     attn_pdrop=0, resid_pdrop=0, embd_pdrop=0)
    with torch.device("meta"):
        return GPT2LMHeadModel(cfg).to(torch.bfloat16)


def llama(hidden, layers, heads, kv, inter, vocab=128256):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv, intermediate_size=inter, vocab_size=vocab,
                      max_position_embeddings=8192)
    with torch.device("meta"):
        return LlamaForCausalLM(cfg).to(torch.bfloat16)


ZERO3_RC = dict(pp=1, tp=1, s_p=64, s_g=64, s_os=64, recompute=True)
ROWS = {
    "gpt5b": (gpt5b, ("perlmutter", 16), 32, ["auto", "alpa", "amsp"]),
    "llama8b": (lambda: llama(4096, 32, 32, 8, 14336), ("dgx-a100", 8), 64, ["auto", "amsp"]),
    "llama70b": (lambda: llama(8192, 80, 64, 8, 28672), ("dgx-a100", 8), 64, [ZERO3_RC]),
}


def run(name: str) -> list[dict]:
    make, (preset, nodes), batch, kinds = ROWS[name]
    cluster = fxpar.Cluster.preset(preset, nodes=nodes)
    ids = torch.zeros(batch, 2048, dtype=torch.long, device="meta")
    out = []
    for kind in kinds:
        model = make()
        t0 = time.perf_counter()
        try:
            p = fxpar.plan(model, cluster, (ids,), plan=kind).plan
        except fxpar.FxparError as e:
            out.append({"model": name, "plan": str(kind), "error": str(e).splitlines()[0][:300]})
            continue
        plan_s = time.perf_counter() - t0
        best = p.schedule["search"]["ranked"][0]
        out.append({"model": name, "plan": str(kind), "plan_s": round(plan_s, 2),
                    "config": best["name"], "search_step_s": best["step"],
                    "plan_time_s": p.time, "ratio": p.time / best["step"],
                    "memory_gib": p.memory / 2**30})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--tag", default="")
    a = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    rows = [r for name in a.rows.split(",") for r in run(name)]
    print(f"{'model':9} {'plan':>8} {'plan s':>7} {'search ms':>10} {'Plan.time ms':>12} "
          f"{'ratio':>6} {'GiB':>6}  config")
    for r in rows:
        if "error" in r:
            print(f"{r['model']:9} {r['plan'][:8]:>8}  error: {r['error'][:100]}")
            continue
        print(f"{r['model']:9} {r['plan'][:8]:>8} {r['plan_s']:7.1f} {r['search_step_s'] * 1e3:10.1f} "
              f"{r['plan_time_s'] * 1e3:12.1f} {r['ratio']:6.3f} {r['memory_gib']:6.1f}  {r['config']}")
    path = OUT / (f"step_model_{a.tag}.json" if a.tag else "step_model.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"benchmark": "step_model", "tag": a.tag, "rows": rows,
                                "load": os.getloadavg()[0], "cpus": os.cpu_count()}, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
