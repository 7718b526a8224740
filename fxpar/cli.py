"""The ``fxpar`` command.

``fxpar demo``                 compile a small GPT for 4 local processes, print the plan and
                               rank 0's program, train it on 4 gloo processes next to a
                               single-process run, then plan a bigger GPT on a DGX A100 node
``fxpar presets``              list the cluster presets
``fxpar reshard SRC DST ...``  print the cheapest redistribution between two specs, e.g.
                               ``fxpar reshard "S(0)S(1)" RR --cluster dgx-a100 --nodes 2
                               --mesh dp=2,tp=8 --shape 4096,4096 --dtype bfloat16``
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _parse_mesh(text: str) -> dict[str, int]:
    out = {}
    for part in text.split(","):
        name, _, size = part.partition("=")
        if not size:
            raise SystemExit(f"--mesh wants name=size[,name=size...], got {text!r}")
        out[name.strip()] = int(size)
    return out


def _cluster(args):
    from fxpar import Cluster

    return Cluster.local(args.nodes) if args.cluster == "local" else Cluster.preset(args.cluster, nodes=args.nodes)


def cmd_presets(args) -> None:
    from fxpar import Cluster

    for name in Cluster.preset_names():
        print(Cluster.preset(name).describe())


def cmd_reshard(args) -> None:
    from fxpar import Mesh
    from fxpar.reshard import reshard_plan

    mesh = Mesh(_cluster(args), _parse_mesh(args.mesh))
    shape = tuple(int(s) for s in args.shape.split(","))
    plan = reshard_plan(args.src, args.dst, mesh, shape, args.dtype)
    print(f"{mesh!r}, tensor {shape} {args.dtype}")
    print(plan.describe())


def _import_examples():
    try:
        import examples.models as models
    except ImportError:
        # The demo's models live in the repository's examples/ folder, beside the package.
        root = Path(__file__).resolve().parents[1]
        if not (root / "examples" / "models.py").exists():
            raise SystemExit("fxpar demo needs the repository's examples/ folder (run it from a checkout)")
        sys.path.insert(0, str(root))
        import examples.models as models
    return models


_DEMO = dict(vocab=128, d_model=64, n_heads=4, n_layers=2, seq_len=32)
_DEMO_BATCH, _DEMO_STEPS, _DEMO_LR = 8, 5, 3e-3


def _demo_model_and_batch():
    import torch

    models = _import_examples()
    torch.manual_seed(0)
    model = models.GPT(**_DEMO)
    idx = torch.randint(0, _DEMO["vocab"], (_DEMO_BATCH, _DEMO["seq_len"]))
    return model, (idx, idx.roll(-1, dims=1))


def _demo_optimizer(params):
    import torch

    return torch.optim.AdamW(params, lr=_DEMO_LR)


def _demo_rank(plan_json: str) -> list[float]:
    """One rank of the demo (in a gloo group): receive the plan, build this rank's program from
    the same model (same seed, so the same weights) and train."""
    import fxpar

    model, batch = _demo_model_and_batch()
    prog = fxpar.compile(model, None, batch, plan=fxpar.Plan.from_json(plan_json),
                         optimizer=_demo_optimizer)
    runner = prog.runner()
    return [runner.step(*batch).item() for _ in range(_DEMO_STEPS)]


def cmd_demo(args) -> None:
    import torch

    import fxpar
    from fxpar.testing import WorkerPool

    world = 4
    model, batch = _demo_model_and_batch()
    cluster = fxpar.Cluster.local(world)
    print(f"== 1. compile a GPT ({_DEMO}) for {world} local processes, mesh dp=2 x tp=2 ==")
    prog = fxpar.compile(model, cluster, batch, mesh={"dp": 2, "tp": 2},
                         optimizer=_demo_optimizer)
    print(prog.explain())

    print("\n== 2. rank 0's program (local shapes, collectives and waits; specs as comments) ==")
    print(prog.rank_graph(0).print_readable(print_output=False))

    print(f"== 3. train {_DEMO_STEPS} steps on {world} gloo processes vs one process ==")
    with WorkerPool(world, timeout=600) as pool:
        losses = pool.run(_demo_rank, prog.plan.to_json())[0]
    ref, (idx, tgt) = _demo_model_and_batch()
    opt = _demo_optimizer(ref.parameters())
    print("  step  fxpar (4 ranks)  single process  |diff|")
    for k in range(_DEMO_STEPS):
        loss = ref(idx, tgt)
        loss.backward()
        opt.step()
        opt.zero_grad()
        print(f"  {k:>4}  {losses[k]:>15.6f}  {loss.item():>14.6f}  {abs(losses[k] - loss.item()):.1e}")

    print("\n== 4. the same planner on a real cluster: a GPT (d=1024) on one DGX A100 node ==")
    with torch.device("meta"):  # planning never allocates weights
        big = _import_examples().GPT(8192, 1024, 16, 2, 512)
    tokens = torch.zeros(32, 512, dtype=torch.long, device="meta")
    planned = fxpar.plan(big, fxpar.Cluster.preset("dgx-a100"), example_inputs=(tokens, tokens),
                         mesh={"dp": 2, "tp": 4})
    print(planned.explain())


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="fxpar", description="auto-parallelizing compiler for PyTorch")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("demo", help="compile a small GPT, show its plan and program, train it on 4 processes")
    sub.add_parser("presets", help="list the cluster presets")
    r = sub.add_parser("reshard", help="plan a redistribution between two specs")
    r.add_argument("src")
    r.add_argument("dst")
    r.add_argument("--cluster", default="dgx-a100", help="preset name or 'local'")
    r.add_argument("--nodes", type=int, default=1, help="nodes (or processes for 'local')")
    r.add_argument("--mesh", required=True, help="axes, e.g. dp=2,tp=4")
    r.add_argument("--shape", required=True, help="tensor shape, e.g. 1024,1024")
    r.add_argument("--dtype", default="float32")
    args = ap.parse_args(argv)
    {"demo": cmd_demo, "presets": cmd_presets, "reshard": cmd_reshard}[args.cmd](args)


if __name__ == "__main__":
    main()
