"""prefetch on a hand-built rank graph: starts move a bounded window ahead; nothing else moves."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx

from fxpar import ir
from fxpar.passes.infra import PassContext, run_passes
from fxpar.passes.prefetch import prefetch_pass
from fxpar.resharding.intra import reshard_plan
from fxpar.runtime.comm import Edge

from tests.passes.toy import mesh, module, placeholder

START, WAIT = torch.ops.fxpar.start.default, torch.ops.fxpar.wait.default


N = 256   # (N, N) fp32 weights: a unit's gather moves N·N·2 bytes per device, not a tiny one


def _toy(tiny: int | None = None) -> fx.GraphModule:
    """x, w0..w2 -> (start_k; wait_k; mm_k) per layer, each start right before its wait;
    the weights are dp-sharded parameters gathered before use. ``tiny=k``: layer ``k`` adds
    an (N,) bias instead (its gather moves 512 bytes: a tiny unit)."""
    m = mesh(dp=2)
    g = fx.Graph()
    x = placeholder(g, "x", (4, N))
    shapes = [(N,) if k == tiny else (N, N) for k in range(3)]
    ws = [placeholder(g, f"w{k}", shapes[k], param=f"l{k}.weight") for k in range(3)]
    edges, h = {}, x
    for k, w in enumerate(ws):
        name = f"w{k}->mm{k}"
        plan = reshard_plan("S(0)", "R", m, shapes[k], torch.float32)
        edges[name] = Edge(name, w.name, f"mm{k}", plan, reshard_plan("P(sum)", "S(0)", m, shapes[k]),
                           param=f"l{k}.weight")
        s = g.create_node("call_function", START, ([w], [name]), name=f"start{k}")
        a = g.create_node("call_function", WAIT, (s, w, name, list(shapes[k]), "sink"), name=f"wait{k}")
        op = torch.ops.aten.add.Tensor if k == tiny else torch.ops.aten.mm.default
        h = g.create_node("call_function", op, (h, a), name=f"mm{k}")
        h = g.call_function(torch.ops.aten.relu.default, (h,))
    g.output(h)
    gm = module(g)
    gm.meta[ir.EDGES] = edges
    return gm


@pytest.mark.parametrize("window,order", [
    (0, ["start0", "wait0", "mm0", "start1", "wait1", "mm1", "start2", "wait2", "mm2"]),
    (1, ["start0", "wait0", "start1", "mm0", "wait1", "start2", "mm1", "wait2", "mm2"]),
    (2, ["start0", "start1", "wait0", "start2", "mm0", "wait1", "mm1", "wait2", "mm2"]),
])
def test_window(window, order):
    """W=1: start0 -> wait0 -> start1 -> mm0 (hides ag1) -> wait1 -> start2 -> mm1 (hides ag2)
    -> wait2 -> mm2. Only starts move: the same nodes with the same arguments."""
    gm = _toy()
    before = {n.name: n.args for n in gm.graph.nodes}
    res = run_passes(gm, PassContext(coord=(0,), prefetch=window), [prefetch_pass])
    assert [n.name for n in res.graph.nodes if n.name in order] == order
    assert {n.name: n.args for n in res.graph.nodes} == before
    # the rank graph still runs on meta tensors (shapes through the ops' fake kernels)
    out = res(torch.empty(4, N, device="meta"), *[torch.empty(N, N, device="meta") for _ in range(3)])
    assert out.shape == (4, N)


def test_a_tiny_unit_rides_with_the_unit_after_it():
    """Layer 1's gather moves 512 bytes (under TINY_GATHER_BYTES): its group takes layer 2 as
    well (one start of both, one gradient bucket), prefetched one group ahead: after layer
    0's wait. Only starts move and merge."""
    gm = _toy(tiny=1)
    before = {n.name: n.args for n in gm.graph.nodes if n.name not in ("start1", "start2")}
    res = run_passes(gm, PassContext(coord=(0,), prefetch=1), [prefetch_pass])
    order = ["start0", "wait0", "start1", "mm0", "wait1", "mm1", "wait2", "mm2"]
    assert [n.name for n in res.graph.nodes if n.name in order + ["start2"]] == order
    start1 = next(n for n in res.graph.nodes if n.name == "start1")
    assert start1.args[1] == ["w1->mm1", "w2->mm2"]
    assert {e.bucket for e in res.meta[ir.EDGES].values()} == {("w1->mm1", "w2->mm2"), ()}
    assert {n.name: n.args for n in res.graph.nodes if n.name != "start1"} == {
        k: (v if k != "wait2" else (start1,) + v[1:]) for k, v in before.items()}


def test_one_layer_one_start_one_gradient_bucket():
    """Two parameters used by one node (a unit): their starts merge into ONE start of both
    edges (coalesced), and their gradient edges form one bucket, on the graph's own copy of the
    edge table (the input graph's table is not touched)."""
    m = mesh(dp=2)
    g = fx.Graph()
    x = placeholder(g, "x", (4, 4))
    w = placeholder(g, "w", (4, 4), param="fc.weight")
    b = placeholder(g, "b", (4,), param="fc.bias")
    edges, got = {}, []
    for p, shape in ((w, (4, 4)), (b, (4,))):
        name = f"{p.name}->addmm"
        edges[name] = Edge(name, p.name, "addmm", reshard_plan("S(0)", "R", m, shape),
                           reshard_plan("P(sum)", "S(0)", m, shape), param=p.meta[ir.PARAM].fqn)
        s = g.create_node("call_function", START, ([p], [name]), name=f"start_{p.name}")
        got.append(g.create_node("call_function", WAIT, (s, p, name, list(shape), "sink"), name=f"wait_{p.name}"))
    y = g.create_node("call_function", torch.ops.aten.addmm.default, (got[1], x, got[0]), name="addmm")
    g.output(y)
    gm = module(g)
    gm.meta[ir.EDGES] = table = dict(edges)
    res = run_passes(gm, PassContext(coord=(0,), prefetch=1), [prefetch_pass])
    starts = list(res.graph.find_nodes(op="call_function", target=START))
    assert len(starts) == 1 and starts[0].args[1] == ["w->addmm", "b->addmm"]
    assert {e.bucket for e in res.meta[ir.EDGES].values()} == {("w->addmm", "b->addmm")}
    assert all(e.bucket == () for e in table.values())


def _toy_with_input() -> fx.GraphModule:
    """:func:`_toy` plus an input ``t`` (no parameter) gathered right before its one use,
    an ``add`` at the end."""
    gm = _toy()
    g = gm.graph
    with g.inserting_after(next(n for n in g.nodes if n.name == "w2")):
        t = g.placeholder("t")
    t.meta[ir.VAL] = torch.empty(4, N, device="meta")
    out = next(n for n in g.nodes if n.op == "output")
    name = "t->add"
    gm.meta[ir.EDGES][name] = Edge(name, "t", "add", reshard_plan("S(0)", "R", mesh(dp=2), (4, N)),
                                   None)
    with g.inserting_before(out):
        s = g.create_node("call_function", START, ([t], [name]), name="start_t")
        w = g.create_node("call_function", WAIT, (s, t, name, [4, N], "none"), name="wait_t")
        out.args = (g.create_node("call_function", torch.ops.aten.add.Tensor, (out.args[0], w),
                                  name="add"),)
    gm.recompile()
    return gm


@pytest.mark.parametrize("window,first", [(1, ["start_t", "start0", "wait0", "start1"]),
                                          (2, ["start_t", "start0", "start1", "wait0"]),
                                          (0, ["start0", "wait0", "mm0", "relu_default"])])
def test_an_inputs_gather_starts_at_the_top(window, first):
    """A program input gathered for its last use (the targets of a mean loss) is no unit: its
    start goes right after the placeholders, ahead of the parameter units, whatever the
    window; its wait stays right before its use. ``W = 0`` leaves it where it was."""
    res = run_passes(_toy_with_input(), PassContext(coord=(0,), prefetch=window), [prefetch_pass])
    names = [n.name for n in res.graph.nodes if n.op not in ("placeholder", "output")]
    assert names[:4] == first
    assert names[-3:] == (["start_t", "wait_t", "add"] if window == 0 else
                          ["relu_default_2", "wait_t", "add"])


def test_a_graph_without_placeholders_is_left_alone():
    """An op of no tensor input (``arange``): no placeholder, nothing to move."""
    g = fx.Graph()
    g.output(g.call_function(torch.ops.aten.arange.default, (4,)))
    res = run_passes(module(g), PassContext(coord=(0,), prefetch=1), [prefetch_pass])
    assert [n.op for n in res.graph.nodes] == ["call_function", "output"]
