"""Pipeline parity with one process, on real gloo ranks.

Every rank builds the same model (same seed) and runs the single-process reference on the
whole batch itself; the pipeline program runs the same global batch as ``m`` microbatches
under a schedule. Checked each of 3 AdamW steps: the loss (equal on every rank), every
parameter's reduced gradient on this rank (its shard of the reference gradient under the
parameter's storage spec on the stage submesh), and the local shards after the steps. fp32,
no dropout.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.distributed as dist

import fxpar

pytestmark = pytest.mark.dist

TOL = dict(rtol=1e-4, atol=2e-5)


class Skip(torch.nn.Module):
    """Four layers; layer 0's output also feeds layer 3: on 4 stages it is relayed."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(4))

    def forward(self, x):
        h0 = torch.relu(self.layers[0](x))
        h = torch.relu(self.layers[1](h0))
        h = self.layers[2](h)
        return (self.layers[3](h) * h0).square().mean()


def _build(name: str, batch: int = 8):
    """``(model, inputs, kwargs, loss_fn, targets, split_points)``, the same on every rank."""
    torch.manual_seed(0)
    if name in ("gpt", "gpt8"):
        from examples.models import GPT

        m = GPT(vocab=64, d_model=32, n_heads=4, n_layers=8 if name == "gpt8" else 4, seq_len=16)
        idx = torch.randint(0, 64, (batch, 16))

        def loss_fn(out, t):
            return torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), t.reshape(-1))
        return m, (idx,), {}, loss_fn, (idx.roll(1, 1),)
    if name == "skip":
        m = Skip()
        return m, (torch.randn(batch, 8),), {}, None, ()
    import transformers as tf

    if name == "gpt2":
        cfg = tf.GPT2Config(vocab_size=96, n_positions=16, n_embd=32, n_layer=4, n_head=4,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
        m = tf.GPT2LMHeadModel(cfg)
    else:
        cfg = tf.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64,
                             num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=16, use_cache=False)
        m = tf.LlamaForCausalLM(cfg)
    ids = torch.randint(0, 96, (batch, 16))
    return m, (ids,), {"labels": ids}, None, ()


def run_pipeline(name: str, mesh: dict, schedule: str, m: int, chunks: int = 1,
                 split_points=None, plan: str = "auto", steps: int = 3, boundary: str = "auto",
                 s_g: int = 1, s_os: int = 1, clip: float | None = None,
                 pin_boundary: str | None = None, on_runner=None):
    """Train ``steps`` steps of the pipeline beside a one-process reference (numerics
    checked each step); ``on_runner(runner)`` runs after building (returns a check to call
    after training, or None)."""
    import fxpar
    model, inputs, kwargs, loss_fn, targets = _build(name, 8 if 8 % m == 0 else 2 * m)
    ref = copy.deepcopy(model)
    opt = lambda ps: torch.optim.AdamW(ps, lr=1e-2, eps=1e-5)  # noqa: E731
    if isinstance(schedule, str) and "," in schedule:  # hand-written, compute actions only
        schedule = fxpar.Schedule.from_csv(schedule)
    kw = dict(loss_fn=loss_fn, example_targets=targets, optimizer=opt, mesh=mesh, plan=plan,
              schedule=schedule, microbatches=m, chunks=chunks, split_points=split_points,
              time_limit=20, boundary=boundary)
    cluster = fxpar.Cluster.local(dist.get_world_size())
    if pin_boundary is not None:  # the first boundary value computed in another layout
        first = fxpar.compile(model, cluster, inputs, kwargs, emit=False, **kw).plan.stages[0]
        kw["pins"] = {first.outputs[0]: pin_boundary}
    prog = fxpar.compile(model, cluster, inputs, kwargs, **kw)
    if pin_boundary is not None:
        st = prog.plan.stages
        assert st[0].out_specs[0] == pin_boundary != st[1].in_specs[0], (st[0].out_specs, st[1].in_specs)
    if split_points:
        assert prog.plan.stages[1].layers[0] == "model." + split_points[0], prog.plan.stages[1].layers
    if boundary == "scatter_gather":
        assert prog.plan.stages[0].scatter == ("tp",), prog.plan.stages[0].scatter
    runner = prog.runner(s_g=s_g, s_os=s_os)
    after = on_runner(runner) if on_runner is not None else None
    losses = train_and_check(runner, ref, opt, inputs, targets, kwargs, loss_fn, steps, clip)
    if after is not None:
        after()
    if prog.schedule.split_backward:   # chunks with boundary inputs: I, then W
        # (except chunks that gather parameters: ZeRO-3 runs I whole)
        split = not any(c.gathers for c in runner.chunks.values())
        inner = sum(a.kind == "I" and a.stage > 0 for a in prog.schedule.actions[runner.pp_rank])
        assert runner.split_backwards == (steps * inner if split else 0), runner.split_backwards
        if split and name in ("gpt", "gpt2", "llama"):   # every matrix used by a linear: deferred
            inner = [c.deferred for k, c in runner.chunks.items() if k > 0]
            assert all(inner), inner
    return losses


def train_and_check(runner, ref, opt, inputs, targets, kwargs, loss_fn, steps: int,
                    clip: float | None = None) -> list[float]:
    """``steps`` AdamW steps of ``runner`` and of the one-process ``ref`` side by side: the
    loss, every reduced gradient shard (and the clipped norm) each step, then every local
    parameter shard, equal to the reference's slice under the parameter's spec."""
    from fxpar.runtime.redistribute import distribute

    ropt = opt(ref.parameters())
    pre = "model." if loss_fn is not None else ""
    ref_state = {pre + k: v for k, v in ref.named_parameters(remove_duplicate=False)}
    # a pipeline runner's shards are on its stage's submesh; a plain runner's on its mesh
    shape, coord = ((runner.sub_mesh.shape, runner.sub_coord) if hasattr(runner, "sub_mesh")
                    else (runner.mesh.shape, tuple(runner.coord)))
    losses = []
    for _ in range(steps):
        loss = runner.forward_backward(*inputs, *targets, **kwargs)
        out = ref(*inputs, **kwargs)
        rl = loss_fn(out, *targets) if loss_fn is not None else getattr(out, "loss", out)
        rl.backward()
        torch.testing.assert_close(loss, rl.detach(), **TOL)
        if clip is not None:  # the norm over every stage, each tied copy counted once
            norm = runner.clip_grad_norm_(clip)
            want = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
            torch.testing.assert_close(norm, want, **TOL)
        for fqn, g in runner.states.grads().items():
            want = distribute(ref_state[fqn].grad, runner.specs[fqn], shape, coord)
            torch.testing.assert_close(g, want, **TOL, msg=lambda s: f"grad of {fqn}: {s}")
        runner.optimizer_step()
        ropt.step()
        ropt.zero_grad()
        losses.append(loss.item())
    for fqn, t in runner.state.items():
        if fqn in ref_state:
            want = distribute(ref_state[fqn].detach(), runner.specs[fqn], shape, coord)
            torch.testing.assert_close(t.detach(), want, **TOL, msg=lambda s: f"param {fqn}: {s}")
    return losses


def _check(results):
    assert all(r == results[0] for r in results), f"ranks disagree on the loss: {results}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name,schedule,m", [
    ("gpt", "1f1b", 4),
    ("gpt", "gpipe", 1),
    ("gpt", "eager-1f1b", 5),
    ("gpt", "zb-h1", 4),      # W from the linears' kept inputs (fxpar.runtime.deferred)
    ("gpt2", "1f1b", 2),
    ("gpt2", "zb-h1", 2),     # Conv1D's addmm deferred the same way
])
def test_pipeline_2_ranks(pools, name, schedule, m):
    _check(pools(2).run(run_pipeline, name, {"pp": 2}, schedule, m))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("schedule", ["looped-bfs", "interleaved-zb", "zbv", "dualpipev"])
def test_pipeline_2_ranks_two_chunks_each(pools, schedule):
    """torch.distributed.pipelining's ``ScheduleLoopedBFS``, ``ScheduleInterleavedZeroBubble``,
    ``ScheduleZBVZeroBubble`` and ``ScheduleDualPipeV`` orders (4 chunks; looped: chunk ``k``
    on rank ``k % 2``; a V: chunks 0 and 3 on rank 0, 1 and 2 on rank 1, the turn from 1 to 2
    without a transfer and the loss on rank 0): breadth first; split backward with the
    weight gradients deferred (every chunk but the first runs ``I`` then ``W``; DualPipeV
    only its tail's)."""
    _check(pools(2).run(run_pipeline, "gpt", {"pp": 2}, schedule, 4, 2))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("schedule,m", [("zbv", 2), ("dualpipev", 4)])
def test_tied_embeddings_in_a_v(pools, schedule, m):
    """GPT-2 ties its token embedding to its LM head; in a V both ends are chunks of rank 0
    (chunks 0 and 3), so that rank's one tensor takes both chunks' gradients each microbatch
    (checked against one process, gradients and parameters, every step)."""
    _check(pools(2).run(run_pipeline, "gpt2", {"pp": 2}, schedule, m, 2, on_runner=_shares_wte))


def _shares_wte(runner):
    """Rank 0 runs chunks 0 and 3, and one parameter (the tied embedding) is used by both."""
    if runner.pp_rank == 0:
        assert set(runner.chunks) == {0, 3}, set(runner.chunks)
        shared = set(runner.chunks[0].order) & set(runner.chunks[3].order)
        assert any("wte" in f for f in shared), shared


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_clip_grad_norm_with_tied_embeddings(pools):
    """GPT-2's tied embedding lives on both stages: the total norm counts it once. In this
    plan the first stage looks it up replicated (its gradient complete on each dp rank) and
    the LM head's gradient is partial over dp: the tied group sums over dp and both stages,
    so the first stage's ranks add half each (checked: gradients and norm equal one
    process's)."""
    model, inputs, kwargs, _, _ = _build("gpt2", 4)
    prog = fxpar.compile(model, fxpar.Cluster.local(4), inputs, kwargs, mesh={"pp": 2, "dp": 2},
                         plan="auto", schedule="1f1b", microbatches=2, time_limit=20,
                         optimizer=lambda ps: torch.optim.AdamW(ps))
    wte = "transformer.wte.weight"
    assert (prog.replica_axes(wte, 0), prog.replica_axes(wte, 1), prog.replica_axes(wte)) \
        == ((), ("dp",), ("dp",))
    _check(pools(4).run(run_pipeline, "gpt2", {"pp": 2, "dp": 2}, "1f1b", 2, 1, None, "auto",
                        3, "auto", 1, 1, 0.05))


@pytest.mark.timeout(300)
def test_cross_mesh_boundary(pools):
    """The block output is computed sequence-sharded on dp (a pin); the next stage takes it
    batch-sharded (its own choice): a cross-mesh reshard between the two submeshes, forward
    and for the gradient back (issue #11 item 4)."""
    _check(pools(4).run(run_pipeline, "gpt", {"pp": 2, "dp": 2}, "1f1b", 2, 1, None, "auto",
                        3, "crossmesh", 1, 1, None, "S(1)"))


@pytest.mark.timeout(300)
def test_user_split_points(pools):
    """Uneven stages at a user's cut (FQNs of the model itself, not of the loss wrapper)."""
    _check(pools(2).run(run_pipeline, "gpt", {"pp": 2}, "1f1b", 2, 1, ["blocks.3"]))


def _count_preposts(runner, policy: str = "step", cap: int | None = None):
    """Records where each receive was posted ahead of its action; the check, under gloo:
    ``"step"`` (within the byte cap) posts every receive of the rank's list, in list order,
    before its first action; ``"compute"`` (and ``"step"`` over the cap) every one after the
    rank's first compute action, each just before the compute action that precedes it; none
    is left over. ``cap`` replaces ``PREPOST_BYTES`` for this runner's steps."""
    from fxpar.runtime import interpreter
    from fxpar.schedule.actions import COMPUTE_KINDS, RECV_KINDS

    def key(a):
        return (a.stage - (a.kind == "RECV_F"), a.microbatch, int(a.kind == "RECV_B"))

    acts = runner.schedule.actions[runner.pp_rank]
    runner.prepost = policy
    saved = interpreter.PREPOST_BYTES
    if cap is not None:
        interpreter.PREPOST_BYTES = cap
    posted, at = [], []
    orig_pre, orig_run = runner._prepost, runner._run
    runner._prepost = lambda *a: (posted.append((a[:3], len(at))), orig_pre(*a))
    runner._run = lambda action, batch: (at.append(action), orig_run(action, batch))
    computes = [j for j, a in enumerate(acts) if a.kind in COMPUTE_KINDS]
    if policy == "off":
        want = []
    elif policy == "step" and cap is None:   # every receive, before the step's first action
        want = [(key(a), 0) for a in acts if a.kind in RECV_KINDS]
    else:       # after each compute action j, the receives up to the next, before j runs
        want = [(key(a), j) for j, nxt in zip(computes, computes[1:])
                for a in acts[j + 1:nxt] if a.kind in RECV_KINDS]

    def check():
        interpreter.PREPOST_BYTES = saved
        n = len(acts)
        got = [(k, i % n) for k, i in posted]
        assert got == want * 3 and (want or policy == "off"), (got, want)
        assert runner._posted == {}
    return check


@pytest.mark.timeout(300)
@pytest.mark.parametrize("policy,cap", [("step", None), ("compute", None), ("step", 0),
                                        ("off", None)])
def test_receives_posted_ahead(pools, policy, cap):
    """Interleaved 1F1B on 2 gloo ranks: receives are posted ahead of their actions, all of a
    step's at its start (``"step"``), or a compute action's successor's before it runs
    (``"compute"``, and ``"step"`` when the buffers exceed ``PREPOST_BYTES``), or none
    (``"off"``); the numerics stay the reference's."""
    _check(pools(2).run(run_pipeline, "gpt", {"pp": 2}, "interleaved", 4, 2,
                        on_runner=functools.partial(_count_preposts, policy=policy, cap=cap)))


def test_unknown_prepost_policy():
    from types import SimpleNamespace

    from fxpar.runtime.interpreter import PipelineRunner

    with pytest.raises(fxpar.FxparError, match="'early' is not one of"):
        PipelineRunner._ahead(SimpleNamespace(prepost="early", _ahead_at=None))


@pytest.mark.timeout(300)
def test_hand_written_schedule(pools):
    """A schedule written by hand (compute actions only; sends and receives are added and the
    lists validated): both microbatches forward, then backward in reverse order."""
    text = "0F0,0F1,0B1,0B0\n1F0,1F1,1B1,1B0\n"
    _check(pools(2).run(run_pipeline, "gpt", {"pp": 2}, text, 2))


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("name,mesh,schedule,m,chunks,plan", [
    ("gpt", {"pp": 4}, "1f1b", 4, 1, "auto"),
    ("gpt", {"pp": 2, "dp": 1, "tp": 2}, "1f1b", 2, 1, "megatron"),
    ("gpt", {"pp": 2, "dp": 2}, "interleaved", 2, 2, "dp"),
    ("llama", {"pp": 2, "tp": 2}, "zb-h1", 5, 1, "auto"),
    ("gpt", {"pp": 2, "dp": 2}, "zb-h1", 2, 1, "zero3"),   # ZeRO-3 chunks run I whole
    ("skip", {"pp": 4}, "gpipe", 2, 1, "auto"),
    ("gpt8", {"pp": 4}, "interleaved", 4, 2, "auto"),   # 8 chunks, chunk k on rank k % 4
    ("gpt8", {"pp": 4}, "zbv", 3, 2, "auto"),           # 8 chunks in a V, fewer microbatches than 2p−1
    ("gpt8", {"pp": 4}, "dualpipev", 8, 2, "auto"),     # a V, B's and a split tail
    ("gpt", {"pp": 2, "dp": 2}, "zbv", 2, 2, "zero3"),   # a V whose stages shard over dp
    ("gpt", {"pp": 2, "tp": 2}, "dualpipev", 4, 2, "megatron"),   # a V of tp=2 stages
])
def test_pipeline_4_ranks(pools, name, mesh, schedule, m, chunks, plan):
    _check(pools(4).run(run_pipeline, name, mesh, schedule, m, chunks, None, plan))


@pytest.mark.timeout(300)
def test_scatter_gather_boundary(pools):
    """Megatron §4.1: the boundary activation (replicated on tp) crosses as 1/t per rank and
    is all-gathered on the receiving stage; gradients come back the same way."""
    _check(pools(4).run(run_pipeline, "gpt", {"pp": 2, "dp": 1, "tp": 2}, "1f1b", 2, 1, None,
                        "megatron", 3, "scatter_gather"))


@pytest.mark.timeout(300)
def test_pipeline_with_state_sharding(pools):
    """AMSP factors per stage: gradients reduce-scattered (s_g=2) and optimizer states
    sharded (s_os=2) over each stage's data-parallel pair."""
    _check(pools(4).run(run_pipeline, "gpt", {"pp": 2, "dp": 2}, "1f1b", 4, 1, None, "dp", 3,
                        "auto", 2, 2))


@pytest.mark.slow
@pytest.mark.timeout(500)
def test_pipeline_8_ranks(pools):
    """pp=2 × dp=2 × tp=2 (Megatron PTD-P): tensor parallel inside a stage, data parallel
    gradients reduced per stage after the last microbatch."""
    _check(pools(8).run(run_pipeline, "gpt", {"pp": 2, "dp": 2, "tp": 2}, "1f1b", 3, 1, None,
                        "megatron"))


def run_dropout(schedule: str, p: float, steps: int = 2):
    """GPT-2 with dropout on pp=2, m=2: the losses and this rank's parameters after ``steps``."""
    import transformers as tf

    import fxpar

    torch.manual_seed(0)
    cfg = tf.GPT2Config(vocab_size=96, n_positions=16, n_embd=32, n_layer=2, n_head=4,
                        resid_pdrop=p, embd_pdrop=p, attn_pdrop=0.0, use_cache=False)
    # (attention dropout inside SDPA: tests/test_runtime_random.py)
    model, ids = tf.GPT2LMHeadModel(cfg), torch.randint(0, 96, (2, 16)).repeat(2, 1)
    prog = fxpar.compile(model, fxpar.Cluster.local(2), (ids,), {"labels": ids},
                         optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2), mesh={"pp": 2},
                         schedule=schedule, microbatches=2, time_limit=20)
    runner = prog.runner()
    losses, per_mb = [], []
    for _ in range(steps):
        losses.append(runner.step(ids, labels=ids).item())
        per_mb.append([x.item() for x in runner._losses])  # the last stage's, per microbatch
    return losses, {f: t.detach().clone() for f, t in runner.state.items()}, per_mb


@pytest.mark.timeout(300)
def test_dropout_is_schedule_invariant(pools):
    """Dropout masks are drawn by (step, microbatch, site, shard), so the forward and the
    backward of a microbatch see the same mask whatever the schedule runs between them:
    GPipe (every forward first), 1F1B and ZB-H1 (split backward) train identically. The two
    microbatches hold the same rows: equal losses without dropout, different ones with it
    (each microbatch draws its own masks)."""
    pool = pools(2)
    runs = {s: pool.run(run_dropout, s, 0.1) for s in ("gpipe", "1f1b", "zb-h1")}
    plain = pool.run(run_dropout, "1f1b", 0.0)
    for rank in range(2):
        ref_losses, ref_state, _ = runs["gpipe"][rank]
        for s in ("1f1b", "zb-h1"):
            losses, state, _ = runs[s][rank]
            assert losses == pytest.approx(ref_losses, rel=1e-6), (s, losses, ref_losses)
            for f, t in state.items():
                torch.testing.assert_close(t, ref_state[f], rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"{s}: {f}: {m}")
    (a, b), = plain[1][2][:1]
    assert a == pytest.approx(b, rel=1e-6)
    for s in runs:
        (a, b) = runs[s][1][2][0]
        assert abs(a - b) > 1e-4 * abs(a), (s, a, b)


def test_split_backward_takes_an_output_that_is_a_view():
    """A last chunk whose loss comes back from a collective's wait as a view: ``I`` (torch's
    ``stage_backward_input``, which detaches the outputs in place) refused it ("Can't detach
    views in-place"; a pp2 x dp2 zb-h1 plan that all-reduces its loss failed at its first
    step). The input gradient is computed, the weight gradient left for ``W``."""
    from torch.distributed.pipelining._backward import stage_backward_weight

    from fxpar.runtime.interpreter import PipelineRunner

    x = torch.randn(3, 4, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(4, 2))
    loss = torch.tanh(x @ w).sum().view(())
    assert loss._is_view()
    assert PipelineRunner._splittable([loss], [x], [w])
    groups = PipelineRunner._split_input([loss], None, [x], [w])
    assert groups is not None and w.grad is None
    ref_x, ref_w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    torch.tanh(ref_x @ ref_w).sum().backward()
    torch.testing.assert_close(x.grad, ref_x.grad)
    stage_backward_weight(iter([w]), groups)
    torch.testing.assert_close(w.grad, ref_w.grad)


def run_reduce_dtype(reduce_dtype, planned=None, schedule="1f1b"):
    """A bf16 GPT on 2 pipeline stages, 4 microbatches: the gradients each rank's states hold
    after one backward, beside a one-process reference that sums the microbatches' bf16
    gradients in fp32. ``planned``: the plan's ``PlannerOptions.reduce_dtype``."""
    import fxpar

    model, (idx,), _, loss_fn, (tgt,) = _build("gpt")
    model = model.to(torch.bfloat16)
    ref = copy.deepcopy(model)
    m = 4
    prog = fxpar.compile(model, fxpar.Cluster.local(2), (idx,), loss_fn=loss_fn,
                         example_targets=(tgt,), optimizer=lambda ps: torch.optim.AdamW(ps),
                         mesh={"pp": 2}, schedule=schedule, microbatches=m, time_limit=20,
                         options=fxpar.PlannerOptions(reduce_dtype=planned))
    runner = prog.runner(reduce_dtype=reduce_dtype)
    runner.forward_backward(idx, tgt)
    want = {}
    for a, b in zip(idx.chunk(m), tgt.chunk(m)):
        (loss_fn(ref(a), b) / m).backward()
        for k, p in ref.named_parameters():
            want[k] = want.get(k, 0) + p.grad.float()
            p.grad = None
    return {f: (str(g.dtype), (g.float() - want[f.removeprefix("model.")]).abs().max().item(),
                want[f.removeprefix("model.")].abs().max().item())
            for f, g in runner.states.grads().items()}


@pytest.mark.timeout(300)
def test_reduce_dtype_sums_microbatches_in_fp32(pools):
    """``runner(reduce_dtype=torch.float32)`` on bf16 parameters (Megatron-LM's fp32 gradient
    accumulation): the states' gradients are fp32, the microbatches' bf16 gradients summed
    in fp32 as the reference sums them; without it they stay bf16, unless the plan priced
    fp32 reductions (``PlannerOptions(reduce_dtype="float32")``): its runner's default."""
    # zb-h1: chunk 1's weight gradients from its deferred linears (fxpar.runtime.deferred)
    for r in [*pools(2).run(run_reduce_dtype, torch.float32),
              *pools(2).run(run_reduce_dtype, None, "float32"),
              *pools(2).run(run_reduce_dtype, torch.float32, None, "zb-h1")]:
        assert r and all(dt == "torch.float32" for dt, _, _ in r.values()), r
        for f, (_, err, scale) in r.items():
            # the same bf16 microbatch gradients summed in fp32 (bitwise equal here); summed
            # in bf16 on the leaf they are ~0.5% of the largest off
            assert err <= 1e-4 * scale, (f, err, scale)
    for r in pools(2).run(run_reduce_dtype, None):
        assert all(dt == "torch.bfloat16" for dt, _, _ in r.values()), r
