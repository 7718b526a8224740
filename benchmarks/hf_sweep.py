"""Hugging Face sweep (issue #32): every causal-LM architecture of the installed transformers
(``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``), built tiny from its own config class
(:mod:`tests.hf_models`: 2 layers, hidden 64, 4 heads, 8 experts where it has them, dropouts
0, float32), trained 2 AdamW steps on 4 gloo ranks under ``auto`` (``{"dp": 2, "tp": 2}``),
``dp`` (``{"dp": 4}``) and ``megatron`` (``{"dp": 2, "tp": 2}``) and compared with the same
model trained in one process (each step's loss, then every parameter). ``--plans`` also takes
``zero3`` (``{"dp": 4}``) and ``auto-tp4`` (``auto`` on ``{"tp": 4}``).

The cluster is ``Cluster.local(4)``, as the parity tests (``--cluster free``: nearly free
communication, where the planner shards even these tiny models wherever it saves compute).
Per architecture and plan: capture time, planning time (``fxpar.compile`` on the captured
graph, ``time_limit`` 20 s; the solver's part apart), training time, and the class:

* ``parity``: every loss and the final parameters match the one-process run;
* ``wrong``: it trained, but a loss is NaN or differs (or a parameter does);
* ``error``: an exception (its first line), a time-out, or a rank that died or hung;
* ``eager-fails``: one forward + backward of the tiny model fails in one process; not
  counted (as the issue did).

Prints a table and the counts per plan; writes ``benchmarks/results/hf_sweep.json`` (after
every architecture, so a run cut short keeps what it did).

    ./dev bench hf-sweep                           # every architecture, all three plans (long)
    ./dev bench hf-sweep --plans auto              # one plan
    ./dev bench hf-sweep --only llama,gpt2,mixtral # some architectures
    ./dev bench hf-sweep --sample                  # the 20 the suite runs (tests/test_hf_sweep.py)
    ./dev bench hf-sweep --limit 10                # the first 10 (sorted)
    ./dev bench hf-sweep --resume --plans dp,megatron --sample   # add to the JSON already there
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the harness lives in tests/ (tests/hf_models.py)
from fxpar.testing import WorkerPool
from tests import hf_models as H

OUT = Path(__file__).resolve().parent / "results" / "hf_sweep.json"


def _commit() -> str:
    """The checkout's commit (``+dirty`` with uncommitted changes to tracked files);
    ``FXPAR_SWEEP_COMMIT`` names it for a run from an exported copy of the tree (other work
    in progress in a shared checkout stays out of the record)."""
    if os.environ.get("FXPAR_SWEEP_COMMIT"):
        return os.environ["FXPAR_SWEEP_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, cwd=ROOT, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, cwd=ROOT,
                               check=True).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _eager(arch: str, timeout: float) -> str:
    """:func:`tests.hf_models.eager_check` in this process, under an alarm."""
    def alarm(signum, frame):
        raise TimeoutError(f"eager step took longer than {timeout:.0f} s")

    old = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        return H.eager_check(arch)
    except TimeoutError as e:
        return str(e)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _cell(r: H.Result | None) -> str:
    if r is None:
        return "-"
    if r.outcome == "eager-fails":
        return "eager-fails"
    t = f" {r.plan_s:.1f}s" if r.plan_s is not None else ""
    return f"{r.outcome}{t}"


def _dumps(data: dict) -> str:
    """JSON with one result per line (diffs line by line)."""
    head = json.dumps({k: v for k, v in data.items() if k != "results"}, indent=1)
    rows = ",\n".join(json.dumps(r, separators=(",", ":")) for r in data["results"])
    return head[:-2] + ',\n "results": [\n' + rows + "\n ]\n}\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="comma-separated model types (default: all)")
    ap.add_argument("--sample", action="store_true",
                    help="the suite's 20 architectures (tests.hf_models.SAMPLE)")
    ap.add_argument("--plans", default=",".join(H.PLANS), help="comma-separated, of "
                    + ", ".join(H.MESHES))
    ap.add_argument("--limit", type=int, default=0, help="the first N architectures (sorted)")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--time-limit", type=float, default=20.0, help="the solver's, per plan")
    ap.add_argument("--timeout", type=float, default=300.0,
                    help="seconds per architecture and plan (on every rank)")
    ap.add_argument("--cluster", default="local", choices=("local", "free"),
                    help="local: Cluster.local(4), as the parity tests; free: nearly free "
                    "communication (the planner shards wherever it saves compute)")
    ap.add_argument("--eager-timeout", type=float, default=120.0)
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--resume", action="store_true",
                    help="keep the results in --out that this run does not redo")
    a = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    import transformers

    transformers.logging.set_verbosity_error()

    plans = [p.strip() for p in a.plans.split(",") if p.strip()]
    bad = [p for p in plans if p not in H.MESHES]
    if bad:
        raise SystemExit(f"unknown plan(s) {bad}; of {list(H.MESHES)}")
    every = H.model_types()
    archs = ([t.strip() for t in a.only.split(",") if t.strip()] if a.only else
             list(H.SAMPLE) if a.sample else every)
    unknown = [t for t in archs if t not in every]
    if unknown:
        raise SystemExit(f"not causal-LM model types of transformers "
                         f"{transformers.__version__}: {unknown}")
    archs = sorted(archs)[:a.limit] if a.limit else sorted(archs)
    out_path = Path(a.out)
    todo = {(t, p) for t in archs for p in plans}
    kept: list[dict] = []
    runs: list[dict] = []
    if a.resume and out_path.exists():
        old = json.loads(out_path.read_text())
        if old.get("config", {}).get("cluster_kind", "local") != a.cluster:
            raise SystemExit(f"--resume: {out_path} is for --cluster "
                             f"{old['config'].get('cluster_kind')}; this run is {a.cluster}")
        kept = [r for r in old.get("results", []) if (r["arch"], r["plan"]) not in todo]
        runs = old.get("runs", [])
    t0 = time.monotonic()
    this_run = {"commit": _commit(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                "archs": len(archs), "plans": plans, "wall_s": 0.0,
                "loadavg_1m_start": round(os.getloadavg()[0], 2)}
    runs.append(this_run)
    results: list[H.Result] = []
    fields = set(H.Result.__dataclass_fields__)

    def everything() -> list[H.Result]:
        old = []
        for rec in kept:
            r = H.Result(**{k: v for k, v in rec.items() if k in fields})
            if "trace" in rec:
                r.__dict__["trace"] = rec["trace"]
            old.append(r)
        return sorted(old + results, key=lambda r: (r.arch, list(H.MESHES).index(r.plan)))

    def dump(final: bool) -> dict:
        this_run["wall_s"] = round(time.monotonic() - t0, 1)
        allr = everything()
        data = {
            "benchmark": "hf_sweep",
            "config": {"cluster_kind": a.cluster, "world": H.WORLD,
                       "meshes": dict(H.MESHES),
                       "model": {"layers": H.LAYERS, "hidden": H.HIDDEN, "heads": H.HEADS,
                                 "kv_heads": H.KV_HEADS, "head_dim": H.HEAD_DIM,
                                 "intermediate": H.INTER, "vocab": H.VOCAB,
                                 "experts": H.EXPERTS, "top_k": H.TOP_K, "dtype": "float32"},
                       "batch": [H.BATCH, H.SEQ], "steps": a.steps,
                       "optimizer": "AdamW(lr=1e-2, eps=1e-5)",
                       "cluster": ("Cluster.local(4)" if a.cluster == "local" else
                                   "Cluster.local(4) with 1e15 B/s links and zero latency"),
                       "loss_rtol": H.RTOL, "loss_atol": H.ATOL, "param_tol": H.PARAM_TOL,
                       "time_limit_s": a.time_limit, "timeout_s": a.timeout},
            "transformers": transformers.__version__,
            "architectures": len(every),
            "complete": final and len(results) == len(todo),
            "wall_s": round(sum(r["wall_s"] for r in runs), 1),
            "runs": runs,
            "machine": {"python": platform.python_version(), "torch": torch.__version__,
                        "cpus": os.cpu_count()},
            "summary": H.summarize(allr),
            "eager_fails": {r.arch: r.error for r in allr if r.outcome == "eager-fails"},
            "results": H.to_json(allr),
        }
        out_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = out_path.with_suffix(".tmp")
        tmp.write_text(_dumps(data))
        tmp.replace(out_path)
        return data

    print(f"{len(archs)} architectures x {len(plans)} plans ({', '.join(plans)}), "
          f"transformers {transformers.__version__}", flush=True)
    hdr = f"{'architecture':26} " + " ".join(f"{p:>18}" for p in plans) + f" {'wall':>6}"
    print(hdr + "\n" + "-" * len(hdr), flush=True)
    try:
        with WorkerPool(H.WORLD, timeout=120, start_timeout=300) as pool:
            for arch in archs:
                ta = time.monotonic()
                why = _eager(arch, a.eager_timeout)
                row = {}
                for p in plans:
                    r = (H.eager_result(arch, p, why) if why else
                         H.run_arch(pool, arch, p, steps=a.steps, time_limit=a.time_limit,
                                    timeout=a.timeout, cluster_kind=a.cluster))
                    results.append(r)
                    row[p] = r
                print(f"{arch:26} " + " ".join(f"{_cell(row[p]):>18}" for p in plans)
                      + f" {time.monotonic() - ta:5.0f}s", flush=True)
                for p in plans:
                    if row[p].outcome not in ("parity", "eager-fails"):
                        print(f"    {p}: {row[p].outcome}: {row[p].error}", flush=True)
                if why:
                    print(f"    eager: {why}", flush=True)
                dump(False)
    except BaseException:
        dump(False)
        print(f"sweep stopped after {len(results)} results; wrote {out_path}", flush=True)
        raise
    data = dump(True)
    print()
    print(f"{'plan':10} " + " ".join(f"{c:>12}" for c in H.CLASSES)
          + f" {'counted':>8} {'parity %':>9} {'w sharded':>10} {'plan s med/max':>15}")
    for p, s in data["summary"].items():
        print(f"{p:10} " + " ".join(f"{s['counts'][c]:12}" for c in H.CLASSES)
              + f" {s['total']:8} {s['parity_pct']:9} {s['sharded']:10} "
              f"{s['plan_s_median'] or 0:7.1f}/{s['plan_s_max'] or 0:.1f}")
    for p, s in data["summary"].items():
        if s["failing"]:
            print(f"\n{p}: {len(s['failing'])} not at parity")
            for arch, why in s["failing"].items():
                print(f"  {arch:26} {why}")
    if data["eager_fails"]:
        print(f"\neager fails ({len(data['eager_fails'])}, not counted):")
        for arch, why in data["eager_fails"].items():
            print(f"  {arch:26} {why}")
    print(f"\nwrote {out_path} ({this_run['wall_s']:.0f} s this run)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
