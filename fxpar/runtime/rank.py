"""One rank of a compiled program, set up the same way by both runners.

:class:`RankRunner` is the base of :class:`~fxpar.runtime.runner.Runner` (one SPMD rank graph)
and :class:`~fxpar.runtime.interpreter.PipelineRunner` (the stage chunks of one pipeline rank).
What they share, in the order a runner's ``__init__`` does it:

1. ``RankRunner.__init__``: every rank exchanges the plan hash, then checks the world size
   against the mesh (:func:`check_world`: a mismatch raises :class:`~fxpar.PlanError` on every
   rank before any collective of the program runs); ``rank``, ``device`` and the RNG tracker
   (:class:`~fxpar.runtime.rng.RNGTracker`, what dropout draws from);
2. :meth:`RankRunner._materialize`: only this rank's shards of the parameters and buffers its
   graphs use (:func:`fxpar.runtime.materialize.local_state`: from the model's real tensors,
   a state dict / checkpoint path, or ``"init"`` on a meta model), by the graphs' FQNs (the
   loss wrapper's :data:`~fxpar.defaults.LOSS_PREFIX` taken off for the user's model and put
   back); trainable parameters require grad;
3. :meth:`RankRunner._init_model_states`: the trainable parameters go to one
   :class:`~fxpar.runtime.model_state.ModelStates` with their replica groups and the AMSP
   factors ``s_g``/``s_os``; every gradient contribution a step makes is declared
   (:func:`param_uses`): a use through a communication op sends its gradient to the sink
   (:meth:`RankRunner._sink`) once per run of its graph; direct uses accumulate on the leaf
   (in its bucket where it can), handed to the model states once, after the step's last
   backward through it (:meth:`RankRunner._direct`). So buckets reduce asynchronously during
   the last backward.

Then both run steps, clip, and save/load checkpoints the same way (:meth:`RankRunner.step`,
:func:`clip_grad_norm`, :mod:`fxpar.runtime.checkpoint`).

Which gradient contributions a rank graph makes, per run (a pure function of the graph):
under plain data parallelism each parameter is used directly (its gradient accumulates on the
leaf); under ZeRO-3 each use runs through its all-gather, whose backward sends the gradient to
the sink:

>>> import torch
>>> from torch import nn
>>> import fxpar
>>> def uses(plan):
...     prog = fxpar.compile(nn.Linear(4, 2), fxpar.Cluster.local(2), (torch.randn(8, 4),),
...                          mesh={"dp": 2}, plan=plan)
...     return param_uses(prog.rank_graph(0), {"weight", "bias"})   # (through, direct)
>>> uses("dp")
({}, ['weight', 'bias'])
>>> uses("zero3")
({'weight': 1, 'bias': 1}, [])
>>> loss_prefix(nn.Linear(4, 2))            # no loss wrapper: the FQNs are the model's
''
"""

from __future__ import annotations

import sys
from collections.abc import Collection, Mapping, Sequence

import numpy as np
import torch
import torch.fx as fx

from fxpar import ir
from fxpar.defaults import BUCKET_BYTES, LOSS_PREFIX
from fxpar.errors import FxparError, PlanError
from fxpar.runtime.comm import REDISTRIBUTE, START, WAIT

__all__ = ["RankRunner", "default_device", "check_world", "clip_grad_norm", "loss_prefix", "param_layouts",
           "param_uses"]


def loss_prefix(model) -> str:
    """The prefix the graphs' FQNs carry over the user's model's: :data:`LOSS_PREFIX` when
    ``model`` is the loss wrapper (:class:`fxpar.capture.WithLoss`), else ``""``."""
    return LOSS_PREFIX if getattr(model, "fxpar_wraps_loss", False) else ""


def check_world(plan, mesh) -> int:
    """This rank, after checking (collectively, over the whole world) that every rank holds
    the same plan and the world has the mesh's size; :class:`PlanError` on every rank if not.
    The hash exchange comes first: a check that fails on some ranks only (a plan for another
    world size on one rank) must not leave the others hanging."""
    import torch.distributed as dist

    if not dist.is_initialized():
        raise FxparError("Program.runner() needs an initialized torch.distributed process "
                         "group (run under torchrun)")
    world = dist.get_world_size()
    hashes: list = [None] * world
    dist.all_gather_object(hashes, plan.hash)
    if len(set(hashes)) != 1:
        bad = {r: h[:12] for r, h in enumerate(hashes)}
        raise PlanError(f"ranks hold different plans (plan hash by rank: {bad}); every rank "
                        "must compute or load the same plan")
    if world != mesh.size:
        raise PlanError(f"the plan is for {mesh.size} ranks ({mesh!r}) but the world has "
                        f"{world} ranks")
    return dist.get_rank()


def param_layouts(holders: Sequence[fx.Node]) -> dict[str, tuple]:
    """``{fqn: (storage spec, global shape)}`` of parameter placeholders ``holders``."""
    return {n.meta[ir.PARAM].fqn: (n.meta[ir.SPECS][0], n.meta[ir.PARAM].shape) for n in holders}


def param_uses(gm: fx.GraphModule, params: Collection[str]) -> tuple[dict[str, int], list[str]]:
    """``(through, direct)`` for the parameters ``params`` of rank graph ``gm``: per
    parameter, how many of its uses run through a communication op of its own edge (each
    sends its gradient to the sink, once per run), and, in placeholder order, those it also
    uses directly (their gradients accumulate on the leaf)."""
    edges = gm.meta.get(ir.EDGES, {})
    through: dict[str, int] = {}
    direct: list[str] = []
    for n in gm.graph.find_nodes(op="placeholder"):
        f = n.meta[ir.PARAM].fqn if ir.PARAM in n.meta else None
        if f not in params:
            continue
        used = False
        for u in n.users:
            e = u.args[-3] if u.target in (WAIT, REDISTRIBUTE) else None
            if e is not None and edges[e].param == f:
                through[f] = through.get(f, 0) + 1
            elif u.target is not START:
                used = True
        if used:
            direct.append(f)
    return through, direct


def clip_grad_norm(states, specs, mesh, replica, max_norm: float, norm_type: float,
                   device) -> torch.Tensor:
    """:meth:`Runner.clip_grad_norm_` for any runner: ``specs`` the storage spec of each
    parameter on ``mesh`` (the mesh its shards are laid out on), ``replica`` the mesh axes its
    gradient is reduced over (those copies are counted by ``states``, the others here)."""
    import torch.distributed as dist

    if states is None:
        raise FxparError("clip_grad_norm_ needs a program compiled with training=True")
    norm_type = float(norm_type)
    copies = {}
    for fqn, spec in specs.items():
        axes = replica.get(fqn, ())
        copies[fqn] = int(np.prod([g for a, (g, pl) in enumerate(zip(mesh.shape, spec))
                                   if pl.is_replicate() and mesh.axis_names[a] not in axes]))
    term = states.grad_norm_term(norm_type, copies).to(device)
    inf = norm_type == float("inf")
    dist.all_reduce(term, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM)
    total = term if inf else term.pow(1.0 / norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    states.scale_grads(float(coef))
    return total


def default_device() -> str:
    """Where a runner computes when not told: under an NCCL process group the rank's GPU
    (``cuda:LOCAL_RANK`` as torchrun sets it, else the current CUDA device), else ``"cpu"``
    (gloo). NCCL moves only device tensors, so a CPU runner on it could not communicate.

    >>> default_device()   # no process group here
    'cpu'
    """
    import os

    import torch.distributed as dist

    if dist.is_initialized() and "nccl" in str(dist.get_backend()) and torch.cuda.is_available():
        local = os.environ.get("LOCAL_RANK")
        return f"cuda:{int(local) if local is not None else torch.cuda.current_device()}"
    return "cpu"


def check_backend_device(backend: str, device: str, world: int) -> None:
    """Refuse a device the process group cannot move tensors of (every rank alike):
    NCCL moves CUDA tensors only; gloo with CUDA tensors crashed fxpar's collectives
    (two gloo ranks on one H200, torch 2.11: a segfault in the functional collectives),
    so with more than one rank it is refused rather than left to crash.

    >>> check_backend_device("gloo", "cuda:0", 1)        # nothing to move
    >>> check_backend_device("gloo", "cuda:0", 2)
    Traceback (most recent call last):
    ...
    fxpar.errors.FxparError: runner(device='cuda:0') under the gloo backend with 2 ranks: gloo collectives on CUDA tensors are not supported; use backend='nccl' (one GPU per rank) or device='cpu'
    """
    kind = torch.device(device).type
    if world > 1 and "gloo" in backend and "nccl" not in backend and kind == "cuda":
        raise FxparError(f"runner(device={device!r}) under the gloo backend with {world} ranks: gloo "
                         "collectives on CUDA tensors are not supported; use backend='nccl' (one "
                         "GPU per rank) or device='cpu'")
    if "nccl" in backend and "gloo" not in backend and kind != "cuda":
        raise FxparError(f"runner(device={device!r}) under the nccl backend: NCCL moves CUDA tensors "
                         "only; use device='cuda' (the default) or backend='gloo'")


class RankRunner:
    """What every runner sets up and does the same way (module docstring): the rank's
    checks, state and model states, where gradients go, steps and checkpoints. A subclass
    builds its graphs between the steps of setup and provides ``forward_backward``."""

    def __init__(self, program, *, device=None, seed: int = 0) -> None:
        from fxpar.runtime.rng import RNGTracker

        self.rank = check_world(program.plan, program.mesh)
        self.program, self.mesh = program, program.mesh
        import torch.distributed as dist

        self.device = device or default_device()
        if dist.is_initialized():
            check_backend_device(str(dist.get_backend()), self.device, dist.get_world_size())
        if device is None and self.device.startswith("cuda"):
            # object collectives and NCCL's own buffers use the current device: make it this
            # rank's (torchrun leaves every rank on cuda:0 until someone sets it)
            torch.cuda.set_device(self.device)
        #: the prefix the graphs' FQNs carry over the user's model's (:func:`loss_prefix`)
        self.fqn_prefix = loss_prefix(program.model)
        self.tracker = RNGTracker(seed)
        #: this rank's parameters and buffers by the graphs' FQNs (:meth:`_materialize`)
        self.state: dict[str, torch.Tensor] = {}
        #: the :class:`~fxpar.runtime.model_state.ModelStates` (``None`` without training)
        self.states = None

    # -- setup ---------------------------------------------------------------------------------
    def _materialize(self, layouts: Mapping[str, tuple], infos: Mapping[str, ir.ParamInfo],
                     mesh_shape, coord, weights, seed: int) -> dict[str, torch.Tensor]:
        """This rank's shards of ``layouts`` (``{fqn: (spec, global shape)}`` on the mesh of
        ``mesh_shape``, at ``coord``) from ``weights``, on the runner's device, in
        ``layouts``' order; trainable parameters (``infos``) require grad."""
        from fxpar.runtime.materialize import local_state

        program = self.program
        model, pre = program.model, self.fqn_prefix
        if pre:   # a loss_fn wrapper holds the model as ``model.``: from the user's model
            model = model.model
        #: what was materialized, and where (:meth:`load_hf_checkpoint` reads the same again)
        self._layouts, self._infos, self._where = dict(layouts), dict(infos), (mesh_shape, coord)
        local = local_state(model, {f.removeprefix(pre): v for f, v in layouts.items()},
                            mesh_shape, coord, source=weights, seed=seed)
        state: dict[str, torch.Tensor] = {}
        for f in layouts:
            info, t = infos[f], local[f.removeprefix(pre)].to(self.device)
            trainable = program.training and info.kind == "param" and info.requires_grad
            state[f] = t.requires_grad_(True) if trainable else t
        return state

    def _trainable(self) -> dict[str, torch.Tensor]:
        """The parameters this rank trains (after checking the program has an optimizer)."""
        if self.program.optimizer is None:
            raise FxparError("training needs an optimizer: fxpar.compile(..., optimizer="
                             "lambda params: torch.optim.AdamW(params, lr=...))")
        return {f: t for f, t in self.state.items() if t.requires_grad}

    def _init_model_states(self, params: Mapping[str, torch.Tensor], groups: Mapping,
                           graphs: Sequence[tuple[fx.GraphModule, int]], *, s_g: int = 1,
                           s_os: int = 1, bucket_bytes: int = BUCKET_BYTES,
                           grad_scale: Mapping[str, float] | None = None,
                           compile: bool | str = False,
                           reduce_dtype: torch.dtype | None = None) -> list[list[str]]:
        """``self.states`` over ``params`` (their replica ``groups``), and every gradient
        contribution of a step declared: ``graphs`` lists each rank graph with how many times
        a step runs it (a pipeline chunk: once per microbatch). ``compile`` (the runner's):
        the optimizer step goes through ``torch.compile`` too (``ModelStates.compile_step``).
        ``reduce_dtype``: gradients summed over backward passes and reduced in it (a direct
        use whose leaf cannot accumulate in its bucket then hands each pass's gradient over,
        so they add up in ``reduce_dtype``, not in the parameter's). Returns, per graph, the
        parameters it uses directly (their leaf hook counts its runs: :meth:`_direct`)."""
        from fxpar.runtime.model_state import ModelStates

        # a compiled step is one fused loop per tensor, no temporaries: whole flat segments
        self.states = ModelStates(params, groups, self.program.optimizer, s_g=s_g, s_os=s_os,
                                  bucket_bytes=bucket_bytes, grad_scale=grad_scale,
                                  step_piece=sys.maxsize if compile else None,
                                  reduce_dtype=reduce_dtype)
        if compile:
            self.states.compile_step("inductor" if compile is True else compile)
        uses = dict.fromkeys(params, 0)
        #: per parameter: direct-use backward passes per step, and how many ran this step
        self._direct_n: dict[str, int] = {}
        self._direct_seen: dict[str, int] = {}
        out = []
        for gm, runs in graphs:
            through, direct = param_uses(gm, params)
            for f, k in through.items():
                uses[f] += k * runs
            for f in direct:
                first = f not in self._direct_n
                if first:
                    params[f].register_post_accumulate_grad_hook(lambda p, f=f: self._direct(f))
                if self.states.in_place(f) or reduce_dtype in (None, params[f].dtype):
                    # one hand-off per step, after the last pass has accumulated on the leaf
                    uses[f] += first
                    self._direct_n[f] = self._direct_n.get(f, 0) + runs
                else:   # every pass's gradient to the states: summed in reduce_dtype
                    uses[f] += runs
                    self._direct_n[f] = 1
            out.append(direct)
        for f, k in uses.items():
            if k:
                self.states.expect(f, k)
        return out

    # -- where gradients go ------------------------------------------------------------------
    def _sink(self, edge, grad: torch.Tensor) -> None:
        """Gradient of one parameter use (``fxpar.sink_grad``), in the consumer's gradient
        layout, scaled: straight to the model states, or through its gradient plan (launched
        with the rest of its bucket, finished after backward: ``ModelStates``) on the mesh of
        the graph that runs (the active bindings)."""
        from fxpar.runtime.bindings import current

        if not edge.bwd.steps:
            self.states.add_grad(edge.param, grad)
        else:
            self.states.add_planned_grad(edge.param, grad, edge.bwd, current().device_mesh,
                                         edge.bucket, edge.name)

    def _direct(self, fqn: str) -> None:
        """A parameter leaf's post-accumulate hook: one backward pass has accumulated into
        ``fqn``'s leaf (in its bucket where it can: ``ModelStates.in_place``); after the
        step's last, its ``.grad`` goes to the model states (one hand-off per step, not per
        microbatch)."""
        k = self._direct_seen.get(fqn, 0) + 1
        if k < self._direct_n[fqn]:
            self._direct_seen[fqn] = k
            return
        self._direct_seen[fqn] = 0
        self.states.leaf_grad(fqn)

    # -- checkpoints and steps ---------------------------------------------------------------
    def save_checkpoint(self, path) -> None:
        """Write this rank's shards of parameters, buffers and optimizer state to ``path`` with
        ``torch.distributed.checkpoint``, keyed by the model's FQNs with DTensor layouts, so it
        loads under any plan and world size, or into a plain module (:mod:`fxpar.runtime.checkpoint`).
        Collective."""
        from fxpar.runtime.checkpoint import save

        save(self, path)

    def load_checkpoint(self, path) -> None:
        """Load a checkpoint written under any plan into this runner's shards (collective)."""
        from fxpar.runtime.checkpoint import load

        load(self, path)

    def load_hf_checkpoint(self, path, prefix: str | None = None) -> None:
        """Read a Hugging Face checkpoint directory (``save_pretrained``'s safetensors, one
        file or an index of shards) into this rank's shards, each rank reading only its
        slices (:mod:`fxpar.runtime.hf_checkpoint`); ``prefix``: the HF model's module path in
        the compiled module (``None``: found by suffix). Optimizer states are left as they
        are. Collective only in that every rank reads its part."""
        from fxpar.runtime.hf_checkpoint import HFCheckpoint

        mesh_shape, coord = self._where
        new = self._materialize(self._layouts, self._infos, mesh_shape, coord,
                                HFCheckpoint(path, prefix), 0)
        with torch.no_grad():
            for f, t in new.items():
                self.state[f].copy_(t)   # in place: the graphs, buckets and masters see it

    def save_hf_checkpoint(self, path) -> None:
        """Write the parameters and persistent buffers as a Hugging Face checkpoint directory
        (sharded safetensors and ``model.safetensors.index.json``) that ``from_pretrained``
        loads once a ``config.json`` is beside it; every rank writes what it owns, once
        (:mod:`fxpar.runtime.hf_checkpoint`). Collective."""
        from fxpar.runtime.hf_checkpoint import save_hf

        save_hf(self, path)

    def optimizer_step(self) -> None:
        """Optimizer step on the local shards, parameters restored, gradients zeroed."""
        self.states.step()
        self.states.zero_grad()

    def step(self, *args, **kwargs) -> torch.Tensor:
        """One training step on the global batch ``(*args, **kwargs)`` (the same on every rank;
        a :class:`Runner` with ``local_batch=True``: this rank's piece): forward and backward
        (a pipeline: its schedule), gradient reduction, optimizer step. Returns the detached
        loss (the same on every rank)."""
        loss = self.forward_backward(*args, **kwargs)
        self.optimizer_step()
        return loss

