"""Llama-3-8B at long context on 8–64 A100s: where context parallelism pays (issue #27 item 4):
``./dev bench long-context``.

For each sequence length (32k, 128k, 256k tokens) and cluster (1, 2, 4, 8 DGX-A100 nodes) the
joint search plans a batch of 8 sequences twice: with context-parallel degrees
(:func:`fxpar.planner.joint.cp_degrees`: 2 ... 32 dividing the sequence and the devices, beside
``tp``, ``pp``, ``dp``, state sharding and recomputation) and without (``cps=(1,)``). Printed
per cell: the winner, its predicted step, tokens/s per GPU and model TFLOP/s per GPU
(``6·P·tokens`` plus causal attention's ``6·l·h·s`` per token, counted as a causal kernel does
— half the unmasked ``12·l·h·s``), its memory, why it has its ``cp``
(:attr:`~fxpar.planner.joint.SearchResult.cp`), how its attentions use ``cp`` (K/V gathered,
ring, Ulysses' heads split) and the best plan without ``cp`` (or that none fits). The model is built on the meta device from Llama-3-8B's config (bf16, GQA 32/8 heads,
vocabulary 128256); nothing is downloaded or run.

    python benchmarks/long_context.py [--quick] [--out F]

``--quick``: 32k and 128k on 8 and 64 GPUs. Writes ``benchmarks/results/long_context.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import fxpar  # noqa: E402
from fxpar.errors import PlanError  # noqa: E402
from fxpar.planner.joint import search  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "long_context.json"
#: Llama-3-8B (Meta's config.json)
LLAMA3_8B = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, intermediate_size=14336, vocab_size=128256,
                 rope_theta=500000.0)
PARAMS = 8.03e9
BATCH = 8


def capture(seq: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**LLAMA3_8B, max_position_embeddings=seq)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    ids = torch.zeros(1, seq, dtype=torch.long, device="meta")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fxpar.capture(model, (ids,), {"labels": ids})


def model_flops_per_token(seq: int) -> float:
    """``6·P`` (forward and backward GEMMs over the parameters) plus causal attention's
    ``6·l·h·s`` (QKᵀ and PV, ``4·h·s`` forward unmasked, halved by the mask, ×3 with backward)."""
    c = LLAMA3_8B
    return 6 * PARAMS + 6 * c["num_hidden_layers"] * c["hidden_size"] * seq


def cell(gm, seq: int, gpus: int) -> dict:
    cluster = fxpar.Cluster.preset("dgx-a100", nodes=gpus // 8)
    out: dict = {"seq": seq, "gpus": gpus, "batch": BATCH}
    for key, cps in (("with_cp", None), ("without_cp", (1,))):
        t0 = time.perf_counter()
        try:
            res = search(gm, cluster, batch=BATCH, cps=cps)
        except PlanError as e:
            out[key] = {"error": str(e).splitlines()[0], "search_s": time.perf_counter() - t0}
            continue
        b = res.best
        tokens = BATCH * seq / b.step
        attention = _attention_layout(res.layouts[b.key]) if b.cp > 1 else ""
        out[key] = {"plan": b.name, "cp": b.cp, "step_s": b.step, "memory_gib": b.memory / 2**30,
                    "tokens_per_s_per_gpu": tokens / gpus,
                    "tflops_per_gpu": tokens * model_flops_per_token(seq) / gpus / 1e12,
                    "attention": attention, "why": res.cp, "tried": res.tried, "over_memory": res.over_memory,
                    "search_s": time.perf_counter() - t0}
    w, wo = out["with_cp"], out["without_cp"]
    if "step_s" in w and "step_s" in wo:
        out["speedup_with_cp"] = wo["step_s"] / w["step_s"]
    return out


def _attention_layout(plan) -> str:
    """How the winner's attentions use cp (axis 0 of its ``{cp, tp}`` table plan): the
    sequence split with K/V gathered, the ring, the heads split (Ulysses) or another."""
    from collections import Counter

    from fxpar.spec import Spec

    ways = Counter()
    for n in plan.nodes:
        if "attention" not in n.op:
            continue
        q, k = (str(Spec.parse(x).placements[0]) for x in n.inputs[:2])
        ways[{("S(2)", "R"): "gathered", ("S(2)", "S(2)"): "ring",
              ("S(1)", "S(1)"): "ulysses"}.get((q, k), f"{q}/{k}")] += 1
    return ", ".join(f"{k} x{v}" for k, v in ways.items())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    seqs = (32768, 131072) if args.quick else (32768, 131072, 262144)
    gpus = (8, 64) if args.quick else (8, 16, 32, 64)
    rows = []
    print(f"{'seq':>7} {'GPUs':>4}  {'plan (with cp)':<58} {'step s':>7} {'tok/s/GPU':>9} "
          f"{'TF/GPU':>6} {'GiB':>5} {'attention':<12}  {'without cp':<52} {'x':>5}")
    for seq in seqs:
        gm = capture(seq)
        for n in gpus:
            r = cell(gm, seq, n)
            rows.append(r)
            w, wo = r["with_cp"], r["without_cp"]
            left = (f"{w['plan']:<58} {w['step_s']:7.2f} {w['tokens_per_s_per_gpu']:9.0f} "
                    f"{w['tflops_per_gpu']:6.0f} {w['memory_gib']:5.1f} {w['attention'][:12]:<12}"
                    if "plan" in w else
                    f"{'no plan: ' + w['error'][:56]:<107}")
            right = (f"{wo['plan'][:52]:<52} {r.get('speedup_with_cp', 0):5.2f}" if "plan" in wo
                     else "nothing fits without cp")
            print(f"{seq:>7} {n:>4}  {left}  {right}", flush=True)
    print()
    for r in rows:
        if r["with_cp"].get("why"):
            print(f"{r['seq']:>7} tokens, {r['gpus']:>2} GPUs: {r['with_cp']['why']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"model": "Llama-3-8B (bf16, meta device)", "batch": BATCH,
                                    "cluster": "dgx-a100 presets", "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
