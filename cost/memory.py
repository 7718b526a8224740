"""Memory cost: tensor bytes under a spec, model states under sharding, activations from
liveness, and the peak memory of a pipeline stage (pure functions).

**Model states** (AMSP §IV-D; ZeRO's ``K``): bytes per parameter of parameters P, gradients G
and optimizer states OS, each divided by its own sharding factor:

=========================  ======  ======  =========================================
optimizer, precision       P       G       OS
=========================  ======  ======  =========================================
Adam, mixed (bf16/fp16)    2       2       12 (fp32 master copy, m, v)
Adam, fp32                 4       4       8 (m, v)
SGD+momentum, mixed        2       2       8 (fp32 master copy, momentum)
SGD+momentum, fp32         4       4       4 (momentum)
SGD, mixed / fp32          2 / 4   2 / 4   4 (master copy) / 0
=========================  ======  ======  =========================================

so mixed-precision Adam gives AMSP's ``2Φ/s_p + 2Φ/s_g + 12Φ/s_os``.

**Activations**: the tensors an op saves for its backward (its inputs for a matmul, its output
for a softmax, a bit mask for dropout, ...) stay live from the forward to the backward; all
other intermediates die after their last forward use. :func:`activation_memory` walks a
forward graph in order with that liveness (views share their base's storage, parameters are
model states and not counted) and reports what one microbatch holds at the end of the
forward and the peak on the way.

**Pipeline stages**: a stage holds the activations of every microbatch in flight
(:func:`fxpar.cost.pipeline.in_flight_microbatches`; 1F1B: stage ``s`` of ``p`` keeps
``p−s``, Megatron-LM §2.2.1). With recomputation (Megatron-LM §3.5) a stage stashes only its
input per microbatch and rebuilds one microbatch's activations at a time, for one extra
forward.

>>> from fxpar.cost.memory import model_state_bytes
>>> ms = model_state_bytes(7e9, s_os=8)          # Adam, mixed precision, OS over 8 devices
>>> round(ms.total / 1e9, 1), round(ms.optimizer / 1e9, 1)
(38.5, 10.5)
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx

from fxpar.cost.compute import Saves, _node_target, _val, is_view, is_view_if_contiguous, saves_of
from fxpar.cost.norms import STAT_BYTES, norm_stat_rows
from fxpar.ir import EDGES, grad_flags, is_trainable_param
from fxpar.cost.pipeline import in_flight_microbatches

__all__ = [
    "dtype_bytes",
    "tensor_bytes",
    "ModelStateBytes",
    "STATE_BYTES_PER_PARAM",
    "model_state_bytes",
    "is_fp32",
    "reduce_scale",
    "ActivationMemory",
    "activation_memory",
    "saved_storage",
    "RecomputeMemory",
    "recompute_memory",
    "GRANULARITIES",
    "selective_keeps",
    "kept_bytes",
    "schedule_activation_peak",
    "stage_peak_memory",
    "in_flight_microbatches",
]


def dtype_bytes(dtype: torch.dtype | str) -> int:
    """Bytes per element: ``dtype_bytes(torch.bfloat16) == dtype_bytes("bfloat16") == 2``."""
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    return dtype.itemsize


def tensor_bytes(shape: Sequence[int], dtype: torch.dtype | str = torch.float32, spec=None,
                 mesh_shape: Sequence[int] | None = None) -> int:
    """Bytes of a tensor, or of its largest local shard under ``spec`` on a mesh of
    ``mesh_shape`` (uneven shards as ``torch.chunk``; Partial and Replicate do not shrink it).

    >>> from fxpar.spec import Spec
    >>> tensor_bytes((1024, 1024), "bfloat16")
    2097152
    >>> tensor_bytes((1024, 1024), "bfloat16", Spec.parse("S(0)R"), (4, 2))
    524288
    >>> tensor_bytes((5, 4), "float32", "S(0)", (4,))      # chunks of 2, 2, 1, 0 rows
    32
    """
    if spec is None:
        return math.prod(int(s) for s in shape) * dtype_bytes(dtype)
    if mesh_shape is None:
        raise ValueError("tensor_bytes: a spec needs the mesh_shape it applies to")
    from fxpar.spec import as_spec

    return as_spec(spec).local_numel(tuple(shape), tuple(mesh_shape)) * dtype_bytes(dtype)


#: Bytes per parameter ``(P, G, OS)`` by ``(optimizer, precision)``; see the module table.
STATE_BYTES_PER_PARAM: dict[tuple[str, str], tuple[int, int, int]] = {
    ("adam", "mixed"): (2, 2, 12),
    ("adam", "fp32"): (4, 4, 8),
    ("sgd_momentum", "mixed"): (2, 2, 8),
    ("sgd_momentum", "fp32"): (4, 4, 4),
    ("sgd", "mixed"): (2, 2, 4),
    ("sgd", "fp32"): (4, 4, 0),
}
_OPT_ALIASES = {"adamw": "adam", "adam": "adam", "sgd": "sgd", "momentum": "sgd_momentum",
                "sgd_momentum": "sgd_momentum"}
_PREC_ALIASES = {"mixed": "mixed", "bf16": "mixed", "fp16": "mixed", "amp": "mixed",
                 "fp32": "fp32", "float32": "fp32"}


def is_fp32(precision: str) -> bool:
    """Whether ``precision`` names fp32 training (4-byte parameters, gradients and values moved).

    >>> is_fp32("float32"), is_fp32("bf16")
    (True, False)
    """
    return _PREC_ALIASES.get(precision.lower()) == "fp32"


@dataclass(frozen=True)
class ModelStateBytes:
    """Per-device bytes of parameters, gradients and optimizer states."""

    params: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer


def model_state_bytes(num_params: float, *, optimizer: str = "adam", precision: str = "mixed",
                      s_p: int = 1, s_g: int = 1, s_os: int = 1,
                      reduce_dtype: torch.dtype | str | None = None) -> ModelStateBytes:
    """Model-state bytes per device with sharding factors ``s_p, s_g, s_os`` (AMSP §IV-D):
    ``k_P·Φ/s_p + k_G·Φ/s_g + k_OS·Φ/s_os`` with ``k`` from :data:`STATE_BYTES_PER_PARAM`.
    ZeRO-1/2/3 are ``(1,1,N)``, ``(1,N,N)``, ``(N,N,N)``. ``reduce_dtype``: gradients summed
    and reduced in it (the runtime's ``reduce_dtype``: its buckets hold them so), ``k_G`` its
    bytes.

    >>> round(model_state_bytes(1e9).total / 1e9)              # 16 bytes/param unsharded
    16
    >>> model_state_bytes(1e9, optimizer="sgd", precision="fp32").optimizer
    0.0
    >>> round(model_state_bytes(1e9, s_p=8, s_g=8, s_os=8).total / 1e9)   # ZeRO-3 on 8
    2
    >>> model_state_bytes(1e9, reduce_dtype="float32").grads / 1e9     # bf16 params, fp32 grads
    4.0
    """
    key = (_OPT_ALIASES.get(optimizer.lower(), optimizer.lower()),
           _PREC_ALIASES.get(precision.lower(), precision.lower()))
    if key not in STATE_BYTES_PER_PARAM:
        raise ValueError(f"unknown optimizer/precision {optimizer!r}/{precision!r}; known: "
                         f"{sorted(STATE_BYTES_PER_PARAM)}")
    kp, kg, kos = STATE_BYTES_PER_PARAM[key]
    if reduce_dtype is not None:
        kg = dtype_bytes(reduce_dtype)
    for name, s in (("s_p", s_p), ("s_g", s_g), ("s_os", s_os)):
        if s < 1:
            raise ValueError(f"{name} must be >= 1, got {s}")
    return ModelStateBytes(kp * num_params / s_p, kg * num_params / s_g, kos * num_params / s_os)


def reduce_scale(precision: str, reduce_dtype: torch.dtype | str | None) -> float:
    """Bytes a gradient element is reduced in over the bytes a value moves under ``precision``
    (2 mixed, 4 fp32): what ``reduce_dtype`` multiplies every gradient reduction's bytes by.

    >>> reduce_scale("mixed", "float32"), reduce_scale("fp32", "bfloat16"), reduce_scale("mixed", None)
    (2.0, 0.5, 1.0)
    """
    if reduce_dtype is None:
        return 1.0
    return dtype_bytes(reduce_dtype) / (4 if is_fp32(precision) else 2)


# --------------------------------------------------------------------------------------------
# activations
# --------------------------------------------------------------------------------------------
# What each op saves for its backward, when its output needs a gradient, is its record's
# ``saves`` (``fxpar.strategies``, read through fxpar.cost.compute.saves_of):
#   "partners": every tensor input whose partner operand needs a gradient (matmul, mul, conv)
#   "output":   its output (softmax, tanh, sigmoid, exp, relu, rsqrt, sqrt)
#   "input0":   its first input (gelu, silu, reductions that need the input)
#   "stats":    its first input plus 2 fp32 statistics per row (norms: mean and rstd)
#   "channel_stats", "group_stats": the same per channel (batch norm), per sample and group
#               (group norm; instance norm: a group per channel), fxpar.cost.norms
#   "qkvo":     q, k, v and the output (fused attention), plus the logsumexp
#   "nothing":  no tensor (add/sub/neg, sum/mean, copies, views)
#   "indices":  its integer inputs (embedding, gather, index)
#   "mask":     a 1-byte mask per element of its input (dropout)
# Unrecorded: every tensor input ("all"; "partners" for a call_module).


def _first_tensor_node(n: fx.Node) -> fx.Node | None:
    for a in n.all_input_nodes:
        if isinstance(_val(a), (torch.Tensor, list, tuple)):
            return a
    return None


def _nbytes_val(v) -> int:
    if isinstance(v, torch.Tensor):
        return int(math.prod(int(s) for s in v.shape)) * v.dtype.itemsize
    return 0


@dataclass(frozen=True)
class ActivationMemory:
    """Activation bytes of one microbatch through a forward graph.

    * ``saved_bytes``: held from the forward to the backward (what each in-flight microbatch
      costs a pipeline stage);
    * ``peak_forward_bytes``: the most live at once during the forward (saved + temporaries);
    * ``peak_bytes``: also covering the backward: ``saved + max(dY + dX)`` over the ops;
    * ``input_bytes``: the graph's activation inputs (what recomputation stashes);
    * ``saved``: names of the nodes whose storage is saved.
    """

    saved_bytes: int
    peak_forward_bytes: int
    peak_bytes: int
    input_bytes: int
    saved: tuple[str, ...]

    @property
    def transient_bytes(self) -> int:
        """What the peak adds on top of the saved activations."""
        return max(0, self.peak_bytes - self.saved_bytes)


def _storage_roots(gm: fx.GraphModule, nodes: list[fx.Node]) -> tuple[dict, dict]:
    """``(root, is_param)``: the node owning each node's storage (a view's base) and whether
    that storage is a model state (parameter, buffer, attribute)."""
    root: dict[fx.Node, fx.Node] = {}
    is_param: dict[fx.Node, bool] = {}
    for n in nodes:
        if n.op in ("placeholder", "get_attr"):
            root[n] = n
            is_param[n] = n.op == "get_attr" or is_trainable_param(n) or _is_buffer(n)
            continue
        if n.op == "output":
            continue
        target = _node_target(n, gm) if n.op != "call_module" else None
        src = _first_tensor_node(n)
        alias = (is_view(target) or (is_view_if_contiguous(target) and src is not None and _views(n, src))
                 or _returns_input(n, target))
        if target is operator.getitem and src is not None and isinstance(_val(src), (list, tuple)):
            # an element of a multi-output op: its own storage, unless the op is a view (split)
            t = _node_target(src, gm) if src.op != "call_module" else None
            alias = t is not None and (is_view(t) or t in _MULTI_VIEWS)
            if alias:  # the element at index k views the op's k-th tensor input
                k = n.args[1] if isinstance(n.args[1], int) else 0
                ins = _list_inputs(src)
                if t in _MULTI_VIEWS and k < len(ins):
                    root[n] = root.get(ins[k], ins[k])
                    is_param[n] = is_param.get(root[n], False)
                    continue
        root[n] = root[src] if alias and src is not None else n
        is_param[n] = is_param.get(root[n], False) if alias else False
    return root, is_param


#: multi-output ops whose k-th output is a view of their k-th tensor input (measured: a loss
#: on ``broadcast_tensors`` outputs saves the broadcast inputs' storages, nothing new)
_MULTI_VIEWS = {torch.ops.aten.broadcast_tensors.default}


def _list_inputs(n: fx.Node) -> list[fx.Node]:
    a = n.args[0] if n.args else None
    return [x for x in a if isinstance(x, fx.Node)] if isinstance(a, (list, tuple)) else []


# what an op keeps for its backward, by its record's ``saves``: ``f(node, tensor inputs, grad
# flags) -> (nodes whose storage it keeps, extra bytes it keeps besides)``
def _saves_nothing(n, ins, flags):
    return [], 0


def _differentiable(dtype: torch.dtype) -> bool:
    """A dtype autograd carries a gradient for (floating or complex)."""
    return dtype.is_floating_point or dtype.is_complex


def _saves_partners(n, ins, flags):  # an integer or bool input (a mask) is kept whatever
    return [a for a in ins if any(flags.get(b, False) for b in ins if b is not a)
            or not _differentiable(_val(a).dtype)], 0


def _saves_stats(n, ins, flags):  # mean and rstd (or the batch statistics): 2 fp32 per row
    x = _val(ins[0])
    rows = math.prod(int(s) for s in x.shape[:-1]) if x.dim() else 1
    return ins[:1], 2 * 4 * rows


def _saves_channel_stats(n, ins, flags):  # batch norm: mean and invstd per channel
    return ins[:1], 2 * STAT_BYTES * norm_stat_rows("batch", _val(ins[0]).shape)


def _given(n: fx.Node) -> dict:
    """``n``'s arguments by their schema names (positional and keyword)."""
    schema = getattr(n.target, "_schema", None)
    names = [a.name for a in schema.arguments] if schema is not None else []
    return dict(zip(names, n.args)) | dict(n.kwargs)


def _saves_group_stats(n, ins, flags):  # group norm: per (sample, group); instance norm: G = C
    x = _val(ins[0])
    given = _given(n)
    groups = given.get("num_groups", given.get("group"))
    if not isinstance(groups, int):
        groups = int(x.shape[1]) if x.dim() > 1 else 1
    return ins[:1], 2 * STAT_BYTES * norm_stat_rows("group", x.shape, groups=groups)


def _saves_qkvo(n, ins, flags):
    """Fused attention: q, k, v, the output, an fp32 logsumexp per query row and an
    ``attn_mask`` if given, which the memory-efficient and CPU kernels take again as the
    backward's bias: a float mask itself, a bool one as the additive mask it becomes (its
    shape in q's dtype; BERT's padding mask, 2% of its activations). With
    ``dropout_p > 0`` fxpar runs it as math attention with a keyed dropout
    (``fxpar.keyed_sdpa``, :mod:`fxpar.runtime.keyed`), which keeps q, k and v for its two
    matmuls, the softmax's probabilities and their dropped copy (``B·H·L·S`` each, in q's
    dtype) and the bool masks it fills with ``-inf`` (the causal one, a bool ``attn_mask``'s
    complement); under grouped-query attention the repeated k and v instead of k and v."""
    q = _val(ins[0])
    b = _given(n)
    if not float(b.get("dropout_p") or 0.0):
        lse = 4 * math.prod(int(s) for s in q.shape[:-1])            # logsumexp, fp32
        mask = b.get("attn_mask")
        if not isinstance(mask, fx.Node):
            return ins[:3] + [n], lse
        if _val(mask).dtype == torch.bool:
            return ins[:3] + [n], lse + math.prod(int(s) for s in _val(mask).shape) * q.dtype.itemsize
        return ins[:3] + [n, mask], lse
    k, v = _val(ins[1]), _val(ins[2])
    L, S = int(q.shape[-2]), int(k.shape[-2])
    rows = math.prod(int(s) for s in q.shape[:-1])          # B·H·L
    extra = 2 * rows * S * q.dtype.itemsize                  # probabilities, dropped
    mask = b.get("attn_mask")
    if b.get("is_causal") or "offset" in b:                   # the causal keep-mask
        extra += L * S
    if isinstance(mask, fx.Node) and _val(mask).dtype == torch.bool:
        extra += math.prod(int(s) for s in _val(mask).shape)
    kept = ins[:1]
    if b.get("enable_gqa") and q.dim() >= 3 and k.shape[-3] != q.shape[-3]:
        rep = int(q.shape[-3]) // int(k.shape[-3])
        extra += rep * (_nbytes_val(k) + _nbytes_val(v))
    else:
        kept = ins[:3]
    return kept, extra


def _saves_logits(n, ins, flags):
    """Vocabulary-parallel cross-entropy (``fxpar.vocab_parallel_cross_entropy``): its
    logits shard, its target and an fp32 logsumexp per target."""
    t = _val(ins[1])
    return ins[:2], 4 * math.prod(int(s) for s in t.shape)


def _saves_balanced(n, ins, flags):
    """Load-balanced causal attention of a sequence shard (``fxpar.balanced_causal_sdpa``,
    :mod:`fxpar.runtime.context_parallel`): two fused attentions on half the rows each, its
    own first half and its partner's second half (swapped in): q, k, v, its own half's output,
    the partner's query half and output, an fp32 logsumexp per row, and each half's causal
    mask (``rows × keys``, in q's dtype: the CPU kernel keeps a bool mask as an additive one)."""
    q = _val(ins[0])
    b = _given(n)
    L = int(q.shape[-2])
    h = L // 2
    row0 = int(b["offset"]) + (int(b["peer"]) - int(b["me"])) * L + h   # the partner's half
    lead = math.prod(int(s) for s in q.shape[:-2])
    half = lead * h * int(_val(ins[2]).shape[-1]) * q.dtype.itemsize
    masks = h * ((int(b["offset"]) + h) + (row0 + h)) * q.dtype.itemsize
    return ins[:3], 3 * half + 4 * lead * L + masks


def _saves_lowered(n, ins, flags):
    """What an op keeps by its ATen lowering, found by running it on meta tensors of its
    inputs' shapes, strides and ``requires_grad``: each saved tensor that shares an input's
    (or the output's) storage keeps that node; any other is a buffer of the op's own, counted
    in bytes. ``torch.einsum`` permutes its operands and reshapes them for one ``bmm``
    (ATen's ``sumproduct_pair``), which keeps those operands: a view of the input where the
    permuted layout reshapes without a copy, else a copy of its own (Mamba-2's chunked scan:
    every einsum kept two copies, which the inputs' rule priced as the inputs, 16% under);
    ``sort`` and ``topk`` keep their indices, not their input (a mixture of experts' router).
    Bytes of the op's own are sharded as its first output (:func:`fxpar.planner.pricing.node_memory`),
    so an op whose buffers follow an input's sharding instead (a loss: a scalar out of a
    batch's log-softmax) keeps its record's rule.
    An op that cannot run on meta tensors keeps all its inputs (conservative).

    >>> import torch
    >>> g = fx.Graph()
    >>> a, b = g.placeholder("a"), g.placeholder("b")
    >>> a.meta["val"] = b.meta["val"] = torch.empty(2, 8, 3, 4, device="meta")
    >>> e = g.call_function(torch.ops.aten.einsum.default, ("blhn,bshn->blsh", [a, b]))
    >>> e.meta["val"] = torch.empty(2, 8, 8, 3, device="meta")
    >>> _saves_lowered(e, [a, b], {a: True, b: True})   # (b·h, l, n) and (b·h, n, s): copies
    ([], 1536)
    """
    def meta(a: fx.Node) -> torch.Tensor:
        v = _val(a)
        t = torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta")
        return t.requires_grad_(bool(flags.get(a, False)) and _differentiable(v.dtype))

    env = {a: meta(a) for a in ins}
    args, kwargs = fx.node.map_arg((n.args, n.kwargs), lambda a: env.get(a, a))
    kept: list[torch.Tensor] = []
    try:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
            out = n.target(*args, **kwargs)
    except Exception:  # noqa: BLE001 (any failure: the conservative rule)
        return ins, 0
    owner = {t.untyped_storage()._cdata: a for a, t in env.items()}
    if isinstance(out, (list, tuple)):   # an element is its getitem's node (none: a buffer)
        items = {u.args[1]: u for u in n.users if u.target is operator.getitem}
        for i, o in enumerate(out):
            if isinstance(o, torch.Tensor) and i in items:
                owner.setdefault(o.untyped_storage()._cdata, items[i])
    elif isinstance(out, torch.Tensor):
        owner.setdefault(out.untyped_storage()._cdata, n)
    chosen, extra, seen = [], 0, set()
    for t in kept:
        key = t.untyped_storage()._cdata
        if key not in seen:
            seen.add(key)
            if key in owner:
                chosen.append(owner[key])
            else:
                extra += t.untyped_storage().nbytes()
    return chosen, extra


def _math_attention(n: fx.Node, device: str) -> bool:
    """Whether ``scaled_dot_product_attention`` at ``n`` runs PyTorch's math path on
    ``device``: on a CPU, whose fused kernel (``_scaled_dot_product_flash_attention_for_cpu``)
    needs q, k and v of one head dim, when they differ (multi-head latent attention:
    DeepSeek-V2's q and k heads of 192, v of 128). The math path keeps the scaled q and k,
    the probabilities and v (:func:`_saves_lowered` finds them: on meta tensors the math path
    is the one that runs), not q, k, v, the output and a logsumexp; an attention with dropout
    is fxpar's keyed one wherever it runs (:func:`_saves_qkvo`).

    >>> g = fx.Graph()
    >>> q, k, v = (g.placeholder(x) for x in "qkv")
    >>> for x, d in ((q, 24), (k, 24), (v, 16)):
    ...     x.meta["val"] = torch.empty(2, 4, 16, d, device="meta")
    >>> a = g.call_function(torch.ops.aten.scaled_dot_product_attention.default, (q, k, v))
    >>> _math_attention(a, "cpu-process"), _math_attention(a, "A100-80GB")
    (True, False)
    """
    if not device.lower().startswith("cpu") or float(_given(n).get("dropout_p") or 0.0):
        return False
    dims = {int(_val(a).shape[-1]) for a in n.args[:3] if isinstance(a, fx.Node)}
    return len(dims) > 1


#: what fxpar's own graph ops keep for their backward, by op name (a ``fxpar`` op not named
#: keeps nothing: a collective, a random draw, a dropout whose backward draws its mask again
#: and the loss's helpers hand their backward shapes only, :mod:`fxpar.runtime.library`)
_FXPAR_SAVES = {
    "vocab_parallel_cross_entropy": _saves_logits,
    "vocab_parallel_log_softmax": lambda n, ins, flags: ([n], 0),
    "ring_sdpa": _saves_qkvo,
    "keyed_sdpa": _saves_qkvo,
    "offset_causal_sdpa": _saves_qkvo,
    "balanced_causal_sdpa": _saves_balanced,
}


_SAVED = {
    Saves.ALL: lambda n, ins, flags: (ins, 0),
    Saves.PARTNERS: _saves_partners,
    Saves.OUTPUT: lambda n, ins, flags: ([n], 0),
    Saves.INPUT0: lambda n, ins, flags: (ins[:1], 0),
    Saves.STATS: _saves_stats,
    Saves.CHANNEL_STATS: _saves_channel_stats,
    Saves.GROUP_STATS: _saves_group_stats,
    Saves.QKVO: _saves_qkvo,
    Saves.INDICES: lambda n, ins, flags: ([a for a in ins if not _val(a).dtype.is_floating_point], 0),
    Saves.NOTHING: _saves_nothing,
    Saves.LOWERED: _saves_lowered,
    # the bool mask of its first input
    Saves.MASK: lambda n, ins, flags: ([], sum(math.prod(int(s) for s in _val(a).shape) for a in ins[:1])),
}


def _saving_nodes(gm: fx.GraphModule, nodes, flags, only=None):
    """The nodes whose backward runs (they carry a gradient; views excluded)."""
    for n in nodes:
        if n.op in ("placeholder", "get_attr", "output") or not flags.get(n, False):
            continue
        if only is not None and not only(n):
            continue
        if is_view(_node_target(n, gm) if n.op != "call_module" else None):
            continue
        yield n


def saved_storage(gm: fx.GraphModule, flags, *, only: Callable[[fx.Node], bool] | None = None,
                  roots=None, device: str = "") -> tuple[dict[fx.Node, None], dict[fx.Node, int]]:
    """``(saved, extra)``: the storages autograd keeps from the forward to the backward (the
    nodes owning them, in graph order: a saved view keeps its base; model states excluded),
    and per saving node the bytes it keeps besides tensors of the graph (a norm's fp32
    statistics, a dropout's mask, attention's logsumexp). By each op's record's ``saves``
    (:class:`~fxpar.cost.compute.Saves`); an op without a record keeps all its inputs.
    ``flags``: :func:`~fxpar.ir.grad_flags`; ``only``: the saves of those nodes alone;
    ``device``: the type of device the graph runs on (``Cluster.device_type``): on a CPU one,
    attention whose fused CPU kernel cannot run keeps what PyTorch's math path keeps
    (:func:`_math_attention`); otherwise attention is a fused kernel's.

    >>> import torch
    >>> mlp = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    >>> gm = torch.export.export(mlp, (torch.randn(2, 4),)).graph_module
    >>> saved, extra = saved_storage(gm, grad_flags(gm))
    >>> [n.name for n in saved], extra     # x for dW1; relu's output for dW2 and relu'
    (['input', 'relu'], {})
    """
    nodes = list(gm.graph.nodes)
    root, is_param = roots if roots is not None else _storage_roots(gm, nodes)
    saved: dict[fx.Node, None] = {}
    extra: dict[fx.Node, int] = {}
    for n in _saving_nodes(gm, nodes, flags, only):
        target = _node_target(n, gm) if n.op != "call_module" else None
        kind = saves_of(target)
        ins = [a for a in n.all_input_nodes if isinstance(_val(a), torch.Tensor)]
        rule = None
        if kind is None and getattr(target, "namespace", None) == "fxpar":
            rule = _FXPAR_SAVES.get(getattr(target, "_opname", None), _saves_nothing)
        elif kind is None:
            kind = Saves.PARTNERS if n.op == "call_module" else Saves.ALL
        if kind is Saves.QKVO and _math_attention(n, device):
            rule = _saves_lowered
        chosen, more = (rule or _SAVED.get(kind, _saves_nothing))(n, ins, flags)
        if more:
            extra[n] = more
        for a in chosen:
            r = root.get(a, a)
            if not is_param.get(r, False):
                saved[r] = None
    order = {n: i for i, n in enumerate(nodes)}
    return dict.fromkeys(sorted(saved, key=order.__getitem__)), extra


def activation_memory(gm: fx.GraphModule, *,
                      requires_grad: Iterable[fx.Node] | Callable[[fx.Node], bool] = (),
                      only: Callable[[fx.Node], bool] | None = None,
                      device: str = "") -> ActivationMemory:
    """Liveness of the tensors of a forward graph during training (see module docstring).

    Views alias their base (``view``, ``transpose``, ``split`` ... cost nothing); a saved view
    keeps its whole base alive. Parameters and buffers are model states, not activations.
    Ops without a rule save all their tensor inputs (conservative). ``only``: count the saves
    of those nodes alone (what a part of the graph keeps, e.g. outside recomputed layers).

    >>> import torch
    >>> mlp = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
    >>> gm = torch.export.export(mlp, (torch.randn(8, 64),)).graph_module
    >>> am = activation_memory(gm)
    >>> am.saved_bytes == 4 * (8 * 64 + 8 * 256)   # x for dW1, relu output (for dW2 and relu')
    True
    """
    flags = grad_flags(gm, requires_grad)
    nodes = list(gm.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    root, is_param = _storage_roots(gm, nodes)
    saved, extras = saved_storage(gm, flags, only=only, roots=(root, is_param), device=device)
    extra = sum(extras.values())

    # forward last use of every storage root (uses of aliases count)
    last_use: dict[fx.Node, int] = {}
    for n in nodes:
        for a in n.all_input_nodes:
            r = root.get(a, a)
            last_use[r] = max(last_use.get(r, -1), index[n])
    out_node = nodes[-1] if nodes and nodes[-1].op == "output" else None
    backward_transient = 0
    for n in _saving_nodes(gm, nodes, flags, only):
        # backward of this op: dY plus the gradients of its inputs live at once
        ins = [a for a in n.all_input_nodes if isinstance(_val(a), torch.Tensor)]
        v = _val(n)
        dy = _nbytes_val(v) if isinstance(v, torch.Tensor) else sum(_nbytes_val(e) for e in v or ())
        dx = sum(_nbytes_val(_val(a)) for a in ins if flags.get(a, False) and not is_param.get(root.get(a, a), False))
        backward_transient = max(backward_transient, dy + dx)

    def size(r: fx.Node) -> int:
        return _nbytes_val(_val(r))

    saved_bytes = sum(size(r) for r in saved) + extra
    # forward walk: a root is live from its definition to its last use, or to the end if saved
    outputs = set()
    if out_node is not None:
        for a in out_node.all_input_nodes:
            outputs.add(root.get(a, a))
    live: dict[fx.Node, int] = {}
    peak = 0
    input_bytes = 0
    for n in nodes:
        if n.op == "output":
            break
        r = root.get(n, n)
        if r is n and not is_param.get(n, False):
            live[n] = size(n)
            if n.op == "placeholder":
                input_bytes += size(n)
        peak = max(peak, sum(live.values()))
        for a in set(n.all_input_nodes) | {n}:
            ra = root.get(a, a)
            if ra in live and ra not in saved and ra not in outputs and last_use.get(ra, -1) <= index[n]:
                del live[ra]
    peak_fwd = max(peak, saved_bytes)
    return ActivationMemory(int(saved_bytes), int(peak_fwd), int(max(peak_fwd, saved_bytes + backward_transient)),
                            int(input_bytes), tuple(r.name for r in saved))


#: What a recomputed layer re-runs in backward (``recompute_granularity``): ``"full"`` its
#: whole forward, keeping only its inputs; ``"selective"`` all but the ops
#: :func:`selective_keeps` names, whose outputs it keeps (Megatron-LM's "selective"
#: granularity, torchtitan's per-op activation checkpointing).
GRANULARITIES = ("full", "selective")

#: the ops whose outputs selective recomputation keeps, by namespace: the GEMMs of linear
#: layers, fused attention kernels and convolutions (nearly all of a layer's FLOPs), and
#: communication (no collective runs twice); ``matmul`` only where it lowers to a GEMM
#: (an operand of at most 2 dims), so an attention core written out (``QKᵀ``, softmax, ``·V``:
#: batched matmuls, ``s×s`` scores) is recomputed, as Megatron-LM's selective granularity does
_KEEPS = {
    "aten": frozenset({
        "mm", "addmm", "linear", "matmul",
        "scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_fused_attention_overrideable",
        "convolution", "_convolution", "conv1d", "conv2d", "conv3d",
        "conv_transpose1d", "conv_transpose2d", "conv_transpose3d"}),
    "fxpar": frozenset({"start", "wait", "redistribute", "cp_swap", "ring_sdpa_fwd"}),
}


def selective_keeps(target, ndims: Sequence[int] = (), *, gathers_param: bool = False) -> bool:
    """Whether selective recomputation keeps the output of a call of ``target`` (an ATen or
    ``fxpar`` overload or packet; ``ndims``: its tensor operands' dims, which decide
    ``matmul``) instead of recomputing it: the same rule for a graph's nodes (the memory
    model) and for the ops the runtime dispatches (:mod:`fxpar.runtime.recompute`). A
    communication op that ``gathers_param`` (ZeRO-3's gathers) is recomputed: keeping the
    gathered parameter to the backward is what sharding it avoids.

    >>> aten = torch.ops.aten
    >>> selective_keeps(aten.addmm.default), selective_keeps(aten.gelu.default)
    (True, False)
    >>> selective_keeps(aten.matmul.default, (3, 2)), selective_keeps(aten.matmul.default, (4, 4))
    (True, False)
    """
    name = None if gathers_param else _kept_name(target)
    return name is not None and (name != "matmul" or min(ndims, default=3) <= 2)


@functools.lru_cache(maxsize=None)
def _kept_name(target) -> str | None:
    """``target``'s op name if :data:`_KEEPS` names it (per op, once: the runtime asks on
    every op a recomputed region dispatches)."""
    packet = target.overloadpacket if isinstance(target, torch._ops.OpOverload) else target
    if not isinstance(packet, torch._ops.OpOverloadPacket):
        return None
    name = packet.__name__
    return name if name in _KEEPS.get(packet._qualified_op_name.split("::")[0], ()) else None


def _gathers_param(n: fx.Node, edges) -> bool:
    """Whether a rank graph's node waits for or redistributes a gathered parameter (its
    edge, ``fxpar.wait``'s third argument or ``fxpar.redistribute``'s second:
    ``Edge.gathers_param``)."""
    from fxpar.layers import wait_or_redistribute

    name = wait_or_redistribute(n)
    if name is None:
        return False
    e = edges.get(n.args[2 if name == "wait" else 1])
    return e is not None and e.gathers_param


def kept_bytes(n: fx.Node, out: float | None = None) -> float:
    """What selective recomputation keeps of a node it keeps: its output (``out`` bytes, by
    default the whole value's; a device's piece under a layout), and beside an attention
    kernel's output its fp32 logsumexp, one per output row."""
    v = _val(n)
    if out is None:
        out = _nbytes_val(v) if isinstance(v, torch.Tensor) else sum(_nbytes_val(e) for e in v or ())
    if out and isinstance(v, torch.Tensor) and saves_of(n.target) is Saves.QKVO:
        out += 4 * out / v.dtype.itemsize / max(1, int(v.shape[-1]))
    return out


@dataclass(frozen=True)
class RecomputeMemory:
    """Activation bytes of one microbatch when ``layers`` are recomputed (each under its own
    checkpoint, as the runtime does: :mod:`fxpar.runtime.recompute`):

    * ``stash_bytes``: held from the forward to the backward: every recomputed layer's inputs
      (activations entering its node range; parameters are model states) and what the other
      nodes save, each storage once;
    * ``rebuilt_bytes``: the largest recomputed layer's own saved bytes, live while that layer's
      backward runs (one layer at a time; selective: less what the layer kept);
    * ``layers``: the recomputed layers found in the graph.

    ``granularity="selective"`` (:data:`GRANULARITIES`): each recomputed layer also keeps the
    outputs of its nodes :func:`selective_keeps` names (an attention node's with its fp32
    logsumexp), each storage once.
    """

    stash_bytes: int
    rebuilt_bytes: int
    layers: tuple[str, ...]


def recompute_memory(gm: fx.GraphModule, layers: Iterable[str], *,
                     requires_grad: Iterable[fx.Node] | Callable[[fx.Node], bool] = (),
                     granularity: str = "full", device: str = "") -> RecomputeMemory:
    """Per-layer recomputation's activation bytes for one microbatch (:class:`RecomputeMemory`).

    A layer's node range runs from its first to its last node (:func:`fxpar.layers.node_layers`,
    as the runtime cuts them); a value defined before the range and used in it is an input the
    layer keeps.

    >>> import torch
    >>> class Block(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.fc = torch.nn.Linear(64, 64)
    ...     def forward(self, x):
    ...         return torch.tanh(self.fc(x))
    >>> class Net(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.blocks = torch.nn.ModuleList(Block() for _ in range(2))
    ...     def forward(self, x):
    ...         for b in self.blocks:
    ...             x = b(x)
    ...         return x
    >>> gm = torch.export.export(Net(), (torch.randn(8, 64),)).graph_module
    >>> activation_memory(gm).saved_bytes // 2048    # x, tanh 0 (also block 1's input), tanh 1
    3
    >>> rm = recompute_memory(gm, ["blocks.0", "blocks.1"])
    >>> rm.stash_bytes // 2048, rm.rebuilt_bytes // 2048   # the block inputs; one block's saves
    (2, 2)
    >>> rm = recompute_memory(gm, ["blocks.0", "blocks.1"], granularity="selective")
    >>> rm.stash_bytes // 2048, rm.rebuilt_bytes // 2048   # and each linear's output
    (4, 2)
    """
    from fxpar.layers import node_layers

    if granularity not in GRANULARITIES:
        raise ValueError(f"recompute_memory: granularity {granularity!r}, one of {GRANULARITIES}")

    nodes = list(gm.graph.nodes)
    want = set(layers)
    owner = node_layers(gm)   # the regions the runtime cuts (a wait belongs to its user's layer)
    span: dict[str, list[int]] = {}
    for i, n in enumerate(nodes):
        if n.op in ("placeholder", "output", "get_attr"):
            continue
        lay = owner[n]
        if lay in want:
            span.setdefault(lay, [i, i])[1] = i
    region: dict[fx.Node, str] = {}
    for lay, (a, b) in span.items():
        for n in nodes[a:b + 1]:
            region[n] = lay
    rest = activation_memory(gm, requires_grad=requires_grad, only=lambda n: n not in region,
                             device=device)
    root, is_param = _storage_roots(gm, nodes)
    kept = set(rest.saved)
    stash = rest.saved_bytes
    for n, lay in region.items():
        for a in n.all_input_nodes:
            if region.get(a) == lay:
                continue
            r = root.get(a, a)
            if is_param.get(r, False) or r.name in kept or not isinstance(_val(r), torch.Tensor):
                continue
            kept.add(r.name)
            stash += _nbytes_val(_val(r))
    held: dict[str, set[str]] = {lay: set() for lay in span}   # per layer: storages it keeps
    if granularity == "selective":
        edges = gm.meta.get(EDGES, {})
        for n, lay in region.items():
            ndims = [_val(a).dim() for a in n.all_input_nodes if isinstance(_val(a), torch.Tensor)]
            if n.op == "call_function" and selective_keeps(n.target, ndims,
                                                           gathers_param=_gathers_param(n, edges)):
                r = root.get(n, n)
                held[lay].add(r.name)
                if r.name not in kept:
                    kept.add(r.name)
                    stash += kept_bytes(n)
    flags = grad_flags(gm, requires_grad)

    def rebuilt_of(lay: str) -> int:   # what the layer's recomputation saves anew
        saved, extra = saved_storage(gm, flags, only=lambda n: region.get(n) == lay,
                                     roots=(root, is_param), device=device)
        return sum(_nbytes_val(_val(r)) for r in saved if r.name not in held[lay]) + sum(extra.values())
    rebuilt = max((rebuilt_of(lay) for lay in span), default=0)
    return RecomputeMemory(int(stash), int(rebuilt), tuple(sorted(span)))


def _is_buffer(n: fx.Node) -> bool:
    info = n.meta.get("fxpar_param")
    return info is not None and getattr(info, "kind", None) == "buffer"


#: dropout variants (``input, p, train``) that return their input itself at ``p == 0`` or
#: outside training (ATen's ``_dropout_impl``; models keep ``nn.Dropout(0.0)`` in their graph)
_DROPOUTS = {torch.ops.aten.dropout, torch.ops.aten.feature_dropout, torch.ops.aten.alpha_dropout,
             torch.ops.aten.feature_alpha_dropout}


def _returns_input(n: fx.Node, target) -> bool:
    if getattr(target, "overloadpacket", None) not in _DROPOUTS:
        return False
    b = _given(n)
    return b.get("p") == 0 or b.get("train") is False


def _views(n: fx.Node, src: fx.Node) -> bool:
    """Whether ``n`` (``reshape``, ``flatten``, ``contiguous``: ops that alias their input
    only when they can) returns a view of ``src``: ``contiguous`` of a contiguous input, a
    reshape whose shape the input's strides can express (as ``torch.reshape`` decides: the same
    shape, or dims merged that are laid out together, is a view of a non-contiguous input too,
    e.g. attention's output in the fused kernels' heads-after-sequence layout)."""
    v, out = _val(src), _val(n)
    try:
        contiguous = getattr(n.target, "overloadpacket", None) is torch.ops.aten.contiguous
        if contiguous or not isinstance(out, torch.Tensor):
            return bool(v.is_contiguous())
        torch.empty_strided(tuple(v.shape), tuple(v.stride()), device="meta").view(tuple(out.shape))
        return True
    except RuntimeError:   # the strides cannot express the shape: torch copies
        return False
    except Exception:  # noqa: BLE001  (no fake value: take it as a view)
        return True


def schedule_activation_peak(schedule: str, stage: int, stages: int, m: int,
                             chunk_bytes: Sequence[float], v: int = 1) -> float:
    """The most activation bytes stage ``stage`` holds at once under ``schedule``: its compute
    order (:class:`fxpar.schedule.Schedule`'s, as the runtime runs it) walked with
    ``chunk_bytes[c]`` added at each forward of its local chunk ``c`` and released when that
    chunk's backward ends (``B``, or ``W`` where split). Equal chunks give
    ``in_flight_microbatches × Σ chunk_bytes``; unequal ones (the last chunk holds the loss)
    give what the schedule really keeps, which that closed form over- or under-states
    (measured: tests/test_memory_measured.py).

    >>> schedule_activation_peak("1f1b", 0, 4, 8, [100])
    400
    >>> schedule_activation_peak("interleaved", 1, 2, 4, [100, 150], v=2)  # 2 of chunk 0, 1 of chunk 1
    350
    """
    from fxpar.schedule import Schedule, normalize_name
    from fxpar.schedule.actions import ActionKind as K

    sched = Schedule.build(normalize_name(schedule), stages=stages, microbatches=m, chunks=v)
    local = {k: j for j, k in enumerate(sched.chunks_of(stage))}
    live = peak = 0
    for a in sched.compute_only()[stage]:
        c = local[a.stage]
        if a.kind is K.F:
            live += chunk_bytes[c]
        elif a.kind in (K.B, K.W):   # a backward's last pass (DualPipeV splits only some)
            live -= chunk_bytes[c]
        peak = max(peak, live)
    return peak


def stage_peak_memory(model_state: float, activation: ActivationMemory | float, in_flight: float, *,
                      recompute: bool = False, input_bytes: float | None = None,
                      transient_bytes: float | None = None) -> float:
    """Peak bytes of one pipeline stage (Megatron-LM §2.2 and §3.5):

    * no recomputation: ``model_state + in_flight·A + transient``;
    * recomputation: ``model_state + in_flight·A_input + A + transient`` (only the stage input
      is stashed per microbatch; one microbatch's activations ``A`` are rebuilt for its
      backward, at the cost of one extra forward).

    ``activation`` is an :class:`ActivationMemory` (its ``saved_bytes``, ``input_bytes`` and
    ``transient_bytes`` are used) or the saved bytes of one microbatch. The recompute formula
    above checkpoints the stage as ONE region (only the stage input stashed); the runtime
    checkpoints each recomputed layer, which stashes every recomputed layer's input and what
    the other nodes save: pass the :class:`RecomputeMemory` of :func:`recompute_memory` for
    that (``model_state + in_flight·stash + rebuilt + transient``; measured exact in
    tests/test_memory_measured.py, where the stage-input form understates a 2-layer stage's
    stash by half).

    >>> stage_peak_memory(10e9, 1e9, in_flight=4)                  # 1F1B, stage 0 of 4
    14000000000.0
    >>> stage_peak_memory(10e9, 1e9, in_flight=4, recompute=True, input_bytes=0.05e9)
    11200000000.0
    """
    if isinstance(activation, RecomputeMemory):  # per-layer recomputation, measured-exact stash
        return (model_state + in_flight * activation.stash_bytes + activation.rebuilt_bytes
                + float(transient_bytes or 0.0))
    if isinstance(activation, ActivationMemory):
        a = float(activation.saved_bytes)
        a_in = float(activation.input_bytes if input_bytes is None else input_bytes)
        tr = float(activation.transient_bytes if transient_bytes is None else transient_bytes)
    else:
        a = float(activation)
        a_in = float(input_bytes or 0.0)
        tr = float(transient_bytes or 0.0)
    if recompute:
        return model_state + in_flight * a_in + a + tr
    return model_state + in_flight * a + tr
