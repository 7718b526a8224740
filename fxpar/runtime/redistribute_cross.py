"""Execute a :class:`fxpar.resharding.cross.CrossMeshPlan` with ``torch.distributed`` (gloo or NCCL).

Device id = global rank (as :meth:`fxpar.Mesh.to_device_mesh`). Two calls:

* :func:`prepare_cross_mesh` ``(plan)`` — **collective over the whole world**: every rank
  calls it with the same plans in the same order. It creates, with ``dist.new_group``, the
  subgroups the plan broadcasts and all-gathers over (``{sender} ∪ receivers`` of a broadcast
  task, the receivers on one host of an all-gather task), in sorted order, and, for a Partial
  source, the source mesh's ``DeviceMesh``. Groups are cached per rank set (shared by plans),
  the preparation per plan; a second call is free.
* :func:`cross_mesh_reshard` ``(plan, local)`` — prepares the plan if needed (then every rank
  must call it), and moves the data: returns this rank's destination shard (a contiguous
  tensor of ``plan.dst_spec``'s local shape at its coordinate) or ``None`` if the rank is not on
  the destination mesh. A rank outside both meshes returns ``None`` at once (after the
  preparation); once a plan is prepared, only ranks of the two meshes need to call.

What a rank does, in order:

1. a source rank with a Partial source runs ``plan.pre`` (the intra-mesh reduction) on the
   source mesh (:func:`fxpar.runtime.redistribute.execute`);
2. a destination rank allocates its shard and copies in the pieces it holds itself
   (``task.local``: overlapping meshes, no transfer);
3. the tasks in ``plan.order`` (by predicted start): every rank runs the operations it takes
   part in, in that one global order, so blocking sends, receives and collectives over
   overlapping groups never wait on each other in a cycle. Per strategy:
   ``send_recv``: the sender sends the piece to each receiver; ``broadcast``:
   ``dist.broadcast`` over ``{sender} ∪ receivers``; ``allgather``: per receiving host the
   sender sends piece ``i`` of the slice (bytes padded to ``k·⌈n/k⌉``) to the ``i``-th
   receiver, then the host's receivers ``all_gather_into_tensor`` and drop the padding.

Pieces travel as raw bytes (``uint8`` views of contiguous slices), so any dtype moves bit for
bit on any backend; uneven shards need no other padding (every piece has a known shape).
Tensors live on ``local``'s device, else on ``device`` (default: the current CUDA device when
the default backend is NCCL, else CPU).

>>> import torch
>>> from fxpar.runtime.redistribute_cross import _to_bytes, _from_bytes
>>> x = torch.arange(6, dtype=torch.float16).reshape(2, 3)
>>> b = _to_bytes(x)
>>> b.dtype, b.numel(), torch.equal(_from_bytes(b, torch.float16, (2, 3)), x)
(torch.uint8, 12, True)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fxpar.cost.reshard_cross import Strategy
from fxpar.errors import ReshardError
from fxpar.kinds import StrKind
from fxpar.resharding.cross import CrossMeshPlan, region_slices

__all__ = ["cross_mesh_reshard", "cross_mesh_start", "prepare_cross_mesh", "plan_groups", "rank_ops"]

_GROUPS: dict[tuple[int, ...], object] = {}
_PREPARED: dict = {}
_WORLD: list = [None]


# -- pure: the operations of a plan ------------------------------------------------------------
class OpKind(StrKind):
    """What one operation of a plan's global order does (:class:`_Op`)."""

    SEND = "send"      # src -> dst
    BCAST = "bcast"    # over group, from src
    GATHER = "gather"  # all-gather over group


_GROUP_OPS = frozenset({OpKind.BCAST, OpKind.GATHER})  # the ones that need a process group


@dataclass(frozen=True)
class _Op:
    """One operation of the global order: ``kind`` an :class:`OpKind`; ``task`` is the unit
    task; ``part``/``parts`` the piece of an all-gather task (``parts == 0``: the whole slice)."""

    kind: OpKind
    task: int
    src: int
    dst: int = -1
    group: tuple[int, ...] = ()
    part: int = 0
    parts: int = 0

    def ranks(self) -> tuple[int, ...]:
        return (self.src, self.dst) if self.kind is OpKind.SEND else self.group


def _hosts(plan: CrossMeshPlan, sender: int, receivers: Sequence[int]) -> list[tuple[int, ...]]:
    """Receivers by host: the sender's host first, then ascending (as the cost model)."""
    node = plan.src_mesh.cluster.node_of
    by: dict[int, list[int]] = {}
    for r in sorted(receivers):
        by.setdefault(node(r), []).append(r)
    me = node(sender)
    return [tuple(by[h]) for h in sorted(by, key=lambda h: (h != me, h))]


def _send_recv_ops(plan: CrossMeshPlan, i: int, t) -> list[_Op]:
    return [_Op(OpKind.SEND, i, t.sender, r) for r in t.receivers]


def _broadcast_ops(plan: CrossMeshPlan, i: int, t) -> list[_Op]:
    return [_Op(OpKind.BCAST, i, t.sender, group=tuple(sorted((t.sender,) + t.receivers)))]


def _allgather_ops(plan: CrossMeshPlan, i: int, t) -> list[_Op]:
    out: list[_Op] = []
    s = t.sender
    hosts = _hosts(plan, s, t.receivers)
    for rs in hosts:
        k = len(rs)
        out += [_Op(OpKind.SEND, i, s, r, group=rs, part=j, parts=k) for j, r in enumerate(rs)]
    out += [_Op(OpKind.GATHER, i, s, group=rs, parts=len(rs)) for rs in hosts if len(rs) > 1]
    return out


#: a task's strategy -> ``f(plan, task index, task)``: its operations
_TASK_OPS = {Strategy.SEND_RECV: _send_recv_ops, Strategy.BROADCAST: _broadcast_ops,
             Strategy.ALLGATHER: _allgather_ops}


def _ops(plan: CrossMeshPlan) -> tuple[_Op, ...]:
    out: list[_Op] = []
    for i in plan.order:
        t = plan.tasks[i]
        ops = _TASK_OPS.get(t.strategy)
        if ops is None:
            raise ReshardError(f"cross-mesh plan task {i} has unknown strategy {t.strategy!r}")
        out += ops(plan, i, t)
    return tuple(out)


def plan_groups(plan: CrossMeshPlan) -> tuple[tuple[int, ...], ...]:
    """The process groups (sorted global ranks) the plan's collectives run over, sorted: what
    :func:`prepare_cross_mesh` creates.

    >>> import fxpar
    >>> c = fxpar.Cluster.preset("aws-p3.8xlarge", nodes=2)
    >>> a, b = fxpar.Mesh(c, x=4), fxpar.Mesh(c, x=4, offset=4)
    >>> plan_groups(fxpar.cross_mesh_plan(a, "S(0)", b, "R", shape=(4, 2**20)))
    ((0, 4, 5, 6, 7), (1, 4, 5, 6, 7), (2, 4, 5, 6, 7), (3, 4, 5, 6, 7))
    """
    return tuple(sorted({op.group for op in _ops(plan) if op.kind in _GROUP_OPS}))


def rank_ops(plan: CrossMeshPlan, rank: int) -> tuple[_Op, ...]:
    """The operations ``rank`` takes part in, in the plan's global order.

    >>> import fxpar
    >>> c = fxpar.Cluster.preset("aws-p3.8xlarge", nodes=2)
    >>> a, b = fxpar.Mesh(c, x=2), fxpar.Mesh(c, x=2, offset=4)
    >>> [(o.kind, o.src, o.dst) for o in rank_ops(fxpar.cross_mesh_plan(a, "S(0)", b, "S(0)", shape=(4,)), 5)]
    [('send', 1, 5)]
    """
    return tuple(op for op in _ops(plan) if rank in op.ranks())


# -- process groups ----------------------------------------------------------------------------
def _check_world() -> None:
    world = dist.group.WORLD
    if _WORLD[0] is not world:  # a new default group: old subgroups are gone
        _GROUPS.clear()
        _PREPARED.clear()
        _WORLD[0] = world


def _new_groups(needed: Sequence[tuple[int, ...]]) -> None:
    """Create (collectively, in sorted order) every group in ``needed`` not made yet; every rank
    asks for the same groups in the same order, so the caches agree."""
    for ranks in sorted(set(needed) - set(_GROUPS)):
        _GROUPS[ranks] = dist.new_group(list(ranks))


@dataclass
class _Prepared:
    ops: tuple[_Op, ...]          # this rank's
    src_dm: object = None         # DeviceMesh of the source mesh (Partial sources)


def prepare_cross_mesh(plan: CrossMeshPlan, *, src_device_mesh=None) -> None:
    """Create the plan's subgroups (and, for a Partial source, the source mesh's ``DeviceMesh``
    unless ``src_device_mesh`` is given). **Collective over the world**: every rank calls it
    with the same plans in the same order. Cached per plan; later calls return at once."""
    if not isinstance(plan, CrossMeshPlan):
        raise ReshardError(f"cross-mesh reshard needs a CrossMeshPlan, got {type(plan).__name__}")
    if not dist.is_initialized():
        raise ReshardError("cross-mesh reshard needs an initialized torch.distributed process group")
    _check_world()
    if plan in _PREPARED:
        return
    world = dist.get_world_size()
    top = max(plan.src_mesh.devices + plan.dst_mesh.devices)
    if top >= world:
        raise ReshardError(f"cross-mesh plan {plan!r} uses device {top} but the world has {world} ranks "
                           f"(device id = global rank)")
    src_dm = src_device_mesh
    if plan.pre is not None and src_dm is None:
        from fxpar.runtime.redistribute import as_device_mesh

        src_dm = as_device_mesh(plan.src_mesh)  # collective: every rank
    _new_groups(plan_groups(plan))
    _PREPARED[plan] = _Prepared(rank_ops(plan, dist.get_rank()), src_dm)


def _default_device():
    if torch.cuda.is_available() and "nccl" in str(dist.get_backend()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _to_bytes(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().reshape(-1).view(torch.uint8)


def _from_bytes(b: torch.Tensor, dtype: torch.dtype, shape) -> torch.Tensor:
    return b.view(dtype).reshape(shape)


def _setup(plan: CrossMeshPlan, local, device, src_device_mesh):
    """Checks, the Partial pre-reduction and the destination shard with its local pieces:
    ``(rank, prepared, local, device, dtype, src region, out, dst region)``, or ``None`` on a
    rank outside both meshes."""
    prepare_cross_mesh(plan, src_device_mesh=src_device_mesh)
    rank = dist.get_rank()
    in_src, in_dst = rank in plan.src_mesh.devices, rank in plan.dst_mesh.devices
    if not in_src and local is not None:
        raise ReshardError(f"cross-mesh reshard: rank {rank} is not on the source mesh "
                           f"{plan.src_mesh!r} but was given a local tensor of shape {tuple(local.shape)}")
    if not in_src and not in_dst:
        return None
    prep = _PREPARED[plan]
    if in_src:
        coord = plan.src_mesh.coord(rank)
        if local is None:
            raise ReshardError(f"cross-mesh reshard: rank {rank} at coordinate {coord} of the source mesh "
                               f"{plan.src_mesh!r} needs its shard of {plan.src_spec} (got None)")
        want = plan.src_spec.local_shape(plan.shape, plan.src_mesh.shape, coord)
        if tuple(local.shape) != tuple(want):
            raise ReshardError(
                f"cross-mesh reshard: local tensor of shape {tuple(local.shape)} at coordinate {coord} "
                f"of {plan.src_mesh!r}, but spec {plan.src_spec} of global shape {plan.shape} gives {want}")
        if local.dtype != plan.dtype:
            raise ReshardError(
                f"cross-mesh reshard: local tensor of dtype {local.dtype} at coordinate {coord} of "
                f"{plan.src_mesh!r}, but the plan ({plan.src_spec} -> {plan.dst_spec}) was made for "
                f"{plan.dtype} (ranks only on the destination mesh allocate that dtype)")
        if plan.pre is not None:
            from fxpar.runtime.redistribute import execute

            local = execute(plan.pre, local, prep.src_dm)
        dev, dtype = local.device, local.dtype
        src_reg = plan.src_region(rank)
    else:
        dev = torch.device(device) if device is not None else _default_device()
        dtype, src_reg = plan.dtype, None

    out = None
    dst_reg = None
    if in_dst:
        dst_reg = plan.dst_region(rank)
        out = torch.empty(tuple(b - a for a, b in dst_reg), dtype=dtype, device=dev)
        for t in plan.tasks:
            if rank in t.local:
                out[region_slices(t.region, dst_reg)] = local[region_slices(t.region, src_reg)]
    return rank, prep, local, dev, dtype, src_reg, out, dst_reg


def cross_mesh_reshard(plan: CrossMeshPlan, local: torch.Tensor | None, *, device=None,
                       src_device_mesh=None, tag: int = 0) -> torch.Tensor | None:
    """Run ``plan`` (module docstring): ``local`` is this rank's source shard in
    ``plan.src_spec`` (``None`` on a rank outside the source mesh); returns its destination
    shard in ``plan.dst_spec`` (``None`` outside the destination mesh). ``tag`` marks the
    point-to-point messages (gloo matches sends and receives by peer and tag).

    Raises :class:`fxpar.ReshardError` naming the plan, mesh, coordinate and shapes when
    ``local`` is missing on a source rank, given on another rank, or of the wrong shape or
    dtype (``plan.dtype``: ranks only on the destination mesh allocate their shard in it).
    """
    got = _setup(plan, local, device, src_device_mesh)
    if got is None:
        return None
    rank, prep, local, dev, dtype, src_reg, out, dst_reg = got

    def piece(t) -> torch.Tensor:  # this (sender) rank's bytes of task t
        return _to_bytes(local[region_slices(t.region, src_reg)])

    def put(t, b: torch.Tensor) -> None:  # write received bytes of task t into the shard
        out[region_slices(t.region, dst_reg)] = _from_bytes(b, dtype, t.shape)

    parts: dict[int, torch.Tensor] = {}   # all-gather tasks: this rank's received part
    padded: dict[tuple[int, int], torch.Tensor] = {}   # sender: an all-gather task's padded bytes

    def send_part(op: _Op, t, nb: int) -> None:  # part `op.part` of `op.parts` of an all-gather task
        c = math.ceil(nb / op.parts)
        if rank == op.src:
            key = (op.task, op.parts)
            if key not in padded:
                padded[key] = _pad(piece(t), c * op.parts)
            dist.send(padded[key][op.part * c: (op.part + 1) * c], op.dst, tag=tag)
        else:
            buf = torch.empty(c, dtype=torch.uint8, device=dev)
            dist.recv(buf, op.src, tag=tag)
            if op.parts == 1:
                put(t, buf[:nb])
            else:
                parts[op.task] = buf

    def send(op: _Op, t, nb: int) -> None:
        if op.parts:
            return send_part(op, t, nb)
        if rank == op.src:
            dist.send(piece(t), op.dst, tag=tag)
        else:
            buf = torch.empty(nb, dtype=torch.uint8, device=dev)
            dist.recv(buf, op.src, tag=tag)
            put(t, buf)

    def bcast(op: _Op, t, nb: int) -> None:
        buf = piece(t) if rank == op.src else torch.empty(nb, dtype=torch.uint8, device=dev)
        dist.broadcast(buf, src=op.src, group=_GROUPS[op.group])
        if rank != op.src:
            put(t, buf)

    def gather(op: _Op, t, nb: int) -> None:
        mine = parts.pop(op.task)
        full = torch.empty(mine.numel() * op.parts, dtype=torch.uint8, device=dev)
        _all_gather(full, mine, group=_GROUPS[op.group])
        put(t, full[:nb])

    run = {OpKind.SEND: send, OpKind.BCAST: bcast, OpKind.GATHER: gather}
    for op in prep.ops:
        t = plan.tasks[op.task]
        run[op.kind](op, t, t.nbytes)
    return out


def _pad(b: torch.Tensor, n: int) -> torch.Tensor:
    return torch.cat([b, b.new_zeros(n - b.numel())]) if n > b.numel() else b


def _all_gather(out: torch.Tensor, x: torch.Tensor, group) -> None:
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, x, group=group)


def cross_mesh_start(plan: CrossMeshPlan, local: torch.Tensor | None, *, device=None,
                     src_device_mesh=None, tag: int = 0):
    """:func:`cross_mesh_reshard` without blocking the sending side, for a plan whose tasks
    are all ``send_recv`` (what a pipeline boundary uses: its schedules assume a send never
    waits for the receiver). Returns ``(out, works)``: this rank's destination shard, already
    received (``None`` off the destination mesh), and the sends' works, to wait on before
    ``local`` is changed or freed."""
    bad = sorted({t.strategy for t in plan.tasks} - {Strategy.SEND_RECV})
    if bad:
        raise ReshardError(f"cross_mesh_start needs a send_recv plan; {plan!r} has {bad} tasks")
    got = _setup(plan, local, device, src_device_mesh)
    if got is None:
        return None, []
    rank, prep, local, dev, dtype, src_reg, out, dst_reg = got
    sends, recvs = [], []
    for op in prep.ops:
        t = plan.tasks[op.task]
        if rank == op.src:
            sends.append(dist.P2POp(dist.isend, _to_bytes(local[region_slices(t.region, src_reg)]),
                                    op.dst, tag=tag))
        else:
            recvs.append((t, dist.P2POp(dist.irecv, torch.empty(t.nbytes, dtype=torch.uint8, device=dev),
                                        op.src, tag=tag)))
    works = dist.batch_isend_irecv(sends + [op for _, op in recvs]) if sends or recvs else []
    for w in works[len(sends):]:
        w.wait()
    for t, op in recvs:
        out[region_slices(t.region, dst_reg)] = _from_bytes(op.tensor, dtype, t.shape)
    return out, list(works[:len(sends)])
