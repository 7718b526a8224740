"""Cluster physics (issue #24 item 3): GEMM tile quantization, attention and memory
efficiency, bus-bandwidth efficiency per network level, fixed costs per kernel and per
microbatch. Every number is checked against its closed form, written out here."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import fxpar
from fxpar.cluster import PHYSICS_SOURCES, ClusterError, ComputeProfile, Physics
from fxpar.cost.comm import collective_time, link_bandwidth
from fxpar.cost.compute import OpCost, TensorArg, gemm_efficiency, op_cost, op_time
from fxpar.cost.step import UnitCost, chunk_costs

PH = Physics(gemm_tile=(128, 256), gemm_efficiency=0.9)


def _brute(n, ph):
    """Every column tile the kernel may pick (256, 128, 64 wide), by enumeration: padding to
    whole tiles times the tile's operand reuse relative to the preset's 128 x 256."""
    full = 128 * 256 / (128 + 256)
    return ph.gemm_efficiency * max(min(1.0, 128 * tn / (128 + tn) / full) * n / (math.ceil(n / tn) * tn)
                                    for tn in (256, 128, 64))


@pytest.mark.parametrize("n", [256, 512, 257, 100, 64, 1, 2304 * 3 // 8, 4096 + 64])
def test_gemm_efficiency_is_tile_quantization_of_the_columns(n):
    assert gemm_efficiency((3, 1000, n, 77), PH) == pytest.approx(_brute(n, PH))


def test_whole_tiles_reach_the_saturated_fraction_and_rows_are_linear():
    assert gemm_efficiency((1, 1280, 1024), PH) == pytest.approx(0.9)
    assert gemm_efficiency((1, 1281, 1024), PH) == gemm_efficiency((7, 5, 1024), PH) == pytest.approx(0.9)
    # tensor parallelism that cuts the columns off the tile grid pays for the padding
    assert gemm_efficiency((1, 4096, 3 * 2304 // 8), PH) < 0.9 * 0.95


def test_op_time_is_the_roofline_at_the_ops_efficiency():
    c = fxpar.Cluster.preset("dgx-a100")
    ph = c.physics
    x = TensorArg((4, 2048, 4096), torch.bfloat16, requires_grad=True)
    w = TensorArg((12288, 4096), torch.bfloat16, requires_grad=True)
    cost = op_cost(torch.ops.aten.linear.default, (x, w), out=TensorArg((4, 2048, 12288), torch.bfloat16))
    assert cost.gemm == (1, 8192, 12288, 4096)
    f, b = op_time(cost, c)
    ef = gemm_efficiency((1, 8192, 12288), ph)
    eb = (gemm_efficiency((1, 8192, 4096), ph) + gemm_efficiency((1, 4096, 12288), ph)) / 2
    assert ef == eb == pytest.approx(ph.gemm_efficiency)   # whole 128-wide tiles
    assert f == pytest.approx(max(cost.fwd_flops / (312e12 * ef),
                                  cost.fwd_bytes / (c.memory_bandwidth * ph.memory_efficiency))
                              + ph.kernel_overhead)
    assert b == pytest.approx(cost.bwd_flops / (312e12 * eb) + ph.kernel_overhead)
    # attention at its own efficiency; an elementwise op by its bytes
    att = OpCost(1e12, 2e12, 1e6, 2e6, "attention")
    assert op_time(att, c)[0] == pytest.approx(1e12 / (312e12 * ph.attention_efficiency) + ph.kernel_overhead)
    add = OpCost(1e6, 0.0, 6e8, 0.0, "pointwise")
    assert op_time(add, c) == pytest.approx((6e8 / (c.memory_bandwidth * ph.memory_efficiency)
                                             + ph.kernel_overhead, 0.0))
    # without physics: the flat roofline of PlannerOptions.efficiency, as before
    flat = fxpar.Cluster.preset("dgx-a100", physics=None)
    assert op_time(cost, flat, 0.5)[0] == pytest.approx(cost.fwd_flops / (312e12 * 0.5))


def test_a_calibrated_profile_replaces_the_compute_physics():
    prof = ComputeProfile(gemm=((1e3, 1e9), (1e12, 1e9)), memory=((1e3, 1e9), (1e12, 1e9)),
                          op_overhead=0.0, bwd_op_overhead=0.0)
    c = fxpar.Cluster.preset("dgx-a100", compute=prof)
    assert op_time(OpCost(1e9, 0, 0, 0, "matmul", gemm=(1, 64, 64, 64)), c)[0] == pytest.approx(1.0)


def test_collectives_run_at_the_levels_bus_bandwidth():
    c = fxpar.Cluster.preset("dgx-a100", nodes=2)
    ph = c.physics
    assert link_bandwidth(c, "intra") == pytest.approx(300e9 * ph.intra_comm_efficiency)
    assert link_bandwidth(c, "inter") == pytest.approx(200e9 * ph.inter_comm_efficiency)
    # one node: ring all-reduce of 1 GB over 8, 14 steps of 3 µs
    t = collective_time("all_reduce", 1e9, range(8), c)
    assert t == pytest.approx(14 * 3e-6 + 2 * 7 / 8 * 1e9 / (300e9 * ph.intra_comm_efficiency))
    # 8 rings cross the node boundary at once: each gets 1/8 of the node's bus bandwidth
    groups = [(i, i + 8) for i in range(8)]
    t = collective_time("all_gather", 1e8, (0, 8), c, concurrent=groups)
    assert t == pytest.approx(8e-6 + 1e8 / (200e9 * ph.inter_comm_efficiency / 8))


def test_every_preset_has_physics_with_its_sources_and_json_round_trips():
    assert set(PHYSICS_SOURCES) == set(fxpar.Cluster.preset_names())
    for name in fxpar.Cluster.preset_names():
        c = fxpar.Cluster.preset(name, nodes=2)
        assert c.physics is not None and PHYSICS_SOURCES[name]
        assert fxpar.Cluster.from_json(c.to_json()) == c
    assert fxpar.Cluster.local(2).physics is None
    with pytest.raises(ClusterError, match="gemm_efficiency"):
        Physics(gemm_efficiency=1.5)
    with pytest.raises(ClusterError, match="gemm_tile"):
        Physics(gemm_tile=(0, 128))


def test_microbatch_overhead_is_paid_per_action_not_scaled():
    u = UnitCost("l", "x", fwd=1.0, bwd=2.0, fwd_fixed=0.0, bwd_fixed=0.0, act=0.0, params=0.0,
                 out=0.0, fwd_lat=0.25, bwd_lat=0.5)
    plain = chunk_costs([u, u], (0,), scale=0.5)[0]
    # the fixed part (fwd_lat) is not halved: (1 - 0.25)·0.5 + 0.25 per unit
    assert plain.fwd == pytest.approx(2 * (0.75 * 0.5 + 0.25))
    assert plain.bwd == pytest.approx(2 * (1.5 * 0.5 + 0.5))
    over = chunk_costs([u, u], (0,), scale=0.5, overhead=0.1)[0]
    assert over.fwd == pytest.approx(plain.fwd + 0.1) and over.bwd == pytest.approx(plain.bwd + 0.1)
    assert over.unit_fwd[0] == pytest.approx(plain.unit_fwd[0] + 0.1)   # the pass's first unit
    assert over.unit_bwd[-1] == pytest.approx(plain.unit_bwd[-1] + 0.1)


def test_per_op_fixed_costs_do_not_shrink_with_the_microbatch():
    """A plan's units carry their ops' fixed costs (kernel launches, dispatch) in
    ``fwd_lat``/``bwd_lat``: a smaller microbatch does not make them cheaper."""
    from examples.models import MLP

    prof = ComputeProfile(gemm=((1e3, 1e10), (1e12, 1e10)), memory=((1e3, 1e10), (1e12, 1e10)),
                          op_overhead=1e-3, bwd_op_overhead=2e-3)
    c = fxpar.Cluster.local(2, compute=prof)
    model = MLP(64, 256, 64)
    p = fxpar.plan(model, c, (torch.randn(8, 64),), mesh={"dp": 2}, plan="dp").plan
    # per kernel dispatched and per backward node (torch's autograd, not fxpar's counting):
    # a linear of a 2-D input dispatches t and addmm and runs TBackward0 and AddmmBackward0,
    # the GELU one of each; every parameter's AccumulateGrad is a backward node too, and adds
    # its gradient into its bucket's (two reads and a write of its 4-byte elements at the
    # memory curve's 10 GB/s: cost.compute.accumulate_time), whatever the microbatch
    params = 2 * 64 * 256 + 256 + 64
    assert sum(u.fwd_lat for u in p.units) == pytest.approx(5e-3)
    assert sum(u.bwd_lat for u in p.units) == pytest.approx(5 * 2e-3 + 4 * 2e-3
                                                            + 3 * 4 * params / 1e10)
    for u in p.units:
        assert u.forward(0.25) >= u.fwd_lat
    # on an asynchronous (CUDA) profile the host's overheads hide behind the kernels, the
    # accumulation is a kernel of its own: it alone stays
    g = fxpar.Cluster.local(2, compute=dataclasses.replace(prof, asynchronous=True))
    q = fxpar.plan(model, g, (torch.randn(8, 64),), mesh={"dp": 2}, plan="dp").plan
    assert sum(u.fwd_lat for u in q.units) == 0.0
    assert sum(u.bwd_lat for u in q.units) == pytest.approx(3 * 4 * params / 1e10)


def test_per_microbatch_costs_make_many_microbatches_dearer():
    """With a fixed cost per pipeline action the search no longer finds more microbatches
    always cheaper (issue #24: pipeline predictions anti-correlated with measurements)."""
    from examples.models import GPT

    gm = fxpar.capture(GPT(vocab=64, d_model=32, n_heads=2, n_layers=4, seq_len=16),
                       (torch.randint(0, 64, (1, 16)),))
    base = fxpar.Cluster.preset("dgx-a100")
    slow = dataclasses.replace(base, physics=dataclasses.replace(base.physics, microbatch_overhead=1e-3))
    from fxpar.planner.joint import search

    only = dict(pp=2, dp=4, tp=1, schedule="1f1b")
    steps = {m: search(gm, slow, batch=32, only={**only, "microbatch": 8 // m}).best
             for m in (1, 8)}
    assert steps[1].microbatches == 1 and steps[8].microbatches == 8
    # (m + p - 1) forward and backward actions of 1 ms each on the critical path: 4 ms at
    # m = 1, 18 ms at m = 8, far above what the smaller bubble saves
    assert steps[8].step > steps[1].step + 10e-3


def test_math_attention_is_sdpa_with_the_scores_through_memory():
    """``GPT(attention="math")`` (Megatron-LM's attention before flash kernels, used by the
    published-figures benchmark for its 2021 rows) computes what SDPA does, and its price
    carries the ``s × s`` scores through memory, which fused SDPA's does not."""
    from examples.models import GPT
    from fxpar.cost.compute import graph_cost

    torch.manual_seed(0)
    fused = GPT(vocab=64, d_model=32, n_heads=4, n_layers=2, seq_len=128)
    math_ = GPT(vocab=64, d_model=32, n_heads=4, n_layers=2, seq_len=128, attention="math")
    math_.load_state_dict(fused.state_dict())
    x = torch.randint(0, 64, (2, 128))
    torch.testing.assert_close(math_(x), fused(x), rtol=1e-5, atol=1e-5)
    costs = [graph_cost(fxpar.capture(m, (x,))) for m in (fused, math_)]
    scores = 2 * 4 * 128 * 128 * 4   # batch x heads x s x s, float32, per layer
    assert costs[1].total_bytes - costs[0].total_bytes > 2 * 2 * scores  # 2 layers, >1 pass each
    assert costs[1].gemm_flops == pytest.approx(costs[0].gemm_flops, rel=0.01)


def test_the_optimizer_step_is_priced_memory_bound_from_the_physics():
    """Without a measured price, a preset's physics prices the optimizer step: every state
    read and written, the gradient read, the parameter written, at ``memory_efficiency`` of
    the memory bandwidth, one kernel per tensor; mixed-precision AdamW moves 28 bytes an
    element (fp32 master, m, v: 2 × 12; bf16 gradient and parameter: 2 + 2)."""
    from examples.models import MLP

    model = MLP(64, 256, 64)
    n = sum(p.numel() for p in model.parameters())
    c = fxpar.Cluster.preset("dgx-a100")
    ph = c.physics
    p = fxpar.plan(model, c, (torch.randn(8, 64),), mesh={"dp": 8}, plan="dp").plan
    want = 4 * ph.kernel_overhead + 28 * n / (c.memory_bandwidth * ph.memory_efficiency)
    ov = p.overlap()
    fwd_bwd = sum(x.fwd_time + x.bwd_time for x in p.nodes if x.op != "placeholder")
    assert ov.compute - fwd_bwd == pytest.approx(want, rel=1e-9)
    # the flat roofline (no physics) prices no optimizer step
    q = fxpar.plan(model, dataclasses.replace(c, physics=None), (torch.randn(8, 64),),
                   mesh={"dp": 8}, plan="dp").plan
    assert q.overlap().compute == pytest.approx(
        sum(x.fwd_time + x.bwd_time for x in q.nodes if x.op != "placeholder"), rel=1e-9)


@pytest.mark.parametrize("sigma", [1.0, 1.5, 3.0])
def test_split_backward_prices_both_halves(sigma):
    """zb-h1, 2 stages, 1 microbatch, forward 1 s and backward 2 s per chunk: rank 1 runs
    ``F1 [1, 2]``, ``I1 [2, 2 + σ]``, ``W1`` (σ s) after it; rank 0's ``I0`` is its whole
    backward (2 s) after ``I1``; the step is ``max(4 + σ, 2 + 2σ)``."""
    from fxpar.cost.step import DpTerms, step_time
    from fxpar.schedule import Schedule

    u = UnitCost("l", "x", 1.0, 2.0, 0.0, 0.0, 0.0, 1.0, 0.0)
    ch = chunk_costs([u, u], (0, 1))
    sched = Schedule.build("zb-h1", stages=2, microbatches=1)
    got = step_time(sched, ch, lambda k: (0.0, 0.0), [DpTerms(), DpTerms()], split=sigma).step
    assert got == pytest.approx(max(4 + sigma, 2 + 2 * sigma))


def test_split_backward_must_not_make_the_split_cheaper():
    assert Physics(split_backward=1.7) == Physics.from_dict(Physics(split_backward=1.7).to_dict())
    with pytest.raises(ClusterError, match="split_backward"):
        Physics(split_backward=0.9)
