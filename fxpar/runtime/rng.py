"""Random ops under sharding: dropout masks that agree where data is shared (Megatron's RNG tracker).

A sharded program runs the same random op on many ranks. Two ranks that hold **the same data**
(a replicated tensor, or the addends of a ``Partial("sum")`` tensor over some mesh axis) must
draw **the same** mask, or the replicas drift apart (and a partial sum of differently masked
addends is not a masked sum). Two ranks that hold **different shards** must draw
**independent** masks, or the mask repeats itself across shards. fxpar gets both from one rule:
every mask is drawn from a fresh ``torch.Generator`` seeded by

    (tracker seed, training step, microbatch, site, shard key)

where the *site* identifies the random op in the program (e.g. its node index), and the *shard
key* (:func:`shard_key`) is the rank's coordinates on the mesh axes where the tensor's spec is
``Shard`` (``Replicate`` and ``Partial`` axes are left out, so every rank holding the same
data has the same key). The seed is the same on every rank; nothing is communicated.

Consequences worth knowing:

* Masks depend only on that tuple, so recomputing a forward (activation checkpointing,
  pipeline re-runs) reproduces the mask exactly.
* The global mask of a sharded tensor is a function of the layout: training is
  *statistically* the same as on one device (each element kept with probability ``1 - p``,
  independently), not bitwise the same as ``torch.nn.functional.dropout``.
* Masks are drawn in float32 (``torch.rand(...) >= p``) on the tensor's device, so the mask
  does not depend on the tensor's dtype; CPU and CUDA draw different masks.

The ``localize`` pass replaces a training ``aten.dropout`` node by
``torch.ops.fxpar.sharded_dropout`` (:mod:`fxpar.runtime.ops`; the same arithmetic as
:func:`dropout`) with the node's site and the rank's shard key, and every other random op by a
``torch.ops.fxpar.keyed_*`` op drawing from :meth:`RNGTracker.generator` the same way
(:mod:`fxpar.runtime.keyed`); the runner binds its tracker,
calls :meth:`RNGTracker.next_step` once per training step, and a pipeline interpreter calls
:meth:`RNGTracker.set_microbatch` before each microbatch's forward AND backward (the backward
draws the mask again).

>>> import torch
>>> from fxpar.spec import Spec
>>> tracker = RNGTracker(seed=0)
>>> spec = Spec.parse("S(0)R")                  # dim 0 split over mesh axis 0
>>> shard_key(spec, (1, 0)), shard_key(spec, (1, 1)), shard_key(spec, (0, 1))
((1,), (1,), (0,))
>>> x = torch.ones(4, 8)
>>> a = dropout(x, 0.5, True, site=3, shard_key=(1,), tracker=tracker)   # rank (1, 0)
>>> b = dropout(x, 0.5, True, site=3, shard_key=(1,), tracker=tracker)   # rank (1, 1): a replica
>>> c = dropout(x, 0.5, True, site=3, shard_key=(0,), tracker=tracker)   # rank (0, 1): another shard
>>> torch.equal(a, b), torch.equal(a, c), set(a.unique().tolist()) <= {0.0, 2.0}
(True, False, True)
>>> tracker.next_step()
>>> torch.equal(a, dropout(x, 0.5, True, site=3, shard_key=(1,), tracker=tracker))
False
>>> dropout(x, 0.5, False, site=3, shard_key=(1,), tracker=tracker) is x     # eval: identity
True
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from fxpar.errors import SpecError
from fxpar.spec import Shard, Spec, as_spec

__all__ = ["RNGTracker", "dropout", "keep_mask", "native_dropout", "seed_from", "shard_key"]


def seed_from(*parts) -> int:
    """A 63-bit seed from a tuple of ints/strings, the same in every process (no ``hash()``,
    which Python salts per process).

    >>> seed_from(0, "w", (1, 2)) == seed_from(0, "w", (1, 2)) != seed_from(0, "w", (2, 1))
    True
    """
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def shard_key(spec: Spec | str, coord: Sequence[int]) -> tuple[int, ...]:
    """The coordinates of ``coord`` on the mesh axes where ``spec`` has a ``Shard`` placement.

    Ranks with equal keys hold the same data (``Replicate`` and ``Partial`` axes are
    excluded), ranks with different keys hold different shards.

    >>> shard_key("RS(1)P(sum)", (1, 0, 1)), shard_key("RR", (1, 1))
    ((0,), ())
    """
    spec = as_spec(spec)
    if len(coord) != len(spec):
        raise SpecError(f"shard_key: spec {spec} has {len(spec)} placements but coord {tuple(coord)} "
                        f"has {len(coord)} entries")
    return tuple(int(c) for c, p in zip(coord, spec) if isinstance(p, Shard))


class RNGTracker:
    """Seeds for random ops: the same ``seed`` on every rank, a step counter and a microbatch index.

    ``next_step()`` is called by the runner once per training step (it also resets the
    microbatch index to 0); ``set_microbatch(i)`` before running microbatch ``i`` of a step,
    so microbatches draw independent masks. ``state_dict()`` / ``load_state_dict()`` carry
    the counters through checkpoints so a resumed run draws the masks it would have drawn.
    """

    def __init__(self, seed: int = 0) -> None:
        self.seed = int(seed)
        self.step = 0
        self.microbatch = 0

    def next_step(self) -> None:
        self.step += 1
        self.microbatch = 0

    def set_microbatch(self, index: int) -> None:
        self.microbatch = int(index)

    def seed_for(self, site, shard_key: Sequence[int]) -> int:
        """The seed of the generator for one random op (``site``) on one shard."""
        return seed_from("fxpar.rng", self.seed, self.step, self.microbatch, site,
                         tuple(int(k) for k in shard_key))

    def generator(self, site, shard_key: Sequence[int], device: torch.device | str | None = None) -> torch.Generator:
        """A fresh generator on ``device`` (CPU if None) seeded by :meth:`seed_for`."""
        g = torch.Generator(device=torch.device("cpu") if device is None else torch.device(device))
        g.manual_seed(self.seed_for(site, shard_key))
        return g

    def state_dict(self) -> dict:
        return {"seed": self.seed, "step": self.step, "microbatch": self.microbatch}

    def load_state_dict(self, state: dict) -> None:
        self.seed, self.step, self.microbatch = int(state["seed"]), int(state["step"]), int(state["microbatch"])

    def __repr__(self) -> str:
        return f"RNGTracker(seed={self.seed}, step={self.step}, microbatch={self.microbatch})"


class _MaskScale(torch.autograd.Function):
    """``x * mask * scale`` with the (bool) mask saved for backward: grad = g * mask * scale."""

    @staticmethod
    def forward(ctx, x, mask, scale):
        ctx.save_for_backward(mask)
        ctx.scale = scale
        return x * mask * scale

    @staticmethod
    def backward(ctx, grad):
        (mask,) = ctx.saved_tensors
        return grad * mask * ctx.scale, None, None


def _check_p(p: float) -> float:
    p = float(p)
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
    return p


def keep_mask(shape: Sequence[int], p: float, *, site, shard_key: Sequence[int], tracker: RNGTracker,
              device: torch.device | str | None = None) -> torch.Tensor:
    """The bool keep-mask (each entry True with probability ``1 - p``) for one site and shard."""
    g = tracker.generator(site, shard_key, device)
    return torch.rand(tuple(shape), generator=g, device=g.device, dtype=torch.float32) >= _check_p(p)


def native_dropout(x: torch.Tensor, p: float, train: bool | None, *, site, shard_key: Sequence[int],
                   tracker: RNGTracker) -> tuple[torch.Tensor, torch.Tensor]:
    """``aten.native_dropout`` semantics: ``(x * mask / (1 - p), mask)`` with a bool mask;
    ``train=False`` gives ``(x, all-True mask)``; ``train=None`` counts as training (as in ATen).
    ``p = 1`` drops everything (zeros, zero gradient)."""
    p = _check_p(p)
    if train is False or p == 0.0:
        return x, torch.ones_like(x, dtype=torch.bool)
    mask = keep_mask(x.shape, p, site=site, shard_key=shard_key, tracker=tracker, device=x.device)
    scale = 0.0 if p == 1.0 else 1.0 / (1.0 - p)
    return _MaskScale.apply(x, mask, scale), mask


def dropout(x: torch.Tensor, p: float, train: bool, *, site, shard_key: Sequence[int],
            tracker: RNGTracker) -> torch.Tensor:
    """``aten.dropout(x, p, train)`` with a shard-aware mask.

    The keep-mask has ``x``'s (local) shape, is drawn from ``tracker.generator(site,
    shard_key, x.device)``, and the result is ``x * mask * (1 / (1 - p))``; the gradient is
    exactly ``grad * mask * (1 / (1 - p))``. ``train=False`` or ``p == 0`` returns ``x``
    itself. ``site`` is any hashable made of ints/strings (a node index, or a tuple).
    """
    p = _check_p(p)
    if not train or p == 0.0:
        return x
    return native_dropout(x, p, True, site=site, shard_key=shard_key, tracker=tracker)[0]
