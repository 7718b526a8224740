"""Runner: one rank's executable program, built by :meth:`fxpar.Program.runner` under torchrun.

Steps 1-3 are the per-rank setup both runners share (:class:`fxpar.runtime.rank.RankRunner`):

1. all ranks exchange the plan hash, then check the world size against the mesh: a mismatch
   raises :class:`~fxpar.PlanError` on every rank before any collective of the program runs;
2. materializes only this rank's shards of parameters and buffers
   (:func:`fxpar.runtime.materialize.local_state`: from the model's real tensors, a state
   dict / checkpoint path, or ``"init"`` on a meta model);
3. hands every trainable parameter to :class:`fxpar.runtime.model_state.ModelStates` with its
   replica group (the mesh axes over which its gradient is a partial sum) and the AMSP factors
   ``s_g``/``s_os``; the gradient of each parameter use goes there (asynchronous, bucketed);
4. binds what the rank graph names at call time (:class:`~fxpar.runtime.bindings.Bindings`:
   edges, process groups, the gradient sink, the RNG tracker): the graph itself holds no
   state, so several runners of one Program coexist;
5. with ``recompute`` (layer names, ``"all"``, or the plan's ``schedule["recompute"]``), the
   graph runs through :class:`~fxpar.runtime.recompute.Recompute`: those layers keep only
   their inputs for backward and run their forward again there (activation checkpointing);
6. ``runner.step(*batch)`` slices this rank's piece of the global batch (or takes a local batch
   with ``local_batch=True``), runs forward and backward, reduces gradients, steps the
   optimizer on local shards and returns the loss (the same value on every rank).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import numpy as np
import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from fxpar import ir
from fxpar.defaults import BUCKET_BYTES, FIRST_BUCKET_BYTES
from fxpar.errors import FxparError
from fxpar.mesh import Mesh
from fxpar.runtime.bindings import Bindings, bind
from fxpar.runtime.comm import gathers_params
from fxpar.runtime.rank import (RankRunner, check_world, clip_grad_norm, loss_prefix, param_uses,
                                param_layouts)
from fxpar.runtime.recompute import (Recompute, RecomputeError, check_granularity, known_layers,
                                    resolve)

__all__ = ["Runner", "TrainingSteps", "replica_group", "check_world", "clip_grad_norm",
           "recompute_layers", "compiled"]

#: the shared base of both runners, under its former name
TrainingSteps = RankRunner


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


def compiled(gm: fx.GraphModule, compile, recompute: frozenset[str], split: bool = False):
    """``gm`` through ``torch.compile`` (``compile=True``: inductor; a string: that backend;
    static shapes, as the plan fixes them), or ``gm`` itself for ``compile=False``.
    Communication ops stay opaque calls (``torch.ops.fxpar.*``) the compiler schedules around.
    Recomputed layers run their pieces under autograd's checkpoint, which the compiled graph
    cannot: that combination is refused (``recompute=False``, or compile without it).

    ``split``: one compiled piece per gradient bucket's worth of layers (:func:`_bucket_pieces`;
    ``torch.fx``'s ``split_module``, the returned module calls them in order, ``meta[ir.SOURCE]``
    is ``gm``), as ``torch.compile`` of DDP splits at its buckets: a whole-graph compiled
    backward is ONE autograd node, so every parameter's gradient reaches its leaf (and its
    bucket's all-reduce starts) only after the whole backward; per piece, the last layers'
    buckets reduce while the first layers' backward runs."""
    if not compile:
        return gm
    if recompute:
        raise RecomputeError(f"compile={compile!r} with recomputed layers {sorted(recompute)[:4]}: "
                             "not supported; pass recompute=False (or compile=False)")
    backend = "inductor" if compile is True else compile
    parts = _bucket_pieces(gm) if split else {}
    if len(set(parts.values())) < 2:
        return torch.compile(gm, backend=backend, dynamic=False)
    from torch.fx.passes.split_module import split_module

    out = split_module(gm, gm, lambda n: parts[n], keep_original_order=True)
    for name, sub in list(out.named_children()):
        setattr(out, name, torch.compile(sub, backend=backend, dynamic=False))
    out.meta = {**gm.meta, ir.SOURCE: gm}
    return out


def _bucket_pieces(gm: fx.GraphModule, first: int = FIRST_BUCKET_BYTES,
                   size: int = BUCKET_BYTES) -> dict[fx.Node, int]:
    """Each computing node's piece: layers (in graph order) cut where their parameters, counted
    from the last layer back, fill a gradient bucket (``first`` bytes, then ``size``: the
    runtime's buckets, where ``torch.compile`` of DDP splits too); nodes of no named layer
    (``"(top)"``: the loss, collectives) stay in the piece they are found in."""
    from fxpar.layers import layer_of

    order: list[str] = []
    nbytes: dict[str, int] = {}
    for n in gm.graph.nodes:
        lay = layer_of(n)
        if n.op == "placeholder":
            if ir.PARAM in n.meta:
                v = n.meta[ir.VAL]
                nbytes[lay] = nbytes.get(lay, 0) + v.numel() * v.element_size()
        elif n.op != "output" and lay != "(top)" and lay not in order:
            order.append(lay)
    starts, acc, cap = set(), 0, first
    for lay in reversed(order[1:]):
        acc += nbytes.get(lay, 0)
        if acc >= cap:
            starts.add(lay)
            acc, cap = 0, size
    out, k = {}, 0
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "output"):
            continue
        lay = layer_of(n)
        if lay in starts:
            starts.discard(lay)
            k += 1
        out[n] = k
    return out


def recompute_layers(program, recompute, known, granularity: str = "full") -> frozenset[str]:
    """The layers a runner recomputes: ``recompute`` as given (``"all"``, layer names, or
    ``()``/``False`` for none), or with ``None`` the plan's choice
    (``plan.config.recompute``, what the joint planner writes), checked against the
    program's layers ``known`` (:func:`fxpar.runtime.recompute.resolve`); ``granularity``
    checked against :data:`fxpar.cost.memory.GRANULARITIES`."""
    check_granularity(granularity)
    if recompute is None:
        cfg = getattr(program.plan, "config", None)
        recompute = sorted(cfg.recompute) if cfg is not None and cfg.recompute else None
    if recompute is False:
        recompute = None
    return resolve(recompute, known, prefix=loss_prefix(program.model))


class Runner(RankRunner):
    """One rank's executable program (module docstring); build with :meth:`Program.runner`."""

    def __init__(self, program, weights=None, *, s_g=1, s_os=1, seed=0,
                 local_batch=False, device=None, bucket_bytes=BUCKET_BYTES,
                 regather=True, recompute=None, compile=False, reduce_dtype=None,
                 recompute_granularity="full") -> None:
        super().__init__(program, device=device, seed=seed)
        mesh, rank = self.mesh, self.rank
        self.coord = mesh.coord(rank)
        self.local_batch = local_batch
        self.regather, self.regathers = regather, 0
        #: gathered parameters still held between forward and backward (``regather``: those
        #: of the last gathered group only, which backward needs first; ``None`` without)
        self.held_after_forward = 0 if regather else None
        gm = program.rank_graph(rank, self.device)
        #: the rank graph this runner calls (replaceable, e.g. by ``torch.compile(runner.gm)``:
        #: what the runner needs of its meta is read here, once)
        self.gm = gm
        self._input_tree, self._output_tree = gm.meta[ir.INPUT_TREE], gm.meta[ir.OUTPUT_TREE]
        self._outputs = ir.outputs(gm)
        out_node = next(iter(gm.graph.find_nodes(op="output")))
        self._out_specs = [(n.meta.get(ir.SPECS), n.meta.get(ir.GLOBAL_VAL)) if isinstance(n, fx.Node)
                           else (None, None) for n in pytree.tree_leaves(out_node.args[0])]
        # parameters and buffers: this rank's shards only
        holders = [n for n in gm.graph.find_nodes(op="placeholder") if ir.PARAM in n.meta]
        self.inputs = [n for n in gm.graph.find_nodes(op="placeholder") if ir.INPUT in n.meta]
        layouts = param_layouts(holders)
        #: storage spec of every parameter and buffer (its local shard's layout)
        self.specs = {f: spec for f, (spec, _) in layouts.items()}
        self.state = self._materialize(layouts, {n.meta[ir.PARAM].fqn: n.meta[ir.PARAM] for n in holders},
                                       mesh.shape, self.coord, weights, seed)
        self._order = [n.meta[ir.PARAM].fqn for n in holders]
        #: the layers whose forward is recomputed in backward (:mod:`fxpar.runtime.recompute`)
        self.recompute = recompute_layers(program, recompute, known_layers(gm), recompute_granularity)
        self.recompute_granularity = recompute_granularity
        self._rc = None
        if self.recompute:   # checked now, not at the first step
            self._rc = Recompute(gm, self.recompute, recompute_granularity)
        replica = gm.meta.get(ir.REPLICA_AXES, {})
        groups = {f: replica_group(mesh, replica.get(f, ()), rank) for f in self._order}
        # in pieces at bucket boundaries where leaves take gradients that other ranks reduce
        # (hooks fire per piece); with nothing to reduce a piece is only overhead (a Dynamo
        # frame and its guards: 1 ms of a 16 ms step of benchmarks/runtime.py's GPT, 1 rank)
        self.gm = compiled(gm, compile, self.recompute, split=program.training and any(
            groups[f] is not None and len(groups[f].ranks) > 1
            for f in param_uses(gm, self._order)[1]))
        edges = gm.meta.get(ir.EDGES, {})
        #: whether a training step enters Regather's saved-tensor hooks (only if it gathers
        #: a parameter: the hooks cost a Python call per saved tensor)
        self._regather_on = regather and gathers_params(edges)
        at = {n.name: k for k, n in enumerate(self.inputs)}
        #: edges out of a batch input through a collective: handed the global batch, a rank
        #: slices their destination layout itself instead (``Bindings.given``)
        self._input_edges = [(at[e.producer], e) for e in edges.values()
                             if e.producer in at and e.collective]
        self.bindings = Bindings(edges, mesh, tuple(self.coord), sink=self._sink, tracker=self.tracker,
                                 fresh_grads=bool(compile))
        if program.training:
            params = self._trainable()
            groups = {f: groups[f] for f in params}
            # A use through a communication op sends its gradient to the sink; the other
            # uses accumulate on the leaf, whose post-accumulate hook sends the sum (once).
            self._init_model_states(params, groups, [(gm, 1)], s_g=s_g, s_os=s_os,
                                    bucket_bytes=bucket_bytes, compile=compile,
                                    reduce_dtype=reduce_dtype)

    @property
    def recomputed(self) -> int:
        """Recomputed layer forwards run in backward so far (0 without ``recompute``)."""
        return self._rc.recomputed if self._rc is not None else 0

    # -- batches ---------------------------------------------------------------------------
    def _local_inputs(self, args, kwargs) -> list:
        from fxpar.capture import flatten_inputs
        from fxpar.runtime.redistribute import distribute

        flat = flatten_inputs(tuple(args), dict(kwargs), self._input_tree)
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
        if not self.local_batch:
            self.bindings.given = {e.name: distribute(flat[k], e.fwd.dst, self.mesh.shape,
                                                      self.coord).to(self.device)
                                   for k, e in self._input_edges}
        return out

    def forward(self, *args, **kwargs):
        """Run the local program; returns the flat local outputs (finalized: no Partial)."""
        ins = self._local_inputs(args, kwargs)
        fn = self.gm
        if self.recompute:
            if self._rc is None or self._rc.gm is not self.gm:
                self._rc = Recompute(self.gm, self.recompute, self.recompute_granularity)
            fn = self._rc
        with bind(self.bindings):
            return fn(*[self.state[f] for f in self._order], *ins)

    def forward_backward(self, *args, **kwargs) -> torch.Tensor:
        """Forward and backward on the batch, gradients reduced (``states.grads()`` shows
        them); no optimizer step. Calls accumulate gradients until :meth:`optimizer_step`."""
        return self._forward_backward(args, kwargs, step=False)

    def step(self, *args, **kwargs) -> torch.Tensor:
        """One training step (as :meth:`RankRunner.step`), its optimizer step overlapped with
        the last gradient reductions (:meth:`ModelStates.finish_backward_and_step`)."""
        loss = self._forward_backward(args, kwargs, step=True)
        self.states.zero_grad()
        return loss

    def _forward_backward(self, args, kwargs, step: bool) -> torch.Tensor:
        if self.states is None:
            raise FxparError("training steps need a program compiled with training=True")
        from fxpar.runtime.comm import Regather
        from fxpar.runtime.redistribute import finish

        with bind(self.bindings):
            deferred = self.bindings.deferred = []
            # the last gathered group stays for the backward, which needs it first
            with Regather(keep_last=True) if self._regather_on else contextlib.nullcontext() as rg:
                self.bindings.regather = rg
                try:
                    out = self.forward(*args, **kwargs)
                finally:
                    self.bindings.regather = self.bindings.deferred = None
                    if rg is not None:
                        rg.end_forward()
            if rg is not None:
                self.held_after_forward = rg.alive()
            loss = out[0] if isinstance(out, (tuple, list)) else out
            if not (isinstance(loss, torch.Tensor) and loss.ndim == 0 and loss.is_floating_point()):
                raise FxparError("the compiled model's first output is not a scalar loss; pass "
                                 "loss_fn=... to fxpar.compile")
            self.states.begin_backward()
            loss.backward()
        self.regathers = rg.count if rg is not None else 0
        if step:
            self.states.finish_backward_and_step()
        else:
            self.states.finish_backward()
        for pending in deferred:   # the loss's all-reduce (rt.in_flight): now its value is read
            finish(pending)
        self.tracker.next_step()
        return loss.detach()

    def profile(self, *args, steps: int = 3, **kwargs):
        """Measure ``steps`` training steps (forward, backward, optimizer; one warm-up step
        first) on the batch ``args``/``kwargs`` (none: zeros and normals of the compiled
        shapes) and return a :class:`fxpar.Profile`: per node, layer and collective the
        measured forward and backward seconds beside the plan's predicted ones
        (:mod:`fxpar.runtime.profile`). The steps train: the weights change as in
        :meth:`step`. Collective: every rank calls it with the same ``steps``.

        ``runner.profile(x, y).compare()`` prints predicted against measured;
        ``cluster.refine(profile)`` re-fits the cluster's rates to the measurement."""
        from fxpar.runtime.profile import profile_runner

        return profile_runner(self, args, kwargs, steps)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the reduced gradients as ``torch.nn.utils.clip_grad_norm_`` does on one process:
        the ``norm_type``-norm of ALL gradients together (every distinct element once: over
        this rank's gradient chunks, weighted by how many ranks hold the same chunk — replica
        groups, ``s_g`` sharding, mesh axes the plan replicates the parameter on — and summed
        over the world), then every gradient times ``min(1, max_norm / (norm + 1e-6))``.
        Call between :meth:`forward_backward` and :meth:`optimizer_step`; collective; returns
        the total norm (the same on every rank).

        ``‖g‖_p = (Σ_ranks Σ_{owned chunks} |g|^p · s_g / (n · copies))^(1/p)``;
        ``p = inf``: the max over ranks of the max ``|g|``."""
        return clip_grad_norm(self.states, self.specs, self.mesh,
                              self.gm.meta.get(ir.REPLICA_AXES, {}), max_norm, norm_type,
                              self.device)

    def __call__(self, *args, gather: bool = True, **kwargs):
        """Inference: the model's outputs in its own structure, gathered to their global form
        (``gather=False``: this rank's local pieces)."""
        from fxpar.resharding.intra import reshard_plan
        from fxpar.runtime.redistribute import execute

        with torch.no_grad():
            out = self.forward(*args, **kwargs)
            flat = list(out) if isinstance(out, (tuple, list)) else [out]
            if gather:
                for k, (specs, glob) in enumerate(self._out_specs):
                    if isinstance(flat[k], torch.Tensor) and specs and not specs[0].is_replicated:
                        shape = tuple(glob.shape)
                        plan = reshard_plan(specs[0], "R" * self.mesh.ndim, self.mesh, shape,
                                            flat[k].dtype)
                        flat[k] = execute(plan, flat[k], self.bindings.device_mesh)
        infos = self._outputs
        user = [v for info, v in zip(infos, flat) if info.kind == "user"] if infos else flat
        return pytree.tree_unflatten(user, self._output_tree)
