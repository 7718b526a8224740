"""Which shard of which parameter each rank owns: replica groups, AMSP factors, subgroups.

Every parameter has a *storage* tensor on each rank: its local shard under the plan's spec (the
plan may already shard parameters — AMSP's ``s_p``, e.g. ZeRO-3 — which this package does not
see). The ranks that hold the *identical* storage of a parameter and each compute a partial
gradient of it form its **replica group** (:class:`ReplicaGroup`; classic data parallelism): the
true gradient of the storage is the **sum** of the contributions over the group. Inside each
replica group of size ``n`` two AMSP factors decide who keeps what::

    1 <= s_g <= s_os <= n,      s_g | s_os | n

What each rank holds, for a parameter of ``N`` elements, flattened and zero-padded to
``N_p = ceil(N / s_os) * s_os`` (FSDP-style flat chunks; only the last chunk carries padding;
:func:`chunk_sizes`):

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

At run time (:func:`rank_layouts`, collective over the default process group) every rank
exchanges its replica groups' partitions and factors, checks them (a bad factor or an
inconsistent layout raises :class:`PlanError` on every rank), creates the subgroups' process
groups in one order everywhere and keeps its own view of each layout (:class:`RankLayout`:
process groups and chunk indices); :func:`param_shards` gives every parameter its record
(:class:`ParamShard`), which the gradient buckets and the optimizer fill in.

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

One process, nothing to reduce (``None`` groups): every parameter on the local layout::

>>> import torch
>>> ps = {"w": torch.zeros(2, 3)}
>>> shards = param_shards(ps, {"w": None}, rank_layouts(ps, {"w": None}, s_g=1, s_os=1))
>>> p = shards["w"]
>>> p.lay.key, p.lay.n, (p.numel, p.padded, p.cg, p.cos)
('<local>', 1, (6, 6, 6, 6))
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from fxpar.errors import FxparError, PlanError

if TYPE_CHECKING:
    from fxpar.runtime.model_state.buckets import Bucket

__all__ = ["ReplicaGroup", "GroupLayout", "group_layout", "check_factors", "chunk_sizes",
           "RankLayout", "ParamShard", "LOCAL_KEY", "rank_layouts", "param_shards", "lookup"]

#: the layout key of parameters with nothing to reduce (no replica group, or a group of one)
LOCAL_KEY = "<local>"


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


# -- this rank's view ----------------------------------------------------------------------------

@dataclass(eq=False)
class RankLayout:
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


@dataclass(eq=False)
class ParamShard:
    """One parameter on this rank: its layout and chunk lengths (set here), its place in a
    gradient bucket (:mod:`~fxpar.runtime.model_state.buckets`) and its optimizer tensor
    (:mod:`~fxpar.runtime.model_state.optimizer`)."""

    fqn: str
    tensor: torch.Tensor
    lay: RankLayout
    numel: int
    padded: int
    cg: int
    cos: int
    # -- its gradient bucket (buckets.py) --
    bucket: Bucket | None = None
    off: int = 0          # offset of this param's gradient chunk in the bucket's row
    ooff: int = 0         # offset of its optimizer chunk in the bucket's gather buffer
    expected: int | None = None
    count: int = 0
    in_place: bool = False   # its leaf .grad accumulates in the bucket buffer (begin_backward)
    view: torch.Tensor | None = None   # that .grad in this round's buffer
    # -- its optimizer tensor (optimizer.py) --
    master: torch.Tensor | None = None   # the optimizer's tensor holding this param's chunk
    moff: int = 0         # offset of the chunk in it (a flat segment holds several params)
    master_is_view: bool = False
    version: int = -1

    @property
    def real(self) -> int:  # real (non-padding) elements of the optimizer chunk
        lo = self.lay.k * self.cos
        return max(0, min(self.numel, lo + self.cos) - lo)


def lookup(params: Mapping[str, ParamShard], fqn: str) -> ParamShard:
    """``params[fqn]``, or :class:`FxparError` naming the unknown parameter."""
    try:
        return params[fqn]
    except KeyError:
        raise FxparError(f"ModelStates: unknown parameter {fqn!r}") from None


def rank_layouts(params: Mapping[str, torch.Tensor], groups: Mapping[str, ReplicaGroup | None],
                 s_g: int, s_os: int,
                 factors: Mapping[str, tuple[int, int]] | None = None) -> dict[str, RankLayout]:
    """``{key: RankLayout}`` of this rank, one per replica-group key, plus :data:`LOCAL_KEY`.

    Collective over the default process group when it is initialized: every rank gathers every
    rank's keys, partitions, factors (``factors[key]`` overrides ``(s_g, s_os)``) and a digest
    of the parameters under each key, and checks them the same way, so a bad factor or an
    inconsistent layout raises the same :class:`PlanError` on every rank; then the subgroups'
    process groups are created, in one order on every rank."""
    factors = dict(factors or {})
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
    out = {LOCAL_KEY: RankLayout(LOCAL_KEY, 1, 1, 1)}
    for key, gl in layouts.items():
        rl = RankLayout(key, len(gl.group), gl.s_g, gl.s_os, gl.grad_chunk[me], gl.os_chunk[me])
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


def param_shards(params: Mapping[str, torch.Tensor], groups: Mapping[str, ReplicaGroup | None],
                 layouts: Mapping[str, RankLayout]) -> dict[str, ParamShard]:
    """``{fqn: ParamShard}`` in ``params``' order: each parameter on its group key's layout
    (:data:`LOCAL_KEY` for ``None`` or a group of one) with its chunk lengths."""
    out: dict[str, ParamShard] = {}
    for fqn, t in params.items():
        g = groups[fqn]
        lay = layouts[LOCAL_KEY if g is None or len(g.ranks) == 1 else g.key]
        n = t.numel()
        out[fqn] = ParamShard(fqn, t, lay, n, *chunk_sizes(n, lay.s_g, lay.s_os))
    return out
