"""Planning at scale (world 256 and 1024) on a fake process group: a small GPT on DGX A100
nodes, checked against hand-derived expectations.

Planning itself runs no collective; the fake group (``init_process_group("fake")``, one
process standing for rank 0 of ``N``) is there so the plan's mesh can be turned into the
``DeviceMesh`` the runtime would use, and its process groups checked against the plan's
communication: the gradient all-reduce of a replicated weight runs over the ``dp`` group of
the mesh, ``N / 8`` ranks, strided by 8 (``tp`` innermost: consecutive ranks share a node).

GPT(vocab=512, d=256, 4 heads, 2 blocks, seq 64), fp32, global batch ``2 · dp``:

* megatron on ``(dp=N/8, tp=8)``: ``qkv``, ``fc1`` and the head are column-parallel
  (weight ``(out, in)`` stored ``S(0)`` on ``tp``, ``R`` on ``dp``), ``proj`` and ``fc2``
  row-parallel (``S(1)`` on ``tp``); column outputs ``S(0)S(2)``, row outputs
  ``S(0)P(sum)``; each pinned weight keeps its model states, 16 B per local element
  (Adam, mixed precision), ``numel / 8`` local elements; its gradient is a partial sum over
  ``dp`` (the batch is split there) and all-reduced once per step over ``dp``
  (``numel / 8 · 4`` bytes).
* dp on ``(dp=N)``: every parameter ``R``, states ``16 · numel`` bytes; the gradient of a
  linear layer's weight or bias (its consumer split on the batch) all-reduced once over all
  ``N`` ranks (embeddings are left to the solver).
* memory: one liveness point, so the plan's memory is the sum of its nodes' memory.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import fxpar
from examples.models import GPT
from fxpar import ir

VOCAB, D, HEADS, LAYERS, SEQ = 512, 256, 4, 2, 64
COLUMN = ("attn.qkv.weight", "mlp.fc1.weight")
ROW = ("attn.proj.weight", "mlp.fc2.weight")


@pytest.fixture(params=[256, 1024], ids=lambda n: f"world{n}")
def world(request):
    from torch.testing._internal.distributed.fake_pg import FakeStore

    n = request.param
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=n)
    try:
        yield n
    finally:
        dist.destroy_process_group()


def _gpt_plan(n: int, kind: str):
    with torch.device("meta"):
        model = GPT(vocab=VOCAB, d_model=D, n_heads=HEADS, n_layers=LAYERS, seq_len=SEQ)
    batch = 2 * (n // 8 if kind == "megatron" else n)
    tok = torch.zeros(batch, SEQ, dtype=torch.long, device="meta")
    cluster = fxpar.Cluster.preset("dgx-a100", nodes=n // 8)
    planned = fxpar.plan(model, cluster, (tok, tok), plan=kind, time_limit=120)
    return planned, cluster


def _params(planned) -> dict[str, tuple[str, tuple[int, ...]]]:
    """``{fqn: (placeholder node name, shape)}`` of the trainable parameters."""
    return {n.meta[ir.PARAM].fqn: (n.name, tuple(n.meta[ir.VAL].shape))
            for n in planned.graph.graph.nodes if ir.PARAM in n.meta and n.meta[ir.PARAM].requires_grad}


def _bwd_all_reduces(plan, producer: str):
    return [s for e in plan.edges if e.producer == producer and e.direction == "bwd"
            for s in e.steps if s.kind == "all_reduce"]


def test_megatron_at_scale(world):
    n = world
    dp, tp = n // 8, 8
    planned, cluster = _gpt_plan(n, "megatron")
    plan = planned.plan
    assert plan.mesh["axis_names"] == ("dp", "tp") and plan.mesh["shape"] == (dp, tp)
    assert plan.status == "OPTIMAL"

    # the runtime's view of the mesh on the fake group: the dp group of rank 0 is strided by 8
    mesh = fxpar.Mesh(cluster, dp=dp, tp=tp)
    dm = mesh.to_device_mesh("cpu")
    assert dm.size() == n and dm.get_group("dp").size() == dp and dm.get_group("tp").size() == tp
    assert mesh.group_of(0, "dp") == tuple(range(0, n, 8))
    assert mesh.group_of(0, "tp") == tuple(range(8))

    params = _params(planned)
    # the fused qkv weight's column split is strided: each rank holds its q, k and v rows
    weights = {f"blocks.{b}.{w}": ("RS(0,3)" if w.startswith("attn.qkv") else "RS(0)" if w in COLUMN
                                   else "RS(1)")
               for b in range(LAYERS) for w in COLUMN + ROW} | {"head.weight": "RS(0)"}
    for fqn, spec in weights.items():
        name, shape = params[fqn]
        node = plan.node(name)
        assert node.outputs == (spec,), (fqn, node.outputs)
        numel = shape[0] * shape[1]
        assert node.memory == 16 * numel // tp, fqn      # Adam mixed: 16 B per local element
        ars = _bwd_all_reduces(plan, name)
        assert len(ars) == 1 and ars[0].axis == "dp", (fqn, ars)
        assert ars[0].nbytes == numel // tp * 4, fqn       # the local fp32 gradient, once

    # linear outputs: column S(0)S(2) (batch on dp, features on tp), row S(0)P(sum)
    lin = [nd for nd in plan.nodes if nd.op == "linear"]
    assert len(lin) == 4 * LAYERS + 1
    assert sorted({nd.outputs[0] for nd in lin}) == ["S(0)P(sum)", "S(0)S(2)", "S(0)S(2,3)"]
    assert sum(nd.outputs[0] == "S(0)P(sum)" for nd in lin) == 2 * LAYERS

    # one liveness point: the plan's memory is the sum of its nodes' memory plus one op's
    # backward (its output's and inputs' gradients), within budget
    transient = plan.stats["backward_transient"]
    assert 0 < transient and plan.memory == sum(nd.memory for nd in plan.nodes) + transient
    assert plan.memory <= cluster.device_memory


def test_dp_at_scale(world):
    n = world
    planned, cluster = _gpt_plan(n, "dp")
    plan = planned.plan
    assert plan.mesh["shape"] == (n,)
    dm = fxpar.Mesh(cluster, dp=n).to_device_mesh("cpu")
    assert dm.get_group("dp").size() == n
    params = _params(planned)
    total = 0
    for fqn, (name, shape) in params.items():
        node = plan.node(name)
        numel = 1
        for s in shape:
            numel *= s
        total += numel
        assert node.outputs == ("R",), fqn
        assert node.memory == 16 * numel, fqn
        if fqn.rsplit(".", 2)[-2] in ("qkv", "proj", "fc1", "fc2", "head"):
            # a linear layer's weight or bias, consumed by a linear pinned S(0) (batch split):
            # its gradient is a partial sum over all n ranks, all-reduced once, whole (fp32)
            ars = _bwd_all_reduces(plan, name)
            assert [(s.axis, s.nbytes) for s in ars] == [("dp", numel * 4)], fqn
    states = sum(nd.memory for nd in plan.nodes if nd.op == "placeholder" and nd.name in
                 {v[0] for v in params.values()})
    assert states == 16 * total
