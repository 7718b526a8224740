r"""Layers of a captured graph: which layer a node belongs to, and which layers are copies of
one repeated block. Imported by the planner (tie groups, ``NodePlan.layer``), its baselines
(per-block pins, AxoNN's layer count) and the passes (prefetch units); imports only
:mod:`fxpar.ir`.

* :func:`layer_of`: the innermost module FQN ending in an integer (``blocks.0``,
  ``model.layers.17``: a *repeated layer*), else the top-level module (``fc1``), else
  ``(params)`` / ``(inputs)`` / ``(top)``. A parameter's layer comes from its FQN, any other
  node's from ``meta["nn_module_stack"]``.
* :func:`node_layers`: every node's layer as recomputation owns it: :func:`layer_of`, and a
  ``fxpar.wait``/``fxpar.redistribute`` the passes inserted (no module of its own) that of its
  first user (the runtime's :class:`~fxpar.runtime.recompute.Recompute` and the memory model's
  :func:`~fxpar.cost.memory.recompute_memory` cut regions by it).
* :func:`repeated_copies`: the copies of each repeated block, ``{template: [(layer, node
  indices), ...]}`` (``"blocks" -> [("blocks.0", [...]), ("blocks.1", [...])]``) in copy order.
* :func:`template_fqn`: a parameter FQN with its block indices wildcarded, so every copy's
  ``blocks.3.attn.weight`` reads ``blocks.#.attn.weight``.

>>> import torch, fxpar
>>> from examples.models import GPT
>>> gm = fxpar.capture(GPT(vocab=32, d_model=16, n_heads=2, n_layers=2, seq_len=8),
...                    (torch.randint(0, 32, (2, 8)),))
>>> nodes = list(gm.graph.nodes)
>>> sorted({layer_of(n) for n in nodes})[:4]
['(inputs)', '(top)', 'blocks.0', 'blocks.1']
>>> [(t, [lay for lay, _ in c]) for t, c in repeated_copies(nodes).items()]
[('blocks', ['blocks.0', 'blocks.1'])]
>>> template_fqn("blocks.1.attn.qkv.weight"), split_repeat("model.layers.17")
('blocks.#.attn.qkv.weight', ('model.layers', 17))
"""

from __future__ import annotations

import functools
import re
from collections import defaultdict
from collections.abc import Sequence

import torch.fx as fx

from fxpar import ir

__all__ = ["layer_of", "node_layers", "repeated_copies", "split_repeat", "template_fqn",
           "wait_or_redistribute"]

#: ``<template>.<copy index>``: a repeated layer's name
_REPEAT = re.compile(r"^(.*?)\.(\d+)$")


@functools.lru_cache(maxsize=65536)
def _plain_fqn(fqn: str) -> str:
    """``fqn`` without Dynamo's ``L['self']`` wrapping (a model has few distinct ones; the
    planner asks for every node of every graph it builds)."""
    fqn = re.sub(r"^L\['self'\]\.?", "", fqn)
    return fqn.replace("._modules['", ".").replace("']", "")


def _stack_fqns(node: fx.Node) -> list[str]:
    """Module FQNs of ``meta["nn_module_stack"]``, outermost first (Dynamo's ``L['self']``
    wrapping removed)."""
    st = node.meta.get(ir.NN_MODULE_STACK) or {}
    out = [_plain_fqn(v[0] if isinstance(v, tuple) else str(v)) for v in st.values()]
    return [f for f in out if f]


def _repeat_of(fqns: Sequence[str]) -> str | None:
    """Innermost module FQN that is ``<prefix>.<int>`` (a repeated layer), else None."""
    for f in reversed(fqns):
        parts = f.split(".")
        for k in range(len(parts) - 1, 0, -1):
            if parts[k].isdigit():
                return ".".join(parts[:k + 1])
    return None


def layer_of(node: fx.Node) -> str:
    """The layer a node belongs to: its repeated block (``blocks.0``), else its top-level
    module (``fc1``), else ``(params)``/``(inputs)``/``(top)``."""
    info = node.meta.get(ir.PARAM)
    if info is not None:
        fqns = [info.fqn.rsplit(".", 1)[0]] if "." in info.fqn else []
    else:
        fqns = _stack_fqns(node)
    rep = _repeat_of(fqns)
    if rep is not None:
        return rep
    if fqns:
        return fqns[0].split(".")[0]
    if node.op == "placeholder":
        return "(params)" if info is not None else "(inputs)"
    return "(top)"


def wait_or_redistribute(n: fx.Node) -> str | None:
    """``"wait"`` or ``"redistribute"`` for a node of those fxpar communication ops, else
    ``None`` (by name: this module sits below the runtime that defines them)."""
    t = n.target
    name = getattr(t, "_opname", None)
    ok = n.op == "call_function" and getattr(t, "namespace", None) == "fxpar"
    return name if ok and name in ("wait", "redistribute") else None


def node_layers(gm: fx.GraphModule) -> dict[fx.Node, str]:
    """The layer of every node of ``gm`` for recomputation: :func:`layer_of`, and for a
    ``wait``/``redistribute`` without a module, the layer of its first user (a chain of such
    nodes takes its last user's): a layer's region starts with the waits of its own gathered
    parameters and input, so recomputing it gathers them again rather than keeping them."""
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    lay = {n: layer_of(n) for n in nodes}
    for n in reversed(nodes):  # users first
        if n.users and not is_layer(lay[n]) and wait_or_redistribute(n):
            lay[n] = lay[min(n.users, key=pos.get)]
    return lay


def is_layer(name: str) -> bool:
    """Whether ``name`` (a :func:`layer_of` result) is a layer the runtime can recompute: a
    module, not one of the pseudo layers ``(top)``, ``(params)``, ``(inputs)``.

    >>> is_layer("blocks.0"), is_layer("(top)")
    (True, False)
    """
    return bool(name) and not name.startswith("(")


def split_repeat(layer: str) -> tuple[str, int] | None:
    """``(template, copy index)`` of a repeated layer (``"blocks.3"`` → ``("blocks", 3)``),
    else ``None``."""
    m = _REPEAT.match(layer)
    return (m.group(1), int(m.group(2))) if m else None


def repeated_copies(nodes: Sequence[fx.Node], layers: Sequence[str] | None = None
                    ) -> dict[str, list[tuple[str, list[int]]]]:
    """``{template: [(layer, indices into nodes), ...]}`` for every repeated layer, templates
    sorted, copies by their integer index, indices in ``nodes`` order (``layers[i]``:
    :func:`layer_of` of ``nodes[i]``, computed when not given). Copies are candidates only:
    whether two copies are the same block (same node sequence) is the caller's test."""
    copies: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(list))
    for i, n in enumerate(nodes):
        lay = layers[i] if layers is not None else layer_of(n)
        m = _REPEAT.match(lay)
        if m:
            copies[m.group(1)][lay].append(i)
    return {t: [(lay, copies[t][lay]) for lay in
                sorted(copies[t], key=lambda s: int(_REPEAT.match(s).group(2)))]
            for t in sorted(copies)}


def template_fqn(fqn: str) -> str:
    """``fqn`` with every inner integer component wildcarded: the same parameter in every copy
    of a repeated block (``"blocks.3.mlp.fc.weight"`` → ``"blocks.#.mlp.fc.weight"``)."""
    return re.sub(r"\.\d+\.", ".#.", fqn)
