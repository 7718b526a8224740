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
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from fxpar import ir
from fxpar.defaults import BUCKET_BYTES
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
                 prefetch: int = 1, stage_graphs: Sequence[fx.GraphModule] | None = None) -> None:
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
        #: pipeline programs: one sub-program per stage chunk (its plan, its graph), and the
        #: schedule the interpreter runs (``None`` for one SPMD step)
        self.stage_programs: list[Program] = []
        self.schedule = None
        if plan.stages:
            from fxpar.planner.price import schedule_of

            if stage_graphs is None or len(stage_graphs) != len(plan.stages):
                raise PlanError("a pipeline plan needs its stage chunk graphs "
                                "(fxpar.compile(..., mesh={'pp': ...}) builds them)")
            self.stage_programs = [Program(st.plan, g, model, optimizer=optimizer,
                                           training=training, prefetch=prefetch)
                                   for st, g in zip(plan.stages, stage_graphs)]
            self.schedule = schedule_of(plan)

    def explain(self) -> str:
        return self.plan.explain()

    def simulate(self):
        """The step the plan predicts (``plan.time``, the one step model's:
        :func:`fxpar.planner.price.price_plan`) as a :class:`fxpar.sim.SimResult` over the
        schedule's action lists (one SPMD step: a one-stage, one-microbatch schedule), with
        memory traced; a plan saved without its unit costs: its summed costs simulated."""
        from fxpar.planner.price import price_plan
        from fxpar.schedule import Schedule
        from fxpar.sim import simulate

        p = self.plan
        if p.config is not None and (p.units or (p.stages and p.stages[0].plan.units)):
            return price_plan(p, memory=True)[0].sim
        return simulate(Schedule.build("1f1b", stages=1, microbatches=1),
                        fwd=p.compute_fwd + sum(e.time for e in p.edges if e.direction == "fwd"),
                        bwd=p.compute_bwd + sum(e.time for e in p.edges if e.direction != "fwd"))

    def verify(self, *args, weights: Any = None, atol: float | None = None,
               rtol: float | None = None, **kwargs):
        """Run the single-process capture and this distributed program on one batch (the
        global batch, as ``runner.step`` takes it) and compare every node's forward value and
        gradient, and every parameter's reduced gradient; returns a
        :class:`fxpar.VerifyReport` (``ok``; ``first``: the first diverging node with its op,
        layer, strategy, specs and errors; ``str()``: a short table). Collective: every rank
        calls it; every rank gets the same report. ``weights`` as for :meth:`runner` (a
        ``meta`` model: ``"init"``). :mod:`fxpar.verify` says how."""
        from fxpar.verify import verify

        return verify(self, args, kwargs, weights=weights, atol=atol, rtol=rtol)

    # -- pipelines -------------------------------------------------------------------------
    def device_mesh(self):
        """The ``DeviceMesh`` of the whole mesh (made once; collective on first use)."""
        from fxpar.runtime.redistribute import as_device_mesh

        return as_device_mesh(self.mesh)

    def flat_batch(self, args, kwargs) -> list:
        """The flat user inputs of a global batch for a pipeline program: every tensor input is
        ``microbatches`` times its captured (microbatch) shape along dim 0."""
        from fxpar.capture import flatten_inputs

        flat = flatten_inputs(tuple(args), dict(kwargs), self.graph.meta[ir.INPUT_TREE])
        m = self.plan.schedule["microbatches"]
        for info, x in zip(ir.user_inputs(self.graph), flat, strict=True):
            if not info.is_tensor:
                continue
            want = (info.shape[0] * m, *info.shape[1:])
            if not isinstance(x, torch.Tensor) or tuple(x.shape) != want:
                got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
                raise FxparError(f"input {info.name!r}: got {got}, the pipeline program was "
                                 f"compiled for a global batch of shape {want} ({m} microbatches "
                                 f"of {tuple(info.shape)})")
        return flat

    def user_index(self, name: str) -> int:
        """Index of the user input placeholder ``name`` in :meth:`flat_batch`."""
        return next(i for i, info in enumerate(ir.user_inputs(self.graph)) if info.node_name == name)

    def loss_rank(self) -> int:
        """The global rank that broadcasts a pipeline step's loss (the last chunk's first)."""
        return int(self.plan.stages[-1].plan.mesh["devices"][0])

    def replica_axes(self, fqn: str, pp_rank: int | None = None) -> tuple[str, ...]:
        """The mesh axes ``fqn``'s gradient is a partial sum over, in the chunks of pipeline
        rank ``pp_rank`` (``None``: in any chunk, the axes its replica group reduces over).
        Chunks may differ: a tied embedding looked up replicated on the first stage (its
        gradient complete on every ``dp`` rank) and used batch-sharded by the LM head on the
        last (partial over ``dp``)."""
        axes: list[str] = []
        for st, sp in zip(self.plan.stages, self.stage_programs):
            if pp_rank is None or st.rank == pp_rank:
                for a in sp.distributed_graph.meta.get(ir.REPLICA_AXES, {}).get(fqn, ()):
                    if a not in axes:
                        axes.append(a)
        return tuple(axes)

    def replica_group(self, fqn: str, rank: int):
        """``fqn``'s replica group for ``rank`` over the WHOLE mesh: the axes its gradient is
        a partial sum over, and the pipeline ranks holding a copy when there are several
        (a tied embedding/LM head). Every rank computes the same partition for one key."""
        from fxpar.runtime.model_state import ReplicaGroup

        holders = sorted({st.rank for st, sp in zip(self.plan.stages, self.stage_programs)
                          if fqn in ir.params(sp.graph)})
        axes = list(self.replica_axes(fqn))
        pp = self.mesh.axis_names.index("pp")
        arr = np.asarray(self.mesh.devices).reshape(self.mesh.shape)
        key = "+".join(axes)
        idx = [self.mesh.axis_names.index(a) for a in axes]
        if len(holders) > 1:
            arr = np.take(arr, holders, axis=pp)
            idx.append(pp)
            key += f"|pp{','.join(map(str, holders))}"
        if not idx:
            return None
        rest = [i for i in range(arr.ndim) if i not in idx]
        groups = arr.transpose(rest + idx).reshape(-1, int(np.prod([arr.shape[i] for i in idx])))
        all_ = tuple(tuple(int(x) for x in g) for g in groups)
        return ReplicaGroup(key, next(g for g in all_ if rank in g), all_)

    @property
    def distributed_graph(self) -> fx.GraphModule:
        """The global graph after annotate + insert_collectives (the same for every rank)."""
        if self._dist is None:
            ctx = PassContext(self.plan, self.mesh, prefetch=self.prefetch, timings=self.timings)
            self._dist = run_passes(_copy(self.graph), ctx, GLOBAL_PASSES)
        return self._dist

    def rank_graph(self, rank: int, device: str = "cpu", chunk: int | None = None) -> fx.GraphModule:
        """Rank ``rank``'s GraphModule (local shapes, explicit collectives and waits); for a
        pipeline, that of stage chunk ``chunk`` (default: the rank's first chunk)."""
        if self.plan.stages:
            mine = [st.index for st in self.plan.stages if rank in st.plan.mesh["devices"]]
            if chunk is None and not mine:
                raise PlanError(f"rank {rank} is not in the plan's mesh {self.mesh!r}")
            k = mine[0] if chunk is None else chunk
            if k not in mine:
                raise PlanError(f"stage chunk {k} does not run on rank {rank} (its chunks: {mine})")
            return self.stage_programs[k].rank_graph(rank, device)
        key = (rank, device)
        if key not in self._ranks:
            if rank not in self.mesh.devices:
                raise PlanError(f"rank {rank} is not in the plan's mesh {self.mesh!r}")
            ctx = PassContext(self.plan, self.mesh, coord=self.mesh.coord(rank),
                              prefetch=self.prefetch, device=device, timings=self.timings)
            self._ranks[key] = run_passes(_copy(self.distributed_graph), ctx, RANK_PASSES,
                                          already_run=[p.__name__ for p in GLOBAL_PASSES])
        return self._ranks[key]

    def runner(self, weights: Any = None, *, s_g: int | None = None, s_os: int | None = None, seed: int = 0,
               local_batch: bool = False, device: str | None = None,
               bucket_bytes: int = BUCKET_BYTES, regather: bool = True,
               recompute=None, compile: bool | str = False,
               reduce_dtype: torch.dtype | None = None,
               recompute_granularity: str | None = None) -> Runner:
        """This rank's :class:`Runner` (collective: every rank of the mesh calls it).

        ``weights``: ``None`` (the model's own real tensors), a state dict of full tensors, a
        checkpoint path, or ``"init"`` (the model's initializers, for a model on ``meta``).
        ``s_g``/``s_os``: gradient and optimizer-state sharding factors inside each parameter's
        replica group (AMSP; ZeRO-1 = ``(1, N)``, ZeRO-2 = ``(N, N)``). ``regather``: free
        a gathered parameter after its forward use and gather it again in backward (what the
        planner prices, ZeRO-3); ``False`` keeps it for backward (more memory, less traffic).
        ``s_g``/``s_os``/``recompute``/``recompute_granularity`` left out: what the plan chose
        (``plan.config``'s state factors, recomputed layers and granularity), else 1, 1, none
        and ``"full"``. ``recompute_granularity``: ``"full"`` (a recomputed layer keeps its
        inputs, re-runs its whole forward) or ``"selective"`` (it also keeps its GEMMs',
        attention kernels' and activations' collectives' outputs and re-runs the rest, as
        Megatron-LM's selective granularity: :mod:`fxpar.runtime.recompute`). ``compile``: the rank graph (a
        pipeline: each stage chunk's) through ``torch.compile``, ``True`` for inductor or a
        backend's name (:func:`fxpar.runtime.runner.compiled`; not with recomputed layers),
        and the optimizer step with it (a built-in element-wise optimizer:
        ``ModelStates.compile_step``, one fused kernel per flat segment). Under ``compile``,
        ``regather`` gives the same results (tested) but what memory it frees has not been
        measured. ``reduce_dtype``: the dtype gradients are summed over microbatches and
        reduced in, e.g. ``torch.float32`` for bf16 parameters (Megatron-LM's
        ``accumulate_allreduce_grads_in_fp32``, FSDP2's ``MixedPrecisionPolicy(reduce_dtype=
        torch.float32)``, torchtitan's default); left out: the plan's
        (``PlannerOptions.reduce_dtype``, what it priced), else the parameters' own.
        """
        if reduce_dtype is None and self.plan.options.get("reduce_dtype"):
            reduce_dtype = getattr(torch, self.plan.options["reduce_dtype"])
        cfg = self.plan.config
        if recompute_granularity is None:
            recompute_granularity = cfg.recompute_granularity if cfg is not None else "full"
        # the plan's factors are over dp; the runner's are inside each parameter's replica
        # group, which parameters sharded over s_p of the replicas (ZeRO-3) shrink by s_p
        sp, g, o = cfg.state if cfg is not None else (1, 1, 1)
        s_g = g // sp if s_g is None else s_g
        s_os = o // sp if s_os is None else s_os
        if self.plan.stages:
            from fxpar.runtime.interpreter import PipelineRunner

            if local_batch:
                raise FxparError("a pipeline runner takes the global batch (local_batch=False)")
            return PipelineRunner(self, weights, s_g=s_g, s_os=s_os, seed=seed, device=device,
                                  bucket_bytes=bucket_bytes, regather=regather,
                                  recompute=recompute, compile=compile,
                                  reduce_dtype=reduce_dtype,
                                  recompute_granularity=recompute_granularity)
        return Runner(self, weights, s_g=s_g, s_os=s_os, seed=seed, local_batch=local_batch,
                      device=device, bucket_bytes=bucket_bytes, regather=regather,
                      recompute=recompute, compile=compile, reduce_dtype=reduce_dtype,
                      recompute_granularity=recompute_granularity)

    # -- save / load -----------------------------------------------------------------------
    def save(self, path) -> None:
        """The plan, the model's parameter signature and the captured input shapes (a
        pipeline's: one microbatch's) as JSON, with the values capture specialized
        (``ir.READS``: the file's inputs are only shapes); :func:`load` rebuilds the program."""
        from fxpar.capture.specialize import reads_to_json

        reads = self.graph.meta.get(ir.READS)
        d = dict(fxpar_program=1, plan=self.plan.to_dict(), signature=model_signature(self.graph),
                 inputs=[dict(name=i.name, path=i.path, shape=list(i.shape) if i.is_tensor else None,
                              dtype=str(i.dtype).removeprefix("torch.") if i.is_tensor else None,
                              value=None if i.is_tensor else i.value)
                         for i in ir.user_inputs(self.graph)],
                 in_spec=pytree.treespec_dumps(self.graph.meta[ir.INPUT_TREE]),
                 training=self.training, prefetch=self.prefetch,
                 n_targets=getattr(self.model, "n_targets", 0),
                 reads=reads_to_json(reads) if reads is not None else None)
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
    from fxpar.capture import WithLoss as _WithLoss
    from fxpar.capture import capture
    from fxpar.capture import frozen_params as _Frozen
    from fxpar.capture.specialize import reads_from_json

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
            # the values capture specialized are the saved ones, not the zero inputs'
            gm = capture(wrapped, args, kwargs, reads=reads_from_json(d["reads"])
                         if d.get("reads") is not None else None)
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
    chunks = None
    if plan.stages:  # the same chunks again, from where each started
        from fxpar.split import split_stages

        chunks = [c.graph for c in split_stages(gm, len(plan.stages),
                                                start_nodes=[st.start for st in plan.stages])]
    return Program(plan, gm, wrapped, optimizer=optimizer, training=training,
                   prefetch=d.get("prefetch", 1), stage_graphs=chunks)
