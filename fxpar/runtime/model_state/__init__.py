"""Model states at run time: bucketed asynchronous gradient reduction and a sharded optimizer
with AMSP's independent sharding factors (DESIGN §3, §4, §6; AMSP §IV).

:class:`ModelStates` is what the runners use; it puts together one module per job:

* :mod:`~fxpar.runtime.model_state.layout` — which chunk of which parameter each rank owns:
  replica groups, the factors ``1 <= s_g <= s_os <= |group|`` (gradients in ``s_g`` chunks,
  optimizer states and fp32 masters in ``s_os``), subgroups and their process groups;
* :mod:`~fxpar.runtime.model_state.buckets` — gradient buckets: flat storage, contributions
  summed into one buffer per bucket (in place for leaves where it can), one asynchronous
  collective per bucket, launched in bucket order while backward runs;
* :mod:`~fxpar.runtime.model_state.optimizer` — fp32 masters of this rank's chunks, the
  flat (or per-parameter) optimizer step and the all-gather that makes storage whole again,
  gradient norms and clipping, optimizer state per parameter for checkpoints.

Dependencies point down: this facade → optimizer → buckets → layout.

One process, nothing to reduce (``None`` groups; on a real world every parameter names its
:class:`ReplicaGroup`):

>>> import torch
>>> w = torch.ones(3)
>>> ms = ModelStates({"w": w}, {"w": None}, lambda ps: torch.optim.SGD(ps, lr=0.5))
>>> ms.expect("w", 1)
>>> ms.add_grad("w", torch.full((3,), 2.0)); ms.launched_buckets     # complete: launched
1
>>> ms.finish_backward(); ms.step(); ms.zero_grad(); w
tensor([0., 0., 0.])
>>> ms.shard_info("w")["os_range"], ms.memory()
((0, 3), {'grad': 12, 'master': 0, 'optimizer': 0})

Use on every rank (``grad`` of each parameter arrives in its partial form)::

    ms = ModelStates(dict(model.named_parameters()),
                     {n: ReplicaGroup("dp", dp_ranks, all_dp_groups) for n, _ in model.named_parameters()},
                     lambda ps: torch.optim.AdamW(ps, lr=1e-3), s_g=2, s_os=4)
    for n, p in model.named_parameters():
        ms.expect(n, 1)                           # lets buckets launch during backward
        ms.in_place(n)                            # where it can (s_g = 1): .grad in the bucket
        p.register_post_accumulate_grad_hook(lambda p, n=n: ms.leaf_grad(n))
    ms.begin_backward(); loss.backward(); ms.finish_backward(); ms.step(); ms.zero_grad()
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from fxpar.defaults import BUCKET_BYTES, FIRST_BUCKET_BYTES
from fxpar.errors import FxparError
from fxpar.runtime.model_state.buckets import GradientBuckets
from fxpar.runtime.model_state.layout import (GroupLayout, ReplicaGroup, check_factors,
                                              chunk_sizes, group_layout, param_shards,
                                              rank_layouts)
from fxpar.runtime.model_state.optimizer import (ELEMENTWISE, ShardedOptimizer, grad_norm_term,
                                                 param_options, scale_grads)

__all__ = ["ReplicaGroup", "ModelStates", "GroupLayout", "group_layout", "check_factors",
           "chunk_sizes", "ELEMENTWISE"]


class ModelStates(GradientBuckets):
    """Gradients and optimizer states of one rank's parameters, sharded per AMSP factors.

    ``params``: fqn -> local storage (leaf tensors, in registration order); ``groups``: fqn ->
    :class:`ReplicaGroup` (``None``: nothing to reduce — the rank owns the parameter alone);
    ``optimizer(params_or_groups)`` builds any ``torch.optim`` optimizer over the per-chunk fp32
    tensors; ``s_g``/``s_os``: factors inside every replica group (``factors`` overrides them per
    group key; groups of one rank keep everything, factors 1). ``param_groups(fqn)`` optionally
    returns optimizer options for a parameter (e.g. ``{"weight_decay": 0.0}``), which become
    param groups. ``reduce_dtype`` reduces gradients in another dtype than the parameters'.
    ``grad_scale``: a factor per parameter applied to each contribution before it is summed
    (a pipeline rank whose copy of a tied parameter is complete where its group sums).
    ``step_piece``: the most elements of one optimizer tensor cut from a flat bucket segment
    (:class:`~fxpar.runtime.model_state.optimizer.ShardedOptimizer`'s ``piece``).
    Parameters of flat buckets are moved into one storage per bucket
    (:mod:`~fxpar.runtime.model_state.buckets`).

    The gradient side (``expect``, ``in_place``, ``begin_backward``, ``leaf_grad``,
    ``add_grad``, ``add_planned_grad``, ``finish_backward``, ``grads``) is
    :class:`~fxpar.runtime.model_state.buckets.GradientBuckets`'; the optimizer side is a
    :class:`~fxpar.runtime.model_state.optimizer.ShardedOptimizer` (``self.optimizer`` is its
    ``torch.optim`` optimizer).

    Construction is collective over the default process group (all ranks exchange their group
    keys and layouts, check them, then create the subgroups); a bad factor or an inconsistent
    layout raises :class:`PlanError` on every rank.
    """

    def __init__(self, params: Mapping[str, torch.Tensor],
                 groups: Mapping[str, ReplicaGroup | None],
                 optimizer: Callable[[list], torch.optim.Optimizer],
                 s_g: int = 1, s_os: int = 1,
                 bucket_bytes: int = BUCKET_BYTES, *, first_bucket_bytes: int = FIRST_BUCKET_BYTES,
                 factors: Mapping[str, tuple[int, int]] | None = None,
                 param_groups: Callable[[str], Mapping] | None = None,
                 reduce_dtype: torch.dtype | None = None,
                 grad_scale: Mapping[str, float] | None = None,
                 step_piece: int | None = None) -> None:
        missing = [f for f in params if f not in groups]
        if missing:
            raise FxparError(f"ModelStates: no replica group given for {missing[:5]} "
                             f"(use None for parameters with nothing to reduce)")
        layouts = rank_layouts(params, groups, s_g, s_os, factors)
        shards = param_shards(params, groups, layouts)
        opts, keys = param_options(params, param_groups)
        super().__init__(shards, bucket_bytes=bucket_bytes, first_bucket_bytes=first_bucket_bytes,
                         segment=keys, reduce_dtype=reduce_dtype, grad_scale=grad_scale)
        self._opt = ShardedOptimizer(self._params, self._buckets, optimizer, opts, keys,
                                     grouped=param_groups is not None, piece=step_piece)

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The ``torch.optim`` optimizer over this rank's chunks (``None``: no parameters)."""
        return self._opt.optimizer

    # -- step ------------------------------------------------------------------------------
    def step(self) -> None:
        """Optimizer step on the local chunks, then every rank's storage is made whole again
        (all-gather over the ``s_os`` subgroups; in place, so ``param`` objects stay valid)."""
        if self._in_round:
            raise FxparError("step() called before finish_backward()")
        self._opt.step()

    def compile_step(self, backend="inductor") -> bool:
        """Step the optimizer under ``torch.compile`` from now on
        (:meth:`ShardedOptimizer.compile`); returns whether it is compiled."""
        return self._opt.compile(backend)

    def finish_backward_and_step(self) -> None:
        """:meth:`finish_backward` then :meth:`step`, overlapped where that is exact (an
        element-wise optimizer on flat fp32 buckets, ``s_os = 1``): each bucket's tensors
        are stepped as soon as its reduction is waited, while the later buckets' reductions
        are in flight (what an eager DDP/FSDP loop cannot do: its ``optimizer.step()``
        starts after the whole backward)."""
        if not self._opt.steps_per_bucket():
            self.finish_backward()
            self.step()
            return
        self.finish_backward(on_reduced=self._opt.step_bucket)
        self._opt.clear_grads()

    def zero_grad(self) -> None:
        """Drop the reduced gradients (and wait for any reduction still in flight)."""
        self.drop_grads()
        self._opt.clear_grads()

    def grad_norm_term(self, norm_type: float, copies: Mapping[str, int]) -> torch.Tensor:
        """This rank's share of ``Σ |g|^p`` over every distinct gradient element, after
        :meth:`finish_backward` (:func:`~fxpar.runtime.model_state.optimizer.grad_norm_term`:
        chunks weighted by ``s_g / (n · copies[fqn])``, so summed over all ranks each distinct
        element counts once; ``p = inf``: the max ``|g|``)."""
        return grad_norm_term(self._buckets, norm_type, copies)

    def scale_grads(self, factor: float) -> None:
        """Multiply every reduced gradient chunk by ``factor`` (gradient clipping)."""
        scale_grads(self._buckets, factor)

    # -- checkpoints -------------------------------------------------------------------------
    def optimizer_state(self) -> tuple[dict[str, dict[str, torch.Tensor]], list[dict]]:
        """Per parameter, its optimizer state in its local STORAGE shape, and the param groups
        with ``"params"`` as FQN lists (:meth:`ShardedOptimizer.optimizer_state
        <fxpar.runtime.model_state.optimizer.ShardedOptimizer.optimizer_state>`; collective
        over the optimizer subgroups)."""
        return self._opt.optimizer_state()

    def load_optimizer_state(self, state: Mapping[str, Mapping[str, torch.Tensor]],
                             groups: list[dict] | None = None) -> None:
        """Inverse of :meth:`optimizer_state`: this rank's chunks of the saved states, the
        saved groups' hyperparameters."""
        self._opt.load_optimizer_state(state, groups)

    # -- inspection ------------------------------------------------------------------------
    def shard_info(self, fqn: str) -> dict:
        """What this rank keeps of ``fqn``: factors, chunk indices and lengths, flat ranges."""
        p = self._param(fqn)
        lay = p.lay
        return {"key": lay.key, "group_size": lay.n, "s_g": lay.s_g, "s_os": lay.s_os,
                "padded": p.padded, "grad_chunk": lay.b, "os_chunk": lay.k,
                "grad_range": (lay.b * p.cg, (lay.b + 1) * p.cg) if lay.s_g > 1 else (0, p.padded),
                "os_range": (lay.k * p.cos, (lay.k + 1) * p.cos),
                "bucket": None if p.bucket is None else p.bucket.index}

    def memory(self) -> dict[str, int]:
        """Bytes this rank holds for gradients (reduced, or the spare buffer kept for the next
        round), fp32 masters (copies only) and optimizer states."""
        return {"grad": self.grad_bytes(), **self._opt.memory()}
