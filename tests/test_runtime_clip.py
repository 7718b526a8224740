"""``runner.clip_grad_norm_``: the global norm over every shard, replica and gradient chunk,
equal to ``torch.nn.utils.clip_grad_norm_`` on one process, and the same clipped update."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.dist

TOL = dict(rtol=1e-4, atol=2e-6)


def clip_worker(plan: str, mesh: dict, s_g: int, norm_type: float):
    import fxpar
    from fxpar.runtime.redistribute import distribute
    from examples.models import GPT

    torch.manual_seed(0)
    m = GPT(vocab=64, d_model=32, n_heads=4, n_layers=2, seq_len=16)
    idx = torch.randint(0, 64, (8, 16))
    ref = copy.deepcopy(m)
    opt = lambda ps: torch.optim.SGD(ps, lr=0.5)  # noqa: E731  (a large step: clipping shows)
    prog = fxpar.compile(m, fxpar.Cluster.local(dist.get_world_size()), (idx, idx.roll(1, 1)),
                         plan=plan, mesh=mesh, optimizer=opt, time_limit=20)
    runner = prog.runner(s_g=s_g, s_os=s_g)
    ropt = opt(ref.parameters())
    norms = []
    for _ in range(2):
        runner.forward_backward(idx, idx.roll(1, 1))
        got = runner.clip_grad_norm_(0.05, norm_type)
        ref(idx, idx.roll(1, 1)).backward()
        want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05, norm_type)
        torch.testing.assert_close(got, want, **TOL)
        ref_state = dict(ref.named_parameters())
        for fqn, g in runner.states.grads().items():  # the clipped gradients themselves
            w = distribute(ref_state[fqn].grad, runner.specs[fqn], runner.mesh.shape, runner.coord)
            torch.testing.assert_close(g, w, **TOL, msg=lambda s: f"clipped grad of {fqn}: {s}")
        runner.optimizer_step()
        ropt.step()
        ropt.zero_grad()
        norms.append(got.item())
    for fqn, t in runner.state.items():
        w = distribute(dict(ref.named_parameters())[fqn].detach(), runner.specs[fqn],
                       runner.mesh.shape, runner.coord)
        torch.testing.assert_close(t.detach(), w, **TOL, msg=lambda s: f"param {fqn}: {s}")
    return norms


@pytest.mark.timeout(300)
@pytest.mark.parametrize("plan,mesh,s_g,norm_type", [
    ("dp", {"dp": 2}, 1, 2.0),
    ("dp", {"dp": 2}, 2, 2.0),               # gradient chunks (ZeRO-2): each held once
    ("zero3", {"dp": 2}, 1, 2.0),            # parameters sharded by the plan
    ("megatron", {"dp": 1, "tp": 2}, 1, 2.0),  # column/row shards, norms/biases replicated on tp
    ("megatron", {"dp": 1, "tp": 2}, 1, float("inf")),
])
def test_clip_2_ranks(pools, plan, mesh, s_g, norm_type):
    norms = pools(2).run(clip_worker, plan, mesh, s_g, norm_type)
    assert norms[0] == norms[1] and norms[0][0] > 0.05  # same on every rank; it did clip


@pytest.mark.timeout(300)
@pytest.mark.parametrize("plan,mesh,s_g", [
    ("megatron", {"dp": 2, "tp": 2}, 2),     # replicas over dp, chunks, tp shards at once
    ("zero3", {"dp": 4}, 1),
])
def test_clip_4_ranks(pools, plan, mesh, s_g):
    norms = pools(4).run(clip_worker, plan, mesh, s_g, 2.0)
    assert all(n == norms[0] for n in norms)
