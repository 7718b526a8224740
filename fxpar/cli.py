"""The ``fxpar`` command.

``fxpar demo``                 capture a small GPT, build a cluster and a mesh, print the
                               captured graph with shapes, resharding plans and a parallel plan
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


def cmd_demo(args) -> None:
    import torch

    import fxpar
    from fxpar import ir
    from fxpar.reshard import reshard_plan

    models = _import_examples()
    torch.manual_seed(0)
    vocab, d, heads, layers, seq, batch = 256, 64, 4, 2, 32, 8
    with torch.device("meta"):  # planning never allocates weights
        model = models.GPT(vocab, d, heads, layers, seq)
    idx = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    gm = fxpar.capture(model, (idx, idx))

    print("== 1. captured graph (torch.export, non-strict, fake tensors; meta-device weights) ==")
    print(ir.format_graph(gm, params=False))
    params = ir.params(gm)
    total = sum(p.numel for p in params.values())
    print(f"\n{len(params)} parameters, {total:,} elements; e.g.")
    for p in list(params.values())[:4]:
        print(f"  {p.fqn:<28} {tuple(p.shape)} {p.dtype}")

    cluster = fxpar.Cluster.preset("dgx-a100", nodes=2)
    mesh = fxpar.Mesh(cluster, dp=2, tp=8)
    print("\n== 2. cluster and mesh ==")
    print(cluster.describe())
    print(f"{mesh!r}: tp groups {mesh.groups('tp')[0]} (one node), dp groups {mesh.groups('dp')[0]} "
          f"(span {mesh.nodes_of_axis('dp')} nodes)")

    # The MLP's first weight after a column split, gathered back for a replicated consumer.
    w = next(p for p in params.values() if len(p.shape) == 2 and "mlp" in p.fqn.lower()) \
        if any("mlp" in p.fqn.lower() for p in params.values()) else next(iter(params.values()))
    print("\n== 3. resharding plans ==")
    for src, dst, shape in [("S(0)S(1)", "RR", (batch * seq, d)),
                            ("RP(sum)", "RS(0)", tuple(w.shape)),
                            ("S(0)S(0)", "S(1)R", (4096, 4096))]:
        plan = reshard_plan(src, dst, mesh, shape, torch.bfloat16)
        print(f"\n{src} -> {dst} for a {shape} bf16 tensor:")
        print(plan.describe())

    # A model big enough that sharding pays (a toy one is cheapest fully replicated).
    print("\n== 4. plan for a GPT (d=1024, 2 layers, batch 32 x 512) on one DGX A100 node, mesh dp=2 x tp=4 ==")
    with torch.device("meta"):
        big = models.GPT(8192, 1024, 16, 2, 512)
    tokens = torch.zeros(32, 512, dtype=torch.long, device="meta")
    planned = fxpar.plan(big, fxpar.Cluster.preset("dgx-a100"), example_inputs=(tokens, tokens),
                         mesh={"dp": 2, "tp": 4})
    print(planned.explain())


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="fxpar", description="auto-parallelizing compiler for PyTorch")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("demo", help="capture a small GPT and show a cluster, mesh and resharding plans")
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
