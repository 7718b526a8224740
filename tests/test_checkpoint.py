"""DCP checkpoints across plans: saved under megatron on 2 ranks, loaded under zero3 on 2
ranks, under dp on 4 ranks, and into a plain module + AdamW in one process; the next steps'
losses equal an uninterrupted run (optimizer state included)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

pytestmark = [pytest.mark.dist, pytest.mark.slow]

STEPS = 2


def _gpt(seed: int):
    from examples.models import GPT

    torch.manual_seed(seed)
    m = GPT(vocab=64, d_model=32, n_heads=4, n_layers=2, seq_len=16)
    g = torch.Generator().manual_seed(7)
    batches = [torch.randint(0, 64, (8, 16), generator=g) for _ in range(2 + STEPS)]
    return m, [(b, b.roll(1, 1)) for b in batches]


def _opt(ps):
    return torch.optim.AdamW(ps, lr=1e-2)


def _runner(seed: int, plan: str, mesh: dict, **kw):
    import fxpar

    m, batches = _gpt(seed)
    prog = fxpar.compile(m, fxpar.Cluster.local(dist.get_world_size()), batches[0], plan=plan,
                         mesh=mesh, optimizer=_opt, time_limit=20)
    return prog.runner(**kw), batches


def save_worker(path: str):
    """Train 2 steps under megatron, save, train STEPS more: the uninterrupted losses."""
    runner, batches = _runner(0, "megatron", {"dp": 1, "tp": 2})
    for b in batches[:2]:
        runner.step(*b)
    runner.save_checkpoint(path)
    return [runner.step(*b).item() for b in batches[2:]]


def load_worker(path: str, plan: str, mesh: dict, s_os: int = 1):
    """Another plan (and other initial weights): load, then the same STEPS batches."""
    runner, batches = _runner(1, plan, mesh, s_os=s_os)
    runner.load_checkpoint(path)
    return [runner.step(*b).item() for b in batches[2:]]


def pipeline_worker(path: str, again: str, schedule: str = "1f1b"):
    """Load into a 2-stage pipeline (2 microbatches), run the STEPS batches, save again."""
    import fxpar

    m, batches = _gpt(1)
    prog = fxpar.compile(m, fxpar.Cluster.local(dist.get_world_size()), batches[0],
                         mesh={"pp": 2}, microbatches=2, optimizer=_opt, time_limit=20,
                         schedule=schedule)
    assert [st.rank for st in prog.plan.stages] == ([0, 1, 1, 0] if schedule == "zbv" else [0, 1])
    runner = prog.runner()
    runner.load_checkpoint(path)
    losses = [runner.step(*b).item() for b in batches[2:]]
    runner.save_checkpoint(again)
    return losses


@pytest.fixture(scope="module")
def saved(pools, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ckpt") / "step2")
    losses = pools(2).run(save_worker, path)
    assert losses[0] == losses[1]
    return path, losses[0]


@pytest.mark.timeout(300)
def test_load_under_zero3_on_2_ranks(pools, saved):
    path, want = saved
    for got in pools(2).run(load_worker, path, "zero3", {"dp": 2}):
        assert got == pytest.approx(want, rel=1e-5)


@pytest.mark.timeout(300)
def test_load_under_dp_on_4_ranks_with_sharded_optimizer(pools, saved):
    path, want = saved
    for got in pools(4).run(load_worker, path, "dp", {"dp": 4}, 2):
        assert got == pytest.approx(want, rel=1e-5)


@pytest.mark.timeout(120)
def test_load_into_a_plain_module(saved):
    """No fxpar on the loading side: torch's own state-dict helpers and DCP."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    path, want = saved
    model, batches = _gpt(1)
    opt = _opt(model.parameters())
    sd = {"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(sd, checkpoint_id=path)
    model.load_state_dict(sd["model"])
    set_optimizer_state_dict(model, opt, sd["optim"])
    got = []
    for b in batches[2:]:
        loss = model(*b)
        loss.backward()
        opt.step()
        opt.zero_grad()
        got.append(loss.item())
    assert got == pytest.approx(want, rel=1e-5)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_pipeline_loads_and_saves(pools, saved, tmp_path, schedule):
    """A checkpoint from a megatron plan loads into a pp=2 pipeline (each stage reads its
    layers; zbv: four chunks in a V, rank 0 holding the first and the last); the pipeline's
    own checkpoint then loads into a plain module whose weights equal the pipeline's after its
    steps: a second plain step from either gives the same loss."""
    import torch.distributed.checkpoint as dcp

    path, want = saved
    again = str(tmp_path / "pp")
    for got in pools(2).run(pipeline_worker, path, again, schedule):
        assert got == pytest.approx(want, rel=1e-5)
    model, batches = _gpt(1)
    sd = {"model": model.state_dict()}
    dcp.load(sd, checkpoint_id=again)
    model.load_state_dict(sd["model"])
    from torch.distributed.checkpoint.state_dict import (get_optimizer_state_dict,
                                                         set_optimizer_state_dict)

    ref, _ = _gpt(1)
    opt = _opt(ref.parameters())
    sd = {"model": ref.state_dict(), "optim": get_optimizer_state_dict(ref, opt)}
    dcp.load(sd, checkpoint_id=path)
    ref.load_state_dict(sd["model"])
    set_optimizer_state_dict(ref, opt, sd["optim"])
    for b in batches[2:]:   # the uninterrupted run, in one process, from the first checkpoint
        ref(*b).backward()
        opt.step()
        opt.zero_grad()
    # atol: the attention key bias has an exactly-zero gradient in theory, so its update is
    # Adam (eps 1e-8) on rounding noise, which microbatching reorders (the parity tests note it)
    for (k, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=2e-4, msg=lambda s: f"{k}: {s}")


def _gpt2(seed: int):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=4,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(cfg)


def gpt2_worker(path: str, save: bool):
    """HF GPT-2 under megatron (its fused c_attn held strided, ``S(1,3)``): train 2 steps and
    save, or load; then STEPS more steps."""
    import fxpar

    m = _gpt2(0 if save else 1)
    g = torch.Generator().manual_seed(7)
    batches = [torch.randint(0, 64, (4, 16), generator=g) for _ in range(2 + STEPS)]
    prog = fxpar.compile(m, fxpar.Cluster.local(2), (batches[0],), {"labels": batches[0]},
                         plan="megatron", mesh={"tp": 2}, optimizer=_opt, time_limit=20)
    runner = prog.runner()
    assert str(runner.specs["transformer.h.0.attn.c_attn.weight"]) == "S(1,3)"
    if save:
        for b in batches[:2]:
            runner.step(b, labels=b)
        runner.save_checkpoint(path)
    else:
        runner.load_checkpoint(path)
    return [runner.step(b, labels=b).item() for b in batches[2:]]


@pytest.mark.timeout(300)
def test_fused_qkv_checkpoint_is_plain(pools, tmp_path):
    """A strided (fused q/k/v) parameter is checkpointed as the plain tensor: it loads back
    under megatron, and into a plain HF module whose next steps give the same losses."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    path = str(tmp_path / "gpt2")
    want = pools(2).run(gpt2_worker, path, True)[0]
    for got in pools(2).run(gpt2_worker, path, False):
        assert got == pytest.approx(want, rel=1e-5)
    model = _gpt2(1)
    opt = _opt(model.parameters())
    sd = {"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(sd, checkpoint_id=path)
    model.load_state_dict(sd["model"])
    set_optimizer_state_dict(model, opt, sd["optim"])
    g = torch.Generator().manual_seed(7)
    batches = [torch.randint(0, 64, (4, 16), generator=g) for _ in range(2 + STEPS)]
    got = []
    for b in batches[2:]:
        loss = model(b, labels=b).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        got.append(loss.item())
    assert got == pytest.approx(want, rel=1e-5)
