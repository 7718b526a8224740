"""Model states at run time: bucketed asynchronous gradient reduction and a sharded optimizer
with AMSP's independent sharding factors (DESIGN §3, §4, §6; AMSP §IV).

Every parameter has a *storage* tensor on each rank: its local shard under the plan's spec (the
plan may already shard parameters — AMSP's ``s_p``, e.g. ZeRO-3 — which this module does not
see). The ranks that hold the *identical* storage of a parameter and each compute a partial
gradient of it form its **replica group** (classic data parallelism): the true gradient of the
storage is the **sum** of the contributions over the group. Inside each replica group of size
``n`` two AMSP factors decide who keeps what::

    1 <= s_g <= s_os <= n,      s_g | s_os | n

What each rank holds, for a parameter of ``N`` elements, flattened and zero-padded to
``N_p = ceil(N / s_os) * s_os`` (FSDP-style flat chunks; only the last chunk carries padding):

* **parameters**: its whole local storage (``s_p`` is the plan's business);
* **gradients**: ``s_g = 1``: the whole reduced gradient (DDP, ZeRO-1);
  ``s_g > 1``: chunk ``b`` of ``s_g`` chunks of ``c_g = N_p / s_g`` elements;
* **optimizer states** (and the fp32 master copy when the parameter is bf16/fp16): chunk ``k``
  of ``s_os`` chunks of ``c_os = N_p / s_os`` elements, with ``k`` chosen inside the gradient
  chunk the rank holds: ``k = b·(s_os/s_g) + c``.

Layout of a replica group ``g = (g_0, …, g_{n-1})`` (:func:`group_layout`, pure):

* gradient subgroups: ``s_g`` *consecutive* members ``g[a·s_g : (a+1)·s_g]``; a member's chunk
  ``b`` is its rank in that subgroup's process group (members sorted by global rank);
* cross groups: the ``n/s_g`` members (one per gradient subgroup) that hold the same ``b``;
* optimizer subgroups: ``s_os`` consecutive members ``g[A·s_os : (A+1)·s_os]`` — a union of
  ``s_os/s_g`` gradient subgroups, so ``c`` = which of them (``(i // s_g) mod (s_os/s_g)`` for
  member ``i``) and ``(b, c)`` runs over every chunk ``k`` exactly once.

Communication per step, for Φ gradient elements of ``e`` bytes each (ring volumes per device;
AMSP writes ``2Φ`` for bf16):

* ``s_g = 1``: all-reduce of the full gradient over the group, ``2·(n−1)/n · eΦ``;
* ``s_g > 1``: reduce-scatter inside the ``s_g`` subgroup, ``(s_g−1)/s_g · eΦ``, then an
  all-reduce of the ``eΦ/s_g`` shard across the ``n/s_g`` subgroups holding the same chunk,
  ``2·(n/s_g−1)/(n/s_g) · eΦ/s_g`` (hierarchical: AMSP's ``T_g`` and ``T_os0``);
* the rank updates its ``c_os`` chunk (an optimizer over per-chunk fp32 leaf tensors), then
  ``s_os > 1``: all-gather of the updated chunks inside the ``s_os`` subgroup,
  ``(s_os−1)/s_os · eΦ`` (AMSP's ``T_os1``), so every rank's storage is whole again.

Memory per rank (mixed precision, Adam): ``2Φ`` parameters + ``2Φ/s_g`` gradients + ``12Φ/s_os``
fp32 master, ``exp_avg``, ``exp_avg_sq`` — the AMSP formula with ``s_p = 1`` on the local
storage. fp32 parameters with ``s_os = 1`` are their own master (no copy). Special cases:
DDP = ``(1, 1)``, ZeRO-1 = ``(1, n)``, ZeRO-2 = ``(n, n)``, MiCS/HSDP-like = ``(s, s)`` with
``s < n``.

Because the optimizer sees per-chunk tensors, element-wise optimizers (SGD, Adam, AdamW,
Adagrad, RMSprop, …) give exactly the unsharded result; optimizers that couple elements of a
tensor (LBFGS, Adafactor, per-tensor norms) see chunks instead of tensors.

Flat buckets. The parameters of a bucket that is fp32 with ``s_os = 1`` (and none of whose
parameters shares storage with another) are moved into one storage, in bucket order (``t.data``
is replaced: the parameter objects stay, and what writes them in place writes it). If the
optimizer is one of :data:`ELEMENTWISE`, it steps one tensor per (bucket, param group) — a
view of that storage, the parameters of a param group contiguous in the bucket — whose
gradient is a slice of the bucket's reduced buffer (no copy): one kernel per operation
instead of one per parameter, and per element the per-parameter update (bitwise for AdamW on
CPU, tested). Its states are per segment; :meth:`ModelStates.optimizer_state` still gives
them per parameter. Other optimizers (built first over the segments, then again) get a
master per parameter, as above.

Gradients in place (DDP's ``gradient_as_bucket_view``). A leaf declared with
:meth:`ModelStates.in_place` (``s_g = 1``, no ``grad_scale``, reduced in its own dtype) has its
``.grad`` pointed at its slice of the round's bucket buffer by
:meth:`ModelStates.begin_backward`, so autograd accumulates straight into the bucket; its
post-accumulate hook (:meth:`ModelStates.leaf_grad`) only counts the arrival. After
:meth:`ModelStates.finish_backward` that ``.grad`` is ``None`` again: the buffer becomes the
reduced gradient or next round's buffer.

Ordering and overlap. Parameters are put into buckets in *reverse registration order*
(backward produces the last layers' gradients first), one stream of buckets per
``(group key, dtype)``, each bucket closed once it holds ``bucket_bytes`` (the first of a
stream once it holds ``first_bucket_bytes``, 1 MiB by default as DDP's: the last layers'
gradients go out early, while backward still has the rest to compute); buckets are numbered
in creation order. A bucket's gradients live in one flat buffer (laid out ``[s_g, L]`` so that
row ``b`` holds chunk ``b`` of every parameter of the bucket) and go out as **one** collective.
Buckets are launched strictly in bucket-number order: bucket ``i`` is launched once all its
parameters have received their declared number of contributions (:meth:`ModelStates.expect`)
*and* every bucket before it has been launched; the second stage of a hierarchical reduction
(the cross-group all-reduce of bucket ``i``) is launched right after bucket ``i+1`` is
launched, or in :meth:`ModelStates.finish_backward`. Launch order is thus a function of the
bucket numbering alone — identical on every rank whatever the order or timing of
``add_grad`` calls — so collectives on each process group are issued in the same order on every
member. Parameters without a declared expectation are reduced at ``finish_backward``.

>>> lay = group_layout(range(8), s_g=2, s_os=4)
>>> lay.grad_groups
((0, 1), (2, 3), (4, 5), (6, 7))
>>> lay.cross_groups
((0, 2, 4, 6), (1, 3, 5, 7))
>>> lay.os_groups
((0, 1, 2, 3), (4, 5, 6, 7))
>>> [lay.grad_chunk[r] for r in range(8)], [lay.os_chunk[r] for r in range(8)]
([0, 1, 0, 1, 0, 1, 0, 1], [0, 2, 1, 3, 0, 2, 1, 3])
>>> chunk_sizes(10, s_g=2, s_os=4)     # N_p, c_g, c_os: rank 1 keeps grad [6, 12), states [6, 9)
(12, 6, 3)
>>> check_factors(4, s_g=3, s_os=3)
Traceback (most recent call last):
...
fxpar.errors.PlanError: s_g=3 does not divide the replica group size |group|=4

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

import hashlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fxpar.errors import FxparError, PlanError

__all__ = ["ReplicaGroup", "ModelStates", "GroupLayout", "group_layout", "check_factors",
           "chunk_sizes", "ELEMENTWISE"]

_LOCAL_KEY = "<local>"

#: optimizers whose update of an element reads only that element's parameter, gradient and
#: states (and per-tensor scalars that depend on the step count alone): stepping one flat
#: tensor for many parameters gives what stepping each does (checked against torch 2.13)
ELEMENTWISE = frozenset({torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW,
                         torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam,
                         torch.optim.Adagrad, torch.optim.RMSprop, torch.optim.Rprop,
                         torch.optim.ASGD})


@dataclass(frozen=True)
class ReplicaGroup:
    """The ranks holding identical storage of a parameter (ordered), and the partition of the
    whole world into such groups for this layout (every rank belongs to exactly one group of
    ``all``; all ranks must see the same ``all``)."""

    key: str                      # layout identity, e.g. "dp"; params with equal key share groups
    ranks: tuple[int, ...]        # this rank's group (global ranks, ordered)
    all: tuple[tuple[int, ...], ...]


# -- pure layout math --------------------------------------------------------------------------

def check_factors(n: int, s_g: int, s_os: int, where: str = "") -> None:
    """Raise :class:`PlanError` unless ``1 <= s_g <= s_os <= n`` and ``s_g | s_os | n``."""
    at = f" ({where})" if where else ""
    for name, s in (("s_g", s_g), ("s_os", s_os)):
        if not isinstance(s, int) or s < 1:
            raise PlanError(f"{name}={s!r} must be a positive integer{at}")
    if s_g > n:
        raise PlanError(f"s_g={s_g} exceeds the replica group size |group|={n}{at}")
    if n % s_g:
        raise PlanError(f"s_g={s_g} does not divide the replica group size |group|={n}{at}")
    if s_os > n:
        raise PlanError(f"s_os={s_os} exceeds the replica group size |group|={n}{at}")
    if n % s_os:
        raise PlanError(f"s_os={s_os} does not divide the replica group size |group|={n}{at}")
    if s_g > s_os:
        raise PlanError(f"s_g={s_g} > s_os={s_os}: a rank's optimizer chunk must lie inside its "
                        f"gradient chunk (AMSP needs s_g <= s_os; |group|={n}){at}")
    if s_os % s_g:
        raise PlanError(f"s_g={s_g} does not divide s_os={s_os} (|group|={n}){at}")


def chunk_sizes(numel: int, s_g: int, s_os: int) -> tuple[int, int, int]:
    """``(N_p, c_g, c_os)``: padded flat length, gradient chunk and optimizer chunk lengths."""
    padded = -(-numel // s_os) * s_os
    return padded, padded // s_g, padded // s_os


@dataclass(frozen=True, eq=False)
class GroupLayout:
    """How one replica group is cut for factors ``(s_g, s_os)``: the same on every rank.

    Every subgroup lists its members sorted by global rank (the order of its process group);
    ``grad_chunk[r]`` is ``b`` (= rank of ``r`` in its gradient subgroup), ``os_chunk[r]`` is
    ``k``."""

    group: tuple[int, ...]
    s_g: int
    s_os: int
    grad_groups: tuple[tuple[int, ...], ...]
    cross_groups: tuple[tuple[int, ...], ...]
    os_groups: tuple[tuple[int, ...], ...]
    grad_chunk: Mapping[int, int]
    os_chunk: Mapping[int, int]

    def subgroups(self) -> list[tuple[int, ...]]:
        """Every subgroup of more than one rank that needs a process group."""
        out = []
        if self.s_g > 1:
            out += self.grad_groups
        if len(self.group) // self.s_g > 1:
            out += self.cross_groups
        if self.s_os > 1:
            out += self.os_groups
        return out


def group_layout(group: Iterable[int], s_g: int, s_os: int) -> GroupLayout:
    """The subgroups and chunk indices of one replica group (see the module docstring)."""
    group = tuple(int(r) for r in group)
    n = len(group)
    check_factors(n, s_g, s_os, f"replica group {group}")
    m = s_os // s_g
    grad_groups = tuple(tuple(sorted(group[a * s_g:(a + 1) * s_g])) for a in range(n // s_g))
    b = {r: gg.index(r) for gg in grad_groups for r in gg}
    cross = tuple(tuple(sorted(gg[j] for gg in grad_groups)) for j in range(s_g))
    os_groups = tuple(tuple(sorted(group[a * s_os:(a + 1) * s_os])) for a in range(n // s_os))
    k = {r: b[r] * m + (i // s_g) % m for i, r in enumerate(group)}
    return GroupLayout(group, s_g, s_os, grad_groups, cross, os_groups, b, k)


# -- process groups ----------------------------------------------------------------------------

_PGS: dict[tuple[int, ...], object] = {}
_PG_WORLD: list = [None]


def _process_groups(needed: Iterable[tuple[int, ...]]) -> dict[tuple[int, ...], object]:
    """Create (collectively, in sorted order) every process group in ``needed`` not made yet.

    The cache is the same on every rank (every rank asks for the same union), so every rank
    calls ``new_group`` for the same groups in the same order."""
    world = dist.group.WORLD
    if _PG_WORLD[0] is not world:  # a new default group: old subgroups are gone
        _PGS.clear()
        _PG_WORLD[0] = world
    for ranks in sorted(set(needed) - set(_PGS)):
        pg = dist.new_group(list(ranks))
        if pg is not None and pg is not dist.GroupMember.NON_GROUP_MEMBER:
            got = tuple(dist.get_process_group_ranks(pg))
            if got != ranks:
                raise FxparError(f"process group over {ranks} came back ordered {got}")
        _PGS[ranks] = pg
    return _PGS


@dataclass(eq=False)
class _RankLayout:
    """This rank's view of a group layout: process groups and chunk indices."""

    key: str
    n: int
    s_g: int
    s_os: int
    b: int = 0
    k: int = 0
    sub_pg: object = None      # gradient subgroup (s_g > 1)
    cross_pg: object = None    # ranks holding the same gradient chunk (n/s_g > 1)
    os_pg: object = None       # optimizer subgroup (s_os > 1)
    os_order: torch.Tensor | None = None  # os-subgroup ranks sorted by the chunk k they hold


# -- per-parameter and per-bucket state ---------------------------------------------------------

@dataclass(eq=False)
class _Param:
    fqn: str
    tensor: torch.Tensor
    lay: _RankLayout
    numel: int
    padded: int
    cg: int
    cos: int
    bucket: _Bucket | None = None
    off: int = 0          # offset of this param's gradient chunk in the bucket's row
    ooff: int = 0         # offset of its optimizer chunk in the bucket's gather buffer
    expected: int | None = None
    count: int = 0
    master: torch.Tensor | None = None   # the optimizer's tensor holding this param's chunk
    moff: int = 0         # offset of the chunk in it (a flat segment holds several params)
    master_is_view: bool = False
    version: int = -1
    in_place: bool = False   # its leaf .grad accumulates in the bucket buffer (begin_backward)
    view: torch.Tensor | None = None   # that .grad in this round's buffer

    @property
    def real(self) -> int:  # real (non-padding) elements of the optimizer chunk
        lo = self.lay.k * self.cos
        return max(0, min(self.numel, lo + self.cos) - lo)


@dataclass(eq=False)
class _Bucket:
    index: int
    key: str
    dtype: torch.dtype        # the parameters' dtype
    rdtype: torch.dtype       # the reduction dtype
    lay: _RankLayout
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


class ModelStates:
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
    Parameters of flat buckets are moved into one storage per bucket (module docstring).

    Construction is collective over the default process group (all ranks exchange their group
    keys and layouts, check them, then create the subgroups); a bad factor or an inconsistent
    layout raises :class:`PlanError` on every rank.
    """

    def __init__(self, params: Mapping[str, torch.Tensor],
                 groups: Mapping[str, ReplicaGroup | None],
                 optimizer: Callable[[list], torch.optim.Optimizer],
                 s_g: int = 1, s_os: int = 1,
                 bucket_bytes: int = 25 * 2**20, *, first_bucket_bytes: int = 2**20,
                 factors: Mapping[str, tuple[int, int]] | None = None,
                 param_groups: Callable[[str], Mapping] | None = None,
                 reduce_dtype: torch.dtype | None = None,
                 grad_scale: Mapping[str, float] | None = None) -> None:
        missing = [f for f in params if f not in groups]
        if missing:
            raise FxparError(f"ModelStates: no replica group given for {missing[:5]} "
                             f"(use None for parameters with nothing to reduce)")
        self.bucket_bytes = int(bucket_bytes)
        self.first_bucket_bytes = min(int(first_bucket_bytes), self.bucket_bytes)
        #: per parameter, a factor on each contribution before it is summed (add_grad)
        self.grad_scale = dict(grad_scale or {})
        factors = dict(factors or {})
        self._layouts = self._make_layouts(params, groups, s_g, s_os, factors)
        self._params: dict[str, _Param] = {}
        for fqn, t in params.items():
            g = groups[fqn]
            lay = self._layouts[_LOCAL_KEY if g is None or len(g.ranks) == 1 else g.key]
            n = t.numel()
            self._params[fqn] = _Param(fqn, t, lay, n, *chunk_sizes(n, lay.s_g, lay.s_os))
        # optimizer options per parameter, as a hashable key (equal keys: one param group)
        self._opts = {f: dict(param_groups(f) or {}) if param_groups else {} for f in params}
        self._okey = {f: tuple(sorted((k, repr(v)) for k, v in o.items()))
                      for f, o in self._opts.items()}
        self._buckets = self._make_buckets(reduce_dtype)
        self._planned: dict[tuple, list] = {}   # edge bucket -> [(fqn, plan, grad)] arrived
        self._inflight: list = []               # [(fqns, Pending)] planned gradients launched
        self._next = 0           # next bucket to launch in this round
        self._in_round = False   # some contribution or launch since the last finish_backward
        self._in_place: list[_Param] = []       # leaves whose .grad is a view of a bucket
        self._flatten()
        self._make_masters(flat=True)
        self.optimizer = self._make_optimizer(optimizer, param_groups is not None)
        if type(self.optimizer) not in ELEMENTWISE and any(bk.flat for bk in self._buckets):
            # it may couple the elements of a tensor: one master per parameter, as it expects
            self._make_masters(flat=False)
            self.optimizer = self._make_optimizer(optimizer, param_groups is not None)

    # -- construction ------------------------------------------------------------------------
    def _make_layouts(self, params, groups, s_g, s_os, factors) -> dict[str, _RankLayout]:
        initialized = dist.is_available() and dist.is_initialized()
        me = dist.get_rank() if initialized else 0
        world = dist.get_world_size() if initialized else 1
        errors: list[str] = []
        mine: dict[str, tuple] = {}
        digest: dict[str, list] = {}
        for fqn, g in groups.items():
            if fqn not in params or g is None:
                continue
            if me not in g.ranks:
                errors.append(f"rank {me}: parameter {fqn!r} has replica group {g.ranks} "
                              f"(key {g.key!r}) without this rank")
            if tuple(g.ranks) not in {tuple(x) for x in g.all}:
                errors.append(f"rank {me}: replica group {g.ranks} of {fqn!r} is not one of "
                              f"the groups of key {g.key!r}: {g.all}")
            if len(g.ranks) == 1:
                continue
            spec = (tuple(tuple(x) for x in g.all), tuple(factors.get(g.key, (s_g, s_os))))
            if mine.setdefault(g.key, spec) != spec:
                errors.append(f"rank {me}: key {g.key!r} is given two partitions: "
                              f"{mine[g.key][0]} and {spec[0]}")
            t = params[fqn]
            digest.setdefault(g.key, []).append((fqn, tuple(t.shape), str(t.dtype)))
        payload = {"keys": mine, "errors": errors, "group": {}, "digest": {}}
        for fqn, g in groups.items():
            if g is not None and fqn in params and len(g.ranks) > 1:
                payload["group"][g.key] = tuple(g.ranks)
        payload["digest"] = {k: hashlib.sha1(repr(v).encode()).hexdigest()
                             for k, v in digest.items()}
        if initialized and world > 1:
            gathered: list = [None] * world
            dist.all_gather_object(gathered, payload)
        else:
            gathered = [payload]
        # Every rank now checks the same gathered data, so every rank raises the same error.
        errs = [e for p in gathered for e in p["errors"]]
        keys: dict[str, tuple] = {}
        for r, p in enumerate(gathered):
            for key, spec in p["keys"].items():
                if keys.setdefault(key, spec) != spec:
                    errs.append(f"key {key!r}: rank {r} sees partition/factors {spec}, "
                                f"another rank {keys[key]}")
        layouts: dict[str, GroupLayout] = {}
        for key in sorted(keys):
            parts, (kg, kos) = keys[key]
            seen: set[int] = set()
            for grp in parts:
                bad = [r for r in grp if not 0 <= r < world or r in seen]
                if bad:
                    errs.append(f"key {key!r}: groups {parts} overlap or name ranks outside "
                                f"0..{world - 1}: {bad}")
                seen.update(grp)
                if len(grp) > 1:
                    try:
                        check_factors(len(grp), kg, kos, f"key {key!r}, replica group {grp}")
                    except PlanError as e:
                        errs.append(str(e))
                # members of a group must hold the same parameters of this key
                dg = {gathered[r]["digest"].get(key) for r in grp if 0 <= r < world}
                if len(dg) > 1:
                    errs.append(f"key {key!r}: the ranks of replica group {grp} hold different "
                                f"parameters (names, shapes or dtypes) under this key")
        if errs:
            uniq = list(dict.fromkeys(errs))
            raise PlanError("ModelStates: " + "; ".join(uniq[:8]) +
                            (f" (+{len(uniq) - 8} more)" if len(uniq) > 8 else ""))
        needed: set[tuple[int, ...]] = set()
        for key in sorted(keys):
            parts, (kg, kos) = keys[key]
            for grp in parts:
                if len(grp) > 1:
                    gl = group_layout(grp, kg, kos)
                    if me in grp:
                        layouts[key] = gl
                    needed.update(gl.subgroups())
        pgs = _process_groups(needed) if needed else {}
        out = {_LOCAL_KEY: _RankLayout(_LOCAL_KEY, 1, 1, 1)}
        for key, gl in layouts.items():
            rl = _RankLayout(key, len(gl.group), gl.s_g, gl.s_os, gl.grad_chunk[me], gl.os_chunk[me])
            for gg in gl.grad_groups:
                if me in gg and gl.s_g > 1:
                    rl.sub_pg = pgs[gg]
            for cg in gl.cross_groups:
                if me in cg and len(cg) > 1:
                    rl.cross_pg = pgs[cg]
            for og in gl.os_groups:
                if me in og and gl.s_os > 1:
                    rl.os_pg = pgs[og]
                    ks = [gl.os_chunk[r] for r in og]
                    rl.os_order = torch.tensor(sorted(range(len(og)), key=ks.__getitem__))
            out[key] = rl
        return out

    def _make_buckets(self, reduce_dtype) -> list[_Bucket]:
        buckets: list[_Bucket] = []
        open_: dict[tuple, _Bucket] = {}
        closed: set[tuple] = set()   # streams whose first bucket is full
        for p in reversed(list(self._params.values())):
            if p.numel == 0:
                continue
            t = p.tensor
            sk = (p.lay.key, t.dtype, t.device)
            bk = open_.get(sk)
            if bk is None:
                bk = _Bucket(len(buckets), p.lay.key, t.dtype, reduce_dtype or t.dtype, p.lay,
                             t.device, [])
                buckets.append(bk)
                open_[sk] = bk
            p.bucket = bk
            bk.params.append(p)
            bk.row += p.cg
            bk.orow += p.cos
            if bk.nbytes >= (self.bucket_bytes if sk in closed else self.first_bucket_bytes):
                del open_[sk]
                closed.add(sk)
        shared = _shared_storage(p.tensor for p in self._params.values())
        for bk in buckets:
            # a param group's parameters next to each other (one flat segment each); which
            # parameters a bucket holds, not their order in it, decides when it launches
            first = {}
            for p in bk.params:
                first.setdefault(self._okey[p.fqn], len(first))
            bk.params.sort(key=lambda p: first[self._okey[p.fqn]])
            row = orow = 0
            for p in bk.params:
                p.off, p.ooff = row, orow
                row, orow = row + p.cg, orow + p.cos
            bk.waiting = len(bk.params)
            bk.flat = (bk.dtype == torch.float32 and bk.lay.s_os == 1 and
                       all(p.tensor.is_contiguous() and not shared(p.tensor) for p in bk.params))
        return buckets

    def _flatten(self) -> None:
        """The parameters of each flat bucket move into one storage, in bucket order (their
        Python objects stay, so whatever writes them in place writes it)."""
        with torch.no_grad():
            for bk in self._buckets:
                if bk.flat:
                    bk.store = torch.empty(bk.row, dtype=torch.float32, device=bk.device)
                    for p in bk.params:
                        view = bk.store[p.off:p.off + p.numel].view(p.tensor.shape)
                        view.copy_(p.tensor)
                        p.tensor.data = view

    def _make_masters(self, flat: bool) -> None:
        """The optimizer's tensors: with ``flat``, one per (bucket, param group) segment of
        each flat bucket (a view of its storage); the others one per parameter. ``_masters``
        lists ``(tensor, bucket, start)``: its gradient is ``bucket.reduced[start:start + n]``."""
        self._masters: list[tuple[torch.Tensor, _Bucket | None, int]] = []
        for bk in self._buckets:
            if not (flat and bk.flat):
                continue
            segs: dict[tuple, list[_Param]] = {}
            for p in bk.params:
                segs.setdefault(self._okey[p.fqn], []).append(p)
            for ps in segs.values():
                lo = ps[0].off
                master = bk.store[lo:ps[-1].off + ps[-1].numel]
                self._masters.append((master, bk, lo))
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

    def _load_master(self, p: _Param) -> None:
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
            return optimizer([p.master for p in masters.values()])
        groups: dict[tuple, dict] = {}
        for p in masters.values():
            key = self._okey[p.fqn]
            groups.setdefault(key, {**self._opts[p.fqn], "params": []})["params"].append(p.master)
        return optimizer(list(groups.values()))

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

    def _param(self, fqn: str) -> _Param:
        try:
            return self._params[fqn]
        except KeyError:
            raise FxparError(f"ModelStates: unknown parameter {fqn!r}") from None

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
        return ok

    def begin_backward(self) -> None:
        """Before a backward: the ``.grad`` of every :meth:`in_place` leaf becomes a view of
        its slice of this round's bucket buffer (made now: reused, zeroed), so autograd's
        accumulation (``grad += new``, grad mode off) writes the bucket directly. Contributions
        through :meth:`add_grad` add to the same buffer. :meth:`finish_backward` (and
        :meth:`zero_grad`) set those ``.grad`` back to ``None``: the buffer is reused later."""
        for p in self._in_place:
            p.view = p.bucket.round_buf()[p.off:p.off + p.numel].view(p.tensor.shape)
            p.tensor.grad = p.view

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

    def _arrive(self, p: _Param, fqn: str) -> None:
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
    def _advance(bk: _Bucket) -> None:
        """Second stage of a hierarchical reduction: all-reduce the scattered chunk across."""
        if not bk.stage2:
            return
        bk.work.wait()
        bk.buf = None
        bk.work = dist.all_reduce(bk.out, group=bk.lay.cross_pg, async_op=True)
        bk.stage2 = False

    def finish_backward(self) -> None:
        """Finish the planned contributions (:meth:`add_planned_grad`), then launch every bucket
        not launched yet (in bucket order) and wait for all of them."""
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

    # -- step ------------------------------------------------------------------------------
    def step(self) -> None:
        """Optimizer step on the local chunks, then every rank's storage is made whole again
        (all-gather over the ``s_os`` subgroups; in place, so ``param`` objects stay valid)."""
        if self._in_round:
            raise FxparError("step() called before finish_backward()")
        for p in self._params.values():
            if not p.master_is_view and p.tensor._version != p.version:
                self._load_master(p)   # the parameter was changed outside (weights loaded)
        for master, bk, lo in self._masters:   # the reduced gradient: a view into the bucket
            g = None if bk is None or bk.reduced is None else bk.reduced[lo:lo + master.numel()]
            if g is not None and g.dtype != torch.float32:
                g = g.float()
            master.grad = g
        if self.optimizer is not None:
            self.optimizer.step()
        gathers = []
        for bk in self._buckets:
            lay = bk.lay
            if lay.os_pg is None:
                continue
            inp = torch.empty(bk.orow, dtype=bk.dtype, device=bk.device)
            for p in bk.params:
                inp[p.ooff:p.ooff + p.cos].copy_(p.master)
            out = torch.empty(lay.s_os * bk.orow, dtype=bk.dtype, device=bk.device)
            gathers.append((bk, out, dist.all_gather_into_tensor(out, inp, group=lay.os_pg,
                                                                 async_op=True)))
        with torch.no_grad():
            for p in self._params.values():
                if p.lay.os_pg is None and not p.master_is_view:
                    p.tensor.copy_(p.master[:p.numel].view(p.tensor.shape))
                    p.version = p.tensor._version
            for bk, out, work in gathers:
                work.wait()
                rows = out.view(bk.lay.s_os, bk.orow)
                order = bk.lay.os_order.to(bk.device)
                for p in bk.params:
                    full = rows[:, p.ooff:p.ooff + p.cos].index_select(0, order).reshape(-1)
                    p.tensor.copy_(full[:p.numel].view(p.tensor.shape))
                    p.version = p.tensor._version
        for master, _, _ in self._masters:
            master.grad = None

    def zero_grad(self) -> None:
        """Drop the reduced gradients (and wait for any reduction still in flight)."""
        for bk in self._buckets:
            self._advance(bk)
            if bk.work is not None:
                bk.work.wait()
            if bk.lay.s_g == 1 and bk.reduced is not None:
                bk.spare = bk.reduced     # (a round's buffer) dropped: reused, not reallocated
            bk.reduced = None
        self._reset_round()
        for master, _, _ in self._masters:
            master.grad = None

    # -- inspection ------------------------------------------------------------------------
    def grad_norm_term(self, norm_type: float, copies: Mapping[str, int]) -> torch.Tensor:
        """This rank's share of ``Σ |g|^p`` over every distinct gradient element (fp32 scalar;
        for ``p = inf`` the max ``|g|``), after :meth:`finish_backward`.

        A rank holds chunk ``b`` of each reduced gradient (``s_g`` chunks per replica group of
        ``n``), and ``n/s_g`` ranks of the group hold that same chunk; ``copies[fqn]`` says how
        many more identical copies of the parameter's storage exist outside its replica group
        (mesh axes where the plan replicates it and nothing is reduced; default 1). So element
        sums are weighted by ``s_g / (n · copies)``: summed over all ranks (``all_reduce``),
        each distinct element counts once. Padding is zero and adds nothing."""
        inf = norm_type == float("inf")
        total = torch.zeros((), dtype=torch.float32)
        for bk in self._buckets:
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

    def scale_grads(self, factor: float) -> None:
        """Multiply every reduced gradient chunk by ``factor`` (gradient clipping)."""
        with torch.no_grad():
            for bk in self._buckets:
                if bk.reduced is not None:
                    bk.reduced.mul_(factor)

    def grads(self) -> dict[str, torch.Tensor]:
        """Every parameter's fully reduced local gradient (storage shape). Collective when
        ``s_g > 1`` (gathers the chunks); for tests and debugging, not the hot path."""
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
                out[p.fqn] = g.view(p.tensor.shape).to(p.tensor.dtype).clone()
        for fqn, p in self._params.items():
            if fqn not in out:  # empty parameters
                out[fqn] = torch.zeros_like(p.tensor)
        return {fqn: out[fqn] for fqn in self._params}

    def optimizer_state(self) -> tuple[dict[str, dict[str, torch.Tensor]], list[dict]]:
        """The optimizer state of every parameter in its local STORAGE shape (per-element
        states gathered over the ``s_os`` subgroup; scalars such as Adam's ``step`` as they
        are, copied: a flat segment's parameters share them), and the param groups'
        hyperparameters with ``"params"`` as FQN lists. Collective over the optimizer
        subgroups; for checkpoints, not the hot path."""
        out: dict[str, dict[str, torch.Tensor]] = {}
        members: dict[int, list[str]] = {}
        for p in self._params.values():
            members.setdefault(id(p.master), []).append(p.fqn)
            st = self.optimizer.state.get(p.master, {})
            n = p.master.numel()
            out[p.fqn] = {k: (self._whole(p, v[p.moff:p.moff + p.cos]) if v.ndim and v.numel() == n
                              else v.clone()) if torch.is_tensor(v) else v for k, v in st.items()}
        order = {f: i for i, f in enumerate(self._params)}
        groups = [{**{k: v for k, v in g.items() if k != "params"},
                   "params": sorted((f for t in g["params"] for f in members[id(t)]), key=order.get)}
                  for g in (self.optimizer.param_groups if self.optimizer is not None else ())]
        return out, groups

    def _whole(self, p: _Param, chunk: torch.Tensor) -> torch.Tensor:
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
        new: dict[int, dict] = {}
        for fqn, st in state.items():
            p = self._param(fqn)
            m = p.master
            chunk = new.setdefault(id(m), {})
            for k, v in st.items():
                if torch.is_tensor(v) and v.ndim and v.numel() == p.numel:
                    if k not in chunk:
                        chunk[k] = torch.zeros(m.numel(), dtype=v.dtype, device=m.device)
                    lo = p.lay.k * p.cos
                    chunk[k][p.moff:p.moff + p.real].copy_(v.reshape(-1)[lo:lo + p.real])
                else:
                    chunk[k] = v.to(m.device) if torch.is_tensor(v) else v
            self.optimizer.state[m] = chunk
        if groups and self.optimizer is not None:
            saved = {f: g for g in groups for f in g["params"]}
            fqn_of = {id(p.master): p.fqn for p in reversed(self._params.values())}
            for g in self.optimizer.param_groups:
                src = saved.get(fqn_of[id(g["params"][0])]) if g["params"] else None
                if src is not None:
                    g.update({k: v for k, v in src.items() if k != "params"})

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
        grad = sum(t.numel() * t.element_size() for bk in self._buckets
                   for t in (bk.reduced, bk.spare) if t is not None)
        master = sum(p.master.numel() * 4 for p in self._params.values() if not p.master_is_view)
        states = 0
        for st in (self.optimizer.state.values() if self.optimizer is not None else ()):
            for v in st.values():
                if torch.is_tensor(v) and v.dim() > 0:
                    states += v.numel() * v.element_size()
        return {"grad": grad, "master": master, "optimizer": states}

    @property
    def num_buckets(self) -> int:
        return len(self._buckets)

    @property
    def launched_buckets(self) -> int:
        """Buckets launched so far in the current backward (for tests of overlap)."""
        return self._next
