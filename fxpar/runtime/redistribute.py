"""Execute a resharding plan on a live process group, with local (per-rank) tensors.

:func:`execute` runs each :class:`fxpar.resharding.intra.ReshardStep` of a plan over the process group
of the step's mesh axis (``DeviceMesh.get_group(axis)``) with the functional collectives
``torch.ops._c10d_functional.*`` (the ops fxpar's emitted graphs use) followed by
``wait_tensor``. Every rank of the mesh must call it with the same plan.

Uneven shards (``torch.chunk`` rules: chunks of ``c = ceil(n/G)``, the last ones smaller or
empty) are padded to ``c`` before the collective and trimmed after. Because only the trailing
chunks are short, the real data of the ``G`` padded blocks laid end to end is a prefix of
length ``n``: one ``narrow`` trims it. A group whose padded buffers are empty skips the
collective (every member of that group sees the same padded shapes, so they agree).

**Layout contract.** Every tensor :func:`execute`, :func:`execute_many` and :func:`finish`
return is contiguous (row-major, storage offset 0, no padding), as the fake kernels of the
communication ops (``x.new_empty(shape)``) and eager PyTorch's fresh tensors are. The trims
above are views into padded buffers (``narrow`` on a dim other than 0 is not contiguous), and
ops that read raw storage (``resize_``, ``as_strided``, ``set_``, ``.view`` after a gather)
would otherwise see the padding; so the result of the last step is made contiguous once, in
:func:`finish` (a copy only where a trim left a strided view).

:func:`execute_many` runs many plans at once and coalesces their collectives (one per mesh
axis, kind, op and dtype per round).

Step semantics on mesh axis ``i`` of size ``G`` (coordinate ``k`` on it):

* ``all_gather`` S(d)→R: pad dim d to ``c``, all-gather along a new leading dim, concatenate
  the blocks along d, keep the first ``n``.
* ``reduce_scatter`` P→S(d): pad dim d to ``G·c``, stack the ``G`` chunks, reduce-scatter
  (sum or avg), keep this rank's ``chunk_bounds(n, G, k)`` length.
* ``all_reduce`` P→R: all-reduce with the placement's op (sum, avg, max, min).
* ``all_to_all`` S(d)→S(e): pad d to ``c_d`` and e to ``G·c_e``, send chunk ``g`` of e to rank
  ``g``, concatenate what arrives along d, trim d to ``n_d`` and e to this rank's chunk.
* ``chunk`` R→S(d): keep ``chunk_bounds(n, G, k)`` of dim d (a copy, so the full buffer can be
  freed).
* ``to_partial`` R→P: sum: coordinate 0 keeps the value, the others hold zeros;
  avg/max/min: every rank keeps the value.
* ``rescale`` P(sum)→P(avg): ×G; P(avg)→P(sum): ÷G.

gloo in torch 2.13 supports every collective used here on CPU (all-gather into a tensor,
reduce-scatter of a tensor incl. avg, all-reduce incl. avg, equal-split all-to-all), so no
emulation is needed; but not every dtype (no int16, uint16/32/64, float8; no complex
all-to-all): such buffers travel bit-cast to ``uint8`` (data movement) or in a wider dtype
(reductions), see :func:`_to_wire`, so every plan runs whatever its dtypes.

>>> import torch
>>> from fxpar.spec import Spec
>>> full = torch.arange(10.).reshape(5, 2)
>>> distribute(full, Spec.parse("S(0)R"), (2, 2), (1, 0))
tensor([[6., 7.],
        [8., 9.]])
>>> parts = {c: distribute(full, Spec.parse("S(0)P(sum)"), (2, 2), c) for c in [(0, 0), (0, 1), (1, 0), (1, 1)]}
>>> parts[(0, 1)].abs().sum().item(), torch.equal(assemble(parts, "S(0)P(sum)", (2, 2), (5, 2)), full)
(0.0, True)
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from fxpar.cost.reshard import StepKind
from fxpar.errors import ReshardError
from fxpar.spec import Partial, Replicate, Spec, as_spec, chunk_bounds, partial_reducible, placement_kind

__all__ = ["execute", "execute_many", "execute_step", "start", "finish", "Pending", "distribute", "assemble",
           "as_device_mesh"]

_DEVICE_MESHES: dict = {}


# -- mesh helpers --------------------------------------------------------------------------
def _mesh_shape(mesh) -> tuple[int, ...]:
    if isinstance(mesh, (tuple, list)):
        return tuple(int(s) for s in mesh)
    shape = mesh.shape
    return tuple(int(s) for s in (shape() if callable(shape) else shape))


def as_device_mesh(mesh):
    """A ``DeviceMesh`` for an fxpar ``Mesh`` (made once per mesh and world group: making one
    is collective) or the ``DeviceMesh`` itself."""
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(mesh, DeviceMesh):
        return mesh
    from fxpar.mesh import Mesh

    if not isinstance(mesh, Mesh):
        raise ReshardError(f"execute needs a torch DeviceMesh or an fxpar Mesh, got {type(mesh).__name__}")
    import torch.distributed as dist

    key = (mesh, id(dist.group.WORLD))
    if key not in _DEVICE_MESHES:
        _DEVICE_MESHES[key] = mesh.to_device_mesh()
    return _DEVICE_MESHES[key]


# -- pure layout helpers -------------------------------------------------------------------
def distribute(full: torch.Tensor, spec: Spec | str, mesh, coord: Sequence[int]) -> torch.Tensor:
    """The local tensor of the device at ``coord`` for a tensor whose global value is ``full``
    (pure slicing per :meth:`Spec.global_slices`; a contiguous copy). On a ``Partial`` axis
    the value is split as ``to_partial`` does: for sum, coordinate 0 of that axis holds it and
    the others zeros; for avg/max/min every coordinate holds it. ``mesh`` is an fxpar Mesh, a
    DeviceMesh or a mesh shape tuple."""
    spec = as_spec(spec)
    mesh_shape = _mesh_shape(mesh)
    local = spec.local_of(full, mesh_shape, coord).clone()
    for axis, p in enumerate(spec):
        if isinstance(p, Partial) and p.reduce_op == "sum" and coord[axis] != 0:
            local.zero_()
    return local


def assemble(locals_: Mapping[tuple[int, ...], torch.Tensor], spec: Spec | str, mesh,
             shape: Sequence[int]) -> torch.Tensor:
    """Inverse of :func:`distribute` (for tests): the global value from every device's local
    tensor (``{coord: tensor}``). Partial axes are reduced with their op (the innermost axis
    first; mixed ops must commute), then every piece is written to its global slice. Devices
    that hold the same region (replicas) must agree exactly, else :class:`ReshardError`."""
    spec = as_spec(spec)
    mesh_shape = _mesh_shape(mesh)
    shape = tuple(shape)
    red = dict(locals_)
    for axis in reversed(range(len(spec))):
        p = spec[axis]
        if not isinstance(p, Partial):
            continue
        out = {}
        for c in red:
            if c[axis] == 0:
                st = torch.stack([red[c[:axis] + (k,) + c[axis + 1:]] for k in range(mesh_shape[axis])])
                op = p.reduce_op
                out[c] = (st.sum(0) if op == "sum" else st.mean(0) if op == "avg"
                          else st.amax(0) if op == "max" else st.amin(0))
        red = out
    full = next(iter(locals_.values())).new_zeros(shape)
    plain = Spec(tuple(Replicate() if isinstance(p, Partial) else p for p in spec))
    seen: dict[tuple, tuple] = {}
    for c, t in red.items():
        sl = plain.global_index(shape, mesh_shape, c)
        key = tuple(tuple(s) if isinstance(s, list) else (s.start, s.stop) for s in sl)
        if key in seen:
            if not torch.equal(seen[key][1], t):
                raise ReshardError(f"assemble {spec} of shape {shape}: devices {seen[key][0]} and {c} "
                                   f"hold the same region {key} with different values")
            continue
        seen[key] = (c, t)
        if any(isinstance(s, list) for s in sl):   # a strided dim: index every dim
            idx = [torch.tensor(s) if isinstance(s, list) else torch.arange(s.start, s.stop) for s in sl]
            full[torch.meshgrid(*idx, indexing="ij")] = t
        else:
            full[sl] = t
    return full


def _pad(x: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """``x`` zero-padded at the end of ``dim`` to ``size`` (``x`` itself if already that size)."""
    if x.shape[dim] == size:
        return x
    shape = list(x.shape)
    shape[dim] = size
    out = x.new_zeros(shape)
    out.narrow(dim, 0, x.shape[dim]).copy_(x)
    return out


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


# -- steps -----------------------------------------------------------------------------------
_F = None


def _ops():
    global _F
    if _F is None:
        import torch.distributed  # noqa: F401  (registers the _c10d_functional ops)

        _F = torch.ops._c10d_functional
    return _F


@dataclass
class _Comm:
    """A collective one step needs: ``data`` is flat ``(m,)`` for all_gather / all_reduce and
    ``(G, m)`` (block ``g`` for member ``g``) for reduce_scatter / all_to_all; ``finish``
    turns what comes back into the new local tensor: ``(G, m)`` gathered blocks, ``(m,)``
    reduced buffer, ``(m,)`` own reduced block, ``(G, m)`` received blocks respectively."""

    kind: str
    axis: int
    op: str | None
    data: torch.Tensor
    finish: Callable[[torch.Tensor], torch.Tensor]


@functools.lru_cache(maxsize=1 << 16)
def _local_shape(spec: Spec, shape: tuple[int, ...], mesh_shape: tuple[int, ...],
                 coord: tuple[int, ...]) -> tuple[int, ...]:
    """``spec.local_shape`` memoized: the same few (spec, shape, coordinate) recur every step."""
    return tuple(spec.local_shape(shape, mesh_shape, coord))


# one function per step kind: (local, axis i, group size G, source and destination placements
# on i, this rank's coordinate on i, the destination's local shape) -> the new local tensor (a
# local step) or the _Comm a collective needs
def _step_chunk(local, i, G, src_p, dst_p, k, out_shape):
    d = dst_p.dim
    if placement_kind(dst_p) == "T":   # chunk k of each of the f groups (even: checked by the spec)
        f = dst_p.split_factor
        grouped = local.unflatten(d, (f, local.shape[d] // f))
        c = grouped.shape[d + 1] // G
        return grouped.narrow(d + 1, k * c, c).flatten(d, d + 1).clone()
    a, b = chunk_bounds(local.shape[d], G, k)
    return local.narrow(d, a, b - a).clone()  # a copy: the full buffer can go


def _step_to_partial(local, i, G, src_p, dst_p, k, out_shape):
    return torch.zeros_like(local) if dst_p.reduce_op == "sum" and k != 0 else local


def _step_rescale(local, i, G, src_p, dst_p, k, out_shape):
    return local * G if dst_p.reduce_op == "avg" else local / G


def _step_all_reduce(local, i, G, src_p, dst_p, k, out_shape):
    x = local.contiguous()
    return _Comm(StepKind.ALL_REDUCE, i, src_p.reduce_op, x.view(-1), lambda r: r.view(x.shape))


def _step_all_gather(local, i, G, src_p, dst_p, k, out_shape):
    if placement_kind(src_p) == "T":
        return _gather_strided(local, i, G, src_p)
    # Pad to the first (largest) chunk; the G padded blocks end to end hold the n real
    # entries as a prefix, because only trailing chunks are short.
    d, n = src_p.dim, out_shape()[src_p.dim]
    x = _pad(local, d, _ceil(n, G)).contiguous()

    def finish_ag(r):
        return torch.cat(r.reshape(G, *x.shape).unbind(0), dim=d).narrow(d, 0, n)
    return _Comm(StepKind.ALL_GATHER, i, None, x.view(-1), finish_ag)


def _gather_strided(local, i, G, src_p):
    # member g's block holds chunk g of each of the f groups: (G, .., f, c, ..) -> (.., f, G, c, ..)
    d, f = src_p.dim, src_p.split_factor
    x = local.contiguous()

    def finish_ag(r):
        blocks = r.reshape(G, *x.shape).unflatten(d + 1, (f, x.shape[d] // f))
        return blocks.movedim(0, d + 1).flatten(d, d + 2)
    return _Comm(StepKind.ALL_GATHER, i, None, x.view(-1), finish_ag)


def _step_reduce_scatter(local, i, G, src_p, dst_p, k, out_shape):
    d = dst_p.dim
    c = _ceil(local.shape[d], G)
    blocks = torch.stack(_pad(local, d, G * c).split(c, dim=d))  # (G, chunk)
    b = blocks.shape[1:]
    n = out_shape()[d]
    return _Comm(StepKind.REDUCE_SCATTER, i, src_p.reduce_op, blocks.view(G, b.numel()),
                 lambda r: r.view(b).narrow(d, 0, n))


def _step_all_to_all(local, i, G, src_p, dst_p, k, out_shape):
    # S(d) -> S(e): chunk g of dim e goes to member g; what arrives from member g is its
    # piece of dim d, so the pieces concatenate along d.
    d, e = src_p.dim, dst_p.dim
    shp = out_shape()
    n_d = shp[d]
    c_e = _ceil(local.shape[e], G)
    x = _pad(_pad(local, d, _ceil(n_d, G)), e, G * c_e)
    blocks = torch.stack(x.split(c_e, dim=e))
    b = blocks.shape[1:]

    def finish_a2a(r):
        got = torch.cat(r.reshape(G, *b).unbind(0), dim=d)
        return got.narrow(d, 0, n_d).narrow(e, 0, shp[e])
    return _Comm(StepKind.ALL_TO_ALL, i, None, blocks.view(G, b.numel()), finish_a2a)


_STEPS = {
    StepKind.CHUNK: _step_chunk,
    StepKind.TO_PARTIAL: _step_to_partial,
    StepKind.RESCALE: _step_rescale,
    StepKind.ALL_REDUCE: _step_all_reduce,
    StepKind.ALL_GATHER: _step_all_gather,
    StepKind.REDUCE_SCATTER: _step_reduce_scatter,
    StepKind.ALL_TO_ALL: _step_all_to_all,
}
#: collectives that only move bytes: their result arrives as ``(G, m)`` per-member blocks, and
#: any dtype travels bit-cast to ``uint8`` (:func:`_to_wire`)
_BLOCKWISE = frozenset({StepKind.ALL_GATHER, StepKind.ALL_TO_ALL})


def _start(step, local: torch.Tensor, mesh_shape: tuple[int, ...], shape: Sequence[int],
           coord: Sequence[int]) -> torch.Tensor | _Comm:
    """The new local tensor for a local step, or the :class:`_Comm` a collective step needs."""
    i = step.axis
    G = mesh_shape[i]
    if G == 1 and step.kind != StepKind.RESCALE:
        return local  # a size-1 axis: every layout on it is the same tensor

    def out_shape():  # the destination's local shape gives every size (dim pieces, this rank's chunk)
        return _local_shape(step.dst, tuple(shape), tuple(mesh_shape), tuple(coord))
    run = _STEPS.get(step.kind)
    if run is None:
        raise ReshardError(f"unknown reshard step kind {step.kind!r} ({step})")
    return run(local, i, G, step.src[i], step.dst[i], coord[i], out_shape)


#: Dtypes every backend fxpar runs on (gloo, NCCL) moves and reduces natively.
_NATIVE = frozenset({torch.int8, torch.uint8, torch.int32, torch.int64, torch.bool, torch.float16,
                     torch.bfloat16, torch.float32, torch.float64})
#: Reductions of other dtypes run in a wider dtype holding every value (sum wraps the same way
#: once cast back: two's complement arithmetic is modulo 2**bits; max/min are order-preserving).
_WIDER = {torch.int16: torch.int32, torch.uint16: torch.int32, torch.uint32: torch.int64}


def _to_wire(buf: torch.Tensor, kind: str, op: str) -> torch.Tensor:
    """``buf`` as a dtype the backend supports (gloo has no int16, uint16/32/64, float8, nor
    complex all-to-all: ``RuntimeError: Invalid scalar type``). Data movement (all_gather,
    all_to_all) only copies bytes, so any other dtype is sent bit-cast to ``uint8`` (a view:
    the flat last dim grows by the element size). Reductions need arithmetic: int16/uint16/
    uint32 reduce in a wider integer, uint64 sums as int64 bits (the same modulo 2**64),
    float8 in float32; complex reduces natively. A reduction with no exact wire form (max/min
    of uint64) raises :class:`ReshardError` naming the dtype and op. :func:`_from_wire` undoes it.
    """
    dt = buf.dtype
    if dt in _NATIVE:
        return buf
    if kind in _BLOCKWISE:
        return buf.view(torch.uint8)
    if not partial_reducible(dt, op):  # the planner offers no such Partial; a hand-made plan
        raise ReshardError(f"{kind} with reduce op {op!r} of dtype {dt}: no backend-supported "
                           "dtype represents it exactly; keep this tensor replicated")
    if dt.is_complex:
        return buf
    if dt in _WIDER:
        return buf.to(_WIDER[dt])
    if dt == torch.uint64 and op == "sum":
        return buf.view(torch.int64)
    if dt.is_floating_point and op in ("sum", "max", "min"):
        return buf.to(torch.float32)
    raise ReshardError(f"{kind} with reduce op {op!r} of dtype {dt}: no backend-supported dtype "
                       "represents it exactly; keep this tensor replicated (or in another dtype)")


def _from_wire(r: torch.Tensor, dtype: torch.dtype, kind: str) -> torch.Tensor:
    """What came back from a collective run on :func:`_to_wire`'s buffer, as ``dtype``."""
    if r.dtype == dtype:
        return r
    if r.dtype == torch.uint8 and kind in _BLOCKWISE:
        return r.view(dtype)
    if dtype == torch.uint64 and r.dtype == torch.int64:
        return r.view(dtype)
    return r.to(dtype)


def _launch_all_to_all(f, buf, op, G, name):
    m = buf.shape[-1]  # per-member block, in wire elements
    return f.all_to_all_single(buf.reshape(-1), [m] * G, [m] * G, name)


#: collective -> ``f(functional ops, wire buffer, reduce op, group size, group name)`` launching it
_LAUNCH = {
    StepKind.ALL_REDUCE: lambda f, buf, op, G, name: f.all_reduce(buf, op, name),
    StepKind.ALL_GATHER: lambda f, buf, op, G, name: f.all_gather_into_tensor(buf, G, name),
    StepKind.REDUCE_SCATTER: lambda f, buf, op, G, name: f.reduce_scatter_tensor(buf.reshape(-1), op, G, name),
    StepKind.ALL_TO_ALL: _launch_all_to_all,
}


def _launch_comms(comms: Sequence[_Comm], device_mesh, mesh_shape) -> tuple[list, list]:
    """Launch the collectives of one round, coalesced: one collective per (axis, kind, op,
    dtype), none waited on. Every member of an axis group has the same requests with the same
    sizes (padded shapes do not depend on the coordinate along that axis), so the groups are
    the same on every member and in the same (sorted) order; a group with nothing to send is
    skipped by all its members alike. Returns ``(done, waiting)`` for :func:`_finish_comms`."""
    f = _ops()
    groups: dict[tuple, list[int]] = {}
    for k, c in enumerate(comms):
        groups.setdefault((c.axis, c.kind, c.op or "", str(c.data.dtype)), []).append(k)
    out: list = [None] * len(comms)
    waiting = []
    for key in sorted(groups):
        axis, kind, op, _ = key
        idx = groups[key]
        G = mesh_shape[axis]
        sizes = [comms[k].data.shape[-1] for k in idx]
        total = sum(sizes)
        if total == 0:
            for k in idx:
                d = comms[k].data
                out[k] = comms[k].finish(d.new_empty((G, 0) if kind in _BLOCKWISE else (0,)))
            continue
        parts = [comms[k].data for k in idx]
        buf = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
        dtype = buf.dtype
        buf = _to_wire(buf.contiguous(), kind, op)  # a dtype the backend has (same bytes moved)
        name = device_mesh.get_group(axis).group_name
        h = _LAUNCH[kind](f, buf, op, G, name)
        waiting.append((kind, G, idx, sizes, h, dtype))
    return out, waiting


def _finish_comms(comms: Sequence[_Comm], launched: tuple[list, list]) -> list[torch.Tensor]:
    """Wait for what :func:`_launch_comms` started; the new local tensors in order."""
    f = _ops()
    out, waiting = launched
    for kind, G, idx, sizes, h, dtype in waiting:
        r = _from_wire(f.wait_tensor(h), dtype, kind)
        if kind in _BLOCKWISE:
            r = r.view(G, -1)
        off = 0
        for k, m in zip(idx, sizes):
            out[k] = comms[k].finish(r[..., off:off + m])
            off += m
    return out


def _run_comms(comms: Sequence[_Comm], device_mesh, mesh_shape) -> list[torch.Tensor]:
    """Launch the collectives of one round (:func:`_launch_comms`), then wait for them."""
    return _finish_comms(comms, _launch_comms(comms, device_mesh, mesh_shape))


# -- execution -----------------------------------------------------------------------------
def _run_round(items: list, device_mesh, mesh_shape) -> list[torch.Tensor]:
    """``items`` are the results of :func:`_start`; returns the new local tensors."""
    comm_at = [k for k, x in enumerate(items) if isinstance(x, _Comm)]
    if comm_at:
        done = _run_comms([items[k] for k in comm_at], device_mesh, mesh_shape)
        items = list(items)
        for k, t in zip(comm_at, done):
            items[k] = t
    return items


def execute_step(step, local: torch.Tensor, device_mesh, shape: Sequence[int],
                 coord: Sequence[int]) -> torch.Tensor:
    """Run one :class:`~fxpar.resharding.intra.ReshardStep` on this rank's ``local`` tensor; ``coord``
    is this rank's mesh coordinate and ``shape`` the global shape. Returns the new local."""
    mesh_shape = _mesh_shape(device_mesh)
    return _run_round([_start(step, local, mesh_shape, shape, coord)], device_mesh, mesh_shape)[0]


def _prepare(plan, local: torch.Tensor, mesh_shape, coord) -> None:
    if mesh_shape != tuple(plan.mesh.shape):
        raise ReshardError(f"plan {plan} is for mesh shape {tuple(plan.mesh.shape)} "
                           f"({plan.mesh!r}) but the device mesh has shape {mesh_shape}")
    want = _local_shape(plan.src, tuple(plan.shape), tuple(mesh_shape), tuple(coord))
    if tuple(local.shape) != want:
        raise ReshardError(
            f"plan {plan}: local tensor of shape {tuple(local.shape)} at mesh coordinate {coord} "
            f"but spec {plan.src} of global shape {plan.shape} gives {want}")


def _coord(dm, what) -> tuple[int, ...]:
    coord = dm.get_coordinate()
    if coord is None:
        raise ReshardError(f"this rank is not in the device mesh {dm} of {what}")
    return tuple(coord)


def execute(plan, local: torch.Tensor, mesh) -> torch.Tensor:
    """Run ``plan`` (a :class:`fxpar.resharding.intra.ReshardPlan`) on this rank's ``local`` tensor and
    return the new local tensor. ``mesh`` is the ``DeviceMesh`` of the plan's mesh, or the
    fxpar ``Mesh`` itself (its ``DeviceMesh`` is made once and cached; making it is
    collective). Collective over the mesh: every rank calls it with the same plan.

    Raises :class:`ReshardError` if the mesh shape differs from the plan's or ``local`` does
    not have this rank's local shape under ``plan.src``. The plan's dtype only priced it; any
    dtype runs (avg and rescale need a floating dtype).
    """
    return execute_many([plan], [local], mesh)[0]


def execute_many(plans: Sequence, locals_: Sequence[torch.Tensor], mesh) -> list[torch.Tensor]:
    """Run several independent plans on the same mesh together; return their new local
    tensors in order. Round ``k`` runs step ``k`` of every plan that has one, and the
    collectives of a round are **coalesced**: one collective per (mesh axis, kind, reduce op,
    dtype) over the concatenated buffers of all plans, all launched before any is waited on
    (as FSDP gathers a flat parameter: one latency instead of one per tensor). Every rank
    must pass the same plans in the same order. Same checks as :func:`execute`.
    """
    return finish(start(plans, locals_, mesh))


@dataclass
class Pending:
    """Plans whose first round is in flight (:func:`start`); :func:`finish` completes them
    (once: later calls return the same tensors)."""

    plans: Sequence
    locals_: list
    comms: list
    launched: tuple | None
    device_mesh: object
    mesh_shape: tuple[int, ...]
    coord: tuple[int, ...]
    inputs: list = ()   # the local tensors started from
    done: list | None = None


def start(plans: Sequence, locals_: Sequence[torch.Tensor], mesh) -> Pending:
    """Launch round 0 of ``plans`` (as :func:`execute_many` would, coalesced) without waiting:
    the asynchronous half of a collective whose wait is placed later (prefetch). Local steps
    of round 0 run now. Collective: every rank starts the same plans in the same order."""
    if len(plans) != len(locals_):
        raise ReshardError(f"start: {len(plans)} plans but {len(locals_)} local tensors")
    dm = as_device_mesh(mesh)
    mesh_shape, coord = _mesh_shape(dm), _coord(dm, "start")
    for plan, local in zip(plans, locals_):
        _prepare(plan, local, mesh_shape, coord)
    cur = list(locals_)
    items = [_start(p.steps[0], cur[j], mesh_shape, p.shape, coord) if p.steps else cur[j]
             for j, p in enumerate(plans)]
    comm_at = [k for k, x in enumerate(items) if isinstance(x, _Comm)]
    comms = [items[k] for k in comm_at]
    launched = _launch_comms(comms, dm, mesh_shape) if comms else None
    return Pending(list(plans), items, comm_at, launched, dm, mesh_shape, coord, list(locals_))


def in_flight(p: Pending) -> torch.Tensor | None:
    """The buffer that will hold the result of ``p`` once :func:`finish` waits for it, when
    that is the whole plan (one plan, one all-reduce round in a native dtype: the reduced
    buffer IS the result), else ``None``. Reading it before :func:`finish` reads garbage;
    autograd may hold it (a loss: backward never reads the loss's value)."""
    if len(p.plans) != 1 or len(p.plans[0].steps) != 1 or p.launched is None:
        return None
    waiting = p.launched[1]
    if len(waiting) != 1:
        return None
    kind, _, _, _, h, dtype = waiting[0]
    return h if kind == StepKind.ALL_REDUCE and h.dtype == dtype else None


def finish(p: Pending) -> list[torch.Tensor]:
    """Wait for round 0 of :func:`start`, then run the remaining rounds; new local tensors,
    each contiguous (the layout contract of the module docstring)."""
    if p.done is not None:
        return p.done
    cur = list(p.locals_)
    if p.launched is not None:
        for k, t in zip(p.comms, _finish_comms([cur[k] for k in p.comms], p.launched)):
            cur[k] = t
    plans = p.plans
    for k in range(1, max((len(q.steps) for q in plans), default=0)):
        live = [j for j, q in enumerate(plans) if k < len(q.steps)]
        new = _run_round([_start(plans[j].steps[k], cur[j], p.mesh_shape, plans[j].shape, p.coord)
                          for j in live], p.device_mesh, p.mesh_shape)
        for j, t in zip(live, new):
            cur[j] = t
    cur = [t.contiguous() for t in cur]  # the layout contract (module docstring)
    p.done, p.locals_ = cur, []
    return cur
