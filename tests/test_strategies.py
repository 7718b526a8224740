"""Strategy rules, checked by simulation: for EVERY strategy a rule produces on small meshes, run
the op on each device's local inputs (cut by ``Spec.global_slices``; partial inputs as random
addends) and assemble the local outputs by the output spec (reduce over P axes, place by S
slices): it must equal the op on the global inputs. A wrong rule fails here.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F  # noqa: F401
from torch.distributed.tensor import Partial

from fxpar import Cluster, Mesh
from fxpar.strategies import is_unsharded, strategies_for
from fxpar.strategies.attention import _ring_of
from fxpar.strategies.embedding import is_vocab_parallel
from fxpar.strategies.losses import sharded_mean_call, vocab_call

aten = torch.ops.aten
torch.manual_seed(0)


def _mesh(shape):
    return Mesh(Cluster.local(math.prod(shape)), {f"a{i}": k for i, k in enumerate(shape)})


def _node(op, args, kwargs):
    """A one-op fx graph whose placeholders carry the (real) global tensors as meta['val']."""
    g = fx.Graph()
    tensors = []

    def ph(x):
        if isinstance(x, torch.Tensor):
            n = g.placeholder(f"t{len(tensors)}")
            n.meta["val"] = x
            tensors.append(x)
            return n
        if isinstance(x, (list, tuple)) and any(isinstance(y, torch.Tensor) for y in x):
            return type(x)(ph(y) for y in x)
        return x

    nargs = tuple(ph(a) for a in args)
    nkw = {k: ph(v) for k, v in kwargs.items()}
    node = g.call_function(op, nargs, nkw)
    node.meta["val"] = op(*args, **kwargs)
    return node


_LOCALIZE_SIZE = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.expand.default,
                  aten.view_copy.default, aten.expand_copy.default}


def _reduce(ts, op):
    st = torch.stack(ts)
    return {"sum": st.sum(0), "avg": st.mean(0), "max": st.amax(0), "min": st.amin(0)}[op]


def _vocab_outputs(node, strat, mesh_shape, coords, local_in):
    """``{coord: output}`` of a vocabulary-parallel loss (its local program all-gathers or
    all-reduces over the axes splitting the classes: :mod:`fxpar.runtime.vocab`), one thread per
    device and the collectives emulated in memory (a barrier per round), or ``None`` for
    another strategy."""
    import threading
    from unittest import mock

    import fxpar.runtime.vocab as V

    shape_of = lambda n: n.meta["val"].shape  # noqa: E731
    calls = {c: vocab_call(node, strat.inputs, shape_of, mesh_shape, c) for c in coords}
    if calls[coords[0]] is None:
        return None
    barrier, slots, coord_of, out = threading.Barrier(len(coords)), {}, {}, {}

    def collective(t, axes, combine):
        c = coord_of[threading.get_ident()]
        for a in axes:
            group = c[:a] + c[a + 1:]
            slots[a, group, c[a]] = t
            barrier.wait()
            t = combine([slots[a, group, i] for i in range(mesh_shape[a])])
            barrier.wait()   # every member has read this round before the next one writes
        return t

    def all_reduce(t, op, axes):
        return collective(t, axes, lambda ts: _reduce(ts, op))

    def gather(t, axes):   # all_gather_into_tensor: the group's inputs along dim 0, in order
        return collective(t.unsqueeze(0), axes, lambda ts: torch.cat(ts, 0))

    def run(c):
        coord_of[threading.get_ident()] = c
        fn, margs = calls[c]
        out[c] = fn(*fx.node.map_arg(margs, lambda n: local_in[(n, c)]))

    with mock.patch.object(V, "_all_reduce", all_reduce), mock.patch.object(V, "_gather", gather):
        threads = [threading.Thread(target=run, args=(c,)) for c in coords]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    assert len(out) == len(coords), "a device of the emulated vocabulary-parallel loss failed"
    return out


_SPLIT_SIZES = (aten.split.Tensor, aten.split_with_sizes.default)


def simulate(node, strat, mesh_shape, gen):
    """Run ``strat`` device by device; return max abs error against the global result."""
    ins = node.all_input_nodes
    coords = list(itertools.product(*[range(k) for k in mesh_shape]))
    # addends for partial inputs: one full-size tensor per coordinate of the P axes
    local_in = {}
    for n, spec in zip(ins, strat.inputs):
        g = n.meta["val"]
        paxes = [a for a, p in enumerate(spec) if isinstance(p, Partial)]
        assert all(spec[a].reduce_op == "sum" for a in paxes), "tests feed only P(sum) inputs"
        parties = list(itertools.product(*[range(mesh_shape[a]) for a in paxes]))
        add = {}
        if parties != [()]:
            rest = g.clone()
            for pc in parties[1:]:
                add[pc] = torch.randn(g.shape, generator=gen, dtype=g.dtype)
                rest = rest - add[pc]
            add[parties[0]] = rest
        else:
            add[()] = g
        for c in coords:
            local_in[(n, c)] = spec.local_of(add[tuple(c[a] for a in paxes)], mesh_shape, c)
    outs_global = node.meta["val"]
    glist = [v for v in (outs_global if isinstance(outs_global, (tuple, list)) else [outs_global])
             if isinstance(v, torch.Tensor)]
    local_out = {}
    vocab = _vocab_outputs(node, strat, mesh_shape, coords, local_in)
    for c in coords:
        env = {n: local_in[(n, c)] for n in ins}
        args = fx.node.map_arg(node.args, lambda n: env[n])
        kwargs = fx.node.map_arg(node.kwargs, lambda n: env[n])
        if node.target in _LOCALIZE_SIZE:  # the localize-shapes pass: size args -> local out shape
            args = (args[0], list(strat.outputs[0].local_shape(glist[0].shape, mesh_shape, c))) + tuple(args[2:])
        if node.target in _SPLIT_SIZES:  # a strided input's parts: split_sizes gives local sizes
            dim = args[2] if len(args) > 2 else 0
            sizes = [o.local_shape(v.shape, mesh_shape, c)[dim] for o, v in zip(strat.outputs, glist)]
            args = (args[0], sizes[0] if isinstance(args[1], int) else sizes) + tuple(args[2:])
        mean_loss = sharded_mean_call(node, strat.inputs, lambda n: n.meta["val"].shape, mesh_shape, c)
        if vocab is not None:  # vocabulary-parallel: run above, all devices at once
            out = vocab[c]
        elif mean_loss is not None:  # the local program of a mean loss with its input sharded
            fn, margs = mean_loss
            out = fn(*fx.node.map_arg(margs, lambda n: env[n]))
        elif node.target is aten.scaled_dot_product_attention.default and _ring_of(*strat.inputs[:2]):
            out = _ring(node, strat, mesh_shape, c, local_in)   # ring attention, all ranks here
        elif (node.target is aten.scaled_dot_product_attention.default and node.kwargs.get("is_causal")
              and strat.inputs[0].shard_axes(2)):   # attention_local: the mask at the global rows
            import fxpar.runtime.ops  # noqa: F401

            off = strat.inputs[0].global_slices(ins[0].meta["val"].shape, mesh_shape, c)[2].start
            out = torch.ops.fxpar.offset_causal_sdpa(args[0], args[1], args[2], None, off, 0.0, None,
                                                     False, 0, [])
        elif node.target is aten.embedding.default and is_vocab_parallel(strat.inputs[0], strat.inputs[1]):
            w, ids = args[0], args[1]
            lo = strat.inputs[0].global_slices(ins[0].meta["val"].shape, mesh_shape, c)[0].start
            inside = (ids >= lo) & (ids < lo + w.shape[0])
            out = F.embedding(torch.where(inside, ids - lo, 0), w) * inside.unsqueeze(-1)
        else:
            out = node.target(*args, **kwargs)
        outs = [v for v in (out if isinstance(out, (tuple, list)) else [out]) if isinstance(v, torch.Tensor)]
        local_out[c] = outs
    err = 0.0
    for j, (gv, spec) in enumerate(zip(glist, strat.outputs)):
        paxes = [a for a, p in enumerate(spec) if isinstance(p, Partial)]
        for c in coords:
            if any(c[a] for a in paxes):
                continue
            # reduce over the P axes, last axis first
            group = {c: local_out[c][j]}
            for a in reversed(paxes):
                new = {}
                for cc in group:
                    vals = [group[cc[:a] + (i,) + cc[a + 1:]] if (cc[:a] + (i,) + cc[a + 1:]) in group
                            else None for i in range(mesh_shape[a])]
                    if None in vals:
                        vals = [_full(local_out, cc[:a] + (i,) + cc[a + 1:], j, paxes, a, mesh_shape, spec)
                                for i in range(mesh_shape[a])]
                    new[cc] = _reduce(vals, spec[a].reduce_op)
                group = new
            val = group[c]
            want = spec.local_of(gv, mesh_shape, c)
            assert val.shape == want.shape, (strat, j, c, val.shape, want.shape)
            if want.dtype.is_floating_point:
                err = max(err, (val.double() - want.double()).abs().max().item() if want.numel() else 0.0)
            else:
                assert torch.equal(val, want), (strat, j, c)
    return err


def _ring(node, strat, mesh_shape, c, local_in):
    """Ring attention at coordinate ``c``, every rank's K/V block read from ``local_in``: the
    runtime's merge (:func:`fxpar.runtime.context_parallel.ring_step`) over the blocks in the
    ring's order (its own first), later blocks skipped and the diagonal masked when causal."""
    from fxpar.runtime.context_parallel import ring_step

    axes = _ring_of(*strat.inputs[:2])
    q, k, v = (local_in[(n, c)] for n in node.args[:3])
    sizes = [mesh_shape[a] for a in axes]

    def coord_of(b):
        cc, rest = list(c), b
        for a, n in reversed(list(zip(axes, sizes))):
            cc[a], rest = rest % n, rest // n
        return tuple(cc)

    n_blocks = math.prod(sizes)
    me = next(b for b in range(n_blocks) if coord_of(b) == tuple(c))
    causal = bool(node.kwargs.get("is_causal"))
    acc = torch.promote_types(q.dtype, torch.float32)
    out = q.new_zeros(q.shape[:-1] + (v.shape[-1],), dtype=acc)
    lse = q.new_full(q.shape[:-1], float("-inf"), dtype=acc)
    for t in range(n_blocks):
        j = (me - t) % n_blocks
        if not causal or j <= me:
            kb, vb = (local_in[(x, coord_of(j))] for x in node.args[1:3])
            out, lse = ring_step(q, kb, vb, out, lse, q.shape[-1] ** -0.5, causal and j == me)
    return out.to(q.dtype)


def _full(local_out, coord, j, paxes, upto, mesh_shape, spec):
    """Value at ``coord`` reduced over the P axes after ``upto`` (recursive helper)."""
    later = [a for a in paxes if a > upto]
    if not later:
        return local_out[coord][j]
    a = later[-1]
    vals = [_full(local_out, coord[:a] + (i,) + coord[a + 1:], j, [p for p in paxes if p != a], upto,
                  mesh_shape, spec) for i in range(mesh_shape[a])]
    return _reduce(vals, spec[a].reduce_op)


def check_all(op, args, kwargs=None, meshes=((2,), (2, 2))):
    node = _node(op, args, kwargs or {})
    gen = torch.Generator().manual_seed(0)
    total = 0
    for ms in meshes:
        strats = strategies_for(node, _mesh(ms))
        assert strats and strats[0].inputs is not None
        assert len({(s.inputs, s.outputs) for s in strats}) == len(strats), "duplicates"
        for s in strats:
            err = simulate(node, s, ms, gen)
            tol = 1e-8 if all(v.dtype == torch.float64 for v in _vals(node) if v.is_floating_point()) else 1e-5
            assert err < tol, f"{op} on mesh {ms}: strategy {s} is wrong (max err {err})"
        total += len(strats)
    return total


def _vals(node):
    v = node.meta["val"]
    return [x for x in (v if isinstance(v, (tuple, list)) else [v]) if isinstance(x, torch.Tensor)]


def r(*shape):
    return torch.randn(*shape, dtype=torch.float64)


def ri(hi, *shape):
    return torch.randint(0, hi, shape)


M3 = ((2,), (2, 2), (2, 2, 2))
CASES = {
    "linear": (aten.linear.default, (r(4, 6, 8), r(10, 8), r(10)), {}, M3),
    "linear_nobias": (aten.linear.default, (r(4, 8), r(6, 8)), {}, M3),
    "mm": (aten.mm.default, (r(4, 6), r(6, 8)), {}, M3),
    "addmm": (aten.addmm.default, (r(8), r(4, 6), r(6, 8)), {}, ((2,), (2, 2))),
    "bmm": (aten.bmm.default, (r(2, 4, 6), r(2, 6, 4)), {}, ((2,), (2, 2))),
    "matmul_bcast": (aten.matmul.default, (r(2, 4, 6), r(6, 4)), {}, ((2,), (2, 2))),
    "einsum": (aten.einsum.default, ("bij,bjk->bik", [r(2, 4, 6), r(2, 6, 4)]), {}, ((2,), (2, 2))),
    "add_bcast": (aten.add.Tensor, (r(4, 6), r(6)), {}, ((2,), (2, 2))),
    "add_scalar": (aten.add.Tensor, (r(4, 6), 1.5), {}, ((2,),)),
    "mul": (aten.mul.Tensor, (r(4, 1, 6), r(3, 6)), {}, ((2,), (2, 2))),
    "div": (aten.div.Tensor, (r(4, 6), r(4, 1) + 3), {}, ((2,),)),
    "gelu": (aten.gelu.default, (r(4, 6),), {}, ((2,), (2, 2))),
    "where": (aten.where.self, (r(4, 6) > 0, r(4, 6), r(6)), {}, ((2,),)),
    "neg": (aten.neg.default, (r(4, 6),), {}, ((2,),)),
    "to": (aten.to.dtype, (r(4, 6), torch.float32), {}, ((2,),)),
    "dropout_p0": (aten.dropout.default, (r(4, 6), 0.0, True), {}, ((2,),)),
    "view_merge": (aten.view.default, (r(4, 6), [24]), {}, ((2,), (2, 2))),
    "view_split": (aten.view.default, (r(24, 3), [4, 6, 3]), {}, ((2,), (2, 2))),
    "reshape_uneven": (aten.reshape.default, (r(3, 6), [3, 2, 3]), {}, ((2,), (2, 2))),
    "view_heads": (aten.view.default, (r(2, 4, 8), [2, 4, 2, 4]), {}, ((2,), (2, 2))),
    "transpose": (aten.transpose.int, (r(2, 4, 6), 1, 2), {}, ((2,), (2, 2))),
    "t": (aten.t.default, (r(4, 6),), {}, ((2,),)),
    "permute": (aten.permute.default, (r(2, 4, 6), [2, 0, 1]), {}, ((2,), (2, 2))),
    "expand": (aten.expand.default, (r(1, 6), [4, 6]), {}, ((2,), (2, 2))),
    "unsqueeze": (aten.unsqueeze.default, (r(4, 6), 1), {}, ((2,),)),
    "split": (aten.split.Tensor, (r(4, 6), 2, 1), {}, ((2,), (2, 2))),
    "chunk": (aten.chunk.default, (r(4, 6), 3, 1), {}, ((2,),)),
    "cat": (aten.cat.default, ([r(4, 2), r(4, 3)], 1), {}, ((2,), (2, 2))),
    "stack": (aten.stack.default, ([r(4, 2), r(4, 2)], 1), {}, ((2,),)),
    "slice": (aten.slice.Tensor, (r(4, 6), 1, 1, 5), {}, ((2,), (2, 2))),
    "slice_full": (aten.slice.Tensor, (r(4, 6), 1, 0, 9223372036854775807), {}, ((2,),)),
    "pad": (aten.pad.default, (r(4, 6, 3), [1, 0, 0, 0]), {}, ((2,), (2, 2))),
    "select": (aten.select.int, (r(4, 6), 0, 1), {}, ((2,),)),
    "index_select": (aten.index_select.default, (r(4, 6), 0, ri(4, 6)), {}, ((2,), (2, 2))),
    "layer_norm": (aten.layer_norm.default, (r(2, 4, 6), [6], r(6), r(6)), {}, ((2,), (2, 2))),
    "native_layer_norm": (aten.native_layer_norm.default, (r(2, 4, 6), [6], r(6), r(6), 1e-5), {}, ((2,),)),
    "rms_norm": (aten.rms_norm.default, (r(4, 6), [6], r(6)), {}, ((2,),)),
    "sum": (aten.sum.dim_IntList, (r(4, 6), [1]), {}, ((2,), (2, 2))),
    "sum_all": (aten.sum.default, (r(4, 6),), {}, ((2,),)),
    "mean_keep": (aten.mean.dim, (r(4, 6), [-1], True), {}, ((2,), (2, 2))),
    "amax": (aten.amax.default, (r(4, 6), [0]), {}, ((2,),)),
    "logsumexp": (aten.logsumexp.default, (r(4, 6, 3), [0, 2]), {}, ((2,), (2, 2))),
    "logsumexp_keep": (aten.logsumexp.default, (r(4, 6, 3), [1], True), {}, ((2,), (2, 2))),
    "expand_copy": (aten.expand_copy.default, (r(4, 1, 3), [4, 5, 3]), {}, ((2,), (2, 2))),
    "view_copy": (aten.view_copy.default, (r(4, 6, 2), [24, 2]), {}, ((2,), (2, 2))),
    "softmax": (aten._softmax.default, (r(4, 6), 1, False), {}, ((2,), (2, 2))),
    "softmax_int": (aten.softmax.int, (r(4, 6), 0), {}, ((2,),)),
    "log_softmax": (aten.log_softmax.int, (r(4, 6), -1), {}, ((2,),)),
    "argmax": (aten.argmax.default, (r(4, 6), 1), {}, ((2,),)),
    "cumsum": (aten.cumsum.default, (r(4, 6), 1), {}, ((2,),)),
    "diff_prepend": (aten.diff.default, (r(5, 4), 2, 0, r(1, 4), r(2, 4)), {}, ((2,), (2, 2))),
    "topk": (aten.topk.default, (r(4, 6), 2), {}, ((2,),)),
    "sort": (aten.sort.default, (r(4, 6), 0), {}, ((2,),)),
    "histc": (aten.histc.default, (r(4, 6), 5, -1.0, 1.0), {}, ((2,), (2, 2))),
    "embedding": (aten.embedding.default, (r(8, 6), ri(8, 2, 4)), {}, ((2,), (2, 2))),
    "sdpa_causal": (aten.scaled_dot_product_attention.default, (r(2, 4, 4, 3), r(2, 4, 4, 3), r(2, 4, 4, 3)),
                    {"is_causal": True}, ((2,), (2, 2))),
    "sdpa_mask": (aten.scaled_dot_product_attention.default,
                  (r(2, 2, 4, 3), r(2, 2, 6, 3), r(2, 2, 6, 3), r(4, 6)), {}, ((2,), (2, 2))),
    "sdpa_gqa": (aten.scaled_dot_product_attention.default, (r(2, 4, 4, 3), r(2, 2, 4, 3), r(2, 2, 4, 3)),
                 {"enable_gqa": True}, ((2,),)),
    "ce_none": (aten.cross_entropy_loss.default, (r(4, 5), ri(5, 4), None, 0), {}, ((2,),)),
    "ce_sum": (aten.cross_entropy_loss.default, (r(4, 5, 2), ri(5, 4, 2), None, 2), {}, ((2,), (2, 2))),
    "ce_mean": (aten.cross_entropy_loss.default, (r(4, 5), ri(5, 4)), {}, ((2,), (2, 2))),
    "nll_fwd": (aten.nll_loss_forward.default, (r(4, 5), ri(5, 4), None, 2, -100), {}, ((2,),)),
    # mean with ignored targets spread unevenly over uneven shards, class weights, smoothing
    "ce_mean_ignore": (aten.cross_entropy_loss.default, (r(5, 4), ri(4, 5), None, 1, 1), {},
                       ((2,), (2, 2))),
    "ce_mean_weight": (aten.cross_entropy_loss.default,
                       (r(5, 4, 3), ri(4, 5, 3), r(4).abs() + 0.1, 1, 2, 0.1), {}, ((2,), (2, 2))),
    "nll_fwd_mean": (aten.nll_loss_forward.default, (r(5, 4), ri(4, 5), r(4).abs() + 0.1, 1, 1), {},
                     ((2,), (2, 2))),
    # vocabulary-parallel (class/softmax dim split; collectives emulated by _vocab_outputs)
    "ce_smooth_none": (aten.cross_entropy_loss.default, (r(5, 6), ri(6, 5), None, 0, 2, 0.2), {},
                       ((2,), (2, 2))),
    "log_softmax_dim1": (aten._log_softmax.default, (r(4, 6, 3), 1, False), {}, ((2,), (2, 2))),
    "log_softmax_0d": (aten.log_softmax.int, (r(1)[0], 0), {}, ((2,),)),   # nothing to split
    "nll_nd_ignore": (aten.nll_loss_nd.default, (r(5, 4, 2), ri(4, 5, 2), None, 1, 1), {},
                      ((2,), (2, 2))),
    "conv2d": (aten.conv2d.default, (r(2, 4, 5, 5), r(6, 4, 3, 3), r(6)), {}, ((2,), (2, 2))),
    "convolution_T": (aten.convolution.default, (r(2, 4, 5, 5), r(4, 6, 3, 3), None, [1, 1], [0, 0], [1, 1],
                                                 True, [0, 0], 1), {}, ((2,),)),
    "gather": (aten.gather.default, (r(4, 6), 1, ri(6, 4, 3)), {}, ((2,),)),
    "scatter_add": (aten.scatter_add.default, (r(4, 6), 1, ri(6, 4, 6), r(4, 6)), {}, ((2,),)),
    "index": (aten.index.Tensor, (r(2, 6, 4), [None, ri(6, 5)]), {}, ((2,), (2, 2))),
    "index_put": (aten.index_put.default, (r(6, 4), [ri(6, 3)], r(3, 4), True), {}, ((2,),)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_strategy_computes_the_global_result(name):
    op, args, kwargs, meshes = CASES[name]
    n = check_all(op, args, kwargs, meshes)
    assert n >= len(meshes)


def _names(op, args, shape):
    return {s.name: s for s in strategies_for(_node(op, args, {}), _mesh(shape))}


def test_megatron_col_row_dp_on_1d():
    s = _names(aten.linear.default, (r(4, 6, 8), r(10, 8), r(10)), (2,))
    assert str(s["col"]) == "col: R, S(0), S(0) -> S(2)"
    assert str(s["row"]) == "row: S(2), S(1), P(sum) -> P(sum)"
    assert str(s["dp"]) == "dp: S(0), R, R -> S(0)"
    s = _names(aten.linear.default, (r(4, 6, 8), r(10, 8)), (2,))
    assert str(s["row"]) == "row: S(2), S(1) -> P(sum)"


def test_axonn_3d_matmul_present():
    node = _node(aten.linear.default, (r(16, 8), r(12, 8)), {})
    mesh = Mesh(Cluster.local(8), z=2, y=2, x=2)
    got = {(s.inputs, s.outputs): s for s in strategies_for(node, mesh)}
    from fxpar.spec import Spec
    key = ((Spec.parse("S(0)S(1)R"), Spec.parse("RS(1)S(0)")), (Spec.parse("S(0)P(sum)S(1)"),))
    assert key in got and got[key].name == "z:dp y:row x:col"
    # transposed layer (x and y swapped) is there too
    key2 = ((Spec.parse("S(0)RS(1)"), Spec.parse("RS(0)S(1)")), (Spec.parse("S(0)S(1)P(sum)"),))
    assert key2 in got


def test_multi_axis_sharding_needs_the_same_choice():
    # row on a0 and col on a1 shard different weight dims: fine; but view-merge over two axes
    # must split the outer dim evenly by 4
    node = _node(aten.view.default, (r(2, 6), [12]), {})
    for s in strategies_for(node, _mesh((2, 2))):
        assert str(s.inputs[0]) != "S(0)S(0)"


def test_size_one_axis_only_replicates_and_dims_too_small_drop():
    node = _node(aten.linear.default, (r(4, 8), r(6, 8)), {})
    assert len(strategies_for(node, _mesh((1, 2)))) == len(strategies_for(node, _mesh((2,))))
    node = _node(aten.add.Tensor, (r(1, 6), r(1, 6)), {})
    assert all("S(0)" not in str(s) for s in strategies_for(node, _mesh((2,))))


def test_linear_strategy_counts(capsys):
    node = _node(aten.linear.default, (r(8, 64, 64), r(64, 64), r(64)), {})
    counts = {}
    for shape in ((2,), (2, 2), (2, 2, 2), (2, 2, 2, 2)):
        counts[len(shape)] = len(strategies_for(node, _mesh(shape)))
    print("linear strategy counts by mesh rank:", counts)
    assert counts[1] == 5 and counts[4] <= 625


def test_fallback_is_unsharded():
    node = _node(aten.nonzero.default, (r(4, 6),), {})
    (s,) = strategies_for(node, _mesh((2, 2)))
    assert s.unsharded and s.outputs[0].is_replicated and is_unsharded(node)
    assert not is_unsharded(_node(aten.mm.default, (r(4, 6), r(6, 8)), {}))


def test_placeholder_specs():
    g = fx.Graph()
    p = g.placeholder("w")
    p.meta["val"] = r(4, 1)
    specs = [str(s.outputs[0]) for s in strategies_for(p, _mesh((2, 2)))]
    assert specs == ["RR", "RS(0)", "S(0)R", "S(0)S(0)"]


def test_fused_projection_offers_the_strided_column_split():
    """(#31, #26 item 3) A projection whose output is split into q, k, v offers ``col/3``: its
    weight and output strided ``S(d,3)`` (each rank holds its q, k and v columns); the view on
    the way keeps it; the split hands out ``S(d)`` parts with no communication; the weight's
    placeholder offers the strided layout. A projection whose output is not split does not."""
    from fxpar.capture import capture
    from fxpar.strategies import placeholder_strategies

    class QKV(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv, self.out = torch.nn.Linear(8, 24), torch.nn.Linear(8, 8)

        def forward(self, x):
            q, k, v = self.qkv(x).view(2, 3, 24).split(8, dim=-1)
            return self.out(q * k + v).sum()

    gm = capture(QKV(), (torch.randn(6, 8),))
    mesh = _mesh((2,))
    lin = [n for n in gm.graph.nodes if n.target == aten.linear.default]
    names = {s.name: str(s) for s in strategies_for(lin[0], mesh)}
    assert names["col/3"] == "col/3: R, S(0,3), S(0,3) -> S(1,3)", names
    assert not any("/" in s.name for s in strategies_for(lin[1], mesh))
    view = next(n for n in gm.graph.nodes if n.target == aten.view.default)
    assert "S2/3: S(1,3) -> S(2,3)" in [str(s) for s in strategies_for(view, mesh)]
    split = next(n for n in gm.graph.nodes if n.target == aten.split.Tensor)
    assert "fused: S(2,3) -> S(2), S(2), S(2)" in [str(s) for s in strategies_for(split, mesh)]
    w = next(n for n in gm.graph.nodes if n.op == "placeholder" and n.name.endswith("qkv_weight"))
    assert [str(s.outputs[0]) for s in placeholder_strategies(w, mesh)] == ["R", "S(0)", "S(1)", "S(0,3)"]
    # 24 columns cannot be cut into 3 groups over 16 devices: no strided choice there
    assert "col/3" not in {s.name for s in strategies_for(lin[0], _mesh((16,)))}
