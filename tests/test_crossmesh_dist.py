"""Cross-mesh resharding on 8 real gloo ranks (issue #11): every result bit for bit.

The 8 ranks are modelled as 2 hosts of 4 (``Cluster.local(8, nodes=2, devices_per_node=4)``),
so plans use intra- and inter-host links, per-host all-gathers and broadcasts that span both
hosts. Mesh pairs: 2×2→1×4 and 2×2→2×2 on other devices (disjoint), 4→2×2, 1×4→2×2 and
2×3→3×2 (overlapping: a device in both keeps what it holds), and a 2×2 whose rows straddle the
hosts. Every pair of specs from {S(0), S(1), R} per mesh axis runs, each pair under one
strategy (``auto``, ``send_recv``, ``allgather``, ``broadcast`` in turn) on an even or an
uneven shape (in turn: every strategy meets both), in float32 and, on some pairs, int64,
bfloat16 or bool; P(sum) sources are reduced on the source mesh first. On every destination
rank the result equals the slice of the global tensor (:meth:`Spec.global_slices`); ranks
outside the destination mesh get ``None``.

Plans are made once in the test process (planning is deterministic: every rank would make the
same one) and shipped to the ranks, which run all cases of one mesh pair in one call.
"""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest
import torch

STRATS = ("auto", "send_recv", "allgather", "broadcast")
SHAPES = ((12, 12), (7, 5))
DTYPES = {0: torch.int64, 3: torch.bfloat16, 5: torch.bool}   # by pair index mod 7, else float32

MESHES = {
    "2x2->1x4": ([[0, 1], [2, 3]], [[4, 5, 6, 7]]),
    "2x2->2x2": ([[0, 1], [2, 3]], [[4, 5], [6, 7]]),
    "4->2x2 overlap": ([0, 1, 2, 3], [[2, 3], [4, 5]]),
    "1x4->2x2 overlap": ([[0, 1, 2, 3]], [[0, 1], [6, 7]]),
    "2x3->3x2 overlap": ([[0, 1, 2], [3, 4, 5]], [[2, 3], [4, 5], [6, 7]]),
    "2x2 across hosts->2x2": ([[0, 4], [1, 5]], [[2, 6], [7, 3]]),
}


def _cluster():
    from fxpar import Cluster

    return Cluster.local(8, nodes=2, devices_per_node=4)


def _mesh(devs, prefix):
    from fxpar import Mesh

    return Mesh.from_devices(_cluster(), [f"{prefix}{i}" for i in range(np.ndim(devs))], devs)


def _specs(ndim, partial=False):
    pl = ["S(0)", "S(1)", "R"] + (["P(sum)"] if partial else [])
    out = ["".join(p) for p in itertools.product(pl, repeat=ndim)]
    return [s for s in out if "P" in s] if partial else out


def _full(shape, dtype):
    n = int(np.prod(shape))
    x = torch.arange(1, 1 + n, dtype=torch.int64).reshape(shape)
    if dtype == torch.bool:
        return (x % 3 == 0)
    return x.to(dtype)


def _source_local(plan, full, rank, seed):
    """This rank's source shard: for a Partial source, integer addends over the partial
    coordinates whose sum is ``full`` (the same on every rank for one seed)."""
    from fxpar.spec import Partial, Replicate, Spec

    spec, mesh = plan.src_spec, plan.src_mesh
    coord = mesh.coord(rank)
    plain = Spec(tuple(Replicate() if isinstance(p, Partial) else p for p in spec))
    sl = plain.global_slices(full.shape, mesh.shape, coord)
    axes = [a for a, p in enumerate(spec) if isinstance(p, Partial)]
    if not axes:
        return full[sl].clone()
    gen = torch.Generator().manual_seed(seed)
    pcs = list(itertools.product(*[range(mesh.shape[a]) for a in axes]))
    noise = {pc: torch.randint(-3, 4, full.shape, generator=gen).to(full.dtype) for pc in pcs[1:]}
    mine = tuple(coord[a] for a in axes)
    value = full - sum(noise.values(), torch.zeros_like(full)) if mine == pcs[0] else noise[mine]
    return value[sl].clone()


def _run_cases(cases):
    """Worker: run every ``(plan, seed)``; return failures and seconds."""
    import torch.distributed as dist

    from fxpar.runtime import cross_mesh_reshard
    from fxpar.runtime.redistribute import distribute

    rank = dist.get_rank()
    fails = []
    t0 = time.perf_counter()
    for plan, seed in cases:
        full = _full(plan.shape, plan.dtype)
        local = _source_local(plan, full, rank, seed) if rank in plan.src_mesh.devices else None
        out = cross_mesh_reshard(plan, local)
        name = f"{plan.src_spec} -> {plan.dst_spec} {plan.strategy} {plan.dtype} {list(plan.shape)}"
        if rank in plan.dst_mesh.devices:
            want = distribute(full, plan.dst_spec, plan.dst_mesh, plan.dst_mesh.coord(rank))
            if out is None or out.dtype != want.dtype or out.shape != want.shape or not torch.equal(out, want):
                fails.append(f"rank {rank}: {name}: got {None if out is None else out.tolist()} "
                             f"want {want.tolist()}")
            elif not out.is_contiguous():
                fails.append(f"rank {rank}: {name}: not contiguous")
        elif out is not None:
            fails.append(f"rank {rank}: {name}: not on the destination mesh but got a tensor")
    return fails, time.perf_counter() - t0


def _plans(src_devs, dst_devs, partial=False):
    from fxpar import cross_mesh_plan

    src, dst = _mesh(src_devs, "s"), _mesh(dst_devs, "d")
    pairs = list(itertools.product(_specs(src.ndim, partial), _specs(dst.ndim)))
    out = []
    for i, (a, b) in enumerate(pairs):
        strategy = STRATS[i % 4]
        shape = SHAPES[(i // 4) % 2]
        dtype = torch.float32 if partial else DTYPES.get(i % 7, torch.float32)
        out.append((cross_mesh_plan(src, a, dst, b, shape=shape, dtype=dtype, strategy=strategy), i))
    return out


def _check(pool, cases, label):
    t = time.perf_counter()
    results = pool.run(_run_cases, cases, timeout=240)
    fails = [f for fs, _ in results for f in fs]
    assert not fails, f"{label}: {len(fails)} failures, first ones:\n" + "\n".join(fails[:8])
    print(f"{label}: {len(cases)} plans, {time.perf_counter() - t:.1f} s wall, "
          f"rank 0 {results[0][1]:.1f} s")


@pytest.mark.dist
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(MESHES))
def test_every_spec_pair(pools, name):
    src, dst = MESHES[name]
    cases = _plans(src, dst)
    used = {(p.strategy, p.shape) for p, _ in cases}
    assert used == set(itertools.product(STRATS, SHAPES))  # every strategy on both shapes
    _check(pools(8), cases, name)


@pytest.mark.dist
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["2x2->1x4", "4->2x2 overlap", "2x3->3x2 overlap"])
def test_partial_sources(pools, name):
    src, dst = MESHES[name]
    cases = _plans(src, dst, partial=True)
    assert all(p.pre is not None for p, _ in cases)
    _check(pools(8), cases, name + " P(sum)")


def _errors_and_bystanders():
    import torch.distributed as dist

    from fxpar import ReshardError, cross_mesh_plan
    from fxpar.runtime import cross_mesh_reshard
    from fxpar.runtime.redistribute_cross import prepare_cross_mesh

    rank = dist.get_rank()
    src, dst = _mesh([0, 1], "s"), _mesh([2, 3], "d")
    plan = cross_mesh_plan(src, "S(0)", dst, "S(1)", shape=(4, 6))
    prepare_cross_mesh(plan)          # collective: every rank
    full = _full((4, 6), torch.float32)
    errors = []
    # ranks 4..7 are on neither mesh: None at once, no communication (ranks 0..3 never wait)
    if rank >= 4:
        assert cross_mesh_reshard(plan, None) is None
        try:
            cross_mesh_reshard(plan, torch.zeros(2, 6))
        except ReshardError as e:
            errors.append(str(e))
        return errors
    if rank in (0, 1):
        good = full[2 * rank: 2 * rank + 2].clone()
        for bad in (None, torch.zeros(3, 6), good.double()):
            try:
                cross_mesh_reshard(plan, bad)
            except ReshardError as e:
                errors.append(str(e))
        out = cross_mesh_reshard(plan, good)
        assert out is None
    else:
        out = cross_mesh_reshard(plan, None)
        assert torch.equal(out, full[:, 3 * (rank - 2): 3 * (rank - 1)])
    return errors


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_bad_local_tensors_and_bystanders(pools):
    res = pools(8).run(_errors_and_bystanders, timeout=60)
    for rank in (0, 1):
        assert len(res[rank]) == 3
        assert "coordinate" in res[rank][0] and "S(0)" in res[rank][0] and "None" in res[rank][0]
        assert "(3, 6)" in res[rank][1] and "(4, 6)" in res[rank][1]
        assert "float64" in res[rank][2] and "float32" in res[rank][2]
    for rank in range(4, 8):
        assert len(res[rank]) == 1 and "not on the source mesh" in res[rank][0]
