"""localize on hand-annotated toy graphs: local shapes, size arguments, dropout, random ops."""

from __future__ import annotations

import zlib

import pytest
import torch
import torch.fx as fx
from torch.testing import FileCheck

import fxpar
from fxpar import ir
from fxpar.passes.infra import PassContext, run_passes
from fxpar.passes.insert_collectives import insert_collectives_pass
from fxpar.passes.localize import localize_pass

from tests.passes.toy import annotate, call, mesh, module, placeholder

aten = torch.ops.aten


def _view_graph():
    """x[8, 16] S(0) -> view [8, 4, 4] S(0) -> dropout(0.5, train) S(0) -> output."""
    g = fx.Graph()
    x = annotate(placeholder(g, "x", (8, 16)), "S(0)")
    v = annotate(call(g, aten.view.default, (x, [8, 4, 4]), (8, 4, 4), "view"), "S(0)", ("S(0)",))
    d = annotate(call(g, aten.dropout.default, (v, 0.5, True), (8, 4, 4), "dropout"), "S(0)", ("S(0)",))
    o = g.output((d,))
    o.meta[ir.IN_SPECS] = (None,)
    return module(g)


@pytest.mark.parametrize("coord", [(0,), (1,)])
def test_local_shapes_size_args_and_dropout(coord):
    """On dp=2 every rank holds 4 rows: view's size argument becomes [4, 4, 4]; the global
    value stays under GLOBAL_VAL; dropout becomes fxpar's sharded dropout keyed by the node's
    name (site crc32("dropout")) and this rank's coordinate (dp shards the input)."""
    gm = run_passes(_view_graph(), PassContext(mesh=mesh(dp=2), coord=coord), [localize_pass])
    (FileCheck().check("aten.view.default(x, [4, 4, 4])")
     .check(f"dropout = torch.ops.fxpar.sharded_dropout.default(view, 0.5, True, "
            f"{zlib.crc32(b'dropout')}, [{coord[0]}])")
     .check_not("dropout.default").run(gm.code))
    v = next(n for n in gm.graph.nodes if n.name == "view")
    assert tuple(v.meta[ir.VAL].shape) == (4, 4, 4) and v.meta[ir.VAL].device.type == "meta"
    assert tuple(v.meta[ir.GLOBAL_VAL].shape) == (8, 4, 4)


def test_eval_dropout_is_left_alone():
    g = fx.Graph()
    x = annotate(placeholder(g, "x", (8, 16)), "S(0)")
    d = annotate(call(g, aten.dropout.default, (x, 0.5, False), (8, 16), "dropout"), "S(0)", ("S(0)",))
    g.output((d,))
    gm = run_passes(module(g), PassContext(mesh=mesh(dp=2), coord=(0,)), [localize_pass])
    FileCheck().check("aten.dropout.default(x, 0.5, False)").check_not("keep_mask").run(gm.code)


def test_random_op_refused_naming_the_node():
    g = fx.Graph()
    x = annotate(placeholder(g, "x", (8, 16)), "S(0)")
    r = annotate(call(g, aten.randn_like.default, (x,), (8, 16), "noise"), "S(0)", ("S(0)",))
    g.output((r,))
    with pytest.raises(fxpar.PlanError, match="node noise .*randn_like.*random ops other than dropout"):
        run_passes(module(g), PassContext(mesh=mesh(dp=2), coord=(1,)), [localize_pass])


def test_comm_op_shapes_become_local():
    """A wait's shape argument is the destination's local shape: S(0) -> S(1) on dp=2 of an
    [8, 16] tensor is [8, 8] on each rank."""
    g = fx.Graph()
    x = annotate(placeholder(g, "x", (8, 16)), "S(0)")
    y = annotate(call(g, aten.relu.default, (x,), (8, 16), "relu"), "S(1)", ("S(1)",))
    o = g.output((y,))
    o.meta[ir.IN_SPECS] = (None,)
    m = mesh(dp=2)
    gm = run_passes(module(g), PassContext(mesh=m), [insert_collectives_pass])
    FileCheck().check("torch.ops.fxpar.wait.default").check("[8, 16]").run(gm.code)
    gm = run_passes(gm, PassContext(mesh=m, coord=(0,)), [localize_pass])
    FileCheck().check("torch.ops.fxpar.wait.default").check("'x->relu', [8, 8], 'none')").run(gm.code)
