"""GPU benchmark: fxpar's first runs on a CUDA device (one GPU), NCCL and gloo paths.

Nothing in the suite needs a GPU; this script is what a session with a lent GPU runs first
(``./dev bench gpu``, or ``python3 benchmarks/gpu.py`` where torch and OR-Tools are installed).
Every section is isolated: a failure is recorded with its traceback and the next one runs.

* ``env``: torch, CUDA, the device; measured ceilings: a bf16 and a float32 (TF32 off)
  ``n×n @ n×n`` GEMM (``2n³`` FLOPs, median of CUDA-event timings, random data) and a
  device-to-device copy (bytes read + written), next to the cluster preset's nominal figures.
* ``calibrate``: :meth:`fxpar.Cluster.calibrate` on a one-rank NCCL group (compute only: GEMM
  curve, memory, vector, attention, AdamW, per-op overheads), the numbers the planner would
  price with.
* ``parity``: a small HF Llama (float32, TF32 off) compiled by fxpar for one NCCL rank
  (``plan="dp"``), captured on the CPU and run with ``runner(device="cuda")``, trained 5 AdamW
  steps next to the same model trained eagerly on the GPU: ``max |Δloss|``; then
  ``prog.verify`` on the GPU (every node's value and gradient against one process).
* ``speed``: a ~0.5B-parameter HF Llama in bf16 (batch × seq tokens per step), fxpar's one-rank
  program against the hand-written eager step (``loss.backward(); opt.step()``), AdamW on both,
  stepping interleaved (A B, B A, ...); medians, tokens/s, measured peak memory
  (``torch.cuda.max_memory_allocated``) against the plan's ``memory`` and measured step against
  the plan's ``time`` under the nominal preset and under the calibrated cluster.
* ``profile``: ``torch.profiler`` over three steps of each ``speed`` side: the top ops by
  self device time, device milliseconds and kernels per step, and the rank graph's op counts.
* ``compiled``: the ``speed`` model again, each side through ``torch.compile`` (fxpar:
  ``prog.runner(compile=True)``; eager: the model), interleaved
  as above, compile time recorded (issue #26's question: what compiling the emitted program buys).
* ``gloo2``: two processes on the one GPU over gloo with CUDA tensors (NCCL refuses two ranks
  on one device): ``dp=2`` and ``megatron`` ``tp=2`` on a small float32 Llama, 3 steps against
  one process, and ``prog.verify``; the multi-rank CUDA paths of the runtime.

    python benchmarks/gpu.py                      # writes benchmarks/results/gpu.json
    python benchmarks/gpu.py --sections env parity --out /tmp/gpu.json
    python benchmarks/gpu.py --quick              # tiny sizes (also runs on a CPU, to check the script)
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]

SECTIONS = ("env", "calibrate", "parity", "speed", "profile", "compiled", "gloo2")


def _dev() -> torch.device:
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _time(fn, reps: int) -> float:
    """Median seconds of ``fn()`` over ``reps`` timed calls after two warm-ups."""
    fn(), fn()
    ts = []
    for _ in range(reps):
        _sync()
        t0 = time.perf_counter()
        fn()
        _sync()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def _preset(n_devices: int = 1):
    """The nominal cluster for this device: ``dgx-h100`` scaled to ``n_devices`` (H200: its
    memory and bandwidth), else ``Cluster.local``."""
    import fxpar

    if not torch.cuda.is_available():
        return fxpar.Cluster.local(n_devices)
    name = torch.cuda.get_device_name(0)
    base = fxpar.Cluster.preset("dgx-h100", nodes=1)
    upd = dict(devices_per_node=n_devices, device_memory=torch.cuda.get_device_properties(0).total_memory,
               device_type=name, name="gpu-" + name.split()[-1].lower())
    if "H200" in name:
        upd["memory_bandwidth"] = 4800e9
    return dataclasses.replace(base, **upd)


def _llama(hidden, layers, heads, vocab, seq, dtype=torch.float32, seed=0):
    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=int(2.6875 * hidden) // 64 * 64,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                         max_position_embeddings=seq, use_cache=False, attn_implementation="sdpa")
    torch.manual_seed(seed)
    return tf.LlamaForCausalLM(cfg).to(dtype)


def _init_nccl():
    if dist.is_initialized():
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    kw = {"device_id": _dev()} if backend == "nccl" else {}
    dist.init_process_group(backend, init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1, **kw)


# -- sections --------------------------------------------------------------------------------
def sec_env(args) -> dict:
    out = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
           "host": platform.node()}
    try:
        import transformers
        out["transformers"] = transformers.__version__
    except ImportError:
        pass
    if not torch.cuda.is_available():
        out["device"] = "cpu"
        return out
    p = torch.cuda.get_device_properties(0)
    out.update(device=p.name, sms=p.multi_processor_count, memory_gib=p.total_memory / 2**30,
               capability=f"{p.major}.{p.minor}", nccl=".".join(map(str, torch.cuda.nccl.version())))
    n = 1024 if args.quick else 8192
    for dt, tf32 in ((torch.bfloat16, False), (torch.float32, False), (torch.float32, True)):
        torch.backends.cuda.matmul.allow_tf32 = tf32
        a, b = (torch.randn(n, n, device="cuda", dtype=dt) for _ in range(2))
        t = _time(lambda: torch.mm(a, b), 10)
        out[f"gemm_{str(dt)[6:]}{'_tf32' if tf32 else ''}_tflops"] = 2 * n**3 / t / 1e12
    torch.backends.cuda.matmul.allow_tf32 = False
    x = torch.randn(2**28 // (16 if args.quick else 1), device="cuda")  # 1 GiB of float32
    y = torch.empty_like(x)
    t = _time(lambda: y.copy_(x), 10)
    out["copy_tbps"] = 2 * x.numel() * 4 / t / 1e12
    pre = _preset()
    out["preset"] = {"name": pre.name, "peak_tflops": pre.peak_flops / 1e12,
                     "memory_tbps": pre.memory_bandwidth / 1e12}
    return out


def sec_calibrate(args) -> dict:
    import fxpar

    _init_nccl()
    base = _preset()
    gem = (256, 1024, 4096) if args.quick or not torch.cuda.is_available() else (256, 1024, 4096, 8192)
    mem = (2**16, 2**20, 2**24) if args.quick else (2**16, 2**20, 2**24, 2**28)
    t0 = time.perf_counter()
    # in the dtype the speed section trains in (bf16 on a GPU), as a user calibrating for it would
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    cal = fxpar.Cluster.calibrate(None, base=base, collectives=(), gemm_sizes=gem, memory_sizes=mem,
                                  iters=3, min_time=0.02, dtype=dtype)
    cp = cal.compute
    return {"seconds": time.perf_counter() - t0, "dtype": cp.dtype, "asynchronous": cp.asynchronous,
            "peak_tflops": cal.peak_flops / 1e12,
            "memory_tbps": cal.memory_bandwidth / 1e12,
            "gemm": [(f, r / 1e12) for f, r in cp.gemm], "vector": [(f, r / 1e12) for f, r in cp.vector],
            "attention": [(f, r / 1e12) for f, r in cp.attention], "optimizer": list(cp.optimizer),
            "op_overhead_us": cp.op_overhead * 1e6, "bwd_op_overhead_us": cp.bwd_op_overhead * 1e6,
            "dispatch_us": cp.dispatch * 1e6, "_cluster": cal}


def _eager_step(model, opt, ids):
    loss = model(ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


class _MasterStep:
    """The hand-written bf16 step with fp32 master weights (Megatron's ``Float16OptimizerWithFloat16Params``,
    what fxpar's runtime does for bf16 parameters): the optimizer steps fp32 copies on
    fp32 gradients and the bf16 parameters are copied back. Plain ``AdamW`` over bf16
    parameters (``_eager_step``) rounds every update to bf16 and keeps bf16 states: cheaper,
    and a different trajectory."""

    def __init__(self, model, opt_fn):
        self.model, self.params = model, [p for p in model.parameters() if p.requires_grad]
        self.masters = [p.detach().float().requires_grad_() for p in self.params]
        self.opt = opt_fn(self.masters)

    def __call__(self, ids):
        loss = self.model(ids, labels=ids).loss
        loss.backward()
        for p, m in zip(self.params, self.masters):
            m.grad, p.grad = p.grad.float(), None
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            torch._foreach_copy_(self.params, self.masters)
        return loss.detach()


def _parity_run(cluster, plan: str, mesh: dict, seq: int, steps: int, seed: int) -> dict:
    """A small float32 HF Llama compiled by fxpar and the same model trained eagerly on this
    device, ``steps`` AdamW steps each: both loss lists, their largest gap, then
    ``prog.verify`` of the first batch (its error recorded, the losses kept)."""
    import fxpar

    dev = _dev()
    vocab, bsz = 512, 4
    model = _llama(128, 2, 4, vocab, seq)
    ref = copy.deepcopy(model).to(dev)
    g = torch.Generator().manual_seed(seed)
    batches = [torch.randint(0, vocab, (bsz, seq), generator=g).to(dev) for _ in range(steps)]
    t0 = time.perf_counter()
    prog = fxpar.compile(model, cluster, (batches[0].cpu(),), {"labels": batches[0].cpu()}, plan=plan,
                         mesh=mesh, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    out = {"compile_s": time.perf_counter() - t0}
    runner = prog.runner(device=str(dev))
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    fx_l = [float(runner.step(ids, labels=ids)) for ids in batches]
    ref_l = [float(_eager_step(ref, opt, ids)) for ids in batches]
    out.update(fxpar_losses=fx_l, eager_losses=ref_l, max_dloss=max(abs(a - b) for a, b in zip(fx_l, ref_l)))
    t0 = time.perf_counter()
    try:
        rep = prog.verify(batches[0], labels=batches[0])
        out.update(verify_ok=rep.ok, verify_s=time.perf_counter() - t0, verify_checked=rep.checked,
                   verify_first=str(rep.first) if not rep.ok else None)
    except Exception as e:  # noqa: BLE001 - the losses above are still a result
        out.update(verify_error=f"{type(e).__name__}: {e}", verify_traceback=traceback.format_exc()[-3000:])
    return out


def sec_parity(args) -> dict:
    _init_nccl()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return _parity_run(_preset(), "dp", {"dp": 1}, seq=64, steps=5, seed=1)


def sec_speed(args) -> dict:
    import fxpar

    _init_nccl()
    dev = _dev()
    torch.backends.cuda.matmul.allow_tf32 = True
    if args.quick:
        hidden, layers, heads, vocab, seq, bsz, steps = 128, 2, 4, 512, 64, 2, 4
    else:
        hidden, layers, heads, vocab, seq, bsz, steps = 2048, 8, 16, 32000, 2048, 4, args.steps
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    model = _llama(hidden, layers, heads, vocab, seq, dtype)
    out = {"model": dict(hidden=hidden, layers=layers, heads=heads, vocab=vocab, seq=seq, batch=bsz,
                         dtype=str(dtype), params=sum(p.numel() for p in model.parameters()))}
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, vocab, (bsz, seq), generator=g)
    opt_fn = lambda ps: torch.optim.AdamW(ps, lr=1e-4)  # noqa: E731
    t0 = time.perf_counter()
    prog = fxpar.compile(model, _preset(), (ids,), {"labels": ids}, plan="dp", mesh={"dp": 1},
                         optimizer=opt_fn)
    out["compile_s"] = time.perf_counter() - t0
    out["pred_time_nominal_ms"] = prog.plan.time * 1e3
    out["pred_memory_gib"] = prog.plan.memory / 2**30
    cal = args.calibrated
    if cal is not None:
        try:
            p2 = fxpar.compile(model, cal, (ids,), {"labels": ids}, plan="dp", mesh={"dp": 1},
                               optimizer=opt_fn, emit=False)
            out["pred_time_calibrated_ms"] = p2.plan.time * 1e3
        except Exception as e:  # noqa: BLE001 - recorded, the measurement goes on
            out["pred_time_calibrated_error"] = f"{type(e).__name__}: {e}"
    idd = ids.to(dev)
    built = {}

    def make_fxpar():
        built["runner"] = runner = prog.runner(device=str(dev))
        return lambda: runner.step(idd, labels=idd)

    def make_eager():
        built["ref"] = ref = copy.deepcopy(model).to(dev)
        ref_opt = opt_fn(ref.parameters())
        return lambda: _eager_step(ref, ref_opt, idd)

    def make_master():  # fxpar keeps fp32 masters of low-precision parameters: so does this side
        master = _MasterStep(copy.deepcopy(model).to(dev), opt_fn)
        return lambda: master(idd)

    makers = {"fxpar": make_fxpar, "eager": make_eager}
    if dtype != torch.float32:
        makers["eager_fp32_master"] = make_master
    sides, losses, peak = {}, {k: [] for k in makers}, {}
    for k, make in makers.items():
        # each side's own peak: built and warmed up (2 steps) with the earlier sides resident,
        # whose bytes (constant meanwhile) are subtracted
        _sync()
        before = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        sides[k] = fn = make()
        for _ in range(2):
            losses[k].append(float(fn()))
        _sync()
        if torch.cuda.is_available():
            peak[k] = (torch.cuda.max_memory_allocated() - before) / 2**30
    model = None   # freed: the sides hold their own copies (the makers ran above)
    runner, ref = built["runner"], built["ref"]
    samples = _interleave(sides, steps, losses)
    args.speed_state, args.speed_runner = (prog, ref, opt_fn, idd), runner
    med = {k: statistics.median(v) for k, v in samples.items()}
    tokens = bsz * seq
    if "fxpar" in peak:
        out["pred_memory_over_measured"] = out["pred_memory_gib"] / peak["fxpar"]
    out.update(samples=samples, losses=losses, peak_mem_gib=peak,
               median_ms={k: v * 1e3 for k, v in med.items()},
               tokens_per_s={k: tokens / v for k, v in med.items()},
               ratio_fxpar_over_eager=med["fxpar"] / med["eager"],
               ratio_fxpar_over_master=med["fxpar"] / med.get("eager_fp32_master", med["eager"]),
               max_dloss_vs_master=(max(abs(a - b) for a, b in zip(losses["fxpar"], losses["eager_fp32_master"]))
                                    if "eager_fp32_master" in losses else None),
               pred_over_measured_nominal=prog.plan.time / med["fxpar"])
    if "pred_time_calibrated_ms" in out:
        out["pred_over_measured_calibrated"] = out["pred_time_calibrated_ms"] / 1e3 / med["fxpar"]
    n = out["model"]["params"]
    out["model_tflops_per_s"] = {k: 6 * n * tokens / v / 1e12 for k, v in med.items()}  # 6N per token
    return out


def _interleave(sides: dict, steps: int, losses: dict | None = None) -> dict:
    """``{side: [seconds per step]}`` of ``steps`` rounds, the sides' order alternating each
    round (A B, B A, ...); each step's loss appended to ``losses[side]`` when given."""
    samples = {k: [] for k in sides}
    for i in range(steps):
        for k in (list(sides) if i % 2 == 0 else list(reversed(sides))):
            _sync()
            t0 = time.perf_counter()
            loss = float(sides[k]())   # .item() synchronizes
            samples[k].append(time.perf_counter() - t0)
            if losses is not None:
                losses[k].append(loss)
    return samples


def sec_profile(args) -> dict:
    """Where a step's time goes: ``torch.profiler`` over 3 steps of each side of ``speed``
    (top ops by self device time, else self CPU time) and the rank graph's op counts."""
    from collections import Counter

    from torch.profiler import ProfilerActivity, profile

    if getattr(args, "speed_state", None) is None:
        raise RuntimeError("run the speed section first (it builds the model)")
    prog, ref, opt_fn, idd = args.speed_state
    runner = args.speed_runner
    ref_opt = opt_fn(ref.parameters())
    sides = {"fxpar": lambda: runner.step(idd, labels=idd), "eager": lambda: _eager_step(ref, ref_opt, idd)}
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    key = "self_device_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    out = {}
    for k, fn in sides.items():
        fn()
        _sync()
        with profile(activities=acts) as prof:
            for _ in range(3):
                fn()
            _sync()
        ka = prof.key_averages()
        out[f"{k}_table"] = ka.table(sort_by=key, row_limit=25, max_name_column_width=60)
        out[f"{k}_device_ms_per_step"] = sum(getattr(e, key, 0) for e in ka) / 3e3
        out[f"{k}_kernels_per_step"] = sum(e.count for e in ka if getattr(e, key, 0) > 0) / 3
        print(f"-- {k}\n" + out[f"{k}_table"], flush=True)
    ops = Counter(str(n.target) for n in runner.gm.graph.nodes if n.op == "call_function")
    out["rank_graph_ops"] = dict(ops.most_common(40))
    return out


def sec_compiled(args) -> dict:
    if getattr(args, "speed_state", None) is None:
        raise RuntimeError("run the speed section first (it builds the model)")
    prog, ref, opt_fn, idd = args.speed_state
    dev = _dev()
    runner = prog.runner(device=str(dev))
    out, sides = {}, {}
    sides["fxpar"] = lambda: runner.step(idd, labels=idd)
    ref_opt = opt_fn(ref.parameters())
    sides["eager"] = lambda: _eager_step(ref, ref_opt, idd)
    crunner = prog.runner(device=str(dev), compile=True)
    cref = torch.compile(ref)
    cref_opt = ref_opt
    for k, fn in (("fxpar+compile", lambda: crunner.step(idd, labels=idd)),
                  ("eager+compile", lambda: _eager_step(cref, cref_opt, idd))):
        t0 = time.perf_counter()
        try:
            fn(), fn()
            _sync()
            sides[k] = fn
            out[f"{k}_compile_s"] = time.perf_counter() - t0
        except Exception as e:  # noqa: BLE001 - recorded; the other sides are still measured
            out[f"{k}_error"] = f"{type(e).__name__}: {e}"
            out[f"{k}_traceback"] = traceback.format_exc()[-3000:]
    for fn in sides.values():
        fn()
    samples = _interleave(sides, args.steps)
    med = {k: statistics.median(v) for k, v in samples.items()}
    out.update(samples=samples, median_ms={k: v * 1e3 for k, v in med.items()},
               ratio_to_eager={k: v / med["eager"] for k, v in med.items()})
    return out


def _gloo2_worker(rank, world, init, plan, mesh, res_path):
    import faulthandler

    faulthandler.enable()  # a crash in a collective prints where
    torch.cuda.set_device(0) if torch.cuda.is_available() else None
    torch.backends.cuda.matmul.allow_tf32 = False
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        import fxpar

        res = _parity_run(fxpar.Cluster.local(world), plan, mesh, seq=32, steps=3, seed=3)
    except Exception as e:  # noqa: BLE001 - reported to the parent
        res = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
    if rank == 0:
        Path(res_path).write_text(json.dumps(res))
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass


def sec_gloo2(args) -> dict:
    import torch.multiprocessing as mp

    out = {}
    for plan, mesh in (("dp", {"dp": 2}), ("megatron", {"dp": 1, "tp": 2})):
        res_path = tempfile.mktemp(suffix=".json")
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_gloo2_worker,
                             args=(r, 2, f"file://{res_path}.store", plan, mesh, res_path))
                 for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=240)
        for p in procs:
            if p.is_alive():
                p.kill()
        key = f"{plan}:{','.join(f'{a}={s}' for a, s in mesh.items())}"
        out[key] = (json.loads(Path(res_path).read_text()) if os.path.exists(res_path)
                    else {"error": f"no result (exit codes {[p.exitcode for p in procs]})"})
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sections", nargs="*", default=list(SECTIONS), choices=SECTIONS)
    ap.add_argument("--steps", type=int, default=12, help="timed steps per side (speed)")
    ap.add_argument("--quick", action="store_true", help="tiny sizes (a check of the script itself)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gpu.json"))
    args = ap.parse_args(argv)
    args.calibrated = None
    results = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "argv": sys.argv[1:]}
    for name in args.sections:
        t0 = time.perf_counter()
        print(f"== {name}", flush=True)
        try:
            r = globals()[f"sec_{name}"](args)
        except Exception as e:  # noqa: BLE001 - one section's failure is a result, not the end
            r = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
            print(r["traceback"], flush=True)
        if "_cluster" in r:
            args.calibrated = r.pop("_cluster")
        r["section_s"] = time.perf_counter() - t0
        results[name] = r
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=1, default=str))
        print(json.dumps({k: v for k, v in r.items() if k not in ("samples", "traceback")}, default=str)[:1500],
              flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
