"""OpInfo sweep: every op of PyTorch's ``op_db`` (float32 on CPU, with the integer/bool
tensor arguments its samples carry), each sample compiled by fxpar with ``plan="auto"`` on
``{"dp": 2, "tp": 2}`` over a nearly-free-communication cluster, run on 4 gloo ranks and
compared with eager (:mod:`tests.opinfo_ops`).

Writes ``benchmarks/results/opinfo_sweep.json`` (per op and sample: outcome, first line of the
error, phase, sharded or not, unsharded fallbacks, time) and prints a summary: counts per
outcome, % of compiled cases that were really sharded, the wrong/crash ops.

    ./dev bench opinfo_sweep                      # every sample of every op (long)
    ./dev bench opinfo_sweep --samples 3          # the first 3 samples of every op
    ./dev bench opinfo_sweep --budget 1500        # stop starting batches after 1500 s
    ./dev bench opinfo_sweep --ops mm,cat,gather  # some ops only
    ./dev bench opinfo_sweep --resume             # run only the cases the JSON lacks
    ./dev bench opinfo_sweep --resume --redo narrow,mm  # ... and these ops' cases again

With ``--budget`` the sweep runs the ops in a fixed interleaved order (every k-th op first), so
a sweep cut short is still a deterministic, spread-out subset; the JSON says how far it got.
With ``--resume`` the results already in ``--out`` (same mesh and dtype) are kept and only the
missing cases run (``--redo`` drops the named ops' results first, to re-run them after a fix);
``runs`` in the JSON lists each run (commit, cases it ran, wall time).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

from fxpar.testing import WorkerPool

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the harness lives in tests/ (tests/opinfo_ops.py)
from tests import opinfo_ops as T  # noqa: E402

OUT = Path(__file__).resolve().parent / "results" / "opinfo_sweep.json"


def _order(names: list[str], k: int = 7) -> list[str]:
    """Every k-th name, then the next residue...: a cut-short run covers the alphabet."""
    return [n for r in range(k) for n in names[r::k]]


def _commit() -> str:
    """The checkout's commit (``+dirty`` with uncommitted changes); ``FXPAR_SWEEP_COMMIT``
    names it for a run from an exported copy of the tree."""
    if os.environ.get("FXPAR_SWEEP_COMMIT"):
        return os.environ["FXPAR_SWEEP_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, cwd=Path(__file__).parent, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, cwd=Path(__file__).parent,
                               check=True).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _previous(path: Path, wanted: set[str], redo: set[str]) -> tuple[list[T.Result], list[dict]]:
    """The results in a previous report at ``path`` that are cases of this run (and not of an
    op in ``redo``), and its list of runs."""
    if not path.exists():
        return [], []
    data = json.loads(path.read_text())
    cfg = data.get("config", {})
    if cfg.get("mesh") != T.MESH or cfg.get("dtype") != "float32":
        raise SystemExit(f"--resume: {path} is for mesh {cfg.get('mesh')}, "
                         f"dtype {cfg.get('dtype')}; this run is {T.MESH}, float32")
    fields = set(T.Result.__dataclass_fields__)
    out = []
    for rec in data.get("results", []):
        r = T.Result(**{k: v for k, v in rec.items() if k in fields})
        if r.id in wanted and r.op not in redo:
            if "trace" in rec:
                r.__dict__["trace"] = rec["trace"]
            out.append(r)
    runs = data.get("runs") or [{"commit": "unknown", "cases_run": data.get("cases_run", 0),
                                 "wall_s": data.get("wall_s", 0.0)}]
    return out, runs


def _dumps(data: dict) -> str:
    """JSON with one case per line: 18k cases stay a few MB and diff line by line."""
    head = json.dumps({k: v for k, v in data.items() if k != "results"}, indent=1)
    rows = ",\n".join(json.dumps(r, separators=(",", ":")) for r in data["results"])
    return head[:-2] + ',\n "results": [\n' + rows + "\n ]\n}\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", default="", help="comma-separated op names (default: all of op_db)")
    ap.add_argument("--samples", type=int, default=0, help="first N samples per op (0: all)")
    ap.add_argument("--budget", type=float, default=0.0, help="seconds; 0: no limit")
    ap.add_argument("--case-timeout", type=float, default=60.0)
    ap.add_argument("--batch", type=int, default=40)
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--resume", action="store_true",
                    help="keep the results already in --out; run only the missing cases")
    ap.add_argument("--redo", default="",
                    help="with --resume: comma-separated ops whose results are run again")
    a = ap.parse_args(argv)

    t0 = time.monotonic()
    names = [n.strip() for n in a.ops.split(",") if n.strip()] or T.op_names()
    names = _order(names)
    cases: list[T.Case] = []
    sample_counts: dict[str, int] = {}
    for n in names:
        try:
            k = T.num_samples(n)
        except Exception as e:  # noqa: BLE001 - the OpInfo cannot make float32 samples
            print(f"  {n}: no samples ({T._first_line(e)})", file=sys.stderr)
            k = 0
        sample_counts[n] = k
        cases += [T.Case(n, i) for i in range(min(k, a.samples) if a.samples else k)]
    print(f"{len(names)} ops, {len(cases)} cases (samples made in {time.monotonic() - t0:.0f} s)",
          flush=True)
    deadline = t0 + a.budget if a.budget else None
    done = [0]
    out_path = Path(a.out)
    results: list[T.Result] = []
    runs: list[dict] = []
    if a.resume:
        results, runs = _previous(out_path, {c.id for c in cases},
                                  {n.strip() for n in a.redo.split(",") if n.strip()})
        have = {r.id for r in results}
        print(f"resume: {len(results)} results kept from {out_path}, "
              f"{sum(1 for c in cases if c.id not in have)} cases to run", flush=True)
        cases_todo = [c for c in cases if c.id not in have]
    else:
        cases_todo = cases
    this_run = {"commit": _commit(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                "cases_run": 0, "wall_s": 0.0,
                "ops": a.ops or "all", "redo": a.redo or None}
    runs.append(this_run)

    def dump(final: bool) -> dict:
        summary = T.summarize(results)
        ran = {r.id for r in results}
        this_run["wall_s"] = round(time.monotonic() - t0, 1)
        data = {
            "benchmark": "opinfo_sweep",
            "config": {"mesh": T.MESH, "world": T.WORLD, "dtype": "float32", "plan": "auto",
                       "cluster": "Cluster.local(4) with 1e15 B/s links and zero latency",
                       "rtol": T.RTOL, "atol": T.ATOL, "samples_per_op": a.samples or "all",
                       "case_timeout_s": a.case_timeout, "budget_s": a.budget or None,
                       "ops_requested": a.ops or "all of op_db (float32 on CPU)"},
            "scope": (f"first {a.samples} samples of each op: {len(cases)} of the "
                      f"{sum(sample_counts.values())} float32 samples of {len(names)} ops"
                      if a.samples else f"all {len(cases)} float32 samples of {len(names)} ops"),
            "complete": final and len(ran) == len(cases),
            "cases_planned": len(cases), "cases_run": len(results),
            "not_run": [] if len(ran) == len(cases) else
            sorted({c.op for c in cases if c.id not in ran}),
            "wall_s": round(sum(r["wall_s"] for r in runs), 1),
            "runs": runs,
            "machine": {"python": platform.python_version(), "torch": torch.__version__,
                        "cpus": os.cpu_count()},
            "summary": summary,
            "errors": {r.op: r.error for r in sorted(results, key=lambda r: r.id)
                       if r.outcome in ("wrong", "crash")},
            "results": T.to_json(sorted(results, key=lambda r: (r.op, r.sample))),
        }
        out_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = out_path.with_suffix(".tmp")
        tmp.write_text(_dumps(data))
        tmp.replace(out_path)
        return data

    def on_result(r: T.Result) -> None:
        results.append(r)
        this_run["cases_run"] += 1
        done[0] += 1
        if r.outcome in ("wrong", "crash"):
            print(f"  {r.outcome:6} {r.id}: {r.error}", flush=True)
        if done[0] % 100 == 0:
            s = T.summarize(results)
            print(f"[{time.monotonic() - t0:5.0f} s] {done[0]}/{len(cases)} {s['counts']} "
                  f"sharded {s['sharded_pct']}%", flush=True)
            dump(False)

    try:
        with WorkerPool(T.WORLD, timeout=120, start_timeout=300) as pool:
            T.run_cases(pool, cases_todo, case_timeout=a.case_timeout, batch=a.batch,
                        on_result=on_result, deadline=deadline)
    except BaseException:
        dump(False)  # what ran is kept (--resume goes on from it)
        print(f"sweep stopped after {len(results)} results; wrote {out_path}", flush=True)
        raise
    data = dump(True)
    s = data["summary"]
    print()
    print(f"{'outcome':12} {'cases':>6} {'ops':>5}")
    for k in T.OUTCOMES:
        print(f"{k:12} {s['counts'][k]:6} {s['op_counts'][k]:5}")
    print(f"{'total':12} {s['cases']:6} {s['ops']:5}")
    print(f"compiled {s['compiled']} cases, sharded {s['sharded']} ({s['sharded_pct']}%); "
          f"passing cases sharded {s['sharded_pct_of_pass']}%; integer-arg cases "
          f"{s['int_arg_cases']}; random (shape-only) {s['random_cases']}")
    if s["explain_missing_unsharded"]:
        print("explain() misses unsharded ops for:", ", ".join(s["explain_missing_unsharded"]))
    for kind in ("wrong", "crash"):
        print(f"{kind} ({len(s[kind])} ops):")
        for op in s[kind]:
            print(f"  {op}: {data['errors'].get(op, '')}")
    if not data["complete"]:
        print(f"INCOMPLETE: {data['cases_run']}/{data['cases_planned']} cases run "
              f"(budget {a.budget:.0f} s); ops not (fully) run: {len(data['not_run'])}")
    print(f"wrote {out_path} ({data['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
