"""Compute cost: FLOPs and bytes moved per ATen op, forward and backward, and roofline time.

Pure functions of shapes and dtypes. :func:`node_cost` reads a node's fake-tensor meta
(``node.meta["val"]``), :func:`op_cost` takes shapes directly (e.g. the *local* shapes of a
sharded strategy), :func:`graph_cost` sums a whole graph, propagating which tensors need a
gradient from the parameters.

Counting rules (a FLOP is one multiply or one add, Megatron-LM Appendix):

===============  ============================================================  =======================
family           forward FLOPs                                                 backward FLOPs
===============  ============================================================  =======================
matmul           ``2·M·K·N`` (× batch) for mm/bmm/addmm/baddbmm/matmul/         ``2·M·K·N`` per operand
                 linear/einsum; bias adds not counted (< 1/(2K) of the GEMM)   that needs a gradient
attention        SDPA (all variants): ``2·B·H·L·S·(E + Ev)`` (QKᵀ and PV);      ``2×`` forward (dQ, dK,
                 the causal mask does not halve it (Megatron, AMSP fn. 2)      dV, dP), per operand
convolution      ``2·N·C_out·(C_in/groups)·Πk·Π(out spatial)``                 same per operand
embedding        0 (a gather)                                                  ``numel(out)`` (scatter-add)
norms            ``5·numel`` (layer/group/batch/RMS norm)                      ``2×`` forward
softmax, loss    ``5·numel`` (softmax, log-softmax, cross-entropy)             ``4·numel``
pointwise        ``numel(out)``                                                ``numel(out)`` per input
                                                                               needing a gradient
activation       as pointwise (transcendental: gelu, silu, tanh, exp, erf, ...;  as pointwise
                 kind ``"activation"``, priced at a measured rate of their own)
reductions       ``numel(input)``                                              ``numel(input)``
views, shapes    0 FLOPs, 0 bytes (aliases of their input)                     0
copies           0 FLOPs, read + write bytes                                   same bytes
===============  ============================================================  =======================

Bytes moved: forward reads every tensor input and writes every output; backward, per input
that needs a gradient, reads the output gradient and the saved operands and writes the input
gradient (for a matmul that is ``2×`` the forward bytes). SDPA is priced as a fused
(flash) kernel: the ``L×S`` score matrix never reaches memory. Ops without a rule count bytes
only (forward; backward bytes = forward bytes when an input needs a gradient) and are listed in
:attr:`GraphCost.unknown_ops`; an unknown op never raises, a rule that raises is a bug and
raises :class:`CostRuleError` naming the op and the rule.

**Where an op's rule lives.** This module holds the formulas (``mm_cost``, ``pointwise_cost``, ...:
pure functions ``(args, kwargs, out) -> OpCost`` with :class:`TensorArg` in place of tensors) and
the lookup (:func:`cost_rule`, :func:`is_view`, :func:`saves_of`), keyed by op objects. Which op
uses which formula is written once, in the op's record in :mod:`fxpar.strategies`
(``register(aten.mm, cost=mm_cost)``), which fills the table through :func:`set_op_cost`; this
package imports nothing of strategies, planner, solver, runtime or passes.

Megatron-LM's FLOP formula (PTD-P §5.1 eq. 3 and Appendix) counts GEMMs only (attention
scores included); :attr:`GraphCost.gemm_flops` counts the same way, and for a GPT equals
``72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h))`` (no recomputation) and, recomputing the transformer
layers, ``96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h))``.

>>> import torch
>>> from fxpar.cost.compute import op_cost, TensorArg
>>> x = TensorArg((8, 512, 1024), torch.bfloat16, requires_grad=True)
>>> w = TensorArg((4096, 1024), torch.bfloat16, requires_grad=True)
>>> c = op_cost(torch.ops.aten.linear.default, (x, w), out=TensorArg((8, 512, 4096), torch.bfloat16))
>>> c.fwd_flops == 2 * 8 * 512 * 1024 * 4096, c.bwd_flops == 2 * c.fwd_flops, c.kind
(True, True, 'matmul')
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from fxpar.errors import FxparError
from fxpar.kinds import StrKind
from fxpar.ir import grad_flags, op_keys

__all__ = [
    "TensorArg",
    "OpCost",
    "GraphCost",
    "GEMM_KINDS",
    "op_cost",
    "node_cost",
    "graph_cost",
    "roofline_time",
    "calibrated_time",
    "op_time",
    "gemm_efficiency",
    "physics_time",
    "op_overheads",
    "dispatches",
    "node_dispatches",
    "Rule",
    "CostRuleError",
    "set_op_cost",
    "cost_rule",
    "is_view",
    "is_view_if_contiguous",
    "saves_of",
    "SAVES_KINDS",
    "Saves",
    "op_name",
    # the formulas (pure functions (args, kwargs, out) -> OpCost) that op records reference
    "mm_cost", "addmm_cost", "bmm_cost", "baddbmm_cost", "matmul_cost", "linear_cost", "einsum_cost",
    "sdpa_cost", "convolution_cost", "convnd_cost", "conv_transpose_cost", "embedding_cost",
    "norm_cost", "softmax_cost", "pointwise_cost", "activation_cost", "dropout_cost", "reduction_cost", "copy_cost",
    "maybe_copy_cost", "creation_cost", "view_cost",
]

_VAL = "val"

#: Kinds whose FLOPs Megatron-LM counts (its formula considers GEMMs only).
GEMM_KINDS = ("matmul", "attention", "conv")


# --------------------------------------------------------------------------------------------
# value types
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TensorArg:
    """Shape, dtype and gradient flag of one tensor argument of an op.

    ``requires_grad`` defaults to "floating point" (training: every float activation carries
    a gradient) when left as ``None``; ``contiguous`` decides whether ``contiguous``/``reshape``
    copy.
    """

    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32
    requires_grad: bool | None = None
    contiguous: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(_as_int(s) for s in self.shape))
        if self.requires_grad is None:
            object.__setattr__(self, "requires_grad", bool(self.dtype.is_floating_point or self.dtype.is_complex))

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @property
    def is_float(self) -> bool:
        return self.dtype.is_floating_point or self.dtype.is_complex

    @classmethod
    def of(cls, v: Any, requires_grad: bool | None = None) -> TensorArg | None:
        """From a (fake) tensor or anything with ``shape``/``dtype`` (e.g. ``fxpar.ir.TensorMeta``)."""
        if isinstance(v, torch.Tensor):
            try:
                contig = bool(v.is_contiguous())
            except Exception:  # noqa: BLE001 - symbolic strides
                contig = True
            return cls(tuple(v.shape), v.dtype, requires_grad, contig)
        if hasattr(v, "shape") and hasattr(v, "dtype") and isinstance(getattr(v, "dtype"), torch.dtype):
            rg = requires_grad if requires_grad is not None else getattr(v, "requires_grad", None)
            return cls(tuple(v.shape), v.dtype, rg)
        return None


@dataclass(frozen=True)
class OpCost:
    """FLOPs and bytes of one op, forward and backward; ``kind`` is its family (see the table
    in the module docstring); ``known`` is False for ops priced by bytes only."""

    fwd_flops: float = 0.0
    bwd_flops: float = 0.0
    fwd_bytes: float = 0.0
    bwd_bytes: float = 0.0
    kind: str = "other"
    known: bool = True
    #: a GEMM's forward product ``(batch, m, n, k)`` (``b × (m×k)·(k×n)``), read by
    #: :func:`gemm_efficiency`; ``()``: not a GEMM, or its shape is not known
    gemm: tuple[int, int, int, int] | tuple = ()

    @property
    def flops(self) -> float:
        return self.fwd_flops + self.bwd_flops

    @property
    def nbytes(self) -> float:
        return self.fwd_bytes + self.bwd_bytes

    def scaled(self, f: float) -> OpCost:
        """All four numbers times ``f`` (e.g. ``1/shards`` for an evenly split op)."""
        return OpCost(self.fwd_flops * f, self.bwd_flops * f, self.fwd_bytes * f, self.bwd_bytes * f,
                      self.kind, self.known)

    def __add__(self, other: OpCost) -> OpCost:
        kind = self.kind if self.kind == other.kind else "mixed"
        return OpCost(self.fwd_flops + other.fwd_flops, self.bwd_flops + other.bwd_flops,
                      self.fwd_bytes + other.fwd_bytes, self.bwd_bytes + other.bwd_bytes,
                      kind, self.known and other.known)


ZERO = OpCost(kind="view")


@dataclass
class GraphCost:
    """Totals over a graph. ``recompute_*`` is the extra forward of recomputed nodes;
    ``by_kind`` sums per op family; ``per_node`` maps node names to their :class:`OpCost`;
    ``unknown_ops`` lists the targets priced by bytes only."""

    fwd_flops: float = 0.0
    bwd_flops: float = 0.0
    fwd_bytes: float = 0.0
    bwd_bytes: float = 0.0
    recompute_flops: float = 0.0
    recompute_bytes: float = 0.0
    gemm_fwd_flops: float = 0.0
    gemm_bwd_flops: float = 0.0
    gemm_recompute_flops: float = 0.0
    by_kind: dict[str, OpCost] = field(default_factory=dict)
    per_node: dict[str, OpCost] = field(default_factory=dict)
    unknown_ops: tuple[str, ...] = ()

    @property
    def total_flops(self) -> float:
        """Forward + backward + recomputed forward FLOPs of every op."""
        return self.fwd_flops + self.bwd_flops + self.recompute_flops

    @property
    def total_bytes(self) -> float:
        return self.fwd_bytes + self.bwd_bytes + self.recompute_bytes

    @property
    def gemm_flops(self) -> float:
        """GEMM FLOPs (matmul, attention, convolution) forward + backward + recompute: what
        Megatron-LM's formula counts."""
        return self.gemm_fwd_flops + self.gemm_bwd_flops + self.gemm_recompute_flops

    def time(self, cluster, efficiency: float = 0.5, memory_efficiency: float = 0.8) -> float:
        """Sum of per-op roofline times (forward, backward and recompute)."""
        t = 0.0
        for name, c in self.per_node.items():
            f, b = op_time(c, cluster, efficiency, memory_efficiency)
            t += f + b
        return t + roofline_time(self.recompute_flops, self.recompute_bytes, cluster, efficiency,
                                 memory_efficiency)


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------
def _as_int(s: Any) -> int:
    try:
        return int(s)
    except Exception:  # noqa: BLE001 - an unbacked SymInt: use its hint
        hint = getattr(getattr(s, "node", None), "hint", None)
        return int(hint) if hint is not None else 1


def _tensors(x: Any) -> list[TensorArg]:
    """Every TensorArg inside nested args."""
    if isinstance(x, TensorArg):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for e in x for t in _tensors(e)]
    if isinstance(x, Mapping):
        return [t for e in x.values() for t in _tensors(e)]
    return []


def _nbytes(ts: Iterable[TensorArg | None]) -> float:
    return float(sum(t.nbytes for t in ts if t is not None))


def _rg(t: TensorArg | None) -> bool:
    return bool(t is not None and t.requires_grad and t.is_float)


def _arg(args: Sequence, kwargs: Mapping, i: int, name: str, default: Any = None) -> Any:
    if name in kwargs:
        return kwargs[name]
    return args[i] if len(args) > i else default


def _out_list(out: Any) -> list[TensorArg]:
    return _tensors(out)


# --------------------------------------------------------------------------------------------
# rules: (args, kwargs, out) -> OpCost, with TensorArg in place of tensors
# --------------------------------------------------------------------------------------------
Rule = Callable[[Sequence, Mapping, Any], OpCost]


def view_cost(args, kwargs, out) -> OpCost:
    """An alias of (part of) an input, or shape arithmetic: no FLOPs, no bytes."""
    return ZERO


def _gemm(flops: float, operands: Sequence[TensorArg | None], out: Any, kind: str = "matmul",
          shape: tuple = ()) -> OpCost:
    """Forward ``flops``; backward ``flops`` per operand needing a gradient; bytes: forward
    reads operands and writes the output, backward per operand reads dY and the other operand
    and writes the gradient."""
    outs = _out_list(out)
    ob = _nbytes(outs)
    ops = [t for t in operands if t is not None]
    fwd_bytes = _nbytes(ops) + ob
    bwd_flops = 0.0
    bwd_bytes = 0.0
    for i, t in enumerate(ops):
        if _rg(t):
            bwd_flops += flops
            others = [o for j, o in enumerate(ops) if j != i]
            bwd_bytes += ob + _nbytes(others) + t.nbytes
    return OpCost(flops, bwd_flops, fwd_bytes, bwd_bytes, kind, gemm=tuple(int(x) for x in shape))


def mm_cost(args, kwargs, out):
    a, b = args[0], args[1]
    m, k = a.shape
    n = b.shape[-1]
    return _gemm(2.0 * m * k * n, (a, b), out, shape=(1, m, n, k))


def addmm_cost(args, kwargs, out):
    bias, a, b = args[0], args[1], args[2]
    m, k = a.shape
    n = b.shape[-1]
    c = _gemm(2.0 * m * k * n, (a, b), out, shape=(1, m, n, k))
    # The bias is read once forward; its gradient (a column sum) is not counted as FLOPs.
    return dataclasses.replace(c, fwd_bytes=c.fwd_bytes + bias.nbytes)


def bmm_cost(args, kwargs, out):
    a, b = args[0], args[1]
    bsz, m, k = a.shape
    n = b.shape[-1]
    return _gemm(2.0 * bsz * m * k * n, (a, b), out, shape=(bsz, m, n, k))


def baddbmm_cost(args, kwargs, out):
    c0, a, b = args[0], args[1], args[2]
    bsz, m, k = a.shape
    n = b.shape[-1]
    c = _gemm(2.0 * bsz * m * k * n, (a, b), out, shape=(bsz, m, n, k))
    return dataclasses.replace(c, fwd_bytes=c.fwd_bytes + c0.nbytes)


def _matmul_shape(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[float, tuple]:
    """FLOPs and GEMM shape ``(batch, m, n, k)`` of ``torch.matmul`` (1-d operands promoted,
    batch dims broadcast; a batch ``b`` times one weight is one ``(b·m) × k`` GEMM, as the
    kernels run it); a 0-d operand (``inner``/``tensordot`` with a scalar) is a scaling: one
    flop per element, no GEMM."""
    if not a or not b:
        return float(math.prod(a) * math.prod(b)), ()
    if len(a) == 1 and len(b) == 1:
        return 2.0 * a[0], ()
    if len(a) == 1:
        a = (1,) + a
    if len(b) == 1:
        b = b + (1,)
    m, k = a[-2], a[-1]
    n = b[-1]
    batch = math.prod(torch.broadcast_shapes(tuple(a[:-2]), tuple(b[:-2])))
    shape = (1, batch * m, n, k) if len(b) == 2 else (batch, m, n, k)
    return 2.0 * batch * m * k * n, shape


def matmul_cost(args, kwargs, out):
    a, b = args[0], args[1]
    flops, shape = _matmul_shape(a.shape, b.shape)
    return _gemm(flops, (a, b), out, shape=shape)


def linear_cost(args, kwargs, out):
    x, w = args[0], _arg(args, kwargs, 1, "weight")
    bias = _arg(args, kwargs, 2, "bias")
    n, k = (w.shape if len(w.shape) == 2 else (1, w.shape[0]))
    m = math.prod(x.shape[:-1])
    c = _gemm(2.0 * m * k * n, (x, w), out, shape=(1, m, n, k))
    bb = bias.nbytes if isinstance(bias, TensorArg) else 0.0
    return dataclasses.replace(c, fwd_bytes=c.fwd_bytes + bb,
                               bwd_bytes=c.bwd_bytes + (bb if _rg(bias) else 0.0))


def einsum_cost(args, kwargs, out):
    """``2·numel(out)·Π(contracted index sizes)`` (exact for two operands)."""
    eq = args[0].replace(" ", "")
    ops = _tensors(args[1:])
    lhs, arrow, rhs = eq.partition("->")
    terms = lhs.split(",")
    letters = [c for c in lhs if c.isalpha()]
    if not arrow:  # implicit output: the letters used once
        rhs = "".join(sorted(c for c in set(letters) if letters.count(c) == 1))
    sizes: dict[str, int] = {}
    for term, t in zip(terms, ops):
        head, _, tail = term.partition("...")
        dims = list(t.shape[:len(head)]) + (list(t.shape[len(t.shape) - len(tail):]) if tail else [])
        for c, s in zip(head + tail, dims):
            sizes[c] = max(sizes.get(c, 1), int(s))
    outs = _out_list(out)
    n_out = outs[0].numel if outs else math.prod(sizes.get(c, 1) for c in rhs)
    contracted = math.prod(sizes[c] for c in set(sizes) - set(rhs))
    return _gemm(2.0 * n_out * contracted, ops, out)


#: passes over the ``B·H·L·S`` scores of math attention with dropout (what fxpar runs for it:
#: ``fxpar.keyed_sdpa``), forward: written by QKᵀ, scaled, masked, softmax, dropped (read and
#: written each), read by PV; backward: dP written, dropout, softmax, mask and scale backward
#: (read and written each), dS read by its two matmuls
MATH_ATTENTION_PASSES = (11, 12)


def sdpa_cost(args, kwargs, out):
    """Attention ``softmax(QKᵀ)V``: ``4·B·H·L·S·E`` FLOPs forward (two matmuls), twice that
    backward, at the attention kernel's rate; with ``dropout_p > 0`` (the plain op's fifth
    argument or keyword) fxpar runs it as math attention (:mod:`fxpar.runtime.keyed`): the
    same matmuls at the GEMM rate and :data:`MATH_ATTENTION_PASSES` over the scores."""
    q, k, v = args[0], args[1], args[2]
    *batch, L, E = q.shape
    S = k.shape[-2]
    Ev = v.shape[-1]
    bh = math.prod(batch)
    qk = 2.0 * bh * L * S * E
    pv = 2.0 * bh * L * S * Ev
    p = _arg(args, kwargs, 4, "dropout_p", 0.0)   # a variant's fifth argument may be a flag
    math_path = isinstance(p, float) and not isinstance(p, bool) and p > 0
    outs = _out_list(out)
    o = outs[0] if outs else TensorArg(tuple(batch) + (L, Ev), q.dtype)
    mask = _arg(args, kwargs, 3, "attn_mask")
    extra = [t for t in outs[1:2]]  # logsumexp
    fwd_bytes = q.nbytes + k.nbytes + v.nbytes + o.nbytes + _nbytes(extra)
    if isinstance(mask, TensorArg):
        fwd_bytes += mask.nbytes
    # Backward: dP = dO·Vᵀ and dV = Pᵀ·dO (PV part), dQ = dS·K and dK = dSᵀ·Q (QKᵀ part).
    bwd = 0.0
    if _rg(q) or _rg(k):
        bwd += pv  # dP
    if _rg(v):
        bwd += pv
    if _rg(q):
        bwd += qk
    if _rg(k):
        bwd += qk
    grads = sum(t.nbytes for t in (q, k, v) if _rg(t))
    bwd_bytes = (q.nbytes + k.nbytes + v.nbytes + 2 * o.nbytes + _nbytes(extra) + grads) if bwd else 0.0
    if math_path:
        scores = bh * L * S * q.dtype.itemsize
        fwd_bytes += MATH_ATTENTION_PASSES[0] * scores
        bwd_bytes += MATH_ATTENTION_PASSES[1] * scores if bwd else 0.0
        return OpCost(qk + pv, bwd, fwd_bytes, bwd_bytes, "matmul")
    return OpCost(qk + pv, bwd, fwd_bytes, bwd_bytes, "attention")




def _conv(x: TensorArg, w: TensorArg, out: Any, transposed: bool, groups: int, bias) -> OpCost:
    outs = _out_list(out)
    y = outs[0]
    n = x.shape[0]
    # torch.utils.flop_counter convention: batch × Πweight × Π(spatial of out, or of x if transposed)
    spatial = (x.shape[2:] if transposed else y.shape[2:])
    flops = 2.0 * n * math.prod(w.shape) * math.prod(spatial)
    c = _gemm(flops, (x, w), out, kind="conv")
    bb = bias.nbytes if isinstance(bias, TensorArg) else 0.0
    return OpCost(c.fwd_flops, c.bwd_flops, c.fwd_bytes + bb, c.bwd_bytes, "conv")


def convolution_cost(args, kwargs, out):
    x, w, bias = args[0], args[1], _arg(args, kwargs, 2, "bias")
    transposed = bool(_arg(args, kwargs, 6, "transposed", False))
    groups = int(_arg(args, kwargs, 8, "groups", 1))
    return _conv(x, w, out, transposed, groups, bias)


def convnd_cost(args, kwargs, out):
    x, w, bias = args[0], args[1], _arg(args, kwargs, 2, "bias")
    return _conv(x, w, out, False, int(_arg(args, kwargs, 6, "groups", 1)), bias)


def conv_transpose_cost(args, kwargs, out):
    x, w, bias = args[0], args[1], _arg(args, kwargs, 2, "bias")
    return _conv(x, w, out, True, int(_arg(args, kwargs, 6, "groups", 1)), bias)


def embedding_cost(args, kwargs, out):
    ts = _tensors(args[:2])
    weight = next((t for t in ts if t.is_float), ts[0])
    idx = next((t for t in ts if not t.is_float), None)
    y = _out_list(out)[0]
    fwd_bytes = 2.0 * y.nbytes + (idx.nbytes if idx else 0.0)  # gather rows + write
    if _rg(weight):  # dense scatter-add into a zeroed (V, h) gradient
        return OpCost(0.0, float(y.numel), fwd_bytes, y.nbytes + (idx.nbytes if idx else 0.0) + weight.nbytes,
                      "embedding")
    return OpCost(0.0, 0.0, fwd_bytes, 0.0, "embedding")


def _family(fwd_per_elem: float, bwd_per_elem: float, kind: str, saved_reads: int = 1) -> Rule:
    """Ops costing a fixed number of FLOPs per element of their first input."""
    def rule(args, kwargs, out):
        ts = _tensors(args)
        x = ts[0]
        outs = _out_list(out)
        fwd_bytes = _nbytes(ts) + _nbytes(outs)
        if not any(_rg(t) for t in ts):
            return OpCost(fwd_per_elem * x.numel, 0.0, fwd_bytes, 0.0, kind)
        # backward: read dY and the saved input(s), write dX (and small parameter grads)
        y0 = outs[0].nbytes if outs else x.nbytes
        bwd_bytes = y0 + saved_reads * x.nbytes + sum(t.nbytes for t in ts if _rg(t))
        return OpCost(fwd_per_elem * x.numel, bwd_per_elem * x.numel, fwd_bytes, bwd_bytes, kind)
    return rule


#: layer/group/batch/RMS norm: 5 FLOPs per element forward, 10 backward
norm_cost = _family(5.0, 10.0, "norm")

#: softmax, log-softmax and the losses built on them: 5 FLOPs per element forward, 4 backward
softmax_cost = _family(5.0, 4.0, "softmax")
norm_cost.__name__ = norm_cost.__qualname__ = "norm_cost"
softmax_cost.__name__ = softmax_cost.__qualname__ = "softmax_cost"


def pointwise_cost(args, kwargs, out):
    ts = _tensors(args) + _tensors(kwargs)
    outs = _out_list(out)
    n = float(outs[0].numel) if outs else float(max((t.numel for t in ts), default=0))
    fwd_bytes = _nbytes(ts) + _nbytes(outs)
    needing = [t for t in ts if _rg(t)]
    if not needing or (outs and not outs[0].is_float):
        return OpCost(n, 0.0, fwd_bytes, 0.0, "pointwise")
    ob = outs[0].nbytes if outs else 0.0
    bwd_bytes = ob + _nbytes(ts) + _nbytes(needing)  # read dY and saved operands, write grads
    return OpCost(n, n * len(needing), fwd_bytes, bwd_bytes, "pointwise")


def activation_cost(args, kwargs, out):
    """:func:`pointwise_cost` of a transcendental elementwise op (GELU, SiLU, tanh, exp, erf,
    ...), kind ``"activation"``: the same FLOPs (one per element and direction), priced at
    ``ComputeProfile.activation`` where calibrated. On a CPU a GELU's forward and backward run
    4–15x an add's time per element (erf and exp evaluated in software), so bytes alone
    underprice them; on a GPU they are bound by their bytes like any pointwise op.

    >>> import torch
    >>> x = TensorArg((4, 8), torch.float32, requires_grad=True)
    >>> c = activation_cost((x,), {}, TensorArg((4, 8), torch.float32))
    >>> c.fwd_flops, c.bwd_flops, c.kind
    (32.0, 32.0, 'activation')
    """
    return dataclasses.replace(pointwise_cost(args, kwargs, out), kind="activation")


def dropout_cost(args, kwargs, out):
    x = _tensors(args)[0]
    mask = x.numel  # one bool per element
    fwd_bytes = 2.0 * x.nbytes + mask
    if _rg(x):
        return OpCost(2.0 * x.numel, float(x.numel), fwd_bytes, 2.0 * x.nbytes + mask, "pointwise")
    return OpCost(2.0 * x.numel, 0.0, fwd_bytes, 0.0, "pointwise")


def reduction_cost(args, kwargs, out):
    ts = _tensors(args)
    x = ts[0]
    outs = _out_list(out)
    fwd_bytes = x.nbytes + _nbytes(outs)
    if _rg(x) and outs and outs[0].is_float:
        return OpCost(float(x.numel), float(x.numel), fwd_bytes, _nbytes(outs[:1]) + x.nbytes, "reduction")
    return OpCost(float(x.numel), 0.0, fwd_bytes, 0.0, "reduction")




def copy_cost(args, kwargs, out):
    ts = _tensors(args)
    outs = _out_list(out)
    ob = _nbytes(outs)
    n_in, n_out = sum(t.numel for t in ts), sum(t.numel for t in outs)
    if n_in <= n_out:  # copies, casts, concatenations, repeats: every input element is read
        read = _nbytes(ts)
    else:  # gathers, slicing copies, pooling windows: as many elements read as written
        read = n_out * (_nbytes(ts) / n_in if n_in else 0.0)
    if any(_rg(t) for t in ts) and outs and outs[0].is_float:
        return OpCost(0.0, 0.0, read + ob, read + ob, "copy")
    return OpCost(0.0, 0.0, read + ob, 0.0, "copy")




def maybe_copy_cost(args, kwargs, out):
    x = _tensors(args)[0]
    if x.contiguous:
        return ZERO  # already dense: a view
    return copy_cost(args, kwargs, out)


def creation_cost(args, kwargs, out):
    return OpCost(0.0, 0.0, _nbytes(_out_list(out)), 0.0, "creation")



# --------------------------------------------------------------------------------------------
# the table: op object -> cost rule, filled by the op records
# --------------------------------------------------------------------------------------------
#: op object (ATen overload or packet, or another callable a graph can hold) -> its cost rule.
#: The records of :mod:`fxpar.strategies` fill it (``register(aten.mm, cost=mm_cost)``): an op's
#: strategies, cost rule and local rewrite are written in one place; this module keeps the pure
#: formulas and the lookup. In-place packets (``aten.tanh_``) fall back to the functional op's rule.
_COST: dict[object, Rule] = {}
_INPLACE: dict[object, Rule] = {}
_VIEWS: set = set()
_VIEW_IF_CONTIGUOUS: set = set()
_SAVES: dict[object, Saves] = {}


class Saves(StrKind):
    """What an op keeps for its backward, as its record says (``register(..., saves=...)``);
    :func:`fxpar.cost.memory.activation_memory` counts each by its own rule."""

    PARTNERS = "partners"   # each input whose partner in the op needs a gradient (a matmul's)
    OUTPUT = "output"       # its output (tanh, softmax, ...)
    INPUT0 = "input0"       # its first input
    STATS = "stats"         # its first input and two fp32 statistics per row (norms)
    CHANNEL_STATS = "channel_stats"  # its first input and two fp32 statistics per channel (batch norm)
    GROUP_STATS = "group_stats"      # ... per sample and channel group (group / instance norm)
    QKVO = "qkvo"           # q, k, v, the output and the fp32 logsumexp (attention)
    NOTHING = "nothing"
    INDICES = "indices"     # its integer inputs (embedding, gather)
    MASK = "mask"           # a bool mask of its first input (dropout)
    LOWERED = "lowered"     # what its ATen lowering keeps, run on meta tensors (einsum's bmm operands)
    ALL = "all"             # every tensor input: an op without a record (not registrable)


#: What an op's record may say it keeps for its backward (:func:`fxpar.cost.memory.activation_memory`).
SAVES_KINDS = tuple(k for k in Saves if k is not Saves.ALL)


def set_op_cost(op: Any, rule: Rule | None = None, *, view: bool | str = False, saves: str | None = None) -> None:
    """Record the cost facts of ``op`` (called by ``fxpar.strategies.register``, not by hand).

    ``rule`` prices one call; ``view=True`` marks an alias of an input (free, shares storage),
    ``view="if_contiguous"`` one that aliases only a contiguous input (``reshape``);
    ``saves`` is what the op keeps for its backward (one of :data:`SAVES_KINDS`).
    """
    if saves is not None and saves not in SAVES_KINDS:
        raise ValueError(f"set_op_cost({op}): saves={saves!r} is not one of {SAVES_KINDS}")
    if view not in (True, False, "if_contiguous"):
        raise ValueError(f"set_op_cost({op}): view={view!r} must be True, False or 'if_contiguous'")
    if rule is not None:
        _COST[op] = rule
        if isinstance(op, torch._ops.OpOverloadPacket):
            inplace = getattr(torch.ops.aten, op.__name__ + "_", None)
            if isinstance(inplace, torch._ops.OpOverloadPacket) and op.__name__[-1:] != "_":
                _INPLACE[inplace] = rule
    if view is True:
        _VIEWS.add(op)
    elif view == "if_contiguous":
        _VIEW_IF_CONTIGUOUS.add(op)
    if saves is not None:
        _SAVES[op] = Saves(saves)


def _find(table: Mapping, target: Any) -> Any:
    for k in op_keys(target):
        if k in table:
            return table[k]
    return None


def cost_rule(target: Any) -> Rule | None:
    """The cost rule of ``target`` (overload, then packet, then an in-place op's functional
    form; torch-level targets through :func:`fxpar.ir.op_keys`), or ``None``.

    >>> import torch, fxpar.strategies
    >>> cost_rule(torch.ops.aten.addmm.default) is addmm_cost
    True
    >>> cost_rule(torch.ops.aten.relu_.default) is pointwise_cost     # in-place: relu's rule
    True
    """
    rule = _find(_COST, target)
    return rule if rule is not None else _find(_INPLACE, target)


def is_view(target: Any) -> bool:
    """True when ``target`` returns an alias of (part of) an input (no FLOPs, bytes or memory).

    >>> import torch, fxpar.strategies
    >>> is_view(torch.ops.aten.transpose.int), is_view(torch.ops.aten.mm.default)
    (True, False)
    """
    return any(k in _VIEWS for k in op_keys(target))


def is_view_if_contiguous(target: Any) -> bool:
    """True for ops that alias a contiguous input and copy otherwise (``reshape``, ``contiguous``)."""
    return any(k in _VIEW_IF_CONTIGUOUS for k in op_keys(target))


def saves_of(target: Any) -> Saves | None:
    """What ``target`` keeps for its backward (:data:`SAVES_KINDS`), ``None`` when unrecorded."""
    return _find(_SAVES, target)


def op_name(target: Any) -> str:
    """Short display name of a target (``aten.mm.default`` → ``"mm"``, ``operator.getitem`` →
    ``"getitem"``) for plans and reports; tables are keyed by the objects, not by this name."""
    if isinstance(target, str):
        return target
    if isinstance(target, torch._ops.OpOverload):
        return target.overloadpacket.__name__
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target.__name__
    if target is operator.getitem:
        return "getitem"
    return getattr(target, "__name__", str(target))


class CostRuleError(FxparError):
    """A cost rule raised on a call it is registered for: the op, the rule and the cause."""


def _unknown(args, kwargs, out) -> OpCost:
    ts = _tensors(args) + _tensors(kwargs)
    fwd = _nbytes(ts) + _nbytes(_out_list(out))
    return OpCost(0.0, 0.0, fwd, fwd if any(_rg(t) for t in ts) else 0.0, "unknown", known=False)


def op_cost(target: Any, args: Sequence = (), kwargs: Mapping | None = None, out: Any = None) -> OpCost:
    """Cost of one op call given :class:`TensorArg` in place of tensors (local or global shapes).

    ``target`` is an ATen overload (``torch.ops.aten.mm.default``), a torch-level callable or a
    method name. An op without a rule is priced by bytes only with ``known=False``; a rule
    that raises is a bug and raises :class:`CostRuleError` naming the op and the rule.

    >>> import torch
    >>> a = TensorArg((64, 32)); b = TensorArg((32, 16))
    >>> op_cost(torch.ops.aten.mm.default, (a, b), out=TensorArg((64, 16))).fwd_flops
    65536.0
    >>> op_cost(torch.ops.aten.view.default, (a, [2048]), out=TensorArg((2048,))).fwd_bytes
    0.0
    >>> op_cost("my_custom_op", (a,), out=TensorArg((64, 32))).known
    False
    >>> op_cost(torch.ops.aten.mm.default, (TensorArg((3,)),), out=TensorArg((3,)))
    Traceback (most recent call last):
    ...
    fxpar.cost.compute.CostRuleError: cost rule mm_cost failed on aten.mm.default: IndexError: ...
    """
    kwargs = dict(kwargs or {})
    rule = cost_rule(target)
    if rule is None:
        return _unknown(args, kwargs, out)
    try:
        return rule(args, kwargs, out)
    except Exception as e:
        name = getattr(rule, "__qualname__", repr(rule))
        raise CostRuleError(f"cost rule {name} failed on {target}: {type(e).__name__}: {e}") from e


# --------------------------------------------------------------------------------------------
# nodes and graphs
# --------------------------------------------------------------------------------------------
def _val(node: fx.Node) -> Any:
    return node.meta.get(_VAL, node.meta.get("example_value"))


def _to_args(x: Any, grad: Callable[[fx.Node], bool | None]) -> Any:
    """Replace nodes in args by TensorArg (or their Python value)."""
    if isinstance(x, fx.Node):
        v = _val(x)
        if isinstance(v, torch.Tensor):
            return TensorArg.of(v, grad(x))
        if isinstance(v, (list, tuple)) and v and all(isinstance(e, torch.Tensor) for e in v):
            return type(v)(TensorArg.of(e, grad(x)) for e in v)
        return v
    if isinstance(x, (list, tuple)):
        return type(x)(_to_args(e, grad) for e in x)
    if isinstance(x, dict):
        return {k: _to_args(e, grad) for k, e in x.items()}
    return x


def _out_meta(node: fx.Node) -> Any:
    v = _val(node)
    if isinstance(v, torch.Tensor):
        return TensorArg.of(v, False)
    if isinstance(v, (list, tuple)):
        return tuple(TensorArg.of(e, False) if isinstance(e, torch.Tensor) else None for e in v)
    return None


def _node_target(node: fx.Node, gm: fx.GraphModule | None) -> Any:
    if node.op == "call_module" and gm is not None:
        mod = gm.get_submodule(node.target)
        aten = torch.ops.aten
        return {torch.nn.Linear: aten.linear, torch.nn.Embedding: aten.embedding,
                torch.nn.LayerNorm: aten.layer_norm, torch.nn.Conv1d: aten.conv1d, torch.nn.Conv2d: aten.conv2d,
                torch.nn.Conv3d: aten.conv3d, torch.nn.GELU: aten.gelu, torch.nn.ReLU: aten.relu,
                torch.nn.Dropout: aten.dropout, torch.nn.Softmax: aten.softmax}.get(type(mod), type(mod).__name__)
    return node.target


def _module_args(node: fx.Node, gm: fx.GraphModule, args: tuple) -> tuple:
    """Make a call_module's args look like its functional form (append the parameters)."""
    mod = gm.get_submodule(node.target)
    extra = []
    for pname in ("weight", "bias"):
        p = getattr(mod, pname, None)
        if isinstance(p, torch.Tensor):
            extra.append(TensorArg(tuple(p.shape), p.dtype, p.requires_grad))
    if isinstance(mod, torch.nn.Embedding):
        return (extra[0],) + tuple(args)
    if isinstance(mod, torch.nn.LayerNorm):
        return tuple(args) + (list(mod.normalized_shape),) + tuple(extra)
    return tuple(args) + tuple(extra)


def node_cost(node: fx.Node, *, requires_grad: Mapping[fx.Node, bool] | Callable[[fx.Node], bool] | None = None,
              gm: fx.GraphModule | None = None) -> OpCost:
    """Cost of one node from its fake-tensor meta (``node.meta["val"]``).

    ``requires_grad`` says which input nodes carry a gradient (a mapping or a predicate); by
    default every floating-point input does. Placeholders, ``get_attr`` and ``output`` nodes
    cost nothing; ``call_module`` of common leaf modules is understood when ``gm`` is given.
    """
    if node.op in ("placeholder", "get_attr", "output"):
        return ZERO
    if requires_grad is None:
        grad = lambda n: None  # noqa: E731 - TensorArg default: floating point needs a gradient
    elif callable(requires_grad):
        grad = requires_grad
    else:
        grad = lambda n: bool(requires_grad.get(n, False))  # noqa: E731
    args = _to_args(tuple(node.args), grad)
    kwargs = _to_args(dict(node.kwargs), grad)
    target = _node_target(node, gm)
    if node.op == "call_module" and gm is not None:
        args = _module_args(node, gm, args)
    if node.op == "call_method" and args and not isinstance(args[0], TensorArg):
        return ZERO
    return op_cost(target, args, kwargs, _out_meta(node))


def graph_cost(gm: fx.GraphModule, *, training: bool = True,
               recompute: bool | Callable[[fx.Node], bool] = False,
               requires_grad: Iterable[fx.Node] | Callable[[fx.Node], bool] = ()) -> GraphCost:
    """Sum :func:`node_cost` over a forward graph.

    * ``training``: include backward costs (gradients flow from the parameters; add nodes with
      ``requires_grad`` for inputs that need one); ``False`` prices the graph as is (use it
      for a graph that already contains its backward).
    * ``recompute``: ``True`` re-runs every op's forward before the backward (full activation
      checkpointing); a predicate recomputes only the nodes it selects (e.g. the transformer
      layers, as Megatron-LM does).

    >>> import torch
    >>> gm = torch.export.export(torch.nn.Linear(64, 32), (torch.randn(8, 64),)).graph_module
    >>> c = graph_cost(gm)
    >>> c.fwd_flops, c.bwd_flops  # no grad for the input: only dW
    (32768.0, 32768.0)
    """
    flags = grad_flags(gm, requires_grad) if training else {}
    gc = GraphCost()
    unknown: dict[str, None] = {}
    pred = recompute if callable(recompute) else (lambda n: bool(recompute))
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "get_attr", "output"):
            continue
        c = node_cost(n, requires_grad=flags if training else (lambda _n: False), gm=gm)
        if not training:
            c = dataclasses.replace(c, bwd_flops=0.0, bwd_bytes=0.0)
        gc.per_node[n.name] = c
        gc.fwd_flops += c.fwd_flops
        gc.bwd_flops += c.bwd_flops
        gc.fwd_bytes += c.fwd_bytes
        gc.bwd_bytes += c.bwd_bytes
        is_gemm = c.kind in GEMM_KINDS
        if is_gemm:
            gc.gemm_fwd_flops += c.fwd_flops
            gc.gemm_bwd_flops += c.bwd_flops
        if training and pred(n):
            gc.recompute_flops += c.fwd_flops
            gc.recompute_bytes += c.fwd_bytes
            if is_gemm:
                gc.gemm_recompute_flops += c.fwd_flops
        gc.by_kind[c.kind] = gc.by_kind.get(c.kind, OpCost(kind=c.kind)) + c
        if not c.known:
            unknown[str(n.target)] = None
    gc.unknown_ops = tuple(unknown)
    return gc


# --------------------------------------------------------------------------------------------
# time
# --------------------------------------------------------------------------------------------
def roofline_time(flops: float, nbytes: float, cluster, efficiency: float = 0.5,
                  memory_efficiency: float = 0.8) -> float:
    """Roofline: ``max(flops / (peak·efficiency), bytes / (memory_bandwidth·memory_efficiency))``.

    The default compute efficiency 0.5 is what Megatron-LM reaches end to end (44–52% of peak,
    PTD-P Table 1); pass a measured value where one exists.

    >>> from fxpar import Cluster
    >>> c = Cluster.preset("dgx-a100")                       # 312 TFLOP/s, 2039 GB/s
    >>> round(roofline_time(312e12, 0, c, efficiency=1.0), 6)
    1.0
    >>> round(roofline_time(0, 2039e9, c, memory_efficiency=1.0), 6)
    1.0
    """
    if flops <= 0 and nbytes <= 0:
        return 0.0
    return max(flops / (cluster.peak_flops * efficiency),
               nbytes / (cluster.memory_bandwidth * memory_efficiency))


def calibrated_time(flops: float, nbytes: float, profile, *, gemm: bool = True,
                    gemm_size: float | None = None, rates=None) -> float:
    """Kernel seconds from a measured :class:`fxpar.cluster.ComputeProfile`:
    ``max(flops / R_gemm(size), bytes / R_mem(bytes))`` (no per-op overhead; see :func:`op_time`).

    ``R_gemm`` is the measured GEMM rate looked up at ``size`` = ``gemm_size`` (the FLOPs of
    one GEMM call) or else ``flops``; ``R_mem`` the measured elementwise bandwidth looked up at
    ``nbytes``; both interpolated in log-log (:func:`fxpar.cost.calibration.interp_loglog`).
    Non-GEMM work (``gemm=False``: pointwise, norms, softmax, reductions) is priced at the
    measured non-GEMM rate ``R_vec(flops)`` (``profile.vector``: a log-softmax's FLOP/s), or at
    the fastest GEMM rate for a profile without one (then such ops are bound by their bytes).
    ``rates``: another measured ``((size, FLOP/s), ...)`` curve for the FLOPs, looked up like
    the GEMM's (fused attention: ``profile.attention``).

    >>> from fxpar.cluster import ComputeProfile
    >>> p = ComputeProfile(gemm=((1e3, 1e9), (1e7, 1e11)), memory=((1e3, 1e9), (1e9, 1e10)),
    ...                    op_overhead=0.0, bwd_op_overhead=0.0)
    >>> round(calibrated_time(1e5, 0, p) * 1e6, 6)                 # 1e5 FLOPs at 10 GFLOP/s
    10.0
    >>> round(calibrated_time(1e5, 0, p, gemm=False) * 1e6, 6)     # at the 100 GFLOP/s peak
    1.0
    >>> v = ComputeProfile(gemm=p.gemm, memory=p.memory, op_overhead=0.0, bwd_op_overhead=0.0,
    ...                    vector=((1e3, 1e9),))                 # softmax-like work at 1 GFLOP/s
    >>> round(calibrated_time(1e5, 0, v, gemm=False) * 1e6, 6)
    100.0
    >>> round(calibrated_time(0, 1e9, p), 6)                        # 1 GB at 10 GB/s
    0.1
    """
    from fxpar.cost.calibration import interp_loglog

    if flops <= 0 and nbytes <= 0:
        return 0.0
    t_f = 0.0
    if flops > 0:
        size = gemm_size if gemm_size else flops
        rate = (interp_loglog(rates, size) if rates
                else interp_loglog(profile.gemm, size) if gemm
                else interp_loglog(profile.vector, flops) if profile.vector
                else profile.peak_flops)
        t_f = flops / rate
    t_b = nbytes / interp_loglog(profile.memory, nbytes) if nbytes > 0 else 0.0
    return max(t_f, t_b)


def gemm_efficiency(shape: Sequence[int], physics) -> float:
    """Fraction of peak a ``b × (m×k)·(k×n)`` GEMM reaches (:class:`fxpar.cluster.Physics`):
    its output columns run in tiles of ``tn`` (the preset's ``gemm_tile`` or a halving of it,
    down to 64, whichever wastes least), padded to whole tiles, and full tiles of the preset's
    size reach ``gemm_efficiency``. A narrower tile reuses each operand element fewer times
    (``tm·tn/(tm+tn)`` FLOPs per element loaded): below the preset tile, the smallest that
    saturates the tensor cores, its rate falls in proportion (``reuse``)::

        eff = gemm_efficiency · max_tn reuse(tn) · n / (⌈n/tn⌉ · tn)

    The rows ``m`` (tokens: ``b·s``) and the batch are taken as continuous, so no row padding
    and no wave quantization: a GEMM's time stays linear in the microbatch, which the joint
    search's scaling of a probe's unit costs relies on (training GEMMs have thousands of rows,
    where both average out); the columns are weights' dimensions, split by tensor
    parallelism (``3h/t`` not a multiple of the tile pads every row).

    >>> from fxpar.cluster import Physics
    >>> ph = Physics(gemm_tile=(256, 128), gemm_efficiency=0.8)
    >>> gemm_efficiency((1, 4096, 128 * 9), ph)        # whole tiles
    0.8
    >>> round(gemm_efficiency((1, 4096, 128 * 9 + 1), ph), 3)   # one column over: a 10th tile
    0.721
    """
    n = max(1, int(shape[2]))
    tm, tn = physics.gemm_tile
    full = tm * tn / (tm + tn)  # the preset tile's operand reuse: the smallest that saturates
    best = 0.0
    while True:
        reuse = min(1.0, tm * tn / (tm + tn) / full)
        best = max(best, reuse * n / (-(-n // tn) * tn))
        if tn <= 64:
            break
        tn = max(64, tn // 2)
    return physics.gemm_efficiency * best


def physics_time(cost: OpCost, cluster) -> tuple[float, float]:
    """``(forward, backward)`` seconds of one op on a cluster with :class:`~fxpar.cluster.Physics`
    ``ph`` and no measured compute: the roofline at the op's own efficiency, plus
    ``ph.kernel_overhead`` per direction that does work::

        t = max(flops / (peak · eff), bytes / (memory_bandwidth · ph.memory_efficiency)) + kernel

    ``eff`` is :func:`gemm_efficiency` for a GEMM (forward at its ``(b, m, n, k)``, backward at
    the mean of its two gradient products ``(b, m, k, n)`` and ``(b, k, n, m)``),
    ``ph.attention_efficiency`` for attention, ``ph.gemm_efficiency`` for the rest (FLOPs of
    other ops are few; the bytes decide them).

    >>> from fxpar import Cluster
    >>> c = Cluster.preset("dgx-a100")
    >>> f, b = physics_time(OpCost(2 * 4096.0**3, 4 * 4096.0**3, 0, 0, "matmul",
    ...                            gemm=(1, 4096, 4096, 4096)), c)
    >>> rate = 2 * 4096**3 / (f - c.physics.kernel_overhead)           # whole tiles
    >>> round(rate / 312e12, 3) == c.physics.gemm_efficiency
    True
    """
    ph = cluster.physics
    peak, bw = cluster.peak_flops, cluster.memory_bandwidth * ph.memory_efficiency
    if cost.kind == "attention":
        ef = eb = ph.attention_efficiency
    elif cost.gemm:
        bt, m, n, k = cost.gemm
        ef = gemm_efficiency((bt, m, n), ph)
        eb = (gemm_efficiency((bt, m, k), ph) + gemm_efficiency((bt, k, n), ph)) / 2
    else:
        ef = eb = ph.gemm_efficiency

    def t(flops, nbytes, eff):
        if flops <= 0 and nbytes <= 0:
            return 0.0
        return max(flops / (peak * eff), nbytes / bw) + ph.kernel_overhead

    return t(cost.fwd_flops, cost.fwd_bytes, ef), t(cost.bwd_flops, cost.bwd_bytes, eb)


def op_overheads(cluster) -> tuple[float, float]:
    """``(forward, backward)`` seconds :func:`op_time` adds to every op that does work in
    that direction whatever its size (a kernel launch, the host's dispatch and autograd
    record): paid once per microbatch, not scaled with it (:func:`fxpar.planner.price.unit_table`)."""
    prof = getattr(cluster, "compute", None)
    if prof is not None:
        return (0.0, 0.0) if prof.asynchronous else (prof.op_overhead, prof.bwd_op_overhead)
    ph = getattr(cluster, "physics", None)
    return (ph.kernel_overhead, ph.kernel_overhead) if ph is not None else (0.0, 0.0)


def accumulate_time(nbytes: float, cluster) -> float:
    """Seconds a backward takes to add a parameter's gradient of ``nbytes`` into the one
    accumulated before it (``grad += new``: two reads and a write), what autograd does every
    backward where ``.grad`` is a view of a gradient bucket (fxpar's gradients in place, as
    DDP's ``gradient_as_bucket_view``), so in every microbatch of a pipeline: a pass the size
    of the parameters, not of the batch. Priced on a measured compute profile (its memory
    curve at ``3·nbytes``, a CUDA profile's too: a kernel the backward waits for); 0 on a preset,
    whose GPU runs fuse it into the weight-gradient GEMM (Megatron-LM's
    ``gradient_accumulation_fusion``).

    >>> from fxpar import Cluster
    >>> from fxpar.cluster import ComputeProfile
    >>> prof = ComputeProfile(gemm=((1e3, 1e9),), memory=((1e3, 1e10), (1e9, 1e10)),
    ...                       op_overhead=0.0, bwd_op_overhead=0.0)
    >>> round(accumulate_time(4e6, Cluster.local(2, compute=prof)) * 1e3, 6)   # 12 MB at 10 GB/s
    1.2
    >>> accumulate_time(4e6, Cluster.preset("dgx-a100"))
    0.0
    """
    prof = getattr(cluster, "compute", None)
    if prof is None or nbytes <= 0:
        return 0.0
    return calibrated_time(0.0, 3.0 * nbytes, prof)


_FUSED_ATTENTION = (torch.ops.aten.scaled_dot_product_attention,)


def _signature(x):
    """A hashable key of one argument: a :class:`TensorArg` by shape, dtype and gradient flag,
    a sequence by its items, anything else as itself (``None`` where it is not hashable)."""
    if isinstance(x, TensorArg):
        return ("T", x.shape, x.dtype, bool(x.requires_grad))
    if isinstance(x, (list, tuple)):
        items = tuple(_signature(y) for y in x)
        return None if None in items else ("S", type(x) is list, items)
    try:
        hash(x)
    except TypeError:
        return None
    return ("C", x)


def _rebuild(sig):
    kind = sig[0]
    if kind == "T":
        _, shape, dtype, grad = sig
        t = torch.empty(shape, dtype=dtype, device="meta")
        return t.requires_grad_(grad and (dtype.is_floating_point or dtype.is_complex))
    if kind == "S":
        items = [_rebuild(y) for y in sig[2]]
        return items if sig[1] else tuple(items)
    # a factory op's device: nothing is allocated for real while counting
    return torch.device("meta") if isinstance(sig[1], torch.device) else sig[1]


@functools.lru_cache(maxsize=16384)
def _dispatches_of(target, args_sig, kwargs_sig) -> tuple[int, int] | None:
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += 1
            return func(*args, **(kwargs or {}))

    try:
        args = _rebuild(args_sig)
        kwargs = dict(_rebuild(kwargs_sig))
        with torch.enable_grad(), _Count() as mode:
            out = target(*args, **kwargs)
    except Exception:   # an op meta tensors cannot run (a collective, a custom op): unknown
        return None
    seen, todo = set(), [o.grad_fn for o in torch.utils._pytree.tree_leaves(out)
                         if isinstance(o, torch.Tensor) and o.grad_fn is not None]
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen or type(fn).__name__ == "AccumulateGrad":
            continue
        seen.add(fn)
        todo.extend(f for f, _ in fn.next_functions)
    return mode.n, len(seen)


def dispatches(target, args: Sequence, kwargs: Mapping | None = None) -> tuple[int, int] | None:
    """``(forward, backward)``: the ATen kernels ``target`` dispatches below autograd and the
    autograd nodes its backward runs (leaves' ``AccumulateGrad`` not counted: one per
    parameter, not per op), run once on meta tensors of the arguments' shapes (cached);
    ``None`` where that cannot run (a collective, a custom op). A composite op pays the host's
    per-op work once per op it decomposes into, and a view of a tensor that needs a gradient
    runs a backward node though it does no work: on one CPU thread four GPT blocks at 128
    tokens ran 174 backward nodes where one per op with backward work counts 40
    (49 ``AccumulateGrad``, 48 ``ViewBackward0``, 16 ``TBackward0``, 16 ``TransposeBackward0``).

    >>> import torch
    >>> x = TensorArg((2, 4, 8), requires_grad=True)
    >>> w, b = TensorArg((16, 8), requires_grad=True), TensorArg((16,), requires_grad=True)
    >>> dispatches(torch.ops.aten.linear.default, (x, w, b))    # view, t, addmm, view
    (4, 4)
    >>> dispatches(torch.ops.aten.transpose.int, (x, 1, 2))
    (1, 1)
    >>> dispatches(torch.ops.aten.transpose.int, (TensorArg((2, 4), requires_grad=False), 0, 1))
    (1, 0)
    """
    if not isinstance(target, torch._ops.OpOverload):
        return None
    if target.overloadpacket in _FUSED_ATTENTION:
        # one fused kernel each way where the device has one (flash on CPU and CUDA); on meta
        # tensors SDPA takes its math path (23 kernels, 17 backward nodes)
        grad = any(isinstance(x, TensorArg) and x.requires_grad for x in args)
        return 1, int(grad)
    a, k = _signature(tuple(args)), _signature(tuple(sorted((kwargs or {}).items())))
    if a is None or k is None:
        return None
    return _dispatches_of(target, a, k)


def node_dispatches(node: fx.Node, *, requires_grad: Mapping[fx.Node, bool] | None = None
                    ) -> tuple[int, int] | None:
    """:func:`dispatches` of a graph node from its fake-tensor meta (``requires_grad`` as in
    :func:`node_cost`; default: every floating-point input); ``None`` for anything but a
    ``call_function`` of an ATen op."""
    if node.op != "call_function":
        return None
    grad = ((lambda n: None) if requires_grad is None  # noqa: E731
            else (lambda n: bool(requires_grad.get(n, False))))
    return dispatches(node.target, _to_args(tuple(node.args), grad), _to_args(dict(node.kwargs), grad))


def op_time(cost: OpCost, cluster, efficiency: float = 0.5, memory_efficiency: float = 0.8, *,
            dispatches: tuple[int, int] | None = None) -> tuple[float, float]:
    """``(forward, backward)`` seconds of one op.

    Without a measured compute profile (``cluster.compute is None``): the roofline
    (:func:`roofline_time`) of each direction. With one (:meth:`fxpar.Cluster.calibrate`),
    ``efficiency``/``memory_efficiency`` are not used; the measured curves are::

        t_fwd = calibrated_time(fwd_flops, fwd_bytes, size = fwd_flops) + op_overhead
        t_bwd = calibrated_time(bwd_flops, bwd_bytes, size = fwd_flops) + bwd_op_overhead
                (no overheads on an asynchronous device)
                (t_bwd = 0 when the op has no backward work)

    A backward GEMM is looked up at the forward GEMM's size: each gradient GEMM of a matmul
    has the forward's ``M·K·N``. Fused attention uses the measured ``attention`` curve where
    the profile has one, transcendental elementwise ops (kind ``"activation"``) the measured
    ``activation`` curve (by forward FLOPs, one per element). Every op pays ``op_overhead``
    forward (views too: they are dispatched like any op); with ``dispatches = (k_f, k_b)``
    (:func:`dispatches`: the kernels it dispatches below autograd, the backward nodes it
    runs) ``k_f·op_overhead`` and ``k_b·bwd_op_overhead``, a view of a tensor that needs a
    gradient included (its backward node does no work).

    >>> from fxpar import Cluster
    >>> from fxpar.cluster import ComputeProfile
    >>> prof = ComputeProfile(gemm=((1e3, 1e9), (1e7, 1e11)), memory=((1e3, 1e10), (1e9, 1e10)),
    ...                       op_overhead=5e-6, bwd_op_overhead=2e-5)
    >>> c = Cluster.local(2, compute=prof)
    >>> f, b = op_time(OpCost(1e5, 2e5, 0, 0, "matmul"), c)      # 10 GFLOP/s at 1e5 FLOPs
    >>> round(f * 1e6, 6), round(b * 1e6, 6)                    # 10 + 5 µs, 20 + 20 µs
    (15.0, 40.0)
    >>> [round(t * 1e6, 6) for t in op_time(ZERO, c)]            # a view: dispatch only
    [5.0, 0.0]
    >>> [round(t * 1e6, 6) for t in op_time(ZERO, c, dispatches=(1, 1))]   # ... needing a gradient
    [5.0, 20.0]
    >>> [round(t * 1e6, 6) for t in op_time(OpCost(1e5, 2e5, 0, 0, "matmul"), c, dispatches=(4, 4))]
    [30.0, 100.0]

    On an asynchronous device (``prof.asynchronous``, CUDA) the host's per-op work overlaps
    the kernels queued before it: an op costs its kernel alone and a view nothing (a model
    small enough for the host to be the bottleneck is then priced too fast).

    >>> import dataclasses
    >>> g = Cluster.local(2, compute=dataclasses.replace(prof, asynchronous=True))
    >>> [round(t * 1e6, 6) for t in op_time(OpCost(1e5, 2e5, 0, 0, "matmul"), g)]
    [10.0, 20.0]
    >>> op_time(ZERO, g)
    (0.0, 0.0)
    """
    prof = getattr(cluster, "compute", None)
    if prof is None:
        if getattr(cluster, "physics", None) is not None:
            return physics_time(cost, cluster)
        return (roofline_time(cost.fwd_flops, cost.fwd_bytes, cluster, efficiency, memory_efficiency),
                roofline_time(cost.bwd_flops, cost.bwd_bytes, cluster, efficiency, memory_efficiency))
    gemm = cost.kind in GEMM_KINDS
    size = cost.fwd_flops if cost.fwd_flops > 0 else None
    rates = (prof.attention if cost.kind == "attention"
             else prof.activation if cost.kind == "activation" else None)
    hidden = getattr(prof, "asynchronous", False)  # the host's work overlaps queued kernels
    work = cost.bwd_flops > 0 or cost.bwd_bytes > 0
    nf, nb = dispatches if dispatches is not None else (1, int(work))
    nb = max(nb, int(work))
    f = calibrated_time(cost.fwd_flops, cost.fwd_bytes, prof, gemm=gemm, gemm_size=size,
                        rates=rates) + (0.0 if hidden else nf * prof.op_overhead)
    b = (calibrated_time(cost.bwd_flops, cost.bwd_bytes, prof, gemm=gemm, gemm_size=size,
                         rates=rates) if work else 0.0)
    return f, b + (0.0 if hidden else nb * prof.bwd_op_overhead)
