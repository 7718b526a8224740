"""Runtime benchmark: training step time of fxpar's programs against hand-written PyTorch.

On 2 gloo processes of this machine (spawned by this script, one intra-op thread each), the
same small GPT (:class:`examples.models.GPT`, plain torch; two shapes: ``gpt`` with a fused
QKV projection and 4 heads, ``gpt-qkv8`` with separate q/k/v projections and 8 heads) is
trained with AdamW by each of fxpar's baseline plans and by the hand-written PyTorch code a
user would write for the same strategy:

==========  ================================  ================================================
strategy    fxpar                             hand-written PyTorch
==========  ================================  ================================================
dp          ``plan="dp"``, mesh ``dp=2``      ``DistributedDataParallel`` (defaults)
zero3       ``plan="zero3"``, mesh ``dp=2``   FSDP2 ``fully_shard`` on every block, then root
megatron    ``plan="megatron"``,              DTensor ``parallelize_module``: ``qkv``/``fc1``
            mesh ``dp=1, tp=2``               ``ColwiseParallel``, ``proj``/``fc2``
                                              ``RowwiseParallel``; rest replicated
==========  ================================  ================================================

Both sides start from the same initial weights and see the same global batches (fxpar:
``runner.step(idx, targets)`` with the global batch; DDP/FSDP: each rank its half of it;
TP: both ranks the whole batch). Hand-written TP needs per-head sharding of the fused QKV
projection, so on the PyTorch side the rows of ``qkv.weight`` are permuted to
``[q₀ k₀ v₀ | q₁ k₁ v₁]`` (rank r's heads contiguous) and the attention forward splits its
*local* projection into thirds — the same math on the same weights, as Megatron does it.
fxpar's ``megatron`` plan also makes the LM head column-parallel, so a second PyTorch side
(row ``megatron+vp``) adds ``head: ColwiseParallel(output_layouts=Shard(-1))`` with the loss
under ``loss_parallel()`` (vocab-parallel cross-entropy); the ratio that counts is against
the faster of the two.

How it is measured: the sides step **interleaved** in one run (A B, B A, A B, ... —
rotating which goes first, so drift and load spikes hit all alike); before each step a
barrier lines the ranks up, and a step's sample is the **slowest rank's** wall time of that
step (loss returned, optimizer stepped). ``--warmup`` steps per side are excluded; the table
shows medians over ``--steps`` samples, the ratio of medians fxpar/torch (the project's aim
is ≤ 1.0), the median of the per-step ratios (``paired``: step ``i`` of fxpar against
step ``i`` of torch, taken moments apart) and the ratio of the fastest steps (``mins``: the
steps least disturbed by other load). The losses of the two sides (global-batch mean;
per-rank losses of DDP/FSDP averaged after timing) are compared step by step, warm-up
included: same math, so they should agree to float rounding — ``max |Δloss|`` is printed,
never hidden. A plan fxpar fails on is recorded with its error (message and traceback) and
the PyTorch side is still measured alone.

    python benchmarks/runtime.py            # writes benchmarks/results/runtime.json
    python benchmarks/runtime.py --steps 30 --plans dp megatron --profile
    python benchmarks/runtime.py --compile --out benchmarks/results/runtime_compiled.json

``--compile`` adds two sides per strategy, stepped in the same interleaved rounds:
``prog.runner(compile=True)`` (every rank graph and the optimizer step under inductor) and
the torch side with its wrapped model and its ``optimizer.step`` under ``torch.compile`` (the
compiled-optimizer recipe; over DTensors too); each is compiled by one step first (timed, not
measured), and the rows get ``compiled_over_eager`` (compiled / eager fxpar, issue #26 aims
≤ 0.9) and ``compiled_ratio`` (compiled fxpar / compiled torch, aim ≤ 1.0; megatron: against
the faster of its two compiled torch sides, with and without the vocabulary-parallel head).

The JSON holds, per strategy, every sample and loss of every side, fxpar's compile and
runner-construction times, and ``fxpar_comm``: the communicating edges of fxpar's rank-0
graph (each forward or gradient collective is one blocking or prefetched collective per
step, on top of the bucketed parameter-gradient reductions). ``--profile`` adds a cProfile
(rank 0) of every side's measured steps (profiled steps are slower; use it to see where time
goes, not for the ratios). The machine's 2 cores are shared: every collective is a point
where one rank waits for the other, so plans with more synchronous collectives suffer more
from load; compare the columns of one run, not numbers across runs.
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import datetime
import io
import json
import os
import platform
import pstats
import statistics
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WORLD = 2
#: the project's benchmark GPT (fused QKV, 4 heads) and a second shape with separate q/k/v
#: projections and 8 heads (what the issue measured: no all-to-all needed for heads)
MODELS = {"gpt": dict(vocab=512, d_model=128, n_heads=4, n_layers=2, seq_len=64),
          "gpt-qkv8": dict(vocab=512, d_model=128, n_heads=8, n_layers=2, seq_len=64,
                           fused_qkv=False)}
BATCH = 8
LR = 1e-3
PLANS = ("dp", "zero3", "megatron")
MESHES = {"dp": {"dp": 2}, "zero3": {"dp": 2}, "megatron": {"dp": 1, "tp": 2}}
TORCH_SIDE = {"dp": "DistributedDataParallel", "zero3": "FSDP2 fully_shard (blocks + root)",
              "megatron": "parallelize_module Colwise(qkv, fc1) / Rowwise(proj, fc2)"}


def _adamw(params):
    return torch.optim.AdamW(params, lr=LR)


# ---------------------------------------------------------------------------------------------
# hand-written PyTorch sides
# ---------------------------------------------------------------------------------------------
def _tp_attn_forward(self, x: torch.Tensor) -> torch.Tensor:
    """CausalSelfAttention.forward on this rank's heads: ``qkv`` is column-parallel with rows
    permuted to [q_r k_r v_r] per rank, so its local output splits into thirds (separate
    ``q``/``k``/``v``: each column-parallel, its local output is this rank's heads)."""
    import torch.nn.functional as F

    b, t, _ = x.shape
    if hasattr(self, "qkv"):
        q, k, v = self.qkv(x).chunk(3, dim=2)
    else:
        q, k, v = self.q(x), self.k(x), self.v(x)
    hd = q.shape[-1] // self.local_heads
    q, k, v = (z.view(b, t, self.local_heads, hd).transpose(1, 2) for z in (q, k, v))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return self.proj(y.transpose(1, 2).reshape(b, t, -1))


def _permute_qkv(attn, tp: int) -> None:
    """Reorder the fused QKV rows from [q | k | v] to [q_0 k_0 v_0 | q_1 k_1 v_1 | ...]."""
    d = attn.proj.in_features
    c = d // tp
    idx = torch.cat([torch.arange(j * d + r * c, j * d + (r + 1) * c)
                     for r in range(tp) for j in range(3)])
    with torch.no_grad():
        attn.qkv.weight.copy_(attn.qkv.weight[idx].clone())
        attn.qkv.bias.copy_(attn.qkv.bias[idx].clone())


class TorchSide:
    """The hand-written PyTorch training step of ``strategy`` (``vocab_parallel``: megatron
    with the LM head column-parallel too and the loss under ``loss_parallel``)."""

    def __init__(self, strategy: str, model: torch.nn.Module, rank: int,
                 vocab_parallel: bool = False, compiled: bool = False) -> None:
        import contextlib

        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        self.strategy, self.rank = strategy, rank
        self.ctx = contextlib.nullcontext
        if strategy == "dp":
            from torch.nn.parallel import DistributedDataParallel as DDP

            self.model = DDP(model)
        elif strategy == "zero3":
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",))
            for block in model.blocks:
                fully_shard(block, mesh=mesh)
            self.model = fully_shard(model, mesh=mesh)
        elif strategy == "megatron":
            import types

            from torch.distributed.tensor import Shard
            from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                           loss_parallel, parallelize_module)

            mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tp",))
            for block in model.blocks:
                attn = block.attn
                fused = hasattr(attn, "qkv")
                if fused:
                    _permute_qkv(attn, WORLD)
                attn.local_heads = attn.n_heads // WORLD
                attn.forward = types.MethodType(_tp_attn_forward, attn)
                cols = ["attn.qkv"] if fused else ["attn.q", "attn.k", "attn.v"]
                parallelize_module(block, mesh, {**{c: ColwiseParallel() for c in cols},
                                                 "attn.proj": RowwiseParallel(),
                                                 "mlp.fc1": ColwiseParallel(),
                                                 "mlp.fc2": RowwiseParallel()})
            if vocab_parallel:
                parallelize_module(model, mesh, {"head": ColwiseParallel(
                    output_layouts=Shard(-1), use_local_output=False)})
                self.ctx = loss_parallel
            self.model = model
        else:
            raise ValueError(strategy)
        self.opt = _adamw(self.model.parameters())
        self.opt_step = self.opt.step
        if compiled:   # the wrapped model under torch.compile (inductor), as torchtitan does,
            self.model = torch.compile(self.model)
            # and the optimizer step, as PyTorch's compiled-optimizer recipe does (fxpar's
            # compile=True compiles its step too)
            self.opt_step = torch.compile(self.opt.step)
        self.split = strategy in ("dp", "zero3")
        self.dist = dist

    def step(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.split:
            n = idx.shape[0] // WORLD
            idx, targets = idx[self.rank * n:(self.rank + 1) * n], targets[self.rank * n:(self.rank + 1) * n]
        with self.ctx():
            loss = self.model(idx, targets)
            loss.backward()
        self.opt_step()
        self.opt.zero_grad(set_to_none=True)
        return loss.detach()

    def global_losses(self, local: list[torch.Tensor]) -> list[float]:
        """The global-batch loss per step (DDP/FSDP: mean of the equal halves' means)."""
        from torch.distributed.tensor import DTensor

        t = torch.stack([x.full_tensor() if isinstance(x, DTensor) else x for x in local]).double()
        if self.split:
            self.dist.all_reduce(t)
            t /= WORLD
        return t.tolist()


def _comm_summary(runner) -> dict:
    """The communicating edges of this rank's fxpar graph (forward and gradient plans)."""
    from fxpar import ir
    from fxpar.cost.reshard import LOCAL_KINDS

    def talks(plan) -> bool:
        return plan is not None and any(st.kind and st.kind not in LOCAL_KINDS for st in plan.steps)

    edges = list(runner.gm.meta[ir.EDGES].values())
    comm = [e for e in edges if talks(e.fwd) or talks(e.bwd)]
    return dict(edges=len(edges), forward_collective_edges=sum(talks(e.fwd) for e in edges),
                backward_collective_edges=sum(talks(e.bwd) for e in edges),
                comm_edges=[f"{e.producer} -> {e.consumer}: {e.describe()}" for e in comm])


# ---------------------------------------------------------------------------------------------
# one rank
# ---------------------------------------------------------------------------------------------
def _bench_plan(shape: str, strategy: str, rank: int, args, batches) -> dict:
    import torch.distributed as dist

    import fxpar
    from examples.models import GPT

    torch.manual_seed(0)
    model = GPT(**MODELS[shape])
    ref0 = copy.deepcopy(model)  # the same initial weights for the PyTorch side(s)
    ref = copy.deepcopy(ref0)
    row: dict = dict(model=shape, strategy=strategy, mesh=MESHES[strategy],
                     torch_side=TORCH_SIDE[strategy])

    fx_step, err = None, None
    try:
        t0 = time.perf_counter()
        prog = fxpar.compile(model, fxpar.Cluster.local(WORLD), batches[0], plan=strategy,
                             mesh=MESHES[strategy], optimizer=_adamw)
        row["fxpar_compile_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        runner = prog.runner()
        row["fxpar_runner_s"] = time.perf_counter() - t0
        fx_step = runner.step
        row["fxpar_comm"] = _comm_summary(runner)
    except Exception as e:   # noqa: BLE001 — recorded, the benchmark goes on
        err = dict(type=type(e).__name__, message=str(e), traceback=traceback.format_exc())
    # every rank must agree on whether fxpar runs, or the interleaved collectives would hang
    ok = torch.tensor([0 if err else 1])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if err is None and not ok.item():
        err = dict(type="PeerError", message="fxpar failed on another rank", traceback="")
    if err is not None:
        fx_step = None
        row["fxpar_error"] = err

    tsides = {"torch": TorchSide(strategy, ref, rank)}
    if strategy == "megatron":
        tsides["torch_vp"] = TorchSide(strategy, copy.deepcopy(ref0), rank, vocab_parallel=True)
    sides = {k: v.step for k, v in tsides.items()}
    if fx_step is not None:
        sides = {"fxpar": fx_step, **sides}
    if args.compile:   # compiled twins: fxpar's rank graph and the torch side under inductor
        sides.update(_compiled_sides(strategy, ref0, rank, batches, row, tsides))
    order = list(sides)
    times: dict = {k: [] for k in sides}
    losses: dict = {k: [] for k in sides}
    profs = {k: cProfile.Profile() for k in sides} if (args.profile and rank == 0) else {}
    n_total = args.warmup + args.steps
    for i in range(n_total):
        j = i % len(order)   # rotate which side goes first
        idx, tgt = batches[i]
        for k in order[j:] + order[:j]:
            dist.barrier()
            prof = profs.get(k) if i >= args.warmup else None
            if prof is not None:
                prof.enable()
            t0 = time.perf_counter()
            loss = sides[k](idx, tgt)
            dt = time.perf_counter() - t0
            if prof is not None:
                prof.disable()
            times[k].append(dt)
            losses[k].append(loss)

    # a step's sample = the slowest rank's time
    out: dict = {}
    for k in order:
        t = torch.tensor(times[k], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        ms = [1e3 * x for x in t.tolist()[args.warmup:]]
        gl = tsides[k].global_losses(losses[k]) if k in tsides else [float(x) for x in losses[k]]
        out[k] = dict(median_ms=statistics.median(ms), min_ms=min(ms), samples_ms=ms,
                      losses=gl[args.warmup:], warmup_losses=gl[:args.warmup])
    row["torch_median_ms"] = out["torch"]["median_ms"]
    if "fxpar" in out:
        fx = out["fxpar"]
        row["fxpar_median_ms"] = fx["median_ms"]
        row["ratio"] = fx["median_ms"] / out["torch"]["median_ms"]
        # per-step ratio, paired: robust to drift over the run
        row["paired_ratio_median"] = statistics.median(
            a / b for a, b in zip(fx["samples_ms"], out["torch"]["samples_ms"]))
        # best steps: the least disturbed by other load on the machine
        row["ratio_of_mins"] = fx["min_ms"] / out["torch"]["min_ms"]

        def diff(k):
            a = fx["warmup_losses"] + fx["losses"]
            b = out[k]["warmup_losses"] + out[k]["losses"]
            return max(abs(x - y) for x, y in zip(a, b))

        row["loss_max_abs_diff"] = diff("torch")
        row["loss_first"] = dict(fxpar=fx["warmup_losses"][0] if args.warmup else fx["losses"][0],
                                 torch=(out["torch"]["warmup_losses"] or out["torch"]["losses"])[0])
        row["loss_last"] = dict(fxpar=fx["losses"][-1], torch=out["torch"]["losses"][-1])
        if "torch_vp" in out:
            row["vocab_parallel"] = dict(
                torch_side=TORCH_SIDE["megatron"] + " + head Colwise(Shard(-1)), loss_parallel",
                torch_median_ms=out["torch_vp"]["median_ms"],
                ratio=fx["median_ms"] / out["torch_vp"]["median_ms"],
                paired_ratio_median=statistics.median(
                    a / b for a, b in zip(fx["samples_ms"], out["torch_vp"]["samples_ms"])),
                ratio_of_mins=fx["min_ms"] / out["torch_vp"]["min_ms"],
                loss_max_abs_diff=diff("torch_vp"))
    elif "torch_vp" in out:
        row["vocab_parallel"] = dict(torch_median_ms=out["torch_vp"]["median_ms"])
    for k in ("fxpar_c", "torch_c", "torch_vp_c"):
        if k in out:
            row[f"{k}_median_ms"] = out[k]["median_ms"]
    if "fxpar_c" in out and "fxpar" in out:
        row["compiled_over_eager"] = out["fxpar_c"]["median_ms"] / out["fxpar"]["median_ms"]
    if "fxpar_c" in out and "torch_c" in out:
        # against the faster compiled torch side (megatron: with or without the
        # vocabulary-parallel head), as the eager ratio that counts
        best = min(out[k]["median_ms"] for k in ("torch_c", "torch_vp_c") if k in out)
        row["compiled_ratio"] = out["fxpar_c"]["median_ms"] / best
        if "torch_vp_c" in out:
            row["compiled_ratio_vocab_parallel"] = (out["fxpar_c"]["median_ms"]
                                                    / out["torch_vp_c"]["median_ms"])
    row["samples"] = out
    for k, prof in profs.items():
        s = io.StringIO()
        st = pstats.Stats(prof, stream=s)
        st.sort_stats("cumulative").print_stats(30)
        st.sort_stats("tottime").print_stats(20)
        row.setdefault("profile_rank0", {})[k] = s.getvalue()
    return row


def _compiled_sides(strategy, ref0, rank, batches, row, tsides) -> dict:
    """``prog.runner(compile=True)`` and the torch side under ``torch.compile``, each stepped
    once here (the compilation, timed) and kept only if every rank compiled it."""
    import torch.distributed as dist

    import fxpar

    out = {}

    def fx_side():
        prog = fxpar.compile(copy.deepcopy(ref0), fxpar.Cluster.local(WORLD), batches[0],
                             plan=strategy, mesh=MESHES[strategy], optimizer=_adamw)
        return prog.runner(compile=True).step

    def torch_side(key="torch_c", **kw):
        tsides[key] = TorchSide(strategy, copy.deepcopy(ref0), rank, compiled=True, **kw)
        return tsides[key].step

    makers = [("fxpar_c", fx_side), ("torch_c", torch_side)]
    if strategy == "megatron":   # fxpar's plan is vocabulary-parallel: so is this twin
        makers.append(("torch_vp_c", lambda: torch_side("torch_vp_c", vocab_parallel=True)))
    for key, make in makers:
        err = None
        try:
            t0 = time.perf_counter()
            step = make()
            step(*batches[0])
            row[f"{key}_compile_s"] = time.perf_counter() - t0
        except Exception as e:   # noqa: BLE001 — recorded, the benchmark goes on
            err = dict(type=type(e).__name__, message=str(e)[:2000],
                       traceback=traceback.format_exc()[-3000:])
        ok = torch.tensor([0 if err else 1])
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        if err is None and ok.item():
            out[key] = step
        else:
            row[f"{key}_error"] = err or dict(type="PeerError", message="failed on another rank")
            tsides.pop(key, None)
    return out


def _worker(rank: int, store_path: str, out_path: str, args) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)   # 2 ranks on 2 shared cores: one intra-op thread each
    store = dist.FileStore(store_path, WORLD)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=args.timeout))
    g = torch.Generator().manual_seed(1234)
    n = args.warmup + args.steps
    vocab, seq = MODELS["gpt"]["vocab"], MODELS["gpt"]["seq_len"]   # the same for both shapes
    batches = [(torch.randint(0, vocab, (BATCH, seq), generator=g),
                torch.randint(0, vocab, (BATCH, seq), generator=g))
               for _ in range(n)]
    rows = []
    for shape in args.models:
        for strategy in args.plans:
            rows.append(_bench_plan(shape, strategy, rank, args, batches))
            if rank == 0:
                r = rows[-1]
                print(f"[{shape} {strategy}] fxpar {r.get('fxpar_median_ms', float('nan')):.2f} ms, "
                  f"torch {r['torch_median_ms']:.2f} ms", flush=True)
    if rank == 0:
        Path(out_path).write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# driver
# ---------------------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=60, help="measured steps per side")
    ap.add_argument("--warmup", type=int, default=5, help="unmeasured steps per side first")
    ap.add_argument("--plans", nargs="+", default=list(PLANS), choices=PLANS)
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--profile", action="store_true", help="cProfile fxpar's steps on rank 0")
    ap.add_argument("--compile", action="store_true",
                    help="also step prog.runner(compile=True) and the torch side under torch.compile")
    ap.add_argument("--timeout", type=float, default=300.0, help="process-group timeout, s")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "runtime.json"))
    args = ap.parse_args()

    import torch.multiprocessing as mp

    os.environ.setdefault("OMP_NUM_THREADS", "1")   # inherited by the spawned ranks
    with tempfile.TemporaryDirectory(prefix="fxpar-bench-") as tmp:
        out_path = os.path.join(tmp, "rows.json")
        mp.spawn(_worker, args=(os.path.join(tmp, "store"), out_path, args), nprocs=WORLD,
                 join=True)
        rows = json.loads(Path(out_path).read_text())

    print(f"\nGPTs {MODELS}, global batch {BATCH}, AdamW; {WORLD} gloo ranks x 1 thread; "
          f"medians over {args.steps} steps after {args.warmup} warm-up, interleaved")
    print(f"{'model':<9} {'strategy':<11} {'fxpar ms':>9} {'torch ms':>9} {'fxpar/torch':>12} "
          f"{'paired':>7} {'mins':>6} {'max|dloss|':>11}   torch side")
    for r in rows:
        if "fxpar_error" in r:
            e = r["fxpar_error"]
            print(f"{r['model']:<9} {r['strategy']:<11} {'error':>9} {r['torch_median_ms']:>9.2f} {'-':>12} "
                  f"{'-':>7} {'-':>6} {'-':>11}   {r['torch_side']}\n"
                  f"            fxpar: {e['type']}: {e['message'][:300]}")
            continue
        sides = [(r["strategy"], r)] + ([(r["strategy"] + "+vp", r["vocab_parallel"])]
                                         if "vocab_parallel" in r else [])
        for label, v in sides:
            print(f"{r['model']:<9} {label:<11} {r['fxpar_median_ms']:>9.2f} {v['torch_median_ms']:>9.2f} "
                  f"{v['ratio']:>12.3f} {v['paired_ratio_median']:>7.3f} {v['ratio_of_mins']:>6.3f} "
                  f"{v['loss_max_abs_diff']:>11.2e}   {v['torch_side']}")
    print("fxpar/torch: ratio of medians; paired: median of per-step ratios (same step index); "
          "mins: ratio of the fastest steps")
    for r in rows:
        if any(k.startswith(("fxpar_c_", "torch_c_")) for k in r):   # not fxpar_compile_s
            def ms(k):
                return f"{r[k]:.2f} ms" if k in r else f"error: {r.get(k.replace('median_ms', 'error'), {}).get('message', '?')[:200]}"
            print(f"compiled {r['model']} {r['strategy']}: fxpar {ms('fxpar_c_median_ms')} "
                  f"(compile {r.get('fxpar_c_compile_s', float('nan')):.0f} s), torch "
                  f"{ms('torch_c_median_ms')} (compile {r.get('torch_c_compile_s', float('nan')):.0f} s)"
                  + (f", torch+vp {ms('torch_vp_c_median_ms')}" if r['strategy'] == "megatron" else "")
                  + "; "
                  f"compiled/eager fxpar {r.get('compiled_over_eager', float('nan')):.3f}, "
                  f"compiled fxpar/torch {r.get('compiled_ratio', float('nan')):.3f}")
    for r in rows:
        if "fxpar_comm" in r:
            c = r["fxpar_comm"]
            print(f"fxpar {r['model']} {r['strategy']}: {c['forward_collective_edges']} edges with a forward "
                  f"collective, {c['backward_collective_edges']} with a gradient collective "
                  f"(of {c['edges']} edges; parameter-gradient buckets not counted)")
    for r in rows:
        for k, text in r.get("profile_rank0", {}).items():
            print(f"\n--- {r['model']} {r['strategy']} / {k}: cProfile of the measured steps, rank 0 ---")
            print(text)

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(
        date=datetime.datetime.now().isoformat(timespec="seconds"),
        python=platform.python_version(), torch=torch.__version__, machine=platform.machine(),
        cpus=os.cpu_count(), world=WORLD, backend="gloo", threads_per_rank=1,
        models={k: dict(name="examples.models.GPT", **v) for k, v in MODELS.items()
                if k in args.models}, global_batch=BATCH,
        optimizer=f"AdamW(lr={LR})", steps=args.steps, warmup=args.warmup,
        sample="max over ranks of one step's wall time (barrier before each step), ms",
        order="interleaved, rotating which side goes first", rows=rows), indent=1))
    try:
        shown = out.relative_to(ROOT)
    except ValueError:
        shown = out
    print(f"\nwrote {shown}")


if __name__ == "__main__":
    main()
