"""Resharding planner benchmark: plan quality against a naive plan, and planner speed.

For each mesh and every pair of specs from {S(0), S(1), R, P(sum)} per axis, on a
4096×4096 bf16 tensor, the planned time (:func:`fxpar.reshard_plan`) is compared with the
**naive** plan that is always legal: keep the leading axes on which ``src`` and ``dst`` agree,
gather / all-reduce every later axis from the last to the first, then chunk / to_partial them
from the first to the last — each step priced by the same :func:`fxpar.cost.reshard.step_cost`. Speed: every pair planned with cold caches,
then again warm (cached).

    python benchmarks/reshard.py            # writes benchmarks/results/reshard.json

Timings on shared machines are noisy: compare rows of the same run.
"""

from __future__ import annotations

import itertools
import json
import math
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fxpar import Cluster, Mesh, Partial, Replicate, Shard, Spec  # noqa: E402
from fxpar.cost.reshard import step_cost  # noqa: E402
from fxpar.resharding.intra import _graph, _plan, reshard_plan  # noqa: E402

SHAPE, DTYPE = (4096, 4096), torch.bfloat16
BASIC = (Shard(0), Shard(1), Replicate(), Partial("sum"))


def naive_time(src: Spec, dst: Spec, mesh) -> float:
    """Keep the common leading axes; gather the rest (last axis first), then split again."""
    first = next((i for i, (a, b) in enumerate(zip(src, dst)) if a != b), len(src))
    t, cur = 0.0, src
    for axis in reversed(range(first, len(src))):
        p = cur[axis]
        if isinstance(p, Replicate):
            continue
        kind = "all_reduce" if isinstance(p, Partial) else "all_gather"
        nxt = cur.with_axis(axis, Replicate())
        t += step_cost(kind, cur, nxt, mesh, axis, SHAPE, DTYPE)[1]
        cur = nxt
    for axis in range(first, len(dst)):
        p = dst[axis]
        if isinstance(p, Replicate):
            continue
        kind = "to_partial" if isinstance(p, Partial) else "chunk"
        nxt = cur.with_axis(axis, p)
        t += step_cost(kind, cur, nxt, mesh, axis, SHAPE, DTYPE)[1]
        cur = nxt
    assert cur == dst
    return t


def bench(name: str, mesh) -> dict:
    specs = [Spec(ps) for ps in itertools.product(BASIC, repeat=mesh.ndim)]
    pairs = list(itertools.product(specs, specs))
    _plan.cache_clear()
    _graph.cache_clear()
    t0 = time.perf_counter()
    plans = [reshard_plan(a, b, mesh, SHAPE, DTYPE) for a, b in pairs]
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    for a, b in pairs:
        reshard_plan(a, b, mesh, SHAPE, DTYPE)
    warm = time.perf_counter() - t0
    ratios, best = [], []
    for (a, b), p in zip(pairs, plans):
        n = naive_time(a, b, mesh)
        assert p.time <= n * (1 + 1e-12), (str(p), p.time, n)
        if a != b:
            ratios.append(p.time / n)
            best.append((p.time / n, str(p), p.time, n))
    best.sort()
    return dict(mesh=name, pairs=len(pairs), cold_ms_per_plan=1e3 * cold / len(pairs),
                warm_us_per_plan=1e6 * warm / len(pairs),
                geomean_planned_over_naive=math.exp(sum(math.log(max(r, 1e-9)) for r in ratios) / len(ratios)),
                changed_pairs=len(ratios), better_than_naive=sum(r < 1 - 1e-9 for r in ratios),
                top_savings=[dict(plan=s, planned_us=1e6 * t, naive_us=1e6 * n) for _, s, t, n in best[:3]])


def main() -> None:
    rows = [
        bench("dgx-a100 x2: dp=2, tp=8", Mesh(Cluster.preset("dgx-a100", nodes=2), dp=2, tp=8)),
        bench("perlmutter x4: dp=4, tp=4", Mesh(Cluster.preset("perlmutter", nodes=4), dp=4, tp=4)),
        bench("dgx-a100 x4: dp=4, y=2, x=4", Mesh(Cluster.preset("dgx-a100", nodes=4), dp=4, y=2, x=4)),
    ]
    print(f"{'mesh':<30} {'pairs':>6} {'cold ms':>8} {'warm us':>8} {'planned/naive':>14} {'better':>7}"
          "   (planned/naive: geometric mean over pairs with src != dst)")
    for r in rows:
        print(f"{r['mesh']:<30} {r['pairs']:>6} {r['cold_ms_per_plan']:>8.3f} {r['warm_us_per_plan']:>8.1f} "
              f"{r['geomean_planned_over_naive']:>14.3f} {r['better_than_naive']:>7}")
    for r in rows:
        print(f"\n{r['mesh']}: largest savings over the naive plan")
        for s in r["top_savings"]:
            print(f"  {s['planned_us']:9.1f} us vs {s['naive_us']:9.1f} us  {s['plan']}")
    out = ROOT / "benchmarks" / "results" / "reshard.json"
    out.write_text(json.dumps({"python": platform.python_version(), "torch": torch.__version__,
                               "shape": SHAPE, "dtype": str(DTYPE), "rows": rows}, indent=1))
    print(f"\nwrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
