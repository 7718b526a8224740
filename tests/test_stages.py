"""Stage splitting (fxpar.split) and pipeline planning (fxpar.planner.stages), one process.

The chunk graphs are checked by running them in sequence on real tensors against the whole
model (the relay of skip connections, tied parameters on two chunks); the plans by what the
stage chunks must hold (submeshes, pinned boundary layouts) and by JSON round trips.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fxpar
from fxpar import ir
from fxpar.errors import PlanError
from fxpar.split import is_boundary, split_stages


class Skip(nn.Module):
    """Four layers; layer 0's output also feeds layer 3 (a U-Net style skip)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    def forward(self, x):
        h0 = torch.relu(self.layers[0](x))
        h = torch.relu(self.layers[1](h0))
        h = torch.relu(self.layers[2](h))
        return self.layers[3](h + h0).sum()


class Tied(nn.Module):
    """An embedding whose weight is also the LM head (GPT-2's tying)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        h = self.emb(idx)
        for b in self.blocks:
            h = torch.tanh(b(h))
        return self.head(h).logsumexp(-1).mean()


def _run_chunks(chunks, model, flat_inputs):
    """Run the chunk graphs in order on real tensors, feeding boundary values by name."""
    state = dict(model.named_parameters(remove_duplicate=False))
    values: dict[str, torch.Tensor] = {}
    out = None
    for c in chunks:
        gm = c.graph
        params = [state[n.meta[ir.PARAM].fqn] for n in gm.graph.find_nodes(op="placeholder")
                  if ir.PARAM in n.meta]
        ins = [flat_inputs[c.user_inputs[j]] if not is_boundary(n.meta[ir.INPUT])
               else values[n.name]
               for j, n in enumerate(n for n in gm.graph.find_nodes(op="placeholder")
                                     if ir.INPUT in n.meta)]
        out = gm(*params, *ins)
        if not c.is_last:
            values.update(zip(c.outputs, out))
    return out


def test_skip_connection_is_relayed():
    torch.manual_seed(0)
    model, x = Skip(), torch.randn(4, 8)
    gm = fxpar.capture(model, (x,))
    chunks = split_stages(gm, 4, split_points=["layers.1", "layers.2", "layers.3"])
    assert [c.layers[0] for c in chunks] == ["layers.0", "layers.1", "layers.2", "layers.3"]
    (relu0,) = chunks[0].outputs  # relu(h0): input of layer 1 and of the skip
    # ``h + h0`` runs after layer 2's relu (chunk 2): the skip passes through chunk 1 unchanged
    assert relu0 in chunks[1].inputs and relu0 in chunks[1].outputs
    assert relu0 in chunks[2].inputs and relu0 not in chunks[2].outputs
    got = _run_chunks(chunks, model, [x])
    torch.testing.assert_close(got[0] if isinstance(got, (tuple, list)) else got, model(x))


def test_tied_parameter_lives_on_both_chunks():
    torch.manual_seed(0)
    model, idx = Tied(), torch.randint(0, 16, (2, 5))
    gm = fxpar.capture(model, (idx,))
    chunks = split_stages(gm, 2, split_points=["blocks.1"])
    first, last = (set(ir.params(c.graph)) for c in chunks)
    assert "emb.weight" in first and "emb.weight" in last
    got = _run_chunks(chunks, model, [idx])
    torch.testing.assert_close(got[0] if isinstance(got, (tuple, list)) else got, model(idx))


def test_gpt_chunks_compose_to_the_model():
    from examples.models import GPT

    torch.manual_seed(0)
    model = GPT(vocab=32, d_model=16, n_heads=2, n_layers=4, seq_len=8)
    idx = torch.randint(0, 32, (2, 8))
    gm = fxpar.capture(model, (idx,))
    for n in (1, 2, 3, 6):
        chunks = split_stages(gm, n)
        assert len(chunks) == n
        layers = [lay for c in chunks for lay in c.layers]
        assert len(layers) == len(set(layers)), "a layer is in two chunks"
        got = _run_chunks(chunks, model, [idx])
        torch.testing.assert_close(got[0] if isinstance(got, (tuple, list)) else got, model(idx))


def test_balanced_split_is_balanced():
    """Equal blocks: 4 blocks over 2 chunks put 2 in each (the DP minimizes the larger)."""
    from examples.models import GPT

    gm = fxpar.capture(GPT(vocab=32, d_model=64, n_heads=2, n_layers=4, seq_len=8),
                       (torch.randint(0, 32, (2, 8)),))
    chunks = split_stages(gm, 2)
    blocks = [[lay for lay in c.layers if lay.startswith("blocks.")] for c in chunks]
    assert blocks == [["blocks.0", "blocks.1"], ["blocks.2", "blocks.3"]]


@pytest.mark.parametrize("kw,match", [
    (dict(n=40), "only"),
    (dict(n=2, split_points=["nope.3"]), "names no module"),
    (dict(n=3, split_points=["blocks.2", "blocks.1"]), "forward order"),
    (dict(n=3, split_points=["blocks.2"]), "give 2"),
])
def test_bad_splits(kw, match):
    from examples.models import GPT

    gm = fxpar.capture(GPT(vocab=32, d_model=16, n_heads=2, n_layers=4, seq_len=8),
                       (torch.randint(0, 32, (2, 8)),))
    n = kw.pop("n")
    with pytest.raises(PlanError, match=match):
        split_stages(gm, n, **kw)


def _gpt_prog(**kw):
    from examples.models import GPT

    torch.manual_seed(0)
    model = GPT(vocab=64, d_model=32, n_heads=4, n_layers=4, seq_len=16)
    idx = torch.randint(0, 64, (8, 16))
    return fxpar.compile(model, fxpar.Cluster.preset("dgx-a100"), (idx, idx), time_limit=20,
                         optimizer=lambda ps: torch.optim.AdamW(ps), **kw)


def test_megatron_pipeline_plan():
    """pp=2 × tp=2 Megatron: stage 0 on devices (0, 1), stage 1 on (2, 3); the linears are
    column/row split on tp; the boundary value crosses in the layout both sides agree on."""
    prog = _gpt_prog(mesh={"pp": 2, "dp": 1, "tp": 2}, plan="megatron", microbatches=4)
    plan = prog.plan
    assert [st.plan.mesh["devices"] for st in plan.stages] == [(0, 1), (2, 3)]
    assert [st.plan.mesh["axis_names"] for st in plan.stages] == [("dp", "tp")] * 2
    for st in plan.stages:
        names = {n.strategy_name for n in st.plan.nodes if n.op == "linear"}
        assert names & {"col(tp)", "row(tp)"} or any("S(" in n.strategy for n in st.plan.nodes
                                                        if n.op == "linear"), names
    (boundary,) = plan.stages[0].outputs
    assert plan.stages[1].inputs == (boundary,)
    sent = plan.stages[0].plan.node(boundary).outputs[0]
    got = next(n for n in plan.stages[1].plan.nodes if n.name == boundary).outputs[0]
    assert sent.replace("P(sum)", "R") == got
    assert fxpar.Plan.from_json(plan.to_json()) == plan
    text = prog.explain()
    assert "schedule 1f1b" in text and "-- stage 1 (pipeline rank 1) --" in text
    assert prog.simulate().step_time == pytest.approx(plan.time)


def test_pipeline_bad_input():
    with pytest.raises(PlanError, match="microbatches do not divide"):
        _gpt_prog(mesh={"pp": 2}, microbatches=3)
    with pytest.raises(PlanError, match="names no module"):
        _gpt_prog(mesh={"pp": 2}, split_points=["model.nope"])
    with pytest.raises(fxpar.ScheduleError):
        _gpt_prog(mesh={"pp": 2}, schedule="interleaved", chunks=2, microbatches=1)


def test_scatter_gather_chosen_by_cost():
    """Two DGX nodes, one stage each: the boundary activation (replicated on tp=8) crosses the
    slow inter-node link as 1/8 per rank and is all-gathered over NVLink (Megatron §4.1);
    forced send/recv moves 8 copies and is slower. (A small activation stays send/recv: the
    all-gather's 7 latency steps cost more than the bytes saved.)"""
    from examples.models import GPT

    torch.manual_seed(0)
    with torch.device("meta"):  # 8·512·1024 fp32 = 16 MiB per microbatch: bandwidth-bound
        model = GPT(vocab=64, d_model=1024, n_heads=8, n_layers=2, seq_len=512)
    idx = torch.randint(0, 64, (16, 512))
    kw = dict(mesh={"pp": 2, "dp": 1, "tp": 8}, plan="megatron", microbatches=2, time_limit=20)
    c = fxpar.Cluster.preset("dgx-a100", nodes=2)
    # the block output, replicated on tp (Megatron's layout between blocks)
    first = fxpar.compile(model, c, (idx, idx), emit=False, **kw).plan.stages[0]
    kw["pins"] = {first.outputs[0]: "RR"}
    auto = fxpar.compile(model, c, (idx, idx), emit=False, **kw).plan.stages[0]
    plain = fxpar.compile(model, c, (idx, idx), emit=False, boundary="send_recv", **kw).plan.stages[0]
    assert auto.scatter == ("tp",) and plain.scatter == ("",)
    assert auto.send_bytes * 8 == plain.send_bytes
    assert auto.send_time < plain.send_time


def test_simulated_memory_follows_the_schedule():
    """Rank 0 keeps all m=4 microbatches' activations under GPipe, min(m, p)=2 under 1F1B:
    the peaks differ by exactly two microbatches of chunk 0's activations."""
    peaks, act0 = {}, None
    for sch in ("gpipe", "1f1b"):
        prog = _gpt_prog(mesh={"pp": 2}, microbatches=4, schedule=sch)
        peaks[sch] = prog.simulate().peak_memory[0]
        act0 = sum(n.memory for n in prog.plan.stages[0].plan.nodes if n.op != "placeholder")
    assert act0 > 0
    assert peaks["gpipe"] - peaks["1f1b"] == pytest.approx(2 * act0)


@pytest.mark.parametrize("schedule,ranks", [("1f1b", (0, 1)), ("interleaved", (0, 1, 0, 1)),
                                            ("zbv", (0, 1, 1, 0))])
def test_pipeline_memory_is_the_busiest_ranks(schedule, ranks):
    """A pipeline plan's memory per device is its busiest rank's: the sum over the chunks it
    runs (two per rank here, but 1F1B's one), each chunk's states and one microbatch live."""
    plan = _gpt_prog(mesh={"pp": 2}, microbatches=4, schedule=schedule,
                     chunks=1 if schedule == "1f1b" else 2).plan
    assert tuple(st.rank for st in plan.stages) == ranks
    per_rank = [sum(st.plan.memory for st in plan.stages if st.rank == r) for r in (0, 1)]
    assert plan.memory == max(per_rank)
    if len(ranks) > 2:
        assert plan.memory > max(st.plan.memory for st in plan.stages)


@pytest.mark.parametrize("schedule", ["interleaved", "zbv"])
def test_pipeline_program_saves_and_loads(tmp_path, schedule):
    """A saved pipeline program loads back with the same plan and, per stage chunk and rank,
    the same emitted graph (the model re-captured at the microbatch shape, split where the
    plan's chunks start; zbv: its V placement too)."""
    prog = _gpt_prog(mesh={"pp": 2, "tp": 2}, microbatches=4, schedule=schedule, chunks=2)
    path = tmp_path / "pp.json"
    prog.save(path)
    from examples.models import GPT

    torch.manual_seed(0)
    again = fxpar.load(path, GPT(vocab=64, d_model=32, n_heads=4, n_layers=4, seq_len=16))
    assert again.plan == prog.plan and again.schedule == prog.schedule
    assert again.schedule.placement == ("v" if schedule == "zbv" else "loop")
    for st in prog.plan.stages:
        for rank in st.plan.mesh["devices"]:
            a = prog.rank_graph(rank, chunk=st.index).print_readable(print_output=False)
            b = again.rank_graph(rank, chunk=st.index).print_readable(print_output=False)
            assert a == b, (st.index, rank)
    with pytest.raises(PlanError, match="another model"):
        fxpar.load(path, GPT(vocab=64, d_model=32, n_heads=4, n_layers=2, seq_len=16))


def test_build_cache_builds_the_same_problems():
    """The chunks of a GPT pipeline built with one shared BuildCache (as plan_pipeline does)
    give the problems built each on its own: same strategies, node costs, memory, edges,
    pins, ties; and each chunk's solved plan is the same."""
    import numpy as np

    from examples.models import GPT
    from fxpar.planner.intra_op import BuildCache, PlannerOptions, build_problem, plan_graph

    gm = fxpar.capture(GPT(vocab=64, d_model=32, n_heads=4, n_layers=6, seq_len=16),
                       (torch.randint(0, 64, (4, 16)),))
    chunks = split_stages(gm, 4, split_points=["blocks.1", "blocks.3", "blocks.5"])
    mesh = fxpar.Mesh(fxpar.Cluster.preset("dgx-a100"), dp=2, tp=2)
    opts = PlannerOptions(grad_steps=4)
    cache, alone = BuildCache(), []
    # options the cache must not mix up with ``opts`` (gradient reshards priced once per step)
    build_problem(chunks[1].graph, mesh, options=PlannerOptions(), cache=cache)
    for sg in chunks:
        pins = {i.name: "S(0)R" for i in ir.user_inputs(sg.graph) if i.is_tensor}
        a = build_problem(sg.graph, mesh, pins=pins, options=opts, cache=cache)
        alone.append(BuildCache())
        build_problem(sg.graph, mesh, pins=pins, options=opts, cache=alone[-1])
        b = build_problem(sg.graph, mesh, pins=pins, options=opts)
        assert [[str(s) for s in x] for x in a.strategies] == [[str(s) for s in x] for x in b.strategies]
        for key in ("cost", "mem"):
            for x, y in zip(getattr(a.problem, key), getattr(b.problem, key), strict=True):
                np.testing.assert_array_equal(x, y)
        assert [e[:2] for e in a.problem.edges] == [e[:2] for e in b.problem.edges]
        for x, y in zip(a.problem.edges, b.problem.edges, strict=True):
            np.testing.assert_array_equal(x[2], y[2])
        assert a.problem.pins == b.problem.pins and a.problem.ties == b.problem.ties
        assert a.edge_info == b.edge_info and a.outputs == b.outputs
        pa = fxpar.planner.plan_and_keep(sg.graph, mesh, pins=pins, options=opts, cache=cache)[0]
        assert pa.hash == plan_graph(sg.graph, mesh, pins=pins, options=opts).hash
    # the middle chunks are made of the same layers: their nodes were priced once
    shared = len(cache._for(mesh, opts)[0])
    assert shared < sum(len(c._for(mesh, opts)[0]) for c in alone) - 10
