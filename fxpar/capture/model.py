"""The model side of a capture: its state by FQN, meta-device models, inputs, wrappers.

Contract: nothing here reads or edits a graph. These helpers answer what both frontends
(:mod:`fxpar.capture.export`, :mod:`fxpar.capture.symbolic`) and :func:`fxpar.capture.capture`
need to know about the ``nn.Module`` itself, without modifying it:

* :func:`canonical_names`: every parameter/buffer FQN mapped to the name
  ``named_parameters()`` gives its tensor (the first one), and the other names of tied tensors
  (GPT-2's ``lm_head.weight`` is ``transformer.wte.weight``);
* :func:`unique_state`: parameters then buffers, each tensor once;
* :func:`param_info_from_tensor`: a :class:`~fxpar.ir.ParamInfo` read from the module;
* :func:`on_meta`: whether the model lives on the meta device (its inputs are then moved to
  ``meta`` too, fake propagation refuses to mix devices);
* :func:`unalias_inputs`: a tensor passed twice (``labels=input_ids``) is cloned once, so the
  captured graph keeps two distinct placeholders;
* :class:`WithLoss`: model + loss function as one module, so the loss is captured with it;
* :func:`frozen_params`: parameters temporarily not requiring grad (inference captures).

Example (tied weights: one tensor, two names)::

    >>> import torch
    >>> m = torch.nn.Sequential(torch.nn.Embedding(4, 2), torch.nn.Linear(2, 4, bias=False))
    >>> m[1].weight = m[0].weight
    >>> canonical_names(m)
    ({'0.weight': '0.weight', '1.weight': '0.weight'}, {'0.weight': ['1.weight']})
    >>> [name for name, _ in unique_state(m)]
    ['0.weight']
    >>> param_info_from_tensor("0.weight", m[0].weight, m, None, {"0.weight": ["1.weight"]}).aliases
    ('1.weight',)
"""

from __future__ import annotations

import contextlib
import itertools
from collections import defaultdict
from collections.abc import Iterator, Mapping

import torch
import torch.utils._pytree as pytree

from fxpar.ir import ParamInfo

__all__ = ["WithLoss", "frozen_params", "canonical_names", "unique_state",
           "param_info_from_tensor", "on_meta", "unalias_inputs"]


def unalias_inputs(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Clone a tensor passed twice (``labels=input_ids``): export would bind both placeholders to
    one fake tensor and the graph would read the wrong one when they differ at run time."""
    seen: set[int] = set()

    def fresh(t: torch.Tensor) -> torch.Tensor:
        if id(t) in seen:
            return t.clone()
        seen.add(id(t))
        return t

    return pytree.tree_map_only(torch.Tensor, fresh, (args, kwargs))


def on_meta(model: torch.nn.Module) -> bool:
    """Whether the model's first parameter (or buffer) is on the meta device."""
    t = next(itertools.chain(model.parameters(), model.buffers()), None)
    return t is not None and t.is_meta


def unique_state(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Parameters then buffers, deduplicated by identity like ``named_parameters()``."""
    seen: set[int] = set()
    for name, t in itertools.chain(model.named_parameters(), model.named_buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            yield name, t


def canonical_names(model: torch.nn.Module) -> tuple[dict[str, str], dict[str, list[str]]]:
    """``{every FQN: canonical FQN}`` (first name of each tensor) and ``{canonical: aliases}``."""
    first: dict[int, str] = {}
    canon: dict[str, str] = {}
    aliases: dict[str, list[str]] = defaultdict(list)
    for name, t in itertools.chain(model.named_parameters(remove_duplicate=False),
                                   model.named_buffers(remove_duplicate=False)):
        c = first.setdefault(id(t), name)
        canon[name] = c
        if c != name:
            aliases[c].append(name)
    return canon, dict(aliases)


def param_info_from_tensor(fqn: str, t: torch.Tensor, model: torch.nn.Module,
                           node_name: str | None, aliases: Mapping[str, list[str]]) -> ParamInfo:
    """The :class:`~fxpar.ir.ParamInfo` of ``model``'s tensor ``t`` named ``fqn``, held by the
    graph node ``node_name`` (``None``: no node uses it)."""
    is_param = isinstance(t, torch.nn.Parameter)
    persistent = True
    if not is_param:
        owner, _, leaf = fqn.rpartition(".")
        mod = model.get_submodule(owner) if owner else model
        persistent = leaf not in mod._non_persistent_buffers_set
    return ParamInfo(fqn=fqn, kind="param" if is_param else "buffer", shape=tuple(t.shape),
                     dtype=t.dtype, node_name=node_name,
                     requires_grad=bool(is_param and t.requires_grad), persistent=persistent,
                     aliases=tuple(aliases.get(fqn, ())))


class WithLoss(torch.nn.Module):
    """``loss_fn(model(*args[:n_inputs], **kwargs), *args[n_inputs:])`` as one module, so the
    loss is part of the captured graph (its parameters are ``model.<fqn>``); ``n_targets``
    of the trailing arguments are targets.

    >>> import torch
    >>> m = WithLoss(torch.nn.Linear(2, 1), torch.nn.functional.mse_loss, 1, 1)
    >>> m(torch.zeros(3, 2), m.model(torch.zeros(3, 2))).item()
    0.0
    """

    fxpar_wraps_loss = True
    # its public name: graphs' ``nn_module_stack`` meta names the class ``fxpar.capture.WithLoss``
    __module__ = "fxpar.capture"

    def __init__(self, model: torch.nn.Module, loss_fn, n_inputs: int,
                 n_targets: int = 0) -> None:
        super().__init__()
        self.model, self.loss_fn = model, loss_fn
        self.n_inputs, self.n_targets = n_inputs, n_targets

    def forward(self, *args, **kwargs):
        return self.loss_fn(self.model(*args[:self.n_inputs], **kwargs), *args[self.n_inputs:])


@contextlib.contextmanager
def frozen_params(model: torch.nn.Module) -> Iterator[None]:
    """Parameters temporarily not requiring grad (restored on exit, also on error): an
    inference capture plans the forward only.

    >>> lin = torch.nn.Linear(2, 2)
    >>> with frozen_params(lin):
    ...     lin.weight.requires_grad
    False
    >>> lin.weight.requires_grad
    True
    """
    flags = {}
    try:
        for p in model.parameters():
            flags[p] = p.requires_grad
            p.requires_grad_(False)
        yield
    finally:
        for p, f in flags.items():
            p.requires_grad_(f)
