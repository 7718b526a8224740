"""Weight sources: a model's tensors by name, and full tensors (the model's own, a state dict,
a file) cut to this rank's shard.

The model's tensors (:func:`model_entries`): one :class:`Entry` per distinct tensor, under the
first name ``named_parameters()`` / ``named_buffers()`` gives (its *canonical* name), with
every alias a tied weight has, the modules that own it and whether it is persistent (in
state dicts). Three sources of full tensors:

* the model itself (:func:`from_model`, ``source=None``): each rank copies its piece (pure
  slicing, :func:`fxpar.runtime.redistribute.distribute`);
* a mapping (:class:`MappingSource`, a state dict of full tensors), or a path
  (:func:`open_path`: ``torch.load(path, mmap=True, weights_only=True)``, or
  :class:`SafetensorsSource`, ``safetensors``' lazy ``safe_open`` for ``*.safetensors``: only
  the pages of the local slice are read, and the slice is cloned so the file can be closed):
  :func:`from_source` checks that every parameter and persistent buffer asked for is there
  (under its name or any alias of a tied weight), that every key names a tensor of the model
  and that shapes agree, else :class:`~fxpar.errors.MaterializeError` naming the key.
  Non-persistent buffers (never in state dicts) are taken from the mapping if there, else
  from the model, else left for the initializers (the ``rebuild`` it returns).

A source's ``take(key, spec, mesh_shape, coord)`` is the local piece of one tensor; on a
``Partial("sum")`` axis coordinate 0 holds the value and the others zeros.

>>> import torch
>>> from torch import nn
>>> from fxpar.spec import Spec
>>> lin = nn.Linear(6, 4)
>>> entries, alias = model_entries(lin)
>>> sorted(entries), entries["weight"].persistent
(['bias', 'weight'], True)
>>> src = MappingSource(lin.state_dict(), "state dict")
>>> src.take("weight", Spec.parse("S(0)R"), (2, 2), (1, 0)).equal(lin.weight[2:])
True
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from fxpar.errors import MaterializeError
from fxpar.runtime.redistribute import distribute
from fxpar.spec import Partial, Spec

__all__ = ["Entry", "model_entries", "set_owned", "zero_partial", "MappingSource",
           "SafetensorsSource", "open_path", "from_model", "from_source"]

#: ``{key asked for: (canonical name, spec, global shape)}``: what a rank materializes
Want = Mapping[str, tuple[str, Spec, tuple[int, ...]]]


# ---------------------------------------------------------------------------------------------
# The model's tensors: canonical names, aliases, owners
# ---------------------------------------------------------------------------------------------
@dataclass
class Entry:
    name: str                              # canonical fqn (first name named_parameters/buffers gives)
    tensor: torch.Tensor
    is_param: bool
    persistent: bool = False
    aliases: list[str] = field(default_factory=list)
    owners: list[tuple[nn.Module, str]] = field(default_factory=list)   # (module, attribute)


def model_entries(model: nn.Module) -> tuple[dict[str, Entry], dict[str, str]]:
    """``({canonical: entry}, {alias or canonical: canonical})``."""
    entries: dict[str, Entry] = {}
    by_id: dict[int, str] = {}
    for n, p in model.named_parameters():
        entries[n] = Entry(n, p, True)
        by_id[id(p)] = n
    for n, b in model.named_buffers():
        if id(b) not in by_id:
            entries[n] = Entry(n, b, False)
            by_id[id(b)] = n
    alias: dict[str, str] = {}
    for prefix, mod in model.named_modules(remove_duplicate=False):
        pre = prefix + "." if prefix else ""
        for attr, t in list(mod._parameters.items()) + list(mod._buffers.items()):
            if t is None or id(t) not in by_id:
                continue
            e = entries[by_id[id(t)]]
            fqn = pre + attr
            if fqn not in alias:
                alias[fqn] = e.name
                e.aliases.append(fqn)
            if not any(m is mod and a == attr for m, a in e.owners):
                e.owners.append((mod, attr))
            if attr in mod._buffers and attr not in mod._non_persistent_buffers_set:
                e.persistent = True
        for attr, t in mod._parameters.items():
            if t is not None and id(t) in by_id:
                entries[by_id[id(t)]].persistent = True
    return entries, alias


def set_owned(e: Entry, value: torch.Tensor) -> None:
    """Make ``value`` the tensor of every module attribute that holds ``e``."""
    for mod, attr in e.owners:
        if attr in mod._parameters:
            mod._parameters[attr] = value
        else:
            mod._buffers[attr] = value


def zero_partial(local: torch.Tensor, spec: Spec, coord: Sequence[int]) -> torch.Tensor:
    """``local``, zeroed where ``coord`` is not 0 on a ``Partial("sum")`` axis of ``spec``."""
    for axis, p in enumerate(spec):
        if isinstance(p, Partial) and p.reduce_op == "sum" and coord[axis] != 0:
            return local.zero_()
    return local


# ---------------------------------------------------------------------------------------------
# Sources of full tensors
# ---------------------------------------------------------------------------------------------
class SafetensorsSource:
    """Lazy reads from a ``.safetensors`` file: only the requested slice is read."""

    def __init__(self, path) -> None:
        from safetensors import safe_open

        self.f = safe_open(os.fspath(path), framework="pt", device="cpu")
        self._keys = list(self.f.keys())

    def keys(self):
        return self._keys

    def shape(self, key):
        return tuple(self.f.get_slice(key).get_shape())

    def take(self, key, spec, mesh_shape, coord):
        d, boxes = spec.boxes(self.shape(key), mesh_shape, coord)
        sl = self.f.get_slice(key)
        local = sl[boxes[0]].clone() if d is None else torch.cat([sl[b] for b in boxes], dim=d)
        return zero_partial(local, spec, coord)


class MappingSource:
    """A mapping of full tensors (``what`` names it in errors)."""

    def __init__(self, mapping: Mapping[str, torch.Tensor], what: str) -> None:
        self.m = mapping
        for k, v in mapping.items():
            if not isinstance(v, torch.Tensor):
                raise MaterializeError(f"{what}: key {k!r} holds a {type(v).__name__}, not a tensor")

    def keys(self):
        return list(self.m.keys())

    def shape(self, key):
        return tuple(self.m[key].shape)

    def take(self, key, spec, mesh_shape, coord):
        return distribute(self.m[key].detach(), spec, mesh_shape, coord)


def open_path(path) -> MappingSource | SafetensorsSource:
    """The source a checkpoint file holds (``*.safetensors``, or a ``torch.save``d state dict,
    possibly under ``"state_dict"`` / ``"model"``)."""
    p = os.fspath(path)
    if not os.path.exists(p):
        raise MaterializeError(f"checkpoint {p!r} does not exist")
    if p.endswith(".safetensors"):
        return SafetensorsSource(p)
    obj = torch.load(p, mmap=True, weights_only=True, map_location="cpu")
    if isinstance(obj, Mapping) and not all(isinstance(v, torch.Tensor) for v in obj.values()):
        for key in ("state_dict", "model"):
            if isinstance(obj.get(key), Mapping):
                obj = obj[key]
                break
    if not isinstance(obj, Mapping):
        raise MaterializeError(f"checkpoint {p!r} holds a {type(obj).__name__}, not a state dict")
    return MappingSource(obj, f"checkpoint {p!r}")


def from_model(entries: Mapping[str, Entry], want: Want, mesh_shape, coord,
               finish: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, torch.Tensor]:
    """``source=None``: every tensor of ``want`` sliced from the model's own (real) tensor."""
    out: dict[str, torch.Tensor] = {}
    for key, (canon, spec, _) in want.items():
        t = entries[canon].tensor
        if t.is_meta:
            raise MaterializeError(
                f"{key!r} is on the meta device and no source was given: pass source='init' "
                f"(the model's initializers), a state dict, or a checkpoint path")
        out[key] = finish(distribute(t.detach(), spec, mesh_shape, coord))
    return out


def from_source(src: MappingSource | SafetensorsSource, what: str, model_name: str,
                entries: Mapping[str, Entry], alias: Mapping[str, str], want: Want,
                mesh_shape, coord, finish: Callable[[torch.Tensor], torch.Tensor]
                ) -> tuple[dict[str, torch.Tensor], dict[str, tuple[str, Spec, tuple[int, ...]]]]:
    """``(out, rebuild)``: the tensors of ``want`` read from ``src`` (or, for a non-persistent
    buffer it lacks, from the model), and the non-persistent buffers that neither holds (the
    model's are on meta), for the initializers to rebuild."""
    out: dict[str, torch.Tensor] = {}
    keys = set(src.keys())
    extra = sorted(k for k in keys if k not in alias)
    if extra:
        raise MaterializeError(f"{what} has key(s) {extra[:5]} that are not parameters or buffers of "
                               f"{model_name}" + (f" (and {len(extra) - 5} more)" if len(extra) > 5 else ""))
    rebuild: dict[str, tuple[str, Spec, tuple[int, ...]]] = {}
    for key, (canon, spec, shape) in want.items():
        e = entries[canon]
        found = next((k for k in [key, canon, *e.aliases] if k in keys), None)
        if found is None:
            if e.persistent:
                raise MaterializeError(f"{what} has no key {key!r}" +
                                       (f" (nor its aliases {e.aliases})" if len(e.aliases) > 1 else ""))
            if not e.tensor.is_meta:
                out[key] = finish(distribute(e.tensor.detach(), spec, mesh_shape, coord))
            else:
                rebuild[key] = (canon, spec, shape)
            continue
        if src.shape(found) != shape:
            raise MaterializeError(f"{what}: {found!r} has shape {src.shape(found)}, the model's "
                                   f"{key!r} has shape {shape}")
        got = src.take(found, spec, mesh_shape, coord)
        if got.is_floating_point() and e.tensor.is_floating_point() and got.dtype != e.tensor.dtype:
            got = got.to(e.tensor.dtype)   # a checkpoint in another dtype (bf16 weights, fp32 model)
        out[key] = finish(got)
    return out, rebuild
