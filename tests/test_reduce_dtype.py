"""``PlannerOptions.reduce_dtype``: the planner prices gradients reduced in another dtype than
the parameters' (bf16 parameters, fp32 gradient reductions: Megatron-LM's
``accumulate_allreduce_grads_in_fp32``, FSDP2's ``MixedPrecisionPolicy(reduce_dtype=)``) as
the runtime runs them (``Program.runner(reduce_dtype=)``): every gradient reduction moves the
reduce dtype's bytes, the gradients occupy them, and a plan's runners reduce in it."""

from __future__ import annotations

import pytest
import torch

import fxpar
from fxpar.cost import amsp
from fxpar.cost.memory import model_state_bytes, reduce_scale
from fxpar.cost.step import DpTerms, chunk_costs, dp_terms, step_time
from fxpar.errors import PlanError
from fxpar.planner import PlannerOptions
from fxpar.planner.joint import search
from fxpar.planner.price import state_bytes
from fxpar.schedule import Schedule


def test_options_name_a_floating_dtype_and_record_it():
    o = PlannerOptions(reduce_dtype=torch.float32)
    assert o.reduce_dtype == "float32" and o == PlannerOptions(reduce_dtype="float32")
    assert o.to_dict()["reduce_dtype"] == "float32"
    assert "reduce_dtype" not in PlannerOptions().to_dict()   # plans without it keep their hash
    for bad in ("int8", torch.long, "fp99"):
        with pytest.raises(PlanError, match=r"PlannerOptions\.reduce_dtype"):
            PlannerOptions(reduce_dtype=bad)


def test_gradients_occupy_the_reduce_dtype():
    """``k_G``: Adam in mixed precision holds 2 bytes of gradient per parameter, 4 in fp32."""
    assert state_bytes(PlannerOptions()) == (2, 2, 12)
    assert state_bytes(PlannerOptions(reduce_dtype="float32")) == (2, 4, 12)
    assert state_bytes(PlannerOptions(precision="fp32", reduce_dtype="bfloat16")) == (4, 2, 8)
    assert model_state_bytes(10, reduce_dtype=torch.float32, s_g=2).grads == 20
    assert reduce_scale("bf16", torch.float32) == 2.0


def test_gradient_collectives_move_the_reduce_dtype_bytes():
    """Latency-free, every term is bandwidth, linear in bytes: at twice the bytes, plain data
    parallelism's all-reduce (``T_os0``) and ZeRO-2's per-microbatch all-reduces (``T_g``)
    take twice as long; ZeRO-3's ``T_p`` is two gathers of the parameters (unchanged) and one
    reduce-scatter of the gradients (doubled): ``4/3``, half of it reduce-scatter; the
    updated parameters' gather (``T_os1``, ZeRO-1) moves parameters: unchanged."""
    c = fxpar.Cluster.preset("a800", physics=None, nodes=2).without_latency()
    args = (1e9, 10, 4, 8, 2)

    def pair(s_p, s_g, s_os):
        return [dp_terms(*args, s_p, s_g, s_os, c, "mixed", "flat", k) for k in (1.0, 2.0)]

    bf, fp = pair(1, 1, 1)
    assert bf.t_os0 > 0 and fp.t_os0 == pytest.approx(2 * bf.t_os0, rel=1e-12)
    bf, fp = pair(1, 16, 16)
    assert bf.t_g > 0 and fp.t_g == pytest.approx(2 * bf.t_g, rel=1e-12)
    bf, fp = pair(1, 1, 16)
    assert bf.t_os1 > 0 and fp.t_os1 == bf.t_os1
    bf, fp = pair(16, 16, 16)
    assert fp.t_p == pytest.approx(4 / 3 * bf.t_p, rel=1e-12)
    assert (bf.rs_share, fp.rs_share) == (pytest.approx(1 / 3), pytest.approx(0.5))
    # with latency, the count of collectives is the same: the bucket grows with the bytes
    lat = fxpar.Cluster.preset("a800", physics=None, nodes=2)
    sh = amsp.Sharding((1, 1), (1, 1), (1, 1))
    grads = 2 * 1e9
    bucket = grads / (1 + -(-(grads - 1 * 2**20) // (25 * 2**20)))
    want = amsp.t_os0(sh, 2e9, 2 * bucket, lat, dp=(8, 2))
    assert dp_terms(*args, 1, 1, 1, lat, "mixed", "flat", 2.0).t_os0 == pytest.approx(want)


def _unit(name, fwd, bwd, params):
    from fxpar.cost.step import UnitCost

    return UnitCost(name, name, fwd, bwd, 0.0, 0.0, 0.0, params, 0.0)


def test_exposed_reduce_scatter_is_its_share_of_t_p():
    """DeepSpeed's exposed reduce-scatters (``rs_exposed``) are ``rs_share`` of ``T_p``: with
    ``T_p = 4`` s at half, 2 s in the backward and 1 s of gathers per pass (0.5 s a unit; the
    first unit's exposed in each pass), two units of 1 s forward and 2 s backward."""
    chunks = chunk_costs([_unit(f"l{i}", 1.0, 2.0, 1.0) for i in range(2)], (0,))
    sched = Schedule.build("1f1b", stages=1, microbatches=1)
    st = step_time(sched, chunks, lambda k: (0, 0), [DpTerms(t_p=4.0, rs_exposed=True, rs_share=0.5)])
    assert st.step == pytest.approx((0.5 + 2) + (0.5 + 4 + 2))


def test_intra_op_plan_reduces_parameter_gradients_in_the_reduce_dtype():
    """A bf16 GPT under ``plan="dp"`` with fp32 reductions: each parameter's gradient edge
    moves and costs exactly what the same model in fp32 moves and costs (the solver and the
    plan's edges agree), twice the bf16 bytes; the plan holds 2 more bytes per parameter."""
    from examples.models import GPT

    torch.manual_seed(0)
    model = GPT(vocab=64, d_model=32, n_heads=2, n_layers=2, seq_len=8)
    idx = torch.zeros(8, 8, dtype=torch.long)
    cl = fxpar.Cluster.preset("dgx-a100", nodes=1)
    params = sum(p.numel() for p in model.parameters())

    def plan(m, opts=None):
        return fxpar.plan(m, cl, (idx,), plan="dp", mesh={"dp": 8}, options=opts, time_limit=20).plan

    def grads(p):
        names = {n.name for n in p.nodes if n.param}
        return {(e.producer, e.consumer): (sum(s.nbytes for s in e.steps), e.time) for e in p.edges
                if e.direction == "bwd" and e.producer in names}

    fp32 = plan(model)
    bf16 = plan(model.to(torch.bfloat16))
    mixed = plan(model, PlannerOptions(reduce_dtype="float32"))
    assert grads(mixed) == grads(fp32) and len(grads(fp32)) >= 10
    assert all(b[0] * 2 == f[0] for b, f in zip(grads(bf16).values(), grads(fp32).values()))
    assert mixed.options["reduce_dtype"] == "float32"
    assert "gradients reduced in float32" in mixed.explain()
    assert "gradients reduced in" not in bf16.explain()
    assert mixed.memory - bf16.memory == 2 * params


def test_joint_search_prices_the_reduce_dtype():
    """Data parallelism over 8 (ZeRO-2 and plain): 2 more bytes per parameter over ``s_g``
    (``rank_memory``), a slower step (the gradients' all-reduce and reduce-scatter move twice
    the bytes), the same configurations ranked."""
    from examples.models import GPT

    torch.manual_seed(0)
    model = GPT(vocab=64, d_model=32, n_heads=2, n_layers=4, seq_len=16)
    gm = fxpar.capture(model, (torch.randint(0, 64, (1, 16)),))
    cl = fxpar.Cluster.preset("dgx-a100", nodes=1)
    params = sum(p.numel() for p in model.parameters())
    for state in ((1, 1, 1), (1, 8, 8)):
        only = dict(pp=1, tp=1, dp=8, microbatch=2, recompute=False,
                    **dict(zip(("s_p", "s_g", "s_os"), state)))
        a, b = (search(gm, cl, batch=16, only=only, options=o).best
                for o in (PlannerOptions(), PlannerOptions(reduce_dtype="float32")))
        assert (a.s_p, a.s_g, a.s_os) == (b.s_p, b.s_g, b.s_os) == state
        assert b.memory - a.memory == pytest.approx(2 * params / state[1], rel=1e-6)
        assert b.step > a.step and b.dp_comm > a.dp_comm
