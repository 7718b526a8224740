"""The pipeline simulator (issue #10 item 5): exact closed forms from the papers, hand-derived
timelines, memory, and the Chrome trace.

Oracles: Megatron-LM §2.2 (bubble ``(p−1)/m`` and ``(p−1)/(v·m)``), the zero-bubble paper's
ZB-H1 bubble ``(p−1)(t_f + t_i − t_w)``, timelines worked out by hand in the docstrings, and
``fxpar.cost.pipeline`` (closed forms) and tests/schedule_oracle.py (a compute-only simulator
written separately).
"""

from __future__ import annotations

import json
import random

import pytest

import fxpar
from fxpar.cluster import Cluster, ComputeProfile
from fxpar.cost import pipeline as cp
from fxpar.cost.step import host_rate
from fxpar.errors import ScheduleError
from fxpar.schedule import Action, Schedule
from fxpar.sim import SimResult, simulate
from tests import schedule_oracle


# ---------------------------------------------------------------------------------------------
# exact bubbles with equal stages and free transfers
# ---------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpipe", "1f1b", "eager-1f1b"])
@pytest.mark.parametrize("tf,tb", [(1.0, 2.0), (0.7, 1.3)])
def test_bubble_one_chunk(name, tf, tb):
    """Megatron §2.2.1: bubble ``(p−1)/m``, step ``(m+p−1)(t_f+t_b)`` (eager-1F1B: the same
    with free transfers, cross-mesh paper §4)."""
    for p in range(1, 9):
        for m in range(1, 17):
            r = simulate(Schedule.build(name, stages=p, microbatches=m), fwd=tf, bwd=tb)
            assert r.bubble_fraction == pytest.approx((p - 1) / m, abs=1e-9), (p, m)
            assert r.step_time == pytest.approx((m + p - 1) * (tf + tb), abs=1e-9)
            assert r.busy == pytest.approx([m * (tf + tb)] * p)


@pytest.mark.slow
@pytest.mark.parametrize("v", [1, 2, 4])
def test_bubble_interleaved(v):
    """Megatron §2.2.2: with per-chunk times ``t_f``, ``t_b`` a rank computes ``m·v(t_f+t_b)``
    and the bubble is ``(p−1)(t_f+t_b)``: fraction ``(p−1)/(v·m)``."""
    tf, tb = 0.5, 1.25
    for p in range(1, 9):
        for m in range(p, 17, p):
            r = simulate(Schedule.build("interleaved", stages=p, microbatches=m, chunks=v), tf, tb)
            assert r.bubble_fraction == pytest.approx((p - 1) / (v * m), abs=1e-9), (p, m, v)
            assert r.bubble_fraction == pytest.approx(cp.bubble_fraction("interleaved", p, m, v), abs=1e-9)
            assert r.step_time == pytest.approx((m * v + p - 1) * (tf + tb), abs=1e-9)


def test_public_api_example():
    sched = fxpar.Schedule.build("1f1b", stages=4, microbatches=8)
    res = fxpar.simulate(sched, fwd=1.0, bwd=2.0)
    assert isinstance(res, fxpar.SimResult)
    assert res.step_time == pytest.approx(33.0) and res.bubble_fraction == pytest.approx(3 / 8)


def test_matches_cost_model_simulator_unequal_stages():
    """Random per-chunk times, no communication: same step time and busy time as
    ``tests/schedule_oracle.py``'s ``simulate`` (its own compute-only event loop)."""
    rng = random.Random(0)
    for name, p, m, v in [("gpipe", 3, 5, 1), ("1f1b", 4, 7, 1), ("1f1b", 5, 3, 1),
                          ("eager-1f1b", 4, 6, 1), ("interleaved", 2, 4, 2), ("interleaved", 3, 6, 3),
                          ("interleaved", 4, 8, 2)]:
        for _ in range(3):
            f = [rng.uniform(0.5, 2.0) for _ in range(p * v)]
            b = [rng.uniform(0.5, 4.0) for _ in range(p * v)]
            r = simulate(Schedule.build(name, p, m, v), fwd=f, bwd=b)
            ref = schedule_oracle.simulate(name.replace("-", "_"), f, b, m, v=v, per_chunk=True)
            assert r.step_time == pytest.approx(ref.step_time, rel=1e-12), (name, p, m, v)
            assert r.busy == pytest.approx(ref.busy, rel=1e-12)
            assert r.bubble_fraction == pytest.approx(ref.bubble_fraction, rel=1e-9, abs=1e-12)


def test_unbalanced_gpipe_closed_form():
    """GPipe, one slow stage (forwards and backwards both slowest on stage 2): the step is
    ``Σ_s(f_s+b_s) + (m−1)(f_max+b_max)``; the bubble is relative to the slowest rank."""
    f = [1.0, 1.0, 3.0, 1.0]
    b = [2.0, 2.0, 5.0, 2.0]
    m = 6
    r = simulate(Schedule.build("gpipe", 4, m), fwd=f, bwd=b)
    assert r.step_time == pytest.approx(sum(f) + sum(b) + (m - 1) * 8.0)
    assert r.busy == pytest.approx([m * (x + y) for x, y in zip(f, b)])
    assert r.bubble_fraction == pytest.approx(r.step_time / (m * 8.0) - 1)


def test_callable_times():
    """``fwd``/``bwd`` as ``callable(chunk, microbatch)``: microbatch 0 twice as slow on every
    stage of a GPipe pipeline with p=2, m=2. Rank 0: F0 [0,2], F1 [2,3]; rank 1: F0 [2,4],
    F1 [4,5], B0 [5,9], B1 [9,11]; rank 0: B0 [9,13], B1 [13,15]."""
    r = simulate(Schedule.build("gpipe", 2, 2), fwd=lambda k, i: 2.0 if i == 0 else 1.0,
                 bwd=lambda k, i: 4.0 if i == 0 else 2.0)
    assert r.step_time == pytest.approx(15.0)
    got = {(e.name): (e.start, e.end) for e in r.events if e.lane == "compute"}
    assert got["1B0"] == (5.0, 9.0) and got["0B1"] == (13.0, 15.0)


# ---------------------------------------------------------------------------------------------
# communication
# ---------------------------------------------------------------------------------------------
def test_gpipe_with_transfers_closed_form():
    """GPipe, equal stages, transfers of ``c ≤ t_f`` seconds: the first microbatch crosses
    ``p−1`` boundaries forward and ``p−1`` back, so the step is ``(m+p−1)(t_f+t_b) + 2(p−1)c``."""
    for p in (2, 3, 4):
        for m in (1, 3, 8):
            for c in (0.25, 0.5, 1.0):
                r = simulate(Schedule.build("gpipe", p, m), fwd=1.0, bwd=2.0, comm=c)
                assert r.step_time == pytest.approx((m + p - 1) * 3.0 + 2 * (p - 1) * c)


def test_eager_1f1b_hand_derived():
    """p=2, m=3, t_f=1, t_b=2, every transfer 1 s.

    1F1B: rank 0 runs F0 F1 B0 F2 B1 B2, rank 1 runs F0 B0 F1 B1 F2 B2. F0 [0,1] arrives at 2,
    rank 1 F0 [2,3] B0 [3,5], its gradient arrives at 6; rank 0 B0 [6,8], only then F2 [8,9],
    which arrives at 10: rank 1 idles from 8 (end of B1) to 10, F2 [10,11] B2 [11,13], gradient
    at 14, rank 0 B2 [14,16]. Step 16: each round trip sits on the critical path.

    Eager-1F1B: rank 0 runs min(m, 2·2−1) = 3 forwards first, F2 [2,3] is sent at [3,4], long
    before rank 1 needs it (at 8): rank 1 runs F0 [2,3] B0 [3,5] F1 [5,6] B1 [6,8] F2 [8,9]
    B2 [9,11] without a gap, gradient at 12, rank 0 B2 [12,14]. Step 14.

    With free transfers both take (m+p−1)(t_f+t_b) = 12."""
    base = simulate(Schedule.build("1f1b", 2, 3), fwd=1.0, bwd=2.0, comm=1.0)
    eager = simulate(Schedule.build("eager-1f1b", 2, 3), fwd=1.0, bwd=2.0, comm=1.0)
    assert base.step_time == pytest.approx(16.0)
    assert eager.step_time == pytest.approx(14.0)
    for name in ("1f1b", "eager-1f1b"):
        assert simulate(Schedule.build(name, 2, 3), 1.0, 2.0).step_time == pytest.approx(12.0)
    ev = {e.name: (e.start, e.end) for e in eager.events if e.rank == 1 and e.lane == "compute"}
    assert ev["1F2"] == (8.0, 9.0) and ev["1B2"] == (9.0, 11.0)


def test_eager_1f1b_vs_1f1b_sweep():
    """Equal step time without transfers; strictly faster with them once the warm-ups differ
    (m ≥ 3: for m ≤ 2 both schedules run the same order)."""
    for p in range(2, 6):
        for m in (1, 2, 3, 4, 8, 13):
            a, b = (Schedule.build(n, p, m) for n in ("1f1b", "eager-1f1b"))
            assert simulate(a, 1.0, 2.0).step_time == pytest.approx(simulate(b, 1.0, 2.0).step_time)
            for c in (0.1, 0.5, 1.0):
                ta = simulate(a, 1.0, 2.0, comm=c).step_time
                tb = simulate(b, 1.0, 2.0, comm=c).step_time
                if m >= 3:
                    assert tb < ta - 1e-9, (p, m, c, ta, tb)
                else:
                    assert tb == pytest.approx(ta)


def test_sends_serialize_on_the_comm_lane():
    """Interleaved p=2, v=2, m=2 with 3-second transfers and 1-second forwards: rank 0's
    sends 0SEND_F0 and 0SEND_F1 leave one after the other on its comm lane ([1,4], [4,7]),
    so microbatch 1 reaches chunk 1 at 7, not 5."""
    r = simulate(Schedule.build("interleaved", 2, 2, 2), fwd=1.0, bwd=2.0, comm=3.0)
    ev = {e.name: (e.start, e.end) for e in r.events}
    assert ev["0SEND_F0"] == (1.0, 4.0) and ev["0SEND_F1"] == (4.0, 7.0)
    assert ev["1RECV_F1"] == (7.0, 7.0)
    assert ev["1F1"][0] == 7.0


def test_comm_callable_and_causality():
    """Transfer time per send action; every receive completes no earlier than its send ends and
    every compute action starts after its inputs."""
    s = Schedule.build("interleaved", 4, 8, 2)
    r = simulate(s, fwd=1.0, bwd=2.0, comm=lambda a: 0.3 if a.kind == "SEND_F" else 0.6)
    ev = {(e.rank, e.name): e for e in r.events}
    for (rank, name), e in ev.items():
        a = Action.parse(name)
        if a.is_send:
            assert e.end - e.start == pytest.approx(0.3 if a.kind == "SEND_F" else 0.6)
        if a.is_recv:
            send = ev[(s.peer_rank(a), str(a.matching()))]
            assert e.end >= send.end - 1e-12
        if a.kind == "F" and a.stage > 0:
            assert e.start >= ev[(rank, f"{a.stage}RECV_F{a.microbatch}")].end - 1e-12
    for rank in range(4):
        comp = sorted((e for e in r.events if e.rank == rank and e.lane == "compute"), key=lambda e: e.start)
        assert all(x.end <= y.start + 1e-12 for x, y in zip(comp, comp[1:]))
        assert [e.name for e in comp] == [str(a) for a in s.compute_only()[rank]]


def test_reduce_grad_on_comm_lane():
    r = simulate(Schedule.build("1f1b", 2, 2), fwd=1.0, bwd=2.0, reduce=5.0)
    ev = {e.name: e for e in r.events}
    assert ev["0REDUCE_GRAD"].start == ev["0B1"].end and ev["0REDUCE_GRAD"].lane == "comm"
    assert r.step_time == pytest.approx(ev["0B1"].end + 5.0)


# ---------------------------------------------------------------------------------------------
# zero bubble
# ---------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_zb_h1_closed_form():
    """Zero-bubble paper: ZB-H1's bubble is ``(p−1)(t_f + t_i − t_w)`` against 1F1B's
    ``(p−1)(t_f + t_i + t_w)`` (``t_i + t_w = t_b``), for ``m ≥ p`` and ``t_w ≤ t_f``."""
    for p in range(1, 8):
        for m in range(p, 17):
            for tf, tb, tw in [(1.0, 2.0, 1.0), (1.0, 2.0, 0.5), (2.0, 3.0, 1.0)]:
                r = simulate(Schedule.build("zb-h1", p, m), fwd=tf, bwd=tb, wgrad=tw)
                ti = tb - tw
                assert r.step_time == pytest.approx(m * (tf + tb) + (p - 1) * (tf + ti - tw)), (p, m, tf, tb, tw)


def test_zb_h1_bubble_below_1f1b():
    for p in range(2, 7):
        for m in (1, 2, p, 2 * p + 1):
            base = simulate(Schedule.build("1f1b", p, m), 1.0, 2.0)
            zb = simulate(Schedule.build("zb-h1", p, m), 1.0, 2.0)            # W = bwd/2
            assert zb.bubble_fraction < base.bubble_fraction - 1e-9
            assert zb.busy == pytest.approx(base.busy)
            # W free: nothing to move into the bubble
            zb0 = simulate(Schedule.build("zb-h1", p, m), 1.0, 2.0, wgrad=0.0)
            assert zb0.step_time == pytest.approx(base.step_time)
            # the default W is bwd/2
            zb_half = simulate(Schedule.build("zb-h1", p, m), 1.0, 2.0, wgrad=1.0)
            assert zb_half.step_time == pytest.approx(zb.step_time)


# ---------------------------------------------------------------------------------------------
# memory
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["gpipe", "1f1b", "eager-1f1b"])
def test_peak_memory_one_chunk(name):
    """Activations in flight: GPipe ``m``, 1F1B ``min(m, p−r)`` (rank 0: ``p``), eager-1F1B
    ``min(m, 2(p−r)−1)`` microbatches (``fxpar.cost.pipeline.warmup_forwards``)."""
    a, st = 3.0, 10.0
    for p in range(1, 7):
        for m in range(1, 13):
            r = simulate(Schedule.build(name, p, m), act_bytes=a, static_bytes=st)
            want = [m if name == "gpipe" else min(m, p - s) if name == "1f1b" else min(m, 2 * (p - s) - 1)
                    for s in range(p)]
            assert r.peak_memory == pytest.approx([st + a * w for w in want]), (p, m)
            assert want == [cp.in_flight_microbatches(name.replace("-", "_"), s, p, m) for s in range(p)]


def test_peak_memory_1f1b_rank0_and_gpipe():
    r = simulate(Schedule.build("1f1b", 4, 8), act_bytes=2.5)
    assert r.peak_memory[0] == pytest.approx(4 * 2.5)
    g = simulate(Schedule.build("gpipe", 4, 8), act_bytes=2.5)
    assert g.peak_memory == pytest.approx([8 * 2.5] * 4)


def test_peak_memory_interleaved_and_zb():
    """Interleaved: chunk activations in flight = Megatron's warm-up + 1 (cost.pipeline's count),
    each chunk holding its own bytes; ZB-H1: a microbatch lives until its W, at most ``min(m,p)``
    per rank, so the largest rank peak equals 1F1B's."""
    for p, m, v in [(2, 4, 2), (4, 8, 2), (3, 6, 3), (4, 4, 4)]:
        r = simulate(Schedule.build("interleaved", p, m, v), act_bytes=1.0)
        assert r.peak_memory == pytest.approx([cp.warmup_forwards("interleaved", s, p, m, v) for s in range(p)])
    for p in range(1, 7):
        for m in range(1, 13):
            zb = simulate(Schedule.build("zb-h1", p, m), act_bytes=1.0).peak_memory
            ref = simulate(Schedule.build("1f1b", p, m), act_bytes=1.0).peak_memory
            assert zb == pytest.approx([min(m, p)] * p) and max(zb) == max(ref)


def test_looped_bfs_bubble_and_memory():
    """Looped BFS with ``m ≥ p``: a rank's next chunk always has queued microbatches while the
    pipeline fills, so the bubble is ``(p−1)(t_f+t_b)`` over ``m·v(t_f+t_b)`` of work, as
    interleaved 1F1B's; with ``m < p`` each of the first ``v−1`` rounds waits ``p`` slots for
    its microbatch to come round (cost.pipeline's closed form). Every chunk's activations of
    every microbatch are alive when the backward starts (``m·v`` chunk activations)."""
    tf, tb = 0.5, 1.25
    for p in range(1, 7):
        for m in range(1, 13):
            for v in (1, 2, 3):
                s = Schedule.build("looped-bfs", stages=p, microbatches=m, chunks=v)
                r = simulate(s, tf, tb, act_bytes=1.0)
                if m >= p:
                    assert r.bubble_fraction == pytest.approx((p - 1) / (v * m), abs=1e-9)
                    assert r.step_time == pytest.approx((m * v + p - 1) * (tf + tb), abs=1e-9)
                assert r.bubble_fraction == pytest.approx(
                    cp.bubble_fraction("looped_bfs", p, m, v), abs=1e-9), (p, m, v)
                assert r.peak_memory == pytest.approx([m * v] * p)
                assert [cp.in_flight_microbatches("looped_bfs", q, p, m, v) for q in range(p)] \
                    == pytest.approx([m] * p)


def test_interleaved_zero_bubble_below_interleaved():
    """Deferring the weight gradients into the bubble (with ``I + W = B``) never lengthens the
    step of interleaved 1F1B and shortens it wherever there is a bubble (``p > 1``)."""
    for p, m, v in [(2, 4, 2), (4, 8, 2), (4, 4, 3), (3, 6, 2), (1, 4, 2)]:
        zb = simulate(Schedule.build("interleaved-zb", p, m, v), fwd=1.0, bwd=2.0).step_time
        il = simulate(Schedule.build("interleaved", p, m, v), fwd=1.0, bwd=2.0).step_time
        assert zb <= il + 1e-9 and (p == 1 or zb < il), (p, m, v, zb, il)


def test_zbv_below_zb_h1_at_the_same_work():
    """ZB-V's two half-stage chunks per rank (per chunk ``t/2``) against ZB-H1's one stage
    (``t``), ``I + W = B``: the V never lengthens the step and holds no more than ZB-H1's
    ``min(m, p)`` microbatches of a stage (``2·min(m, p)`` half-stage chunks)."""
    for p in range(1, 6):
        for m in range(1, 11):
            v = simulate(Schedule.build("zbv", p, m, 2), fwd=1.0, bwd=2.0, act_bytes=0.5)
            h = simulate(Schedule.build("zb-h1", p, m), fwd=2.0, bwd=4.0, act_bytes=1.0)
            assert v.step_time <= h.step_time + 1e-9, (p, m, v.step_time, h.step_time)
            assert max(v.peak_memory) <= max(h.peak_memory) + 1e-9, (p, m)


def test_per_rank_static_and_per_chunk_activations():
    s = Schedule.build("interleaved", 2, 2, 2)     # rank 0 holds chunks 0 and 2
    r = simulate(s, act_bytes=[1.0, 0.0, 10.0, 0.0], static_bytes=[100.0, 200.0])
    # rank 0 runs 0F0 0F1 2F0 2F1 before any backward: 2·1 + 2·10
    assert r.peak_memory == pytest.approx([122.0, 200.0])


# ---------------------------------------------------------------------------------------------
# trace and errors
# ---------------------------------------------------------------------------------------------
def test_chrome_trace(tmp_path):
    s = Schedule.build("interleaved", 4, 4, 2)
    res = simulate(s, fwd=1.0, bwd=2.0, comm=0.1)
    path = tmp_path / "trace.json"
    d = res.to_chrome_trace(str(path))
    loaded = json.loads(path.read_text())
    assert loaded == json.loads(json.dumps(d))
    ev = loaded["traceEvents"]
    xs = [e for e in ev if e["ph"] == "X"]
    assert {e["pid"] for e in xs} == {0, 1, 2, 3}
    names = {e["pid"]: e["args"]["name"] for e in ev if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {r: f"rank {r}" for r in range(4)}
    assert {e["tid"] for e in xs} == {"compute", "comm"}
    assert sorted(e["name"] for e in xs) == sorted(str(a) for acts in s.actions.values() for a in acts)
    for e in xs:
        a = Action.parse(e["name"])
        assert e["pid"] == s.rank_of(a.stage)
        assert e["tid"] == ("compute" if a.is_compute else "comm")
        assert e["dur"] >= 0 and e["ts"] >= 0
    assert max(e["ts"] + e["dur"] for e in xs) == pytest.approx(res.step_time * 1e6)


def test_result_is_frozen_and_consistent():
    r = simulate(Schedule.build("1f1b", 3, 4), 1.0, 2.0)
    with pytest.raises(AttributeError):
        r.step_time = 0.0
    assert r.idle == pytest.approx([r.step_time - b for b in r.busy])
    assert r.ideal == pytest.approx(max(r.busy))
    assert isinstance(r, SimResult) and len(r.events) == sum(len(a) for a in Schedule.build("1f1b", 3, 4).actions.values())


def test_bad_inputs():
    s = Schedule.build("1f1b", 2, 2)
    with pytest.raises(ScheduleError, match="fwd: 3 entries"):
        simulate(s, fwd=[1.0, 1.0, 1.0])
    with pytest.raises(ScheduleError, match="static_bytes"):
        simulate(s, static_bytes=[1.0])
    with pytest.raises(ScheduleError, match="wgrad"):
        simulate(Schedule.build("zb-h1", 2, 2), fwd=1.0, bwd=2.0, wgrad=3.0)
    with pytest.raises(ScheduleError, match="fxpar.Schedule"):
        simulate({0: []})
    with pytest.raises(ScheduleError, match="fwd"):
        simulate(s, fwd="fast")


# ---------------------------------------------------------------------------------------------
# shared compute (rate): ranks on fewer cores than they have threads
# ---------------------------------------------------------------------------------------------
def one_core(k: int) -> float:
    """One core between the ranks, each action's duration measured alone: ``1/k``."""
    return 1.0 / k


def test_shared_core_1f1b_hand_derived():
    """1F1B, 2 ranks, 2 microbatches, t_f = t_b = 1 on one core. r0 F0 alone [0, 1]; r0 F1 and
    r1 F0 share it [1, 3]; r1 B0 alone [3, 4]; r0 B0 and r1 F1 share it [4, 6]; r1 B1 alone
    [6, 7]; r0 B1 alone [7, 8]: the core never idles, 8 = all the work."""
    r = simulate(Schedule.build("1f1b", 2, 2), fwd=1.0, bwd=1.0, rate=one_core)
    got = {(e.rank, e.name): (e.start, e.end) for e in r.events if e.lane == "compute"}
    assert got == {(0, "0F0"): (0, 1), (0, "0F1"): (1, 3), (0, "0B0"): (4, 6), (0, "0B1"): (7, 8),
                   (1, "1F0"): (1, 3), (1, "1B0"): (3, 4), (1, "1F1"): (4, 6), (1, "1B1"): (6, 7)}
    assert r.step_time == 8 and r.busy == (6, 6)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", [(2, 1), (2, 4), (4, 2), (4, 8)])
def test_shared_core_step_is_all_the_work(name, p, m):
    """On one core some rank always computes (each waits only for another's compute), so the
    step is the work of all ranks, ``p·m·(t_f + t_b)``, not ``(m+p−1)(t_f + t_b)``."""
    r = simulate(Schedule.build(name, p, m), fwd=0.5, bwd=1.25, rate=one_core)
    assert r.step_time == pytest.approx(p * m * 1.75)


def test_measured_at_full_load_runs_faster_alone():
    """4 ranks on 2 cores, the durations measured with all 4 busy and a rank alone measured
    at twice that speed (:func:`host_rate` of ``shared = (2, 2, 4/3, 1)``): GPipe with one
    microbatch runs one action at a time, each at twice its measured speed:
    ``p·(t_f + t_b)/2``."""
    rate = host_rate(_host((2.0, 2.0, 4 / 3, 1.0)), 1)
    r = simulate(Schedule.build("gpipe", 4, 1), fwd=1.0, bwd=2.0, rate=rate)
    assert r.step_time == pytest.approx(4 * 3.0 / 2)
    assert simulate(Schedule.build("gpipe", 4, 1), fwd=1.0, bwd=2.0).step_time == 12.0


def test_rate_one_changes_nothing():
    """``rate ≡ 1`` is the fixed-duration model, event for event (zb-h1, transfers, reductions)."""
    s = Schedule.build("zb-h1", 3, 5)
    kw = dict(fwd=[1.0, 1.5, 0.5], bwd=2.0, comm=0.3, reduce=0.7)
    assert simulate(s, rate=lambda k: 1.0, **kw).events == simulate(s, **kw).events


def test_bad_rate():
    with pytest.raises(ScheduleError, match=r"rate\(1\) must be a positive number"):
        simulate(Schedule.build("gpipe", 2, 1), rate=lambda k: 0.0)


def _host(shared: tuple[float, ...], nodes: int = 1) -> Cluster:
    """A cluster whose measured compute ran at ``shared[k-1]`` with ``k`` ranks busy."""
    cp = ComputeProfile(gemm=((1e6, 1e9),), memory=((1e6, 1e9),), op_overhead=0.0,
                        bwd_op_overhead=0.0, ranks=len(shared), shared=shared)
    return Cluster.local(len(shared), nodes=nodes, compute=cp)


def test_host_rate_reads_the_measured_curve_by_busy_processes():
    curve = (2.1, 1.9, 1.5, 1.3, 1.2, 1.1, 1.05, 1.0)
    # 8 ranks as 2 pipeline ranks of 4 (dp x tp): one computing keeps 4 busy
    r = host_rate(_host(curve), 4)
    assert (r(1), r(2)) == (1.3, 1.0)
    r = host_rate(_host(curve), 1)
    assert [r(k) for k in range(1, 9)] == list(curve)
    assert host_rate(_host(curve, nodes=2), 1) is None   # several hosts: not modelled
    assert host_rate(Cluster.local(4), 1) is None        # no measured compute
    with pytest.raises(fxpar.FxparError, match="shared needs one positive speed"):
        _host((1.0, 0.0))
    with pytest.raises(fxpar.FxparError, match="shared needs one positive speed"):
        ComputeProfile(gemm=((1e6, 1e9),), memory=((1e6, 1e9),), op_overhead=0.0,
                       bwd_op_overhead=0.0, ranks=4, shared=(2.0, 1.0))
