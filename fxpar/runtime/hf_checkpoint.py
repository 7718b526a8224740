"""Hugging Face checkpoints in and out, each rank reading and writing only its part (issue #28).

In: :class:`HFCheckpoint` names a directory ``save_pretrained`` wrote (``model.safetensors``, or
shards listed by ``model.safetensors.index.json``). As the ``weights`` of
``prog.runner(weights=fxpar.HFCheckpoint(path))`` (a program built on the meta device
included) or through ``runner.load_hf_checkpoint(path)``, every rank reads the slices of its
own shards with ``safetensors``' lazy slicing (a strided shard as one box per group), so no
rank materializes a tensor it does not hold. Keys are the HF model's; ``prefix`` is that
model's module path inside the compiled module (``None``: the one prefix under which every key
names a parameter or buffer, found by suffix). Tied weights are stored once (under any of their
names); a key the model lacks, a parameter the checkpoint lacks, or a shape that differs is a
:class:`~fxpar.errors.MaterializeError` naming it. A checkpoint in another dtype is cast to the
model's.

Out: :meth:`save <fxpar.runtime.rank.RankRunner.save_hf_checkpoint>` gathers each parameter
and persistent buffer over the mesh it lives on (one at a time) to one owner rank, chosen so
every rank writes about the same bytes; each rank writes what it owns to its own
``model-RRRRR-of-NNNNN.safetensors`` and global rank 0 the index. A tensor two pipeline stages
hold (tied embeddings) is written once. ``config.json`` is left to the user
(``model.config.save_pretrained(path)``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Collection
from dataclasses import dataclass

import torch

from fxpar.errors import MaterializeError
from fxpar.runtime.materialize.sources import SafetensorsSource

__all__ = ["HFCheckpoint", "HFDirSource", "save_hf"]

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"


@dataclass(frozen=True)
class HFCheckpoint:
    """A Hugging Face checkpoint directory as a weight source (module docstring)."""

    path: str | os.PathLike
    prefix: str | None = None

    def source(self, names: Collection[str]) -> HFDirSource:
        """The directory's tensors under the model's names ``names`` (its parameters and
        buffers, every alias of a tied weight)."""
        return HFDirSource(os.fspath(self.path), self.prefix, names)


class HFDirSource:
    """The tensors of an HF checkpoint directory under the model's names (``prefix`` + key);
    each file opened lazily, each read a slice (:class:`SafetensorsSource`)."""

    def __init__(self, path: str, prefix: str | None, names: Collection[str]) -> None:
        index = os.path.join(path, _INDEX)
        if os.path.exists(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        elif os.path.exists(os.path.join(path, _SINGLE)):
            weight_map = {k: _SINGLE for k in SafetensorsSource(os.path.join(path, _SINGLE)).keys()}
        else:
            raise MaterializeError(f"Hugging Face checkpoint {path!r}: neither {_SINGLE} nor {_INDEX} "
                                   "there (a save_pretrained directory with safetensors weights)")
        self.path = path
        pre = _prefix(path, prefix, list(weight_map), set(names))
        self._file = {pre + k: f for k, f in weight_map.items()}
        self._key = {pre + k: k for k in weight_map}
        self._open: dict[str, SafetensorsSource] = {}

    def _src(self, key: str) -> SafetensorsSource:
        f = self._file[key]
        if f not in self._open:
            self._open[f] = SafetensorsSource(os.path.join(self.path, f))
        return self._open[f]

    def keys(self):
        return list(self._file)

    def shape(self, key):
        return self._src(key).shape(self._key[key])

    def take(self, key, spec, mesh_shape, coord):
        return self._src(key).take(self._key[key], spec, mesh_shape, coord)


def _prefix(path: str, prefix: str | None, keys: list[str], names: set[str]) -> str:
    """``prefix``, or the one prefix that makes every key a model name (found by suffix)."""
    if prefix is not None:
        return prefix
    if not keys:
        raise MaterializeError(f"Hugging Face checkpoint {path!r} holds no tensors")
    k0 = min(keys, key=len)
    cands = {n[: len(n) - len(k0)] for n in names if n.endswith(k0) and (n == k0 or n[-len(k0) - 1] == ".")}
    fits = sorted(p for p in cands if all(p + k in names for k in keys))
    if len(fits) == 1:
        return fits[0]
    if len(fits) > 1:
        raise MaterializeError(f"Hugging Face checkpoint {path!r}: its keys name model tensors under "
                               f"several prefixes {fits}: pass prefix=")
    best = max(sorted(cands), key=lambda p: sum(p + k in names for k in keys), default="")
    missing = [k for k in keys if best + k not in names]
    raise MaterializeError(f"Hugging Face checkpoint {path!r}: key(s) {missing[:5]} name no parameter "
                           f"or buffer of the model under prefix {best!r}" +
                           (f" (and {len(missing) - 5} more)" if len(missing) > 5 else "") +
                           "; pass prefix= (the HF model's module path in the compiled module)")


def save_hf(runner, path) -> None:
    """``runner.save_hf_checkpoint(path)`` (module docstring; collective over the world)."""
    import torch.distributed as dist
    from safetensors.torch import save_file

    from fxpar.resharding.intra import reshard_plan
    from fxpar.runtime.redistribute import execute
    from fxpar.spec import Spec

    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    b = runner.bindings
    mesh, dm = b.mesh, b.device_mesh
    pre = runner.fqn_prefix
    infos = runner._infos
    nbytes = {f: torch.Size(infos[f].shape).numel() * runner.state[f].element_size() for f in runner.state
              if not (infos[f].kind == "buffer" and not infos[f].persistent)}
    # owners: the largest first (global sizes: the same on every member of the mesh), each to
    # the least-loaded device
    load = dict.fromkeys(mesh.devices, 0)
    owner = {}
    for f in sorted(nbytes, key=lambda f: (-nbytes[f], f)):
        d = min(load, key=lambda r: (load[r], r))
        owner[f] = d
        load[d] += nbytes[f]
    rank = dist.get_rank() if dist.is_initialized() else 0
    mine: dict[str, torch.Tensor] = {}
    for f in sorted(nbytes):
        spec, t = runner.specs[f], runner.state[f].detach()
        full = t
        if not spec.is_replicated:
            plan = reshard_plan(spec, Spec.replicate(len(spec)), mesh, tuple(infos[f].shape), t.dtype)
            full = execute(plan, t, dm)
        if owner[f] == rank:
            mine[f.removeprefix(pre)] = full.cpu().contiguous()
        del full
    world = dist.get_world_size() if dist.is_initialized() else 1
    owned = {k: v.numel() * v.element_size() for k, v in mine.items()}
    every = [owned]
    if dist.is_initialized():
        every = [None] * world
        dist.all_gather_object(every, owned)
    # a tensor several stages hold (tied across the pipeline) is written by the lowest rank
    first: dict[str, int] = {}
    for r, ks in enumerate(every):
        for k in ks:
            first.setdefault(k, r)
    mine = {k: v for k, v in mine.items() if first[k] == rank}
    if mine:
        save_file(mine, os.path.join(path, f"model-{rank + 1:05d}-of-{world:05d}.safetensors"),
                  metadata={"format": "pt"})
    if rank == 0:
        weight_map = {k: f"model-{r + 1:05d}-of-{world:05d}.safetensors" for k, r in sorted(first.items())}
        total = sum(every[r][k] for k, r in first.items())
        with open(os.path.join(path, _INDEX), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    if dist.is_initialized():
        dist.barrier()   # the index is there when anyone returns
