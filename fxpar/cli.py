"""The ``fxpar`` command (``fxpar COMMAND --help`` for each one's options).

``fxpar demo``                 compile a small GPT for 4 local processes, print the plan and
                               rank 0's program, train it on 4 gloo processes next to a
                               single-process run, then plan a bigger GPT on a DGX A100 node
                               and show the small one as a 2-stage pipeline (schedule, bubble)
``fxpar presets``              list the cluster presets
``fxpar reshard SRC DST ...``  print the cheapest redistribution between two specs, e.g.
                               ``fxpar reshard "S(0)S(1)" RR --cluster dgx-a100 --nodes 2
                               --mesh dp=2,tp=8 --shape 4096,4096 --dtype bfloat16``
``fxpar plan FILE.py:FUNC``    plan your model: ``FUNC()`` returns ``(model, example_inputs)``
                               (or ``(model, inputs, kwargs)``; a meta-device model is fine);
                               prints each phase's time (stderr) and ``explain()``; ``--json``
                               writes the plan
``fxpar explain PLAN.json``    print a saved plan (``--json`` output or ``Program.save``)
``fxpar compare A.json B.json``  two plans of one model side by side: totals, per-layer costs,
                               and every node whose strategy differs
``fxpar dump FILE.py:FUNC --out DIR``  compile and write every rank's readable program to
                               ``DIR/rank{r}.py``
``fxpar verify FILE.py:FUNC``  compile for ``--mesh`` and run ``prog.verify`` (every node's value
                               and gradient against one process; exit status 1 if one
                               diverges): under torchrun on its ranks, else on that many local
                               gloo processes; ``FUNC()`` must build the same model and batch on
                               every rank (seed it) and the model must return its loss
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

    if args.cluster == "env":   # the launch's own shape (torchrun / SLURM variables)
        return Cluster.from_env()
    return Cluster.local(args.nodes) if args.cluster == "local" else Cluster.preset(args.cluster, nodes=args.nodes)


def cmd_presets(args) -> None:
    from fxpar import Cluster

    for name in Cluster.preset_names():
        print(Cluster.preset(name).describe())


def cmd_reshard(args) -> None:
    from fxpar import Mesh
    from fxpar.resharding.intra import reshard_plan

    mesh = Mesh(_cluster(args), _parse_mesh(args.mesh))
    shape = tuple(int(s) for s in args.shape.split(","))
    plan = reshard_plan(args.src, args.dst, mesh, shape, args.dtype)
    print(f"{mesh!r}, tensor {shape} {args.dtype}")
    print(plan.describe())


def _load_target(target: str):
    """``FILE.py:FUNC`` -> ``(model, args, kwargs)`` from ``FUNC()``."""
    import importlib.util

    path, _, func = target.rpartition(":")
    if not path or not func:
        raise SystemExit(f"expected FILE.py:FUNC, got {target!r}")
    spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    if spec is None or not Path(path).exists():
        raise SystemExit(f"no such file: {path}")
    mod = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(Path(path).resolve().parent))
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.path.pop(0)
    if not hasattr(mod, func):
        raise SystemExit(f"{path} has no function {func!r}")
    got = getattr(mod, func)()
    if not isinstance(got, tuple) or len(got) not in (2, 3):
        raise SystemExit(f"{target}() must return (model, example_inputs) or (model, inputs, kwargs)")
    model, inputs = got[0], got[1]
    import torch

    args = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
    return model, args, (dict(got[2]) if len(got) == 3 else {})


class _Phases:
    """Prints ``[fxpar] phase ... 1.23 s`` to stderr as each phase ends (the progress a
    terminal user sees; stdout keeps the result)."""

    def __init__(self) -> None:
        self.times: dict[str, float] = {}

    def run(self, name: str, fn, *a, lines: bool = False, **kw):
        """Time ``fn(*a, **kw)``; ``lines``: the phase prints lines of its own (``say``)."""
        import time

        print(f"[fxpar] {name} ...", end="\n" if lines else "", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        try:
            out = fn(*a, **kw)
        except BaseException:
            print(f"{f'[fxpar] {name}:' if lines else ''} failed", file=sys.stderr, flush=True)
            raise
        self.times[name] = time.perf_counter() - t0
        print(f"{f'[fxpar] {name}:' if lines else ''} {self.times[name]:.2f} s", file=sys.stderr, flush=True)
        return out

    @staticmethod
    def say(line: str) -> None:
        print(f"[fxpar]   {line}", file=sys.stderr, flush=True)


def _plan_target(args, phases: _Phases):
    import fxpar

    model, inputs, kwargs = phases.run("build model (your code)", _load_target, args.target)
    mesh = _parse_mesh(args.mesh) if args.mesh else None
    if mesh is not None and "pp" in mesh:  # a pipeline: captured at the microbatch shape
        return phases.run(f"capture + plan {args.plan} pipeline", fxpar.plan, model,
                          _cluster(args), inputs, kwargs, mesh=mesh, plan=args.plan,
                          time_limit=args.time_limit, **_pipeline_args(args))
    gm = phases.run("capture", fxpar.capture, model, inputs, kwargs)
    return phases.run(f"plan {args.plan}", fxpar.plan, model, _cluster(args), inputs, kwargs,
                      mesh=mesh, plan=args.plan, graph=gm, time_limit=args.time_limit,
                      progress=phases.say, lines=True)


def _pipeline_args(args) -> dict:
    return dict(schedule=args.schedule, microbatches=args.microbatches, chunks=args.chunks)


def cmd_plan(args) -> None:
    planned = _plan_target(args, _Phases())
    print(planned.explain())
    if args.json:
        Path(args.json).write_text(planned.plan.to_json(indent=1))
        print(f"[fxpar] wrote {args.json}", file=sys.stderr)


def _read_plan(path: str):
    import json

    from fxpar.plan_data import Plan

    d = json.loads(Path(path).read_text())
    return Plan.from_dict(d["plan"] if d.get("fxpar_program") == 1 else d)


def cmd_explain(args) -> None:
    print(_read_plan(args.plan).explain())


def _plan_parts(plan):
    """``(nodes, layer rows)`` of a plan; a pipeline's are its stage chunks' together (a
    boundary value once, as its producer's node; a pseudo layer several chunks have, such as
    ``(inputs)``, summed over them)."""
    if not plan.stages:
        return list(plan.nodes), plan.layers()
    nodes, rows = [], {}
    for st in plan.stages:
        nodes += st.plan.nodes
    # a boundary value is a placeholder of the chunk that receives it: keep its producer
    made = {n.name for n in nodes if n.op != "placeholder"}
    nodes = [n for n in nodes if n.op != "placeholder" or n.name not in made]
    for st in plan.stages:
        for r in st.plan.layers():
            if r["layer"] in rows:
                acc = rows[r["layer"]]
                acc.update(fwd=acc["fwd"] + r["fwd"], bwd=acc["bwd"] + r["bwd"],
                           memory=acc["memory"] + r["memory"],
                           comm={k: acc["comm"].get(k, 0.0) + r["comm"].get(k, 0.0)
                                 for k in {**acc["comm"], **r["comm"]}})
            else:
                rows[r["layer"]] = dict(r)
    return nodes, list(rows.values())


def _pipeline_rows(a, b, ms) -> list[str]:
    """The configurations, schedules and stage chunks of two plans (either may be a pipeline):
    per chunk its rank and layers and its forward + backward ms."""
    def sched(p):
        s = p.schedule
        if not s:
            return "-"
        v = f" v={s['chunks']}" if s.get("chunks", 1) > 1 else ""
        place = f" ({s['placement']})" if s.get("placement", "loop") != "loop" else ""
        return f"{s['name']}{v}{place} m={s['microbatches']}"

    def bubble(p):
        return f"{100 * p.schedule['bubble']:.1f}%" if "bubble" in p.schedule else "-"

    def chunk(p, k):
        if k >= len(p.stages):
            return "-"
        st = p.stages[k]
        span = st.layers[0] if len(st.layers) == 1 else f"{st.layers[0]}..{st.layers[-1]}"
        return f"r{st.rank} {span} {ms(st.plan.compute_fwd + st.plan.compute_bwd)}"

    lines = [f"  {'config':<10}A: {a.config.name if a.config else '-'}",
             f"  {'':<10}B: {b.config.name if b.config else '-'}",
             f"  {'schedule':<10}{sched(a):>24}{sched(b):>24}",
             f"  {'bubble':<10}{bubble(a):>24}{bubble(b):>24}",
             "", "stage chunks: rank, layers, fwd+bwd ms"]
    for k in range(max(len(a.stages), len(b.stages))):
        lines.append(f"  {k:<4}A {chunk(a, k):<40} B {chunk(b, k)}")
    return lines


def compare_plans(a, b, names=("A", "B")) -> str:
    """Two plans of one model side by side (as autoparallel's ``diff_solutions``): totals with
    deltas (pipelines: also configuration, schedule, bubble and stage chunks), per-layer
    compute/comm/memory deltas, then every node whose strategy differs."""
    from fxpar.units import fmt_bytes

    def ms(t):
        return f"{t * 1e3:.4g}"

    lines = [f"A = {names[0]}: {a}", f"B = {names[1]}: {b}", "",
             f"  {'':<10}{'A':>12}{'B':>12}{'B - A':>12}"]
    for label, x, y, f in (("step ms", a.time, b.time, ms), ("compute ms", a.compute, b.compute, ms),
                           ("comm ms", a.comm, b.comm, ms), ("memory", a.memory, b.memory, fmt_bytes)):
        d = y - x
        lines.append(f"  {label:<10}{f(x):>12}{f(y):>12}{('+' if d >= 0 else '-') + f(abs(d)):>12}")
    if a.stages or b.stages:
        lines += [""] + _pipeline_rows(a, b, ms)
    na, rows_a = _plan_parts(a)
    nb_, rows_b = _plan_parts(b)
    la, lb = {r["layer"]: r for r in rows_a}, {r["layer"]: r for r in rows_b}
    lines += ["", "per layer (B - A): compute ms, comm ms, memory"]
    for layer in list(la) + [x for x in lb if x not in la]:
        ra, rb = la.get(layer), lb.get(layer)
        ca = (ra["fwd"] + ra["bwd"]) if ra else 0.0
        cb = (rb["fwd"] + rb["bwd"]) if rb else 0.0
        ma, mb = (sum(ra["comm"].values()) if ra else 0.0), (sum(rb["comm"].values()) if rb else 0.0)
        mema, memb = (ra["memory"] if ra else 0), (rb["memory"] if rb else 0)
        if (ca, ma, mema) != (cb, mb, memb):
            lines.append(f"  {layer:<24} compute {ms(cb - ca):>9}  comm {ms(mb - ma):>9}  "
                         f"memory {'+' if memb >= mema else '-'}{fmt_bytes(abs(memb - mema))}")
    nb = {n.name: n for n in nb_}
    diff = [(n, nb[n.name]) for n in na if n.name in nb and n.strategy != nb[n.name].strategy]
    lines += ["", f"nodes whose strategy differs: {len(diff)} of {len(na)}"]
    lines += [f"  {x.name} ({x.op}, {x.layer}): {x.strategy}  ->  {y.strategy}" for x, y in diff]
    missing = sorted(set(nb) ^ {n.name for n in na})
    if missing:
        lines.append(f"nodes in only one plan (plans of different models?): {missing[:8]}")
    return "\n".join(lines)


def cmd_compare(args) -> None:
    print(compare_plans(_read_plan(args.a), _read_plan(args.b), (args.a, args.b)))


def cmd_dump(args) -> None:
    import fxpar

    phases = _Phases()
    model, inputs, kwargs = phases.run("build model (your code)", _load_target, args.target)
    prog = phases.run(f"capture + plan {args.plan}", fxpar.compile, model, _cluster(args), inputs,
                      kwargs, plan=args.plan, training=not args.inference, time_limit=args.time_limit,
                      mesh=_parse_mesh(args.mesh) if args.mesh else None, **_pipeline_args(args))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # a pipeline: one program per stage chunk on each of its ranks
    files = ([(f"rank{r}_chunk{st.index}.py", r, st.index) for st in prog.plan.stages
              for r in st.plan.mesh["devices"]] if prog.plan.stages else
             [(f"rank{r}.py", r, None) for r in prog.mesh.devices])

    def emit():
        for name, r, k in files:
            (out / name).write_text(prog.rank_graph(r, chunk=k).print_readable(print_output=False))
    phases.run(f"emit {len(files)} rank programs", emit)
    print(f"wrote {len(files)} files to {out}/ ({files[0][0]} ... {files[-1][0]})")


def _verify_rank(target: str, mesh: dict, plan: str, time_limit: float, pipeline: dict) -> str:
    """One rank of ``fxpar verify``: build, compile, verify; the report's text."""
    import fxpar

    model, inputs, kwargs = _load_target(target)
    import torch.distributed as dist

    cluster = fxpar.Cluster.local(dist.get_world_size())
    if "pp" not in mesh:
        pipeline = {}
    prog = fxpar.compile(model, cluster, inputs, kwargs, plan=plan, mesh=mesh,
                         time_limit=time_limit, **pipeline)
    r = prog.verify(*inputs, **kwargs)
    return ("OK " if r.ok else "DIVERGED ") + str(r)


def cmd_verify(args) -> None:
    import math
    import os

    mesh = _parse_mesh(args.mesh)
    call = (args.target, mesh, args.plan, args.time_limit, _pipeline_args(args))
    if "WORLD_SIZE" in os.environ:   # under torchrun: this process is one rank
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group("gloo")
        text = _verify_rank(*call)
        if dist.get_rank() == 0:
            print(text)
    else:
        from fxpar.testing import WorkerPool

        sys.path.insert(0, str(Path(args.target.rpartition(":")[0]).resolve().parent))
        with WorkerPool(math.prod(mesh.values()), timeout=args.timeout) as pool:
            text = pool.run(_verify_rank, *call)[0]
        print(text)
    if not text.startswith("OK"):
        raise SystemExit(1)


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

    print("\n== 5. pipelines: the same small GPT in 2 stages (mesh pp=2), 1F1B over 4 microbatches ==")
    model, batch = _demo_model_and_batch()
    pipe = fxpar.compile(model, fxpar.Cluster.local(2), batch, mesh={"pp": 2}, schedule="1f1b",
                         microbatches=4, optimizer=_demo_optimizer)
    print(pipe.explain().split("\n-- stage ")[0])   # the pipeline table (each stage's plan follows)
    print(pipe.schedule.text(compute_only=True))      # rank x step grid: F/B of stage, microbatch
    sim = pipe.simulate()                             # discrete-event simulation of the action lists
    print(f"simulated step {sim.step_time * 1e3:.2f} ms, bubble {sim.bubble_fraction:.1%} "
          f"(equal stages: (p-1)/m = 25%); runner = pipe.runner(); runner.step(idx, tgt) under "
          "torch.distributed runs it")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="fxpar", description="auto-parallelizing compiler for PyTorch")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("demo", help="compile a small GPT, show its plan and program, train it on 4 processes")
    sub.add_parser("presets", help="list the cluster presets")
    r = sub.add_parser("reshard", help="plan a redistribution between two specs")
    r.add_argument("src")
    r.add_argument("dst")
    r.add_argument("--cluster", default="dgx-a100",
                   help="preset name, 'local', or 'env' (the launch's nodes from torchrun/SLURM variables)")
    r.add_argument("--nodes", type=int, default=1, help="nodes (or processes for 'local')")
    r.add_argument("--mesh", required=True, help="axes, e.g. dp=2,tp=4")
    r.add_argument("--shape", required=True, help="tensor shape, e.g. 1024,1024")
    r.add_argument("--dtype", default="float32")
    for name, helptext in (("plan", "plan your model (FILE.py:FUNC returns (model, example_inputs))"),
                           ("dump", "compile and write every rank's readable program to --out DIR")):
        q = sub.add_parser(name, help=helptext, epilog=_EXAMPLES[name],
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        q.add_argument("target", help="FILE.py:FUNC")
        q.add_argument("--cluster", default="dgx-a100",
                       help="preset name, 'local', or 'env' (the launch's nodes from torchrun/SLURM variables)")
        q.add_argument("--nodes", type=int, default=1, help="nodes (or processes for 'local')")
        q.add_argument("--mesh", help="axes, e.g. dp=4,tp=8 (default: searched)")
        q.add_argument("--plan", default="auto", help="auto, dp, zero3, megatron or axonn")
        q.add_argument("--time-limit", type=float, default=60.0, help="solver seconds per mesh")
        q.add_argument("--schedule", default="1f1b", help="pipeline schedule (a pp axis in --mesh)")
        q.add_argument("--microbatches", type=int, default=1, help="pipeline microbatches")
        q.add_argument("--chunks", type=int, default=None,
                   help="chunks per pipeline rank (interleaved; default: the schedule's, "
                   "two for zbv and dualpipev)")
        if name == "plan":
            q.add_argument("--json", help="write the plan here")
        else:
            q.add_argument("--out", required=True, help="directory for rank{r}.py")
            q.add_argument("--inference", action="store_true", help="forward-only programs")
    v = sub.add_parser("verify", help="compile FILE.py:FUNC for --mesh and compare every node "
                       "with one process", epilog=_EXAMPLES["verify"],
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    v.add_argument("target", help="FILE.py:FUNC")
    v.add_argument("--mesh", required=True, help="axes, e.g. dp=2,tp=2 (local processes: their product)")
    v.add_argument("--plan", default="auto", help="auto, dp, zero3, megatron or axonn")
    v.add_argument("--time-limit", type=float, default=20.0, help="solver seconds")
    v.add_argument("--timeout", type=float, default=600.0, help="seconds before the ranks are killed")
    v.add_argument("--schedule", default="1f1b", help="pipeline schedule (a pp axis in --mesh)")
    v.add_argument("--microbatches", type=int, default=1, help="pipeline microbatches")
    v.add_argument("--chunks", type=int, default=None,
                   help="chunks per pipeline rank (interleaved; default: the schedule's, "
                   "two for zbv and dualpipev)")
    e = sub.add_parser("explain", help="print a saved plan")
    e.add_argument("plan", help="plan JSON (fxpar plan --json, or Program.save)")
    c = sub.add_parser("compare", help="two plans of one model side by side")
    c.add_argument("a")
    c.add_argument("b")
    args = ap.parse_args(argv)
    cmd = {"demo": cmd_demo, "presets": cmd_presets, "reshard": cmd_reshard, "plan": cmd_plan,
           "explain": cmd_explain, "compare": cmd_compare, "dump": cmd_dump,
           "verify": cmd_verify}[args.cmd]
    from fxpar.errors import FxparError

    try:
        cmd(args)
    except FxparError as e:   # bad input: its message, not a traceback (exit status 1)
        raise SystemExit(f"fxpar {args.cmd}: {type(e).__name__}: {e}") from e


_EXAMPLES = {
    "plan": """examples:
  fxpar plan my_model.py:build --cluster dgx-a100 --nodes 8
  fxpar plan my_model.py:build --cluster dgx-a100 --nodes 8 --mesh dp=8,tp=8 --plan megatron --json m.json
  fxpar explain m.json
  fxpar compare auto.json m.json""",
    "dump": """examples:
  fxpar dump my_model.py:build --cluster local --nodes 4 --mesh dp=2,tp=2 --out ranks/""",
    "verify": """examples:
  fxpar verify my_model.py:build --mesh dp=2,tp=2 --plan megatron     # 4 local gloo processes
  torchrun --nproc-per-node 4 -m fxpar.cli verify my_model.py:build --mesh dp=2,tp=2""",
}


if __name__ == "__main__":
    main()
