"""Running a captured graph: the single-device reference, and a call's flat inputs.

Contract: :func:`run_captured` runs a capture (any frontend) on real tensors with a model's
parameters and buffers bound by FQN and returns the model's own output structure (e.g. a
``ModelOutput``), so it compares with ``model(*args, **kwargs)``; a functionalized
(``decompose=True``) graph's buffer and input mutations are written back as eager mode would.
:func:`flatten_inputs` turns a call's ``(args, kwargs)`` into the flat user inputs of an
exported graph, in the order of its ``INPUT_TREE`` (the runtime feeds rank graphs this way).

Example::

    >>> import torch
    >>> from fxpar.capture import capture
    >>> lin = torch.nn.Linear(2, 1)
    >>> gm = capture(lin, (torch.zeros(3, 2),))
    >>> x = torch.randn(3, 2)
    >>> torch.equal(run_captured(gm, lin, x), lin(x))
    True
    >>> flatten_inputs((x,), {}, gm.meta[ir.INPUT_TREE])[0] is x
    True
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from fxpar import ir

__all__ = ["run_captured", "flatten_inputs"]


def run_captured(gm: fx.GraphModule, model: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """Run a captured graph on real tensors with ``model``'s parameters and buffers bound by FQN.

    Returns the output in the model's own structure (e.g. a ``ModelOutput``), so it can be
    compared with ``model(*args, **kwargs)``; buffer mutations of a functionalized
    (``decompose=True``) graph are written back into ``model``'s buffers. The reference
    single-device execution of a capture, used by numerics tests.
    """
    state = dict(itertools.chain(model.named_parameters(remove_duplicate=False),
                                 model.named_buffers(remove_duplicate=False)))
    if gm.meta.get(ir.FRONTEND) == "symbolic_trace":
        # The graph module shares the traced model's submodules; swap in ``model``'s tensors
        # (same FQNs) so both frontends run on the weights passed here.
        own = itertools.chain(gm.named_parameters(remove_duplicate=False),
                              gm.named_buffers(remove_duplicate=False))
        bound = {name: state[name] for name, _ in own if name in state}
        return torch.func.functional_call(gm, bound, args, kwargs)
    flat_params = [state[n.meta[ir.PARAM].fqn] for n in gm.graph.find_nodes(op="placeholder")
                   if ir.PARAM in n.meta]
    in_spec = gm.meta[ir.INPUT_TREE]
    flat_inputs = flatten_inputs(args, kwargs, in_spec)
    flat_out = gm(*flat_params, *flat_inputs)
    by_input = {i.name: x for i, x in zip(ir.user_inputs(gm), flat_inputs, strict=True)}
    user: list[Any] = []
    for info, value in zip(ir.outputs(gm), flat_out, strict=True):
        if info.kind == "user":
            user.append(value)
        else:
            # Write-backs of a functionalized graph, through .data: they must not bump the
            # version counter autograd checks (the functional batch-norm saved the old buffer),
            # just as eager batch-norm's in-place update does not.
            dst = state[info.target] if info.kind == "buffer_mutation" else by_input[info.target]
            dst.data.copy_(value)
    return pytree.tree_unflatten(user, gm.meta[ir.OUTPUT_TREE])


def flatten_inputs(args: tuple, kwargs: dict, in_spec: pytree.TreeSpec) -> list[Any]:
    """The flat user inputs of a captured graph from a call's ``(args, kwargs)``, in the order
    of ``in_spec`` (``gm.meta[ir.INPUT_TREE]``): keyword arguments follow the spec (export
    orders them by the forward signature), not the caller. Raises ``TypeError`` when the
    keywords or the structure differ from the captured ones.

    >>> spec = pytree.tree_flatten(((1, 2), {"mask": 3, "ids": 4}))[1]
    >>> flatten_inputs((10, 20), {"ids": 40, "mask": 30}, spec)
    [10, 20, 30, 40]
    """
    # Export orders kwargs by the forward signature; follow the spec, not the caller's order.
    kw_keys = in_spec.child(1).context
    missing = set(kw_keys) ^ set(kwargs)
    if missing:
        raise TypeError(f"captured graph expects keyword arguments {list(kw_keys)}, "
                        f"got {list(kwargs)}")
    flat, spec = pytree.tree_flatten((tuple(args), {k: kwargs[k] for k in kw_keys}))
    if spec != in_spec:
        raise TypeError(f"inputs do not match the captured structure:\n{spec}\nvs\n{in_spec}")
    return flat
