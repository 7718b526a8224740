"""Distributed checkpoints on ``torch.distributed.checkpoint`` (DCP): saved under one plan,
loaded under any other plan, world size, or into a plain ``nn.Module`` + ``torch.optim``.

Layout (the keys ``torch.distributed.checkpoint.state_dict`` uses, by the user model's FQNs)::

    {"model": {fqn: DTensor},                                   # parameters, persistent buffers
     "optim": {"state": {fqn: {"exp_avg": DTensor, "step": tensor, ...}},
               "param_groups": [{"lr": ..., "params": [fqn, ...]}, ...]},
     "fxpar": {"rng": {...}}}                                    # the dropout RNG counters

Every tensor is a ``DTensor`` over the plan's ``DeviceMesh`` with the parameter's storage
placements (fxpar's specs ARE DTensor's layouts, uneven shards included), so DCP writes each
distinct shard once (replicas deduplicated) with the metadata it needs to reshard on load: a
load under another plan asks for its own placements and DCP reads the overlapping pieces.
Optimizer states are kept by :class:`~fxpar.runtime.model_state.ModelStates` as flat chunks
of each parameter's local storage (AMSP's ``s_os``); they are gathered to the storage shape
for the checkpoint (a collective over the optimizer subgroups, at checkpoint time only) and
cut back to this rank's chunk on load. Tied aliases (GPT-2's ``lm_head.weight``) are written
under each name, as ``model.state_dict()`` lists them.

In one process (no fxpar)::

    sd = {"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(sd, checkpoint_id=path)
    model.load_state_dict(sd["model"]); set_optimizer_state_dict(model, opt, sd["optim"])
"""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

from fxpar import ir
from fxpar.errors import FxparError
from fxpar.resharding.intra import reshard_plan
from fxpar.runtime.redistribute import execute
from fxpar.spec import Shard, Spec, placement_kind

__all__ = ["save", "load"]


def _names(runner) -> tuple[str, dict[str, ir.ParamInfo]]:
    """The prefix the loss wrapper adds (:data:`fxpar.defaults.LOSS_PREFIX`, or ``""``:
    ``RankRunner.fqn_prefix``) and ``{graph fqn: ParamInfo}``."""
    return runner.fqn_prefix, ir.params(runner.program.graph)


def _plain(spec: Spec) -> Spec:
    """The layout a tensor is checkpointed in: a strided shard (a fused projection's q, k, v
    chunks per rank, :data:`fxpar.spec.Strided`) as the plain shard of its dim, one box per
    rank as DCP stores, so a checkpoint does not depend on how the projection was fused."""
    return Spec(tuple(Shard(p.dim) if placement_kind(p) == "T" else p for p in spec.placements))


def _relayout(runner, fqn: str, info, local: torch.Tensor, to_plain: bool) -> torch.Tensor:
    """``local`` moved between the runner's layout of ``fqn`` and :func:`_plain` of it
    (collective over the mesh when the layout is strided; ``local`` itself otherwise)."""
    spec = runner.specs[fqn]
    if not spec.is_strided:
        return local
    a, b = (spec, _plain(spec)) if to_plain else (_plain(spec), spec)
    plan = reshard_plan(a, b, runner.bindings.mesh, tuple(info.shape), local.dtype)
    return execute(plan, local, runner.bindings.device_mesh)


def _dtensor(runner, local: torch.Tensor, fqn: str, info) -> DTensor:
    spec = _plain(runner.specs[fqn])
    shape = torch.Size(info.shape)
    return DTensor.from_local(local, runner.bindings.device_mesh, list(spec.placements),
                              run_check=False, shape=shape, stride=torch.empty(shape, device="meta").stride())


def _state(runner, optim: bool, fill: bool) -> dict:
    """The DCP state dict of this rank: current values (``fill``) or empty local tensors of
    this plan's layout for DCP to load into."""
    pre, infos = _names(runner)
    model: dict[str, DTensor] = {}
    for fqn, t in runner.state.items():
        info = infos[fqn]
        if info.kind == "buffer" and not info.persistent:
            continue
        local = _relayout(runner, fqn, info, t.detach(), True) if fill else _empty(runner, fqn, info, t)
        for name in (fqn, *info.aliases):
            model[name.removeprefix(pre)] = _dtensor(runner, local, fqn, info)
    out = {"model": model, "fxpar": {"rng": runner.tracker.state_dict()}}
    if optim and runner.states is not None:
        st, groups = runner.states.optimizer_state()
        state = {}
        for fqn, entries in st.items():
            state[fqn.removeprefix(pre)] = {
                k: _dtensor(runner, _relayout(runner, fqn, infos[fqn], v, True) if fill
                            else _empty(runner, fqn, infos[fqn], v), fqn, infos[fqn])
                if torch.is_tensor(v) and v.ndim else v for k, v in entries.items()}
        out["optim"] = {"state": state,
                        "param_groups": [{**g, "params": [f.removeprefix(pre) for f in g["params"]]}
                                         for g in groups]}
    return out


def _empty(runner, fqn: str, info, like: torch.Tensor, dtype=None) -> torch.Tensor:
    """An empty local tensor of ``fqn``'s checkpoint layout (:func:`_plain`) for DCP to fill."""
    if not runner.specs[fqn].is_strided:
        return torch.empty(like.shape, dtype=dtype or like.dtype, device=like.device)
    b = runner.bindings
    shape = _plain(runner.specs[fqn]).local_shape(tuple(info.shape), tuple(b.mesh.shape), tuple(b.coord))
    return torch.empty(shape, dtype=dtype or like.dtype, device=like.device)


def save(runner, path) -> None:
    """Write this rank's shards of parameters, buffers and optimizer state (collective)."""
    dcp.save(_state(runner, optim=True, fill=True), checkpoint_id=str(path))


def load(runner, path) -> None:
    """Read a checkpoint saved under any plan into this runner's layout (collective)."""
    meta = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    pre, infos = _names(runner)
    sd = _state(runner, optim=False, fill=False)
    missing = [k for k in sd["model"] if f"model.{k}" not in meta]
    if missing:
        raise FxparError(f"checkpoint {path}: no entry for parameters/buffers {missing[:5]} "
                         "(a checkpoint of another model?)")
    optim_state = {}
    if runner.states is not None and any(k.startswith("optim.state.") for k in meta):
        for fqn in (f for f, t in runner.state.items() if t.requires_grad):
            user = fqn.removeprefix(pre)
            head = f"optim.state.{user}."
            names = [k[len(head):] for k in meta if k.startswith(head) and "." not in k[len(head):]]
            local = _empty(runner, fqn, infos[fqn], runner.state[fqn], torch.float32)
            optim_state[user] = {
                n: _dtensor(runner, torch.empty_like(local), fqn, infos[fqn])
                if len(getattr(meta[head + n], "size", ())) else torch.zeros((), dtype=torch.float32)
                for n in names}
        groups: dict[int, dict] = {}  # DCP flattened the list of groups: rebuild its slots
        for k in meta:
            if k.startswith("optim.param_groups."):
                i, _, name = k[len("optim.param_groups."):].partition(".")
                groups.setdefault(int(i), {})[name] = None
        sd["optim"] = {"state": optim_state, "param_groups": [groups[i] for i in sorted(groups)]}
    dcp.load(sd, checkpoint_id=str(path))
    with torch.no_grad():
        for fqn, t in runner.state.items():
            key = fqn.removeprefix(pre)
            if key in sd["model"]:
                t.copy_(_relayout(runner, fqn, infos[fqn], sd["model"][key].to_local(), False))
    runner.tracker.load_state_dict(sd["fxpar"]["rng"])
    if optim_state:
        runner.states.load_optimizer_state(
            {pre + f: {n: _relayout(runner, pre + f, infos[pre + f], v.to_local(), False)
                       if isinstance(v, DTensor) else v
                       for n, v in st.items()}
             for f, st in optim_state.items()},
            [{**g, "params": [pre + f for f in g["params"]]} for g in sd["optim"]["param_groups"]])
