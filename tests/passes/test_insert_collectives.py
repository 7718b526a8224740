"""insert_collectives on hand-annotated toy graphs: which edges get which op, in which order."""

from __future__ import annotations

import pytest
import torch
from torch.testing import FileCheck

from fxpar import ir
from fxpar.passes.infra import PassContext, run_passes
from fxpar.passes.insert_collectives import insert_collectives_pass
from fxpar.errors import PassError
from fxpar.spec import Spec
import torch.fx as fx

from tests.passes.toy import annotate, call, mesh, module, placeholder

aten = torch.ops.aten


def _megatron_mlp():
    """x (R, carries a gradient) -> linear(col: R, S(0) -> S(1)) -> gelu -> linear(row:
    S(1), S(1) -> P(sum)) -> output, on tp=2."""
    g = fx.Graph()
    x = annotate(placeholder(g, "x", (8, 16)), "R")
    x.meta[ir.VAL].requires_grad_(True)
    w1 = annotate(placeholder(g, "w1", (32, 16), param="fc1.weight"), "S(0)")
    w2 = annotate(placeholder(g, "w2", (16, 32), param="fc2.weight"), "S(1)")
    h = annotate(call(g, aten.linear.default, (x, w1), (8, 32), "linear"), "S(1)", ("R", "S(0)"))
    a = annotate(call(g, aten.gelu.default, (h,), (8, 32), "gelu"), "S(1)", ("S(1)",))
    o = annotate(call(g, aten.linear.default, (a, w2), (8, 16), "linear_1"), "P(sum)", ("S(1)", "S(1)"))
    out = g.output((o,))
    out.meta[ir.IN_SPECS] = (None,)
    return module(g)


def test_megatron_mlp_f_and_g():
    """Megatron's conjugate pair, nothing else:

        x -> [reshard f: R -> R | grad P(sum) -> R all_reduce] -> linear(col) -> gelu
          -> linear(row) -> [start all_reduce(tp)] -> [wait] -> output

    No node for the weights (stored as consumed; their gradients accumulate on the leaf)."""
    gm = run_passes(_megatron_mlp(), PassContext(mesh=mesh(tp=2)), [insert_collectives_pass])
    (FileCheck()
     .check("grad_all_reduce_tp__x = torch.ops.fxpar.redistribute.default(x, 'x->linear', [8, 16], 'reshard')")
     .check("aten.linear.default(grad_all_reduce_tp__x, w1)")
     .check("aten.gelu")
     .check("linear_1 = torch.ops.aten.linear.default(gelu, w2)")
     .check("all_reduce_tp__linear_1 = torch.ops.fxpar.start.default([linear_1], ['linear_1->output'])")
     .check("wait__linear_1 = torch.ops.fxpar.wait.default(all_reduce_tp__linear_1, linear_1, "
            "'linear_1->output', [8, 16], 'identity')")
     .check("return (wait__linear_1,)")
     .run(gm.code))
    edges = gm.meta[ir.EDGES]
    assert sorted(edges) == ["linear_1->output", "x->linear"]
    f, g = edges["x->linear"], edges["linear_1->output"]
    assert (not f.fwd.steps and [s.kind for s in f.bwd.steps] == ["all_reduce"]
            and str(f.bwd.src) == "P(sum)" and f.grad_mode == "reshard")
    assert [s.kind for s in g.fwd.steps] == ["all_reduce"] and g.grad_mode == "identity"
    assert gm.meta[ir.REPLICA_AXES] == {"fc1.weight": (), "fc2.weight": ()}


def _linear(wspec: str, lin_in: tuple[str, str], out: str, m):
    g = fx.Graph()
    x = annotate(placeholder(g, "x", (8, 16)), "S(0)")
    w = annotate(placeholder(g, "w", (4, 16), param="fc.weight"), wspec)
    y = annotate(call(g, aten.linear.default, (x, w), (8, 4), "linear"), out, lin_in)
    o = g.output((y,))
    o.meta[ir.IN_SPECS] = (None,)
    return run_passes(module(g), PassContext(mesh=m), [insert_collectives_pass])


def test_data_parallel_weight_has_no_node_but_a_replica_axis():
    """A weight stored R and consumed R by a batch-sharded linear: nothing moves in the graph;
    its gradient is a partial sum over dp, reduced by the model-state manager (replica axis)."""
    gm = _linear("R", ("S(0)", "R"), "S(0)", mesh(dp=2))
    assert not gm.meta.get(ir.EDGES)
    FileCheck().check("aten.linear.default(x, w)").check_not("fxpar").run(gm.code)
    assert gm.meta[ir.REPLICA_AXES] == {"fc.weight": ("dp",)}


def test_zero3_weight_gathered_right_before_use_gradient_to_sink():
    """A weight stored S(0), consumed R: start all_gather right before the linear (prefetch
    moves it later), wait, linear; backward sends the gradient to the sink through a
    reduce-scatter P(sum) -> S(0)."""
    gm = _linear("S(0)", ("S(0)", "R"), "S(0)", mesh(dp=2))
    (FileCheck().check("all_gather_dp__w = torch.ops.fxpar.start.default([w], ['w->linear'])")
     .check("wait__w = torch.ops.fxpar.wait.default(all_gather_dp__w, w, 'w->linear', [4, 16], 'sink')")
     .check("aten.linear.default(x, wait__w)").run(gm.code))
    e = gm.meta[ir.EDGES]["w->linear"]
    assert e.param == "fc.weight" and [s.kind for s in e.bwd.steps] == ["reduce_scatter"]
    assert str(e.bwd.src) == "P(sum)" and str(e.bwd.dst) == "S(0)"


def _position_embedding(second_use: bool):
    """h (S(0), carries a gradient) + embedding(wpe, pos) (R: the same on every rank), on
    dp=2; ``second_use``: wpe also feeds another replicated op."""
    g = fx.Graph()
    w = annotate(placeholder(g, "w", (16, 8), param="wpe.weight"), "R")
    pos = annotate(placeholder(g, "pos", (4,), dtype=torch.int64), "R")
    h = annotate(placeholder(g, "h", (2, 4, 8)), "S(0)")
    h.meta[ir.VAL].requires_grad_(True)
    e = annotate(call(g, aten.embedding.default, (w, pos), (4, 8), "embedding"), "R", ("R", "R"))
    a = annotate(call(g, aten.add.Tensor, (h, e), (2, 4, 8), "add"), "S(0)", ("S(0)", "R"))
    outs = [a]
    if second_use:
        outs.append(annotate(call(g, aten.mul.Tensor, (w, w), (16, 8), "mul"), "R", ("R", "R")))
    out = g.output(tuple(outs))
    out.meta[ir.IN_SPECS] = (None,) * len(outs)
    return run_passes(module(g), PassContext(mesh=mesh(dp=2)), [insert_collectives_pass])


def test_partial_gradient_sunk_into_the_parameter_reduction():
    """The embedding's output gradient is a partial sum over dp (the add broadcasts it over
    the sharded batch). Its only differentiable input is wpe, used nowhere else: no
    synchronous all-reduce of the activation gradient; wpe's gradient is partial and dp is
    its replica axis (reduced in the asynchronous buckets). With a second use of wpe whose
    gradient is whole, mixing would over-count, so the activation all-reduce stays."""
    gm = _position_embedding(second_use=False)
    assert not gm.meta.get(ir.EDGES), gm.meta.get(ir.EDGES)
    FileCheck().check("aten.embedding.default(w, pos)").check_not("fxpar").run(gm.code)
    assert gm.meta[ir.REPLICA_AXES] == {"wpe.weight": ("dp",)}

    gm = _position_embedding(second_use=True)
    e = gm.meta[ir.EDGES]["embedding->add"]
    assert not e.fwd.steps and [s.kind for s in e.bwd.steps] == ["all_reduce"]
    assert gm.meta[ir.REPLICA_AXES] == {"wpe.weight": ()}


def test_requires_annotated_graph():
    g = fx.Graph()
    x = placeholder(g, "x", (4,))
    g.output((x,))
    with pytest.raises(PassError, match="insert_collectives_pass: requires check annotated failed: "
                                        "node x has no meta"):
        run_passes(module(g), PassContext(mesh=mesh(dp=2)), [insert_collectives_pass])


def _qkv(grad_acc: str | None):
    """h = x * 2 (R on tp=2, carries a gradient) read by two column-parallel linears (q, k);
    their output gradients summed, so the graph returns q + k (row-like: P(sum) out)."""
    g = fx.Graph()
    x = annotate(placeholder(g, "x", (8, 16)), "R")
    x.meta[ir.VAL].requires_grad_(True)
    wq = annotate(placeholder(g, "wq", (32, 16), param="q.weight"), "S(0)")
    wk = annotate(placeholder(g, "wk", (32, 16), param="k.weight"), "S(0)")
    h = annotate(call(g, aten.mul.Tensor, (x, 2.0), (8, 16), "h"), "R", ("R",))
    if grad_acc is not None:
        h.meta[ir.GRAD_ACC] = Spec.parse(grad_acc)
    q = annotate(call(g, aten.linear.default, (h, wq), (8, 32), "q"), "S(1)", ("R", "S(0)"))
    k = annotate(call(g, aten.linear.default, (h, wk), (8, 32), "k"), "S(1)", ("R", "S(0)"))
    s = annotate(call(g, aten.add.Tensor, (q, k), (8, 32), "s"), "S(1)", ("S(1)", "S(1)"))
    out = g.output((s,))
    out.meta[ir.IN_SPECS] = (None,)
    return run_passes(module(g), PassContext(mesh=mesh(tp=2)), [insert_collectives_pass])


def test_fan_out_gradients_summed_then_reduced_once():
    """Without accumulation each column linear all-reduces its own partial input gradient
    (two all-reduces, as fxpar did for q, k and v); with ``GRAD_ACC = P(sum)`` both partial
    sums are added by autograd at one node after ``h``, whose backward all-reduces once."""
    per_edge = _qkv(None)
    kinds = {n: [s.kind for s in e.bwd.steps] for n, e in per_edge.meta[ir.EDGES].items() if e.bwd}
    assert kinds == {"h->q": ["all_reduce"], "h->k": ["all_reduce"]}

    gm = _qkv("P(sum)")
    edges = gm.meta[ir.EDGES]
    assert sorted(edges) == ["h->consumers"]     # the consumers' edges have nothing to do
    acc = edges["h->consumers"]
    assert not acc.fwd.steps and [s.kind for s in acc.bwd.steps] == ["all_reduce"]
    assert str(acc.bwd.src) == "P(sum)" and str(acc.bwd.dst) == "R"
    (FileCheck()
     .check("h = torch.ops.aten.mul.Tensor(x, 2.0)")
     .check("fan_out_grad_all_reduce_tp__h = torch.ops.fxpar.redistribute.default(h, 'h->consumers'")
     .check("aten.linear.default(fan_out_grad_all_reduce_tp__h, wq)")
     .check("aten.linear.default(fan_out_grad_all_reduce_tp__h, wk)")
     .run(gm.code))
