"""fxpar.ParallelConfig: validation with rules named, round trips, and plans that carry it."""

from __future__ import annotations

import pytest
import torch

import fxpar
from fxpar import ParallelConfig, PlanError, ScheduleKind
from fxpar.config import recompute_set


def test_schedule_kind_prints_compares_and_hashes_as_its_name():
    k = ScheduleKind.parse("zb-h1")
    assert k is ScheduleKind.ZB_H1 and k == "zb-h1" and str(k) == "zb-h1" and f"{k}" == "zb-h1"
    assert {"zb-h1": 1}[k] == 1 and hash(k) == hash("zb-h1")
    with pytest.raises(PlanError, match="unknown schedule 'zb'"):
        ScheduleKind.parse("zb")


@pytest.mark.parametrize("kw, match", [
    (dict(dp=4, s_p=2, s_g=1), "state factors s_p=2 | s_g=1"),
    (dict(dp=4, s_os=3), "must each divide the next and dp=4"),
    (dict(chunks=2), "chunks=2 needs schedule='interleaved'"),
    (dict(pp=4, microbatches=6, schedule="interleaved", chunks=2), "microbatches=8"),
    (dict(pp=2, dp=4, s_p=2, s_g=2, s_os=2), "s_p=2 with a pipeline"),
    (dict(pp=2, dp=4, s_p=4, s_g=4, s_os=4, microbatches=0), "microbatches=0"),
    (dict(tp=0), "tp=0 must be a positive integer"),
    (dict(extra=(("dp", 2),)), "extra axis dp=2"),
])
def test_invalid_configurations_name_the_rule(kw, match):
    with pytest.raises(PlanError, match=match):
        ParallelConfig(**kw)


def test_v_schedules_default_to_two_chunks():
    """``chunks`` left out is the schedule's own (two for a V, one otherwise); a V with another
    explicit count is refused."""
    v = ParallelConfig(pp=2, microbatches=4, schedule="dualpipev")
    assert v.chunks == 2 and v == ParallelConfig(pp=2, microbatches=4, schedule="dualpipev", chunks=2)
    assert ParallelConfig(pp=2, microbatches=4).chunks == 1
    with pytest.raises(PlanError, match="dualpipev places two chunks per pipeline rank"):
        ParallelConfig(pp=2, microbatches=4, schedule="dualpipev", chunks=1)


def test_degrees_name_and_round_trip():
    c = ParallelConfig(dp=8, tp=2, s_p=4, s_g=4, s_os=8, recompute={"blocks.0", "(top)"})
    assert c.degrees == {"dp": 2, "dp_shard": 4, "tp": 2} and c.devices == 16
    assert c.recompute == frozenset({"blocks.0"})  # pseudo layers are not recomputable
    assert ParallelConfig.from_dict(c.to_dict()) == c and hash(c) == hash(ParallelConfig.from_dict(c.to_dict()))
    z = ParallelConfig(pp=2, dp=4, s_p=4, s_g=4, s_os=4, microbatches=4, schedule="1f1b")
    assert z.degrees == {"pp": 2, "dp": 4, "tp": 1}
    assert recompute_set(["(params)", "fc1"]) == {"fc1"}


def test_validate_against_cluster_and_batch():
    two = fxpar.Cluster.preset("dgx-a100", nodes=2)
    ParallelConfig(pp=2, dp=4, tp=2).validate(two, batch=8)
    with pytest.raises(PlanError, match=r"16 devices, the cluster has 8"):
        ParallelConfig(pp=2, dp=4, tp=2).validate(fxpar.Cluster.preset("dgx-a100"))
    with pytest.raises(PlanError, match=r"tp=3 neither divides a node's 4 devices"):
        ParallelConfig(dp=4, tp=3).validate(_cluster(nodes=3, per_node=4))
    with pytest.raises(PlanError, match="batch 4 is too small for dp=16 replicas"):
        ParallelConfig(dp=16).validate(two, batch=4)
    with pytest.raises(PlanError, match="dp=16 does not divide the batch 24"):
        ParallelConfig(dp=16).validate(two, batch=24)
    with pytest.raises(PlanError, match="is not the batch 32"):
        ParallelConfig(dp=16, microbatch=1, microbatches=1).validate(two, batch=32)
    with pytest.raises(PlanError, match=r"s_os=12 neither divides nor is a multiple of the 8"):
        ParallelConfig(dp=24, s_os=12).validate(fxpar.Cluster.preset("dgx-a100", nodes=3))


def _cluster(nodes: int, per_node: int):
    import dataclasses

    return dataclasses.replace(fxpar.Cluster.preset("dgx-a100"), devices_per_node=per_node,
                               nodes=nodes)


def test_user_tuple_keys_and_values_checked():
    from examples.models import GPT

    model = GPT(vocab=64, d_model=32, n_heads=2, n_layers=2, seq_len=16)
    x = torch.randint(0, 64, (8, 16))
    cl = fxpar.Cluster.preset("dgx-a100", nodes=2)
    with pytest.raises(PlanError, match=r"unknown keys \['zero'\]"):
        fxpar.plan(model, cl, (x,), plan=dict(zero=3))
    with pytest.raises(PlanError, match="pp=0 must be a positive integer"):
        fxpar.plan(model, cl, (x,), plan=dict(pp=0))
    with pytest.raises(PlanError, match="unknown schedule"):
        fxpar.plan(model, cl, (x,), plan=dict(schedule="1f2b"))


def test_empty_search_space_says_so_instead_of_blaming_memory():
    """One sequence cannot occupy 256 devices: the error names the rule, not the budget."""
    from examples.models import GPT

    model = GPT(vocab=64, d_model=32, n_heads=2, n_layers=2, seq_len=16)
    with pytest.raises(PlanError, match="no configuration exists") as e:
        fxpar.plan(model, fxpar.Cluster.preset("dgx-a100", nodes=32), (torch.randint(0, 64, (1, 16)),))
    assert "memory" not in str(e.value) and "at least one sample" in str(e.value)
    # ... and the nearest that works: the largest cluster a batch of 1 occupies
    assert "at most 64 (plan=dict(pp=8, tp=8, dp=1))" in str(e.value), str(e.value)


def test_infeasible_configurations_name_the_rule_and_what_works():
    """(#25 item 5) A batch smaller than the data-parallel degree, under a baseline or a fixed
    degree: the error names the rule and the nearest configurations that exist; each of them
    then plans."""
    from examples.models import GPT

    model = GPT(vocab=64, d_model=32, n_heads=2, n_layers=2, seq_len=16)
    x = torch.randint(0, 64, (2, 16))
    cl = fxpar.Cluster.preset("dgx-a100")
    for kind, mesh in (("dp", {"dp": 8}), ("zero3", {"dp": 8}), ("megatron", {"dp": 4, "tp": 2})):
        with pytest.raises(PlanError, match=f"plan='{kind}' on mesh .* splits the batch of 2 samples") as e:
            fxpar.plan(model, cl, (x, x), plan=kind, mesh=mesh)
        assert "a data-parallel degree of at most 2" in str(e.value), str(e.value)
        fixed = eval(str(e.value).split("(e.g. mesh=")[1].split("),")[0])   # the suggested mesh
        assert fxpar.plan(model, cl, (x, x), plan=kind, mesh=fixed).plan.kind == kind
    with pytest.raises(PlanError, match="no configuration exists") as e:
        fxpar.plan(model, cl, (x, x), plan=dict(dp=8))
    near = str(e.value).split("Nearest that exist: ")[1]
    assert near.startswith("plan=dict(pp=1, tp=4, dp=2)") and "a batch that dp=8 divides (e.g. 8)" in near
    got = fxpar.plan(model, cl, (x, x), plan=dict(pp=1, tp=4, dp=2)).plan.config
    assert (got.pp, got.tp, got.dp) == (1, 4, 2)


def test_plan_config_counts_gathered_storage_only():
    """An SPMD plan's state factors (``mesh_config``): a parameter stored sharded over ``dp``
    and gathered for its use is ZeRO-3 storage (``s_p = 2``); one its use reads sharded there
    (a column-parallel linear on ``dp``) is tensor parallelism, not sharded storage, and must
    not make the step model price (and the runner run) the whole model as ZeRO-3."""
    m = torch.nn.Sequential(torch.nn.Linear(8, 16, bias=False))
    x = torch.randn(4, 8)
    c = fxpar.Cluster.local(2)
    col = fxpar.plan(m, c, (x,), mesh={"dp": 2}, pins={"0.weight": "S(0)", "linear": "S(1)"}).plan
    gathered = fxpar.plan(m, c, (x,), mesh={"dp": 2},
                          pins={"0.weight": "S(0)", "linear": "R", "input": "R"}).plan
    assert col.node("p_0_weight").outputs == gathered.node("p_0_weight").outputs == ("S(0)",)
    assert (col.config.s_p, gathered.config.s_p) == (1, 2)
    assert fxpar.plan(m, c, (x,), plan="zero3", mesh={"dp": 2}).plan.config.s_p == 2


@pytest.mark.parametrize("axis", ["tp", "data", "x"])
def test_a_data_parallel_plan_is_priced_as_one_whatever_its_axis_is_called(axis):
    """A plan that shards the batch and replicates every weight on an axis not named ``dp``
    (``auto`` on ``{"tp": 4}`` picks it for a small GPT; AxoNN's ``data``) is data
    parallelism: the runner reduces its gradients in buckets behind the backward, as on
    ``dp``, so its configuration is ``dp = 4`` and its step the ``dp`` plan's (it was priced
    as a tensor-parallel plan with every gradient all-reduce exposed, 1.18x the same plan on
    ``dp``). A Megatron plan on ``tp`` stays tensor-parallel."""
    from examples.models import GPT

    torch.manual_seed(0)
    x = torch.randint(0, 64, (8, 16))
    c = fxpar.Cluster.local(4)
    on_dp = fxpar.plan(GPT(64, 32, 2, 2, 16), c, (x, x), plan="dp", mesh={"dp": 4}).plan
    other = fxpar.plan(GPT(64, 32, 2, 2, 16), c, (x, x), plan="dp", mesh={axis: 4}).plan
    assert [n.outputs for n in other.nodes] == [n.outputs for n in on_dp.nodes]
    assert (other.config.dp, other.config.tp) == (4, 1)
    assert other.time == pytest.approx(on_dp.time, rel=1e-12)
    tp = fxpar.plan(GPT(64, 32, 2, 2, 16), c, (x, x), plan="megatron", mesh={"tp": 4}).plan
    assert (tp.config.dp, tp.config.tp) == (1, 4)
