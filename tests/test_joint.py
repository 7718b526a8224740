"""The joint search (fxpar.planner.joint): exact stage cuts, the memory model it applies, user
tuples, budgets named when nothing fits, and fxpar.plan's multi-node path end to end."""

import itertools
import math
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


@pytest.mark.slow
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


def _tuple_program(tup: dict):
    """The test GPT compiled with the plan tuple ``tup`` on this process group's ranks, and
    ``train(runner, steps)``: AdamW steps checked against a one-process copy (loss, gradients,
    parameters; :func:`test_pipeline_runtime.train_and_check`)."""
    import copy

    import torch.distributed as dist
    from test_pipeline_runtime import _build, train_and_check

    model, inputs, kwargs, loss_fn, targets = _build("gpt")
    ref = copy.deepcopy(model)
    opt = lambda ps: torch.optim.AdamW(ps, lr=1e-2, eps=1e-5)  # noqa: E731
    prog = fxpar.compile(model, fxpar.Cluster.local(dist.get_world_size()), inputs, kwargs,
                         loss_fn=loss_fn, example_targets=targets, optimizer=opt, plan=tup)
    return prog, lambda runner, steps: train_and_check(runner, ref, opt, inputs, targets,
                                                       kwargs, loss_fn, steps)


def run_joint(steps: int = 3):
    """A user tuple planned by the joint search (pp=2 x dp=2 x tp=2, 1F1B, 4 microbatches,
    recomputation, ZeRO-1 over dp) and run with the runner's defaults from the plan: loss,
    gradients and parameters after each AdamW step against one process."""
    tup = dict(pp=2, dp=2, tp=2, microbatch=1, schedule="1f1b", recompute=True, s_os=2)
    prog, train = _tuple_program(tup)
    cfg = prog.plan.config
    assert (cfg.microbatches, cfg.s_os) == (4, 2) and cfg.recompute, cfg
    runner = prog.runner()  # s_os and recomputation from the plan
    assert runner.recompute, "the plan's recomputation is not in the runner"
    losses = train(runner, steps)
    # ZeRO-1 over dp=2: Adam's two fp32 moments of about half the local elements
    local = sum(t.numel() for t in runner.state.values())
    assert runner.states.memory()["optimizer"] <= 0.6 * 8 * local, (runner.states.memory(), local)
    return losses


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.timeout(400)
def test_joint_plan_trains_like_one_process_on_8_ranks(pools):
    results = pools(8).run(run_joint, timeout=360)
    assert all(r == results[0] for r in results), results


def _bucket(P: int, s_p: int) -> float:
    """The step model's AMSP bucket ``U`` (:func:`fxpar.cost.step.dp_terms`): a P shard's
    ``2P/s_p`` gradient bytes in whole buckets (a first of 1 MiB, then 25 MiB each), equal-sized.
"""
    grads = 2 * P / s_p
    return grads / (1 + math.ceil(max(0, grads - 2**20) / (25 * 2**20)))


def _os_gather(sh, P: float, cl, dp) -> float:
    """``T_os1`` as fxpar's runtime pays it (:data:`fxpar.cost.step.ZERO_STYLES` ``"flat"``):
    one all-gather of a P shard's ``2P/s_p`` updated bytes over the ``s_os/s_p`` ratio groups
    (AMSP's ``t`` of an all-gather, where AMSP's own term broadcasts from each owner)."""
    from fxpar.cost import amsp

    return (amsp.amsp_time("AG", 2 * P / sh.s_p, sh.os, cl, b=sh.p, dp=dp)
            if sh.s_os > sh.s_p else 0.0)


def test_zero3_is_searched_for_one_spmd_step_and_priced_by_amsp(gpt):
    """``(s_p, s_g, s_os) = (d, d, d)`` is a candidate only without a pipeline or microbatches;
    its memory is the states of ``Φ/d`` parameters each (AMSP §IV-D) plus the activations and
    the largest unit's gathered parameters twice (prefetch), by hand from the unit table; its
    data-parallel time is AMSP's terms, ``T_p`` (the forward and backward all-gathers,
    :func:`fxpar.cost.amsp.t_p`) over ``L`` gather groups (units taken until a group moves
    64 KiB, as the runtime gathers them)."""
    from fxpar.cost import amsp

    _, gm = gpt
    cl = fxpar.Cluster.preset("dgx-a100", nodes=2)
    res = search(gm, cl, batch=16, only=dict(pp=1, tp=1), keep=50)
    # sharded parameters over the 16 replicas or over 2, 4 or 8 of them inside a node; with
    # microbatches only over all 16 (gathered again per microbatch)
    assert {c.s_p for c in res.ranked if c.microbatches == 1} == {1, 2, 4, 8, 16}
    assert {c.s_p for c in res.ranked if c.microbatches > 1} <= {1, 16}
    z3 = next(c for c in res.ranked if c.s_p == 16)
    assert any((c.s_p, c.s_g, c.s_os, c.microbatches) == (1, 16, 16, 1) for c in res.ranked)
    assert "zero(p=16,g=16,os=16)" in z3.name
    us, _ = unit_costs(gm, fxpar.Mesh(cl, dp=1))
    phi = sum(u.params for u in us)
    act = sum(u.act for u in us)
    tmp = 2 * 25 * 2**20 + max(u.act for u in us)
    gathered = 2 * 2 * max(u.params for u in us)  # two bf16 copies of the largest unit
    want = model_state_bytes(phi, s_p=16, s_g=16, s_os=16).total + act + tmp + gathered
    assert z3.memory == pytest.approx(want, rel=1e-9)
    # AMSP's L: the gather groups (bf16: 15/16 of a group's bytes move over 16 ranks)
    ps, L, held = [u.params for u in us if u.params > 0], 0, float("inf")
    for x in ps:   # a group takes units until it moves 64 KiB
        L, held = (L + 1, x) if 2 * held * 15 / 16 >= 64 * 2**10 else (L, held + x)
    assert L < len(ps)   # the norms ride along
    sh, P = amsp.Sharding((8, 2), (8, 2), (8, 2)), round(phi)
    U = _bucket(P, 16)
    t_p = amsp.t_p(sh, [P / L], L, 1, cl, dp=(8, 2))
    terms = (t_p, amsp.t_g(sh, P, 1, U, cl, dp=(8, 2)), amsp.t_os0(sh, P, U, cl, dp=(8, 2)),
             _os_gather(sh, P, cl, dp=(8, 2)))
    assert t_p > 0 and z3.dp_comm == pytest.approx(sum(terms), rel=1e-9)
    # AMSP's LLaMA-13B sharding (4, 4, 8): parameters and gradients over 4 GPUs of a node,
    # optimizer states over its 8, priced by the same terms on the (8, 2) grid
    am = next(c for c in res.ranked if (c.s_p, c.s_g, c.s_os) == (4, 4, 8) and not c.recompute)
    assert am.memory == pytest.approx(model_state_bytes(phi, s_p=4, s_g=4, s_os=8).total
                                      + act + tmp + gathered, rel=1e-9)
    sh, U = amsp.Sharding((4, 1), (4, 1), (8, 1)), _bucket(P, 4)
    terms = (amsp.t_p(sh, [P / L], L, 1, cl, dp=(8, 2)), amsp.t_g(sh, P, 1, U, cl, dp=(8, 2)),
             amsp.t_os0(sh, P, U, cl, dp=(8, 2)), _os_gather(sh, P, cl, dp=(8, 2)))
    assert am.dp_comm == pytest.approx(sum(terms), rel=1e-9)
    assert am.spmd_axes == {"dp": 4, "dp_shard": 4, "tp": 1} and z3.spmd_axes == {"dp": 16, "tp": 1}
    # a pipeline gets ZeRO-3 over a stage's replicas at most, and not under zb-h1's split
    # backward; a tuple asking for more is refused
    piped = search(gm, cl, batch=16, only=dict(pp=2), keep=10**6).ranked
    assert all(c.s_p in (1, c.dp) for c in piped) and any(c.s_p > 1 for c in piped)
    assert all(c.schedule != "zb-h1" for c in piped if c.s_p > 1)
    # ZeRO-3's gathers (AMSP's M·T_p) are paid once per microbatch; DDP's reduction once per
    # step (same stage cuts)
    def dp_times(f):
        c1, c2 = (next(c for c in piped if (c.tp, c.microbatches, c.schedule, c.recompute, c.s_p,
                                            c.s_g) == (1, m, "1f1b", False, *f)) for m in (1, 2))
        assert c1.starts == c2.starts
        return c1.dp_comm, c2.dp_comm
    (z1, z2), (d1, d2) = dp_times((8, 8)), dp_times((1, 1))
    assert z2 > z1 and d2 == d1
    with pytest.raises(PlanError, match="inside groups of replicas need pp=1 and one microbatch"):
        search(gm, cl, batch=16, only=dict(pp=2, tp=1, s_p=2, s_g=2, s_os=2))
    with pytest.raises(PlanError, match="zb-h1"):
        search(gm, cl, batch=16, only=dict(pp=2, tp=1, schedule="zb-h1", s_p=8, s_g=8, s_os=8))
    with pytest.raises(PlanError, match=r"s_p \| s_g \| s_os"):
        search(gm, cl, batch=16, only=dict(pp=1, tp=1, s_p=4, s_g=2, s_os=4))


def test_sharding_groups_tile_the_nodes():
    """Sharding factors are groups of consecutive replicas that tile the nodes: they divide
    a node's ``d0`` replicas or are multiples of it (12 replicas, 4 per node: 3 and 6 divide
    12 but split a node or straddle two, which AMSP's intra x inter grid cannot price); a
    user tuple breaking that is refused."""
    from fxpar.planner.joint import _zero_options

    opts = _zero_options(12, {}, True, 4)
    assert {f for o in opts for f in o} == {1, 2, 4, 12}
    assert (2, 4, 12) in opts and (12, 12, 12) in opts
    assert _zero_options(24, dict(s_p=8, s_g=8, s_os=24), True, 4) == [(8, 8, 24)]
    assert _zero_options(12, dict(s_p=3, s_g=3, s_os=12), True, 4) == []


def test_memory_bound_search_picks_zero3(gpt):
    """A budget between ZeRO-3's footprint and every other configuration's: the search
    answers ZeRO-3 over all replicas, and names it in explain()."""
    _, gm = gpt
    cl = fxpar.Cluster.preset("dgx-a100", nodes=2)
    # without recomputation (with it, HSDP over 8 of a node fits a budget this tight too)
    only = dict(pp=1, tp=1, microbatch=1, recompute=False)
    res = search(gm, cl, batch=16, only=only, keep=50)
    z3 = min(c.memory for c in res.ranked if c.s_p == 16)
    rest = min(c.memory for c in res.ranked if c.s_p < 16)  # HSDP over 2-8 of a node too
    assert z3 < rest
    opts = fxpar.planner.PlannerOptions(memory_budget=(z3 + rest) / 2)
    best = search(gm, cl, batch=16, options=opts, only=only).best
    assert (best.s_p, best.s_g, best.s_os) == (16, 16, 16)


def run_joint_zero3(steps: int = 3):
    """A user tuple with ZeRO-3 over dp=2 (one SPMD step): every parameter that splits is
    stored sharded over dp, the runner's factors come from the plan, and loss, gradients and
    parameters follow one process through AdamW steps."""
    tup = dict(pp=1, dp=2, tp=1, s_p=2, s_g=2, s_os=2)
    prog, train = _tuple_program(tup)
    assert prog.plan.config.state == (2, 2, 2)
    assert "model states over dp: s_p=2" in prog.plan.explain()
    runner = prog.runner()
    sharded = {f: str(s) for f, s in runner.specs.items() if runner.state[f].requires_grad}
    assert all(s.startswith("S(") for s in sharded.values()), sharded
    return train(runner, steps)


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_joint_zero3_plan_trains_like_one_process_on_2_ranks(pools):
    results = pools(2).run(run_joint_zero3, timeout=240)
    assert results[0] == results[1], results


def run_joint_hsdp(steps: int = 3):
    """AMSP's intra-group parameter sharding (HSDP / MiCS) from a user tuple on 4 replicas:
    ``s_p = 2`` plans on a ``dp=2 x dp_shard=2`` mesh, every parameter that splits is stored
    sharded over ``dp_shard`` only and replicated over ``dp``, optimizer states over all 4
    (``s_os = 4``: the runner shards them over the 2 copies of each shard); loss, gradients
    and parameters follow one process through AdamW steps."""
    tup = dict(pp=1, dp=4, tp=1, s_p=2, s_g=2, s_os=4)
    prog, train = _tuple_program(tup)
    assert prog.plan.mesh["axis_names"] == ("dp", "dp_shard", "tp"), prog.plan.mesh
    assert prog.plan.mesh["shape"] == (2, 2, 1)
    assert "groups of dp_shard=2 replicas" in prog.plan.explain()
    runner = prog.runner()
    assert (runner.states.shard_info(next(iter(runner.states.grads())))["s_os"]) == 2
    trained = {f: str(s) for f, s in runner.specs.items() if runner.state[f].requires_grad}
    assert all(s.startswith("RS(") for s in trained.values()), trained
    # a shard's gradient is reduce-scattered over dp_shard, then all-reduced over dp (where
    # the plan computes it batch-split: not the position table, looked up whole everywhere)
    replica = runner.gm.meta[fxpar.ir.REPLICA_AXES]
    assert all(replica[f] in (("dp",), ()) for f in trained), replica
    assert all(replica[f] == ("dp",) for f in trained if f.endswith("fc1.weight")), replica
    return train(runner, steps)


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.timeout(300)
def test_joint_hsdp_plan_trains_like_one_process_on_4_ranks(pools):
    results = pools(4).run(run_joint_hsdp, timeout=240)
    assert all(r == results[0] for r in results), results


def run_joint_pipeline_zero3(steps: int = 3):
    """ZeRO-3 over a stage's 2 replicas under an interleaved pipeline (pp=2, 2 chunks per
    rank, 4 microbatches): parameters stored sharded, gathered again for every microbatch;
    loss, gradients and parameters follow one process through AdamW steps."""
    tup = dict(pp=2, dp=2, tp=1, microbatch=1, schedule="interleaved", chunks=2, s_p=2, s_g=2,
               s_os=2)
    prog, train = _tuple_program(tup)
    assert prog.plan.config.microbatches == 4 and prog.plan.config.s_p == 2
    runner = prog.runner()
    trained = {f: str(s) for f, s in runner.specs.items() if runner.state[f].requires_grad}
    assert trained and all(s.startswith("S(") for s in trained.values()), trained
    return train(runner, steps)


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.timeout(300)
def test_joint_pipeline_zero3_plan_trains_like_one_process_on_4_ranks(pools):
    results = pools(4).run(run_joint_pipeline_zero3, timeout=240)
    assert all(r == results[0] for r in results), results


def test_odd_replica_count_is_priced_on_its_own_nodes(gpt):
    """pp=2 x tp=4 on 3 nodes of 8: d = 3 replicas, one per node (3 is not a multiple of the
    node's 2 tp groups). ZeRO-1's data-parallel time minus DDP's is AMSP's, priced for a 1x3
    grid of 3 nodes by hand."""
    from fxpar.cost import amsp

    _, gm = gpt
    cl = fxpar.Cluster.preset("dgx-a100", nodes=3)
    res = search(gm, cl, batch=12, only=dict(pp=2, tp=4, microbatch=1, schedule="1f1b",
                                              recompute=False), keep=50)
    ddp = next(c for c in res.ranked if (c.s_g, c.s_os) == (1, 1))
    z1 = next(c for c in res.ranked if (c.s_g, c.s_os) == (1, 3))
    assert ddp.dp == 3
    us, _ = unit_costs(gm, fxpar.Mesh(cl, tp=4))
    phi = max(round(sum(u.params for u in us[ddp.starts[r]:(ddp.starts + (len(us),))[r + 1]]))
              for r in range(2))  # the fullest rank's (both ranks price alike up to it)

    def terms(sh):
        L, U, kw = 3, 25 * 2**20, dict(dp=(1, 3))
        return (amsp.t_g(sh, phi, 4, U, cl, **kw) + amsp.t_os0(sh, phi, U, cl, **kw)
                + _os_gather(sh, phi, cl, **kw) + amsp.t_p(sh, [phi / L], L, 4, cl, **kw))

    want = terms(amsp.Sharding((1, 1), (1, 1), (1, 3))) - terms(amsp.Sharding())
    assert want != 0 and z1.dp_comm - ddp.dp_comm == pytest.approx(want, rel=1e-6)


def test_recomputation_keeps_each_units_inputs_and_rebuilds_one_unit(gpt):
    """Per-layer recomputation (what the runtime does) on one rank, one microbatch: each
    recomputed unit keeps its input (the previous unit's output), a unit outside any layer
    (``(top)``: not recomputable) its saved activations, plus the largest recomputed unit's
    activations rebuilt, by hand."""
    _, gm = gpt
    cl = fxpar.Cluster.preset("dgx-a100")
    res = search(gm, cl, batch=64, only=dict(pp=1, tp=1, microbatch=8, s_g=1, s_os=1), keep=50)
    full = next(c for c in res.ranked if not c.recompute)
    rc = next(c for c in res.ranked if c.recompute)
    us, _ = unit_costs(gm, fxpar.Mesh(cl, dp=1))
    states = model_state_bytes(sum(u.params for u in us)).total
    tmp = 2 * 25 * 2**20 + 8 * max(u.act for u in us)
    rec = [i for i, u in enumerate(us) if not u.layer.startswith("(")]
    assert 0 < len(rec) < len(us)
    kept = 8 * sum((us[i - 1].out if i else 0.0) if i in rec else u.act for i, u in enumerate(us)) \
        + 8 * max(us[i].act for i in rec)
    assert rc.memory == pytest.approx(states + tmp + kept, rel=1e-9)
    assert full.memory == pytest.approx(states + tmp + 8 * sum(u.act for u in us), rel=1e-9)
    assert rc.memory < full.memory


def _none_and_every(gm):
    """One SPMD shape of the GPT on a DGX A100 (microbatch 8, no state sharding) and its
    candidates without recomputation and recomputing every layer."""
    cl = fxpar.Cluster.preset("dgx-a100")
    only = dict(pp=1, tp=1, microbatch=8, s_g=1, s_os=1)
    res = search(gm, cl, batch=64, only=only, keep=50)
    none = next(c for c in res.ranked if not c.recompute)
    every = next(c for c in res.ranked if c.recompute and not c.recomputed)
    return cl, only, none, every


def test_selective_recomputation_keeps_what_the_runtime_keeps(gpt):
    """``recompute="selective"``: each recomputed unit keeps its input and what selective
    recomputation keeps of it (``sel_act``: its GEMMs' and attention's outputs), by hand as
    above; the same bytes the memory model finds on the graph
    (``recompute_memory(granularity="selective")``, itself checked against the runtime in
    tests/test_cost_memory.py); between none and full in memory, between them in step (its
    backward re-runs only what it does not keep). The plan's configuration carries it."""
    from fxpar.cost.memory import recompute_memory

    model, gm = gpt
    cl, only, none, every = _none_and_every(gm)
    sel = search(gm, cl, batch=64, only=dict(only, recompute="selective")).best
    assert sel.recompute and sel.granularity == "selective" and "recompute(selective)" in sel.name
    us, _ = unit_costs(gm, fxpar.Mesh(cl, dp=1))
    rec = [i for i, u in enumerate(us) if not u.layer.startswith("(")]
    I_ = [us[i - 1].out if i else 0.0 for i in range(len(us))]
    states = model_state_bytes(sum(u.params for u in us)).total
    tmp = 2 * 25 * 2**20 + 8 * max(u.act for u in us)
    kept = sum(I_[i] + u.sel_act if i in rec else u.act for i, u in enumerate(us))
    assert sel.memory == pytest.approx(states + tmp + 8 * kept + 8 * max(us[i].act for i in rec), rel=1e-9)
    blocks = [i for i in rec if us[i].layer.startswith("blocks.")]
    graph = recompute_memory(gm, [us[i].layer for i in blocks], granularity="selective").stash_bytes
    full_graph = recompute_memory(gm, [us[i].layer for i in blocks]).stash_bytes
    assert sum(us[i].sel_act for i in blocks) == pytest.approx(graph - full_graph, rel=0.02)
    assert every.memory < sel.memory < none.memory and none.step < sel.step < every.step
    x = torch.randint(0, 64, (64, 16))
    cfg = fxpar.plan(model, cl, (x,), plan=dict(only, recompute="selective")).plan.config
    assert cfg.recompute_granularity == "selective" and cfg.recompute
    assert fxpar.config.ParallelConfig.from_dict(cfg.to_dict()) == cfg


def test_partial_recomputation_is_the_cheapest_subset_that_fits(gpt):
    """Under a budget between recomputing every layer and none, the search recomputes some
    units: its memory is the formula by hand (no recomputation, less ``Σ(A_u − I_u)`` of the
    chosen units, plus the largest chosen ``A_u`` rebuilt), it fits, its extra forward is the
    cheapest over every subset of the named units that fits (brute force), and it is faster
    than recomputing everything. The plan lists exactly those layers for the runner."""
    model, gm = gpt
    cl, only, none, every = _none_and_every(gm)
    budget = (none.memory + every.memory) / 2
    opts = fxpar.planner.PlannerOptions(memory_budget=budget)
    best = search(gm, cl, batch=64, only=only, options=opts).best
    assert best.recompute and best.recomputed and best.step < every.step
    us, _ = unit_costs(gm, fxpar.Mesh(cl, dp=1))
    A = [8 * u.act for u in us]
    I_ = [8 * us[i - 1].out if i else 0.0 for i in range(len(us))]
    F = [8 * u.fwd + u.fwd_fixed for u in us]

    def memory(sub):
        return none.memory - sum(A[i] - I_[i] for i in sub) + (max(A[i] for i in sub) if sub else 0)
    assert best.memory == pytest.approx(memory(best.recomputed), rel=1e-9)
    assert best.memory <= budget
    named = [i for i, u in enumerate(us) if not u.layer.startswith("(")]
    fits = [sub for k in range(len(named) + 1) for sub in itertools.combinations(named, k)
            if memory(sub) <= budget]
    assert sum(F[i] for i in best.recomputed) == pytest.approx(min(sum(F[i] for i in sub)
                                                                   for sub in fits), rel=1e-9)
    x = torch.randint(0, 64, (64, 16))
    plan = fxpar.plan(model, cl, (x,), plan=only, memory_budget=budget).plan
    assert plan.config.recompute == {us[i].layer for i in best.recomputed}


def test_spmd_recomputation_reaches_the_runner(gpt):
    """A one-step (SPMD) configuration with recomputation writes the layers it priced into
    the plan, and the runner recomputes them (it used to train without, over the priced
    memory): every block, the embeddings and the head."""
    from fxpar.runtime.recompute import known_layers
    from fxpar.runtime.runner import recompute_layers

    model, _ = gpt
    x = torch.randint(0, 64, (8, 16))
    tup = dict(pp=1, tp=1, microbatch=4, s_g=1, s_os=1)
    prog = fxpar.compile(model, fxpar.Cluster.local(2), (x,), plan=dict(tup, recompute=True))
    layers = prog.plan.config.recompute
    assert {f"blocks.{i}" for i in range(4)} | {"head"} <= set(layers), layers
    assert recompute_layers(prog, None, known_layers(prog.rank_graph(0))) == frozenset(layers)
    plain = fxpar.compile(model, fxpar.Cluster.local(2), (x,), plan=dict(tup, recompute=False))
    assert plain.plan.config.recompute == frozenset()


_PLAN_IN_A_PROCESS = """
import torch, fxpar
from examples.models import GPT
m = GPT(vocab=64, d_model=64, n_heads=2, n_layers=4, seq_len=16)
x = torch.zeros(32, 16, dtype=torch.long)
print(fxpar.plan(m, fxpar.Cluster.preset("dgx-a100", nodes=2), (x,)).plan.hash)
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_joint_plan_is_the_same_in_another_process():
    """The joint search and the winner's plan do not depend on the process (string hashing,
    allocation addresses): every rank plans alone and must agree."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONHASHSEED="12345", PYTHONPATH=str(root))
    out = subprocess.run([sys.executable, "-c", _PLAN_IN_A_PROCESS], capture_output=True,
                         text=True, env=env, cwd=root, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    from examples.models import GPT

    m = GPT(vocab=64, d_model=64, n_heads=2, n_layers=4, seq_len=16)
    here = fxpar.plan(m, fxpar.Cluster.preset("dgx-a100", nodes=2),
                      (torch.zeros(32, 16, dtype=torch.long),)).plan
    assert out.stdout.strip().splitlines()[-1] == here.hash


def test_partial_sharding_inside_a_node_is_amsp_priced(gpt):
    """AMSP's partial sharding on 2 nodes of 8 (d = 16 replicas, 8 per node): optimizer
    states over a node's 8 (its LLaMA-7B choice, (1, 1, 8)) keep 12/8 bytes per parameter,
    and its data-parallel time is AMSP's terms for that sharding on a (8, 2) grid, by hand."""
    from fxpar.cost import amsp

    _, gm = gpt
    cl = fxpar.Cluster.preset("dgx-a100", nodes=2)
    res = search(gm, cl, batch=16, only=dict(pp=1, tp=1, microbatch=1), keep=50)
    got = {(c.s_p, c.s_g, c.s_os) for c in res.ranked if not c.recompute}
    assert {(1, 1, 8), (1, 8, 8)} <= got
    c = next(x for x in res.ranked if (x.s_p, x.s_g, x.s_os) == (1, 1, 8) and not x.recompute)
    us, _ = unit_costs(gm, fxpar.Mesh(cl, dp=1))
    phi = sum(u.params for u in us)
    tmp = 2 * 25 * 2**20 + max(u.act for u in us)
    assert c.memory == pytest.approx(model_state_bytes(phi, s_os=8).total + tmp
                                     + sum(u.act for u in us), rel=1e-9)
    L, P, kw = sum(u.params > 0 for u in us), round(phi), dict(dp=(8, 2))
    U = _bucket(P, 1)
    sh = amsp.Sharding((1, 1), (1, 1), (8, 1))
    want = (amsp.t_p(sh, [P / L], L, 1, cl, **kw) + amsp.t_g(sh, P, 1, U, cl, **kw)
            + amsp.t_os0(sh, P, U, cl, **kw) + _os_gather(sh, P, cl, **kw))
    assert want > 0 and c.dp_comm == pytest.approx(want, rel=1e-9)


@pytest.mark.slow
def test_amsp_baseline_is_the_search_with_tp_and_pp_one(gpt):
    """plan="amsp" (AMSP's own program: TP = PP = 1 over every device, its state sharding
    searched) is the joint search's best among the configurations with tp = pp = 1: checked
    against every such candidate the search prices (its ranked list with keep=all), and
    ``auto``, which searches a superset under the same model, is never slower. Under a budget
    that DDP's replicated states exceed, AMSP shards them."""
    from fxpar.planner.joint import _rank_key

    model, gm = gpt   # gm: the model captured with one sample, as the search's probe
    cl = fxpar.Cluster.preset("dgx-a100", nodes=2)
    x = torch.randint(0, 64, (32, 16))
    a = fxpar.plan(model, cl, (x,), plan="amsp").plan
    assert a.kind == "amsp" and not a.stages
    axes = dict(zip(a.mesh["axis_names"], a.mesh["shape"]))   # dp (x dp_shard under HSDP)
    assert axes["tp"] == 1 and axes["dp"] * axes.get("dp_shard", 1) == 16, axes
    every = search(gm, cl, batch=32, keep=10**6).ranked   # every candidate, simulated
    flat = [c for c in every if c.tp == 1 and c.pp == 1]
    best = min(flat, key=_rank_key)
    assert a.schedule["search"]["ranked"][0]["name"] == best.name
    assert fxpar.plan(model, cl, (x,)).plan.time <= a.time * (1 + 1e-9)
    ddp = min(c.memory for c in flat if (c.s_p, c.s_g, c.s_os) == (1, 1, 1))
    sharded = min(c.memory for c in flat if c.s_os > 1)
    assert sharded < ddp
    tight = fxpar.plan(model, cl, (x,), plan="amsp", memory_budget=(sharded + ddp) / 2).plan
    assert tight.config.s_os > 1
    with pytest.raises(PlanError, match="no mesh or graph"):
        fxpar.plan(model, cl, (x,), plan="amsp", mesh={"dp": 16})


@pytest.mark.slow
def test_alpa_baseline_chooses_placement_agnostic_and_is_priced_for_real(gpt):
    """plan="alpa": the configuration is the search's best under the placement-agnostic view
    of the cluster (one node, every link the inter-node figures) with replicated states; the
    plan is then priced on the real cluster, where ``auto`` (same search, true costs) is never
    slower."""
    from fxpar.planner.joint import _rank_key

    model, gm = gpt
    cl = fxpar.Cluster.preset("dgx-a100", nodes=2)
    agn = cl.placement_agnostic()
    assert agn.num_devices == cl.num_devices and agn.nodes == 1
    assert agn.intra_node_bandwidth == cl.inter_node_bandwidth   # 200 GB/s < NVLink's 300
    x = torch.randint(0, 64, (32, 16))
    a = fxpar.plan(model, cl, (x,), plan="alpa").plan
    assert a.kind == "alpa" and any("placement-agnostic" in n for n in a.notes)
    every = search(gm, agn, batch=32, keep=10**6, only=dict(s_p=1, s_g=1, s_os=1),
                   tps=(1, 2, 4, 8)).ranked   # the real cluster's degrees (tp inside a node)
    assert a.schedule["search"]["ranked"][0]["name"] == min(every, key=_rank_key).name
    assert a.config.state == (1, 1, 1)
    # realized auto never slower than realized alpa, on a model wide enough for its GEMMs to
    # be compute-bound at one sample: there the search's probe scales to the realized plans
    # within 2% (tests/test_step.py); this toy's per-op costs do not scale with the batch
    # (its search is 10-20% off its realized plans, so its ranking is not the realized one)
    from examples.models import GPT

    torch.manual_seed(0)
    wide = GPT(vocab=512, d_model=1024, n_heads=8, n_layers=4, seq_len=512)
    xw = torch.randint(0, 512, (32, 512))
    aw = fxpar.plan(wide, cl, (xw,), plan="alpa").plan
    assert fxpar.plan(wide, cl, (xw,)).plan.time <= aw.time * 1.02


@pytest.mark.slow
def test_every_schedule_has_candidates_simulated(gpt):
    """The estimate that preselects candidates for simulation is 1F1B's bubble (zb-h1's and
    eager-1F1B's are smaller), so besides the overall top ``keep`` each schedule's best
    estimates are simulated: with keep=1, every schedule that has a fitting candidate is
    still in the ranked (simulated) list, as in the exhaustive one."""
    from fxpar.planner.joint import PER_SCHEDULE

    _, gm = gpt
    cl = fxpar.Cluster.preset("dgx-a100", nodes=2)
    few = search(gm, cl, batch=32, keep=1).ranked
    every = search(gm, cl, batch=32, keep=10**6).ranked
    scheds = {c.schedule for c in every}
    assert len(scheds) > 1 and {c.schedule for c in few} == scheds
    assert len(few) <= 1 + PER_SCHEDULE * len(scheds) < len(every)


def test_context_parallel_is_searched_and_explained():
    """``cp`` degrees are searched for long sequences (from CP_MIN_SEQ tokens; here given
    explicitly for 4096) beside the others: every one tried is either in the ranking's reason
    with its gap to the winner or named as not fitting; a configuration with cp prices its
    parameters as replicated over cp (the same local parameter count as without) and its
    activations split along the sequence (less memory per device at the same microbatch)."""
    from examples.models import GPT
    from fxpar.planner import joint

    with torch.device("meta"):
        model = GPT(vocab=512, d_model=1024, n_heads=8, n_layers=2, seq_len=4096).to(torch.bfloat16)
    gm = fxpar.capture(model, (torch.zeros(1, 4096, dtype=torch.long, device="meta"),))
    assert joint.cp_degrees(gm, 8)[0] == [1]
    assert joint.cp_degrees(gm, 8, min_seq=4096)[0] == [1, 2, 4, 8]
    res = search(gm, fxpar.Cluster.preset("dgx-a100"), batch=8, cps=(1, 2, 4), pps=(1,), tps=(1,))
    other = {c for c in (1, 2, 4) if c != res.best.cp}
    assert all(f"cp={c}:" in res.cp for c in other), res.cp
    t1, t4 = res.tables[1, 1], res.tables[1, 4]
    assert sum(u.params for u in t4) == sum(u.params for u in t1)
    assert sum(u.act for u in t4) < sum(u.act for u in t1) / 2
    fixed = search(gm, fxpar.Cluster.preset("dgx-a100"), batch=8, only={"cp": 2, "pp": 1, "tp": 1})
    assert fixed.best.cp == 2 and fixed.cp == "context parallelism: cp=2, as the user tuple says"
    # a user's cp that cannot split the sequence or the devices is refused, naming what works
    with pytest.raises(PlanError, match=r"cp=3 must divide the 8 devices .* cp ∈ \[1, 2, 4, 8\]"):
        search(gm, fxpar.Cluster.preset("dgx-a100"), batch=8, only={"cp": 3})
    with pytest.raises(PlanError, match="s_p=2 with cp=2"):
        search(gm, fxpar.Cluster.preset("dgx-a100"), batch=8, only={"cp": 2, "s_p": 2})
