"""Gradient buckets: flat storage, bucketed asynchronous reduction over each replica group.

:class:`GradientBuckets` takes every gradient contribution of one rank's parameters
(:class:`~fxpar.runtime.model_state.layout.ParamShard`, laid out by
:mod:`~fxpar.runtime.model_state.layout`), sums it into its bucket and reduces each bucket over
the parameter's replica group as **one** collective, while backward still runs. After
:meth:`GradientBuckets.finish_backward` each bucket's ``reduced`` holds this rank's chunk of
every gradient in it (row ``b`` of the ``[s_g, L]`` layout below); the optimizer
(:mod:`~fxpar.runtime.model_state.optimizer`) reads its gradients there, as views.

Communication per step, for Φ gradient elements of ``e`` bytes each (ring volumes per device;
AMSP writes ``2Φ`` for bf16):

* ``s_g = 1``: all-reduce of the full gradient over the group, ``2·(n−1)/n · eΦ``;
* ``s_g > 1``: reduce-scatter inside the ``s_g`` subgroup, ``(s_g−1)/s_g · eΦ``, then an
  all-reduce of the ``eΦ/s_g`` shard across the ``n/s_g`` subgroups holding the same chunk,
  ``2·(n/s_g−1)/(n/s_g) · eΦ/s_g`` (hierarchical: AMSP's ``T_g`` and ``T_os0``).

Ordering and overlap. Parameters are put into buckets in *reverse registration order*
(backward produces the last layers' gradients first), one stream of buckets per
``(group key, dtype)``, each bucket closed once it holds ``bucket_bytes`` (the first of a
stream once it holds ``first_bucket_bytes``, 1 MiB by default as DDP's: the last layers'
gradients go out early, while backward still has the rest to compute); buckets are numbered
in creation order. Inside a bucket the parameters of one ``segment`` key (the optimizer's
param group) sit next to each other. A bucket's gradients live in one flat buffer (laid out
``[s_g, L]`` so that row ``b`` holds chunk ``b`` of every parameter of the bucket) and go out
as **one** collective. Buckets are launched strictly in bucket-number order: bucket ``i`` is
launched once all its parameters have received their declared number of contributions
(:meth:`GradientBuckets.expect`) *and* every bucket before it has been launched; the second
stage of a hierarchical reduction (the cross-group all-reduce of bucket ``i``) is launched
right after bucket ``i+1`` is launched, or in :meth:`GradientBuckets.finish_backward`. Launch
order is thus a function of the bucket numbering alone — identical on every rank whatever the
order or timing of ``add_grad`` calls — so collectives on each process group are issued in
the same order on every member. Parameters without a declared expectation are reduced at
``finish_backward``.

Flat storage. The parameters of a bucket that is fp32 with ``s_os = 1`` (and none of whose
parameters shares storage with another) are moved into one storage, in bucket order (``t.data``
is replaced: the parameter objects stay, and what writes them in place writes it); the
optimizer then steps views of it (:mod:`~fxpar.runtime.model_state.optimizer`).

Gradients in place (DDP's ``gradient_as_bucket_view``). A leaf declared with
:meth:`GradientBuckets.in_place` (``s_g = 1``, no ``grad_scale``, reduced in its own dtype) has
its ``.grad`` pointed at its slice of the round's bucket buffer by
:meth:`GradientBuckets.begin_backward`, so autograd accumulates straight into the bucket; its
post-accumulate hook (:meth:`GradientBuckets.leaf_grad`) only counts the arrival. After
:meth:`GradientBuckets.finish_backward` that ``.grad`` is ``None`` again: the buffer becomes the
reduced gradient or next round's buffer.

One process, nothing to reduce (the collectives are skipped, the bookkeeping is the same):

>>> import torch
>>> from fxpar.runtime.model_state.layout import param_shards, rank_layouts
>>> ps = {"w": torch.zeros(2, 3), "b": torch.zeros(3)}
>>> groups = {"w": None, "b": None}
>>> gb = GradientBuckets(param_shards(ps, groups, rank_layouts(ps, groups, s_g=1, s_os=1)))
>>> gb.num_buckets, [p.fqn for p in gb._buckets[0].params]      # reverse registration order
(1, ['b', 'w'])
>>> gb.expect("w"); gb.expect("b")
>>> gb.add_grad("b", torch.ones(3)); gb.launched_buckets
0
>>> gb.add_grad("w", torch.full((2, 3), 2.0)); gb.launched_buckets   # complete: launched
1
>>> gb.finish_backward(); gb.grads()["w"]
tensor([[2., 2., 2.],
        [2., 2., 2.]])
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from fxpar.defaults import BUCKET_BYTES, FIRST_BUCKET_BYTES
from fxpar.errors import FxparError
from fxpar.runtime.model_state.layout import ParamShard, RankLayout, lookup

__all__ = ["Bucket", "GradientBuckets", "make_buckets", "flatten"]


@dataclass(eq=False)
class Bucket:
    index: int
    key: str
    dtype: torch.dtype        # the parameters' dtype
    rdtype: torch.dtype       # the reduction dtype
    lay: RankLayout
    device: torch.device
    params: list
    row: int = 0              # L: elements per row of the [s_g, L] buffer
    orow: int = 0             # elements of the gather buffer per rank
    buf: torch.Tensor | None = None
    out: torch.Tensor | None = None
    work: object = None
    stage2: bool = False
    launched: bool = False
    waiting: int = 0          # params not yet complete in this round
    reduced: torch.Tensor | None = None   # reduced gradient chunk(s), accumulated over rounds
    spare: torch.Tensor | None = None     # s_g = 1: a free buffer from an earlier round
    flat: bool = False        # fp32, s_os = 1: its parameters live in one storage ...
    store: torch.Tensor | None = None     # ... this one (bucket order)
    #: (buffer, views of it per in-place leaf): the last two buffers' (a bucket alternates
    #: between its round buffer and its spare), so a round's leaf views are not re-sliced
    leaf_views: list = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return self.lay.s_g * self.row * self.rdtype.itemsize

    def round_buf(self) -> torch.Tensor:
        """This round's zeroed ``[s_g·L]`` buffer, made on first use: the spare one when there
        is one (as DDP's buckets, allocated once: a fresh megabyte-sized buffer every step
        costs page faults, measured at 10x the zeroing), else a new one. Only ``s_g = 1``
        keeps a spare (its buffer IS the reduced gradient, held anyway); with ``s_g > 1`` the
        full buffer lives only until its reduce-scatter (AMSP's ``2Φ/s_g`` gradient memory)."""
        if self.buf is None:
            buf, self.spare = self.spare, None
            self.buf = (torch.zeros(self.lay.s_g * self.row, dtype=self.rdtype, device=self.device)
                        if buf is None else buf.zero_())
        return self.buf


def _shared_storage(tensors: Iterable[torch.Tensor]) -> Callable[[torch.Tensor], bool]:
    """A predicate: whether a tensor's storage also backs another of ``tensors`` (tied
    parameters that are two tensors: moving one would untie them)."""
    seen: dict[int, int] = {}
    for t in tensors:
        ptr = t.untyped_storage().data_ptr()
        seen[ptr] = seen.get(ptr, 0) + 1
    return lambda t: seen[t.untyped_storage().data_ptr()] > 1


def _add_rows(buf2d: torch.Tensor, off: int, cg: int, flat: torch.Tensor) -> None:
    """Add ``flat`` (unpadded) into columns ``[off, off+cg)`` of the ``[s_g, L]`` buffer, element
    ``t`` going to row ``t // cg``."""
    n = flat.numel()
    full, rem = divmod(n, cg)
    if full:
        buf2d[:full, off:off + cg].add_(flat[:full * cg].view(full, cg))
    if rem:
        buf2d[full, off:off + rem].add_(flat[full * cg:])


def make_buckets(params: Mapping[str, ParamShard], segment: Mapping[str, tuple],
                 bucket_bytes: int, first_bucket_bytes: int,
                 reduce_dtype: torch.dtype | None) -> list[Bucket]:
    """The buckets of ``params`` (module docstring: reverse registration order, one stream per
    ``(key, dtype, device)``, the first bucket of a stream small), each parameter's offsets
    set, the parameters of one ``segment`` key contiguous in a bucket, and which buckets are
    flat."""
    buckets: list[Bucket] = []
    open_: dict[tuple, Bucket] = {}
    closed: set[tuple] = set()   # streams whose first bucket is full
    for p in reversed(list(params.values())):
        if p.numel == 0:
            continue
        t = p.tensor
        sk = (p.lay.key, t.dtype, t.device)
        bk = open_.get(sk)
        if bk is None:
            bk = Bucket(len(buckets), p.lay.key, t.dtype, reduce_dtype or t.dtype, p.lay,
                        t.device, [])
            buckets.append(bk)
            open_[sk] = bk
        p.bucket = bk
        bk.params.append(p)
        bk.row += p.cg
        bk.orow += p.cos
        if bk.nbytes >= (bucket_bytes if sk in closed else first_bucket_bytes):
            del open_[sk]
            closed.add(sk)
    shared = _shared_storage(p.tensor for p in params.values())
    for bk in buckets:
        # a param group's parameters next to each other (one flat segment each); which
        # parameters a bucket holds, not their order in it, decides when it launches
        first = {}
        for p in bk.params:
            first.setdefault(segment[p.fqn], len(first))
        bk.params.sort(key=lambda p: first[segment[p.fqn]])
        row = orow = 0
        for p in bk.params:
            p.off, p.ooff = row, orow
            row, orow = row + p.cg, orow + p.cos
        bk.waiting = len(bk.params)
        bk.flat = (bk.dtype == torch.float32 and bk.lay.s_os == 1 and
                   all(p.tensor.is_contiguous() and not shared(p.tensor) for p in bk.params))
    return buckets


def flatten(buckets: Iterable[Bucket]) -> None:
    """The parameters of each flat bucket move into one storage, in bucket order (their
    Python objects stay, so whatever writes them in place writes it)."""
    with torch.no_grad():
        for bk in buckets:
            if bk.flat:
                bk.store = torch.empty(bk.row, dtype=torch.float32, device=bk.device)
                for p in bk.params:
                    view = bk.store[p.off:p.off + p.numel].view(p.tensor.shape)
                    view.copy_(p.tensor)
                    p.tensor.data = view


class GradientBuckets:
    """The gradients of one rank's parameters, bucketed and reduced asynchronously.

    ``params``: fqn -> :class:`ParamShard` (registration order); ``segment``: fqn -> a hashable
    key, parameters with equal keys contiguous in a bucket (default: one key); ``grad_scale``:
    a factor per parameter applied to each contribution before it is summed;
    ``reduce_dtype``: reduce in another dtype than the parameters'. Flat buckets' parameters
    are moved into one storage at construction (module docstring)."""

    def __init__(self, params: Mapping[str, ParamShard], *, bucket_bytes: int = BUCKET_BYTES,
                 first_bucket_bytes: int = FIRST_BUCKET_BYTES,
                 segment: Mapping[str, tuple] | None = None,
                 reduce_dtype: torch.dtype | None = None,
                 grad_scale: Mapping[str, float] | None = None) -> None:
        self.bucket_bytes = int(bucket_bytes)
        self.first_bucket_bytes = min(int(first_bucket_bytes), self.bucket_bytes)
        #: per parameter, a factor on each contribution before it is summed (add_grad)
        self.grad_scale = dict(grad_scale or {})
        self._params: dict[str, ParamShard] = dict(params)
        self._rdtype = reduce_dtype
        segment = segment if segment is not None else dict.fromkeys(self._params, ())
        self._buckets = make_buckets(self._params, segment, self.bucket_bytes,
                                     self.first_bucket_bytes, reduce_dtype)
        self._planned: dict[tuple, list] = {}   # edge bucket -> [(fqn, plan, grad)] arrived
        self._inflight: list = []               # [(fqns, Pending)] planned gradients launched
        self._next = 0           # next bucket to launch in this round
        self._in_round = False   # some contribution or launch since the last finish_backward
        self._in_place: list[ParamShard] = []   # leaves whose .grad is a view of a bucket
        self._in_place_by_bucket: dict[int, tuple[Bucket, list[ParamShard]]] = {}
        flatten(self._buckets)

    def _param(self, fqn: str) -> ParamShard:
        return lookup(self._params, fqn)

    # -- backward ------------------------------------------------------------------------------
    def expect(self, fqn: str, n_contributions: int = 1) -> None:
        """Declare that ``fqn`` receives ``n_contributions`` ``add_grad`` calls per backward, so
        its bucket can launch as soon as the last one arrives (otherwise: at finish_backward)."""
        p = self._param(fqn)
        if n_contributions < 1:
            raise FxparError(f"expect({fqn!r}, {n_contributions}): need at least 1 contribution")
        if self._in_round:
            raise FxparError("expect() must be called between backward passes")
        p.expected = int(n_contributions)

    def in_place(self, fqn: str) -> bool:
        """Let ``fqn``'s leaf accumulate its gradient in place, in its slice of the bucket
        buffer (DDP's ``gradient_as_bucket_view``), where the layout allows it: ``s_g = 1``, no
        ``grad_scale``, reduced in its own dtype. Then :meth:`begin_backward` points its
        ``.grad`` there before each backward, and its post-accumulate hook calls
        :meth:`leaf_grad`. Returns whether it does."""
        p = self._param(fqn)
        bk = p.bucket
        ok = (bk is not None and bk.lay.s_g == 1 and fqn not in self.grad_scale and
              bk.rdtype == bk.dtype and p.tensor.is_contiguous())
        if ok and not p.in_place:
            p.in_place = True
            self._in_place.append(p)
            self._in_place_by_bucket.setdefault(id(bk), (bk, []))[1].append(p)
        return ok

    def begin_backward(self) -> None:
        """Before a backward: the ``.grad`` of every :meth:`in_place` leaf becomes a view of
        its slice of this round's bucket buffer (made now: reused, zeroed), so autograd's
        accumulation (``grad += new``, grad mode off) writes the bucket directly. Contributions
        through :meth:`add_grad` add to the same buffer. :meth:`finish_backward` (and
        :meth:`drop_grads`) set those ``.grad`` back to ``None``: the buffer is reused later."""
        for bk, ps in self._in_place_by_bucket.values():
            buf = bk.round_buf()
            views = next((v for b, v in bk.leaf_views if b is buf), None)
            if views is None:   # slicing 30 views costs ~0.1 ms a step: made once per buffer
                views = [buf[p.off:p.off + p.numel].view(p.tensor.shape) for p in ps]
                bk.leaf_views = [(buf, views)] + bk.leaf_views[:1]
            for p, v in zip(ps, views):
                p.view = p.tensor.grad = v

    def leaf_grad(self, fqn: str) -> None:
        """A leaf's ``.grad`` is complete for this backward (its post-accumulate hook): counted
        as one contribution if it accumulated in the bucket (:meth:`begin_backward`), else
        added (:meth:`add_grad`) and dropped."""
        p = self._param(fqn)
        t = p.tensor
        if p.view is not None and t.grad is p.view:
            self._arrive(p, fqn)
        else:
            self.add_grad(fqn, t.grad)
            t.grad = None

    def add_grad(self, fqn: str, grad: torch.Tensor) -> None:
        """Add one partial contribution (the local storage's shape) to ``fqn``'s gradient."""
        p = self._param(fqn)
        if grad.shape != p.tensor.shape:
            raise FxparError(f"add_grad({fqn!r}): gradient of shape {tuple(grad.shape)} for a "
                             f"local parameter of shape {tuple(p.tensor.shape)}")
        bk = p.bucket
        if bk is not None and not bk.launched:
            g = grad.detach().reshape(-1)
            if fqn in self.grad_scale:
                g = g * self.grad_scale[fqn]
            with torch.no_grad():
                _add_rows(bk.round_buf().view(bk.lay.s_g, bk.row), p.off, p.cg, g)
        self._arrive(p, fqn)

    def _arrive(self, p: ParamShard, fqn: str) -> None:
        """Count one contribution of ``p`` (already in the buffer); launch what is complete."""
        self._in_round = True
        if p.expected is not None and p.count >= p.expected:
            raise FxparError(f"add_grad({fqn!r}): more than the {p.expected} contribution(s) "
                             f"declared with expect()")
        p.count += 1
        bk = p.bucket
        if bk is None:   # an empty parameter
            return
        if bk.launched:
            raise FxparError(f"add_grad({fqn!r}): its bucket was already launched")
        if p.expected is not None and p.count == p.expected:
            bk.waiting -= 1
            while self._next < len(self._buckets) and self._buckets[self._next].waiting == 0:
                self._launch_next()

    def add_planned_grad(self, fqn: str, grad: torch.Tensor, plan, device_mesh,
                         bucket: tuple[str, ...], member: str) -> None:
        """A contribution that needs a resharding ``plan`` first (a parameter use whose
        gradient layout is not the storage's, e.g. ZeRO-3's reduce-scatter): ``member`` of
        ``bucket`` (one layer's parameter-use edges, ``()``: alone). The plans of a bucket are
        launched together (coalesced, :func:`fxpar.runtime.redistribute.start`) once all its
        members have arrived, in arrival order (the same on every rank), and finished into
        :meth:`add_grad` by :meth:`finish_backward`."""
        self._in_round = True
        key = bucket or (member,)
        got = self._planned.setdefault(key, [])
        got.append((fqn, plan, grad, device_mesh))
        if len(got) == len(key):
            self._launch_planned(key)

    def _launch_planned(self, key) -> None:
        from fxpar.runtime.redistribute import start

        got = self._planned.pop(key)
        pending = start([p for _, p, _, _ in got], [g for _, _, g, _ in got], got[0][3])
        self._inflight.append(([f for f, _, _, _ in got], pending))

    def _finish_planned(self) -> None:
        from fxpar.runtime.redistribute import finish

        for key in sorted(self._planned):  # buckets some of whose gradients never came
            self._launch_planned(key)
        for fqns, pending in self._inflight:
            for fqn, g in zip(fqns, finish(pending)):
                self.add_grad(fqn, g)
        self._inflight.clear()

    def _launch_next(self) -> None:
        """Launch bucket ``_next``, then the second stage of the bucket before it."""
        i = self._next
        bk = self._buckets[i]
        lay = bk.lay
        bk.round_buf()  # (made here if nothing arrived: unused parameters' gradient is zero)
        if lay.s_g == 1:
            bk.out = bk.buf
            if lay.cross_pg is not None:
                bk.work = dist.all_reduce(bk.out, group=lay.cross_pg, async_op=True)
        else:
            bk.out = torch.empty(bk.row, dtype=bk.rdtype, device=bk.device)
            bk.work = dist.reduce_scatter_tensor(bk.out, bk.buf, group=lay.sub_pg, async_op=True)
            bk.stage2 = lay.cross_pg is not None
        bk.launched = True
        self._in_round = True
        self._next += 1
        if i > 0:
            self._advance(self._buckets[i - 1])

    @staticmethod
    def _advance(bk: Bucket) -> None:
        """Second stage of a hierarchical reduction: all-reduce the scattered chunk across."""
        if not bk.stage2:
            return
        bk.work.wait()
        bk.buf = None
        bk.work = dist.all_reduce(bk.out, group=bk.lay.cross_pg, async_op=True)
        bk.stage2 = False

    def finish_backward(self, on_reduced: Callable[[Bucket], None] | None = None) -> None:
        """Finish the planned contributions (:meth:`add_planned_grad`), then launch every bucket
        not launched yet (in bucket order) and wait for all of them, in that order;
        ``on_reduced(bucket)`` runs as soon as a bucket's gradient is reduced, while the
        later buckets' reductions are still in flight."""
        self._finish_planned()
        while self._next < len(self._buckets):
            self._launch_next()
        for bk in self._buckets:
            self._advance(bk)
            if bk.work is not None:
                bk.work.wait()
            if bk.reduced is None:
                bk.reduced = bk.out
            else:
                bk.reduced.add_(bk.out)
                if bk.lay.s_g == 1:
                    bk.spare = bk.out     # (it is the buffer) added: free
            if on_reduced is not None:
                on_reduced(bk)
        self._reset_round()

    def _reset_round(self) -> None:
        for bk in self._buckets:
            bk.buf = bk.out = bk.work = None
            bk.stage2 = bk.launched = False
            bk.waiting = len(bk.params)
        for p in self._params.values():
            p.count = 0
        for p in self._in_place:   # the round's buffer is now the reduced gradient or spare
            p.view = p.tensor.grad = None
        self._next = 0
        self._in_round = False

    def drop_grads(self) -> None:
        """Drop the reduced gradients (and wait for any reduction still in flight)."""
        for bk in self._buckets:
            self._advance(bk)
            if bk.work is not None:
                bk.work.wait()
            if bk.lay.s_g == 1 and bk.reduced is not None:
                bk.spare = bk.reduced     # (a round's buffer) dropped: reused, not reallocated
            bk.reduced = None
        self._reset_round()

    # -- inspection ------------------------------------------------------------------------
    def grads(self) -> dict[str, torch.Tensor]:
        """Every parameter's fully reduced local gradient (storage shape, in the reduction
        dtype: what the optimizer steps with). Collective when ``s_g > 1`` (gathers the
        chunks); for tests and debugging, not the hot path."""
        out: dict[str, torch.Tensor] = {}
        pending = []
        for bk in self._buckets:
            red = bk.reduced
            if red is None:
                red = torch.zeros(bk.row, dtype=bk.rdtype, device=bk.device)
            if bk.lay.s_g > 1:
                full = torch.empty(bk.lay.s_g * bk.row, dtype=red.dtype, device=bk.device)
                pending.append((bk, full, dist.all_gather_into_tensor(
                    full, red.contiguous(), group=bk.lay.sub_pg, async_op=True)))
            else:
                pending.append((bk, red, None))
        for bk, full, work in pending:
            if work is not None:
                work.wait()
            rows = full.view(bk.lay.s_g, bk.row)
            for p in bk.params:
                g = rows[:, p.off:p.off + p.cg].reshape(-1)[:p.numel]
                out[p.fqn] = g.view(p.tensor.shape).clone()
        for fqn, p in self._params.items():
            if fqn not in out:  # empty parameters
                out[fqn] = torch.zeros_like(p.tensor, dtype=self._rdtype or p.tensor.dtype)
        return {fqn: out[fqn] for fqn in self._params}

    def grad_bytes(self) -> int:
        """Bytes held for gradients: reduced, or the spare buffer kept for the next round."""
        return sum(t.numel() * t.element_size() for bk in self._buckets
                   for t in (bk.reduced, bk.spare) if t is not None)

    @property
    def num_buckets(self) -> int:
        return len(self._buckets)

    @property
    def launched_buckets(self) -> int:
        """Buckets launched so far in the current backward (for tests of overlap)."""
        return self._next
