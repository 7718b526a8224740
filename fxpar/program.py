"""Program: a plan turned into per-rank GraphModules.

``fxpar.compile(model, cluster, ...)`` returns a :class:`Program`: the :class:`~fxpar.Plan`,
the captured graph, and (lazily) the distributed graph after the global passes
(:data:`fxpar.passes.lowering.GLOBAL_PASSES`). ``program.rank_graph(r)`` runs the per-rank passes
for rank ``r``. Under ``torchrun`` (a process group initialized), ``program.runner()`` builds
this rank's :class:`~fxpar.runtime.runner.Runner` (what it does, step by step, is in
:mod:`fxpar.runtime.runner`). Rank graphs are cached per rank: they hold no runtime state, so
every runner of the Program shares them.

``Program.save(path)`` writes the plan with the model's parameter signature and the example
input shapes; ``fxpar.load(path, model)`` re-captures the model from those shapes and checks
the signature, so a plan file from another model is an error.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from fxpar import ir
from fxpar.errors import CaptureError, FxparError, PlanError
from fxpar.mesh import Mesh
from fxpar.passes.infra import PassContext, run_passes
from fxpar.passes.lowering import GLOBAL_PASSES, RANK_PASSES
from fxpar.plan_data import Plan
from fxpar.runtime.runner import Runner

__all__ = ["Program", "Runner", "load", "model_signature"]


def model_signature(gm: fx.GraphModule) -> str:
    """sha256 of every parameter/buffer's FQN, shape and dtype, in order."""
    items = [(f, list(p.shape), str(p.dtype)) for f, p in ir.params(gm).items()]
    return hashlib.sha256(json.dumps(items).encode()).hexdigest()


class Program:
    """A compiled model: plan + graphs (module docstring)."""

    def __init__(self, plan: Plan, graph: fx.GraphModule, model: torch.nn.Module, *,
                 optimizer: Callable | None = None, training: bool = True,
                 prefetch: int = 1) -> None:
        if graph.meta.get(ir.FRONTEND) == "symbolic_trace":
            raise FxparError("fxpar.compile needs an ATen-level capture (torch.export); this model "
                             "was only capturable with symbolic_trace")
        self.plan, self.graph, self.model = plan, graph, model
        self.optimizer = optimizer
        self.training, self.prefetch = training, prefetch
        self.mesh = Mesh.from_devices(plan.cluster(), plan.mesh["axis_names"],
                                      np.asarray(plan.mesh["devices"]).reshape(plan.mesh["shape"]))
        self._dist: fx.GraphModule | None = None
        self._ranks: dict[tuple[int, str], fx.GraphModule] = {}
        self.timings: dict[str, float] = {}

    def explain(self) -> str:
        return self.plan.explain()

    @property
    def distributed_graph(self) -> fx.GraphModule:
        """The global graph after annotate + insert_collectives (the same for every rank)."""
        if self._dist is None:
            ctx = PassContext(self.plan, self.mesh, prefetch=self.prefetch, timings=self.timings)
            self._dist = run_passes(_copy(self.graph), ctx, GLOBAL_PASSES)
        return self._dist

    def rank_graph(self, rank: int, device: str = "cpu") -> fx.GraphModule:
        """Rank ``rank``'s GraphModule (local shapes, explicit collectives and waits)."""
        key = (rank, device)
        if key not in self._ranks:
            if rank not in self.mesh.devices:
                raise PlanError(f"rank {rank} is not in the plan's mesh {self.mesh!r}")
            ctx = PassContext(self.plan, self.mesh, coord=self.mesh.coord(rank),
                              prefetch=self.prefetch, device=device, timings=self.timings)
            self._ranks[key] = run_passes(_copy(self.distributed_graph), ctx, RANK_PASSES,
                                          already_run=[p.__name__ for p in GLOBAL_PASSES])
        return self._ranks[key]

    def runner(self, weights: Any = None, *, s_g: int = 1, s_os: int = 1, seed: int = 0,
               local_batch: bool = False, device: str | None = None,
               bucket_bytes: int = 25 * 2**20, regather: bool = True) -> Runner:
        """This rank's :class:`Runner` (collective: every rank of the mesh calls it).

        ``weights``: ``None`` (the model's own real tensors), a state dict of full tensors, a
        checkpoint path, or ``"init"`` (the model's initializers, for a model on ``meta``).
        ``s_g``/``s_os``: gradient and optimizer-state sharding factors inside each parameter's
        replica group (AMSP; ZeRO-1 = ``(1, N)``, ZeRO-2 = ``(N, N)``). ``regather``: free
        a gathered parameter after its forward use and gather it again in backward (what the
        planner prices, ZeRO-3); ``False`` keeps it for backward (more memory, less traffic).
        """
        return Runner(self, weights, s_g=s_g, s_os=s_os, seed=seed, local_batch=local_batch,
                      device=device, bucket_bytes=bucket_bytes, regather=regather)

    # -- save / load -----------------------------------------------------------------------
    def save(self, path) -> None:
        d = dict(fxpar_program=1, plan=self.plan.to_dict(), signature=model_signature(self.graph),
                 inputs=[dict(name=i.name, path=i.path, shape=list(i.shape) if i.is_tensor else None,
                              dtype=str(i.dtype).removeprefix("torch.") if i.is_tensor else None,
                              value=None if i.is_tensor else i.value)
                         for i in ir.user_inputs(self.graph)],
                 in_spec=pytree.treespec_dumps(self.graph.meta[ir.INPUT_TREE]),
                 training=self.training, prefetch=self.prefetch,
                 n_targets=getattr(self.model, "n_targets", 0))
        with open(path, "w") as f:
            json.dump(d, f)


def _copy(gm: fx.GraphModule) -> fx.GraphModule:
    g = fx.Graph()
    val_map: dict[fx.Node, fx.Node] = {}
    out = g.graph_copy(gm.graph, val_map)
    g.output(out)
    for old, new in val_map.items():
        # fx renames a copied node whose name shadows a builtin (export names nn.Sequential's
        # argument ``input``; the copy would be ``input_1``); the plan is keyed by the names
        new.name = old.name
    new = fx.GraphModule(gm, g)
    new.meta.update(gm.meta)
    return new


def load(path, model: torch.nn.Module, *, optimizer: Callable | None = None,
         loss_fn: Callable | None = None) -> Program:
    """Rebuild a :class:`Program` from :meth:`Program.save` for ``model`` (re-captured from the
    saved input shapes). Raises :class:`PlanError` if the file was made for another model."""
    from fxpar.capture import WithLoss as _WithLoss, frozen_params as _Frozen
    from fxpar.capture import capture

    with open(path) as f:
        d = json.load(f)
    if d.get("fxpar_program") != 1:
        raise PlanError(f"{path}: not an fxpar program file")
    plan = Plan.from_dict(d["plan"])
    flat = [torch.zeros(i["shape"], dtype=getattr(torch, i["dtype"])) if i["shape"] is not None
            else i["value"] for i in d["inputs"]]
    args, kwargs = pytree.tree_unflatten(flat, pytree.treespec_loads(d["in_spec"]))
    n_t = d.get("n_targets", 0)
    wrapped = _WithLoss(model, loss_fn, len(args) - n_t, n_t) if loss_fn else model
    training = d.get("training", True)
    was_training = model.training
    model.train(training)  # captured as compile() did: eval + frozen for inference plans
    try:
        with _Frozen(model) if not training else contextlib.nullcontext():
            gm = capture(wrapped, args, kwargs)
    except CaptureError as e:
        raise PlanError(f"{path}: this model does not accept the plan file's inputs "
                        f"{[i['name'] for i in d['inputs']]} (a plan made for another model?): "
                        f"{e}") from e
    finally:
        model.train(was_training)
    sig = model_signature(gm)
    if sig != d["signature"]:
        raise PlanError(f"{path}: the plan was made for another model (parameter signature "
                        f"{d['signature'][:12]}, this model {sig[:12]})")
    return Program(plan, gm, wrapped, optimizer=optimizer, training=training,
                   prefetch=d.get("prefetch", 1))
