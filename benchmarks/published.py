"""Every published figure of the four seeds fxpar can express, predicted from the presets'
physics (issue #24 item 4): ``./dev bench published``.

The model of each row is the one its system ran: Megatron-LM's GPT of 2021 (Tables 1 and 2)
wrote the ``s × s`` attention scores out (``GPT(attention="math")``: its fused
scale-mask-softmax still goes through memory), the later systems' models use fused
attention (SDPA; AMSP's HF LLaMA).

Rows (the papers' own configurations, priced by the one step model through the joint search
restricted to them, ``only=``; see ``benchmarks/reproductions.py`` for how each is set up;
the systems that did not overlap data-parallel communication priced without it,
:data:`NO_OVERLAP`; DeepSpeed's ZeRO-3 as it issues its collectives, :data:`DEEPSPEED_ZERO3`):

* Megatron-LM Table 1, 10 rows (TFLOP/s per GPU by its eq. 3);
* Megatron-LM Table 2, ZeRO-3 and PTD-P at 384 / 768 / 1536 GPUs (TFLOP/s per GPU);
* AMSP §VI, MFU of AMSP's own sharding (7B, 13B, 30B), ZeRO-1 (7B) and ZeRO-3 (7B, 13B);
* AxoNN Table III, % of peak of AxoNN, Megatron-LM and ZeRO-3 at 64 ... 1024 GPUs (the AxoNN
  grid and microbatch of each row: the ones ``benchmarks/reproductions.py`` picked by AxoNN's
  own ranking, stored in ``benchmarks/results/reproductions.json``).

**Fit.** The A100 presets' ``gemm_efficiency`` and ``attention_efficiency``
(:class:`fxpar.cluster.Physics`, shared by ``dgx-a100``, ``perlmutter`` and ``a800``) are
fitted on the rows marked ``fit`` (at most a third, :data:`FIT`) by coordinate search on the
median absolute log error; every other parameter is the preset's, with its source. The other
rows are predicted. Printed per row: published, predicted, error; then the held-out median
and worst error against the targets (≤ 8 % median, ≤ 15 % each), the seeds' orderings, and
with ``--auto`` what ``plan="auto"`` predicts for each row's model, cluster and batch.

    python benchmarks/published.py [--auto] [--quick] [--out F]

``--quick``: one pass at the presets' current physics, no fit. Writes
``benchmarks/results/published.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import fxpar  # noqa: E402
import reproductions as R  # noqa: E402
from fxpar.planner.joint import SCHEDULES, search  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "published.json"
A100 = ("dgx-a100", "perlmutter", "a800")
#: the rows the efficiency parameters are fitted on (8 of 37: under a third), one or two per
#: paper and spread over scale; chosen before seeing any error, cheap to price
FIT = {"T1 1.7B", "T1 18.4B", "T1 76.1B", "T2 ptdp 384", "AMSP amsp llama-7b",
       "AxoNN megatron gpt-5b", "AxoNN zero3 gpt-20b", "AxoNN axonn gpt-10b"}
PARAMS = ("gemm_efficiency", "attention_efficiency")
#: Systems whose published runs did not overlap data-parallel communication with compute,
#: priced with ``comm_interference = 1`` (each second of communication the step model hides
#: slows compute by a second: nothing hidden). Not fitted: from the systems' documentation.
#: Megatron-LM as published in 2021 all-reduced its contiguous gradient buffer after the
#: backward (overlapping it came later, ``--overlap-grad-reduce``); DeepSpeed's ZeRO stage 1
#: defaults to ``overlap_comm: false``. AxoNN (§IV), AMSP (§V) and ZeRO-3 (prefetching,
#: ``overlap_comm`` on by default at stage 3) overlap; but see :data:`DEEPSPEED_ZERO3`.
NO_OVERLAP = ("T1 ", "T2 ptdp", "AxoNN megatron", "AMSP zero1")
#: Rows measured with DeepSpeed's ZeRO-3, priced as that runtime issues its collectives
#: (``PlannerOptions(zero_style="deepspeed")``, :data:`fxpar.cost.step.ZERO_STYLES`): one
#: all-gather per parameter tensor (``partition_parameters._allgather_param``), reduce-scatters
#: not overlapped with the backward (AMSP §VI, Fig. 14). Not fitted: from the systems' code
#: and AMSP's traces. Megatron-LM's Table 2 and AxoNN's Table III compare with DeepSpeed's
#: ZeRO-3, AMSP §VI runs DeepSpeed-ZeRO3.
DEEPSPEED_ZERO3 = ("T2 zero3", "AMSP zero3", "AxoNN zero3")
#: Of those, the rows measured with DeepSpeed ≤ 0.5 (Megatron-LM's paper, April 2021), whose
#: collectives took and returned lists of the group's members
#: (``zero_style="deepspeed-list"``: host work per member). By AMSP's (2023) and AxoNN's
#: (2024) runs DeepSpeed gathered into one flat tensor; its ``reduce_scatter_coalesced`` still
#: slices every tensor per member in Python, which is not priced: their ZeRO-3 rows at 1024
#: GPUs stay over-predicted (``published.json``).
DEEPSPEED_LISTS = ("T2 zero3",)
#: How the rows' systems gather the updated parameters after the step (``T_os1``,
#: :data:`fxpar.cost.step.ZERO_STYLES`): AMSP broadcasts them from each optimizer-state owner
#: (AMSP §IV-C2: ``"amsp"``), DeepSpeed's ZeRO-1 all-gathers them in ``allgather_bucket_size``
#: pieces (``"deepspeed"``); the other rows shard no optimizer state beyond their parameters.
STYLES = {"AMSP amsp": "amsp", "AMSP zero1": "deepspeed"}
#: The pipeline schedules a row's system ran, where the row leaves the schedule to the search:
#: Megatron-LM's 1F1B and interleaved 1F1B (the zero-bubble schedules came later). Rows not
#: named here pin their schedule or run no pipeline.
SYSTEM_SCHEDULES = {"AxoNN megatron": R.MEGATRON_SCHEDULES}


@dataclasses.dataclass
class Row:
    name: str
    published: float
    unit: str                    # "TF" (TFLOP/s per GPU) or "%" (of the 312 TFLOP/s peak)
    preset: str
    nodes: int
    model: tuple                 # key into the capture cache
    batch: int
    only: dict | None            # the configuration (None: an AxoNN grid, ``axonn``)
    work: float                  # FLOPs per step the metric divides by
    gpus: int
    axonn: dict | None = None

    @property
    def fit(self) -> bool:
        return self.name in FIT

    @property
    def options(self) -> fxpar.PlannerOptions | None:
        """How the measured runtime issues ZeRO's collectives (:data:`DEEPSPEED_ZERO3`,
        :data:`STYLES`)."""
        style = next((v for k, v in STYLES.items() if self.name.startswith(k)), None)
        if self.name.startswith(DEEPSPEED_ZERO3):
            style = "deepspeed-list" if self.name.startswith(DEEPSPEED_LISTS) else "deepspeed"
        return fxpar.PlannerOptions(zero_style=style) if style else None

    @property
    def schedules(self) -> tuple[str, ...]:
        """The schedules the search may give the row (:data:`SYSTEM_SCHEDULES`)."""
        return next((v for k, v in SYSTEM_SCHEDULES.items() if self.name.startswith(k)),
                    SCHEDULES)

    @property
    def overlap(self) -> bool:
        """The measured system overlaps data-parallel communication with compute
        (:data:`NO_OVERLAP`); False: priced with every hidden second counted."""
        return not self.name.startswith(NO_OVERLAP)

    def metric(self, step: float) -> float:
        per = self.work / step / self.gpus
        return per / 1e12 if self.unit == "TF" else 100 * per / R.PEAK


_GMS: dict = {}


def _capture(key):
    if key not in _GMS:
        kind, *args = key
        if kind == "gpt":
            from examples.models import GPT

            heads, h, l, attention = args
            with torch.device("meta"):
                model = GPT(vocab=R.V, d_model=h, n_heads=heads, n_layers=l, seq_len=R.S,
                            attention=attention).to(torch.bfloat16)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                _GMS[key] = fxpar.capture(model, (torch.zeros(1, R.S, dtype=torch.long, device="meta"),))
        else:
            from transformers import LlamaConfig, LlamaForCausalLM

            h, l, heads, ffn, s = args
            cfg = LlamaConfig(hidden_size=h, num_hidden_layers=l, num_attention_heads=heads,
                              intermediate_size=ffn, vocab_size=32000, max_position_embeddings=s)
            with torch.device("meta"):
                model = LlamaForCausalLM(cfg).to(torch.bfloat16)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                _GMS[key] = fxpar.capture(model, (torch.zeros(1, s, dtype=torch.long, device="meta"),))
    return _GMS[key]


def rows() -> list[Row]:
    out = []
    for name, heads, h, l, t, p, n, B, tf, _ in R.TABLE1:
        out.append(Row(f"T1 {name}", tf, "TF", "dgx-a100", n // 8, ("gpt", heads, h, l, "math"), B,
                       dict(tp=t, pp=p, dp=n // (t * p), recompute=True, s_p=1, s_g=1, s_os=1,
                            schedule="interleaved" if p > 1 else "1f1b"), R.flops(B, l, h), n))
    for n, b, z_tf, p_tf in R.TABLE2:
        key, B, F = ("gpt", 96, 12288, 96, "math"), 1536, R.flops(1536, 96, 12288)
        # in Megatron-LM's codebase of 2021, as PTD-P: every layer recomputed (its only
        # checkpointing; selective recomputation came in 2022), as eq. 3's FLOPs assume
        out.append(Row(f"T2 zero3 {n}", z_tf, "TF", "dgx-a100", n // 8, key, B,
                       dict(tp=1, pp=1, dp=n, microbatch=b, s_p=n, s_g=n, s_os=n, recompute=True),
                       F, n))
        out.append(Row(f"T2 ptdp {n}", p_tf, "TF", "dgx-a100", n // 8, key, B,
                       dict(tp=8, pp=12, dp=n // 96, microbatch=1, schedule="interleaved",
                            recompute=True, s_p=1, s_g=1, s_os=1), F, n))
    n, B, s = 1024, 1024, 4096
    for name, h, l, heads, ffn, own, p_amsp, p_z1, p_z3 in R.AMSP_ROWS:
        key = ("llama", h, l, heads, ffn, s)
        # AMSP §VI (Table IV): full recomputation for LLaMA-30B, none for 7B and 13B
        flat = dict(tp=1, pp=1, dp=n, microbatch=1, recompute=name == "llama-30b")
        work = None  # set after capture (needs the parameter count)
        for sysname, pub, only in (("amsp", p_amsp, dict(flat, s_p=own[0], s_g=own[1], s_os=own[2])),
                                   ("zero1", p_z1, dict(flat, s_p=1, s_g=1, s_os=n)),
                                   ("zero3", p_z3, dict(flat, s_p=n, s_g=n, s_os=n))):
            if pub is not None:
                out.append(Row(f"AMSP {sysname} {name}", pub, "%", "a800", n // 8, key, B, only,
                               work or 0.0, n))
    stored = {r["model"]: r for r in json.loads((ROOT / "benchmarks" / "results"
                                                 / "reproductions.json").read_text())["axonn"]}
    for name, l, h, heads, n, p_meg, p_z3, _, p_ax in R.AXONN_ROWS:
        key, B, F = ("gpt", heads, h, l, "sdpa"), R.AXONN_BATCH, R.flops(R.AXONN_BATCH, l, h)
        ax = stored[name]["axonn"]
        out.append(Row(f"AxoNN axonn {name}", p_ax, "%", "perlmutter", n // 4, key, B, None, F, n,
                       axonn=dict(G=tuple(ax["grid"][a] for a in ("x", "y", "z", "data")),
                                  b=ax["microbatch"], heads=heads, h=h, l=l)))
        out.append(Row(f"AxoNN megatron {name}", p_meg, "%", "perlmutter", n // 4, key, B,
                       dict(tp=4, recompute=True, s_p=1, s_g=1, s_os=1), F, n))
        out.append(Row(f"AxoNN zero3 {name}", p_z3, "%", "perlmutter", n // 4, key, B,
                       dict(tp=1, pp=1, dp=n, s_p=n, s_g=n, s_os=n, recompute=True), F, n))
    return out


def _amsp_work(row: Row) -> float:
    gm = _capture(row.model)
    from fxpar import ir

    phi = sum(i.numel for i in ir.params(gm, "param").values())
    _, h, l, _, _, s = row.model
    return row.batch * s * (6 * phi + 12 * l * h * s)


def cluster(row: Row, physics: dict) -> fxpar.Cluster:
    base = fxpar.Cluster.preset(row.preset, nodes=row.nodes)
    ph = dataclasses.replace(base.physics, **physics) if row.preset in A100 else base.physics
    return dataclasses.replace(base, physics=ph, comm_interference=0.0 if row.overlap else 1.0)


def predict(row: Row, physics: dict, auto: bool = False) -> dict:
    """The row's metric at ``physics`` (and with ``auto``, the search's own best)."""
    cl = cluster(row, physics)
    gm = _capture(row.model)
    if row.model[0] == "llama" and not row.work:
        row.work = _amsp_work(row)
    t0 = time.perf_counter()
    try:
        if row.axonn is not None:
            a = row.axonn
            r = R.axonn_step(a["heads"], a["h"], a["l"], a["G"], cl, row.batch, a["b"])
            step, config = r["step_s"], f"axonn grid {a['G']} b={a['b']}"
        else:
            c = search(gm, cl, batch=row.batch, only=row.only, options=row.options,
                       schedules=row.schedules).best
            step, config = c.step, c.name
    except fxpar.FxparError as e:
        return {"error": str(e)[:200]}
    out = {"predicted": row.metric(step), "step_s": step, "config": config,
           "s": round(time.perf_counter() - t0, 2)}
    if auto:
        try:
            c = search(gm, cl, batch=row.batch).best
            out["auto"] = {"predicted": row.metric(c.step), "step_s": c.step, "config": c.name}
        except fxpar.FxparError as e:
            out["auto"] = {"error": str(e)[:200]}
    return out


def err(pred: float, pub: float) -> float:
    return pred / pub - 1


def fit(rs: list[Row], start: dict) -> tuple[dict, list]:
    """Coordinate search of :data:`PARAMS` on the fit rows' median |log(pred / published)|:
    per parameter a golden-section search on [0.3, 1], one round (the loss is flat in the
    attention efficiency once the GEMM efficiency is set: attention is ≤ 13 % of the FLOPs)."""
    fr = [r for r in rs if r.fit]
    trace = []

    def loss(ph):
        errs = [abs(math.log(predict(r, ph)["predicted"] / r.published)) for r in fr]
        val = statistics.median(errs) + 0.25 * statistics.mean(errs)
        trace.append({**ph, "loss": val})
        print(f"  fit {', '.join(f'{k}={v:.3f}' for k, v in ph.items())}: loss {val:.4f}", flush=True)
        return val

    ph = dict(start)
    g = (math.sqrt(5) - 1) / 2
    for k in PARAMS:
        lo, hi = 0.3, 1.0
        a, b = hi - g * (hi - lo), lo + g * (hi - lo)
        fa, fb = loss({**ph, k: a}), loss({**ph, k: b})
        for _ in range(6):
            if fa <= fb:
                hi, b, fb = b, a, fa
                a = hi - g * (hi - lo)
                fa = loss({**ph, k: a})
            else:
                lo, a, fa = a, b, fb
                b = lo + g * (hi - lo)
                fb = loss({**ph, k: b})
        ph[k] = round((a + b) / 2, 3)
    return ph, trace


def orderings(res: dict) -> dict:
    """The seeds' own orderings, on the predictions."""
    p = {k: v.get("predicted") for k, v in res.items()}
    out = {}
    for name, *_ in R.AXONN_ROWS:
        ax, mg, z3 = (p.get(f"AxoNN {s} {name}") for s in ("axonn", "megatron", "zero3"))
        out[f"axonn fastest {name}"] = bool(ax and all(ax > (o or 0) for o in (mg, z3)))
    out["megatron above zero3 at gpt-80b"] = bool((p.get("AxoNN megatron gpt-80b") or 0)
                                                  > (p.get("AxoNN zero3 gpt-80b") or 0))
    for n, _, z_tf, p_tf in R.TABLE2:
        z, q = p.get(f"T2 zero3 {n}"), p.get(f"T2 ptdp {n}")
        out[f"T2 zero3/ptdp ratio within 0.15 at {n}"] = bool(z and q and abs(z / q - z_tf / p_tf) <= 0.15)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--auto", action="store_true", help="also price plan='auto' per row")
    ap.add_argument("--quick", action="store_true", help="no fit: the presets' physics")
    ap.add_argument("--only", default="", help="comma-separated row-name prefixes")
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    rs = rows()
    if a.only:
        rs = [r for r in rs if any(r.name.startswith(x) for x in a.only.split(","))]
    base = fxpar.Cluster.preset("dgx-a100").physics
    start = {k: getattr(base, k) for k in PARAMS}
    fitted, trace = (start, []) if a.quick else fit(rs, start)
    print(f"physics: {fitted} ({'preset' if a.quick else 'fitted on ' + ', '.join(sorted(FIT))})")
    res = {}
    print(f"{'row':28s} {'pub':>6s} {'pred':>7s} {'err':>7s} {'fit':>4s}  config")
    for r in rs:
        out = predict(r, fitted, auto=a.auto)
        if "predicted" in out:
            out["error"] = err(out["predicted"], r.published)
        res[r.name] = {"published": r.published, "unit": r.unit, "fit": r.fit, **out}
        pr = f"{out['predicted']:7.1f} {100 * out['error']:+6.1f}%" if "predicted" in out else \
            f"{'-':>7s} {'-':>7s}"
        au = (f" | auto {out['auto']['predicted']:.1f} {r.unit} {out['auto']['config']}"
              if a.auto and "predicted" in out.get("auto", {}) else "")
        print(f"{r.name:28s} {r.published:6.1f} {pr} {'fit' if r.fit else '':>4s}  "
              f"{out.get('config', out.get('error', ''))[:70]}{au}", flush=True)
    held = [abs(v["error"]) for v in res.values() if not v["fit"] and "predicted" in v]
    fitted_err = [abs(v["error"]) for v in res.values() if v["fit"] and "predicted" in v]
    order = orderings(res)
    summary = {"held_out_rows": len(held), "fit_rows": len(fitted_err),
               "held_out_median_abs_error": statistics.median(held) if held else None,
               "held_out_max_abs_error": max(held) if held else None,
               "rows_within_15pct": sum(e <= 0.15 for e in held),
               "fit_median_abs_error": statistics.median(fitted_err) if fitted_err else None,
               "orderings": order, "orderings_hold": sum(order.values()), "orderings_total": len(order),
               "total_s": round(time.perf_counter() - t0, 1)}
    if a.auto:
        au = {k: v["auto"]["predicted"] / v["published"] for k, v in res.items()
              if "predicted" in v.get("auto", {})}
        summary["auto_over_published"] = au
        summary["auto_at_least_published"] = sum(x >= 1 for x in au.values())
    print(json.dumps({k: v for k, v in summary.items() if k != "auto_over_published"}, indent=1))
    out = {"benchmark": "published", "physics": fitted, "fit_rows": sorted(FIT), "fit_trace": trace,
           "rows": res, "summary": summary,
           "targets": {"held_out_median_abs_error": 0.08, "every_row_abs_error": 0.15}}
    if not a.only or a.out:
        dest = Path(a.out) if a.out else OUT
        dest.write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {dest}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
