"""The pipeline interpreter: one rank runs its schedule's action list on ``torch.distributed``.

A pipeline :class:`~fxpar.program.Program` holds one sub-program per stage chunk (its own plan
on its stage's submesh, its own rank graphs). :class:`PipelineRunner` (built by
``Program.runner()`` under torchrun, on every rank) does:

1. the plan-hash exchange and world-size check of :class:`~fxpar.runtime.runner.Runner` (the
   per-rank setup both runners share: :class:`fxpar.runtime.rank.RankRunner`, steps 1, 3, 4);
2. one ``DeviceMesh`` of the whole mesh, made on every rank (making one is collective); each
   chunk's communication runs on the slice of it without ``pp`` (this rank's stage submesh);
3. materializes this rank's shards of every parameter its chunks use (a parameter used by two
   chunks of this rank is one tensor; used on two pipeline ranks, e.g. a tied embedding and LM
   head, each holds a copy with the same layout);
4. one :class:`~fxpar.runtime.model_state.ModelStates` for all its chunks: a parameter's
   replica group is taken over the WHOLE mesh (the mesh axes its gradient is partial over,
   plus, for a parameter on several pipeline ranks, those ranks), so every rank sees the same
   partitions and the tied copies' gradients are summed as Megatron's embedding group does;
   every gradient contribution of every microbatch is declared, so buckets reduce
   asynchronously during the last microbatch's backward;
5. ``step(*batch)``: the global batch is cut into ``m`` microbatches along dim 0; the actions
   of :attr:`fxpar.schedule.Schedule.actions` for this pipeline rank run in order:

   ========  ==================================================================================
   F k i     chunk ``k``'s rank graph on microbatch ``i`` (boundary inputs as leaves that
             require grad; user inputs sliced and distributed to this rank's local shard;
             dropout draws from the RNG tracker at microbatch ``i``, and so does its backward)
   B k i     ``autograd.backward`` of its outputs with their received gradients (the last
             chunk: its loss ``/ m``, so the sum over microbatches is the whole batch's mean)
   I k i     the input gradients (sent back at once), leaving the weight gradients to W: a
             chunk whose every matrix is a linear's weight runs one backward in which each
             linear keeps its input and output gradient (:mod:`fxpar.runtime.deferred`, as
             Megatron's zero-bubble linears do); another keeps the gradients reaching the
             nodes where the weights' paths join the input path (torch.distributed.
             pipelining's ``stage_backward_input``)
   W k i     the weight gradients from those (``dW = dYᵀ·X`` per kept linear, or torch's
             ``stage_backward_weight``), into the model states
   SEND_*    equal layouts on both sides: ``batch_isend_irecv`` of the local shards to the rank
             at the same submesh coordinate of the neighbouring stage, or of ``1/t`` of one
             where the plan chose scatter/gather (``StagePlan.scatter``); different layouts
             (``StagePlan.out_specs`` vs the next chunk's ``in_specs``): the unit tasks of a
             cross-mesh plan (:func:`fxpar.runtime.redistribute_cross.cross_mesh_start`), sent without
             waiting; sends complete at the end of the step
   RECV_*    the same, received (waited at once; under gloo posted ahead, at the step's
             start, :meth:`PipelineRunner._ahead`), scattered pieces all-gathered over their
             submesh axis
   ========  ==================================================================================

   then gradients are finished (``ModelStates.finish_backward``), the optimizer steps on the
   local shards, and the loss (mean over microbatches) is broadcast from the last stage. A
   guard of a value capture specialized (``fxpar.guard_value``) that failed on some stage
   raises its :class:`~fxpar.errors.GuardError` on every rank after the gradients are
   finished (then dropped) and before the optimizer steps
   (:meth:`PipelineRunner._raise_guard_failures`).

Recomputation (``recompute=``: layer names or ``"all"``; default the plan's
``schedule["recompute"]``): a chunk holding recomputed layers runs its forward through
:class:`~fxpar.runtime.recompute.Recompute`, so per microbatch in flight it keeps only those
layers' inputs; each ``B`` re-runs their forward (and the collectives in them) once. Under
ZB-H1, a deferred chunk recomputes once, in ``I``; under torch's split ``I`` and ``W`` are two
backward passes and each recomputes what it needs (``W`` once per weight group
``stage_backward_weight`` forms), correct but more recomputation than ``B``.

Tags: every message carries ``tag = 2·(k·m + i) + direction``, so sends and receives between
one pair of ranks match by what they carry, not by arrival order (gloo; NCCL matches in order,
which the schedules' lowering keeps).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
import torch.fx as fx

from fxpar import ir
from fxpar.defaults import BUCKET_BYTES, PREPOST_BYTES
from fxpar.errors import FxparError, GuardError, PlanError
from fxpar.runtime.bindings import Bindings, bind
from fxpar.runtime.comm import gathers_params
from fxpar.runtime.rank import RankRunner, clip_grad_norm
from fxpar.runtime.recompute import Recompute, known_layers
from fxpar.runtime.runner import compiled, recompute_layers
from fxpar.schedule.actions import COMPUTE_KINDS, RECV_KINDS, Action
from fxpar.schedule.actions import ActionKind as K
from fxpar.split import is_boundary

__all__ = ["PipelineRunner", "SPLIT_BACKWARD", "PREPOST", "PREPOST_POLICIES"]

#: whether ``I``/``W`` actions split backward into input and weight gradients (``False``: ``I``
#: runs the whole backward, ``W`` nothing; for comparisons)
SPLIT_BACKWARD = True
#: under gloo, receives are posted ahead of their actions (:meth:`PipelineRunner._ahead`):
#: ``"step"`` all of a step's at its start (within :data:`~fxpar.defaults.PREPOST_BYTES`),
#: ``"compute"`` a compute action's successor's before it runs, ``"off"`` each at its own
#: action (for comparisons); a runner reads it when built (its ``prepost`` attribute)
PREPOST = "step"
PREPOST_POLICIES = ("step", "compute", "off")


@dataclass(eq=False)
class _Chunk:
    """One stage chunk on this rank: its rank graph and what running it needs."""

    index: int
    gm: fx.GraphModule
    order: list[str]                 # parameter fqns in placeholder order
    inputs: list[fx.Node]            # input placeholders in order
    bindings: Bindings
    last: bool
    # per microbatch: (input leaves that need a gradient, outputs, regather)
    saved: dict[int, tuple] = field(default_factory=dict)
    # per microbatch after I: what W computes (None: I ran the whole backward)
    pending_w: dict[int, tuple | None] = field(default_factory=dict)
    # parameters it uses directly (their gradient accumulates on the leaf)
    direct: list[str] = field(default_factory=list)
    # what runs its forward: ``gm``, or a Recompute of it
    run: object = None
    # whether its forward gathers a parameter (then it runs under Regather)
    gathers: bool = False
    # whether I can leave its weight gradients to W (_splittable; None: not yet known). Its
    # autograd graph has the same shape every microbatch: found once, not walked per action
    splittable: bool | None = None
    # parameters whose gradients W computes from what I kept (fxpar.runtime.deferred); empty:
    # torch's split (stage_backward_input/weight) or none
    deferred: list[str] = field(default_factory=list)


class PipelineRunner(RankRunner):
    """This rank's part of a pipeline program (module docstring)."""

    def __init__(self, program, weights=None, *, s_g=1, s_os=1, seed=0, device=None,
                 bucket_bytes=BUCKET_BYTES, regather=True, recompute=None, compile=False,
                 reduce_dtype=None, recompute_granularity="full") -> None:
        super().__init__(program, device=device, seed=seed)
        self.regather = regather
        self._peers: dict[int, int] = {}     # chunk -> the rank this rank exchanges with there
        self._gloo = dist.get_backend() == "gloo"
        self.schedule = program.schedule
        mesh, sched = program.mesh, program.schedule
        self.m = sched.microbatches
        coord = mesh.coord(self.rank)
        pp = mesh.axis_names.index("pp")
        self.pp_rank = coord[pp]
        sub_axes = tuple(a for a in mesh.axis_names if a != "pp")
        self._dm = program.device_mesh()
        sub_dm = self._dm[sub_axes] if len(sub_axes) > 1 else self._dm[sub_axes[0]]
        self._sub_dm = sub_dm
        self.chunks: dict[int, _Chunk] = {}
        layouts: dict[str, tuple] = {}
        sub_mesh = None
        for st in program.plan.stages:
            if st.rank != self.pp_rank:
                continue
            sp = program.stage_programs[st.index]
            sub_mesh = sp.mesh
            gm = sp.rank_graph(self.rank, self.device)
            holders = [n for n in gm.graph.find_nodes(op="placeholder") if ir.PARAM in n.meta]
            for n in holders:
                f, lay = n.meta[ir.PARAM].fqn, (n.meta[ir.SPECS][0], n.meta[ir.PARAM].shape)
                if layouts.setdefault(f, lay)[0] != lay[0]:
                    raise PlanError(f"parameter {f!r} has layout {layouts[f][0]} in one stage "
                                    f"chunk and {lay[0]} in chunk {st.index} of the same rank")
            b = Bindings(gm.meta.get(ir.EDGES, {}), sub_mesh, tuple(sp.mesh.coord(self.rank)),
                         sink=self._sink, tracker=self.tracker, fresh_grads=bool(compile))
            b._device_mesh = sub_dm
            self.chunks[st.index] = _Chunk(
                st.index, gm, [n.meta[ir.PARAM].fqn for n in holders],
                [n for n in gm.graph.find_nodes(op="placeholder") if ir.INPUT in n.meta], b,
                st.index == len(program.plan.stages) - 1)
        self.sub_mesh, self.sub_coord = sub_mesh, tuple(sub_mesh.coord(self.rank))
        #: the layers recomputed in backward, over the whole pipeline (the same on every rank);
        #: each chunk runs the ones it holds (:mod:`fxpar.runtime.recompute`)
        known = {lay for st in program.plan.stages for lay in st.layers}
        for c in self.chunks.values():
            known |= known_layers(c.gm)
        self.recompute = recompute_layers(program, recompute, known, recompute_granularity)
        for c in self.chunks.values():
            mine = self.recompute & known_layers(c.gm)
            c.run = (compiled(c.gm, compile, mine) if compile
                     else Recompute(c.gm, mine, recompute_granularity) if mine else c.gm)
            c.gathers = gathers_params(c.gm.meta.get(ir.EDGES, {}))
        #: boundary values whose layouts differ across a link: their cross-mesh plans
        self._xm = self._cross_mesh_plans()
        #: storage spec of every parameter and buffer on this rank (on the stage submesh)
        self.specs = {f: spec for f, (spec, _) in layouts.items()}
        #: the bindings of this rank's first chunk: its ``device_mesh`` is the stage submesh's
        #: (what checkpoints lay DTensors out on)
        self.bindings = next(iter(self.chunks.values())).bindings
        infos = {f: i for c in self.chunks.values() for f, i in ir.params(c.gm).items()}
        self.state = self._materialize(layouts, infos, sub_mesh.shape, self.sub_coord, weights, seed)
        #: ``I`` actions that left the weight gradients to their ``W`` (the others ran whole)
        self.split_backwards = 0
        self.prepost = PREPOST
        self._ahead_at: dict | None = None   # receives to post early, by action (_ahead)
        # A failing guard (fxpar.guard_value) is collected and raised on every rank at the end
        # of the step: raised at once on its stage, the other stages would wait on it. Known
        # from the global graph, so every rank runs the check's collective or none does.
        from fxpar.runtime.guards import GUARD_VALUE

        self._guarded = bool(program.graph.graph.find_nodes(op="call_function", target=GUARD_VALUE))
        self._guard_failures: list = []
        for c in self.chunks.values():
            c.bindings.guard_failures = self._guard_failures if self._guarded else None
        if not program.training:
            return
        params = self._trainable()
        groups = {f: program.replica_group(f, self.rank) for f in params}
        # a gradient already complete on this rank over an axis its group sums over (another
        # chunk's is partial there: a tied copy) is the same on each rank of that axis; each
        # adds its share so the group's sum counts it once
        scale = {}
        for f in params:
            mine = program.replica_axes(f, self.pp_rank)
            n = math.prod(mesh.axis_size(a) for a in program.replica_axes(f) if a not in mine)
            if n > 1:
                scale[f] = 1.0 / n
        # A use through a communication op sends its gradient to the sink per microbatch;
        # direct uses accumulate on the leaf (``.grad``, in place) over every microbatch and
        # chunk, handed to the model states once, with the last (``RankRunner._direct``).
        direct = self._init_model_states(params, groups, [(c.gm, self.m) for c in self.chunks.values()],
                                         s_g=s_g, s_os=s_os, bucket_bytes=bucket_bytes,
                                         grad_scale=scale, compile=compile,
                                         reduce_dtype=reduce_dtype)
        for c, fqns in zip(self.chunks.values(), direct):
            c.direct = fqns
            if SPLIT_BACKWARD and not compile and c.index and not c.gathers and self._splits(c.index):
                self._defer(c)

    def _splits(self, k: int) -> bool:
        """Whether the schedule runs chunk ``k``'s backward as ``I`` and ``W``."""
        return any(a.kind is K.I and a.stage == k for row in self.schedule.actions.values() for a in row)

    def _defer(self, c: _Chunk) -> None:
        """Chunk ``c`` on a copy of its graph whose linears leave their weight gradients to
        ``W`` (:func:`fxpar.runtime.deferred.defer_weight_grads`; ``c.deferred``), when that
        covers every matrix it uses directly (else torch's split, which splits any op, serves
        it: nothing changes)."""
        from fxpar.runtime.deferred import defer_weight_grads

        mats = {n.name: n.meta[ir.PARAM].fqn for n in c.gm.graph.find_nodes(op="placeholder")
                if ir.PARAM in n.meta and n.meta[ir.PARAM].fqn in c.direct
                and self.state[n.meta[ir.PARAM].fqn].requires_grad
                and self.state[n.meta[ir.PARAM].fqn].ndim >= 2}
        gm, fqns = defer_weight_grads(c.gm, mats)
        if not mats or len(fqns) < len(mats):
            return
        c.gm, c.deferred = gm, fqns
        c.inputs = [n for n in c.gm.graph.find_nodes(op="placeholder") if ir.INPUT in n.meta]
        if isinstance(c.run, Recompute):   # its segments are copies of the graph
            c.run = Recompute(c.gm, c.run.layers, c.run.granularity)
        else:
            c.run = c.gm

    @property
    def recomputed(self) -> int:
        """Recomputed layer forwards run in backward so far, over this rank's chunks."""
        return sum(c.run.recomputed for c in self.chunks.values() if isinstance(c.run, Recompute))

    # -- point to point ----------------------------------------------------------------------
    def _peer(self, chunk: int) -> int:
        """Global rank at this rank's submesh coordinate in ``chunk``'s stage."""
        if chunk not in self._peers:
            sub = self.program.stage_programs[chunk].mesh
            self._peers[chunk] = int(np.asarray(sub.devices).reshape(sub.shape)[self.sub_coord])
        return self._peers[chunk]

    def _p2p(self, ops) -> list:
        """Issue point-to-point ``ops``: one ``batch_isend_irecv`` (NCCL coalesces them), or
        under gloo, which does not, each directly (``batch_isend_irecv`` only adds its checks)."""
        if not ops:
            return []
        if self._gloo:
            return [op.op(op.tensor, op.peer, tag=op.tag) for op in ops]
        return dist.batch_isend_irecv(ops)

    def _tag(self, k: int, i: int, direction: int) -> int:
        return 2 * (k * self.m + i) + direction

    def _piece(self, t: torch.Tensor, axis: str) -> torch.Tensor:
        """This rank's ``1/t`` of ``t`` (flat, the last piece zero-padded) for scatter/gather
        over submesh ``axis``."""
        a = self.sub_mesh.axis_names.index(axis)
        n, k = t.numel(), self.sub_mesh.shape[a]
        size = -(-n // k)
        flat = t.reshape(-1)
        c = self.sub_coord[a]
        piece = flat[c * size:(c + 1) * size]
        return piece if piece.numel() == size else torch.cat([piece, flat.new_zeros(size - piece.numel())])

    def _send(self, tensors, axes, peer: int, tag: int) -> None:
        """Send ``tensors`` to ``peer``: whole, or this rank's piece where ``axes`` names the
        scatter/gather axis (``""``: whole)."""
        ops = [dist.P2POp(dist.isend, (self._piece(t, ax) if ax else t).contiguous(), peer, tag=tag)
               for t, ax in zip(tensors, axes or [""] * len(tensors), strict=True)]
        if ops:
            self._sends += [(w, ops) for w in self._p2p(ops)]

    def _buffer_shape(self, v, axis: str) -> tuple[int, ...]:
        """Shape of the buffer receiving value ``v``: whole, or (``axis`` a scatter axis) this
        rank's flat piece (:meth:`_piece`)."""
        if not axis:
            return tuple(v.shape)
        return (-(-v.numel() // self.sub_mesh.shape[self.sub_mesh.axis_names.index(axis)]),)

    def _post(self, metas, axes, peer: int, tag: int):
        """Post the receives of :meth:`_recv` (buffers of ``metas``' shapes, or of this rank's
        piece where ``axes`` names a scatter axis) without waiting: ``(buffers, works)``."""
        axes = axes or [""] * len(metas)
        bufs = [torch.empty(self._buffer_shape(v, ax), dtype=v.dtype, device=self.device)
                for v, ax in zip(metas, axes, strict=True)]
        ops = [dist.P2POp(dist.irecv, b, peer, tag=tag) for b in bufs]
        return bufs, self._p2p(ops)

    def _recv(self, metas, axes, peer: int, tag: int, posted=None) -> list[torch.Tensor]:
        """Receive tensors of ``metas``' shapes from ``peer`` (``posted``: what :meth:`_post`
        returned for them earlier; else posted now), waited at once; a scattered one arrives as
        this rank's piece and is all-gathered over its axis (Megatron's scatter/gather)."""
        axes = axes or [""] * len(metas)
        bufs, works = posted or self._post(metas, axes, peer, tag)
        for w in works:
            w.wait()
        out = []
        for b, v, ax in zip(bufs, metas, axes):
            if ax:
                k = self.sub_mesh.shape[self.sub_mesh.axis_names.index(ax)]
                full = torch.empty(k * b.numel(), dtype=b.dtype, device=self.device)
                dist.all_gather_into_tensor(full, b, group=self._sub_dm.get_group(ax))
                b = full[:v.numel()].view(tuple(v.shape))
            out.append(b)
        return out

    # -- stage boundaries ----------------------------------------------------------------------
    def _cross_mesh_plans(self) -> dict[tuple[int, int], tuple]:
        """``{(link, value): (forward plan, gradient plan)}`` for every boundary value whose
        layouts differ on the two sides (link ``l``: chunk ``l`` to ``l + 1``), prepared in one
        order on every rank (making their process groups is collective over the world)."""
        from fxpar.resharding.cross import cross_mesh_plan
        from fxpar.runtime.redistribute_cross import prepare_cross_mesh

        st, progs = self.program.plan.stages, self.program.stage_programs
        plans = {}
        for l in range(len(st) - 1):
            a, b = progs[l].mesh, progs[l + 1].mesh
            vals = {n.name: n.meta[ir.VAL] for n in progs[l].graph.graph.nodes}
            for j, (name, out, inp) in enumerate(zip(st[l].outputs, st[l].out_specs,
                                                     st[l + 1].in_specs)):
                if out == inp:
                    continue
                shape, dtype = tuple(vals[name].shape), vals[name].dtype
                pair = (cross_mesh_plan(a, out, b, inp, shape=shape, dtype=dtype, strategy="send_recv"),
                        cross_mesh_plan(b, inp, a, out, shape=shape, dtype=dtype, strategy="send_recv"))
                for pl in pair:
                    prepare_cross_mesh(pl)
                plans[l, j] = pair
        return plans

    def _xtag(self, l: int, i: int, direction: int, j: int) -> int:
        """A cross-mesh value's tag: above every send/recv tag, one per value."""
        return 2 * len(self.program.plan.stages) * self.m * (1 + j) + self._tag(l, i, direction)

    def _send_link(self, l: int, i: int, direction: int, tensors, peer: int) -> None:
        """Send link ``l``'s values (``direction`` 0: chunk ``l``'s outputs forward, 1: their
        gradients back): equal layouts to ``peer`` (whole or scattered), the others by their
        cross-mesh plan, without waiting for the receivers."""
        from fxpar.runtime.redistribute_cross import cross_mesh_start

        st = self.program.plan.stages[l]
        plain = [(t, ax) for j, (t, ax) in enumerate(zip(tensors, st.scatter))
                 if (l, j) not in self._xm]
        self._send([t for t, _ in plain], [ax for _, ax in plain], peer, self._tag(l, i, direction))
        for j, t in enumerate(tensors):
            if (l, j) in self._xm:
                _, works = cross_mesh_start(self._xm[l, j][direction], t.contiguous(),
                                            tag=self._xtag(l, i, direction, j))
                self._sends += [(w, t) for w in works]

    def _plain(self, l: int, n: int) -> tuple[list[int], list[str]]:
        """Link ``l``'s values (of ``n``) sent point to point, not by a cross-mesh plan, and
        their scatter axes."""
        idx = [j for j in range(n) if (l, j) not in self._xm]
        return idx, [self.program.plan.stages[l].scatter[j] for j in idx]

    def _prepost(self, l: int, i: int, direction: int, metas, peer: int) -> None:
        """Post :meth:`_recv_link`'s point-to-point receives ahead of its action (gloo only:
        :data:`PREPOST`); its action then only waits."""
        idx, axes = self._plain(l, len(metas))
        self._posted[l, i, direction] = self._post([metas[j] for j in idx], axes, peer,
                                                   self._tag(l, i, direction))

    def _recv_link(self, l: int, i: int, direction: int, metas, peer: int) -> list[torch.Tensor]:
        """Receive what :meth:`_send_link` sent, in value order."""
        from fxpar.runtime.redistribute_cross import cross_mesh_start

        idx, axes = self._plain(l, len(metas))
        got = dict(zip(idx, self._recv([metas[j] for j in idx], axes, peer,
                                       self._tag(l, i, direction),
                                       self._posted.pop((l, i, direction), None))))
        for j in range(len(metas)):
            if (l, j) in self._xm:
                got[j], _ = cross_mesh_start(self._xm[l, j][direction], None, device=self.device,
                                             tag=self._xtag(l, i, direction, j))
        return [got[j] for j in range(len(metas))]

    # -- actions -----------------------------------------------------------------------------
    def _boundary_inputs(self, c: _Chunk) -> list[fx.Node]:
        return [n for n in c.inputs if is_boundary(n.meta[ir.INPUT])]

    def _forward(self, k: int, i: int, batch) -> None:
        c = self.chunks[k]
        boundary = self._fwd_in.pop((k, i), [])
        it = iter(boundary)
        args, leaves = [], []
        from fxpar.runtime.redistribute import distribute

        for n in c.inputs:
            info = n.meta[ir.INPUT]
            if is_boundary(info):
                x = next(it)
                if info.requires_grad:
                    x = x.detach().requires_grad_(True)
                    leaves.append(x)
                args.append(x)
            elif not info.is_tensor:
                args.append(info.value)
            else:
                j = self.program.user_index(n.name)
                x = batch[j]
                mb = x[i * info.shape[0]:(i + 1) * info.shape[0]]
                args.append(distribute(mb, n.meta[ir.SPECS][0], self.sub_mesh.shape,
                                       self.sub_coord).to(self.device))
        from fxpar.runtime.comm import Regather

        with bind(c.bindings):
            with Regather() if (self.regather and c.gathers and self.states is not None) else \
                    contextlib.nullcontext() as rg:
                c.bindings.regather = rg
                try:
                    out = c.run(*[self.state[f] for f in c.order], *args)
                finally:
                    c.bindings.regather = None
        out = list(out) if isinstance(out, (tuple, list)) else [out]
        c.saved[i] = (leaves, out, rg)
        if c.last:
            loss = out[0]
            if not (isinstance(loss, torch.Tensor) and loss.ndim == 0 and loss.is_floating_point()):
                raise FxparError("the compiled model's first output is not a scalar loss; pass "
                                 "loss_fn=... to fxpar.compile")
            self._losses.append(loss.detach())
        elif k + 1 in self.chunks:  # the next chunk runs here too: no transfer
            self._fwd_in[(k + 1, i)] = [o.detach() for o in out]

    def _backward(self, k: int, i: int, split: bool = False) -> None:
        """``B`` (``split=False``) or ``I``: the chunk's backward from its output gradients.
        ``I`` computes only the input gradients and keeps, for ``W``, the gradients that
        reach the nodes where the weights' paths join the input path (torch.distributed.
        pipelining's ``stage_backward_input``); with no input needing a gradient (the first
        chunk) or a weight whose path never joins it, ``I`` runs the whole backward and ``W``
        has nothing left."""
        c = self.chunks[k]
        leaves, out, rg = c.saved.pop(i)
        if self.states is None:
            raise FxparError("training steps need a program compiled with training=True")
        if c.last:
            tensors, grads = [out[0]], [torch.full_like(out[0], 1.0 / self.m)]
        else:
            got = self._bwd_in.pop((k, i))
            pairs = [(o, g) for o, g in zip(out, got) if isinstance(o, torch.Tensor) and o.requires_grad]
            tensors, grads = [o for o, _ in pairs], [g for _, g in pairs]
        weights = [self.state[f] for f in dict.fromkeys(c.order) if self.state[f].requires_grad]
        if split and c.deferred:   # linears keep (W, X, dY) for W; the rest runs whole
            from fxpar.runtime.deferred import collecting

            with bind(c.bindings), collecting() as kept:
                if tensors:
                    torch.autograd.backward(tensors, grads)
            c.pending_w[i] = (kept, None, rg)
            self.split_backwards += 1
        else:
            if split and leaves and c.splittable is None:
                c.splittable = self._splittable(tensors, leaves, weights)
            with bind(c.bindings):
                groups = (self._split_input(tensors, grads, leaves, weights)
                          if split and leaves and c.splittable else None)
                if groups is None and tensors:
                    torch.autograd.backward(tensors, grads)
            c.pending_w[i] = (groups, weights, rg) if groups is not None else None
            self.split_backwards += groups is not None
        gs = [x.grad if x.grad is not None else torch.zeros_like(x) for x in leaves]
        if k - 1 in self.chunks:
            # the previous chunk runs here too: its output gradients, in output order
            prev = self.chunks[k - 1]
            want = self.program.plan.stages[k - 1].outputs
            mine = [n.name for n in self._boundary_inputs(c) if n.meta[ir.INPUT].requires_grad]
            self._bwd_in[(k - 1, i)] = self._align(prev, want, mine, gs, i)
        else:
            self._bwd_out[(k, i)] = gs

    @staticmethod
    def _splittable(tensors, leaves, weights) -> bool:
        """Whether every weight the outputs reach joins the input path, so that ``I`` can
        leave its gradient to ``W`` (else ``I`` runs the whole backward)."""
        from torch.distributed.pipelining._backward import construct_reverse_graph, get_param_groups
        from torch.distributed.pipelining._backward import _get_grad_fn_or_grad_acc as node_of

        rev = construct_reverse_graph([n for n in map(node_of, tensors) if n is not None])
        wnodes = [n for n in map(node_of, weights) if n is not None]
        covered = set().union(*(g["params"] for g in get_param_groups(
            [n for n in map(node_of, leaves) if n is not None], wnodes, rev))) if wnodes else set()
        return not {w for w in wnodes if w in rev} - covered

    @staticmethod
    def _split_input(tensors, grads, leaves, weights):
        """Input gradients now (into ``leaves[j].grad``); returns the weight groups for ``W``
        (the chunk must be :meth:`_splittable`)."""
        from torch.distributed.pipelining._backward import stage_backward_input

        # torch detaches the outputs in place afterwards, which a view refuses (a loss that
        # came back from a collective's wait): a copy of a view goes in its place
        tensors = [t.clone() if t._is_view() else t for t in tensors]
        _, groups = stage_backward_input(tensors, grads, leaves, iter(weights))
        return groups

    def _weight(self, k: int, i: int) -> None:
        """``W``: the weight gradients ``I`` left (torch's ``stage_backward_weight``): onto the
        leaves (counted as the leaf hook counts a ``B``), or, for a use through a
        communication op, to the sink on the way."""
        from torch.distributed.pipelining._backward import stage_backward_weight

        c = self.chunks[k]
        if i not in c.pending_w:
            raise FxparError(f"action {k}W{i}: its {k}I{i} has not run")
        pending = c.pending_w.pop(i)
        if pending is None:  # I ran the whole backward
            return
        groups, weights, rg = pending
        if weights is None:   # deferred linears (fxpar.runtime.deferred); the rest ran in I
            from fxpar.runtime.deferred import weight_grads

            weight_grads(groups)
            done = c.deferred
        else:
            with bind(c.bindings):
                stage_backward_weight(iter(weights), groups)  # into the leaves' .grad (no hooks)
            done = c.direct
        for f in done:
            self._direct(f)
        del rg

    def _align(self, prev: _Chunk, want, names, grads, i):
        """The gradients of ``prev``'s outputs (in its output order) from the next chunk's
        boundary-input gradients (``names``/``grads``); outputs without one get zeros."""
        by = dict(zip(names, grads))
        _, outs, _ = prev.saved[i]
        return [by[nm] if nm in by else torch.zeros_like(o) for nm, o in zip(want, outs)]

    def _run(self, action, batch) -> None:
        if action.kind in COMPUTE_KINDS:
            # random ops (dropout) draw by (step, microbatch, site, shard): the same mask in
            # a microbatch's forward and its backward, whatever ran in between
            self.tracker.set_microbatch(action.microbatch)
        run = self._ACTIONS.get(action.kind)
        if run is None:
            raise FxparError(f"action {action}: the interpreter does not run {action.kind!r} yet")
        run(self, action.stage, action.microbatch, batch)

    # one method per action kind: (chunk k, microbatch i, the flat global batch)
    def _act_forward(self, k, i, batch) -> None:
        self._forward(k, i, batch)

    def _act_backward(self, k, i, batch) -> None:
        if self.chunks[k].deferred:
            # a chunk whose linears leave their weight gradients to W (it runs some I's, as
            # DualPipeV's tail) runs a whole backward as its I and W back to back
            n = self.split_backwards
            self._backward(k, i, split=True)
            self._weight(k, i)
            self.split_backwards = n
        else:
            self._backward(k, i, split=False)

    def _act_input_grad(self, k, i, batch) -> None:
        # a chunk that gathers parameters (ZeRO-3) runs I whole: a split W would re-read
        # the gathered copies I released, and the sink, not the leaf, takes their gradient
        self._backward(k, i, split=SPLIT_BACKWARD and not self.chunks[k].gathers)

    def _act_weight_grad(self, k, i, batch) -> None:
        self._weight(k, i)

    def _act_send_f(self, k, i, batch) -> None:
        _, out, _ = self.chunks[k].saved[i]
        self._send_link(k, i, 0, [o.detach() for o in out], self._peer(k + 1))

    def _recv_args(self, kind, k: int, i: int) -> tuple:
        """``(link, microbatch, direction, metas, peer)`` of the receive action ``k{kind}i``."""
        if kind is K.RECV_F:
            return (k - 1, i, 0, [n.meta[ir.VAL] for n in self._boundary_inputs(self.chunks[k])],
                    self._peer(k - 1))
        return k, i, 1, self._out_metas(self.chunks[k]), self._peer(k + 1)

    def _act_recv_f(self, k, i, batch) -> None:
        self._fwd_in[(k, i)] = self._recv_link(*self._recv_args(K.RECV_F, k, i))

    def _act_send_b(self, k, i, batch) -> None:
        c = self.chunks[k]
        grads = self._bwd_out.pop((k, i))
        names = [n.name for n in self._boundary_inputs(c) if n.meta[ir.INPUT].requires_grad]
        # the previous chunk's outputs are this chunk's boundary inputs, in one order
        by = dict(zip(names, grads))
        vals = {n.name: n.meta[ir.VAL] for n in self._boundary_inputs(c)}
        send = [by[nm] if nm in by else torch.zeros(tuple(vals[nm].shape), dtype=vals[nm].dtype)
                for nm in self.program.plan.stages[k - 1].outputs]
        self._send_link(k - 1, i, 1, send, self._peer(k - 1))

    def _act_recv_b(self, k, i, batch) -> None:
        self._bwd_in[(k, i)] = self._recv_link(*self._recv_args(K.RECV_B, k, i))

    def _act_reduce_grad(self, k, i, batch) -> None:
        pass  # buckets launch as their last contribution arrives; finished after the list

    _ACTIONS = {K.F: _act_forward, K.B: _act_backward, K.I: _act_input_grad, K.W: _act_weight_grad,
                K.SEND_F: _act_send_f, K.RECV_F: _act_recv_f, K.SEND_B: _act_send_b,
                K.RECV_B: _act_recv_b, K.REDUCE_GRAD: _act_reduce_grad}

    @staticmethod
    def _out_metas(c: _Chunk):
        out = next(iter(c.gm.graph.find_nodes(op="output")))
        return [a.meta[ir.VAL] for a in out.args[0]]

    # -- steps -------------------------------------------------------------------------------
    def forward_backward(self, *args, **kwargs) -> torch.Tensor:
        """Every action of this rank's list on the global batch; gradients reduced, no
        optimizer step. Returns the loss (mean over microbatches; the same on every rank)."""
        loss, work = self._schedule(args, kwargs)
        work.wait()
        return loss

    def step(self, *args, **kwargs) -> torch.Tensor:
        """One training step on the global batch: the schedule, gradient reduction, optimizer
        step (each bucket's as its reduction is waited; after the guards' check where the
        program has guards); the loss's broadcast from the last stage is waited last. Returns
        the detached loss (the same on every rank)."""
        loss, work = self._schedule(args, kwargs, step=not self._guarded)
        if self._guarded:  # a failed guard drops the step's gradients before any is applied
            self.states.step()
        self.states.zero_grad()
        work.wait()
        return loss

    def _ahead(self) -> dict[int, list[Action]]:
        """``{j: receives}``: the receive actions to post before running action ``j``. Only
        under gloo (:data:`PREPOST`, the runner's ``prepost``), where a posted receive blocks
        nothing: on NCCL an early receive would hold back the sends queued behind it on the
        same communicator, which the peer may be waiting for.

        ``"step"``: all of the step's receives before its first action, while no data moves
        yet, when their buffers fit in :data:`~fxpar.defaults.PREPOST_BYTES` (the buffers of
        the microbatches not yet in flight are the extra memory); otherwise, and under
        ``"compute"``, a compute action's successor's receives before it, so their data moves
        while it computes (torch.distributed.pipelining posts a step's receives with its
        sends). A receive posted while its peer's traffic arrives can wait in the caller for
        gloo's I/O thread: on 2 gloo ranks sharing 2 cores about one per interleaved step
        stalled ~5 ms that way (``benchmarks/prepost.py`` compares the policies)."""
        if self._ahead_at is None:
            if self.prepost not in PREPOST_POLICIES:
                raise FxparError(f"PipelineRunner.prepost: {self.prepost!r} is not one of "
                                 f"{PREPOST_POLICIES}")
            acts = self.schedule.actions[self.pp_rank]
            recvs = [a for a in acts if a.kind in RECV_KINDS]
            self._ahead_at = {}
            if self.prepost == "off" or not self._gloo or not recvs:
                pass
            elif (self.prepost == "step"
                    and sum(self._recv_bytes(a) for a in recvs) <= PREPOST_BYTES):
                self._ahead_at[0] = recvs
            else:
                computes = [j for j, a in enumerate(acts) if a.kind in COMPUTE_KINDS]
                for j, nxt in zip(computes, computes[1:]):
                    after = [a for a in acts[j + 1:nxt] if a.kind in RECV_KINDS]
                    if after:
                        self._ahead_at[j] = after
        return self._ahead_at

    def _recv_bytes(self, a: Action) -> int:
        """Bytes of the buffers :meth:`_prepost` allocates for receive action ``a``."""
        l, _, _, metas, _ = self._recv_args(a.kind, a.stage, a.microbatch)
        idx, axes = self._plain(l, len(metas))
        return sum(math.prod(self._buffer_shape(metas[j], ax)) * metas[j].dtype.itemsize
                   for j, ax in zip(idx, axes))

    def _schedule(self, args, kwargs, step: bool = False):
        """The action list, gradients finished (with ``step``: and the optimizer stepped,
        each bucket as its reduction is waited, :meth:`ModelStates.finish_backward_and_step`);
        ``(loss, work)`` of the loss's broadcast from the last stage, in flight."""
        if self.states is None:
            raise FxparError("training steps need a program compiled with training=True")
        batch = self.program.flat_batch(args, kwargs)
        self._fwd_in, self._bwd_in, self._bwd_out = {}, {}, {}
        self._losses: list[torch.Tensor] = []
        self._sends: list = []
        self._posted: dict = {}
        self.states.begin_backward()
        ahead = self._ahead()
        for j, action in enumerate(self.schedule.actions[self.pp_rank]):
            try:
                for a in ahead.get(j, ()):
                    self._prepost(*self._recv_args(a.kind, a.stage, a.microbatch))
                self._run(action, batch)
            except FxparError:
                raise
            except Exception as e:
                e.add_note(f"fxpar: while running action {action} on rank {self.rank} "
                           f"(pipeline rank {self.pp_rank})")
                raise
        for w, _ in self._sends:
            w.wait()
        self._sends.clear()
        if step:
            self.states.finish_backward_and_step()
        else:
            self.states.finish_backward()
        self.tracker.next_step()
        self._raise_guard_failures()
        loss = torch.stack(self._losses).mean() if self._losses else torch.zeros(())
        loss = loss.to(torch.float32).contiguous()
        return loss, dist.broadcast(loss, src=self.program.loss_rank(), async_op=True)

    def profile(self, *args, steps: int = 3, **kwargs):
        """Measure ``steps`` training steps (one warm-up step first) on the batch, action by
        action, beside each chunk plan's prediction: a :class:`fxpar.Profile` whose
        ``actions`` are this rank's (:func:`fxpar.runtime.profile.profile_pipeline`). The
        steps train. Collective: every rank calls it with the same ``steps``."""
        from fxpar.runtime.profile import profile_pipeline

        return profile_pipeline(self, args, kwargs, steps)

    def _raise_guard_failures(self) -> None:
        """Raise on every rank the first guard error of the lowest rank that had one this step
        (:mod:`fxpar.runtime.guards`), the step's gradients dropped; nothing when no guard
        failed. Collective when the program has guards: one all-reduce of a flag (and, only
        on a failure, a gather of the messages)."""
        if not self._guarded:
            return
        failed = torch.tensor(float(bool(self._guard_failures)), device=self.device)
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)
        if not failed.item():
            return
        mine = str(self._guard_failures[0]) if self._guard_failures else None
        self._guard_failures.clear()
        self.states.zero_grad()  # this step's gradients are of a wrong size or branch
        msgs: list = [None] * dist.get_world_size()
        dist.all_gather_object(msgs, mine)
        raise GuardError(next(m for m in msgs if m is not None))

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """As :meth:`fxpar.runtime.runner.Runner.clip_grad_norm_`, over every stage (a tied
        parameter's copies are one replica group, counted once). Collective."""
        # the axes each gradient's group reduced over (on every chunk, tied copies included)
        replica = {f: self.program.replica_axes(f) for f in self.specs}
        return clip_grad_norm(self.states, self.specs, self.sub_mesh, replica, max_norm,
                              norm_type, self.device)

