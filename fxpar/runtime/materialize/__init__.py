"""Materialize only this rank's shards of a model's parameters and buffers.

:func:`local_state` returns ``{fqn: local tensor}`` for the parameters and buffers named in a
layout table (``fqn -> (spec, global shape)``), for one mesh coordinate, from one of four
sources:

* ``source=None``: the model holds real tensors; each rank copies its piece (pure slicing,
  :func:`fxpar.runtime.redistribute.distribute`).
* a mapping (a state dict of full tensors): the same, from the mapping. Every parameter and
  persistent buffer asked for must be there (under its name or any alias of a tied weight),
  every key must name a tensor of the model, and shapes must agree, else
  :class:`MaterializeError` naming the key. Non-persistent buffers (never in state dicts) are
  taken from the mapping if there, else from the model, else rebuilt as for ``"init"``.
* a path: ``torch.load(path, mmap=True, weights_only=True)`` (or ``safetensors``' lazy
  ``safe_open`` for ``*.safetensors``), then as for a mapping: only the pages of the local
  slice are read, and the slice is cloned so the file can be closed. (The literal string
  ``"init"`` means the next source; pass ``pathlib.Path("init")`` for a file of that name.)
* ``"init"``: the model's parameters are on the ``meta`` device; each rank builds its shards
  from the model's own initializers **without building full tensors**.

One module per job:

* :mod:`~fxpar.runtime.materialize.sources` — the model's tensors by name (canonical names,
  tied aliases, owners) and the first three sources;
* :mod:`~fxpar.runtime.materialize.init_replay` — ``"init"``: the initializers recorded on the
  meta tensors and replayed on local shapes (semantics, fallbacks and errors there);
* :mod:`~fxpar.runtime.materialize.hf` — Hugging Face's special cases (init flags, its table
  of init functions, rotary buffers computed in ``__init__``).

Tied weights appear once under the first name ``named_parameters()`` gives; layouts may use
any alias (all aliases asked for are returned; under ``"init"`` they must share the layout).
``dtype`` casts floating tensors; ``device`` places the results (default: the source's
device, CPU for ``"init"``). Results are plain contiguous tensors (no grad).

>>> import torch
>>> from torch import nn
>>> from fxpar.spec import Spec
>>> with torch.device("meta"):
...     lin = nn.Linear(6, 4)
>>> layouts = {"weight": (Spec.parse("S(0)R"), (4, 6)), "bias": (Spec.parse("RR"), (4,))}
>>> st = {c: local_state(lin, layouts, (2, 2), c, source="init", seed=0)
...       for c in [(0, 0), (0, 1), (1, 0), (1, 1)]}
>>> st[(0, 0)]["weight"].shape, st[(0, 0)]["weight"].device.type
(torch.Size([2, 6]), 'cpu')
>>> torch.equal(st[(0, 0)]["weight"], st[(0, 1)]["weight"])     # replicas agree
True
>>> torch.equal(st[(0, 0)]["weight"], st[(1, 0)]["weight"])     # shards are independent draws
False
>>> bool((st[(1, 1)]["weight"].abs() <= 6 ** -0.5).all())       # kaiming bound from the full fan_in
True
>>> full = nn.Linear(6, 4).state_dict()
>>> local_state(lin, layouts, (2, 2), (1, 0), source=full)["weight"].equal(full["weight"][2:])
True
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from fxpar.errors import MaterializeError
from fxpar.runtime.materialize.init_replay import from_init
from fxpar.runtime.materialize.sources import (MappingSource, from_model, from_source,
                                               model_entries, open_path)
from fxpar.spec import Spec, as_spec

__all__ = ["MaterializeError", "local_state"]


def local_state(model: nn.Module, layouts: Mapping[str, tuple[Spec | str, Sequence[int]]],
                mesh_shape: Sequence[int], coord: Sequence[int], *,
                source: str | os.PathLike | Mapping[str, torch.Tensor] | None = None,
                seed: int = 0, dtype: torch.dtype | None = None,
                device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
    """``{fqn: local tensor}`` for every fqn of ``layouts`` (``fqn -> (spec, global shape)``) on
    the device at mesh ``coord``; see the module docstring for the sources and semantics."""
    mesh_shape = tuple(int(s) for s in mesh_shape)
    coord = tuple(int(c) for c in coord)
    if len(coord) != len(mesh_shape):
        raise MaterializeError(f"coord {coord} does not fit mesh shape {mesh_shape}")
    entries, alias = model_entries(model)
    model_name = type(model).__name__

    # -- resolve the layout table ---------------------------------------------------------
    want: dict[str, tuple[str, Spec, tuple[int, ...]]] = {}
    for key, (spec, shape) in layouts.items():
        if key not in alias:
            raise MaterializeError(f"layouts name {key!r}, which is not a parameter or buffer of {model_name}")
        spec, shape = as_spec(spec), tuple(int(s) for s in shape)
        e = entries[alias[key]]
        if tuple(e.tensor.shape) != shape:
            raise MaterializeError(f"layouts give {key!r} the shape {shape} but the model's tensor has "
                                   f"shape {tuple(e.tensor.shape)}")
        spec.check(shape, mesh_shape)
        want[key] = (e.name, spec, shape)

    def finish(t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        if device is not None:
            t = t.to(device)
        return t.contiguous()

    with torch.no_grad():
        if source is None:
            return from_model(entries, want, mesh_shape, coord, finish)

        if isinstance(source, str) and source == "init":
            return from_init(model, entries, want, mesh_shape, coord, seed, device, finish)

        from fxpar.runtime.hf_checkpoint import HFCheckpoint

        if isinstance(source, HFCheckpoint):
            src = source.source(alias)
            what = f"Hugging Face checkpoint {os.fspath(source.path)!r}"
        elif isinstance(source, (str, os.PathLike)):
            src = open_path(source)
            what = f"checkpoint {os.fspath(source)!r}"
        elif isinstance(source, Mapping):
            src = MappingSource(source, "state dict")
            what = "the state dict"
        else:
            raise MaterializeError(f"source must be None, 'init', a state dict, a path or an HFCheckpoint, "
                                   f"not {type(source).__name__}")
        out, rebuild = from_source(src, what, model_name, entries, alias, want, mesh_shape, coord,
                                   finish)
        if rebuild:
            out.update(from_init(model, entries, rebuild, mesh_shape, coord, seed, device, finish))
        return {k: out[k] for k in want}
