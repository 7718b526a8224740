"""fxpar.cost.amsp: group layouts, T_p / T_g / T_os0 / T_os1 by hand from the ring formulas,
the constraint set (eq. 3–7), and the exact planner against brute force."""

import itertools

import pytest

from fxpar import Cluster
from fxpar.cost.amsp import (
    Sharding,
    evaluate,
    feasible_shardings,
    model_state_memory,
    named_sharding,
    plan,
    sharding_groups,
    t_g,
    t_os0,
    t_os1,
    t_p,
)

# a800: 8 GPUs/node, NVLink 200 GB/s (α 3 µs), 4×200 Gb/s HDR = 100 GB/s per node (α 8 µs)
A800 = dict(bi=200e9, be=100e9, ai=3e-6, ae=8e-6)


def test_group_layouts():
    # P over 4 consecutive local ranks of each node of 8
    assert sharding_groups(8, 2, (4, 1))[:2] == ((0, 1, 2, 3), (4, 5, 6, 7))
    # P over a whole node and 2 consecutive nodes (AMSP §V-D: neighbours under one leaf)
    assert sharding_groups(2, 4, (2, 2)) == ((0, 1, 2, 3), (4, 5, 6, 7))
    # the replicas of a P shard of 2 inside an OS group of 8: same offset modulo 2
    assert sharding_groups(8, 1, (8, 1), (2, 1)) == ((0, 2, 4, 6), (1, 3, 5, 7))
    # data-parallel all-reduce of a node-sharded P across 2 nodes: (i, i+8)
    assert sharding_groups(8, 2, (8, 2), (8, 1)) == tuple((i, i + 8) for i in range(8))


def test_four_terms_by_hand():
    c = Cluster.preset("a800", physics=None, nodes=2)
    phi_mods, L, M, U = [3e6, 5e6], 2, 4, 4e6
    phi = L * sum(phi_mods)
    sh = Sharding(p=(8, 1), g=(8, 1), os=(8, 2))
    a = A800
    # T_p: AG of 2Φ_i over the 8 GPUs of a node (input shard 2Φ_i/8), RS of 2Φ_i; both rings
    # (one per node) stay inside their node
    per = sum(2 * 7 * (a["ai"] + (2 * f / 8) / a["bi"]) + 7 * (a["ai"] + 2 * f / (8 * a["bi"])) for f in phi_mods)
    assert t_p(sh, phi_mods, L, M, c) == pytest.approx(M * L * per)
    assert t_g(sh, phi, M, U, c) == 0.0  # s_g = s_p
    # T_os0: 2Φ/(U·s_p) buckets, each an AR over the 2 replicas (i, i+8); 8 such rings leave
    # every node at once → β_inter / 8
    be8 = a["be"] / 8
    assert t_os0(sh, phi, U, c) == pytest.approx((2 * phi / (U * 8)) * 2 * (a["ae"] + U / (2 * be8)))
    # T_os1: s_os/s_p = 2 broadcasts of 2Φ/s_os over (i, i+8), 8 rings per node
    assert t_os1(sh, phi, c) == pytest.approx(2 * (a["ae"] + (2 * phi / 16) / be8))
    r = evaluate(sh, phi=phi, module_params=phi_mods, L=L, M=M, U=U, cluster=c)
    assert r.time == pytest.approx(r.t_p + r.t_g + r.t_os0 + r.t_os1)
    assert r.memory == 2 * phi / 8 + 2 * phi / 8 + 12 * phi / 16


def test_gradient_sharding_term_by_hand():
    """s_p = 2, s_g = 8 (one node): every microbatch but the last, 2Φ/(U·s_p) bucket
    all-reduces over the 4 GPUs sharing a P shard: (0, 2, 4, 6) and (1, 3, 5, 7)."""
    c = Cluster.preset("a800", physics=None, nodes=1)
    phi, M, U = 1e8, 3, 1e7
    sh = Sharding(p=(2, 1), g=(8, 1), os=(8, 1))
    expected = (M - 1) * (2 * phi / (U * 2)) * 6 * (A800["ai"] + U / (4 * A800["bi"]))
    assert t_g(sh, phi, M, U, c) == pytest.approx(expected)
    assert t_g(sh, phi, 1, U, c) == 0.0  # one microbatch: nothing to accumulate


def _divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


@pytest.mark.parametrize("R, N", [(8, 1), (8, 4), (4, 6)])
def test_feasible_set_is_eq3_to_eq7(R, N):
    got = set(feasible_shardings(R, N, grad_rule=False))
    want = set()
    for p0, g0, o0 in itertools.product(_divisors(R), repeat=3):
        for p1, g1, o1 in itertools.product(_divisors(N), repeat=3):
            if not (p0 <= g0 <= o0 <= R and p1 <= g1 <= o1 <= N):        # eq. 3, 4
                continue
            if g0 % p0 or o0 % g0 or g1 % p1 or o1 % g1:                   # ratio groups exist
                continue
            if any(x1 > 1 and x0 != R for x0, x1 in ((p0, p1), (g0, g1), (o0, o1))):  # eq. 7
                continue
            want.add(Sharding((p0, p1), (g0, g1), (o0, o1)))
    assert got == want
    with_rule = set(feasible_shardings(R, N))
    assert with_rule == {s for s in want if s.g in (s.p, s.os)}          # §IV-C3


def test_plan_is_exact_minimum_under_memory():
    c = Cluster.preset("a800", physics=None, nodes=4)
    kw = dict(phi=7e9, module_params=[7e9 / 32 / 9] * 9, L=32, M=8, U=5e8, cluster=c)
    limit = 60e9
    ranked = plan(memory_limit=limit, activation_bytes=10e9, **kw)
    brute = [evaluate(s, **kw) for s in feasible_shardings(8, 4)]
    fits = [r for r in brute if r.memory + 10e9 <= limit]
    assert len(ranked) == len(fits) > 0
    assert ranked[0].time == min(r.time for r in fits)
    assert all(r.memory + 10e9 <= limit for r in ranked)
    # 16Φ = 112 GB: plain data parallelism does not fit, some state must be sharded
    assert ranked[0].sharding != Sharding()
    # with ample memory nothing is sharded: only the one data-parallel all-reduce remains
    free = plan(memory_limit=1e15, **kw)[0]
    assert free.sharding == Sharding() and free.t_p == free.t_g == free.t_os1 == 0
    assert plan(memory_limit=1e9, **kw) == []


def test_llama7b_on_one_a800_node():
    """LLaMA-7B with ~18 GB of activations on 8 × 80 GB: parameters stay replicated (no
    per-microbatch all-gathers), only optimizer states are sharded inside the node."""
    H, FFN, L, V = 4096, 11008, 32, 32000
    mods = [H * H] * 4 + [H * FFN] * 3 + [H, H]
    phi = L * sum(mods) + 2 * V * H + H
    c = Cluster.preset("a800", physics=None, nodes=1)
    best = plan(phi=phi, module_params=mods, L=L, M=128, U=5e8, cluster=c, activation_bytes=18e9)[0]
    assert best.sharding.p == (1, 1) and best.sharding.g == (1, 1) and best.sharding.os[0] > 1
    assert best.memory + 18e9 <= c.device_memory


def test_named_baselines():
    assert named_sharding("zero3", 8, 4) == Sharding((8, 4), (8, 4), (8, 4))
    assert named_sharding("zero2", 8, 4) == Sharding((1, 1), (8, 4), (8, 4))
    assert named_sharding("mics", 8, 4, group_nodes=2) == Sharding((8, 2), (8, 2), (8, 2))
    assert model_state_memory(1e9, named_sharding("zero3", 8, 4)) == 16e9 / 32
    with pytest.raises(ValueError):
        named_sharding("zero4", 8, 4)
