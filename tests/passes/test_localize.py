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


def test_random_op_without_a_keyed_form_refused_naming_the_node():
    g = fx.Graph()
    x = annotate(placeholder(g, "x", (8, 16)), "S(0)")
    r = annotate(call(g, aten._standard_gamma.default, (x,), (8, 16), "gamma"), "S(0)", ("S(0)",))
    g.output((r,))
    with pytest.raises(fxpar.PlanError, match="node gamma .*_standard_gamma.*no shard-keyed form"):
        run_passes(module(g), PassContext(mesh=mesh(dp=2), coord=(1,)), [localize_pass])


def _random_graph():
    """x[8, 16] S(0)R -> randn_like S(0)R; exponential_ of a clone S(0)S(1); rand [8, 16] RR (a
    factory: replicated); feature_dropout of a [8, 4, 6, 6] image S(0)S(2) (the noise is
    [8, 4, 1, 1]: only the dp axis shards it)."""
    g = fx.Graph()
    x = annotate(placeholder(g, "x", (8, 16)), "S(0)R")
    img = annotate(placeholder(g, "img", (8, 4, 6, 6)), "S(0)S(2)")
    n = annotate(call(g, aten.randn_like.default, (x,), (8, 16), "noise"), "S(0)R", ("S(0)R",))
    c = annotate(call(g, aten.clone.default, (x,), (8, 16), "clone"), "S(0)S(1)", ("S(0)S(1)",))
    e = annotate(call(g, aten.exponential_.default, (c, 2.0), (8, 16), "expo"), "S(0)S(1)", ("S(0)S(1)",))
    r = annotate(call(g, aten.rand.default, ([8, 16],), (8, 16), "rand"), "RR")
    f = annotate(call(g, aten.feature_dropout.default, (img, 0.5, True), (8, 4, 6, 6), "fdrop"),
                 "S(0)S(2)", ("S(0)S(2)",))
    d = annotate(call(g, aten.feature_dropout.default, (img, 0.5, False), (8, 4, 6, 6), "eval_drop"),
                 "S(0)S(2)", ("S(0)S(2)",))
    o = g.output((n, e, r, f, d))
    o.meta[ir.IN_SPECS] = (None,) * 5
    return module(g)


@pytest.mark.parametrize("coord", [(0, 1), (1, 0)])
def test_random_ops_become_keyed_by_site_and_the_drawn_tensors_shard_axes(coord):
    """Each random op calls a torch.ops.fxpar.keyed_* op with its node's site and this rank's
    coordinates on the axes that shard what it draws (local shapes, dtype, device)."""
    gm = run_passes(_random_graph(), PassContext(mesh=mesh(dp=2, tp=2), coord=coord), [localize_pass])
    d, t = coord
    site = {k: zlib.crc32(k.encode()) for k in ("noise", "expo", "rand", "fdrop")}
    (FileCheck()
     .check(f"noise = torch.ops.fxpar.keyed_draw.default([4, 16], torch.float32, device(type='cpu'), "
            f"'normal', [0.0, 1.0], {site['noise']}, [{d}])")
     .check(f"expo = torch.ops.fxpar.keyed_random_.default(clone, 'exponential', [2.0], {site['expo']}, [{d}, {t}])")
     .check(f"rand = torch.ops.fxpar.keyed_draw.default([8, 16], torch.float32, device(type='cpu'), "
            f"'uniform', [0.0, 1.0], {site['rand']}, [])")
     .check(f"fdrop = torch.ops.fxpar.keyed_random.default(img, 'feature_dropout', [0.5], {site['fdrop']}, [{d}])")
     .check("eval_drop = torch.ops.aten.feature_dropout.default(img, 0.5, False)")
     .run(gm.code))


def test_training_attention_dropout_becomes_keyed_sdpa():
    """sdpa(q, k, v, dropout_p=0.1, is_causal=True) with heads on tp: keyed_sdpa keyed by the
    axes sharding B, H or L (here tp); without dropout the plain op stays."""
    g = fx.Graph()
    q, k, v = (annotate(placeholder(g, n, (2, 4, 8, 16)), "RS(1)") for n in "qkv")
    a = annotate(g.call_function(aten.scaled_dot_product_attention.default, (q, k, v),
                                 {"dropout_p": 0.1, "is_causal": True}), "RS(1)", ("RS(1)",) * 3)
    a.name, a.meta[ir.VAL] = "attn", call(g, aten.clone.default, (q,), (2, 4, 8, 16)).meta[ir.VAL]
    b = annotate(g.call_function(aten.scaled_dot_product_attention.default, (q, k, v), {"is_causal": True}),
                 "RS(1)", ("RS(1)",) * 3)
    b.name, b.meta[ir.VAL] = "plain", a.meta[ir.VAL]
    g.output((a, b)).meta[ir.IN_SPECS] = (None, None)
    gm = run_passes(module(g), PassContext(mesh=mesh(dp=2, tp=2), coord=(1, 1)), [localize_pass])
    (FileCheck().check(f"attn = torch.ops.fxpar.keyed_sdpa.default(q, k, v, None, 0.1, True, None, False, "
                       f"{zlib.crc32(b'attn')}, [1])")
     .check("plain = torch.ops.aten.scaled_dot_product_attention.default(q, k, v, is_causal = True)")
     .run(gm.code))


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
