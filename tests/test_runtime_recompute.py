"""Recomputation (activation checkpointing) in the runtime, on real gloo ranks.

Every rank builds the same model (same seed). A program is compiled once; a runner with
``recompute`` and one without (several runners of one program coexist, same seed: the same
dropout masks) train side by side on the same batch for 3 AdamW steps; their losses and
parameters must agree, and without dropout both must match a single-process reference. The
recomputing runner must really recompute (its layer forwards re-run in backward, counted) and
keep fewer bytes for backward (measured with :class:`fxpar.runtime.memory.SavedBytes`).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

pytestmark = pytest.mark.dist

TOL = dict(rtol=1e-4, atol=2e-5)
SAME = dict(rtol=1e-6, atol=1e-7)   # recompute vs not: the same ops on the same values


class Block(nn.Module):
    """A pre-norm MLP block with dropout inside (column-sharded under Megatron's plan) and on
    its output (replicated): masks drawn again in backward must be the forward's."""

    def __init__(self, d: int, p: float) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)
        self.drop = nn.Dropout(p)

    def forward(self, x):
        return x + self.drop(self.fc2(self.drop(nn.functional.gelu(self.fc1(self.ln(x))))))


class DropNet(nn.Module):
    def __init__(self, d: int = 16, n: int = 3, p: float = 0.2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d, p) for _ in range(n))
        self.head = nn.Linear(d, d)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)



def _side_by_side(rc, plain, ref, opt, inputs, targets, loss_fn, steps: int, exact: bool) -> list[float]:
    """``steps`` steps of the recomputing and the plain runner: equal losses each step, and
    equal to the one-process ``ref`` when nothing is random (``exact``)."""
    ropt = opt(ref.parameters())
    batch = list(inputs + targets)
    losses = []
    for _ in range(steps):
        a, b = rc.step(*batch), plain.step(*batch)
        torch.testing.assert_close(a, b, **SAME)
        if exact:
            out = ref(*inputs)
            rl = loss_fn(out, *targets) if loss_fn is not None else out
            rl.backward()
            ropt.step()
            ropt.zero_grad()
            torch.testing.assert_close(a, rl.detach(), **TOL)
        losses.append(a.item())
    return losses

def _build(name: str, p: float = 0.2, n_layers: int = 2):
    torch.manual_seed(0)
    if name == "drop":
        return (DropNet(p=p, n=max(3, n_layers)), (torch.randn(8, 4, 16),), (torch.randn(8, 4, 16),),
                nn.functional.mse_loss)
    from examples.models import GPT

    m = GPT(vocab=64, d_model=32, n_heads=4, n_layers=n_layers, seq_len=16,
            attention="math" if name == "gpt-math" else "sdpa")
    idx = torch.randint(0, 64, (8, 16))
    return m, (idx, idx.roll(1, 1)), (), None


def _layers(runner) -> int:
    return len(runner.recompute)


def _collectives_in(fn) -> int:
    """How many collectives ``fn()`` issues: fxpar's communication ops that run (a collective
    each, the kernels inside them unseen; a wait selective recomputation answers from its
    cache does not run) and functional collectives called directly."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if (func.namespace == "_c10d_functional" and "wait" not in func.__name__
                    or func.namespace == "fxpar" and func._opname in ("start", "wait", "redistribute",
                                                                      "edge_grad")):
                Count.n += 1
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return Count.n


def run_spmd(name: str, plan: str, mesh: dict, p: float, recompute, steps: int = 3,
             granularity: str = "full"):
    """Worker: a recomputing and a plain runner of one program, trained side by side;
    returns the losses, the bytes each holds for backward after its forward (measured, and
    as the memory model prices its rank graph) and the collectives each issues in its
    backward."""
    import fxpar
    from fxpar.runtime.bindings import bind
    from fxpar.runtime.memory import SavedBytes
    from fxpar.runtime.redistribute import distribute

    model, inputs, targets, loss_fn = _build(name, p)
    ref = copy.deepcopy(model)
    opt = lambda ps: torch.optim.AdamW(ps, lr=1e-2, eps=1e-5)  # noqa: E731
    prog = fxpar.compile(model, fxpar.Cluster.local(dist.get_world_size()), inputs,
                         loss_fn=loss_fn, example_targets=targets, plan=plan, mesh=mesh,
                         optimizer=opt, time_limit=20)
    rc = prog.runner(recompute=recompute, recompute_granularity=granularity)
    plain = prog.runner()
    assert rc.recompute and not plain.recompute
    losses = _side_by_side(rc, plain, ref, opt, inputs, targets, loss_fn, steps, p == 0.0)
    assert rc.recomputed == steps * _layers(rc), (rc.recomputed, steps, sorted(rc.recompute))
    assert plain.recomputed == 0
    pre = "model." if loss_fn is not None else ""
    ref_state = {pre + k: v for k, v in ref.named_parameters()}
    for fqn, t in rc.state.items():
        torch.testing.assert_close(t.detach(), plain.state[fqn].detach(), **SAME,
                                   msg=lambda s: f"param {fqn} (recompute vs not): {s}")
        if p == 0.0 and fqn in ref_state:
            want = distribute(ref_state[fqn].detach(), rc.specs[fqn], rc.mesh.shape, rc.coord)
            torch.testing.assert_close(t.detach(), want, **TOL, msg=lambda s: f"param {fqn}: {s}")
    # bytes held for backward after the forward (regather off: its hooks would hide them)
    from fxpar.cost.memory import activation_memory, recompute_memory

    held, comm, priced = [], [], []
    for r in (prog.runner(recompute=recompute, regather=False, recompute_granularity=granularity),
              prog.runner(regather=False)):
        priced.append(recompute_memory(r.gm, r.recompute, granularity=granularity).stash_bytes
                      if r.recompute else activation_memory(r.gm).saved_bytes)
        with SavedBytes(exclude=r.state.values()) as sb:
            out = r.forward(*inputs, *targets)
            held.append(sb.sample())
            with bind(r.bindings):
                comm.append(_collectives_in(out[0].backward))
            after = sb.sample()
        r.states.finish_backward()
        assert after == 0, f"{after} bytes still held after backward"
    return losses, held, comm, priced


def _agree(res):
    losses = [r[0] for r in res]
    assert all(x == losses[0] for x in losses), f"ranks disagree on the loss: {losses}"
    return res


@pytest.mark.timeout(300)
@pytest.mark.parametrize("p", [0.2, 0.0])
def test_megatron_dropout_recompute_all(pools, p):
    """Megatron on tp=2: fc1 column-parallel (a sharded dropout), fc2 row-parallel (an
    all-reduce inside every recomputed block, issued again in backward), dropout on the
    replicated block output. p=0.2: recompute equals no recompute; p=0: both equal one
    process. Saved bytes drop (each block keeps only its input)."""
    res = _agree(pools(2).run(run_spmd, "drop", "megatron", {"tp": 2}, p, "all"))
    for _, (with_rc, without), (comm_rc, comm), _ in res:
        print(f"saved bytes after forward: recompute {with_rc}, without {without}")
        assert with_rc < 0.5 * without, (with_rc, without)
        assert comm_rc > comm, (comm_rc, comm)   # the blocks' all-reduces issued again


@pytest.mark.timeout(300)
@pytest.mark.parametrize("p", [0.2, 0.0])
def test_megatron_selective(pools, p):
    """Selective granularity on tp=2: parity as above, and each block keeps its GEMMs'
    outputs and its all-reduce's (more than its input alone, less than everything it saves),
    so its backward issues no collective the plain runner's does not."""
    res = _agree(pools(2).run(run_spmd, "drop", "megatron", {"tp": 2}, p, "all", 3, "selective"))
    full = pools(2).run(run_spmd, "drop", "megatron", {"tp": 2}, p, "all")
    for (_, (sel, without), (comm_sel, comm), priced), (_, (with_full, _), _, _) in zip(res, full):
        print(f"saved bytes after forward: full {with_full}, selective {sel}, none {without}; "
              f"backward collectives: selective {comm_sel}, none {comm}")
        assert with_full < sel < without, (with_full, sel, without)
        assert comm_sel == comm, (comm_sel, comm)
        assert priced[0] == pytest.approx(sel, rel=0.05), (priced, sel)   # the memory model


@pytest.mark.timeout(300)
def test_gpt_megatron_one_layer(pools):
    """Attention block recomputed alone (``blocks.1``), the other kept: parity with one
    process and the plain runner."""
    res = _agree(pools(2).run(run_spmd, "gpt", "megatron", {"tp": 2}, 0.0, ["blocks.1"]))
    for _, (with_rc, without), _, _ in res:
        assert with_rc < without, (with_rc, without)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("granularity", ["full", "selective"])
def test_gpt_math_attention(pools, granularity):
    """The attention written out: each block's causal mask is a constant the capture folds
    (``get_attr``) and places apart from its block; it belongs to no recomputed region (it
    made every block after the first non-contiguous). Parity with one process, fewer bytes."""
    res = _agree(pools(2).run(run_spmd, "gpt-math", "dp", {"dp": 2}, 0.0, "all", 3, granularity))
    for _, (with_rc, without), _, _ in res:
        assert with_rc < without, (with_rc, without)


@pytest.mark.timeout(300)
def test_zero3_prefetch_regather(pools):
    """ZeRO-3 with prefetch: a recomputed block's parameters are gathered ahead of use (their
    start lies in the previous layer) and gathered again inside the recomputation."""
    _agree(pools(2).run(run_spmd, "drop", "zero3", {"dp": 2}, 0.0, "all"))


def unknown_layer():
    import dataclasses

    import fxpar
    from fxpar.runtime.recompute import RecomputeError

    model, inputs, targets, loss_fn = _build("drop", 0.0)
    prog = fxpar.compile(model, fxpar.Cluster.local(dist.get_world_size()), inputs,
                         loss_fn=loss_fn, example_targets=targets, plan="dp", mesh={"dp": 2},
                         optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    msgs = []
    for kw in (dict(recompute=["blocks.9"]), dict(recompute="all", recompute_granularity="fine")):
        try:
            prog.runner(**kw)
        except RecomputeError as e:
            msgs.append(str(e))
        else:
            raise AssertionError(f"no error for {kw}")
    # the plan's choice is used when none is given (the joint planner writes it there)
    prog.plan = dataclasses.replace(prog.plan, config=dataclasses.replace(
        prog.plan.config, recompute={"blocks.1"}, recompute_granularity="selective"))
    r = prog.runner()
    return (msgs, sorted(r.recompute), sorted(prog.runner(recompute=()).recompute),
            r.recompute_granularity, prog.runner(recompute_granularity="full").recompute_granularity)


@pytest.mark.timeout(300)
def test_unknown_layer_and_plan_choice(pools):
    """An unknown layer or granularity is refused on every rank; left out, the runner takes
    the plan's recomputed layers and granularity."""
    for (layer, gran), from_plan, off, planned, given in pools(2).run(unknown_layer):
        assert "'blocks.9'" in layer and "model.blocks.0" in layer, layer
        assert "'fine'" in gran and "'full', 'selective'" in gran, gran
        assert from_plan == ["model.blocks.1"] and off == []
        assert (planned, given) == ("selective", "full")


@pytest.mark.timeout(300)
def test_zero3_selective(pools):
    """Selective granularity under ZeRO-3 with prefetch: the gathered parameters are not kept
    (each block's waits run again in backward and gather at once), the GEMMs' outputs are:
    parity with one process, more bytes held than full, fewer than none, and the backward
    gathers again (more collectives than the plain runner's, which keeps them:
    ``regather=False``)."""
    res = _agree(pools(2).run(run_spmd, "drop", "zero3", {"dp": 2}, 0.0, "all", 3, "selective"))
    full = pools(2).run(run_spmd, "drop", "zero3", {"dp": 2}, 0.0, "all")
    for (_, (sel, without), (comm_sel, comm), priced), (_, (with_full, _), _, _) in zip(res, full):
        assert with_full < sel < without, (with_full, sel, without)
        assert comm_sel > comm, (comm_sel, comm)
        assert priced[0] == pytest.approx(sel, rel=0.05), (priced, sel)   # the memory model


def run_pipe(name: str, mesh: dict, schedule: str, m: int, recompute, plan: str = "auto",
             p: float = 0.0, chunks: int = 1, n_layers: int = 4, steps: int = 3,
             granularity: str = "full"):
    """Worker: a pipeline program's recomputing and plain runners side by side (and, without
    dropout, the single-process reference)."""
    import fxpar
    from fxpar.runtime.redistribute import distribute

    model, inputs, targets, loss_fn = _build(name, p, n_layers)
    ref = copy.deepcopy(model)
    opt = lambda ps: torch.optim.AdamW(ps, lr=1e-2, eps=1e-5)  # noqa: E731
    prog = fxpar.compile(model, fxpar.Cluster.local(dist.get_world_size()), inputs,
                         loss_fn=loss_fn, example_targets=targets, plan=plan, mesh=mesh,
                         optimizer=opt, schedule=schedule, microbatches=m, chunks=chunks,
                         time_limit=20)
    rc, plain = prog.runner(recompute=recompute, recompute_granularity=granularity), prog.runner()
    losses = _side_by_side(rc, plain, ref, opt, inputs, targets, loss_fn, steps, p == 0.0)
    from fxpar.runtime.recompute import known_layers

    mine = sum(len(rc.recompute & known_layers(c.gm)) for c in rc.chunks.values())
    assert mine > 0, (sorted(rc.recompute), [sorted(known_layers(c.gm)) for c in rc.chunks.values()])
    if prog.schedule.name == "zb-h1":
        # I and W are separate backward passes: each recomputes what it needs (W: once per
        # weight group); chunks with boundary inputs really split
        assert rc.recomputed >= steps * m * mine, (rc.recomputed, steps, m, mine)
        assert rc.pp_rank == 0 or rc.split_backwards == steps * m, rc.split_backwards
    else:
        assert rc.recomputed == steps * m * mine, (rc.recomputed, steps, m, mine)
    pre = "model." if loss_fn is not None else ""
    ref_state = {pre + k: v for k, v in ref.named_parameters(remove_duplicate=False)}
    for fqn, t in rc.state.items():
        torch.testing.assert_close(t.detach(), plain.state[fqn].detach(), **SAME,
                                   msg=lambda s: f"param {fqn} (recompute vs not): {s}")
        if p == 0.0 and fqn in ref_state:
            want = distribute(ref_state[fqn].detach(), rc.specs[fqn], rc.sub_mesh.shape, rc.sub_coord)
            torch.testing.assert_close(t.detach(), want, **TOL, msg=lambda s: f"param {fqn}: {s}")
    return losses


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name,schedule,m,p", [
    ("gpt", "1f1b", 4, 0.0),
    ("drop", "gpipe", 2, 0.2),
    ("gpt", "zb-h1", 4, 0.0),
])
def test_pipeline_2_ranks(pools, name, schedule, m, p):
    """pp=2: every block recomputed, per microbatch, in the schedule's backward order; with
    dropout the recomputed masks are the forward's (equal to the plain runner)."""
    _agree([[x] for x in pools(2).run(run_pipe, name, {"pp": 2}, schedule, m, "all", "auto", p)])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name,schedule,p", [("drop", "1f1b", 0.2), ("gpt", "zb-h1", 0.0)])
def test_pipeline_selective(pools, name, schedule, p):
    """Selective granularity per microbatch in a pipeline (pp=2; with dropout, and with the
    zero-bubble schedule's split backward): the recomputed masks and the kept outputs give
    the plain runner's training (and, without dropout, one process's)."""
    _agree([[x] for x in pools(2).run(run_pipe, name, {"pp": 2}, schedule, 4, "all", "auto",
                                      p, 1, 4, 3, "selective")])


@pytest.mark.timeout(400)
@pytest.mark.parametrize("mesh,schedule,m,chunks,plan,p", [
    ({"pp": 2, "tp": 2}, "1f1b", 2, 1, "megatron", 0.2),   # all-reduces inside recomputed blocks
    ({"pp": 2, "dp": 2}, "interleaved", 2, 2, "dp", 0.0),
])
def test_pipeline_4_ranks(pools, mesh, schedule, m, chunks, plan, p):
    name = "drop" if p else "gpt"
    _agree([[x] for x in pools(4).run(run_pipe, name, mesh, schedule, m, "all", plan, p, chunks)])


def run_hf_llama(plan: str, mesh: dict, granularity: str, steps: int = 3):
    """Worker: a small Hugging Face Llama (grouped-query attention, RoPE, RMSNorm) with every
    layer recomputed at ``granularity`` beside the plain runner; both runners' losses."""
    import warnings

    import fxpar
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    ids = torch.randint(0, 128, (4, 32))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prog = fxpar.compile(LlamaForCausalLM(cfg), fxpar.Cluster.local(dist.get_world_size()),
                             (ids,), {"labels": ids}, plan=plan, mesh=mesh,
                             optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    rc, plain = prog.runner(recompute="all", recompute_granularity=granularity), prog.runner()
    losses = [(rc.step(ids, labels=ids).item(), plain.step(ids, labels=ids).item())
              for _ in range(steps)]
    return losses, rc.recomputed


@pytest.mark.timeout(300)
@pytest.mark.parametrize("plan,mesh", [("dp", {"dp": 2}), ("megatron", {"tp": 2}),
                                       ("zero3", {"dp": 2})], ids=["dp", "megatron", "zero3"])
def test_hf_llama_selective(pools, plan, mesh):
    """A real Hugging Face Llama, selective granularity: the same losses as the plain runner
    step for step (the same ops on the same values), both layers recomputed every step."""
    pytest.importorskip("transformers")
    for losses, recomputed in pools(2).run(run_hf_llama, plan, mesh, "selective"):
        assert all(a == b for a, b in losses), losses
        assert recomputed == 2 * len(losses), recomputed
