"""Op records (fxpar.strategies.base.register): one record per op, and the tables the records
fill (cost rules, views, non-differentiable ops, what the backward saves) agree with torch."""

from __future__ import annotations

import operator
import sys
from pathlib import Path

import pytest
import torch

import fxpar.strategies as st
from fxpar import ir
from fxpar.cost import compute as cc
from fxpar.strategies.base import RECORDS, declare, record_for, register
from fxpar.strategies.embedding import is_vocab_parallel
from fxpar.spec import Spec

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

aten = torch.ops.aten


def test_a_record_holds_rule_cost_and_flags():
    rec = record_for(aten.mm.default)
    assert rec is RECORDS[aten.mm]
    assert (rec.rule.__name__, rec.cost, rec.saves, rec.view, rec.differentiable) == \
        ("mm_rule", cc.mm_cost, "partners", False, True)
    assert record_for("frobnicate") is None and record_for(aten.histc.default).cost is None


def test_one_record_per_op():
    with pytest.raises(ValueError, match="already has a record"):
        declare(aten.mm, cost=cc.view_cost)
    assert RECORDS[aten.mm].cost is cc.mm_cost  # unchanged by the refused registration


def test_register_writes_the_cost_side_tables():
    # a custom op registered like any family would: its cost, view flag and differentiability
    lib = torch.library.Library("fxpar_test_records", "DEF")
    lib.define("twice(Tensor x) -> Tensor")
    lib.define("peek(Tensor(a) x) -> Tensor(a)")
    op, view = torch.ops.fxpar_test_records.twice, torch.ops.fxpar_test_records.peek
    try:
        register(op, cost=cc.pointwise_cost, saves="nothing", differentiable=False)(None)
        declare(view, cost=cc.view_cost, view=True)
        assert cc.cost_rule(op.default) is cc.pointwise_cost and cc.saves_of(op.default) == "nothing"
        assert not ir.is_differentiable(op.default) and ir.is_differentiable(view.default)
        assert cc.is_view(view.default) and not cc.is_view(op.default)
        assert st.strategy_rule(op.default) is None  # no sharding rule: replicated only
        with pytest.raises(ValueError, match="saves="):
            declare(aten.sin.out, saves="everything")
        assert aten.sin.out not in RECORDS
    finally:
        for k in (op, view):
            RECORDS.pop(k, None)
            cc._COST.pop(k, None)
            cc._VIEWS.discard(k)
            cc._SAVES.pop(k, None)
            ir.NON_DIFFERENTIABLE.discard(k)


@pytest.mark.parametrize("target, rule", [
    (aten.tanh_.default, cc.activation_cost),    # in-place: the functional op's rule
    (aten.addmm_.default, cc.addmm_cost),
    (aten.relu_.default, cc.pointwise_cost),     # its own record (no cost) falls back the same way
    (aten.scatter_.src, cc.copy_cost),
    (aten.mm.default, cc.mm_cost),
    ("view", cc.view_cost),                      # symbolic_trace method name -> aten.view
    (torch.matmul, cc.matmul_cost),              # torch binding -> aten.matmul
    (operator.getitem, cc.view_cost),
    (operator.mul, cc.pointwise_cost),
    ("frobnicate", None),
])
def test_cost_rule_lookup(target, rule):
    assert cc.cost_rule(target) is rule


def test_views_agree_with_torch_schemas():
    """Every overload of a packet recorded ``view=True`` that returns a tensor aliases its input
    in its ATen schema, except the few that are views in fxpar's sense only."""
    not_aliasing = {  # free and storage-sharing for fxpar's memory model, not aliases in ATen
        "aten._unsafe_view.default", "aten._unsafe_view.out", "aten.unsafe_split.Tensor",
        "aten.requires_grad_.default", "aten.detach_.default", "aten._functional_sym_constrain_range.default",
        "aten._functional_assert_async.msg", "_c10d_functional.wait_tensor.default"}
    bad = []
    for op in cc._VIEWS:
        if not isinstance(op, torch._ops.OpOverloadPacket):
            continue
        for name in op.overloads():
            ov = getattr(op, name)
            returns_tensor = any("Tensor" in str(r.type) for r in ov._schema.returns)
            if returns_tensor and not ov.is_view and str(ov) not in not_aliasing:
                bad.append(str(ov))
    assert bad == []


def test_non_differentiable_set_comes_from_records():
    assert ir.NON_DIFFERENTIABLE == {op for op, r in RECORDS.items() if not r.differentiable}
    assert not ir.is_differentiable(aten.eq.Tensor) and not ir.is_differentiable("detach")
    assert ir.is_differentiable(aten.add.Tensor) and ir.is_differentiable(operator.getitem)


def test_views_come_from_records():
    assert {op for op, r in RECORDS.items() if r.view is True} == cc._VIEWS
    assert all(cc.is_view(t) for t in (aten.view.default, aten.transpose.int, operator.getitem))
    assert cc.is_view_if_contiguous(aten.reshape.default) and not cc.is_view(aten.reshape.default)


def test_strategy_rule_falls_back_to_pointwise_tag():
    assert st.strategy_rule(aten.atan.default) is st.pointwise.pointwise_rule  # tagged, no rule of its own
    assert st.strategy_rule(aten.mm.default).__name__ == "mm_rule"
    assert st.strategy_rule(aten.dot.default) is None  # a record without a sharding rule


def test_op_keys():
    assert ir.op_keys(aten.mm.default) == (aten.mm.default, aten.mm)
    assert ir.op_keys("__add__")[-1] is aten.add
    assert ir.op_keys(operator.getitem) == (operator.getitem,)


def test_vocab_parallel_is_read_from_the_specs():
    assert is_vocab_parallel(Spec.parse("S(0)"), Spec.parse("R"))
    assert is_vocab_parallel(Spec.parse("RS(0)"), Spec.parse("S(0)R"))      # vocab on the 2nd axis
    assert not is_vocab_parallel(Spec.parse("S(0)"), Spec.parse("S(0)"))    # ids split there too
    assert not is_vocab_parallel(Spec.parse("S(1)R"), Spec.parse("RR"))     # column split
    assert not is_vocab_parallel(None, Spec.parse("R"))


def test_grad_flags_prune_false_is_reachability():
    """``grad_flags(prune=False)`` is capture's "may depend on a tensor that requires grad"."""
    from examples.models import GPT
    from fxpar.capture import capture

    torch.manual_seed(0)
    idx = torch.randint(0, 64, (2, 8))
    gm = capture(GPT(vocab=64, d_model=32, n_heads=4, n_layers=1, seq_len=8), (idx,), {"targets": idx})
    reach = ir.grad_flags(gm, prune=False)
    pruned = ir.grad_flags(gm)
    assert {n for n, f in reach.items() if f} >= {n for n, f in pruned.items() if f}
    # integer index math is reachable from nothing trainable; comparisons are pruned
    ids = next(n for n in gm.graph.nodes if n.op == "placeholder" and n.meta["val"].dtype == torch.long)
    assert not reach[ids] and not pruned[ids]
    emb = next(n for n in gm.graph.nodes if n.target is aten.embedding.default)
    assert reach[emb] and pruned[emb]
    # extra marks an input as carrying a gradient
    assert ir.grad_flags(gm, [ids])[ids]


def test_grad_flags_prunes_non_differentiable_and_integer_results():
    import torch.fx as fx

    g = fx.Graph()
    w = g.placeholder("w")
    w.meta["val"] = torch.zeros(4, requires_grad=True)
    gt = g.call_function(aten.gt.Scalar, (w, 0.0))
    gt.meta["val"] = torch.zeros(4, dtype=torch.bool)
    fl = g.call_function(aten.floor.default, (w,))
    fl.meta["val"] = torch.zeros(4)
    ex = g.call_function(aten.exp.default, (w,))
    ex.meta["val"] = torch.zeros(4)
    g.output((gt, fl, ex))
    flags = ir.grad_flags(fx.GraphModule(torch.nn.Module(), g))
    assert flags == {w: True, gt: False, fl: False, ex: True}
    assert ir.grad_flags(fx.GraphModule(torch.nn.Module(), g), prune=False) == {w: True, gt: True, fl: True, ex: True}
