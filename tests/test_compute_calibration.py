"""Compute calibration: the fitting and lookup functions against hand-computed values, the
measured :class:`ComputeProfile` in the cluster JSON, ``op_time`` on a calibrated cluster, and
``Cluster.calibrate`` measuring compute on a live 2-rank gloo group."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

import fxpar
from fxpar import Cluster, ClusterError
from fxpar.cluster import ComputeProfile
from fxpar.cost.calibration import interp_loglog, median_of_max, rate_points
from fxpar.cost.compute import OpCost, ZERO, calibrated_time, op_time, roofline_time

PROF = ComputeProfile(gemm=((2e3, 1e9), (2e5, 1e10), (2e7, 4e10)),
                      memory=((1e4, 4e10), (1e8, 1e10)),
                      op_overhead=4e-6, bwd_op_overhead=1.5e-5, dispatch=2e-6, ranks=2)


# -- pure helpers ------------------------------------------------------------------------------
def test_rate_points_remove_dispatch_at_most_three_quarters():
    # t = 12 µs, dispatch 2 µs: kernel 10 µs -> 2e5 / 1e-5 = 2e10; t = 2 µs: only t/4 is kept.
    pts = rate_points([2e5, 1e3], [12e-6, 2e-6], dispatch=2e-6)
    assert pts[0] == (1e3, pytest.approx(1e3 / 0.5e-6))
    assert pts[1] == (2e5, pytest.approx(2e10))
    with pytest.raises(ValueError, match="not a measurement"):
        rate_points([1.0], [0.0])
    with pytest.raises(ValueError, match="2 work sizes but 1 times"):
        rate_points([1.0, 2.0], [1.0])


def test_interp_loglog_between_and_outside():
    pts = ((1e3, 1e9), (1e5, 1e11))
    assert interp_loglog(pts, 1e4) == pytest.approx(1e10)          # geometric midpoint
    assert interp_loglog(pts, 10 ** 3.5) == pytest.approx(10 ** 9.5)
    assert interp_loglog(pts, 1.0) == 1e9 and interp_loglog(pts, 1e12) == 1e11  # held at the ends
    # a falling segment is followed too (not forced monotone)
    assert interp_loglog(((1.0, 8.0), (4.0, 2.0)), 2.0) == pytest.approx(4.0)


def test_median_of_max():
    # runs x ranks: maxima 5, 4, 7, 1 -> median 4.5
    assert median_of_max([[5, 1], [2, 4], [7, 7], [1, 0]]) == 4.5


# -- pricing -----------------------------------------------------------------------------------
def test_calibrated_time_closed_form():
    # GEMM of 2e4 FLOPs: rate sqrt(1e9·1e10) (log-midpoint of 2e3 and 2e5) = 3.1623e9
    assert calibrated_time(2e4, 0, PROF) == pytest.approx(2e4 / math.sqrt(1e19))
    # bytes bound: 1e6 B at log-midpoint of (1e4, 4e10), (1e8, 1e10) -> 2e10 B/s
    assert calibrated_time(1.0, 1e6, PROF, gemm=False) == pytest.approx(1e6 / 2e10)
    # max of the two
    assert calibrated_time(2e7, 1e4, PROF) == pytest.approx(2e7 / 4e10)


def test_non_gemm_flops_at_the_measured_vector_rate():
    # without a vector curve, non-GEMM FLOPs run at the GEMM peak (4e10): bytes dominate
    assert calibrated_time(1e3, 1e4, PROF, gemm=False) == pytest.approx(1e4 / 4e10)
    vec = ComputeProfile(gemm=PROF.gemm, memory=PROF.memory, op_overhead=0.0, bwd_op_overhead=0.0,
                         vector=((1e4, 1e8), (1e6, 1e9)))
    # 1e5 FLOPs: log-midpoint rate sqrt(1e8·1e9); a softmax of 2e4 elements (5 FLOPs each)
    assert calibrated_time(1e5, 1e4, vec, gemm=False) == pytest.approx(1e5 / math.sqrt(1e17))
    # GEMMs are unaffected
    assert calibrated_time(2e4, 0, vec) == calibrated_time(2e4, 0, PROF)
    # and it survives the cluster JSON; an old profile without it loads with none
    c = Cluster.local(2, compute=vec)
    assert Cluster.from_json(c.to_json()).compute == vec
    d = json.loads(c.to_json())
    del d["compute"]["vector"]
    assert Cluster.from_dict(d).compute.vector == ()


def test_activations_at_their_measured_rate():
    # GELU, SiLU, tanh, exp: kind "activation", one FLOP per element and direction
    import fxpar.strategies  # noqa: F401 — fills the cost table
    from fxpar.cost.compute import TensorArg, op_cost

    aten = torch.ops.aten
    x = TensorArg((64, 512), torch.float32, requires_grad=True)
    out = TensorArg((64, 512), torch.float32)
    for op in (aten.gelu.default, aten.silu.default, aten.tanh.default, aten.exp.default,
               aten.silu_.default):
        c = op_cost(op, (x,), out=out)
        assert (c.kind, c.fwd_flops, c.bwd_flops) == ("activation", 2.0**15, 2.0**15), op
    # the cheap ones stay bytes-bound pointwise ops
    assert op_cost(aten.add.Tensor, (x, x), out=out).kind == "pointwise"
    assert op_cost(aten.relu.default, (x,), out=out).kind == "pointwise"
    act = ComputeProfile(gemm=PROF.gemm, memory=PROF.memory, op_overhead=0.0, bwd_op_overhead=0.0,
                         vector=((1e3, 1e12),), activation=((1e3, 1e8), (1e5, 1e10)))
    gelu = OpCost(1e4, 1e4, 8e4, 1.2e5, "activation")
    # 1e4 elements: log-midpoint rate 1e9 (both directions looked up at the forward's 1e4)
    f, b = op_time(gelu, Cluster.local(2, compute=act))
    assert f == pytest.approx(1e4 / 1e9) and b == pytest.approx(1e4 / 1e9)
    # the same op as "pointwise" is bound by its bytes (the vector rate is far higher)
    f0, _ = op_time(dataclasses.replace(gelu, kind="pointwise"), Cluster.local(2, compute=act))
    assert f0 == pytest.approx(8e4 / interp_loglog(PROF.memory, 8e4))
    # no curve (a profile saved before it existed): the vector rate
    f1, _ = op_time(gelu, Cluster.local(2, compute=dataclasses.replace(act, activation=())))
    assert f1 == pytest.approx(max(1e4 / 1e12, 8e4 / interp_loglog(PROF.memory, 8e4)))
    c = Cluster.local(2, compute=act)
    assert Cluster.from_json(c.to_json()).compute == act
    d = json.loads(c.to_json())
    del d["compute"]["activation"]
    assert Cluster.from_dict(d).compute.activation == ()
    # refine scales it with the other compute curves
    from fxpar.runtime.profile import NodeTime, Profile
    slow = Profile((NodeTime("mm", "fc", "compute", None, 2e-3, 4e-3, 1e-3, 2e-3),), 0.01, 3)
    assert c.refine(slow).compute.activation == ((1e3, 5e7), (1e5, 5e9))


def test_gemm_calibration_streams_its_second_operand(monkeypatch):
    # the pool holds twice the core's cache: 8 distinct 64x64 float32 matrices for a
    # 64 KiB cache; every one is used, in turn
    import torch.distributed as dist

    from fxpar import cluster as cl

    monkeypatch.setattr(cl, "_cache_bytes", lambda device: 4 * 64 * 64 * 4)
    monkeypatch.setattr(cl, "_interleaved_times",
                        lambda fns, iters, group, min_time, sync: [fn(16) for fn in fns])
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 1)
    seen, real_mm = [], torch.mm

    def mm(a, b):
        seen.append(b.data_ptr())
        return real_mm(a, b)
    monkeypatch.setattr(torch, "mm", mm)
    p = cl._measure_compute(None, torch.device("cpu"), (64,), (2**10,), 1, 0.0,
                            attention_shapes=((1, 8, 4),))
    assert len(set(seen)) == 8 and seen[:8] == seen[8:16]
    assert [w for w, _ in p.activation] == [256.0]    # 1 KiB of float32: 256 elements
    assert cl._cache_bytes(torch.device("cpu")) > 0


def test_attention_at_its_measured_rate():
    # SDPA FLOPs at the attention curve, looked up at the forward's FLOPs (both directions)
    att = ComputeProfile(gemm=PROF.gemm, memory=PROF.memory, op_overhead=0.0, bwd_op_overhead=0.0,
                         attention=((1e6, 1e9),))
    cost = OpCost(2e6, 4e6, 0.0, 0.0, "attention")
    f, b = op_time(cost, Cluster.local(2, compute=att))
    assert (f, b) == (pytest.approx(2e6 / 1e9), pytest.approx(4e6 / 1e9))
    # without the curve: the GEMM rate at 2e6 FLOPs (log-midpoint of 2e5 and 2e7: 2e10)
    f0, _ = op_time(cost, Cluster.local(2, compute=dataclasses.replace(att, attention=())))
    assert f0 == pytest.approx(2e6 / 2e10)
    assert Cluster.from_json(Cluster.local(2, compute=att).to_json()).compute == att


def test_op_time_on_calibrated_cluster():
    c = Cluster.local(2, compute=PROF)
    mm = OpCost(fwd_flops=2e5, bwd_flops=4e5, fwd_bytes=0, bwd_bytes=0, kind="matmul")
    f, b = op_time(mm, c)
    # forward: 2e5 / 1e10 + 4 µs; backward: two GEMMs of the forward's size at 1e10 + 15 µs
    assert f == pytest.approx(2e-5 + 4e-6) and b == pytest.approx(4e-5 + 1.5e-5)
    # an elementwise op: bytes only, at the memory curve (1e4 B -> 4e10 B/s)
    gelu = OpCost(1e3, 1e3, 1e4, 1e4, "pointwise")
    f, b = op_time(gelu, c)
    assert f == pytest.approx(1e4 / 4e10 + 4e-6) and b == pytest.approx(1e4 / 4e10 + 1.5e-5)
    assert op_time(ZERO, c) == (pytest.approx(4e-6), 0.0)
    # efficiency arguments do not apply to measured numbers
    assert op_time(mm, c, 0.1, 0.1) == op_time(mm, c)


def test_uncalibrated_op_time_is_the_roofline():
    c = Cluster.local(2)
    assert c.compute is None
    mm = OpCost(2e9, 4e9, 1e6, 2e6, "matmul")
    assert op_time(mm, c) == (roofline_time(2e9, 1e6, c), roofline_time(4e9, 2e6, c))
    assert op_time(ZERO, c) == (0.0, 0.0)


# -- JSON ----------------------------------------------------------------------------------
def test_json_round_trip_with_compute():
    c = Cluster.local(4, compute=PROF)
    back = Cluster.from_json(c.to_json())
    assert back == c and back.compute == PROF and hash(back) == hash(c)
    assert json.loads(c.to_json())["compute"]["op_overhead"] == 4e-6
    assert "compute measured" in c.describe()


def test_old_json_without_compute_loads_and_is_unchanged():
    d = Cluster.local(2).to_dict()
    assert "compute" not in d                       # an uncalibrated cluster writes what it did
    old = json.dumps(d)
    c = Cluster.from_json(old)
    assert c.compute is None and c.to_json() == Cluster.from_json(c.to_json()).to_json()


@pytest.mark.parametrize("bad, msg", [
    (dict(gemm=()), "gemm"), (dict(memory=((1.0, -1.0),)), "memory"),
    (dict(op_overhead=float("nan")), "op_overhead"), (dict(shared=(1.0, 1.0)), "shared")])
def test_bad_profiles_are_refused(bad, msg):
    kw = dict(gemm=PROF.gemm, memory=PROF.memory, op_overhead=1e-6, bwd_op_overhead=1e-6)
    with pytest.raises(ClusterError, match=msg):
        ComputeProfile(**{**kw, **bad})
    with pytest.raises(ClusterError, match="compute profile"):
        Cluster.from_dict({**Cluster.local(2).to_dict(), "compute": {"gemm": []}})


# -- live calibration ------------------------------------------------------------------------
def _calibrate_tiny():
    base = Cluster.local(2, device_memory=2**30)
    return base.calibrate(sizes=(2**12,), collectives=("all_reduce",), iters=3,
                          gemm_sizes=(8, 32, 128), memory_sizes=(2**10, 2**14, 2**20),
                          min_time=5e-4, in_model=True)


def _calibrate_bf16():
    return Cluster.local(2).calibrate(collectives=(), iters=2, gemm_sizes=(8, 64),
                                      memory_sizes=(2**10, 2**14), min_time=5e-4,
                                      dtype=torch.bfloat16, attention_shapes=((4, 32, 16),),
                                      share_cores=True)


@pytest.mark.dist
@pytest.mark.timeout(180)
def test_calibrate_measures_compute_on_two_ranks(pools):
    clusters = pools(2).run(_calibrate_tiny, timeout=150)
    c = clusters[0]
    assert clusters[1] == c, "ranks must agree on the calibrated cluster"
    assert c.device_memory == 2**30              # called on an instance: that cluster is the base
    p = c.compute
    assert p is not None and p.ranks == 2 and p.shared == ()   # shared cores: not modelled
    assert [w for w, _ in p.gemm] == [2.0 * 8**3, 2.0 * 32**3, 2.0 * 128**3]
    rates = [r for _, r in p.gemm]
    assert all(math.isfinite(r) and 1e6 < r < 1e13 for r in rates), rates
    # a 128³ GEMM runs well above the rate of an 8³ one (launch-bound): the curve rises
    assert rates[-1] > 2 * rates[0], rates
    assert all(math.isfinite(r) and 1e6 < r < 1e13 for _, r in p.memory), p.memory
    # a log-softmax forward + backward per memory size, counted at 5 + 4 FLOPs per element of
    # rows of 512 (at least one)
    assert [w for w, _ in p.vector] == [9.0 * 512, 9.0 * 4096, 9.0 * 2**18]
    # on a CPU it runs well below the GEMM rate of a 128³ GEMM
    assert all(math.isfinite(r) and 1e6 < r < rates[-1] for _, r in p.vector), (p.vector, rates)
    # a GELU forward + backward per memory size, keyed by its elements
    assert [w for w, _ in p.activation] == [256.0, 4096.0, 2.0**18]
    assert all(math.isfinite(r) and 1e6 < r < rates[-1] for _, r in p.activation), p.activation
    # causal SDPA forward + backward at two shapes, keyed by the forward's FLOPs (4·BH·L²·E)
    assert [w for w, _ in p.attention] == [4.0 * 8 * 64 * 64 * 32, 4.0 * 8 * 256 * 256 * 64]
    assert all(math.isfinite(r) and 1e6 < r < 1e13 for _, r in p.attention), p.attention
    # an AdamW step: a positive price per element, a finite one per tensor
    per_tensor, per_element = p.optimizer
    assert 0 < per_element < 1e-6 and 0 <= per_tensor < 1e-3, p.optimizer
    assert 0 < p.dispatch < 1e-3 and 0 < p.op_overhead < 1e-3 and 0 < p.bwd_op_overhead < 1e-3
    assert c.peak_flops == max(rates) and c.memory_bandwidth == p.memory[-1][1]
    # the in-model correction (fxpar.block_probe): fitted inside its ranges, and applied
    s, r = p.in_model
    assert 0.5 <= s <= 2.0 and 1.0 <= r <= 10.0, p.in_model
    assert "in a model: kernels" in c.describe()
    assert Cluster.from_json(c.to_json()) == c

    # planning with it prices compute by the measured curves: a different step time, and a
    # GEMM node's forward time is exactly the calibrated formula on its local shapes
    from examples.models import MLP

    model = MLP(64, 256)
    x = torch.randn(32, 64)
    before = fxpar.plan(model, Cluster.local(2), (x,), mesh={"dp": 2}, plan="dp").plan
    after = fxpar.plan(model, c, (x,), mesh={"dp": 2}, plan="dp").plan
    assert after.compute != before.compute and after.time != before.time
    fc1 = next(n for n in after.nodes if n.op == "linear")
    flops = 2.0 * 16 * 64 * 256                   # local batch 16 of 32 on dp=2
    nbytes = 4.0 * (16 * 64 + 256 * 64 + 256 + 16 * 256)
    # a 2-D linear dispatches two kernels below autograd (t, addmm): two per-op overheads
    assert fc1.fwd_time == pytest.approx(calibrated_time(flops, nbytes, p) + 2 * p.op_overhead)
    assert p.dtype == "float32" and not p.asynchronous   # a CPU: host and kernels add up


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_calibrate_in_the_training_dtype(pools):
    """``dtype=`` measures the curves in the dtype the model trains in (a bf16 GEMM on a GPU
    is ~15× a float32 one): sizes stay bytes, elements follow the element size; the
    attention curve is keyed by the shapes asked for."""
    c = pools(2).run(_calibrate_bf16, timeout=100)[0]
    p = c.compute
    assert p.dtype == "bfloat16" and not p.asynchronous
    # share_cores: the speed with 1 and 2 ranks busy over 2 busy (the step model's
    # host_rate); one rank alone on this host runs at least as fast as two at once, up to
    # the ~2x of a core to itself (0.7: room for a noisy neighbour)
    assert len(p.shared) == 2 and p.shared[1] == 1.0 and 0.7 < p.shared[0] < 3, p.shared
    assert "speed with 1..2 ranks busy" in c.describe()
    assert [w for w, _ in p.memory] == [3.0 * 2**10, 3.0 * 2**14]
    assert [w for w, _ in p.vector] == [9.0 * 512, 9.0 * 2**13]        # 2-byte elements
    assert [w for w, _ in p.attention] == [4.0 * 4 * 32 * 32 * 16]
    assert Cluster.from_json(c.to_json()) == c


def test_in_model_fit_recovers_a_scaled_profile():
    """fxpar.block_probe: the probe's graph priced on a profile whose kernels run 1.3x slower
    and whose ops cost 2.5x the overheads (ComputeProfile.scaled) is, at every size, 1.3x the
    kernels and 2.5x the overheads priced on the original; fit_in_model recovers both."""
    from fxpar.block_probe import BLOCKS, HEADS, SHAPES, WIDTH, ProbeBlock, fit_in_model, price
    from fxpar.capture import capture

    prof = dataclasses.replace(PROF, vector=((1e3, 2e9), (1e7, 5e9)), activation=((1e3, 1e9),),
                               attention=((1e5, 5e9), (1e8, 2e10)))
    slow = prof.scaled(1.3, 2.5)
    assert slow.op_overhead == pytest.approx(2.5 * prof.op_overhead)
    assert slow.gemm[0][1] == pytest.approx(prof.gemm[0][1] / 1.3)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(ProbeBlock(WIDTH // 4, HEADS) for _ in range(BLOCKS)))
    kernels, totals, overheads = [], [], set()
    for b, t in SHAPES:
        gm = capture(model, (torch.randn(b, t // 4, WIDTH // 4),))
        (k, o), (ks, os_) = price(gm, prof), price(gm, slow)
        assert ks == pytest.approx(1.3 * k) and os_ == pytest.approx(2.5 * o) and o > 0
        kernels.append(k)
        totals.append(ks + os_)
        overheads.add(round(o, 12))
    assert len(overheads) == 1        # per-op costs do not depend on the batch
    s, r = fit_in_model(totals, kernels, overheads.pop())
    assert (s, r) == (pytest.approx(1.3), pytest.approx(2.5))
    # a profile's JSON keeps the correction
    stamped = dataclasses.replace(slow, in_model=(1.3, 2.5))
    assert ComputeProfile.from_dict(stamped.to_dict()) == stamped


def _oversubscribed_mixed():
    import os

    import torch.distributed as dist

    from fxpar.cluster import _oversubscribed

    cores, before = len(os.sched_getaffinity(0)), torch.get_num_threads()
    torch.set_num_threads(cores + 1 if dist.get_rank() == 1 else 1)
    try:
        return _oversubscribed(2), _oversubscribed(2, dist.group.WORLD)
    finally:   # the pool's workers serve later tests
        torch.set_num_threads(before)


@pytest.mark.dist
@pytest.mark.timeout(60)
def test_in_model_probe_is_decided_alike_on_every_rank(pools):
    """Cluster.calibrate runs the in-model probe (collectives) only where the host's ranks fit
    its cores: rank 1 with more threads than cores is oversubscribed whatever rank 0 sees, and
    the group's decision is rank 1's on both (else rank 0 would wait in the probe forever)."""
    (mine0, group0), (mine1, group1) = pools(2).run(_oversubscribed_mixed, timeout=50)
    assert mine1 and group0 and group1


def test_interleaved_rounds_alternate_and_take_the_slowest_rank(monkeypatch):
    """_interleaved_times on a faked 2-rank group (rank 1 reports twice rank 0's times): reps
    from each probe's steady per-call time (its slow first call ignored), rounds alternating
    forward/reverse order, per probe the median over rounds of the slower rank."""
    import torch.distributed as dist

    from fxpar.cluster import _interleaved_times

    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "barrier", lambda group=None: None)
    monkeypatch.setattr(dist, "all_reduce", lambda t, op=None, group=None: None)

    def all_gather(every, mine, group=None):
        every[0].copy_(mine)
        every[1].copy_(2 * mine)
    monkeypatch.setattr(dist, "all_gather", all_gather)

    calls = []
    round_times = {"a": iter([1.0, 5.0, 3.0]), "b": iter([10.0, 30.0, 20.0])}
    # warm-up calls: the first pays a one-time 1 s, then the steady time until a run of reps
    # lasts min_time / 8 (a: reps 1, 8; b: reps 1, 8, 64)
    ramp = {"a": 3, "b": 4}

    def probe(name, warm):
        def fn(reps):
            calls.append((name, reps))
            n = sum(c == name for c, _ in calls)
            if n <= ramp[name]:
                return [1.0 if n == 1 else warm]
            return [next(round_times[name]), 7.0] if name == "a" else [next(round_times[name])]
        return fn
    fns = [probe("a", 1e-3), probe("b", 1e-4)]
    out = _interleaved_times(fns, 3, None, 0.01, lambda: None)
    assert calls[:7] == [("a", 1), ("a", 1), ("a", 8), ("b", 1), ("b", 1), ("b", 8), ("b", 64)]
    assert [c for c, _ in calls[7:]] == ["a", "b", "b", "a", "a", "b"]
    assert {c: r for c, r in calls[7:]} == {"a": 10, "b": 100}   # min_time / steady time
    assert out == [[2 * 3.0, 2 * 7.0], [2 * 20.0]]
