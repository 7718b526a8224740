"""emit on toy rank graphs: spec text, the op-nodes-only contract, the local-shape check."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx

import fxpar
from fxpar import ir
from fxpar.passes.emit import emit_pass
from fxpar.passes.infra import PassContext, run_passes
from fxpar.passes.localize import localize_pass

from tests.passes.toy import annotate, call, mesh, module, placeholder

aten = torch.ops.aten


def _graph(view_size):
    g = fx.Graph()
    x = annotate(placeholder(g, "x", (8, 16)), "S(0)")
    v = annotate(call(g, aten.view.default, (x, view_size), (8, 4, 4), "view"), "S(0)", ("S(0)",))
    g.output((v,))
    return module(g)


def test_readable_specs():
    gm = run_passes(_graph([8, 4, 4]), PassContext(mesh=mesh(dp=2), coord=(1,)),
                    [localize_pass, emit_pass])
    text = gm.print_readable(print_output=False)
    assert 'view: "f32[4, 4, 4]" = torch.ops.aten.view.default(x, [4, 4, 4])' in text
    assert "# fxpar_spec: S(0)" in text


def test_no_node_says_its_stack_trace_is_none():
    """A node whose meta says ``stack_trace=None`` (export leaves some) broke torch.compile
    (inductor) of the rank graph; emitted nodes leave the key out, and a real trace stays."""
    gm = _graph([8, 4, 4])
    x, v = [n for n in gm.graph.nodes if n.op != "output"]
    x.meta["stack_trace"], v.meta["stack_trace"] = None, "File model.py, line 3"
    out = run_passes(gm, PassContext(mesh=mesh(dp=2), coord=(0,)), [localize_pass, emit_pass])
    traces = {n.name: n.meta.get("stack_trace", "absent") for n in out.graph.nodes}
    assert traces["x"] == "absent" and traces["view"] == "File model.py, line 3"


def test_wrong_local_shape_is_a_plan_error_naming_the_node():
    """A size argument that does not match the spec's local shape (localize skipped)."""
    gm = _graph([8, 4, 4])
    for n in gm.graph.nodes:  # local meta values as localize would set, args left global
        if ir.SPECS in n.meta:
            n.meta[ir.GLOBAL_VAL] = n.meta[ir.VAL]
            n.meta[ir.VAL] = torch.empty((4,) + tuple(n.meta[ir.VAL].shape[1:]), device="meta")
    with pytest.raises(fxpar.PlanError, match=r"node view .*fails on its local shapes|node view .*computes local shape"):
        run_passes(gm, PassContext(mesh=mesh(dp=2), coord=(0,)), [emit_pass])


def test_module_calls_refused():
    """A rank graph holds op nodes only: a call_module (runtime state) breaks the contract."""
    gm = run_passes(_graph([8, 4, 4]), PassContext(mesh=mesh(dp=2), coord=(0,)), [localize_pass])
    gm.add_submodule("stateful", torch.nn.Identity())
    v = next(n for n in gm.graph.nodes if n.name == "view")
    with gm.graph.inserting_after(v):
        s = gm.graph.call_module("stateful", (v,))
    s.meta.update(v.meta)
    with pytest.raises(fxpar.PassError, match="emit_pass: requires check only_op_nodes failed: "
                                              "node stateful calls module"):
        run_passes(gm, PassContext(mesh=mesh(dp=2), coord=(0,)), [emit_pass],
                   already_run=["localize_pass"])
