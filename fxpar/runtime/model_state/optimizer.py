"""The sharded optimizer: fp32 masters of this rank's chunks, the step, norms, saved state.

:class:`ShardedOptimizer` builds any ``torch.optim`` optimizer over one rank's optimizer
chunks (chunk ``k`` of ``s_os`` of each parameter's flat storage,
:mod:`~fxpar.runtime.model_state.layout`), steps it on the reduced gradients the gradient
buckets hold (:mod:`~fxpar.runtime.model_state.buckets`: views, no copy), and makes every rank's
storage whole again: ``s_os > 1``: all-gather of the updated chunks inside the ``s_os``
subgroup, ``(s_os−1)/s_os · eΦ`` per device (AMSP's ``T_os1``), in place, so ``param`` objects
stay valid.

Memory per rank (mixed precision, Adam): ``2Φ`` parameters + ``2Φ/s_g`` gradients + ``12Φ/s_os``
fp32 master, ``exp_avg``, ``exp_avg_sq`` — the AMSP formula with ``s_p = 1`` on the local
storage. fp32 parameters with ``s_os = 1`` are their own master (no copy). Special cases:
DDP = ``(1, 1)``, ZeRO-1 = ``(1, n)``, ZeRO-2 = ``(n, n)``, MiCS/HSDP-like = ``(s, s)`` with
``s < n``.

Because the optimizer sees per-chunk tensors, element-wise optimizers (SGD, Adam, AdamW,
Adagrad, RMSprop, …) give exactly the unsharded result; optimizers that couple elements of a
tensor (LBFGS, Adafactor, per-tensor norms) see chunks instead of tensors.

Flat step. If the optimizer is one of :data:`ELEMENTWISE`, it steps one tensor per (flat
bucket, param group) — a view of the bucket's storage, the parameters of a param group
contiguous in the bucket — whose gradient is a slice of the bucket's reduced buffer (no
copy): one kernel per operation instead of one per parameter, and per element the
per-parameter update (bitwise for AdamW on CPU, tested). On a CPU the segment is stepped in
pieces of at most :data:`fxpar.defaults.CPU_STEP_PIECE` elements (cut anywhere, across
parameters too: element-wise, so the same bits), whose temporaries stay below the
allocator's fresh-page threshold. Its states are per piece;
:meth:`ShardedOptimizer.optimizer_state` still gives them per parameter. Other optimizers
(built first over the segments, then again) get a master per parameter, as above.

Norms and clipping: :func:`grad_norm_term` (this rank's share of ``Σ |g|^p``, each distinct
element counted once over the world) and :func:`scale_grads` act on the reduced gradients
before the step.

One process, DDP factors (fp32: the flat bucket's storage is the master, no copy):

>>> import torch
>>> from fxpar.runtime.model_state.buckets import GradientBuckets
>>> from fxpar.runtime.model_state.layout import param_shards, rank_layouts
>>> w = torch.ones(4)
>>> shards = param_shards({"w": w}, {"w": None}, rank_layouts({"w": w}, {"w": None}, 1, 1))
>>> gb = GradientBuckets(shards)
>>> opt = ShardedOptimizer(gb._params, gb._buckets, lambda ps: torch.optim.SGD(ps, lr=0.5))
>>> gb.add_grad("w", torch.full((4,), 2.0)); gb.finish_backward()
>>> float(grad_norm_term(gb._buckets, 2.0, {}))      # Σ g² over the one copy
16.0
>>> opt.step(); w
tensor([0., 0., 0., 0.])
>>> opt.memory()
{'master': 0, 'optimizer': 0}
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from fxpar import defaults
from fxpar.runtime.model_state.buckets import Bucket
from fxpar.runtime.model_state.layout import ParamShard, lookup

__all__ = ["ELEMENTWISE", "FUSED", "IMPLEMENTATION", "ShardedOptimizer", "fuse", "param_options",
           "grad_norm_term", "scale_grads"]

#: optimizers whose update of an element reads only that element's parameter, gradient and
#: states (and per-tensor scalars that depend on the step count alone): stepping one flat
#: tensor for many parameters gives what stepping each does (checked against torch 2.13)
ELEMENTWISE = frozenset({torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW,
                         torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam,
                         torch.optim.Adagrad, torch.optim.RMSprop, torch.optim.Rprop,
                         torch.optim.ASGD})
#: param-group keys that choose how a torch optimizer steps, not what it computes: a loaded
#: optimizer state keeps the loading optimizer's own
IMPLEMENTATION = ("fused", "foreach", "capturable", "differentiable")
#: optimizers with a fused implementation (``fused=True``: one kernel per tensor for the whole
#: update, on CPUs and GPUs), which fxpar's runtime uses unless told otherwise (:func:`fuse`)
FUSED = frozenset({torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad})


def fuse(opt: torch.optim.Optimizer) -> bool:
    """Switch ``opt`` to its fused kernel (``group["fused"] = True``) when the user left the
    implementation to torch: a :data:`FUSED` type whose every group has ``fused`` and
    ``foreach`` unset (``None``), not ``differentiable`` nor ``capturable``, over floating
    tensors of a device torch has the kernel for; returns whether it did. The same update,
    element by element (within float rounding of the for-loop one torch picks on a CPU, and
    of the foreach one on a GPU), as Megatron-LM and DeepSpeed step with fused Adam and
    torchtitan's ``implementation = "fused"``: the for-loop step makes a temporary per
    operation (an 0.46 M-element AdamW step: 0.6 ms in 2**17 pieces, 0.2 ms fused, one CPU
    thread). Turned off by :data:`fxpar.defaults.FUSED_STEP` or by passing ``fused=False``
    (or any ``foreach``) to the optimizer.

    >>> w = torch.nn.Parameter(torch.zeros(3))
    >>> fuse(torch.optim.AdamW([w])), fuse(torch.optim.AdamW([w], fused=False))
    (True, False)
    """
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    if not defaults.FUSED_STEP or type(opt) not in FUSED:
        return False
    devices = _get_fused_kernels_supported_devices()
    for g in opt.param_groups:
        if (g.get("fused") is not None or g.get("foreach") is not None
                or g.get("differentiable") or g.get("capturable")):
            return False
        if not all(t.is_floating_point() and t.device.type in devices for t in g["params"]):
            return False
    for g in opt.param_groups:
        g["fused"] = True
    opt.defaults["fused"] = True
    return True


def param_options(fqns, param_groups: Callable[[str], Mapping] | None
                  ) -> tuple[dict[str, dict], dict[str, tuple]]:
    """``(options, keys)``: per parameter the optimizer options ``param_groups(fqn)`` gives
    (``{}`` without), and a hashable key of them: equal keys make one param group (and one
    segment of a flat bucket)."""
    opts = {f: dict(param_groups(f) or {}) if param_groups else {} for f in fqns}
    keys = {f: tuple(sorted((k, repr(v)) for k, v in o.items())) for f, o in opts.items()}
    return opts, keys


class ShardedOptimizer:
    """``optimizer(params_or_groups)`` over this rank's optimizer chunks of ``params``
    (:class:`ParamShard`, already in ``buckets``); ``options``/``keys``: per-parameter
    optimizer options and their hashable keys (:func:`param_options`; the keys the buckets'
    segments were made with), which become param groups when ``grouped``. ``piece``: the most
    elements of one optimizer tensor cut from a flat segment (``None``: the device's default,
    :data:`~fxpar.defaults.CPU_STEP_PIECE` on a CPU, whole segments elsewhere).
    ``self.optimizer`` is ``None`` when there are no parameters."""

    def __init__(self, params: Mapping[str, ParamShard], buckets: Sequence[Bucket],
                 optimizer: Callable[[list], torch.optim.Optimizer],
                 options: Mapping[str, dict] | None = None, keys: Mapping[str, tuple] | None = None,
                 grouped: bool = False, piece: int | None = None) -> None:
        self._params = params
        self._buckets = buckets
        self._piece = piece
        if options is None or keys is None:
            options, keys = param_options(params, None)
        self._opts, self._okey = options, keys
        self._make_masters(flat=True)
        self.optimizer = self._make_optimizer(optimizer, grouped)
        if type(self.optimizer) not in ELEMENTWISE and any(bk.flat for bk in buckets):
            # it may couple the elements of a tensor: one master per parameter, as it expects
            self._make_masters(flat=False)
            self.optimizer = self._make_optimizer(optimizer, grouped)
        #: ``None``: ``optimizer.step()`` runs eagerly; else its compiled twin (:meth:`compile`)
        self.compiled_step: Callable[[], object] | None = None
        self._gather_plan: list | None = None   # the post-step all-gathers (:meth:`_os_groups`)

    def compile(self, backend="inductor") -> bool:
        """Run the optimizer's ``step()`` under ``torch.compile`` from now on (``backend``: a
        backend name or callable), as PyTorch's compiled-optimizer recipe does: one fused
        kernel per flat segment instead of one per operation, for the built-in element-wise
        optimizers (:data:`ELEMENTWISE`; any other stays eager; returns whether it is
        compiled). The step then runs once per step, after every bucket is reduced
        (:meth:`steps_per_bucket` is false): stepping bucket by bucket would compile one
        variant per bucket. A float learning rate a scheduler changes becomes a dynamic input
        at its first change (dynamo's ``specialize_float=False``): one recompilation, not one
        per step. A fused optimizer (:func:`fuse`) stays eager: its one kernel per tensor is
        what compiling would make, and it can step bucket by bucket."""
        if (self.optimizer is None or type(self.optimizer) not in ELEMENTWISE
                or self.optimizer.defaults.get("fused")):
            return False
        step = torch.compile(self._eager_step, backend=backend)

        def run() -> None:
            # dynamo's recompile limit counts the variants of every optimizer of this type
            # in the process (each instance compiles its own): room for a few runners
            with torch._dynamo.config.patch(
                    recompile_limit=max(torch._dynamo.config.recompile_limit, 64)):
                step()
        self.compiled_step = run
        return True

    def _eager_step(self) -> None:
        self.optimizer.step()   # looked up per call: an LR scheduler's wrapper is seen

    # -- construction ------------------------------------------------------------------------
    def _make_masters(self, flat: bool) -> None:
        """The optimizer's tensors: with ``flat``, the pieces of each (bucket, param group)
        segment of each flat bucket (views of its storage; a parameter's ``master`` is its
        whole segment); the others one per parameter. ``_masters`` lists ``(tensor, bucket,
        start)``: its gradient is ``bucket.reduced[start:start + n]``; ``_pieces``: a
        segment's id -> ``(piece, offset in the segment)``, for segments cut in pieces."""
        self._masters: list[tuple[torch.Tensor, Bucket | None, int]] = []
        self._pieces: dict[int, list[tuple[torch.Tensor, int]]] = {}
        for bk in self._buckets:
            if not (flat and bk.flat):
                continue
            segs: dict[tuple, list[ParamShard]] = {}
            for p in bk.params:
                segs.setdefault(self._okey[p.fqn], []).append(p)
            for ps in segs.values():
                lo = ps[0].off
                master = bk.store[lo:ps[-1].off + ps[-1].numel]
                piece = self._piece or (defaults.CPU_STEP_PIECE if master.device.type == "cpu"
                                        else master.numel())
                if master.numel() > piece:
                    self._pieces[id(master)] = [(master[a:a + piece], a)
                                                for a in range(0, master.numel(), piece)]
                for t, a in self._pieces.get(id(master), [(master, 0)]):
                    self._masters.append((t, bk, lo + a))
                for p in ps:
                    p.master, p.moff, p.master_is_view = master, p.off - lo, True
        for p in self._params.values():
            if flat and p.bucket is not None and p.bucket.flat:
                continue
            t = p.tensor
            p.moff = 0
            if t.dtype == torch.float32 and p.lay.s_os == 1 and t.is_contiguous():
                # fp32 and unsharded: the parameter is its own master (a separate leaf tensor
                # over the same storage, so its .grad is ours, not the user's)
                p.master = t.detach().view(-1)
                p.master_is_view = True
            else:
                p.master = torch.zeros(p.cos, dtype=torch.float32, device=t.device)
                self._load_master(p)
            self._masters.append((p.master, p.bucket,
                                  p.off + p.lay.k * p.cos - p.lay.b * p.cg))

    @staticmethod
    def _load_master(p: ParamShard) -> None:
        if p.master_is_view:
            return
        lo, real = p.lay.k * p.cos, p.real
        with torch.no_grad():
            p.master.zero_()
            if real:
                p.master[:real].copy_(p.tensor.detach().reshape(-1)[lo:lo + real])
        p.version = p.tensor._version

    def _make_optimizer(self, optimizer, grouped: bool) -> torch.optim.Optimizer | None:
        if not self._params:  # a rank with nothing to train (a pipeline stage of loss ops)
            return None
        masters = {id(p.master): p for p in self._params.values()}  # first member of each
        if not grouped:
            opt = optimizer([t for p in masters.values() for t in self._tensors(p.master)])
        else:
            groups: dict[tuple, dict] = {}
            for p in masters.values():
                key = self._okey[p.fqn]
                groups.setdefault(key, {**self._opts[p.fqn], "params": []})["params"].extend(
                    self._tensors(p.master))
            opt = optimizer(list(groups.values()))
        fuse(opt)
        return opt

    def _tensors(self, master: torch.Tensor) -> list[torch.Tensor]:
        """The optimizer's tensors of ``master``: its pieces, or itself."""
        return [t for t, _ in self._pieces.get(id(master), [(master, 0)])]

    def _state(self, master: torch.Tensor) -> dict:
        """The optimizer state of ``master`` as one tensor's: its pieces' per-element states
        concatenated, the scalars (Adam's ``step``, equal on every piece) of the first."""
        pieces = self._pieces.get(id(master))
        if pieces is None:
            return self.optimizer.state.get(master, {})
        sts = [self.optimizer.state.get(t, {}) for t, _ in pieces]
        first = pieces[0][0]
        return {k: torch.cat([st[k] for st in sts]) if _per_element(v, first) else v
                for k, v in sts[0].items()}

    def _set_state(self, master: torch.Tensor, state: dict) -> None:
        """Inverse of :meth:`_state`: each piece gets its slice of the per-element states and
        its own copy of the scalars (they are stepped in place)."""
        pieces = self._pieces.get(id(master))
        if pieces is None:
            self.optimizer.state[master] = state
            return
        for t, a in pieces:
            self.optimizer.state[t] = {
                k: (v[a:a + t.numel()].clone() if _per_element(v, master)
                    else v.clone() if torch.is_tensor(v) else v) for k, v in state.items()}

    # -- step ------------------------------------------------------------------------------
    def step(self) -> None:
        """Optimizer step on the local chunks (gradients: the buckets' reduced ones), then every
        rank's storage is made whole again (in place, so ``param`` objects stay valid): per
        ``s_os`` subgroup and dtype, all-gathers of whole buckets whose outputs hold up to
        ``OS_GATHER_BYTES`` (:data:`fxpar.defaults.OS_GATHER_BYTES`; a collective per bucket
        would pay the ring's latency once per 25 MiB: ~3.7 ms each over 1024 ranks)."""
        for p in self._params.values():
            if not p.master_is_view and p.tensor._version != p.version:
                self._load_master(p)   # the parameter was changed outside (weights loaded)
        for master, bk, lo in self._masters:   # the reduced gradient: a view into the bucket
            g = None if bk is None or bk.reduced is None else bk.reduced[lo:lo + master.numel()]
            if g is not None and g.dtype != torch.float32:
                g = g.float()
            master.grad = g
        if self.optimizer is not None:
            (self.compiled_step or self.optimizer.step)()
        gathers = [self._gather_updated(bks) for bks in self._os_groups()]
        with torch.no_grad():
            for p in self._params.values():
                if p.lay.os_pg is None and not p.master_is_view:
                    p.tensor.copy_(p.master[:p.numel].view(p.tensor.shape))
                    p.version = p.tensor._version
            for bks, out, work in gathers:
                work.wait()
                lay = bks[0][0].lay
                rows = out.view(lay.s_os, -1)
                order = lay.os_order.to(out.device)
                for bk, base in bks:
                    for p in bk.params:
                        lo = base + p.ooff
                        full = rows[:, lo:lo + p.cos].index_select(0, order).reshape(-1)
                        p.tensor.copy_(full[:p.numel].view(p.tensor.shape))
                        p.version = p.tensor._version
        self.clear_grads()

    def _os_groups(self) -> list[list[tuple[Bucket, int]]]:
        """The buckets whose optimizer chunks are gathered after the step, by what one
        all-gather can take together (subgroup, its rank order, dtype, device; an output of
        at most ``defaults.OS_GATHER_BYTES``), in bucket order (the same on every rank):
        ``[[(bucket, its offset in the row)]]``. Fixed by the layout: built at the first
        step."""
        if self._gather_plan is None:
            out: dict = {}
            part: dict = {}   # the piece each subgroup fills now
            for bk in self._buckets:
                lay = bk.lay
                if lay.os_pg is None:
                    continue
                key = (id(lay.os_pg), tuple(lay.os_order.tolist()), bk.dtype, bk.device)
                group = out.setdefault((key, part.setdefault(key, 0)), [])
                row = group[-1][1] + group[-1][0].orow if group else 0
                big = lay.s_os * (row + bk.orow) * bk.dtype.itemsize > defaults.OS_GATHER_BYTES
                if group and big:
                    part[key] += 1
                    group, row = out.setdefault((key, part[key]), []), 0
                group.append((bk, row))
            self._gather_plan = list(out.values())
        return self._gather_plan

    @staticmethod
    def _gather_updated(bks):
        """Start the all-gather of the updated chunks of buckets ``bks`` (one subgroup):
        ``(bks, out, work)``, ``out`` holding ``s_os`` rows of every bucket's chunks."""
        bk0, (last, base) = bks[0][0], bks[-1]
        inp = torch.empty(base + last.orow, dtype=bk0.dtype, device=bk0.device)
        for bk, off in bks:
            for p in bk.params:
                inp[off + p.ooff:off + p.ooff + p.cos].copy_(p.master)
        out = torch.empty(bk0.lay.s_os * inp.numel(), dtype=bk0.dtype, device=bk0.device)
        return bks, out, dist.all_gather_into_tensor(out, inp, group=bk0.lay.os_pg, async_op=True)

    def steps_per_bucket(self) -> bool:
        """Whether :meth:`step_bucket` can replace :meth:`step`: an element-wise optimizer
        whose every tensor is a flat bucket segment (fp32, ``s_os = 1``: nothing to gather
        after the step, no master to copy back), stepped eagerly (:meth:`compile`)."""
        return (self.optimizer is not None and type(self.optimizer) in ELEMENTWISE
                and self.compiled_step is None
                and all(bk is not None and bk.flat for _, bk, _ in self._masters))

    def step_bucket(self, bk: Bucket) -> None:
        """The optimizer step of the tensors whose gradients ``bk`` holds (reduced), the
        others left alone (a ``torch.optim`` optimizer skips a tensor without ``.grad``).
        Called once per bucket, each tensor is stepped once with its own state, as by
        :meth:`step`: element-wise, so the result is the same, bit for bit (tested); the
        earlier buckets' steps run while the later ones are still being reduced."""
        mine = [(m, lo) for m, b, lo in self._masters if b is bk]
        if not mine or bk.reduced is None:
            return
        for m, lo in mine:
            m.grad = bk.reduced[lo:lo + m.numel()]
        self.optimizer.step()
        for m, _ in mine:
            m.grad = None

    def clear_grads(self) -> None:
        """Drop the masters' gradients (views of the buckets' reduced gradients)."""
        for master, _, _ in self._masters:
            master.grad = None

    # -- saved state ---------------------------------------------------------------------------
    def optimizer_state(self) -> tuple[dict[str, dict[str, torch.Tensor]], list[dict]]:
        """The optimizer state of every parameter in its local STORAGE shape (per-element
        states gathered over the ``s_os`` subgroup; scalars such as Adam's ``step`` as they
        are, copied: a flat segment's parameters share them), and the param groups'
        hyperparameters with ``"params"`` as FQN lists. Collective over the optimizer
        subgroups; for checkpoints, not the hot path."""
        out: dict[str, dict[str, torch.Tensor]] = {}
        members: dict[int, list[str]] = {}
        states: dict[int, dict] = {}
        for p in self._params.values():
            members.setdefault(id(p.master), []).append(p.fqn)
            if id(p.master) not in states:
                states[id(p.master)] = self._state(p.master)
            out[p.fqn] = {k: (self._whole(p, v[p.moff:p.moff + p.cos]) if _per_element(v, p.master)
                              else v.clone()) if torch.is_tensor(v) else v
                          for k, v in states[id(p.master)].items()}
        order = {f: i for i, f in enumerate(self._params)}
        owner = {id(t): m for m, pieces in self._pieces.items() for t, _ in pieces}
        groups = [{**{k: v for k, v in g.items() if k != "params"},
                   "params": sorted({f for t in g["params"] for f in members[owner.get(id(t), id(t))]},
                                    key=order.get)}
                  for g in (self.optimizer.param_groups if self.optimizer is not None else ())]
        return out, groups

    @staticmethod
    def _whole(p: ParamShard, chunk: torch.Tensor) -> torch.Tensor:
        if p.lay.os_pg is None:
            return chunk[:p.numel].view(p.tensor.shape).clone()
        out = torch.empty(p.lay.s_os * p.cos, dtype=chunk.dtype, device=chunk.device)
        dist.all_gather_into_tensor(out, chunk.contiguous(), group=p.lay.os_pg)
        order = p.lay.os_order.to(chunk.device)
        return out.view(p.lay.s_os, p.cos).index_select(0, order).reshape(-1)[:p.numel].view(p.tensor.shape)

    def load_optimizer_state(self, state: Mapping[str, Mapping[str, torch.Tensor]],
                             groups: list[dict] | None = None) -> None:
        """Inverse of :meth:`optimizer_state`: per parameter, storage-shaped states are cut to this
        rank's chunk (zero padding), scalars taken as they are; each param group's
        hyperparameters are taken from the saved group that held its first parameter. The
        states of a flat segment are rebuilt from its parameters' (one missing from ``state``
        gets zeros there)."""
        new: dict[int, tuple[torch.Tensor, dict]] = {}
        for fqn, st in state.items():
            p = lookup(self._params, fqn)
            m = p.master
            chunk = new.setdefault(id(m), (m, {}))[1]
            for k, v in st.items():
                if torch.is_tensor(v) and v.ndim and v.numel() == p.numel:
                    if k not in chunk:
                        chunk[k] = torch.zeros(m.numel(), dtype=v.dtype, device=m.device)
                    lo = p.lay.k * p.cos
                    chunk[k][p.moff:p.moff + p.real].copy_(v.reshape(-1)[lo:lo + p.real])
                else:   # a copy: the caller's tensor must not become this state (stepped in place)
                    chunk[k] = v.to(m.device, copy=True) if torch.is_tensor(v) else v
        for m, chunk in new.values():
            self._set_state(m, chunk)
        if groups and self.optimizer is not None:
            saved = {f: g for g in groups for f in g["params"]}
            fqn_of = {id(t): p.fqn for p in reversed(self._params.values())
                      for t in self._tensors(p.master)}
            for g in self.optimizer.param_groups:
                src = saved.get(fqn_of[id(g["params"][0])]) if g["params"] else None
                if src is not None:
                    # hyperparameters, not how this optimizer steps (a state saved by torch's
                    # for-loop AdamW leaves a fused one fused)
                    g.update({k: v for k, v in src.items()
                              if k != "params" and k not in IMPLEMENTATION})

    def memory(self) -> dict[str, int]:
        """Bytes of fp32 masters (copies only) and of optimizer states."""
        master = sum(p.master.numel() * 4 for p in self._params.values() if not p.master_is_view)
        states = 0
        for st in (self.optimizer.state.values() if self.optimizer is not None else ()):
            for v in st.values():
                if torch.is_tensor(v) and v.dim() > 0:
                    states += v.numel() * v.element_size()
        return {"master": master, "optimizer": states}


def _per_element(v, master: torch.Tensor) -> bool:
    """Whether the optimizer state ``v`` of ``master`` holds one value per element (Adam's
    ``exp_avg``), not a scalar (its ``step``)."""
    return torch.is_tensor(v) and v.ndim > 0 and v.numel() == master.numel()


# -- norms and clipping --------------------------------------------------------------------------

def grad_norm_term(buckets: Sequence[Bucket], norm_type: float,
                   copies: Mapping[str, int]) -> torch.Tensor:
    """This rank's share of ``Σ |g|^p`` over every distinct gradient element (fp32 scalar;
    for ``p = inf`` the max ``|g|``), after the buckets' ``finish_backward``.

    A rank holds chunk ``b`` of each reduced gradient (``s_g`` chunks per replica group of
    ``n``), and ``n/s_g`` ranks of the group hold that same chunk; ``copies[fqn]`` says how
    many more identical copies of the parameter's storage exist outside its replica group
    (mesh axes where the plan replicates it and nothing is reduced; default 1). So element
    sums are weighted by ``s_g / (n · copies)``: summed over all ranks (``all_reduce``),
    each distinct element counts once. Padding is zero and adds nothing."""
    inf = norm_type == float("inf")
    total = torch.zeros((), dtype=torch.float32)
    for bk in buckets:
        if bk.reduced is None:
            continue
        for p in bk.params:
            g = bk.reduced[p.off:p.off + p.cg].float()
            if inf:
                total = torch.maximum(total, g.abs().max().cpu() if g.numel() else total)
            else:
                w = bk.lay.s_g / (bk.lay.n * copies.get(p.fqn, 1))
                total = total + g.abs().pow(norm_type).sum().cpu() * w
    return total


def scale_grads(buckets: Sequence[Bucket], factor: float) -> None:
    """Multiply every reduced gradient chunk by ``factor`` (gradient clipping)."""
    with torch.no_grad():
        for bk in buckets:
            if bk.reduced is not None:
                bk.reduced.mul_(factor)
