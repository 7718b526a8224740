"""Random ops under sharding: each becomes a shard-keyed op (:mod:`fxpar.runtime.keyed`).

Every ATen op tagged ``nondeterministic_seeded`` that draws (:func:`~fxpar.strategies.local.draws`)
is rewritten by ``localize`` into a ``torch.ops.fxpar.keyed_*`` op keyed by the node's *site*
(the crc32 of its name) and this rank's *shard key*: its coordinates on the mesh axes that
shard the drawn tensor (:func:`~fxpar.strategies.local.shard_key` of the node's output spec).
So ranks holding the same data draw the same values (a replicated draw is one draw made on
every rank alike), different shards independent ones, and a recomputed forward or a pipeline's
backward draws again what the forward drew. The rewrites are the table :data:`LOWERINGS`
(overload -> rewrite); ``aten.dropout`` (:func:`fxpar.strategies.pointwise.dropout_local`) and
training attention with dropout (:func:`fxpar.strategies.attention.attention_local`) have
theirs in their family files.

A random op that draws and has no rewrite (fused attention kernels with dropout, RNNs with
dropout, ``_standard_gamma``, ``binomial``...) is refused by the PLANNER
(:func:`check_random`, called by :func:`fxpar.strategies.strategies_for`), naming the node, so
``fxpar.plan`` fails rather than the runner.

``x.clone().exponential_()`` with ``x`` ``S(0)`` on a 2-way axis, rank 1, becomes
``keyed_random_(clone, 'exponential', [1.0], site, [1])``; replicated, its key is ``[]``.

>>> import torch, torch.fx as fx
>>> from fxpar.spec import Spec
>>> from fxpar.strategies.local import LocalContext
>>> g = fx.Graph(); x = g.placeholder("x")
>>> e = g.call_function(torch.ops.aten.exponential_.default, (x,))
>>> e.meta["val"] = torch.empty(2, 4, device="meta"); e.meta["fxpar_specs"] = (Spec.parse("S(0)"),)
>>> keyed_local(e, LocalContext((2,), (1,), torch.device("cpu"), site=9)); e.target, e.args
(<OpOverload(op='fxpar.keyed_random_', overload='default')>, (x, 'exponential', [1.0], 9, [1]))
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.fx as fx

from fxpar import ir
from fxpar.errors import PlanError
from fxpar.strategies.base import bound
from fxpar.strategies.local import (RANDOM_RULE, LocalContext, draws, refusal, refuse_random,
                                    shard_key)

__all__ = ["LOWERINGS", "keyed_local", "check_random", "is_random", "random_key", "refusal"]

aten = torch.ops.aten


def is_random(target) -> bool:
    """An ATen op tagged ``nondeterministic_seeded`` (every overload of torch's random ops)."""
    return isinstance(target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in target.tags


def random_key(node: fx.Node, lctx: LocalContext, dims: Iterable[int] | None = None) -> list[int]:
    """This rank's shard key for the tensor ``node`` draws: its coordinates on the mesh axes where
    the node's output spec is ``Shard(d)`` (with ``d`` in ``dims`` when given: the dims the
    drawn tensor has; a feature-dropout noise is ``[N, C, 1...]``, so only dims 0 and 1)."""
    spec = node.meta[ir.SPECS][0]
    if dims is None:
        return shard_key(spec, lctx.coord)
    from torch.distributed.tensor import Shard

    dims = set(dims)
    return [int(c) for c, p in zip(lctx.coord, spec) if isinstance(p, Shard) and p.dim in dims]


def _local_shape(node: fx.Node) -> list[int]:
    v = node.meta[ir.VAL]
    return [int(s) for s in (v[0] if isinstance(v, (tuple, list)) else v).shape]


def _dtype(node: fx.Node) -> torch.dtype:
    v = node.meta[ir.VAL]
    return (v[0] if isinstance(v, (tuple, list)) else v).dtype


def _set(node: fx.Node, target, *args) -> None:
    node.target, node.args, node.kwargs = target, tuple(args), {}


def _ops():
    import fxpar.runtime.ops  # noqa: F401  (registers torch.ops.fxpar: only when localizing)

    return torch.ops.fxpar


# --- rewrites ------------------------------------------------------------------------------------
def _fill(kind: str, params: Callable[[dict], list]) -> Callable:
    """``self.<kind>_(...)`` in place -> ``keyed_random_(self, kind, params, site, key)``."""

    def rewrite(node: fx.Node, lctx: LocalContext) -> None:
        b = bound(node)
        _set(node, _ops().keyed_random_.default, b["self"], kind, params(b), lctx.site, random_key(node, lctx))

    return rewrite


def _new(kind: str, params: Callable[[dict], list]) -> Callable:
    """A new tensor of the node's local shape and dtype (``rand``, ``randn_like``,
    ``exponential(x)``...) -> ``keyed_draw(shape, dtype, device, kind, params, site, key)``."""

    def rewrite(node: fx.Node, lctx: LocalContext) -> None:
        _set(node, _ops().keyed_draw.default, _local_shape(node), _dtype(node), lctx.device, kind,
             params(bound(node)), lctx.site, random_key(node, lctx))

    return rewrite


def _randperm(node: fx.Node, lctx: LocalContext) -> None:
    spec = node.meta[ir.SPECS][0]
    if not spec.is_replicated:  # a piece of ONE permutation is no local draw
        raise PlanError(f"node {node.name} ({node.target}): a sharded randperm ({spec}) is not "
                        "supported; keep it replicated")
    _new("randperm", lambda b: [])(node, lctx)


def _sample(kind: str, source: str, params: Callable[[dict], list]) -> Callable:
    """A draw parameterized by the tensor ``source`` -> ``keyed_sample(x, kind, params, site, key)``."""

    def rewrite(node: fx.Node, lctx: LocalContext) -> None:
        b = bound(node)
        _set(node, _ops().keyed_sample.default, b[source], kind, params(b), lctx.site, random_key(node, lctx))

    return rewrite


def _transform(kind: str, params: Callable[[dict], list], x: str = "input", inplace: bool = False,
               dims: Iterable[int] | None = None) -> Callable:
    """A random function of a tensor (``rrelu``, the dropout variants) -> ``keyed_random``
    (``keyed_random_`` for the in-place forms)."""

    def rewrite(node: fx.Node, lctx: LocalContext) -> None:
        b = bound(node)
        op = _ops().keyed_random_.default if inplace else _ops().keyed_random.default
        _set(node, op, b[x], kind, params(b), lctx.site, random_key(node, lctx, dims))

    return rewrite


def _bernoulli_tensor_(node: fx.Node, lctx: LocalContext) -> None:
    b = bound(node)
    _set(node, _ops().keyed_random_.default, b["self"], "bernoulli", [], lctx.site, random_key(node, lctx), b["p"])


def _normal(node: fx.Node, lctx: LocalContext) -> None:
    b = bound(node)
    mean, std = b["mean"], b["std"]
    tm, ts = isinstance(mean, fx.Node), isinstance(std, fx.Node)
    _set(node, _ops().keyed_normal.default, mean if tm else None, std if ts else None,
         0.0 if tm else float(mean), 0.0 if ts else float(std), _local_shape(node), lctx.site,
         random_key(node, lctx))


def _native_dropout(node: fx.Node, lctx: LocalContext) -> None:
    b = bound(node)
    _set(node, _ops().keyed_native_dropout.default, b["input"], float(b["p"]), lctx.site, random_key(node, lctx))


def _f(*names: str) -> Callable[[dict], list]:
    return lambda b: [float(b[n]) for n in names]


def _random_from(node: fx.Node, lctx: LocalContext) -> None:
    b = bound(node)
    if b["to"] is None:
        _fill("random_from", _f("from"))(node, lctx)
    else:
        _fill("random", _f("from", "to"))(node, lctx)


_FEATURE = (0, 1)  # feature noise is [N, C, 1, ...]: shards of other dims share it

#: overload -> local rewrite into a keyed op (module docstring). Only calls that draw get here.
LOWERINGS: dict[object, Callable[[fx.Node, LocalContext], None]] = {
    # in-place fills
    aten.uniform_.default: _fill("uniform", _f("from", "to")),
    aten.normal_.default: _fill("normal", _f("mean", "std")),
    aten.exponential_.default: _fill("exponential", _f("lambd")),
    aten.cauchy_.default: _fill("cauchy", _f("median", "sigma")),
    aten.log_normal_.default: _fill("log_normal", _f("mean", "std")),
    aten.geometric_.default: _fill("geometric", _f("p")),
    aten.bernoulli_.float: _fill("bernoulli", _f("p")),
    aten.bernoulli_.Tensor: _bernoulli_tensor_,
    aten.random_.default: _fill("random", lambda b: []),
    aten.random_.to: _fill("random", _f("to")),
    getattr(aten.random_, "from"): _random_from,  # (a keyword in Python)
    # functional forms of the fills: a new tensor shaped like self
    aten.uniform.default: _new("uniform", _f("from", "to")),
    aten.normal_functional.default: _new("normal", _f("mean", "std")),
    aten.exponential.default: _new("exponential", _f("lambd")),
    aten.cauchy.default: _new("cauchy", _f("median", "sigma")),
    aten.log_normal.default: _new("log_normal", _f("mean", "std")),
    aten.geometric.default: _new("geometric", _f("p")),
    aten.bernoulli.p: _new("bernoulli", _f("p")),
    # factories and *_like (the node's local shape and dtype)
    aten.rand.default: _new("uniform", lambda b: [0.0, 1.0]),
    aten.rand.generator: _new("uniform", lambda b: [0.0, 1.0]),
    aten.rand_like.default: _new("uniform", lambda b: [0.0, 1.0]),
    aten.rand_like.generator: _new("uniform", lambda b: [0.0, 1.0]),
    aten.randn.default: _new("normal", lambda b: [0.0, 1.0]),
    aten.randn.generator: _new("normal", lambda b: [0.0, 1.0]),
    aten.randn_like.default: _new("normal", lambda b: [0.0, 1.0]),
    aten.randn_like.generator: _new("normal", lambda b: [0.0, 1.0]),
    aten.normal.float_float: _new("normal", _f("mean", "std")),
    aten.randint.default: _new("random", lambda b: [0.0, float(b["high"])]),
    aten.randint.generator: _new("random", lambda b: [0.0, float(b["high"])]),
    aten.randint.low: _new("random", _f("low", "high")),
    aten.randint.low_generator: _new("random", _f("low", "high")),
    aten.randint_like.default: _new("random", lambda b: [0.0, float(b["high"])]),
    aten.randint_like.generator: _new("random", lambda b: [0.0, float(b["high"])]),
    aten.randint_like.low_dtype: _new("random", _f("low", "high")),
    aten.randint_like.low_generator_dtype: _new("random", _f("low", "high")),
    aten.randperm.default: _randperm,
    aten.randperm.generator: _randperm,
    # draws parameterized by a tensor
    aten.bernoulli.default: _sample("bernoulli", "self", lambda b: []),
    aten.poisson.default: _sample("poisson", "self", lambda b: []),
    aten.multinomial.default: _sample("multinomial", "self",
                                      lambda b: [float(b["num_samples"]), float(bool(b["replacement"]))]),
    # differentiable: composites of keyed draws and ATen ops (ATen's gradients)
    aten.normal.Tensor_float: _normal,
    aten.normal.float_Tensor: _normal,
    aten.normal.Tensor_Tensor: _normal,
    aten.rrelu.default: _transform("rrelu", _f("lower", "upper"), x="self"),
    aten.rrelu_.default: _transform("rrelu", _f("lower", "upper"), x="self", inplace=True),
    aten.native_dropout.default: _native_dropout,
    aten.alpha_dropout.default: _transform("alpha_dropout", _f("p")),
    aten.feature_dropout.default: _transform("feature_dropout", _f("p"), dims=_FEATURE),
    aten.feature_alpha_dropout.default: _transform("feature_alpha_dropout", _f("p"), dims=_FEATURE),
    aten.dropout_.default: _transform("dropout", _f("p"), x="self", inplace=True),
    aten.alpha_dropout_.default: _transform("alpha_dropout", _f("p"), x="self", inplace=True),
    aten.feature_dropout_.default: _transform("feature_dropout", _f("p"), x="self", inplace=True, dims=_FEATURE),
    aten.feature_alpha_dropout_.default: _transform("feature_alpha_dropout", _f("p"), x="self", inplace=True,
                                                    dims=_FEATURE),
}

#: random ops whose rewrite lives in their family file's record (``local=``).
_OWN_REWRITE = {aten.dropout.default, aten.scaled_dot_product_attention.default}


def keyed_local(node: fx.Node, lctx: LocalContext) -> None:
    """The local rewrite of a random op without one in its record: its :data:`LOWERINGS` entry
    when the call draws (:func:`draws`; a call drawing nothing stays the plain op), else
    :class:`PlanError` naming the node (normally raised at plan time already: :func:`check_random`)."""
    if not draws(node):
        return
    rewrite = LOWERINGS.get(node.target)
    if rewrite is None:
        refuse_random(node, lctx)
    else:
        rewrite(node, lctx)


def check_random(node: fx.Node) -> None:
    """At plan time: :class:`PlanError` naming the node if it is a random op that draws and
    that ``localize`` has no keyed form for (so ``fxpar.plan`` refuses it, not the runner)."""
    if node.op != "call_function" or not is_random(node.target) or not draws(node):
        return
    if node.target in LOWERINGS or node.target in _OWN_REWRITE:
        return
    raise PlanError(refusal(node))


RANDOM_RULE[:] = [keyed_local]   # strategies.local's rule for random ops without a record
