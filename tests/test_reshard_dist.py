"""Resharding on real gloo ranks: every pair of specs from {S(0), S(1), R, P(sum)} per mesh axis,
on an even and an uneven shape, on a 2×2 mesh (4 ranks) and a 2×2×2 mesh (8 ranks).

Every result is compared bit for bit with the expected local tensor (the slice of the global
value that :meth:`Spec.global_slices` gives, the layout DTensor uses) and with
``DTensor.redistribute`` of the same source tensor. Values are small integers in float32, so
every partial sum is exact whatever the reduction order. A Partial destination has many valid
local representations (fxpar keeps the value on coordinate 0, DTensor divides it by G), so
there the results are first reduced over the partial axes (one batched all-reduce per axis
for all such pairs).

Speed (8 gloo ranks share 2 cores here): one tiny collective costs ~2–3 ms of wall time (every
rank of the group has to be scheduled), so many pairs run in one ``pool.run`` call, and on the
2×2×2 mesh all plans of a call run together through :func:`execute_many` (step k of every
plan in flight at once). The DTensor oracle runs one collective at a time (~15–30 ms a pair
there), so on 2×2×2 it checks every pair whose source is one of a fixed sample of specs.
"""

from __future__ import annotations

import itertools
import time
import zlib

import pytest
import torch

from fxpar.spec import Partial, Replicate, Shard, Spec

BASIC = (Shard(0), Shard(1), Replicate(), Partial("sum"))
_MESHES: dict = {}
_SOURCES: dict = {}


def _all_specs(ndim_mesh: int) -> list[str]:
    return [str(Spec(ps)) for ps in itertools.product(BASIC, repeat=ndim_mesh)]


def _meshes(mesh_shape):
    """(DeviceMesh, fxpar Mesh), made once per worker (making a DeviceMesh is collective)."""
    if mesh_shape not in _MESHES:
        import torch.distributed as dist

        from fxpar import Cluster, Mesh

        names = tuple("abcdefgh"[: len(mesh_shape)])
        mesh = Mesh(Cluster.local(dist.get_world_size()), dict(zip(names, mesh_shape)))
        _MESHES[mesh_shape] = (mesh.to_device_mesh("cpu"), mesh)
    return _MESHES[mesh_shape]


def _plain(spec: Spec) -> Spec:
    return Spec(tuple(Replicate() if isinstance(p, Partial) else p for p in spec))


def _source_local(value, src_s, mesh_shape, coord):
    """This rank's local tensor of ``src_s``: different integer addends on partial axes (the
    same on every rank for the same source spec, so cached)."""
    key = (src_s, tuple(value.shape), tuple(mesh_shape))
    if key not in _SOURCES:
        from test_reshard import partial_addends

        spec = Spec.parse(src_s)
        gen = torch.Generator().manual_seed(zlib.crc32(src_s.encode()))
        axes, addends = partial_addends(value, spec, mesh_shape, gen)
        sl = _plain(spec).global_slices(value.shape, mesh_shape, coord)
        _SOURCES[key] = addends[tuple(coord[a] for a in axes)][sl].clone()
    return _SOURCES[key]


def _dtensor_redistribute(local, src, dst, dm, shape, stride):
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor._redistribute import redistribute_local_tensor

    # DTensor.redistribute refuses to make a new Partial ("internal use only") and its engine
    # has no S -> P step: redistribute to dst with those axes replicated, then run the engine
    # for R -> P.
    new_p = [a for a, (p, q) in enumerate(zip(dst, src)) if p.is_partial() and p != q]
    mid = Spec(tuple(Replicate() if a in new_p else p for a, p in enumerate(dst)))
    out = (DTensor.from_local(local, dm, src.placements, run_check=False, shape=shape, stride=stride)
           .redistribute(dm, mid.placements).to_local())
    if new_p:
        meta = TensorMeta(torch.Size(shape), stride, local.dtype)
        out = redistribute_local_tensor(out, DTensorSpec(dm, mid.placements, tensor_meta=meta),
                                        DTensorSpec(dm, dst.placements, tensor_meta=meta))
    return out


def _check_pairs(mesh_shape, shape, pairs, batched, oracle_srcs):
    """Worker: reshard every ``(src, dst)`` pair with fxpar (one by one, or all together with
    ``execute_many``) and, for sources in ``oracle_srcs`` (``None``: all), with DTensor;
    return the failures and timings."""
    import torch.distributed as dist

    from fxpar.reshard import reshard_plan
    from fxpar.runtime.reshard import distribute, execute, execute_many

    dm, mesh = _meshes(tuple(mesh_shape))
    coord = tuple(dm.get_coordinate())
    shape = tuple(shape)
    value = torch.arange(1, 1 + torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
    times = dict(pairs=len(pairs), plan=0.0, fxpar=0.0, dtensor=0.0, check=0.0)

    t = time.perf_counter()
    specs = [(Spec.parse(a), Spec.parse(b)) for a, b in pairs]
    plans = [reshard_plan(src, dst, mesh, shape) for src, dst in specs]
    sources = [_source_local(value, a, mesh_shape, coord) for a, _ in pairs]
    times["plan"] = time.perf_counter() - t

    t = time.perf_counter()
    if batched:
        ours = execute_many(plans, sources, dm)
    else:
        ours = [execute(p, x, dm) for p, x in zip(plans, sources)]
    times["fxpar"] = time.perf_counter() - t

    t = time.perf_counter()
    refs = [_dtensor_redistribute(x, src, dst, dm, shape, value.stride())
            if oracle_srcs is None or str(src) in oracle_srcs else None
            for x, (src, dst) in zip(sources, specs)]
    times["dtensor"] = time.perf_counter() - t
    times["dtensor_pairs"] = sum(r is not None for r in refs)

    t = time.perf_counter()
    failures, pending = [], {}
    for (src_s, dst_s), (src, dst), plan, mine, ref in zip(pairs, specs, plans, ours, refs):
        if dst.has_partial:
            key = tuple((a, p.reduce_op) for a, p in enumerate(dst) if isinstance(p, Partial))
            pending.setdefault(key, []).append((src_s, dst, str(plan), mine, ref))
            continue
        expect = distribute(value, dst, mesh_shape, coord)
        for who, got in (("fxpar", mine), ("DTensor", ref)):
            if got is not None and not (got.shape == expect.shape and torch.equal(got, expect)):
                failures.append(f"{who} {src_s} -> {dst_s} [{plan}] at {coord}: "
                                f"got {got.tolist()} want {expect.tolist()}")
    # Partial destinations: reduce ours and DTensor's over the partial axes, one buffer per
    # pattern of partial axes (every rank has the same patterns in the same order; the members
    # of a partial axis' group hold equal local shapes).
    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    for key in sorted(pending):
        items = pending[key]
        buf = torch.cat([t.reshape(-1) for it in items for t in it[3:] if t is not None])
        for axis, op in key:
            dist.all_reduce(buf, op=ops[op], group=dm.get_group(axis))
        off = 0
        for src_s, dst, plan_s, mine, ref in items:
            expect = distribute(value, _plain(dst), mesh_shape, coord)
            for who, got in (("fxpar", mine), ("DTensor", ref)):
                if got is None:
                    continue
                red = buf[off: off + got.numel()].reshape(got.shape)
                off += got.numel()
                if not (got.shape == expect.shape and torch.equal(red, expect)):
                    failures.append(f"{who} {src_s} -> {dst} [{plan_s}] at {coord}: "
                                    f"reduced {red.tolist()} want {expect.tolist()}")
    times["check"] = time.perf_counter() - t
    return failures, times


def _run(pool, mesh_shape, shape, pairs, batched, oracle_srcs=None, timeout=300):
    t = time.perf_counter()
    results = pool.run(_check_pairs, mesh_shape, shape, pairs, batched, oracle_srcs, timeout=timeout)
    failures = [f for fs, _ in results for f in fs]
    assert not failures, f"{len(failures)} failures, first ones:\n" + "\n".join(failures[:10])
    times = {k: round(v, 2) for k, v in results[0][1].items()}
    print(f"mesh {mesh_shape} shape {shape}: {time.perf_counter() - t:.1f} s wall; rank 0 {times}")
    return results[0][1]


@pytest.mark.dist
@pytest.mark.timeout(300)
@pytest.mark.parametrize("shape", [(8, 4), (5, 3)])
def test_every_pair_2x2(pools, shape):
    """256 pairs, one plan after the other with ``execute``; DTensor on every pair."""
    specs = _all_specs(2)
    _run(pools(4), (2, 2), shape, list(itertools.product(specs, specs)), batched=False)


# Sources checked against DTensor on 2×2×2: all kinds of nesting and partial patterns.
_ORACLE_SRCS_3 = ("S(0)S(0)S(0)", "S(1)P(sum)S(1)", "P(sum)S(0)R", "RS(1)S(0)",
                  "P(sum)P(sum)P(sum)", "S(0)S(1)S(0)")


@pytest.mark.dist
@pytest.mark.timeout(600)
@pytest.mark.parametrize("shape", [(8, 4), (5, 3)])
def test_every_pair_2x2x2(pools, shape):
    """4096 pairs, all together with ``execute_many``; DTensor on the pairs from a sample of
    sources (6 × 64)."""
    specs = _all_specs(3)
    _run(pools(8), (2, 2, 2), shape, list(itertools.product(specs, specs)), batched=True,
         oracle_srcs=_ORACLE_SRCS_3)
