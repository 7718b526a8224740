"""Program: a plan turned into per-rank GraphModules, and the runner that trains them.

``fxpar.compile(model, cluster, ...)`` returns a :class:`Program`: the :class:`~fxpar.Plan`,
the captured graph, and (lazily) the distributed graph after the global passes
(:data:`fxpar.pipeline.GLOBAL_PASSES`). ``program.rank_graph(r)`` runs the per-rank passes
for rank ``r``. Under ``torchrun`` (a process group initialized), ``program.runner()`` builds
this rank's :class:`Runner`:

1. all ranks exchange the plan hash, then check the world size against the mesh: a mismatch
   raises :class:`PlanError` on every rank before any collective of the program runs;
2. materializes only this rank's shards of parameters and buffers
   (:func:`fxpar.runtime.materialize.local_state`: from the model's real tensors, a state
   dict / checkpoint path, or ``"init"`` on a meta model);
3. hands every trainable parameter to :class:`fxpar.runtime.model_state.ModelStates` with its
   replica group (the mesh axes over which its gradient is a partial sum) and the AMSP factors
   ``s_g``/``s_os``; the gradient of each parameter use goes there (asynchronous, bucketed);
4. ``runner.step(*batch)`` slices this rank's piece of the global batch (or takes a local batch
   with ``local_batch=True``), runs forward and backward, reduces gradients, steps the
   optimizer on local shards and returns the loss (the same value on every rank).

``Program.save(path)`` writes the plan with the model's parameter signature and the example
input shapes; ``fxpar.load(path, model)`` re-captures the model from those shapes and checks
the signature, so a plan file from another model is an error.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from fxpar import ir
from fxpar.errors import CaptureError, FxparError, PlanError
from fxpar.mesh import Mesh
from fxpar.pipeline import GLOBAL_PASSES, RANK_PASSES, PassContext, run_passes
from fxpar.plan_data import Plan

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
            self._ranks[key] = run_passes(_copy(self.distributed_graph), ctx, RANK_PASSES)
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


# ---------------------------------------------------------------------------------------------
# runner
# ---------------------------------------------------------------------------------------------
def replica_group(mesh: Mesh, axes: Sequence[str], rank: int):
    """The :class:`ReplicaGroup` of ``rank`` over mesh ``axes`` (``None`` if no axes)."""
    from fxpar.runtime.model_state import ReplicaGroup

    if not axes:
        return None
    arr = np.asarray(mesh.devices).reshape(mesh.shape)
    idx = [mesh.axis_names.index(a) for a in axes]
    rest = [i for i in range(mesh.ndim) if i not in idx]
    groups = arr.transpose(rest + idx).reshape(-1, int(np.prod([mesh.shape[i] for i in idx])))
    all_ = tuple(tuple(int(x) for x in g) for g in groups)
    mine = next(g for g in all_ if rank in g)
    return ReplicaGroup("+".join(axes), mine, all_)


class Runner:
    """One rank's executable program (module docstring); build with :meth:`Program.runner`."""

    def __init__(self, program: Program, weights=None, *, s_g=1, s_os=1, seed=0,
                 local_batch=False, device=None, bucket_bytes=25 * 2**20,
                 regather=True) -> None:
        import torch.distributed as dist

        from fxpar.runtime.comm import CollectiveStart, CollectiveWait, Reshard
        from fxpar.runtime.materialize import local_state
        from fxpar.runtime.model_state import ModelStates
        from fxpar.runtime.ops import ShardedDropout
        from fxpar.runtime.rng import RNGTracker

        if not dist.is_initialized():
            raise FxparError("Program.runner() needs an initialized torch.distributed process "
                             "group (run under torchrun)")
        mesh = program.mesh
        world, rank = dist.get_world_size(), dist.get_rank()
        # the hash exchange comes first, over the whole world: a check that fails on some ranks
        # only (a plan for another world size on one rank) must not leave the others hanging
        hashes: list = [None] * world
        dist.all_gather_object(hashes, program.plan.hash)
        if len(set(hashes)) != 1:
            bad = {r: h[:12] for r, h in enumerate(hashes)}
            raise PlanError(f"ranks hold different plans (plan hash by rank: {bad}); every rank "
                            "must compute or load the same plan")
        if world != mesh.size:
            raise PlanError(f"the plan is for {mesh.size} ranks ({mesh!r}) but the world has "
                            f"{world} ranks")
        self.program, self.rank, self.mesh = program, rank, mesh
        self.coord = mesh.coord(rank)
        self.device = device or "cpu"
        self.local_batch = local_batch
        self.regather, self.regathers = regather, 0
        self._inflight: list = []
        self._buckets: dict[tuple, list] = {}
        gm = program.rank_graph(rank, self.device)
        self.gm = gm
        # parameters and buffers: this rank's shards only
        holders = [n for n in gm.graph.find_nodes(op="placeholder") if ir.PARAM in n.meta]
        self.inputs = [n for n in gm.graph.find_nodes(op="placeholder") if ir.INPUT in n.meta]
        layouts = {n.meta[ir.PARAM].fqn: (n.meta[ir.SPECS][0], n.meta[ir.PARAM].shape)
                   for n in holders}
        #: storage spec of every parameter and buffer (its local shard's layout)
        self.specs = {f: spec for f, (spec, _) in layouts.items()}
        # a loss_fn wrapper holds the model as ``model.``: materialize from the user's model
        model, pre = program.model, ""
        if getattr(model, "fxpar_wraps_loss", False):
            model, pre = model.model, "model."
        local = local_state(model, {f.removeprefix(pre): v for f, v in layouts.items()},
                            mesh.shape, self.coord, source=weights, seed=seed)
        local = {pre + f: t for f, t in local.items()}
        self.state: dict[str, torch.Tensor] = {}
        for n in holders:
            info = n.meta[ir.PARAM]
            t = local[info.fqn].to(self.device)
            trainable = program.training and info.kind == "param" and info.requires_grad
            self.state[info.fqn] = t.requires_grad_(True) if trainable else t
        self._order = [n.meta[ir.PARAM].fqn for n in holders]
        self.states = None
        if program.training:
            if program.optimizer is None:
                raise FxparError("training needs an optimizer: fxpar.compile(..., optimizer="
                                 "lambda params: torch.optim.AdamW(params, lr=...))")
            replica = gm.meta.get(ir.REPLICA_AXES, {})
            params = {f: t for f, t in self.state.items() if t.requires_grad}
            groups = {f: replica_group(mesh, replica.get(f, ()), rank) for f in params}
            self.states = ModelStates(params, groups, program.optimizer, s_g=s_g, s_os=s_os,
                                      bucket_bytes=bucket_bytes)
            # A use through a communication node sends its gradient to the sink; the other
            # uses accumulate on the leaf, whose post-accumulate hook sends the sum (once).
            uses = dict.fromkeys(params, 0)
            for n in holders:
                f = n.meta[ir.PARAM].fqn
                if f not in params:
                    continue
                direct = False
                for u in n.users:
                    mod = gm.get_submodule(u.target) if u.op == "call_module" else None
                    if isinstance(mod, (CollectiveWait, Reshard)) and mod.edge.param == f:
                        mod.edge.sink = self._sink
                        uses[f] += 1
                    elif not (u.op == "call_module" and isinstance(mod, CollectiveStart)):
                        direct = True
                if direct:
                    params[f].register_post_accumulate_grad_hook(self._leaf_hook(f))
                    uses[f] += 1
            for f, k in uses.items():
                if k:
                    self.states.expect(f, k)
        self.tracker = RNGTracker(seed)
        for mod in gm.modules():
            if isinstance(mod, ShardedDropout):
                mod.tracker = self.tracker

    def _sink(self, edge, grad: torch.Tensor) -> None:
        """Gradient of one parameter use (``Edge.backward``): no plan → straight to the model
        states; else its collectives are launched now, coalesced with the rest of its bucket
        once the whole bucket has arrived, and finished after backward. Launch order follows
        autograd's order, the same on every rank."""
        if not edge.bwd.steps:
            self.states.add_grad(edge.param, grad)
            return
        key = edge.bucket or (edge.name,)
        got = self._buckets.setdefault(key, [])
        got.append((edge, grad))
        if len(got) == len(key):
            self._launch(key)

    def _launch(self, key) -> None:
        from fxpar.runtime.reshard import start

        got = self._buckets.pop(key)
        pending = start([e.bwd for e, _ in got], [g for _, g in got], got[0][0].mesh)
        self._inflight.append(([e.param for e, _ in got], pending))

    def _finish_inflight(self) -> None:
        from fxpar.runtime.reshard import finish

        for key in sorted(self._buckets):  # buckets some of whose gradients never came
            self._launch(key)
        for fqns, pending in self._inflight:
            for fqn, g in zip(fqns, finish(pending)):
                self.states.add_grad(fqn, g)
        self._inflight.clear()

    def _leaf_hook(self, fqn: str):
        def hook(p: torch.Tensor) -> None:
            self.states.add_grad(fqn, p.grad)
            p.grad = None
        return hook

    # -- batches ---------------------------------------------------------------------------
    def _local_inputs(self, args, kwargs) -> list:
        from fxpar.capture import flatten_inputs as _flatten_inputs
        from fxpar.runtime.reshard import distribute

        flat = _flatten_inputs(tuple(args), dict(kwargs), self.gm.meta[ir.INPUT_TREE])
        out = []
        for n, x in zip(self.inputs, flat, strict=True):
            info = n.meta[ir.INPUT]
            if not info.is_tensor:
                out.append(x)
                continue
            if not isinstance(x, torch.Tensor):
                raise FxparError(f"input {info.name!r}: expected a tensor, got {type(x).__name__}")
            spec = n.meta[ir.SPECS][0]
            want = tuple(n.meta[ir.VAL].shape) if self.local_batch else tuple(info.shape)
            if tuple(x.shape) != want:
                raise FxparError(
                    f"input {info.name!r}: shape {tuple(x.shape)} but the program was compiled for "
                    f"{'local' if self.local_batch else 'global'} shape {want} (spec {spec}); "
                    "recompile for another batch shape")
            x = x if self.local_batch else distribute(x, spec, self.mesh.shape, self.coord)
            out.append(x.to(self.device))
        return out

    def forward(self, *args, **kwargs):
        """Run the local program; returns the flat local outputs (finalized: no Partial)."""
        ins = self._local_inputs(args, kwargs)
        return self.gm(*[self.state[f] for f in self._order], *ins)

    def forward_backward(self, *args, **kwargs) -> torch.Tensor:
        """Forward and backward on the batch, gradients reduced (``states.grads()`` shows
        them); no optimizer step. Calls accumulate gradients until :meth:`optimizer_step`."""
        if self.states is None:
            raise FxparError("training steps need a program compiled with training=True")
        from fxpar.runtime.comm import Regather

        with Regather() if self.regather else contextlib.nullcontext() as rg:
            out = self.forward(*args, **kwargs)
        #: gathered parameters still held between forward and backward (``regather``: 0)
        self.held_after_forward = rg.alive() if rg is not None else None
        loss = out[0] if isinstance(out, (tuple, list)) else out
        if not (isinstance(loss, torch.Tensor) and loss.ndim == 0 and loss.is_floating_point()):
            raise FxparError("the compiled model's first output is not a scalar loss; pass "
                             "loss_fn=... to fxpar.compile")
        loss.backward()
        self.regathers = rg.count if rg is not None else 0
        self._finish_inflight()
        self.states.finish_backward()
        self.tracker.next_step()
        return loss.detach()

    def optimizer_step(self) -> None:
        """Optimizer step on the local shards, parameters restored, gradients zeroed."""
        self.states.step()
        self.states.zero_grad()

    def step(self, *args, **kwargs) -> torch.Tensor:
        """One training step on the global batch ``(*args, **kwargs)`` (the same on every rank;
        with ``local_batch=True`` this rank's piece): forward, backward, gradient
        reduction, optimizer step. Returns the detached loss (the same on every rank)."""
        loss = self.forward_backward(*args, **kwargs)
        self.optimizer_step()
        return loss

    def __call__(self, *args, gather: bool = True, **kwargs):
        """Inference: the model's outputs in its own structure, gathered to their global form
        (``gather=False``: this rank's local pieces)."""
        from fxpar.reshard import reshard_plan
        from fxpar.runtime.reshard import execute

        with torch.no_grad():
            out = self.forward(*args, **kwargs)
            flat = list(out) if isinstance(out, (tuple, list)) else [out]
            if gather:
                glob = {n.name: n for n in self.program.distributed_graph.graph.nodes}
                out_node = next(iter(self.gm.graph.find_nodes(op="output")))
                for k, node in enumerate(pytree.tree_leaves(out_node.args[0])):
                    specs = node.meta.get(ir.SPECS) if isinstance(node, fx.Node) else None
                    if isinstance(flat[k], torch.Tensor) and specs and not specs[0].is_replicated:
                        shape = tuple(glob[node.name].meta[ir.VAL].shape)
                        plan = reshard_plan(specs[0], "R" * self.mesh.ndim, self.mesh, shape,
                                            flat[k].dtype)
                        flat[k] = execute(plan, flat[k], self.mesh)
        infos = ir.outputs(self.gm)
        user = [v for info, v in zip(infos, flat) if info.kind == "user"] if infos else flat
        return pytree.tree_unflatten(user, self.gm.meta[ir.OUTPUT_TREE])
