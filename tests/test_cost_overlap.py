"""Overlap of asynchronous communication with compute (issue #13 item 3): the pure model of
``cost/overlap.py`` against closed forms, and ``Plan.overlap`` on a toy ZeRO-3 plan whose
prefetched gather is hidden with a window and exposed without one."""

import pytest
import torch

import fxpar
from fxpar.cost.overlap import Comm, overlap


def test_closed_forms():
    # a gather issued before op 0 and needed by op 1 hides under op 0 when it is shorter
    r = overlap([3.0, 2.0], [Comm(2.0, 0, 1)])
    assert (r.step, r.exposed, r.hidden) == (5.0, 0.0, 2.0)
    # longer than the window: the excess is exposed
    r = overlap([3.0, 2.0], [Comm(4.0, 0, 1)])
    assert (r.step, r.exposed, r.hidden) == (6.0, 1.0, 3.0)
    # no window (issued where it is needed): all of it exposed
    assert overlap([3.0, 2.0], [Comm(2.0, 1, 1)]).exposed == 2.0
    # one channel: two 2 s gathers issued together finish at 2 and 4; ops of 1 s need them
    r = overlap([1.0, 1.0, 1.0], [Comm(2.0, 0, 1), Comm(2.0, 0, 2)])
    assert r.step == pytest.approx(5.0) and r.exposed == pytest.approx(2.0)
    # a reduction issued before the last op and waited at the end: max(0, t - c_last) exposed
    r = overlap([1.0, 1.5], [Comm(2.0, 1, 2)])
    assert r.exposed == pytest.approx(0.5) and r.hidden == pytest.approx(1.5)
    with pytest.raises(ValueError, match="issue <= need"):
        overlap([1.0], [Comm(1.0, 1, 0)])


def test_prefetched_gather_is_hidden_and_exposed_without_a_window():
    """ZeRO-3 MLP on dp=2 with slow compute: fc2's weight gathers start when fc1 runs
    (prefetch 1) and hide under it; in backward, fc1's re-gather starts when fc2's is done
    (backward prefetch) and hides under fc2's backward. With prefetch 0 both start where they
    are needed and are exposed, by exactly their time (one coalesced all-gather per layer, as
    the runtime issues them). fc1's forward gathers and fc2's re-gather have nothing before
    them: exposed either way."""
    from examples.models import MLP
    from fxpar.cost.comm import collective_time

    cl = fxpar.Cluster.local(2, peak_flops=1e9, memory_bandwidth=1e9)  # compute >> comm
    p = fxpar.plan(MLP(256, 512, 256), cl, (torch.randn(8, 256),), plan="zero3", mesh={"dp": 2}).plan
    # a layer's gathers (weight and bias) coalesce into one all-gather: priced by hand
    fwd_gather = {layer: collective_time("all_gather", sum(
        st.nbytes for e in p.edges if e.direction == "fwd" and e.layer == layer for st in e.steps),
        (0, 1), cl) for layer in ("fc1", "fc2")}
    fc1 = sum(n.fwd_time for n in p.nodes if n.layer == "fc1")
    assert 0 < fwd_gather["fc2"] < fc1  # the window is long enough
    regather = collective_time("all_gather", sum(
        st.nbytes for e in p.edges if e.direction != "fwd" and e.layer == "fc1"
        for st in e.steps if st.kind == "all_gather"), (0, 1), cl)
    fc2_bwd = sum(n.bwd_time for n in p.nodes if n.layer == "fc2")
    assert 0 < regather < fc2_bwd
    w1, w0 = p.overlap(1), p.overlap(0)
    assert w0.exposed - w1.exposed == pytest.approx(fwd_gather["fc2"] + regather, rel=1e-9)
    assert w1.exposed >= fwd_gather["fc1"] - 1e-15
    assert w1.step < p.summed_time  # the planner's sum counts every collective in full
    assert "communication exposed" in p.explain()


def test_gradient_reductions_coalesce_into_one_bucket():
    """Data parallelism on an MLP: the four parameter gradients are reduced as ONE all-reduce
    (one bucket, α paid once, as the runtime's model-state manager does), launched when the
    last gradient (fc1's, in the last backward op) is in: exposed in full. Priced by hand
    with cost.comm on the plan's own group; the plan's per-edge sum (what the solver
    minimizes) pays each gradient's bandwidth and its byte share of a 25 MiB bucket's α, so
    it lies between the latency-free reductions and the one bucket."""
    from examples.models import MLP
    from fxpar.cost.comm import collective_time

    cl = fxpar.Cluster.local(2)
    p = fxpar.plan(MLP(64, 128, 64), cl, (torch.randn(8, 64),), plan="dp", mesh={"dp": 2}).plan
    steps = [st for e in p.edges for st in e.steps]
    assert len(steps) == 4 and {st.kind for st in steps} == {"all_reduce"}
    bucket = collective_time("all_reduce", sum(st.nbytes for st in steps), (0, 1), cl)
    r = p.overlap()
    assert r.exposed == pytest.approx(bucket, rel=1e-9)
    assert r.step == pytest.approx(p.compute + bucket, rel=1e-9)
    free = sum(collective_time("all_reduce", st.nbytes, (0, 1), cl.without_latency()) for st in steps)
    assert free < p.comm < bucket
    # buckets of one parameter each: every reduction but the last runs under backward compute
    small = p.overlap(bucket_bytes=1)
    assert small.hidden > 0 and small.exposed < p.comm
    # a first bucket of one gradient (fc2's, made first) runs under fc1's backward; the
    # one bucket above has nothing after it to hide behind
    first = p.overlap(first_bucket_bytes=1)
    assert first.hidden > 0 and r.hidden == 0


def test_a_pipeline_plan_sends_you_to_its_stages():
    from examples.models import GPT

    m = GPT(vocab=64, d_model=32, n_heads=2, n_layers=2, seq_len=16)
    p = fxpar.compile(m, fxpar.Cluster.local(2), (torch.randint(0, 64, (4, 16)),),
                      mesh={"pp": 2, "dp": 1, "tp": 1}, microbatches=2, emit=False).plan
    with pytest.raises(fxpar.FxparError, match=r"stages\[k\]\.plan"):
        p.overlap()
    assert p.stages[0].plan.overlap().step > 0


@pytest.mark.parametrize("kind, shards, precision, tensors", [
    ("dp", 1, "mixed", 4), ("zero3", 2, "mixed", 4), ("dp", 1, "fp32", 1), ("zero3", 2, "fp32", 1)])
def test_optimizer_step_is_priced_per_local_parameter(kind, shards, precision, tensors):
    """With a measured optimizer price ``(per_tensor, per_element)``, the step ends with the
    optimizer over each rank's parameter elements: an MLP 64-128-64 has 4 tensors and
    8192 + 128 + 8192 + 64 = 16576 elements, all of them on each dp rank, half under ZeRO-3
    on 2 ranks (each tensor is sharded on dim 0). fp32 parameters with unsharded states are
    stepped flat, one tensor per gradient bucket (here all in the first 1 MiB one). The one
    step model (``Plan.time``) adds the same seconds after the step's last event."""
    import dataclasses

    from examples.models import MLP
    from fxpar.cluster import ComputeProfile
    from fxpar.planner.price import price_plan

    prof = ComputeProfile(gemm=((1e3, 1e10), (1e9, 1e10)), memory=((1e3, 1e10), (1e9, 1e10)),
                          op_overhead=0.0, bwd_op_overhead=0.0, optimizer=(1e-5, 1e-9))
    cl = fxpar.Cluster.local(2, compute=prof)
    p = fxpar.plan(MLP(64, 128, 64), cl, (torch.randn(8, 64),), plan=kind, mesh={"dp": 2},
                   options=fxpar.planner.PlannerOptions(precision=precision)).plan
    unpriced = dict(p.mesh, cluster={**p.mesh["cluster"],
                                     "compute": {**p.mesh["cluster"]["compute"], "optimizer": []}})
    base = dataclasses.replace(p, mesh=unpriced)
    want = tensors * 1e-5 + 16576 / shards * 1e-9
    assert p.overlap().step - base.overlap().step == pytest.approx(want, rel=1e-9)
    assert p.time - price_plan(base)[0].step == pytest.approx(want, rel=1e-9)


def test_a_shared_reshard_is_issued_after_its_producer():
    """A reshard shared by all consumers (``Strategy.shared``: Megatron's sequence-parallel
    all-gather of a norm's output, once for q, k and v) is an edge from the producer to
    itself: it starts after the producer and is needed by the next op, so with nothing to
    hide it under it is exposed in full (the replay used to refuse it: issue after need)."""
    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, use_cache=False)
    ids = torch.zeros(2, 16, dtype=torch.long)
    p = fxpar.plan(tf.LlamaForCausalLM(cfg), fxpar.Cluster.preset("dgx-a100"), (ids,),
                   {"labels": ids}, plan="megatron", mesh={"tp": 2}, sequence_parallel=True).plan
    shared = [e for e in p.edges if e.producer == e.consumer and e.direction == "fwd"]
    assert shared, "no shared reshard in this plan"
    w = p.overlap(0)
    compute = sum(n.fwd_time + n.bwd_time for n in p.nodes)
    assert w.exposed >= sum(e.time for e in shared) - 1e-15
    assert w.step >= compute + sum(e.time for e in shared) - 1e-12


def test_an_inputs_gather_is_issued_at_the_top():
    """The targets a mean loss reads whole are gathered from the top of the program, as
    passes/prefetch.py starts them: hidden behind the whole forward, though the unit before
    their use (the LM head) is too short to hide them; the replay's exposed time is the
    same as without that gather."""
    import dataclasses

    from examples.models import GPT

    cl = fxpar.Cluster.local(2, peak_flops=1e10, memory_bandwidth=1e10)
    x = torch.randint(0, 64, (4, 16))
    p = fxpar.plan(GPT(64, 32, 2, 2, 16), cl, (x, x), plan="dp", mesh={"dp": 2}).plan
    gather = next(e for e in p.edges if e.producer == "targets" and e.direction == "fwd")
    head = sum(n.fwd_time for n in p.nodes if n.layer == "head")
    forward = sum(n.fwd_time for n in p.nodes)
    assert head < gather.time < forward
    without = dataclasses.replace(p, edges=tuple(e for e in p.edges if e is not gather))
    assert p.overlap(1).exposed == pytest.approx(without.overlap(1).exposed, rel=1e-12)


def test_a_cpu_steps_flat_buckets_in_pieces():
    """On a CPU the runtime steps each flat bucket in pieces of CPU_STEP_PIECE (2**17)
    elements: an fp32 MLP 512-512-256 on dp=2 has 262144 + 512 + 131072 + 256 = 393 984
    elements, a first 1 MiB bucket of 262 144 (two pieces) and the rest (two), so the step
    pays four tensors' fixed seconds, not two buckets'; the replay and Plan.time agree."""
    import dataclasses

    from examples.models import MLP
    from fxpar.cluster import ComputeProfile
    from fxpar.planner.price import price_plan

    prof = ComputeProfile(gemm=((1e3, 1e10), (1e9, 1e10)), memory=((1e3, 1e10), (1e9, 1e10)),
                          op_overhead=0.0, bwd_op_overhead=0.0, optimizer=(1e-5, 1e-9))
    cl = fxpar.Cluster.local(2, compute=prof)
    p = fxpar.plan(MLP(512, 512, 256), cl, (torch.randn(8, 512),), plan="dp", mesh={"dp": 2},
                   options=fxpar.planner.PlannerOptions(precision="fp32")).plan
    unpriced = dict(p.mesh, cluster={**p.mesh["cluster"],
                                     "compute": {**p.mesh["cluster"]["compute"], "optimizer": []}})
    base = dataclasses.replace(p, mesh=unpriced)
    want = 4 * 1e-5 + 393984 * 1e-9
    assert p.overlap().step - base.overlap().step == pytest.approx(want, rel=1e-9)
    assert p.time - price_plan(base)[0].step == pytest.approx(want, rel=1e-9)
