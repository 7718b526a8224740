"""Constant causal masks folded into ``is_causal=True``: the fused kernels the eager model runs.

Hugging Face models build their attention mask in Python; run eagerly without padding they
hand ``scaled_dot_product_attention`` no mask and ``is_causal=True``, but under ``torch.export``
(tracing) they build it: an ``arange``/``le``/``and`` chain ending in a ``[B, 1, L, S]``
boolean mask (transformers' own decision is now taken as eager takes it during fxpar's export,
:func:`fxpar.capture.export._eager_causal_skip`; what still arrives here: masks built from
the caller's position ids, other libraries, hand-written models). The captured program then
runs SDPA with an explicit mask, which rules out the flash kernels (on an H200: a 0.5B Llama
at 4×2048 tokens stepped 1.23× slower than eager) and costs a mask per step.

:func:`fold_causal_masks` finds each ``aten.scaled_dot_product_attention`` whose ``attn_mask``
is computed from constants alone (no placeholder among its ancestors: it depends on no input,
parameter or buffer), evaluates that mask once on the CPU, and when it *is* the causal mask
``is_causal=True`` stands for — ``tril(ones(L, S))`` (top-left aligned, as SDPA defines it)
in every batch and head; for a float mask, 0 where that is true and ``≤ finfo.min / 2`` or
``-inf`` elsewhere, which softmax turns into the same exact zeros — it drops the mask and sets
``is_causal=True``; the mask's nodes go when nothing else reads them. A mask that depends on
an input (a padding ``attention_mask``), is not causal (sliding windows, bidirectional
prefixes) or has more than :data:`MAX_ELEMENTS` elements somewhere on its way is left as it is.

>>> import torch
>>> class M(torch.nn.Module):
...     def forward(self, q):
...         i = torch.arange(q.shape[-2])
...         mask = i[:, None] >= i[None, :]
...         return torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=mask)
>>> from fxpar.capture import capture
>>> gm = capture(M(), (torch.randn(1, 2, 4, 8),))
>>> [(n.args[3:], n.kwargs) for n in gm.graph.nodes if "scaled_dot" in str(n.target)]
[((), {'is_causal': True})]
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.fx.operator_schemas import normalize_function

from fxpar.capture.constants import evaluate

__all__ = ["fold_causal_masks", "MAX_ELEMENTS"]

aten = torch.ops.aten

#: the largest tensor (elements) evaluated on the way to a mask: a ``[64, 1, 8192, 8192]``
#: mask (4G) is left unfolded rather than built on the CPU at capture
MAX_ELEMENTS = 1 << 28


def fold_causal_masks(gm: fx.GraphModule) -> int:
    """Fold constant causal masks as the module docstring says; returns how many SDPA nodes
    now run ``is_causal=True``."""
    graph = gm.graph
    parts: dict[fx.Node, list[fx.Node] | None] = {}   # mask -> its nodes when causal, else None
    folded = 0
    for n in list(graph.find_nodes(op="call_function", target=aten.scaled_dot_product_attention.default)):
        bound = normalize_function(n.target, n.args, n.kwargs, normalize_to_only_use_kwargs=True)
        kw = dict(bound.kwargs) if bound is not None else {}
        mask = kw.get("attn_mask")
        if not isinstance(mask, fx.Node) or kw.get("is_causal"):
            continue
        if mask not in parts:
            parts[mask] = _causal_mask_nodes(gm, mask, kw["query"], kw["key"])
        if parts[mask] is None:
            continue
        n.args = (kw.pop("query"), kw.pop("key"), kw.pop("value"))
        del kw["attn_mask"]
        kw["is_causal"] = True
        n.kwargs = {k: v for k, v in kw.items() if not _is_default(k, v)}
        folded += 1
    for nodes in parts.values():   # what only the folded masks read
        for m in reversed(nodes or ()):
            if m.op == "call_function" and not m.users and not m.is_impure():
                graph.erase_node(m)
    if folded:
        gm.recompile()
    return folded


def _is_default(name: str, value) -> bool:
    return (name, value) in (("dropout_p", 0.0), ("scale", None), ("enable_gqa", False))


def _constant_ancestors(mask: fx.Node) -> list[fx.Node] | None:
    """``mask`` and every node it is computed from, or ``None`` when one is a placeholder
    (an input, parameter or buffer) or anything but a call or a constant."""
    seen: set[fx.Node] = set()
    stack = [mask]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op not in ("call_function", "get_attr"):
            return None
        stack.extend(n.all_input_nodes)
    return [n for n in mask.graph.nodes if n in seen]


def _causal_mask_nodes(gm: fx.GraphModule, mask: fx.Node, query: fx.Node,
                       key: fx.Node) -> list[fx.Node] | None:
    """The nodes ``mask`` is computed from (itself last) when it is a constant causal mask
    for this query and key, else ``None``."""
    nodes = _constant_ancestors(mask)
    if nodes is None:
        return None
    for n in nodes:
        v = n.meta.get("val")
        if not isinstance(v, torch.Tensor) or v.numel() > MAX_ELEMENTS:
            return None
    try:
        m = evaluate(gm, nodes)[nodes[-1]]
    except Exception:  # noqa: BLE001 - an op we cannot run on constants: keep the mask
        return None
    L, S = query.meta["val"].shape[-2], key.meta["val"].shape[-2]
    if not isinstance(m, torch.Tensor) or m.ndim < 2 or m.shape[-2] not in (1, L) or m.shape[-1] not in (1, S):
        return None
    causal = torch.ones(L, S, dtype=torch.bool).tril()
    if m.dtype == torch.bool:
        ok = bool((m == causal).all())
    elif m.is_floating_point():
        blocked = (m == float("-inf")) | (m <= torch.finfo(m.dtype).min / 2)
        ok = bool(((m == 0) == causal).all()) and bool(((m == 0) | blocked).all())
    else:
        ok = False
    return nodes if ok else None
