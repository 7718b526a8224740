"""The ``symbolic_trace`` frontend: a plain module → a TORCH-level graph with fake-tensor meta.

Contract of :func:`symbolic_trace_graph`: ``torch.fx.symbolic_trace`` of the module, with
non-tensor arguments specialized to their example values (Python control flow on them, such as
``if targets is None``, is resolved like export resolves it), then fake-tensor propagation
fills ``meta["val"]`` on every node (real weights are fakified, never run). The graph keeps
``call_module`` nodes for leaf modules (``nn.Linear``) and ``call_function`` nodes on
``torch``/``operator`` functions; a parameter or buffer used directly is a ``get_attr`` node
with ``meta[PARAM]``, one used inside a leaf module is listed by the ``call_module`` node's
``meta[MODULE_PARAMS]`` (canonical FQNs). Placeholders mirror the forward's signature (each
with ``meta[INPUT]``) and the graph returns the module's own output structure
(``OUTPUTS`` empty, no ``INPUT_TREE``/``OUTPUT_TREE``). ``forward(*args)``/``**kwargs`` and
tensors nested in containers are refused with :class:`~fxpar.errors.CaptureError`.

Example::

    >>> import torch
    >>> from examples.models import MLP
    >>> gm = symbolic_trace_graph(MLP(8, 16, 4), (torch.randn(2, 8),), {})
    >>> [(n.op, str(n.target)) for n in gm.graph.nodes]  # doctest: +NORMALIZE_WHITESPACE
    [('placeholder', 'x'), ('call_module', 'fc1'), ('call_function', '<built-in function gelu>'),
     ('call_module', 'fc2'), ('output', 'output')]
    >>> gm.graph.find_nodes(op="call_module")[0].meta[ir.MODULE_PARAMS]
    ('fc1.weight', 'fc1.bias')
    >>> gm.graph.find_nodes(op="output")[0].meta[ir.VAL].shape
    torch.Size([2, 4])
"""

from __future__ import annotations

import inspect
import itertools
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.fx.node import map_arg

from fxpar import ir
from fxpar.capture.model import canonical_names, param_info_from_tensor, unique_state
from fxpar.errors import CaptureError
from fxpar.ir import InputInfo, ParamInfo

__all__ = ["symbolic_trace_graph"]


def symbolic_trace_graph(model: torch.nn.Module, args: tuple, kwargs: dict) -> fx.GraphModule:
    """``model(*args, **kwargs)`` traced by ``torch.fx.symbolic_trace`` with fake-tensor meta,
    as the module docstring says."""
    values = _bound_arguments(model, args, kwargs)
    # Non-tensor arguments are specialized to their example values, so Python control flow on
    # them (``if targets is None``) is resolved like export resolves it.
    concrete = {k: v for k, v in values.items() if not isinstance(v, torch.Tensor)}
    gm = fx.symbolic_trace(model, concrete_args=concrete or None)
    _propagate_fake(gm, values)

    canon, infos = _state_infos(gm, model)
    inputs = _input_infos(gm, values)
    for n in gm.graph.nodes:
        if n.op == "get_attr" and isinstance(n.target, str):
            if n.target in canon:
                n.meta[ir.PARAM] = infos[canon[n.target]]
            else:
                n.meta[ir.CONSTANT] = n.target
        if n.op == "output":
            n.meta[ir.VAL] = map_arg(n.args[0], lambda a: a.meta[ir.VAL])

    gm.meta[ir.PARAMS] = infos
    gm.meta[ir.INPUTS] = tuple(inputs)
    gm.meta[ir.OUTPUTS] = ()
    gm.meta[ir.INPUT_TREE] = None
    gm.meta[ir.OUTPUT_TREE] = None
    gm.meta[ir.FRONTEND] = "symbolic_trace"
    return gm


def _bound_arguments(model: torch.nn.Module, args: tuple, kwargs: dict) -> dict[str, Any]:
    """``{forward's parameter name: value}`` with defaults applied, in signature order;
    ``*args``/``**kwargs`` parameters and tensors nested in containers are refused."""
    sig = inspect.signature(model.forward)
    for p in sig.parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise CaptureError(f"forward takes {p} (symbolic_trace needs named arguments)")
    bound = sig.bind(*args, **kwargs)
    bound.apply_defaults()
    values = dict(bound.arguments)
    for name, v in values.items():
        if not isinstance(v, torch.Tensor) and any(
                isinstance(x, torch.Tensor) for x in pytree.tree_leaves(v)):
            raise CaptureError(f"argument {name!r} nests tensors in a container "
                               "(symbolic_trace takes tensors or constants)")
    return values


def _propagate_fake(gm: fx.GraphModule, values: dict[str, Any]) -> None:
    """Fill ``meta["val"]`` by fake-tensor propagation of ``values`` (real weights fakified)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    class _Prop(FakeTensorProp):
        def run_node(self, n: fx.Node) -> Any:
            result = super().run_node(n)
            if ir.VAL not in n.meta:  # FakeTensorProp keeps only tensors/numbers; keep None,
                n.meta[ir.VAL] = result  # torch.device, ... as the Python value
            return result

    mode = FakeTensorMode(allow_non_fake_inputs=True)  # real weights are fakified, never run
    _Prop(gm, mode).propagate(*values.values())


def _state_infos(gm: fx.GraphModule, model: torch.nn.Module
                 ) -> tuple[dict[str, str], dict[str, ParamInfo]]:
    """``{every FQN: canonical FQN}`` and ``{canonical FQN: ParamInfo}`` of the model's state,
    each held by the first node using it (a ``get_attr`` or a ``call_module``, which gets
    ``meta[MODULE_PARAMS]``)."""
    canon, aliases = canonical_names(model)
    tensors = dict(unique_state(model))
    first_user: dict[str, str] = {}
    for n in gm.graph.nodes:
        if n.op == "get_attr" and isinstance(n.target, str) and n.target in canon:
            first_user.setdefault(canon[n.target], n.name)
        elif n.op == "call_module":
            sub = model.get_submodule(n.target)
            fqns = dict.fromkeys(
                canon[f"{n.target}.{name}"] for name, _ in itertools.chain(
                    sub.named_parameters(remove_duplicate=False),
                    sub.named_buffers(remove_duplicate=False)))
            n.meta[ir.MODULE_PARAMS] = tuple(fqns)
            for f in fqns:
                first_user.setdefault(f, n.name)
    infos = {fqn: param_info_from_tensor(fqn, t, model, first_user.get(fqn), aliases)
             for fqn, t in tensors.items()}
    return canon, infos


def _input_infos(gm: fx.GraphModule, values: dict[str, Any]) -> list[InputInfo]:
    """One :class:`InputInfo` per placeholder (``meta[INPUT]``), named as ``forward``'s
    parameter; a placeholder propagation left without a value gets its example value."""
    inputs: list[InputInfo] = []
    placeholders = gm.graph.find_nodes(op="placeholder")
    for n, (name, v) in zip(placeholders, values.items(), strict=True):
        if ir.VAL not in n.meta:  # FakeTensorProp skips None-valued nodes
            n.meta[ir.VAL] = v
        tv = n.meta[ir.VAL]
        is_t = isinstance(tv, torch.Tensor)
        info = InputInfo(name=name, path=name, node_name=n.name,
                         shape=tuple(int(s) for s in tv.shape) if is_t else None,
                         dtype=tv.dtype if is_t else None, value=None if is_t else v)
        n.meta[ir.INPUT] = info
        inputs.append(info)
    return inputs
