"""Train a Hugging Face Llama with fxpar under torchrun: the script to copy.

    torchrun --nproc_per_node 4 examples/train.py --steps 100 --ckpt-dir ckpt --ckpt-every 20
    # two nodes of 4 (on each node, its --node-rank): planned for 2 nodes, links measured
    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 4 --master-addr HOST0 --master-port 29500 \
        examples/train.py --steps 100

Every rank builds the same Llama from a small config (no download), ``fxpar.compile`` plans it
for the launched world (``--plan``/``--mesh``, default: searched; a ``pp`` axis, e.g.
``--mesh pp=2,tp=2 --schedule 1f1b --microbatches 4``, runs a pipeline), and each step trains on a
synthetic batch of tokens that depends only on the step number, so a resumed run sees the batches
it would have seen. Rank 0 prints one line per step (loss, step time, tokens/s, memory). Every
``--ckpt-every`` steps the runner writes a DCP checkpoint to ``--ckpt-dir/step{N}``; started
again, the script resumes from the newest complete one. ``--loss-log FILE`` appends ``{"step", "loss"}``
JSON lines (what the kill-and-resume test reads); ``--crash-after N`` ends the process abruptly
after step N (to test resuming). ``--init-from HF_DIR`` starts from a Hugging Face
``save_pretrained`` directory (the model built on meta from its config, each rank reading its
shards of the safetensors); ``--export-hf DIR`` writes the trained weights and config back as
one that ``from_pretrained`` loads.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
from pathlib import Path

import torch
import torch.distributed as dist


def build_model(args):
    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.heads, max_position_embeddings=args.seq,
                         use_cache=False)
    torch.manual_seed(args.seed)  # the same weights on every rank
    return tf.LlamaForCausalLM(cfg)


def batch(args, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
    return torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)


def latest_checkpoint(ckpt_dir: Path) -> tuple[int, Path] | None:
    """The newest complete checkpoint (DCP writes ``.metadata`` last)."""
    done = [(int(p.name[4:]), p) for p in ckpt_dir.glob("step*") if (p / ".metadata").exists()]
    return max(done) if done else None


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--plan", default="auto")
    ap.add_argument("--mesh", default=None, help="e.g. dp=2,tp=2 (default: searched)")
    ap.add_argument("--schedule", default="1f1b", help="pipeline schedule (with a pp axis in --mesh)")
    ap.add_argument("--microbatches", type=int, default=1, help="pipeline microbatches")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ckpt-dir", default="ckpt")
    ap.add_argument("--ckpt-every", type=int, default=10)
    ap.add_argument("--loss-log", default=None, help="append JSON lines {step, loss} here (rank 0)")
    ap.add_argument("--cluster", default="calibrate", metavar="PRESET|calibrate|local",
                    help="what to plan for: the launch's own nodes (torchrun/SLURM) with links and "
                         "compute measured on them (calibrate, the default), with a preset's "
                         "figures (e.g. dgx-a100), or this machine's processes as one node (local)")
    ap.add_argument("--init-from", default=None, metavar="HF_DIR",
                    help="start from a Hugging Face save_pretrained directory (its config and "
                         "safetensors; each rank reads its shards)")
    ap.add_argument("--export-hf", default=None, metavar="DIR",
                    help="at the end, write the weights (and config) as a Hugging Face directory")
    ap.add_argument("--crash-after", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    import fxpar
    from fxpar.cli import _parse_mesh

    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if torch.cuda.is_available() else "cpu"
    if args.init_from:   # the HF config, built on meta: the weights come from the files
        import transformers as tf

        cfg = tf.AutoConfig.from_pretrained(args.init_from)
        args.vocab = cfg.vocab_size
        with torch.device("meta"):
            model = tf.AutoModelForCausalLM.from_config(cfg)
    else:
        model = build_model(args)
    ids = batch(args, 0)
    t0 = time.perf_counter()
    if args.cluster == "local":
        cluster = fxpar.Cluster.local(world)
    elif args.cluster == "calibrate":
        cluster = fxpar.Cluster.from_env(calibrate=True)
    else:
        cluster = fxpar.Cluster.from_env(args.cluster)
    prog = fxpar.compile(model, cluster, (ids,), {"labels": ids}, plan=args.plan,
                         mesh=_parse_mesh(args.mesh) if args.mesh else None,
                         schedule=args.schedule, microbatches=args.microbatches,
                         optimizer=lambda ps: torch.optim.AdamW(ps, lr=args.lr))
    runner = prog.runner(fxpar.HFCheckpoint(args.init_from) if args.init_from else None, device=device)
    if rank == 0:
        print(prog.explain().splitlines()[0], f"(compiled in {time.perf_counter() - t0:.1f} s)", flush=True)
    ckpt_dir = Path(args.ckpt_dir)
    start = 0
    found = latest_checkpoint(ckpt_dir)
    if found is not None:
        start, path = found
        runner.load_checkpoint(path)
        if rank == 0:
            print(f"resumed from {path} (step {start})", flush=True)
    for step in range(start, args.steps):
        ids = batch(args, step)
        t = time.perf_counter()
        loss = runner.step(ids, labels=ids).item()
        dt = time.perf_counter() - t
        if rank == 0:
            mem = (torch.cuda.max_memory_allocated() if device != "cpu"
                   else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024) / 2**20
            print(f"step {step + 1:>5}/{args.steps}  loss {loss:.4f}  {dt * 1e3:7.1f} ms  "
                  f"{args.batch * args.seq / dt:9.0f} tok/s  mem {mem:.0f} MiB", flush=True)
            if args.loss_log:
                with open(args.loss_log, "a") as f:
                    f.write(json.dumps({"step": step + 1, "loss": loss}) + "\n")
        if (step + 1) % args.ckpt_every == 0:
            runner.save_checkpoint(ckpt_dir / f"step{step + 1}")
        if args.crash_after is not None and step + 1 == args.crash_after:
            os._exit(1)  # a crash: no clean shutdown
    if args.export_hf:
        runner.save_hf_checkpoint(args.export_hf)
        if rank == 0:
            model.config.save_pretrained(args.export_hf)
            print(f"wrote a Hugging Face directory to {args.export_hf}", flush=True)
    # every rank done before any tears its connections down (a gloo peer still flushing its
    # last messages can abort on a closed pair: seen once in ~10 pipeline runs without it)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
