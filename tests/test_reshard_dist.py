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
plan in flight at once, and coalesced into one collective per axis, kind and op). The DTensor
oracle runs one collective at a time (~15–30 ms a pair there), so on 2×2×2 it checks a fixed
eighth of the pairs that covers every source and every destination 8 times; fxpar's results
are checked against the expected slices on all 4096 pairs of both shapes.

Measured on the 2-core CI machine: the whole file ~90 s (2×2: ~5 s per shape; 2×2×2: ~20 s
per shape, of which planning 4096 pairs ~4 s, fxpar ~5 s, DTensor on 512 pairs ~8–14 s; pool
start-up ~15 s for 8 ranks).
"""

from __future__ import annotations

import itertools
import time
import zlib

import pytest
import torch

from fxpar.errors import SpecError
from fxpar.spec import Partial, Replicate, Shard, Spec, Strided

BASIC = (Shard(0), Shard(1), Replicate(), Partial("sum"))
_MESHES: dict = {}
_SOURCES: dict = {}


def _all_specs(ndim_mesh: int) -> list[str]:
    return [str(Spec(ps)) for ps in itertools.product(BASIC, repeat=ndim_mesh)]


def _meshes(mesh_shape):
    """(DeviceMesh, fxpar Mesh), made once per worker (making a DeviceMesh is collective)."""
    if mesh_shape not in _MESHES:
        import logging

        import torch.distributed as dist

        # DTensor warns (once per pattern) about its CPU all-to-all fallback and about
        # sequential all-gathers: expected here, and noise in the test log.
        logging.getLogger("torch.distributed.tensor").setLevel(logging.ERROR)

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
        _SOURCES[key] = _plain(spec).local_of(addends[tuple(coord[a] for a in axes)], mesh_shape,
                                              coord).clone()
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


def _check_pairs(mesh_shape, shape, pairs, batched, oracle_mask=None):
    """Worker: reshard every ``(src, dst)`` pair with fxpar (one by one, or all together with
    ``execute_many``) and, where ``oracle_mask`` is true (``None``: everywhere), with DTensor;
    return the failures and timings."""
    import torch.distributed as dist

    from fxpar.resharding.intra import reshard_plan
    from fxpar.runtime.redistribute import distribute, execute, execute_many

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
    mask = oracle_mask if oracle_mask is not None else [True] * len(pairs)
    refs = [_dtensor_redistribute(x, src, dst, dm, shape, value.stride()) if m else None
            for x, (src, dst), m in zip(sources, specs, mask)]
    times["dtensor"] = time.perf_counter() - t
    times["dtensor_pairs"] = sum(r is not None for r in refs)

    t = time.perf_counter()
    failures, pending, expected = [], {}, {}
    for (src_s, dst_s), (src, dst), plan, mine, ref in zip(pairs, specs, plans, ours, refs):
        if dst.has_partial:
            key = tuple((a, p.reduce_op) for a, p in enumerate(dst) if isinstance(p, Partial))
            pending.setdefault(key, []).append((src_s, dst, str(plan), mine, ref))
            continue
        if dst_s not in expected:
            expected[dst_s] = distribute(value, dst, mesh_shape, coord)
        expect = expected[dst_s]
        for who, got in (("fxpar", mine), ("DTensor", ref)):
            if got is not None and not (got.shape == expect.shape and torch.equal(got, expect)):
                failures.append(f"{who} {src_s} -> {dst_s} [{plan}] at {coord}: "
                                f"got {got.tolist()} want {expect.tolist()}")
    # Partial destinations: reduce ours and DTensor's over the partial axes, one buffer per
    # pattern of partial axes (every rank has the same patterns in the same order; the members
    # of a partial axis' group hold equal local shapes).
    ops = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX,
           "min": dist.ReduceOp.MIN}
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


def _run(pool, mesh_shape, shape, pairs, batched, oracle_mask=None, timeout=300):
    t = time.perf_counter()
    results = pool.run(_check_pairs, mesh_shape, shape, pairs, batched, oracle_mask, timeout=timeout)
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


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.timeout(600)
@pytest.mark.parametrize("shape", [(8, 4), (5, 3)])
def test_every_pair_2x2x2(pools, shape):
    """4096 pairs, all together with ``execute_many``; DTensor on the 512 pairs (i, j) with
    i + j ≡ 0 (mod 8): every source and every destination 8 times."""
    specs = _all_specs(3)
    pairs = list(itertools.product(specs, specs))
    mask = [(i + j) % 8 == 0 for i, j in itertools.product(range(len(specs)), repeat=2)]
    _run(pools(8), (2, 2, 2), shape, pairs, batched=True, oracle_mask=mask)


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_other_reduce_ops_2x2(pools):
    """avg and max partials, and sum mixed with avg, against DTensor (4 ranks, uneven shape)."""
    pairs = []
    for places in ((Shard(0), Replicate(), Partial("avg")), (Shard(1), Replicate(), Partial("max")),
                   (Shard(0), Partial("sum"), Partial("avg"))):
        specs = [str(Spec(ps)) for ps in itertools.product(places, repeat=2)]
        pairs += list(itertools.product(specs, specs))
    _run(pools(4), (2, 2), (5, 3), pairs, batched=False)
    _run(pools(4), (2, 2), (5, 3), pairs, batched=True, oracle_mask=[False] * len(pairs))


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_strided_pairs_2x2(pools):
    """A strided shard ``S(1,2)`` (q/k/v-style groups, DTensor's ``_StridedShard``) with
    every other placement, to and from, against the expected pieces and DTensor."""
    places = BASIC + (Strided(1, split_factor=2),)
    specs = []
    for ps in itertools.product(places, repeat=2):
        try:
            Spec(ps).check((4, 8), (2, 2))
        except SpecError:
            continue   # strided with another axis on its dim: not a layout
        specs.append(str(Spec(ps)))
    pairs = [(a, b) for a, b in itertools.product(specs, specs) if "," in a + b]
    # DTensor (torch 2.13) reads _StridedShard as FSDP2+TP's right-to-left nesting: on axis 1
    # with dim 1 unsharded on axis 0 it is this layout (the oracle runs there); on axis 0 its
    # pieces differ, and from S(1) on axis 0 it raises. Those pairs are checked against the
    # expected pieces only (the indices of Spec.global_index, checked by its doctest).
    mask = [not a.startswith("S(1") and not b.startswith("S(1") for a, b in pairs]
    assert sum(mask) >= 40
    _run(pools(4), (2, 2), (4, 8), pairs, batched=False, oracle_mask=mask)
    _run(pools(4), (2, 2), (4, 8), pairs, batched=True, oracle_mask=[False] * len(pairs))


def _mesh_forms_and_errors():
    import torch.distributed as dist

    from fxpar import Cluster, Mesh, ReshardError
    from fxpar.resharding.intra import reshard_plan
    from fxpar.runtime.redistribute import distribute, execute, execute_many

    mesh = Mesh(Cluster.local(dist.get_world_size()), a=2, b=2)
    dm, _ = _meshes((2, 2))
    coord = tuple(dm.get_coordinate())
    full = torch.arange(35, dtype=torch.float64).reshape(7, 5)
    plan = reshard_plan("S(0)S(1)", "S(1)R", mesh, full.shape, torch.float64)
    local = distribute(full, plan.src, mesh, coord)
    # An fxpar Mesh works in place of the DeviceMesh (made once, cached).
    out = execute(plan, local, mesh)
    assert torch.equal(out, distribute(full, plan.dst, mesh, coord))
    # Plans of different dtypes and axes in one coalesced round.
    ints = torch.arange(12, dtype=torch.int64).reshape(4, 3)
    p2 = reshard_plan("RS(0)", "RR", mesh, ints.shape, torch.int64)
    p3 = reshard_plan("S(1)R", "RR", mesh, full.shape, torch.float64)
    outs = execute_many([plan, p2, p3], [local, distribute(ints, p2.src, mesh, coord),
                                         distribute(full, p3.src, mesh, coord)], dm)
    assert torch.equal(outs[0], out) and torch.equal(outs[1], ints) and torch.equal(outs[2], full)
    errors = []
    for bad in (local[:0], torch.zeros(9, 9, dtype=torch.float64)):
        try:
            execute(plan, bad, dm)
        except ReshardError as e:
            errors.append(str(e))
    return errors


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_mesh_forms_mixed_dtypes_and_shape_errors(pools):
    for errors in pools(4).run(_mesh_forms_and_errors):
        assert len(errors) == 2
        assert all("S(0)S(1)" in e and "(7, 5)" in e and "coordinate" in e for e in errors)
