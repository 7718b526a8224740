"""Resharding planner (single process): plan choice, costs, printing, errors, optimality
against a brute-force minimum, determinism, and the legality of every step checked by an
in-process emulation of the collectives on every device's local tensor."""

import itertools
import random
import re

import pytest
import torch

from fxpar import Cluster, Mesh, Partial, Replicate, ReshardError, Shard, Spec, SpecError
from fxpar.cost.comm import axis_collective_time
from fxpar.cost.reshard import step_cost
from fxpar.resharding.intra import ReshardPlan, reshard_plan, step_kind
from fxpar.runtime.redistribute import assemble, distribute
from fxpar.spec import chunk_bounds


@pytest.fixture(scope="module")
def mesh():
    # dp crosses nodes (slow, shared NICs), tp stays inside one (fast).
    return Mesh(Cluster.preset("perlmutter", nodes=2), dp=2, tp=4)


def specs_over(placements, ndim_mesh):
    return [Spec(ps) for ps in itertools.product(placements, repeat=ndim_mesh)]


BASIC = (Shard(0), Shard(1), Replicate(), Partial("sum"))


# -- choices ---------------------------------------------------------------------------------
def test_two_all_gathers_in_the_cheaper_order(mesh):
    shape, nb = (1024, 1024), 1024 * 1024 * 4
    plan = reshard_plan("S(0)S(1)", "RR", mesh, shape, torch.float32)
    assert [s.kind for s in plan.steps] == ["all_gather", "all_gather"]
    t = lambda axis, m: axis_collective_time("all_gather", m, mesh, axis)  # noqa: E731
    dp_first = t("dp", nb / 8) + t("tp", nb / 4)   # S(0)S(1) -> RS(1) -> RR
    tp_first = t("tp", nb / 8) + t("dp", nb / 2)   # S(0)S(1) -> S(0)R -> RR
    assert plan.time == pytest.approx(min(dp_first, tp_first))
    assert str(plan) == ("S(0)S(1) -> RS(1) -> RR" if dp_first < tp_first else "S(0)S(1) -> S(0)R -> RR")
    assert dp_first < tp_first  # gather the slow axis while the shard is small
    # Make tp the axis that crosses nodes and the order flips.
    flipped = Mesh.from_devices(mesh.cluster, ("dp", "tp"), [[0, 4, 1, 5], [2, 6, 3, 7]])
    assert str(reshard_plan("S(0)S(1)", "RR", flipped, shape)) == "S(0)S(1) -> S(0)R -> RR"
    # Equal links: both orders cost (G-1)·m/β in total, the tie goes to the smaller path string.
    one_node = Mesh(Cluster.preset("dgx-a100", physics=None), dp=2, tp=4)  # exact ties
    assert str(reshard_plan("S(0)S(1)", "RR", one_node, shape)) == "S(0)S(1) -> RS(1) -> RR"


def test_reduce_scatter_preferred_over_all_reduce_then_chunk(mesh):
    tp = mesh.slice(dp=0)
    plan = reshard_plan("P(sum)", "S(0)", tp, (64, 64), "float32")
    assert [(s.kind, s.axis_name) for s in plan.steps] == [("reduce_scatter", "tp")]
    ar_chunk = (axis_collective_time("all_reduce", 64 * 64 * 4, tp, "tp")
                + step_cost("chunk", Spec.parse("R"), Spec.parse("S(0)"), tp, 0, (64, 64), torch.float32)[1])
    assert plan.time < ar_chunk
    assert plan.steps[0].nbytes == 64 * 64 * 4


def test_same_spec_is_empty(mesh):
    plan = reshard_plan("S(0)R", Spec.parse("S(0)R"), mesh, (8, 4), torch.float32)
    assert plan.steps == () and plan.time == 0 and len(plan) == 0
    assert str(plan) == "S(0)R" and "nothing to do" in plan.describe()


def test_printing_and_table(mesh):
    plan = reshard_plan("S(0)S(1)", "RR", mesh, (1024, 1024), "bfloat16")
    assert str(plan) == " -> ".join(map(str, plan.specs))
    table = plan.describe()
    for s in plan.steps:
        assert re.search(rf"{re.escape(str(s.src))} -> {re.escape(str(s.dst))}\s+{s.kind}\s+{s.axis_name}\s+{s.nbytes}\b", table)
    assert "bfloat16[1024, 1024]" in table and "2 steps" in table
    assert plan.dtype is torch.bfloat16 and plan.time == pytest.approx(sum(s.time for s in plan.steps))
    assert "ReshardPlan(S(0)S(1) -> " in repr(plan)


def test_negative_dims_and_strings_normalize(mesh):
    a = reshard_plan("S(-1)R", "RR", mesh, (8, 4))
    b = reshard_plan(Spec((Shard(1), Replicate())), Spec.parse("RR"), mesh, (8, 4), torch.float32)
    assert a is b  # same cache entry


@pytest.mark.parametrize("src,dst,pattern", [
    ("S(2)R", "RR", r"S\(2\)R.*\(8, 4\)"),
    ("RR", "S(0)", r"S\(0\).*1 placements.*\(8, 4\)"),
    ("RR", "R(", r"R\("),
])
def test_invalid_spec_names_spec_and_shape(mesh, src, dst, pattern):
    with pytest.raises(SpecError, match=pattern):
        reshard_plan(src, dst, mesh, (8, 4), torch.float32)


def test_bad_dtype_and_ambiguous_partials(mesh):
    with pytest.raises(ReshardError, match="dtype"):
        reshard_plan("RR", "RR", mesh, (8, 4), "floaty")
    with pytest.raises(ReshardError, match=r"P\(sum\)P\(max\).*'dp': 'sum', 'tp': 'max'.*\(8, 4\)"):
        reshard_plan("P(sum)P(max)", "RR", mesh, (8, 4))


def test_partial_ops(mesh):
    # max/min: all-reduce only, never reduce-scatter.
    for op in ("max", "min"):
        plan = reshard_plan(f"P({op})R", "S(0)R", mesh, (64, 64))
        assert "reduce_scatter" not in [s.kind for s in plan.steps]
        assert "all_reduce" in [s.kind for s in plan.steps]
    # avg reduce-scatters like sum; sum <-> avg is a local rescale; mixed sum/avg plans.
    assert [s.kind for s in reshard_plan("RP(avg)", "RS(0)", mesh, (64, 64)).steps] == ["reduce_scatter"]
    assert [s.kind for s in reshard_plan("P(sum)R", "P(avg)R", mesh, (64, 64)).steps] == ["rescale"]
    plan = reshard_plan("P(sum)P(avg)", "RR", mesh, (64, 64))
    assert plan.dst == Spec.parse("RR") and plan.time > 0
    assert reshard_plan("RR", "P(max)R", mesh, (64, 64)).time == 0  # keep the value
    # A size-1 axis costs nothing.
    m1 = Mesh(Cluster.preset("perlmutter"), a=1, b=4)
    assert reshard_plan("S(0)S(1)", "RS(1)", m1, (8, 8)).time == 0


def test_forbidden_steps_keep_nesting(mesh):
    s = Spec.parse("S(0)S(0)")
    assert step_kind(s, 0, Replicate()) is None          # axis 1 splits dim 0 further
    assert step_kind(s, 1, Replicate()) == "all_gather"
    assert step_kind(Spec.parse("RS(0)"), 0, Shard(0)) is None
    assert step_kind(Spec.parse("P(sum)S(1)"), 0, Shard(1)) is None
    assert step_kind(Spec.parse("S(0)S(1)"), 0, Shard(1)) is None
    assert step_kind(Spec.parse("S(0)S(1)"), 1, Shard(0)) == "all_to_all"
    assert step_kind(Spec.parse("P(max)R"), 0, Shard(0)) is None
    assert step_kind(Spec.parse("S(0)R"), 0, Partial("sum")) is None
    assert str(reshard_plan("S(0)S(0)", "RR", mesh, (64, 64))).endswith("-> RR")


def test_step_cost_formulas(mesh):
    shape, f32 = (64, 32), torch.float32
    S = Spec.parse
    full = 64 * 32 * 4
    cases = [  # kind, src, dst, axis, expected bytes, collective or None
        ("all_gather", S("S(0)S(1)"), S("S(0)R"), 1, full // 8, "all_gather"),
        ("reduce_scatter", S("P(sum)R"), S("S(1)R"), 0, full, "reduce_scatter"),
        ("all_reduce", S("RP(avg)"), S("RR"), 1, full, "all_reduce"),
        ("all_to_all", S("S(0)S(1)"), S("S(0)S(0)"), 1, full // 8, "all_to_all"),
        ("chunk", S("RR"), S("RS(0)"), 1, full // 4, None),
        ("to_partial", S("RR"), S("P(sum)R"), 0, full, None),
        ("to_partial", S("RR"), S("P(max)R"), 0, 0, None),
        ("rescale", S("P(sum)R"), S("P(avg)R"), 0, full, None),
    ]
    bw = mesh.cluster.memory_bandwidth
    for kind, a, b, axis, nbytes, coll in cases:
        got_bytes, t = step_cost(kind, a, b, mesh, axis, shape, f32)
        assert got_bytes == nbytes, kind
        if coll:
            assert t == axis_collective_time(coll, nbytes, mesh, axis)
        else:
            assert t == pytest.approx({"chunk": 2, "to_partial": 1, "rescale": 2}[kind] * nbytes / bw)
    assert step_cost("chunk", S("RR"), S("RS(0)"), mesh, 1, shape, 2)[0] == full // 8  # item size


# -- optimality and determinism --------------------------------------------------------------
def _graph(mesh, shape, dtype, placements):
    """Every legal step between specs made of ``placements``, with its time."""
    specs = specs_over(placements, len(mesh.shape))
    edges = {s: [] for s in specs}
    for spec in specs:
        for axis in range(len(mesh.shape)):
            for p in placements:
                kind = step_kind(spec, axis, p)
                if kind is not None:
                    new = spec.with_axis(axis, p)
                    edges[spec].append((new, step_cost(kind, spec, new, mesh, axis, shape, dtype)[1]))
    return edges


def _brute_force(src, edges, k):
    """Minimum time over all paths of at most ``k`` legal steps from ``src`` to every spec
    (dynamic programming over the path length: the minimum over all enumerated sequences)."""
    best = {src: 0.0}
    frontier = dict(best)
    for _ in range(k):
        nxt = {}
        for spec, c in frontier.items():
            for new, t in edges[spec]:
                if c + t < nxt.get(new, float("inf")):
                    nxt[new] = c + t
        for s, c in nxt.items():
            best[s] = min(best.get(s, float("inf")), c)
        frontier = nxt
    return best


def _enumerate(src, dst, edges, k):
    """Literal enumeration of every step sequence of length <= k (small k only)."""
    out, stack = float("inf"), [(src, 0.0, 0)]
    while stack:
        spec, c, n = stack.pop()
        if spec == dst:
            out = min(out, c)
        if n < k:
            stack.extend((new, c + t, n + 1) for new, t in edges[spec])
    return out


@pytest.mark.parametrize("axes,shape", [({"dp": 2, "tp": 4}, (24, 20)),
                                        ({"a": 2, "b": 2, "c": 2}, (5, 3))])
def test_planner_equals_brute_force_minimum(axes, shape):
    mesh = Mesh(Cluster.preset("perlmutter", nodes=2), axes)
    specs = specs_over(BASIC, len(axes))
    edges = _graph(mesh, shape, torch.float32, BASIC)
    k = 2 * len(axes) + 2
    for src in specs:
        best = _brute_force(src, edges, k)
        for dst in specs:
            plan = reshard_plan(src, dst, mesh, shape, torch.float32)
            assert len(plan.steps) <= k
            assert plan.time == pytest.approx(best[dst], rel=1e-12, abs=1e-15), (src, dst, str(plan))
    # A literal enumeration of sequences agrees on a few pairs.
    for src, dst in [(specs[0], specs[-1]), (specs[-1], specs[0]), (specs[5], specs[2])]:
        plan = reshard_plan(src, dst, mesh, shape, torch.float32)
        assert plan.time == pytest.approx(_enumerate(src, dst, edges, len(plan.steps) + 1), rel=1e-12)


def test_deterministic_and_cached(mesh):
    a = reshard_plan("S(0)P(sum)", "S(1)S(0)", mesh, (48, 40))
    from fxpar.resharding.intra import _plan

    _plan.cache_clear()
    b = reshard_plan("S(0)P(sum)", "S(1)S(0)", mesh, (48, 40))
    assert a == b and a is not b and str(a) == str(b)
    assert reshard_plan("S(0)P(sum)", "S(1)S(0)", mesh, (48, 40)) is b
    assert isinstance(a, ReshardPlan) and hash(a) == hash(b)


# -- legality: emulate every step on every device -------------------------------------------
def _reduce(ts, op):
    st = torch.stack(ts)
    return {"sum": st.sum(0), "avg": st.mean(0), "max": st.amax(0), "min": st.amin(0)}[op]


def emulate_step(step, locals_, mesh_shape, shape):
    """Apply one step to ``{coord: local}`` with collectives written as plain tensor math
    (no padding tricks): independent of fxpar.runtime."""
    i, G = step.axis, mesh_shape[step.axis]
    src_p, dst_p = step.src[i], step.dst[i]
    out = {}
    for c, x in locals_.items():
        members = [locals_[c[:i] + (k,) + c[i + 1:]] for k in range(G)]
        if step.kind == "all_gather":
            out[c] = torch.cat(members, src_p.dim)
        elif step.kind == "all_reduce":
            out[c] = _reduce(members, src_p.reduce_op)
        elif step.kind == "reduce_scatter":
            tot = _reduce(members, src_p.reduce_op)
            a, b = chunk_bounds(tot.shape[dst_p.dim], G, c[i])
            out[c] = tot.narrow(dst_p.dim, a, b - a)
        elif step.kind == "all_to_all":
            e = dst_p.dim
            a, b = chunk_bounds(x.shape[e], G, c[i])
            out[c] = torch.cat([m.narrow(e, a, b - a) for m in members], src_p.dim)
        elif step.kind == "chunk":
            a, b = chunk_bounds(x.shape[dst_p.dim], G, c[i])
            out[c] = x.narrow(dst_p.dim, a, b - a)
        elif step.kind == "to_partial":
            out[c] = torch.zeros_like(x) if dst_p.reduce_op == "sum" and c[i] else x
        elif step.kind == "rescale":
            out[c] = x * G if dst_p.reduce_op == "avg" else x / G
        else:
            raise AssertionError(step.kind)
    return out


def partial_addends(value, spec, mesh_shape, gen):
    """``{partial coords: global addend}`` whose reduction over the partial axes of ``spec``
    (in any order: the ops commute) is ``value``. Integer-valued, so every sum is exact."""
    axes = [i for i, p in enumerate(spec) if isinstance(p, Partial)]

    def split(v, rest):
        if not rest:
            return {(): v}
        a, G = rest[0], mesh_shape[rest[0]]
        op = spec[a].reduce_op
        noise = [torch.randint(-3, 4, v.shape, generator=gen).to(v.dtype) for _ in range(G)]
        if op == "sum":
            parts = noise[1:]
            parts = [v - sum(parts, torch.zeros_like(v))] + parts
        elif op == "avg":
            parts = [v + n * G - sum(noise, torch.zeros_like(v)) for n in noise]  # mean is v
        elif op == "max":
            parts = [v] + [v - n.abs() for n in noise[1:]]
        else:
            parts = [v] + [v + n.abs() for n in noise[1:]]
        return {(k,) + q: t for k, p in enumerate(parts) for q, t in split(p, rest[1:]).items()}

    return axes, split(value, axes)


def source_locals(value, spec, mesh_shape, seed):
    gen = torch.Generator().manual_seed(seed)
    axes, addends = partial_addends(value, spec, mesh_shape, gen)
    plain = Spec(tuple(Replicate() if isinstance(p, Partial) else p for p in spec))
    return {c: addends[tuple(c[a] for a in axes)][plain.global_slices(value.shape, mesh_shape, c)].clone()
            for c in itertools.product(*map(range, mesh_shape))}


def check_plan_by_emulation(plan, value, seed=0):
    mesh_shape, shape = plan.mesh.shape, plan.shape
    locals_ = source_locals(value, plan.src, mesh_shape, seed)
    assert torch.equal(assemble(locals_, plan.src, mesh_shape, shape), value)
    for step in plan.steps:
        locals_ = emulate_step(step, locals_, mesh_shape, shape)
        for c, t in locals_.items():  # every intermediate is a valid layout of the same value
            assert tuple(t.shape) == step.dst.local_shape(shape, mesh_shape, c), (str(plan), str(step), c)
        # avg over an axis of 3 is inexact in binary; everything else is exact on integers
        assert torch.allclose(assemble(locals_, step.dst, mesh_shape, shape), value, rtol=0, atol=1e-9), \
            (str(plan), str(step))
    if not plan.dst.has_partial:
        for c, t in locals_.items():
            assert torch.allclose(t, distribute(value, plan.dst, mesh_shape, c), rtol=0, atol=1e-9), \
                (str(plan), c)


@pytest.mark.parametrize("axes,shape", [({"a": 2, "b": 2}, (8, 4)), ({"a": 2, "b": 2}, (5, 3)),
                                        ({"a": 3, "b": 2}, (7, 5))])
def test_every_pair_is_right_by_emulation(axes, shape):
    mesh = Mesh(Cluster.preset("perlmutter", nodes=2), axes)
    value = torch.arange(1, 1 + shape[0] * shape[1], dtype=torch.float64).reshape(shape)
    specs = specs_over(BASIC, len(axes))
    for n, (src, dst) in enumerate(itertools.product(specs, specs)):
        check_plan_by_emulation(reshard_plan(src, dst, mesh, shape), value, seed=n)


def test_sampled_pairs_3d_mesh_and_other_ops_by_emulation():
    mesh = Mesh(Cluster.preset("perlmutter", nodes=4), a=2, b=3, c=2)
    shape = (7, 6, 3)
    value = torch.arange(1, 1 + 7 * 6 * 3, dtype=torch.float64).reshape(shape)
    places = (Shard(0), Shard(1), Shard(2), Replicate(), Partial("sum"), Partial("avg"))
    specs = [s for s in specs_over(places, 3)
             if len({p.reduce_op for p in s if isinstance(p, Partial)}) <= 2]
    rng = random.Random(0)
    pairs = [tuple(rng.sample(specs, 2)) for _ in range(150)]
    for op in ("max", "min"):  # one non-linear op at a time
        ps = (Shard(0), Shard(1), Replicate(), Partial(op))
        sp = specs_over(ps, 3)
        pairs += [tuple(rng.sample(sp, 2)) for _ in range(60)]
    for n, (src, dst) in enumerate(pairs):
        check_plan_by_emulation(reshard_plan(src, dst, mesh, shape), value, seed=n)


def test_distribute_assemble_round_trip_and_replica_check():
    value = torch.arange(1.0, 36.0).reshape(7, 5)
    mesh_shape = (2, 3)
    coords = list(itertools.product(range(2), range(3)))
    for spec in specs_over((Shard(0), Shard(1), Replicate(), Partial("sum"), Partial("max")), 2):
        if len({p.reduce_op for p in spec if isinstance(p, Partial)}) > 1:
            continue
        parts = {c: distribute(value, spec, mesh_shape, c) for c in coords}
        assert all(tuple(t.shape) == spec.local_shape(value.shape, mesh_shape, c) for c, t in parts.items())
        assert torch.equal(assemble(parts, spec, mesh_shape, value.shape), value), spec
    parts = {c: distribute(value, "RS(0)", mesh_shape, c) for c in coords}
    parts[(1, 2)] = parts[(1, 2)] + 1
    with pytest.raises(ReshardError, match=r"RS\(0\).*\(0, 2\) and \(1, 2\)"):
        assemble(parts, "RS(0)", mesh_shape, value.shape)


def test_fast_moves_equal_step_kind_moves():
    """The planner's state expansion (placement codes, unvalidated Spec construction) gives
    the same steps in the same order as the definition through :func:`step_kind`."""
    from fxpar.resharding.intra import _ambiguous_partials, _moves, _moves_slow

    for mnd, nd in ((1, 2), (2, 3), (3, 2)):
        for ops in ((), ("sum",), ("avg", "sum"), ("max", "sum")):
            pl = [Shard(d) for d in range(nd)] + [Replicate()] + [Partial(o) for o in ops]
            for p in itertools.product(pl, repeat=mnd):
                sp = Spec(p)
                if _ambiguous_partials(sp):
                    continue
                a, b = _moves(sp, nd, ops), list(_moves_slow(sp, nd, ops))
                assert [(k, x, y) for k, x, y in a] == [(k, x, y) for k, x, y in b], sp


@pytest.mark.slow
@pytest.mark.parametrize("axes,shape", [({"dp": 2, "tp": 4}, (24, 20)),
                                        ({"a": 2, "b": 2, "c": 2}, (5, 3, 7)),
                                        ({"a": 2, "b": 2, "c": 2, "d": 2}, (6, 8))])
def test_cost_table_is_bit_identical_to_reshard_plan(axes, shape):
    """``reshard_cost_table`` / ``reshard_costs`` (many sources at once) equal
    ``reshard_plan(...).time`` exactly, not approximately, sum/avg partials included."""
    from fxpar.resharding.intra import reshard_cost_table, reshard_costs

    mesh = Mesh(Cluster.preset("perlmutter", nodes=4), axes)
    pl = [Shard(d) for d in range(len(shape))] + [Replicate(), Partial("sum"), Partial("avg")]
    specs = [Spec(p) for p in itertools.product(pl, repeat=len(axes))]
    rng = random.Random(0)
    srcs = rng.sample(specs, 12)
    dsts = rng.sample(specs, min(len(specs), 60))
    T = reshard_cost_table(srcs, dsts, mesh, shape, torch.float32)
    for a, s in enumerate(srcs):
        assert reshard_costs(s, dsts, mesh, shape) == T[a].tolist()
        for b, d in enumerate(dsts):
            assert T[a, b] == reshard_plan(s, d, mesh, shape, torch.float32).time, (s, d)
    with pytest.raises(SpecError):
        reshard_cost_table(["S(5)" + "R" * (len(axes) - 1)], ["R" * len(axes)], mesh, shape)


def test_cost_tables_batched_across_shapes_equal_reshard_plan():
    """``reshard_cost_tables``: tables of many shapes and dtypes (one topology relaxed as
    the columns of one Bellman-Ford, another with partials beside it) equal
    ``reshard_plan(...).time`` exactly, rows asked twice included, and a bad spec in any
    request raises."""
    from fxpar.resharding.intra import reshard_cost_tables

    mesh = Mesh(Cluster.preset("dgx-a100"), {"dp": 2, "tp": 4})
    rng = random.Random(1)
    pl = [Shard(0), Shard(1), Shard(2), Replicate(), Partial("sum")]
    specs = [Spec(p) for p in itertools.product(pl, repeat=2)]
    reqs = []
    for k in range(24):
        shape = (rng.choice([1, 3, 8, 64]), rng.randint(1, 40), rng.choice([2, 5, 128]))
        dtype = rng.choice([torch.float32, torch.bfloat16])
        reqs.append((rng.sample(specs, 5), rng.sample(specs, 7), mesh, shape, dtype))
    reqs.append(reqs[3])
    for (srcs, dsts, _, shape, dtype), T in zip(reqs, reshard_cost_tables(reqs)):
        for a, s in enumerate(srcs):
            for b, d in enumerate(dsts):
                assert T[a, b] == reshard_plan(s, d, mesh, shape, dtype).time, (s, d, shape)
    with pytest.raises(SpecError):
        reshard_cost_tables(reqs[:2] + [(["S(3)R"], ["RR"], mesh, (4, 4, 4), torch.float32)])


def test_state_graph_is_shared_across_shapes_and_its_step_costs_are_step_cost():
    """Two tensors of one rank share the state graph (legality does not depend on the shape);
    each tensor's vectorised edge times equal ``step_cost`` edge by edge, uneven shards and
    axes of size 1 included; and its tables equal ``reshard_plan`` with ``max`` partials."""
    from fxpar.resharding.intra import _KINDS, _graph, reshard_cost_table

    mesh = Mesh(Cluster.preset("perlmutter", nodes=4), {"a": 2, "b": 4, "c": 1, "d": 2})
    g1 = _graph(mesh, (6, 10, 3), torch.bfloat16, ("max",))
    g2 = _graph(mesh, (64, 5, 7), torch.float32, ("max",))
    assert g1.topo is g2.topo and len(g1.specs) > 500
    for g in (g1, g2):
        U, V, K, A = g.topo.arrays()
        W = g.weights()
        for e in range(0, U.size, 7):
            u, v, k, a = int(U[e]), int(V[e]), int(K[e]), int(A[e])
            assert W[e] == step_cost(_KINDS[k], g.specs[u], g.specs[v], mesh, a, g.shape,
                                     g.dtype)[1], (g.specs[u], g.specs[v])
    pl = [Shard(0), Shard(1), Shard(2), Replicate(), Partial("max")]
    specs = [Spec(p) for p in itertools.product(pl, repeat=4)]
    rng = random.Random(1)
    srcs, dsts = rng.sample(specs, 10), rng.sample(specs, 40)
    T = reshard_cost_table(srcs, dsts, mesh, (6, 10, 3), torch.bfloat16)
    for a, s in enumerate(srcs):
        for b, d in enumerate(dsts):
            assert T[a, b] == reshard_plan(s, d, mesh, (6, 10, 3), torch.bfloat16).time, (s, d)
