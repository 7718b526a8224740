"""fxpar.cost.comm: ring formulas, placement-aware bandwidth (AxoNN eq. 10 and beyond),
leaf-spine level, placement-agnostic variant, calibrated profiles; property tests.

Every expected number is worked out by hand in the test from the formulas, not by calling
the function under test."""

import dataclasses
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fxpar import Cluster, Mesh
from fxpar.cluster import Profile, ProfileEntry
from fxpar.cost.comm import (
    COLLECTIVES,
    axis_bandwidth,
    axis_collective_time,
    collective_time,
    group_bandwidth,
    group_latency,
    latency_steps,
    latency_time,
    ring_steps_and_factor,
)

GB = 1e9


def small(**kw):
    """2 nodes × 4 devices: β_intra 100 GB/s, β_inter 40 GB/s, α 1 µs / 5 µs."""
    f = dict(nodes=2, devices_per_node=4, intra_node_bandwidth=100 * GB, inter_node_bandwidth=40 * GB,
             intra_node_latency=1e-6, inter_node_latency=5e-6, device_memory=2**34, peak_flops=1e14,
             memory_bandwidth=1e12)
    f.update(kw)
    return Cluster(**f)


M = 1e6


@pytest.mark.parametrize("coll, group, expected", [
    # (G−1)·(α + m/β): 3·(1 µs + 1e6/1e11)
    ("all_gather", (0, 1, 2, 3), 3 * (1e-6 + M / 100e9)),
    # (G−1)·(α + m/(Gβ))
    ("reduce_scatter", (0, 1, 2, 3), 3 * (1e-6 + M / (4 * 100e9))),
    # 2(G−1)·(α + m/(Gβ))
    ("all_reduce", (0, 1, 2, 3), 6 * (1e-6 + M / (4 * 100e9))),
    # (G−1)·α + m/β
    ("broadcast", (0, 1, 2, 3), 3e-6 + M / 100e9),
    # α + m/β over the inter-node link
    ("send_recv", (0, 4), 5e-6 + M / 40e9),
    # one all-reduce over both nodes: each node boundary crossed by one ring → β_inter for the
    # ring's 2(G−1)/G·m; latency: a chain of 4 inside the node, a tree over 2 nodes, both ways:
    # 2·3·α_i + 2·⌈log2 2⌉·α_e (was the flat ring's 14·α_e = 70 µs)
    ("all_reduce", tuple(range(8)), 2 * 3 * 1e-6 + 2 * 1 * 5e-6 + 14 * M / (8 * 40e9)),
    # ring all-gather over both nodes: 7 hops, G−N = 6 inside a node, N−1 = 1 crossing
    ("all_gather", tuple(range(8)), 6 * 1e-6 + 1 * 5e-6 + 7 * M / 40e9),
    # all-to-all over both nodes: each node sends 4·4/8·m off-node at 40 GB/s
    ("all_to_all", tuple(range(8)), 7 * 5e-6 + max(7 / 8 * M / 100e9, 2 * M / 40e9)),
    ("all_gather", (3,), 0.0),
])
def test_ring_formulas(coll, group, expected):
    assert collective_time(coll, M, group, small()) == pytest.approx(expected, rel=1e-12)


def test_ring_steps_and_factor_are_axonn_eq_1_to_3():
    g = 8
    assert ring_steps_and_factor("all_gather", g) == (7, 7.0)          # eq. 1: (G−1)·m
    assert ring_steps_and_factor("reduce_scatter", g) == (7, 7 / 8)    # eq. 2: (G−1)/G·m
    assert ring_steps_and_factor("all_reduce", g) == (14, 14 / 8)      # eq. 3: 2(G−1)/G·m
    with pytest.raises(ValueError, match="unknown collective"):
        ring_steps_and_factor("gossip", 4)


def test_issue_example_eq10_16_devices_4_per_node():
    """(Gx, Gy, Gz, Gdata) = (2, 2, 2, 2) on 4 nodes × 4 (the issue's "8 devices" needs 16).

    Eq. 10 by hand: x: Π_{j≤x}=2 ≤ 4 → β_intra; y: Π_{j≤y}=4 ≤ 4 → β_intra;
    z: Π_{j≤z}=8 > 4 → β_inter/min(4, Π_{j<z}=4) = β_inter/4;
    data: Π=16 > 4 → β_inter/min(4, Π_{j<data}=8) = β_inter/4.
    """
    c = Cluster.preset("perlmutter", physics=None, nodes=4)
    mesh = Mesh(c, data=2, z=2, y=2, x=2)
    bi, be = c.intra_node_bandwidth, c.inter_node_bandwidth
    assert [axis_bandwidth(mesh, a) for a in ("x", "y", "z", "data")] == [bi, bi, be / 4, be / 4]
    # the same through explicit concurrent groups
    z_groups = mesh.groups("z")
    assert z_groups[0] == (0, 4)
    assert group_bandwidth((0, 4), c, concurrent=z_groups) == be / 4
    assert group_bandwidth((0, 4), c) == be  # alone it would get the whole NIC bandwidth


def test_axis_time_is_slowest_concurrent_group():
    c = Cluster.preset("perlmutter", physics=None, nodes=2)
    mesh = Mesh(c, dp=2, tp=4)
    groups = mesh.groups("dp")
    expected = max(collective_time("all_reduce", 1e8, g, c, concurrent=groups) for g in groups)
    assert axis_collective_time("all_reduce", 1e8, mesh, "dp") == expected
    # by hand: 4 dp rings cross each node → 100 GB/s / 4; 2 steps of 8 µs
    assert expected == pytest.approx(2 * 8e-6 + 2 * (1 / 2) * 1e8 / 25e9)
    assert axis_collective_time("all_reduce", 1e8, mesh.reshape(dp=1, tp=8), "dp") == 0.0


def test_innermost_axis_not_dividing_the_node():
    """6 devices per node, Mesh(dp=3, tp=4): tp group (4,5,6,7) straddles nodes 0 and 1.

    Eq. 10 would call tp intra-node (Π_{j≤tp}=4 ≤ 6); the general model sees one ring crossing
    each node boundary → β_inter for that group, so the axis runs at β_inter. dp groups
    (0,4,8), (1,5,9), (2,6,10), (3,7,11) all cross: 4 rings per node → β_inter/4 (= eq. 10).
    """
    c = small(devices_per_node=6, nodes=2)
    mesh = Mesh(c, dp=3, tp=4)
    assert mesh.groups("tp")[1] == (4, 5, 6, 7)
    assert axis_bandwidth(mesh, "tp") == 40 * GB
    assert axis_bandwidth(mesh, "dp") == 40 * GB / 4
    t = axis_collective_time("all_reduce", M, mesh, "tp")
    # the straddling group (2 + 2 members) is the slowest: 2·(2−1)·α_i + 2·⌈log2 2⌉·α_e
    # + 2·3/4·m/β_inter = 12 µs + 37.5 µs (the flat ring had 6·α_e = 30 µs of latency);
    # the intra groups: 6·α_i + 1.5·m/β_intra = 21 µs
    assert t == pytest.approx(2 * 1e-6 + 2 * 5e-6 + 6 * M / (4 * 40e9))


def test_leaf_spine_third_level():
    """4 nodes × 2 devices, 2 nodes per leaf switch, uplink 20 GB/s (AMSP §V-D)."""
    c = small(nodes=4, devices_per_node=2, nodes_per_switch=2, inter_switch_bandwidth=20 * GB)
    assert group_bandwidth(range(8), c) == 20 * GB          # one ring leaves each leaf once
    strided = [(0, 2, 4, 6), (1, 3, 5, 7)]                  # 2 rings per node and per leaf
    assert group_bandwidth(strided[0], c, concurrent=strided) == min(40 * GB / 2, 20 * GB / 2)
    in_leaf = [(0, 1, 2, 3), (4, 5, 6, 7)]                  # never leaves its leaf
    assert group_bandwidth(in_leaf[0], c, concurrent=in_leaf) == 40 * GB


def test_placement_agnostic_is_one_bandwidth():
    c = Cluster.preset("perlmutter", physics=None, nodes=4)
    mesh = Mesh(c, data=2, z=2, y=2, x=2)
    agn = {axis_bandwidth(mesh, a, placement_aware=False) for a in ("x", "y", "z", "data")}
    assert agn == {c.inter_node_bandwidth}
    assert group_latency((0, 1), c, placement_aware=False) == c.inter_node_latency
    one = Cluster.preset("perlmutter", physics=None, nodes=1)
    assert group_bandwidth((0, 1), one, placement_aware=False) == one.intra_node_bandwidth


def test_calibrated_profile_replaces_nominal_and_keeps_sharing():
    prof = Profile((ProfileEntry("all_reduce", "intra", 4, 1e-5, 1e9),
                    ProfileEntry("all_reduce", "inter", 2, 2e-5, 5e8)))
    c = small(profile=prof)
    assert collective_time("all_reduce", M, (0, 1, 2, 3), c) == pytest.approx(6 * 1e-5 + 1.5 * M / 1e9)
    # inter entry, and 4 rings sharing the NICs: β × (β_inter/4)/β_inter
    groups = [(i, i + 4) for i in range(4)]
    t = collective_time("all_reduce", M, (0, 4), c, concurrent=groups)
    assert t == pytest.approx(2 * 2e-5 + 1.0 * M / (5e8 / 4))
    # no entry for this collective: nominal figures
    assert collective_time("all_gather", M, (0, 1), c) == pytest.approx(1e-6 + M / 100e9)


# ------------------------------------------------------- hierarchical latency (N nodes × k)
MiB = 2**20


@pytest.mark.parametrize("coll, g, nodes, per_node, expected", [
    ("all_reduce", 8, 1, None, (14, 0)),          # one node: the ring, 2(G−1)
    ("all_reduce", 1024, 128, None, (14, 14)),    # 2(k−1), 2⌈log2 N⌉ = 2·7
    ("all_reduce", 128, 128, None, (0, 14)),      # one per node: the tree alone
    ("all_reduce", 24, 3, None, (14, 4)),         # ⌈log2 3⌉ = 2
    ("all_reduce", 6, 3, 4, (6, 4)),              # uneven 1 + 4 + 1: k = 4
    ("all_gather", 16, 2, None, (14, 1)),         # G−N hops inside, N−1 across
    ("reduce_scatter", 1024, 128, None, (896, 127)),
    ("all_gather", 6, 3, 4, (3, 2)),
    ("broadcast", 16, 2, None, (7, 1)),           # k−1, ⌈log2 N⌉
    ("broadcast", 8, 1, None, (7, 0)),
    ("all_to_all", 16, 2, None, (0, 15)),         # unchanged: G−1 at the slowest link
    ("send_recv", 2, 2, None, (0, 1)),
    ("send_recv", 2, 1, None, (1, 0)),
    ("all_reduce", 1, 1, None, (0, 0)),
])
def test_latency_steps_table(coll, g, nodes, per_node, expected):
    assert latency_steps(coll, g, nodes, per_node) == expected


def test_latency_steps_refuses_impossible_spans():
    with pytest.raises(ValueError, match="cannot span"):
        latency_steps("all_reduce", 4, 8)
    with pytest.raises(ValueError, match="at most 1 on one"):
        latency_steps("all_reduce", 8, 2, 1)


def test_1024_gpu_data_parallel_all_reduce_is_a_tree():
    """AMSP's cluster: 128 nodes × 8 A800 (α_i 3 µs, α_e 8 µs, β_intra 200, β_inter 100 GB/s),
    one 25 MiB gradient bucket all-reduced over all 1024 GPUs."""
    c = Cluster.preset("a800", physics=None, nodes=128)
    u = 25 * MiB
    bw = 2 * 1023 / 1024 * u / 100e9           # one ring crosses each node once: β_inter
    # a chain of 8 inside the node (2·7·3 µs), a tree over 128 nodes (2·7·8 µs): 154 µs
    assert latency_time("all_reduce", range(1024), c) == pytest.approx(2 * 7 * 3e-6 + 2 * 7 * 8e-6)
    assert collective_time("all_reduce", u, range(1024), c) == pytest.approx(154e-6 + bw)
    # the flat ring paid 2·1023·8 µs = 16.4 ms of latency per bucket; AMSP-style DP over the
    # nodes (8 strided groups of 128, one member per node, 8 rings sharing each node's NICs):
    mesh = Mesh(c, dp=128, tp=8)
    assert axis_collective_time("all_reduce", u, mesh, "dp") == pytest.approx(
        2 * 7 * 8e-6 + 2 * 127 / 128 * u / (100e9 / 8))
    # the whole machine as one data-parallel axis
    assert axis_collective_time("all_reduce", u, Mesh(c, dp=1024), "dp") == pytest.approx(154e-6 + bw)


def test_all_gather_over_two_nodes_of_eight():
    """2 nodes × 8 (dgx-a100: α_i 3 µs, α_e 8 µs, β_inter 200 GB/s): the ring's 15 hops, one
    crossing the node boundary; the bandwidth term is the ring's, as before."""
    c = Cluster.preset("dgx-a100", physics=None, nodes=2)
    shard = 1e6
    assert collective_time("all_gather", shard, range(16), c) == pytest.approx(
        14 * 3e-6 + 1 * 8e-6 + 15 * shard / 200e9)
    assert collective_time("reduce_scatter", 16 * shard, range(16), c) == pytest.approx(
        14 * 3e-6 + 1 * 8e-6 + 15 / 16 * 16 * shard / 200e9)
    # broadcast: a chain of 8 and one tree level, then the pipelined m/β
    assert collective_time("broadcast", shard, range(16), c) == pytest.approx(
        7 * 3e-6 + 1 * 8e-6 + shard / 200e9)
    # the tp=8 × dp=2 mesh: 8 dp rings (i, i+8) share each node's NICs, k = 1
    mesh = Mesh(c, dp=2, tp=8)
    assert axis_collective_time("all_gather", shard, mesh, "dp") == pytest.approx(8e-6 + shard / 25e9)


def test_multi_node_ring_steps_pay_the_network_post_overhead():
    """NCCL's ring across nodes floors every intra-node step at its network post overhead
    (``Physics.net_overhead``, 6 µs on dgx-a100's AMD hosts): a ring all-gather over
    1024 devices on 128 nodes pays ``896·6 + 127·8`` µs of latency, not ``896·3 + 127·8``.
    Inside one node, and for the tree all-reduce across nodes, nothing changes."""
    c = Cluster.preset("dgx-a100", nodes=128)
    assert c.physics.net_overhead == 6e-6
    shard = 1e6
    for coll, m, factor in (("all_gather", shard, 1023), ("reduce_scatter", 1024 * shard, 1023 / 1024)):
        assert collective_time(coll, m, range(1024), c) == pytest.approx(
            896 * 6e-6 + 127 * 8e-6 + factor * m / (200e9 * 0.92))   # one ring: a NIC's β
        assert latency_time(coll, range(16), c) == pytest.approx(14 * 6e-6 + 8e-6)
        assert latency_time(coll, range(8), c) == pytest.approx(7 * 3e-6)     # one node
    assert latency_time("all_reduce", range(1024), c) == pytest.approx(14 * 3e-6 + 14 * 8e-6)
    # a floor below α_i changes nothing; without latency there is none
    low = dataclasses.replace(c, physics=dataclasses.replace(c.physics, net_overhead=1e-6))
    assert latency_time("all_gather", range(16), low) == pytest.approx(14 * 3e-6 + 8e-6)
    assert latency_time("all_gather", range(1024), c.without_latency()) == 0.0


@pytest.mark.parametrize("coll", COLLECTIVES)
def test_intra_node_times_unchanged(coll):
    """Inside one node every step is an intra-node ring step: ``steps·α_i + factor·m/β_intra``
    on a one-node cluster and for an intra-node group of a multi-node cluster alike."""
    g = 2 if coll == "send_recv" else 8
    steps = {"all_gather": 7, "reduce_scatter": 7, "all_reduce": 14, "broadcast": 7,
             "all_to_all": 7, "send_recv": 1}[coll]
    factor = {"all_gather": 7, "reduce_scatter": 7 / 8, "all_reduce": 14 / 8, "broadcast": 1,
              "all_to_all": 7 / 8, "send_recv": 1}[coll]
    expected = steps * 3e-6 + factor * M / 300e9
    for nodes in (1, 4):
        c = Cluster.preset("dgx-a100", physics=None, nodes=nodes)
        assert collective_time(coll, M, range(8, 8 + g) if nodes > 1 else range(g), c) == \
            pytest.approx(expected, rel=1e-12)
        assert axis_collective_time(coll, M, Mesh(c, dp=nodes * 8 // g, tp=g), "tp") == \
            pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("coll, steps, factor", [
    ("all_reduce", 30, 30 / 16), ("all_gather", 15, 15.0), ("reduce_scatter", 15, 15 / 16),
    ("broadcast", 15, 1.0), ("all_to_all", 15, 15 / 16)])
def test_placement_agnostic_keeps_the_flat_ring(coll, steps, factor):
    """AxoNN §V-C's agnostic model: one α (inter-node) on the flat ring's steps, one β, for
    every group (it knows no nodes, so no hierarchy)."""
    c = Cluster.preset("perlmutter", physics=None, nodes=4)       # α_e 8 µs, β_inter 100 GB/s
    t = collective_time(coll, M, range(16), c, placement_aware=False)
    assert t == pytest.approx(steps * 8e-6 + factor * M / 100e9, rel=1e-12)
    # an intra-node pair is priced the same way: 2 steps of α_e for the all-reduce
    assert collective_time("all_reduce", M, (0, 1), c, placement_aware=False) == pytest.approx(
        2 * 8e-6 + 1.0 * M / 100e9)
    mesh = Mesh(c, data=2, z=2, y=2, x=2)
    assert axis_collective_time("all_reduce", M, mesh, "x", placement_aware=False) == pytest.approx(
        2 * 8e-6 + 1.0 * M / 100e9)


def test_calibrated_inter_entry_is_per_hierarchical_step():
    """An "inter" profile entry's α is per step of ``intra + inter`` of :func:`latency_steps`,
    the count the fit divided by: a measured group is reproduced exactly."""
    from fxpar.cost.calibration import fit_alpha_beta

    alpha, beta = 2e-5, 5e8
    sizes = [1e3, 1e5, 1e6, 1e7]
    # 2 nodes × 4, all-reduce: (2·3 + 2·1) = 8 steps (the flat ring: 14), factor 2·7/8
    times = [8 * alpha + 14 / 8 * m / beta for m in sizes]
    a, b, _ = fit_alpha_beta("all_reduce", 8, sizes, times, nodes=2, per_node=4)
    assert a == pytest.approx(alpha, rel=1e-6) and b == pytest.approx(beta, rel=1e-6)
    c = small(profile=Profile((ProfileEntry("all_reduce", "inter", 8, a, b),)))
    for m, t in zip(sizes, times):
        assert collective_time("all_reduce", m, range(8), c) == pytest.approx(t, rel=1e-6)
    # the agnostic model spreads the same α over the flat ring's 14 steps
    assert collective_time("all_reduce", M, range(8), c, placement_aware=False) == pytest.approx(
        14 * a + 14 / 8 * M / b, rel=1e-6)


# ---------------------------------------------------------------------------- properties
# Physical clusters: the network is never faster than the node's own links.
clusters = st.builds(
    lambda dpn, nodes, bi, frac, ai, extra: small(devices_per_node=dpn, nodes=nodes, intra_node_bandwidth=bi,
                                                  inter_node_bandwidth=bi * frac, intra_node_latency=ai,
                                                  inter_node_latency=ai + extra),
    st.sampled_from([1, 2, 4, 8]), st.integers(1, 4), st.floats(1e9, 1e12), st.floats(1e-3, 1.0),
    st.floats(0, 1e-4), st.floats(0, 1e-4))


@settings(max_examples=60, deadline=None)
@given(c=clusters, coll=st.sampled_from(COLLECTIVES), m1=st.floats(1, 1e10), m2=st.floats(1, 1e10),
       g=st.integers(2, 32))
def test_time_grows_with_bytes(c, coll, m1, m2, g):
    group = tuple(range(min(g, c.num_devices)))
    if coll == "send_recv":
        group = group[:2]
    lo, hi = sorted((m1, m2))
    assert collective_time(coll, lo, group, c) <= collective_time(coll, hi, group, c)


@settings(max_examples=60, deadline=None)
@given(c=clusters, coll=st.sampled_from([x for x in COLLECTIVES if x != "send_recv"]),
       m=st.floats(1, 1e10), g1=st.integers(1, 32), g2=st.integers(1, 32))
def test_time_grows_with_group_size(c, coll, m, g1, g2):
    n = c.num_devices
    a, b = sorted((min(g1, n), min(g2, n)))
    assert collective_time(coll, m, range(a), c) <= collective_time(coll, m, range(b), c) * (1 + 1e-12)


@settings(max_examples=60, deadline=None)
@given(c=clusters, coll=st.sampled_from(COLLECTIVES), m=st.floats(1, 1e10), g=st.integers(2, 32),
       f=st.floats(1.0, 100.0), aware=st.booleans())
def test_time_shrinks_with_bandwidth(c, coll, m, g, f, aware):
    import dataclasses

    group = tuple(range(min(g, c.num_devices)))
    faster = dataclasses.replace(c, intra_node_bandwidth=c.intra_node_bandwidth * f,
                                 inter_node_bandwidth=c.inter_node_bandwidth * f)
    t0 = collective_time(coll, m, group, c, placement_aware=aware)
    t1 = collective_time(coll, m, group, faster, placement_aware=aware)
    assert t1 <= t0 * (1 + 1e-12)


@settings(max_examples=40, deadline=None)
@given(dp=st.sampled_from([1, 2, 4]), tp=st.sampled_from([1, 2, 4, 8]), m=st.floats(1e3, 1e9))
def test_sharing_never_helps(dp, tp, m):
    """A ring with concurrent rings is never faster than alone; agnostic ignores sharing."""
    c = Cluster.preset("dgx-a100", physics=None, nodes=4)
    mesh = Mesh(c, dp=dp, tp=tp) if dp * tp <= c.num_devices else Mesh(c, dp=1, tp=tp)
    for axis in ("dp", "tp"):
        for g in mesh.groups(axis):
            alone = collective_time("all_reduce", m, g, c)
            shared = collective_time("all_reduce", m, g, c, concurrent=mesh.groups(axis))
            assert shared >= alone * (1 - 1e-12)
    assert math.isfinite(axis_collective_time("all_gather", m, mesh, "tp"))


def test_flat_calibration_fit_gives_finite_times():
    """A calibration whose times do not grow with size fits β = inf (no bandwidth term); the
    cluster then carries inf bandwidth too, and times must stay α-only, never NaN."""
    e = ProfileEntry(collective="all_reduce", level="intra", group_size=4, latency=1e-4,
                     bandwidth=float("inf"))
    c = Cluster.local(4, profile=Profile((e,)), intra_node_bandwidth=float("inf"))
    steps, _ = ring_steps_and_factor("all_reduce", 4)
    assert collective_time("all_reduce", 2**20, range(4), c) == pytest.approx(steps * 1e-4)


@settings(max_examples=60, deadline=None)
@given(c=clusters, coll=st.sampled_from(COLLECTIVES), lo=st.integers(0, 31), g=st.integers(1, 32))
def test_hierarchy_never_costs_more_latency_than_the_flat_ring(c, coll, lo, g):
    """With α_i ≤ α_e, the hierarchical latency of any contiguous group is at most the flat
    ring's steps at α_e (the agnostic model's latency)."""
    n = c.num_devices
    group = tuple(range(min(lo, n - 1), min(lo + g, n)))
    if coll == "send_recv":
        group = group[:2]
    aware = latency_time(coll, group, c)
    flat = latency_time(coll, group, c, placement_aware=False)
    assert aware <= flat * (1 + 1e-12)
