"""Local rewrites (fxpar.strategies.local and the records' ``local=`` entries) on toy fx graphs:
each rule edits one node given this rank's LocalContext, as passes/localize.py calls it."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx

import fxpar.runtime.ops  # noqa: F401  (registers torch.ops.fxpar.*)
from fxpar import ir
from fxpar.errors import PlanError
from fxpar.spec import Spec
from fxpar.strategies import LocalContext, local_rule
from fxpar.strategies.local import arange_bounds, shape_arg, unflatten_sizes

aten = torch.ops.aten
CPU = torch.device("cpu")


def _call(target, args, local_shape, *, specs=None, in_specs=None, kwargs=None, global_shapes=None):
    """One call_function node whose placeholders carry global fake values; returns (node, shapes)."""
    g = fx.Graph()
    shapes = {}

    def ph(a):
        if isinstance(a, torch.Tensor):
            n = g.placeholder(f"t{len(shapes)}")
            n.meta[ir.VAL] = a
            shapes[n] = tuple(a.shape)
            return n
        return a

    n = g.call_function(target, tuple(ph(a) for a in args), kwargs or {})
    n.meta[ir.VAL] = torch.empty(local_shape, device="meta")
    if specs is not None:
        n.meta[ir.SPECS] = tuple(Spec.parse(s) for s in specs)
    if in_specs is not None:
        n.meta[ir.IN_SPECS] = tuple(None if s is None else Spec.parse(s) for s in in_specs)
    shapes.update(global_shapes or {})
    return n, shapes


@pytest.mark.parametrize("target, args, local, want", [
    (aten.view.default, (torch.zeros(4, 6), [4, 2, 3]), (2, 2, 3), [2, 2, 3]),
    (aten.reshape.default, (torch.zeros(4, 6), [24]), (12,), [12]),
    (aten._unsafe_view.default, (torch.zeros(4, 6), [4, 6]), (4, 3), [4, 3]),
    (aten.expand.default, (torch.zeros(1, 6), [8, 6]), (4, 6), [4, 6]),
    (aten.new_zeros.default, (torch.zeros(3), [8, 2]), (4, 2), [4, 2]),
    (aten.new_full.default, (torch.zeros(3), [8, 2], 1.0), (8, 1), [8, 1]),
])
def test_size_argument_becomes_the_local_shape(target, args, local, want):
    n, shapes = _call(target, args, local)
    local_rule(target)(n, LocalContext((2,), (1,), CPU, shapes))
    assert n.target is target and n.args[1] == want and n.args[2:] == args[2:]


@pytest.mark.parametrize("target, args, local", [
    (aten.zeros.default, ([8, 4],), (2, 4)),
    (aten.ones.default, ([8, 4],), (8, 1)),
    (aten.full.default, ([8, 4], 3.0), (4, 4)),
    (aten.empty.memory_format, ([8, 4],), (8, 2)),
])
def test_factory_size_becomes_the_local_shape(target, args, local):
    n, shapes = _call(target, args, local)
    local_rule(target)(n, LocalContext((4,), (0,), CPU, shapes))
    assert n.args[0] == list(local) and n.args[1:] == args[1:]


def test_other_overloads_keep_their_arguments():
    n, shapes = _call(aten.view.dtype, (torch.zeros(4, 6), torch.float16), (2, 6))
    local_rule(aten.view.dtype)(n, LocalContext((2,), (0,), CPU, shapes))
    assert n.args[1] is torch.float16
    assert shape_arg(1, "default").__name__ == "shape_arg(1, 'default')"


@pytest.mark.parametrize("dim, local, want", [(1, (3, 2, 8), [2, 8]), (-1, (3, 2, 8), [2, 8]),
                                              (0, (2, 4, 5), [2, 4])])
def test_unflatten_sizes(dim, local, want):
    x = torch.zeros(3, 32) if dim != 0 else torch.zeros(8, 5)
    sizes = [4, 8] if dim != 0 else [2, 4]
    n, shapes = _call(aten.unflatten.int, (x, dim, sizes), local)
    assert local_rule(aten.unflatten.int) is unflatten_sizes
    unflatten_sizes(n, LocalContext((2,), (0,), CPU, shapes))
    assert n.args[2] == want and n.args[1] == dim


@pytest.mark.parametrize("target, args, coord, want", [
    (aten.arange.default, (10,), (1,), (5, 10, 1)),
    (aten.arange.start, (2, 12), (0,), (2, 7, 1)),
    (aten.arange.start_step, (0, 20, 2), (1,), (10, 20, 2)),
])
def test_sharded_arange_gets_this_ranks_bounds(target, args, coord, want):
    n, shapes = _call(target, args, (5,), specs=["S(0)"])
    assert local_rule(target) is arange_bounds
    arange_bounds(n, LocalContext((2,), coord, CPU, {**shapes, n: (10,)}))
    assert n.target is aten.arange.start_step and n.args == want
    assert torch.arange(*n.args).tolist() == torch.arange(*args).tolist()[5 * coord[0]:5 * coord[0] + 5]


def test_replicated_arange_is_left_alone():
    n, shapes = _call(aten.arange.default, (10,), (10,), specs=["R"])
    arange_bounds(n, LocalContext((2,), (1,), CPU, {n: (10,)}))
    assert n.target is aten.arange.default and n.args == (10,)


W, IDS = torch.randn(8, 3, generator=torch.Generator().manual_seed(0)), torch.tensor([[0, 5, 7, 2]])


def _embedding(wspec, ispec, coord, mesh=(2,)):
    w, ids = W, IDS
    n, shapes = _call(aten.embedding.default, (w, ids), (1, 4, 3), in_specs=[wspec, ispec])
    lctx = LocalContext(mesh, coord, CPU, shapes)
    local_rule(n.target)(n, lctx)
    return n, w, ids


def test_vocab_parallel_embedding_is_chosen_by_the_specs():
    from fxpar.runtime.ops import vocab_parallel_embedding

    total = 0
    for r in range(2):
        n, w, ids = _embedding("S(0)", "R", (r,))
        assert n.target is vocab_parallel_embedding and n.args[2] == 4 * r
        total = total + n.target(w[4 * r:4 * r + 4], ids, *n.args[2:])
    assert torch.allclose(total, torch.nn.functional.embedding(ids, w))  # P(sum) of the pieces


@pytest.mark.parametrize("wspec, ispec", [("S(1)", "R"), ("R", "S(0)"), ("R", "R")])
def test_other_embeddings_stay_plain(wspec, ispec):
    n, _, _ = _embedding(wspec, ispec, (1,))
    assert n.target is aten.embedding.default and len(n.args) == 2


def test_dropout_becomes_sharded_dropout_keyed_by_site_and_shard():
    n, shapes = _call(aten.dropout.default, (torch.zeros(4, 6), 0.1, True), (2, 6),
                      in_specs=["S(0)RS(1)"])
    x = n.args[0]
    local_rule(n.target)(n, LocalContext((2, 2, 2), (1, 0, 1), CPU, shapes, site=7))
    assert n.target is torch.ops.fxpar.sharded_dropout.default
    assert n.args == (x, 0.1, True, 7, [1, 1]) and n.kwargs == {}


@pytest.mark.parametrize("p, train", [(0.1, False), (0.0, True)])
def test_dropout_that_draws_nothing_is_left_alone(p, train):
    n, shapes = _call(aten.dropout.default, (torch.zeros(4), p, train), (4,), in_specs=["R"])
    local_rule(n.target)(n, LocalContext((2,), (0,), CPU, shapes))
    assert n.target is aten.dropout.default


@pytest.mark.parametrize("target, args", [
    (aten._standard_gamma.default, (torch.ones(4),)),
    (aten.binomial.default, (torch.ones(4), torch.full((4,), 0.5))),
])
def test_random_ops_without_a_keyed_form_are_refused_naming_the_node(target, args):
    n, shapes = _call(target, args, (4,), in_specs=["R"] * sum(isinstance(a, torch.Tensor) for a in args))
    rule = local_rule(target)
    assert rule is not None
    with pytest.raises(PlanError, match=rf"node {n.name} .*random op"):
        rule(n, LocalContext((2,), (0,), CPU, shapes))


def test_random_rule_comes_from_the_tag_not_a_list():
    """Every op torch tags nondeterministic_seeded goes to the keyed rewrite (which refuses
    the few without a keyed form), whether or not it is listed anywhere."""
    from fxpar.strategies.rand import keyed_local

    for t in (aten.randperm.default, aten.poisson.default, aten._standard_gamma.default):
        assert torch.Tag.nondeterministic_seeded in t.tags and local_rule(t) is keyed_local


def test_attention_without_dropout_and_plain_ops_need_no_rewrite():
    q = torch.zeros(1, 1, 2, 4)
    n, shapes = _call(aten.scaled_dot_product_attention.default, (q, q, q), (1, 1, 2, 4))
    local_rule(n.target)(n, LocalContext((2,), (0,), CPU, shapes))  # no error, unchanged
    assert n.target is aten.scaled_dot_product_attention.default
    assert local_rule(aten.mm.default) is None and local_rule(aten.add.Tensor) is None


def test_context_names_a_missing_global_shape():
    g = fx.Graph()
    x = g.placeholder("x")
    with pytest.raises(KeyError, match="node x"):
        LocalContext((2,), (0,), CPU).global_shape(x)
