"""Strategy-selection solver benchmark on a synthetic transformer (no torch, no graph code).

A transformer-like chain: ``L`` layers x 30 nodes per layer (LayerNorm, q/k/v projections,
head views and transposes, RoPE, score and value bmm, softmax, dropout, output projection,
residual adds, SwiGLU MLP) plus embedding and head, on a 2-axis mesh ``(dp, tp)``. An
activation layout is one placement per axis out of replicated, token-split, hidden-split and
partial sum (16 layouts). Matmuls have 16 strategies (per axis: data, column, row or
replicated), pointwise ops 9 (no partial sums), views 16 (free, layout-preserving). Resharding
costs are shortest paths over single-axis ring collectives (AxoNN eq. 1-3), so they obey the
triangle inequality as a real resharding planner's do; compute costs come from FLOP counts;
memory from parameters (16 B/param, mixed-precision Adam) and saved activations; liveness
points at every layer boundary of the forward pass; the budget sits half-way between the
smallest footprint and the footprint of the unconstrained optimum, so it binds. The layers'
nodes are tied (identical blocks).

Rows: Llama-3-8B-shaped (L=32, mesh 8x8) and GPT-3-175B-shaped (L=96, mesh 128x8), each solved
with all reductions and each edge encoding, without follower merging, without merging and
pruning, with ties only, with the ties kept as equality constraints instead of shared variables,
and the same model with no ties at all (a different, larger problem).

    python benchmarks/solver.py            # all rows, writes benchmarks/results/solver.json
    python benchmarks/solver.py --quick    # L=32 only

Timings on shared machines are noisy: compare rows of the same run.
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fxpar.errors import PlanError  # noqa: E402
from fxpar.solver import ALL_REDUCTIONS, StrategyProblem, fmt_bytes, solve  # noqa: E402

# per-axis placements of a 2-d activation [tokens, hidden]: R, S0 (tokens), S1 (hidden), P (sum)
PLACE = ("R", "S0", "S1", "P")
LAYOUTS = list(itertools.product(PLACE, PLACE))              # all 16 (dp, tp) layouts
PLAIN = [lay for lay in LAYOUTS if "P" not in lay]           # 9 layouts without a partial sum


class Mesh2:
    """dp (inter-node) x tp (intra-node) with ring collective costs."""

    def __init__(self, dp: int, tp: int, bw_dp: float = 25e9, bw_tp: float = 300e9,
                 lat: float = 5e-6, flops: float = 312e12 * 0.5):
        self.g = (dp, tp)
        self.bw = (bw_dp, bw_tp)
        self.lat, self.flops = lat, flops
        self._cache: dict[float, np.ndarray] = {}

    def local_bytes(self, layout, nbytes: float) -> float:
        return nbytes / int(np.prod([g for g, p in zip(self.g, layout) if p[0] == "S"]))

    def axis_cost(self, ax: int, src: str, dst: str, m: float) -> float | None:
        """One step on one axis; ``m`` = bytes held along that axis (None: not one step)."""
        g, bw = self.g[ax], self.bw[ax]
        if src == dst or g == 1:
            return 0.0
        steps = g - 1
        if src == "R":
            return 0.0                         # local slice, or keep on one rank as partial
        if src[0] == "S" and dst == "R":
            return steps * (self.lat + m / g / bw)                 # all-gather
        if src[0] == "S" and dst[0] == "S":
            return steps * (self.lat + m / g / g / bw)             # all-to-all
        if src == "P" and dst == "R":
            return 2 * steps * (self.lat + m / g / bw)             # all-reduce
        if src == "P" and dst[0] == "S":
            return steps * (self.lat + m / g / bw)                 # reduce-scatter
        return None                                # S -> P goes through R

    def reshard_matrix(self, nbytes: float) -> np.ndarray:
        """Cheapest sequence of single-axis collectives between every two layouts (a shortest
        path, so the triangle inequality holds, as for a real resharding planner); forward
        plus the conjugate backward move."""
        if nbytes in self._cache:
            return self._cache[nbytes]
        n = len(LAYOUTS)
        d = np.full((n, n), np.inf)
        for a, src in enumerate(LAYOUTS):
            d[a, a] = 0.0
            for ax in (0, 1):
                for p in PLACE:
                    dst = tuple(p if k == ax else x for k, x in enumerate(src))
                    held = self.local_bytes(tuple("R" if k == ax else x
                                                  for k, x in enumerate(src)), nbytes)
                    c = self.axis_cost(ax, src[ax], p, held)
                    if c is not None:
                        b = LAYOUTS.index(dst)
                        d[a, b] = min(d[a, b], 2.0 * c)
        for k in range(n):  # Floyd-Warshall
            d = np.minimum(d, d[:, k:k + 1] + d[k:k + 1, :])
        self._cache[nbytes] = d
        return d

    def reshard(self, src, dst, nbytes: float) -> float:
        return float(self.reshard_matrix(nbytes)[LAYOUTS.index(src), LAYOUTS.index(dst)])


def build(layers: int, hidden: int, ffn: int, tokens: int, vocab: int, mesh: Mesh2,
          tie: bool = True, budget: float | None = None) -> StrategyProblem:
    """The synthetic transformer problem (see the module docstring)."""
    names, cost, mem, out_layouts = [], [], [], []
    edges: dict[tuple[int, int], np.ndarray] = {}
    kinds: list[str] = []

    def add(name, kind, strat_cost, strat_mem, outs, ins: list[tuple[int, list, float]]):
        i = len(names)
        names.append(name)
        kinds.append(kind)
        cost.append(strat_cost)
        mem.append(strat_mem)
        out_layouts.append(outs)
        for src, lays, nbytes in ins:
            d = mesh.reshard_matrix(nbytes)
            r = d[np.ix_([LAYOUTS.index(o) for o in out_layouts[src]],
                         [LAYOUTS.index(lay) for lay in lays])]
            edges[(src, i)] = edges[(src, i)] + r if (src, i) in edges else r
        return i

    def pointwise(name, srcs, width=hidden, flops_per=8.0, view=False, save=True):
        nbytes = 2.0 * tokens * width
        c, m = [], []
        lays = LAYOUTS if view else PLAIN  # views keep partial sums partial
        for lay in lays:
            local = mesh.local_bytes(lay, nbytes)
            c.append(0.0 if view else 3 * flops_per * local / 2 / mesh.flops + local / 2e12)
            m.append(0 if (view or not save) else local)
        return add(name, "view" if view else "pointwise", c, m, lays,
                   [(s, lays, nbytes) for s in srcs])

    def matmul(name, src, k, n):
        """x[tokens, k] @ W[k, n]; per axis: data (S0,R,S0), column (R,S1,S1),
        row (S1,S0,P) or replicated; dp-sharded batch all-reduces the weight gradient."""
        c, m, outs, ins = [], [], [], []
        opts = {"data": ("S0", "R", "S0"), "col": ("R", "S1", "S1"), "row": ("S1", "S0", "P"),
                "rep": ("R", "R", "R")}
        for a0, a1 in itertools.product(opts, opts):
            (i0, w0, o0), (i1, w1, o1) = opts[a0], opts[a1]
            split = 1
            for ax, a in enumerate((a0, a1)):
                split *= mesh.g[ax] if a != "rep" else 1
            fl = 6.0 * tokens * k * n / split / mesh.flops
            wshard = int(np.prod([mesh.g[ax] for ax, w in enumerate((w0, w1)) if w != "R"]))
            wbytes = 2.0 * k * n / wshard
            grad_ar = 0.0
            for ax, a in enumerate((a0, a1)):  # weight replicated over a token-split axis
                if a == "data":
                    g = mesh.g[ax]
                    grad_ar += 2 * (g - 1) * (mesh.lat + wbytes / g / mesh.bw[ax])
            c.append(fl + grad_ar)
            m.append(8.0 * wbytes + mesh.local_bytes((i0, i1), 2.0 * tokens * k))
            outs.append((o0, o1))
            ins.append((i0, i1))
        return add(name, "matmul", c, m, outs, [(src, ins, 2.0 * tokens * k)])

    emb = add("embed", "embed", [2.0 * tokens * hidden / 2e12] * len(PLAIN),
              [8.0 * vocab * hidden / mesh.g[1] if l[1] != "R" else 8.0 * vocab * hidden
               for l in PLAIN], PLAIN, [])
    x = emb
    ties: list[list[int]] = []
    for layer in range(layers):
        start = len(names)
        p = f"l{layer}."
        ln1 = pointwise(p + "ln1", [x], flops_per=12)
        q = matmul(p + "q_proj", ln1, hidden, hidden)
        k = matmul(p + "k_proj", ln1, hidden, hidden)
        v = matmul(p + "v_proj", ln1, hidden, hidden)
        qv = pointwise(p + "q_view", [q], view=True)
        kv = pointwise(p + "k_view", [k], view=True)
        vv = pointwise(p + "v_view", [v], view=True)
        qt = pointwise(p + "q_t", [qv], view=True)
        kt = pointwise(p + "k_t", [kv], view=True)
        vt = pointwise(p + "v_t", [vv], view=True)
        qr = pointwise(p + "q_rope", [qt], flops_per=6)
        kr = pointwise(p + "k_rope", [kt], flops_per=6)
        ktt = pointwise(p + "k_tT", [kr], view=True)
        sc = pointwise(p + "scores", [qr, ktt], flops_per=2.0 * 1024)   # bmm-like
        sc2 = pointwise(p + "scale", [sc], save=False)
        sm = pointwise(p + "softmax", [sc2], flops_per=10)
        dr = pointwise(p + "attn_dropout", [sm], flops_per=2)
        av = pointwise(p + "attn_v", [dr, vt], flops_per=2.0 * 1024)
        at = pointwise(p + "attn_t", [av], view=True)
        aw = pointwise(p + "attn_view", [at], view=True)
        o = matmul(p + "o_proj", aw, hidden, hidden)
        r1 = pointwise(p + "resid1", [o, x], save=False)
        ln2 = pointwise(p + "ln2", [r1], flops_per=12)
        gate = matmul(p + "gate_proj", ln2, hidden, ffn)
        up = matmul(p + "up_proj", ln2, hidden, ffn)
        act = pointwise(p + "silu", [gate], width=ffn, flops_per=8)
        mul = pointwise(p + "mul", [act, up], width=ffn, flops_per=1)
        down = matmul(p + "down_proj", mul, ffn, hidden)
        dd = pointwise(p + "mlp_dropout", [down], flops_per=2)
        x = pointwise(p + "resid2", [dd, r1], save=False)
        ties.append(list(range(start, len(names))))
    lnf = pointwise("ln_f", [x], flops_per=12)
    head = matmul("lm_head", lnf, hidden, vocab)
    pointwise("loss", [head], width=vocab, flops_per=10)

    per_layer = len(ties[0])
    tie_groups = [list(g) for g in zip(*ties)] if tie else []
    # liveness at each layer boundary of the forward pass: every weight-carrying node (its
    # memory includes parameters) plus the saved activations of the layers run so far
    n = len(names)
    weights = {i for i in range(n) if kinds[i] in ("matmul", "embed")}
    live = []
    for layer in range(1, layers + 1):
        done = set(range(ties[0][0] + layer * per_layer))
        live.append(sorted(weights | done))
    live.append(list(range(n)))
    live_names = [f"after layer {k}" for k in range(1, layers + 1)] + ["end of forward"]
    return StrategyProblem(cost=cost, mem=mem, edges=edges, live=live, budget=budget,
                           ties=tie_groups, names=names, live_names=live_names)


MODELS = {
    # name: layers, hidden, ffn, tokens per step per replica-group, vocab, mesh
    "llama3-8b": dict(layers=32, hidden=4096, ffn=14336, tokens=8 * 8192, vocab=128256,
                      mesh=(8, 8)),
    "gpt3-175b": dict(layers=96, hidden=12288, ffn=4 * 12288, tokens=128 * 2048, vocab=50257,
                      mesh=(128, 8)),
}


def run(model: str, time_limit: float, repeats: int) -> list[dict]:
    cfg = dict(MODELS[model])
    mesh = Mesh2(*cfg.pop("mesh"))
    rows = []
    t0 = time.perf_counter()
    free = build(**cfg, mesh=mesh)
    build_s = time.perf_counter() - t0
    # budget: half-way between the smallest footprint and the unconstrained optimum's peak
    lo = solve(free, time_limit=time_limit)
    min_mem = int(sum(int(m.min()) for m in free.mem))
    budget = min_mem + (lo.peak - min_mem) // 2
    print(f"\n{model}: {free.n} nodes, {sum(c.size for c in free.cost)} strategies, "
          f"{len(free.edges)} edges, {len(free.live)} liveness points, build {build_s:.2f} s, "
          f"budget {fmt_bytes(budget)} (unconstrained optimum's peak {fmt_bytes(lo.peak)})")
    tied = build(**cfg, mesh=mesh, budget=budget)
    untied = build(**cfg, mesh=mesh, budget=budget, tie=False)
    every = ALL_REDUCTIONS
    variants = [  # label, problem, reductions, edge encoding, repeats (fast rows: best of n)
        ("tied, all reductions", tied, every, "marginal", repeats),
        ("tied, table edges", tied, every, "table", repeats),
        ("tied, clause edges", tied, every, "clause", repeats),
        ("tied, no merge", tied, every - {"merge"}, "marginal", repeats),
        ("tied, no merge/prune", tied, every - {"merge", "prune"}, "marginal", repeats),
        ("tied, ties only", tied, {"ties"}, "marginal", repeats),
        ("ties as constraints", tied, every - {"ties"}, "marginal", 1),
        ("no ties, all reductions", untied, every, "marginal", 1),
        ("no ties, table edges", untied, every, "table", 1),
    ]
    print(f"{'variant':26} {'classes':>7} {'values':>6} {'edges':>5} {'pts':>3} {'reduce s':>8}"
          f" {'solve s':>8} {'total s':>8} {'status':>8} {'gap':>7} {'objective s':>11}")
    for label, prob, red, enc, n in variants:
        best = None
        for _ in range(n):
            try:
                s = solve(prob, time_limit=time_limit, reductions=red, edge_encoding=enc)
            except PlanError as e:
                print(f"{label:26} PlanError: {e}")
                rows.append(dict(model=model, variant=label, error=str(e)))
                break
            if best is None or s.wall_time < best.wall_time:
                best = s
        if best is None:
            continue
        s, st = best, best.stats
        print(f"{label:26} {st['classes']:7d} {st['values']:6d} {st['class_edges']:5d} "
              f"{st['class_points']:3d} {st['reduce_s']:8.3f} {st['solve_s']:8.3f} "
              f"{s.wall_time:8.3f} {s.status:>8} {s.gap:7.2%} {s.objective:11.6f}")
        rows.append(dict({k: v for k, v in st.items() if isinstance(v, (int, float, str))},
                         model=model, variant=label, budget=budget, wall_s=s.wall_time,
                         status=s.status, gap=s.gap, objective_s=s.objective, peak=s.peak,
                         time_limit_s=time_limit, best_of=n))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="L=32 only")
    ap.add_argument("--time-limit", type=float, default=60.0,
                    help="CP-SAT wall-clock limit per solve (the untied rows hit it)")
    ap.add_argument("--repeats", type=int, default=3, help="best of n for the tied rows")
    args = ap.parse_args()
    rows = []
    for model in ["llama3-8b"] + ([] if args.quick else ["gpt3-175b"]):
        rows += run(model, args.time_limit, args.repeats)
    out = ROOT / "benchmarks" / "results" / "solver.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    import ortools

    out.write_text(json.dumps({"python": platform.python_version(), "ortools": ortools.__version__,
                               "machine": platform.machine(), "rows": rows}, indent=1) + "\n")
    print(f"\nwrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
