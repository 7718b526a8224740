"""Recomputation in the runtime, measured: step time and activation bytes of no, full and
selective recomputation on the same program (``./dev bench recompute``).

On 2 gloo processes of this machine (one intra-op thread each) a GPT
(:class:`examples.models.GPT`, 4 blocks, ``d_model`` 128, sequence 256, batch 8; fused
attention, and the attention written out as Megatron-LM's 2021 GPT has it, ``attention="math"``:
its ``s×s`` scores are what selective recomputation re-runs) is compiled once per plan
(``dp``: mesh ``dp=2``; ``megatron``: ``tp=2``, an all-reduce inside every block) and three
runners of it train side by side with AdamW: ``recompute=None``, ``recompute="all"`` at the
full granularity, and at the selective one (:mod:`fxpar.runtime.recompute`). The sides step
**interleaved** (the order rotates each round), a barrier before each step, a sample the
slowest rank's step; medians over ``--steps``. Their losses must be equal (the same math: a
check, printed).

Activation bytes: per side, what the rank holds for backward after a forward
(:class:`fxpar.runtime.memory.SavedBytes`, runners without regather), against the memory
model on the rank graph (:func:`fxpar.cost.memory.recompute_memory`,
:func:`~fxpar.cost.memory.activation_memory`).

    python benchmarks/recompute.py [--steps 30] [--out F]

Writes ``benchmarks/results/recompute.json``: per (model, plan) the median step of each side,
its ratio to no recomputation, the bytes held and predicted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

OUT = ROOT / "benchmarks" / "results" / "recompute.json"
MODEL = dict(vocab=512, d_model=128, n_heads=4, n_layers=4, seq_len=256)
BATCH = 8
PLANS = {"dp": {"dp": 2}, "megatron": {"tp": 2}}
SIDES = {"none": (None, "full"), "full": ("all", "full"), "selective": ("all", "selective")}


def measure(attention: str, plan: str, steps: int, warmup: int) -> dict:
    """Worker: one (model, plan) row, every side interleaved."""
    import torch.distributed as dist

    import fxpar
    from examples.models import GPT
    from fxpar.cost.memory import activation_memory, recompute_memory
    from fxpar.runtime.bindings import bind
    from fxpar.runtime.memory import SavedBytes

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT(**MODEL, attention=attention)
    gen = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, MODEL["vocab"], (BATCH, MODEL["seq_len"]), generator=gen) for _ in range(4)]
    batches = [(x, x.roll(-1, 1)) for x in ids]   # (tokens, next tokens)
    prog = fxpar.compile(model, fxpar.Cluster.local(dist.get_world_size()), batches[0],
                         plan=plan, mesh=PLANS[plan],
                         optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    runners = {k: prog.runner(recompute=rc, recompute_granularity=g) for k, (rc, g) in SIDES.items()}
    times: dict = {k: [] for k in SIDES}
    losses: dict = {k: [] for k in SIDES}
    order = list(SIDES)
    for i in range(warmup + steps):
        j = i % len(order)
        for k in order[j:] + order[:j]:
            dist.barrier()
            t0 = time.perf_counter()
            loss = runners[k].step(*batches[i % len(batches)])
            dt = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            losses[k].append(loss.item())
            if i >= warmup:
                times[k].append(dt.item())
    held, priced = {}, {}
    for k, (rc, g) in SIDES.items():
        r = prog.runner(recompute=rc, recompute_granularity=g, regather=False)
        with SavedBytes(exclude=r.state.values()) as sb:
            out = r.forward(*batches[0])
            held[k] = sb.sample()
            with bind(r.bindings):
                out[0].backward()
        r.states.finish_backward()
        priced[k] = (recompute_memory(r.gm, r.recompute, granularity=g).stash_bytes
                     if r.recompute else activation_memory(r.gm).saved_bytes)
    med = {k: statistics.median(v) for k, v in times.items()}
    return dict(attention=attention, plan=plan, mesh=PLANS[plan],
                median_ms={k: v * 1e3 for k, v in med.items()},
                step_over_none={k: med[k] / med["none"] for k in SIDES},
                held_bytes=held, predicted_bytes=priced,
                held_over_none={k: held[k] / held["none"] for k in SIDES},
                max_loss_diff=max(abs(a - b) for k in SIDES for a, b in zip(losses[k], losses["none"])),
                samples={k: v for k, v in times.items()})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args(argv)
    from fxpar.testing import WorkerPool

    t0 = time.perf_counter()
    rows = []
    with WorkerPool(2, timeout=900) as pool:
        for attention in ("sdpa", "math"):
            for plan in PLANS:
                rows.append(pool.run(measure, attention, plan, args.steps, args.warmup)[0])
    print(f"GPT {MODEL}, batch {BATCH}, 2 gloo ranks x 1 thread, AdamW; medians over "
          f"{args.steps} interleaved steps")
    print(f"{'attention':9s} {'plan':9s} {'side':10s} {'step ms':>8s} {'/none':>6s} "
          f"{'held KiB':>9s} {'/none':>6s} {'model KiB':>9s}")
    for r in rows:
        for k in SIDES:
            print(f"{r['attention']:9s} {r['plan']:9s} {k:10s} {r['median_ms'][k]:8.1f} "
                  f"{r['step_over_none'][k]:6.3f} {r['held_bytes'][k] / 1024:9.0f} "
                  f"{r['held_over_none'][k]:6.3f} {r['predicted_bytes'][k] / 1024:9.0f}")
        print(f"{'':20s} max |loss - none's| {r['max_loss_diff']:.2e}")
    Path(args.out).write_text(json.dumps(dict(
        benchmark="recompute", model=MODEL, batch=BATCH, steps=args.steps, warmup=args.warmup,
        date=time.strftime("%Y-%m-%dT%H:%M:%S"), total_s=round(time.perf_counter() - t0, 1),
        rows=rows), indent=1) + "\n")
    print("wrote", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
