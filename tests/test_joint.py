"""The joint search (fxpar.planner.joint): exact stage cuts, the memory model it applies, user
tuples, budgets named when nothing fits, and fxpar.plan's multi-node path end to end."""

import itertools
import random

import pytest
import torch

import fxpar
from fxpar.cost.memory import model_state_bytes
from fxpar.cost.pipeline import in_flight_microbatches
from fxpar.errors import PlanError
from fxpar.planner.joint import partition, search, unit_costs


def _brute(times, n):
    u = len(times)
    best = None
    for cuts in itertools.combinations(range(1, u), n - 1):
        b = (0, *cuts, u)
        v = max(sum(times[b[k]:b[k + 1]]) for k in range(n))
        best = v if best is None else min(best, v)
    return best


def test_partition_equals_brute_force():
    rng = random.Random(0)
    for _ in range(200):
        u = rng.randint(1, 9)
        n = rng.randint(1, u)
        times = tuple(rng.choice([0.5, 1.0, 2.0, 3.0, rng.random()]) for _ in range(u))
        starts = partition(times, n)
        assert len(starts) == n and starts[0] == 0 and list(starts) == sorted(set(starts))
        b = (*starts, u)
        got = max(sum(times[b[k]:b[k + 1]]) for k in range(n))
        assert got == pytest.approx(_brute(times, n), rel=1e-9), (times, n, starts)
    with pytest.raises(PlanError, match="3 stage chunks for 2 units"):
        partition((1.0, 1.0), 3)


@pytest.fixture(scope="module")
def gpt():
    from examples.models import GPT

    torch.manual_seed(0)
    model = GPT(vocab=64, d_model=32, n_heads=2, n_layers=4, seq_len=16)
    return model, fxpar.capture(model, (torch.randint(0, 64, (1, 16)),))


def test_search_memory_is_the_stage_model(gpt):
    """The fullest rank's memory of a ranked configuration is AMSP's states of its local
    parameters plus the schedule's in-flight microbatches times its chunks' activations
    (Megatron §2.2), computed here from the unit table by hand."""
    _, gm = gpt
    cl = fxpar.Cluster.preset("dgx-a100", nodes=2)
    res = search(gm, cl, batch=16, only=dict(pp=2, tp=2, microbatch=1, schedule="1f1b",
                                              recompute=False))
    c = next(x for x in res.ranked if (x.s_g, x.s_os) == (1, 1))
    assert (c.pp, c.tp, c.dp, c.microbatches) == (2, 2, 4, 4)
    us, _ = unit_costs(gm, fxpar.Mesh(cl, tp=2))
    bounds = (*c.starts, len(us))
    tmp = 2 * 25 * 2**20 + max(u.act for u in us)
    want = []
    for r in range(2):
        chunk = us[bounds[r]:bounds[r + 1]]
        phi = sum(u.params for u in chunk)
        act = sum(u.act for u in chunk) * in_flight_microbatches("1f1b", r, 2, 4)
        want.append(model_state_bytes(phi).total + act + tmp)
    assert c.memory == pytest.approx(max(want), rel=1e-9)
    # ZeRO-1 over the 4 replicas keeps 12/4 of the optimizer bytes per parameter
    z1 = next(x for x in res.ranked if (x.s_g, x.s_os) == (1, 4))
    assert z1.memory < c.memory


def test_user_tuple_is_respected_and_budget_is_named(gpt):
    _, gm = gpt
    cl = fxpar.Cluster.preset("dgx-a100", nodes=2)
    res = search(gm, cl, batch=16, only=dict(pp=2, dp=2, tp=4, schedule="interleaved", chunks=2))
    assert all((c.pp, c.dp, c.tp, c.schedule, c.chunks) == (2, 2, 4, "interleaved", 2)
               for c in res.ranked)
    assert all(c.simulated for c in res.ranked)
    assert [c.step for c in res.ranked] == sorted(c.step for c in res.ranked)
    opts = fxpar.planner.PlannerOptions(memory_budget=1e5)
    with pytest.raises(PlanError, match=r"budget of 0\.0 GiB[\s\S]*smallest found: pp=\d+"):
        search(gm, cl, batch=16, options=opts)


def test_plan_auto_on_a_multi_node_cluster_runs_the_joint_search():
    """fxpar.plan(..., plan="auto") without a mesh on 2 nodes: the search's best, planned for
    real; the same plan twice; a user tuple gives a pipeline on exactly those degrees."""
    from examples.models import GPT

    model = GPT(vocab=64, d_model=64, n_heads=2, n_layers=4, seq_len=16)
    cl = fxpar.Cluster.preset("dgx-a100", nodes=2)
    x = torch.randint(0, 64, (32, 16))
    a = fxpar.plan(model, cl, (x,))
    assert a.plan == fxpar.plan(model, cl, (x,)).plan
    p = fxpar.plan(model, cl, (x,), plan=dict(pp=2, tp=2, dp=4, microbatch=1, schedule="1f1b"))
    pl = p.plan
    assert pl.mesh["axis_names"] == ("pp", "dp", "tp") and pl.mesh["shape"] == (2, 4, 2)
    assert pl.schedule["name"] == "1f1b" and pl.schedule["microbatches"] == 8
    assert len(p.stage_graphs) == 2
    ranked = pl.schedule["search"]["ranked"]
    assert ranked and ranked[0]["name"].startswith("pp=2 dp=4 tp=2 b=1 m=8 1f1b")
    text = pl.explain()
    assert "joint search:" in text and "1. pp=2 dp=4 tp=2" in text
    # the batch of one replica's microbatch stays split over dp in every chunk
    for st in pl.stages:
        assert all(n.outputs[0].startswith("S(0)") for n in st.plan.nodes if n.name == "idx")
    with pytest.raises(PlanError, match="unknown keys"):
        fxpar.plan(model, cl, (x,), plan=dict(pp=2, tensor=2))


def run_joint(steps: int = 3):
    """A user tuple planned by the joint search (pp=2 x dp=2 x tp=2, 1F1B, 4 microbatches,
    recomputation, ZeRO-1 over dp) and run with the runner's defaults from the plan: loss,
    gradients and parameters after each AdamW step against one process."""
    import copy

    import torch.distributed as dist
    from test_pipeline_runtime import _build, train_and_check

    model, inputs, kwargs, loss_fn, targets = _build("gpt")
    ref = copy.deepcopy(model)
    opt = lambda ps: torch.optim.AdamW(ps, lr=1e-2, eps=1e-5)  # noqa: E731
    tup = dict(pp=2, dp=2, tp=2, microbatch=1, schedule="1f1b", recompute=True, s_os=2)
    prog = fxpar.compile(model, fxpar.Cluster.local(dist.get_world_size()), inputs, kwargs,
                         loss_fn=loss_fn, example_targets=targets, optimizer=opt, plan=tup)
    sc = prog.plan.schedule
    assert (sc["microbatches"], sc["state"]["s_os"]) == (4, 2) and sc["recompute"], sc
    runner = prog.runner()  # s_os and recomputation from the plan
    assert runner.recompute, "the plan's recomputation is not in the runner"
    losses = train_and_check(runner, ref, opt, inputs, targets, kwargs, loss_fn, steps)
    # ZeRO-1 over dp=2: Adam's two fp32 moments of about half the local elements
    local = sum(t.numel() for t in runner.state.values())
    assert runner.states.memory()["optimizer"] <= 0.6 * 8 * local, (runner.states.memory(), local)
    return losses


@pytest.mark.timeout(400)
def test_joint_plan_trains_like_one_process_on_8_ranks(pools):
    results = pools(8).run(run_joint, timeout=360)
    assert all(r == results[0] for r in results), results
