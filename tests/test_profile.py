"""``runner.profile()``, ``Profile.compare`` and ``Cluster.refine`` (issue #24 item 6): the
closed loop from measured steps back to the cluster's rates, on 2 gloo ranks."""

from __future__ import annotations

import json

import pytest
import torch

pytestmark = [pytest.mark.dist]


def _gpt():
    from examples.models import GPT

    torch.manual_seed(0)
    m = GPT(vocab=64, d_model=64, n_heads=4, n_layers=2, seq_len=32)
    x = torch.randint(0, 64, (8, 32), generator=torch.Generator().manual_seed(1))
    return m, (x, x.roll(1, 1))


def _opt(ps):
    return torch.optim.AdamW(ps, lr=1e-3)


def _measure(cluster, plan: str, mesh: dict, steps: int = 5):
    import fxpar

    m, batch = _gpt()
    prog = fxpar.compile(m, cluster, batch, plan=plan, mesh=mesh, optimizer=_opt, time_limit=20)
    runner = prog.runner()
    return prog.plan, runner.profile(*batch, steps=steps)


def refine_worker(trace: str, attempts: int = 3):
    """Profile dp, refine the cluster on it; then megatron (another plan) priced on the
    nominal and on the refined cluster against its measured step. The measurements are
    wall-clock times on shared cores, and a load burst during one profile (a comm scale
    fitted 39x too high, seen once) says nothing about ``refine``: the whole loop is measured
    again, up to ``attempts`` times, until the refined prediction is the closer one (a
    ``refine`` that does not help fails every attempt)."""
    import torch.distributed as dist

    import fxpar

    nominal = fxpar.Cluster.local(dist.get_world_size())
    for attempt in range(attempts):
        plan_dp, prof_dp = _measure(nominal, "dp", {"dp": 2})
        refined = nominal.refine(prof_dp)
        plan_mt, prof_mt = _measure(nominal, "megatron", {"tp": 2})
        plan_mt2, _ = _measure(refined, "megatron", {"tp": 2}, steps=1)
        err = [abs(t - prof_mt.step) for t in (plan_mt2.time, plan_mt.time)]
        closer = torch.tensor(float(err[0] < err[1]))
        dist.all_reduce(closer, op=dist.ReduceOp.MIN)   # every rank stops at the same attempt
        if closer.item():
            break
    text = prof_dp.compare(plan_dp, trace=trace)
    return dict(text=text, scales=prof_dp.scales(), layers=prof_dp.layers(),
                coll=prof_mt.collectives(), measured=prof_mt.step, optimizer=prof_mt.optimizer,
                nominal=plan_mt.time, refined=plan_mt2.time, compute=sum(
                    n.fwd + n.bwd for n in prof_mt.nodes if n.kind == "compute"),
                nodes=len(prof_mt.nodes), profile=prof_dp.to_dict(), attempts=attempt + 1,
                blocking={k: {n.edge: n.blocking for n in p.nodes if n.kind == "comm"}
                          for k, p in (("dp", prof_dp), ("megatron", prof_mt))})


@pytest.mark.timeout(300)
def test_profile_compare_and_refine(pools, tmp_path):
    import fxpar

    trace = str(tmp_path / "trace.json")
    res = pools(2).run(refine_worker, trace)
    r = res[0]
    # the table names every layer with both sides, and the collectives
    assert "blocks.0" in r["text"] and "fwd pred" in r["text"] and "fwd meas" in r["text"]
    assert set(r["layers"]) >= {"blocks.0", "blocks.1", "head"}
    assert all(v["fwd"] > 0 and v["bwd"] > 0 for k, v in r["layers"].items() if k.startswith("blocks."))
    # megatron's collectives were measured, each mapped to a planned edge with a prediction
    assert r["coll"] and all(v["measured"] > 0 and v["predicted"] > 0 for v in r["coll"].values()), r["coll"]
    # megatron's all-reduces are waited where launched (their measured time is their
    # duration); dp's gather of the targets is launched first and waited at the loss
    # (overlapped), so it is not what refine scales communication by
    assert all(r["blocking"]["megatron"][e] for e in r["coll"] if "output" not in e), r["blocking"]
    early = [b for e, b in r["blocking"]["dp"].items() if e.startswith("targets->")]
    assert early == [False], r["blocking"]["dp"]
    # the measured parts add up to at most the measured step (forward, backward, optimizer)
    assert 0 < r["compute"] + sum(v["measured"] for v in r["coll"].values()) + r["optimizer"] <= r["measured"]
    # a Chrome trace with a measured and a predicted lane
    events = json.load(open(str(tmp_path / "trace.rank0.json")))["traceEvents"]
    assert {e["pid"] for e in events if e.get("ph") == "X"} == {0, 1}
    # the closed loop: refined on dp, the prediction of megatron's step gets closer
    err = lambda t: abs(t - r["measured"]) / r["measured"]  # noqa: E731
    assert err(r["refined"]) < err(r["nominal"]), (r["refined"], r["nominal"], r["measured"], r["scales"])
    # a profile survives JSON
    p = fxpar.Profile.from_dict(json.loads(json.dumps(r["profile"])))
    assert p.scales() == r["scales"]


def pipeline_worker():
    import torch.distributed as dist

    import fxpar

    m, batch = _gpt()
    prog = fxpar.compile(m, fxpar.Cluster.local(dist.get_world_size()), batch, mesh={"pp": 2},
                         microbatches=2, optimizer=_opt, time_limit=20)
    prof = prog.runner().profile(*batch, steps=2)
    return prof.to_dict(), prof.compare(trace=None)


@pytest.mark.timeout(300)
def test_pipeline_profile_per_action(pools):
    """A pp=2 pipeline: every action of each rank timed per microbatch beside its chunk's
    prediction; compute actions predicted and measured, the table printed."""
    import fxpar

    for rank, (d, text) in enumerate(pools(2).run(pipeline_worker)):
        p = fxpar.Profile.from_dict(d)
        kinds = {(a.kind, a.stage) for a in p.actions}
        assert ("F", rank) in kinds and ({("B", rank), ("I", rank)} & kinds), kinds
        assert (("SEND_F", 0) in kinds) if rank == 0 else (("RECV_F", 1) in kinds), kinds
        compute = [a for a in p.actions if a.kind in ("F", "B", "I", "W")]
        assert all(a.measured > 0 and a.predicted > 0 for a in compute if a.kind != "W"), compute
        assert {a.microbatch for a in compute} == {0, 1} and p.microbatches == 2
        assert "pipeline actions" in text and "compute" in p.scales()
        assert sum(a.measured for a in p.actions) <= p.step


def _pipe_profile(m, f, slope=2.0, fixed=3e-3):
    """A pipeline rank's profile at ``m`` microbatches whose forward was predicted ``f`` s
    and backward ``2f``, measured ``slope·pred + fixed``."""
    from fxpar.runtime.profile import ActionTime, Profile

    acts = tuple(ActionTime(k, 0, i, slope * pred + fixed, pred)
                 for i in range(m) for k, pred in (("F", f), ("B", 2 * f)))
    return Profile((), 0.1, 3, actions=acts + (ActionTime("RECV_B", 0, 0, 0.01, 0.0),),
                   microbatches=m)


def test_refine_fits_the_per_action_overhead_from_two_microbatch_counts():
    """Actions measured at ``2·predicted + 3 ms``: from two microbatch counts the refined
    cluster computes at half the rate and charges 3 ms per action; from one the fixed part
    cannot be told apart and the ratio of sums is kept (no overhead)."""
    import fxpar

    c = fxpar.Cluster.local(2)
    r = c.refine(_pipe_profile(2, 0.02), _pipe_profile(8, 0.005))
    assert r.peak_flops == pytest.approx(c.peak_flops / 2)
    assert r.physics.microbatch_overhead == pytest.approx(3e-3)
    one = c.refine(_pipe_profile(2, 0.02))
    assert one.physics is None and one.peak_flops == pytest.approx(c.peak_flops / (2 + 3e-3 / 0.03))
    # no per-action cost to find: nothing but the rate changes
    flat = c.refine(_pipe_profile(2, 0.02, fixed=0.0), _pipe_profile(8, 0.005, fixed=0.0))
    assert flat.physics is None and flat.peak_flops == pytest.approx(c.peak_flops / 2)


def shared_cores_worker():
    """A GPipe pp=2 m=2 profile's predicted actions on a cluster whose two ranks share one
    core's worth of speed (alone a rank computes 2x as fast) and on the same without it."""
    import dataclasses

    import torch.distributed as dist

    import fxpar
    from fxpar.cluster import ComputeProfile

    cp = ComputeProfile(gemm=((1e3, 1e9), (1e9, 1e10)), memory=((1e3, 1e9), (1e9, 1e10)),
                        op_overhead=1e-6, bwd_op_overhead=2e-6, ranks=2, shared=(2.0, 1.0))
    out = []
    for shared in (cp.shared, ()):
        cluster = fxpar.Cluster.local(dist.get_world_size(),
                                      compute=dataclasses.replace(cp, shared=shared))
        m, batch = _gpt()
        prog = fxpar.compile(m, cluster, batch, mesh={"pp": 2}, schedule="gpipe",
                             microbatches=2, optimizer=_opt, time_limit=20)
        prof = prog.runner().profile(*batch, steps=1)
        out.append({f"{a.kind}{a.stage}.{a.microbatch}": a.predicted for a in prof.actions
                    if a.kind in ("F", "B")})
    return out


@pytest.mark.timeout(300)
def test_pipeline_profile_predicts_actions_at_the_shared_speed(pools):
    """Where ranks share a host's cores the plan runs an action alone at the speed the others
    leave it, and its profile predicts it so: in GPipe rank 0's first forward (rank 1 waits
    for it) and last backward (rank 1 done), rank 1's last forward (rank 0 done) and first
    backward (rank 0 waits for it) run alone, predicted at half the time of the same plan
    without sharing; the others overlap, at most as fast. So refine fits the rate at every
    rank busy, which the simulation speeds up again."""
    for rank, (shared, plain) in enumerate(pools(2).run(shared_cores_worker)):
        assert shared.keys() == plain.keys() and plain
        ratio = {k: shared[k] / plain[k] for k in plain}
        alone = ("F0.0", "B0.1") if rank == 0 else ("F1.1", "B1.0")
        assert all(ratio[k] == pytest.approx(0.5) for k in alone), ratio
        assert all(0.5 - 1e-9 <= r <= 1.0 + 1e-9 for r in ratio.values()), ratio


def _spmd_profile(pred, hidden, measured, comm=None):
    """An SPMD rank's profile: compute predicted ``pred`` s and measured ``measured``, under
    ``hidden`` s of predicted bucketed gradient reductions; ``comm``: a blocking collective
    ``(measured, predicted)``."""
    from fxpar.runtime.profile import NodeTime, Profile

    nodes = [NodeTime("mm", "fc", "compute", None, measured, 0.0, pred, 0.0),
             NodeTime("(gradient sync)", "(params)", "comm", "(gradient sync)", 0.0, 1e-4, 0.0, hidden)]
    if comm is not None:
        nodes.append(NodeTime("ar", "fc", "comm", "mm->add", comm[0], 0.0, comm[1], 0.0))
    return Profile(tuple(nodes), 0.1, 3)


def test_refine_fits_the_interference_of_hidden_communication():
    """Two plans, compute predicted 10 ms each, measured 1.5x that plus 0.4 s of compute per
    second of communication hidden under it (0 and 5 ms predicted hidden; collectives at 2x
    their predicted time): the refined cluster computes at 1/1.5 of the rate and its
    ``comm_interference``, which multiplies the refined (2x) collective seconds, is 0.2. One
    plan cannot tell interference from rate (the ratio stands, ``comm_interference`` kept);
    compute slower where less is hidden fits no negative interference: 0."""
    import dataclasses

    import fxpar

    c = dataclasses.replace(fxpar.Cluster.local(2), comm_interference=0.7)
    a = _spmd_profile(10e-3, 0.0, 15e-3, comm=(2e-3, 1e-3))
    b = _spmd_profile(10e-3, 5e-3, 15e-3 + 0.4 * 5e-3)
    assert a.scales(b) == pytest.approx({"compute": 1.5, "comm": 2.0, "interference": 0.4})
    r = c.refine(a, b)
    assert r.peak_flops == pytest.approx(c.peak_flops / 1.5)
    assert r.intra_node_bandwidth == pytest.approx(c.intra_node_bandwidth / 2)
    assert r.comm_interference == pytest.approx(0.2)
    assert "interference" not in b.scales() and c.refine(b).comm_interference == 0.7
    faster = _spmd_profile(10e-3, 5e-3, 14e-3)
    assert a.scales(faster)["interference"] == 0.0
    assert c.refine(a, faster).comm_interference == 0.0


def test_nominal_physics_prices_as_no_physics():
    """``Physics.nominal()`` (what a refined cluster without physics gets) changes no price
    of compute or communication: the same plan on a preset without physics and with it. It
    adds the optimizer step, which physics prices and the flat roofline does not:
    memory-bound at its 80%, 28 bytes an element of mixed-precision AdamW (16 bytes of model
    states an element), no fixed cost."""
    import dataclasses

    import fxpar
    from examples.models import GPT

    c = fxpar.Cluster.preset("dgx-a100", physics=None)
    x = torch.randint(0, 64, (4, 16))
    none, nominal = [fxpar.plan(GPT(64, 32, 2, 2, 16), cl, (x,), mesh={"dp": 2, "tp": 4}).plan
                     for cl in (c, dataclasses.replace(c, physics=fxpar.cluster.Physics.nominal()))]
    assert (none.compute, none.comm, none.summed_time) == (nominal.compute, nominal.comm,
                                                          nominal.summed_time)
    elements = sum(n.memory for n in nominal.nodes if n.param) / 16
    assert nominal.time - none.time == pytest.approx(
        28 * elements / (c.memory_bandwidth * 0.8), rel=1e-9)


def test_the_gradient_sync_wait_does_not_scale_communication():
    """The gradient sync measures the wait its buckets left exposed after the backward, not
    their duration (what the plan predicts for it), an overlapped collective its launch and
    exposed wait, a pipeline send its launch: refine's communication scale comes from the
    blocking collectives only."""
    from fxpar.runtime.profile import ActionTime, NodeTime, Profile

    mm = NodeTime("mm", "fc", "compute", None, 2e-3, 4e-3, 1e-3, 2e-3)
    ar = NodeTime("ar", "fc", "comm", "mm->add", 3e-3, 0.0, 1e-3, 0.0)
    sync = NodeTime("(gradient sync)", "(params)", "comm", "(gradient sync)", 0.0, 0.05, 0.0, 0.01)
    assert Profile((mm, ar, sync), 0.1, 3).scales() == {"compute": 2.0, "comm": 3.0}
    assert "comm" not in Profile((mm, sync), 0.1, 3).scales()
    early = NodeTime("ag", "fc", "comm", "x->mm", 1e-4, 0.0, 1e-3, 0.0, blocking=False)
    assert Profile((mm, ar, early), 0.1, 3).scales() == {"compute": 2.0, "comm": 3.0}
    send = ActionTime("SEND_F", 0, 0, 1e-5, 1e-3)
    assert "comm" not in Profile((mm,), 0.1, 3, actions=(send,)).scales()


def _zb_profile(m, f, split, slope=2.0, fixed=3e-3):
    """A zero-bubble pipeline's two ranks at ``m`` microbatches: chunk 0 runs ``F`` (``f``)
    and its whole backward as ``I`` (``2f``) with an empty ``W``, chunk 1 ``F`` and halves
    ``I``/``W`` predicted ``f`` each; every action measured ``slope·pred + fixed``, chunk 1's
    halves at ``split`` times that rate."""
    from fxpar.runtime.profile import ActionTime, Profile

    acts = []
    for i in range(m):
        acts += [ActionTime("F", 0, i, slope * f + fixed, f),
                 ActionTime("I", 0, i, slope * 2 * f + fixed, 2 * f),
                 ActionTime("W", 0, i, 1e-6, 0.0),
                 ActionTime("F", 1, i, slope * f + fixed, f),
                 ActionTime("I", 1, i, split * slope * f + fixed, f),
                 ActionTime("W", 1, i, split * slope * f + fixed, f)]
    return Profile((), 0.1, 3, actions=tuple(acts), microbatches=m)


def test_refine_fits_the_split_backward():
    """The halves of chunk 1's split backward measured at 1.7x the rate its forward and chunk
    0's unsplit backward give: the refined cluster prices ``(I + W) / B`` at 1.7 (with the
    per-action overhead fitted from two microbatch counts, or none from one), and a cluster
    already at 1.7 whose profile predicted that is left there."""
    import dataclasses

    import fxpar
    from fxpar.cluster import Physics

    c = fxpar.Cluster.local(2)
    two = c.refine(_zb_profile(2, 0.02, 1.7), _zb_profile(8, 0.005, 1.7))
    assert two.physics.split_backward == pytest.approx(1.7)
    assert two.physics.microbatch_overhead == pytest.approx(3e-3)
    assert two.peak_flops == pytest.approx(c.peak_flops / 2)
    one = c.refine(_zb_profile(4, 0.01, 1.7, fixed=0.0))
    assert one.physics.split_backward == pytest.approx(1.7)
    # the profile of a plan priced at 1.7 predicted the halves at 1.7: measured so, the
    # factor stays; measured at the unsplit rate, it goes back to 1
    at = dataclasses.replace(c, physics=dataclasses.replace(Physics.nominal(), split_backward=1.7))
    for measured, want in ((1.7, 1.7), (1.0, 1.0)):
        p = _zb_profile(4, 0.01, measured, fixed=0.0)
        p = dataclasses.replace(p, actions=tuple(
            dataclasses.replace(a, predicted=a.predicted * 1.7) if a.stage and a.kind in "IW" else a
            for a in p.actions))
        assert at.refine(p).physics.split_backward == pytest.approx(want)
    # not a split (1F1B): no split factor
    assert "split" not in _pipe_profile(2, 0.02).scales()
